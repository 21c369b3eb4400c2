//! `trace`: one reminder's deliveries (or one delivery) as the ledger holds them, every
//! attempt, and findings that say whether lateness came from scheduling, from the provider's
//! throttling, or from a worker leasing work before it was eligible (a bug, flagged loudly).
//!
//! Read-only. The ledger's trace carries ids, times, states, status codes and reason codes;
//! it never holds a destination, a subscriber reference or message content, so nothing
//! here can print one.

use std::io::Write;

use anyhow::Context;
use chrono::{DateTime, SecondsFormat, Utc};
use nudge_ledger::{DeliveryTrace, Findings, Ledger, MatchedAs, Trace, TraceId};

use crate::table::{Align, write_table};

pub(crate) const HELP: &str = "\
Show a reminder's deliveries as the ledger holds them, every attempt, and what made them late. \
Read-only.

ID is a delivery id, a reminder id, or TENANT/EVENT_ID (the tenant's name, a slash, the \
client's event id; the event id may contain slashes, the first slash splits). A uuid is tried as \
a delivery id first (the trace then shows just that delivery), then as a reminder id.

Per delivery: when it was scheduled, first and latest attempted, when it expires; its state, \
lane, attempt count and attempt base (the retry limit counts attempt_count - attempt_base, \
from the last redrive), when it is next eligible, the lease if a worker holds it, the provider \
account and message id, the last error, and any redrive it belongs to. Then each attempt: \
when it became eligible and started, its outcome, HTTP status, Retry-After (as seen, and \
whether it was valid), the delay chosen, the next state and next eligible time, account, \
worker and incident.

Findings tell three causes of lateness apart: scheduling delay (time the delivery was eligible \
but not attempted: before its first attempt, after each retry came due, and so far when it is \
due now), provider throttling (attempts answered 429 or retryable with a Retry-After, and the \
delay chosen after them), and a lease before eligibility (an attempt started before the \
previous attempt's next eligible time, or a first attempt or lease before scheduled_at, by more \
than 50 ms): that one is a bug, and is also reported on stderr.

Never prints a destination, subscriber reference or message content.

--json prints {\"matched_as\": \"delivery\"|\"reminder\"|\"event\", \"reminder\": {\"id\", \
\"tenant_id\", \"tenant_name\", \"event_id\", \"channels\", \"scheduled_at\", \"expires_at\", \
\"cancelled_at\", \"created_at\", \"revision\", \"reschedules\": [{\"revision\", \
\"from_scheduled_at\", \"to_scheduled_at\", \"from_expires_at\", \"to_expires_at\", \
\"channels_added\", \"channels_removed\", \"source\", \"at\"}]}, \"deliveries\": [{\"id\", \"channel\", \"state\", \"lane\", \
\"scheduled_at\", \"first_attempt_at\", \"last_attempt_at\", \"expires_at\", \"next_attempt_at\", \
\"settled_at\", \"attempt_count\", \"attempt_base\", \"lease\": null|{\"owner\", \"expires_at\", \
\"send_started_at\"}, \"provider_account\", \"provider_message_id\", \"last_error_class\", \
\"last_error_reason\", \"redrives\": [{\"redrive_id\", \"position\", \"fed_at\", \
\"skipped_reason\", \"redrive_state\", \"incident\", \"pending\"}], \"attempts\": \
[{\"attempt_number\", \"generation\", \"lane\", \"started_at\", \"finished_at\", \
\"outcome_class\", \"http_status\", \"retry_after_seen\", \"retry_after_valid\", \
\"delay_chosen_ms\", \"next_state\", \"next_attempt_at\", \"reason\", \"provider_message_id\", \
\"provider_account\", \"worker\", \"incident\"}], \"findings\": {\"first_attempt_delay_ms\", \
\"scheduling_delay_ms\", \"waiting_now_ms\", \"throttled_attempts\", \"throttle_delay_ms\", \
\"leased_before_eligible\": [{\"attempt_number\", \"started_at\", \"eligible_at\", \
\"early_by_ms\"}], \"timings\": [{\"attempt_number\", \"eligible_at\", \"started_after_ms\", \
\"throttled\"}]}}]}. Times are RFC 3339 in UTC.";

/// Traces `id` and prints it.
pub(crate) async fn trace(
    ledger: &Ledger,
    id: &TraceId,
    json: bool,
    now: DateTime<Utc>,
    out: &mut impl Write,
    err: &mut impl Write,
) -> anyhow::Result<()> {
    let trace = ledger
        .trace(id, now)
        .await
        .with_context(|| format!("failed to trace {id}"))?;
    print(&trace, json, out, err)
}

/// Prints a trace as JSON or as the operator's report, and warns on `err` about every
/// lease before eligibility.
pub(crate) fn print(
    trace: &Trace,
    json: bool,
    out: &mut impl Write,
    err: &mut impl Write,
) -> anyhow::Result<()> {
    if json {
        serde_json::to_writer_pretty(&mut *out, trace)?;
        writeln!(out)?;
    } else {
        write_trace(trace, out)?;
    }
    for delivery in &trace.deliveries {
        let early = delivery.findings.leased_before_eligible.len();
        if early > 0 {
            writeln!(
                err,
                "warning: delivery {} was leased before it was eligible ({early} time{}): a \
                 worker bug, see its findings",
                delivery.id,
                if early == 1 { "" } else { "s" },
            )?;
        }
    }
    Ok(())
}

fn ts(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn opt_ts(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "-".to_owned(), ts)
}

fn opt<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// Milliseconds as seconds with three decimals, signed when asked (`+1.250s`).
fn secs(ms: i64, signed: bool) -> String {
    let sign = if ms < 0 {
        "-"
    } else if signed {
        "+"
    } else {
        ""
    };
    let abs = ms.unsigned_abs();
    format!("{sign}{}.{:03}s", abs / 1000, abs % 1000)
}

fn write_trace(trace: &Trace, out: &mut impl Write) -> std::io::Result<()> {
    let r = &trace.reminder;
    let matched = match trace.matched_as {
        MatchedAs::Delivery => "delivery id",
        MatchedAs::Reminder => "reminder id",
        MatchedAs::Event => "tenant/event id",
    };
    writeln!(
        out,
        "reminder {}  tenant {} ({})  event {}  (matched as {matched})",
        r.id, r.tenant_name, r.tenant_id, r.event_id
    )?;
    let channels: Vec<&str> = r.channels.iter().map(|c| c.as_str()).collect();
    writeln!(
        out,
        "  channels {}  scheduled {}  expires {}  cancelled {}",
        channels.join(","),
        ts(r.scheduled_at),
        ts(r.expires_at),
        opt_ts(r.cancelled_at)
    )?;
    if r.revision > 0 || !r.reschedules.is_empty() {
        writeln!(out, "  revision {}", r.revision)?;
    }
    for h in &r.reschedules {
        let mut changed = String::new();
        for added in &h.channels_added {
            changed.push_str(&format!("  +{added}"));
        }
        for removed in &h.channels_removed {
            changed.push_str(&format!("  -{removed}"));
        }
        writeln!(
            out,
            "  rescheduled at {} by {} to revision {}: {} -> {} (expires {} -> {}){changed}",
            ts(h.at),
            h.source,
            h.revision,
            ts(h.from_scheduled_at),
            ts(h.to_scheduled_at),
            ts(h.from_expires_at),
            ts(h.to_expires_at),
        )?;
    }
    if trace.deliveries.is_empty() {
        writeln!(
            out,
            "\nno deliveries yet: the producer has not materialised this reminder"
        )?;
    }
    for delivery in &trace.deliveries {
        writeln!(out)?;
        write_delivery(delivery, out)?;
    }
    Ok(())
}

fn write_delivery(d: &DeliveryTrace, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "delivery {} ({})", d.id, d.channel)?;
    let lease = match &d.lease {
        None => "none".to_owned(),
        Some(l) => format!(
            "held by {} until {}; send {}",
            l.lease_holder,
            ts(l.expires_at),
            l.send_started_at.map_or_else(
                || "not started".to_owned(),
                |t| format!("started {}", ts(t))
            )
        ),
    };
    let last_error = match (&d.last_error_class, &d.last_error_reason) {
        (None, None) => "-".to_owned(),
        // Not an attempt's error: why it waits (0411); `status` lists these per tenant.
        (_, Some(reason)) if reason == "account_unavailable" => {
            "account_unavailable: waits for its tenant's own provider account, which no \
             running worker had at its last look (never sent through another)"
                .to_owned()
        }
        (_, Some(reason))
            if reason == "quiet_hours" && d.state == nudge_domain::DeliveryState::RetryWait =>
        {
            format!(
                "quiet_hours: deferred by quiet hours until {} (the subscriber's window; never \
                 sent inside it)",
                opt_ts(d.next_attempt_at)
            )
        }
        (_, Some(reason))
            if reason == "quiet_hours" && d.state == nudge_domain::DeliveryState::Expired =>
        {
            "quiet_hours: expired inside the subscriber's quiet hours, which outlasted it \
             (nothing sent)"
                .to_owned()
        }
        (class, reason) => format!("{}: {}", opt(class.as_deref()), opt(reason.as_deref())),
    };
    let fields = [
        ("state", d.state.as_str().to_owned()),
        ("lane", d.lane.as_str().to_owned()),
        ("scheduled", ts(d.scheduled_at)),
        ("first attempt", opt_ts(d.first_attempt_at)),
        ("latest attempt", opt_ts(d.last_attempt_at)),
        ("expires", ts(d.expires_at)),
        ("next eligible", opt_ts(d.next_attempt_at)),
        ("settled", opt_ts(d.settled_at)),
        (
            "attempts",
            format!(
                "{} (base {}: {} count toward the retry limit)",
                d.attempt_count,
                d.attempt_base,
                d.attempt_count.saturating_sub(d.attempt_base)
            ),
        ),
        ("lease", lease),
        (
            "provider",
            format!(
                "account {}, message id {}",
                opt(d.provider_account.as_deref()),
                opt(d.provider_message_id.as_deref())
            ),
        ),
        ("last error", last_error),
    ];
    for (name, value) in fields {
        writeln!(out, "  {name:<15} {value}")?;
    }
    if d.redrives.is_empty() {
        writeln!(out, "  {:<15} none", "redrive")?;
    }
    for item in &d.redrives {
        let progress = match (&item.fed_at, &item.skipped_reason) {
            (Some(at), _) => format!("fed {}", ts(*at)),
            (None, Some(reason)) => format!("skipped: {reason}"),
            (None, None) if item.pending => "pending: it will be fed back".to_owned(),
            (None, None) => "never fed".to_owned(),
        };
        writeln!(
            out,
            "  {:<15} #{} position {} ({}, incident {}): {progress}",
            "redrive",
            item.redrive_id,
            item.position,
            item.redrive_state,
            opt(item.incident.as_deref())
        )?;
    }
    writeln!(out)?;
    write_attempts(d, out)?;
    writeln!(out)?;
    write_findings(&d.findings, out)
}

fn write_attempts(d: &DeliveryTrace, out: &mut impl Write) -> std::io::Result<()> {
    if d.attempts.is_empty() {
        return writeln!(out, "  no attempts yet");
    }
    let rows: Vec<Vec<String>> = d
        .attempts
        .iter()
        .map(|a| {
            let timing = d
                .findings
                .timings
                .iter()
                .find(|t| t.attempt_number == a.attempt_number);
            let after = timing
                .and_then(|t| t.started_after_ms)
                .map_or_else(|| "-".to_owned(), |ms| secs(ms, true));
            let retry_after = match &a.retry_after_seen {
                None => "-".to_owned(),
                Some(seen) if a.retry_after_valid => seen.clone(),
                Some(seen) => format!("{seen} (invalid)"),
            };
            vec![
                a.attempt_number.to_string(),
                a.lane.as_str().to_owned(),
                ts(a.started_at),
                after,
                ts(a.finished_at),
                a.outcome_class.as_str().to_owned(),
                opt(a.http_status),
                retry_after,
                opt(a.delay_chosen.map(|d| d.as_millis())),
                a.next_state.as_str().to_owned(),
                opt_ts(a.next_attempt_at),
                opt(a.provider_account.as_deref()),
                opt(a.worker.as_deref()),
                opt(a.incident.as_deref()),
                opt(a.reason.as_deref()),
            ]
        })
        .collect();
    write_table(
        out,
        "  ",
        &[
            ("#", Align::Right),
            ("lane", Align::Left),
            ("started", Align::Left),
            ("after_eligible", Align::Right),
            ("finished", Align::Left),
            ("outcome", Align::Left),
            ("http", Align::Right),
            ("retry_after", Align::Left),
            ("delay_ms", Align::Right),
            ("next_state", Align::Left),
            ("next_eligible", Align::Left),
            ("account", Align::Left),
            ("worker", Align::Left),
            ("incident", Align::Left),
            ("reason", Align::Left),
        ],
        &rows,
    )
}

fn write_findings(f: &Findings, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "  findings")?;
    let mut delay = format!(
        "{} eligible but not attempted",
        secs(f.scheduling_delay_ms, false)
    );
    if let Some(first) = f.first_attempt_delay_ms {
        delay.push_str(&format!(
            "; first attempt {} after scheduled",
            secs(first, false)
        ));
    }
    if let Some(waiting) = f.waiting_now_ms {
        delay.push_str(&format!("; due now, waiting {}", secs(waiting, false)));
    }
    writeln!(out, "    {:<19} {delay}", "scheduling delay")?;
    let throttling = if f.throttled_attempts == 0 {
        "none".to_owned()
    } else {
        format!(
            "{} attempt{} answered 429 or with a Retry-After; {} of delay chosen after them",
            f.throttled_attempts,
            if f.throttled_attempts == 1 { "" } else { "s" },
            secs(f.throttle_delay_ms, false)
        )
    };
    writeln!(out, "    {:<19} {throttling}", "provider throttling")?;
    if f.leased_before_eligible.is_empty() {
        writeln!(out, "    {:<19} none", "early leases")?;
    }
    for early in &f.leased_before_eligible {
        let what = early
            .attempt_number
            .map_or_else(|| "the first lease".to_owned(), |n| format!("attempt {n}"));
        writeln!(
            out,
            "    !! LEASED BEFORE ELIGIBLE (a worker bug): {what} started {}, {} before it was \
             eligible at {}",
            ts(early.started_at),
            secs(early.early_by_ms, false),
            ts(early.eligible_at)
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use chrono::TimeZone;
    use nudge_ledger::EarlyStart;

    use super::*;

    #[test]
    fn a_lease_before_eligibility_is_called_a_bug_in_the_findings() {
        let eligible = Utc.with_ymd_and_hms(2026, 11, 29, 9, 2, 1).unwrap();
        let findings = Findings {
            first_attempt_delay_ms: Some(0),
            scheduling_delay_ms: 0,
            waiting_now_ms: None,
            throttled_attempts: 1,
            throttle_delay_ms: 120_000,
            leased_before_eligible: vec![EarlyStart {
                attempt_number: Some(2),
                started_at: eligible - chrono::Duration::seconds(116),
                eligible_at: eligible,
                early_by_ms: 116_000,
            }],
            timings: Vec::new(),
        };
        let mut out = Vec::new();

        write_findings(&findings, &mut out).unwrap();

        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains(
                "!! LEASED BEFORE ELIGIBLE (a worker bug): attempt 2 started \
                 2026-11-29T09:00:05.000Z, 116.000s before it was eligible at \
                 2026-11-29T09:02:01.000Z"
            ),
            "{text}"
        );
        assert!(!text.contains("early leases"), "{text}");
    }

    #[test]
    fn milliseconds_read_as_seconds_with_their_sign() {
        assert_eq!(secs(1_250, true), "+1.250s");
        assert_eq!(secs(-50, true), "-0.050s");
        assert_eq!(secs(120_000, false), "120.000s");
    }
}
