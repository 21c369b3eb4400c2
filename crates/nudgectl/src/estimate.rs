//! `estimate-drain`: how long each channel's owed work takes to drain at the rate its buckets
//! admit, and which deliveries would expire before their turn.
//!
//! The model (the floor T = (B + N) / R and its iteration, which buckets count towards R, the
//! expiry walk) is `nudge_domain::drain`, shared with the relay and the redrive; this module
//! only asks the ledger for B, N over each horizon and the owed deliveries in due order, and
//! renders the answer. Output names deliveries by id only, never anything about the subscriber.

use std::io::Write;

use anyhow::Context;
use chrono::{DateTime, Utc};
use nudge_domain::Channel;
use nudge_domain::drain::{self, DrainIteration, Expiring, Idle, MAX_HORIZON_S};
use nudge_ledger::{Backlog, Ledger, RateBucket};
use serde::Serialize;

use crate::rate::timestamp;

/// The most owed deliveries walked for expiry; a larger backlog is walked in part (and says so).
const WALK_LIMIT: u64 = 250_000;

/// One bucket of the channel as the report shows it, and whether its rate counts towards
/// what is admitted now (`nudge_domain::drain::BucketRates::idle_at`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct BucketShare {
    account: String,
    rate_per_second: f64,
    effective_rate: f64,
    burst: u32,
    paused_until: Option<DateTime<Utc>>,
    /// Its effective rate is part of R.
    counted: bool,
    /// Why it admits nothing now, when it does not count.
    note: Option<String>,
}

/// R for `channel` (`nudge_domain::drain::admitted_rate` over its buckets) with each bucket's
/// share; `None` when the channel has no bucket at all.
fn bucket_shares(
    channel: Channel,
    buckets: &[RateBucket],
    now: DateTime<Utc>,
) -> (Option<f64>, Vec<BucketShare>) {
    let own: Vec<&RateBucket> = buckets.iter().filter(|b| b.channel == channel).collect();
    let rate = drain::admitted_rate(own.iter().map(|b| b.rates()), now);
    let shares = own
        .iter()
        .map(|b| {
            let note = b.rates().idle_at(now).map(|idle| match idle {
                Idle::Paused { until } => {
                    format!("paused until {} (provider Retry-After)", timestamp(until))
                }
                Idle::Stopped => "stopped (rate 0)".to_owned(),
                Idle::Throttled => "effective rate 0 after 429s".to_owned(),
            });
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
    (rate, shares)
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
    let (rate, shares) = bucket_shares(channel, buckets, now);
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
        expiring: drain::expiring_before_turn(now, rate, &owed),
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

    fn bucket(account: &str, channel: Channel, rate: f64, effective: f64) -> RateBucket {
        RateBucket {
            account: ProviderAccount::parse(account).unwrap(),
            channel,
            rate_per_second: rate,
            burst: 1,
            learned_burst: None,
            effective_rate: effective,
            paused_until: None,
            pause_cause: None,
            last_throttled_at: None,
            reserve_new: 0.2,
            reserve_recovery: 0.1,
            changed_by: "ops".into(),
            changed_at: t0(),
            change_reason: None,
        }
    }

    #[test]
    fn each_bucket_of_the_channel_says_whether_it_counts_and_why_not() {
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

        let (rate, shares) = bucket_shares(Channel::Sms, &buckets, t0());

        assert_eq!(rate, Some(30.0));
        let counted: Vec<&str> = shares
            .iter()
            .filter(|s| s.counted)
            .map(|s| s.account.as_str())
            .collect();
        assert_eq!(counted, ["sms-main", "sms-resumed"]);
        assert_eq!(
            shares[1].note.as_deref(),
            Some("paused until 2026-11-29T09:00:10Z (provider Retry-After)")
        );
        assert_eq!(shares[3].note.as_deref(), Some("stopped (rate 0)"));
    }

    #[test]
    fn a_channel_whose_buckets_all_admit_nothing_says_why() {
        let buckets = [
            bucket("sms-main", Channel::Sms, 0.0, 0.0),
            bucket("sms-b", Channel::Sms, 10.0, 0.0),
        ];
        let (rate, shares) = bucket_shares(Channel::Sms, &buckets, t0());
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
        let (rate, shares) = bucket_shares(Channel::Push, &buckets, t0());
        assert_eq!(rate, None);
        assert!(shares.is_empty());
    }
}
