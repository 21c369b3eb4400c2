//! Firebase Cloud Messaging, HTTP v1: `POST {base_url}/v1/projects/{project_id}/messages:send`
//! with `{"message": {"token", "notification", "data", ...}}`, authorised by an OAuth 2 access
//! token of a service account ([`oauth`]), answers mapped by [`map::map_response`].
//!
//! FCM honours no idempotency key: a send whose answer is lost (timeout, reset, 5xx) is
//! ambiguous. The payload (`notification` and `data`, as JSON) is limited to
//! [`MAX_PAYLOAD_BYTES`] and checked before anything is sent; a larger one is refused, terminal.
//!
//! # Keys
//!
//! Of an account of kind `fcm`, beside the keys every account has:
//!
//! | key | default | rule |
//! |-----|---------|------|
//! | `project_id` | required | the Firebase project: lowercase letters, digits and `-`, at most 63 |
//! | `client_email` | required | the service account's e-mail (the assertion's `iss`) |
//! | `private_key` (secret) | required | the service account's RSA private key, PEM (PKCS#8 as in its JSON key file, or PKCS#1) |
//! | `private_key_id` | unset | the key's id, sent as the assertion's `kid` |
//! | `token_uri` | `https://oauth2.googleapis.com/token` | where assertions are exchanged for access tokens; also the assertion's `aud` |
//! | `base_url` | `https://fcm.googleapis.com` | FCM's root; `/v1/projects/{project_id}/messages:send` is appended to its path |
//! | `token_refresh_margin_s` | `60` | how long before its `expires_in` an access token is replaced, 0..=1800 |

pub mod map;
pub mod oauth;

use std::time::Duration;

use jsonwebtoken::EncodingKey;
use nudge_config::{ConfigError, Secret};
use nudge_domain::ProviderAccount;
use reqwest::header::{self, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use url::Url;

use crate::ProviderError;
use crate::push::{
    PushContent, PushMessage, PushVerdict, Timeouts, join_path, parse_base_url, read_bounded,
    seconds_left, verdict_of_transport_error,
};
use oauth::ServiceAccountTokens;

pub use map::map_response;

/// FCM's limit on a message's payload (keys and values), in bytes.
pub const MAX_PAYLOAD_BYTES: usize = 4096;
/// How much of an answer is read; FCM's are small.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// Stable reasons of refusals before sending.
pub mod reason {
    /// The notification and data are over [`super::MAX_PAYLOAD_BYTES`].
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
    /// The device token is empty or holds characters no token has.
    pub const INVALID_DEVICE_TOKEN: &str = "invalid_device_token";
}

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const CORRELATION_ID: HeaderName = HeaderName::from_static("x-correlation-id");
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The keys of an account of kind `fcm` (see the module docs).
#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub struct FcmConfig {
    pub project_id: String,
    pub client_email: String,
    pub private_key: Secret,
    #[serde(default)]
    pub private_key_id: Option<String>,
    #[serde(default = "default_token_uri")]
    pub token_uri: String,
    #[serde(default = "default_base_url")]
    pub base_url: String,
    #[serde(default = "default_token_refresh_margin_s")]
    pub token_refresh_margin_s: u64,
}

fn default_token_uri() -> String {
    "https://oauth2.googleapis.com/token".to_owned()
}

fn default_base_url() -> String {
    "https://fcm.googleapis.com".to_owned()
}

const fn default_token_refresh_margin_s() -> u64 {
    60
}

fn key(prefix: &str, field: &str) -> String {
    if prefix.is_empty() {
        field.to_owned()
    } else {
        format!("{prefix}.{field}")
    }
}

impl FcmConfig {
    /// A config with the defaults for every optional key.
    pub fn new(
        project_id: impl Into<String>,
        client_email: impl Into<String>,
        private_key: Secret,
    ) -> Self {
        Self {
            project_id: project_id.into(),
            client_email: client_email.into(),
            private_key,
            private_key_id: None,
            token_uri: default_token_uri(),
            base_url: default_base_url(),
            token_refresh_margin_s: default_token_refresh_margin_s(),
        }
    }

    /// Checks every rule, naming the first bad key as `{key_prefix}.{field}`; never repeats a
    /// value (the key is secret, URLs may carry credentials).
    pub fn validate(&self, key_prefix: &str) -> Result<(), ConfigError> {
        self.parsed(key_prefix).map(|_| ())
    }

    fn parsed(&self, prefix: &str) -> Result<Parsed, ConfigError> {
        let id = &self.project_id;
        if id.is_empty()
            || id.len() > 63
            || !id
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(ConfigError::invalid(
                key(prefix, "project_id"),
                "must be 1 to 63 lowercase letters, digits or `-`",
            ));
        }
        let email = &self.client_email;
        if !email.contains('@') || !email.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::invalid(
                key(prefix, "client_email"),
                "must be the service account's e-mail address",
            ));
        }
        let signing_key =
            EncodingKey::from_rsa_pem(self.private_key.expose().as_bytes()).map_err(|_| {
                ConfigError::invalid(
                    key(prefix, "private_key"),
                    "must be an RSA private key in PEM (PKCS#8 or PKCS#1)",
                )
            })?;
        if let Some(kid) = &self.private_key_id
            && (kid.is_empty() || !kid.bytes().all(|b| b.is_ascii_graphic()))
        {
            return Err(ConfigError::invalid(
                key(prefix, "private_key_id"),
                "must be visible ASCII without whitespace",
            ));
        }
        let token_uri = parse_base_url(&self.token_uri)
            .map_err(|m| ConfigError::invalid(key(prefix, "token_uri"), m))?;
        let base_url = parse_base_url(&self.base_url)
            .map_err(|m| ConfigError::invalid(key(prefix, "base_url"), m))?;
        if self.token_refresh_margin_s > 1800 {
            return Err(ConfigError::invalid(
                key(prefix, "token_refresh_margin_s"),
                "must be at most 1800",
            ));
        }
        let endpoint = join_path(
            &base_url,
            &format!("/v1/projects/{}/messages:send", self.project_id),
        );
        Ok(Parsed {
            signing_key,
            token_uri,
            endpoint,
        })
    }
}

struct Parsed {
    signing_key: EncodingKey,
    token_uri: Url,
    endpoint: Url,
}

/// An FCM account: one pooled client for the token endpoint and FCM, and the account's cached
/// access token.
pub struct FcmProvider {
    account: ProviderAccount,
    endpoint: Url,
    client: reqwest::Client,
    tokens: ServiceAccountTokens,
}

impl std::fmt::Debug for FcmProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FcmProvider")
            .field("account", &self.account)
            .field("endpoint", &self.endpoint.as_str())
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
}

impl FcmProvider {
    /// Validates `cfg` (errors name keys relative to the account's section) and builds the
    /// client.
    pub fn new(
        account: ProviderAccount,
        cfg: &FcmConfig,
        timeouts: Timeouts,
    ) -> Result<Self, ProviderError> {
        let parsed = cfg.parsed("")?;
        let client = timeouts
            .client_builder()
            .build()
            .map_err(|source| ProviderError::Client {
                account: account.clone(),
                source,
            })?;
        let tokens = ServiceAccountTokens::new(
            client.clone(),
            parsed.token_uri,
            cfg.client_email.clone(),
            parsed.signing_key,
            cfg.private_key_id.clone(),
            Duration::from_secs(cfg.token_refresh_margin_s),
        );
        Ok(Self {
            account,
            endpoint: parsed.endpoint,
            client,
            tokens,
        })
    }

    pub fn account(&self) -> &ProviderAccount {
        &self.account
    }

    /// Where messages are posted.
    pub fn endpoint(&self) -> &Url {
        &self.endpoint
    }

    /// How many access tokens this account fetched so far.
    pub fn access_tokens_fetched(&self) -> u64 {
        self.tokens.fetched()
    }

    /// Sends once and says what it means. Never fails: every failure is a verdict.
    pub async fn push(&self, msg: PushMessage<'_>) -> PushVerdict {
        let body = match request_body(&msg, chrono::Utc::now()) {
            Ok(b) => b,
            Err(refused) => return refused,
        };
        let auth = match self.tokens.authorization().await {
            Ok(h) => h,
            Err(verdict) => return verdict,
        };
        let mut request = self
            .client
            .post(self.endpoint.clone())
            .header(header::AUTHORIZATION, auth.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json");
        // FCM ignores it; sent so a provider's logs, and the stub, can tell deliveries apart.
        if let Ok(v) = HeaderValue::from_str(msg.idempotency_key.as_str()) {
            request = request.header(IDEMPOTENCY_KEY, v);
        }
        if let Ok(v) = HeaderValue::from_str(msg.correlation_id) {
            request = request.header(CORRELATION_ID, v);
        }
        if let Some(v) = msg.traceparent.and_then(|t| HeaderValue::from_str(t).ok()) {
            request = request.header(TRACEPARENT, v);
        }
        let response = match request.body(body).send().await {
            Ok(r) => r,
            Err(e) => return verdict_of_transport_error(&e),
        };
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = read_bounded(response, MAX_BODY_BYTES)
            .await
            .unwrap_or_default();
        let verdict = map_response(status, &headers, &body);
        if matches!(verdict, PushVerdict::AuthFailed { status: 401, .. }) {
            // The access token itself may be what was refused (revoked, expired early): the next
            // send after the account resumes asks for another.
            self.tokens.forget(&auth).await;
        }
        verdict
    }
}

#[derive(Serialize)]
struct Envelope<'a> {
    message: Message<'a>,
}

#[derive(Serialize)]
struct Message<'a> {
    token: &'a str,
    #[serde(flatten)]
    payload: &'a Payload,
    #[serde(skip_serializing_if = "Option::is_none")]
    android: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    apns: Option<serde_json::Value>,
}

#[derive(Serialize)]
struct Payload {
    #[serde(skip_serializing_if = "Option::is_none")]
    notification: Option<Notification>,
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    data: serde_json::Map<String, serde_json::Value>,
}

#[derive(Serialize)]
struct Notification {
    #[serde(skip_serializing_if = "Option::is_none")]
    title: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body: Option<String>,
}

/// The request body, or why it is refused before sending.
fn request_body(
    msg: &PushMessage<'_>,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<Vec<u8>, PushVerdict> {
    let token = msg.destination;
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(PushVerdict::RefusedBeforeSend {
            reason: reason::INVALID_DEVICE_TOKEN,
        });
    }
    let content = PushContent::of(msg.content);
    let notification =
        (content.title.is_some() || content.body.is_some()).then_some(Notification {
            title: content.title,
            body: content.body,
        });
    let payload = Payload {
        notification,
        data: content.data,
    };
    let payload_len = serde_json::to_vec(&payload)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    if payload_len > MAX_PAYLOAD_BYTES {
        return Err(PushVerdict::RefusedBeforeSend {
            reason: reason::PAYLOAD_TOO_LARGE,
        });
    }
    let (android, apns) = match msg.expires_at {
        Some(at) => (
            Some(serde_json::json!({"ttl": format!("{}s", seconds_left(at, now))})),
            Some(
                serde_json::json!({"headers": {"apns-expiration": at.timestamp().max(0).to_string()}}),
            ),
        ),
        None => (None, None),
    };
    serde_json::to_vec(&Envelope {
        message: Message {
            token,
            payload: &payload,
            android,
            apns,
        },
    })
    .map_err(|_| PushVerdict::RefusedBeforeSend {
        reason: crate::reason::REQUEST_BUILD_ERROR,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;
    use nudge_domain::{Channel, IdempotencyKey, ReminderId};

    fn key() -> IdempotencyKey {
        IdempotencyKey::for_delivery(ReminderId::new(), Channel::Push)
    }

    fn msg<'a>(key: &'a IdempotencyKey, content: Option<&'a serde_json::Value>) -> PushMessage<'a> {
        PushMessage {
            idempotency_key: key,
            destination: "fcm-token-1",
            content,
            expires_at: None,
            correlation_id: "c",
            traceparent: None,
        }
    }

    #[test]
    fn the_body_is_an_fcm_v1_message_with_notification_data_and_time_to_live() {
        let key = key();
        let content =
            serde_json::json!({"title": "Appointment", "body": "Tomorrow", "template": "appt"});
        let now = chrono::Utc::now();
        let mut m = msg(&key, Some(&content));
        m.expires_at = Some(now + chrono::TimeDelta::seconds(90));
        let body: serde_json::Value =
            serde_json::from_slice(&request_body(&m, now).unwrap()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"message": {
                "token": "fcm-token-1",
                "notification": {"title": "Appointment", "body": "Tomorrow"},
                "data": {"template": "appt"},
                "android": {"ttl": "90s"},
                "apns": {"headers": {"apns-expiration": (now + chrono::TimeDelta::seconds(90)).timestamp().to_string()}}
            }})
        );
    }

    #[test]
    fn a_payload_over_4096_bytes_is_refused_before_sending_and_one_at_the_limit_is_not() {
        let key = key();
        let now = chrono::Utc::now();
        // `{"data":{"k":"…"}}` is 17 bytes around the value.
        let at_limit = serde_json::json!({"k": "x".repeat(MAX_PAYLOAD_BYTES - 17)});
        assert!(request_body(&msg(&key, Some(&at_limit)), now).is_ok());
        let over = serde_json::json!({"k": "x".repeat(MAX_PAYLOAD_BYTES - 16)});
        assert_eq!(
            request_body(&msg(&key, Some(&over)), now).unwrap_err(),
            PushVerdict::RefusedBeforeSend {
                reason: reason::PAYLOAD_TOO_LARGE
            }
        );
    }

    #[test]
    fn an_empty_or_unprintable_device_token_is_refused_before_sending() {
        let key = key();
        for bad in ["", "a b", "tok\n"] {
            let mut m = msg(&key, None);
            m.destination = bad;
            assert_eq!(
                request_body(&m, chrono::Utc::now()).unwrap_err(),
                PushVerdict::RefusedBeforeSend {
                    reason: reason::INVALID_DEVICE_TOKEN
                },
                "{bad:?}"
            );
        }
    }
}
