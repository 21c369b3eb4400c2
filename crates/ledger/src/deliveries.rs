use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{
    AttemptContext, Channel, Decision, DeliveryId, DeliveryState, IdempotencyKey,
    IdempotencySupport, Jitter, Lane, OutcomeClass, ProviderAccount, ReminderId, RetryPolicy,
    SendOutcome, TenantId, decide,
};

use crate::{Ledger, LedgerError};

/// A delivery claimed for publishing, with the generation its message must carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueDelivery {
    pub id: DeliveryId,
    pub reminder_id: ReminderId,
    pub tenant_id: TenantId,
    pub channel: Channel,
    pub generation: u64,
    pub lane: Lane,
    pub next_attempt_at: DateTime<Utc>,
}

/// Why a message did not lead to a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseOutcome {
    Leased(LeasedDelivery),
    /// It was owed but its time ran out: it is now `expired` and must not be sent.
    Expired,
    /// A duplicate or old message: the delivery moved on (other state or generation).
    Stale {
        state: DeliveryState,
        generation: u64,
    },
    NotFound,
}

/// A delivery held by one worker until `lease_expires_at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeasedDelivery {
    pub id: DeliveryId,
    pub reminder_id: ReminderId,
    pub tenant_id: TenantId,
    pub channel: Channel,
    /// 1-based number of the attempt this lease is for.
    pub attempt_number: u32,
    pub generation: u64,
    pub lane: Lane,
    pub idempotency_key: IdempotencyKey,
    pub scheduled_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub lease_owner: String,
    pub lease_expires_at: DateTime<Utc>,
}

/// Facts about one attempt that the decision does not carry.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub provider_account: Option<ProviderAccount>,
    pub worker: String,
    pub correlation_id: Option<String>,
}

/// The ledger's view of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryRecord {
    pub id: DeliveryId,
    pub reminder_id: ReminderId,
    pub tenant_id: TenantId,
    pub channel: Channel,
    pub state: DeliveryState,
    pub idempotency_key: IdempotencyKey,
    pub attempt_count: u32,
    pub generation: u64,
    pub lane: Lane,
    pub scheduled_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub lease_owner: Option<String>,
    pub provider_message_id: Option<String>,
    pub last_error_class: Option<String>,
    pub last_error_reason: Option<String>,
    pub settled_at: Option<DateTime<Utc>>,
}

/// One row of the append-only attempt history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub attempt_number: u32,
    pub generation: u64,
    pub lane: Lane,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub outcome_class: OutcomeClass,
    pub http_status: Option<u16>,
    pub retry_after_seen: Option<String>,
    pub retry_after_valid: bool,
    pub delay_chosen: Option<Duration>,
    pub next_state: DeliveryState,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub reason: Option<String>,
    pub provider_message_id: Option<String>,
}

#[derive(sqlx::FromRow)]
struct DueRow {
    id: uuid::Uuid,
    reminder_id: uuid::Uuid,
    tenant_id: uuid::Uuid,
    channel: String,
    generation: i64,
    lane: String,
    next_attempt_at: DateTime<Utc>,
}

impl TryFrom<DueRow> for DueDelivery {
    type Error = LedgerError;
    fn try_from(row: DueRow) -> Result<Self, Self::Error> {
        Ok(Self {
            id: DeliveryId::from_uuid(row.id),
            reminder_id: ReminderId::from_uuid(row.reminder_id),
            tenant_id: TenantId::from_uuid(row.tenant_id),
            channel: parse(&row.channel)?,
            generation: to_u64(row.generation)?,
            lane: parse(&row.lane)?,
            next_attempt_at: row.next_attempt_at,
        })
    }
}

#[derive(sqlx::FromRow)]
struct LeaseRow {
    id: uuid::Uuid,
    reminder_id: uuid::Uuid,
    tenant_id: uuid::Uuid,
    channel: String,
    attempt_count: i32,
    generation: i64,
    lane: String,
    idempotency_key: String,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    lease_owner: Option<String>,
    lease_expires_at: Option<DateTime<Utc>>,
}

impl TryFrom<LeaseRow> for LeasedDelivery {
    type Error = LedgerError;
    fn try_from(row: LeaseRow) -> Result<Self, Self::Error> {
        Ok(Self {
            id: DeliveryId::from_uuid(row.id),
            reminder_id: ReminderId::from_uuid(row.reminder_id),
            tenant_id: TenantId::from_uuid(row.tenant_id),
            channel: parse(&row.channel)?,
            attempt_number: u32::try_from(row.attempt_count)
                .map_err(|e| LedgerError::corrupt("deliveries", e))?,
            generation: to_u64(row.generation)?,
            lane: parse(&row.lane)?,
            idempotency_key: IdempotencyKey::parse(&row.idempotency_key)
                .map_err(|e| LedgerError::corrupt("deliveries", e))?,
            scheduled_at: row.scheduled_at,
            expires_at: row.expires_at,
            lease_owner: row
                .lease_owner
                .ok_or_else(|| LedgerError::corrupt("deliveries", "leased without owner"))?,
            lease_expires_at: row
                .lease_expires_at
                .ok_or_else(|| LedgerError::corrupt("deliveries", "leased without expiry"))?,
        })
    }
}

#[derive(sqlx::FromRow)]
struct DeliveryRow {
    id: uuid::Uuid,
    reminder_id: uuid::Uuid,
    tenant_id: uuid::Uuid,
    channel: String,
    state: String,
    idempotency_key: String,
    attempt_count: i32,
    generation: i64,
    lane: String,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    next_attempt_at: Option<DateTime<Utc>>,
    lease_owner: Option<String>,
    provider_message_id: Option<String>,
    last_error_class: Option<String>,
    last_error_reason: Option<String>,
    settled_at: Option<DateTime<Utc>>,
}

impl TryFrom<DeliveryRow> for DeliveryRecord {
    type Error = LedgerError;
    fn try_from(row: DeliveryRow) -> Result<Self, Self::Error> {
        Ok(Self {
            id: DeliveryId::from_uuid(row.id),
            reminder_id: ReminderId::from_uuid(row.reminder_id),
            tenant_id: TenantId::from_uuid(row.tenant_id),
            channel: parse(&row.channel)?,
            state: parse(&row.state)?,
            idempotency_key: IdempotencyKey::parse(&row.idempotency_key)
                .map_err(|e| LedgerError::corrupt("deliveries", e))?,
            attempt_count: u32::try_from(row.attempt_count)
                .map_err(|e| LedgerError::corrupt("deliveries", e))?,
            generation: to_u64(row.generation)?,
            lane: parse(&row.lane)?,
            scheduled_at: row.scheduled_at,
            expires_at: row.expires_at,
            next_attempt_at: row.next_attempt_at,
            lease_owner: row.lease_owner,
            provider_message_id: row.provider_message_id,
            last_error_class: row.last_error_class,
            last_error_reason: row.last_error_reason,
            settled_at: row.settled_at,
        })
    }
}

#[derive(sqlx::FromRow)]
struct AttemptRow {
    attempt_number: i32,
    generation: i64,
    lane: String,
    started_at: DateTime<Utc>,
    finished_at: DateTime<Utc>,
    outcome_class: String,
    http_status: Option<i16>,
    retry_after_seen: Option<String>,
    retry_after_valid: bool,
    delay_chosen_ms: Option<i64>,
    next_state: String,
    next_attempt_at: Option<DateTime<Utc>>,
    reason: Option<String>,
    provider_message_id: Option<String>,
}

impl TryFrom<AttemptRow> for Attempt {
    type Error = LedgerError;
    fn try_from(row: AttemptRow) -> Result<Self, Self::Error> {
        Ok(Self {
            attempt_number: u32::try_from(row.attempt_number)
                .map_err(|e| LedgerError::corrupt("attempts", e))?,
            generation: to_u64(row.generation)?,
            lane: parse(&row.lane)?,
            started_at: row.started_at,
            finished_at: row.finished_at,
            outcome_class: parse(&row.outcome_class)?,
            http_status: row
                .http_status
                .map(u16::try_from)
                .transpose()
                .map_err(|e| LedgerError::corrupt("attempts", e))?,
            retry_after_seen: row.retry_after_seen,
            retry_after_valid: row.retry_after_valid,
            delay_chosen: row
                .delay_chosen_ms
                .map(|ms| u64::try_from(ms).map(Duration::from_millis))
                .transpose()
                .map_err(|e| LedgerError::corrupt("attempts", e))?,
            next_state: parse(&row.next_state)?,
            next_attempt_at: row.next_attempt_at,
            reason: row.reason,
            provider_message_id: row.provider_message_id,
        })
    }
}

/// What identifies a lease for a conditional update.
struct HeldLease {
    id: DeliveryId,
    owner: String,
    generation: u64,
    lane: Lane,
    attempt_number: u32,
}

impl From<&LeasedDelivery> for HeldLease {
    fn from(lease: &LeasedDelivery) -> Self {
        Self {
            id: lease.id,
            owner: lease.lease_owner.clone(),
            generation: lease.generation,
            lane: lease.lane,
            attempt_number: lease.attempt_number,
        }
    }
}

#[derive(sqlx::FromRow)]
struct ReapRow {
    id: uuid::Uuid,
    lease_owner: Option<String>,
    generation: i64,
    lane: String,
    attempt_count: i32,
    expires_at: DateTime<Utc>,
    lease_idempotent: Option<bool>,
    provider_account: Option<String>,
    last_attempt_at: Option<DateTime<Utc>>,
}

/// Applies a decision to a held lease and appends the attempt. Returns false, writing
/// nothing, when the lease is no longer held as described.
async fn apply_decision(
    conn: &mut sqlx::PgConnection,
    lease: &HeldLease,
    decision: &Decision,
    attempt: &AttemptRecord,
) -> Result<bool, LedgerError> {
    let next = DeliveryState::Sending.transition(decision.next_state)?;
    let now = attempt.finished_at;
    let facts = &decision.facts;
    let settled = next.is_terminal() || next.is_held();
    let error_class = match facts.outcome_class {
        OutcomeClass::Delivered => None,
        other => Some(other.as_str()),
    };
    let updated = sqlx::query(
        "UPDATE deliveries
         SET state = $4, next_attempt_at = $5, lease_owner = NULL, lease_expires_at = NULL,
             lease_idempotent = NULL,
             provider_message_id = COALESCE($6, provider_message_id),
             provider_account = COALESCE($7, provider_account),
             last_error_class = $8, last_error_reason = $9,
             settled_at = CASE WHEN $10 THEN $11 ELSE NULL END, updated_at = $11
         WHERE id = $1 AND state = 'sending' AND lease_owner = $2 AND generation = $3",
    )
    .bind(lease.id.as_uuid())
    .bind(&lease.owner)
    .bind(to_i64(lease.generation))
    .bind(next.as_str())
    .bind(decision.next_attempt_at)
    .bind(facts.provider_message_id.as_deref())
    .bind(attempt.provider_account.as_ref().map(|a| a.as_str()))
    .bind(error_class)
    .bind(facts.reason.as_deref())
    .bind(settled)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    if updated.rows_affected() != 1 {
        return Ok(false);
    }
    sqlx::query(
        "INSERT INTO attempts (delivery_id, attempt_number, generation, lane, started_at,
             finished_at, outcome_class, http_status, retry_after_seen, retry_after_valid,
             delay_chosen_ms, next_state, next_attempt_at, reason, provider_account,
             provider_message_id, worker, correlation_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)",
    )
    .bind(lease.id.as_uuid())
    .bind(i32::try_from(lease.attempt_number.max(1)).unwrap_or(i32::MAX))
    .bind(to_i64(lease.generation))
    .bind(lease.lane.as_str())
    .bind(attempt.started_at)
    .bind(attempt.finished_at)
    .bind(facts.outcome_class.as_str())
    .bind(
        facts
            .http_status
            .map(|s| i16::try_from(s).unwrap_or(i16::MAX)),
    )
    .bind(facts.retry_after_seen.as_deref())
    .bind(facts.retry_after_valid)
    .bind(facts.delay_chosen.map(millis))
    .bind(next.as_str())
    .bind(decision.next_attempt_at)
    .bind(facts.reason.as_deref())
    .bind(attempt.provider_account.as_ref().map(|a| a.as_str()))
    .bind(facts.provider_message_id.as_deref())
    .bind(&attempt.worker)
    .bind(attempt.correlation_id.as_deref())
    .execute(&mut *conn)
    .await?;
    Ok(true)
}

fn parse<T>(value: &str) -> Result<T, LedgerError>
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    value
        .parse()
        .map_err(|e| LedgerError::corrupt("deliveries", e))
}

fn to_u64(value: i64) -> Result<u64, LedgerError> {
    u64::try_from(value).map_err(|e| LedgerError::corrupt("deliveries", e))
}

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn chrono_duration(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

const CLAIM_DUE: &str = "WITH due AS (
        SELECT id FROM deliveries
        WHERE state IN ('scheduled', 'retry_wait') AND next_attempt_at <= $1
        ORDER BY next_attempt_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED)
    UPDATE deliveries d
    SET state = 'queued', generation = d.generation + 1, queued_at = $1, updated_at = $1,
        lane = CASE WHEN d.state = 'retry_wait' AND d.lane = 'new' THEN 'retry' ELSE d.lane END
    FROM due WHERE d.id = due.id
    RETURNING d.id, d.reminder_id, d.tenant_id, d.channel, d.generation, d.lane, d.next_attempt_at";

const CLAIM_DUE_FOR: &str = "WITH due AS (
        SELECT id FROM deliveries
        WHERE channel = $3 AND state IN ('scheduled', 'retry_wait') AND next_attempt_at <= $1
        ORDER BY next_attempt_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED)
    UPDATE deliveries d
    SET state = 'queued', generation = d.generation + 1, queued_at = $1, updated_at = $1,
        lane = CASE WHEN d.state = 'retry_wait' AND d.lane = 'new' THEN 'retry' ELSE d.lane END
    FROM due WHERE d.id = due.id
    RETURNING d.id, d.reminder_id, d.tenant_id, d.channel, d.generation, d.lane, d.next_attempt_at";

const CLAIM_UNCONSUMED: &str = "WITH lost AS (
        SELECT id FROM deliveries
        WHERE state = 'queued' AND queued_at <= $3
        ORDER BY queued_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED)
    UPDATE deliveries d
    SET generation = d.generation + 1, queued_at = $1, updated_at = $1
    FROM lost WHERE d.id = lost.id
    RETURNING d.id, d.reminder_id, d.tenant_id, d.channel, d.generation, d.lane, d.next_attempt_at";

const DELIVERY_COLUMNS: &str = "id, reminder_id, tenant_id, channel, state, idempotency_key, \
     attempt_count, generation, lane, scheduled_at, expires_at, next_attempt_at, lease_owner, \
     provider_message_id, last_error_class, last_error_reason, settled_at";

impl Ledger {
    /// Claims up to `limit` deliveries whose `next_attempt_at` has come (first attempts and
    /// retries), oldest first, skipping rows another relay is claiming, and commits them as
    /// `queued` with a new generation. Publish one message per item afterwards.
    ///
    /// The claim commits *before* anything is published: a worker's lease is a conditional
    /// UPDATE, which under READ COMMITTED compares against the last committed row and does not
    /// wait for an uncommitted claim, so a message must never point at a generation that is not
    /// yet committed. A crash between claim and publish leaves the delivery `queued` with no
    /// message, which [`claim_unconsumed`](Self::claim_unconsumed) republishes after its timeout;
    /// a publish that fails is handed to [`mark_unpublished`](Self::mark_unpublished) so the next
    /// tick republishes it at once.
    pub async fn claim_due(
        &self,
        now: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<DueDelivery>, LedgerError> {
        self.claim(CLAIM_DUE, now, limit, None).await
    }

    /// [`claim_due`](Self::claim_due) for one channel: the relay claims per channel so a
    /// backlog on one channel never crowds another out of a batch.
    pub async fn claim_due_for(
        &self,
        channel: Channel,
        now: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<DueDelivery>, LedgerError> {
        let rows = sqlx::query_as::<_, DueRow>(CLAIM_DUE_FOR)
            .bind(now)
            .bind(i64::from(limit))
            .bind(channel.as_str())
            .fetch_all(&self.pool)
            .await?;
        let mut items = rows
            .into_iter()
            .map(DueDelivery::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        items.sort_by_key(|d| d.next_attempt_at);
        Ok(items)
    }

    /// Deliveries of `channel` published or being sent: what the relay has in flight.
    pub async fn in_flight(&self, channel: Channel) -> Result<u64, LedgerError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM deliveries WHERE channel = $1 AND state IN ('queued', 'sending')",
        )
        .bind(channel.as_str())
        .fetch_one(&self.pool)
        .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Claims deliveries that were published (`queued`) more than `older_than` ago and never
    /// leased: their message was lost (broker restart, unroutable, dropped, relay crash). They
    /// get a new generation and are published again; if an old message does turn up, it is
    /// stale and dropped.
    pub async fn claim_unconsumed(
        &self,
        now: DateTime<Utc>,
        older_than: Duration,
        limit: u32,
    ) -> Result<Vec<DueDelivery>, LedgerError> {
        self.claim(
            CLAIM_UNCONSUMED,
            now,
            limit,
            Some(now - chrono_duration(older_than)),
        )
        .await
    }

    async fn claim(
        &self,
        sql: &'static str,
        now: DateTime<Utc>,
        limit: u32,
        cutoff: Option<DateTime<Utc>>,
    ) -> Result<Vec<DueDelivery>, LedgerError> {
        let mut query = sqlx::query_as::<_, DueRow>(sql)
            .bind(now)
            .bind(i64::from(limit));
        if let Some(cutoff) = cutoff {
            query = query.bind(cutoff);
        }
        let rows = query.fetch_all(&self.pool).await?;
        let mut items = rows
            .into_iter()
            .map(DueDelivery::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        items.sort_by_key(|d| d.next_attempt_at);
        Ok(items)
    }

    /// Marks claimed deliveries whose publish failed so that the next
    /// [`claim_unconsumed`](Self::claim_unconsumed) takes them at once, with a new generation.
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

    /// Leases a delivery for one attempt with a single conditional UPDATE: it must be
    /// `queued` with the message's generation, due, and not expired. Exactly one of any
    /// number of concurrent callers wins. An owed delivery whose time has run out is
    /// settled as `expired` here, so it is never sent.
    pub async fn lease(
        &self,
        id: DeliveryId,
        generation: u64,
        owner: &str,
        lease_for: Duration,
        now: DateTime<Utc>,
    ) -> Result<LeaseOutcome, LedgerError> {
        self.lease_via(id, generation, owner, lease_for, now, None)
            .await
    }

    /// [`lease`](Self::lease), recording which provider account the attempt goes through and
    /// whether it honours idempotency keys. If the lease then expires without an outcome,
    /// the reaper resends only when that is safe.
    pub async fn lease_via(
        &self,
        id: DeliveryId,
        generation: u64,
        owner: &str,
        lease_for: Duration,
        now: DateTime<Utc>,
        via: Option<(&ProviderAccount, IdempotencySupport)>,
    ) -> Result<LeaseOutcome, LedgerError> {
        let leased: Option<LeaseRow> = sqlx::query_as(
            "UPDATE deliveries
             SET state = 'sending', lease_owner = $3, lease_expires_at = $4,
                 attempt_count = attempt_count + 1,
                 first_attempt_at = COALESCE(first_attempt_at, $5), last_attempt_at = $5,
                 provider_account = COALESCE($6, provider_account), lease_idempotent = $7,
                 updated_at = $5
             WHERE id = $1 AND generation = $2 AND state = 'queued'
               AND next_attempt_at <= $5 AND expires_at > $5
             RETURNING id, reminder_id, tenant_id, channel, attempt_count, generation, lane,
                       idempotency_key, scheduled_at, expires_at, lease_owner, lease_expires_at",
        )
        .bind(id.as_uuid())
        .bind(to_i64(generation))
        .bind(owner)
        .bind(now + chrono_duration(lease_for))
        .bind(now)
        .bind(via.map(|(account, _)| account.as_str()))
        .bind(via.map(|(_, idem)| idem == IdempotencySupport::Honoured))
        .fetch_optional(&self.pool)
        .await?;
        if let Some(row) = leased {
            return Ok(LeaseOutcome::Leased(row.try_into()?));
        }

        // Not leased: settle an expired one, otherwise say why the message is stale.
        let expired = sqlx::query(
            "UPDATE deliveries
             SET state = 'expired', settled_at = $3, updated_at = $3, next_attempt_at = NULL,
                 last_error_reason = 'expired_before_send'
             WHERE id = $1 AND generation = $2 AND state IN ('scheduled', 'queued', 'retry_wait')
               AND expires_at <= $3",
        )
        .bind(id.as_uuid())
        .bind(to_i64(generation))
        .bind(now)
        .execute(&self.pool)
        .await?;
        if expired.rows_affected() == 1 {
            return Ok(LeaseOutcome::Expired);
        }
        let current: Option<(String, i64)> =
            sqlx::query_as("SELECT state, generation FROM deliveries WHERE id = $1")
                .bind(id.as_uuid())
                .fetch_optional(&self.pool)
                .await?;
        match current {
            None => Ok(LeaseOutcome::NotFound),
            Some((state, generation)) => Ok(LeaseOutcome::Stale {
                state: parse(&state)?,
                generation: to_u64(generation)?,
            }),
        }
    }

    /// Records an attempt and applies the domain's decision in one transaction, only if the
    /// caller still holds the lease; otherwise nothing is written and the error says so.
    pub async fn record_outcome(
        &self,
        lease: &LeasedDelivery,
        decision: &Decision,
        attempt: &AttemptRecord,
    ) -> Result<(), LedgerError> {
        let mut tx = self.pool.begin().await?;
        let applied = apply_decision(&mut tx, &HeldLease::from(lease), decision, attempt).await?;
        if !applied {
            tx.rollback().await?;
            return Err(self.lease_lost(lease.id).await);
        }
        tx.commit().await?;
        Ok(())
    }

    /// Settles deliveries whose lease expired without an outcome (the worker crashed or was
    /// cut off mid-send). Whether the provider got the request is unknown, so the domain
    /// decides as for a timeout after send: retry when the account honours idempotency keys
    /// (the key makes a resend safe), `ambiguous` when it does not or is not known; never
    /// past the attempt budget or the expiry. Each one gets an attempt row.
    pub async fn reap_expired_leases(
        &self,
        now: DateTime<Utc>,
        limit: u32,
        policy: &RetryPolicy,
        jitter: &mut (impl Jitter + Send),
    ) -> Result<Vec<(DeliveryId, DeliveryState)>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let rows: Vec<ReapRow> = sqlx::query_as(
            "SELECT id, lease_owner, generation, lane, attempt_count, expires_at,
                    lease_idempotent, provider_account, last_attempt_at
             FROM deliveries
             WHERE state = 'sending' AND lease_expires_at <= $1
             ORDER BY lease_expires_at LIMIT $2
             FOR UPDATE SKIP LOCKED",
        )
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        let mut reaped = Vec::with_capacity(rows.len());
        for row in rows {
            let held = HeldLease {
                id: DeliveryId::from_uuid(row.id),
                owner: row.lease_owner.unwrap_or_default(),
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
            let ctx = AttemptContext {
                attempt_number: held.attempt_number.max(1),
                expires_at: row.expires_at,
                idempotency,
            };
            let outcome = SendOutcome::UnknownAfterSend {
                reason: "lease_expired".to_owned(),
            };
            let mut decision = decide(&ctx, &outcome, now, policy, jitter);
            decision.facts.reason = Some(format!(
                "lease_expired: {}",
                decision.facts.reason.as_deref().unwrap_or("unknown")
            ));
            let record = AttemptRecord {
                started_at: row.last_attempt_at.unwrap_or(now).min(now),
                finished_at: now,
                provider_account: row
                    .provider_account
                    .as_deref()
                    .map(ProviderAccount::parse)
                    .transpose()
                    .map_err(|e| LedgerError::corrupt("deliveries", e))?,
                worker: "lease-reaper".to_owned(),
                correlation_id: None,
            };
            if apply_decision(&mut tx, &held, &decision, &record).await? {
                reaped.push((held.id, decision.next_state));
            }
        }
        tx.commit().await?;
        Ok(reaped)
    }

    /// Gives a lease back without an attempt having been made (shutdown before sending, or
    /// no rate-limit token in time): the delivery waits until `next_attempt_at` and the
    /// attempt it did not make is not counted against its budget.
    pub async fn release(
        &self,
        lease: &LeasedDelivery,
        next_attempt_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<(), LedgerError> {
        let updated = sqlx::query(
            "UPDATE deliveries
             SET state = 'retry_wait', next_attempt_at = $4, lease_owner = NULL,
                 lease_expires_at = NULL, lease_idempotent = NULL,
                 attempt_count = attempt_count - 1, updated_at = $5
             WHERE id = $1 AND state = 'sending' AND lease_owner = $2 AND generation = $3",
        )
        .bind(lease.id.as_uuid())
        .bind(&lease.lease_owner)
        .bind(to_i64(lease.generation))
        .bind(next_attempt_at)
        .bind(now)
        .execute(&self.pool)
        .await?;
        if updated.rows_affected() != 1 {
            return Err(self.lease_lost(lease.id).await);
        }
        Ok(())
    }

    async fn lease_lost(&self, id: DeliveryId) -> LedgerError {
        let state: Result<Option<String>, _> =
            sqlx::query_scalar("SELECT state FROM deliveries WHERE id = $1")
                .bind(id.as_uuid())
                .fetch_optional(&self.pool)
                .await;
        match state {
            Ok(Some(state)) => match state.parse() {
                Ok(state) => LedgerError::LeaseLost {
                    delivery_id: id.as_uuid(),
                    state,
                },
                Err(e) => LedgerError::corrupt("deliveries", e),
            },
            Ok(None) => LedgerError::corrupt("deliveries", "leased delivery vanished"),
            Err(e) => LedgerError::Database(e),
        }
    }

    /// Settles up to `limit` owed deliveries whose `expires_at` has passed as `expired`.
    /// Work being sent is left to finish; its outcome decides.
    pub async fn expire_overdue(&self, now: DateTime<Utc>, limit: u32) -> Result<u64, LedgerError> {
        let done = sqlx::query(
            "WITH overdue AS (
                 SELECT id FROM deliveries
                 WHERE state IN ('scheduled', 'queued', 'retry_wait') AND expires_at <= $1
                 ORDER BY expires_at LIMIT $2
                 FOR UPDATE SKIP LOCKED)
             UPDATE deliveries d
             SET state = 'expired', settled_at = $1, updated_at = $1, next_attempt_at = NULL,
                 last_error_reason = 'expired_before_send'
             FROM overdue WHERE d.id = overdue.id",
        )
        .bind(now)
        .bind(i64::from(limit))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    pub async fn delivery(&self, id: DeliveryId) -> Result<Option<DeliveryRecord>, LedgerError> {
        let row: Option<DeliveryRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {DELIVERY_COLUMNS} FROM deliveries WHERE id = $1"
        )))
        .bind(id.as_uuid())
        .fetch_optional(&self.pool)
        .await?;
        row.map(DeliveryRecord::try_from).transpose()
    }

    pub async fn deliveries_of_reminder(
        &self,
        reminder_id: ReminderId,
    ) -> Result<Vec<DeliveryRecord>, LedgerError> {
        let rows: Vec<DeliveryRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {DELIVERY_COLUMNS} FROM deliveries WHERE reminder_id = $1 ORDER BY channel"
        )))
        .bind(reminder_id.as_uuid())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(DeliveryRecord::try_from).collect()
    }

    /// The attempt history of one delivery, in order.
    pub async fn attempts(&self, id: DeliveryId) -> Result<Vec<Attempt>, LedgerError> {
        let rows: Vec<AttemptRow> = sqlx::query_as(
            "SELECT attempt_number, generation, lane, started_at, finished_at, outcome_class,
                    http_status, retry_after_seen, retry_after_valid, delay_chosen_ms, next_state,
                    next_attempt_at, reason, provider_message_id
             FROM attempts WHERE delivery_id = $1 ORDER BY attempt_number",
        )
        .bind(id.as_uuid())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(Attempt::try_from).collect()
    }
}
