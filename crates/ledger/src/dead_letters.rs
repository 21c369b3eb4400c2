use chrono::{DateTime, Utc};
use nudge_domain::Channel;

use crate::{Ledger, LedgerError, MessagePointer};

/// Kept of a dead-lettered message's bytes (it carries ids only, never PHI).
const PAYLOAD_KEEP: usize = 4096;

/// A message that reached a dead-letter queue.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub queue: String,
    pub channel: Option<Channel>,
    /// RabbitMQ's reason (`rejected`, `delivery_limit`, ...).
    pub death_reason: String,
    /// Why the envelope could not be used, when it did not decode.
    pub decode_error: Option<String>,
    /// The delivery it points at, when it decoded.
    pub delivery: Option<MessagePointer>,
    pub delivery_count: u64,
    pub payload: Vec<u8>,
}

/// What recording a dead letter did to the delivery it pointed at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterAction {
    /// It pointed at owed work with its current generation: that delivery is now
    /// `dead_lettered`, visible to operators and redrivable.
    DeliveryDeadLettered,
    /// Stale, unknown or undecodable: only the record was kept.
    Recorded,
}

impl DeadLetterAction {
    fn as_str(self) -> &'static str {
        match self {
            DeadLetterAction::DeliveryDeadLettered => "delivery_dead_lettered",
            DeadLetterAction::Recorded => "recorded",
        }
    }
}

impl Ledger {
    /// Records a dead-lettered message, and dead-letters the delivery it points at if that
    /// delivery is still `queued` with the message's generation (a poison message for live
    /// work: nothing else would ever settle it). One transaction.
    pub async fn record_dead_letter(
        &self,
        letter: &DeadLetter,
        now: DateTime<Utc>,
    ) -> Result<DeadLetterAction, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let mut action = DeadLetterAction::Recorded;
        if let Some(MessagePointer {
            delivery_id,
            generation,
        }) = letter.delivery
        {
            let reason = format!("poison_message: {}", letter.death_reason);
            let done = sqlx::query(
                "UPDATE deliveries
                 SET state = 'dead_lettered', settled_at = $3, updated_at = $3,
                     last_error_class = 'poison', last_error_reason = $4
                 WHERE id = $1 AND generation = $2 AND state = 'queued'",
            )
            .bind(delivery_id.as_uuid())
            .bind(i64::try_from(generation).unwrap_or(i64::MAX))
            .bind(now)
            .bind(&reason)
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 1 {
                action = DeadLetterAction::DeliveryDeadLettered;
            }
        }
        let kept = &letter.payload[..letter.payload.len().min(PAYLOAD_KEEP)];
        sqlx::query(
            "INSERT INTO dead_letters (queue, channel, death_reason, decode_error, delivery_id,
                 generation, delivery_count, payload, payload_size, action, recorded_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        )
        .bind(&letter.queue)
        .bind(letter.channel.map(|c| c.as_str()))
        .bind(&letter.death_reason)
        .bind(letter.decode_error.as_deref())
        .bind(letter.delivery.map(|m| m.delivery_id.as_uuid()))
        .bind(
            letter
                .delivery
                .map(|m| i64::try_from(m.generation).unwrap_or(i64::MAX)),
        )
        .bind(i64::try_from(letter.delivery_count).unwrap_or(i64::MAX))
        .bind(kept)
        .bind(i32::try_from(letter.payload.len()).unwrap_or(i32::MAX))
        .bind(action.as_str())
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(action)
    }

    /// How many dead letters have been recorded (per channel, for status and tests).
    pub async fn dead_letter_count(&self, channel: Option<Channel>) -> Result<u64, LedgerError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM dead_letters WHERE $1::text IS NULL OR channel = $1",
        )
        .bind(channel.map(|c| c.as_str()))
        .fetch_one(&self.pool)
        .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
