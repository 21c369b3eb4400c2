//! The relay's side: claiming due work for publishing, and handing back what failed to publish.
//!
//! A claim commits before its message is published (see the module above and
//! `docs/decisions/0405-a-claim-commits-before-its-message-is-published.md`): a worker's lease
//! never waits for an uncommitted claim, so a message must never point at a generation that is
//! not yet committed.

use nudge_domain::Channel;

use super::{DueDelivery, DueRow, LedgerTime, to_i64};
use crate::{Ledger, LedgerError};

const CLAIM_DUE: &str = "WITH due AS (
        SELECT id FROM deliveries
        WHERE channel = $1 AND state IN ('scheduled', 'retry_wait')
          AND next_attempt_at <= COALESCE($3, now()) AND owner = $4
        ORDER BY next_attempt_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED)
    UPDATE deliveries d
    SET state = 'queued', generation = d.generation + 1,
        queued_at = COALESCE($3, now()), updated_at = COALESCE($3, now())
    FROM due WHERE d.id = due.id
    RETURNING d.id, d.reminder_id, d.tenant_id, d.channel, d.generation, d.lane,
              d.next_attempt_at,
              (SELECT r.correlation_id FROM reminders r WHERE r.id = d.reminder_id)
                  AS correlation_id";

impl Ledger {
    /// PostgreSQL's plan for [`claim_due`](Self::claim_due), the very statement the relay
    /// runs (EXPLAIN, not executed): operators and tests check that it stays an index scan.
    pub async fn explain_claim_due(
        &self,
        channel: Channel,
        limit: u32,
        at: LedgerTime,
    ) -> Result<String, LedgerError> {
        let lines: Vec<String> =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {CLAIM_DUE}")))
                .bind(channel.as_str())
                .bind(i64::from(limit))
                .bind(at.bind())
                .bind(&*self.sender)
                .fetch_all(&self.pool)
                .await?;
        Ok(lines.join("\n"))
    }

    /// Claims up to `limit` deliveries of `channel` whose `next_attempt_at` has come (first
    /// attempts and retries), oldest first, skipping rows another relay is claiming, and commits
    /// them as `queued` with a new generation. Publish one message per item afterwards. The
    /// relay claims per channel, so a backlog on one channel never crowds another out of a batch.
    ///
    /// A crash between claim and publish leaves the delivery `queued` with no message, which
    /// [`unconsumed`](Self::unconsumed) finds for the relay to republish after its timeout; a publish that
    /// fails is handed to [`mark_unpublished`](Self::mark_unpublished) so the next tick
    /// republishes it at once. Only the handle's sender's deliveries are claimed
    /// ([`Ledger::for_sender`]). The lane is the delivery's own: it becomes `retry` when an
    /// attempt fails, never because a lease was given back.
    pub async fn claim_due(
        &self,
        channel: Channel,
        limit: u32,
        at: LedgerTime,
    ) -> Result<Vec<DueDelivery>, LedgerError> {
        let rows = sqlx::query_as::<_, DueRow>(CLAIM_DUE)
            .bind(channel.as_str())
            .bind(i64::from(limit))
            .bind(at.bind())
            .bind(&*self.sender)
            .fetch_all(&self.pool)
            .await?;
        sorted(rows)
    }

    /// Marks claimed deliveries whose publish failed so that the next
    /// [`unconsumed`](Self::unconsumed) returns them at once.
    /// Only the claim's own generation is touched: work that moved on is left alone.
    pub async fn mark_unpublished(&self, items: &[DueDelivery]) -> Result<u64, LedgerError> {
        let ids: Vec<uuid::Uuid> = items.iter().map(|d| d.id.as_uuid()).collect();
        let generations: Vec<i64> = items.iter().map(|d| to_i64(d.generation)).collect();
        let done = sqlx::query(
            "UPDATE deliveries d SET queued_at = 'epoch'
             FROM UNNEST($1::uuid[], $2::bigint[]) AS u(id, generation)
             WHERE d.id = u.id AND d.generation = u.generation AND d.state = 'queued'",
        )
        .bind(&ids)
        .bind(&generations)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}

fn sorted(rows: Vec<DueRow>) -> Result<Vec<DueDelivery>, LedgerError> {
    let mut items = rows
        .into_iter()
        .map(DueDelivery::try_from)
        .collect::<Result<Vec<_>, _>>()?;
    items.sort_by_key(|d| d.next_attempt_at);
    Ok(items)
}
