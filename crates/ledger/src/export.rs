//! The incident export: every attempt made under an incident (a redrive's or a drain's), as
//! ids, times and outcome classes, never a destination, content or subscriber reference.

use chrono::{DateTime, Utc};

use crate::{Ledger, LedgerError};

/// One attempt made under an incident, as `nudgectl export attempts` writes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct IncidentAttempt {
    /// The attempt row's id: the export's order and its resume point.
    pub id: i64,
    pub incident: String,
    pub delivery_id: uuid::Uuid,
    pub reminder_id: uuid::Uuid,
    pub tenant_id: uuid::Uuid,
    pub channel: String,
    pub attempt_number: i32,
    pub lane: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub outcome_class: String,
    pub http_status: Option<i16>,
    pub retry_after_seen: Option<String>,
    pub retry_after_valid: bool,
    pub delay_chosen_ms: Option<i64>,
    pub next_state: String,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub reason: Option<String>,
    pub provider_account: Option<String>,
    pub provider_message_id: Option<String>,
    pub worker: Option<String>,
    pub correlation_id: Option<String>,
}

impl Ledger {
    /// Up to `limit` attempts made under `incident` after attempt id `after`, in id order:
    /// call again with the last id until it returns fewer than `limit`.
    pub async fn incident_attempts(
        &self,
        incident: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<IncidentAttempt>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT a.id, a.incident, a.delivery_id, d.reminder_id, d.tenant_id, d.channel,
                    a.attempt_number, a.lane, a.started_at, a.finished_at, a.outcome_class,
                    a.http_status, a.retry_after_seen, a.retry_after_valid, a.delay_chosen_ms,
                    a.next_state, a.next_attempt_at, a.reason, a.provider_account,
                    a.provider_message_id, a.worker, a.correlation_id
             FROM attempts a JOIN deliveries d ON d.id = a.delivery_id
             WHERE a.incident = $1 AND a.id > $2
             ORDER BY a.id LIMIT $3",
        )
        .bind(incident)
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?)
    }
}
