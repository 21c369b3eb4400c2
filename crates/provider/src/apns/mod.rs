//! Apple Push Notification service (kind `apns`): `POST {base_url}/3/device/{device token}` over
//! HTTP/2 and TLS, authorised by an ES256 provider token ([`token`]), answers mapped by
//! [`map::map_response`]. `base_url` is APNs's root: `https://api.push.apple.com`, or
//! `https://api.sandbox.push.apple.com` for development builds of the app.
//!
//! Headers: `authorization: bearer <token>`, `apns-topic` (the app's bundle id),
//! `apns-push-type`, `apns-priority`, `apns-expiration` (the reminder's `expires_at`, Unix
//! seconds: APNs stops trying to deliver after it) and `apns-id` (the reminder's id: the same on
//! every attempt, echoed by APNs, so an attempt and its answer can be matched in Apple's tools;
//! APNs does not deduplicate by it). The payload is `{"aps": {"alert": {"title", "body"}}, ...}`
//! (or `{"aps": {"content-available": 1}, ...}` with no title or body), at most
//! [`MAX_PAYLOAD_BYTES`], checked before sending; so is the device token, which goes into the
//! path and must be hexadecimal.
//!
//! # Keys
//!
//! The `apns` table of an account of kind `apns` (`[providers.apns]`):
//!
//! | key | default | rule |
//! |-----|---------|------|
//! | `team_id` | required | the Apple developer team id (the token's `iss`): 1 to 64 ASCII letters or digits |
//! | `key_id` | required | the signing key's id (the token's `kid`): 1 to 64 ASCII letters or digits |
//! | `private_key` (secret) | required | the signing key (`.p8`): an EC P-256 private key in PEM (PKCS#8) |
//! | `topic` | required | the app's bundle id, sent as `apns-topic` |
//! | `ca_file` | unset (the system's roots) | a PEM bundle; when set, the only roots trusted for this account |
//! | `push_type` | `alert` | `apns-push-type`: `alert` or `background` |
//! | `priority` | `10` | `apns-priority`: `10` (now), `5` (power-considerate) or `1` (background) |
//! | `token_refresh_s` | `3000` | the provider token's age at which it is replaced, 1200..=3300 (Apple: not more than once per 20 minutes, not less than once per hour) |
//! | `misconfigured_window` | `50` | how many of the account's recent answers are kept to tell a misconfigured account from bad tokens, 10..=10000 |
//! | `misconfigured_share` | `0.5` | the share of those answers that, being `400 BadDeviceToken` (a sandbox token sent to production, or the reverse), makes one the account's fault (an auth failure: alert, account suspended) rather than the contact's, (0, 1] |
//! | `misconfigured_min_answers` | `5` | how many `BadDeviceToken` answers the window must hold before that, 1..=`misconfigured_window` |

pub mod map;
pub mod token;

use std::path::PathBuf;
use std::time::Duration;

use jsonwebtoken::EncodingKey;
use nudge_config::{ConfigError, Secret};
use nudge_domain::{IdempotencySupport, ProviderAccount, ProviderAnswer, SendOutcome, Verdict};
use reqwest::header::{self, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use url::Url;

use crate::push::{PushContent, refused_before_send};
use crate::transport::{client_builder, logged_outcome_of_error, read_body};
use crate::{HttpProviderConfig, Provider, ProviderError, SendRequest};
use token::ProviderTokens;

pub use map::map_response;

/// APNs's limit on a notification's payload, in bytes.
pub const MAX_PAYLOAD_BYTES: usize = 4096;
/// How much of an answer is read; APNs's are tiny.
const MAX_BODY_BYTES: usize = 16 * 1024;
/// Device tokens are hexadecimal; Apple's are 64 characters today and may grow.
const MAX_DEVICE_TOKEN_LEN: usize = 200;

/// Codes of the refusals before sending.
pub mod reason {
    /// The payload is over [`super::MAX_PAYLOAD_BYTES`].
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
    /// The device token is not hexadecimal (it goes into the request's path).
    pub const INVALID_DEVICE_TOKEN: &str = "invalid_device_token";
}

const APNS_TOPIC: HeaderName = HeaderName::from_static("apns-topic");
const APNS_PUSH_TYPE: HeaderName = HeaderName::from_static("apns-push-type");
const APNS_PRIORITY: HeaderName = HeaderName::from_static("apns-priority");
const APNS_EXPIRATION: HeaderName = HeaderName::from_static("apns-expiration");
const APNS_ID: HeaderName = HeaderName::from_static("apns-id");
const CORRELATION_ID: HeaderName = HeaderName::from_static("x-correlation-id");
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// `apns-push-type` values nudge sends.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PushType {
    #[default]
    Alert,
    Background,
}

impl PushType {
    fn as_str(self) -> &'static str {
        match self {
            Self::Alert => "alert",
            Self::Background => "background",
        }
    }
}

/// The `apns` table of an account (see the module docs).
#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub struct ApnsKeys {
    pub team_id: String,
    pub key_id: String,
    pub private_key: Secret,
    pub topic: String,
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default)]
    pub push_type: PushType,
    #[serde(default = "default_priority")]
    pub priority: u8,
    #[serde(default = "default_token_refresh_s")]
    pub token_refresh_s: u64,
    #[serde(default = "crate::push::default_misconfigured_window")]
    pub misconfigured_window: usize,
    #[serde(default = "crate::push::default_misconfigured_share")]
    pub misconfigured_share: f64,
    #[serde(default = "crate::push::default_misconfigured_min_answers")]
    pub misconfigured_min_answers: usize,
}

const fn default_priority() -> u8 {
    10
}

const fn default_token_refresh_s() -> u64 {
    3000
}

fn key(prefix: &str, field: &str) -> String {
    if prefix.is_empty() {
        field.to_owned()
    } else {
        format!("{prefix}.{field}")
    }
}

fn is_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric())
}

struct Parsed {
    signing_key: EncodingKey,
    roots: Option<Vec<reqwest::Certificate>>,
    topic: HeaderValue,
}

impl ApnsKeys {
    /// The keys with the defaults for every optional one.
    pub fn new(
        team_id: impl Into<String>,
        key_id: impl Into<String>,
        private_key: Secret,
        topic: impl Into<String>,
    ) -> Self {
        Self {
            team_id: team_id.into(),
            key_id: key_id.into(),
            private_key,
            topic: topic.into(),
            ca_file: None,
            push_type: PushType::default(),
            priority: default_priority(),
            token_refresh_s: default_token_refresh_s(),
            misconfigured_window: crate::push::default_misconfigured_window(),
            misconfigured_share: crate::push::default_misconfigured_share(),
            misconfigured_min_answers: crate::push::default_misconfigured_min_answers(),
        }
    }

    /// Valid keys with a fresh P-256 key, for tests.
    #[cfg(test)]
    #[allow(clippy::unwrap_used)]
    pub(crate) fn for_tests() -> Self {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        Self::new(
            "TEAM123456",
            "KEY1234567",
            Secret::new(key.serialize_pem()),
            "org.example.app",
        )
    }

    /// Checks every rule (parsing the private key and reading `ca_file`), naming the first bad
    /// key as `{key_prefix}.{field}`; never repeats a secret.
    pub fn validate(&self, key_prefix: &str) -> Result<(), ConfigError> {
        self.parsed(key_prefix).map(|_| ())
    }

    fn parsed(&self, prefix: &str) -> Result<Parsed, ConfigError> {
        if !is_id(&self.team_id) {
            return Err(ConfigError::invalid(
                key(prefix, "team_id"),
                "must be 1 to 64 ASCII letters or digits",
            ));
        }
        if !is_id(&self.key_id) {
            return Err(ConfigError::invalid(
                key(prefix, "key_id"),
                "must be 1 to 64 ASCII letters or digits",
            ));
        }
        let signing_key =
            EncodingKey::from_ec_pem(self.private_key.expose().as_bytes()).map_err(|_| {
                ConfigError::invalid(
                    key(prefix, "private_key"),
                    "must be an EC P-256 private key in PEM (PKCS#8, as in the .p8 file)",
                )
            })?;
        let topic = (!self.topic.is_empty() && self.topic.bytes().all(|b| b.is_ascii_graphic()))
            .then(|| HeaderValue::from_str(&self.topic).ok())
            .flatten()
            .ok_or_else(|| {
                ConfigError::invalid(key(prefix, "topic"), "must be the app's bundle id")
            })?;
        let roots = match &self.ca_file {
            None => None,
            Some(path) => {
                let pem = std::fs::read(path).map_err(|e| {
                    ConfigError::invalid(key(prefix, "ca_file"), format!("cannot be read ({e})"))
                })?;
                let certs = reqwest::Certificate::from_pem_bundle(&pem)
                    .ok()
                    .filter(|c| !c.is_empty())
                    .ok_or_else(|| {
                        ConfigError::invalid(
                            key(prefix, "ca_file"),
                            "must hold one or more PEM certificates",
                        )
                    })?;
                Some(certs)
            }
        };
        if !matches!(self.priority, 1 | 5 | 10) {
            return Err(ConfigError::invalid(
                key(prefix, "priority"),
                "must be 10, 5 or 1",
            ));
        }
        if !(1200..=3300).contains(&self.token_refresh_s) {
            return Err(ConfigError::invalid(
                key(prefix, "token_refresh_s"),
                "must be between 1200 and 3300 (Apple: at most once per 20 minutes, at least once per hour)",
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
            roots,
            topic,
        })
    }
}

/// An APNs account: one HTTP/2 client (one connection carries every concurrent send) and the
/// account's provider token.
pub struct ApnsProvider {
    account: ProviderAccount,
    /// `{base_url}/3/device`; the device token is appended per send.
    endpoint: Url,
    topic: HeaderValue,
    push_type: PushType,
    priority: u8,
    client: reqwest::Client,
    tokens: ProviderTokens,
    /// The longest one request runs (`timeout_ms`).
    timeout: Duration,
    misconfiguration: crate::push::Misconfiguration,
}

impl std::fmt::Debug for ApnsProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApnsProvider")
            .field("account", &self.account)
            .field("endpoint", &self.endpoint.as_str())
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
}

use crate::invalid_key as invalid;

impl ApnsProvider {
    /// Builds the account from its validated configuration (errors name keys relative to the
    /// provider section).
    pub fn new(cfg: &HttpProviderConfig) -> Result<Self, ProviderError> {
        let account = cfg
            .parsed_account()
            .map_err(|e| invalid("account", e.to_string()))?;
        let keys = cfg
            .apns
            .as_ref()
            .ok_or_else(|| invalid("apns", "required for kind `apns`"))?;
        let parsed = keys.parsed("apns")?;
        let endpoint = cfg
            .endpoint_at("3/device")
            .map_err(|m| invalid("base_url", m))?;
        // APNs speaks only HTTP/2.
        let mut builder = client_builder(cfg).http2_prior_knowledge();
        if let Some(roots) = parsed.roots {
            builder = builder.tls_certs_only(roots);
        }
        let client = builder.build().map_err(|source| ProviderError::Client {
            account: account.clone(),
            source,
        })?;
        let tokens = ProviderTokens::new(
            keys.team_id.clone(),
            keys.key_id.clone(),
            parsed.signing_key,
            Duration::from_secs(keys.token_refresh_s),
        );
        Ok(Self {
            account,
            endpoint,
            topic: parsed.topic,
            push_type: keys.push_type,
            priority: keys.priority,
            client,
            tokens,
            timeout: Duration::from_millis(cfg.timeout_ms),
            misconfiguration: crate::push::Misconfiguration::new(
                keys.misconfigured_window,
                keys.misconfigured_share,
                keys.misconfigured_min_answers,
            ),
        })
    }

    /// How many provider tokens this account made so far.
    pub fn provider_tokens_made(&self) -> u64 {
        self.tokens.made()
    }

    async fn send_once(&self, req: SendRequest<'_>) -> SendOutcome {
        let device = req.destination;
        if device.is_empty()
            || device.len() > MAX_DEVICE_TOKEN_LEN
            || !device.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return SendOutcome::Answered(refused_before_send(reason::INVALID_DEVICE_TOKEN));
        }
        let body = match payload(&req) {
            Ok(b) => b,
            Err(code) => return SendOutcome::Answered(refused_before_send(code)),
        };
        let auth = match self.tokens.authorization() {
            Ok(h) => h,
            Err(outcome) => return outcome,
        };
        let mut url = self.endpoint.clone();
        url.set_path(&format!("{}/{device}", self.endpoint.path()));
        // `apns-expiration` is read from the window as the request is built.
        let expiry = match req.open(self.timeout) {
            Ok(expiry) => expiry,
            Err(outcome) => return outcome,
        };
        let request = self
            .client
            .post(url)
            .headers(self.headers(&req, expiry, auth.clone()));
        let response = match request.body(body).send().await {
            Ok(r) => r,
            Err(e) => return logged_outcome_of_error(&self.account, e),
        };
        let status = response.status().as_u16();
        if let Some(outcome) = crate::transport::out_of_range(status) {
            return outcome;
        }
        let headers = response.headers().clone();
        let body = read_body(response, MAX_BODY_BYTES)
            .await
            .unwrap_or_default();
        let answer = map_response(status, &headers, &body);
        // A sandbox token sent to production (or the reverse) gets this on every send.
        let suspect = answer.verdict == Verdict::ContactInvalid
            && status == 400
            && answer
                .code
                .as_ref()
                .is_some_and(|c| c.as_str() == "BadDeviceToken");
        let answer = self.misconfiguration.judge(answer, suspect);
        self.after(&answer, &auth);
        SendOutcome::Answered(answer)
    }

    /// The request's headers: the provider token, APNs's own, and our trace ids.
    fn headers(
        &self,
        req: &SendRequest<'_>,
        expiry: Option<crate::Expiry>,
        auth: HeaderValue,
    ) -> reqwest::header::HeaderMap {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(header::AUTHORIZATION, auth);
        headers.insert(APNS_TOPIC, self.topic.clone());
        headers.insert(
            APNS_PUSH_TYPE,
            HeaderValue::from_static(self.push_type.as_str()),
        );
        headers.insert(APNS_PRIORITY, HeaderValue::from(u16::from(self.priority)));
        let apns_id = req
            .idempotency_key
            .reminder_id()
            .as_uuid()
            .hyphenated()
            .to_string();
        if let Ok(v) = HeaderValue::from_str(&apns_id) {
            headers.insert(APNS_ID, v);
        }
        if let Some(expiry) = expiry {
            headers.insert(
                APNS_EXPIRATION,
                HeaderValue::from(expiry.expires_at.timestamp().max(0)),
            );
        }
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Ok(v) = HeaderValue::from_str(req.correlation_id) {
            headers.insert(CORRELATION_ID, v);
        }
        if let Some(v) = req.traceparent.and_then(|t| HeaderValue::from_str(t).ok()) {
            headers.insert(TRACEPARENT, v);
        }
        headers
    }

    /// What an answer says about the provider token.
    fn after(&self, answer: &ProviderAnswer, used: &HeaderValue) {
        if map::is_provider_token_refusal(answer) {
            self.tokens.refused(used);
        }
        if answer.verdict == Verdict::OwnFault {
            tracing::error!(
                provider_account = %self.account,
                provider_tokens_made = self.tokens.made(),
                "APNs says the provider token is renewed too often"
            );
        }
    }
}

impl Provider for ApnsProvider {
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

/// The notification's JSON, or the code of its refusal before sending.
fn payload(req: &SendRequest<'_>) -> Result<Vec<u8>, &'static str> {
    let content = PushContent::of(req.content);
    let aps = if content.title.is_some() || content.body.is_some() {
        let mut alert = serde_json::Map::new();
        if let Some(t) = content.title {
            alert.insert("title".into(), t.into());
        }
        if let Some(b) = content.body {
            alert.insert("body".into(), b.into());
        }
        serde_json::json!({ "alert": alert })
    } else {
        serde_json::json!({ "content-available": 1 })
    };
    let mut root = content.data;
    root.insert("aps".into(), aps);
    let body = serde_json::to_vec(&root).map_err(|_| crate::reason::REQUEST_BUILD_ERROR)?;
    if body.len() > MAX_PAYLOAD_BYTES {
        return Err(reason::PAYLOAD_TOO_LARGE);
    }
    Ok(body)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;
    use nudge_domain::{Channel, IdempotencyKey, ReminderId};

    fn msg<'a>(key: &'a IdempotencyKey, content: Option<&'a serde_json::Value>) -> SendRequest<'a> {
        SendRequest {
            idempotency_key: key,
            channel: Channel::Push,
            destination: "00fc13adff785122b4ad28809a3420982341241421348097878e577c991de8f0",
            content,
            correlation_id: "c",
            traceparent: None,
            window: None,
        }
    }

    #[test]
    fn the_payload_puts_title_and_body_in_aps_alert_and_the_rest_beside_it() {
        let key = IdempotencyKey::for_delivery(ReminderId::new(), Channel::Push);
        let content =
            serde_json::json!({"title": "Appointment", "body": "Tomorrow", "template": "appt"});
        let body: serde_json::Value =
            serde_json::from_slice(&payload(&msg(&key, Some(&content))).unwrap()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"aps": {"alert": {"title": "Appointment", "body": "Tomorrow"}}, "template": "appt"})
        );
        let body: serde_json::Value =
            serde_json::from_slice(&payload(&msg(&key, None)).unwrap()).unwrap();
        assert_eq!(body, serde_json::json!({"aps": {"content-available": 1}}));
    }

    #[test]
    fn a_payload_over_4096_bytes_is_refused_before_sending() {
        let key = IdempotencyKey::for_delivery(ReminderId::new(), Channel::Push);
        let big = serde_json::json!({"body": "x".repeat(MAX_PAYLOAD_BYTES)});
        assert_eq!(
            payload(&msg(&key, Some(&big))).unwrap_err(),
            reason::PAYLOAD_TOO_LARGE
        );
    }

    fn keys() -> ApnsKeys {
        ApnsKeys::for_tests()
    }

    #[test]
    fn the_headers_carry_topic_push_type_priority_the_reminder_id_and_the_expiry() {
        let mut cfg = HttpProviderConfig::new("push-apns", Channel::Push, "https://127.0.0.1:9");
        cfg.kind = crate::ProviderKind::Apns;
        cfg.apns = Some(keys());
        let provider = ApnsProvider::new(&cfg).unwrap();
        let reminder = ReminderId::new();
        let key = IdempotencyKey::for_delivery(reminder, Channel::Push);
        let now = chrono::Utc::now();
        let expires_at = now + chrono::TimeDelta::minutes(30);
        let req = msg(&key, None);
        let expiry = Some(crate::Expiry { expires_at, now });
        let headers = provider.headers(&req, expiry, HeaderValue::from_static("bearer t"));
        let get = |name: &str| headers.get(name).unwrap().to_str().unwrap().to_owned();
        assert_eq!(get("authorization"), "bearer t");
        assert_eq!(get("apns-topic"), "org.example.app");
        assert_eq!(get("apns-push-type"), "alert");
        assert_eq!(get("apns-priority"), "10");
        assert_eq!(get("apns-id"), reminder.as_uuid().hyphenated().to_string());
        assert_eq!(get("apns-expiration"), expires_at.timestamp().to_string());
        let headers = provider.headers(&req, None, HeaderValue::from_static("bearer t"));
        assert!(headers.get("apns-expiration").is_none());
    }

    #[test]
    fn each_bad_value_is_reported_under_its_own_key_and_never_repeats_the_key() {
        let invalid = |c: &ApnsKeys| c.validate("providers.1.apns").unwrap_err().key();
        keys().validate("providers.1.apns").unwrap();
        let mut c = keys();
        c.team_id = "team id".into();
        assert_eq!(invalid(&c).as_deref(), Some("providers.1.apns.team_id"));
        let mut c = keys();
        c.key_id = String::new();
        assert_eq!(invalid(&c).as_deref(), Some("providers.1.apns.key_id"));
        let mut c = keys();
        c.private_key =
            Secret::new("-----BEGIN PRIVATE KEY-----\nhunter2\n-----END PRIVATE KEY-----\n");
        assert_eq!(invalid(&c).as_deref(), Some("providers.1.apns.private_key"));
        assert!(!c.validate("p").unwrap_err().to_string().contains("hunter2"));
        let mut c = keys();
        c.topic = String::new();
        assert_eq!(invalid(&c).as_deref(), Some("providers.1.apns.topic"));
        let mut c = keys();
        c.ca_file = Some("/nonexistent/ca.pem".into());
        assert_eq!(invalid(&c).as_deref(), Some("providers.1.apns.ca_file"));
        let mut c = keys();
        c.priority = 7;
        assert_eq!(invalid(&c).as_deref(), Some("providers.1.apns.priority"));
        for bad in [1199, 3301] {
            let mut c = keys();
            c.token_refresh_s = bad;
            assert_eq!(
                invalid(&c).as_deref(),
                Some("providers.1.apns.token_refresh_s")
            );
        }
    }
}
