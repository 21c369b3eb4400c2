//! The ledger away, as a loop of a long-running binary sees it (a failover, a restart, a
//! server turned read-only): the outage is logged once when it begins (warn, with the error
//! that showed it) and once when it ends (info, with how long it lasted), never once per try;
//! the pause between tries doubles from the loop's own up to [`MAX_PAUSE`], and the loop goes
//! on by itself once the ledger is back (docs/decisions/0018-the-pool-keeps-only-a-writable-primary.md).
//!
//! It must never swallow an error that is not the ledger being away: [`Outage::away`] says
//! `false` for those, and the loop logs them as it did.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nudge_telemetry::error_chain;
use tracing::{info, warn};

/// The longest pause between two tries of a loop while the ledger is away (unless the loop's
/// own pause is longer).
pub const MAX_PAUSE: Duration = Duration::from_secs(5);

/// One loop's view of ledger outages.
#[derive(Debug)]
pub struct Outage {
    /// The loop, as logged (`relay`, `sweep`...).
    task: &'static str,
    current: Mutex<Option<Away>>,
    /// Whether `current` holds an outage: read without the lock by [`Outage::is_away`], which
    /// a busy caller (the intake, per request) asks often.
    away: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct Away {
    since: Instant,
    failures: u32,
}

impl Outage {
    pub fn new(task: &'static str) -> Self {
        Self {
            task,
            current: Mutex::new(None),
            away: AtomicBool::new(false),
        }
    }

    /// Whether `e` is the ledger being away (`nudge_ledger::is_unavailable`); if it is, the
    /// outage is counted, and logged when this is its first failure.
    pub fn away(&self, e: &(dyn std::error::Error + 'static)) -> bool {
        if !nudge_ledger::is_unavailable(e) {
            return false;
        }
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        match current.as_mut() {
            Some(away) => away.failures = away.failures.saturating_add(1),
            None => {
                warn!(task = self.task, error.cause_chain = %error_chain(e),
                      "the ledger is away or read-only; waiting for it");
                *current = Some(Away {
                    since: Instant::now(),
                    failures: 1,
                });
                self.away.store(true, Ordering::Release);
            }
        }
        true
    }

    /// The loop's work succeeded: an outage under way has ended.
    pub fn back(&self) {
        if !self.is_away() {
            return;
        }
        let ended = {
            let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
            self.away.store(false, Ordering::Release);
            current.take()
        };
        if let Some(away) = ended {
            info!(
                task = self.task,
                away_ms = away.since.elapsed().as_millis() as u64,
                failures = away.failures,
                "the ledger is back"
            );
        }
    }

    /// Whether an outage is under way.
    pub fn is_away(&self) -> bool {
        self.away.load(Ordering::Acquire)
    }

    /// The pause before the loop's next try: `normal` while the ledger answers; during an
    /// outage, `normal` doubled per failure after the first, up to [`MAX_PAUSE`] (or `normal`
    /// when that is longer).
    pub fn pause(&self, normal: Duration) -> Duration {
        let current = *self.current.lock().unwrap_or_else(|p| p.into_inner());
        match current {
            None => normal,
            Some(away) => {
                let doubled =
                    normal.saturating_mul(1u32 << away.failures.saturating_sub(1).min(16));
                doubled.min(MAX_PAUSE.max(normal))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nudge_ledger::LedgerError;

    #[test]
    fn an_outage_doubles_the_pause_up_to_the_bound_and_ends_when_the_work_succeeds() {
        let outage = Outage::new("test");
        let every = Duration::from_millis(500);
        assert_eq!(outage.pause(every), every);
        let away = LedgerError::ReadOnly;
        for expected in [500, 1_000, 2_000, 4_000, 5_000, 5_000] {
            assert!(outage.away(&away));
            assert_eq!(outage.pause(every), Duration::from_millis(expected));
        }
        assert!(outage.is_away());
        outage.back();
        assert!(!outage.is_away());
        assert_eq!(outage.pause(every), every);
    }

    #[test]
    fn an_error_that_is_not_the_ledger_away_is_left_to_the_loop() {
        let outage = Outage::new("test");
        assert!(!outage.away(&LedgerError::InvalidInput("x")));
        assert!(!outage.is_away());
        assert!(outage.away(&LedgerError::ReadOnly));
    }

    #[test]
    fn a_loop_whose_own_pause_is_longer_keeps_it() {
        let outage = Outage::new("test");
        assert!(outage.away(&LedgerError::ReadOnly));
        assert!(outage.away(&LedgerError::ReadOnly));
        let hourly = Duration::from_secs(3_600);
        assert_eq!(outage.pause(hourly), hourly);
    }
}
