//! Delivery receipts: provider events recorded against their delivery, and what they settle.
//!
//! Protocol, in one transaction per batch of receipts: each receipt is inserted once per
//! `(account, event key)` (a replay inserts nothing and does nothing); a newly inserted one
//! names its delivery by the key it carried (reminder and channel, the delivery's unique pair)
//! and only if that delivery went through the same provider account; then, for the newly
//! inserted only, a delivery held `ambiguous` is settled `delivered` or `dead_lettered` by what
//! the receipt shows, and a bounce or opt-out flags the contact while it still holds the
//! destination that delivery was sent to; an opt-out is also the destination's own
//! (`destination_consent`, decision 0505), kept whatever the contact holds later. A receipt never moves a
//! delivery in any other state: one already delivered stays delivered, one being retried is
//! left to its own send.

use nudge_domain::{ContactFlag, IdempotencyKey, ProviderAccount};

use crate::{Ledger, LedgerError, LedgerTime};

/// What a receipt says happened to the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiptOutcome {
    /// On its way (queued, sent, processed, deferred, opened): recorded only.
    Progress,
    /// The provider handed it over (delivered, read; an unsubscribe or spam report implies it).
    Delivered,
    /// It will not arrive (failed, undelivered, bounced, dropped).
    Failed,
}

impl ReceiptOutcome {
    pub const fn as_str(self) -> &'static str {
        match self {
            ReceiptOutcome::Progress => "progress",
            ReceiptOutcome::Delivered => "delivered",
            ReceiptOutcome::Failed => "failed",
        }
    }
}

/// One provider event, parsed by the intake from a verified receipt. Holds no PHI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    pub account: ProviderAccount,
    /// The provider's identity of the event (the replay guard), at most 200 characters.
    pub event_key: String,
    /// The delivery key the receipt carried, when it carried a valid one.
    pub delivery_key: Option<IdempotencyKey>,
    /// The provider's status word, at most 64 characters.
    pub status: String,
    pub outcome: ReceiptOutcome,
    pub contact_flag: Option<ContactFlag>,
    pub code: Option<String>,
    pub provider_message_id: Option<String>,
}

/// What became of one receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiptRecorded {
    /// Recorded; `settled` when it settled an ambiguous delivery.
    New { matched: bool, settled: bool },
    /// Seen before: nothing changed.
    Replay,
}

const RECORD: &str = "WITH input AS (
        SELECT * FROM unnest($1::text[], $2::text[], $3::uuid[], $4::text[], $5::text[],
                             $6::text[], $7::text[], $8::text[], $9::text[], $10::int[])
            AS i(account, event_key, reminder_id, channel, status, outcome, contact_flag,
                 code, provider_message_id, ord)),
    -- The delivery each receipt names, locked: a receipt settles it only from `ambiguous`.
    target AS (
        SELECT i.ord, d.id, d.state
        FROM input i JOIN deliveries d
          ON d.reminder_id = i.reminder_id AND d.channel = i.channel
         AND d.provider_account = i.account
        FOR UPDATE OF d),
    inserted AS (
        INSERT INTO provider_events (provider_account, event_key, delivery_id, status, outcome,
                                     contact_flag, code, provider_message_id, settled,
                                     received_at)
        SELECT i.account, i.event_key, t.id, i.status, i.outcome, i.contact_flag, i.code,
               i.provider_message_id,
               COALESCE(t.state = 'ambiguous' AND i.outcome IN ('delivered', 'failed'), false),
               COALESCE($11, now())
        FROM input i LEFT JOIN target t ON t.ord = i.ord
        ON CONFLICT (provider_account, event_key) DO NOTHING
        RETURNING id, provider_account, event_key, delivery_id, outcome, contact_flag, status,
                  code, settled),
    settled AS (
        UPDATE deliveries d
        SET state = CASE WHEN e.outcome = 'delivered' THEN 'delivered' ELSE 'dead_lettered' END,
            last_error_class = CASE WHEN e.outcome = 'delivered' THEN NULL ELSE 'terminal' END,
            last_error_reason = 'receipt: ' || e.status || COALESCE(': ' || e.code, ''),
            settled_at = COALESCE($11, now()), updated_at = COALESCE($11, now())
        FROM inserted e
        WHERE d.id = e.delivery_id AND e.settled
        RETURNING d.id),
    flagged AS (
        UPDATE contacts c
        SET invalid_at = CASE WHEN e.contact_flag = 'invalid'
                              THEN COALESCE(c.invalid_at, COALESCE($11, now()))
                              ELSE c.invalid_at END,
            opted_out_at = CASE WHEN e.contact_flag = 'opted_out'
                                THEN COALESCE(c.opted_out_at, COALESCE($11, now()))
                                ELSE c.opted_out_at END
        FROM inserted e JOIN deliveries d ON d.id = e.delivery_id
             JOIN reminders r ON r.id = d.reminder_id
        WHERE e.contact_flag IS NOT NULL AND c.tenant_id = r.tenant_id
          AND c.subscriber_ref = r.subscriber_ref AND c.channel = d.channel
          -- Only while the contact holds the destination the send used (stamped by its
          -- fence): a late bounce or STOP for an old number never flags the one stored since.
          AND c.destination_digest IS NOT DISTINCT FROM d.destination_digest
        RETURNING 1),
    -- An unsubscribe is the destination's opt-out (decision 0505), kept by the digest the
    -- send used; its history entry is the trigger's.
    opted_out AS (
        INSERT INTO destination_consent (tenant_id, channel, destination_digest, state, source,
                                         actor, changed_at)
        SELECT DISTINCT ON (d.tenant_id, d.channel, d.destination_digest)
               d.tenant_id, d.channel, d.destination_digest, 'opted_out', 'provider_stop',
               'provider:' || e.provider_account, COALESCE($11, now())
        FROM inserted e JOIN deliveries d ON d.id = e.delivery_id
        WHERE e.contact_flag = 'opted_out' AND d.destination_digest IS NOT NULL
        ORDER BY d.tenant_id, d.channel, d.destination_digest
        ON CONFLICT (tenant_id, channel, destination_digest) DO UPDATE
        SET state = EXCLUDED.state, source = EXCLUDED.source, actor = EXCLUDED.actor,
            keyword = NULL, correlation_id = NULL, provider_event = NULL,
            changed_at = EXCLUDED.changed_at
        WHERE destination_consent.state <> 'opted_out'
        RETURNING 1)
    SELECT e.provider_account, e.event_key, e.delivery_id IS NOT NULL AS matched,
           EXISTS (SELECT 1 FROM settled s WHERE s.id = e.delivery_id) AS settled
    FROM inserted e";

impl Ledger {
    /// Records verified receipts in one transaction (see the module's protocol); returns what
    /// became of each, in order.
    pub async fn record_receipts(
        &self,
        receipts: &[Receipt],
        at: LedgerTime,
    ) -> Result<Vec<ReceiptRecorded>, LedgerError> {
        if receipts.is_empty() {
            return Ok(Vec::new());
        }
        for r in receipts {
            if r.event_key.is_empty() || r.event_key.chars().count() > 200 {
                return Err(LedgerError::InvalidInput(
                    "a receipt's event key is 1 to 200 characters",
                ));
            }
            if r.status.is_empty() || r.status.chars().count() > 64 {
                return Err(LedgerError::InvalidInput(
                    "a receipt's status is 1 to 64 characters",
                ));
            }
        }
        let accounts: Vec<&str> = receipts.iter().map(|r| r.account.as_str()).collect();
        let keys: Vec<&str> = receipts.iter().map(|r| r.event_key.as_str()).collect();
        let reminders: Vec<Option<uuid::Uuid>> = receipts
            .iter()
            .map(|r| r.delivery_key.as_ref().map(|k| k.reminder_id().as_uuid()))
            .collect();
        let channels: Vec<Option<&str>> = receipts
            .iter()
            .map(|r| r.delivery_key.as_ref().map(|k| k.channel().as_str()))
            .collect();
        let statuses: Vec<&str> = receipts.iter().map(|r| r.status.as_str()).collect();
        let outcomes: Vec<&str> = receipts.iter().map(|r| r.outcome.as_str()).collect();
        let flags: Vec<Option<&str>> = receipts
            .iter()
            .map(|r| r.contact_flag.map(ContactFlag::as_str))
            .collect();
        let codes: Vec<Option<&str>> = receipts.iter().map(|r| r.code.as_deref()).collect();
        let ids: Vec<Option<&str>> = receipts
            .iter()
            .map(|r| r.provider_message_id.as_deref())
            .collect();
        let ord: Vec<i32> = (0..receipts.len())
            .map(|i| i32::try_from(i).unwrap_or(i32::MAX))
            .collect();
        let mut tx = self.pool.begin().await?;
        let rows: Vec<(String, String, bool, bool)> = sqlx::query_as(RECORD)
            .bind(&accounts)
            .bind(&keys)
            .bind(&reminders)
            .bind(&channels)
            .bind(&statuses)
            .bind(&outcomes)
            .bind(&flags)
            .bind(&codes)
            .bind(&ids)
            .bind(&ord)
            .bind(at.bind())
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(receipts
            .iter()
            .map(|r| {
                rows.iter()
                    .find(|(a, k, _, _)| a == r.account.as_str() && *k == r.event_key)
                    .map_or(ReceiptRecorded::Replay, |(_, _, matched, settled)| {
                        ReceiptRecorded::New {
                            matched: *matched,
                            settled: *settled,
                        }
                    })
            })
            .collect())
    }
}
