//! The worker's view of the database's clock.
//!
//! Every time condition is evaluated in SQL with PostgreSQL's clock; what the worker itself
//! computes with time (when a retry is due, when an attempt started and finished, how long to
//! wait for a slot) must agree with it, or a worker whose clock runs behind would shorten a
//! provider's `Retry-After` and one ahead would lengthen it. So the worker never uses its own
//! clock as such: it keeps the offset between the database's clock and its own, measured at
//! every lease round trip (the midpoint of the request), and adds it. A process clock that is
//! off by minutes is then off by no more than half a round trip.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use chrono::{DateTime, Utc};

/// A clock, injected so tests can move or skew it.
pub type Clock = Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>;

/// The local clock corrected by the last measured offset to the database's clock.
pub struct LedgerClock {
    local: Clock,
    offset_ns: AtomicI64,
}

impl std::fmt::Debug for LedgerClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerClock")
            .field("offset_ns", &self.offset_ns.load(Ordering::Relaxed))
            .finish()
    }
}

impl LedgerClock {
    pub fn new(local: Clock) -> Self {
        Self {
            local,
            offset_ns: AtomicI64::new(0),
        }
    }

    /// The local clock's reading, before correction: to bracket a round trip.
    pub fn local(&self) -> DateTime<Utc> {
        (self.local)()
    }

    /// The database's time, as well as this worker knows it.
    pub fn now(&self) -> DateTime<Utc> {
        self.local() + chrono::Duration::nanoseconds(self.offset_ns.load(Ordering::Relaxed))
    }

    /// Learns the offset from a database time read during a round trip that started at
    /// `sent` and ended at `received` (local readings).
    pub fn observe(&self, database: DateTime<Utc>, sent: DateTime<Utc>, received: DateTime<Utc>) {
        let midpoint = sent + (received - sent) / 2;
        if let Some(offset) = (database - midpoint).num_nanoseconds() {
            self.offset_ns.store(offset, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn a_clock_thirty_seconds_behind_reads_the_database_time_once_observed() {
        let true_now = Utc.with_ymd_and_hms(2026, 12, 1, 12, 0, 0).unwrap();
        let behind = true_now - chrono::Duration::seconds(30);
        let clock = LedgerClock::new(Arc::new(move || behind));
        assert_eq!(clock.now(), behind);
        clock.observe(true_now, behind, behind);
        assert_eq!(clock.now(), true_now);
    }

    #[test]
    fn the_offset_is_taken_at_the_midpoint_of_the_round_trip() {
        let t = Utc.with_ymd_and_hms(2026, 12, 1, 12, 0, 0).unwrap();
        let clock = LedgerClock::new(Arc::new(move || t));
        // Sent at t, answered at t + 10 ms, the database said t + 5 ms + 30 s.
        clock.observe(
            t + chrono::Duration::milliseconds(5) + chrono::Duration::seconds(30),
            t,
            t + chrono::Duration::milliseconds(10),
        );
        assert_eq!(clock.now(), t + chrono::Duration::seconds(30));
    }
}
