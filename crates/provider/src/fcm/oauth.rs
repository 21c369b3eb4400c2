//! The OAuth 2 service-account flow FCM HTTP v1 is authorised with.
//!
//! An assertion (a JWT signed RS256 with the service account's private key: `iss` the account's
//! e-mail, `scope` FCM's, `aud` the token URI, `iat` now, `exp` an hour on) is exchanged at the
//! configured `token_uri` (`grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer`) for an access
//! token, which is cached until `refresh_margin` before its `expires_in` and shared by every send
//! of the account. When it is due, one fetch is started and every send that needs the token
//! meanwhile waits for that same fetch and gets its result, a failure included: a failed fetch
//! answers all its waiters at once rather than each asking again in turn (a hanging endpoint
//! would otherwise hold the last waiter for one timeout per send ahead of it). The fetch is not
//! owned by any one send: a send that stops waiting (its window closed) leaves it running for
//! the others.
//!
//! What can go wrong before the push itself leaves: the token endpoint refuses the assertion
//! (4xx: the key, the account or the clock is wrong) is an auth failure of the account; an
//! endpoint that cannot be reached, times out, throttles or fails is "the push never left"
//! (retryable). Neither the assertion, the key nor the access token is ever logged.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::future::{BoxFuture, Shared};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::header::{self, HeaderValue};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use url::Url;

use nudge_domain::{SendOutcome, Verdict};
use nudge_telemetry::error_chain;

use crate::push::answer;
use crate::transport::{failed_before_send, read_body};

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

/// What one fetch gives every send that waited for it: the header and the token's lifetime,
/// or the outcome of their attempts (the push was not sent).
type Fetched = Result<(HeaderValue, Duration), SendOutcome>;

/// A fetch in flight, shared by the sends waiting for it.
type Fetch = Shared<BoxFuture<'static, Fetched>>;

#[derive(Default)]
struct State {
    cached: Option<Cached>,
    /// The fetch every send needing a token waits for, until one of them sees it finish.
    fetching: Option<Fetch>,
}

/// The access tokens of one service account.
pub(crate) struct ServiceAccountTokens {
    client: reqwest::Client,
    token_uri: Url,
    client_email: String,
    key: EncodingKey,
    key_id: Option<String>,
    refresh_margin: Duration,
    state: Mutex<State>,
    fetched: Arc<AtomicU64>,
    started: AtomicU64,
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
            state: Mutex::default(),
            fetched: Arc::default(),
            started: AtomicU64::new(0),
        }
    }

    /// How many access tokens were fetched so far.
    pub(crate) fn fetched(&self) -> u64 {
        self.fetched.load(Ordering::Relaxed)
    }

    /// How many fetches were started so far (whatever they got).
    pub(crate) fn fetches_started(&self) -> u64 {
        self.started.load(Ordering::Relaxed)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The `Authorization` value to send with, refreshing the token first if it is due. An `Err`
    /// is the outcome of the whole attempt: the push was not sent. Sends that need a token
    /// while one is being fetched wait for that fetch and share its result.
    pub(crate) async fn authorization(&self) -> Result<HeaderValue, SendOutcome> {
        let fetch = {
            let mut state = self.state();
            if let Some(cached) = state
                .cached
                .as_ref()
                .filter(|c| Instant::now() < c.refresh_at)
            {
                return Ok(cached.header.clone());
            }
            match &state.fetching {
                Some(fetch) => fetch.clone(),
                None => {
                    let fetch = self.start_fetch();
                    state.fetching = Some(fetch.clone());
                    fetch
                }
            }
        };
        let result = fetch.clone().await;
        let mut state = self.state();
        // The first waiter to see the fetch finish stores what it got; the others only read.
        if state.fetching.as_ref().is_some_and(|f| f.ptr_eq(&fetch)) {
            state.fetching = None;
            if let Ok((header, lifetime)) = &result {
                let lifetime = (*lifetime).min(MAX_TOKEN_LIFETIME);
                state.cached = Some(Cached {
                    header: header.clone(),
                    refresh_at: Instant::now() + lifetime.saturating_sub(self.refresh_margin),
                });
            }
        }
        result.map(|(header, _)| header)
    }

    /// Forgets `used` if it is still the cached token (the provider refused it), so the next
    /// send fetches another; a token refreshed meanwhile is kept.
    pub(crate) fn forget(&self, used: &HeaderValue) {
        let mut state = self.state();
        if state.cached.as_ref().is_some_and(|c| c.header == *used) {
            state.cached = None;
        }
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

    /// A fetch that owns what it needs, so that it outlives any one waiter.
    fn start_fetch(&self) -> Fetch {
        self.started.fetch_add(1, Ordering::Relaxed);
        let Ok(assertion) = self.assertion() else {
            let refused: Fetched = Err(failed_before_send(reason::ASSERTION_UNSIGNED));
            return futures_util::future::ready(refused).boxed().shared();
        };
        let form = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("grant_type", JWT_BEARER_GRANT)
            .append_pair("assertion", &assertion)
            .finish();
        fetch(
            self.client.clone(),
            self.token_uri.clone(),
            form,
            self.fetched.clone(),
        )
        .boxed()
        .shared()
    }
}

async fn fetch(
    client: reqwest::Client,
    token_uri: Url,
    form: String,
    fetched: Arc<AtomicU64>,
) -> Fetched {
    let unavailable = || failed_before_send(reason::TOKEN_UNAVAILABLE);
    let response = client
        .post(token_uri)
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
    let mut value = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| unavailable())?;
    value.set_sensitive(true);
    fetched.fetch_add(1, Ordering::Relaxed);
    let lifetime = Duration::from_secs(issued.expires_in.unwrap_or(0));
    tracing::debug!(
        expires_in_s = lifetime.as_secs(),
        "fetched an FCM access token"
    );
    Ok((value, lifetime))
}
