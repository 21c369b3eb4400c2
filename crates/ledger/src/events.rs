//! Delivery events (`delivery_events`, decision 0601): what a client is told of its
//! deliveries. A trigger on `deliveries` writes each event in the statement that makes the
//! change, so no path here or elsewhere writes one, none is lost and none exists for a change
//! that rolled back. Events are read by position: [`Ledger::sequence_events`] (the janitor)
//! numbers them after their transactions committed, in an order no later number can precede,
//! and [`Ledger::tenant_events`] pages a tenant's numbered events from a position on.
//!
//! An event holds ids, states, classes and times; never a destination, content or subscriber
//! reference (DESIGN invariant 6).

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, TenantId};
use uuid::Uuid;

use crate::{Ledger, LedgerError};

/// The most events one page holds.
pub const EVENTS_PAGE_MAX: u32 = 1_000;

/// The most events one call of [`Ledger::sequence_events`] numbers.
pub const SEQUENCE_BATCH_MAX: u32 = 100_000;

/// What happened to a delivery, as its client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeliveryEventKind {
    /// Made, waiting for its time.
    Scheduled,
    /// Waiting again: for a retry after a failed or throttled attempt, for the account's
    /// slot, or for the subscriber's quiet hours to end (`next_attempt_at` says until when).
    Deferred,
    /// The provider accepted it (`provider_message_id`).
    Sent,
    /// A receipt settled it as delivered (one that was held ambiguous or waiting).
    Delivered,
    /// Dead-lettered (`error_class`, `reason`).
    Failed,
    Expired,
    Cancelled,
    /// Never sent: its destination or its category opted out.
    Suppressed,
    /// Its outcome is unknown (the provider may have it): held for an operator or a receipt.
    HeldAmbiguous,
    /// A dead letter fed again by a redrive.
    Redriven,
    /// Its time moved.
    Rescheduled,
}

impl DeliveryEventKind {
    pub const ALL: [DeliveryEventKind; 11] = [
        Self::Scheduled,
        Self::Deferred,
        Self::Sent,
        Self::Delivered,
        Self::Failed,
        Self::Expired,
        Self::Cancelled,
        Self::Suppressed,
        Self::HeldAmbiguous,
        Self::Redriven,
        Self::Rescheduled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Scheduled => "scheduled",
            Self::Deferred => "deferred",
            Self::Sent => "sent",
            Self::Delivered => "delivered",
            Self::Failed => "failed",
            Self::Expired => "expired",
            Self::Cancelled => "cancelled",
            Self::Suppressed => "suppressed",
            Self::HeldAmbiguous => "held_ambiguous",
            Self::Redriven => "redriven",
            Self::Rescheduled => "rescheduled",
        }
    }

    fn parse(text: &str) -> Result<Self, LedgerError> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == text)
            .ok_or_else(|| LedgerError::corrupt("delivery_events", format!("kind {text:?}")))
    }
}

/// One event of a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryEvent {
    /// The tenant's cursor: positions only grow, in the order the events became readable.
    pub position: i64,
    /// The event's stable id (a client's duplicate check).
    pub id: Uuid,
    pub kind: DeliveryEventKind,
    pub delivery_id: Uuid,
    /// The delivery's own count of events, 1 for its first: the order per delivery.
    pub delivery_seq: i32,
    pub reminder_id: Uuid,
    /// The client's id of the reminder.
    pub event_id: String,
    pub channel: Channel,
    pub state: String,
    pub previous_state: Option<String>,
    pub lane: String,
    pub attempt_count: i32,
    pub error_class: Option<String>,
    pub reason: Option<String>,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub provider_message_id: Option<String>,
    /// The database's time of the change.
    pub occurred_at: DateTime<Utc>,
}

impl DeliveryEvent {
    /// The event as every client reads it: the events API's shape, `nudgectl events`' lines
    /// and each pushed batch's `data.events`.
    pub fn wire(&self) -> serde_json::Value {
        serde_json::json!({
            "position": self.position,
            "id": self.id,
            "kind": self.kind.as_str(),
            "delivery_id": self.delivery_id,
            "delivery_seq": self.delivery_seq,
            "reminder_id": self.reminder_id,
            "event_id": self.event_id,
            "channel": self.channel.as_str(),
            "state": self.state,
            "previous_state": self.previous_state,
            "lane": self.lane,
            "attempts": self.attempt_count,
            "error_class": self.error_class,
            "reason": self.reason,
            "next_attempt_at": self.next_attempt_at,
            "provider_message_id": self.provider_message_id,
            "occurred_at": self.occurred_at,
        })
    }
}

/// One page of a tenant's events, oldest position first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventsPage {
    pub events: Vec<DeliveryEvent>,
    /// Where the next page starts: the last event's position, or the one asked from when the
    /// page is empty (poll again with it).
    pub next_after: i64,
    /// Whether more numbered events follow at once.
    pub more: bool,
}

#[derive(sqlx::FromRow)]
struct EventRow {
    position: i64,
    event_uuid: Uuid,
    kind: String,
    delivery_id: Uuid,
    delivery_seq: i32,
    reminder_id: Uuid,
    event_id: String,
    channel: String,
    state: String,
    previous_state: Option<String>,
    lane: String,
    attempt_count: i32,
    error_class: Option<String>,
    reason: Option<String>,
    next_attempt_at: Option<DateTime<Utc>>,
    provider_message_id: Option<String>,
    occurred_at: DateTime<Utc>,
}

impl EventRow {
    fn event(self) -> Result<DeliveryEvent, LedgerError> {
        Ok(DeliveryEvent {
            position: self.position,
            id: self.event_uuid,
            kind: DeliveryEventKind::parse(&self.kind)?,
            delivery_id: self.delivery_id,
            delivery_seq: self.delivery_seq,
            reminder_id: self.reminder_id,
            event_id: self.event_id,
            channel: self
                .channel
                .parse()
                .map_err(|e| LedgerError::corrupt("delivery_events", e))?,
            state: self.state,
            previous_state: self.previous_state,
            lane: self.lane,
            attempt_count: self.attempt_count,
            error_class: self.error_class,
            reason: self.reason,
            next_attempt_at: self.next_attempt_at,
            provider_message_id: self.provider_message_id,
            occurred_at: self.occurred_at,
        })
    }
}

const EVENT_COLUMNS: &str = "position, event_uuid, kind, delivery_id, delivery_seq, reminder_id, \
     event_id, channel, state, previous_state, lane, attempt_count, error_class, reason, \
     next_attempt_at, provider_message_id, occurred_at";

/// What one call of the sequencer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequencedEvents {
    /// Events numbered by this call; `None` when another caller held the sequencer.
    pub numbered: Option<u32>,
}

impl Ledger {
    /// Numbers up to `max` of the committed events without a position, in the order they
    /// were written: an event committed later gets a later position than any numbered before.
    /// One caller at a time: while another holds the sequencer this numbers none and answers
    /// `numbered: None`.
    pub async fn sequence_events(&self, max: u32) -> Result<SequencedEvents, LedgerError> {
        let max = i32::try_from(max.clamp(1, SEQUENCE_BATCH_MAX)).unwrap_or(i32::MAX);
        let numbered: i32 = sqlx::query_scalar("SELECT nudge_sequence_delivery_events($1)")
            .bind(max)
            .fetch_one(&self.pool)
            .await?;
        Ok(SequencedEvents {
            numbered: u32::try_from(numbered).ok(),
        })
    }

    /// A tenant's numbered events after position `after` (0: from the first kept), at most
    /// `limit` ([`EVENTS_PAGE_MAX`] at most), oldest first.
    pub async fn tenant_events(
        &self,
        tenant: TenantId,
        after: i64,
        limit: u32,
    ) -> Result<EventsPage, LedgerError> {
        let limit = limit.clamp(1, EVENTS_PAGE_MAX);
        let rows: Vec<EventRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {EVENT_COLUMNS} FROM delivery_events
             WHERE tenant_id = $1 AND position > $2
             ORDER BY position
             LIMIT $3"
        )))
        .bind(tenant.as_uuid())
        .bind(after.max(0))
        .bind(i64::from(limit) + 1)
        .fetch_all(&self.pool)
        .await?;
        let more = rows.len() > limit as usize;
        let events = rows
            .into_iter()
            .take(limit as usize)
            .map(EventRow::event)
            .collect::<Result<Vec<_>, _>>()?;
        let next_after = events.last().map_or(after.max(0), |e| e.position);
        Ok(EventsPage {
            events,
            next_after,
            more,
        })
    }

    /// The position just before a tenant's first numbered event at or after `at` (to replay
    /// from a time), or its newest when none is that late. Reads the tenant's numbered events
    /// without an index on time: for an operator's replay, not a client's polling.
    pub async fn tenant_events_position_at(
        &self,
        tenant: TenantId,
        at: DateTime<Utc>,
    ) -> Result<i64, LedgerError> {
        let first: Option<i64> = sqlx::query_scalar(
            "SELECT min(position) FROM delivery_events
             WHERE tenant_id = $1 AND position IS NOT NULL AND occurred_at >= $2",
        )
        .bind(tenant.as_uuid())
        .bind(at)
        .fetch_one(&self.pool)
        .await?;
        match first {
            Some(p) => Ok(p - 1),
            None => self.tenant_events_newest(tenant).await,
        }
    }

    /// The position of a tenant's newest numbered event (0 when it has none): where to start
    /// reading only what comes next.
    pub async fn tenant_events_newest(&self, tenant: TenantId) -> Result<i64, LedgerError> {
        let last: Option<i64> = sqlx::query_scalar(
            "SELECT max(position) FROM delivery_events
             WHERE tenant_id = $1 AND position IS NOT NULL",
        )
        .bind(tenant.as_uuid())
        .fetch_one(&self.pool)
        .await?;
        Ok(last.unwrap_or(0))
    }
}
