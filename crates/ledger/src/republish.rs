//! What the relay may republish: per channel, the `queued` deliveries whose message was not
//! consumed in time, and how many deliveries of the channel are `queued` at all.
//!
//! Both are reads. The relay compares the `queued` count with the work queue's depth and
//! republishes at most the difference, so a queue nobody consumes never holds more messages
//! than there are `queued` deliveries (see `nudge-producer`'s relay). A republished message
//! carries the delivery's current generation: it is a second pointer to the same claim, and of
//! any number of such pointers exactly one can lease (the lease is one conditional UPDATE).
//!
//! Time conditions use PostgreSQL's clock, as every time condition in SQL does.

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, DeliveryId, ReminderId, TenantId};

use crate::{DueDelivery, Ledger, LedgerError, LedgerTime};

#[derive(sqlx::FromRow)]
struct UnconsumedRow {
    id: uuid::Uuid,
    reminder_id: uuid::Uuid,
    tenant_id: uuid::Uuid,
    channel: String,
    generation: i64,
    lane: String,
    next_attempt_at: DateTime<Utc>,
    correlation_id: Option<String>,
}

impl TryFrom<UnconsumedRow> for DueDelivery {
    type Error = LedgerError;
    fn try_from(row: UnconsumedRow) -> Result<Self, Self::Error> {
        let corrupt = |e: String| LedgerError::corrupt("deliveries", e);
        Ok(Self {
            id: DeliveryId::from_uuid(row.id),
            reminder_id: ReminderId::from_uuid(row.reminder_id),
            tenant_id: TenantId::from_uuid(row.tenant_id),
            channel: row.channel.parse().map_err(|e| corrupt(format!("{e}")))?,
            generation: u64::try_from(row.generation).map_err(|e| corrupt(e.to_string()))?,
            lane: row.lane.parse().map_err(|e| corrupt(format!("{e}")))?,
            next_attempt_at: row.next_attempt_at,
            correlation_id: row.correlation_id,
        })
    }
}

impl Ledger {
    /// Up to `limit` deliveries of `channel` that have been `queued` for at least
    /// `older_than` (by the database's clock) and never leased, oldest publish first; a
    /// publish handed back with [`mark_unpublished`](Self::mark_unpublished) counts as oldest.
    pub async fn unconsumed(
        &self,
        channel: Channel,
        older_than: Duration,
        limit: u32,
        at: LedgerTime,
    ) -> Result<Vec<DueDelivery>, LedgerError> {
        let rows: Vec<UnconsumedRow> = sqlx::query_as(
            "SELECT id, reminder_id, tenant_id, channel, generation, lane, next_attempt_at,
                    (SELECT r.correlation_id FROM reminders r WHERE r.id = deliveries.reminder_id)
                        AS correlation_id
             FROM deliveries
             WHERE state = 'queued' AND channel = $1 AND owner = $5
               AND queued_at <= COALESCE($4, now()) - make_interval(secs => $2)
             ORDER BY queued_at
             LIMIT $3",
        )
        .bind(channel.as_str())
        .bind(older_than.as_secs_f64())
        .bind(i64::from(limit))
        .bind(at.bind())
        .bind(&*self.sender)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(DueDelivery::try_from).collect()
    }

    /// How many deliveries of `channel` are `queued`: published, or to be republished, and
    /// not yet leased. Each needs one message in `work.<channel>`.
    pub async fn queued(&self, channel: Channel) -> Result<u64, LedgerError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM deliveries WHERE state = 'queued' AND channel = $1",
        )
        .bind(channel.as_str())
        .fetch_one(&self.pool)
        .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
