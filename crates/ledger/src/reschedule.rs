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
use crate::contacts::{SubscriberZone, seal_contact, set_subscriber_zones, upsert_contacts};
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

/// A replacement as the transaction applies it: `None` keeps the reminder's own (channels,
/// content, subscriber check, revision: the current + 1).
struct Target<'a> {
    tenant_id: nudge_domain::TenantId,
    event_id: &'a nudge_domain::EventId,
    revision: Option<Revision>,
    digest: Option<&'a [u8]>,
    subscriber: Option<&'a SubscriberRef>,
    channels: Option<&'a [nudge_domain::Channel]>,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    content: Option<Option<&'a [u8]>>,
    contacts: &'a [(nudge_domain::Channel, crate::Destination)],
    /// The subscriber's zone, when the replacement gives one.
    time_zone: Option<nudge_domain::Zone>,
    /// Whether it ignores quiet hours, when the replacement says (a whole new body does).
    ignore_quiet_hours: Option<bool>,
    /// Its category, when the replacement says (a whole new body does).
    category: Option<&'a nudge_domain::Category>,
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
    replaced: bool,
    db_now: DateTime<Utc>,
}

/// A reminder's delivery as a change found it under its row lock.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct LockedDelivery {
    pub(crate) id: uuid::Uuid,
    pub(crate) channel: String,
    pub(crate) state: String,
    pub(crate) fenced: bool,
    pub(crate) reason: Option<String>,
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
        "SELECT id, channel, state, send_started_at IS NOT NULL AS fenced,
                last_error_reason AS reason
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
        let target = Target {
            tenant_id: reminder.tenant_id(),
            event_id: reminder.event_id(),
            revision: Some(replacement.revision),
            digest: reminder.request_digest.as_deref(),
            subscriber: Some(reminder.subscriber_ref()),
            channels: Some(reminder.channels()),
            scheduled_at: reminder.scheduled_at,
            expires_at: reminder.expires_at,
            content: Some(reminder.content.as_deref()),
            contacts: &replacement.item.contacts,
            time_zone: reminder.time_zone(),
            ignore_quiet_hours: Some(reminder.ignores_quiet_hours()),
            category: Some(reminder.category()),
        };
        self.replace(&target, cipher, by, at).await
    }

    /// Moves a reminder to a new schedule and expiry, keeping its channels, destinations and
    /// content, as an operator (`nudgectl reminders reschedule`): [`Ledger::reschedule_reminder`]'s
    /// rules, at `revision` or, without one, the current revision + 1; audited in the same
    /// transaction.
    #[allow(clippy::too_many_arguments)]
    pub async fn move_reminder(
        &self,
        tenant_id: nudge_domain::TenantId,
        event_id: &nudge_domain::EventId,
        scheduled_at: DateTime<Utc>,
        expires_at: DateTime<Utc>,
        revision: Option<Revision>,
        cipher: &DestinationCipher,
        by: &Operator,
        at: LedgerTime,
    ) -> Result<RescheduleOutcome, LedgerError> {
        use chrono::SubsecRound;
        let (scheduled_at, expires_at) =
            (scheduled_at.trunc_subsecs(6), expires_at.trunc_subsecs(6));
        if expires_at <= scheduled_at {
            return Err(LedgerError::InvalidInput(
                "expires_at must be after scheduled_at",
            ));
        }
        let target = Target {
            tenant_id,
            event_id,
            revision,
            digest: None,
            subscriber: None,
            channels: None,
            scheduled_at,
            expires_at,
            content: None,
            contacts: &[],
            time_zone: None,
            ignore_quiet_hours: None,
            category: None,
        };
        self.replace(&target, cipher, &ReplacedBy::Operator(by.clone()), at)
            .await
    }

    async fn replace(
        &self,
        target: &Target<'_>,
        cipher: &DestinationCipher,
        by: &ReplacedBy,
        at: LedgerTime,
    ) -> Result<RescheduleOutcome, LedgerError> {
        let tenant_id = target.tenant_id;
        let mut tx = self.pool.begin().await?;
        // Shared with creations, exclusive with a window (see `reminders`): a reminder moved
        // into a window being run is either read by it or sees its run intent here.
        let tenant: Option<(bool, bool)> = sqlx::query_as(
            "SELECT t.intake_paused,
                    $2::text IS NULL OR $2 = 'general'
                    OR EXISTS (SELECT 1 FROM categories c WHERE c.tenant_id = t.id AND c.name = $2)
             FROM tenants t WHERE t.id = $1 FOR SHARE OF t",
        )
        .bind(tenant_id.as_uuid())
        .bind(target.category.map(nudge_domain::Category::as_str))
        .fetch_optional(&mut *tx)
        .await?;
        let Some((paused, category_known)) = tenant else {
            return Ok(RescheduleOutcome::NotFound);
        };
        if !category_known {
            return Err(LedgerError::UnknownCategory(
                target
                    .category
                    .map(|c| c.as_str().to_owned())
                    .unwrap_or_default(),
            ));
        }
        // NO KEY UPDATE: a window inserting deliveries takes KEY SHARE on the reminder.
        let current: Option<CurrentRow> = sqlx::query_as(
            "SELECT id, subscriber_ref, subscriber_ref_keyed, channels, scheduled_at, expires_at,
                    cancelled_at, erased_at, revision, revision_digest, request_digest,
                    EXISTS (SELECT 1 FROM reminder_revisions h WHERE h.reminder_id = r.id)
                        AS replaced,
                    COALESCE($3, now()) AS db_now
             FROM reminders r WHERE tenant_id = $1 AND event_id = $2 FOR NO KEY UPDATE",
        )
        .bind(tenant_id.as_uuid())
        .bind(target.event_id.as_str())
        .bind(at.bind())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(current) = current.filter(|c| c.erased_at.is_none()) else {
            return Ok(RescheduleOutcome::NotFound);
        };
        let id = ReminderId::from_uuid(current.id);
        let revision = Revision::new(current.revision)
            .map_err(|_| LedgerError::corrupt("reminders", "negative revision"))?;
        // Until its first replacement, the post made the current revision (0, or what it gave).
        let made_by = if current.replaced {
            &current.revision_digest
        } else {
            &current.request_digest
        };
        let same_body = made_by.is_some() && made_by.as_deref() == target.digest;
        let wanted = match target.revision {
            Some(wanted) => wanted,
            None => Revision::new(revision.get().saturating_add(1))
                .map_err(|_| LedgerError::corrupt("reminders", "revision out of range"))?,
        };
        match nudge_domain::change::order(revision, wanted, same_body) {
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
        if let Some(subscriber) = target.subscriber {
            let stored_ref = cipher.stored_ref(tenant_id, subscriber)?;
            if !same_subscriber(&current, &stored_ref, subscriber) {
                return Ok(RescheduleOutcome::SubscriberDiffers);
            }
        }
        let now = current.db_now;
        let (scheduled_at, expires_at) = (target.scheduled_at, target.expires_at);
        let time_changed = current.scheduled_at != scheduled_at || current.expires_at != expires_at;
        if current.scheduled_at != scheduled_at && scheduled_at < now {
            return Ok(RescheduleOutcome::ScheduledInThePast);
        }
        if expires_at <= now {
            return Ok(RescheduleOutcome::ExpiresInThePast);
        }

        let old_channels = parse_channels(&current.channels)?;
        let new_channels = match target.channels {
            Some(channels) => channels.to_vec(),
            None => old_channels.clone(),
        };
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
        move_locked(&mut tx, &to_move, scheduled_at, expires_at, now).await?;
        cancel_locked(&mut tx, &to_cancel, "channel_removed", now).await?;

        // Content: sealed again when given (None: the reminder has none now), else kept.
        let content = match target.content {
            Some(content) => Some(
                content
                    .map(|c| cipher.seal(c, &content_aad(tenant_id, id)))
                    .transpose()?,
            ),
            None => None,
        };
        let channel_names: Vec<&str> = new_channels.iter().map(|c| c.as_str()).collect();
        sqlx::query(
            "UPDATE reminders
             SET channels = $2, scheduled_at = $3, expires_at = $4,
                 content_ciphertext = CASE WHEN $8 THEN $5 ELSE content_ciphertext END,
                 content_from_series = CASE WHEN $8 THEN false ELSE content_from_series END,
                 revision = $6, revision_digest = $7,
                 ignore_quiet_hours = COALESCE($9, ignore_quiet_hours),
                 category = COALESCE($10, category)
             WHERE id = $1",
        )
        .bind(current.id)
        .bind(&channel_names)
        .bind(scheduled_at)
        .bind(expires_at)
        .bind(content.clone().flatten())
        .bind(wanted.get())
        .bind(target.digest)
        .bind(content.is_some())
        .bind(target.ignore_quiet_hours)
        .bind(target.category.map(nudge_domain::Category::as_str))
        .execute(&mut *tx)
        .await?;

        if let Some(subscriber) = target.subscriber {
            let stored_ref = cipher.stored_ref(tenant_id, subscriber)?;
            let mut sealed = Vec::with_capacity(target.contacts.len());
            for (channel, destination) in target.contacts {
                sealed.push(
                    seal_contact(cipher, tenant_id, stored_ref.clone(), *channel, destination)?
                        .with_time_zone(target.time_zone),
                );
            }
            upsert_contacts(&mut tx, &sealed, now).await?;
            if let Some(zone) = target.time_zone {
                set_subscriber_zones(
                    &mut tx,
                    &[SubscriberZone {
                        tenant_id: tenant_id.as_uuid(),
                        stored_ref,
                        zone,
                    }],
                )
                .await?;
            }
        }

        // A channel added, or a reminder moved into a window that ran (or to now), gets its
        // deliveries now; later windows take the rest (their insert skips what exists).
        let covered: bool = sqlx::query_scalar(
            "SELECT $2 <= $3 OR EXISTS (
                 SELECT 1 FROM run_intents ri WHERE ri.tenant_id = $1
                   AND ri.window_start <= $2 AND ri.window_end > $2)",
        )
        .bind(tenant_id.as_uuid())
        .bind(scheduled_at)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let deliveries_created = if covered && !paused {
            let window = WindowReminder {
                id: current.id,
                channels: channel_names.iter().map(|c| (*c).to_owned()).collect(),
                scheduled_at,
                expires_at,
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
        .bind(wanted.get())
        .bind(current.scheduled_at)
        .bind(scheduled_at)
        .bind(current.expires_at)
        .bind(expires_at)
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
                    "revision": wanted.get(),
                    "from": current.scheduled_at,
                    "to": scheduled_at,
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
            revision: wanted,
            scheduled_at,
            expires_at,
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
