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
