//! What a restored ledger may no longer trust: which deliveries could have been sent after the
//! backup's point T, and so must be held for review instead of sent again.
//!
//! A restore does not move a delivery along its state machine ([`crate::state`]): the record
//! it replaces was stale, not wrong at T. Between T and the restore the lost history may have
//! leased, sent and settled anything that was owed and due, so the one safe reading of such a
//! record is "maybe sent": `ambiguous`, the state a send with an unknown outcome takes. The
//! rule is the same for every provider: one that honours the idempotency key would absorb a
//! resend, but the ledger cannot tell which key a provider kept across the lost history.

use chrono::{DateTime, Utc};

use crate::DeliveryState;

/// The reason recorded on a delivery held by a restore's reconciliation
/// (`deliveries.last_error_reason` starts with it).
pub const RESTORED_REASON: &str = "restored";

/// Whether a delivery restored from a backup could have been sent after the backup's point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AfterRestore {
    /// Maybe sent: hold it `ambiguous` for review.
    Hold(HoldReason),
    /// Nothing can have been sent that the record does not show.
    Keep(KeepReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HoldReason {
    /// Leased at T: its send may have been under way or have started right after.
    Leased,
    /// Published at T: any worker could have leased and sent it.
    Published,
    /// Waiting at T for a time that has come since: the relay could have published it.
    CameDue,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeepReason {
    /// Its time has not come yet (now, by the database's clock): nothing published it.
    NotYetDue,
    /// Settled or held at T: nothing sends it on its own (a dead letter goes back only through
    /// a redrive, which the reconciliation pauses).
    NotOwed,
}

/// States held whatever their time: the work was in a worker's hands or on the queue at T.
pub const HOLD_ALWAYS: [DeliveryState; 2] = [DeliveryState::Queued, DeliveryState::Sending];

/// States held once their `next_attempt_at` has come.
pub const HOLD_ONCE_DUE: [DeliveryState; 2] = [DeliveryState::Scheduled, DeliveryState::RetryWait];

/// The rule: a delivery in `state` at T, waiting for `next_attempt_at` (when it waits), seen
/// at `now` (the database's clock at the reconciliation, later than anything the lost history
/// did).
pub fn after_restore(
    state: DeliveryState,
    next_attempt_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> AfterRestore {
    match state {
        DeliveryState::Sending => AfterRestore::Hold(HoldReason::Leased),
        DeliveryState::Queued => AfterRestore::Hold(HoldReason::Published),
        DeliveryState::Scheduled | DeliveryState::RetryWait => match next_attempt_at {
            // A waiting delivery always knows its time (the ledger's CHECK); without one,
            // nothing says it was not due.
            Some(at) if at > now => AfterRestore::Keep(KeepReason::NotYetDue),
            _ => AfterRestore::Hold(HoldReason::CameDue),
        },
        DeliveryState::Delivered
        | DeliveryState::DeadLettered
        | DeliveryState::Expired
        | DeliveryState::Ambiguous
        | DeliveryState::Cancelled
        | DeliveryState::Suppressed => AfterRestore::Keep(KeepReason::NotOwed),
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 12, 2, 3, 0, 0).unwrap()
    }

    #[test]
    fn leased_and_published_work_is_held_whatever_its_time() {
        let later = Some(now() + chrono::Duration::hours(1));
        assert_eq!(
            after_restore(DeliveryState::Sending, later, now()),
            AfterRestore::Hold(HoldReason::Leased)
        );
        assert_eq!(
            after_restore(DeliveryState::Queued, later, now()),
            AfterRestore::Hold(HoldReason::Published)
        );
    }

    #[test]
    fn waiting_work_is_held_once_its_time_has_come_and_kept_before() {
        for state in HOLD_ONCE_DUE {
            assert_eq!(
                after_restore(state, Some(now()), now()),
                AfterRestore::Hold(HoldReason::CameDue)
            );
            assert_eq!(
                after_restore(state, Some(now() - chrono::Duration::days(3)), now()),
                AfterRestore::Hold(HoldReason::CameDue)
            );
            assert_eq!(
                after_restore(state, Some(now() + chrono::Duration::seconds(1)), now()),
                AfterRestore::Keep(KeepReason::NotYetDue)
            );
        }
    }

    #[test]
    fn every_owed_state_is_held_or_waits_and_nothing_else_is_held() {
        for state in DeliveryState::ALL {
            let held = matches!(
                after_restore(state, Some(now()), now()),
                AfterRestore::Hold(_)
            );
            assert_eq!(held, state.is_live(), "{state}");
            assert_eq!(
                HOLD_ALWAYS.contains(&state) || HOLD_ONCE_DUE.contains(&state),
                state.is_live(),
                "{state}"
            );
        }
    }
}
