//! The worker's side before a send: leasing a batch of messages, taking their send slots, and
//! the fence.
//!
//! Protocol, in one transaction per batch:
//! 1. One SELECT ... FOR UPDATE locks every message's delivery that may be leased: `queued`
//!    with the message's generation, due, not expired, its reminder not cancelled, and its
//!    provider account (the tenant's routing, else the worker's default) one this worker can
//!    send through. It returns what the send needs: routing, the sealed destination and
//!    content, and whether the account has a rate bucket.
//! 2. Messages not locked are explained in one more statement (only when there are any):
//!    expired or cancelled deliveries are settled so; one whose tenant is routed to an account
//!    no live worker has is given back until the next look (`account_unavailable`, 0411);
//!    others are stale, owned by another sender, or left for a worker that has their account.
//!    A tenant routed to its own account is never sent through another (it fails closed).
//!    A candidate inside its quiet hours (its subscriber's window or its tenant's, in the
//!    subscriber's zone, by the database's clock) takes no slot: it is given back due at the
//!    window's end, or settled `expired` when its expiry comes first, both with the reason
//!    `quiet_hours`. The others carry the next window's start, and no fence stamps a send at
//!    or after it.
//! 3. Candidates on accounts with a bucket (or, without one, suspended: `account_suspensions`)
//!    take their slots (`buckets::admit_slots`: one lock per bucket, the database's clock read
//!    under it).
//! 4. One UPDATE applies the plan to every candidate: leased and fenced (`send_started_at`
//!    stamped) when the account has no bucket or the slot has come; leased unfenced when the
//!    slot is within the admission wait (the worker waits for it, then [`Ledger::fence`]); not
//!    leased but due again when the bucket opens when there is no slot in time (no attempt
//!    spent, its lane kept). Each row is written once per transaction: a second UPDATE of a
//!    row the transaction wrote makes PostgreSQL re-check its foreign keys (`KEY SHARE` on the
//!    tenant), which deadlocked with a window holding the tenant `FOR UPDATE`.
//!
//! Nothing here waits on the network while a transaction is open.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, NaiveTime, Utc};
use nudge_domain::{
    Admission, AdmissionSettings, Channel, DeferReason, DeliveryId, DeliveryState, IdempotencyKey,
    IdempotencySupport, ProviderAccount, QuietHours, QuietVerdict, ReminderId, TenantId, Zone,
    quiet_verdict,
};

use super::{LeasedDelivery, LedgerTime, MessagePointer, QuietRule, millis, parse, to_i64, to_u64};
use crate::buckets::{BucketReading, SlotRequest, admit_slots};
use crate::contacts::destination_aad;
use crate::crypto::content_aad;
use crate::{Destination, DestinationCipher, DestinationDigest, Ledger, LedgerError};

/// The provider accounts a worker can send through.
#[derive(Debug, Clone)]
pub struct WorkerRoutes {
    /// For tenants without their own routing on the channel.
    pub default: ProviderAccount,
    /// Every account the worker has, with whether it honours idempotency keys.
    pub accounts: Vec<(ProviderAccount, IdempotencySupport)>,
}

/// Everything a batch lease needs besides the messages.
#[derive(Debug, Clone, Copy)]
pub struct LeaseBatch<'a> {
    pub channel: Channel,
    /// The worker that holds the leases (stored as the column `lease_owner`); not the sender
    /// that owns the deliveries, which is the ledger's own (`deliveries.owner`).
    pub lease_holder: &'a str,
    /// How long a lease is held before the reaper may settle it; renewed by the fence.
    pub lease_for: Duration,
    pub routes: &'a WorkerRoutes,
    /// How long a delivery routed to an account no live worker has waits before it is looked
    /// at again (`worker.account_recheck_ms`).
    pub account_recheck: Duration,
    pub admission: &'a AdmissionSettings,
    pub cipher: &'a DestinationCipher,
    pub at: LedgerTime,
}

/// What a send needs, opened just before it.
#[derive(Debug)]
pub struct Material {
    /// None when the subscriber has no destination on file for the channel.
    pub destination: Option<Destination>,
    pub content: Option<Vec<u8>>,
    /// What a provider said about the destination (opted out wins over invalid): the worker
    /// settles the delivery without a send.
    pub contact_flag: Option<nudge_domain::ContactFlag>,
}

/// When a leased delivery may be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendSlot {
    /// Fenced already: send now.
    Now,
    /// A slot reserved at `reserved_at` for `send_at` (both the database's clock): wait
    /// `send_at - reserved_at`, then [`Ledger::fence`].
    At {
        send_at: DateTime<Utc>,
        reserved_at: DateTime<Utc>,
    },
}

/// What became of one message of a batch.
// One per message, moved once from the batch to its send: boxing the lease buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum LeaseOutcome {
    Leased {
        lease: LeasedDelivery,
        /// Err when the sealed material did not open (wrong key, moved ciphertext).
        material: Result<Material, LedgerError>,
        slot: SendSlot,
    },
    /// Leased, but its bucket had no slot within the admission wait: given back in the same
    /// transaction, due at `until`, its lane kept, no attempt spent.
    Released {
        until: DateTime<Utc>,
        reason: DeferReason,
        account: ProviderAccount,
    },
    /// Owed, but its time ran out: settled `expired`, nothing sent.
    Expired,
    /// Due inside its quiet hours, which outlast its expiry: settled `expired` with the
    /// reason `quiet_hours`, nothing sent.
    QuietHoursExpired,
    /// Its reminder was cancelled: settled `cancelled`, nothing sent.
    Cancelled,
    /// A duplicate or old message: the delivery moved on (other state or generation).
    Stale {
        state: DeliveryState,
        generation: u64,
    },
    NotFound,
    /// Routed to an account this worker has no configuration for but another live worker of
    /// its sender has (`worker_accounts`): left `queued`, for the republished message to reach
    /// that worker.
    UnknownAccount(String),
    /// Routed to an account no live worker of its sender has: given back in the same
    /// transaction as `retry_wait` (reason `account_unavailable`), due at `until` (the next
    /// look, never past its expiry), its lane kept, no attempt spent. Never sent through
    /// another account: a tenant's own account fails closed.
    AccountUnavailable {
        until: DateTime<Utc>,
        account: ProviderAccount,
    },
    /// Owned by another sender (handed over with `nudgectl owner set`): left as it is.
    OwnedBy(String),
}

/// A batch's outcomes (in message order), the database time of the lease, and the buckets
/// its slots came from.
#[derive(Debug)]
pub struct LeaseResult {
    pub outcomes: Vec<LeaseOutcome>,
    pub leased_at: DateTime<Utc>,
    pub buckets: Vec<BucketReading>,
}

/// The reason recorded on a delivery given back or expired for its quiet hours.
pub const QUIET_HOURS: &str = "quiet_hours";

/// The reason of a delivery settled `suppressed` because its destination opted out, or its
/// subscriber switched its category off on its channel.
pub const CONTACT_OPTED_OUT: &str = "contact_opted_out";

/// Why [`Ledger::fence`] refused a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceRefused {
    /// The lease is no longer this worker's (reaped, or the delivery moved on).
    LeaseLost,
    /// Its time ran out while it waited: settled `expired`.
    Expired,
    /// Its reminder was cancelled while it waited: settled `cancelled`.
    Cancelled,
    /// Its destination opted out (or its category was switched off) while it waited: settled
    /// `suppressed`, reason [`CONTACT_OPTED_OUT`].
    OptedOut,
    /// The bucket was closed or paused while it waited: give the lease back until then.
    BucketClosedUntil(DateTime<Utc>),
    /// A 429 slowed the bucket after the slot was reserved: reserve again.
    Slowed,
    /// Its quiet hours began while it waited: given back due at `until` (the window's end),
    /// or, when `until` is None, settled `expired` because its expiry comes first; both with
    /// the reason `quiet_hours`.
    QuietHours { until: Option<DateTime<Utc>> },
}

#[derive(sqlx::FromRow)]
struct CandidateRow {
    id: uuid::Uuid,
    reminder_id: uuid::Uuid,
    tenant_id: uuid::Uuid,
    channel: String,
    generation: i64,
    lane: String,
    idempotency_key: String,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    account: String,
    bucketed: bool,
    /// The tenant's cap on its share of the bucket, if any.
    max_share: Option<f64>,
    subscriber_ref: String,
    content_ciphertext: Option<Vec<u8>>,
    /// The content is the series' (an occurrence not rescheduled): sealed bound to the series.
    content_series: Option<uuid::Uuid>,
    destination_ciphertext: Option<Vec<u8>>,
    destination_digest: Option<Vec<u8>>,
    contact_invalid: bool,
    contact_opted_out: bool,
    /// The subscriber's zone (on this channel's contact).
    contact_zone: Option<String>,
    tenant_zone: Option<String>,
    ignore_quiet_hours: bool,
    contact_quiet_from: Option<NaiveTime>,
    contact_quiet_to: Option<NaiveTime>,
    contact_quiet_off: bool,
    tenant_quiet_from: Option<NaiveTime>,
    tenant_quiet_to: Option<NaiveTime>,
    db_now: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct AppliedRow {
    id: uuid::Uuid,
    attempt_count: i32,
    attempt_base: i32,
    lease_expires_at: Option<DateTime<Utc>>,
    lease_idempotent: Option<bool>,
    /// Whether the statement stamped the send start (a `now` plan whose delivery had not
    /// expired by then).
    started: bool,
}

/// What the lease transaction does with one locked candidate.
enum Plan {
    Now,
    Wait {
        send_at: DateTime<Utc>,
        reserved_at: DateTime<Utc>,
    },
    Defer {
        until: DateTime<Utc>,
        reason: DeferReason,
    },
    /// Inside its quiet hours, which outlast its expiry: settled `expired`.
    QuietExpire,
}

impl Plan {
    fn action(&self) -> &'static str {
        match self {
            Plan::Now => "now",
            Plan::Wait { .. } => "wait",
            Plan::Defer { .. } => "defer",
            Plan::QuietExpire => "expire",
        }
    }

    /// The reason it records, when it records one.
    fn reason(&self) -> Option<&'static str> {
        match self {
            Plan::Defer {
                reason: DeferReason::QuietHours,
                ..
            }
            | Plan::QuietExpire => Some(QUIET_HOURS),
            _ => None,
        }
    }

    fn until(&self) -> Option<DateTime<Utc>> {
        match self {
            Plan::Defer { until, .. } => Some(*until),
            _ => None,
        }
    }
}

impl CandidateRow {
    /// The quiet hours this delivery is under: the subscriber's own window (or none, when
    /// they switched them off), else the tenant's for the channel, read in the subscriber's
    /// zone, else the tenant's (a zone this binary's tz database does not know, stored by a
    /// newer one during a rolling deploy, is passed over for the next). None when the reminder
    /// ignores them, when there is no window, or when there is no zone to read it in.
    fn quiet_hours(&self) -> Option<(QuietHours, Zone)> {
        if self.ignore_quiet_hours || self.contact_quiet_off {
            return None;
        }
        let (from, to) = match (self.contact_quiet_from, self.contact_quiet_to) {
            (Some(from), Some(to)) => (from, to),
            _ => (self.tenant_quiet_from?, self.tenant_quiet_to?),
        };
        let hours = QuietHours::new(from, to).ok()?;
        let zone = [&self.contact_zone, &self.tenant_zone]
            .into_iter()
            .flatten()
            .find_map(|name| Zone::parse(name).ok())?;
        Some((hours, zone))
    }

    fn lease(
        &self,
        lease_holder: &str,
        applied: &AppliedRow,
        quiet: Option<QuietRule>,
    ) -> Result<LeasedDelivery, LedgerError> {
        let corrupt = |e: String| LedgerError::corrupt("deliveries", e);
        Ok(LeasedDelivery {
            id: DeliveryId::from_uuid(self.id),
            reminder_id: ReminderId::from_uuid(self.reminder_id),
            tenant_id: TenantId::from_uuid(self.tenant_id),
            channel: parse(&self.channel)?,
            attempt_number: u32::try_from(applied.attempt_count)
                .map_err(|e| corrupt(e.to_string()))?,
            attempt_base: u32::try_from(applied.attempt_base)
                .map_err(|e| corrupt(e.to_string()))?,
            generation: to_u64(self.generation)?,
            lane: parse(&self.lane)?,
            idempotency_key: IdempotencyKey::parse(&self.idempotency_key)
                .map_err(|e| corrupt(e.to_string()))?,
            scheduled_at: self.scheduled_at,
            expires_at: self.expires_at,
            lease_holder: lease_holder.to_owned(),
            lease_expires_at: applied
                .lease_expires_at
                .ok_or_else(|| corrupt("leased without expiry".into()))?,
            provider_account: ProviderAccount::parse(&self.account)
                .map_err(|e| corrupt(e.to_string()))?,
            idempotency: IdempotencySupport::from(applied.lease_idempotent == Some(true)),
            destination_digest: self
                .destination_digest
                .clone()
                .and_then(DestinationDigest::from_stored),
            quiet,
        })
    }

    fn material(&self, cipher: &DestinationCipher) -> Result<Material, LedgerError> {
        let tenant_id = TenantId::from_uuid(self.tenant_id);
        let channel: Channel = parse(&self.channel)?;
        let destination = self
            .destination_ciphertext
            .as_deref()
            .map(|sealed| {
                let plain = cipher.open(
                    sealed,
                    &destination_aad(tenant_id, &self.subscriber_ref, channel),
                )?;
                String::from_utf8(plain)
                    .map(Destination::new)
                    .map_err(|_| LedgerError::Crypto)
            })
            .transpose()?;
        let content = self
            .content_ciphertext
            .as_deref()
            .map(|sealed| {
                let aad = match self.content_series {
                    Some(series) => crate::series::series_content_aad(tenant_id, series),
                    None => content_aad(tenant_id, ReminderId::from_uuid(self.reminder_id)),
                };
                cipher.open(sealed, &aad)
            })
            .transpose()?;
        let contact_flag = if self.contact_opted_out {
            Some(nudge_domain::ContactFlag::OptedOut)
        } else if self.contact_invalid {
            Some(nudge_domain::ContactFlag::Invalid)
        } else {
            None
        };
        Ok(Material {
            destination,
            content,
            contact_flag,
        })
    }
}

#[derive(sqlx::FromRow)]
struct UnleasedRow {
    id: uuid::Uuid,
    state: Option<String>,
    generation: Option<i64>,
    expired: bool,
    cancelled: bool,
    /// Given back by this statement, due again at this time: no live worker has its account.
    unavailable_until: Option<DateTime<Utc>>,
    account: Option<String>,
    owner: Option<String>,
}

#[derive(sqlx::FromRow)]
struct FenceRow {
    state: String,
    lease_owner: Option<String>,
    generation: i64,
    lease_expires_at: Option<DateTime<Utc>>,
    expires_at: DateTime<Utc>,
    cancelled: bool,
    opted_out: bool,
    rate_per_second: Option<f64>,
    effective_rate: Option<f64>,
    paused_until: Option<DateTime<Utc>>,
    last_decrease_at: Option<DateTime<Utc>>,
    db_now: DateTime<Utc>,
}

/// The messages' deliveries that may be leased, locked: `queued` with the message's
/// generation, due, not expired, reminder not cancelled, routed to an account the worker has;
/// with what the send needs. Locking (rather than updating) here keeps every row to one
/// UPDATE per transaction: a second UPDATE of a row the same transaction wrote makes
/// PostgreSQL re-check its foreign keys, taking `KEY SHARE` on the tenant, which deadlocks
/// with a window holding the tenant `FOR UPDATE` while it inserts deliveries.
///
/// Each message's delivery is found by its primary key and locked if it qualifies, one at a
/// time in id order (the lateral subquery with its own `FOR UPDATE` is never flattened; the id
/// order is the lock order, so two workers never wait on each other in a cycle). The state it
/// must be in comes from the input rows, not a constant: given `state = 'queued'` with the
/// channel and the due time, the planner may use the partial index of eligible work
/// (`deliveries_eligible_idx`), and whenever its statistics missed the transient `queued`
/// state (most of the time) it costed a walk of the channel's whole in-flight window, dead
/// versions included, the same as the key, and took it: milliseconds per batch, growing with
/// the backlog. A state that is a column of a materialised input proves no partial index's
/// predicate, so the key is the only index left. `FOR UPDATE` re-checks every condition on the
/// newest version of a row updated meanwhile (a republish marker leaves it leasable).
const CANDIDATES: &str = "WITH input AS MATERIALIZED (
        SELECT i.id, i.generation, 'queued'::text AS state
        FROM unnest($1::uuid[], $2::bigint[]) AS i(id, generation) ORDER BY i.id)
    SELECT d.id, d.reminder_id, d.tenant_id, d.channel, d.generation, d.lane,
           d.idempotency_key, d.scheduled_at, d.expires_at, a.account, a.bucketed,
           r.subscriber_ref,
           CASE WHEN r.content_from_series
                THEN (SELECT s.content_ciphertext FROM series s WHERE s.id = r.series_key)
                ELSE r.content_ciphertext END AS content_ciphertext,
           CASE WHEN r.content_from_series THEN r.series_key END AS content_series,
           c.destination_ciphertext, c.destination_digest,
           COALESCE(c.invalid, false) AS contact_invalid,
           -- Its destination opted out, or its subscriber switched its category off on the
           -- channel (0506).
           COALESCE(c.opted_out, false)
               OR EXISTS (SELECT 1 FROM subscriber_preferences sp
                          WHERE sp.tenant_id = d.tenant_id AND sp.subscriber_ref = r.subscriber_ref
                            AND sp.channel = d.channel AND sp.category = r.category
                            AND sp.state = 'opted_out') AS contact_opted_out,
           (SELECT t.max_share FROM tenants t WHERE t.id = d.tenant_id) AS max_share,
           c.time_zone AS contact_zone,
           (SELECT t.time_zone FROM tenants t WHERE t.id = d.tenant_id) AS tenant_zone,
           r.ignore_quiet_hours
               AND (SELECT t.quiet_hours_ignorable FROM tenants t WHERE t.id = d.tenant_id)
               AS ignore_quiet_hours,
           sq.quiet_from AS contact_quiet_from, sq.quiet_to AS contact_quiet_to,
           COALESCE(sq.quiet_off, false) AS contact_quiet_off,
           q.quiet_from AS tenant_quiet_from, q.quiet_to AS tenant_quiet_to,
           COALESCE($5, now()) AS db_now
    FROM input i
    CROSS JOIN LATERAL (
        SELECT d0.id, d0.reminder_id, d0.tenant_id, d0.channel, d0.generation, d0.lane,
               d0.idempotency_key, d0.scheduled_at, d0.expires_at
        FROM deliveries d0
        WHERE d0.id = i.id AND d0.generation = i.generation AND d0.state = i.state
          AND d0.channel = $3 AND d0.owner = $7
          AND d0.next_attempt_at <= COALESCE($5, now()) AND d0.expires_at > COALESCE($5, now())
        FOR UPDATE) d
    JOIN reminders r ON r.id = d.reminder_id
    LEFT JOIN LATERAL (
        SELECT c0.destination_ciphertext, c0.destination_digest,
               c0.invalid_at IS NOT NULL AS invalid,
               -- The destination opted out (0505), or the contact carries a provider's flag
               -- (set before consent was kept by the destination, or by a binary of the
               -- version before during a rolling deploy; a START clears it).
               c0.opted_out_at IS NOT NULL
               OR EXISTS (SELECT 1 FROM destination_consent k
                          WHERE k.tenant_id = c0.tenant_id AND k.channel = c0.channel
                            AND k.destination_digest = c0.destination_digest
                            AND k.state = 'opted_out') AS opted_out,
               c0.time_zone
        FROM contacts c0
        WHERE c0.tenant_id = d.tenant_id AND c0.subscriber_ref = r.subscriber_ref
          AND c0.channel = d.channel) c ON true
    LEFT JOIN LATERAL (
        SELECT s.quiet_from, s.quiet_to, s.quiet_off
        FROM contacts s
        WHERE s.tenant_id = d.tenant_id AND s.subscriber_ref = r.subscriber_ref
          AND s.quiet_set_at IS NOT NULL
        ORDER BY s.quiet_set_at DESC, s.channel
        LIMIT 1) sq ON true
    CROSS JOIN LATERAL (
        SELECT x.account, EXISTS (
                   SELECT 1 FROM rate_buckets b
                   WHERE b.provider_account = x.account AND b.channel = $3)
               OR EXISTS (
                   SELECT 1 FROM account_suspensions s
                   WHERE s.provider_account = x.account AND s.channel = $3
                     AND s.suspended_until > COALESCE($5, now())) AS bucketed
        FROM (SELECT COALESCE(
                  (SELECT tc.provider_account FROM tenant_channels tc
                   WHERE tc.tenant_id = r.tenant_id AND tc.channel = $3),
                  $4) AS account) x) a
    LEFT JOIN tenant_quiet_hours q ON q.tenant_id = d.tenant_id AND q.channel = d.channel
    WHERE r.cancelled_at IS NULL AND a.account = ANY($6::text[])
    ORDER BY d.id";

/// One UPDATE for every locked candidate: `now` leases and fences (the slot has come, or the
/// account has no bucket), `wait` leases for a slot ahead, `defer` gives it back due when its
/// bucket opens or its quiet hours end (no lease, no attempt, its lane kept), `expire` settles
/// it `expired` (its quiet hours outlast it); `reason` is recorded where given. A `now` is
/// fenced only before its next quiet window starts (`quiet_from`), else leased unstamped for
/// the fence to give back. The candidates were found with the
/// transaction's clock, before the waits for the buckets' locks: a `now` delivery whose expiry
/// has come by this statement's clock, or whose destination opted out meanwhile (a STOP that
/// committed during those waits), is leased unstamped (`started` false), and the fence that
/// must then come before its send settles it expired or suppressed. The fence stamps the digest of the
/// destination the send will use. A delivery that waited for its account
/// (`account_unavailable`) no longer does: the reason is cleared.
const APPLY_LEASES: &str = "WITH plan AS (
        SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::timestamptz[], $9::bytea[],
                             $10::text[], $11::timestamptz[])
            AS p(id, action, account, until, digest, reason, quiet_from))
    UPDATE deliveries d
    SET state = CASE p.action WHEN 'defer' THEN 'retry_wait' WHEN 'expire' THEN 'expired'
                              ELSE 'sending' END,
        next_attempt_at = CASE p.action WHEN 'defer' THEN p.until WHEN 'expire' THEN NULL
                                        ELSE d.next_attempt_at END,
        lease_owner = CASE WHEN p.action IN ('defer', 'expire') THEN NULL ELSE $5 END,
        lease_expires_at = CASE WHEN p.action IN ('defer', 'expire') THEN NULL
                                ELSE COALESCE($7, clock_timestamp())
                                     + $6 * interval '1 millisecond' END,
        attempt_count = CASE WHEN p.action IN ('defer', 'expire') THEN d.attempt_count
                             ELSE d.attempt_count + 1 END,
        first_attempt_at = CASE WHEN p.action IN ('defer', 'expire') THEN d.first_attempt_at
                                ELSE COALESCE(d.first_attempt_at, COALESCE($7, clock_timestamp())) END,
        last_attempt_at = CASE WHEN p.action IN ('defer', 'expire') THEN d.last_attempt_at
                               ELSE COALESCE($7, clock_timestamp()) END,
        provider_account = CASE WHEN p.action IN ('defer', 'expire') THEN d.provider_account
                                ELSE p.account END,
        lease_idempotent = CASE WHEN p.action IN ('defer', 'expire') THEN NULL
                                ELSE p.account = ANY($8::text[]) END,
        last_error_reason = COALESCE(p.reason,
            CASE WHEN d.last_error_reason IN ('account_unavailable', 'quiet_hours') THEN NULL
                 ELSE d.last_error_reason END),
        settled_at = CASE WHEN p.action = 'expire' THEN COALESCE($7, clock_timestamp())
                          ELSE d.settled_at END,
        send_started_at = CASE WHEN p.action = 'now'
                                    AND d.expires_at > COALESCE($7, clock_timestamp())
                                    AND COALESCE($7, clock_timestamp())
                                        < COALESCE(p.quiet_from, 'infinity'::timestamptz)
                                    AND NOT EXISTS (
                                        SELECT 1 FROM destination_consent k
                                        WHERE k.tenant_id = d.tenant_id AND k.channel = d.channel
                                          AND k.destination_digest = p.digest
                                          AND k.state = 'opted_out')
                                    AND NOT EXISTS (
                                        SELECT 1 FROM reminders r, subscriber_preferences sp
                                        WHERE r.id = d.reminder_id
                                          AND sp.tenant_id = d.tenant_id
                                          AND sp.subscriber_ref = r.subscriber_ref
                                          AND sp.channel = d.channel
                                          AND sp.category = r.category
                                          AND sp.state = 'opted_out')
                               THEN COALESCE($7, clock_timestamp()) END,
        destination_digest = CASE WHEN p.action = 'now'
                                       AND d.expires_at > COALESCE($7, clock_timestamp())
                                       AND COALESCE($7, clock_timestamp())
                                           < COALESCE(p.quiet_from, 'infinity'::timestamptz)
                                       AND NOT EXISTS (
                                           SELECT 1 FROM destination_consent k
                                           WHERE k.tenant_id = d.tenant_id
                                             AND k.channel = d.channel
                                             AND k.destination_digest = p.digest
                                             AND k.state = 'opted_out')
                                       AND NOT EXISTS (
                                           SELECT 1 FROM reminders r, subscriber_preferences sp
                                           WHERE r.id = d.reminder_id
                                             AND sp.tenant_id = d.tenant_id
                                             AND sp.subscriber_ref = r.subscriber_ref
                                             AND sp.channel = d.channel
                                             AND sp.category = r.category
                                             AND sp.state = 'opted_out')
                                  THEN p.digest ELSE d.destination_digest END,
        updated_at = COALESCE($7, clock_timestamp())
    FROM plan p
    WHERE d.id = p.id
    RETURNING d.id, d.attempt_count, d.attempt_base, d.lease_expires_at, d.lease_idempotent,
              d.send_started_at IS NOT NULL AS started";

/// Explains, and settles where it can, the messages the lease did not lock: expired or
/// cancelled deliveries are settled so; a delivery whose tenant is routed to an account that
/// neither this worker nor any live worker of its sender has (`worker_accounts`) is given back
/// as `retry_wait` until the next look (`LeaseBatch::account_recheck`, never past its expiry),
/// reason `account_unavailable`, its lane and attempts untouched; one whose account another
/// live worker has is left `queued` for it. Runs only when a message was not leased, so the
/// common batch never pays for it.
const EXPLAIN_UNLEASED: &str = "WITH input AS (
        SELECT * FROM unnest($1::uuid[], $2::bigint[]) AS i(id, generation)),
    expired AS (
        UPDATE deliveries d
        SET state = 'expired', settled_at = COALESCE($4, now()), updated_at = COALESCE($4, now()),
            next_attempt_at = NULL, last_error_reason = 'expired_before_send'
        FROM input i
        WHERE d.id = i.id AND d.generation = i.generation
          AND d.state IN ('scheduled', 'queued', 'retry_wait')
          AND d.expires_at <= COALESCE($4, now())
        RETURNING d.id),
    cancelled AS (
        UPDATE deliveries d
        SET state = 'cancelled', settled_at = COALESCE($4, now()),
            updated_at = COALESCE($4, now()), next_attempt_at = NULL,
            last_error_reason = 'cancelled_by_client'
        FROM input i, reminders r
        WHERE d.id = i.id AND d.generation = i.generation
          AND d.state IN ('scheduled', 'queued', 'retry_wait')
          AND d.expires_at > COALESCE($4, now())
          AND r.id = d.reminder_id AND r.cancelled_at IS NOT NULL
        RETURNING d.id),
    unavailable AS (
        UPDATE deliveries d
        SET state = 'retry_wait',
            next_attempt_at = LEAST(COALESCE($4, now()) + $6 * interval '1 millisecond',
                                    d.expires_at),
            last_error_reason = 'account_unavailable', updated_at = COALESCE($4, now())
        FROM input i, reminders r, tenant_channels tc
        WHERE d.id = i.id AND d.generation = i.generation AND d.state = 'queued'
          AND d.owner = $7 AND d.expires_at > COALESCE($4, now())
          AND r.id = d.reminder_id AND r.cancelled_at IS NULL
          AND tc.tenant_id = d.tenant_id AND tc.channel = d.channel
          AND tc.provider_account IS NOT NULL AND tc.provider_account <> ALL($5::text[])
          AND NOT EXISTS (
              SELECT 1 FROM worker_accounts w
              WHERE w.owner = d.owner AND w.channel = d.channel
                AND w.provider_account = tc.provider_account
                AND w.held_until > COALESCE($4, now()))
        RETURNING d.id, d.next_attempt_at)
    SELECT i.id, d.state, d.generation,
           EXISTS (SELECT 1 FROM expired e WHERE e.id = i.id) AS expired,
           EXISTS (SELECT 1 FROM cancelled c WHERE c.id = i.id) AS cancelled,
           (SELECT u.next_attempt_at FROM unavailable u WHERE u.id = i.id) AS unavailable_until,
           COALESCE((SELECT tc.provider_account FROM tenant_channels tc
                     WHERE tc.tenant_id = d.tenant_id AND tc.channel = d.channel), $3) AS account,
           d.owner
    FROM input i LEFT JOIN deliveries d ON d.id = i.id";

/// Stamps the send start of leases whose slot has come (the fence, inside the admission
/// transaction) and gives back those without a slot in time. The lease owner and expiry stand
/// for `state = 'sending'` (a CHECK holds them together), so each row is found by its key,
/// never by a scan of the lease index (see `record::APPLY`).
const STAMP_AND_RELEASE: &str = "WITH started AS (
        UPDATE deliveries d
        SET send_started_at = COALESCE($7, clock_timestamp()),
            lease_expires_at = COALESCE($7, clock_timestamp()) + $4 * interval '1 millisecond',
            destination_digest = s.digest,
            updated_at = COALESCE($7, clock_timestamp())
        FROM unnest($1::uuid[], $2::bigint[], $9::bytea[], $10::timestamptz[])
                 AS s(id, generation, digest, quiet_from),
             reminders r
        WHERE d.id = s.id AND d.generation = s.generation AND d.lease_owner = $3
          AND d.lease_expires_at IS NOT NULL AND d.send_started_at IS NULL
          AND d.lease_expires_at > COALESCE($7, clock_timestamp())
          AND d.expires_at > COALESCE($7, clock_timestamp())
          AND COALESCE($7, clock_timestamp()) < COALESCE(s.quiet_from, 'infinity'::timestamptz)
          AND r.id = d.reminder_id AND r.cancelled_at IS NULL
          AND NOT EXISTS (SELECT 1 FROM destination_consent k
                          WHERE k.tenant_id = d.tenant_id AND k.channel = d.channel
                            AND k.destination_digest = s.digest AND k.state = 'opted_out')
          AND NOT EXISTS (SELECT 1 FROM subscriber_preferences sp
                          WHERE sp.tenant_id = d.tenant_id AND sp.subscriber_ref = r.subscriber_ref
                            AND sp.channel = d.channel AND sp.category = r.category
                            AND sp.state = 'opted_out')
        RETURNING d.id, d.lease_expires_at),
    released AS (
        UPDATE deliveries d
        SET state = 'retry_wait', next_attempt_at = u.until, lease_owner = NULL,
            lease_expires_at = NULL, lease_idempotent = NULL, send_started_at = NULL,
            attempt_count = d.attempt_count - 1, updated_at = COALESCE($7, clock_timestamp())
        FROM unnest($5::uuid[], $6::bigint[], $8::timestamptz[]) AS u(id, generation, until)
        WHERE d.id = u.id AND d.generation = u.generation AND d.lease_owner = $3
          AND d.lease_expires_at IS NOT NULL AND d.send_started_at IS NULL
        RETURNING d.id)
    SELECT id, lease_expires_at FROM started";

/// The bucket check (`rate_per_second <= 0 OR effective_rate <= 0 OR paused_until > now`) is
/// `nudge_domain::drain::BucketRates::idle_at` in SQL, kept here because the fence is the one
/// statement before a send: asking Rust would add a round trip per send. The bucket test
/// `the_fence_refuses_exactly_the_buckets_the_drain_model_leaves_out` holds them together.
const FENCE: &str = "UPDATE deliveries d
    SET send_started_at = COALESCE($6, clock_timestamp()),
        destination_digest = $7,
        lease_expires_at = COALESCE($6, clock_timestamp()) + $5 * interval '1 millisecond',
        updated_at = COALESCE($6, clock_timestamp())
    FROM reminders r
    WHERE d.id = $1 AND d.lease_owner = $2 AND d.generation = $3 AND d.state = 'sending'
      AND d.send_started_at IS NULL
      AND d.lease_expires_at > COALESCE($6, clock_timestamp())
      AND d.expires_at > COALESCE($6, clock_timestamp())
      AND COALESCE($6, clock_timestamp()) < COALESCE($8::timestamptz, 'infinity'::timestamptz)
      AND r.id = d.reminder_id AND r.cancelled_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM destination_consent k
                      WHERE k.tenant_id = d.tenant_id AND k.channel = d.channel
                        AND k.destination_digest = $7 AND k.state = 'opted_out')
      AND NOT EXISTS (SELECT 1 FROM subscriber_preferences sp
                  WHERE sp.tenant_id = d.tenant_id AND sp.subscriber_ref = r.subscriber_ref
                    AND sp.channel = d.channel AND sp.category = r.category
                    AND sp.state = 'opted_out')
      AND NOT EXISTS (
          SELECT 1 FROM rate_buckets b
          WHERE b.provider_account = d.provider_account AND b.channel = d.channel
            AND (b.rate_per_second <= 0 OR b.effective_rate <= 0
                 OR b.paused_until > COALESCE($6, clock_timestamp())
                 OR b.last_decrease_at >= $4))
    RETURNING d.lease_expires_at";

impl Ledger {
    /// Leases a batch of messages (what each points at) and takes their send slots, in one
    /// transaction; see the module's protocol. Outcomes come back in message order.
    pub async fn lease_batch(
        &self,
        batch: &LeaseBatch<'_>,
        messages: &[MessagePointer],
    ) -> Result<LeaseResult, LedgerError> {
        // A delivery twice in one batch (a republished copy arriving with its original) is
        // tried once, with the newest generation among its copies: an older copy is stale
        // whatever order the broker delivered them in.
        let mut newest: HashMap<uuid::Uuid, u64> = HashMap::with_capacity(messages.len());
        let mut order = Vec::with_capacity(messages.len());
        for message in messages {
            let id = message.delivery_id.as_uuid();
            match newest.entry(id) {
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(message.generation);
                    order.push(id);
                }
                std::collections::hash_map::Entry::Occupied(mut e) => {
                    if message.generation > *e.get() {
                        e.insert(message.generation);
                    }
                }
            }
        }
        let (ids, generations): (Vec<uuid::Uuid>, Vec<i64>) =
            order.iter().map(|id| (*id, to_i64(newest[id]))).unzip();
        let configured: Vec<&str> = batch
            .routes
            .accounts
            .iter()
            .map(|(a, _)| a.as_str())
            .collect();
        let honoured: Vec<&str> = batch
            .routes
            .accounts
            .iter()
            .filter(|(_, i)| *i == IdempotencySupport::Honoured)
            .map(|(a, _)| a.as_str())
            .collect();

        let mut tx = self.pool.begin().await?;
        let rows: Vec<CandidateRow> = sqlx::query_as(CANDIDATES)
            .bind(&ids)
            .bind(&generations)
            .bind(batch.channel.as_str())
            .bind(batch.routes.default.as_str())
            .bind(batch.at.bind())
            .bind(&configured)
            .bind(&*self.sender)
            .fetch_all(&mut *tx)
            .await?;
        let mut leased_at = rows.first().map(|r| r.db_now);

        let mut by_id: HashMap<uuid::Uuid, LeaseOutcome> = HashMap::with_capacity(messages.len());
        if rows.len() < messages.len() {
            let found: std::collections::HashSet<uuid::Uuid> = rows.iter().map(|r| r.id).collect();
            let (rest_ids, rest_generations): (Vec<uuid::Uuid>, Vec<i64>) = ids
                .iter()
                .zip(&generations)
                .filter(|(id, _)| !found.contains(id))
                .map(|(id, g)| (*id, *g))
                .unzip();
            let unleased: Vec<UnleasedRow> = sqlx::query_as(EXPLAIN_UNLEASED)
                .bind(&rest_ids)
                .bind(&rest_generations)
                .bind(batch.routes.default.as_str())
                .bind(batch.at.bind())
                .bind(&configured)
                .bind(millis(batch.account_recheck))
                .bind(&*self.sender)
                .fetch_all(&mut *tx)
                .await?;
            for (row, generation) in unleased.into_iter().zip(rest_generations) {
                let outcome = explain(&row, generation, batch, &self.sender)?;
                by_id.insert(row.id, outcome);
            }
        }

        // Quiet hours first, by the statement's clock: a candidate inside them takes no slot.
        let mut plans: Vec<Plan> = rows.iter().map(|_| Plan::Now).collect();
        let mut quiet: Vec<Option<QuietRule>> = vec![None; rows.len()];
        for (i, row) in rows.iter().enumerate() {
            let Some((hours, zone)) = row.quiet_hours() else {
                continue;
            };
            match quiet_verdict(hours, zone, row.db_now, row.expires_at) {
                QuietVerdict::Send { next_start, .. } => {
                    quiet[i] = Some(QuietRule {
                        hours,
                        zone,
                        next_start,
                    });
                }
                QuietVerdict::Defer { until } => {
                    plans[i] = Plan::Defer {
                        until,
                        reason: DeferReason::QuietHours,
                    };
                }
                QuietVerdict::Expire => plans[i] = Plan::QuietExpire,
            }
        }

        // Slots for the candidates whose account has a bucket, under the buckets' locks.
        let mut buckets = Vec::new();
        let bucketed: Vec<usize> = (0..rows.len())
            .filter(|&i| rows[i].bucketed && matches!(plans[i], Plan::Now))
            .collect();
        if !bucketed.is_empty() {
            let accounts = bucketed
                .iter()
                .map(|&i| {
                    ProviderAccount::parse(&rows[i].account)
                        .map_err(|e| LedgerError::corrupt("deliveries", e))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let lanes = bucketed
                .iter()
                .map(|&i| parse(&rows[i].lane))
                .collect::<Result<Vec<nudge_domain::Lane>, _>>()?;
            let requests: Vec<SlotRequest<'_>> = accounts
                .iter()
                .zip(&lanes)
                .zip(&bucketed)
                .map(|((account, lane), &i)| {
                    Ok(SlotRequest {
                        account,
                        lane: *lane,
                        tenant: TenantId::from_uuid(rows[i].tenant_id),
                        max_share: max_share(rows[i].max_share)?,
                    })
                })
                .collect::<Result<_, LedgerError>>()?;
            let answers =
                admit_slots(&mut tx, batch.channel, &requests, batch.admission, batch.at).await?;
            leased_at = Some(answers.decided_at);
            buckets = answers.readings;
            for (&i, admission) in bucketed.iter().zip(answers.admissions) {
                plans[i] = match admission {
                    Admission::Admitted { send_at } if send_at <= answers.decided_at => Plan::Now,
                    Admission::Admitted { send_at } => Plan::Wait {
                        send_at,
                        reserved_at: answers.decided_at,
                    },
                    Admission::Deferred { until, reason } => Plan::Defer { until, reason },
                };
            }
        }

        if !rows.is_empty() {
            let plan_ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.id).collect();
            let actions: Vec<&str> = plans.iter().map(Plan::action).collect();
            let accounts: Vec<&str> = rows.iter().map(|r| r.account.as_str()).collect();
            let untils: Vec<Option<DateTime<Utc>>> = plans.iter().map(Plan::until).collect();
            let digests: Vec<Option<&[u8]>> = rows
                .iter()
                .map(|r| {
                    r.destination_digest
                        .as_deref()
                        .filter(|d| d.len() == DestinationDigest::LEN)
                })
                .collect();
            let reasons: Vec<Option<&str>> = plans.iter().map(Plan::reason).collect();
            let quiet_from: Vec<Option<DateTime<Utc>>> =
                quiet.iter().map(|q| q.map(|q| q.next_start)).collect();
            let applied: Vec<AppliedRow> = sqlx::query_as(APPLY_LEASES)
                .bind(&plan_ids)
                .bind(&actions)
                .bind(&accounts)
                .bind(&untils)
                .bind(batch.lease_holder)
                .bind(millis(batch.lease_for))
                .bind(batch.at.bind())
                .bind(&honoured)
                .bind(&digests)
                .bind(&reasons)
                .bind(&quiet_from)
                .fetch_all(&mut *tx)
                .await?;
            let applied: HashMap<uuid::Uuid, AppliedRow> =
                applied.into_iter().map(|a| (a.id, a)).collect();
            for ((row, plan), quiet) in rows.iter().zip(plans).zip(quiet) {
                let applied = applied
                    .get(&row.id)
                    .ok_or_else(|| LedgerError::corrupt("deliveries", "a locked lease vanished"))?;
                let outcome = match plan {
                    Plan::Defer { until, reason } => LeaseOutcome::Released {
                        until,
                        reason,
                        account: ProviderAccount::parse(&row.account)
                            .map_err(|e| LedgerError::corrupt("deliveries", e))?,
                    },
                    Plan::QuietExpire => LeaseOutcome::QuietHoursExpired,
                    Plan::Now if applied.started => LeaseOutcome::Leased {
                        lease: row.lease(batch.lease_holder, applied, quiet)?,
                        material: row.material(batch.cipher),
                        slot: SendSlot::Now,
                    },
                    // Expired, its quiet hours began or its destination opted out while the
                    // lease waited for its buckets' locks: leased unstamped, so the fence
                    // settles it and nothing is sent.
                    Plan::Now => {
                        let decided_at = leased_at.unwrap_or(row.db_now);
                        LeaseOutcome::Leased {
                            lease: row.lease(batch.lease_holder, applied, quiet)?,
                            material: row.material(batch.cipher),
                            slot: SendSlot::At {
                                send_at: decided_at,
                                reserved_at: decided_at,
                            },
                        }
                    }
                    Plan::Wait {
                        send_at,
                        reserved_at,
                    } => LeaseOutcome::Leased {
                        lease: row.lease(batch.lease_holder, applied, quiet)?,
                        material: row.material(batch.cipher),
                        slot: SendSlot::At {
                            send_at,
                            reserved_at,
                        },
                    },
                };
                by_id.insert(row.id, outcome);
            }
        }
        tx.commit().await?;

        let leased_at = match leased_at {
            Some(at) => at,
            None => self.clock(batch.at).await?,
        };
        // Each outcome goes to the copy it was decided for (the newest generation); every
        // other copy is stale.
        let outcomes = messages
            .iter()
            .map(|message| {
                let id = message.delivery_id.as_uuid();
                let tried = newest.get(&id) == Some(&message.generation);
                tried
                    .then(|| by_id.remove(&id))
                    .flatten()
                    .unwrap_or(LeaseOutcome::Stale {
                        state: DeliveryState::Sending,
                        generation: message.generation,
                    })
            })
            .collect();
        Ok(LeaseResult {
            outcomes,
            leased_at,
            buckets,
        })
    }

    /// Takes a new slot for a held, unstamped lease (its bucket slowed while it waited), in
    /// one transaction: the slot is fenced at once when it has come, returned when it is within
    /// the admission wait, and the lease is given back when there is none in time.
    pub async fn readmit(
        &self,
        batch: &LeaseBatch<'_>,
        lease: LeasedDelivery,
    ) -> Result<Slotted, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let share: Option<f64> = sqlx::query_scalar("SELECT max_share FROM tenants WHERE id = $1")
            .bind(lease.tenant_id.as_uuid())
            .fetch_optional(&mut *tx)
            .await?
            .flatten();
        let requests = [SlotRequest {
            account: &lease.provider_account,
            lane: lease.lane,
            tenant: lease.tenant_id,
            max_share: max_share(share)?,
        }];
        let answers =
            admit_slots(&mut tx, batch.channel, &requests, batch.admission, batch.at).await?;
        let mut slotted = stamp_or_release(
            &mut tx,
            batch,
            vec![(lease, answers.admissions[0])],
            answers.decided_at,
        )
        .await?;
        tx.commit().await?;
        let (_, slotted) = slotted
            .pop()
            .ok_or_else(|| LedgerError::corrupt("deliveries", "readmit lost its lease"))?;
        Ok(slotted)
    }

    /// The fence for a send that waited for its slot: one conditional UPDATE, with the
    /// database's clock, that the lease is still this worker's and not expired, the delivery
    /// has not expired, its reminder is not cancelled and its bucket is neither closed, paused
    /// nor slowed since `reserved_at`; it stamps `send_started_at` and renews the lease.
    /// Returns the renewed lease expiry, or why not: an expired or cancelled delivery is
    /// settled so here, and nothing may be sent.
    pub async fn fence(
        &self,
        lease: &LeasedDelivery,
        reserved_at: DateTime<Utc>,
        lease_for: Duration,
        closed_recheck: Duration,
        at: LedgerTime,
    ) -> Result<Result<DateTime<Utc>, FenceRefused>, LedgerError> {
        let fenced: Option<DateTime<Utc>> = sqlx::query_scalar(FENCE)
            .bind(lease.id.as_uuid())
            .bind(&lease.lease_holder)
            .bind(to_i64(lease.generation))
            .bind(reserved_at)
            .bind(millis(lease_for))
            .bind(at.bind())
            .bind(
                lease
                    .destination_digest
                    .as_ref()
                    .map(DestinationDigest::as_bytes),
            )
            .bind(lease.quiet.map(|q| q.next_start))
            .fetch_optional(&self.pool)
            .await?;
        if let Some(until) = fenced {
            return Ok(Ok(until));
        }
        let row: Option<FenceRow> = sqlx::query_as(
            "SELECT d.state, d.lease_owner, d.generation, d.lease_expires_at, d.expires_at,
                    r.cancelled_at IS NOT NULL AS cancelled, b.rate_per_second, b.effective_rate,
                    b.paused_until, b.last_decrease_at,
                    EXISTS (SELECT 1 FROM destination_consent k
                            WHERE k.tenant_id = d.tenant_id AND k.channel = d.channel
                              AND k.destination_digest = $3 AND k.state = 'opted_out')
                    OR EXISTS (SELECT 1 FROM subscriber_preferences sp
                               WHERE sp.tenant_id = d.tenant_id
                                 AND sp.subscriber_ref = r.subscriber_ref
                                 AND sp.channel = d.channel AND sp.category = r.category
                                 AND sp.state = 'opted_out')
                        AS opted_out,
                    COALESCE($2, clock_timestamp()) AS db_now
             FROM deliveries d JOIN reminders r ON r.id = d.reminder_id
             LEFT JOIN rate_buckets b
                    ON b.provider_account = d.provider_account AND b.channel = d.channel
             WHERE d.id = $1",
        )
        .bind(lease.id.as_uuid())
        .bind(at.bind())
        .bind(
            lease
                .destination_digest
                .as_ref()
                .map(DestinationDigest::as_bytes),
        )
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(Err(FenceRefused::LeaseLost));
        };
        let now = row.db_now;
        let ours = row.state == "sending"
            && row.lease_owner.as_deref() == Some(lease.lease_holder.as_str())
            && row.generation == to_i64(lease.generation)
            && row.lease_expires_at.is_some_and(|l| l > now);
        if !ours {
            return Ok(Err(FenceRefused::LeaseLost));
        }
        let settle = if row.expires_at <= now {
            Some((
                DeliveryState::Expired,
                "expired_before_send",
                FenceRefused::Expired,
            ))
        } else if row.cancelled {
            Some((
                DeliveryState::Cancelled,
                "cancelled_by_client",
                FenceRefused::Cancelled,
            ))
        } else if row.opted_out {
            Some((
                DeliveryState::Suppressed,
                CONTACT_OPTED_OUT,
                FenceRefused::OptedOut,
            ))
        } else if let Some(rule) = lease.quiet.filter(|q| now >= q.next_start) {
            match quiet_verdict(rule.hours, rule.zone, now, row.expires_at) {
                QuietVerdict::Expire => Some((
                    DeliveryState::Expired,
                    QUIET_HOURS,
                    FenceRefused::QuietHours { until: None },
                )),
                // Inside the window, or past it (the fence came after a whole window: a
                // ledger away that long): due again at its end, or now, and looked at anew.
                verdict => {
                    let until = match verdict {
                        QuietVerdict::Defer { until } => until,
                        _ => now,
                    };
                    return self.give_back_for_quiet_hours(lease, until, at).await;
                }
            }
        } else {
            None
        };
        if let Some((state, reason, refused)) = settle {
            DeliveryState::Sending.transition(state)?;
            let done = sqlx::query(
                "UPDATE deliveries
                 SET state = $4, lease_owner = NULL, lease_expires_at = NULL,
                     lease_idempotent = NULL, send_started_at = NULL, next_attempt_at = NULL,
                     attempt_count = attempt_count - 1, last_error_reason = $5,
                     settled_at = COALESCE($6, now()), updated_at = COALESCE($6, now())
                 WHERE id = $1 AND lease_owner = $2 AND generation = $3 AND state = 'sending'
                   AND send_started_at IS NULL",
            )
            .bind(lease.id.as_uuid())
            .bind(&lease.lease_holder)
            .bind(to_i64(lease.generation))
            .bind(state.as_str())
            .bind(reason)
            .bind(at.bind())
            .execute(&self.pool)
            .await?;
            return Ok(Err(if done.rows_affected() == 1 {
                refused
            } else {
                FenceRefused::LeaseLost
            }));
        }
        let closed = row.rate_per_second.is_some_and(|r| r <= 0.0)
            || row.effective_rate.is_some_and(|r| r <= 0.0);
        Ok(Err(if closed {
            FenceRefused::BucketClosedUntil(
                now + chrono::Duration::from_std(closed_recheck)
                    .unwrap_or(chrono::Duration::seconds(10)),
            )
        } else if let Some(paused) = row.paused_until.filter(|p| *p > now) {
            FenceRefused::BucketClosedUntil(paused)
        } else if row.last_decrease_at.is_some_and(|d| d >= reserved_at) {
            FenceRefused::Slowed
        } else {
            // Everything checked out a moment later: a race with a change that has passed.
            FenceRefused::Slowed
        }))
    }

    /// Gives back a lease whose quiet hours began before its send: due at `until`, reason
    /// `quiet_hours`, its lane kept, the attempt it did not make not counted.
    async fn give_back_for_quiet_hours(
        &self,
        lease: &LeasedDelivery,
        until: DateTime<Utc>,
        at: LedgerTime,
    ) -> Result<Result<DateTime<Utc>, FenceRefused>, LedgerError> {
        let given_back = self
            .give_back_unsent(lease, Some(until), Some(QUIET_HOURS), at)
            .await?;
        Ok(Err(if given_back {
            FenceRefused::QuietHours { until: Some(until) }
        } else {
            FenceRefused::LeaseLost
        }))
    }

    /// The one statement that gives a lease back before its send started: `retry_wait`, due
    /// at `until` (None: now), with `reason` when given (else the one it had), the attempt it
    /// did not make not counted. False when the lease was no longer this worker's unsent one.
    async fn give_back_unsent(
        &self,
        lease: &LeasedDelivery,
        until: Option<DateTime<Utc>>,
        reason: Option<&str>,
        at: LedgerTime,
    ) -> Result<bool, LedgerError> {
        let updated = sqlx::query(
            "UPDATE deliveries
             SET state = 'retry_wait', next_attempt_at = COALESCE($4, $5, now()),
                 last_error_reason = COALESCE($6, last_error_reason),
                 lease_owner = NULL, lease_expires_at = NULL, lease_idempotent = NULL,
                 send_started_at = NULL, attempt_count = attempt_count - 1,
                 updated_at = COALESCE($5, now())
             WHERE id = $1 AND state = 'sending' AND lease_owner = $2 AND generation = $3
               AND send_started_at IS NULL",
        )
        .bind(lease.id.as_uuid())
        .bind(&lease.lease_holder)
        .bind(to_i64(lease.generation))
        .bind(until)
        .bind(at.bind())
        .bind(reason)
        .execute(&self.pool)
        .await?;
        Ok(updated.rows_affected() == 1)
    }

    /// Gives a lease back before its send started (shutdown, the bucket closed while it
    /// waited): due at `until` (None: at once), its lane kept, the attempt it did not make not
    /// counted. A lease whose send started is never given back: its outcome decides.
    pub async fn release(
        &self,
        lease: &LeasedDelivery,
        until: Option<DateTime<Utc>>,
        at: LedgerTime,
    ) -> Result<(), LedgerError> {
        if !self.give_back_unsent(lease, until, None, at).await? {
            return Err(self.lease_lost(lease.id).await);
        }
        Ok(())
    }

    /// The database's clock (or the fixed time a test set).
    pub async fn clock(&self, at: LedgerTime) -> Result<DateTime<Utc>, LedgerError> {
        Ok(sqlx::query_scalar("SELECT COALESCE($1, clock_timestamp())")
            .bind(at.bind())
            .fetch_one(&self.pool)
            .await?)
    }

    pub(crate) async fn lease_lost(&self, id: DeliveryId) -> LedgerError {
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
}

/// Why a message of `generation` was not leased, from what [`EXPLAIN_UNLEASED`] found.
fn explain(
    row: &UnleasedRow,
    generation: i64,
    batch: &LeaseBatch<'_>,
    sender: &str,
) -> Result<LeaseOutcome, LedgerError> {
    if row.expired {
        return Ok(LeaseOutcome::Expired);
    }
    if row.cancelled {
        return Ok(LeaseOutcome::Cancelled);
    }
    if let (Some(until), Some(account)) = (row.unavailable_until, row.account.as_deref()) {
        return Ok(LeaseOutcome::AccountUnavailable {
            until,
            account: ProviderAccount::parse(account)
                .map_err(|e| LedgerError::corrupt("tenant_channels", e))?,
        });
    }
    let (Some(state), Some(current)) = (row.state.as_deref(), row.generation) else {
        return Ok(LeaseOutcome::NotFound);
    };
    let state: DeliveryState = parse(state)?;
    if let Some(owner) = row.owner.as_deref().filter(|o| *o != sender) {
        return Ok(LeaseOutcome::OwnedBy(owner.to_owned()));
    }
    if state == DeliveryState::Queued
        && current == generation
        && let Some(account) = row
            .account
            .as_deref()
            .filter(|a| !batch.routes.accounts.iter().any(|(c, _)| c.as_str() == *a))
    {
        return Ok(LeaseOutcome::UnknownAccount(account.to_owned()));
    }
    Ok(LeaseOutcome::Stale {
        state,
        generation: to_u64(current)?,
    })
}

/// What a new slot for a held lease came to.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Slotted {
    /// A slot, with the lease as it now stands (renewed when fenced).
    Slot(SendSlot, LeasedDelivery),
    /// No slot in time: the lease was given back, due at `until`.
    Released {
        until: DateTime<Utc>,
        reason: DeferReason,
    },
    /// The fence refused it (expired or cancelled in the instant between): give it back.
    Unfenced,
}

/// Fences the leases whose slot has come and gives back those without a slot in time, in one
/// statement. Returns each lease with what became of it.
async fn stamp_or_release(
    conn: &mut sqlx::PgConnection,
    batch: &LeaseBatch<'_>,
    leases: Vec<(LeasedDelivery, Admission)>,
    decided_at: DateTime<Utc>,
) -> Result<Vec<(LeasedDelivery, Slotted)>, LedgerError> {
    let mut stamp = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut release = (Vec::new(), Vec::new(), Vec::new());
    for (lease, admission) in &leases {
        match admission {
            Admission::Admitted { send_at } if *send_at <= decided_at => {
                stamp.0.push(lease.id.as_uuid());
                stamp.1.push(to_i64(lease.generation));
                stamp.2.push(
                    lease
                        .destination_digest
                        .as_ref()
                        .map(DestinationDigest::as_bytes),
                );
                stamp.3.push(lease.quiet.map(|q| q.next_start));
            }
            Admission::Admitted { .. } => {}
            Admission::Deferred { until, .. } => {
                release.0.push(lease.id.as_uuid());
                release.1.push(to_i64(lease.generation));
                release.2.push(*until);
            }
        }
    }
    let stamped: Vec<(uuid::Uuid, DateTime<Utc>)> = if stamp.0.is_empty() && release.0.is_empty() {
        Vec::new()
    } else {
        sqlx::query_as(STAMP_AND_RELEASE)
            .bind(&stamp.0)
            .bind(&stamp.1)
            .bind(batch.lease_holder)
            .bind(millis(batch.lease_for))
            .bind(&release.0)
            .bind(&release.1)
            .bind(batch.at.bind())
            .bind(&release.2)
            .bind(&stamp.2)
            .bind(&stamp.3)
            .fetch_all(&mut *conn)
            .await?
    };
    let stamped: HashMap<uuid::Uuid, DateTime<Utc>> = stamped.into_iter().collect();
    Ok(leases
        .into_iter()
        .map(|(lease, admission)| {
            let slotted = match admission {
                Admission::Admitted { send_at } if send_at <= decided_at => {
                    match stamped.get(&lease.id.as_uuid()) {
                        Some(until) => {
                            let mut fenced = lease.clone();
                            fenced.lease_expires_at = *until;
                            Slotted::Slot(SendSlot::Now, fenced)
                        }
                        None => Slotted::Unfenced,
                    }
                }
                Admission::Admitted { send_at } => Slotted::Slot(
                    SendSlot::At {
                        send_at,
                        reserved_at: decided_at,
                    },
                    lease.clone(),
                ),
                Admission::Deferred { until, reason } => Slotted::Released { until, reason },
            };
            (lease, slotted)
        })
        .collect())
}

/// A stored cap, parsed: NULL (or 1) is none.
fn max_share(stored: Option<f64>) -> Result<Option<nudge_domain::MaxShare>, LedgerError> {
    stored
        .map(nudge_domain::MaxShare::new)
        .transpose()
        .map(Option::flatten)
        .map_err(|e| LedgerError::corrupt("tenants", e))
}
