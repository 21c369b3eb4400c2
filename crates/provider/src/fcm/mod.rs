//! Firebase Cloud Messaging, HTTP v1 (kind `fcm`): `POST
//! {base_url}/v1/projects/{project_id}/messages:send` with `{"message": {"token", "notification",
//! "data", "android": {"ttl"}, "apns": {"headers": {"apns-expiration"}}}}`, authorised by an
//! OAuth 2 access token of a service account ([`oauth`]), answers mapped by
//! [`map::map_response`]. `base_url` is FCM's root, `https://fcm.googleapis.com`.
//!
//! FCM honours no idempotency key: a send whose answer is lost (timeout, reset, 5xx) is
//! ambiguous. The payload (`notification` and `data`, as JSON) is limited to
//! [`MAX_PAYLOAD_BYTES`] and checked before anything is sent; a larger one is rejected, terminal,
//! and never sent.
//!
//! # Keys
//!
//! The `fcm` table of an account of kind `fcm` (`[providers.fcm]`):
//!
//! | key | default | rule |
//! |-----|---------|------|
//! | `project_id` | required | the Firebase project: 1 to 63 lowercase letters, digits and `-` |
//! | `client_email` | required | the service account's e-mail (the assertion's `iss`) |
//! | `private_key` (secret) | required | the service account's RSA private key, PEM (PKCS#8 as in its JSON key file, or PKCS#1) |
//! | `private_key_id` | unset | the key's id, sent as the assertion's `kid` |
//! | `token_uri` | `https://oauth2.googleapis.com/token` | where assertions are exchanged for access tokens; also the assertion's `aud` |
//! | `token_refresh_margin_s` | `60` | how long before its `expires_in` an access token is replaced, 0..=1800 |
//! | `misconfigured_window` | `50` | how many of the account's recent answers are kept to tell a misconfigured account from bad tokens, 10..=10000 |
//! | `misconfigured_share` | `0.5` | the share of those answers that, being `SENDER_ID_MISMATCH`, makes one the account's fault (an auth failure: alert, account suspended) rather than the contact's, (0, 1] |
//! | `misconfigured_min_answers` | `5` | how many `SENDER_ID_MISMATCH` answers the window must hold before that, 1..=`misconfigured_window` |

pub mod map;
pub mod oauth;

use std::time::Duration;

use jsonwebtoken::EncodingKey;
use nudge_config::{ConfigError, Secret};
use nudge_domain::{IdempotencySupport, ProviderAccount, SendOutcome};
use reqwest::header::{self, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use url::Url;

use crate::push::{Misconfiguration, PushContent, parse_base_url, refused_before_send};
use crate::transport::{MAX_BODY_BYTES, client, logged_outcome_of_error, read_body};
use crate::{Expiry, HttpProviderConfig, Provider, ProviderError, SendRequest};
use oauth::ServiceAccountTokens;

pub use map::map_response;

/// FCM's limit on a message's payload (keys and values), in bytes.
pub const MAX_PAYLOAD_BYTES: usize = 4096;

/// Codes of the refusals before sending.
pub mod reason {
    /// The notification and data are over [`super::MAX_PAYLOAD_BYTES`].
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
    /// The device token is empty or holds characters no token has.
    pub const INVALID_DEVICE_TOKEN: &str = "invalid_device_token";
}

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const CORRELATION_ID: HeaderName = HeaderName::from_static("x-correlation-id");
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The `fcm` table of an account (see the module docs).
#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub struct FcmKeys {
    pub project_id: String,
    pub client_email: String,
    pub private_key: Secret,
    #[serde(default)]
    pub private_key_id: Option<String>,
    #[serde(default = "default_token_uri")]
    pub token_uri: String,
    #[serde(default = "default_token_refresh_margin_s")]
    pub token_refresh_margin_s: u64,
    #[serde(default = "crate::push::default_misconfigured_window")]
    pub misconfigured_window: usize,
    #[serde(default = "crate::push::default_misconfigured_share")]
    pub misconfigured_share: f64,
    #[serde(default = "crate::push::default_misconfigured_min_answers")]
    pub misconfigured_min_answers: usize,
}

fn default_token_uri() -> String {
    "https://oauth2.googleapis.com/token".to_owned()
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

impl FcmKeys {
    /// The keys with the defaults for every optional one.
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
            token_refresh_margin_s: default_token_refresh_margin_s(),
            misconfigured_window: crate::push::default_misconfigured_window(),
            misconfigured_share: crate::push::default_misconfigured_share(),
            misconfigured_min_answers: crate::push::default_misconfigured_min_answers(),
        }
    }

    /// Valid keys with a fresh RSA key, for tests.
    #[cfg(test)]
    #[allow(clippy::unwrap_used)]
    pub(crate) fn for_tests() -> Self {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256).unwrap();
        Self::new(
            "nudge-test",
            "nudge@nudge-test.iam.gserviceaccount.com",
            Secret::new(key.serialize_pem()),
        )
    }

    /// Checks every rule (parsing the private key), naming the first bad key as
    /// `{key_prefix}.{field}`; never repeats a value (the key is secret, a URL may carry
    /// credentials).
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
        if self.token_refresh_margin_s > 1800 {
            return Err(ConfigError::invalid(
                key(prefix, "token_refresh_margin_s"),
                "must be at most 1800",
            ));
        }
        crate::push::validate_misconfigured(
            self.misconfigured_window,
            self.misconfigured_share,
            self.misconfigured_min_answers,
            |field| key(prefix, field),
        )?;
        Ok(Parsed {
            signing_key,
            token_uri,
        })
    }
}

struct Parsed {
    signing_key: EncodingKey,
    token_uri: Url,
}

/// An FCM account: one pooled client for the token endpoint and FCM, and the account's cached
/// access token.
pub struct FcmProvider {
    account: ProviderAccount,
    endpoint: Url,
    client: reqwest::Client,
    tokens: ServiceAccountTokens,
    /// The longest one request runs (`timeout_ms`).
    timeout: Duration,
    misconfiguration: Misconfiguration,
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

use crate::invalid_key as invalid;

impl FcmProvider {
    /// Builds the account from its validated configuration (errors name keys relative to the
    /// provider section).
    pub fn new(cfg: &HttpProviderConfig) -> Result<Self, ProviderError> {
        let account = cfg
            .parsed_account()
            .map_err(|e| invalid("account", e.to_string()))?;
        let keys = cfg
            .fcm
            .as_ref()
            .ok_or_else(|| invalid("fcm", "required for kind `fcm`"))?;
        let parsed = keys.parsed("fcm")?;
        let endpoint = cfg
            .endpoint_at(&format!("v1/projects/{}/messages:send", keys.project_id))
            .map_err(|m| invalid("base_url", m))?;
        let client = client(cfg, &account)?;
        let tokens = ServiceAccountTokens::new(
            client.clone(),
            parsed.token_uri,
            keys.client_email.clone(),
            parsed.signing_key,
            keys.private_key_id.clone(),
            Duration::from_secs(keys.token_refresh_margin_s),
        );
        Ok(Self {
            account,
            endpoint,
            client,
            tokens,
            timeout: Duration::from_millis(cfg.timeout_ms),
            misconfiguration: Misconfiguration::new(
                keys.misconfigured_window,
                keys.misconfigured_share,
                keys.misconfigured_min_answers,
            ),
        })
    }

    /// How many access tokens this account fetched so far.
    pub fn access_tokens_fetched(&self) -> u64 {
        self.tokens.fetched()
    }

    /// How many access-token fetches this account started so far, whatever they got.
    pub fn access_token_fetches_started(&self) -> u64 {
        self.tokens.fetches_started()
    }

    async fn send_once(&self, req: SendRequest<'_>) -> SendOutcome {
        // Refused before anything is asked of Google: a bad token or an oversized payload.
        let payload = match payload(&req) {
            Ok(p) => p,
            Err(code) => return SendOutcome::Answered(refused_before_send(code)),
        };
        let auth = match self.tokens.authorization().await {
            Ok(h) => h,
            Err(outcome) => return outcome,
        };
        // The token may have taken a while: the window decides whether the push may still
        // start, and `ttl` counts from now.
        let expiry = match req.open(self.timeout) {
            Ok(expiry) => expiry,
            Err(outcome) => return outcome,
        };
        let body = match envelope(req.destination, &payload, expiry) {
            Ok(b) => b,
            Err(code) => return SendOutcome::Answered(refused_before_send(code)),
        };
        let mut request = self
            .client
            .post(self.endpoint.clone())
            .header(header::AUTHORIZATION, auth.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json");
        // FCM ignores it; sent so that the provider's logs, and the stub, tell deliveries apart.
        if let Ok(v) = HeaderValue::from_str(req.idempotency_key.as_str()) {
            request = request.header(IDEMPOTENCY_KEY, v);
        }
        if let Ok(v) = HeaderValue::from_str(req.correlation_id) {
            request = request.header(CORRELATION_ID, v);
        }
        if let Some(v) = req.traceparent.and_then(|t| HeaderValue::from_str(t).ok()) {
            request = request.header(TRACEPARENT, v);
        }
        let response = match request.body(body).send().await {
            Ok(r) => r,
            Err(e) => return logged_outcome_of_error(&self.account, e),
        };
        let status = response.status().as_u16();
        if let Some(outcome) = crate::transport::out_of_range(status) {
            return outcome;
        }
        let headers = response.headers().clone();
        // A body that breaks off or is too long loses only what it would have added.
        let body = read_body(response, MAX_BODY_BYTES)
            .await
            .unwrap_or_default();
        let answer = map_response(status, &headers, &body);
        // A token of another project is what every send of a wrong credential gets.
        let suspect = answer.verdict == nudge_domain::Verdict::ContactInvalid
            && answer
                .code
                .as_ref()
                .is_some_and(|c| c.as_str() == "SENDER_ID_MISMATCH");
        let answer = self.misconfiguration.judge(answer, suspect);
        if answer.verdict == nudge_domain::Verdict::AuthFailure && status == 401 {
            // The access token itself may be what was refused (revoked, expired early): the
            // first send after the account resumes asks for another.
            self.tokens.forget(&auth);
        }
        SendOutcome::Answered(answer)
    }
}

impl Provider for FcmProvider {
    fn account(&self) -> &ProviderAccount {
        &self.account
    }

    fn idempotency(&self) -> IdempotencySupport {
        IdempotencySupport::NotHonoured
    }

    fn endpoint(&self) -> &Url {
        &self.endpoint
    }

    fn send<'a>(
        &'a self,
        req: SendRequest<'a>,
    ) -> impl std::future::Future<Output = SendOutcome> + Send + 'a {
        self.send_once(req)
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

/// The notification and data of a request, or the code of its refusal before sending (an
/// unusable device token, a payload over [`MAX_PAYLOAD_BYTES`]).
fn payload(req: &SendRequest<'_>) -> Result<Payload, &'static str> {
    let token = req.destination;
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(reason::INVALID_DEVICE_TOKEN);
    }
    let content = PushContent::of(req.content);
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
        return Err(reason::PAYLOAD_TOO_LARGE);
    }
    Ok(payload)
}

/// The request body for `token`, with the expiry as of the moment it is built.
fn envelope(
    token: &str,
    payload: &Payload,
    expiry: Option<Expiry>,
) -> Result<Vec<u8>, &'static str> {
    // Android is told how long the message is worth keeping, iOS (through FCM) until when.
    let (android, apns) = match expiry {
        Some(expiry @ Expiry { expires_at, .. }) => (
            Some(serde_json::json!({"ttl": format!("{}s", expiry.seconds_left())})),
            Some(serde_json::json!({
                "headers": {"apns-expiration": expires_at.timestamp().max(0).to_string()}
            })),
        ),
        None => (None, None),
    };
    serde_json::to_vec(&Envelope {
        message: Message {
            token,
            payload,
            android,
            apns,
        },
    })
    .map_err(|_| crate::reason::REQUEST_BUILD_ERROR)
}

/// [`payload`] then [`envelope`], for tests of the whole body.
#[cfg(test)]
fn request_body(req: &SendRequest<'_>, expiry: Option<Expiry>) -> Result<Vec<u8>, &'static str> {
    envelope(req.destination, &payload(req)?, expiry)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;
    use nudge_domain::{Channel, IdempotencyKey, ReminderId};

    fn key() -> IdempotencyKey {
        IdempotencyKey::for_delivery(ReminderId::new(), Channel::Push)
    }

    fn msg<'a>(key: &'a IdempotencyKey, content: Option<&'a serde_json::Value>) -> SendRequest<'a> {
        SendRequest {
            idempotency_key: key,
            channel: Channel::Push,
            destination: "fcm-token-1",
            content,
            correlation_id: "c",
            traceparent: None,
            window: None,
        }
    }

    #[test]
    fn the_body_is_an_fcm_v1_message_with_notification_data_and_time_to_live() {
        let key = key();
        let content =
            serde_json::json!({"title": "Appointment", "body": "Tomorrow", "template": "appt"});
        let now = chrono::Utc::now();
        let expires_at = now + chrono::TimeDelta::seconds(90);
        let m = msg(&key, Some(&content));
        let expiry = Some(Expiry { expires_at, now });
        let body: serde_json::Value =
            serde_json::from_slice(&request_body(&m, expiry).unwrap()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"message": {
                "token": "fcm-token-1",
                "notification": {"title": "Appointment", "body": "Tomorrow"},
                "data": {"template": "appt"},
                "android": {"ttl": "90s"},
                "apns": {"headers": {"apns-expiration": expires_at.timestamp().to_string()}}
            }})
        );
    }

    #[test]
    fn a_payload_over_4096_bytes_is_refused_before_sending_and_one_at_the_limit_is_not() {
        let key = key();
        // `{"data":{"k":"…"}}` is 17 bytes around the value.
        let at_limit = serde_json::json!({"k": "x".repeat(MAX_PAYLOAD_BYTES - 17)});
        assert!(request_body(&msg(&key, Some(&at_limit)), None).is_ok());
        let over = serde_json::json!({"k": "x".repeat(MAX_PAYLOAD_BYTES - 16)});
        assert_eq!(
            request_body(&msg(&key, Some(&over)), None).unwrap_err(),
            reason::PAYLOAD_TOO_LARGE
        );
    }

    #[test]
    fn an_empty_or_unprintable_device_token_is_refused_before_sending() {
        let key = key();
        for bad in ["", "a b", "tok\n"] {
            let mut m = msg(&key, None);
            m.destination = bad;
            assert_eq!(
                request_body(&m, None).unwrap_err(),
                reason::INVALID_DEVICE_TOKEN,
                "{bad:?}"
            );
        }
    }

    fn keys() -> FcmKeys {
        FcmKeys::for_tests()
    }

    #[test]
    fn each_bad_value_is_reported_under_its_own_key_and_never_repeats_the_key() {
        let invalid = |k: &FcmKeys| k.validate("providers.1.fcm").unwrap_err().key();
        keys().validate("providers.1.fcm").unwrap();
        for bad in ["", "Upper", "has_underscore", &"a".repeat(64)] {
            let mut k = keys();
            k.project_id = bad.into();
            assert_eq!(
                invalid(&k).as_deref(),
                Some("providers.1.fcm.project_id"),
                "{bad}"
            );
        }
        let mut k = keys();
        k.client_email = "no-at-sign".into();
        assert_eq!(invalid(&k).as_deref(), Some("providers.1.fcm.client_email"));
        let mut k = keys();
        k.private_key =
            Secret::new("-----BEGIN PRIVATE KEY-----\nhunter2\n-----END PRIVATE KEY-----\n");
        assert_eq!(invalid(&k).as_deref(), Some("providers.1.fcm.private_key"));
        assert!(!k.validate("p").unwrap_err().to_string().contains("hunter2"));
        let mut k = keys();
        k.private_key_id = Some("has space".into());
        assert_eq!(
            invalid(&k).as_deref(),
            Some("providers.1.fcm.private_key_id")
        );
        let mut k = keys();
        k.token_uri = "http://user:hunter2@h/token".into();
        assert_eq!(invalid(&k).as_deref(), Some("providers.1.fcm.token_uri"));
        assert!(!k.validate("p").unwrap_err().to_string().contains("hunter2"));
        let mut k = keys();
        k.token_refresh_margin_s = 1801;
        assert_eq!(
            invalid(&k).as_deref(),
            Some("providers.1.fcm.token_refresh_margin_s")
        );
    }
}
