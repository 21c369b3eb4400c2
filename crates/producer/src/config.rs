//! Configuration of `nudge-producer`.
//!
//! Keys, beyond the shared `database.*`, `amqp.*` and `telemetry.*` (see `nudge-config`):
//! - `producer.relay_interval_ms` (default 200): how often the relay looks for due work when
//!   the last look found none (a full batch is followed at once by the next).
//! - `producer.batch_size` (default 500, 1..=10000): deliveries claimed and published per batch.
//! - `producer.republish_after_s` (default 5, at least 5): a `queued` delivery not leased
//!   within this long may have lost its message (broker restart, relay crash; a worker holds
//!   its messages while the ledger is away rather than dropping them); it is published again when
//!   its channel's work queue holds fewer messages than the channel has `queued` deliveries,
//!   and at most that many, so a queue nobody consumes does not grow.
//! - `producer.publish_timeout_ms` (default 5000, 100..=120000): how long one batch's publish
//!   (opening a channel, sending, and every publisher confirm) may take before the batch is
//!   handed back to the ledger for a later pass. RabbitMQ blocks publishers without an error
//!   during a memory or disk alarm; this keeps the relay going instead of stalling.
//! - `producer.schedule_interval_ms` (default 1000): how often schedules are re-read and
//!   their windows advanced.
//! - `producer.in_flight_seconds` (default 1.0): per channel, the relay keeps about this many
//!   seconds of the channel's admitted rate (the sum of its rate buckets) published or being
//!   sent, so every message finds a send slot within the workers' admission wait (keep it below
//!   `admission.max_wait_ms`: a claim's surplus goes back and loses its tenant's turn).
//! - `producer.min_in_flight_per_channel` (default 20) and `producer.max_in_flight_per_channel`
//!   (default 2000): bounds of that window; a channel without rate buckets gets the maximum.

use nudge_config::{AmqpConfig, ConfigError, DatabaseConfig, TelemetryConfig, Validate};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProducerConfig {
    pub database: DatabaseConfig,
    pub amqp: AmqpConfig,
    pub telemetry: TelemetryConfig,
    pub producer: ProducerSection,
}

impl ProducerConfig {
    pub const SECTIONS: &'static [&'static str] = &["database", "amqp", "telemetry", "producer"];
}

impl nudge_runtime::ServiceConfig for ProducerConfig {
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
        Some(&self.producer.owner)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProducerSection {
    pub relay_interval_ms: u64,
    pub batch_size: u32,
    pub republish_after_s: u64,
    pub publish_timeout_ms: u64,
    pub schedule_interval_ms: u64,
    pub in_flight_seconds: f64,
    pub min_in_flight_per_channel: u32,
    pub max_in_flight_per_channel: u32,
    /// The sender whose deliveries the relay publishes (`deliveries.owner`); work handed to
    /// another sender with `nudgectl owner set` is left to it.
    pub owner: String,
}

impl Default for ProducerSection {
    fn default() -> Self {
        Self {
            relay_interval_ms: 200,
            batch_size: 500,
            republish_after_s: 5,
            publish_timeout_ms: 5_000,
            schedule_interval_ms: 1_000,
            in_flight_seconds: 1.0,
            min_in_flight_per_channel: 20,
            max_in_flight_per_channel: 2_000,
            owner: nudge_ledger::DEFAULT_SENDER.to_owned(),
        }
    }
}

impl Validate for ProducerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.database.validate()?;
        self.amqp.validate()?;
        self.telemetry.validate()?;
        let p = &self.producer;
        if !(10..=60_000).contains(&p.relay_interval_ms) {
            return Err(ConfigError::invalid(
                "producer.relay_interval_ms",
                "must be between 10 and 60000",
            ));
        }
        if !(1..=10_000).contains(&p.batch_size) {
            return Err(ConfigError::invalid(
                "producer.batch_size",
                "must be between 1 and 10000",
            ));
        }
        if p.republish_after_s < 5 {
            return Err(ConfigError::invalid(
                "producer.republish_after_s",
                "must be at least 5 (shorter only republishes messages that are merely slow)",
            ));
        }
        if !(100..=120_000).contains(&p.publish_timeout_ms) {
            return Err(ConfigError::invalid(
                "producer.publish_timeout_ms",
                "must be between 100 and 120000",
            ));
        }
        if !(p.in_flight_seconds.is_finite() && (0.1..=60.0).contains(&p.in_flight_seconds)) {
            return Err(ConfigError::invalid(
                "producer.in_flight_seconds",
                "must be between 0.1 and 60",
            ));
        }
        if p.min_in_flight_per_channel == 0
            || p.min_in_flight_per_channel > p.max_in_flight_per_channel
        {
            return Err(ConfigError::invalid(
                "producer.min_in_flight_per_channel",
                "must be at least 1 and at most producer.max_in_flight_per_channel",
            ));
        }
        if !nudge_ledger::is_owner_name(&p.owner) {
            return Err(ConfigError::invalid(
                "producer.owner",
                "must be 1 to 64 of [a-z0-9_-], starting with a letter or digit",
            ));
        }
        if !(100..=60_000).contains(&p.schedule_interval_ms) {
            return Err(ConfigError::invalid(
                "producer.schedule_interval_ms",
                "must be between 100 and 60000",
            ));
        }
        Ok(())
    }
}
