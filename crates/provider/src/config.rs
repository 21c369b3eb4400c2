//! The settings of one HTTP provider account.
//!
//! # Keys
//!
//! Relative to where the binary puts the section (e.g. `providers.0`):
//!
//! | key | default | rule |
//! |-----|---------|------|
//! | `account` | required | a provider account name (lowercase letters, digits, `_`, `-`) |
//! | `channel` | required | `push`, `email` or `sms` |
//! | `base_url` | required | `http://` or `https://` URL without credentials, query or fragment; `/v1/messages` is appended to its path |
//! | `auth_token` (secret) | unset (no `Authorization`) | sent as `Authorization: Bearer <token>`; visible ASCII |
//! | `timeout_ms` | `10000` | > 0; the whole request, from connect to the last byte of the answer |
//! | `connect_timeout_ms` | `2000` | > 0 and below `timeout_ms` |
//! | `honours_idempotency` | `false` | whether the provider dedups by `Idempotency-Key` |
//! | `default_for_channel` | `false` | the account a worker uses for its channel when none is chosen |
//! | `rate_per_second` | unset (not limited) | the account's starting admission rate, >= 0; creates its shared rate bucket if none exists (a bucket changed at run time with `nudgectl rate set` keeps its rate) |
//! | `burst` | `max(1, ceil(rate_per_second))` | how many sends may go back to back, >= 1 |

use nudge_config::{ConfigError, Secret};
use nudge_domain::{Channel, IdempotencySupport, ProviderAccount};
use reqwest::header::HeaderValue;
use serde::{Deserialize, Serialize};
use url::Url;

/// One provider account reached over HTTP. See the module docs for the keys and their rules.
#[derive(Deserialize, Serialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub struct HttpProviderConfig {
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
        }
    }

    /// Checks every rule; the error names the first bad key as `{key_prefix}.{field}` and never
    /// contains the configured value (the URL could carry credentials, the token is secret).
    pub fn validate(&self, key_prefix: &str) -> Result<(), ConfigError> {
        self.parsed_account()
            .map_err(|e| ConfigError::invalid(key(key_prefix, "account"), e.to_string()))?;
        self.endpoint()
            .map_err(|m| ConfigError::invalid(key(key_prefix, "base_url"), m))?;
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

    /// The starting burst: as configured, else one second's worth of the rate (at least 1).
    pub fn starting_burst(&self) -> u32 {
        self.burst.unwrap_or_else(|| {
            // Saturating float-to-int: provider rates are far below u32::MAX.
            (self.rate_per_second.unwrap_or(1.0).ceil() as u32).max(1)
        })
    }

    /// Whether a resend after an unknown outcome is safe with this account.
    pub fn idempotency(&self) -> IdempotencySupport {
        self.honours_idempotency.into()
    }

    pub(crate) fn parsed_account(&self) -> Result<ProviderAccount, nudge_domain::IdError> {
        ProviderAccount::parse(&self.account)
    }

    /// `{base_url}/v1/messages`, keeping any path prefix of `base_url`, with or without its
    /// trailing slash. The error message never repeats the URL.
    pub(crate) fn endpoint(&self) -> Result<Url, String> {
        let mut url = Url::parse(&self.base_url).map_err(|e| format!("not a URL ({e})"))?;
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
        let path = format!("{}/v1/messages", url.path().trim_end_matches('/'));
        url.set_path(&path);
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
