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
//! - `nudgectl.require_synchronous_standby` (default `false`): when set, `status` warns unless
//!   the server it reaches reports a synchronous standby (`synchronous_standby_names` set, a
//!   standby `sync` or `quorum` in `pg_stat_replication`, `synchronous_commit` waiting for it).
//!   Set it wherever the ledger runs with a replica that can be promoted; leave it off for a
//!   single server.

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
    pub nudgectl: CtlSection,
}

/// `[nudgectl]`: what the operator's checks expect of the deployment.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CtlSection {
    /// `status` warns when the server reports no synchronous standby.
    pub require_synchronous_standby: bool,
}

impl CtlConfig {
    pub const SECTIONS: &'static [&'static str] =
        &["database", "telemetry", "crypto", "retention", "nudgectl"];
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
            nudgectl: CtlSection::default(),
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
