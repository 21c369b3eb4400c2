//! `events replay|tail`: a tenant's delivery events (decision 0601) as JSON Lines, the same
//! fields as `GET /v1/tenants/{tenant}/events`, from a position or a time. Reads only.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use nudge_domain::TenantId;
use nudge_ledger::{EVENTS_PAGE_MAX, Ledger};

pub const HELP: &str = "\
A tenant's delivery events: every change of its deliveries a client can see (scheduled,
deferred, sent, delivered, failed, expired, cancelled, suppressed, held_ambiguous, redriven,
rescheduled), written with the change, numbered by the janitor within
janitor.events_interval_ms of its commit (docs/decisions/0601). One JSON object per line, the
fields of GET /v1/tenants/{tenant}/events; ids, states and times only, never a destination.

  events replay --tenant T [--from CURSOR|TIME]   every event after CURSOR (a position) or
                                                  from TIME (RFC 3339) on, up to the newest,
                                                  then exits; without --from, from the first
                                                  kept
  events tail --tenant T [--from CURSOR|TIME] [--for SECONDS] [--limit N]
                                                  new events as they are numbered (from the
                                                  newest, or from --from), until Ctrl-C,
                                                  --for seconds or --limit events

Each ends by printing the position to go on from on stderr (`next cursor: N`): give it as
--from to go on where it stopped.";

/// Where to start: after a position, or at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum From {
    Position(i64),
    Time(DateTime<Utc>),
}

/// `--from`: a whole number is a position, anything else must be an RFC 3339 time.
pub fn parse_from(text: &str) -> Result<From, String> {
    if let Ok(position) = text.parse::<i64>() {
        return if position >= 0 {
            Ok(From::Position(position))
        } else {
            Err("a position is 0 or more".to_owned())
        };
    }
    DateTime::parse_from_rfc3339(text)
        .map(|t| From::Time(t.with_timezone(&Utc)))
        .map_err(|_| {
            "must be a position (a whole number) or an RFC 3339 time (2027-03-14T08:00:00Z)"
                .to_owned()
        })
}

/// How often `tail` reads again when it is at the newest.
const TAIL_EVERY: Duration = Duration::from_millis(500);

async fn start(ledger: &Ledger, tenant: TenantId, from: Option<From>) -> anyhow::Result<i64> {
    Ok(match from {
        None => 0,
        Some(From::Position(p)) => p,
        Some(From::Time(t)) => ledger
            .tenant_events_position_at(tenant, t)
            .await
            .context("failed to find the first event at that time")?,
    })
}

/// `events replay`.
pub async fn replay(
    ledger: &Ledger,
    tenant: &str,
    from: Option<From>,
    out: &mut impl Write,
    err: &mut impl Write,
) -> anyhow::Result<()> {
    let id = crate::find_tenant(ledger, tenant).await?.id;
    let mut after = start(ledger, id, from).await?;
    let mut printed = 0_u64;
    loop {
        let page = ledger
            .tenant_events(id, after, EVENTS_PAGE_MAX)
            .await
            .context("failed to read the tenant's events")?;
        for event in &page.events {
            writeln!(out, "{}", event.wire())?;
        }
        printed += page.events.len() as u64;
        after = page.next_after;
        if !page.more {
            break;
        }
    }
    out.flush()?;
    writeln!(err, "{printed} events; next cursor: {after}")?;
    Ok(())
}

/// `events tail`.
pub async fn tail(
    ledger: &Ledger,
    tenant: &str,
    from: Option<From>,
    for_seconds: Option<u64>,
    limit: Option<u64>,
    out: &mut impl Write,
    err: &mut impl Write,
) -> anyhow::Result<()> {
    let id = crate::find_tenant(ledger, tenant).await?.id;
    let mut after = match from {
        Some(from) => start(ledger, id, Some(from)).await?,
        None => newest(ledger, id).await?,
    };
    let until = for_seconds.map(|s| tokio::time::Instant::now() + Duration::from_secs(s));
    let mut printed = 0_u64;
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    'reading: loop {
        let want = limit.map_or(u64::from(EVENTS_PAGE_MAX), |l| l - printed);
        let page = ledger
            .tenant_events(id, after, u32::try_from(want).unwrap_or(EVENTS_PAGE_MAX))
            .await
            .context("failed to read the tenant's events")?;
        for event in &page.events {
            writeln!(out, "{}", event.wire())?;
        }
        out.flush()?;
        printed += page.events.len() as u64;
        after = page.next_after;
        if limit.is_some_and(|l| printed >= l) {
            break;
        }
        if until.is_some_and(|u| tokio::time::Instant::now() >= u) {
            break;
        }
        let wait = if page.more {
            Duration::ZERO
        } else {
            TAIL_EVERY
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = &mut interrupted => break 'reading,
        }
    }
    writeln!(err, "{printed} events; next cursor: {after}")?;
    Ok(())
}

/// The newest numbered position of the tenant (0 when none).
async fn newest(ledger: &Ledger, tenant: TenantId) -> anyhow::Result<i64> {
    ledger
        .tenant_events_newest(tenant)
        .await
        .context("failed to read the tenant's newest event")
}
