//! The OAuth 2 service-account flow FCM HTTP v1 is authorised with.
//!
//! An assertion (a JWT signed RS256 with the service account's private key: `iss` the account's
//! e-mail, `scope` FCM's, `aud` the token URI, `iat` now, `exp` an hour on) is exchanged at the
//! configured `token_uri` (`grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer`) for an access
//! token, which is cached until `refresh_margin` before its `expires_in` and shared by every send
//! of the account. When it is due, one send refreshes it and the others wait for that refresh
//! rather than each asking for a token of their own.
//!
//! What can go wrong before the push itself leaves: the token endpoint refuses the assertion
//! (4xx: the key, the account or the clock is wrong) is an auth failure of the account; an
//! endpoint that cannot be reached, times out, throttles or fails is "the push never left"
//! (retryable). Neither the assertion, the key nor the access token is ever logged.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::header::{self, HeaderValue};
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, RwLock};
use tokio::time::Instant;
use url::Url;

use nudge_domain::{SendOutcome, Verdict};

use crate::push::answer;
use crate::transport::{error_chain, failed_before_send, read_body};

/// The scope FCM HTTP v1 needs.
pub const FCM_SCOPE: &str = "https://www.googleapis.com/auth/firebase.messaging";
/// The grant type of a service-account assertion (RFC 7523).
pub const JWT_BEARER_GRANT: &str = "urn:ietf:params:oauth:grant-type:jwt-bearer";
/// How long an assertion is valid; Google accepts at most an hour.
const ASSERTION_LIFETIME_S: i64 = 3600;
/// The longest an access token is cached whatever `expires_in` says (Google's are an hour).
const MAX_TOKEN_LIFETIME: Duration = Duration::from_secs(3600);
/// A token answer is small; a larger one is refused unread.
const MAX_TOKEN_BODY_BYTES: usize = 64 * 1024;

/// Stable reasons of the token step, metric-label safe.
pub mod reason {
    /// The token endpoint answered 4xx: the assertion was refused.
    pub const TOKEN_REFUSED: &str = "token_refused";
    /// The token endpoint could not be reached, timed out, throttled, failed or answered with
    /// something that is not a token: the push never left.
    pub const TOKEN_UNAVAILABLE: &str = "token_unavailable";
    /// The assertion could not be signed (cannot happen with a key checked at start-up).
    pub const ASSERTION_UNSIGNED: &str = "assertion_unsigned";
}

#[derive(Serialize)]
struct AssertionClaims<'a> {
    iss: &'a str,
    scope: &'a str,
    aud: &'a str,
    iat: i64,
    exp: i64,
}

#[derive(Deserialize)]
struct TokenAnswer {
    access_token: String,
    #[serde(default)]
    expires_in: Option<u64>,
}

struct Cached {
    header: HeaderValue,
    refresh_at: Instant,
}

/// The access tokens of one service account.
pub(crate) struct ServiceAccountTokens {
    client: reqwest::Client,
    token_uri: Url,
    client_email: String,
    key: EncodingKey,
    key_id: Option<String>,
    refresh_margin: Duration,
    cached: RwLock<Option<Cached>>,
    /// Held by the one send refreshing the token; the others wait on it, then read the cache.
    refreshing: Mutex<()>,
    fetched: AtomicU64,
}

impl std::fmt::Debug for ServiceAccountTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceAccountTokens")
            .field("token_uri", &self.token_uri.as_str())
            .field("refresh_margin", &self.refresh_margin)
            .field("fetched", &self.fetched.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl ServiceAccountTokens {
    pub(crate) fn new(
        client: reqwest::Client,
        token_uri: Url,
        client_email: String,
        key: EncodingKey,
        key_id: Option<String>,
        refresh_margin: Duration,
    ) -> Self {
        Self {
            client,
            token_uri,
            client_email,
            key,
            key_id,
            refresh_margin,
            cached: RwLock::new(None),
            refreshing: Mutex::new(()),
            fetched: AtomicU64::new(0),
        }
    }

    /// How many access tokens were fetched so far.
    pub(crate) fn fetched(&self) -> u64 {
        self.fetched.load(Ordering::Relaxed)
    }

    /// The `Authorization` value to send with, refreshing the token first if it is due. An `Err`
    /// is the outcome of the whole attempt: the push was not sent.
    pub(crate) async fn authorization(&self) -> Result<HeaderValue, SendOutcome> {
        if let Some(h) = self.fresh().await {
            return Ok(h);
        }
        let _refreshing = self.refreshing.lock().await;
        // Another send may have refreshed it while this one waited.
        if let Some(h) = self.fresh().await {
            return Ok(h);
        }
        let (header, lifetime) = self.fetch().await?;
        let lifetime = lifetime.min(MAX_TOKEN_LIFETIME);
        let refresh_at = Instant::now() + lifetime.saturating_sub(self.refresh_margin);
        *self.cached.write().await = Some(Cached {
            header: header.clone(),
            refresh_at,
        });
        Ok(header)
    }

    /// Forgets `used` if it is still the cached token (the provider refused it), so the next
    /// send fetches another; a token refreshed meanwhile is kept.
    pub(crate) async fn forget(&self, used: &HeaderValue) {
        let mut cached = self.cached.write().await;
        if cached.as_ref().is_some_and(|c| c.header == *used) {
            *cached = None;
        }
    }

    async fn fresh(&self) -> Option<HeaderValue> {
        let cached = self.cached.read().await;
        cached
            .as_ref()
            .filter(|c| Instant::now() < c.refresh_at)
            .map(|c| c.header.clone())
    }

    fn assertion(&self) -> Result<String, jsonwebtoken::errors::Error> {
        let now = chrono::Utc::now().timestamp();
        let mut header = Header::new(Algorithm::RS256);
        header.kid = self.key_id.clone();
        let claims = AssertionClaims {
            iss: &self.client_email,
            scope: FCM_SCOPE,
            aud: self.token_uri.as_str(),
            iat: now,
            exp: now + ASSERTION_LIFETIME_S,
        };
        jsonwebtoken::encode(&header, &claims, &self.key)
    }

    async fn fetch(&self) -> Result<(HeaderValue, Duration), SendOutcome> {
        let unavailable = || failed_before_send(reason::TOKEN_UNAVAILABLE);
        let assertion = self
            .assertion()
            .map_err(|_| failed_before_send(reason::ASSERTION_UNSIGNED))?;
        let form = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("grant_type", JWT_BEARER_GRANT)
            .append_pair("assertion", &assertion)
            .finish();
        let response = self
            .client
            .post(self.token_uri.clone())
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(header::ACCEPT, "application/json")
            .body(form)
            .send()
            .await;
        let response = match response {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(
                    error.cause_chain = %error_chain(&e.without_url()),
                    "the OAuth token endpoint could not be reached"
                );
                return Err(unavailable());
            }
        };
        let status = response.status().as_u16();
        if (400..=499).contains(&status) && status != 429 && status != 408 {
            tracing::error!(
                status,
                "the OAuth token endpoint refused the service account's assertion"
            );
            return Err(SendOutcome::Answered(answer(
                Verdict::AuthFailure,
                status,
                Some(reason::TOKEN_REFUSED),
            )));
        }
        if !(200..=299).contains(&status) {
            tracing::warn!(status, "the OAuth token endpoint did not issue a token");
            return Err(unavailable());
        }
        let body = read_body(response, MAX_TOKEN_BODY_BYTES)
            .await
            .ok_or_else(unavailable)?;
        let issued: TokenAnswer = serde_json::from_slice(&body).map_err(|_| {
            tracing::warn!("the OAuth token endpoint answered 2xx without a token");
            unavailable()
        })?;
        let token = &issued.access_token;
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            tracing::warn!("the OAuth token endpoint issued a token that cannot be a header");
            return Err(unavailable());
        }
        let mut value =
            HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| unavailable())?;
        value.set_sensitive(true);
        self.fetched.fetch_add(1, Ordering::Relaxed);
        let lifetime = Duration::from_secs(issued.expires_in.unwrap_or(0));
        tracing::debug!(
            expires_in_s = lifetime.as_secs(),
            "fetched an FCM access token"
        );
        Ok((value, lifetime))
    }
}
