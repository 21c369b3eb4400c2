//! Configuration of a channel worker (`nudge-push`, `nudge-email`, `nudge-sms`).
//!
//! Keys, beyond the shared sections documented in `nudge-config` (`database.*`, `amqp.*`,
//! `telemetry.*`, `crypto.destination_key`, required here; when `telemetry.metrics_addr` is set
//! the worker serves Prometheus `GET /metrics` there, see `WorkerMetrics`):
//! - `worker.lease_seconds` (default 60): how long a leased delivery is held before the
//!   janitor's reaper may settle it. It must outlive a send and its wait: for every provider
//!   account, `lease_seconds * 1000 >= timeout_ms + admission.max_wait_ms +`
//!   [`LEASE_MARGIN_MS`] (the ledger round trips around the send); checked at start-up.
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
//! - `admission.max_pause_s` is also how long an account whose credentials a provider refused
//!   is suspended (its bucket paused, its rate kept) before one send probes again.
//! - `admission.send_margin_ms` (default 1000, 100..=60000): no request starts unless it can be
//!   answered (its `timeout_ms`) this long before its lease ends, nor within this long of the
//!   delivery's expiry; a send still waiting inside its adapter then (e.g. for an access token)
//!   is given up, never started, and recorded as failed before send (retried by the retry
//!   policy, never ambiguous). The lease must cover `timeout_ms + admission.max_wait_ms` and
//!   the larger of this and [`LEASE_MARGIN_MS`].
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
        self.check_lease_outlives_a_send()
    }
}

/// What a lease must hold beyond a provider's timeout and the admission wait: the ledger's
/// round trips between the lease and the request, and the record after the answer.
pub const LEASE_MARGIN_MS: u64 = 1_000;

impl WorkerConfig {
    /// A lease shorter than a send lets the reaper settle a delivery whose request is still
    /// in flight, and a second worker send it again.
    fn check_lease_outlives_a_send(&self) -> Result<(), ConfigError> {
        let lease_ms = self.worker.lease_seconds.saturating_mul(1000);
        let margin_ms = LEASE_MARGIN_MS.max(self.admission.send_margin_ms);
        for provider in &self.providers {
            let needed_ms = provider
                .timeout_ms
                .saturating_add(self.admission.max_wait_ms)
                .saturating_add(margin_ms);
            if lease_ms < needed_ms {
                return Err(ConfigError::invalid(
                    "worker.lease_seconds",
                    format!(
                        "must cover a send and its wait: provider account {} needs at least \
                         {} s (its timeout_ms {} + admission.max_wait_ms {} + {} ms margin), \
                         got {} s",
                        provider.account,
                        needed_ms.div_ceil(1000),
                        provider.timeout_ms,
                        self.admission.max_wait_ms,
                        margin_ms,
                        self.worker.lease_seconds
                    ),
                ));
            }
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
    /// The sender whose deliveries this worker leases (`deliveries.owner`).
    pub owner: String,
}

impl Default for WorkerSection {
    fn default() -> Self {
        Self {
            lease_seconds: 60,
            shutdown_grace_ms: 20_000,
            batch_size: 64,
            owner: nudge_ledger::DEFAULT_SENDER.to_owned(),
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

    fn with_account(timeout_ms: u64, lease_seconds: u64) -> WorkerConfig {
        let mut config = WorkerConfig::default();
        let mut account = HttpProviderConfig::new("sms-main", Channel::Sms, "http://127.0.0.1:1");
        account.timeout_ms = timeout_ms;
        account.connect_timeout_ms = 1_000;
        account.default_for_channel = true;
        config.providers.push(account);
        config.worker.lease_seconds = lease_seconds;
        config
    }

    fn invalid_key(config: &WorkerConfig) -> Option<String> {
        config
            .validate_for(Channel::Sms)
            .err()
            .and_then(|e| e.key())
    }

    #[test]
    fn a_lease_shorter_than_a_send_and_its_wait_is_refused_naming_the_key() {
        // 10 s timeout + 1.5 s wait + 1 s margin: 12.5 s.
        let config = with_account(10_000, 12);
        let error = config.validate().unwrap_err();
        assert_eq!(error.key().as_deref(), Some("worker.lease_seconds"));
        let message = error.to_string();
        assert!(
            message.contains("sms-main needs at least 13 s"),
            "{message}"
        );
        assert!(message.contains("got 12 s"), "{message}");
    }

    #[test]
    fn a_lease_that_outlives_the_slowest_send_and_its_wait_is_accepted() {
        let mut config = with_account(10_000, 13);
        config.crypto.destination_key = Some(nudge_config::Secret::new(
            "BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwc=",
        ));
        assert_eq!(invalid_key(&config), None);
        config.admission.max_wait_ms = 2_100;
        assert_eq!(
            invalid_key(&config).as_deref(),
            Some("worker.lease_seconds")
        );
    }
}
