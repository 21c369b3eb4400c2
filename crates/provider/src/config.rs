//! The settings of one provider account.
//!
//! # Keys
//!
//! Relative to where the binary puts the section (e.g. `providers.0`):
//!
//! | key | default | rule |
//! |-----|---------|------|
//! | `kind` | `generic` | `generic` (nudge's own JSON protocol, [`crate::HttpProvider`]), `twilio`, `sendgrid`, `fcm` or `apns`; each kind but `generic` takes its own keys in a table named after it (`[providers.twilio]`, ...), and only its own |
//! | `account` | required | a provider account name (lowercase letters, digits, `_`, `-`) |
//! | `channel` | required | `push`, `email` or `sms` |
//! | `base_url` | required | `http://` or `https://` URL without credentials, query or fragment; `generic` appends `/v1/messages` to its path, the other kinds their provider's path |
//! | `auth_token` (secret) | unset (no `Authorization`) | `generic` only: sent as `Authorization: Bearer <token>`; visible ASCII |
//! | `timeout_ms` | `10000` | > 0; the whole request, from connect to the last byte of the answer |
//! | `connect_timeout_ms` | `2000` | > 0 and below `timeout_ms` |
//! | `honours_idempotency` | `false` | whether the provider dedups by `Idempotency-Key`; only `generic` may set it true (none of the real providers does) |
//! | `default_for_channel` | `false` | the account a worker uses for its channel when none is chosen |
//! | `rate_per_second` | unset (not limited) | the account's starting admission rate, >= 0; creates its shared rate bucket if none exists (a bucket changed at run time with `nudgectl rate set` keeps its rate). An account without a bucket cannot be suspended when its credentials are refused |
//! | `burst` | `max(1, ceil(rate_per_second))` | how many sends may go back to back, >= 1 |
//!
//! The kinds' own tables: `twilio` ([`crate::twilio::TwilioKeys`]), `sendgrid`
//! ([`crate::sendgrid::SendgridKeys`]), `fcm` ([`FcmKeys`]) and `apns` ([`ApnsKeys`]).

use nudge_config::{ConfigError, Secret};
use nudge_domain::{Channel, IdempotencySupport, ProviderAccount};
use reqwest::header::HeaderValue;
use serde::{Deserialize, Serialize};
use url::Url;

/// Which provider's contract an account speaks.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// nudge's own JSON protocol (`POST {base_url}/v1/messages`), the stub's default shape.
    #[default]
    Generic,
    Twilio,
    Sendgrid,
    Fcm,
    Apns,
}

impl ProviderKind {
    pub const ALL: [ProviderKind; 5] = [
        ProviderKind::Generic,
        ProviderKind::Twilio,
        ProviderKind::Sendgrid,
        ProviderKind::Fcm,
        ProviderKind::Apns,
    ];

    /// The name in configuration, and the name of the kind's own key table.
    pub const fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Generic => "generic",
            ProviderKind::Twilio => "twilio",
            ProviderKind::Sendgrid => "sendgrid",
            ProviderKind::Fcm => "fcm",
            ProviderKind::Apns => "apns",
        }
    }
}

impl std::fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

pub use crate::apns::ApnsKeys;
pub use crate::fcm::FcmKeys;

/// One provider account. See the module docs for the keys and their rules.
#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub struct HttpProviderConfig {
    #[serde(default)]
    pub kind: ProviderKind,
    pub account: String,
    pub channel: Channel,
    pub base_url: String,
    #[serde(default)]
    pub auth_token: Option<Secret>,
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    #[serde(default)]
    pub honours_idempotency: bool,
    #[serde(default)]
    pub default_for_channel: bool,
    #[serde(default)]
    pub rate_per_second: Option<f64>,
    #[serde(default)]
    pub burst: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub twilio: Option<crate::twilio::TwilioKeys>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sendgrid: Option<crate::sendgrid::SendgridKeys>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fcm: Option<FcmKeys>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apns: Option<ApnsKeys>,
}

const fn default_timeout_ms() -> u64 {
    10_000
}

const fn default_connect_timeout_ms() -> u64 {
    2_000
}

fn key(prefix: &str, field: &str) -> String {
    if prefix.is_empty() {
        field.to_owned()
    } else {
        format!("{prefix}.{field}")
    }
}

impl HttpProviderConfig {
    /// A config with the defaults for everything but the three required keys.
    pub fn new(account: impl Into<String>, channel: Channel, base_url: impl Into<String>) -> Self {
        Self {
            kind: ProviderKind::Generic,
            account: account.into(),
            channel,
            base_url: base_url.into(),
            auth_token: None,
            timeout_ms: default_timeout_ms(),
            connect_timeout_ms: default_connect_timeout_ms(),
            honours_idempotency: false,
            default_for_channel: false,
            rate_per_second: None,
            burst: None,
            twilio: None,
            sendgrid: None,
            fcm: None,
            apns: None,
        }
    }

    /// Checks every rule; the error names the first bad key as `{key_prefix}.{field}` and never
    /// contains the configured value (the URL could carry credentials, the token is secret).
    pub fn validate(&self, key_prefix: &str) -> Result<(), ConfigError> {
        self.parsed_account()
            .map_err(|e| ConfigError::invalid(key(key_prefix, "account"), e.to_string()))?;
        self.base()
            .map_err(|m| ConfigError::invalid(key(key_prefix, "base_url"), m))?;
        self.validate_kind(key_prefix)?;
        if self.auth_token.is_some() && self.auth_header().is_none() {
            return Err(ConfigError::invalid(
                key(key_prefix, "auth_token"),
                "must be visible ASCII without whitespace",
            ));
        }
        if self.timeout_ms == 0 {
            return Err(ConfigError::invalid(
                key(key_prefix, "timeout_ms"),
                "must be greater than 0",
            ));
        }
        if self.connect_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                key(key_prefix, "connect_timeout_ms"),
                "must be greater than 0",
            ));
        }
        // Otherwise a slow connect would be cut by the overall timeout, which cannot tell that the
        // request never left, and a send that surely failed would be reported as unknown.
        if self.connect_timeout_ms >= self.timeout_ms {
            return Err(ConfigError::invalid(
                key(key_prefix, "connect_timeout_ms"),
                format!(
                    "must be less than timeout_ms ({}), got {}",
                    self.timeout_ms, self.connect_timeout_ms
                ),
            ));
        }
        if let Some(rate) = self.rate_per_second
            && (!rate.is_finite() || rate < 0.0)
        {
            return Err(ConfigError::invalid(
                key(key_prefix, "rate_per_second"),
                "must be a finite number >= 0",
            ));
        }
        if self.burst == Some(0) {
            return Err(ConfigError::invalid(
                key(key_prefix, "burst"),
                "must be at least 1",
            ));
        }
        Ok(())
    }

    /// The kind's rules: its own table present (and valid), every other kind's absent; the
    /// generic-only keys unset for a real provider, which never honours our idempotency key.
    fn validate_kind(&self, key_prefix: &str) -> Result<(), ConfigError> {
        let present = [
            (ProviderKind::Twilio, self.twilio.is_some()),
            (ProviderKind::Sendgrid, self.sendgrid.is_some()),
            (ProviderKind::Fcm, self.fcm.is_some()),
            (ProviderKind::Apns, self.apns.is_some()),
        ];
        for (kind, is_set) in present {
            if is_set && kind != self.kind {
                return Err(ConfigError::invalid(
                    key(key_prefix, kind.as_str()),
                    format!(
                        "only for kind `{kind}`; this account is kind `{}`",
                        self.kind
                    ),
                ));
            }
            if !is_set && kind == self.kind {
                return Err(ConfigError::invalid(
                    key(key_prefix, kind.as_str()),
                    format!("required for kind `{kind}`"),
                ));
            }
        }
        if self.kind == ProviderKind::Generic {
            return Ok(());
        }
        if self.honours_idempotency {
            return Err(ConfigError::invalid(
                key(key_prefix, "honours_idempotency"),
                format!(
                    "must be false for kind `{}`: the provider does not dedupe by an idempotency key",
                    self.kind
                ),
            ));
        }
        if self.auth_token.is_some() {
            return Err(ConfigError::invalid(
                key(key_prefix, "auth_token"),
                format!(
                    "only for kind `generic`; kind `{}` takes its credentials in its own table",
                    self.kind
                ),
            ));
        }
        let own = key(key_prefix, self.kind.as_str());
        match (&self.twilio, &self.sendgrid, &self.fcm, &self.apns) {
            (Some(k), _, _, _) => k.validate(&own),
            (_, Some(k), _, _) => k.validate(&own),
            (_, _, Some(k), _) => k.validate(&own),
            (_, _, _, Some(k)) => k.validate(&own),
            _ => Ok(()),
        }
    }

    /// The starting burst: as configured, else one second's worth of the rate (at least 1).
    pub fn starting_burst(&self) -> u32 {
        self.burst.unwrap_or_else(|| {
            // Saturating float-to-int: provider rates are far below u32::MAX.
            (self.rate_per_second.unwrap_or(1.0).ceil() as u32).max(1)
        })
    }

    /// Whether a resend after an unknown outcome is safe with this account: never for a real
    /// provider's kind.
    pub fn idempotency(&self) -> IdempotencySupport {
        (self.kind == ProviderKind::Generic && self.honours_idempotency).into()
    }

    pub fn parsed_account(&self) -> Result<ProviderAccount, nudge_domain::IdError> {
        ProviderAccount::parse(&self.account)
    }

    /// `{base_url}/v1/messages`, keeping any path prefix of `base_url`, with or without its
    /// trailing slash. The error message never repeats the URL.
    pub(crate) fn endpoint(&self) -> Result<Url, String> {
        self.endpoint_at("v1/messages")
    }

    /// `{base_url}/{path}`, keeping any path prefix of `base_url`; `path` has no leading slash.
    /// The error message never repeats the URL.
    pub fn endpoint_at(&self, path: &str) -> Result<Url, String> {
        let mut url = self.base()?;
        let path = format!("{}/{path}", url.path().trim_end_matches('/'));
        url.set_path(&path);
        Ok(url)
    }

    /// `base_url`, checked. The error message never repeats the URL.
    fn base(&self) -> Result<Url, String> {
        let url = Url::parse(&self.base_url).map_err(|e| format!("not a URL ({e})"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!(
                "expected an http:// or https:// URL, found scheme `{}`",
                url.scheme()
            ));
        }
        if url.host().is_none() {
            return Err("expected a host".to_owned());
        }
        // Credentials in a URL end up in logs and proxies; they belong in `auth_token`.
        if !url.username().is_empty() || url.password().is_some() {
            return Err("must not contain credentials; use auth_token".to_owned());
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err("must not have a query or fragment".to_owned());
        }
        Ok(url)
    }

    /// The `Authorization` header value, marked sensitive so that `Debug` of a request hides it.
    /// `None` when no token is configured or it cannot be a header value.
    pub(crate) fn auth_header(&self) -> Option<HeaderValue> {
        let token = self.auth_token.as_ref()?;
        let token = token.expose();
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return None;
        }
        let mut value = HeaderValue::from_str(&format!("Bearer {token}")).ok()?;
        value.set_sensitive(true);
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(base_url: &str) -> HttpProviderConfig {
        HttpProviderConfig::new("sms-main", Channel::Sms, base_url)
    }

    fn invalid_key(c: &HttpProviderConfig) -> Option<String> {
        c.validate("providers.0").err().and_then(|e| e.key())
    }

    #[test]
    fn missing_optional_keys_take_their_defaults() {
        let c: HttpProviderConfig = serde_json::from_value(serde_json::json!({
            "account": "sms-main", "channel": "sms", "base_url": "http://127.0.0.1:9"
        }))
        .unwrap();
        assert_eq!(c.timeout_ms, 10_000);
        assert_eq!(c.connect_timeout_ms, 2_000);
        assert!(!c.honours_idempotency);
        assert!(!c.default_for_channel);
        assert!(c.auth_token.is_none());
        assert_eq!(c.idempotency(), IdempotencySupport::NotHonoured);
        c.validate("p").unwrap();
    }

    #[test]
    fn an_unknown_key_is_rejected() {
        let r: Result<HttpProviderConfig, _> = serde_json::from_value(serde_json::json!({
            "account": "sms-main", "channel": "sms", "base_url": "http://127.0.0.1:9",
            "timeout": 5
        }));
        assert!(r.is_err());
    }

    #[test]
    fn the_endpoint_keeps_a_path_prefix_with_or_without_a_trailing_slash() {
        for (base, want) in [
            ("http://127.0.0.1:9", "http://127.0.0.1:9/v1/messages"),
            ("http://127.0.0.1:9/", "http://127.0.0.1:9/v1/messages"),
            (
                "http://127.0.0.1:9/accounts/sms-main",
                "http://127.0.0.1:9/accounts/sms-main/v1/messages",
            ),
            (
                "http://127.0.0.1:9/accounts/sms-main/",
                "http://127.0.0.1:9/accounts/sms-main/v1/messages",
            ),
            (
                "https://127.0.0.1:9/a//",
                "https://127.0.0.1:9/a/v1/messages",
            ),
        ] {
            assert_eq!(cfg(base).endpoint().unwrap().as_str(), want, "{base}");
        }
    }

    #[test]
    fn each_bad_value_is_reported_under_its_own_key() {
        let mut c = cfg("http://127.0.0.1:9");
        c.account = "SMS Main".into();
        assert_eq!(invalid_key(&c).as_deref(), Some("providers.0.account"));

        for bad in [
            "127.0.0.1:9",
            "ftp://127.0.0.1/",
            "http://user:pw@127.0.0.1/",
            "http://127.0.0.1/?k=v",
            "http://127.0.0.1/#f",
            "not a url",
        ] {
            assert_eq!(
                invalid_key(&cfg(bad)).as_deref(),
                Some("providers.0.base_url"),
                "{bad}"
            );
        }

        let mut c = cfg("http://127.0.0.1:9");
        c.timeout_ms = 0;
        assert_eq!(invalid_key(&c).as_deref(), Some("providers.0.timeout_ms"));

        let mut c = cfg("http://127.0.0.1:9");
        c.connect_timeout_ms = 0;
        assert_eq!(
            invalid_key(&c).as_deref(),
            Some("providers.0.connect_timeout_ms")
        );

        let mut c = cfg("http://127.0.0.1:9");
        c.connect_timeout_ms = c.timeout_ms;
        assert_eq!(
            invalid_key(&c).as_deref(),
            Some("providers.0.connect_timeout_ms")
        );

        let mut c = cfg("http://127.0.0.1:9");
        c.auth_token = Some(Secret::new("has space"));
        assert_eq!(invalid_key(&c).as_deref(), Some("providers.0.auth_token"));
    }

    fn twilio() -> crate::twilio::TwilioKeys {
        crate::twilio::TwilioKeys {
            account_sid: format!("AC{}", "0a".repeat(16)),
            auth_token: Secret::new("twilio-secret"),
            from: Some("+15550100".into()),
            messaging_service_sid: None,
            status_callback_url: Some("https://intake.example/receipts/twilio/sms-twilio".into()),
        }
    }

    fn of_kind(kind: ProviderKind) -> HttpProviderConfig {
        let mut c = cfg("https://api.example");
        c.kind = kind;
        match kind {
            ProviderKind::Generic => {}
            ProviderKind::Twilio => c.twilio = Some(twilio()),
            ProviderKind::Sendgrid => {
                c.sendgrid = Some(crate::sendgrid::SendgridKeys::new(
                    "SG.key",
                    "clinic@example.org",
                ))
            }
            ProviderKind::Fcm => c.fcm = Some(FcmKeys::for_tests()),
            ProviderKind::Apns => c.apns = Some(ApnsKeys::for_tests()),
        }
        c
    }

    #[test]
    fn the_kind_defaults_to_generic_and_each_kind_with_its_table_is_valid() {
        let c: HttpProviderConfig = serde_json::from_value(serde_json::json!({
            "account": "sms-main", "channel": "sms", "base_url": "http://127.0.0.1:9"
        }))
        .unwrap();
        assert_eq!(c.kind, ProviderKind::Generic);
        for kind in ProviderKind::ALL {
            of_kind(kind).validate("providers.0").unwrap();
        }
    }

    #[test]
    fn a_kind_without_its_table_or_with_another_kind_s_table_is_refused_by_the_table_s_key() {
        let mut c = of_kind(ProviderKind::Twilio);
        c.twilio = None;
        assert_eq!(invalid_key(&c).as_deref(), Some("providers.0.twilio"));
        let mut c = of_kind(ProviderKind::Generic);
        c.sendgrid = Some(crate::sendgrid::SendgridKeys::new("k", "a@b"));
        assert_eq!(invalid_key(&c).as_deref(), Some("providers.0.sendgrid"));
        let mut c = of_kind(ProviderKind::Sendgrid);
        c.twilio = Some(twilio());
        assert_eq!(invalid_key(&c).as_deref(), Some("providers.0.twilio"));
    }

    #[test]
    fn a_real_provider_can_never_honour_idempotency_or_take_the_generic_token() {
        for kind in [
            ProviderKind::Twilio,
            ProviderKind::Sendgrid,
            ProviderKind::Fcm,
            ProviderKind::Apns,
        ] {
            let mut c = of_kind(kind);
            assert_eq!(c.idempotency(), IdempotencySupport::NotHonoured);
            c.honours_idempotency = true;
            assert_eq!(
                invalid_key(&c).as_deref(),
                Some("providers.0.honours_idempotency"),
                "{kind}"
            );
            assert_eq!(c.idempotency(), IdempotencySupport::NotHonoured, "{kind}");
            let mut c = of_kind(kind);
            c.auth_token = Some(Secret::new("tok"));
            assert_eq!(
                invalid_key(&c).as_deref(),
                Some("providers.0.auth_token"),
                "{kind}"
            );
        }
        let mut c = of_kind(ProviderKind::Generic);
        c.honours_idempotency = true;
        assert_eq!(c.idempotency(), IdempotencySupport::Honoured);
    }

    #[test]
    fn a_bad_kind_key_is_reported_under_its_table() {
        let mut c = of_kind(ProviderKind::Twilio);
        c.twilio.as_mut().unwrap().account_sid = "AC123".into();
        assert_eq!(
            invalid_key(&c).as_deref(),
            Some("providers.0.twilio.account_sid")
        );
        let mut c = of_kind(ProviderKind::Twilio);
        c.twilio.as_mut().unwrap().messaging_service_sid = Some(format!("MG{}", "1".repeat(32)));
        assert_eq!(invalid_key(&c).as_deref(), Some("providers.0.twilio.from"));
        let mut c = of_kind(ProviderKind::Twilio);
        c.twilio.as_mut().unwrap().auth_token = Secret::new("two words");
        assert_eq!(
            invalid_key(&c).as_deref(),
            Some("providers.0.twilio.auth_token")
        );
        let mut c = of_kind(ProviderKind::Twilio);
        c.twilio.as_mut().unwrap().status_callback_url = Some("https://u:p@intake.example/".into());
        assert_eq!(
            invalid_key(&c).as_deref(),
            Some("providers.0.twilio.status_callback_url")
        );
        let mut c = of_kind(ProviderKind::Sendgrid);
        c.sendgrid.as_mut().unwrap().from_email = "nobody".into();
        assert_eq!(
            invalid_key(&c).as_deref(),
            Some("providers.0.sendgrid.from_email")
        );
        let mut c = of_kind(ProviderKind::Sendgrid);
        c.sendgrid.as_mut().unwrap().api_key = Secret::new("");
        assert_eq!(
            invalid_key(&c).as_deref(),
            Some("providers.0.sendgrid.api_key")
        );
    }

    #[test]
    fn an_unknown_kind_or_an_unknown_key_in_a_kind_s_table_is_rejected() {
        let base = serde_json::json!({
            "account": "sms-main", "channel": "sms", "base_url": "http://127.0.0.1:9"
        });
        let mut v = base.clone();
        v["kind"] = "twillio".into();
        assert!(serde_json::from_value::<HttpProviderConfig>(v).is_err());
        let mut v = base;
        v["kind"] = "twilio".into();
        v["twilio"] = serde_json::json!({"account_sid": "AC", "auth_token": "x", "form": "+1"});
        assert!(serde_json::from_value::<HttpProviderConfig>(v).is_err());
    }

    #[test]
    fn a_kind_s_secrets_never_show_in_debug_or_errors() {
        let mut c = of_kind(ProviderKind::Twilio);
        c.twilio.as_mut().unwrap().auth_token = Secret::new("twilio secret");
        let msg = c.validate("p").unwrap_err().to_string();
        assert!(!msg.contains("twilio secret"), "{msg}");
        assert!(!format!("{c:?}").contains("twilio secret"));
        let mut c = of_kind(ProviderKind::Sendgrid);
        c.sendgrid.as_mut().unwrap().api_key = Secret::new("SG.very-secret");
        assert!(!format!("{c:?}").contains("very-secret"));
    }

    #[test]
    fn a_validation_error_never_repeats_the_url_or_the_token() {
        let c = cfg("http://user:hunter2@127.0.0.1/");
        let msg = c.validate("p").unwrap_err().to_string();
        assert!(!msg.contains("hunter2"), "{msg}");

        let mut c = cfg("http://127.0.0.1/");
        c.auth_token = Some(Secret::new("hunter2 x"));
        let msg = c.validate("p").unwrap_err().to_string();
        assert!(!msg.contains("hunter2"), "{msg}");
        assert!(!format!("{c:?}").contains("hunter2"));
    }
}
