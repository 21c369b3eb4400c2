//! `nudgectl console token create|list|revoke`: who may log in to nudge-console
//! (decision 0701).

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Subcommand;
use nudge_ledger::{ConsoleRole, Ledger};

use crate::operator;

pub const HELP: &str = "The tokens nudge-console's users log in with. A token is shown once, \
    when made, and kept only as its SHA-256; it names a role (viewer: reads every page; \
    operator: may also pause and resume a tenant's intake, drain a channel, set or resume a \
    rate and run redrives, each with a reason and an audit row), expires (at most 90 days), and \
    can be revoked, which ends its sessions at their next request.";

#[derive(Debug, Subcommand)]
pub enum ConsoleCommand {
    /// Console tokens: make one (printed once), list them, revoke one.
    #[command(subcommand, long_about = HELP)]
    Token(TokenCommand),
}

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Make a token and print it, once, on standard output.
    Create {
        /// Whose token: shown in the console and in the audit log as `console:NAME`.
        #[arg(long)]
        name: String,
        /// viewer (reads) or operator (reads and acts).
        #[arg(long, value_parser = parse_role)]
        role: ConsoleRole,
        /// How long it lives (at most 90 days).
        #[arg(long, value_name = "DURATION", default_value = "12h",
              value_parser = humantime::parse_duration)]
        expires_in: Duration,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Every token: id, name, role, expiry, revoked or not (never a secret).
    List,
    /// Revoke a token: its sessions end at their next request.
    Revoke {
        /// The token's id (`console token list`).
        id: i64,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
}

fn parse_role(text: &str) -> Result<ConsoleRole, String> {
    text.parse().map_err(|e: &str| e.to_owned())
}

pub async fn run(
    ledger: &Ledger,
    actor: &str,
    command: ConsoleCommand,
    out: &mut impl Write,
    err: &mut impl Write,
) -> anyhow::Result<()> {
    let ConsoleCommand::Token(command) = command;
    match command {
        TokenCommand::Create {
            name,
            role,
            expires_in,
            reason,
        } => {
            let ttl = chrono::Duration::from_std(expires_in)
                .ok()
                .filter(|d| *d <= nudge_ledger::CONSOLE_TOKEN_MAX_TTL)
                .context("--expires-in is at most 90 days")?;
            let created = ledger
                .create_console_token(
                    &name,
                    role,
                    ttl,
                    &operator(ledger, actor, Some(&reason)).await?,
                )
                .await
                .context("failed to make the token")?;
            writeln!(out, "{}", created.secret.expose())?;
            writeln!(
                err,
                "console token {} ({}, {}) made, expiring at {}; it is printed above, once",
                created.token.id,
                created.token.name,
                created.token.role,
                created.token.expires_at.to_rfc3339()
            )?;
        }
        TokenCommand::List => {
            let tokens = ledger.console_tokens().await?;
            if tokens.is_empty() {
                writeln!(out, "no console token")?;
                return Ok(());
            }
            writeln!(
                out,
                "{:>6}  {:<24}  {:<8}  {:<25}  state",
                "id", "name", "role", "expires"
            )?;
            let now = chrono::Utc::now();
            for t in tokens {
                let state = match (&t.revoked_at, t.expires_at <= now) {
                    (Some(at), _) => format!(
                        "revoked at {} by {}",
                        at.to_rfc3339(),
                        t.revoked_by.as_deref().unwrap_or("?")
                    ),
                    (None, true) => "expired".to_owned(),
                    (None, false) => "live".to_owned(),
                };
                writeln!(
                    out,
                    "{:>6}  {:<24}  {:<8}  {:<25}  {state}",
                    t.id,
                    t.name,
                    t.role.as_str(),
                    t.expires_at.format("%Y-%m-%dT%H:%M:%SZ").to_string()
                )?;
            }
        }
        TokenCommand::Revoke { id, reason } => {
            let by = operator(ledger, actor, Some(&reason)).await?;
            match ledger.revoke_console_token(id, &by).await? {
                Some((t, true)) => {
                    writeln!(out, "console token {id} ({}) revoked", t.name)?;
                }
                Some((t, false)) => writeln!(
                    out,
                    "console token {id} ({}) was already revoked; nothing changed",
                    t.name
                )?,
                None => bail!("no console token with id {id} (nudgectl console token list)"),
            }
        }
    }
    Ok(())
}
