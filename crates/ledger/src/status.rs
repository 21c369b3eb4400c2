use chrono::{DateTime, Utc};
use nudge_domain::{Channel, ProviderAccount, TenantId};

use crate::gauges::LIVE_WORK;
use crate::{Ledger, LedgerError, LedgerTime};

/// The live picture of one channel, for `nudgectl status` and the drain estimate.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ChannelStatus {
    pub channel: Channel,
    pub scheduled: u64,
    /// Scheduled or waiting to retry, and whose time has come.
    pub due: u64,
    pub queued: u64,
    pub sending: u64,
    pub retry_wait: u64,
    pub dead_lettered: u64,
    pub ambiguous: u64,
    /// Of `retry_wait`: deferred to the end of the subscriber's quiet hours.
    pub quiet_hours: u64,
    /// Settled `expired` because their quiet hours outlasted them (reason `quiet_hours`),
    /// as long as retention keeps them: what the policy cost.
    pub expired_quiet_hours: u64,
    /// Settled `suppressed` (not sent: the destination opted out, or the category was
    /// switched off), as long as retention keeps them.
    pub suppressed: u64,
    /// How long the oldest eligible delivery (due, not yet being sent) has waited, in seconds.
    pub oldest_eligible_age_s: Option<i64>,
    /// Draining: nothing new is scheduled for the channel (see `nudgectl drain`).
    pub draining: bool,
    pub drain_incident: Option<String>,
    pub drain_started_at: Option<DateTime<Utc>>,
    /// The sender that owns the channel's new work.
    pub owner: String,
}

#[derive(sqlx::FromRow)]
struct StatusRow {
    channel: String,
    scheduled: i64,
    due: i64,
    queued: i64,
    sending: i64,
    retry_wait: i64,
    dead_lettered: i64,
    ambiguous: i64,
    quiet_hours: i64,
    oldest_eligible: Option<DateTime<Utc>>,
}

impl Ledger {
    /// Per-channel counts of work not yet settled, plus the dead-lettered and ambiguous
    /// totals. Every channel appears, with zeros when it has nothing.
    pub async fn status(&self, now: DateTime<Utc>) -> Result<Vec<ChannelStatus>, LedgerError> {
        // Each state through its own partial index (a single `state IN (...)` over them would
        // read the whole table, settled history included).
        let rows: Vec<StatusRow> = sqlx::query_as(
            "SELECT channel,
                    count(*) FILTER (WHERE state = 'scheduled') AS scheduled,
                    count(*) FILTER (WHERE state IN ('scheduled', 'retry_wait')
                                     AND next_attempt_at <= $1) AS due,
                    count(*) FILTER (WHERE state = 'queued') AS queued,
                    count(*) FILTER (WHERE state = 'sending') AS sending,
                    count(*) FILTER (WHERE state = 'retry_wait') AS retry_wait,
                    count(*) FILTER (WHERE state = 'dead_lettered') AS dead_lettered,
                    count(*) FILTER (WHERE state = 'ambiguous') AS ambiguous,
                    count(*) FILTER (WHERE state = 'retry_wait' AND next_attempt_at > $1
                                     AND last_error_reason = 'quiet_hours') AS quiet_hours,
                    min(next_attempt_at) FILTER (WHERE state IN ('scheduled', 'queued', 'retry_wait')
                                                 AND next_attempt_at <= $1) AS oldest_eligible
             FROM (SELECT channel, state, next_attempt_at, last_error_reason FROM deliveries
                   WHERE state IN ('scheduled', 'queued', 'retry_wait')
                   UNION ALL SELECT channel, state, next_attempt_at, last_error_reason
                   FROM deliveries WHERE state = 'sending'
                   UNION ALL SELECT channel, state, next_attempt_at, last_error_reason
                   FROM deliveries WHERE state = 'dead_lettered'
                   UNION ALL SELECT channel, state, next_attempt_at, last_error_reason
                   FROM deliveries WHERE state = 'ambiguous') d
             GROUP BY channel",
        )
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        let mut out: Vec<ChannelStatus> = Channel::ALL
            .iter()
            .map(|&channel| ChannelStatus {
                channel,
                scheduled: 0,
                due: 0,
                queued: 0,
                sending: 0,
                retry_wait: 0,
                dead_lettered: 0,
                ambiguous: 0,
                quiet_hours: 0,
                expired_quiet_hours: 0,
                suppressed: 0,
                oldest_eligible_age_s: None,
                draining: false,
                drain_incident: None,
                drain_started_at: None,
                owner: crate::DEFAULT_SENDER.to_owned(),
            })
            .collect();
        for control in self.channel_controls().await? {
            if let Some(status) = out.iter_mut().find(|s| s.channel == control.channel) {
                status.draining = control.draining;
                status.drain_incident = control.drain_incident;
                status.drain_started_at = control.drain_started_at;
                status.owner = control.owner;
            }
        }
        for row in rows {
            let channel: Channel = row
                .channel
                .parse()
                .map_err(|e| LedgerError::corrupt("deliveries", e))?;
            if let Some(status) = out.iter_mut().find(|s| s.channel == channel) {
                status.scheduled = count(row.scheduled);
                status.due = count(row.due);
                status.queued = count(row.queued);
                status.sending = count(row.sending);
                status.retry_wait = count(row.retry_wait);
                status.dead_lettered = count(row.dead_lettered);
                status.ambiguous = count(row.ambiguous);
                status.quiet_hours = count(row.quiet_hours);
                status.oldest_eligible_age_s =
                    row.oldest_eligible.map(|t| (now - t).num_seconds().max(0));
            }
        }
        // Settled rows worth an operator's eye, through the index of settled states.
        let settled: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT channel,
                    count(*) FILTER (WHERE state = 'expired'
                                     AND last_error_reason = 'quiet_hours'),
                    count(*) FILTER (WHERE state = 'suppressed')
             FROM deliveries WHERE state IN ('expired', 'suppressed') GROUP BY channel",
        )
        .fetch_all(&self.pool)
        .await?;
        for (channel, expired, suppressed) in settled {
            let channel: Channel = channel
                .parse()
                .map_err(|e| LedgerError::corrupt("deliveries", e))?;
            if let Some(status) = out.iter_mut().find(|s| s.channel == channel) {
                status.expired_quiet_hours = count(expired);
                status.suppressed = count(suppressed);
            }
        }
        Ok(out)
    }
}

/// The live work of one tenant on one channel, for the per-tenant table of `nudgectl status`:
/// a tenant's lateness, not the channel's average (invariant 14).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TenantLateness {
    pub tenant_id: TenantId,
    pub tenant: String,
    pub channel: Channel,
    /// The tenant's own account on the channel; None: the workers' default.
    pub account: Option<ProviderAccount>,
    /// Its intake is paused (`nudgectl tenant pause`): what it already had still goes out.
    pub intake_paused: bool,
    /// `scheduled` or `retry_wait` whose time has come, not yet claimed by the relay.
    pub due: u64,
    /// Claimed and published, waiting for a worker.
    pub queued: u64,
    pub sending: u64,
    /// `retry_wait` whose next attempt is still ahead (a backoff, a bucket's pause, or the
    /// next look for an account: see `awaiting_account`).
    pub backoff: u64,
    /// Of `backoff`: given back because no live worker had the tenant's account.
    pub awaiting_account: u64,
    /// Of `backoff`: deferred to the end of the subscriber's quiet hours.
    pub quiet_hours: u64,
    /// How long the tenant's oldest eligible delivery (due or queued) has waited, in seconds;
    /// the same figure as the gauge `nudge_ledger_tenant_oldest_eligible_age_seconds`.
    pub oldest_eligible_age_s: Option<i64>,
}

/// The tenants with live work, the latest first, at most as many as asked for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TenantLatenessReport {
    pub tenants: Vec<TenantLateness>,
    /// How many tenant and channel pairs have live work (the report may show fewer).
    pub total: u64,
}

#[derive(sqlx::FromRow)]
struct TenantRow {
    tenant_id: uuid::Uuid,
    tenant: String,
    intake_paused: bool,
    channel: String,
    account: Option<String>,
    due: i64,
    queued: i64,
    sending: i64,
    backoff: i64,
    awaiting_account: i64,
    quiet_hours: i64,
    oldest_eligible_age_s: Option<f64>,
    total: i64,
}

impl Ledger {
    /// Every tenant and channel with live work (due, queued, sending or waiting to retry), the
    /// latest first: by the age of the oldest eligible delivery, then by the work waiting for
    /// an account, then by the work due; at most `limit` of them. One pass over the live
    /// rows, as the janitor's gauges make.
    pub async fn tenant_lateness(
        &self,
        limit: u32,
        at: LedgerTime,
    ) -> Result<TenantLatenessReport, LedgerError> {
        let rows: Vec<TenantRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "WITH c AS (SELECT COALESCE($1, now()) AS at),
             work AS ({LIVE_WORK})
             SELECT w.tenant_id, t.name AS tenant, t.intake_paused, w.channel,
                    tc.provider_account AS account,
                    w.due, w.queued, w.sending, w.backoff, w.awaiting_account, w.quiet_hours,
                    w.oldest_eligible_age_s, count(*) OVER () AS total
             FROM work w JOIN tenants t ON t.id = w.tenant_id
             LEFT JOIN tenant_channels tc ON tc.tenant_id = w.tenant_id AND tc.channel = w.channel
             ORDER BY w.oldest_eligible_age_s DESC NULLS LAST, w.awaiting_account DESC,
                      w.due DESC, t.name, w.channel
             LIMIT $2"
        )))
        .bind(at.bind())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        let total = rows.first().map_or(0, |r| count(r.total));
        let tenants = rows
            .into_iter()
            .map(|r| {
                Ok(TenantLateness {
                    tenant_id: TenantId::from_uuid(r.tenant_id),
                    tenant: r.tenant,
                    intake_paused: r.intake_paused,
                    channel: r
                        .channel
                        .parse()
                        .map_err(|e| LedgerError::corrupt("deliveries", e))?,
                    account: r
                        .account
                        .as_deref()
                        .map(ProviderAccount::parse)
                        .transpose()
                        .map_err(|e| LedgerError::corrupt("tenant_channels", e))?,
                    due: count(r.due),
                    queued: count(r.queued),
                    sending: count(r.sending),
                    backoff: count(r.backoff),
                    awaiting_account: count(r.awaiting_account),
                    quiet_hours: count(r.quiet_hours),
                    // Whole seconds, as the channel table shows them.
                    oldest_eligible_age_s: r.oldest_eligible_age_s.map(|s| s.max(0.0) as i64),
                })
            })
            .collect::<Result<Vec<_>, LedgerError>>()?;
        Ok(TenantLatenessReport { tenants, total })
    }
}
