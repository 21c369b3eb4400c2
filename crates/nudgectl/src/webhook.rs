//! `nudgectl tenant webhook set|rotate|enable|disable|show`: the endpoint nudge-events pushes
//! a tenant's delivery events to (decision 0602).

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Subcommand;
use nudge_ledger::{DestinationCipher, Ledger, check_webhook_url};

use crate::{find_tenant, operator};

#[derive(Debug, Subcommand)]
pub enum WebhookCommand {
    /// Set the endpoint (https). A tenant's first webhook gets a signing secret, printed once,
    /// and is sent what happens from now on (or from --from); changing the URL of an existing
    /// one keeps its secrets and where it was.
    Set {
        /// Tenant name.
        name: String,
        /// The endpoint: an absolute https URL without user name, password or fragment.
        #[arg(long)]
        url: String,
        /// A new webhook's start: the position after which its first batch begins (0: every
        /// event the ledger keeps; at most the tenant's newest). Default: the tenant's newest
        /// event (what comes next). Refused for an existing webhook, which resumes where it was.
        #[arg(long, value_name = "POSITION")]
        from: Option<u64>,
        /// Accept a plain http URL (for a receiver on loopback in tests; nudge-events refuses
        /// it too unless events.allow_http).
        #[arg(long)]
        allow_http: bool,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Make a new signing secret and print it, once; the previous one keeps signing for
    /// --overlap (each request carries both signatures), so the client can switch without
    /// missing a batch.
    Rotate {
        /// Tenant name.
        name: String,
        /// How long the previous secret keeps signing (0s: it stops now).
        #[arg(long, value_name = "DURATION", default_value = "24h",
              value_parser = humantime::parse_duration)]
        overlap: Duration,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Enable the webhook (after nudge-events disabled it, or an operator did): its failures
    /// are cleared and the push resumes at once after the last acknowledged batch.
    Enable {
        /// Tenant name.
        name: String,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Disable the webhook: nothing is pushed and the events wait (nothing is skipped).
    Disable {
        /// Tenant name.
        name: String,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Where the webhook stands: URL, enabled, acknowledged and newest positions, failures,
    /// the last error, the secrets' generations (never a secret).
    Show {
        /// Tenant name.
        name: String,
    },
}

fn needs_cipher(cipher: Option<&DestinationCipher>) -> anyhow::Result<&DestinationCipher> {
    cipher.context(
        "this command needs crypto.destination_key (NUDGE_CRYPTO__DESTINATION_KEY), and \
         crypto.tenant_secret_key where the intake has it: webhook secrets are stored sealed \
         with the keys the tenants' signing secrets use",
    )
}

pub async fn run(
    ledger: &Ledger,
    cipher: Option<&DestinationCipher>,
    actor: &str,
    command: WebhookCommand,
    out: &mut impl Write,
    err: &mut impl Write,
) -> anyhow::Result<()> {
    match command {
        WebhookCommand::Set {
            name,
            url,
            from,
            allow_http,
            reason,
        } => {
            let url = match check_webhook_url(&url, allow_http) {
                Ok(normal) => normal,
                Err(why) => bail!("--url refused: {why}"),
            };
            let cipher = needs_cipher(cipher)?;
            let tenant = find_tenant(ledger, &name).await?;
            let from = from
                .map(|p| i64::try_from(p).context("--from is too large"))
                .transpose()?;
            let set = ledger
                .set_tenant_webhook(
                    tenant.id,
                    &url,
                    from,
                    cipher,
                    &operator(ledger, actor, Some(&reason)).await?,
                )
                .await
                .context("failed to set the webhook")?;
            match set.secret {
                Some(secret) => {
                    writeln!(out, "{}", secret.expose())?;
                    writeln!(
                        err,
                        "webhook of tenant {name:?} set to {url}, pushing events after position \
                         {}; its signing secret is printed above, once: the client verifies \
                         each request with it (Standard Webhooks)",
                        set.acked_position
                    )?;
                }
                None => {
                    writeln!(
                        out,
                        "webhook of tenant {name:?} now points at {url}; its secrets, state and \
                         position ({}) are kept",
                        set.acked_position
                    )?;
                    if let Some(w) = ledger.tenant_webhook(tenant.id).await?
                        && !w.enabled
                    {
                        writeln!(
                            out,
                            "it is disabled: `nudgectl tenant webhook enable {name}` resumes it"
                        )?;
                    }
                }
            }
        }
        WebhookCommand::Rotate {
            name,
            overlap,
            reason,
        } => {
            let cipher = needs_cipher(cipher)?;
            let tenant = find_tenant(ledger, &name).await?;
            let secret = ledger
                .rotate_webhook_secret(
                    tenant.id,
                    overlap,
                    cipher,
                    &operator(ledger, actor, Some(&reason)).await?,
                )
                .await
                .context("failed to rotate the webhook secret")?;
            writeln!(out, "{}", secret.expose())?;
            writeln!(
                err,
                "the new webhook secret of tenant {name:?} is printed above, once; the previous \
                 one keeps signing for {}",
                humantime::format_duration(overlap)
            )?;
        }
        WebhookCommand::Enable { name, reason } => {
            set_enabled(ledger, actor, &name, &reason, true, out).await?;
        }
        WebhookCommand::Disable { name, reason } => {
            set_enabled(ledger, actor, &name, &reason, false, out).await?;
        }
        WebhookCommand::Show { name } => {
            let tenant = find_tenant(ledger, &name).await?;
            let Some(w) = ledger
                .tenant_webhook(tenant.id)
                .await
                .context("failed to read the webhook")?
            else {
                bail!("tenant {name:?} has no webhook (nudgectl tenant webhook set)");
            };
            writeln!(out, "tenant:            {name}")?;
            writeln!(out, "url:               {}", w.url)?;
            writeln!(
                out,
                "enabled:           {}",
                if w.enabled {
                    "yes".to_owned()
                } else {
                    format!(
                        "no, since {}, by {} ({})",
                        w.disabled_at.map_or_else(String::new, |t| t.to_rfc3339()),
                        w.disabled_by.as_deref().unwrap_or("?"),
                        w.disabled_reason.as_deref().unwrap_or("")
                    )
                }
            )?;
            writeln!(out, "acknowledged:      {}", w.acked_position)?;
            writeln!(
                out,
                "waiting:           {} (newest position {})",
                if w.newest_position > w.acked_position {
                    "events after the acknowledged position"
                } else {
                    "none"
                },
                w.newest_position
            )?;
            if let Some(p) = w.pending_through {
                writeln!(out, "retrying batch:    through position {p}")?;
            }
            writeln!(out, "failures:          {}", w.failures)?;
            if let Some(since) = w.failing_since {
                writeln!(out, "failing since:     {}", since.to_rfc3339())?;
                writeln!(out, "next attempt:      {}", w.next_attempt_at.to_rfc3339())?;
            }
            if let Some(e) = &w.last_error {
                writeln!(out, "last error:        {e}")?;
            }
            for (generation, created, retires) in &w.secrets {
                writeln!(
                    out,
                    "secret:            generation {generation}, made {}{}",
                    created.to_rfc3339(),
                    retires
                        .map_or_else(String::new, |r| format!(", signs until {}", r.to_rfc3339()))
                )?;
            }
        }
    }
    Ok(())
}

async fn set_enabled(
    ledger: &Ledger,
    actor: &str,
    name: &str,
    reason: &str,
    enabled: bool,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let tenant = find_tenant(ledger, name).await?;
    let changed = ledger
        .set_tenant_webhook_enabled(
            tenant.id,
            enabled,
            &operator(ledger, actor, Some(reason)).await?,
        )
        .await
        .context("failed to change the webhook")?;
    let state = if enabled { "enabled" } else { "disabled" };
    if changed {
        writeln!(out, "webhook of tenant {name:?} {state}")?;
    } else {
        writeln!(
            out,
            "webhook of tenant {name:?} was already {state}: nothing changed"
        )?;
    }
    Ok(())
}
