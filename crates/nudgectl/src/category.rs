//! `category create|list`: what a tenant's reminders are about (decision 0506). A reminder
//! names one (`general` unless it says); a subscriber may switch a category off per channel
//! through the preferences API unless the tenant made it required.

use std::io::Write;

use anyhow::Context;
use nudge_domain::Category;
use nudge_ledger::{CategoryCreated, Ledger};

use crate::table::{Align, write_table};

pub const HELP: &str = "\
Categories: what a tenant's reminders are about (appointment, billing, medication). A reminder
or a series names one in `category` (`general` when it does not; one the tenant does not have
is refused with 400). A subscriber may switch a category off per channel (PUT
/v1/tenants/{tenant}/subscribers/{ref}/preferences) unless it is required: switching a required
one off is refused with 409. A destination's opt-out (a patient's STOP) stops every category,
required ones too. Every tenant has `general`, never required. Categories are never deleted or
changed: a reminder names one for its whole life (docs/decisions/0506).

  category create TENANT NAME [--required] --reason TEXT
  category list TENANT";

/// `category create TENANT NAME [--required] --reason TEXT`.
pub async fn create(
    ledger: &Ledger,
    actor: &str,
    tenant: &str,
    name: &str,
    required: bool,
    reason: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let name = Category::parse(name).map_err(|e| anyhow::anyhow!("NAME: {e}"))?;
    let id = crate::find_tenant(ledger, tenant).await?.id;
    let by = crate::operator(ledger, actor, Some(reason)).await?;
    let created = ledger
        .create_category(id, &name, required, &by)
        .await
        .context("failed to create the category")?;
    let kind = if required { "required" } else { "optional" };
    match created {
        CategoryCreated::Created => writeln!(out, "created {kind} category {name} of {tenant}")?,
        CategoryCreated::AlreadyPresent => {
            writeln!(
                out,
                "{kind} category {name} of {tenant} exists already: nothing changed"
            )?;
        }
    }
    Ok(())
}

/// `category list TENANT`.
pub async fn list(ledger: &Ledger, tenant: &str, out: &mut impl Write) -> anyhow::Result<()> {
    let id = crate::find_tenant(ledger, tenant).await?.id;
    let rows: Vec<Vec<String>> = ledger
        .categories(id)
        .await
        .context("failed to read the categories")?
        .into_iter()
        .map(|c| {
            vec![
                c.name.to_string(),
                if c.required { "yes" } else { "no" }.to_owned(),
                c.created_at.map_or_else(
                    || "-".to_owned(),
                    |t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
                ),
            ]
        })
        .collect();
    write_table(
        out,
        "",
        &[
            ("category", Align::Left),
            ("required", Align::Left),
            ("created", Align::Left),
        ],
        &rows,
    )?;
    Ok(())
}
