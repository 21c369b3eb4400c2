//! Typed configuration for every nudge binary.
//!
//! Owns: the shared config sections, the [`Secret`] wrapper, and the one loading order
//! ([`load`]): defaults, then a TOML file (`--config`, else `NUDGE_CONFIG`), then `NUDGE_`
//! environment variables with `__` for nesting, then validation whose error names the bad key.
//! Each binary defines its own struct in its own crate from these sections, with
//! `#[serde(deny_unknown_fields)]`, and implements [`Validate`] for it.
//!
//! Must never: print a secret (not in `Debug`, not in an error message), read configuration from
//! anywhere else (no implicit file lookup, no other environment variables), or open connections;
//! it only describes and checks settings.
//!
//! # Keys
//!
//! Environment form: `NUDGE_` + key in upper case with `.` replaced by `__`, e.g.
//! `database.url` is `NUDGE_DATABASE__URL`. A binary reads only the sections it has. A key of
//! an entry of a list of tables takes the entry's index: `providers.0.auth_token` (the first
//! `[[providers]]` of the file) is `NUDGE_PROVIDERS__0__AUTH_TOKEN`; the environment cannot add
//! an entry.
//!
//! | key | default | rule |
//! |-----|---------|------|
//! | `database.url` (secret) | `"postgres://postgres@127.0.0.1:5432/nudge"` | `postgres://` or `postgresql://` URL |
//! | `database.max_connections` | `10` | 1..=1000 |
//! | `database.acquire_timeout_ms` | `5000` | > 0 |
//! | `amqp.url` (secret) | `"amqp://guest:guest@127.0.0.1:5672/%2f"` | `amqp://` or `amqps://` URL; used when `amqp.urls` is empty |
//! | `amqp.urls` (secrets) | `[]` | up to 16 `amqp://` or `amqps://` URLs, the nodes of a cluster: when not empty they replace `amqp.url`; connect to the first that answers, fail over to the next in turn; environment form `NUDGE_AMQP__URLS='["amqp://…","amqp://…"]'` |
//! | `amqp.prefetch` | `96` | >= 1 |
//! | `amqp.connect_timeout_ms` | `10000` | > 0 |
//! | `amqp.namespace` | `""` | empty, or `[a-z0-9-]{1,40}` then `.`: prefix of exchange and queue names |
//! | `amqp.delivery_limit` | `5` | >= 1: redeliveries before the broker dead-letters a message |
//! | `telemetry.log_format` | `"pretty"` | `"json"` or `"pretty"` |
//! | `telemetry.log_filter` | `"info"` | non-empty tracing filter; `RUST_LOG` overrides it |
//! | `telemetry.otlp_endpoint` | unset (no export) | `http://` or `https://` URL |
//! | `telemetry.metrics_addr` | unset (no listener) | socket address, e.g. `"0.0.0.0:9464"` |
//! | `crypto.destination_key` (secret) | unset | standard base64 of exactly 32 bytes |
//! | `crypto.subscriber_key` (secret) | unset | standard base64 of exactly 32 bytes; writers only |
//! | `crypto.tenant_secret_key` (secret) | unset | standard base64 of exactly 32 bytes; the intake, `nudge-events` and `nudgectl` only |
//! | `retry.base_delay_ms` | `1000` | >= 1 |
//! | `retry.max_delay_ms` | `300000` | >= `retry.base_delay_ms` |
//! | `retry.max_attempts` | `8` | >= 1 |
//! | `retry.max_retry_after_s` | `3600` | > 0 |
//! | `retention.*` | see [`RetentionConfig`] | boundaries in days, at or above their safety floors |
//!
//! `NUDGE_CONFIG` is the file path, never a key. Any other `NUDGE_` variable that is not a key
//! of a known section (`NUDGE_<SECTION>__<KEY>`) stops the binary naming it, unless it is one
//! of the variables read elsewhere ([`NOT_CONFIG_VARIABLES`], [`NOT_CONFIG_PREFIXES`]).
//!
//! # Example
//!
//! ```no_run
//! use nudge_config::{ConfigError, DatabaseConfig, TelemetryConfig, Validate};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Default, Serialize, Deserialize)]
//! #[serde(deny_unknown_fields, default)]
//! struct JanitorConfig {
//!     database: DatabaseConfig,
//!     telemetry: TelemetryConfig,
//! }
//!
//! impl Validate for JanitorConfig {
//!     fn validate(&self) -> Result<(), ConfigError> {
//!         self.database.validate()?;
//!         self.telemetry.validate()
//!     }
//! }
//!
//! # fn main() -> Result<(), ConfigError> {
//! let config: JanitorConfig = nudge_config::load(None, &["database", "telemetry"])?;
//! # let _ = config;
//! # Ok(())
//! # }
//! ```

mod error;
mod load;
mod retention;
mod secret;
mod sections;

pub use error::ConfigError;
pub use load::{
    CONFIG_FILE_ENV, ENV_NESTING, ENV_PREFIX, KNOWN_SECTIONS, NOT_CONFIG_PREFIXES,
    NOT_CONFIG_VARIABLES, Validate, load,
};
pub use retention::RetentionConfig;
pub use secret::Secret;
pub use sections::{
    AmqpConfig, CryptoConfig, DatabaseConfig, LogFormat, RetryConfig, TelemetryConfig,
};
