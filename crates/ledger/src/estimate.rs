//! Read-only queries behind `nudgectl estimate-drain`: what a channel owes now, in the order
//! it would be sent, and how much more falls due over a drain.
//!
//! They return ids and times only, never anything about the subscriber, and they use the
//! partial indexes meant for them (`deliveries_eligible_idx` on `(channel, next_attempt_at)`,
//! `deliveries_lease_idx` for what is in flight, `reminders_window_idx` per tenant).

use chrono::{DateTime, Utc};
/// The owed deliveries come back as the drain model walks them.
pub use nudge_domain::drain::OwedDelivery;
use nudge_domain::{Channel, DeliveryId};

use crate::{Ledger, LedgerError};

/// What a channel owes right now: eligible deliveries whose time has come, and those a worker
/// is sending.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Backlog {
    /// `scheduled`, `retry_wait` or `queued` with `next_attempt_at <= now`.
    pub due: u64,
    /// `sending`: leased by a worker.
    pub sending: u64,
}

impl Backlog {
    pub fn total(&self) -> u64 {
        self.due.saturating_add(self.sending)
    }
}

#[derive(sqlx::FromRow)]
struct OwedRow {
    id: uuid::Uuid,
    next_attempt_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct BacklogRow {
    due: i64,
    sending: i64,
}

fn count(table: &'static str, n: i64) -> Result<u64, LedgerError> {
    u64::try_from(n).map_err(|e| LedgerError::corrupt(table, e))
}

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

impl Ledger {
    /// How many deliveries of `channel` are owed at `now` (see [`Backlog`]).
    pub async fn backlog(
        &self,
        channel: Channel,
        now: DateTime<Utc>,
    ) -> Result<Backlog, LedgerError> {
        let row: BacklogRow = sqlx::query_as(
            "SELECT (SELECT count(*) FROM deliveries
                     WHERE channel = $1 AND state IN ('scheduled', 'queued', 'retry_wait')
                       AND next_attempt_at <= $2) AS due,
                    (SELECT count(*) FROM deliveries
                     WHERE state = 'sending' AND channel = $1) AS sending",
        )
        .bind(channel.as_str())
        .bind(now)
        .fetch_one(&self.pool)
        .await?;
        Ok(Backlog {
            due: count("deliveries", row.due)?,
            sending: count("deliveries", row.sending)?,
        })
    }

    /// Up to `limit` deliveries of `channel` owed at `now`, in the order they would be sent:
    /// those in flight first (already admitted), then the eligible ones by `next_attempt_at`,
    /// then id.
    pub async fn owed_in_due_order(
        &self,
        channel: Channel,
        now: DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<OwedDelivery>, LedgerError> {
        let mut conn = self.pool.acquire().await?;
        // A delivery in flight keeps the next_attempt_at it was leased at; the fallbacks only
        // guard a row written without one.
        let sending: Vec<OwedRow> = sqlx::query_as(
            "SELECT id, COALESCE(next_attempt_at, last_attempt_at, updated_at) AS next_attempt_at,
                    expires_at
             FROM deliveries
             WHERE state = 'sending' AND channel = $1
             ORDER BY 2, id
             LIMIT $2",
        )
        .bind(channel.as_str())
        .bind(to_i64(limit))
        .fetch_all(&mut *conn)
        .await?;
        let remaining = limit.saturating_sub(sending.len() as u64);
        let eligible: Vec<OwedRow> = if remaining == 0 {
            Vec::new()
        } else {
            sqlx::query_as(
                "SELECT id, next_attempt_at, expires_at
                 FROM deliveries
                 WHERE channel = $1 AND state IN ('scheduled', 'queued', 'retry_wait')
                   AND next_attempt_at <= $2
                 ORDER BY next_attempt_at, id
                 LIMIT $3",
            )
            .bind(channel.as_str())
            .bind(now)
            .bind(to_i64(remaining))
            .fetch_all(&mut *conn)
            .await?
        };
        let owed = |row: OwedRow, in_flight: bool| OwedDelivery {
            id: DeliveryId::from_uuid(row.id),
            next_attempt_at: row.next_attempt_at,
            expires_at: row.expires_at,
            in_flight,
        };
        Ok(sending
            .into_iter()
            .map(|row| owed(row, true))
            .chain(eligible.into_iter().map(|row| owed(row, false)))
            .collect())
    }

    /// How much work of `channel` falls due in `(from, to]`: deliveries waiting for a later
    /// `next_attempt_at`, plus reminders scheduled then on that channel that have no delivery
    /// yet (not materialised by the producer). Cancelled reminders do not count, nor do
    /// unmaterialised ones while the channel drains (they are held until the drain ends).
    pub async fn arrivals(
        &self,
        channel: Channel,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<u64, LedgerError> {
        if to <= from {
            return Ok(0);
        }
        // Per tenant, so each reminder scan is a range of reminders_window_idx.
        let n: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM deliveries
                     WHERE channel = $1 AND state IN ('scheduled', 'queued', 'retry_wait')
                       AND next_attempt_at > $2 AND next_attempt_at <= $3)
                  + (SELECT count(*)
                     FROM tenants t
                     JOIN channel_controls cc ON cc.channel = $1 AND NOT cc.draining
                     CROSS JOIN LATERAL (
                         SELECT 1 FROM reminders r
                         WHERE r.tenant_id = t.id AND r.cancelled_at IS NULL
                           AND r.scheduled_at > $2 AND r.scheduled_at <= $3
                           AND $1 = ANY (r.channels)
                           AND NOT EXISTS (SELECT 1 FROM deliveries d
                                           WHERE d.reminder_id = r.id AND d.channel = $1)
                     ) pending)",
        )
        .bind(channel.as_str())
        .bind(from)
        .bind(to)
        .fetch_one(&self.pool)
        .await?;
        count("deliveries", n)
    }
}
