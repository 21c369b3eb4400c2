//! Recording outcomes: the domain's decision applied to a held lease, and the attempt appended,
//! for many sends in one statement (group commit).
//!
//! Each outcome is applied only if its lease is still held as it was leased (state `sending`,
//! the same lease holder and generation); the attempt row is inserted only for the deliveries that
//! statement changed, so an outcome whose lease was lost writes nothing. A retry moves a
//! delivery from the `new` lane to `retry`: the lane says whether an attempt failed, which a
//! lease given back before its send does not.

use chrono::{DateTime, Utc};
use nudge_domain::{Decision, DeliveryState, OutcomeClass};

use super::{AttemptRecord, LeasedDelivery, LedgerTime, millis, to_i64};
use crate::{Ledger, LedgerError};

/// One finished attempt to record.
#[derive(Debug, Clone, Copy)]
pub struct OutcomeToRecord<'a> {
    pub lease: &'a LeasedDelivery,
    pub decision: &'a Decision,
    pub attempt: &'a AttemptRecord,
}

/// What became of one outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    Applied,
    /// The lease was no longer held (reaped, or the delivery moved on): nothing was written.
    LeaseLost,
}

/// The columns of one outcome, as arrays for `unnest`.
#[derive(Default)]
pub(super) struct OutcomeColumns {
    ids: Vec<uuid::Uuid>,
    lease_holders: Vec<String>,
    generations: Vec<i64>,
    next_states: Vec<&'static str>,
    next_attempt_at: Vec<Option<DateTime<Utc>>>,
    provider_message_ids: Vec<Option<String>>,
    error_classes: Vec<Option<&'static str>>,
    reasons: Vec<Option<String>>,
    attempt_numbers: Vec<i32>,
    lanes: Vec<&'static str>,
    started_at: Vec<DateTime<Utc>>,
    finished_at: Vec<DateTime<Utc>>,
    outcome_classes: Vec<&'static str>,
    http_statuses: Vec<Option<i16>>,
    retry_after_seen: Vec<Option<String>>,
    retry_after_valid: Vec<bool>,
    delay_chosen_ms: Vec<Option<i64>>,
    workers: Vec<String>,
    correlation_ids: Vec<Option<String>>,
    contact_flags: Vec<Option<&'static str>>,
}

/// The identity of a held lease, as the conditional update checks it.
pub(super) struct Held<'a> {
    pub id: uuid::Uuid,
    pub lease_holder: &'a str,
    pub generation: u64,
    pub lane: nudge_domain::Lane,
    pub attempt_number: u32,
}

impl OutcomeColumns {
    pub(super) fn push(
        &mut self,
        held: &Held<'_>,
        decision: &Decision,
        attempt: &AttemptRecord,
    ) -> Result<(), LedgerError> {
        let next = DeliveryState::Sending.transition(decision.next_state)?;
        let facts = &decision.facts;
        self.ids.push(held.id);
        self.lease_holders.push(held.lease_holder.to_owned());
        self.generations.push(to_i64(held.generation));
        self.next_states.push(next.as_str());
        self.next_attempt_at.push(decision.next_attempt_at);
        self.provider_message_ids
            .push(facts.provider_message_id.clone());
        self.error_classes.push(match facts.outcome_class {
            OutcomeClass::Delivered => None,
            other => Some(other.as_str()),
        });
        self.reasons.push(facts.reason.clone());
        self.attempt_numbers
            .push(i32::try_from(held.attempt_number.max(1)).unwrap_or(i32::MAX));
        self.lanes.push(held.lane.as_str());
        self.started_at.push(attempt.started_at);
        self.finished_at
            .push(attempt.finished_at.max(attempt.started_at));
        self.outcome_classes.push(facts.outcome_class.as_str());
        self.http_statuses.push(
            facts
                .http_status
                .map(|s| i16::try_from(s).unwrap_or(i16::MAX)),
        );
        self.retry_after_seen.push(facts.retry_after_seen.clone());
        self.retry_after_valid.push(facts.retry_after_valid);
        self.delay_chosen_ms.push(facts.delay_chosen.map(millis));
        self.workers.push(attempt.worker.clone());
        self.correlation_ids.push(attempt.correlation_id.clone());
        self.contact_flags.push(
            decision
                .effects
                .contact
                .map(nudge_domain::ContactFlag::as_str),
        );
        Ok(())
    }

    fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

const APPLY: &str = "WITH input AS (
        SELECT * FROM unnest($1::uuid[], $2::text[], $3::bigint[], $4::text[],
                             $5::timestamptz[], $6::text[], $7::text[], $8::text[], $9::int[],
                             $10::text[], $11::timestamptz[], $12::timestamptz[], $13::text[],
                             $14::smallint[], $15::text[], $16::bool[], $17::bigint[], $18::text[],
                             $19::text[], $21::text[])
            AS i(id, owner, generation, next_state, next_attempt_at, provider_message_id,
                 error_class, reason, attempt_number, lane, started_at, finished_at,
                 outcome_class, http_status, retry_after_seen, retry_after_valid,
                 delay_chosen_ms, worker, correlation_id, contact_flag)),
    applied AS (
        UPDATE deliveries d
        SET state = i.next_state, next_attempt_at = i.next_attempt_at, lease_owner = NULL,
            lease_expires_at = NULL, lease_idempotent = NULL, send_started_at = NULL,
            provider_message_id = COALESCE(i.provider_message_id, d.provider_message_id),
            last_error_class = i.error_class, last_error_reason = i.reason,
            lane = CASE WHEN i.next_state = 'retry_wait' AND d.lane = 'new' THEN 'retry'
                        ELSE d.lane END,
            settled_at = CASE WHEN i.next_state IN ('delivered', 'dead_lettered', 'expired',
                                                    'cancelled', 'suppressed', 'ambiguous')
                              THEN COALESCE($20, now()) END,
            updated_at = COALESCE($20, now())
        FROM input i
        -- A lease owner and expiry are set exactly while the delivery is `sending` (a CHECK
        -- holds them together), so they are the state test. Spelling out `state = 'sending'`
        -- would let the planner scan the lease index, dead versions and all, instead of
        -- looking each outcome's delivery up by its key.
        WHERE d.id = i.id AND d.lease_owner = i.owner AND d.lease_expires_at IS NOT NULL
          AND d.generation = i.generation
        RETURNING d.id, d.provider_account, d.reminder_id, d.tenant_id, d.channel,
            d.destination_digest,
            -- A redriven delivery's attempts carry its redrive's incident; any other attempt
            -- made while its channel drains, the drain's.
            COALESCE(
                CASE WHEN d.lane = 'redrive' THEN
                    (SELECT r.incident FROM redrive_items ri
                     JOIN redrives r ON r.id = ri.redrive_id
                     WHERE ri.delivery_id = d.id AND ri.fed_at IS NOT NULL
                     ORDER BY ri.redrive_id DESC LIMIT 1) END,
                (SELECT cc.drain_incident FROM channel_controls cc
                 WHERE cc.channel = d.channel AND cc.draining)) AS incident),
    -- What the answer said about the contact, flagged with the outcome that showed it (only
    -- for outcomes applied; a flag already set keeps its first time), and only while the
    -- contact holds the destination the send used (its fence stamped the digest): a number
    -- stored since is never flagged for the old one.
    flagged AS (
        UPDATE contacts c
        SET invalid_at = CASE WHEN i.contact_flag = 'invalid'
                              THEN COALESCE(c.invalid_at, COALESCE($20, now()))
                              ELSE c.invalid_at END,
            opted_out_at = CASE WHEN i.contact_flag = 'opted_out'
                                THEN COALESCE(c.opted_out_at, COALESCE($20, now()))
                                ELSE c.opted_out_at END
        FROM input i JOIN applied a ON a.id = i.id JOIN reminders r ON r.id = a.reminder_id
        WHERE i.contact_flag IS NOT NULL AND c.tenant_id = r.tenant_id
          AND c.subscriber_ref = r.subscriber_ref AND c.channel = a.channel
          AND c.destination_digest IS NOT DISTINCT FROM a.destination_digest
        RETURNING 1),
    -- An opt-out is the destination's (decision 0505): kept by the digest the send used, for
    -- every later post of that destination in the tenant; its history entry is the trigger's.
    opted_out AS (
        INSERT INTO destination_consent (tenant_id, channel, destination_digest, state, source,
                                         actor, correlation_id, changed_at)
        SELECT DISTINCT ON (a.tenant_id, a.channel, a.destination_digest)
               a.tenant_id, a.channel, a.destination_digest, 'opted_out', 'provider_stop',
               'provider:' || a.provider_account, i.correlation_id, COALESCE($20, now())
        FROM input i JOIN applied a ON a.id = i.id
        WHERE i.contact_flag = 'opted_out' AND a.destination_digest IS NOT NULL
          AND a.provider_account IS NOT NULL
        ORDER BY a.tenant_id, a.channel, a.destination_digest
        ON CONFLICT (tenant_id, channel, destination_digest) DO UPDATE
        SET state = EXCLUDED.state, source = EXCLUDED.source, actor = EXCLUDED.actor,
            keyword = NULL, correlation_id = EXCLUDED.correlation_id, provider_event = NULL,
            changed_at = EXCLUDED.changed_at
        WHERE destination_consent.state <> 'opted_out'
        RETURNING 1)
    INSERT INTO attempts (delivery_id, attempt_number, generation, lane, started_at,
        finished_at, outcome_class, http_status, retry_after_seen, retry_after_valid,
        delay_chosen_ms, next_state, next_attempt_at, reason, provider_account,
        provider_message_id, worker, correlation_id, incident)
    SELECT i.id, i.attempt_number, i.generation, i.lane, i.started_at, i.finished_at,
           i.outcome_class, i.http_status, i.retry_after_seen, i.retry_after_valid,
           i.delay_chosen_ms, i.next_state, i.next_attempt_at, i.reason, a.provider_account,
           i.provider_message_id, i.worker, i.correlation_id, a.incident
    FROM input i JOIN applied a ON a.id = i.id
    RETURNING delivery_id";

/// Applies the outcomes in one statement; returns the ids it applied.
pub(super) async fn apply(
    conn: &mut sqlx::PgConnection,
    columns: &OutcomeColumns,
    at: LedgerTime,
) -> Result<Vec<uuid::Uuid>, LedgerError> {
    if columns.is_empty() {
        return Ok(Vec::new());
    }
    Ok(sqlx::query_scalar(APPLY)
        .bind(&columns.ids)
        .bind(&columns.lease_holders)
        .bind(&columns.generations)
        .bind(&columns.next_states)
        .bind(&columns.next_attempt_at)
        .bind(&columns.provider_message_ids)
        .bind(&columns.error_classes)
        .bind(&columns.reasons)
        .bind(&columns.attempt_numbers)
        .bind(&columns.lanes)
        .bind(&columns.started_at)
        .bind(&columns.finished_at)
        .bind(&columns.outcome_classes)
        .bind(&columns.http_statuses)
        .bind(&columns.retry_after_seen)
        .bind(&columns.retry_after_valid)
        .bind(&columns.delay_chosen_ms)
        .bind(&columns.workers)
        .bind(&columns.correlation_ids)
        .bind(at.bind())
        .bind(&columns.contact_flags)
        .fetch_all(&mut *conn)
        .await?)
}

impl Ledger {
    /// Records finished attempts: for each, the domain's decision is applied and the attempt
    /// appended, only if its lease is still held; all in one statement, so one commit covers
    /// every send of the batch. Contact flags ride in that statement; an outcome that suspends
    /// its account (`BucketSignal::Suspend`: credentials refused) pauses the account's bucket
    /// for `suspend_for` in the same transaction. Returns what became of each, in order.
    pub async fn record_outcomes(
        &self,
        outcomes: &[OutcomeToRecord<'_>],
        suspend_for: std::time::Duration,
        at: LedgerTime,
    ) -> Result<Vec<Recorded>, LedgerError> {
        let mut columns = OutcomeColumns::default();
        let mut suspend: Vec<(
            &nudge_domain::ProviderAccount,
            nudge_domain::Channel,
            uuid::Uuid,
        )> = Vec::new();
        for o in outcomes {
            columns.push(
                &Held {
                    id: o.lease.id.as_uuid(),
                    lease_holder: &o.lease.lease_holder,
                    generation: o.lease.generation,
                    lane: o.lease.lane,
                    attempt_number: o.lease.attempt_number,
                },
                o.decision,
                o.attempt,
            )?;
            if o.decision.effects.bucket == Some(nudge_domain::BucketSignal::Suspend) {
                suspend.push((
                    &o.lease.provider_account,
                    o.lease.channel,
                    o.lease.id.as_uuid(),
                ));
            }
        }
        let applied = if suspend.is_empty() {
            let mut conn = self.pool.acquire().await?;
            apply(&mut conn, &columns, at).await?
        } else {
            let mut tx = self.pool.begin().await?;
            let applied = apply(&mut tx, &columns, at).await?;
            let mut done = std::collections::HashSet::new();
            for (account, channel, id) in suspend {
                // Only an outcome that was applied speaks for the account; one bucket once.
                if applied.contains(&id) && done.insert((account.as_str(), channel)) {
                    crate::buckets::suspend(&mut tx, account, channel, suspend_for, at).await?;
                }
            }
            tx.commit().await?;
            applied
        };
        Ok(outcomes
            .iter()
            .map(|o| {
                if applied.contains(&o.lease.id.as_uuid()) {
                    Recorded::Applied
                } else {
                    Recorded::LeaseLost
                }
            })
            .collect())
    }
}
