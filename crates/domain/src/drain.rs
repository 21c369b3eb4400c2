//! The drain model: what a channel's buckets admit together, how long owed work takes at that
//! rate, when each piece of it gets its turn, and which would expire first.
//!
//! `nudgectl estimate-drain`, the relay's in-flight window and the redrive's selection all ask
//! these questions; they are answered here once, as plain functions of numbers and times. The
//! callers read the ledger and pass the rows in.
//!
//! **Admitted rate.** A bucket counts towards a channel's admitted rate R when it is not paused
//! at `now`, its configured rate is above 0 and its effective rate is above 0
//! ([`BucketRates::idle_at`]); R is the sum of the effective rates of the buckets that count
//! ([`admitted_rate`]). A channel with no bucket at all is not limited by admission (`None`).
//! This Rust is the one definition wherever a round trip allows it: the relay
//! (`Ledger::channel_rate`) reads its channel's bucket rows in the one query it made before and
//! calls [`admitted_rate`]. The worker's fence (the last statement before a send) keeps its own
//! SQL form of [`BucketRates::idle_at`] inside its conditional `UPDATE`, because asking Rust
//! there would cost a round trip per send; a ledger test holds the two together.
//!
//! **Turns.** At R, owed work is sent one slot of `1 / R` seconds after another: the k-th
//! (from 1) has its turn at the start of its slot, `now + (k - 1) / R` ([`turn_at`]), and its
//! slot ends where the next one's starts. The redrive excludes a dead letter that expires by
//! the start of its turn (it is fed then); the estimate reports one that expires by the end of
//! its slot ([`expiring_before_turn`]), so that a floor never hides a delivery that may miss
//! its send.
//! `n` sends take [`drain_s`]`(n, R) = n / R`: the end of the n-th slot.
//!
//! **Floor.** With B owed now, N more falling due during the drain and an admitted rate R, the
//! drain takes at least T = (B + N) / R (docs/DESIGN.md). N depends on T, so T is found by iterating
//! T ← (B + N(T)) / R from B / R until it stops growing ([`DrainIteration`]). It is a floor:
//! every admitted slot is assumed to send this channel's owed work in due order, so failed
//! sends, 429 slowdowns and lane reserves only lengthen it.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::DeliveryId;

/// The longest drain estimated; past it the answer is "not within 7 days".
pub const MAX_HORIZON_S: f64 = 7.0 * 24.0 * 3600.0;
/// Arrivals close to the rate make the iteration converge slowly; past this many steps the
/// floor is reported as a lower bound.
pub const MAX_ITERATIONS: u32 = 64;
/// How many delivery ids the expiry report lists.
pub const LISTED_IDS: usize = 10;

/// A bucket's rates as the ledger holds them: what decides whether it admits anything now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketRates {
    /// The configured rate; 0 is the operator's stop switch.
    pub rate_per_second: f64,
    /// The rate after 429 feedback.
    pub effective_rate: f64,
    /// A provider's `Retry-After` pause, for every replica.
    pub paused_until: Option<DateTime<Utc>>,
}

/// Why a bucket admits nothing now, in the order it is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idle {
    /// Paused by a provider's `Retry-After` until then.
    Paused { until: DateTime<Utc> },
    /// The operator set its rate to 0.
    Stopped,
    /// 429 feedback brought its effective rate to 0.
    Throttled,
}

impl BucketRates {
    /// Why the bucket admits nothing at `now`; `None` when its effective rate counts.
    ///
    /// The worker's fence (`FENCE` in `nudge-ledger`'s `deliveries/lease.rs`) holds the same
    /// rule in SQL (`rate_per_second <= 0 OR effective_rate <= 0 OR paused_until > now`); the
    /// ledger's bucket tests compare the two on the same rows.
    pub fn idle_at(&self, now: DateTime<Utc>) -> Option<Idle> {
        if let Some(until) = self.paused_until.filter(|until| *until > now) {
            Some(Idle::Paused { until })
        } else if self.rate_per_second <= 0.0 {
            Some(Idle::Stopped)
        } else if self.effective_rate <= 0.0 {
            Some(Idle::Throttled)
        } else {
            None
        }
    }
}

/// R for a channel whose buckets are `buckets`: the sum of the effective rates of those that
/// admit at `now`. `None` when there is no bucket at all: a channel without one is not limited
/// by admission, so there is no rate to drain at.
pub fn admitted_rate(
    buckets: impl IntoIterator<Item = BucketRates>,
    now: DateTime<Utc>,
) -> Option<f64> {
    let mut any = false;
    // A fold from +0: an empty f64 sum is -0, which would print as "-0/s".
    let rate = buckets.into_iter().fold(0.0, |sum, bucket| {
        any = true;
        if bucket.idle_at(now).is_none() {
            sum + bucket.effective_rate
        } else {
            sum
        }
    });
    any.then_some(rate)
}

/// Seconds `count` sends take at `rate` per second: the end of the `count`-th slot. Infinite
/// when the rate admits nothing (0, negative or not a number) and there is something to send.
pub fn drain_s(count: u64, rate: f64) -> f64 {
    if count == 0 {
        0.0
    } else if admits(rate) {
        count as f64 / rate
    } else {
        f64::INFINITY
    }
}

/// Seconds from now to the `k`-th turn (from 1; 0 is read as 1) at `rate` per second: the
/// first goes now, each next one a slot of `1 / rate` later. Infinite when the rate admits
/// nothing, except for the first.
pub fn turn_s(k: u64, rate: f64) -> f64 {
    drain_s(k.saturating_sub(1), rate)
}

/// When the `k`-th (from 1) of work sent at `rate` per second in order has its turn:
/// `now + (k - 1) / rate`, to the microsecond; `None` when it never comes (the rate admits
/// nothing) or lies past what a timestamp holds.
///
/// The redrive's selection computes the same instant in SQL (`crates/ledger/src/redrive.rs`).
pub fn turn_at(now: DateTime<Utc>, k: u64, rate: f64) -> Option<DateTime<Utc>> {
    let s = turn_s(k, rate);
    if !s.is_finite() {
        return None;
    }
    let micros = (s * 1e6).round();
    // Beyond i64 microseconds (about 292,000 years) there is no timestamp to give.
    if micros >= i64::MAX as f64 {
        return None;
    }
    now.checked_add_signed(chrono::Duration::microseconds(micros as i64))
}

fn admits(rate: f64) -> bool {
    rate > 0.0 && rate.is_finite()
}

/// The drain floor of one channel.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DrainFloor {
    /// N: what falls due over the horizon last counted.
    pub arrivals: u64,
    /// The horizon N was last counted over, in seconds from now.
    pub horizon_s: f64,
    /// T = (B + N) / R in seconds, at most [`MAX_HORIZON_S`].
    pub floor_s: f64,
    /// How many times N was counted.
    pub iterations: u32,
    /// T stopped growing. Otherwise `floor_s` is a lower bound: either the horizon reached
    /// 7 days (`capped`) or the iteration stopped after [`MAX_ITERATIONS`].
    pub converged: bool,
    /// The drain does not finish within 7 days.
    pub capped: bool,
}

/// The fixed-point iteration T_{k+1} = (B + N(T_k)) / R from T_0 = B / R, one step at a time,
/// so the caller counts N (a ledger query) between steps:
///
/// ```text
/// while let Some(horizon_s) = iteration.next_horizon_s() {
///     iteration.record(arrivals_within(horizon_s));
/// }
/// let floor = iteration.finish();
/// ```
///
/// N never decreases as the horizon grows, so T never shrinks: it stops when N stays the same
/// (T is then a fixed point), when T reaches 7 days, or after [`MAX_ITERATIONS`].
#[derive(Debug, Clone)]
pub struct DrainIteration {
    backlog: u64,
    rate: f64,
    horizon_s: f64,
    arrivals: u64,
    iterations: u32,
    done: bool,
    converged: bool,
    capped: bool,
}

impl DrainIteration {
    /// `None` when `rate` admits nothing (0, negative or not a number): nothing drains.
    pub fn new(backlog: u64, rate: f64) -> Option<Self> {
        if !admits(rate) {
            return None;
        }
        let t0 = drain_s(backlog, rate);
        let capped = t0 >= MAX_HORIZON_S;
        Some(Self {
            backlog,
            rate,
            horizon_s: t0.min(MAX_HORIZON_S),
            arrivals: 0,
            iterations: 0,
            // Nothing owed: nothing to drain, whatever arrives later.
            done: backlog == 0,
            converged: backlog == 0,
            capped,
        })
    }

    /// The horizon (seconds from now) to count arrivals over next; `None` once finished.
    pub fn next_horizon_s(&self) -> Option<f64> {
        (!self.done).then_some(self.horizon_s)
    }

    /// Records N over the horizon last given by [`next_horizon_s`](Self::next_horizon_s).
    pub fn record(&mut self, arrivals: u64) {
        if self.done {
            return;
        }
        self.iterations += 1;
        if self.capped {
            // B alone takes 7 days: N over those 7 days is only for the report.
            self.arrivals = arrivals;
            self.done = true;
            return;
        }
        if arrivals <= self.arrivals {
            self.converged = true;
            self.done = true;
            return;
        }
        self.arrivals = arrivals;
        let next = self.floor_s();
        if next >= MAX_HORIZON_S {
            self.horizon_s = MAX_HORIZON_S;
            self.capped = true;
            self.done = true;
        } else {
            self.horizon_s = next;
            self.done = self.iterations >= MAX_ITERATIONS;
        }
    }

    fn floor_s(&self) -> f64 {
        drain_s(self.backlog.saturating_add(self.arrivals), self.rate).min(MAX_HORIZON_S)
    }

    /// The floor as far as the iteration went.
    pub fn finish(&self) -> DrainFloor {
        DrainFloor {
            arrivals: self.arrivals,
            horizon_s: self.horizon_s,
            floor_s: self.floor_s(),
            iterations: self.iterations,
            converged: self.converged && !self.capped,
            capped: self.capped,
        }
    }
}

/// The drain floor for `backlog` owed now at `rate` per second, where `arrivals(t)` is how
/// much falls due within `t` seconds from now; `None` when the rate admits nothing.
pub fn drain_floor(
    backlog: u64,
    rate: f64,
    mut arrivals: impl FnMut(f64) -> u64,
) -> Option<DrainFloor> {
    let mut iteration = DrainIteration::new(backlog, rate)?;
    while let Some(horizon_s) = iteration.next_horizon_s() {
        iteration.record(arrivals(horizon_s));
    }
    Some(iteration.finish())
}

/// One owed delivery, in the order it would be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwedDelivery {
    pub id: DeliveryId,
    /// When it came due (for one in flight: when it last came due, else its last attempt).
    pub next_attempt_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// Leased by a worker: already admitted, not waiting for a send slot.
    pub in_flight: bool,
}

/// The owed deliveries that would expire before their turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Expiring {
    pub count: u64,
    /// The first [`LISTED_IDS`] of them, in send order.
    pub delivery_ids: Vec<DeliveryId>,
    /// How many owed deliveries were walked.
    pub walked: u64,
}

/// Walks `owed` in send order and counts those that expire by the end of their slot: the k-th
/// (from 1) when its `expires_at` is at or before `now + k / rate`, the start of the next turn
/// ([`turn_s`]`(k + 1)`). One in flight holds its place in the order but has already been
/// admitted, so it is never counted. With no rate nothing waiting is ever sent, so every
/// waiting delivery counts.
pub fn expiring_before_turn(now: DateTime<Utc>, rate: f64, owed: &[OwedDelivery]) -> Expiring {
    let mut expiring = Expiring {
        count: 0,
        delivery_ids: Vec::new(),
        walked: owed.len() as u64,
    };
    for (position, delivery) in (1u64..).zip(owed) {
        if delivery.in_flight {
            continue;
        }
        let slot_end_s = turn_s(position.saturating_add(1), rate);
        if seconds_from(now, delivery.expires_at) <= slot_end_s {
            expiring.count += 1;
            if expiring.delivery_ids.len() < LISTED_IDS {
                expiring.delivery_ids.push(delivery.id);
            }
        }
    }
    expiring
}

fn seconds_from(now: DateTime<Utc>, at: DateTime<Utc>) -> f64 {
    let d = at - now;
    d.num_microseconds()
        .map_or_else(|| d.num_milliseconds() as f64 / 1e3, |us| us as f64 / 1e6)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use chrono::TimeZone;
    use proptest::prelude::*;

    use super::*;

    fn t0() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 29, 9, 0, 0).unwrap()
    }

    fn secs(s: i64) -> chrono::Duration {
        chrono::Duration::seconds(s)
    }

    /// `n` owed deliveries, due in order, each expiring an hour from `t0`.
    fn owed(n: usize) -> Vec<OwedDelivery> {
        (0..n)
            .map(|i| OwedDelivery {
                id: DeliveryId::new(),
                next_attempt_at: t0() - secs(600 - i as i64 % 600),
                expires_at: t0() + chrono::Duration::hours(1),
                in_flight: false,
            })
            .collect()
    }

    fn bucket(rate: f64, effective: f64) -> BucketRates {
        BucketRates {
            rate_per_second: rate,
            effective_rate: effective,
            paused_until: None,
        }
    }

    #[test]
    fn a_backlog_with_arrivals_spread_over_the_drain_reaches_the_floor_of_the_whole() {
        // 300 arrive evenly over the 30 s the whole takes: 10 a second.
        let uniform = |t: f64| (10.0 * t).min(300.0) as u64;

        let floor = drain_floor(900, 40.0, uniform).unwrap();

        assert!(floor.converged, "{floor:?}");
        assert!(!floor.capped);
        assert!((29.9..=30.0).contains(&floor.floor_s), "{floor:?}");
        assert!((297..=300).contains(&floor.arrivals), "{floor:?}");
        assert!(floor.iterations <= MAX_ITERATIONS);
    }

    #[test]
    fn the_seed_example_is_three_hundred_seconds() {
        // docs/DESIGN.md: 9,000 owed, 3,000 more arriving, 40 req/s.
        let floor = drain_floor(9000, 40.0, |t| (10.0 * t).min(3000.0) as u64).unwrap();
        assert!((299.0..=300.0).contains(&floor.floor_s), "{floor:?}");
    }

    #[test]
    fn with_no_arrivals_the_floor_is_the_backlog_over_the_rate_after_one_count() {
        let mut horizons = Vec::new();
        let floor = drain_floor(900, 40.0, |t| {
            horizons.push(t);
            0
        })
        .unwrap();
        assert_eq!(floor.floor_s, 22.5);
        assert_eq!(horizons, [22.5]);
        assert!(floor.converged);
    }

    #[test]
    fn nothing_owed_drains_at_once_without_counting_arrivals() {
        let floor = drain_floor(0, 40.0, |_| panic!("no need to count")).unwrap();
        assert_eq!(floor.floor_s, 0.0);
        assert!(floor.converged);
    }

    #[test]
    fn a_rate_of_zero_will_not_drain() {
        assert_eq!(drain_floor(900, 0.0, |_| 0), None);
        assert_eq!(drain_floor(900, f64::NAN, |_| 0), None);
    }

    #[test]
    fn arrivals_faster_than_the_rate_cap_the_drain_at_seven_days() {
        // 50 a second arrive, 40 a second leave.
        let floor = drain_floor(900, 40.0, |t| (50.0 * t) as u64).unwrap();
        assert!(floor.capped, "{floor:?}");
        assert!(!floor.converged);
        assert_eq!(floor.floor_s, MAX_HORIZON_S);
    }

    #[test]
    fn a_backlog_longer_than_seven_days_is_capped_and_still_counts_arrivals_once() {
        let mut counts = 0;
        let floor = drain_floor(10_000_000, 1.0, |_| {
            counts += 1;
            5
        })
        .unwrap();
        assert!(floor.capped);
        assert_eq!(floor.arrivals, 5);
        assert_eq!(counts, 1);
    }

    #[test]
    fn arrivals_nearly_as_fast_as_the_rate_stop_after_the_iteration_cap_as_a_lower_bound() {
        // 39.9 a second arrive against 40: the fixed point is 9000 s, reached very slowly.
        let floor = drain_floor(900, 40.0, |t| (39.9 * t) as u64).unwrap();
        assert_eq!(floor.iterations, MAX_ITERATIONS);
        assert!(!floor.converged && !floor.capped, "{floor:?}");
        assert!(floor.floor_s < 9000.0);
    }

    #[test]
    fn a_delivery_expiring_before_its_place_in_line_is_reported() {
        let mut owed = owed(900);
        // Position 400's slot ends at 10 s; position 100's at 2.5 s.
        owed[399].expires_at = t0() + secs(5);
        owed[99].expires_at = t0() + secs(5);

        let expiring = expiring_before_turn(t0(), 40.0, &owed);

        assert_eq!(expiring.count, 1);
        assert_eq!(expiring.delivery_ids, [owed[399].id]);
        assert_eq!(expiring.walked, 900);
    }

    #[test]
    fn the_report_lists_ten_ids_and_counts_them_all() {
        let mut owed = owed(50);
        for d in &mut owed {
            d.expires_at = t0();
        }
        let expiring = expiring_before_turn(t0(), 40.0, &owed);
        assert_eq!(expiring.count, 50);
        assert_eq!(expiring.delivery_ids.len(), LISTED_IDS);
        assert_eq!(expiring.delivery_ids[0], owed[0].id);
    }

    #[test]
    fn one_in_flight_holds_its_place_but_is_never_reported() {
        let mut owed = owed(3);
        owed[0].in_flight = true;
        owed[0].expires_at = t0();
        // Position 2 at 1 rps: its slot ends at 2 s.
        owed[1].expires_at = t0() + secs(2);
        let expiring = expiring_before_turn(t0(), 1.0, &owed);
        assert_eq!(expiring.delivery_ids, [owed[1].id]);
    }

    #[test]
    fn with_no_rate_every_waiting_delivery_expires_before_its_turn() {
        let mut owed = owed(12);
        owed[0].in_flight = true;
        let expiring = expiring_before_turn(t0(), 0.0, &owed);
        assert_eq!(expiring.count, 11);
    }

    #[test]
    fn the_first_turn_is_now_and_each_next_one_a_slot_later() {
        assert_eq!(turn_at(t0(), 1, 0.1), Some(t0()));
        assert_eq!(turn_at(t0(), 2, 0.1), Some(t0() + secs(10)));
        assert_eq!(turn_at(t0(), 3, 0.1), Some(t0() + secs(20)));
        assert_eq!(turn_at(t0(), 0, 0.1), Some(t0()), "0 is read as the first");
        assert_eq!(
            turn_at(t0(), 2, 3.0),
            Some(t0() + chrono::Duration::microseconds(333_333))
        );
    }

    #[test]
    fn with_no_rate_only_the_first_turn_comes() {
        assert_eq!(turn_at(t0(), 1, 0.0), Some(t0()));
        assert_eq!(turn_at(t0(), 2, 0.0), None);
        assert_eq!(turn_at(t0(), 2, f64::NAN), None);
        assert_eq!(turn_at(t0(), u64::MAX, 1e-9), None, "past any timestamp");
    }

    #[test]
    fn n_sends_take_n_slots() {
        assert_eq!(drain_s(6, 0.1), 60.0);
        assert_eq!(drain_s(0, 0.0), 0.0);
        assert_eq!(drain_s(1, 0.0), f64::INFINITY);
        assert_eq!(drain_s(5, 2.0), turn_s(6, 2.0), "the end of the 5th slot");
    }

    #[test]
    fn the_admitted_rate_sums_the_effective_rates_of_the_buckets_that_send() {
        let main = bucket(40.0, 25.0);
        let paused = BucketRates {
            paused_until: Some(t0() + secs(10)),
            ..bucket(30.0, 30.0)
        };
        let resumed = BucketRates {
            paused_until: Some(t0() - secs(1)),
            ..bucket(5.0, 5.0)
        };
        let stopped = bucket(0.0, 0.0);

        assert_eq!(
            admitted_rate([main, paused, resumed, stopped], t0()),
            Some(30.0)
        );
        assert_eq!(main.idle_at(t0()), None);
        assert_eq!(
            paused.idle_at(t0()),
            Some(Idle::Paused {
                until: t0() + secs(10)
            })
        );
        assert_eq!(paused.idle_at(t0() + secs(10)), None, "the pause has ended");
        assert_eq!(resumed.idle_at(t0()), None);
        assert_eq!(stopped.idle_at(t0()), Some(Idle::Stopped));
    }

    #[test]
    fn a_stopped_bucket_admits_nothing_whatever_its_effective_rate_says() {
        assert_eq!(bucket(0.0, 10.0).idle_at(t0()), Some(Idle::Stopped));
        assert_eq!(bucket(10.0, 0.0).idle_at(t0()), Some(Idle::Throttled));
        assert_eq!(bucket(10.0, -1.0).idle_at(t0()), Some(Idle::Throttled));
        assert_eq!(
            admitted_rate([bucket(0.0, 10.0), bucket(10.0, -1.0)], t0()),
            Some(0.0)
        );
    }

    #[test]
    fn a_channel_whose_buckets_all_admit_nothing_has_a_rate_of_positive_zero() {
        let rate = admitted_rate([bucket(0.0, 0.0), bucket(10.0, 0.0)], t0());
        assert_eq!(rate, Some(0.0));
        assert!(rate.unwrap().is_sign_positive(), "prints as 0, not -0");
    }

    #[test]
    fn a_channel_without_buckets_is_not_limited() {
        assert_eq!(admitted_rate([], t0()), None);
    }

    fn any_bucket() -> impl Strategy<Value = BucketRates> {
        (
            prop_oneof![Just(0.0), 0.0..1000.0f64],
            prop_oneof![Just(0.0), -10.0..1000.0f64],
            proptest::option::of(-60i64..60),
        )
            .prop_map(|(rate, effective, paused)| BucketRates {
                rate_per_second: rate,
                effective_rate: effective,
                paused_until: paused.map(|s| t0() + secs(s)),
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn the_floor_is_never_below_the_backlog_over_the_rate_nor_above_seven_days(
            backlog in 0u64..10_000_000,
            rate in 0.01f64..1000.0,
            per_second in 0.0f64..2000.0,
            cap in 0u64..10_000_000,
        ) {
            // Arrivals at a steady pace up to a cap: never decreasing with the horizon.
            let floor = drain_floor(backlog, rate, |t| ((per_second * t) as u64).min(cap)).unwrap();
            let least = (backlog as f64 / rate).min(MAX_HORIZON_S);
            prop_assert!(floor.floor_s >= least, "{floor:?} < {least}");
            prop_assert!(floor.floor_s <= MAX_HORIZON_S);
            prop_assert!(floor.iterations <= MAX_ITERATIONS);
            prop_assert!(!(floor.converged && floor.capped));
            if floor.converged {
                let whole = drain_s(backlog + floor.arrivals, rate);
                prop_assert!((floor.floor_s - whole).abs() <= 1e-9 * whole.max(1.0));
            }
        }

        #[test]
        fn turns_come_in_order_one_slot_apart(
            k in 1u64..1_000_000,
            rate in 0.001f64..10_000.0,
        ) {
            let this = turn_s(k, rate);
            let next = turn_s(k + 1, rate);
            prop_assert!(next >= this);
            prop_assert!((next - this - 1.0 / rate).abs() <= 1e-6 * next.max(1.0));
            let at = turn_at(t0(), k, rate).unwrap();
            let at_next = turn_at(t0(), k + 1, rate).unwrap();
            prop_assert!(at >= t0() && at_next >= at);
        }

        #[test]
        fn a_faster_rate_never_makes_more_expire_before_their_turn(
            expiries in proptest::collection::vec((0i64..120, any::<bool>()), 0..60),
            rate in 0.01f64..50.0,
            faster_by in 1.0f64..10.0,
        ) {
            let owed: Vec<OwedDelivery> = expiries
                .iter()
                .map(|&(s, in_flight)| OwedDelivery {
                    id: DeliveryId::new(),
                    next_attempt_at: t0(),
                    expires_at: t0() + secs(s),
                    in_flight,
                })
                .collect();
            let slow = expiring_before_turn(t0(), rate, &owed);
            let fast = expiring_before_turn(t0(), rate * faster_by, &owed);
            let waiting = owed.iter().filter(|d| !d.in_flight).count() as u64;
            prop_assert!(fast.count <= slow.count);
            prop_assert!(slow.count <= waiting);
            prop_assert_eq!(expiring_before_turn(t0(), 0.0, &owed).count, waiting);
        }

        #[test]
        fn the_admitted_rate_is_the_sum_of_what_each_bucket_admits(
            buckets in proptest::collection::vec(any_bucket(), 0..8),
        ) {
            let rate = admitted_rate(buckets.iter().copied(), t0());
            prop_assert_eq!(rate.is_none(), buckets.is_empty());
            let rate = rate.unwrap_or(0.0);
            prop_assert!(rate >= 0.0 && rate.is_sign_positive());
            let counted: f64 = buckets
                .iter()
                .filter(|b| b.idle_at(t0()).is_none())
                .map(|b| b.effective_rate)
                .sum();
            prop_assert!((rate - counted).abs() <= 1e-9 * counted.max(1.0));
            // Pausing every bucket past now leaves nothing admitted.
            let paused = buckets.iter().map(|b| BucketRates {
                paused_until: Some(t0() + secs(1)),
                ..*b
            });
            prop_assert_eq!(admitted_rate(paused, t0()).unwrap_or(0.0), 0.0);
        }
    }
}
