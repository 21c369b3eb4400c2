//! `nudgectl status`'s per-tenant view: the tenants with live work, the latest first (a
//! tenant's lateness, not the channel's average; invariant 14), and the deliveries that wait
//! for a provider account no live worker has (0411). Read-only.

use std::io::Write;

use anyhow::Context;
use chrono::{DateTime, Utc};
use nudge_ledger::{AwaitingAccount, ChannelStatus, Ledger, LedgerTime, TenantLatenessReport};

use crate::rate::timestamp;
use crate::table::{Align, write_table};

/// What `status` shows beside the channels and the buckets, read at one instant.
pub(crate) struct TenantView {
    pub lateness: TenantLatenessReport,
    pub awaiting: Vec<AwaitingAccount>,
}

impl TenantView {
    /// Reads the `limit` latest tenants and what waits for an account, at `now`.
    pub(crate) async fn read(
        ledger: &Ledger,
        limit: u32,
        now: DateTime<Utc>,
    ) -> anyhow::Result<Self> {
        let at = LedgerTime::Fixed(now);
        Ok(Self {
            lateness: ledger
                .tenant_lateness(limit, at)
                .await
                .context("failed to read the tenants' live work")?,
            awaiting: ledger
                .awaiting_accounts(at)
                .await
                .context("failed to read the deliveries that wait for an account")?,
        })
    }
}

/// One channel of `status --json`: the channel's counts as before, with the channel's rows of
/// the per-tenant view (`tenants`, the latest first, within `--tenants`) and what waits for an
/// account (`awaiting_account`). Still an array of channels.
#[derive(serde::Serialize)]
pub(crate) struct ChannelJson<'a> {
    #[serde(flatten)]
    pub status: &'a ChannelStatus,
    pub tenants: Vec<&'a nudge_ledger::TenantLateness>,
    pub awaiting_account: Vec<&'a AwaitingAccount>,
}

pub(crate) fn json<'a>(status: &'a [ChannelStatus], view: &'a TenantView) -> Vec<ChannelJson<'a>> {
    status
        .iter()
        .map(|s| ChannelJson {
            status: s,
            tenants: view
                .lateness
                .tenants
                .iter()
                .filter(|t| t.channel == s.channel)
                .collect(),
            awaiting_account: view
                .awaiting
                .iter()
                .filter(|a| a.channel == s.channel)
                .collect(),
        })
        .collect()
}

fn opt_secs(s: Option<i64>) -> String {
    s.map_or_else(|| "-".to_owned(), |s| s.to_string())
}

/// The per-tenant table, then (when there are any) the deliveries waiting for an account.
pub(crate) fn write(view: &TenantView, out: &mut impl Write) -> std::io::Result<()> {
    let shown = view.lateness.tenants.len();
    writeln!(
        out,
        "tenants with live work, the latest first ({shown} of {})",
        view.lateness.total
    )?;
    if shown == 0 {
        writeln!(out, "  none")?;
    } else {
        let rows: Vec<Vec<String>> = view
            .lateness
            .tenants
            .iter()
            .map(|t| {
                vec![
                    t.tenant.clone(),
                    t.channel.as_str().to_owned(),
                    t.account
                        .as_ref()
                        .map_or_else(|| "(default)".to_owned(), |a| a.as_str().to_owned()),
                    t.due.to_string(),
                    t.queued.to_string(),
                    t.sending.to_string(),
                    t.backoff.to_string(),
                    t.awaiting_account.to_string(),
                    t.quiet_hours.to_string(),
                    opt_secs(t.oldest_eligible_age_s),
                ]
            })
            .collect();
        write_table(
            out,
            "  ",
            &[
                ("tenant", Align::Left),
                ("channel", Align::Left),
                ("account", Align::Left),
                ("due", Align::Right),
                ("queued", Align::Right),
                ("sending", Align::Right),
                ("retry_wait", Align::Right),
                ("awaiting_account", Align::Right),
                ("quiet_hours", Align::Right),
                ("oldest_due_s", Align::Right),
            ],
            &rows,
        )?;
    }
    if view.awaiting.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "\ndeliveries waiting for their tenant's own provider account (never sent through another)"
    )?;
    let rows: Vec<Vec<String>> = view
        .awaiting
        .iter()
        .map(|a| {
            vec![
                a.tenant.clone(),
                a.channel.as_str().to_owned(),
                a.account
                    .as_ref()
                    .map_or_else(|| "(default now)".to_owned(), |a| a.as_str().to_owned()),
                a.deliveries.to_string(),
                a.oldest_scheduled_age_s.to_string(),
                timestamp(a.next_look_at),
                if a.held_now {
                    "yes: they go at their next look"
                } else {
                    "no live worker has it"
                }
                .to_owned(),
            ]
        })
        .collect();
    write_table(
        out,
        "  ",
        &[
            ("tenant", Align::Left),
            ("channel", Align::Left),
            ("account", Align::Left),
            ("deliveries", Align::Right),
            ("oldest_owed_s", Align::Right),
            ("next_look", Align::Left),
            ("worker", Align::Left),
        ],
        &rows,
    )?;
    if view.awaiting.iter().any(|a| !a.held_now) {
        writeln!(
            out,
            "  A worker with the account's [[providers]] entry sends them; or route the tenant \
             elsewhere (`nudgectl tenant route`). Until then they wait, and expire at their \
             expiry. See docs/OPERATIONS.md."
        )?;
    }
    Ok(())
}
