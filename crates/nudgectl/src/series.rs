//! `series list|show|cancel`: a tenant's recurring reminders as the ledger has them (no
//! subscriber, destination or content), and cancelling one, audited.

use std::io::Write;

use anyhow::{Context, bail};
use nudge_ledger::{Ledger, LedgerTime};

use crate::table::{Align, write_table};

pub const HELP: &str = "\
A tenant's recurring reminders (series), posted through POST /v1/tenants/{tenant}/series.
Each occurrence becomes its own reminder (event id `{series_id}/{local date-time}`) when the
producer's window reaches it; `reminders`, `trace TENANT/EVENT_ID` and `status` see it then.

  series list TENANT              newest first: created, next occurrence not yet created,
                                  occurrences created, cancelled
  series show TENANT SERIES_ID    the rule, its zone and start, counts, the next occurrences
  series cancel TENANT SERIES_ID --reason TEXT
                                  no occurrence is created any more; those created and not
                                  sent are cancelled with their deliveries (audited)";

fn time(t: Option<chrono::DateTime<chrono::Utc>>) -> String {
    t.map_or_else(
        || "-".to_owned(),
        |t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
    )
}

/// `series list TENANT`.
pub async fn list(
    ledger: &Ledger,
    tenant: &str,
    limit: u32,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let id = crate::find_tenant(ledger, tenant).await?.id;
    let all = ledger
        .list_series(id, limit)
        .await
        .context("failed to read the series")?;
    if all.is_empty() {
        writeln!(out, "no series for tenant {tenant}")?;
        return Ok(());
    }
    let rows: Vec<Vec<String>> = all
        .into_iter()
        .map(|s| {
            vec![
                s.series_id,
                s.time_zone,
                time(Some(s.created_at)),
                time(s.next_at),
                s.occurrences_created.to_string(),
                time(s.cancelled_at),
            ]
        })
        .collect();
    write_table(
        out,
        "",
        &[
            ("series", Align::Left),
            ("zone", Align::Left),
            ("created", Align::Left),
            ("next to create", Align::Left),
            ("created occurrences", Align::Right),
            ("cancelled", Align::Left),
        ],
        &rows,
    )?;
    Ok(())
}

/// `series show TENANT SERIES_ID`.
pub async fn show(
    ledger: &Ledger,
    tenant: &str,
    series_id: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let id = crate::find_tenant(ledger, tenant).await?.id;
    let now = crate::database_now(ledger).await?;
    let Some(s) = ledger
        .series_status(id, series_id, now)
        .await
        .context("failed to read the series")?
    else {
        bail!("tenant {tenant} has no series {series_id:?}");
    };
    let channels: Vec<&str> = s.channels.iter().map(|c| c.as_str()).collect();
    writeln!(out, "series {} of tenant {tenant}", s.series_id)?;
    writeln!(out, "  rule          {}", s.rrule)?;
    writeln!(
        out,
        "  start         {} {}",
        s.start_local.format("%Y-%m-%dT%H:%M:%S"),
        s.time_zone
    )?;
    writeln!(out, "  channels      {}", channels.join(", "))?;
    writeln!(out, "  expires after {} s", s.expires_after_s)?;
    writeln!(out, "  created       {}", time(Some(s.created_at)))?;
    writeln!(out, "  cancelled     {}", time(s.cancelled_at))?;
    writeln!(
        out,
        "  occurrences   {} created, {} sent",
        s.occurrences_created, s.occurrences_sent
    )?;
    writeln!(out, "  next to create {}", time(s.next_at))?;
    if s.unexpandable {
        writeln!(
            out,
            "  cannot be expanded: its zone or rule no longer parses (a zone this build's tz \
             database lacks); its occurrences wait. Post it again under a new id with a current \
             zone, then cancel this one."
        )?;
    }
    if s.upcoming.is_empty() {
        writeln!(out, "  upcoming      none")?;
    } else {
        let rows: Vec<Vec<String>> = s
            .upcoming
            .iter()
            .map(|o| {
                vec![
                    o.local.to_string(),
                    time(Some(o.instant())),
                    match o.resolved.kind {
                        nudge_domain::Resolution::Exact => "exact",
                        nudge_domain::Resolution::Skipped { .. } => "moved past the gap",
                        nudge_domain::Resolution::Repeated { .. } => "earlier of two",
                    }
                    .to_owned(),
                ]
            })
            .collect();
        writeln!(out, "  upcoming")?;
        write_table(
            out,
            "    ",
            &[
                ("local", Align::Left),
                ("due", Align::Left),
                ("wall clock", Align::Left),
            ],
            &rows,
        )?;
    }
    Ok(())
}

/// `series cancel TENANT SERIES_ID --reason`.
pub async fn cancel(
    ledger: &Ledger,
    actor: &str,
    tenant: &str,
    series_id: &str,
    reason: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    crate::require_reason(reason)?;
    let id = crate::find_tenant(ledger, tenant).await?.id;
    let by = crate::operator(ledger, actor, Some(reason)).await?;
    let Some(done) = ledger
        .cancel_series(id, series_id, Some(&by), LedgerTime::Database)
        .await
        .context("failed to cancel the series")?
    else {
        bail!("tenant {tenant} has no series {series_id:?}");
    };
    if done.already_cancelled {
        writeln!(
            out,
            "series {series_id} was cancelled before: nothing changed"
        )?;
    } else {
        writeln!(
            out,
            "series {series_id} cancelled: {} occurrences cancelled ({} deliveries), {} already \
             sent",
            done.occurrences_cancelled, done.deliveries_cancelled, done.occurrences_sent
        )?;
    }
    Ok(())
}
