//! Reminders: creation (one at a time or imported in batches, one path for both), the
//! producer's windows, cancellation and the orphan watchdog.
//!
//! Creating a reminder and running its window are serialised on the tenant row: a creation
//! (or a whole import batch) holds its tenants `FOR SHARE` until it commits, a window takes
//! its tenant `FOR NO KEY UPDATE` (see [`Ledger::materialise_window`]). A reminder whose window has
//! already run, or whose time has come, gets its deliveries in its own create transaction.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, SubsecRound, Utc};
use nudge_domain::{
    Channel, DeliveryId, EventId, IdempotencyKey, ReminderId, SubscriberRef, TenantId,
};
use sqlx::PgConnection;

use crate::contacts::{SubscriberZone, seal_contact, set_subscriber_zones, upsert_contacts};
use crate::crypto::{Destination, DestinationCipher};
use crate::{Ledger, LedgerError};

/// Reminders a producer window reads and materialises at a time (its memory is bounded by
/// this, not by the window's size).
pub const WINDOW_BATCH: usize = 5_000;

/// The largest message content accepted, in bytes of its JSON text.
pub const MAX_CONTENT_BYTES: usize = 16 * 1024;

/// The largest destination accepted (phone number, email address, push token), in bytes.
pub const MAX_DESTINATION_BYTES: usize = 1024;

/// A reminder as the clinic app describes it, checked: at least one channel, no channel
/// twice, and an expiry after its schedule. Construct with [`NewReminder::new`].
#[derive(Debug, Clone)]
pub struct NewReminder {
    tenant_id: TenantId,
    event_id: EventId,
    subscriber_ref: SubscriberRef,
    channels: Vec<Channel>,
    pub(crate) scheduled_at: DateTime<Utc>,
    pub(crate) expires_at: DateTime<Utc>,
    pub(crate) content: Option<Vec<u8>>,
    correlation_id: Option<String>,
    pub(crate) request_digest: Option<Vec<u8>>,
    revision: nudge_domain::Revision,
    /// The reminder's own zone: stored as its subscriber's zone on their contacts.
    time_zone: Option<nudge_domain::Zone>,
    /// `"quiet_hours": "ignore"`: sent inside quiet hours where its tenant allows it.
    ignore_quiet_hours: bool,
    /// What it is about: `general` unless given; one of its tenant's categories.
    category: nudge_domain::Category,
}

/// The longest correlation id stored with a reminder (printable ASCII, as on the envelope).
pub const MAX_CORRELATION_ID_BYTES: usize = 128;

/// A correlation id as stored with a reminder or a series: 1 to 128 printable ASCII characters.
pub(crate) fn checked_correlation_id(id: &str) -> Result<String, LedgerError> {
    if id.is_empty()
        || id.len() > MAX_CORRELATION_ID_BYTES
        || !id.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(LedgerError::InvalidInput(
            "a correlation id is 1 to 128 printable ASCII characters",
        ));
    }
    Ok(id.to_owned())
}

impl NewReminder {
    pub fn new(
        tenant_id: TenantId,
        event_id: EventId,
        subscriber_ref: SubscriberRef,
        channels: &[Channel],
        scheduled_at: DateTime<Utc>,
        expires_at: DateTime<Utc>,
    ) -> Result<Self, LedgerError> {
        if channels.is_empty() {
            return Err(LedgerError::InvalidInput(
                "a reminder needs at least one channel",
            ));
        }
        let mut sorted = channels.to_vec();
        sorted.sort();
        sorted.dedup();
        if sorted.len() != channels.len() {
            return Err(LedgerError::InvalidInput("a channel is listed twice"));
        }
        // PostgreSQL keeps microseconds: a time with nanoseconds would be stored other than
        // posted, and the same reminder posted again would no longer compare equal.
        let scheduled_at = scheduled_at.trunc_subsecs(6);
        let expires_at = expires_at.trunc_subsecs(6);
        if expires_at <= scheduled_at {
            return Err(LedgerError::InvalidInput(
                "expires_at must be after scheduled_at",
            ));
        }
        Ok(Self {
            tenant_id,
            event_id,
            subscriber_ref,
            channels: sorted,
            scheduled_at,
            expires_at,
            content: None,
            correlation_id: None,
            request_digest: None,
            revision: nudge_domain::Revision::FIRST,
            time_zone: None,
            ignore_quiet_hours: false,
            category: nudge_domain::Category::general(),
        })
    }

    /// Message content (template parameters): a JSON object of at most
    /// [`MAX_CONTENT_BYTES`], refused otherwise (a worker sends it as the message's
    /// parameters). Stored encrypted; never logged, and never quoted in an error.
    pub fn with_content(mut self, content: Vec<u8>) -> Result<Self, LedgerError> {
        if content.len() > MAX_CONTENT_BYTES {
            return Err(LedgerError::InvalidInput(
                "content is larger than 16384 bytes",
            ));
        }
        match serde_json::from_slice::<serde_json::Value>(&content) {
            Ok(serde_json::Value::Object(_)) => {}
            _ => return Err(LedgerError::InvalidInput("content must be a JSON object")),
        }
        self.content = Some(content);
        Ok(self)
    }

    /// The correlation id its deliveries' envelopes carry (1 to 128 printable ASCII
    /// characters); without one, each publish makes its own.
    pub fn with_correlation_id(mut self, id: &str) -> Result<Self, LedgerError> {
        self.correlation_id = Some(checked_correlation_id(id)?);
        Ok(self)
    }

    /// A digest of the request that posted it ([`DestinationCipher::request_digest`]): the same
    /// event posted again is the same reminder only with the same digest.
    pub fn with_request_digest(mut self, digest: Vec<u8>) -> Self {
        self.request_digest = Some(digest);
        self
    }

    /// The client's revision of the reminder: 0 unless given. A replacement
    /// ([`crate::Ledger::reschedule_reminder`]) must give a higher one.
    pub fn with_revision(mut self, revision: nudge_domain::Revision) -> Self {
        self.revision = revision;
        self
    }

    pub fn revision(&self) -> nudge_domain::Revision {
        self.revision
    }

    /// The subscriber's zone as this reminder gives it (`time_zone`): written to all the
    /// subscriber's contacts with the reminder (from then on the subscriber's zone).
    pub fn with_time_zone(mut self, zone: Option<nudge_domain::Zone>) -> Self {
        self.time_zone = zone;
        self
    }

    pub fn time_zone(&self) -> Option<nudge_domain::Zone> {
        self.time_zone
    }

    /// The reminder says `"quiet_hours": "ignore"`: its deliveries are sent inside quiet hours
    /// where its tenant allows it (`tenants.quiet_hours_ignorable`, checked at each lease).
    pub fn ignoring_quiet_hours(mut self, ignore: bool) -> Self {
        self.ignore_quiet_hours = ignore;
        self
    }

    pub fn ignores_quiet_hours(&self) -> bool {
        self.ignore_quiet_hours
    }

    /// Its category (`general` unless given): the import refuses one its tenant does not
    /// have ([`ImportOutcome::UnknownCategory`]).
    pub fn with_category(mut self, category: nudge_domain::Category) -> Self {
        self.category = category;
        self
    }

    pub fn category(&self) -> &nudge_domain::Category {
        &self.category
    }

    pub fn event_id(&self) -> &EventId {
        &self.event_id
    }

    pub fn tenant_id(&self) -> TenantId {
        self.tenant_id
    }

    pub fn channels(&self) -> &[Channel] {
        &self.channels
    }

    pub fn subscriber_ref(&self) -> &SubscriberRef {
        &self.subscriber_ref
    }
}

/// One reminder to import, with its subscriber's destinations (encrypted on the way in).
#[derive(Debug, Clone)]
pub struct ImportReminder {
    pub reminder: NewReminder,
    pub contacts: Vec<(Channel, Destination)>,
}

/// What importing one reminder of a batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportOutcome {
    /// Written now, with this many deliveries (its window had run, or its time had come).
    Created {
        id: ReminderId,
        deliveries_created: u64,
    },
    /// The same event was imported before (or earlier in the batch): its destinations are
    /// updated, nothing else changes.
    AlreadyPresent {
        id: ReminderId,
    },
    /// The event id is already used for a different reminder: nothing of this one is written.
    EventConflict,
    UnknownTenant,
    /// Its tenant has no such category: nothing of this one is written.
    UnknownCategory,
}

/// The answer to a create: the same event posted twice gets the same id, `created: false`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreatedReminder {
    pub id: ReminderId,
    pub created: bool,
    /// Deliveries created with the reminder (its window had run, or its time had come).
    pub deliveries_created: u64,
}

/// What a producer tick did for one `(tenant, window)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowOutcome {
    /// First run of this window: the run intent was written with this many new deliveries,
    /// and this many occurrences of the tenant's series became reminders. `series_unexpandable`
    /// series could not be expanded (their stored rule or zone no longer parses: a zone the tz
    /// database dropped); they wait, and the producer logs them as errors.
    Materialised {
        deliveries_created: u64,
        occurrences_created: u64,
        series_unexpandable: u64,
    },
    /// The window had run before: nothing was created.
    AlreadyRun,
    /// The tenant's intake is paused: no run intent, so the window runs after resume.
    Paused,
}

/// A reminder as the producer reads it to materialise deliveries.
#[derive(sqlx::FromRow)]
pub(crate) struct WindowReminder {
    pub(crate) id: uuid::Uuid,
    pub(crate) channels: Vec<String>,
    pub(crate) scheduled_at: DateTime<Utc>,
    pub(crate) expires_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct ExistingReminder {
    id: uuid::Uuid,
    tenant_id: uuid::Uuid,
    event_id: String,
    subscriber_ref: String,
    subscriber_ref_keyed: bool,
    channels: Vec<String>,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    request_digest: Option<Vec<u8>>,
}

impl ExistingReminder {
    /// The same reminder posted again: same subscriber (compared in the form the row holds:
    /// its keyed hash, or the reference itself on a row not converted yet), channels and times.
    fn is_same(&self, reminder: &NewReminder, stored_ref: &str) -> bool {
        let subscriber = if self.subscriber_ref_keyed {
            stored_ref
        } else {
            reminder.subscriber_ref.as_str()
        };
        let mut channels = self.channels.clone();
        channels.sort();
        let mut wanted: Vec<&str> = reminder.channels.iter().map(|c| c.as_str()).collect();
        wanted.sort_unstable();
        // Both posted with a digest (through the intake): the whole request must match, and
        // then the first post's fields did: a reschedule since (which changes them, never
        // the post's digest) does not make the client's retry of its post a conflict.
        match (&self.request_digest, &reminder.request_digest) {
            (Some(stored), Some(posted)) => stored == posted && self.subscriber_ref == subscriber,
            _ => {
                self.subscriber_ref == subscriber
                    && channels == wanted
                    && self.scheduled_at == reminder.scheduled_at
                    && self.expires_at == reminder.expires_at
            }
        }
    }
}

impl Ledger {
    /// Creates a reminder, idempotently on `(tenant, event_id)`. Re-posting the same event
    /// answers with the first reminder's id; re-using the event id for a different reminder
    /// (other subscriber, channels or times) is a [`LedgerError::EventConflict`].
    ///
    /// A reminder that the producer's windows would not pick up any more (its time has come,
    /// or a run intent already covers its time) gets its deliveries in the same transaction,
    /// unless the tenant's intake is paused: then the producer's catch-up materialises it
    /// when the tenant resumes.
    pub async fn create_reminder(
        &self,
        reminder: &NewReminder,
        cipher: &DestinationCipher,
        now: DateTime<Utc>,
    ) -> Result<CreatedReminder, LedgerError> {
        self.import_reminder(reminder, &[], cipher, now).await
    }

    /// Like [`create_reminder`](Self::create_reminder), and stores the subscriber's
    /// destinations (encrypted) in the same transaction: all of it is written, or none.
    pub async fn import_reminder(
        &self,
        reminder: &NewReminder,
        contacts: &[(Channel, Destination)],
        cipher: &DestinationCipher,
        now: DateTime<Utc>,
    ) -> Result<CreatedReminder, LedgerError> {
        let item = ImportReminder {
            reminder: reminder.clone(),
            contacts: contacts.to_vec(),
        };
        let outcome = self
            .import_reminders(std::slice::from_ref(&item), cipher, now)
            .await?;
        match outcome.first() {
            Some(ImportOutcome::Created {
                id,
                deliveries_created,
            }) => Ok(CreatedReminder {
                id: *id,
                created: true,
                deliveries_created: *deliveries_created,
            }),
            Some(ImportOutcome::AlreadyPresent { id }) => Ok(CreatedReminder {
                id: *id,
                created: false,
                deliveries_created: 0,
            }),
            Some(ImportOutcome::EventConflict) => Err(LedgerError::EventConflict {
                tenant_id: reminder.tenant_id.as_uuid(),
            }),
            Some(ImportOutcome::UnknownCategory) => Err(LedgerError::UnknownCategory(
                reminder.category.as_str().to_owned(),
            )),
            Some(ImportOutcome::UnknownTenant) | None => {
                Err(LedgerError::UnknownTenant(reminder.tenant_id.as_uuid()))
            }
        }
    }

    /// Imports a batch of reminders in one transaction, with a few statements whatever its
    /// size, and answers for each in order. Each one is idempotent on `(tenant, event_id)`
    /// as in [`create_reminder`](Self::create_reminder), within the batch too (the first
    /// occurrence wins); a conflict or an unknown tenant writes nothing of that reminder and
    /// does not stop the others. Destinations of the same subscriber and channel given twice:
    /// the later one is kept. Any other error writes nothing of the batch.
    pub async fn import_reminders(
        &self,
        items: &[ImportReminder],
        cipher: &DestinationCipher,
        now: DateTime<Utc>,
    ) -> Result<Vec<ImportOutcome>, LedgerError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        for item in items {
            if item
                .contacts
                .iter()
                .any(|(_, d)| d.expose().len() > MAX_DESTINATION_BYTES)
            {
                return Err(LedgerError::InvalidInput(
                    "a destination is larger than 1024 bytes",
                ));
            }
        }
        let mut tx = self.pool.begin().await?;
        let outcomes = import_in(&mut tx, items, cipher, now).await?;
        tx.commit().await?;
        Ok(outcomes)
    }

    /// Marks a reminder cancelled and settles its owed deliveries as `cancelled`. A delivery
    /// already being sent finishes; one already settled keeps its state. Returns the number
    /// of deliveries cancelled, or None when the event is unknown. Times are the database's
    /// ([`LedgerTime::Database`](crate::LedgerTime::Database)) unless a test fixes them.
    pub async fn cancel_reminder(
        &self,
        tenant_id: TenantId,
        event_id: &EventId,
        at: crate::deliveries::LedgerTime,
    ) -> Result<Option<u64>, LedgerError> {
        // One path: the intake's cancellation, which also reports per channel.
        Ok(self
            .cancel_reminder_by_channel(tenant_id, event_id, at)
            .await?
            .map(|c| c.cancelled.len() as u64))
    }

    /// The producer's tick for one tenant and window `[start, end)`: in one transaction,
    /// writes the run intent and materialises a `scheduled` delivery (due at the reminder's
    /// `scheduled_at`) for each channel of each reminder scheduled in the window. A window
    /// that has run before creates nothing, whether replayed later or by a concurrent
    /// producer; a paused tenant gets no run intent.
    pub async fn materialise_window(
        &self,
        tenant_id: TenantId,
        start: DateTime<Utc>,
        end: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<WindowOutcome, LedgerError> {
        if end <= start {
            return Err(LedgerError::InvalidInput(
                "a window must end after it starts",
            ));
        }
        let mut tx = self.pool.begin().await?;
        // Exclusive on the tenant row: reminder creations hold it FOR SHARE until they commit,
        // so this window waits for every creation in flight (and then reads their reminders),
        // and a creation that starts later waits for this window (and then sees its intent and
        // materialises itself). Without it, a reminder committing around the window's read is
        // taken by neither. A concurrent pause also either lands before this intent or waits.
        // NO KEY UPDATE, not UPDATE: it conflicts with FOR SHARE as much, but not with the
        // KEY SHARE a foreign key's check takes. The relay's claim inserts the tenant's pass
        // (`tenant_claim_passes`, keyed to the tenant) while it updates deliveries a replayed
        // window inserts again: under FOR UPDATE each waited for the other (a deadlock the
        // read-only-ledger test met as the window replayed after the outage).
        let paused: Option<bool> =
            sqlx::query_scalar("SELECT intake_paused FROM tenants WHERE id = $1 FOR NO KEY UPDATE")
                .bind(tenant_id.as_uuid())
                .fetch_optional(&mut *tx)
                .await?;
        match paused {
            None => return Err(LedgerError::UnknownTenant(tenant_id.as_uuid())),
            Some(true) => return Ok(WindowOutcome::Paused),
            Some(false) => {}
        }
        let intent: Option<i64> = sqlx::query_scalar(
            "INSERT INTO run_intents (tenant_id, window_start, window_end, deliveries_created, created_at)
             VALUES ($1, $2, $3, 0, $4)
             ON CONFLICT (tenant_id, window_start) DO NOTHING
             RETURNING id",
        )
        .bind(tenant_id.as_uuid())
        .bind(start)
        .bind(end)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(intent) = intent else {
            return Ok(WindowOutcome::AlreadyRun);
        };
        // The occurrences of the tenant's series this window reaches become reminders first,
        // in this transaction, so the read below materialises them with the rest.
        let expanded = crate::series::expand_series(&mut tx, tenant_id, start, end, now).await?;
        let mut created = insert_deliveries(&mut tx, tenant_id, &expanded.early, now).await?;

        // Streamed through a cursor, WINDOW_BATCH reminders at a time, all in this one
        // transaction: a window may hold any number of reminders, and the producer's memory
        // must not grow with it.
        sqlx::query(
            "DECLARE window_reminders NO SCROLL CURSOR FOR
             SELECT id, channels, scheduled_at, expires_at FROM reminders
             WHERE tenant_id = $1 AND scheduled_at >= $2 AND scheduled_at < $3
               AND cancelled_at IS NULL",
        )
        .bind(tenant_id.as_uuid())
        .bind(start)
        .bind(end)
        .execute(&mut *tx)
        .await?;
        loop {
            let reminders: Vec<WindowReminder> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "FETCH FORWARD {WINDOW_BATCH} FROM window_reminders"
            )))
            .fetch_all(&mut *tx)
            .await?;
            if reminders.is_empty() {
                break;
            }
            created += insert_deliveries(&mut tx, tenant_id, &reminders, now).await?;
            if reminders.len() < WINDOW_BATCH {
                break;
            }
        }
        sqlx::query("CLOSE window_reminders")
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE run_intents SET deliveries_created = $2 WHERE id = $1")
            .bind(intent)
            .bind(i32::try_from(created).unwrap_or(i32::MAX))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(WindowOutcome::Materialised {
            deliveries_created: created,
            occurrences_created: expanded.occurrences_created,
            series_unexpandable: expanded.unexpandable,
        })
    }

    /// Materialises one reminder's deliveries now, whatever its window. Idempotent:
    /// existing deliveries are kept.
    pub async fn materialise_reminder(
        &self,
        tenant_id: TenantId,
        reminder_id: ReminderId,
        now: DateTime<Utc>,
    ) -> Result<u64, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let reminders: Vec<WindowReminder> = sqlx::query_as(
            "SELECT id, channels, scheduled_at, expires_at FROM reminders
             WHERE tenant_id = $1 AND id = $2 AND cancelled_at IS NULL",
        )
        .bind(tenant_id.as_uuid())
        .bind(reminder_id.as_uuid())
        .fetch_all(&mut *tx)
        .await?;
        let created = insert_deliveries(&mut tx, tenant_id, &reminders, now).await?;
        tx.commit().await?;
        Ok(created)
    }

    /// The watchdog for "no reminder is silently dropped": reminders of tenants that are not
    /// paused, not cancelled, whose time came between `since` and `now - grace`, yet that miss
    /// a delivery on one of their channels that is not draining (a draining channel holds its
    /// deliveries on purpose). Each one gets its missing deliveries (they then send, or
    /// expire, visibly); returns how many reminders were repaired, which should always be 0.
    pub async fn repair_orphaned_reminders(
        &self,
        since: DateTime<Utc>,
        now: DateTime<Utc>,
        grace: std::time::Duration,
        limit: u32,
    ) -> Result<u64, LedgerError> {
        let until = now - chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::zero());
        let orphans: Vec<(uuid::Uuid, uuid::Uuid)> = sqlx::query_as(
            "SELECT r.tenant_id, r.id FROM reminders r
             JOIN tenants t ON t.id = r.tenant_id AND NOT t.intake_paused
             WHERE r.cancelled_at IS NULL AND r.scheduled_at >= $1 AND r.scheduled_at <= $2
               AND EXISTS (
                   SELECT 1 FROM unnest(r.channels) c
                   JOIN channel_controls cc ON cc.channel = c AND NOT cc.draining
                   WHERE NOT EXISTS (SELECT 1 FROM deliveries d
                                     WHERE d.reminder_id = r.id AND d.channel = c))
             ORDER BY r.scheduled_at LIMIT $3",
        )
        .bind(since)
        .bind(until)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let mut repaired = 0;
        for (tenant_id, reminder_id) in orphans {
            if self
                .materialise_reminder(
                    TenantId::from_uuid(tenant_id),
                    ReminderId::from_uuid(reminder_id),
                    now,
                )
                .await?
                > 0
            {
                repaired += 1;
            }
        }
        Ok(repaired)
    }

    /// The end of the latest window run for a tenant, where the producer's catch-up resumes.
    pub async fn last_window_end(
        &self,
        tenant_id: TenantId,
    ) -> Result<Option<DateTime<Utc>>, LedgerError> {
        Ok(
            sqlx::query_scalar("SELECT max(window_end) FROM run_intents WHERE tenant_id = $1")
                .bind(tenant_id.as_uuid())
                .fetch_one(&self.pool)
                .await?,
        )
    }
}

/// A reminder as it is about to be written: its id, stored subscriber reference and sealed
/// content, computed before the insert (the content's associated data names the id).
struct Prepared<'a> {
    item: &'a ImportReminder,
    id: ReminderId,
    stored_ref: String,
    channels: String,
    content: Option<Vec<u8>>,
}

async fn import_in(
    tx: &mut PgConnection,
    items: &[ImportReminder],
    cipher: &DestinationCipher,
    now: DateTime<Utc>,
) -> Result<Vec<ImportOutcome>, LedgerError> {
    // Shared with other creations, exclusive with a producer window: see materialise_window.
    // Locked in id order so that two batches and a window never wait on each other in a cycle.
    let mut tenant_ids: Vec<uuid::Uuid> = items
        .iter()
        .map(|i| i.reminder.tenant_id.as_uuid())
        .collect();
    tenant_ids.sort_unstable();
    tenant_ids.dedup();
    // With each tenant, its categories (never deleted: one seen here stays).
    let known: HashMap<uuid::Uuid, Vec<String>> = sqlx::query_as::<_, (uuid::Uuid, Vec<String>)>(
        "SELECT t.id, ARRAY(SELECT c.name FROM categories c WHERE c.tenant_id = t.id)
         FROM tenants t WHERE t.id = ANY($1) ORDER BY t.id FOR SHARE OF t",
    )
    .bind(&tenant_ids)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();

    let mut prepared: Vec<Result<Prepared<'_>, ImportOutcome>> = Vec::with_capacity(items.len());
    for item in items {
        let reminder = &item.reminder;
        let Some(categories) = known.get(&reminder.tenant_id.as_uuid()) else {
            prepared.push(Err(ImportOutcome::UnknownTenant));
            continue;
        };
        if !reminder.category.is_general()
            && !categories.iter().any(|c| c == reminder.category.as_str())
        {
            prepared.push(Err(ImportOutcome::UnknownCategory));
            continue;
        }
        let id = ReminderId::new();
        let content = reminder
            .content
            .as_deref()
            .map(|c| cipher.seal(c, &crate::crypto::content_aad(reminder.tenant_id, id)))
            .transpose()?;
        let channels: Vec<&str> = reminder.channels.iter().map(|c| c.as_str()).collect();
        prepared.push(Ok(Prepared {
            item,
            id,
            stored_ref: cipher.stored_ref(reminder.tenant_id, &reminder.subscriber_ref)?,
            channels: channels.join(","),
            content,
        }));
    }
    let rows: Vec<&Prepared<'_>> = prepared.iter().filter_map(|p| p.as_ref().ok()).collect();

    // Inserted in (tenant, event) order, the first occurrence in the batch first, so that
    // concurrent imports of overlapping batches take the unique index in one order.
    let created: HashSet<uuid::Uuid> = sqlx::query_scalar(
        "INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, subscriber_ref_keyed,
                                channels, content_ciphertext, scheduled_at, expires_at, created_at,
                                correlation_id, request_digest, revision, ignore_quiet_hours,
                                category)
         SELECT r.id, r.tenant_id, r.event_id, r.subscriber_ref, true,
                string_to_array(r.channels, ','), r.content, r.scheduled_at, r.expires_at, $9,
                r.correlation_id, r.request_digest, r.revision, r.ignore_quiet_hours,
                r.category
         FROM UNNEST($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::text[], $6::bytea[],
                     $7::timestamptz[], $8::timestamptz[], $10::text[], $11::bytea[],
                     $12::bigint[], $13::boolean[], $14::text[])
              WITH ORDINALITY AS r(id, tenant_id, event_id, subscriber_ref, channels, content,
                                   scheduled_at, expires_at, correlation_id, request_digest,
                                   revision, ignore_quiet_hours, category, ord)
         ORDER BY r.tenant_id, r.event_id, r.ord
         ON CONFLICT (tenant_id, event_id) DO NOTHING
         RETURNING id",
    )
    .bind(rows.iter().map(|r| r.id.as_uuid()).collect::<Vec<_>>())
    .bind(
        rows.iter()
            .map(|r| r.item.reminder.tenant_id.as_uuid())
            .collect::<Vec<_>>(),
    )
    .bind(
        rows.iter()
            .map(|r| r.item.reminder.event_id.as_str())
            .collect::<Vec<_>>(),
    )
    .bind(
        rows.iter()
            .map(|r| r.stored_ref.as_str())
            .collect::<Vec<_>>(),
    )
    .bind(rows.iter().map(|r| r.channels.as_str()).collect::<Vec<_>>())
    .bind(
        rows.iter()
            .map(|r| r.content.as_deref())
            .collect::<Vec<_>>(),
    )
    .bind(
        rows.iter()
            .map(|r| r.item.reminder.scheduled_at)
            .collect::<Vec<_>>(),
    )
    .bind(
        rows.iter()
            .map(|r| r.item.reminder.expires_at)
            .collect::<Vec<_>>(),
    )
    .bind(now)
    .bind(
        rows.iter()
            .map(|r| r.item.reminder.correlation_id.as_deref())
            .collect::<Vec<_>>(),
    )
    .bind(
        rows.iter()
            .map(|r| r.item.reminder.request_digest.as_deref())
            .collect::<Vec<_>>(),
    )
    .bind(
        rows.iter()
            .map(|r| r.item.reminder.revision.get())
            .collect::<Vec<_>>(),
    )
    .bind(
        rows.iter()
            .map(|r| r.item.reminder.ignore_quiet_hours)
            .collect::<Vec<_>>(),
    )
    .bind(
        rows.iter()
            .map(|r| r.item.reminder.category.as_str())
            .collect::<Vec<_>>(),
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();

    // The rest were there before (or earlier in this batch): the same reminder, or a conflict.
    let others: Vec<&Prepared<'_>> = rows
        .iter()
        .copied()
        .filter(|r| !created.contains(&r.id.as_uuid()))
        .collect();
    let existing: HashMap<(uuid::Uuid, String), ExistingReminder> = if others.is_empty() {
        HashMap::new()
    } else {
        sqlx::query_as::<_, ExistingReminder>(
            "SELECT r.id, r.tenant_id, r.event_id, r.subscriber_ref, r.subscriber_ref_keyed,
                    r.channels, r.scheduled_at, r.expires_at, r.request_digest
             FROM reminders r
             JOIN UNNEST($1::uuid[], $2::text[]) AS k(tenant_id, event_id)
               ON r.tenant_id = k.tenant_id AND r.event_id = k.event_id",
        )
        .bind(
            others
                .iter()
                .map(|r| r.item.reminder.tenant_id.as_uuid())
                .collect::<Vec<_>>(),
        )
        .bind(
            others
                .iter()
                .map(|r| r.item.reminder.event_id.as_str())
                .collect::<Vec<_>>(),
        )
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(|e| ((e.tenant_id, e.event_id.clone()), e))
        .collect()
    };

    let mut outcomes = Vec::with_capacity(items.len());
    let mut contacts: BTreeMap<(uuid::Uuid, String, Channel), &Destination> = BTreeMap::new();
    // A subscriber's zone, as the last reminder of the batch that gives one says.
    let mut zones: BTreeMap<(uuid::Uuid, String), nudge_domain::Zone> = BTreeMap::new();
    let mut materialise: Vec<&Prepared<'_>> = Vec::new();
    for row in &prepared {
        let row = match row {
            Ok(row) => row,
            Err(refused) => {
                outcomes.push(*refused);
                continue;
            }
        };
        let reminder = &row.item.reminder;
        let outcome = if created.contains(&row.id.as_uuid()) {
            materialise.push(row);
            ImportOutcome::Created {
                id: row.id,
                deliveries_created: 0,
            }
        } else {
            let key = (
                reminder.tenant_id.as_uuid(),
                reminder.event_id.as_str().to_owned(),
            );
            match existing.get(&key) {
                Some(existing) if existing.is_same(reminder, &row.stored_ref) => {
                    ImportOutcome::AlreadyPresent {
                        id: ReminderId::from_uuid(existing.id),
                    }
                }
                Some(_) => ImportOutcome::EventConflict,
                // Inserted and deleted again between the two statements: rare enough to let
                // the caller import it again.
                None => {
                    return Err(LedgerError::InvalidInput(
                        "a reminder of this batch changed while it was imported; import it again",
                    ));
                }
            }
        };
        // Only a reminder created now brings its destinations: a repeated post (a client's
        // retry of an old event, perhaps with a number the patient has since replaced)
        // changes nothing at all, and a conflicting one is refused.
        if matches!(outcome, ImportOutcome::Created { .. }) {
            if let Some(zone) = reminder.time_zone {
                zones.insert((reminder.tenant_id.as_uuid(), row.stored_ref.clone()), zone);
            }
            for (channel, destination) in &row.item.contacts {
                contacts.insert(
                    (
                        reminder.tenant_id.as_uuid(),
                        row.stored_ref.clone(),
                        *channel,
                    ),
                    destination,
                );
            }
        }
        outcomes.push(outcome);
    }

    let mut sealed = Vec::with_capacity(contacts.len());
    for ((tenant_id, stored_ref, channel), destination) in contacts {
        let zone = zones.get(&(tenant_id, stored_ref.clone())).copied();
        sealed.push(
            seal_contact(
                cipher,
                TenantId::from_uuid(tenant_id),
                stored_ref,
                channel,
                destination,
            )?
            .with_time_zone(zone),
        );
    }
    upsert_contacts(tx, &sealed, now).await?;
    let zones: Vec<SubscriberZone> = zones
        .into_iter()
        .map(|((tenant_id, stored_ref), zone)| SubscriberZone {
            tenant_id,
            stored_ref,
            zone,
        })
        .collect();
    set_subscriber_zones(tx, &zones).await?;

    let counts = materialise_created(tx, &materialise, now).await?;
    for outcome in &mut outcomes {
        if let ImportOutcome::Created {
            id,
            deliveries_created,
        } = outcome
        {
            *deliveries_created = counts.get(&id.as_uuid()).copied().unwrap_or(0);
        }
    }
    Ok(outcomes)
}

/// The newly created reminders that the producer's windows would not pick up any more (the
/// tenant is not paused, and their time has come or a run intent already covers it) get
/// their deliveries now. Returns the deliveries created per reminder.
async fn materialise_created(
    tx: &mut PgConnection,
    created: &[&Prepared<'_>],
    now: DateTime<Utc>,
) -> Result<HashMap<uuid::Uuid, u64>, LedgerError> {
    if created.is_empty() {
        return Ok(HashMap::new());
    }
    let due: HashSet<uuid::Uuid> = sqlx::query_scalar(
        "SELECT k.id
         FROM UNNEST($1::uuid[], $2::uuid[], $3::timestamptz[]) AS k(id, tenant_id, scheduled_at)
         JOIN tenants t ON t.id = k.tenant_id
         WHERE NOT t.intake_paused AND (k.scheduled_at <= $4 OR EXISTS (
               SELECT 1 FROM run_intents ri
               WHERE ri.tenant_id = k.tenant_id
                 AND ri.window_start <= k.scheduled_at AND ri.window_end > k.scheduled_at))",
    )
    .bind(created.iter().map(|r| r.id.as_uuid()).collect::<Vec<_>>())
    .bind(
        created
            .iter()
            .map(|r| r.item.reminder.tenant_id.as_uuid())
            .collect::<Vec<_>>(),
    )
    .bind(
        created
            .iter()
            .map(|r| r.item.reminder.scheduled_at)
            .collect::<Vec<_>>(),
    )
    .bind(now)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();

    let mut by_tenant: BTreeMap<uuid::Uuid, Vec<WindowReminder>> = BTreeMap::new();
    let mut counts = HashMap::new();
    for row in created.iter().filter(|r| due.contains(&r.id.as_uuid())) {
        let reminder = &row.item.reminder;
        by_tenant
            .entry(reminder.tenant_id.as_uuid())
            .or_default()
            .push(WindowReminder {
                id: row.id.as_uuid(),
                channels: reminder
                    .channels
                    .iter()
                    .map(|c| c.as_str().to_owned())
                    .collect(),
                scheduled_at: reminder.scheduled_at,
                expires_at: reminder.expires_at,
            });
    }
    // One per channel, less those of a draining channel (withheld until the drain ends).
    for (tenant_id, reminders) in by_tenant {
        for reminder_id in
            inserted_deliveries(tx, TenantId::from_uuid(tenant_id), &reminders, now).await?
        {
            *counts.entry(reminder_id).or_insert(0) += 1;
        }
    }
    Ok(counts)
}

/// On resume: the reminders created while the tenant was paused, and any earlier one still
/// missing a delivery on one of its channels (withheld by a drain that ended while the tenant
/// was paused), whose window already ran (or whose time has come) get their deliveries now;
/// later windows take the rest. A channel still draining stays withheld.
pub(crate) async fn materialise_paused_backlog(
    tx: &mut PgConnection,
    tenant_id: TenantId,
    paused_at: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<u64, LedgerError> {
    let reminders: Vec<WindowReminder> = sqlx::query_as(
        "SELECT r.id, r.channels, r.scheduled_at, r.expires_at FROM reminders r
         WHERE r.tenant_id = $1 AND r.cancelled_at IS NULL
           AND (r.created_at >= $2 OR EXISTS (
                SELECT 1 FROM unnest(r.channels) c
                WHERE NOT EXISTS (SELECT 1 FROM deliveries d
                                  WHERE d.reminder_id = r.id AND d.channel = c)))
           AND (r.scheduled_at <= $3 OR EXISTS (
                SELECT 1 FROM run_intents ri
                WHERE ri.tenant_id = r.tenant_id
                  AND ri.window_start <= r.scheduled_at AND ri.window_end > r.scheduled_at))",
    )
    .bind(tenant_id.as_uuid())
    .bind(paused_at)
    .bind(now)
    .fetch_all(&mut *tx)
    .await?;
    insert_deliveries(tx, tenant_id, &reminders, now).await
}

/// When a channel's drain ends: every reminder of a tenant that is not paused, not cancelled,
/// whose time has come or whose window already ran, and that has no delivery on `channel`,
/// gets it now. Not bounded by the drain's start: a tenant resumed during the drain, or a
/// window caught up during it, withheld work too. Returns the deliveries created.
pub(crate) async fn materialise_withheld(
    tx: &mut PgConnection,
    channel: Channel,
    now: DateTime<Utc>,
) -> Result<u64, LedgerError> {
    let rows: Vec<(uuid::Uuid, uuid::Uuid, DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
        "SELECT r.tenant_id, r.id, r.scheduled_at, r.expires_at FROM reminders r
         JOIN tenants t ON t.id = r.tenant_id AND NOT t.intake_paused
         WHERE $1 = ANY(r.channels) AND r.cancelled_at IS NULL
           AND NOT EXISTS (SELECT 1 FROM deliveries d
                           WHERE d.reminder_id = r.id AND d.channel = $1)
           AND (r.scheduled_at <= $2 OR EXISTS (
                SELECT 1 FROM run_intents ri
                WHERE ri.tenant_id = r.tenant_id
                  AND ri.window_start <= r.scheduled_at AND ri.window_end > r.scheduled_at))",
    )
    .bind(channel.as_str())
    .bind(now)
    .fetch_all(&mut *tx)
    .await?;
    let mut by_tenant: BTreeMap<uuid::Uuid, Vec<WindowReminder>> = BTreeMap::new();
    for (tenant_id, id, scheduled_at, expires_at) in rows {
        by_tenant
            .entry(tenant_id)
            .or_default()
            .push(WindowReminder {
                id,
                channels: vec![channel.as_str().to_owned()],
                scheduled_at,
                expires_at,
            });
    }
    let mut created = 0;
    for (tenant_id, reminders) in by_tenant {
        created += insert_deliveries(tx, TenantId::from_uuid(tenant_id), &reminders, now).await?;
    }
    Ok(created)
}

/// Inserts one delivery per (reminder, channel), skipping those that exist and those of a
/// channel that is draining (withheld until the drain ends), each owned by its channel's owner.
/// The channels' control rows are read `FOR SHARE`: a drain turned on waits for this
/// transaction, and this one for a drain being turned on. The idempotency key comes from the
/// domain, the one place that defines it.
pub(crate) async fn insert_deliveries(
    tx: &mut PgConnection,
    tenant_id: TenantId,
    reminders: &[WindowReminder],
    now: DateTime<Utc>,
) -> Result<u64, LedgerError> {
    Ok(inserted_deliveries(tx, tenant_id, reminders, now)
        .await?
        .len() as u64)
}

/// [`insert_deliveries`], returning the reminder id of each delivery created.
async fn inserted_deliveries(
    tx: &mut PgConnection,
    tenant_id: TenantId,
    reminders: &[WindowReminder],
    now: DateTime<Utc>,
) -> Result<Vec<uuid::Uuid>, LedgerError> {
    let mut ids = Vec::new();
    let mut reminder_ids = Vec::new();
    let mut channels = Vec::new();
    let mut keys = Vec::new();
    let mut scheduled = Vec::new();
    let mut expires = Vec::new();
    for reminder in reminders {
        for channel in &reminder.channels {
            let channel: Channel = channel
                .parse()
                .map_err(|e| LedgerError::corrupt("reminders", e))?;
            let reminder_id = ReminderId::from_uuid(reminder.id);
            ids.push(DeliveryId::new().as_uuid());
            reminder_ids.push(reminder.id);
            channels.push(channel.as_str());
            keys.push(
                IdempotencyKey::for_delivery(reminder_id, channel)
                    .as_str()
                    .to_owned(),
            );
            scheduled.push(reminder.scheduled_at);
            expires.push(reminder.expires_at);
        }
    }
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    // One statement: the channels' control rows are joined and locked `FOR SHARE` by the
    // insert itself (a draining channel's row drops out of the join, and a drain turned on
    // meanwhile is seen once its lock is released). A delivery due now (by `now` and by the
    // database's clock, whichever is earlier: a caller's clock ahead never decides) whose
    // destination opted out, or whose category its subscriber switched off on the channel, is
    // created settled `suppressed` at the database's time (0505, 0506): never claimed, never
    // sent. One due later is created `scheduled` whatever its consent says now: an opt-in
    // before its time must still send it, so its consent is the lease's and the fence's to
    // read, as is any change committed after this.
    let done: Vec<uuid::Uuid> = sqlx::query_scalar(
        "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
                                 scheduled_at, expires_at, next_attempt_at, created_at, updated_at,
                                 owner, settled_at, last_error_reason)
         SELECT d.id, d.reminder_id, $1, d.channel,
                CASE WHEN x.opted_out THEN 'suppressed' ELSE 'scheduled' END, d.key,
                d.scheduled_at, d.expires_at,
                CASE WHEN x.opted_out THEN NULL ELSE d.scheduled_at END, $2, $2, cc.owner,
                CASE WHEN x.opted_out THEN now() END,
                CASE WHEN x.opted_out THEN 'contact_opted_out' END
         FROM UNNEST($3::uuid[], $4::uuid[], $5::text[], $6::text[], $7::timestamptz[],
                     $8::timestamptz[])
              AS d(id, reminder_id, channel, key, scheduled_at, expires_at)
         JOIN channel_controls cc ON cc.channel = d.channel AND NOT cc.draining
         CROSS JOIN LATERAL (
             SELECT d.scheduled_at <= LEAST($2, now()) AND (
                        EXISTS (SELECT 1 FROM contacts c
                                WHERE c.tenant_id = r.tenant_id
                                  AND c.subscriber_ref = r.subscriber_ref
                                  AND c.channel = d.channel
                                  AND (c.opted_out_at IS NOT NULL
                                       OR EXISTS (SELECT 1 FROM destination_consent k
                                                  WHERE k.tenant_id = c.tenant_id
                                                    AND k.channel = c.channel
                                                    AND k.destination_digest
                                                        = c.destination_digest
                                                    AND k.state = 'opted_out')))
                        OR EXISTS (SELECT 1 FROM subscriber_preferences sp
                                   WHERE sp.tenant_id = r.tenant_id
                                     AND sp.subscriber_ref = r.subscriber_ref
                                     AND sp.channel = d.channel AND sp.category = r.category
                                     AND sp.state = 'opted_out')) AS opted_out
             FROM reminders r WHERE r.id = d.reminder_id) x
         FOR SHARE OF cc
         ON CONFLICT (reminder_id, channel) DO NOTHING
         RETURNING reminder_id",
    )
    .bind(tenant_id.as_uuid())
    .bind(now)
    .bind(&ids)
    .bind(&reminder_ids)
    .bind(&channels)
    .bind(&keys)
    .bind(&scheduled)
    .bind(&expires)
    .fetch_all(&mut *tx)
    .await?;
    Ok(done)
}
