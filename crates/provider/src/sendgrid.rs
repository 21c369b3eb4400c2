//! SendGrid v3 Mail Send (kind `sendgrid`): the account's keys and the adapter.
//!
//! # Keys (the `sendgrid` table of a provider account)
//!
//! | key | default | rule |
//! |-----|---------|------|
//! | `api_key` (secret) | required | sent as `Authorization: Bearer <key>`; visible ASCII |
//! | `from_email` | required | the sender address (`local@domain`, at most 254 characters) |
//! | `from_name` | unset | the sender's display name, at most 100 characters |
//! | `subject` | `"Reminder"` | the subject when the reminder's content has no `subject`; 1 to 200 characters |

use nudge_config::{ConfigError, Secret};
use serde::{Deserialize, Serialize};

/// The `sendgrid` table. See the module docs for the keys and their rules.
#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub struct SendgridKeys {
    pub api_key: Secret,
    pub from_email: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_name: Option<String>,
    #[serde(default = "default_subject")]
    pub subject: String,
}

fn default_subject() -> String {
    "Reminder".to_owned()
}

fn key(prefix: &str, field: &str) -> String {
    format!("{prefix}.{field}")
}

fn plain_text(value: &str, max_chars: usize) -> bool {
    !value.trim().is_empty()
        && value.chars().count() <= max_chars
        && !value.chars().any(char::is_control)
}

impl SendgridKeys {
    /// Keys with the defaults for everything optional.
    pub fn new(api_key: impl Into<String>, from_email: impl Into<String>) -> Self {
        Self {
            api_key: Secret::new(api_key.into()),
            from_email: from_email.into(),
            from_name: None,
            subject: default_subject(),
        }
    }

    /// Checks every rule; errors name `{key_prefix}.{field}` and never the value.
    pub fn validate(&self, key_prefix: &str) -> Result<(), ConfigError> {
        if !crate::twilio::is_token(self.api_key.expose()) {
            return Err(ConfigError::invalid(
                key(key_prefix, "api_key"),
                "must be visible ASCII without whitespace",
            ));
        }
        let email_ok = self.from_email.len() <= 254
            && self
                .from_email
                .split_once('@')
                .is_some_and(|(local, domain)| {
                    !local.is_empty() && !domain.is_empty() && !domain.contains('@')
                })
            && !self
                .from_email
                .chars()
                .any(|c| c.is_whitespace() || c.is_control());
        if !email_ok {
            return Err(ConfigError::invalid(
                key(key_prefix, "from_email"),
                "must be an address `local@domain` of at most 254 characters",
            ));
        }
        if let Some(name) = &self.from_name
            && !plain_text(name, 100)
        {
            return Err(ConfigError::invalid(
                key(key_prefix, "from_name"),
                "must be 1 to 100 characters without control characters",
            ));
        }
        if !plain_text(&self.subject, 200) {
            return Err(ConfigError::invalid(
                key(key_prefix, "subject"),
                "must be 1 to 200 characters without control characters",
            ));
        }
        Ok(())
    }
}

// ---- the adapter ----

use nudge_domain::{
    IdempotencySupport, ProviderAccount, ProviderAnswer, RetryAfter, SendOutcome, Verdict,
    retry_after_at,
};
use reqwest::header::{self, HeaderValue};

use crate::transport::{self, MAX_BODY_BYTES, header_text};
use crate::{HttpProviderConfig, Provider, ProviderError, SendRequest};

/// The `custom_args` key that carries the delivery's key, so events map back to it.
pub const CUSTOM_ARG_KEY: &str = "nudge_key";
const MAX_MESSAGE_ID_LEN: usize = 128;
const MAX_HEADER_LEN: usize = 128;

/// A SendGrid account sending email through v3 Mail Send.
pub struct SendgridProvider {
    account: ProviderAccount,
    endpoint: url::Url,
    auth: HeaderValue,
    from_email: String,
    from_name: Option<String>,
    subject: String,
    client: reqwest::Client,
    /// The longest one request runs (`timeout_ms`).
    timeout: std::time::Duration,
}

impl std::fmt::Debug for SendgridProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendgridProvider")
            .field("account", &self.account)
            .field("endpoint", &self.endpoint.as_str())
            .field("auth", &"[redacted]")
            .finish_non_exhaustive()
    }
}

/// SendGrid's error body: `{"errors": [{"message", "field", "help"}]}`; only `field` is read.
#[derive(serde::Deserialize, Default)]
struct ErrorBody {
    #[serde(default)]
    errors: Vec<ErrorItem>,
}

#[derive(serde::Deserialize)]
struct ErrorItem {
    field: Option<String>,
}

impl SendgridProvider {
    /// Validates `cfg` (errors name keys relative to the provider section) and builds the client.
    pub fn new(cfg: &HttpProviderConfig) -> Result<Self, ProviderError> {
        cfg.validate("")?;
        let invalid = |key: &str, m: String| nudge_config::ConfigError::invalid(key, m);
        let account = cfg
            .parsed_account()
            .map_err(|e| invalid("account", e.to_string()))?;
        let keys = cfg
            .sendgrid
            .as_ref()
            .ok_or_else(|| invalid("sendgrid", "required for kind `sendgrid`".to_owned()))?;
        let endpoint = cfg
            .endpoint_at("v3/mail/send")
            .map_err(|m| invalid("base_url", m))?;
        let mut auth = HeaderValue::from_str(&format!("Bearer {}", keys.api_key.expose()))
            .map_err(|_| invalid("sendgrid.api_key", "not a header value".to_owned()))?;
        auth.set_sensitive(true);
        let client = transport::client(cfg, &account)?;
        Ok(Self {
            account,
            endpoint,
            auth,
            from_email: keys.from_email.clone(),
            from_name: keys.from_name.clone(),
            subject: keys.subject.clone(),
            client,
            timeout: std::time::Duration::from_millis(cfg.timeout_ms),
        })
    }

    /// The Mail Send body. PHI (the address, the text) goes only into this body.
    fn body(&self, req: &SendRequest<'_>) -> serde_json::Value {
        let subject = req
            .content
            .and_then(|c| c.get("subject"))
            .and_then(|s| s.as_str())
            .unwrap_or(&self.subject);
        let mut from = serde_json::json!({ "email": self.from_email });
        if let Some(name) = &self.from_name {
            from["name"] = name.clone().into();
        }
        serde_json::json!({
            "personalizations": [{ "to": [{ "email": req.destination }] }],
            "from": from,
            "subject": subject,
            "content": [{
                "type": "text/plain",
                "value": crate::twilio::message_text(req.content),
            }],
            "custom_args": { CUSTOM_ARG_KEY: req.idempotency_key.as_str() },
        })
    }

    async fn send_once(&self, req: SendRequest<'_>) -> SendOutcome {
        let body = self.body(&req);
        if let Err(outcome) = req.open(self.timeout) {
            return outcome;
        }
        let response = self
            .client
            .post(self.endpoint.clone())
            .header(header::AUTHORIZATION, self.auth.clone())
            .json(&body)
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
        let headers = response.headers();
        let retry_after = header_text(headers, "retry-after", MAX_HEADER_LEN);
        let reset = header_text(headers, "x-ratelimit-reset", MAX_HEADER_LEN);
        let message_id = header_text(headers, "x-message-id", MAX_MESSAGE_ID_LEN);
        let errors: ErrorBody = if status == 400 {
            transport::read_body(response, MAX_BODY_BYTES)
                .await
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default()
        } else {
            ErrorBody::default()
        };
        SendOutcome::Answered(interpret(status, retry_after, reset, message_id, &errors))
    }
}

/// What SendGrid's answer means. A 429's `X-RateLimit-Reset` (a Unix time) is its
/// `Retry-After` as a date when it sent no `Retry-After` itself.
fn interpret(
    status: u16,
    retry_after: Option<String>,
    reset: Option<String>,
    message_id: Option<String>,
    errors: &ErrorBody,
) -> ProviderAnswer {
    let to_address_refused = errors.errors.iter().any(|e| {
        e.field
            .as_deref()
            .is_some_and(|f| f.starts_with("personalizations") && f.contains(".to"))
    });
    let verdict = match status {
        200..=299 => Verdict::Accepted,
        429 => Verdict::ThrottledAccount,
        // 401: the key is wrong; 403: the key lacks `mail.send` or the sender is not verified.
        // Either way every send through the account fails the same.
        401 | 403 => Verdict::AuthFailure,
        400 if to_address_refused => Verdict::ContactInvalid,
        503 if retry_after
            .as_deref()
            .is_some_and(|v| RetryAfter::parse(v).is_ok()) =>
        {
            Verdict::RetryLater
        }
        500..=599 => Verdict::MaybeSent,
        _ => Verdict::Rejected,
    };
    let retry_after = retry_after.or_else(|| {
        (verdict == Verdict::ThrottledAccount)
            .then_some(reset)
            .flatten()
            .and_then(|r| r.parse::<i64>().ok())
            .and_then(|secs| chrono::DateTime::from_timestamp(secs, 0))
            .map(retry_after_at)
    });
    let message_id = message_id
        .filter(|_| verdict == Verdict::Accepted)
        .filter(|id| {
            !id.is_empty()
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        });
    ProviderAnswer::new(verdict, Some(status))
        .with_retry_after(retry_after)
        .with_message_id(message_id)
}

impl Provider for SendgridProvider {
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

    fn errors(fields: &[&str]) -> ErrorBody {
        ErrorBody {
            errors: fields
                .iter()
                .map(|f| ErrorItem {
                    field: Some((*f).to_owned()),
                })
                .collect(),
        }
    }

    #[test]
    fn sendgrid_answers_map_onto_verdicts() {
        let none = ErrorBody::default();
        for (status, ra, errs, want) in [
            (202, None, &none, Verdict::Accepted),
            (429, None, &none, Verdict::ThrottledAccount),
            (401, None, &none, Verdict::AuthFailure),
            (403, None, &none, Verdict::AuthFailure),
            (
                400,
                None,
                &errors(&["personalizations.0.to.0.email"]),
                Verdict::ContactInvalid,
            ),
            (400, None, &errors(&["subject"]), Verdict::Rejected),
            (413, None, &none, Verdict::Rejected),
            (500, None, &none, Verdict::MaybeSent),
            (503, Some("5"), &none, Verdict::RetryLater),
            (503, None, &none, Verdict::MaybeSent),
        ] {
            let got = interpret(status, ra.map(str::to_owned), None, None, errs);
            assert_eq!(got.verdict, want, "{status}");
        }
    }

    #[test]
    fn a_429_s_reset_time_becomes_a_retry_after_date() {
        let a = interpret(
            429,
            None,
            Some("1893456300".into()),
            None,
            &ErrorBody::default(),
        );
        assert_eq!(
            a.retry_after.as_deref(),
            Some("Tue, 01 Jan 2030 00:05:00 GMT")
        );
        let a = interpret(
            429,
            Some("7".into()),
            Some("1893456300".into()),
            None,
            &ErrorBody::default(),
        );
        assert_eq!(a.retry_after.as_deref(), Some("7"));
        let a = interpret(429, None, Some("soon".into()), None, &ErrorBody::default());
        assert_eq!(a.retry_after, None);
    }

    #[test]
    fn the_message_id_header_is_kept_only_when_accepted_and_plain() {
        let e = ErrorBody::default();
        let a = interpret(
            202,
            None,
            None,
            Some("14c5d75ce93.dfd.64b469.filter-1".into()),
            &e,
        );
        assert_eq!(
            a.provider_message_id.as_deref(),
            Some("14c5d75ce93.dfd.64b469.filter-1")
        );
        let a = interpret(202, None, None, Some("a b".into()), &e);
        assert_eq!(a.provider_message_id, None);
    }
}
