//! Twilio Programmable Messaging (kind `twilio`): the account's keys and the adapter.
//!
//! # Keys (the `twilio` table of a provider account)
//!
//! | key | default | rule |
//! |-----|---------|------|
//! | `account_sid` | required | `AC` and 32 hex digits; the path's `{AccountSid}` and the Basic auth user |
//! | `auth_token` (secret) | required | the Basic auth password (and what signs status callbacks); visible ASCII |
//! | `from` | unset | the sender: an E.164 number, a short code or an alphanumeric sender id; exactly one of `from` and `messaging_service_sid` |
//! | `messaging_service_sid` | unset | `MG` and 32 hex digits: send through a Messaging Service instead of one number |
//! | `status_callback_url` | unset (no receipts) | `http(s)://` URL of the intake's Twilio receipts endpoint (`{receipts.public_base_url}/receipts/twilio/{account}`); each message's `StatusCallback` is this URL with `?key=<delivery key>` added |

use nudge_config::{ConfigError, Secret};
use serde::{Deserialize, Serialize};
use url::Url;

/// The `twilio` table. See the module docs for the keys and their rules.
#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub struct TwilioKeys {
    pub account_sid: String,
    pub auth_token: Secret,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messaging_service_sid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_callback_url: Option<String>,
}

fn key(prefix: &str, field: &str) -> String {
    format!("{prefix}.{field}")
}

/// `prefix` and 32 hex digits: Twilio's SIDs.
fn is_sid(value: &str, prefix: &str) -> bool {
    value.len() == 34
        && value.starts_with(prefix)
        && value[2..].bytes().all(|b| b.is_ascii_hexdigit())
}

/// Visible ASCII, no whitespace: what fits an `Authorization` header and an HMAC key as is.
pub(crate) fn is_token(value: &str) -> bool {
    !value.is_empty() && value.bytes().all(|b| b.is_ascii_graphic())
}

impl TwilioKeys {
    /// Checks every rule; errors name `{key_prefix}.{field}` and never the value.
    pub fn validate(&self, key_prefix: &str) -> Result<(), ConfigError> {
        if !is_sid(&self.account_sid, "AC") {
            return Err(ConfigError::invalid(
                key(key_prefix, "account_sid"),
                "must be `AC` followed by 32 hex digits",
            ));
        }
        if !is_token(self.auth_token.expose()) {
            return Err(ConfigError::invalid(
                key(key_prefix, "auth_token"),
                "must be visible ASCII without whitespace",
            ));
        }
        match (&self.from, &self.messaging_service_sid) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(ConfigError::invalid(
                    key(key_prefix, "from"),
                    "set exactly one of `from` and `messaging_service_sid`",
                ));
            }
            (Some(from), None) => {
                let ok = !from.is_empty()
                    && from.chars().count() <= 32
                    && from
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '+' || c == ' ');
                if !ok {
                    return Err(ConfigError::invalid(
                        key(key_prefix, "from"),
                        "must be an E.164 number, a short code or an alphanumeric sender id",
                    ));
                }
            }
            (None, Some(sid)) => {
                if !is_sid(sid, "MG") {
                    return Err(ConfigError::invalid(
                        key(key_prefix, "messaging_service_sid"),
                        "must be `MG` followed by 32 hex digits",
                    ));
                }
            }
        }
        if let Some(url) = &self.status_callback_url {
            callback_base(url)
                .map_err(|m| ConfigError::invalid(key(key_prefix, "status_callback_url"), m))?;
        }
        Ok(())
    }
}

/// The status callback URL, checked (the message never repeats it).
pub(crate) fn callback_base(raw: &str) -> Result<Url, String> {
    let url = Url::parse(raw).map_err(|e| format!("not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err("expected an http:// or https:// URL with a host".to_owned());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must not contain credentials".to_owned());
    }
    if url.fragment().is_some() {
        return Err("must not have a fragment".to_owned());
    }
    Ok(url)
}

// ---- the adapter ----

use nudge_domain::{
    IdempotencySupport, ProviderAccount, ProviderAnswer, RetryAfter, SendOutcome, Verdict,
};
use reqwest::header::{self, HeaderValue};

use crate::transport::{self, MAX_BODY_BYTES, header_text};
use crate::{Expiry, HttpProviderConfig, Provider, ProviderError, SendRequest};

/// Twilio's longest `ValidityPeriod`, in seconds.
pub const MAX_VALIDITY_S: u64 = 36_000;
/// The query parameter of the status callback URL that carries the delivery's key.
pub const CALLBACK_KEY_PARAM: &str = "key";
const MAX_SID_LEN: usize = 64;
const MAX_RETRY_AFTER_LEN: usize = 128;

/// Twilio's error codes that nudge maps (the rest of a 4xx is a rejection).
pub mod code {
    /// Too many requests: the account's concurrency or rate.
    pub const TOO_MANY_REQUESTS: i64 = 20429;
    /// Authentication error: the account SID or token is wrong.
    pub const AUTHENTICATION: i64 = 20003;
    /// Invalid 'To' phone number.
    pub const INVALID_TO: i64 = 21211;
    /// 'To' is not a valid mobile number (a landline, say).
    pub const NOT_MOBILE: i64 = 21614;
    /// The recipient replied STOP: Twilio refuses to send to it.
    pub const UNSUBSCRIBED: i64 = 21610;
}

/// A Twilio account sending SMS through the Messages resource.
pub struct TwilioProvider {
    account: ProviderAccount,
    endpoint: url::Url,
    auth: HeaderValue,
    sender: Sender,
    callback: Option<url::Url>,
    client: reqwest::Client,
    /// The longest one request runs (`timeout_ms`).
    timeout: std::time::Duration,
}

enum Sender {
    From(String),
    Service(String),
}

impl std::fmt::Debug for TwilioProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TwilioProvider")
            .field("account", &self.account)
            .field("endpoint", &self.endpoint.as_str())
            .field("auth", &"[redacted]")
            .finish_non_exhaustive()
    }
}

/// The body Twilio answers with, success or error; every field optional.
#[derive(serde::Deserialize, Default)]
struct Answer {
    sid: Option<String>,
    code: Option<i64>,
}

impl TwilioProvider {
    /// Validates `cfg` (errors name keys relative to the provider section) and builds the client.
    pub fn new(cfg: &HttpProviderConfig) -> Result<Self, ProviderError> {
        cfg.validate("")?;
        let invalid = |key: &str, m: String| nudge_config::ConfigError::invalid(key, m);
        let account = cfg
            .parsed_account()
            .map_err(|e| invalid("account", e.to_string()))?;
        let keys = cfg
            .twilio
            .as_ref()
            .ok_or_else(|| invalid("twilio", "required for kind `twilio`".to_owned()))?;
        let endpoint = cfg
            .endpoint_at(&format!(
                "2010-04-01/Accounts/{}/Messages.json",
                keys.account_sid
            ))
            .map_err(|m| invalid("base_url", m))?;
        let auth = basic_auth(&keys.account_sid, keys.auth_token.expose())
            .ok_or_else(|| invalid("twilio.auth_token", "not a header value".to_owned()))?;
        let sender = match (&keys.from, &keys.messaging_service_sid) {
            (Some(from), _) => Sender::From(from.clone()),
            (None, Some(sid)) => Sender::Service(sid.clone()),
            (None, None) => {
                return Err(invalid("twilio.from", "required".to_owned()).into());
            }
        };
        let callback = keys
            .status_callback_url
            .as_deref()
            .map(callback_base)
            .transpose()
            .map_err(|m| invalid("twilio.status_callback_url", m))?;
        let client = transport::client(cfg, &account)?;
        Ok(Self {
            account,
            endpoint,
            auth,
            sender,
            callback,
            client,
            timeout: std::time::Duration::from_millis(cfg.timeout_ms),
        })
    }

    /// The form Twilio takes. PHI (`To`, `Body`) goes only into this body.
    fn form(&self, req: &SendRequest<'_>, expiry: Option<Expiry>) -> String {
        let mut form = url::form_urlencoded::Serializer::new(String::new());
        form.append_pair("To", req.destination);
        match &self.sender {
            Sender::From(from) => form.append_pair("From", from),
            Sender::Service(sid) => form.append_pair("MessagingServiceSid", sid),
        };
        form.append_pair("Body", &message_text(req.content));
        if let Some(callback) = &self.callback {
            let mut url = callback.clone();
            url.query_pairs_mut()
                .append_pair(CALLBACK_KEY_PARAM, req.idempotency_key.as_str());
            form.append_pair("StatusCallback", url.as_str());
        }
        if let Some(expiry) = expiry {
            let validity = expiry.seconds_left().clamp(1, MAX_VALIDITY_S);
            form.append_pair("ValidityPeriod", &validity.to_string());
        }
        form.finish()
    }

    async fn send_once(&self, req: SendRequest<'_>) -> SendOutcome {
        // `ValidityPeriod` counts from now, as the request is built.
        let expiry = match req.open(self.timeout) {
            Ok(expiry) => expiry,
            Err(outcome) => return outcome,
        };
        let response = self
            .client
            .post(self.endpoint.clone())
            .header(header::AUTHORIZATION, self.auth.clone())
            .header(header::ACCEPT, "application/json")
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(self.form(&req, expiry))
            .send()
            .await;
        let response = match response {
            Ok(r) => r,
            Err(e) => return transport::logged_outcome_of_error(&self.account, e),
        };
        let status = response.status().as_u16();
        if let Some(outcome) = crate::transport::out_of_range(status) {
            return outcome;
        }
        let retry_after = header_text(response.headers(), "retry-after", MAX_RETRY_AFTER_LEN);
        let body = transport::read_body(response, MAX_BODY_BYTES).await;
        let answer: Answer = body
            .as_deref()
            .and_then(|b| serde_json::from_slice(b).ok())
            .unwrap_or_default();
        SendOutcome::Answered(interpret(status, retry_after, answer))
    }
}

/// What Twilio's answer means. The error `code` of the body decides where it is known; the
/// status otherwise.
fn interpret(status: u16, retry_after: Option<String>, answer: Answer) -> ProviderAnswer {
    let code = answer.code;
    let verdict = match (status, code) {
        (200..=299, _) => Verdict::Accepted,
        (_, Some(code::TOO_MANY_REQUESTS)) | (429, _) => Verdict::ThrottledAccount,
        (_, Some(code::AUTHENTICATION)) | (401, _) => Verdict::AuthFailure,
        (_, Some(code::INVALID_TO | code::NOT_MOBILE)) => Verdict::ContactInvalid,
        (_, Some(code::UNSUBSCRIBED)) => Verdict::ContactOptedOut,
        (503, _)
            if retry_after
                .as_deref()
                .is_some_and(|v| RetryAfter::parse(v).is_ok()) =>
        {
            Verdict::RetryLater
        }
        // Twilio may have queued the message before its edge failed: no key dedupes a resend.
        (500..=599, _) => Verdict::MaybeSent,
        _ => Verdict::Rejected,
    };
    let message_id = answer
        .sid
        .filter(|_| verdict == Verdict::Accepted)
        .filter(|s| s.len() <= MAX_SID_LEN && s.bytes().all(|b| b.is_ascii_alphanumeric()));
    ProviderAnswer::new(verdict, Some(status))
        .with_retry_after(retry_after)
        .with_message_id(message_id)
        .with_code(code.map(|c| c.to_string()).as_deref())
}

/// `Basic base64(sid:token)`, marked sensitive.
fn basic_auth(user: &str, password: &str) -> Option<HeaderValue> {
    use base64::Engine as _;
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let mut value = HeaderValue::from_str(&format!("Basic {encoded}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

/// The text of a message from a reminder's content: its `body`, else its `text`, else the
/// content as JSON (a template's name and fields); empty without content.
pub fn message_text(content: Option<&serde_json::Value>) -> String {
    match content {
        None => String::new(),
        Some(c) => ["body", "text"]
            .iter()
            .find_map(|k| c.get(k).and_then(|v| v.as_str()).map(str::to_owned))
            .unwrap_or_else(|| c.to_string()),
    }
}

impl Provider for TwilioProvider {
    fn account(&self) -> &ProviderAccount {
        &self.account
    }

    fn idempotency(&self) -> IdempotencySupport {
        IdempotencySupport::NotHonoured
    }

    fn endpoint(&self) -> &url::Url {
        &self.endpoint
    }

    fn send<'a>(
        &'a self,
        req: SendRequest<'a>,
    ) -> impl std::future::Future<Output = SendOutcome> + Send + 'a {
        self.send_once(req)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn answer(sid: Option<&str>, code: Option<i64>) -> Answer {
        Answer {
            sid: sid.map(str::to_owned),
            code,
        }
    }

    #[test]
    fn twilio_answers_map_onto_verdicts() {
        for (status, code, ra, want) in [
            (201, None, None, Verdict::Accepted),
            (429, Some(20429), None, Verdict::ThrottledAccount),
            (429, None, Some("10"), Verdict::ThrottledAccount),
            (400, Some(20429), None, Verdict::ThrottledAccount),
            (401, Some(20003), None, Verdict::AuthFailure),
            (401, None, None, Verdict::AuthFailure),
            (400, Some(21211), None, Verdict::ContactInvalid),
            (400, Some(21614), None, Verdict::ContactInvalid),
            (400, Some(21610), None, Verdict::ContactOptedOut),
            (400, Some(21602), None, Verdict::Rejected),
            (404, None, None, Verdict::Rejected),
            (500, None, None, Verdict::MaybeSent),
            (502, None, None, Verdict::MaybeSent),
            (503, None, None, Verdict::MaybeSent),
            (503, None, Some("30"), Verdict::RetryLater),
            (503, None, Some("soon"), Verdict::MaybeSent),
        ] {
            let got = interpret(status, ra.map(str::to_owned), answer(None, code));
            assert_eq!(got.verdict, want, "{status} {code:?} {ra:?}");
            assert_eq!(got.http_status, Some(status));
        }
    }

    #[test]
    fn the_message_sid_is_kept_only_when_accepted_and_plain() {
        let a = interpret(201, None, answer(Some("SM0123456789abcdef"), None));
        assert_eq!(a.provider_message_id.as_deref(), Some("SM0123456789abcdef"));
        let a = interpret(201, None, answer(Some("SM 1"), None));
        assert_eq!(a.provider_message_id, None);
        let a = interpret(400, None, answer(Some("SM1"), Some(21211)));
        assert_eq!(a.provider_message_id, None);
        assert_eq!(a.code.unwrap().as_str(), "21211");
    }

    #[test]
    fn the_text_comes_from_body_then_text_then_the_content_itself() {
        use serde_json::json;
        assert_eq!(message_text(Some(&json!({"body": "a", "text": "b"}))), "a");
        assert_eq!(message_text(Some(&json!({"text": "b"}))), "b");
        assert_eq!(
            message_text(Some(&json!({"template": "t"}))),
            r#"{"template":"t"}"#
        );
        assert_eq!(message_text(None), "");
    }
}
