//! `nudgectl` configuration.
//!
//! Keys (see `nudge-config` for each key's default and rule):
//! - `database.url`, `database.max_connections`, `database.acquire_timeout_ms`
//! - `telemetry.log_format`, `telemetry.log_filter` (default here: `warn`, so operator output
//!   is not mixed with logs), `telemetry.otlp_endpoint`, `telemetry.metrics_addr`

use nudge_config::{ConfigError, DatabaseConfig, TelemetryConfig, Validate};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CtlConfig {
    pub database: DatabaseConfig,
    pub telemetry: TelemetryConfig,
}

impl CtlConfig {
    pub const SECTIONS: &'static [&'static str] = &["database", "telemetry"];
}

impl Default for CtlConfig {
    fn default() -> Self {
        Self {
            database: DatabaseConfig::default(),
            telemetry: TelemetryConfig {
                log_filter: "warn".to_owned(),
                ..TelemetryConfig::default()
            },
        }
    }
}

impl Validate for CtlConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.database.validate()?;
        self.telemetry.validate()
    }
}
