//! What a client's reschedule or cancellation did to each channel of a reminder, and the rule
//! that orders a reminder's revisions.
//!
//! A delivery may be moved or cancelled only while nothing can have been sent for it: owed
//! (`scheduled`, `queued`, `retry_wait`) or leased but not fenced (`sending` without a send
//! start, a lease waiting for its bucket slot). Past the fence, or settled, it is reported as
//! it stands, never claimed. The ledger applies the change under the delivery's row lock and
//! asks these functions what to answer; they never read a clock or the ledger.

use std::fmt;

use crate::state::DeliveryState;

/// A reminder's revision: the client's counter, which must grow with each replacement. The
/// first post is revision 0 unless it gives one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Revision(i64);

/// A revision that is not an integer from 0 to 2^63 - 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("revision must be an integer from 0 to 9223372036854775807")]
pub struct InvalidRevision;

impl Revision {
    pub const FIRST: Revision = Revision(0);

    pub fn new(value: i64) -> Result<Self, InvalidRevision> {
        if value < 0 {
            return Err(InvalidRevision);
        }
        Ok(Self(value))
    }

    pub const fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How a replacement's revision stands against the reminder's current one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RevisionOrder {
    /// Higher than the current one: the replacement applies.
    Newer,
    /// The current revision with the same body: a retry, answered without a change.
    Repeat,
    /// Older, or the current revision with another body: refused, naming the current one.
    Conflict,
}

/// Orders a replacement of revision `posted` (whose body is `same_body` as the one that made
/// the current revision) against the `current` one.
pub fn order(current: Revision, posted: Revision, same_body: bool) -> RevisionOrder {
    match posted.cmp(&current) {
        std::cmp::Ordering::Greater => RevisionOrder::Newer,
        std::cmp::Ordering::Equal if same_body => RevisionOrder::Repeat,
        _ => RevisionOrder::Conflict,
    }
}

/// A channel's delivery as a change found it under its row lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    pub state: DeliveryState,
    /// Its send started (`send_started_at` stamped): a request may have left.
    pub fenced: bool,
}

impl Found {
    /// Nothing can have been sent for it yet and it is still owed: a change may take it.
    pub const fn movable(self) -> bool {
        match self.state {
            DeliveryState::Scheduled | DeliveryState::Queued | DeliveryState::RetryWait => true,
            DeliveryState::Sending => !self.fenced,
            _ => false,
        }
    }
}

/// What a reschedule did to one channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelChange {
    /// Its delivery (or the reminder, while no delivery exists yet) moved to the new time.
    Moved,
    /// A channel the reminder did not have: its delivery is created (now, or by its window).
    Added,
    /// A channel no longer wanted: its owed delivery is cancelled, or none will be made.
    Removed,
    /// Kept, and its time did not change.
    Unchanged,
    /// Being sent or settled: not touched; the state it had when answered.
    TooLate(DeliveryState),
}

impl ChannelChange {
    /// The word the API answers.
    pub const fn as_str(self) -> &'static str {
        match self {
            ChannelChange::Moved => "moved",
            ChannelChange::Added => "added",
            ChannelChange::Removed => "removed",
            ChannelChange::Unchanged => "unchanged",
            ChannelChange::TooLate(_) => "too_late",
        }
    }
}

/// The answer for one channel of a reschedule. `was`/`wanted`: whether the reminder had the
/// channel before and has it after; `found`: its delivery as the change found it (None: not
/// made yet); `now`: its state after the change (for a too-late answer); `time_changed`:
/// whether the schedule or the expiry moved.
pub fn rescheduled(
    was: bool,
    wanted: bool,
    found: Option<Found>,
    now: Option<DeliveryState>,
    time_changed: bool,
) -> ChannelChange {
    let too_late = |f: Found| ChannelChange::TooLate(now.unwrap_or(f.state));
    match (was, wanted, found) {
        (false, _, None) => ChannelChange::Added,
        (false, _, Some(f)) if f.movable() => ChannelChange::Added,
        (false, _, Some(f)) => too_late(f),
        (true, false, Some(f)) if !f.movable() => too_late(f),
        (true, false, _) => ChannelChange::Removed,
        (true, true, Some(f)) if !f.movable() && time_changed => too_late(f),
        (true, true, _) if time_changed => ChannelChange::Moved,
        (true, true, _) => ChannelChange::Unchanged,
    }
}

/// What a cancellation did to one channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelChange {
    /// Settled `cancelled` now (or none will be made): no request will ever be made for it.
    Cancelled,
    /// Its send started or it was delivered, or is held as maybe sent: the state it had.
    TooLate(DeliveryState),
    /// Settled before without a send of ours to report (cancelled, expired, dead-lettered).
    AlreadySettled(DeliveryState),
}

impl CancelChange {
    pub const fn as_str(self) -> &'static str {
        match self {
            CancelChange::Cancelled => "cancelled",
            CancelChange::TooLate(_) => "too_late",
            CancelChange::AlreadySettled(_) => "already_settled",
        }
    }

    /// The delivery state the answer names, when it names one.
    pub const fn state(self) -> Option<DeliveryState> {
        match self {
            CancelChange::Cancelled => None,
            CancelChange::TooLate(s) | CancelChange::AlreadySettled(s) => Some(s),
        }
    }
}

/// The answer for one channel of a cancellation: `found` as under its row lock (None: no
/// delivery made yet), `now` its state after (for the state named).
pub fn cancelled(found: Option<Found>, now: Option<DeliveryState>) -> CancelChange {
    match found {
        None => CancelChange::Cancelled,
        Some(f) if f.movable() => CancelChange::Cancelled,
        Some(f) => {
            let state = now.unwrap_or(f.state);
            match f.state {
                DeliveryState::Sending | DeliveryState::Delivered | DeliveryState::Ambiguous => {
                    CancelChange::TooLate(state)
                }
                _ => CancelChange::AlreadySettled(state),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use DeliveryState::*;

    fn found(state: DeliveryState, fenced: bool) -> Option<Found> {
        Some(Found { state, fenced })
    }

    #[test]
    fn a_revision_is_never_negative() {
        assert_eq!(Revision::new(-1), Err(InvalidRevision));
        assert_eq!(Revision::new(0).map(Revision::get), Ok(0));
        assert_eq!(Revision::default(), Revision::FIRST);
    }

    #[test]
    fn only_a_higher_revision_applies_and_an_equal_one_repeats_only_with_its_body() {
        let r = |v| Revision::new(v).unwrap_or_default();
        assert_eq!(order(r(3), r(4), false), RevisionOrder::Newer);
        assert_eq!(order(r(3), r(4), true), RevisionOrder::Newer);
        assert_eq!(order(r(3), r(3), true), RevisionOrder::Repeat);
        assert_eq!(order(r(3), r(3), false), RevisionOrder::Conflict);
        assert_eq!(order(r(3), r(2), true), RevisionOrder::Conflict);
        assert_eq!(order(r(3), r(2), false), RevisionOrder::Conflict);
    }

    #[test]
    fn owed_and_unfenced_work_is_movable_and_nothing_past_the_fence_is() {
        for state in [Scheduled, Queued, RetryWait] {
            assert!(
                Found {
                    state,
                    fenced: false
                }
                .movable()
            );
        }
        assert!(
            Found {
                state: Sending,
                fenced: false
            }
            .movable()
        );
        assert!(
            !Found {
                state: Sending,
                fenced: true
            }
            .movable()
        );
        for state in [Delivered, DeadLettered, Expired, Ambiguous, Cancelled] {
            assert!(
                !Found {
                    state,
                    fenced: false
                }
                .movable()
            );
            assert!(
                !Found {
                    state,
                    fenced: true
                }
                .movable()
            );
        }
    }

    #[test]
    fn a_reschedule_answers_each_channel_by_what_it_could_touch() {
        assert_eq!(
            rescheduled(true, true, None, None, true),
            ChannelChange::Moved
        );
        assert_eq!(
            rescheduled(true, true, found(Queued, false), Some(Scheduled), true),
            ChannelChange::Moved
        );
        assert_eq!(
            rescheduled(true, true, found(Sending, false), Some(Scheduled), true),
            ChannelChange::Moved
        );
        assert_eq!(
            rescheduled(true, true, found(Sending, true), Some(Delivered), true),
            ChannelChange::TooLate(Delivered)
        );
        assert_eq!(
            rescheduled(true, true, found(Delivered, true), None, false),
            ChannelChange::Unchanged
        );
        assert_eq!(
            rescheduled(true, true, None, None, false),
            ChannelChange::Unchanged
        );
        assert_eq!(
            rescheduled(false, true, None, None, true),
            ChannelChange::Added
        );
        assert_eq!(
            rescheduled(false, true, found(Cancelled, false), None, true),
            ChannelChange::TooLate(Cancelled)
        );
        assert_eq!(
            rescheduled(true, false, None, None, true),
            ChannelChange::Removed
        );
        assert_eq!(
            rescheduled(true, false, found(RetryWait, false), Some(Cancelled), false),
            ChannelChange::Removed
        );
        assert_eq!(
            rescheduled(true, false, found(Sending, true), None, false),
            ChannelChange::TooLate(Sending)
        );
    }

    #[test]
    fn a_cancel_claims_only_what_no_request_can_have_left_for() {
        assert_eq!(cancelled(None, None), CancelChange::Cancelled);
        assert_eq!(
            cancelled(found(Sending, false), Some(Cancelled)),
            CancelChange::Cancelled
        );
        assert_eq!(
            cancelled(found(Sending, true), Some(Sending)),
            CancelChange::TooLate(Sending)
        );
        assert_eq!(
            cancelled(found(Sending, true), Some(Delivered)),
            CancelChange::TooLate(Delivered)
        );
        assert_eq!(
            cancelled(found(Delivered, true), None),
            CancelChange::TooLate(Delivered)
        );
        assert_eq!(
            cancelled(found(Ambiguous, true), None),
            CancelChange::TooLate(Ambiguous)
        );
        for state in [Cancelled, Expired, DeadLettered] {
            assert_eq!(
                cancelled(found(state, false), None),
                CancelChange::AlreadySettled(state)
            );
        }
    }
}
