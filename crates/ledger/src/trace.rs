//! Tracing a reminder's deliveries for an operator (`nudgectl trace`, `nudgectl dlq show`):
//! each delivery's times, state, lease, redrive membership and attempt history, and
//! [`findings`] that tell apart the three causes of lateness.
//!
//! Read-only. It must never select a destination, message content or subscriber reference:
//! every statement here names its columns, and no column of `contacts`, nor
//! `reminders.content_ciphertext` or `reminders.subscriber_ref`, is among them.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use nudge_domain::{
    Channel, DeliveryId, DeliveryState, EventId, IdError, Lane, OutcomeClass, RedriveId,
    ReminderId, TenantId,
};

use crate::deliveries::parse;
use crate::{Attempt, Ledger, LedgerError};

/// Clock rounding allowed between two timestamps written by different statements or
/// processes before an attempt counts as started early.
pub const CLOCK_TOLERANCE_MS: i64 = 50;

/// What an operator asked to trace: a delivery or reminder id (a uuid), or a tenant's name
/// and the client's event id, written `TENANT/EVENT_ID` and split at the first slash (an
/// event id may contain slashes, a tenant name used here may not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceId {
    /// Tried as a delivery id, then as a reminder id.
    Uuid(uuid::Uuid),
    Event {
        tenant: String,
        event_id: EventId,
    },
}

/// Why a trace id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceIdError {
    #[error("expected a delivery id or a reminder id (a uuid), or TENANT/EVENT_ID")]
    Unrecognised,
    #[error("TENANT/EVENT_ID needs a tenant name of 1 to 200 bytes before the first slash")]
    TenantName,
    #[error("TENANT/EVENT_ID has an invalid event id after the first slash")]
    EventId(#[source] IdError),
}

impl TraceId {
    pub fn parse(text: &str) -> Result<Self, TraceIdError> {
        if let Ok(uuid) = uuid::Uuid::parse_str(text) {
            return Ok(Self::Uuid(uuid));
        }
        let Some((tenant, event)) = text.split_once('/') else {
            return Err(TraceIdError::Unrecognised);
        };
        if tenant.is_empty() || tenant.len() > 200 {
            return Err(TraceIdError::TenantName);
        }
        Ok(Self::Event {
            tenant: tenant.to_owned(),
            event_id: EventId::parse(event).map_err(TraceIdError::EventId)?,
        })
    }
}

impl FromStr for TraceId {
    type Err = TraceIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceId::Uuid(uuid) => fmt::Display::fmt(&uuid.hyphenated(), f),
            TraceId::Event { tenant, event_id } => write!(f, "{tenant}/{event_id}"),
        }
    }
}

/// Why nothing could be traced.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error(
        "no delivery and no reminder has id {0} (tried it as a delivery id, then as a reminder id)"
    )]
    UnknownId(uuid::Uuid),
    #[error("no delivery has id {0}")]
    UnknownDelivery(DeliveryId),
    #[error("no tenant named {0:?} (tried TENANT/EVENT_ID)")]
    UnknownTenant(String),
    #[error("tenant {tenant:?} has no reminder with event id {event_id:?}")]
    UnknownEvent { tenant: String, event_id: String },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// How the id given was matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MatchedAs {
    /// A delivery id: the trace holds just that delivery.
    Delivery,
    Reminder,
    /// `TENANT/EVENT_ID`.
    Event,
}

/// One reminder's deliveries (or the one delivery asked for), with their histories.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Trace {
    pub matched_as: MatchedAs,
    pub reminder: ReminderSummary,
    pub deliveries: Vec<DeliveryTrace>,
}

/// The reminder behind a trace: ids and times only.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReminderSummary {
    pub id: ReminderId,
    pub tenant_id: TenantId,
    pub tenant_name: String,
    pub event_id: String,
    pub channels: Vec<Channel>,
    pub scheduled_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub cancelled_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    /// The client's current revision (0 until a reschedule).
    pub revision: i64,
    /// Each applied reschedule, oldest first.
    pub reschedules: Vec<RescheduleEntry>,
}

/// One applied reschedule of a reminder: from and to, its revision, who asked and when (the
/// database's clock).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct RescheduleEntry {
    pub revision: i64,
    pub from_scheduled_at: DateTime<Utc>,
    pub to_scheduled_at: DateTime<Utc>,
    pub from_expires_at: DateTime<Utc>,
    pub to_expires_at: DateTime<Utc>,
    pub channels_added: Vec<String>,
    pub channels_removed: Vec<String>,
    /// `intake` (the client) or `nudgectl` (an operator; the audit log names who).
    pub source: String,
    pub at: DateTime<Utc>,
}

/// A worker's hold on a delivery (state `sending`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LeaseHeld {
    /// The worker holding the lease; `owner` in the JSON of `nudgectl trace`, as it always was.
    #[serde(rename = "owner")]
    pub lease_holder: String,
    pub expires_at: DateTime<Utc>,
    /// Stamped by the send fence: the request may have left.
    pub send_started_at: Option<DateTime<Utc>>,
}

/// A delivery's place in a paced redrive.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RedriveMembership {
    pub redrive_id: RedriveId,
    pub position: i32,
    pub fed_at: Option<DateTime<Utc>>,
    pub skipped_reason: Option<String>,
    /// The redrive's state: running, paused, finished or cancelled.
    pub redrive_state: String,
    pub incident: Option<String>,
    /// Not fed nor skipped yet, in a running or paused redrive: it will be fed back, so
    /// redriving it again would send it twice.
    pub pending: bool,
}

/// One delivery as the ledger holds it now, with its history and findings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeliveryTrace {
    pub id: DeliveryId,
    pub channel: Channel,
    pub state: DeliveryState,
    pub lane: Lane,
    pub scheduled_at: DateTime<Utc>,
    /// When it was first and last leased for an attempt.
    pub first_attempt_at: Option<DateTime<Utc>>,
    pub last_attempt_at: Option<DateTime<Utc>>,
    pub expires_at: DateTime<Utc>,
    /// When it is (or was last) eligible for its next attempt.
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub settled_at: Option<DateTime<Utc>>,
    pub attempt_count: u32,
    /// Attempts made before its last redrive: the retry policy's limit counts
    /// `attempt_count - attempt_base`.
    pub attempt_base: u32,
    pub lease: Option<LeaseHeld>,
    pub provider_account: Option<String>,
    pub provider_message_id: Option<String>,
    pub last_error_class: Option<String>,
    pub last_error_reason: Option<String>,
    pub redrives: Vec<RedriveMembership>,
    pub attempts: Vec<Attempt>,
    pub findings: Findings,
}

/// When one attempt became eligible, and whether provider throttling came before it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AttemptTiming {
    pub attempt_number: u32,
    /// `scheduled_at` for the first attempt, the previous attempt's `next_attempt_at` after
    /// that; unknown after a settled attempt (a redrive fed it back).
    pub eligible_at: Option<DateTime<Utc>>,
    /// How long after `eligible_at` it started (negative: before).
    pub started_after_ms: Option<i64>,
    /// This attempt was answered 429, or retryable with a `Retry-After`.
    pub throttled: bool,
}

/// An attempt (or the first lease) that started before the delivery was eligible: a worker
/// leased work that was not due. That is a bug, never an expected path.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct EarlyStart {
    /// `None`: the first lease (`first_attempt_at`) came before `scheduled_at`.
    pub attempt_number: Option<u32>,
    pub started_at: DateTime<Utc>,
    pub eligible_at: DateTime<Utc>,
    pub early_by_ms: i64,
}

/// The three causes of lateness, told apart.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Findings {
    /// From `scheduled_at` to the first attempt's start.
    pub first_attempt_delay_ms: Option<i64>,
    /// Time the delivery was eligible but not being attempted: before each attempt, plus the
    /// wait so far when it is eligible now. No provider answer explains it (a bucket paused
    /// by other deliveries' 429s shows in `rate list`, not here).
    pub scheduling_delay_ms: i64,
    /// Eligible now and not being sent: how long it has waited so far.
    pub waiting_now_ms: Option<i64>,
    /// Attempts answered 429, or retryable with a `Retry-After`.
    pub throttled_attempts: u32,
    /// The delay chosen after those attempts, summed.
    pub throttle_delay_ms: i64,
    /// Attempts started before the delivery was eligible (beyond [`CLOCK_TOLERANCE_MS`]):
    /// a bug.
    pub leased_before_eligible: Vec<EarlyStart>,
    pub timings: Vec<AttemptTiming>,
}

/// What [`findings`] reads of a delivery.
#[derive(Debug, Clone, Copy)]
pub struct Timeline<'a> {
    pub scheduled_at: DateTime<Utc>,
    /// The delivery's `first_attempt_at` (its first lease).
    pub first_leased_at: Option<DateTime<Utc>>,
    /// The attempts, in attempt order.
    pub attempts: &'a [Attempt],
    /// When the delivery became eligible, if it is owed now and not being sent
    /// (`scheduled`, `queued` or `retry_wait`: its `next_attempt_at`).
    pub owed_since: Option<DateTime<Utc>>,
}

fn is_throttled(attempt: &Attempt) -> bool {
    attempt.http_status == Some(429)
        || (attempt.outcome_class == OutcomeClass::Retryable && attempt.retry_after_seen.is_some())
}

/// Tells apart scheduling delay, provider throttling and leasing before eligibility in one
/// delivery's history, as of `now`. Pure, so the rule is tested without a database.
///
/// Each attempt is eligible from `scheduled_at` (the first) or from the previous attempt's
/// `next_attempt_at`; time past that before it started is scheduling delay, the delay chosen
/// after a throttled answer is throttling, and a start earlier than eligibility by more than
/// [`CLOCK_TOLERANCE_MS`] is a lease before eligibility. A first lease (`first_attempt_at`)
/// before `scheduled_at` is one too, even when no attempt was recorded.
pub fn findings(timeline: &Timeline<'_>, now: DateTime<Utc>) -> Findings {
    let mut scheduling_delay_ms = 0;
    let mut throttled_attempts = 0;
    let mut throttle_delay_ms = 0;
    let mut early = Vec::new();
    let mut timings = Vec::with_capacity(timeline.attempts.len());
    let mut eligible_at = Some(timeline.scheduled_at);
    if let Some(leased) = timeline.first_leased_at {
        let early_by_ms = (timeline.scheduled_at - leased).num_milliseconds();
        if early_by_ms > CLOCK_TOLERANCE_MS {
            early.push(EarlyStart {
                attempt_number: None,
                started_at: leased,
                eligible_at: timeline.scheduled_at,
                early_by_ms,
            });
        }
    }
    for attempt in timeline.attempts {
        let started_after_ms = eligible_at.map(|at| (attempt.started_at - at).num_milliseconds());
        if let (Some(after), Some(at)) = (started_after_ms, eligible_at) {
            scheduling_delay_ms += after.max(0);
            if after < -CLOCK_TOLERANCE_MS {
                early.push(EarlyStart {
                    attempt_number: Some(attempt.attempt_number),
                    started_at: attempt.started_at,
                    eligible_at: at,
                    early_by_ms: -after,
                });
            }
        }
        let throttled = is_throttled(attempt);
        if throttled {
            throttled_attempts += 1;
            throttle_delay_ms += attempt
                .delay_chosen
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        }
        timings.push(AttemptTiming {
            attempt_number: attempt.attempt_number,
            eligible_at,
            started_after_ms,
            throttled,
        });
        eligible_at = attempt.next_attempt_at;
    }
    let waiting_now_ms = timeline
        .owed_since
        .filter(|since| *since <= now)
        .map(|since| (now - since).num_milliseconds());
    scheduling_delay_ms += waiting_now_ms.unwrap_or(0);
    Findings {
        first_attempt_delay_ms: timeline
            .attempts
            .first()
            .map(|a| (a.started_at - timeline.scheduled_at).num_milliseconds()),
        scheduling_delay_ms,
        waiting_now_ms,
        throttled_attempts,
        throttle_delay_ms,
        leased_before_eligible: early,
        timings,
    }
}

#[derive(sqlx::FromRow)]
struct ReminderRow {
    id: uuid::Uuid,
    tenant_id: uuid::Uuid,
    tenant_name: String,
    event_id: String,
    channels: Vec<String>,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    cancelled_at: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    revision: i64,
}

#[derive(sqlx::FromRow)]
struct DeliveryRow {
    id: uuid::Uuid,
    reminder_id: uuid::Uuid,
    channel: String,
    state: String,
    lane: String,
    scheduled_at: DateTime<Utc>,
    first_attempt_at: Option<DateTime<Utc>>,
    last_attempt_at: Option<DateTime<Utc>>,
    expires_at: DateTime<Utc>,
    next_attempt_at: Option<DateTime<Utc>>,
    settled_at: Option<DateTime<Utc>>,
    attempt_count: i32,
    attempt_base: i32,
    lease_owner: Option<String>,
    lease_expires_at: Option<DateTime<Utc>>,
    send_started_at: Option<DateTime<Utc>>,
    provider_account: Option<String>,
    provider_message_id: Option<String>,
    last_error_class: Option<String>,
    last_error_reason: Option<String>,
}

#[derive(sqlx::FromRow)]
struct RedriveRow {
    redrive_id: i64,
    position: i32,
    fed_at: Option<DateTime<Utc>>,
    skipped_reason: Option<String>,
    redrive_state: String,
    incident: Option<String>,
}

const DELIVERY_COLUMNS: &str = "id, reminder_id, channel, state, lane, scheduled_at, \
     first_attempt_at, last_attempt_at, expires_at, next_attempt_at, settled_at, attempt_count, \
     attempt_base, lease_owner, lease_expires_at, send_started_at, provider_account, \
     provider_message_id, last_error_class, last_error_reason";

fn count(value: i32) -> Result<u32, LedgerError> {
    u32::try_from(value).map_err(|e| LedgerError::corrupt("deliveries", e))
}

impl Ledger {
    /// Traces `id`: tried as a delivery id, then as a reminder id, or as `TENANT/EVENT_ID`.
    /// A delivery id traces just that delivery; the others every delivery of the reminder.
    pub async fn trace(&self, id: &TraceId, now: DateTime<Utc>) -> Result<Trace, TraceError> {
        match id {
            TraceId::Uuid(uuid) => {
                if let Some(trace) = self
                    .trace_delivery(DeliveryId::from_uuid(*uuid), now)
                    .await?
                {
                    return Ok(trace);
                }
                self.trace_reminder(ReminderId::from_uuid(*uuid), MatchedAs::Reminder, now)
                    .await?
                    .ok_or(TraceError::UnknownId(*uuid))
            }
            TraceId::Event { tenant, event_id } => {
                let found = self
                    .tenant_by_name(tenant)
                    .await?
                    .ok_or_else(|| TraceError::UnknownTenant(tenant.clone()))?;
                let unknown = || TraceError::UnknownEvent {
                    tenant: tenant.clone(),
                    event_id: event_id.as_str().to_owned(),
                };
                let reminder: Option<uuid::Uuid> = sqlx::query_scalar(
                    "SELECT id FROM reminders WHERE tenant_id = $1 AND event_id = $2",
                )
                .bind(found.id.as_uuid())
                .bind(event_id.as_str())
                .fetch_optional(&self.pool)
                .await
                .map_err(LedgerError::from)?;
                let reminder = reminder.ok_or_else(unknown)?;
                self.trace_reminder(ReminderId::from_uuid(reminder), MatchedAs::Event, now)
                    .await?
                    .ok_or_else(unknown)
            }
        }
    }

    /// Traces one delivery (`None` when there is no such delivery).
    pub async fn trace_delivery(
        &self,
        id: DeliveryId,
        now: DateTime<Utc>,
    ) -> Result<Option<Trace>, LedgerError> {
        let row: Option<DeliveryRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {DELIVERY_COLUMNS} FROM deliveries WHERE id = $1"
        )))
        .bind(id.as_uuid())
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let Some(reminder) = self
            .reminder_summary(ReminderId::from_uuid(row.reminder_id))
            .await?
        else {
            return Err(LedgerError::corrupt(
                "deliveries",
                "a delivery without its reminder",
            ));
        };
        Ok(Some(Trace {
            matched_as: MatchedAs::Delivery,
            reminder,
            deliveries: vec![self.delivery_trace(row, now).await?],
        }))
    }

    async fn trace_reminder(
        &self,
        id: ReminderId,
        matched_as: MatchedAs,
        now: DateTime<Utc>,
    ) -> Result<Option<Trace>, LedgerError> {
        let Some(reminder) = self.reminder_summary(id).await? else {
            return Ok(None);
        };
        let rows: Vec<DeliveryRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {DELIVERY_COLUMNS} FROM deliveries WHERE reminder_id = $1 ORDER BY channel"
        )))
        .bind(id.as_uuid())
        .fetch_all(&self.pool)
        .await?;
        let mut deliveries = Vec::with_capacity(rows.len());
        for row in rows {
            deliveries.push(self.delivery_trace(row, now).await?);
        }
        Ok(Some(Trace {
            matched_as,
            reminder,
            deliveries,
        }))
    }

    async fn reminder_summary(
        &self,
        id: ReminderId,
    ) -> Result<Option<ReminderSummary>, LedgerError> {
        let row: Option<ReminderRow> = sqlx::query_as(
            "SELECT r.id, r.tenant_id, t.name AS tenant_name, r.event_id, r.channels,
                    r.scheduled_at, r.expires_at, r.cancelled_at, r.created_at, r.revision
             FROM reminders r JOIN tenants t ON t.id = r.tenant_id
             WHERE r.id = $1",
        )
        .bind(id.as_uuid())
        .fetch_optional(&self.pool)
        .await?;
        let reschedules: Vec<RescheduleEntry> = if row.is_some() {
            sqlx::query_as(
                "SELECT revision, from_scheduled_at, to_scheduled_at, from_expires_at,
                        to_expires_at, channels_added, channels_removed, source,
                        created_at AS at
                 FROM reminder_revisions WHERE reminder_id = $1 ORDER BY revision",
            )
            .bind(id.as_uuid())
            .fetch_all(&self.pool)
            .await?
        } else {
            Vec::new()
        };
        row.map(|row| {
            Ok(ReminderSummary {
                id: ReminderId::from_uuid(row.id),
                tenant_id: TenantId::from_uuid(row.tenant_id),
                tenant_name: row.tenant_name,
                event_id: row.event_id,
                channels: row
                    .channels
                    .iter()
                    .map(|c| parse(c))
                    .collect::<Result<_, _>>()?,
                scheduled_at: row.scheduled_at,
                expires_at: row.expires_at,
                cancelled_at: row.cancelled_at,
                created_at: row.created_at,
                revision: row.revision,
                reschedules,
            })
        })
        .transpose()
    }

    async fn delivery_trace(
        &self,
        row: DeliveryRow,
        now: DateTime<Utc>,
    ) -> Result<DeliveryTrace, LedgerError> {
        let id = DeliveryId::from_uuid(row.id);
        let attempts = self.attempts(id).await?;
        let redrives: Vec<RedriveRow> = sqlx::query_as(
            "SELECT ri.redrive_id, ri.position, ri.fed_at, ri.skipped_reason,
                    r.state AS redrive_state, r.incident
             FROM redrive_items ri JOIN redrives r ON r.id = ri.redrive_id
             WHERE ri.delivery_id = $1
             ORDER BY ri.redrive_id",
        )
        .bind(row.id)
        .fetch_all(&self.pool)
        .await?;
        let state: DeliveryState = parse(&row.state)?;
        let owed_since = match state {
            DeliveryState::Scheduled | DeliveryState::Queued | DeliveryState::RetryWait => {
                row.next_attempt_at
            }
            _ => None,
        };
        let findings = findings(
            &Timeline {
                scheduled_at: row.scheduled_at,
                first_leased_at: row.first_attempt_at,
                attempts: &attempts,
                owed_since,
            },
            now,
        );
        let lease = match (row.lease_owner, row.lease_expires_at) {
            (Some(lease_holder), Some(expires_at)) => Some(LeaseHeld {
                lease_holder,
                expires_at,
                send_started_at: row.send_started_at,
            }),
            _ => None,
        };
        Ok(DeliveryTrace {
            id,
            channel: parse(&row.channel)?,
            state,
            lane: parse(&row.lane)?,
            scheduled_at: row.scheduled_at,
            first_attempt_at: row.first_attempt_at,
            last_attempt_at: row.last_attempt_at,
            expires_at: row.expires_at,
            next_attempt_at: row.next_attempt_at,
            settled_at: row.settled_at,
            attempt_count: count(row.attempt_count)?,
            attempt_base: count(row.attempt_base)?,
            lease,
            provider_account: row.provider_account,
            provider_message_id: row.provider_message_id,
            last_error_class: row.last_error_class,
            last_error_reason: row.last_error_reason,
            redrives: redrives
                .into_iter()
                .map(|r| {
                    Ok(RedriveMembership {
                        pending: r.fed_at.is_none()
                            && r.skipped_reason.is_none()
                            && matches!(r.redrive_state.as_str(), "running" | "paused"),
                        redrive_id: RedriveId::try_from(r.redrive_id)
                            .map_err(|e| LedgerError::corrupt("redrive_items", e))?,
                        position: r.position,
                        fed_at: r.fed_at,
                        skipped_reason: r.skipped_reason,
                        redrive_state: r.redrive_state,
                        incident: r.incident,
                    })
                })
                .collect::<Result<_, LedgerError>>()?,
            attempts,
            findings,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use chrono::TimeZone;

    use super::*;

    fn t0() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 29, 9, 0, 0).unwrap()
    }

    fn ms(n: i64) -> chrono::Duration {
        chrono::Duration::milliseconds(n)
    }

    /// An attempt started `start_ms` after t0 that took 100 ms and made the delivery eligible
    /// again `next_ms` after t0.
    fn attempt(number: u32, start_ms: i64, status: u16, next_ms: Option<i64>) -> Attempt {
        let retryable = status == 429 || status >= 500;
        Attempt {
            attempt_number: number,
            generation: u64::from(number),
            lane: if number == 1 { Lane::New } else { Lane::Retry },
            started_at: t0() + ms(start_ms),
            finished_at: t0() + ms(start_ms + 100),
            outcome_class: if retryable {
                OutcomeClass::Retryable
            } else {
                OutcomeClass::Delivered
            },
            http_status: Some(status),
            retry_after_seen: None,
            retry_after_valid: false,
            delay_chosen: next_ms
                .map(|next| Duration::from_millis(u64::try_from(next - start_ms - 100).unwrap())),
            next_state: if retryable {
                DeliveryState::RetryWait
            } else {
                DeliveryState::Delivered
            },
            next_attempt_at: next_ms.map(|n| t0() + ms(n)),
            reason: None,
            provider_message_id: None,
            provider_account: Some("main".into()),
            worker: Some("worker-1".into()),
            incident: None,
        }
    }

    fn check(attempts: &[Attempt], first_leased_ms: Option<i64>) -> Findings {
        findings(
            &Timeline {
                scheduled_at: t0(),
                first_leased_at: first_leased_ms.map(|n| t0() + ms(n)),
                attempts,
                owed_since: None,
            },
            t0() + ms(1_000_000),
        )
    }

    #[test]
    fn a_late_first_attempt_is_scheduling_delay_not_throttling() {
        let found = check(&[attempt(1, 30_000, 200, None)], Some(29_990));

        assert_eq!(found.first_attempt_delay_ms, Some(30_000));
        assert_eq!(found.scheduling_delay_ms, 30_000);
        assert_eq!(found.throttled_attempts, 0);
        assert!(found.leased_before_eligible.is_empty());
    }

    #[test]
    fn waits_chosen_after_429s_are_throttling_and_only_the_lag_past_eligibility_is_delay() {
        // 429 at 0 s, eligible again at 10 s, started at 10.5 s; 429 with Retry-After, eligible
        // at 70 s, started on time; delivered.
        let mut second = attempt(2, 10_500, 429, Some(70_000));
        second.retry_after_seen = Some("60".into());
        second.retry_after_valid = true;
        let found = check(
            &[
                attempt(1, 0, 429, Some(10_000)),
                second,
                attempt(3, 70_000, 200, None),
            ],
            Some(0),
        );

        assert_eq!(found.throttled_attempts, 2);
        assert_eq!(found.throttle_delay_ms, 9_900 + 59_400);
        assert_eq!(found.scheduling_delay_ms, 500);
        assert!(found.leased_before_eligible.is_empty());
        assert_eq!(found.timings[1].eligible_at, Some(t0() + ms(10_000)));
        assert_eq!(found.timings[1].started_after_ms, Some(500));
    }

    #[test]
    fn a_retryable_answer_with_a_retry_after_counts_as_throttling_and_a_plain_5xx_does_not() {
        let mut with_header = attempt(1, 0, 503, Some(5_000));
        with_header.retry_after_seen = Some("not-a-date".into());
        let plain = attempt(2, 5_000, 503, Some(9_000));

        let found = check(&[with_header, plain], None);

        assert_eq!(found.throttled_attempts, 1);
        assert_eq!(found.throttle_delay_ms, 4_900);
        assert!(found.timings[0].throttled && !found.timings[1].throttled);
    }

    #[test]
    fn an_attempt_before_the_previous_next_attempt_at_is_a_lease_before_eligibility() {
        let found = check(
            &[
                attempt(1, 0, 429, Some(60_000)),
                attempt(2, 1_000, 200, None),
            ],
            Some(0),
        );

        assert_eq!(
            found.leased_before_eligible,
            vec![EarlyStart {
                attempt_number: Some(2),
                started_at: t0() + ms(1_000),
                eligible_at: t0() + ms(60_000),
                early_by_ms: 59_000,
            }]
        );
        assert_eq!(found.scheduling_delay_ms, 0, "an early start is no delay");
    }

    #[test]
    fn a_first_attempt_or_lease_before_scheduled_at_is_a_lease_before_eligibility() {
        let found = check(&[attempt(1, -2_000, 200, None)], Some(-2_000));

        let numbers: Vec<_> = found
            .leased_before_eligible
            .iter()
            .map(|e| e.attempt_number)
            .collect();
        assert_eq!(numbers, [None, Some(1)]);
        assert!(
            found
                .leased_before_eligible
                .iter()
                .all(|e| e.early_by_ms == 2_000)
        );
    }

    #[test]
    fn clock_rounding_within_the_tolerance_is_not_flagged() {
        let edge = check(
            &[
                attempt(1, -CLOCK_TOLERANCE_MS, 429, Some(1_000)),
                attempt(2, 1_000 - CLOCK_TOLERANCE_MS, 200, None),
            ],
            Some(-CLOCK_TOLERANCE_MS),
        );
        let past = check(&[attempt(1, -CLOCK_TOLERANCE_MS - 1, 200, None)], None);

        assert!(edge.leased_before_eligible.is_empty());
        assert_eq!(past.leased_before_eligible.len(), 1);
    }

    #[test]
    fn after_a_settled_attempt_eligibility_is_unknown_and_nothing_is_judged() {
        let mut dead = attempt(1, 0, 400, None);
        dead.outcome_class = OutcomeClass::Terminal;
        dead.next_state = DeliveryState::DeadLettered;
        let redriven = attempt(2, 500, 200, None);

        let found = check(&[dead, redriven], Some(0));

        assert_eq!(found.timings[1].eligible_at, None);
        assert!(found.leased_before_eligible.is_empty());
        assert_eq!(found.scheduling_delay_ms, 0);
    }

    #[test]
    fn owed_work_whose_time_has_come_counts_its_wait_so_far_as_scheduling_delay() {
        let now = t0() + ms(90_000);
        let owed = |since| {
            findings(
                &Timeline {
                    scheduled_at: t0(),
                    first_leased_at: None,
                    attempts: &[],
                    owed_since: Some(since),
                },
                now,
            )
        };

        let waiting = owed(t0());
        let not_yet = owed(now + ms(1));

        assert_eq!(waiting.waiting_now_ms, Some(90_000));
        assert_eq!(waiting.scheduling_delay_ms, 90_000);
        assert_eq!(waiting.first_attempt_delay_ms, None);
        assert_eq!(not_yet.waiting_now_ms, None);
    }

    #[test]
    fn a_trace_id_is_a_uuid_or_a_tenant_and_an_event_split_at_the_first_slash() {
        let uuid = uuid::Uuid::now_v7();

        assert_eq!(TraceId::parse(&uuid.to_string()), Ok(TraceId::Uuid(uuid)));
        assert_eq!(
            TraceId::parse("clinic-a/appt/2026/11"),
            Ok(TraceId::Event {
                tenant: "clinic-a".into(),
                event_id: EventId::parse("appt/2026/11").unwrap(),
            })
        );
        assert_eq!(TraceId::parse("appt-1"), Err(TraceIdError::Unrecognised));
        assert_eq!(TraceId::parse("/appt-1"), Err(TraceIdError::TenantName));
        assert!(matches!(
            TraceId::parse("clinic-a/"),
            Err(TraceIdError::EventId(_))
        ));
    }
}
