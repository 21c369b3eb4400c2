//! Configuration of `nudge-intake`.
//!
//! Keys, beyond the shared `database.*` and `telemetry.*` (see `nudge-config`), and
//! `crypto.destination_key` and `crypto.subscriber_key`, both required here (the intake seals
//! destinations and content, stores subscriber references as a keyed hash), and
//! `crypto.tenant_secret_key` (unset by default; set it): the key that opens the tenants'
//! signing secrets, held by the intake and `nudgectl` only. Unset, the intake opens only the
//! secrets sealed with the destination key and warns at start-up.
//! - `intake.listen_addr` (default `"127.0.0.1:8080"`): where the HTTP API listens.
//! - `intake.body_limit_bytes` (default 1048576, 1024..=67108864): the largest request body;
//!   a longer one is answered 413 without being read further.
//! - `intake.batch_max` (default 500, 1..=5000): the most reminders in one `{"reminders": [...]}`.
//! - `intake.timestamp_tolerance_s` (default 300, 1..=3600): how far a signature's timestamp
//!   may be from the intake's clock, either way.
//! - `intake.header_read_timeout_ms` (default 5000): how long a client may take to send a
//!   request's headers before the connection is closed.
//! - `intake.body_read_timeout_ms` (default 10000): how long a client may take to send a whole
//!   body, counted from its headers, however it is cut into frames (408 past it).
//! - `intake.request_timeout_ms` (default 30000): the longest a request may take in all (408).
//! - `intake.max_schedule_ahead_days` (default 400, 1..=3650): the furthest ahead a reminder
//!   may be scheduled.
//! - `intake.max_connections` (default 1024): connections served at once; more wait to be
//!   accepted.
//! - `intake.max_body_reads` (default 64, 1..=10000): request bodies read at once. A body is
//!   read whole before its signature is checked, so this and `body_limit_bytes` bound the
//!   memory unauthenticated clients can hold (64 x 1 MiB by default); a request that finds no
//!   room within `body_read_timeout_ms` is answered 408 without a byte of it read.
//! - `receipts.*`: the providers whose delivery receipts are taken, and how each is verified
//!   (see [`crate::receipts`]).

use std::net::SocketAddr;

use nudge_config::{ConfigError, CryptoConfig, DatabaseConfig, TelemetryConfig, Validate};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IntakeConfig {
    pub database: DatabaseConfig,
    pub telemetry: TelemetryConfig,
    pub crypto: CryptoConfig,
    pub intake: IntakeSection,
    pub receipts: crate::receipts::ReceiptsSection,
}

impl IntakeConfig {
    pub const SECTIONS: &'static [&'static str] =
        &["database", "telemetry", "crypto", "intake", "receipts"];
}

impl nudge_runtime::ServiceConfig for IntakeConfig {
    const SECTIONS: &'static [&'static str] = Self::SECTIONS;

    fn database(&self) -> &DatabaseConfig {
        &self.database
    }

    fn telemetry(&self) -> &TelemetryConfig {
        &self.telemetry
    }
}

/// The `[intake]` section (see the module documentation for each key).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IntakeSection {
    pub listen_addr: SocketAddr,
    pub body_limit_bytes: usize,
    pub batch_max: usize,
    pub timestamp_tolerance_s: u64,
    pub header_read_timeout_ms: u64,
    pub body_read_timeout_ms: u64,
    pub request_timeout_ms: u64,
    pub max_schedule_ahead_days: u32,
    pub max_connections: usize,
    pub max_body_reads: usize,
}

impl Default for IntakeSection {
    fn default() -> Self {
        Self {
            listen_addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            body_limit_bytes: 1024 * 1024,
            batch_max: 500,
            timestamp_tolerance_s: 300,
            header_read_timeout_ms: 5_000,
            body_read_timeout_ms: 10_000,
            request_timeout_ms: 30_000,
            max_schedule_ahead_days: 400,
            max_connections: 1024,
            max_body_reads: 64,
        }
    }
}

fn within<T: PartialOrd + std::fmt::Display>(
    key: &'static str,
    value: T,
    min: T,
    max: T,
) -> Result<(), ConfigError> {
    if value < min || value > max {
        return Err(ConfigError::invalid(
            key,
            format!("must be between {min} and {max}"),
        ));
    }
    Ok(())
}

impl IntakeConfig {
    /// [`Validate::validate`], and the keys the intake cannot run without (left out of
    /// `validate` so the example file, which cannot hold real keys, loads as this config).
    pub fn validate_to_run(&self) -> Result<(), ConfigError> {
        self.validate()?;
        if self.crypto.destination_key.is_none() {
            return Err(ConfigError::invalid(
                "crypto.destination_key",
                "required: the intake seals destinations and opens signing secrets",
            ));
        }
        if self.crypto.subscriber_key.is_none() {
            return Err(ConfigError::invalid(
                "crypto.subscriber_key",
                "required: the intake stores subscriber references as a keyed hash",
            ));
        }
        Ok(())
    }
}

impl Validate for IntakeConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.database.validate()?;
        self.telemetry.validate()?;
        self.crypto.validate_at("crypto")?;
        let i = &self.intake;
        within(
            "intake.body_limit_bytes",
            i.body_limit_bytes,
            1024,
            64 << 20,
        )?;
        within("intake.batch_max", i.batch_max, 1, 5_000)?;
        within(
            "intake.timestamp_tolerance_s",
            i.timestamp_tolerance_s,
            1,
            3_600,
        )?;
        within(
            "intake.header_read_timeout_ms",
            i.header_read_timeout_ms,
            100,
            600_000,
        )?;
        within(
            "intake.body_read_timeout_ms",
            i.body_read_timeout_ms,
            100,
            600_000,
        )?;
        within(
            "intake.request_timeout_ms",
            i.request_timeout_ms,
            100,
            600_000,
        )?;
        within(
            "intake.max_schedule_ahead_days",
            i.max_schedule_ahead_days,
            1,
            3_650,
        )?;
        within("intake.max_connections", i.max_connections, 1, 100_000)?;
        within("intake.max_body_reads", i.max_body_reads, 1, 10_000)?;
        self.receipts.build()?;
        Ok(())
    }
}
