//! `nudgectl` configuration.
//!
//! Keys (see `nudge-config` for each key's default and rule):
//! - `database.url`, `database.acquire_timeout_ms` (`database.max_connections` is read but
//!   not used: `nudgectl` opens `CHUNKS_IN_FLIGHT` + 2 connections, 8 today, what
//!   `reminders load` writes with)
//! - `telemetry.log_format`, `telemetry.log_filter` (default here: `warn`, so operator output
//!   is not mixed with logs), `telemetry.otlp_endpoint`, `telemetry.metrics_addr`
//! - `crypto.destination_key` (secret): the key the workers decrypt destinations and content
//!   with. Only `reminders load` needs it, and fails naming the key when it is unset; when it
//!   is set but malformed, every command fails at start-up like any other bad value.
//! - `crypto.subscriber_key` (secret, unset by default): the key of the keyed hash subscriber
//!   references are stored as. `reminders load` needs it; `migrate` uses it (with the
//!   destination key) to convert rows written before.
//! - `crypto.tenant_secret_key` (secret, unset by default): the key tenants' signing
//!   secrets are sealed with (`tenant secret rotate`); `migrate` uses it (with the
//!   destination key) to seal again the secrets written before it. Unset: secrets are sealed
//!   with the destination key, as before.
//! - `retention.*`: the retention policy `retention plan` counts by (the janitor's; see
//!   `nudge_config::RetentionConfig`). The janitor-only keys (pace, export) are read and
//!   checked but unused here.

use nudge_config::{
    ConfigError, CryptoConfig, DatabaseConfig, RetentionConfig, TelemetryConfig, Validate,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CtlConfig {
    pub database: DatabaseConfig,
    pub telemetry: TelemetryConfig,
    pub crypto: CryptoConfig,
    pub retention: RetentionConfig,
}

impl CtlConfig {
    pub const SECTIONS: &'static [&'static str] = &["database", "telemetry", "crypto", "retention"];
}

impl Default for CtlConfig {
    fn default() -> Self {
        Self {
            database: DatabaseConfig::default(),
            telemetry: TelemetryConfig {
                log_filter: "warn".to_owned(),
                ..TelemetryConfig::default()
            },
            crypto: CryptoConfig::default(),
            retention: RetentionConfig::default(),
        }
    }
}

impl Validate for CtlConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.database.validate()?;
        self.telemetry.validate()?;
        self.retention.validate()?;
        self.crypto.validate()
    }
}
