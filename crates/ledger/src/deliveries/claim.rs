//! The relay's side: claiming due work for publishing, and handing back what failed to publish.
//!
//! A claim commits before its message is published (see the module above and
//! `docs/decisions/0405-a-claim-commits-before-its-message-is-published.md`): a worker's lease
//! never waits for an uncommitted claim, so a message must never point at a generation that is
//! not yet committed.

use nudge_domain::Channel;

use super::{DueDelivery, DueRow, LedgerTime, to_i64};
use crate::{Ledger, LedgerError};

/// Due work in weighted turns per tenant (invariant 14; decisions 0410 and 0413), the rule of
/// `nudge_domain::fairness::claim_order` in SQL (a ledger test holds the two together): each
/// tenant with due work on the channel offers its oldest deliveries, the n-th at turn
/// `start + (n - 1) / claim_weight`, where `start` is the tenant's pass on the channel, kept
/// within one turn above the lowest pass among the tenants with due work (a tenant without one
/// starts at that lowest pass). The claim takes the earliest turns; tenants at the same turn go
/// in the order of the claim's draw (`$5`, fresh for every claim: a fixed order would serve the
/// same tenant first at every turn, claim after claim); oldest first within a tenant.
/// Deliveries due at the same instant go in the order they were created (their ids are UUIDv7),
/// so one given back by the reaper keeps its place among them. The claim then moves each
/// tenant's pass one turn past its last delivery claimed (to its start, for a tenant that had due
/// work and got none), so claims of a few deliveries serve the tenants in turn, and by weight, as
/// one large claim does; a pass another relay moved since this claim read it is left as that
/// relay wrote it (the other claim's turns stand; this one's are the ones not counted). Each
/// tenant offers at most the claim's limit, so a claim reads at most
/// `tenants with due work x limit` index entries. The lock and the update then take each
/// offered row where the offer read it (its `ctid`, with its id): a plan that owes nothing to
/// the table's statistics. Found again through an index or a join of all due rows, the plan
/// rested on statistics that a batch falling due leaves stale until the next analyse, and a
/// nested loop over 10,000 due rows cost a second per claim (decision 0414). The lock
/// re-checks that each row is still due and still this sender's, on its newest version: a
/// reschedule that moved it later meanwhile leaves it for its new time, never queued early for
/// a lease that would refuse it; the update follows the row to that version.
const CLAIM_DUE: &str = "WITH due_tenants AS MATERIALIZED (
        SELECT t.id, t.claim_weight, p.pass,
               sha256(convert_to(t.id::text || ':' || $5, 'UTF8')) AS tiebreak
        FROM tenants t
        LEFT JOIN tenant_claim_passes p ON p.channel = $1 AND p.tenant_id = t.id
        WHERE EXISTS (
            SELECT 1 FROM deliveries d
            WHERE d.channel = $1 AND d.tenant_id = t.id AND d.state IN ('scheduled', 'retry_wait')
              AND d.next_attempt_at <= COALESCE($3, now()) AND d.owner = $4)),
    starts AS MATERIALIZED (
        SELECT dt.id, dt.claim_weight, dt.pass, dt.tiebreak,
               LEAST(GREATEST(COALESCE(dt.pass, f.low), f.low), f.low + 1) AS start
        FROM due_tenants dt
        CROSS JOIN (SELECT COALESCE(min(pass), 0) AS low FROM due_tenants) f),
    turns AS (
        SELECT offered.id, offered.row_tid, offered.next_attempt_at, s.tiebreak,
               s.start + (offered.n - 1)::float8 / s.claim_weight AS turn
        FROM starts s
        CROSS JOIN LATERAL (
            SELECT d.id, d.ctid AS row_tid, d.next_attempt_at,
                   row_number() OVER (ORDER BY d.next_attempt_at, d.id) AS n
            FROM deliveries d
            WHERE d.channel = $1 AND d.tenant_id = s.id AND d.state IN ('scheduled', 'retry_wait')
              AND d.next_attempt_at <= COALESCE($3, now()) AND d.owner = $4
            ORDER BY d.next_attempt_at, d.id
            LIMIT $2) offered
        ORDER BY turn, s.tiebreak, offered.next_attempt_at, offered.id
        LIMIT $2),
    due AS (
        SELECT d.id, turns.row_tid, turns.turn, turns.tiebreak
        FROM turns
        CROSS JOIN LATERAL (
            SELECT d0.id FROM deliveries d0
            WHERE d0.ctid = turns.row_tid AND d0.id = turns.id
              AND d0.state IN ('scheduled', 'retry_wait')
              AND d0.next_attempt_at <= COALESCE($3, now()) AND d0.owner = $4
            FOR UPDATE SKIP LOCKED) d),
    claimed AS (
        UPDATE deliveries d
        SET state = 'queued', generation = d.generation + 1,
            queued_at = COALESCE($3, now()), updated_at = COALESCE($3, now())
        FROM due WHERE d.ctid = due.row_tid AND d.id = due.id
        RETURNING d.id, d.reminder_id, d.tenant_id, d.channel, d.generation, d.lane,
                  d.next_attempt_at, due.turn, due.tiebreak,
                  (SELECT r.correlation_id FROM reminders r WHERE r.id = d.reminder_id)
                      AS correlation_id),
    passes AS (
        INSERT INTO tenant_claim_passes AS p (channel, tenant_id, pass)
        SELECT $1, s.id, COALESCE(max(c.turn) + 1::float8 / s.claim_weight, s.start)
        FROM starts s LEFT JOIN claimed c ON c.tenant_id = s.id
        GROUP BY s.id, s.claim_weight, s.start, s.pass
        HAVING count(c.id) > 0 OR s.pass IS DISTINCT FROM s.start
        ORDER BY s.id
        ON CONFLICT (channel, tenant_id) DO UPDATE SET pass = EXCLUDED.pass
        WHERE p.pass IS NOT DISTINCT FROM (SELECT s2.pass FROM starts s2 WHERE s2.id = p.tenant_id))
    SELECT * FROM claimed";

/// A claimed row and its turn, so the batch is published in turn order.
#[derive(sqlx::FromRow)]
struct ClaimedRow {
    #[sqlx(flatten)]
    due: DueRow,
    turn: f64,
    tiebreak: Vec<u8>,
}

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
                .bind("0")
                .fetch_all(&self.pool)
                .await?;
        Ok(lines.join("\n"))
    }

    /// Claims up to `limit` deliveries of `channel` whose `next_attempt_at` has come (first
    /// attempts and retries), in weighted turns per tenant and oldest first within a tenant
    /// (see `CLAIM_DUE`), skipping rows another relay is claiming, and commits
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
        self.claim_due_drawn(channel, limit, at, rand::random())
            .await
    }

    /// [`claim_due`](Self::claim_due) with the claim's draw given: tenants at the same turn
    /// go in the order of `sha256("{tenant id}:{draw}")`. Tests give it to know the order.
    pub async fn claim_due_drawn(
        &self,
        channel: Channel,
        limit: u32,
        at: LedgerTime,
        draw: u64,
    ) -> Result<Vec<DueDelivery>, LedgerError> {
        let mut rows = sqlx::query_as::<_, ClaimedRow>(CLAIM_DUE)
            .bind(channel.as_str())
            .bind(i64::from(limit))
            .bind(at.bind())
            .bind(&*self.sender)
            .bind(draw.to_string())
            .fetch_all(&self.pool)
            .await?;
        // Published in turn order: a small tenant's first deliveries lead the batch beside a
        // large one's, not behind all of it.
        rows.sort_by(|a, b| {
            a.turn
                .total_cmp(&b.turn)
                .then_with(|| a.tiebreak.cmp(&b.tiebreak))
                .then(a.due.next_attempt_at.cmp(&b.due.next_attempt_at))
                .then(a.due.id.cmp(&b.due.id))
        });
        rows.into_iter()
            .map(|r| DueDelivery::try_from(r.due))
            .collect()
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
