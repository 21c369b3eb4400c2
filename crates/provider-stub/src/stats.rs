//! What the stub saw, as served by `GET /stats` and `GET /stats/keys`.
//!
//! Counts, statuses, times and idempotency keys (opaque ids) only: never a destination or body.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// `GET /stats`: every account, and all of them together.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    pub total: AccountStats,
    pub accounts: BTreeMap<String, AccountStats>,
}

/// Counters of one account (or of all of them, in [`Stats::total`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccountStats {
    /// Every request that reached the provider route.
    pub requests: u64,
    /// Distinct `Idempotency-Key`s seen.
    pub unique_keys: u64,
    /// First 2xx per key (and every 2xx to a request without a key).
    pub accepted: u64,
    /// Requests for a key that already got a 2xx; answered with that same 2xx.
    pub duplicates: u64,
    /// Requests without an `Idempotency-Key`.
    pub without_key: u64,
    /// Answers by status (hung requests are not answered and not counted here).
    pub by_status: BTreeMap<u16, u64>,
    /// 429s from the token bucket (scripted 429s are only in `by_status`).
    pub rate_limited: u64,
    /// Requests held by a `hang` step.
    pub hung: u64,
    /// The most requests that arrived within any 1 s window.
    pub max_requests_in_any_second: u64,
    #[serde(with = "rfc3339_ms::option")]
    pub first_request_at: Option<DateTime<Utc>>,
    #[serde(with = "rfc3339_ms::option")]
    pub last_request_at: Option<DateTime<Utc>>,
}

/// `GET /stats/keys`: one entry per `(account, idempotency key)`, sorted by account then key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeysReport {
    pub keys: Vec<KeyReport>,
}

impl KeysReport {
    /// The entry for `key` at `account`, if that key was seen there.
    pub fn get(&self, account: &str, key: &str) -> Option<&KeyReport> {
        self.keys
            .iter()
            .find(|k| k.account == account && k.key == key)
    }
}

/// The history of one idempotency key at one account.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyReport {
    pub account: String,
    pub key: String,
    /// Every request with this key, in arrival order.
    pub requests: Vec<KeyRequest>,
    /// When the key first got a 2xx.
    #[serde(with = "rfc3339_ms::option")]
    pub accepted_at: Option<DateTime<Utc>>,
    /// The id given with that 2xx (and with every duplicate after it).
    pub message_id: Option<String>,
}

/// One request with a key: when it arrived (server clock, UTC, ms) and what it got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRequest {
    #[serde(with = "rfc3339_ms")]
    pub at: DateTime<Utc>,
    /// The status answered (for a hung request: the status it was scripted with).
    pub status: u16,
    pub kind: AnswerKind,
    /// The request's W3C `traceparent` header, when it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// Which rule produced an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerKind {
    /// A step of the script (sequence or default).
    Scripted,
    /// The cached 2xx of an already-accepted key.
    Duplicate,
    /// A 429 from the token bucket.
    RateLimited,
    /// A 400 for a request the stub could not take (no key when one is required, bad body).
    Invalid,
    /// A `hang` step: never answered.
    Hung,
}

/// The largest number of events in any window of `width`, fed in arrival order.
///
/// A window holding the most events can always be slid to end at one of them, so checking the
/// window that ends at each event finds the maximum. Windows are half-open: an event exactly
/// `width` before another is not in its window.
#[derive(Debug, Clone)]
pub struct SlidingWindowMax {
    width: Duration,
    recent: VecDeque<Instant>,
    max: u64,
}

impl SlidingWindowMax {
    pub fn new(width: Duration) -> Self {
        Self {
            width,
            recent: VecDeque::new(),
            max: 0,
        }
    }

    /// Records an event at `at` (not before the previous one) and returns the maximum so far.
    pub fn record(&mut self, at: Instant) -> u64 {
        while let Some(&front) = self.recent.front() {
            if at.saturating_duration_since(front) >= self.width {
                self.recent.pop_front();
            } else {
                break;
            }
        }
        self.recent.push_back(at);
        self.max = self.max.max(self.recent.len() as u64);
        self.max
    }

    pub fn max(&self) -> u64 {
        self.max
    }
}

/// RFC 3339 in UTC with exactly millisecond precision, e.g. `2026-11-29T20:29:05.123Z`.
pub mod rfc3339_ms {
    use chrono::{DateTime, SecondsFormat, Utc};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn format(t: &DateTime<Utc>) -> String {
        t.to_rfc3339_opts(SecondsFormat::Millis, true)
    }

    pub fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format(t))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        let s = String::deserialize(d)?;
        DateTime::parse_from_rfc3339(&s)
            .map(|t| t.with_timezone(&Utc))
            .map_err(serde::de::Error::custom)
    }

    pub mod option {
        use super::*;

        pub fn serialize<S: Serializer>(
            t: &Option<DateTime<Utc>>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            match t {
                Some(t) => s.serialize_some(&format(t)),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<DateTime<Utc>>, D::Error> {
            Option::<String>::deserialize(d)?
                .map(|s| {
                    DateTime::parse_from_rfc3339(&s)
                        .map(|t| t.with_timezone(&Utc))
                        .map_err(serde::de::Error::custom)
                })
                .transpose()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busiest_second_is_found_wherever_it_starts() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut w = SlidingWindowMax::new(Duration::from_secs(1));
        // Two per calendar-aligned second, but four within 600..1500.
        for at in [0, 100, 600, 900, 1_100, 1_500, 2_600, 3_700] {
            w.record(ms(at));
        }
        assert_eq!(w.max(), 4);
    }

    #[test]
    fn events_exactly_one_second_apart_are_in_different_windows() {
        let t0 = Instant::now();
        let mut w = SlidingWindowMax::new(Duration::from_secs(1));
        for n in 0..5 {
            w.record(t0 + Duration::from_secs(n));
        }
        assert_eq!(w.max(), 1);
        w.record(t0 + Duration::from_millis(4_999));
        assert_eq!(w.max(), 2);
    }

    #[test]
    fn a_burst_counts_every_event_in_it() {
        let t0 = Instant::now();
        let mut w = SlidingWindowMax::new(Duration::from_secs(1));
        for n in 0..40 {
            w.record(t0 + Duration::from_millis(n * 24));
        }
        assert_eq!(w.max(), 40);
    }

    #[test]
    fn timestamps_are_written_with_milliseconds_in_utc() {
        let t = DateTime::parse_from_rfc3339("2026-11-29T21:29:05+01:00")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(rfc3339_ms::format(&t), "2026-11-29T20:29:05.000Z");
        let r = KeyRequest {
            at: t,
            status: 202,
            kind: AnswerKind::Scripted,
            traceparent: None,
        };
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["at"], "2026-11-29T20:29:05.000Z");
        assert_eq!(json["kind"], "scripted");
        assert_eq!(serde_json::from_value::<KeyRequest>(json).unwrap(), r);
    }
}
