use chrono::{DateTime, Utc};
use nudge_domain::Channel;

use crate::{Ledger, LedgerError};

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
    oldest_eligible: Option<DateTime<Utc>>,
}

impl Ledger {
    /// Per-channel counts of work not yet settled, plus the dead-lettered and ambiguous
    /// totals. Every channel appears, with zeros when it has nothing.
    pub async fn status(&self, now: DateTime<Utc>) -> Result<Vec<ChannelStatus>, LedgerError> {
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
                    min(next_attempt_at) FILTER (WHERE state IN ('scheduled', 'queued', 'retry_wait')
                                                 AND next_attempt_at <= $1) AS oldest_eligible
             FROM deliveries
             WHERE state IN ('scheduled', 'queued', 'sending', 'retry_wait', 'dead_lettered', 'ambiguous')
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
                status.oldest_eligible_age_s =
                    row.oldest_eligible.map(|t| (now - t).num_seconds().max(0));
            }
        }
        Ok(out)
    }
}
