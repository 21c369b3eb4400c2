//! What the intake (`nudge-intake`) asks of the ledger beyond creating reminders: the tenants'
//! signing secrets (sealed with the tenant secret key, at most two per tenant, rotated and
//! retired with an audit row in the same transaction), a reminder's state per channel,
//! cancellation answered per channel, a subscriber's destinations replaced together, and
//! erasure of a subscriber.
//!
//! Must never: return or log a secret other than to the one caller that asked for it (the
//! rotation prints it once, the intake verifies with it); keep a subscriber's ciphertext or
//! reference after erasure.

use chrono::{DateTime, Utc};
use nudge_domain::{
    CancelChange, Channel, DeliveryState, EventId, ReminderId, SubscriberRef, TenantId, Zone,
};
use rand::RngExt;

use crate::audit::{self, Operator};
use crate::contacts::{SubscriberZone, seal_contact, set_subscriber_zones, upsert_contacts};
use crate::crypto::{Destination, DestinationCipher, SealedWith};
use crate::deliveries::LedgerTime;
use crate::reschedule::{cancel_locked, lock_deliveries};
use crate::{Ledger, LedgerError};

/// The most signing secrets a tenant has at once (the current one and the one it replaces).
pub const MAX_ACTIVE_SECRETS: i64 = 2;

/// A tenant's signing secret, as `nudgectl tenant secret rotate` prints it once. `Debug` is
/// redacted; [`SigningSecret::expose`] is the only way to read it.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningSecret(String);

impl std::fmt::Debug for SigningSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningSecret(<redacted>)")
    }
}

impl SigningSecret {
    /// A new random secret: `nsk_` and 64 hex digits (32 random bytes). The HMAC key is the
    /// whole string's bytes, so a client uses it exactly as printed.
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::rng().random();
        let mut text = String::with_capacity(4 + 64);
        text.push_str("nsk_");
        for b in bytes {
            text.push_str(&format!("{b:02x}"));
        }
        Self(text)
    }

    pub fn from_text(text: String) -> Self {
        Self(text)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// What the intake needs to authenticate and answer a tenant's request, read in one query.
#[derive(Debug, Clone)]
pub struct IntakeTenant {
    pub id: TenantId,
    pub intake_paused: bool,
    /// Channels draining now: a reminder for them is recorded and held.
    pub draining: Vec<Channel>,
    /// Newest first; empty when the tenant has none (every request is then refused).
    pub secrets: Vec<SigningSecret>,
}

/// One channel of a reminder, as the intake reports it: its delivery's state, attempts and
/// settlement, never PHI. (Not the operator's [`crate::ChannelStatus`], which counts a whole
/// channel's work.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReminderChannelState {
    pub channel: Channel,
    /// `None` while no delivery exists yet (not due, tenant paused or channel draining).
    pub state: Option<DeliveryState>,
    pub attempts: i32,
    pub settled_at: Option<DateTime<Utc>>,
}

/// A reminder's state as the intake reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReminderStatus {
    pub id: ReminderId,
    pub scheduled_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub cancelled_at: Option<DateTime<Utc>>,
    pub correlation_id: Option<String>,
    /// The client's current revision (a reschedule must give a higher one).
    pub revision: i64,
    pub channels: Vec<ReminderChannelState>,
}

/// What a cancellation did, per channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancellation {
    /// Deliveries settled `cancelled` by this request.
    pub cancelled: Vec<Channel>,
    /// Every channel of the reminder, in channel order, with what the cancellation could do.
    pub channels: Vec<(Channel, CancelChange)>,
    /// The reminder after the cancellation: what had already gone, or is being sent and will
    /// finish (never retried: its reminder is cancelled).
    pub status: ReminderStatus,
}

/// What an erasure did (counts only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Erasure {
    pub contacts_deleted: u64,
    pub reminders_erased: u64,
    pub deliveries_cancelled: u64,
    /// Series of the subscriber: cancelled, their subscriber reference replaced and their
    /// content dropped, as their reminders'.
    pub series_erased: u64,
    /// Their preferences (per channel and category), deleted: the consent history keeps
    /// their entries under subjects that no longer name anyone. A destination's opt-out is
    /// the destination's, not theirs: it stays.
    pub preferences_deleted: u64,
}

/// Locks the tenant's row for a change to its secrets (two rotations never race), or says
/// it does not exist.
pub(crate) async fn lock_tenant(
    tx: &mut sqlx::PgConnection,
    tenant_id: TenantId,
) -> Result<(), LedgerError> {
    let exists: Option<uuid::Uuid> =
        sqlx::query_scalar("SELECT id FROM tenants WHERE id = $1 FOR UPDATE")
            .bind(tenant_id.as_uuid())
            .fetch_optional(&mut *tx)
            .await?;
    exists
        .map(|_| ())
        .ok_or(LedgerError::UnknownTenant(tenant_id.as_uuid()))
}

pub(crate) fn secret_aad(tenant_id: uuid::Uuid, generation: i32) -> Vec<u8> {
    format!("tenant-secret:{tenant_id}:{generation}").into_bytes()
}

/// What a sealed secret looks like in length (nonce, `nsk_` and 64 hex digits, tag): opened in
/// place of a secret a tenant does not have.
const PLACEHOLDER_SEALED: [u8; 24 + 68 + 16] = [0; 24 + 68 + 16];

#[derive(sqlx::FromRow)]
struct TenantRow {
    id: Option<uuid::Uuid>,
    intake_paused: bool,
    draining: Vec<String>,
    generations: Vec<i32>,
    ciphertexts: Vec<Vec<u8>>,
    sealed_with: Vec<String>,
}

#[derive(sqlx::FromRow)]
struct StatusRow {
    id: uuid::Uuid,
    channels: Vec<String>,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    cancelled_at: Option<DateTime<Utc>>,
    correlation_id: Option<String>,
    revision: i64,
}

#[derive(sqlx::FromRow)]
struct DeliveryRow {
    channel: String,
    state: String,
    attempt_count: i32,
    settled_at: Option<DateTime<Utc>>,
}

impl Ledger {
    /// The tenant named `name` with its secrets opened, or `None` when there is no such tenant.
    ///
    /// The same work either way, so that its time does not say whether the tenant exists (the
    /// intake answers both alike): the statement always yields one row (the tenant's, or one
    /// of NULLs) and runs every subquery, and as many secrets are opened as a tenant can have
    /// ([`MAX_ACTIVE_SECRETS`]), placeholders standing in for the missing ones.
    pub async fn intake_tenant(
        &self,
        name: &str,
        cipher: &DestinationCipher,
    ) -> Result<Option<IntakeTenant>, LedgerError> {
        let row: TenantRow = sqlx::query_as(
            "SELECT t.id, COALESCE(t.intake_paused, false) AS intake_paused,
                    ARRAY(SELECT channel FROM channel_controls WHERE draining ORDER BY channel)
                        AS draining,
                    ARRAY(SELECT generation FROM tenant_secrets s WHERE s.tenant_id = t.id
                          ORDER BY generation DESC) AS generations,
                    ARRAY(SELECT secret_ciphertext FROM tenant_secrets s WHERE s.tenant_id = t.id
                          ORDER BY generation DESC) AS ciphertexts,
                    ARRAY(SELECT sealed_with FROM tenant_secrets s WHERE s.tenant_id = t.id
                          ORDER BY generation DESC) AS sealed_with
             FROM (VALUES (1)) AS one (x) LEFT JOIN tenants t ON t.name = $1",
        )
        .bind(name)
        .fetch_one(&self.pool)
        .await?;
        let id = row.id.unwrap_or_else(uuid::Uuid::nil);
        let secrets: Vec<SigningSecret> = cipher
            .open_tenant_secrets(
                "tenant_secrets",
                &row.generations,
                &row.ciphertexts,
                &row.sealed_with,
                |generation| secret_aad(id, generation),
            )?
            .into_iter()
            .map(SigningSecret)
            .collect();
        // The placeholders open with the key new secrets are sealed with.
        let placeholder_sealing = if cipher.has_tenant_secret_key() {
            SealedWith::TenantSecretKey
        } else {
            SealedWith::DestinationKey
        };
        let missing = usize::try_from(MAX_ACTIVE_SECRETS)
            .unwrap_or(0)
            .saturating_sub(secrets.len());
        for _ in 0..missing {
            // Fails to open (it is no ciphertext of ours) after the same authentication work.
            let _ = std::hint::black_box(cipher.open_tenant_secret(
                &PLACEHOLDER_SEALED,
                placeholder_sealing,
                &secret_aad(id, 0),
            ));
        }
        let Some(id) = row.id else {
            return Ok(None);
        };
        let draining = row
            .draining
            .iter()
            .map(|c| {
                c.parse::<Channel>()
                    .map_err(|_| LedgerError::corrupt("channel_controls", "unknown channel"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Some(IntakeTenant {
            id: TenantId::from_uuid(id),
            intake_paused: row.intake_paused,
            draining,
            secrets,
        }))
    }

    /// Adds a new signing secret for the tenant and returns it (the caller shows it once).
    /// Refused while the tenant already has [`MAX_ACTIVE_SECRETS`]: retire the old one first.
    /// Audited (never with the secret) in the same transaction.
    pub async fn rotate_signing_secret(
        &self,
        tenant_id: TenantId,
        cipher: &DestinationCipher,
        by: &Operator,
    ) -> Result<SigningSecret, LedgerError> {
        let mut tx = self.pool.begin().await?;
        lock_tenant(&mut tx, tenant_id).await?;
        let (count, newest): (i64, Option<i32>) = sqlx::query_as(
            "SELECT count(*), max(generation) FROM tenant_secrets WHERE tenant_id = $1",
        )
        .bind(tenant_id.as_uuid())
        .fetch_one(&mut *tx)
        .await?;
        if count >= MAX_ACTIVE_SECRETS {
            return Err(LedgerError::InvalidInput(
                "the tenant already has two signing secrets: retire the old one first",
            ));
        }
        let generation = newest.unwrap_or(0) + 1;
        let secret = SigningSecret::generate();
        let (sealed, with) = cipher.seal_tenant_secret(
            secret.expose().as_bytes(),
            &secret_aad(tenant_id.as_uuid(), generation),
        )?;
        sqlx::query(
            "INSERT INTO tenant_secrets (tenant_id, generation, secret_ciphertext, created_at,
                                         sealed_with)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(tenant_id.as_uuid())
        .bind(generation)
        .bind(sealed)
        .bind(by.at())
        .bind(with.as_str())
        .execute(&mut *tx)
        .await?;
        audit::insert(
            &mut tx,
            &by.entry(
                "tenant_secret_rotate",
                format!("tenant:{tenant_id}"),
                serde_json::json!({ "generation": generation, "active": count + 1 }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(secret)
    }

    /// Drops every signing secret of the tenant but the newest. Returns how many were dropped
    /// (0 when there was only one, or none). Audited in the same transaction.
    pub async fn retire_signing_secret(
        &self,
        tenant_id: TenantId,
        by: &Operator,
    ) -> Result<u64, LedgerError> {
        let mut tx = self.pool.begin().await?;
        lock_tenant(&mut tx, tenant_id).await?;
        let retired = sqlx::query(
            "DELETE FROM tenant_secrets WHERE tenant_id = $1
               AND generation < (SELECT max(generation) FROM tenant_secrets WHERE tenant_id = $1)",
        )
        .bind(tenant_id.as_uuid())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        audit::insert(
            &mut tx,
            &by.entry(
                "tenant_secret_retire",
                format!("tenant:{tenant_id}"),
                serde_json::json!({ "retired": retired }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(retired)
    }

    /// A reminder's state per channel, or `None` when the tenant has no such event.
    pub async fn reminder_status(
        &self,
        tenant_id: TenantId,
        event_id: &EventId,
    ) -> Result<Option<ReminderStatus>, LedgerError> {
        let mut conn = self.pool.acquire().await?;
        status_in(&mut conn, tenant_id, event_id).await
    }

    /// Cancels a reminder and answers per channel, in one transaction; `None` when the tenant
    /// has no such event. Every delivery of the reminder is locked (see `reschedule`): one
    /// that nothing can have been sent for (owed, or leased and waiting for its slot) is
    /// settled `cancelled`, and its fence, if it comes, finds no lease of its own; one whose
    /// send started, or that was delivered or is held as maybe sent, is answered `too_late`
    /// (it is never retried: its reminder is cancelled); one settled before is
    /// `already_settled`. A channel with no delivery yet is `cancelled` (none will be made).
    /// `cancelled_at` and the deliveries' `settled_at` are the database's time
    /// ([`LedgerTime::Database`]), like every other settlement.
    pub async fn cancel_reminder_by_channel(
        &self,
        tenant_id: TenantId,
        event_id: &EventId,
        at: LedgerTime,
    ) -> Result<Option<Cancellation>, LedgerError> {
        self.cancel_audited(tenant_id, event_id, None, at).await
    }

    /// [`Ledger::cancel_reminder_by_channel`] by an operator (`nudgectl reminders cancel`),
    /// audited with what it answered in the same transaction.
    pub async fn cancel_reminder_as(
        &self,
        tenant_id: TenantId,
        event_id: &EventId,
        by: &Operator,
        at: LedgerTime,
    ) -> Result<Option<Cancellation>, LedgerError> {
        self.cancel_audited(tenant_id, event_id, Some(by), at).await
    }

    async fn cancel_audited(
        &self,
        tenant_id: TenantId,
        event_id: &EventId,
        by: Option<&Operator>,
        at: LedgerTime,
    ) -> Result<Option<Cancellation>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        // `before`: whether it was cancelled already (a repeated cancel answers as the first).
        let row: Option<(uuid::Uuid, Vec<String>, DateTime<Utc>, bool)> = sqlx::query_as(
            "WITH before AS (
                 SELECT id, cancelled_at IS NOT NULL AS cancelled FROM reminders
                 WHERE tenant_id = $1 AND event_id = $2 FOR NO KEY UPDATE)
             UPDATE reminders r SET cancelled_at = COALESCE(r.cancelled_at, $3, now())
             FROM before b WHERE r.id = b.id
             RETURNING r.id, r.channels, COALESCE($3, now()), b.cancelled",
        )
        .bind(tenant_id.as_uuid())
        .bind(event_id.as_str())
        .bind(at.bind())
        .fetch_optional(&mut *tx)
        .await?;
        let Some((id, names, now, cancelled_before)) = row else {
            return Ok(None);
        };
        let locked = lock_deliveries(&mut tx, id).await?;
        let mut movable = Vec::new();
        for delivery in &locked {
            if delivery.found()?.movable() {
                movable.push(delivery.id);
            }
        }
        cancel_locked(&mut tx, &movable, "cancelled_by_client", now).await?;
        let status = status_in(&mut tx, tenant_id, event_id)
            .await?
            .ok_or_else(|| LedgerError::corrupt("reminders", "cancelled row vanished"))?;
        let mut channels = Vec::with_capacity(names.len());
        for name in &names {
            let channel: Channel = name
                .parse()
                .map_err(|_| LedgerError::corrupt("reminders", "unknown channel"))?;
            let delivery = locked.iter().find(|d| d.channel == *name);
            let found = delivery
                .map(crate::reschedule::LockedDelivery::found)
                .transpose()?;
            let now_state = status
                .channels
                .iter()
                .find(|c| c.channel == channel)
                .and_then(|c| c.state);
            // Settled by an earlier cancel of this reminder: answered as that cancel was.
            let by_earlier_cancel = cancelled_before
                && delivery.is_some_and(|d| {
                    d.state == DeliveryState::Cancelled.as_str()
                        && d.reason.as_deref() == Some("cancelled_by_client")
                });
            let change = if by_earlier_cancel {
                CancelChange::Cancelled
            } else {
                nudge_domain::change::cancelled(found, now_state)
            };
            channels.push((channel, change));
        }
        channels.sort_by_key(|(c, _)| *c);
        if let Some(by) = by {
            let answers: serde_json::Map<String, serde_json::Value> = channels
                .iter()
                .map(|(c, change)| (c.as_str().to_owned(), change.as_str().into()))
                .collect();
            let mut entry = by.entry(
                "reminder_cancel",
                format!("reminder:{id}"),
                serde_json::json!({ "channels": answers }),
            );
            entry.at = now;
            audit::insert(&mut tx, &entry).await?;
        }
        tx.commit().await?;
        let cancelled = channels
            .iter()
            .filter(|(_, change)| *change == CancelChange::Cancelled)
            .filter(|(c, _)| locked.iter().any(|d| d.channel == c.as_str()))
            .map(|(c, _)| *c)
            .collect();
        Ok(Some(Cancellation {
            cancelled,
            channels,
            status,
        }))
    }

    /// Replaces a subscriber's destinations for the channels given (others are kept), and
    /// when `time_zone` is given makes it the subscriber's zone on all their contacts, and when
    /// `quiet_hours` is given their quiet hours, in one transaction. Needs the subscriber key.
    #[allow(clippy::too_many_arguments)]
    pub async fn set_contacts(
        &self,
        tenant_id: TenantId,
        subscriber_ref: &SubscriberRef,
        destinations: &[(Channel, Destination)],
        time_zone: Option<Zone>,
        quiet_hours: Option<crate::SubscriberQuietHours>,
        cipher: &DestinationCipher,
        now: DateTime<Utc>,
    ) -> Result<(), LedgerError> {
        let stored_ref = cipher.stored_ref(tenant_id, subscriber_ref)?;
        let mut sealed = Vec::with_capacity(destinations.len());
        for (channel, destination) in destinations {
            if destination.expose().len() > crate::MAX_DESTINATION_BYTES {
                return Err(LedgerError::InvalidInput(
                    "a destination is larger than 1024 bytes",
                ));
            }
            sealed.push(
                seal_contact(cipher, tenant_id, stored_ref.clone(), *channel, destination)?
                    .with_time_zone(time_zone),
            );
        }
        let mut tx = self.pool.begin().await?;
        upsert_contacts(&mut tx, &sealed, now)
            .await
            .map_err(|e| match e {
                LedgerError::InvalidInput(_) => LedgerError::UnknownTenant(tenant_id.as_uuid()),
                other => other,
            })?;
        if let Some(zone) = time_zone {
            set_subscriber_zones(
                &mut tx,
                &[SubscriberZone {
                    tenant_id: tenant_id.as_uuid(),
                    stored_ref: stored_ref.clone(),
                    zone,
                }],
            )
            .await?;
        }
        if let Some(quiet) = quiet_hours {
            crate::quiet::set_subscriber_quiet_hours(&mut tx, tenant_id, &stored_ref, quiet, now)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Erases a subscriber of a tenant, in one transaction: deletes their destinations (the
    /// rows, so the ciphertext with them) and their preferences (a destination's opt-out, kept
    /// by its keyed digest, stays), settles their owed deliveries `cancelled` (a lease
    /// waiting for its slot too; one whose send started finishes), and strips their reminders
    /// to the audit fields: the reference is replaced by a random value unrelated to the
    /// subscriber, content and request digest are dropped, `erased_at` is set. An audit row
    /// with the counts (never the reference) is written in the same transaction. Every time it
    /// writes, the audit row's included, is the database's ([`LedgerTime::Database`]), read
    /// once at its start. Needs the subscriber key.
    pub async fn erase_subscriber(
        &self,
        tenant_id: TenantId,
        subscriber_ref: &SubscriberRef,
        cipher: &DestinationCipher,
        by: &Operator,
        at: LedgerTime,
    ) -> Result<Erasure, LedgerError> {
        let stored_ref = cipher.stored_ref(tenant_id, subscriber_ref)?;
        let mut tx = self.pool.begin().await?;
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT COALESCE($1, now())")
            .bind(at.bind())
            .fetch_one(&mut *tx)
            .await?;
        let contacts_deleted = sqlx::query(
            "DELETE FROM contacts WHERE tenant_id = $1
               AND (subscriber_ref = $2 OR (NOT subscriber_ref_keyed AND subscriber_ref = $3))",
        )
        .bind(tenant_id.as_uuid())
        .bind(&stored_ref)
        .bind(subscriber_ref.as_str())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let preferences_deleted = sqlx::query(
            "DELETE FROM subscriber_preferences WHERE tenant_id = $1 AND subscriber_ref = $2",
        )
        .bind(tenant_id.as_uuid())
        .bind(&stored_ref)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        // Their series first (a window expanding one holds it, then inserts its reminders),
        // locked in id order as the window locks them: no occurrence is created for them any
        // more.
        let series: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT id FROM series WHERE tenant_id = $1 AND subscriber_ref = $2
             ORDER BY id FOR NO KEY UPDATE",
        )
        .bind(tenant_id.as_uuid())
        .bind(&stored_ref)
        .fetch_all(&mut *tx)
        .await?;
        let series_erased = sqlx::query(
            "UPDATE series
             SET subscriber_ref = 'erased:' || id::text, content_ciphertext = NULL,
                 request_digest = NULL, next_at = NULL, next_local = NULL,
                 cancelled_at = COALESCE(cancelled_at, $2), erased_at = $2
             WHERE id = ANY($1)",
        )
        .bind(&series)
        .bind(now)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let reminders: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT id FROM reminders WHERE tenant_id = $1
               AND (subscriber_ref = $2 OR (NOT subscriber_ref_keyed AND subscriber_ref = $3))
             FOR UPDATE",
        )
        .bind(tenant_id.as_uuid())
        .bind(&stored_ref)
        .bind(subscriber_ref.as_str())
        .fetch_all(&mut *tx)
        .await?;
        // As a cancel does (see `reschedule`): a lease waiting for its slot is taken too, under
        // the row lock its fence needs, so nothing leaves for an erased subscriber once this
        // commits.
        let deliveries_cancelled = sqlx::query(
            "UPDATE deliveries
             SET state = 'cancelled', settled_at = $2, updated_at = $2, next_attempt_at = NULL,
                 last_error_reason = 'subscriber_erased',
                 attempt_count = CASE WHEN state = 'sending' THEN attempt_count - 1
                                      ELSE attempt_count END,
                 lease_owner = NULL, lease_expires_at = NULL, lease_idempotent = NULL
             WHERE reminder_id = ANY($1)
               AND (state IN ('scheduled', 'queued', 'retry_wait')
                    OR (state = 'sending' AND send_started_at IS NULL))",
        )
        .bind(&reminders)
        .bind(now)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let placeholders: Vec<String> = reminders.iter().map(|_| random_ref()).collect();
        let reminders_erased = sqlx::query(
            "UPDATE reminders r
             SET subscriber_ref = p.placeholder, subscriber_ref_keyed = true,
                 content_ciphertext = NULL, request_digest = NULL, revision_digest = NULL,
                 cancelled_at = COALESCE(r.cancelled_at, $3), erased_at = $3
             FROM UNNEST($1::uuid[], $2::text[]) AS p(id, placeholder)
             WHERE r.id = p.id",
        )
        .bind(&reminders)
        .bind(&placeholders)
        .bind(now)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let erasure = Erasure {
            contacts_deleted,
            reminders_erased,
            deliveries_cancelled,
            series_erased,
            preferences_deleted,
        };
        let mut entry = by.entry(
            "subscriber_erase",
            format!("tenant:{tenant_id}"),
            serde_json::json!({
                "contacts_deleted": contacts_deleted,
                "reminders_erased": reminders_erased,
                "deliveries_cancelled": deliveries_cancelled,
                "series_erased": series_erased,
                "preferences_deleted": preferences_deleted,
            }),
        );
        entry.at = now;
        audit::insert(&mut tx, &entry).await?;
        tx.commit().await?;
        Ok(erasure)
    }
}

/// 64 random hex digits: the shape of a stored reference, related to no subscriber.
fn random_ref() -> String {
    let bytes: [u8; 32] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn status_in(
    conn: &mut sqlx::PgConnection,
    tenant_id: TenantId,
    event_id: &EventId,
) -> Result<Option<ReminderStatus>, LedgerError> {
    let row: Option<StatusRow> = sqlx::query_as(
        "SELECT id, channels, scheduled_at, expires_at, cancelled_at, correlation_id, revision
         FROM reminders WHERE tenant_id = $1 AND event_id = $2",
    )
    .bind(tenant_id.as_uuid())
    .bind(event_id.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let deliveries: Vec<DeliveryRow> = sqlx::query_as(
        "SELECT channel, state, attempt_count, settled_at FROM deliveries WHERE reminder_id = $1",
    )
    .bind(row.id)
    .fetch_all(&mut *conn)
    .await?;
    let mut channels = Vec::with_capacity(row.channels.len());
    for name in &row.channels {
        let channel: Channel = name
            .parse()
            .map_err(|_| LedgerError::corrupt("reminders", "unknown channel"))?;
        let delivery = deliveries.iter().find(|d| d.channel == *name);
        channels.push(ReminderChannelState {
            channel,
            state: delivery
                .map(|d| {
                    d.state
                        .parse::<DeliveryState>()
                        .map_err(|_| LedgerError::corrupt("deliveries", "unknown state"))
                })
                .transpose()?,
            attempts: delivery.map_or(0, |d| d.attempt_count),
            settled_at: delivery.and_then(|d| d.settled_at),
        });
    }
    channels.sort_by_key(|c| c.channel);
    Ok(Some(ReminderStatus {
        id: ReminderId::from_uuid(row.id),
        scheduled_at: row.scheduled_at,
        expires_at: row.expires_at,
        cancelled_at: row.cancelled_at,
        correlation_id: row.correlation_id,
        revision: row.revision,
        channels,
    }))
}
