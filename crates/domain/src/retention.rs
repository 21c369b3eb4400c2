//! The retention policy: how long settled history is kept before it may be deleted.
//!
//! A boundary per terminal state (`delivered`, `expired`, `cancelled`, which `suppressed`
//! shares, `dead_lettered`; a
//! delivery's attempts, dead-letter records and finished redrive items go with it), one for
//! reminders and one for contacts that no delivery or reminder needs any more, two for the
//! delivery events (one for those the tenant's webhook acknowledged, or of a tenant with none,
//! and a longer one for those it has not: an endpoint that is down keeps its events that long
//! and no longer), and one for the audit log, which is evidence of what operators did and is kept longest: at least as long as
//! every other boundary. No boundary may be below its safety floor ([`DELIVERY_FLOOR_DAYS`],
//! [`AUDIT_FLOOR_DAYS`]): a policy of `0` or a slip of units would otherwise delete evidence
//! the moment it settles. The database holds the same floors (migration
//! `20261202000001_retention`), so a policy that got past this check still deletes nothing
//! younger.
//!
//! Held (`ambiguous`) and owed work has no boundary at all: it is never deleted.

use std::fmt;

/// The shortest boundary, in days, for any delivery state, reminders and contacts.
pub const DELIVERY_FLOOR_DAYS: u32 = 7;
/// The shortest boundary, in days, for the audit log.
pub const AUDIT_FLOOR_DAYS: u32 = 365;
/// The longest boundary accepted, in days (100 years): beyond it, keep forever by disabling
/// retention instead.
pub const MAX_DAYS: u32 = 36_500;

/// Boundaries in days, as configured; [`RetentionPolicy::new`] checks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RetentionDays {
    pub delivered: u32,
    pub expired: u32,
    pub cancelled: u32,
    pub dead_lettered: u32,
    pub reminders: u32,
    pub contacts: u32,
    /// Delivery events, counted from when they were written: those the tenant's webhook
    /// acknowledged, and every event of a tenant without one.
    pub events: u32,
    /// Delivery events the tenant's webhook has not acknowledged (at least `events`).
    pub events_unacknowledged: u32,
    pub audit: u32,
}

/// A checked retention policy (see the module's rules).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy(RetentionDays);

/// A boundary the policy refuses, naming it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidRetention {
    /// The boundary's name as configured (`delivered_days`, ...).
    pub field: &'static str,
    pub message: String,
}

impl RetentionPolicy {
    /// Checks every boundary against its floor and the ceiling, and the audit log against
    /// every other boundary.
    pub fn new(days: RetentionDays) -> Result<Self, InvalidRetention> {
        let within = |field: &'static str, value: u32, floor: u32| {
            if (floor..=MAX_DAYS).contains(&value) {
                Ok(())
            } else {
                Err(InvalidRetention {
                    field,
                    message: format!(
                        "{value} days is outside {floor}..={MAX_DAYS} (the safety floor is {floor} days)"
                    ),
                })
            }
        };
        within("delivered_days", days.delivered, DELIVERY_FLOOR_DAYS)?;
        within("expired_days", days.expired, DELIVERY_FLOOR_DAYS)?;
        within("cancelled_days", days.cancelled, DELIVERY_FLOOR_DAYS)?;
        within(
            "dead_lettered_days",
            days.dead_lettered,
            DELIVERY_FLOOR_DAYS,
        )?;
        within("reminders_days", days.reminders, DELIVERY_FLOOR_DAYS)?;
        within("contacts_days", days.contacts, DELIVERY_FLOOR_DAYS)?;
        within("events_days", days.events, DELIVERY_FLOOR_DAYS)?;
        within(
            "events_unacknowledged_days",
            days.events_unacknowledged,
            DELIVERY_FLOOR_DAYS,
        )?;
        within("audit_days", days.audit, AUDIT_FLOOR_DAYS)?;
        if days.events_unacknowledged < days.events {
            return Err(InvalidRetention {
                field: "events_unacknowledged_days",
                message: format!(
                    "events a webhook has not acknowledged are kept at least as long as the others ({} days), got {}",
                    days.events, days.events_unacknowledged
                ),
            });
        }
        let longest = [
            days.delivered,
            days.expired,
            days.cancelled,
            days.dead_lettered,
            days.reminders,
            days.contacts,
            days.events,
            days.events_unacknowledged,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        if days.audit < longest {
            return Err(InvalidRetention {
                field: "audit_days",
                message: format!(
                    "the audit log is kept at least as long as anything else ({longest} days), got {}",
                    days.audit
                ),
            });
        }
        Ok(Self(days))
    }

    pub fn days(&self) -> RetentionDays {
        self.0
    }
}

impl fmt::Display for RetentionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        write!(
            f,
            "delivered {}d, expired {}d, cancelled {}d, dead_lettered {}d, reminders {}d, contacts {}d, events {}d ({}d unacknowledged), audit {}d",
            d.delivered,
            d.expired,
            d.cancelled,
            d.dead_lettered,
            d.reminders,
            d.contacts,
            d.events,
            d.events_unacknowledged,
            d.audit
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn days() -> RetentionDays {
        RetentionDays {
            delivered: 30,
            expired: 30,
            cancelled: 30,
            dead_lettered: 90,
            reminders: 90,
            contacts: 90,
            events: 30,
            events_unacknowledged: 90,
            audit: 2_190,
        }
    }

    #[test]
    fn a_policy_at_the_floors_is_accepted() {
        let floor = RetentionDays {
            delivered: DELIVERY_FLOOR_DAYS,
            expired: DELIVERY_FLOOR_DAYS,
            cancelled: DELIVERY_FLOOR_DAYS,
            dead_lettered: DELIVERY_FLOOR_DAYS,
            reminders: DELIVERY_FLOOR_DAYS,
            contacts: DELIVERY_FLOOR_DAYS,
            events: DELIVERY_FLOOR_DAYS,
            events_unacknowledged: DELIVERY_FLOOR_DAYS,
            audit: AUDIT_FLOOR_DAYS,
        };
        assert!(RetentionPolicy::new(floor).is_ok());
        assert!(RetentionPolicy::new(days()).is_ok());
    }

    #[test]
    fn a_boundary_below_its_floor_is_refused_by_name() {
        let zero = RetentionDays {
            expired: 0,
            ..days()
        };
        assert_eq!(
            RetentionPolicy::new(zero).map_err(|e| e.field),
            Err("expired_days")
        );
        let audit = RetentionDays {
            audit: AUDIT_FLOOR_DAYS - 1,
            ..days()
        };
        assert_eq!(
            RetentionPolicy::new(audit).map_err(|e| e.field),
            Err("audit_days")
        );
    }

    #[test]
    fn unacknowledged_events_are_kept_at_least_as_long_as_acknowledged_ones() {
        let shorter = RetentionDays {
            events: 30,
            events_unacknowledged: 20,
            ..days()
        };
        assert_eq!(
            RetentionPolicy::new(shorter).map_err(|e| e.field),
            Err("events_unacknowledged_days")
        );
        let below_floor = RetentionDays {
            events: 6,
            ..days()
        };
        assert_eq!(
            RetentionPolicy::new(below_floor).map_err(|e| e.field),
            Err("events_days")
        );
        let beyond_audit = RetentionDays {
            events_unacknowledged: 3_000,
            ..days()
        };
        assert_eq!(
            RetentionPolicy::new(beyond_audit).map_err(|e| e.field),
            Err("audit_days")
        );
    }

    #[test]
    fn the_audit_log_is_kept_at_least_as_long_as_deliveries() {
        let short_audit = RetentionDays {
            dead_lettered: 400,
            audit: 365,
            ..days()
        };
        assert_eq!(
            RetentionPolicy::new(short_audit).map_err(|e| e.field),
            Err("audit_days")
        );
    }
}
