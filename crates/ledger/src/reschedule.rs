//! Reschedule: a client (or an operator) replaces a pending reminder's schedule and body under a
//! growing revision, in one transaction; and the row locks a reschedule and a cancellation take
//! so that each either wins over the fence or reports what it could not touch.
//!
//! The race with a send is decided on the delivery's row: the change locks every delivery of
//! the reminder (`FOR UPDATE`, in id order as the lease does) and takes only those that nothing
//! can have been sent for (`nudge_domain::Found::movable`: owed, or leased and not fenced).
//! The lease locks and the fence updates the same row, so one of them waits for the other:
//! a lease or fence that comes second finds the row moved on (another state or generation, no
//! lease owner) and sends nothing; a change that comes second finds `send_started_at` stamped
//! and answers `too_late`. See `docs/decisions/0309-reschedule-and-truthful-cancel.md`.
//!
//! Must never: move or cancel a delivery whose send started; answer a channel as moved or
//! cancelled when a request may still leave for it; change a reminder without its revision
//! growing.

use chrono::{DateTime, Utc};
use nudge_domain::{ChannelChange, Found, ReminderId, Revision, RevisionOrder, SubscriberRef};
use sqlx::PgConnection;

use crate::audit::{self, Operator};
use crate::contacts::{seal_contact, upsert_contacts};
use crate::crypto::{DestinationCipher, content_aad};
use crate::deliveries::LedgerTime;
use crate::reminders::{ImportReminder, WindowReminder, insert_deliveries};
use crate::{Ledger, LedgerError};

/// One replacement of a reminder: the whole reminder as it should now be (its event id names
/// the one replaced; its request digest tells a repeat of the same body), and its revision.
#[derive(Debug, Clone)]
pub struct Replacement {
    pub item: ImportReminder,
    pub revision: Revision,
}

/// Who asked for a replacement: the client through the intake, or an operator (audited).
#[derive(Debug, Clone)]
pub enum ReplacedBy {
    Client,
    Operator(Operator),
}

impl ReplacedBy {
    fn source(&self) -> &'static str {
        match self {
            ReplacedBy::Client => "intake",
            ReplacedBy::Operator(_) => "nudgectl",
        }
    }
}

/// What a replacement did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rescheduled {
    pub id: ReminderId,
    pub revision: Revision,
    pub scheduled_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// Every channel of the old and the new reminder, in channel order, with what became of it.
    pub channels: Vec<(nudge_domain::Channel, ChannelChange)>,
    /// Deliveries created now (an added channel, or a reminder moved into a window that ran).
    pub deliveries_created: u64,
}

/// The answer to a replacement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RescheduleOutcome {
    /// Applied: the reminder is at `revision` now.
    Applied(Rescheduled),
    /// The current revision with the same body again: nothing changed.
    Repeat(Rescheduled),
    /// An older revision, or the current one with another body: nothing changed.
    RevisionConflict { current: Revision },
    /// The body names another subscriber: a reminder keeps its patient.
    SubscriberDiffers,
    /// The reminder is cancelled: nothing to move.
    Cancelled,
    /// The new schedule is before the database's now: nothing changed.
    ScheduledInThePast,
    /// The new expiry is not after the database's now: nothing changed.
    ExpiresInThePast,
    /// No such event for the tenant, or its subscriber was erased.
    NotFound,
}

#[derive(sqlx::FromRow)]
struct CurrentRow {
    id: uuid::Uuid,
    subscriber_ref: String,
    subscriber_ref_keyed: bool,
    channels: Vec<String>,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    cancelled_at: Option<DateTime<Utc>>,
    erased_at: Option<DateTime<Utc>>,
    revision: i64,
    revision_digest: Option<Vec<u8>>,
    request_digest: Option<Vec<u8>>,
    db_now: DateTime<Utc>,
}

/// A reminder's delivery as a change found it under its row lock.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct LockedDelivery {
    pub(crate) id: uuid::Uuid,
    pub(crate) channel: String,
    pub(crate) state: String,
    pub(crate) fenced: bool,
}

impl LockedDelivery {
    pub(crate) fn channel(&self) -> Result<nudge_domain::Channel, LedgerError> {
        self.channel
            .parse()
            .map_err(|_| LedgerError::corrupt("deliveries", "unknown channel"))
    }

    pub(crate) fn found(&self) -> Result<Found, LedgerError> {
        Ok(Found {
            state: self
                .state
                .parse()
                .map_err(|_| LedgerError::corrupt("deliveries", "unknown state"))?,
            fenced: self.fenced,
        })
    }
}

/// Locks every delivery of a reminder, in id order (the lease's lock order), and reads each
/// as it stands once locked: a lease or fence in flight on one of them commits first.
pub(crate) async fn lock_deliveries(
    conn: &mut PgConnection,
    reminder_id: uuid::Uuid,
) -> Result<Vec<LockedDelivery>, LedgerError> {
    Ok(sqlx::query_as(
        "SELECT id, channel, state, send_started_at IS NOT NULL AS fenced
         FROM deliveries WHERE reminder_id = $1 ORDER BY id FOR UPDATE",
    )
    .bind(reminder_id)
    .fetch_all(&mut *conn)
    .await?)
}

/// Settles locked, movable deliveries `cancelled` with `reason`. A lease waiting for its slot
/// loses its holder and the attempt it had not made: its fence then finds no lease of its own
/// and nothing is sent.
pub(crate) async fn cancel_locked(
    conn: &mut PgConnection,
    ids: &[uuid::Uuid],
    reason: &str,
    now: DateTime<Utc>,
) -> Result<(), LedgerError> {
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "UPDATE deliveries
         SET state = 'cancelled', settled_at = $2, updated_at = $2, next_attempt_at = NULL,
             last_error_reason = $3,
             attempt_count = CASE WHEN state = 'sending' THEN attempt_count - 1
                                  ELSE attempt_count END,
             lease_owner = NULL, lease_expires_at = NULL, lease_idempotent = NULL
         WHERE id = ANY($1)
           AND (state IN ('scheduled', 'queued', 'retry_wait')
                OR (state = 'sending' AND send_started_at IS NULL))",
    )
    .bind(ids)
    .bind(now)
    .bind(reason)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

impl Ledger {
    /// Replaces a reminder's schedule, channels, destinations and content under a revision
    /// that must grow, in one transaction (see the module): each owed delivery not yet fenced
    /// moves to the new time, keeping its id, key and attempts (`queued` and a lease waiting
    /// for its slot go back to `scheduled` with a new generation, so their message is stale);
    /// a removed channel's is cancelled; an added channel's is created when the reminder's
    /// time has come or its window ran; the reminder's content is sealed again and the
    /// destinations stored. A delivery being sent or settled is not touched and is answered
    /// `too_late` with its state. Times are the database's unless a test fixes them.
    pub async fn reschedule_reminder(
        &self,
        replacement: &Replacement,
        cipher: &DestinationCipher,
        by: &ReplacedBy,
        at: LedgerTime,
    ) -> Result<RescheduleOutcome, LedgerError> {
        let reminder = &replacement.item.reminder;
        let tenant_id = reminder.tenant_id();
        let mut tx = self.pool.begin().await?;
        // Shared with creations, exclusive with a window (see `reminders`): a reminder moved
        // into a window being run is either read by it or sees its run intent here.
        let paused: Option<bool> =
            sqlx::query_scalar("SELECT intake_paused FROM tenants WHERE id = $1 FOR SHARE")
                .bind(tenant_id.as_uuid())
                .fetch_optional(&mut *tx)
                .await?;
        let Some(paused) = paused else {
            return Ok(RescheduleOutcome::NotFound);
        };
        // NO KEY UPDATE: a window inserting deliveries takes KEY SHARE on the reminder.
        let current: Option<CurrentRow> = sqlx::query_as(
            "SELECT id, subscriber_ref, subscriber_ref_keyed, channels, scheduled_at, expires_at,
                    cancelled_at, erased_at, revision, revision_digest, request_digest,
                    COALESCE($3, now()) AS db_now
             FROM reminders WHERE tenant_id = $1 AND event_id = $2 FOR NO KEY UPDATE",
        )
        .bind(tenant_id.as_uuid())
        .bind(reminder.event_id().as_str())
        .bind(at.bind())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(current) = current.filter(|c| c.erased_at.is_none()) else {
            return Ok(RescheduleOutcome::NotFound);
        };
        let id = ReminderId::from_uuid(current.id);
        let revision = Revision::new(current.revision)
            .map_err(|_| LedgerError::corrupt("reminders", "negative revision"))?;
        let made_by = if revision == Revision::FIRST {
            &current.request_digest
        } else {
            &current.revision_digest
        };
        let same_body = made_by.is_some() && *made_by == reminder.request_digest;
        match nudge_domain::change::order(revision, replacement.revision, same_body) {
            RevisionOrder::Conflict => {
                return Ok(RescheduleOutcome::RevisionConflict { current: revision });
            }
            RevisionOrder::Repeat => {
                let channels = parse_channels(&current.channels)?
                    .into_iter()
                    .map(|c| (c, ChannelChange::Unchanged))
                    .collect();
                return Ok(RescheduleOutcome::Repeat(Rescheduled {
                    id,
                    revision,
                    scheduled_at: current.scheduled_at,
                    expires_at: current.expires_at,
                    channels,
                    deliveries_created: 0,
                }));
            }
            RevisionOrder::Newer => {}
        }
        if current.cancelled_at.is_some() {
            return Ok(RescheduleOutcome::Cancelled);
        }
        let stored_ref = cipher.stored_ref(tenant_id, reminder.subscriber_ref())?;
        if !same_subscriber(&current, &stored_ref, reminder.subscriber_ref()) {
            return Ok(RescheduleOutcome::SubscriberDiffers);
        }
        let now = current.db_now;
        let time_changed = current.scheduled_at != reminder.scheduled_at
            || current.expires_at != reminder.expires_at;
        if current.scheduled_at != reminder.scheduled_at && reminder.scheduled_at < now {
            return Ok(RescheduleOutcome::ScheduledInThePast);
        }
        if reminder.expires_at <= now {
            return Ok(RescheduleOutcome::ExpiresInThePast);
        }

        let old_channels = parse_channels(&current.channels)?;
        let new_channels = reminder.channels().to_vec();
        let locked = lock_deliveries(&mut tx, current.id).await?;
        let mut to_move = Vec::new();
        let mut to_cancel = Vec::new();
        for delivery in &locked {
            if !delivery.found()?.movable() {
                continue;
            }
            if new_channels.contains(&delivery.channel()?) {
                if time_changed {
                    to_move.push(delivery.id);
                }
            } else {
                to_cancel.push(delivery.id);
            }
        }
        move_locked(
            &mut tx,
            &to_move,
            reminder.scheduled_at,
            reminder.expires_at,
            now,
        )
        .await?;
        cancel_locked(&mut tx, &to_cancel, "channel_removed", now).await?;

        let content = reminder
            .content
            .as_deref()
            .map(|c| cipher.seal(c, &content_aad(tenant_id, id)))
            .transpose()?;
        let channel_names: Vec<&str> = new_channels.iter().map(|c| c.as_str()).collect();
        sqlx::query(
            "UPDATE reminders
             SET channels = $2, scheduled_at = $3, expires_at = $4, content_ciphertext = $5,
                 revision = $6, revision_digest = $7
             WHERE id = $1",
        )
        .bind(current.id)
        .bind(&channel_names)
        .bind(reminder.scheduled_at)
        .bind(reminder.expires_at)
        .bind(content)
        .bind(replacement.revision.get())
        .bind(reminder.request_digest.as_deref())
        .execute(&mut *tx)
        .await?;

        let mut sealed = Vec::with_capacity(replacement.item.contacts.len());
        for (channel, destination) in &replacement.item.contacts {
            sealed.push(seal_contact(
                cipher,
                tenant_id,
                stored_ref.clone(),
                *channel,
                destination,
            )?);
        }
        upsert_contacts(&mut tx, &sealed, now).await?;

        // A channel added, or a reminder moved into a window that ran (or to now), gets its
        // deliveries now; later windows take the rest (their insert skips what exists).
        let covered: bool = sqlx::query_scalar(
            "SELECT $2 <= $3 OR EXISTS (
                 SELECT 1 FROM run_intents ri WHERE ri.tenant_id = $1
                   AND ri.window_start <= $2 AND ri.window_end > $2)",
        )
        .bind(tenant_id.as_uuid())
        .bind(reminder.scheduled_at)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let deliveries_created = if covered && !paused {
            let window = WindowReminder {
                id: current.id,
                channels: channel_names.iter().map(|c| (*c).to_owned()).collect(),
                scheduled_at: reminder.scheduled_at,
                expires_at: reminder.expires_at,
            };
            insert_deliveries(&mut tx, tenant_id, std::slice::from_ref(&window), now).await?
        } else {
            0
        };

        let added: Vec<&str> = new_channels
            .iter()
            .filter(|c| !old_channels.contains(c))
            .map(|c| c.as_str())
            .collect();
        let removed: Vec<&str> = old_channels
            .iter()
            .filter(|c| !new_channels.contains(c))
            .map(|c| c.as_str())
            .collect();
        sqlx::query(
            "INSERT INTO reminder_revisions (reminder_id, revision, from_scheduled_at,
                 to_scheduled_at, from_expires_at, to_expires_at, channels_added,
                 channels_removed, source, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(current.id)
        .bind(replacement.revision.get())
        .bind(current.scheduled_at)
        .bind(reminder.scheduled_at)
        .bind(current.expires_at)
        .bind(reminder.expires_at)
        .bind(&added)
        .bind(&removed)
        .bind(by.source())
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if let ReplacedBy::Operator(operator) = by {
            let mut entry = operator.entry(
                "reminder_reschedule",
                format!("reminder:{id}"),
                serde_json::json!({
                    "revision": replacement.revision.get(),
                    "from": current.scheduled_at,
                    "to": reminder.scheduled_at,
                    "channels_added": added,
                    "channels_removed": removed,
                }),
            );
            entry.at = now;
            audit::insert(&mut tx, &entry).await?;
        }

        // Every channel of either version, answered from what the change found under its locks
        // (the locks are held until commit: the states read are the answered ones).
        let mut all = old_channels.clone();
        all.extend(new_channels.iter().filter(|c| !old_channels.contains(c)));
        all.sort();
        let mut channels = Vec::with_capacity(all.len());
        for channel in all {
            let found = locked
                .iter()
                .find(|d| d.channel == channel.as_str())
                .map(LockedDelivery::found)
                .transpose()?;
            channels.push((
                channel,
                nudge_domain::change::rescheduled(
                    old_channels.contains(&channel),
                    new_channels.contains(&channel),
                    found,
                    None,
                    time_changed,
                ),
            ));
        }
        tx.commit().await?;
        Ok(RescheduleOutcome::Applied(Rescheduled {
            id,
            revision: replacement.revision,
            scheduled_at: reminder.scheduled_at,
            expires_at: reminder.expires_at,
            channels,
            deliveries_created,
        }))
    }
}

/// Moves locked, movable deliveries to a new schedule and expiry: due at the new time, their
/// key, id, lane and attempts kept. A `queued` one and a lease waiting for its slot go back
/// to `scheduled` with a new generation (their message is then stale, and the lease's fence
/// finds no lease of its own); a `retry_wait` one waits for the new time.
async fn move_locked(
    conn: &mut PgConnection,
    ids: &[uuid::Uuid],
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<(), LedgerError> {
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "UPDATE deliveries
         SET state = CASE WHEN state = 'retry_wait' THEN 'retry_wait' ELSE 'scheduled' END,
             generation = CASE WHEN state IN ('queued', 'sending') THEN generation + 1
                               ELSE generation END,
             attempt_count = CASE WHEN state = 'sending' THEN attempt_count - 1
                                  ELSE attempt_count END,
             scheduled_at = $2, expires_at = $3, next_attempt_at = $2,
             lease_owner = NULL, lease_expires_at = NULL, lease_idempotent = NULL,
             updated_at = $4
         WHERE id = ANY($1)
           AND (state IN ('scheduled', 'queued', 'retry_wait')
                OR (state = 'sending' AND send_started_at IS NULL))",
    )
    .bind(ids)
    .bind(scheduled_at)
    .bind(expires_at)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

fn parse_channels(names: &[String]) -> Result<Vec<nudge_domain::Channel>, LedgerError> {
    let mut channels = names
        .iter()
        .map(|c| c.parse())
        .collect::<Result<Vec<nudge_domain::Channel>, _>>()
        .map_err(|_| LedgerError::corrupt("reminders", "unknown channel"))?;
    channels.sort();
    Ok(channels)
}

/// The same subscriber, compared in the form the row holds (its keyed hash, or the reference
/// itself on a row not converted yet).
fn same_subscriber(current: &CurrentRow, stored_ref: &str, posted: &SubscriberRef) -> bool {
    if current.subscriber_ref_keyed {
        current.subscriber_ref == stored_ref
    } else {
        current.subscriber_ref == posted.as_str()
    }
}
