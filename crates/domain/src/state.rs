//! The delivery state machine. The ledger stores these names; every change of state goes through
//! [`DeliveryState::transition`] so that an illegal jump is an error, never a silent overwrite.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ids::IdError;

/// Where one `(reminder, channel)` delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryState {
    /// Materialised, waiting for its send time.
    Scheduled,
    /// Published to the work queue; a worker may lease it.
    Queued,
    /// Leased by a worker that is talking to the provider.
    Sending,
    /// Released after a retryable failure until `next_attempt_at`.
    RetryWait,
    Delivered,
    /// Given up on, with a reason and the attempt history; an operator may redrive it.
    DeadLettered,
    /// Its `expires_at` passed before it could be delivered.
    Expired,
    /// The provider may or may not have sent it and cannot dedup a resend: held for review.
    Ambiguous,
    Cancelled,
    /// Never sent because its destination opted out (or its category was switched off): settled
    /// by the lease or the fence without a request.
    Suppressed,
}

impl DeliveryState {
    pub const ALL: [DeliveryState; 10] = [
        DeliveryState::Scheduled,
        DeliveryState::Queued,
        DeliveryState::Sending,
        DeliveryState::RetryWait,
        DeliveryState::Delivered,
        DeliveryState::DeadLettered,
        DeliveryState::Expired,
        DeliveryState::Ambiguous,
        DeliveryState::Cancelled,
        DeliveryState::Suppressed,
    ];

    /// The name stored in the ledger.
    pub const fn as_str(self) -> &'static str {
        match self {
            DeliveryState::Scheduled => "scheduled",
            DeliveryState::Queued => "queued",
            DeliveryState::Sending => "sending",
            DeliveryState::RetryWait => "retry_wait",
            DeliveryState::Delivered => "delivered",
            DeliveryState::DeadLettered => "dead_lettered",
            DeliveryState::Expired => "expired",
            DeliveryState::Ambiguous => "ambiguous",
            DeliveryState::Cancelled => "cancelled",
            DeliveryState::Suppressed => "suppressed",
        }
    }

    /// Nothing more will happen on its own. (A dead letter can still be redriven by an operator.)
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            DeliveryState::Delivered
                | DeliveryState::DeadLettered
                | DeliveryState::Expired
                | DeliveryState::Cancelled
                | DeliveryState::Suppressed
        )
    }

    /// Work is still owed: the expiry sweep and the drain watch these.
    pub const fn is_live(self) -> bool {
        matches!(
            self,
            DeliveryState::Scheduled
                | DeliveryState::Queued
                | DeliveryState::Sending
                | DeliveryState::RetryWait
        )
    }

    /// Held for operator review (ambiguous): neither live nor terminal, waiting for a person
    /// (or a provider receipt) to decide. "Held" means only this in nudge; the gauges'
    /// ambiguous + dead-lettered count is "awaiting operator" (`docs/GLOSSARY.md`).
    pub const fn is_held(self) -> bool {
        matches!(self, DeliveryState::Ambiguous)
    }

    /// Whether retention cleanup may ever delete a record in this state. Kept separate from
    /// [`DeliveryState::is_terminal`] so that widening one can never silently widen the other.
    pub const fn is_retention_deletable(self) -> bool {
        matches!(
            self,
            DeliveryState::Delivered
                | DeliveryState::DeadLettered
                | DeliveryState::Expired
                | DeliveryState::Cancelled
                | DeliveryState::Suppressed
        )
    }

    pub const fn can_transition_to(self, to: DeliveryState) -> bool {
        use DeliveryState::*;
        matches!(
            (self, to),
            (Scheduled, Queued | Expired | Cancelled)
                // Dead-lettered from `queued`: its message was poison (the worker could not
                // process it and the broker's delivery limit dead-lettered it). Back to
                // `scheduled`: a reschedule moved it (its message is stale by generation).
                | (Queued, Scheduled | Sending | RetryWait | DeadLettered | Expired | Cancelled)
                // Cancelled, expired, suppressed or rescheduled from `sending` only before the
                // send started: the lease or the fence saw it (suppressed: its destination
                // opted out), or lost to the change, and nothing was sent.
                | (
                    Sending,
                    Scheduled
                        | Delivered
                        | RetryWait
                        | DeadLettered
                        | Expired
                        | Ambiguous
                        | Cancelled
                        | Suppressed
                )
                | (RetryWait, Queued | Expired | Cancelled)
                // Redrive: fed back due in the `redrive` lane, or republished directly.
                | (DeadLettered, Queued | RetryWait)
                // Operator resolution after review; never back to a send on its own.
                | (Ambiguous, Delivered | DeadLettered | Cancelled)
        )
    }

    pub fn transition(self, to: DeliveryState) -> Result<DeliveryState, IllegalTransition> {
        if self.can_transition_to(to) {
            Ok(to)
        } else {
            Err(IllegalTransition { from: self, to })
        }
    }
}

impl fmt::Display for DeliveryState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DeliveryState {
    type Err = IdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DeliveryState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or(IdError::UnknownState)
    }
}

/// A state change the state machine does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal delivery transition from {from} to {to}")]
pub struct IllegalTransition {
    pub(crate) from: DeliveryState,
    pub(crate) to: DeliveryState,
}

impl IllegalTransition {
    pub fn from(&self) -> DeliveryState {
        self.from
    }

    pub fn to(&self) -> DeliveryState {
        self.to
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::DeliveryState::*;
    use super::*;

    /// The legal transitions, written out independently of `can_transition_to`.
    const LEGAL: &[(DeliveryState, DeliveryState)] = &[
        (Scheduled, Queued),
        (Scheduled, Expired),
        (Scheduled, Cancelled),
        (Queued, Scheduled),
        (Queued, Sending),
        (Queued, RetryWait),
        (Queued, DeadLettered),
        (Queued, Expired),
        (Queued, Cancelled),
        (Sending, Scheduled),
        (Sending, Delivered),
        (Sending, RetryWait),
        (Sending, DeadLettered),
        (Sending, Expired),
        (Sending, Ambiguous),
        (Sending, Cancelled),
        (Sending, Suppressed),
        (RetryWait, Queued),
        (RetryWait, Expired),
        (RetryWait, Cancelled),
        (DeadLettered, RetryWait),
        (DeadLettered, Queued),
        (Ambiguous, Delivered),
        (Ambiguous, DeadLettered),
        (Ambiguous, Cancelled),
    ];

    #[test]
    fn every_one_of_the_100_pairs_is_legal_exactly_when_the_table_says_so() {
        let mut checked = 0;
        for from in DeliveryState::ALL {
            for to in DeliveryState::ALL {
                let legal = LEGAL.contains(&(from, to));
                assert_eq!(from.can_transition_to(to), legal, "{from} -> {to}");
                match from.transition(to) {
                    Ok(next) => {
                        assert!(legal, "{from} -> {to}");
                        assert_eq!(next, to);
                    }
                    Err(e) => {
                        assert!(!legal, "{from} -> {to}");
                        assert_eq!((e.from(), e.to()), (from, to));
                    }
                }
                checked += 1;
            }
        }
        assert_eq!(checked, 100);
    }

    #[test]
    fn delivered_expired_and_cancelled_go_nowhere() {
        for from in [Delivered, Expired, Cancelled] {
            assert!(
                DeliveryState::ALL
                    .iter()
                    .all(|&to| !from.can_transition_to(to))
            );
        }
    }

    #[test]
    fn state_names_are_the_ledger_spellings_and_parse_back() {
        let names: Vec<_> = DeliveryState::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(
            names,
            [
                "scheduled",
                "queued",
                "sending",
                "retry_wait",
                "delivered",
                "dead_lettered",
                "expired",
                "ambiguous",
                "cancelled",
                "suppressed"
            ]
        );
        for s in DeliveryState::ALL {
            assert_eq!(s.as_str().parse::<DeliveryState>(), Ok(s));
            assert_eq!(s.to_string(), s.as_str());
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.as_str())
            );
        }
        assert_eq!(
            "RetryWait".parse::<DeliveryState>(),
            Err(IdError::UnknownState)
        );
    }

    #[test]
    fn every_state_is_exactly_one_of_live_held_or_terminal() {
        for s in DeliveryState::ALL {
            let kinds = [s.is_live(), s.is_held(), s.is_terminal()];
            assert_eq!(kinds.iter().filter(|&&k| k).count(), 1, "{s}");
        }
        assert!(Ambiguous.is_held());
    }

    #[test]
    fn retention_may_delete_only_terminal_records_never_live_or_ambiguous_ones() {
        for s in DeliveryState::ALL {
            assert_eq!(s.is_retention_deletable(), s.is_terminal(), "{s}");
            if s.is_live() || s.is_held() {
                assert!(!s.is_retention_deletable(), "{s}");
            }
        }
    }

    #[test]
    fn an_illegal_transition_says_both_states() {
        let err = Delivered.transition(Queued).unwrap_err();
        assert_eq!(
            err.to_string(),
            "illegal delivery transition from delivered to queued"
        );
    }
}
