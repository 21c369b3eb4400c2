//! `nudgectl retention plan`: what a retention run would delete now, and what it keeps and
//! why. Read-only; counted in SQL by the same rule the deletion functions apply.

use std::io::Write;

use anyhow::Context;
use clap::Subcommand;
use nudge_config::RetentionConfig;
use nudge_domain::RetentionPolicy;
use nudge_ledger::{Ledger, LedgerTime, RetentionPlan};

use crate::table::{Align, write_table};

#[derive(Debug, Subcommand)]
pub enum RetentionCommand {
    /// Count what a retention run would delete now, by table, state and age band, and what
    /// it keeps and why. Read-only.
    #[command(long_about = PLAN_HELP)]
    Plan {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// The policy to count by: the configuration's `[retention]` section, set by `run`
        /// (the defaults when none is given).
        #[arg(skip)]
        policy: Option<RetentionPolicy>,
    },
}

pub(crate) const PLAN_HELP: &str = "\
Count what a retention run would delete now, by table, state and age band, and what it keeps \
and why. Read-only: nothing is recorded or deleted (the janitor's runs do that, by the same \
rule, which the database's retention functions apply).

The policy is the configuration's [retention] section, the one the janitor reads: a boundary \
per terminal state (delivered, expired, cancelled (suppressed too), dead_lettered; attempts, dead-letter records \
and finished redrive items go with their delivery), reminders with no delivery left, contacts \
no remaining reminder names, delivery events (events_days once acknowledged by the tenant's webhook or of a tenant without \
one, events_unacknowledged_days otherwise), and the audit log on its own; the consent history's \
entries on the audit log's boundary.

Kept, and why: owed (scheduled, queued, sending, waiting to retry), held (ambiguous), \
awaiting_redrive (named by a running or paused redrive), ownership_uncertain (owned by another \
sender than its channel's), too_young (within its boundary), has_delivery (a reminder with a \
delivery that stays), in_use (a contact a staying reminder names), with_delivery (a dead-letter \
record that stays with its delivery), held_by_operator (a reminder of a paused tenant or \
draining channel), replay_guard (a consent history entry a patient's inbound STOP or START wrote: \
never deleted, so the message stays refused if sent again), unacknowledged (a delivery event \
its tenant's webhook has not acknowledged, or not yet numbered, within \
retention.events_unacknowledged_days). Ages count from settled_at, or from scheduled_at for owed work (due soon \
shows as <1h).

--json prints {\"at\", \"policy\": {\"delivered\", \"expired\", \"cancelled\", \"dead_lettered\", \
\"reminders\", \"contacts\", \"events\", \"events_unacknowledged\", \"audit\"} (days), \"deliveries\": [{\"state\", \"age_band\", \"kept\", \
\"count\"}], \"tables\": {TABLE: {\"delete\", \"kept\": {REASON: N}}}} with kept null for rows that \
go.";

/// Prints the plan for `policy` (the defaults when `None`).
pub(crate) async fn plan(
    ledger: &Ledger,
    policy: Option<RetentionPolicy>,
    json: bool,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let policy = match policy {
        Some(policy) => policy,
        None => RetentionConfig::default().policy()?,
    };
    let plan = ledger
        .plan_retention(&policy, LedgerTime::Database)
        .await
        .context("failed to count what retention would delete")?;
    if json {
        serde_json::to_writer_pretty(&mut *out, &plan)?;
        writeln!(out)?;
        return Ok(());
    }
    write_plan(&plan, &policy, out)?;
    Ok(())
}

fn kept_list(kept: &std::collections::BTreeMap<nudge_ledger::KeepReason, u64>) -> String {
    kept.iter()
        .map(|(why, n)| format!("{} {n}", why.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn write_plan(
    plan: &RetentionPlan,
    policy: &RetentionPolicy,
    out: &mut impl Write,
) -> std::io::Result<()> {
    writeln!(out, "retention plan at {}", plan.at.to_rfc3339())?;
    writeln!(out, "policy: {policy}")?;
    writeln!(out)?;
    let rows: Vec<Vec<String>> = plan
        .tables
        .iter()
        .map(|(table, count)| {
            vec![
                table.as_str().to_owned(),
                count.delete.to_string(),
                kept_list(&count.kept),
            ]
        })
        .collect();
    write_table(
        out,
        "",
        &[
            ("table", Align::Left),
            ("delete", Align::Right),
            ("kept (why)", Align::Left),
        ],
        &rows,
    )?;
    writeln!(out)?;
    writeln!(out, "deliveries by state and age:")?;
    let rows: Vec<Vec<String>> = plan
        .deliveries
        .iter()
        .map(|c| {
            vec![
                c.state.as_str().to_owned(),
                c.age_band.as_str().to_owned(),
                c.kept.map_or_else(
                    || "delete".to_owned(),
                    |why| format!("keep: {}", why.as_str()),
                ),
                c.count.to_string(),
            ]
        })
        .collect();
    write_table(
        out,
        "  ",
        &[
            ("state", Align::Left),
            ("age", Align::Left),
            ("verdict", Align::Left),
            ("count", Align::Right),
        ],
        &rows,
    )
}
