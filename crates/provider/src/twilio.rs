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
//! | `status_callback_url` | unset (no receipts) | `http(s)://` URL of the intake's Twilio receipts endpoint (`.../v1/receipts/twilio/{account}`); each message's `StatusCallback` is this URL with `?key=<delivery key>` added |

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
