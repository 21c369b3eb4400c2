//! The janitor's side: the expiry sweep and the lease reaper.
//!
//! A lease that expired without `send_started_at` was never sent (its worker died or lost the
//! database before the fence): it goes back due at once, on its own lane, without an attempt
//! and never `ambiguous`. One whose send started may have reached the provider: the domain
//! decides it as a timeout after send, so it is retried only where the idempotency key makes a
//! resend safe and held `ambiguous` otherwise. Work being sent is never expired by the sweep:
//! its outcome (or the reaper) decides.
//!
//! Either way the delivery keeps its place in line: it is due again at the time it was due
//! (or now, if that is earlier), not behind the work that fell due while its holder was dying.
//! A lease lapses only when its holder died or lost the ledger (a live one renews it, 0119),
//! never because a provider was slow, so a retry here owes the provider no backoff.

use chrono::{DateTime, Utc};
use nudge_domain::{
    AttemptContext, DeliveryId, DeliveryState, IdempotencySupport, Jitter, RetryPolicy,
    SendOutcome, decide,
};

use super::record::{Held, OutcomeColumns, apply};
use super::{AttemptRecord, LedgerTime, parse, to_u64};
use crate::{Ledger, LedgerError};

/// What one reaper pass settled.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reaped {
    /// Leases whose send never started: due again, no attempt spent.
    pub unsent: Vec<DeliveryId>,
    /// Leases whose send started: decided like a timeout after send.
    pub decided: Vec<(DeliveryId, DeliveryState)>,
}

#[derive(sqlx::FromRow)]
struct ReapRow {
    id: uuid::Uuid,
    lease_owner: Option<String>,
    generation: i64,
    lane: String,
    attempt_count: i32,
    attempt_base: i32,
    expires_at: DateTime<Utc>,
    lease_idempotent: Option<bool>,
    send_started_at: Option<DateTime<Utc>>,
    next_attempt_at: Option<DateTime<Utc>>,
    db_now: DateTime<Utc>,
}

impl Ledger {
    /// Settles up to `limit` owed deliveries whose `expires_at` has passed as `expired`.
    /// Work being sent is left to finish; its outcome decides.
    pub async fn expire_overdue(&self, limit: u32, at: LedgerTime) -> Result<u64, LedgerError> {
        let done = sqlx::query(
            "WITH overdue AS (
                 SELECT id FROM deliveries
                 WHERE state IN ('scheduled', 'queued', 'retry_wait')
                   AND expires_at <= COALESCE($2, now())
                 ORDER BY expires_at LIMIT $1
                 FOR UPDATE SKIP LOCKED)
             UPDATE deliveries d
             SET state = 'expired', settled_at = COALESCE($2, now()),
                 updated_at = COALESCE($2, now()), next_attempt_at = NULL,
                 last_error_reason = 'expired_before_send'
             FROM overdue WHERE d.id = overdue.id",
        )
        .bind(i64::from(limit))
        .bind(at.bind())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Settles up to `limit` deliveries whose lease expired without an outcome; see the
    /// module's rules. Each decided one gets an attempt row; an unsent one gets none.
    pub async fn reap_expired_leases(
        &self,
        limit: u32,
        policy: &RetryPolicy,
        jitter: &mut (impl Jitter + Send),
        at: LedgerTime,
    ) -> Result<Reaped, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let unsent: Vec<uuid::Uuid> = sqlx::query_scalar(
            "WITH lapsed AS (
                 SELECT id FROM deliveries
                 WHERE state = 'sending' AND lease_expires_at <= COALESCE($2, now())
                   AND send_started_at IS NULL
                 ORDER BY lease_expires_at LIMIT $1
                 FOR UPDATE SKIP LOCKED)
             UPDATE deliveries d
             SET state = 'retry_wait',
                 next_attempt_at = LEAST(d.next_attempt_at, COALESCE($2, now())),
                 lease_owner = NULL, lease_expires_at = NULL, lease_idempotent = NULL,
                 attempt_count = d.attempt_count - 1, updated_at = COALESCE($2, now())
             FROM lapsed WHERE d.id = lapsed.id
             RETURNING d.id",
        )
        .bind(i64::from(limit))
        .bind(at.bind())
        .fetch_all(&mut *tx)
        .await?;

        let rows: Vec<ReapRow> = sqlx::query_as(
            "SELECT id, lease_owner, generation, lane, attempt_count, attempt_base, expires_at,
                    lease_idempotent, send_started_at, next_attempt_at,
                    COALESCE($2, now()) AS db_now
             FROM deliveries
             WHERE state = 'sending' AND lease_expires_at <= COALESCE($2, now())
               AND send_started_at IS NOT NULL
             ORDER BY lease_expires_at LIMIT $1
             FOR UPDATE SKIP LOCKED",
        )
        .bind(i64::from(limit))
        .bind(at.bind())
        .fetch_all(&mut *tx)
        .await?;
        let mut columns = OutcomeColumns::default();
        let mut decided = Vec::with_capacity(rows.len());
        for row in &rows {
            let held = Held {
                id: row.id,
                lease_holder: row.lease_owner.as_deref().unwrap_or_default(),
                generation: to_u64(row.generation)?,
                lane: parse(&row.lane)?,
                attempt_number: u32::try_from(row.attempt_count)
                    .map_err(|e| LedgerError::corrupt("deliveries", e))?,
            };
            let idempotency = if row.lease_idempotent == Some(true) {
                IdempotencySupport::Honoured
            } else {
                IdempotencySupport::NotHonoured
            };
            let since_redrive = u32::try_from(row.attempt_count - row.attempt_base)
                .map_err(|e| LedgerError::corrupt("deliveries", e))?;
            let ctx = AttemptContext {
                attempt_number: since_redrive.max(1),
                expires_at: row.expires_at,
                idempotency,
            };
            let outcome = SendOutcome::UnknownAfterSend {
                reason: "lease_expired".to_owned(),
            };
            let now = row.db_now;
            let mut decision = decide(&ctx, &outcome, now, policy, jitter);
            if decision.next_state == DeliveryState::RetryWait {
                decision.next_attempt_at = Some(row.next_attempt_at.map_or(now, |t| t.min(now)));
            }
            decision.facts.reason = Some(format!(
                "lease_expired: {}",
                decision.facts.reason.as_deref().unwrap_or("unknown")
            ));
            let record = AttemptRecord {
                started_at: row.send_started_at.unwrap_or(now).min(now),
                finished_at: now,
                worker: "lease-reaper".to_owned(),
                correlation_id: None,
            };
            columns.push(&held, &decision, &record)?;
            decided.push((DeliveryId::from_uuid(row.id), decision.next_state));
        }
        let applied = apply(&mut tx, &columns, at).await?;
        tx.commit().await?;
        Ok(Reaped {
            unsent: unsent.into_iter().map(DeliveryId::from_uuid).collect(),
            decided: decided
                .into_iter()
                .filter(|(id, _)| applied.contains(&id.as_uuid()))
                .collect(),
        })
    }
}
