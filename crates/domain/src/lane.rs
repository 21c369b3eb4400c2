//! Which stream of work an attempt belongs to. Lanes share a provider's rate bucket with a
//! reserve for new work, so recovery traffic cannot starve fresh reminders.

use std::fmt;
use std::str::FromStr;

/// New work (first attempt), a retry of it, or an operator redrive of dead-lettered work.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Lane {
    New,
    Retry,
    Redrive,
}

impl Lane {
    pub const ALL: [Lane; 3] = [Lane::New, Lane::Retry, Lane::Redrive];

    pub fn as_str(self) -> &'static str {
        match self {
            Lane::New => "new",
            Lane::Retry => "retry",
            Lane::Redrive => "redrive",
        }
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A lane name that is not `new`, `retry` or `redrive`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown lane (expected new, retry or redrive)")]
pub struct UnknownLane;

impl FromStr for Lane {
    type Err = UnknownLane;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Lane::ALL
            .into_iter()
            .find(|lane| lane.as_str() == s)
            .ok_or(UnknownLane)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lane_round_trips_through_its_name() {
        for lane in Lane::ALL {
            assert_eq!(lane.as_str().parse::<Lane>(), Ok(lane));
        }
    }

    #[test]
    fn an_unknown_or_differently_cased_lane_is_refused() {
        assert_eq!("New".parse::<Lane>(), Err(UnknownLane));
        assert_eq!("".parse::<Lane>(), Err(UnknownLane));
    }
}
