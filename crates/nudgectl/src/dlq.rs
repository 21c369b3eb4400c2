//! `dlq list` and `dlq show`: what is dead-lettered or held ambiguous, counted so an operator
//! can choose what to redrive (and see what an active redrive already holds), and one
//! delivery's history through the trace report.
//!
//! Read-only. Counting is done by the ledger in SQL; this prints the groups.

use std::io::Write;

use anyhow::Context;
use chrono::{DateTime, SecondsFormat, Utc};
use nudge_domain::{Channel, DeliveryId};
use nudge_ledger::{AgeBand, DlqReport, Ledger};

use crate::table::{Align, write_table};

pub(crate) const LIST_HELP: &str = "\
Dead-lettered and ambiguous deliveries, counted by channel, state, reason and age band, and the \
raw dead-letter records. Read-only; everything is counted in the database.

The reason is the delivery's last error (http_400, attempts_exhausted: http_503, \
poison_message: delivery_limit, maybe_sent: http_500, unknown_outcome_after_send, ...). The age \
counts from the reminder's scheduled time, in the bands <1h, 1h-6h, 6h-24h, 1d-7d and >7d that \
`redrive` uses too. Up to 3 sample delivery ids are listed per channel, state and reason (most \
recently settled first); `dlq show ID` gives one's history. in_redrive counts the dead-lettered \
deliveries already waiting in a running or paused redrive (not fed nor skipped yet): they will \
be fed back, so do not redrive them again.

The dead-letter records count the messages that reached a dead.<channel> queue, by queue and \
what the recorder did: delivery_dead_lettered (the message's delivery was dead-lettered with \
reason poison_message: ...) or recorded (stale, unknown or undecodable: no delivery changed, \
so only this record shows it).

--json prints {\"now\", \"channel\", \"deliveries\": [{\"channel\", \"state\", \"reason\", \
\"count\", \"by_age\": {\"<1h\": n, ...}, \"redrive_pending\", \"sample_ids\"}], \
\"dead_letters\": [{\"queue\", \"action\", \"count\", \"latest_recorded_at\"}]}; bands with no \
delivery are left out of by_age.";

pub(crate) const SHOW_HELP: &str = "\
One delivery's history: its times, state, lease, redrive membership, every attempt and the \
findings, as `trace` prints them for a delivery id. Read-only. --json prints the trace document \
(see `trace --help`) with that one delivery.";

/// Prints the dead-letter report.
pub(crate) async fn list(
    ledger: &Ledger,
    channel: Option<Channel>,
    json: bool,
    now: DateTime<Utc>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let report = ledger
        .dlq_report(channel, now)
        .await
        .context("failed to count dead-lettered deliveries")?;
    if json {
        serde_json::to_writer_pretty(&mut *out, &report)?;
        writeln!(out)?;
        return Ok(());
    }
    write_report(&report, out)?;
    Ok(())
}

/// Prints one delivery's trace.
pub(crate) async fn show(
    ledger: &Ledger,
    id: DeliveryId,
    json: bool,
    now: DateTime<Utc>,
    out: &mut impl Write,
    err: &mut impl Write,
) -> anyhow::Result<()> {
    let trace = ledger
        .trace_delivery(id, now)
        .await
        .with_context(|| format!("failed to read delivery {id}"))?
        .with_context(|| format!("no delivery has id {id}"))?;
    crate::trace::print(&trace, json, out, err)
}

fn write_report(report: &DlqReport, out: &mut impl Write) -> std::io::Result<()> {
    if report.deliveries.is_empty() {
        writeln!(out, "no dead-lettered or ambiguous deliveries")?;
    } else {
        let rows: Vec<Vec<String>> = report
            .deliveries
            .iter()
            .map(|g| {
                let mut row = vec![
                    g.channel.as_str().to_owned(),
                    g.state.as_str().to_owned(),
                    g.reason.clone().unwrap_or_else(|| "-".to_owned()),
                    g.count.to_string(),
                ];
                row.extend(
                    AgeBand::ALL
                        .iter()
                        .map(|b| g.by_age.get(b).copied().unwrap_or(0).to_string()),
                );
                row.push(g.redrive_pending.to_string());
                let samples: Vec<String> = g.sample_ids.iter().map(ToString::to_string).collect();
                row.push(samples.join(" "));
                row
            })
            .collect();
        let mut columns = vec![
            ("channel", Align::Left),
            ("state", Align::Left),
            ("reason", Align::Left),
            ("total", Align::Right),
        ];
        columns.extend(AgeBand::ALL.iter().map(|b| (b.as_str(), Align::Right)));
        columns.push(("in_redrive", Align::Right));
        columns.push(("samples", Align::Left));
        write_table(out, "", &columns, &rows)?;
        if report.deliveries.iter().any(|g| g.redrive_pending > 0) {
            writeln!(
                out,
                "in_redrive: already waiting in an active redrive; do not redrive them again"
            )?;
        }
    }
    writeln!(out)?;
    if report.dead_letters.is_empty() {
        return writeln!(out, "no dead-letter records");
    }
    writeln!(out, "dead-letter records")?;
    let rows: Vec<Vec<String>> = report
        .dead_letters
        .iter()
        .map(|l| {
            vec![
                l.queue.clone(),
                l.action.clone(),
                l.count.to_string(),
                l.latest_recorded_at
                    .to_rfc3339_opts(SecondsFormat::Millis, true),
            ]
        })
        .collect();
    write_table(
        out,
        "",
        &[
            ("queue", Align::Left),
            ("action", Align::Left),
            ("count", Align::Right),
            ("latest", Align::Left),
        ],
        &rows,
    )
}
