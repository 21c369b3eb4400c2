//! Configuration of a channel worker (`nudge-push`, `nudge-email`, `nudge-sms`).
//!
//! Keys, beyond the shared sections documented in `nudge-config` (`database.*`, `amqp.*`,
//! `telemetry.*`, `crypto.destination_key`, required here; when `telemetry.metrics_addr` is set
//! the worker serves Prometheus `GET /metrics` there, see `WorkerMetrics`):
//! - `worker.lease_seconds` (default 60): how long a leased delivery is held before the
//!   janitor's reaper may settle it; must exceed the longest provider timeout.
//! - `worker.shutdown_grace_ms` (default 20000): how long in-flight sends may finish after
//!   SIGTERM before the worker exits (their leases then expire and are reaped).
//! - `worker.batch_size` (default 64, 1..=1000): the most messages leased in one transaction;
//!   messages that arrived together are leased together, a lone one is not held back.
//! - `retry.base_delay_ms` (1000), `retry.max_delay_ms` (300000), `retry.max_attempts` (8),
//!   `retry.max_retry_after_s` (3600): the retry policy (see `nudge_domain::RetryPolicy`).
//! - `admission.max_wait_ms` (default 1500): how long a worker may wait for its reserved send
//!   slot; a delivery whose slot is further away goes back to the ledger, due at that time.
//! - `admission.closed_recheck_ms` (default 10000): when a bucket is closed (rate 0), how long
//!   its deliveries wait before they are looked at again.
//! - `admission.max_pause_s` (default 60, 1..=3600): the longest one provider answer (a 429's
//!   `Retry-After`) may pause a whole bucket; the delivery that got the answer still follows
//!   `retry.max_retry_after_s`.
//! - `providers`: a list (`[[providers]]` in TOML) of provider accounts, each
//!   `account`, `channel`, `base_url`, `auth_token`, `timeout_ms`, `connect_timeout_ms`,
//!   `honours_idempotency`, `default_for_channel`, `rate_per_second`, `burst` (see
//!   `nudge_provider::HttpProviderConfig`). A worker uses the accounts of its channel;
//!   exactly one of them must be the default (used for tenants without their own routing).

use std::time::Duration;

use nudge_config::{
    AmqpConfig, ConfigError, CryptoConfig, DatabaseConfig, RetryConfig, TelemetryConfig, Validate,
};
use nudge_domain::{Channel, RetryPolicy};
use nudge_provider::HttpProviderConfig;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    pub database: DatabaseConfig,
    pub amqp: AmqpConfig,
    pub telemetry: TelemetryConfig,
    pub crypto: CryptoConfig,
    pub worker: WorkerSection,
    pub retry: RetryConfig,
    pub admission: AdmissionSection,
    pub providers: Vec<HttpProviderConfig>,
}

impl WorkerConfig {
    pub const SECTIONS: &'static [&'static str] = &[
        "database",
        "amqp",
        "telemetry",
        "crypto",
        "worker",
        "retry",
        "admission",
        "providers",
    ];

    /// Checks everything a worker for `channel` needs, naming the bad key.
    pub fn validate_for(&self, channel: Channel) -> Result<(), ConfigError> {
        self.validate()?;
        if self.crypto.destination_key.is_none() {
            return Err(ConfigError::invalid(
                "crypto.destination_key",
                "required: the worker decrypts destinations",
            ));
        }
        let defaults = self
            .providers
            .iter()
            .filter(|p| p.channel == channel && p.default_for_channel)
            .count();
        if defaults != 1 {
            return Err(ConfigError::invalid(
                "providers",
                format!(
                    "exactly one provider account for channel {channel} must have \
                     default_for_channel = true (found {defaults})"
                ),
            ));
        }
        Ok(())
    }

    pub fn retry_policy(&self) -> Result<RetryPolicy, ConfigError> {
        self.retry.policy()
    }
}

impl Validate for WorkerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.database.validate()?;
        self.amqp.validate()?;
        self.telemetry.validate()?;
        self.crypto.validate()?;
        self.worker.validate_at("worker")?;
        self.retry_policy()?;
        self.admission.validate_at("admission")?;
        for (i, provider) in self.providers.iter().enumerate() {
            provider.validate(&format!("providers[{i}]"))?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSection {
    pub lease_seconds: u64,
    pub shutdown_grace_ms: u64,
    pub batch_size: usize,
}

impl Default for WorkerSection {
    fn default() -> Self {
        Self {
            lease_seconds: 60,
            shutdown_grace_ms: 20_000,
            batch_size: 64,
        }
    }
}

impl WorkerSection {
    fn validate_at(&self, prefix: &str) -> Result<(), ConfigError> {
        if !(5..=3600).contains(&self.lease_seconds) {
            return Err(ConfigError::invalid(
                format!("{prefix}.lease_seconds"),
                "must be between 5 and 3600",
            ));
        }
        if !(1..=1000).contains(&self.batch_size) {
            return Err(ConfigError::invalid(
                format!("{prefix}.batch_size"),
                "must be between 1 and 1000",
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionSection {
    pub max_wait_ms: u64,
    pub closed_recheck_ms: u64,
    pub max_pause_s: u64,
}

impl Default for AdmissionSection {
    fn default() -> Self {
        Self {
            max_wait_ms: 1_500,
            closed_recheck_ms: 10_000,
            max_pause_s: 60,
        }
    }
}

impl AdmissionSection {
    fn validate_at(&self, prefix: &str) -> Result<(), ConfigError> {
        if self.max_wait_ms > 10_000 {
            return Err(ConfigError::invalid(
                format!("{prefix}.max_wait_ms"),
                "must be at most 10000: a worker must not sit on capacity",
            ));
        }
        if !(100..=600_000).contains(&self.closed_recheck_ms) {
            return Err(ConfigError::invalid(
                format!("{prefix}.closed_recheck_ms"),
                "must be between 100 and 600000",
            ));
        }
        if !(1..=3600).contains(&self.max_pause_s) {
            return Err(ConfigError::invalid(
                format!("{prefix}.max_pause_s"),
                "must be between 1 and 3600: no provider answer may stop an account for longer",
            ));
        }
        Ok(())
    }

    pub fn settings(&self) -> nudge_domain::AdmissionSettings {
        nudge_domain::AdmissionSettings {
            max_wait: Duration::from_millis(self.max_wait_ms),
            closed_recheck: Duration::from_millis(self.closed_recheck_ms),
            max_pause: Duration::from_secs(self.max_pause_s),
            ..nudge_domain::AdmissionSettings::default()
        }
    }
}
