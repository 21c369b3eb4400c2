//! `estimate-drain`: how long each channel's owed work takes to drain at the rate its buckets
//! admit, and which deliveries would expire before their turn.
//!
//! The model is the floor of DESIGN.md: with B owed now, N more falling due during the drain
//! and an admitted rate R, the drain takes at least T = (B + N) / R. N depends on T, so T is
//! found by iterating T ← (B + N(T)) / R from B / R until it stops growing
//! ([`DrainIteration`]). It is a floor: every admitted slot is assumed to send this channel's
//! owed work in due order, so failed sends, 429 slowdowns and lane reserves only lengthen it.
//!
//! The arithmetic (the iteration, the expiry walk, which buckets count) is plain functions,
//! tested below; the ledger answers B, N over a horizon and the owed deliveries in due order.
//! Output names deliveries by id only, never anything about the subscriber.

use std::io::Write;

use anyhow::Context;
use chrono::{DateTime, Utc};
use nudge_domain::{Channel, DeliveryId};
use nudge_ledger::{Backlog, Ledger, OwedDelivery, RateBucket};
use serde::Serialize;

use crate::rate::timestamp;

/// The longest drain estimated; past it the answer is "not within 7 days".
pub const MAX_HORIZON_S: f64 = 7.0 * 24.0 * 3600.0;
/// Arrivals close to the rate make the iteration converge slowly; past this many steps the
/// floor is reported as a lower bound.
pub const MAX_ITERATIONS: u32 = 64;
/// How many delivery ids the expiry report lists.
pub const LISTED_IDS: usize = 10;
/// The most owed deliveries walked for expiry; a larger backlog is walked in part (and says so).
const WALK_LIMIT: u64 = 250_000;

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
        if !(rate > 0.0 && rate.is_finite()) {
            return None;
        }
        let t0 = backlog as f64 / rate;
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
        (self.backlog.saturating_add(self.arrivals) as f64 / self.rate).min(MAX_HORIZON_S)
    }

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

/// The owed deliveries that would expire before their turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Expiring {
    pub count: u64,
    /// The first [`LISTED_IDS`] of them, in send order.
    pub delivery_ids: Vec<DeliveryId>,
    /// How many owed deliveries were walked.
    pub walked: u64,
}

/// Walks `owed` in send order, giving the k-th (from 1) the send time `now + k / rate`, and
/// counts those whose `expires_at` is at or before it. One in flight holds its place in the
/// order but has already been admitted, so it is never counted. With no rate nothing waiting
/// is ever sent, so every waiting delivery counts.
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
        let turn_s = if rate > 0.0 {
            position as f64 / rate
        } else {
            f64::INFINITY
        };
        if seconds_from(now, delivery.expires_at) <= turn_s {
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

/// One bucket of the channel, and whether its rate counts towards what is admitted now.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BucketShare {
    pub account: String,
    pub rate_per_second: f64,
    pub effective_rate: f64,
    pub burst: u32,
    pub paused_until: Option<DateTime<Utc>>,
    /// Its effective rate is part of R.
    pub counted: bool,
    /// Why it admits nothing now, when it does not count.
    pub note: Option<String>,
}

/// R for `channel`: the sum of the effective rates of its buckets that are not paused at
/// `now`, with each bucket's share; `None` when the channel has no bucket at all (a provider
/// account without a bucket is not limited by admission).
pub fn admitted_rate(
    channel: Channel,
    buckets: &[RateBucket],
    now: DateTime<Utc>,
) -> (Option<f64>, Vec<BucketShare>) {
    let shares: Vec<BucketShare> = buckets
        .iter()
        .filter(|b| b.channel == channel)
        .map(|b| {
            let note = if let Some(until) = b.paused_until.filter(|until| *until > now) {
                Some(format!(
                    "paused until {} (provider Retry-After)",
                    timestamp(until)
                ))
            } else if b.rate_per_second <= 0.0 {
                Some("stopped (rate 0)".to_owned())
            } else if b.effective_rate <= 0.0 {
                Some("effective rate 0 after 429s".to_owned())
            } else {
                None
            };
            BucketShare {
                account: b.account.as_str().to_owned(),
                rate_per_second: b.rate_per_second,
                effective_rate: b.effective_rate,
                burst: b.burst,
                paused_until: b.paused_until,
                counted: note.is_none(),
                note,
            }
        })
        .collect();
    if shares.is_empty() {
        return (None, shares);
    }
    // A fold from +0: an empty f64 sum is -0, which would print as "-0/s".
    let rate = shares
        .iter()
        .filter(|s| s.counted)
        .fold(0.0, |sum, s| sum + s.effective_rate);
    (Some(rate), shares)
}

/// Why nothing is admitted, naming each bucket.
fn stalled_reason(shares: &[BucketShare]) -> String {
    let buckets: Vec<String> = shares
        .iter()
        .map(|s| {
            format!(
                "{} {}",
                s.account,
                s.note.as_deref().unwrap_or("admits 0/s")
            )
        })
        .collect();
    format!("admitted rate is 0: {}", buckets.join("; "))
}

/// The estimate for one channel, as `--json` prints it.
#[derive(Debug, Serialize)]
pub(crate) struct ChannelEstimate {
    channel: Channel,
    /// B: owed now (due + sending).
    backlog: u64,
    backlog_due: u64,
    backlog_sending: u64,
    /// Whether any bucket limits the channel; without one there is no floor to estimate.
    limited: bool,
    /// R, sends per second; null when not limited.
    rate_per_second: Option<f64>,
    /// N over `horizon_s`.
    arrivals: u64,
    horizon_s: f64,
    /// The backlog drains within 7 days at R.
    drains: bool,
    /// (B + N) / R; null when R is 0 or the channel is not limited.
    floor_s: Option<f64>,
    converged: bool,
    capped: bool,
    iterations: u32,
    stalled_reason: Option<String>,
    buckets: Vec<BucketShare>,
    /// Null when the channel is not limited.
    expiring: Option<ExpiringReport>,
}

#[derive(Debug, Serialize)]
struct ExpiringReport {
    #[serde(flatten)]
    expiring: Expiring,
    /// Every owed delivery was walked (false past 250,000).
    complete: bool,
}

/// Estimates every channel (or one) and prints a report or JSON.
pub(crate) async fn estimate_drain(
    ledger: &Ledger,
    channel: Option<Channel>,
    json: bool,
    now: DateTime<Utc>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let buckets = ledger
        .rate_buckets()
        .await
        .context("failed to read the rate buckets")?;
    let channels = channel.map_or_else(|| Channel::ALL.to_vec(), |c| vec![c]);
    let mut estimates = Vec::with_capacity(channels.len());
    for channel in channels {
        estimates.push(
            estimate_channel(ledger, channel, &buckets, now)
                .await
                .with_context(|| format!("failed to estimate the {channel} drain"))?,
        );
    }
    if json {
        serde_json::to_writer_pretty(
            &mut *out,
            &serde_json::json!({ "now": now, "channels": estimates }),
        )?;
        writeln!(out)?;
    } else {
        for estimate in &estimates {
            write_estimate(estimate, out)?;
        }
    }
    Ok(())
}

async fn estimate_channel(
    ledger: &Ledger,
    channel: Channel,
    buckets: &[RateBucket],
    now: DateTime<Utc>,
) -> anyhow::Result<ChannelEstimate> {
    let backlog: Backlog = ledger.backlog(channel, now).await?;
    let (rate, shares) = admitted_rate(channel, buckets, now);
    let mut estimate = ChannelEstimate {
        channel,
        backlog: backlog.total(),
        backlog_due: backlog.due,
        backlog_sending: backlog.sending,
        limited: rate.is_some(),
        rate_per_second: rate,
        arrivals: 0,
        horizon_s: 0.0,
        drains: true,
        floor_s: None,
        converged: false,
        capped: false,
        iterations: 0,
        stalled_reason: None,
        buckets: shares,
        expiring: None,
    };
    let Some(rate) = rate else {
        return Ok(estimate);
    };

    let owed = ledger.owed_in_due_order(channel, now, WALK_LIMIT).await?;
    estimate.expiring = Some(ExpiringReport {
        expiring: expiring_before_turn(now, rate, &owed),
        complete: (owed.len() as u64) < WALK_LIMIT,
    });

    match DrainIteration::new(backlog.total(), rate) {
        Some(mut iteration) => {
            while let Some(horizon_s) = iteration.next_horizon_s() {
                let n = ledger
                    .arrivals(channel, now, now + seconds(horizon_s))
                    .await?;
                iteration.record(n);
            }
            let floor = iteration.finish();
            estimate.arrivals = floor.arrivals;
            estimate.horizon_s = floor.horizon_s;
            estimate.drains = !floor.capped;
            estimate.floor_s = Some(floor.floor_s);
            estimate.converged = floor.converged;
            estimate.capped = floor.capped;
            estimate.iterations = floor.iterations;
        }
        None => {
            // Nothing drains; say how much more piles up over the longest horizon.
            estimate.arrivals = ledger
                .arrivals(channel, now, now + seconds(MAX_HORIZON_S))
                .await?;
            estimate.horizon_s = MAX_HORIZON_S;
            estimate.drains = false;
            estimate.iterations = 1;
            estimate.stalled_reason = Some(stalled_reason(&estimate.buckets));
        }
    }
    Ok(estimate)
}

fn seconds(s: f64) -> chrono::Duration {
    // At most 7 days, so the cast cannot saturate.
    chrono::Duration::milliseconds((s * 1000.0).ceil() as i64)
}

fn write_estimate(e: &ChannelEstimate, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{}: {} owed now ({} due, {} sending)",
        e.channel, e.backlog, e.backlog_due, e.backlog_sending
    )?;
    let Some(rate) = e.rate_per_second else {
        writeln!(
            out,
            "  no rate bucket: admission does not limit this channel, so there is no floor to \
             estimate"
        )?;
        return Ok(());
    };
    let shares: Vec<String> = e
        .buckets
        .iter()
        .map(|s| match &s.note {
            None => format!("{} {}/s", s.account, s.effective_rate),
            Some(note) => format!("{} not counted: {note}", s.account),
        })
        .collect();
    writeln!(out, "  admitted {rate}/s: {}", shares.join(", "))?;
    match (&e.stalled_reason, e.floor_s) {
        (Some(reason), _) => writeln!(
            out,
            "  will not drain: {reason}; {} more fall due in the next 7 days",
            e.arrivals
        )?,
        (None, Some(_)) if e.capped => writeln!(
            out,
            "  will not drain within 7 days: {} owed and {} falling due by then, at {rate}/s",
            e.backlog, e.arrivals
        )?,
        (None, Some(floor)) if e.converged => writeln!(
            out,
            "  floor {floor:.1} s = ({} owed + {} falling due during the drain) / {rate}/s",
            e.backlog, e.arrivals
        )?,
        (None, Some(floor)) => writeln!(
            out,
            "  floor at least {floor:.1} s = ({} owed + {} falling due) / {rate}/s; arrivals \
             nearly keep pace with the rate (stopped after {} iterations)",
            e.backlog, e.arrivals, e.iterations
        )?,
        (None, None) => {}
    }
    if let Some(report) = &e.expiring {
        let x = &report.expiring;
        write!(out, "  expiring before their turn: {}", x.count)?;
        if !x.delivery_ids.is_empty() {
            let ids: Vec<String> = x.delivery_ids.iter().map(ToString::to_string).collect();
            write!(out, " (first {}: {})", ids.len(), ids.join(", "))?;
        }
        if !report.complete {
            write!(out, " among the first {} owed walked", x.walked)?;
        }
        writeln!(out)?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use chrono::TimeZone;
    use nudge_domain::ProviderAccount;

    use super::*;

    fn t0() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 29, 9, 0, 0).unwrap()
    }

    /// `n` owed deliveries, due in order, each expiring an hour from `t0`.
    fn owed(n: usize) -> Vec<OwedDelivery> {
        (0..n)
            .map(|i| OwedDelivery {
                id: DeliveryId::new(),
                next_attempt_at: t0() - chrono::Duration::seconds(600 - i as i64 % 600),
                expires_at: t0() + chrono::Duration::hours(1),
                in_flight: false,
            })
            .collect()
    }

    fn bucket(account: &str, channel: Channel, rate: f64, effective: f64) -> RateBucket {
        RateBucket {
            account: ProviderAccount::parse(account).unwrap(),
            channel,
            rate_per_second: rate,
            burst: 1,
            effective_rate: effective,
            paused_until: None,
            pause_cause: None,
            reserve_new: 0.2,
            reserve_recovery: 0.1,
            changed_by: "ops".into(),
            changed_at: t0(),
            change_reason: None,
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
        // DESIGN.md: 9,000 owed, 3,000 more arriving, 40 req/s.
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
        // Position 400 goes at 10 s; position 100 at 2.5 s.
        owed[399].expires_at = t0() + chrono::Duration::seconds(5);
        owed[99].expires_at = t0() + chrono::Duration::seconds(5);

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
        // Position 2 at 1 rps goes at 2 s.
        owed[1].expires_at = t0() + chrono::Duration::seconds(2);
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
    fn the_admitted_rate_sums_the_effective_rates_of_the_buckets_that_send() {
        let mut paused = bucket("sms-paused", Channel::Sms, 30.0, 30.0);
        paused.paused_until = Some(t0() + chrono::Duration::seconds(10));
        let mut resumed = bucket("sms-resumed", Channel::Sms, 5.0, 5.0);
        resumed.paused_until = Some(t0() - chrono::Duration::seconds(1));
        let buckets = [
            bucket("email-main", Channel::Email, 100.0, 100.0),
            bucket("sms-main", Channel::Sms, 40.0, 25.0),
            paused,
            resumed,
            bucket("sms-stopped", Channel::Sms, 0.0, 0.0),
        ];

        let (rate, shares) = admitted_rate(Channel::Sms, &buckets, t0());

        assert_eq!(rate, Some(30.0));
        let counted: Vec<&str> = shares
            .iter()
            .filter(|s| s.counted)
            .map(|s| s.account.as_str())
            .collect();
        assert_eq!(counted, ["sms-main", "sms-resumed"]);
        assert!(
            shares[1]
                .note
                .as_deref()
                .unwrap()
                .starts_with("paused until")
        );
        assert_eq!(shares[3].note.as_deref(), Some("stopped (rate 0)"));
    }

    #[test]
    fn a_channel_whose_buckets_all_admit_nothing_says_why() {
        let buckets = [
            bucket("sms-main", Channel::Sms, 0.0, 0.0),
            bucket("sms-b", Channel::Sms, 10.0, 0.0),
        ];
        let (rate, shares) = admitted_rate(Channel::Sms, &buckets, t0());
        assert_eq!(rate, Some(0.0));
        assert!(rate.unwrap().is_sign_positive(), "prints as 0, not -0");
        assert_eq!(
            stalled_reason(&shares),
            "admitted rate is 0: sms-main stopped (rate 0); sms-b effective rate 0 after 429s"
        );
    }

    #[test]
    fn a_channel_without_buckets_is_not_limited() {
        let buckets = [bucket("email-main", Channel::Email, 100.0, 100.0)];
        let (rate, shares) = admitted_rate(Channel::Push, &buckets, t0());
        assert_eq!(rate, None);
        assert!(shares.is_empty());
    }
}
