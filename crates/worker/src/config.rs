//! Configuration of a channel worker (`nudge-push`, `nudge-email`, `nudge-sms`).
//!
//! Keys, beyond the shared sections documented in `nudge-config` (`database.*`, `amqp.*`,
//! `telemetry.*`, `crypto.destination_key`, required here; when `telemetry.metrics_addr` is set
//! the worker serves Prometheus `GET /metrics` there, see `WorkerMetrics`):
//! - `worker.lease_seconds` (default 5, 2..=3600): how long a lease outlives its holder's last
//!   heartbeat. A live worker renews all of its leases every `worker.heartbeat_ms`, for as long
//!   as it holds them (a slow send, an outcome held while the ledger is away), so this bounds
//!   how long a dead worker's deliveries wait for the reaper, not how long a send may take.
//! - `worker.heartbeat_ms` (default 1000, 100..=60000): how often the leases are renewed; at
//!   least three heartbeats must fit in a lease, so one or two late or lost ones cost nothing.
//! - `worker.shutdown_grace_ms` (default 20000): how long in-flight sends may finish after
//!   SIGTERM before the worker exits (their leases then expire and are reaped).
//! - `worker.batch_size` (default 64, 1..=1000): the most messages leased in one transaction;
//!   messages that arrived together are leased together, a lone one is not held back.
//! - `worker.account_recheck_ms` (default 30000, 1000..=3600000): a delivery whose tenant is
//!   routed to a provider account that no live worker has (none announced it in
//!   `worker_accounts`) is given back as `retry_wait` (reason `account_unavailable`, no
//!   attempt spent) and looked at again after this long; never sent through another account
//!   (docs/decisions/0411-a-tenants-own-account-fails-closed.md). Each look is one claim,
//!   publish and lease of the delivery: longer means less work while it waits, shorter means
//!   sooner out once a worker has the account.
//! - `retry.base_delay_ms` (1000), `retry.max_delay_ms` (300000), `retry.max_attempts` (8),
//!   `retry.max_retry_after_s` (3600): the retry policy (see `nudge_domain::RetryPolicy`).
//! - `admission.max_wait_ms` (default 1500): how long a worker may wait for its reserved send
//!   slot; a delivery whose slot is further away goes back to the ledger, due at that time.
//! - `admission.closed_recheck_ms` (default 10000): when a bucket is closed (rate 0), how long
//!   its deliveries wait before they are looked at again.
//! - `admission.max_pause_s` (default 60, 1..=3600): the longest one provider answer (a 429's
//!   `Retry-After`) may pause a whole bucket; the delivery that got the answer still follows
//!   `retry.max_retry_after_s`.
//! - `admission.max_pause_s` is also how long an account whose credentials a provider refused
//!   is suspended (its bucket paused, its rate kept) before one send probes again.
//! - `admission.send_margin_ms` (default 1000, 100..=60000): no request starts within this
//!   long of its lease's current end (renewed by the heartbeat) or of the delivery's expiry; a
//!   send still waiting inside its adapter then (e.g. for an access token) is given up, never
//!   started, and recorded as failed before send (retried by the retry policy, never ambiguous).
//! - `providers`: a list (`[[providers]]` in TOML) of provider accounts, each
//!   `kind` (`generic`, `twilio`, `sendgrid`, `fcm`, `apns`), `account`, `channel`, `base_url`,
//!   `auth_token`, `timeout_ms`, `connect_timeout_ms`, `honours_idempotency`,
//!   `default_for_channel`, `rate_per_second`, `burst`, and the kind's own table
//!   (`[providers.twilio]`, ...; see `nudge_provider::HttpProviderConfig`). A worker uses the
//!   accounts of its channel; exactly one of them must be the default (used for tenants
//!   without their own routing).

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

impl nudge_runtime::ServiceConfig for WorkerConfig {
    const SECTIONS: &'static [&'static str] = Self::SECTIONS;

    fn database(&self) -> &DatabaseConfig {
        &self.database
    }

    fn telemetry(&self) -> &TelemetryConfig {
        &self.telemetry
    }

    fn amqp(&self) -> Option<&AmqpConfig> {
        Some(&self.amqp)
    }

    fn sender(&self) -> Option<&str> {
        Some(&self.worker.owner)
    }
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
    pub heartbeat_ms: u64,
    pub shutdown_grace_ms: u64,
    pub batch_size: usize,
    /// The sender whose deliveries this worker leases (`deliveries.owner`).
    pub owner: String,
    /// How long a delivery routed to a provider account no live worker has waits before it
    /// is looked at again.
    pub account_recheck_ms: u64,
}

impl Default for WorkerSection {
    fn default() -> Self {
        Self {
            lease_seconds: 5,
            heartbeat_ms: 1_000,
            shutdown_grace_ms: 20_000,
            batch_size: 64,
            owner: nudge_ledger::DEFAULT_SENDER.to_owned(),
            account_recheck_ms: 30_000,
        }
    }
}

impl WorkerSection {
    fn validate_at(&self, prefix: &str) -> Result<(), ConfigError> {
        if !(2..=3600).contains(&self.lease_seconds) {
            return Err(ConfigError::invalid(
                format!("{prefix}.lease_seconds"),
                "must be between 2 and 3600",
            ));
        }
        if !(100..=60_000).contains(&self.heartbeat_ms) {
            return Err(ConfigError::invalid(
                format!("{prefix}.heartbeat_ms"),
                "must be between 100 and 60000",
            ));
        }
        if self.heartbeat_ms.saturating_mul(3) > self.lease_seconds.saturating_mul(1000) {
            return Err(ConfigError::invalid(
                format!("{prefix}.heartbeat_ms"),
                format!(
                    "must fit three times in {prefix}.lease_seconds ({} s): a lease renewed \
                     less often lapses after one late heartbeat",
                    self.lease_seconds
                ),
            ));
        }
        if !nudge_ledger::is_owner_name(&self.owner) {
            return Err(ConfigError::invalid(
                format!("{prefix}.owner"),
                "must be 1 to 64 of [a-z0-9_-], starting with a letter or digit",
            ));
        }
        if !(1..=1000).contains(&self.batch_size) {
            return Err(ConfigError::invalid(
                format!("{prefix}.batch_size"),
                "must be between 1 and 1000",
            ));
        }
        if !(1_000..=3_600_000).contains(&self.account_recheck_ms) {
            return Err(ConfigError::invalid(
                format!("{prefix}.account_recheck_ms"),
                "must be between 1000 and 3600000",
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
    pub send_margin_ms: u64,
}

impl Default for AdmissionSection {
    fn default() -> Self {
        Self {
            max_wait_ms: 1_500,
            closed_recheck_ms: 10_000,
            max_pause_s: 60,
            send_margin_ms: 1_000,
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
        if !(100..=60_000).contains(&self.send_margin_ms) {
            return Err(ConfigError::invalid(
                format!("{prefix}.send_margin_ms"),
                "must be between 100 and 60000",
            ));
        }
        Ok(())
    }

    pub fn settings(&self) -> nudge_domain::AdmissionSettings {
        nudge_domain::AdmissionSettings {
            max_wait: Duration::from_millis(self.max_wait_ms),
            closed_recheck: Duration::from_millis(self.closed_recheck_ms),
            max_pause: Duration::from_secs(self.max_pause_s),
            send_margin: Duration::from_millis(self.send_margin_ms),
            ..nudge_domain::AdmissionSettings::default()
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn with_heartbeat(lease_seconds: u64, heartbeat_ms: u64) -> WorkerConfig {
        let mut config = WorkerConfig::default();
        let mut account = HttpProviderConfig::new("sms-main", Channel::Sms, "http://127.0.0.1:1");
        // A provider slower than the lease is fine: the heartbeat renews it while it runs.
        account.timeout_ms = 30_000;
        account.connect_timeout_ms = 1_000;
        account.default_for_channel = true;
        config.providers.push(account);
        config.crypto.destination_key = Some(nudge_config::Secret::new(
            "BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwc=",
        ));
        config.worker.lease_seconds = lease_seconds;
        config.worker.heartbeat_ms = heartbeat_ms;
        config
    }

    fn invalid_key(config: &WorkerConfig) -> Option<String> {
        config
            .validate_for(Channel::Sms)
            .err()
            .and_then(|e| e.key())
    }

    #[test]
    fn a_heartbeat_that_does_not_fit_three_times_in_a_lease_is_refused_naming_the_key() {
        let config = with_heartbeat(5, 2_000);
        let error = config.validate().unwrap_err();
        assert_eq!(error.key().as_deref(), Some("worker.heartbeat_ms"));
        assert!(error.to_string().contains("three times"), "{error}");
    }

    #[test]
    fn a_short_lease_renewed_often_enough_is_accepted_whatever_the_provider_timeout() {
        assert_eq!(invalid_key(&with_heartbeat(5, 1_000)), None);
        assert_eq!(
            invalid_key(&WorkerConfig {
                crypto: with_heartbeat(5, 1_000).crypto,
                providers: with_heartbeat(5, 1_000).providers,
                ..WorkerConfig::default()
            }),
            None
        );
        assert_eq!(
            invalid_key(&with_heartbeat(1, 300)).as_deref(),
            Some("worker.lease_seconds")
        );
    }
}
