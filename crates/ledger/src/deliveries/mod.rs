//! Deliveries: the rows, and the protocol every statement on them keeps.
//!
//! A delivery moves `scheduled -> queued -> sending -> (delivered | retry_wait | dead_lettered |
//! expired | ambiguous | cancelled)`; `retry_wait` comes back to `queued`. The statements live
//! by concern:
//! - [`claim`]: the relay claims due work and commits it `queued` with `generation + 1` *before*
//!   it publishes; a message carries the generation it was published with, so it is a pointer,
//!   never the authority.
//! - [`lease`]: a worker leases a batch of messages in one statement (state `queued`, the
//!   message's generation, due, not expired, reminder not cancelled, routed to an account the
//!   worker has), with routing and send material, and in the same transaction takes their send
//!   slots from the rate buckets. The **fence** is the statement that stamps `send_started_at`:
//!   it re-checks, with the database's clock, that the lease is still held, the delivery has not
//!   expired and its reminder is not cancelled, and renews the lease to cover the send. No
//!   stamp, no request. A lease given back before its send keeps its lane and spends no attempt.
//! - [`record`]: outcomes of concurrent sends are applied in one statement (group commit), each
//!   only if its lease is still held as leased; the attempt rows are appended in the same
//!   statement.
//! - [`renew`]: the holder's heartbeat renews all of its leases in one statement; a lease
//!   lives as long as its holder, not as long as a configured worst case.
//! - [`sweep`]: the expiry sweep and the lease reaper. A lease that expired *without*
//!   `send_started_at` was never sent: it goes back due, on its lane, without an attempt. One
//!   that expired after its send started is decided like a timeout after send.
//!
//! Time: every time condition is evaluated with PostgreSQL's clock (`now()`, or
//! `clock_timestamp()` after a lock wait). A [`LedgerTime::Fixed`] replaces it in the same
//! statements, so tests move time without sleeping; processes always pass
//! [`LedgerTime::Database`].

mod claim;
mod lease;
mod record;
mod renew;
mod sweep;

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{
    Channel, DeliveryId, DeliveryState, IdempotencyKey, IdempotencySupport, Lane, OutcomeClass,
    ProviderAccount, ReminderId, TenantId,
};

use crate::{Ledger, LedgerError};

pub use lease::{
    CONTACT_OPTED_OUT, FenceRefused, LeaseBatch, LeaseOutcome, LeaseResult, Material, SendSlot,
    Slotted, WorkerRoutes,
};
pub use record::{OutcomeToRecord, Recorded};
pub use renew::RenewedLease;
pub use sweep::Reaped;

/// Which clock a statement's time conditions use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LedgerTime {
    /// PostgreSQL's clock: what every process uses.
    #[default]
    Database,
    /// A fixed instant in place of PostgreSQL's clock, in the same statements: for tests
    /// that move time.
    Fixed(DateTime<Utc>),
}

impl LedgerTime {
    /// The bind value for `COALESCE($n, now())`: `NULL` selects the database's clock.
    pub(crate) fn bind(self) -> Option<DateTime<Utc>> {
        match self {
            LedgerTime::Database => None,
            LedgerTime::Fixed(at) => Some(at),
        }
    }
}

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
    /// The reminder's correlation id (given to the intake, or generated there), which every
    /// envelope of the delivery carries; `None` for reminders that came another way.
    pub correlation_id: Option<String>,
}

impl DueDelivery {
    /// What the message published for this claim points at.
    pub fn message_pointer(&self) -> MessagePointer {
        MessagePointer {
            delivery_id: self.id,
            generation: self.generation,
        }
    }
}

/// What a queue message points at: a delivery, at the generation the relay published it with.
/// A pointer, never the authority: the ledger leases (or dead-letters) the delivery only while
/// it is still `queued` with that generation; a message with an older one is a stale copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MessagePointer {
    pub delivery_id: DeliveryId,
    /// The delivery's `generation` when the message was published (each claim raises it).
    pub generation: u64,
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
    /// Attempts made before the last redrive: the retry policy's limit counts from here.
    pub attempt_base: u32,
    pub generation: u64,
    pub lane: Lane,
    pub idempotency_key: IdempotencyKey,
    pub scheduled_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// The worker holding the lease (the column `lease_owner`).
    pub lease_holder: String,
    /// By the database's clock, as of the last lease or fence statement.
    pub lease_expires_at: DateTime<Utc>,
    /// The provider account the send goes through (the tenant's routing, or the default).
    pub provider_account: ProviderAccount,
    pub idempotency: IdempotencySupport,
    /// The digest of the destination the lease's material holds (none for a contact stored
    /// before digests were, or without a contact): the fence stamps it on the delivery, so
    /// the answer or a later receipt flags the contact only while it still holds it.
    pub destination_digest: Option<crate::DestinationDigest>,
    /// The quiet hours it is under, if any (its subscriber's or its tenant's window, in the
    /// subscriber's zone, else the tenant's; none when the reminder ignores them): the fence
    /// sends only before `next_start`, the next window's start when it was leased.
    pub quiet: Option<QuietRule>,
}

/// A leased delivery's quiet hours: the window, its zone, and the next window's start as of
/// the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuietRule {
    pub hours: nudge_domain::QuietHours,
    pub zone: nudge_domain::Zone,
    pub next_start: DateTime<Utc>,
}

/// Facts about one attempt that the decision does not carry. Times are the database's clock
/// as the worker knows it (see `nudge-worker`'s clock).
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
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
    /// The worker holding its lease while it is `sending` (the column `lease_owner`).
    pub lease_holder: Option<String>,
    pub provider_message_id: Option<String>,
    pub last_error_class: Option<String>,
    pub last_error_reason: Option<String>,
    pub settled_at: Option<DateTime<Utc>>,
}

/// One row of the append-only attempt history.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
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
    #[serde(rename = "delay_chosen_ms", serialize_with = "serialize_millis")]
    pub delay_chosen: Option<Duration>,
    pub next_state: DeliveryState,
    /// When the delivery became eligible again after this attempt (none once settled).
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub reason: Option<String>,
    pub provider_message_id: Option<String>,
    /// The account the send went through, as routed when it was leased.
    pub provider_account: Option<String>,
    /// The worker that made the attempt (its lease holder name).
    pub worker: Option<String>,
    /// The incident (a redrive's or a drain's) the attempt was made under.
    pub incident: Option<String>,
}

/// A duration as whole milliseconds, the unit the ledger stores and operators read.
fn serialize_millis<S: serde::Serializer>(
    value: &Option<Duration>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(d) => serializer.serialize_some(&millis(*d)),
        None => serializer.serialize_none(),
    }
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
    correlation_id: Option<String>,
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
            correlation_id: row.correlation_id,
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
            lease_holder: row.lease_owner,
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
    provider_account: Option<String>,
    worker: Option<String>,
    incident: Option<String>,
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
            provider_account: row.provider_account,
            worker: row.worker,
            incident: row.incident,
        })
    }
}

pub(super) fn parse<T>(value: &str) -> Result<T, LedgerError>
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    value
        .parse()
        .map_err(|e| LedgerError::corrupt("deliveries", e))
}

pub(super) fn to_u64(value: i64) -> Result<u64, LedgerError> {
    u64::try_from(value).map_err(|e| LedgerError::corrupt("deliveries", e))
}

pub(super) fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

const DELIVERY_COLUMNS: &str = "id, reminder_id, tenant_id, channel, state, idempotency_key, \
     attempt_count, generation, lane, scheduled_at, expires_at, next_attempt_at, lease_owner, \
     provider_message_id, last_error_class, last_error_reason, settled_at";

impl Ledger {
    /// Deliveries of `channel` published or being sent: what the relay has in flight.
    pub async fn in_flight(&self, channel: Channel) -> Result<u64, LedgerError> {
        // One count per state, so each reads its partial index (`queued_idx`, `lease_idx`):
        // an `IN` over both made PostgreSQL scan the whole table, 56 ms a pass with a million
        // deliveries scheduled for later, against 0.06 ms this way.
        let n: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM deliveries WHERE state = 'queued' AND channel = $1)
                  + (SELECT count(*) FROM deliveries WHERE state = 'sending' AND channel = $1)",
        )
        .bind(channel.as_str())
        .fetch_one(&self.pool)
        .await?;
        Ok(u64::try_from(n).unwrap_or(0))
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
                    next_attempt_at, reason, provider_message_id, provider_account, worker,
                    incident
             FROM attempts WHERE delivery_id = $1 ORDER BY attempt_number",
        )
        .bind(id.as_uuid())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(Attempt::try_from).collect()
    }
}
