//! The `[retention]` section, shared by `nudge-janitor` (which deletes by it) and `nudgectl`
//! (whose `retention plan` counts by it), so both read the same boundaries from one file.
//!
//! Keys (defaults in brackets):
//! - `retention.enabled` (`true`): whether the janitor runs retention at all.
//! - `retention.interval_s` (`3600`): how often a run starts (60..=604800): this long after
//!   the last finished run began, on the ledger's record, not at each start-up.
//! - `retention.batch_size` (`500`): deliveries (or rows of another table) per batch,
//!   each batch its own short transaction (1..=10000).
//! - `retention.pause_ms` (`200`): pause between batches, so live traffic keeps the database
//!   (0..=60000).
//! - `retention.delivered_days`, `expired_days`, `cancelled_days` (`30`),
//!   `dead_lettered_days` (`90`): per terminal state, counted from `settled_at`; a
//!   delivery's attempts, dead-letter records and finished redrive items go with it.
//! - `retention.reminders_days`, `contacts_days` (`90`): reminders with no delivery left,
//!   counted from `expires_at`; contacts no remaining reminder names, from `updated_at`.
//! - `retention.events_days` (`30`): delivery events, counted from when they were written,
//!   once the tenant's webhook acknowledged them (or of a tenant with no webhook).
//! - `retention.events_unacknowledged_days` (`90`, at least `events_days`): delivery events
//!   the tenant's webhook has not acknowledged (an endpoint down or disabled that long).
//! - `retention.audit_days` (`2190`, six years): the audit log, on its own and longest.
//! - `retention.export_dir` (unset): when set, each run writes `retention-<run id>.jsonl` there
//!   (ids, states, times and outcome classes of every deleted delivery) before its deletions
//!   commit.
//!
//! Floors: 7 days for every delivery state, reminders, contacts and events, 365 for the audit
//! log, which must also be at least the longest other boundary; `events_unacknowledged_days`
//! at least `events_days` (`nudge_domain::retention`).

use std::path::PathBuf;

use nudge_domain::{RetentionDays, RetentionPolicy};
use serde::{Deserialize, Serialize};

use crate::{ConfigError, Validate};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    pub enabled: bool,
    pub interval_s: u64,
    pub batch_size: u32,
    pub pause_ms: u64,
    pub delivered_days: u32,
    pub expired_days: u32,
    pub cancelled_days: u32,
    pub dead_lettered_days: u32,
    pub reminders_days: u32,
    pub contacts_days: u32,
    pub events_days: u32,
    pub events_unacknowledged_days: u32,
    pub audit_days: u32,
    pub export_dir: Option<PathBuf>,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            interval_s: 3_600,
            batch_size: 500,
            pause_ms: 200,
            delivered_days: 30,
            expired_days: 30,
            cancelled_days: 30,
            dead_lettered_days: 90,
            reminders_days: 90,
            contacts_days: 90,
            events_days: 30,
            events_unacknowledged_days: 90,
            audit_days: 2_190,
            export_dir: None,
        }
    }
}

impl RetentionConfig {
    /// The checked policy, or an error naming the `retention.*_days` key below its floor.
    pub fn policy(&self) -> Result<RetentionPolicy, ConfigError> {
        RetentionPolicy::new(RetentionDays {
            delivered: self.delivered_days,
            expired: self.expired_days,
            cancelled: self.cancelled_days,
            dead_lettered: self.dead_lettered_days,
            reminders: self.reminders_days,
            contacts: self.contacts_days,
            events: self.events_days,
            events_unacknowledged: self.events_unacknowledged_days,
            audit: self.audit_days,
        })
        .map_err(|e| ConfigError::invalid(format!("retention.{}", e.field), e.message))
    }
}

impl Validate for RetentionConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(60..=604_800).contains(&self.interval_s) {
            return Err(ConfigError::invalid(
                "retention.interval_s",
                "must be between 60 and 604800",
            ));
        }
        if !(1..=10_000).contains(&self.batch_size) {
            return Err(ConfigError::invalid(
                "retention.batch_size",
                "must be between 1 and 10000",
            ));
        }
        if self.pause_ms > 60_000 {
            return Err(ConfigError::invalid(
                "retention.pause_ms",
                "must be at most 60000",
            ));
        }
        if self
            .export_dir
            .as_ref()
            .is_some_and(|d| d.as_os_str().is_empty())
        {
            return Err(ConfigError::invalid(
                "retention.export_dir",
                "must name a directory when set",
            ));
        }
        self.policy().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid() {
        assert!(RetentionConfig::default().validate().is_ok());
    }

    #[test]
    fn a_boundary_below_the_floor_is_refused_naming_its_key() {
        let config = RetentionConfig {
            delivered_days: 1,
            ..RetentionConfig::default()
        };
        assert_eq!(
            config.validate().err().and_then(|e| e.key()).as_deref(),
            Some("retention.delivered_days")
        );
        let config = RetentionConfig {
            audit_days: 30,
            ..RetentionConfig::default()
        };
        assert_eq!(
            config.validate().err().and_then(|e| e.key()).as_deref(),
            Some("retention.audit_days")
        );
    }
}
