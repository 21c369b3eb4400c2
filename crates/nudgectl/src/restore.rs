//! `nudgectl restore status` and `nudgectl restore reconcile`: the operator's side of a ledger
//! restored from a backup (`nudge_ledger`'s `restore` module does the work, in one
//! transaction with its audit row; docs/decisions/0017-restored-ledger.md).

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use clap::Subcommand;
use nudge_domain::IdempotencyKey;
use nudge_ledger::{
    ConfirmedSend, IdentityVerdict, Ledger, RestoreCount, RestoreReconciliation, RestoreStatus,
};

use crate::rate::timestamp;
use crate::{operator, require_reason};

pub const RECONCILE_HELP: &str = "\
Reconcile a ledger restored from a backup with what may have happened after the backup's point \
T. A dry run unless --execute: the dry run runs the same statements and rolls them back, so its \
counts are what --execute would do at that instant.

In one transaction, with its audit row (actor, --reason, --incident, the counts):
  1. reminders created by T, due before now, with no delivery on one of their channels get that \
delivery, held (the lost history may have materialised and sent it);
  2. deliveries of reminders created by T that the lost history could have sent are held \
`ambiguous` with reason `restored`: leased (sending) or published (queued) at T, or scheduled \
or waiting to retry with a time that has come by now (the database's clock). Work not yet due, \
settled, held or dead-lettered is left as it is;
  3. held deliveries that a provider receipt recorded since the restore speaks for are settled \
by it (delivered, or dead-lettered for a failure), and those named in --sent FILE (the \
provider's own records of its sends) are settled delivered;
  4. running redrives are paused (a restored redrive would feed dead letters the lost history \
may have fed and sent already);
  5. the server's identity is recorded and the restore cleared: the workers and the producer \
start again (restart them).
What remains held is listed by channel and tenant for review (`nudgectl dlq list`).

T is a time by the database's clock: the backup's point (the recovery target of a \
point-in-time restore, the start of a pg_dump). It may not be before the restored copy's last \
heartbeat (`nudgectl restore status` shows it): a later T holds more, never less. Reminders \
created after T are taken to be posts made after the restore and are left to be sent; the \
report counts those created between T and the moment the restore was found.

--sent FILE: JSON Lines, one send per line, {\"idempotency_key\": \"nudge-<reminder>-<channel>\", \
\"provider_message_id\": \"...\"} (the message id is optional; other fields are ignored), as \
exported from the provider's message log. Without it, only receipts settle.

Examples:
  nudgectl restore status
  nudgectl restore reconcile --since 2026-12-02T01:30:00Z --reason \"restored after disk loss\"
  nudgectl restore reconcile --since 2026-12-02T01:30:00Z --sent twilio-export.jsonl \\
      --reason \"restored after disk loss\" --incident INC-7 --execute";

#[derive(Debug, Subcommand)]
pub enum RestoreCommand {
    /// Whether the ledger is restored from a backup and not reconciled, why, and the
    /// identities recorded and seen (read-only, but a first look records the identity).
    Status {
        /// Print JSON instead of a report.
        #[arg(long)]
        json: bool,
    },
    /// Hold what could have been sent after the backup, settle what the provider's records
    /// confirm, and let the workers start again (a dry run unless --execute).
    #[command(long_about = RECONCILE_HELP)]
    Reconcile {
        /// The backup's point, RFC 3339 by the database's clock, e.g. 2026-12-02T01:30:00Z.
        #[arg(long, value_name = "T", value_parser = parse_since)]
        since: DateTime<Utc>,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
        /// The incident this is part of (audit log).
        #[arg(long, value_name = "ID")]
        incident: Option<String>,
        /// The provider's records of its sends, JSON Lines (see above).
        #[arg(long, value_name = "FILE")]
        sent: Option<PathBuf>,
        /// Act (otherwise a dry run).
        #[arg(long)]
        execute: bool,
        /// Print JSON instead of a report.
        #[arg(long)]
        json: bool,
    },
}

fn parse_since(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("expected an RFC 3339 time with an offset: {e}"))
}

pub async fn command(
    ledger: &Ledger,
    actor: &str,
    command: RestoreCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    match command {
        RestoreCommand::Status { json } => {
            let status = ledger
                .restore_status()
                .await
                .context("failed to read the ledger's identity")?;
            if json {
                serde_json::to_writer_pretty(&mut *out, &status)?;
                writeln!(out)?;
            } else {
                write_status(&status, out)?;
            }
        }
        RestoreCommand::Reconcile {
            since,
            reason,
            incident,
            sent,
            execute,
            json,
        } => {
            require_reason(&reason)?;
            let confirmed = match &sent {
                Some(path) => read_sent(path)?,
                None => Vec::new(),
            };
            let by = operator(ledger, actor, Some(&reason))
                .await?
                .with_incident(incident.as_deref())
                .context("invalid --incident")?;
            let report = ledger
                .reconcile_restore(since, &confirmed, &by, execute)
                .await
                .context("failed to reconcile the restored ledger")?;
            if json {
                serde_json::to_writer_pretty(&mut *out, &report)?;
                writeln!(out)?;
            } else {
                write_reconciliation(&report, out)?;
            }
        }
    }
    Ok(())
}

/// The provider's records: one JSON object a line; blank lines skipped.
fn read_sent(path: &Path) -> anyhow::Result<Vec<ConfirmedSend>> {
    #[derive(serde::Deserialize)]
    struct Line {
        idempotency_key: IdempotencyKey,
        #[serde(default)]
        provider_message_id: Option<String>,
    }
    let file =
        std::fs::File::open(path).with_context(|| format!("failed to open {}", path.display()))?;
    let mut sends = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("failed to read {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed: Line = serde_json::from_str(&line)
            .with_context(|| format!("{} line {}: not a provider record", path.display(), n + 1))?;
        if parsed
            .provider_message_id
            .as_deref()
            .is_some_and(|id| id.is_empty() || id.len() > 256)
        {
            bail!(
                "{} line {}: provider_message_id is 1 to 256 bytes",
                path.display(),
                n + 1
            );
        }
        sends.push(ConfirmedSend {
            idempotency_key: parsed.idempotency_key,
            provider_message_id: parsed.provider_message_id,
        });
    }
    Ok(sends)
}

fn write_status(status: &RestoreStatus, out: &mut impl Write) -> std::io::Result<()> {
    let o = &status.observed;
    let headline = match o.verdict {
        IdentityVerdict::Restored => {
            "RESTORED, not reconciled: the workers and the producer refuse to start"
        }
        IdentityVerdict::InRecovery => "the server is a standby in recovery: nothing decided",
        IdentityVerdict::FirstStart => "not restored (identity recorded now, first look)",
        IdentityVerdict::Failover => "not restored (a failover: the new identity was adopted now)",
        IdentityVerdict::Same => "not restored",
    };
    writeln!(out, "ledger: {headline}")?;
    writeln!(out, "why: {}", o.reason)?;
    if let Some(r) = &status.recorded {
        writeln!(
            out,
            "recorded identity: system {} timeline {} database OID {} (since {})",
            r.identity.system_identifier,
            r.identity.timeline_id,
            r.identity.database_oid,
            timestamp(r.recorded_at)
        )?;
        writeln!(
            out,
            "last heartbeat: {}{} (a failover is adopted within {} s of it)",
            timestamp(r.heartbeat_at),
            if r.restored_at.is_some() {
                ": the restored copy's; the backup's point is at or after it"
            } else {
                ""
            },
            r.failover_max_gap_s
        )?;
        if let Some(at) = r.restored_at {
            writeln!(out, "restore found at: {}", timestamp(at))?;
        }
    }
    if let Some(s) = &status.server {
        writeln!(
            out,
            "server reports: system {} timeline {} database OID {}",
            s.system_identifier, s.timeline_id, s.database_oid
        )?;
    }
    if o.verdict == IdentityVerdict::Restored {
        writeln!(
            out,
            "next: nudgectl restore reconcile --since <the backup's point> --reason \"...\" \
             (a dry run), then again with --execute"
        )?;
    }
    if !status.events.is_empty() {
        writeln!(out, "\nidentity events (newest first):")?;
        for e in &status.events {
            writeln!(out, "  {} {:<11} {}", timestamp(e.at), e.event, e.detail)?;
        }
    }
    Ok(())
}

fn write_counts(title: &str, counts: &[RestoreCount], out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "{title}")?;
    if counts.is_empty() {
        return writeln!(out, "  none");
    }
    writeln!(
        out,
        "  {:<7} {:<30} {:<12} {:>8}",
        "channel", "tenant", "state", "count"
    )?;
    for c in counts {
        writeln!(
            out,
            "  {:<7} {:<30} {:<12} {:>8}",
            c.channel.as_str(),
            c.tenant,
            c.state,
            c.count
        )?;
    }
    Ok(())
}

fn write_reconciliation(r: &RestoreReconciliation, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{} since {} (now {}, the database's clock)",
        if r.executed {
            "RECONCILED"
        } else {
            "dry run (nothing changed; --execute to act)"
        },
        timestamp(r.since),
        timestamp(r.now)
    )?;
    match &r.restored_reason {
        Some(why) if r.was_restored => writeln!(out, "the ledger was restored: {why}")?,
        _ => writeln!(
            out,
            "the ledger was not marked restored: holding anyway, as asked"
        )?,
    }
    write_counts(
        "\nheld ambiguous (reason restored), by the state they had:",
        &r.held,
        out,
    )?;
    writeln!(
        out,
        "created held (no delivery at the backup, due since): {}",
        r.materialised_held
    )?;
    writeln!(
        out,
        "settled by receipts recorded since the restore: {}",
        r.settled_by_receipt
    )?;
    writeln!(
        out,
        "settled delivered by the provider's records: {} ({} of their keys named no held delivery)",
        r.settled_by_provider_records, r.provider_records_unmatched
    )?;
    if !r.redrives_paused.is_empty() {
        writeln!(out, "redrives paused: {:?}", r.redrives_paused)?;
    }
    write_counts("\nstill held for review:", &r.for_review, out)?;
    if r.reminders_after_since > 0 {
        writeln!(
            out,
            "\n{} reminders were created after --since and before the restore was found: left \
             to be sent as new posts. If they came from the backup, --since is too early.",
            r.reminders_after_since
        )?;
    }
    writeln!(
        out,
        "\nidentity {}: system {} timeline {} database OID {}{}",
        if r.executed { "recorded" } else { "to record" },
        r.identity.system_identifier,
        r.identity.timeline_id,
        r.identity.database_oid,
        if r.executed {
            "; restart the workers and the producer"
        } else {
            ""
        }
    )?;
    Ok(())
}
