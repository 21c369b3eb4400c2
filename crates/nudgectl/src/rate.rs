//! `rate set` and `rate list`: the shared rate buckets, one per provider account + channel.
//!
//! A bucket's rate is read by every worker replica at each admission, so a change here takes
//! effect within a second without a redeploy; rate 0 is the rollback switch (no new sends).

use std::fmt;
use std::io::Write;
use std::str::FromStr;

use anyhow::{Context, bail};
use chrono::{DateTime, SecondsFormat, Utc};
use nudge_domain::{Channel, ProviderAccount};
use nudge_ledger::{Ledger, RateBucket};
use serde::Serialize;

/// The highest rate accepted, far above any provider's limit; it keeps a mistyped rate (or a
/// default burst derived from it) within what the ledger stores.
const MAX_RATE: f64 = 1_000_000.0;

/// A bucket's configured rate as given on the command line: sends per second, a finite
/// number from 0 (stop sending) to 1,000,000.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RatePerSecond(f64);

/// Why a rate was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "PER_SECOND must be a number of sends per second from 0 to 1000000, e.g. 40 or 0.5 \
     (0 stops sending on the bucket); got {0:?}"
)]
pub struct RateError(String);

impl RatePerSecond {
    pub fn parse(text: &str) -> Result<Self, RateError> {
        let refused = || RateError(text.to_owned());
        let rate: f64 = text.trim().parse().map_err(|_| refused())?;
        // NaN and the infinities are outside the range too; `-0` is inside, and means 0.
        if !(0.0..=MAX_RATE).contains(&rate) {
            return Err(refused());
        }
        Ok(Self(rate.abs()))
    }

    pub fn get(self) -> f64 {
        self.0
    }

    /// Rate 0: the bucket admits no new sends.
    pub fn stops(self) -> bool {
        self.0 == 0.0
    }
}

impl FromStr for RatePerSecond {
    type Err = RateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for RatePerSecond {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

pub(crate) const SET_HELP: &str = "\
Set the rate of the shared bucket of a provider account + channel, creating the bucket if it \
does not exist. Every worker replica takes its send slots from this one bucket, and running \
workers read the change at their next admission: it takes effect within a second, without a \
restart or redeploy.

PER_SECOND is sends per second, a number from 0 to 1000000 (fractions allowed, e.g. 0.5). \
0 stops sending on that bucket: this is the rollback switch. Owed work is kept and waits \
(a worker holding a lease releases it), and sending resumes when the rate is raised again.

--burst is how many sends may go back to back, at least 1 (0 is accepted only with rate 0). \
Without it the bucket keeps its burst; a new bucket gets max(1, ceil(PER_SECOND)).

The effective rate (what 429 feedback currently admits) restarts at the new rate; a pause \
ordered by a provider's Retry-After is kept. The previous rate and burst are recorded in the \
audit row with --reason.";

/// Sets the rate, audits old and new values, and prints the new state.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn set(
    ledger: &Ledger,
    actor: &str,
    account: &ProviderAccount,
    channel: Channel,
    rate: RatePerSecond,
    burst: Option<u32>,
    reason: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    crate::require_reason(reason)?;
    if burst == Some(0) && !rate.stops() {
        bail!(
            "--burst must be at least 1 unless the rate is 0: a burst of 0 would admit no send \
             at {rate}/s"
        );
    }
    let by = crate::operator(ledger, actor, Some(reason)).await?;
    let now = by.at();
    let previous = ledger
        .rate_buckets()
        .await
        .context("failed to read the current bucket")?
        .into_iter()
        .find(|b| &b.account == account && b.channel == channel);
    // A stopped bucket may have burst 0; raising its rate needs a burst that admits something.
    let burst = match (burst, &previous) {
        (None, Some(p)) if p.burst == 0 && !rate.stops() => Some(default_burst(rate)),
        _ => burst,
    };
    let bucket = ledger
        .set_rate(account, channel, rate.get(), burst, &by)
        .await
        .context("failed to set the rate")?;

    let was = match &previous {
        Some(p) => format!("was {}/s, burst {}", p.rate_per_second, p.burst),
        None => "new bucket".to_owned(),
    };
    if rate.stops() {
        writeln!(
            out,
            "bucket {account}/{channel}: stopped, rate 0 ({was}): no new sends on this bucket \
             until the rate is raised"
        )?;
    } else {
        writeln!(
            out,
            "bucket {account}/{channel}: rate {}/s, burst {}, effective {}/s ({was})",
            bucket.rate_per_second, bucket.burst, bucket.effective_rate
        )?;
    }
    if let Some(until) = bucket.paused_until.filter(|until| *until > now) {
        writeln!(
            out,
            "the provider's pause (Retry-After) still holds until {}",
            timestamp(until)
        )?;
    }
    writeln!(
        out,
        "running workers pick it up at their next admission: takes effect within a second"
    )?;
    Ok(())
}

fn default_burst(rate: RatePerSecond) -> u32 {
    // The rate is at most MAX_RATE, so the cast cannot saturate.
    (rate.get().ceil() as u32).max(1)
}

/// A bucket as `rate list --json` prints it: a stable shape of its own, whatever the ledger
/// type grows.
#[derive(Debug, Serialize)]
pub(crate) struct BucketView<'a> {
    account: &'a str,
    channel: Channel,
    rate_per_second: f64,
    burst: u32,
    /// The smaller burst learnt from the provider's 429s, in force until the bucket is set.
    learned_burst: Option<u32>,
    effective_rate: f64,
    paused_until: Option<DateTime<Utc>>,
    pause_cause: Option<&'a str>,
    reserve_new: f64,
    reserve_recovery: f64,
    changed_by: &'a str,
    changed_at: DateTime<Utc>,
    change_reason: Option<&'a str>,
}

impl<'a> From<&'a RateBucket> for BucketView<'a> {
    fn from(b: &'a RateBucket) -> Self {
        Self {
            account: b.account.as_str(),
            channel: b.channel,
            rate_per_second: b.rate_per_second,
            burst: b.burst,
            learned_burst: b.learned_burst,
            effective_rate: b.effective_rate,
            paused_until: b.paused_until,
            pause_cause: b.pause_cause.as_deref(),
            reserve_new: b.reserve_new,
            reserve_recovery: b.reserve_recovery,
            changed_by: &b.changed_by,
            changed_at: b.changed_at,
            change_reason: b.change_reason.as_deref(),
        }
    }
}

pub(crate) async fn list(ledger: &Ledger, json: bool, out: &mut impl Write) -> anyhow::Result<()> {
    let buckets = ledger
        .rate_buckets()
        .await
        .context("failed to read the rate buckets")?;
    if json {
        let views: Vec<BucketView<'_>> = buckets.iter().map(BucketView::from).collect();
        serde_json::to_writer_pretty(&mut *out, &views)?;
        writeln!(out)?;
        return Ok(());
    }
    if buckets.is_empty() {
        writeln!(out, "{NO_BUCKETS}")?;
        return Ok(());
    }
    let width = account_width(&buckets);
    writeln!(
        out,
        "{:<width$} {:<7} {:>9} {:>11} {:>6} {:>7} {:<20} {:<16} {:<20} reason",
        "account",
        "channel",
        "rate/s",
        "effective/s",
        "burst",
        "learned",
        "paused_until",
        "changed_by",
        "changed_at",
    )?;
    for b in &buckets {
        writeln!(
            out,
            "{:<width$} {:<7} {:>9} {:>11} {:>6} {:>7} {:<20} {:<16} {:<20} {}",
            b.account.as_str(),
            b.channel.as_str(),
            b.rate_per_second,
            b.effective_rate,
            b.burst,
            b.learned_burst
                .map_or_else(|| "-".to_owned(), |l| l.to_string()),
            b.paused_until.map_or_else(|| "-".to_owned(), timestamp),
            b.changed_by,
            timestamp(b.changed_at),
            b.change_reason.as_deref().unwrap_or("-"),
        )?;
    }
    Ok(())
}

pub(crate) const RESUME_HELP: &str = "\
Clear the pause of the shared bucket of a provider account + channel: the pause a provider's \
429 with Retry-After put on it (at most admission.max_pause_s). The rate and burst are kept. \
Running workers send on it again at their next admission, within a second. The pause it \
cleared (its end and cause) is recorded in the audit log with the actor and --reason.";

/// Clears a bucket's pause, with its audit row in the same transaction.
pub(crate) async fn resume(
    ledger: &Ledger,
    actor: &str,
    account: &ProviderAccount,
    channel: Channel,
    reason: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    crate::require_reason(reason)?;
    let by = crate::operator(ledger, actor, Some(reason)).await?;
    let Some(bucket) = ledger
        .resume_bucket(account, channel, &by)
        .await
        .context("failed to resume the bucket")?
    else {
        bail!("no rate bucket {account}/{channel} (see `nudgectl rate list`)");
    };
    writeln!(
        out,
        "bucket {account}/{channel}: pause cleared; rate {}/s, effective {}/s; running workers \
         send on it again within a second",
        bucket.rate_per_second, bucket.effective_rate
    )?;
    Ok(())
}

const NO_BUCKETS: &str =
    "no rate buckets (a provider account without a bucket is not limited by admission)";

/// The bucket table of `status`: what admission allows on each bucket right now.
pub(crate) fn write_bucket_table(
    buckets: &[RateBucket],
    out: &mut impl Write,
) -> std::io::Result<()> {
    writeln!(out, "rate buckets")?;
    if buckets.is_empty() {
        writeln!(out, "{NO_BUCKETS}")?;
        return Ok(());
    }
    let width = account_width(buckets);
    writeln!(
        out,
        "{:<width$} {:<7} {:>9} {:>11} {:>6} paused_until (cause)",
        "account", "channel", "rate/s", "effective/s", "burst",
    )?;
    for b in buckets {
        let pause = match (b.paused_until, &b.pause_cause) {
            (None, _) => "-".to_owned(),
            (Some(until), None) => timestamp(until),
            (Some(until), Some(cause)) => format!("{} ({cause})", timestamp(until)),
        };
        writeln!(
            out,
            "{:<width$} {:<7} {:>9} {:>11} {:>6} {pause}",
            b.account.as_str(),
            b.channel.as_str(),
            b.rate_per_second,
            b.effective_rate,
            b.burst,
        )?;
    }
    Ok(())
}

fn account_width(buckets: &[RateBucket]) -> usize {
    buckets
        .iter()
        .map(|b| b.account.as_str().len())
        .max()
        .unwrap_or(0)
        .max("account".len())
}

pub(crate) fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Secs, true)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_is_a_finite_number_from_zero() {
        assert_eq!(RatePerSecond::parse("40").unwrap().get(), 40.0);
        assert_eq!(RatePerSecond::parse("0.5").unwrap().get(), 0.5);
        assert!(RatePerSecond::parse("0").unwrap().stops());
        assert!(RatePerSecond::parse("-0").unwrap().stops());
        assert_eq!(RatePerSecond::parse("1000000").unwrap().get(), MAX_RATE);
    }

    #[test]
    fn a_negative_infinite_or_non_numeric_rate_is_refused_saying_what_is_expected() {
        for text in [
            "-1", "NaN", "nan", "inf", "-inf", "1e400", "1000001", "forty", "",
        ] {
            let err = RatePerSecond::parse(text).unwrap_err().to_string();
            assert!(
                err.starts_with("PER_SECOND must be a number"),
                "{text}: {err}"
            );
            assert!(err.contains("0 stops sending"), "{text}: {err}");
        }
    }

    #[test]
    fn a_default_burst_admits_at_least_one_send() {
        assert_eq!(default_burst(RatePerSecond::parse("0.2").unwrap()), 1);
        assert_eq!(default_burst(RatePerSecond::parse("40").unwrap()), 40);
        assert_eq!(default_burst(RatePerSecond::parse("2.5").unwrap()), 3);
    }
}
