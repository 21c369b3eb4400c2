//! `nudgectl`, the operator's command line: migrations, tenants, status.
//!
//! Every command that changes operator state leaves an audit row with the actor and the
//! reason. Output meant for scripts is available as JSON (`--json`); human output goes to
//! stdout, errors to stderr with their whole chain. It must never print a destination,
//! subscriber reference or message content.

mod config;

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use chrono::Utc;
use clap::{Parser, Subcommand};
use nudge_ledger::{AuditEntry, ChannelStatus, Ledger};

pub use config::CtlConfig;

#[derive(Debug, Parser)]
#[command(
    name = "nudgectl",
    version,
    about = "Operate nudge: apply migrations, manage tenants, inspect delivery status.",
    long_about = "Operate nudge: apply migrations, manage tenants, inspect delivery status.\n\n\
        Configuration comes from defaults, then the TOML file given by --config or NUDGE_CONFIG, \
        then NUDGE_* environment variables (e.g. NUDGE_DATABASE__URL)."
)]
pub struct Cli {
    /// TOML configuration file (overrides NUDGE_CONFIG).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Who is acting, recorded in the audit log with every change.
    #[arg(long, global = true, env = "NUDGE_ACTOR", default_value_t = default_actor())]
    pub actor: String,

    #[command(subcommand)]
    pub command: Command,
}

fn default_actor() -> String {
    std::env::var("USER").unwrap_or_else(|_| "unknown".to_owned())
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply every pending database migration (safe to repeat).
    Migrate,
    /// Create and manage tenants.
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// Per-channel counts of owed, in-flight, dead-lettered and ambiguous deliveries.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum TenantCommand {
    /// Create a tenant (or show the existing one of that name); prints its id.
    Create {
        /// Unique tenant name, 1 to 200 bytes.
        name: String,
    },
    /// Stop intake and new run intents for a tenant. Work already owed continues.
    Pause {
        name: String,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Let a paused tenant take new work again.
    Resume {
        name: String,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
}

/// Runs one command to completion.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let config: CtlConfig = nudge_config::load(cli.config.as_deref(), CtlConfig::SECTIONS)
        .context("failed to load configuration")?;
    // Operator output is the table; logs only speak up for warnings unless asked.
    let _telemetry = nudge_telemetry::init("nudgectl", &config.telemetry)
        .context("failed to initialise logging")?;
    let ledger = Ledger::connect(
        config.database.url.expose(),
        2,
        Duration::from_millis(config.database.acquire_timeout_ms),
    )
    .await
    .context("failed to connect to the database (database.url)")?;
    let mut out = std::io::stdout().lock();
    execute(&ledger, &cli.actor, cli.command, &mut out).await
}

/// Executes a command against a ledger, writing operator output to `out`.
pub async fn execute(
    ledger: &Ledger,
    actor: &str,
    command: Command,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let now = Utc::now();
    match command {
        Command::Migrate => {
            ledger
                .migrate()
                .await
                .context("failed to apply migrations")?;
            writeln!(out, "migrations applied")?;
        }
        Command::Tenant(TenantCommand::Create { name }) => {
            let tenant = ledger
                .create_tenant(&name, now)
                .await
                .context("failed to create tenant")?;
            ledger
                .record_audit(&AuditEntry {
                    at: now,
                    actor: actor.to_owned(),
                    action: "tenant_create".into(),
                    target: Some(format!("tenant:{}", tenant.id)),
                    reason: None,
                    details: serde_json::json!({ "name": tenant.name }),
                })
                .await?;
            writeln!(out, "{}", tenant.id)?;
        }
        Command::Tenant(TenantCommand::Pause { name, reason }) => {
            set_paused(ledger, actor, &name, true, &reason, out).await?;
        }
        Command::Tenant(TenantCommand::Resume { name, reason }) => {
            set_paused(ledger, actor, &name, false, &reason, out).await?;
        }
        Command::Status { json } => {
            let status = ledger.status(now).await.context("failed to read status")?;
            if json {
                serde_json::to_writer_pretty(&mut *out, &status)?;
                writeln!(out)?;
            } else {
                write_status_table(&status, out)?;
            }
        }
    }
    Ok(())
}

async fn set_paused(
    ledger: &Ledger,
    actor: &str,
    name: &str,
    paused: bool,
    reason: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    if reason.trim().is_empty() {
        bail!("--reason must say why (it is recorded in the audit log)");
    }
    let now = Utc::now();
    let Some(tenant) = ledger.tenant_by_name(name).await? else {
        bail!("no tenant named {name:?}");
    };
    ledger.set_intake_paused(tenant.id, paused, now).await?;
    ledger
        .record_audit(&AuditEntry {
            at: now,
            actor: actor.to_owned(),
            action: if paused {
                "intake_pause"
            } else {
                "intake_resume"
            }
            .into(),
            target: Some(format!("tenant:{}", tenant.id)),
            reason: Some(reason.to_owned()),
            details: serde_json::json!({ "intake_paused": paused }),
        })
        .await?;
    writeln!(
        out,
        "tenant {name}: intake {}",
        if paused { "paused" } else { "resumed" }
    )?;
    Ok(())
}

fn write_status_table(status: &[ChannelStatus], out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<7} {:>9} {:>7} {:>7} {:>7} {:>10} {:>13} {:>9} {:>14}",
        "channel",
        "scheduled",
        "due",
        "queued",
        "sending",
        "retry_wait",
        "dead_lettered",
        "ambiguous",
        "oldest_due_s"
    )?;
    for s in status {
        writeln!(
            out,
            "{:<7} {:>9} {:>7} {:>7} {:>7} {:>10} {:>13} {:>9} {:>14}",
            s.channel.as_str(),
            s.scheduled,
            s.due,
            s.queued,
            s.sending,
            s.retry_wait,
            s.dead_lettered,
            s.ambiguous,
            s.oldest_eligible_age_s
                .map_or_else(|| "-".to_owned(), |a| a.to_string()),
        )?;
    }
    Ok(())
}
