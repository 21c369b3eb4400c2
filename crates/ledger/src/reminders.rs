use chrono::{DateTime, Utc};
use nudge_domain::{
    Channel, DeliveryId, EventId, IdempotencyKey, ReminderId, SubscriberRef, TenantId,
};
use sqlx::PgConnection;

use crate::contacts::upsert_contact;
use crate::crypto::{Destination, DestinationCipher};
use crate::{Ledger, LedgerError};

/// A reminder as the clinic app describes it, checked: at least one channel, no channel
/// twice, and an expiry after its schedule. Construct with [`NewReminder::new`].
#[derive(Debug, Clone)]
pub struct NewReminder {
    tenant_id: TenantId,
    event_id: EventId,
    subscriber_ref: SubscriberRef,
    channels: Vec<Channel>,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    content: Option<Vec<u8>>,
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
        })
    }

    /// Message content (template parameters). Stored encrypted; never logged.
    pub fn with_content(mut self, content: Vec<u8>) -> Self {
        self.content = Some(content);
        self
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
    /// First run of this window: the run intent was written with this many new deliveries.
    Materialised { deliveries_created: u64 },
    /// The window had run before: nothing was created.
    AlreadyRun,
    /// The tenant's intake is paused: no run intent, so the window runs after resume.
    Paused,
}

pub(crate) fn content_aad(tenant_id: TenantId, reminder_id: ReminderId) -> Vec<u8> {
    format!("content:{tenant_id}:{reminder_id}").into_bytes()
}

/// A reminder as the producer reads it to materialise deliveries.
#[derive(sqlx::FromRow)]
struct WindowReminder {
    id: uuid::Uuid,
    channels: Vec<String>,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct ExistingReminder {
    id: uuid::Uuid,
    subscriber_ref: String,
    channels: Vec<String>,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
}

fn unknown_tenant(tenant_id: TenantId) -> impl FnOnce(sqlx::Error) -> LedgerError {
    move |e| match &e {
        sqlx::Error::Database(db) if db.is_foreign_key_violation() => {
            LedgerError::UnknownTenant(tenant_id.as_uuid())
        }
        _ => LedgerError::Database(e),
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
        let mut tx = self.pool.begin().await?;
        for (channel, destination) in contacts {
            upsert_contact(
                &mut tx,
                reminder.tenant_id,
                &reminder.subscriber_ref,
                *channel,
                destination,
                cipher,
                now,
            )
            .await?;
        }
        let created = create_reminder_in(&mut tx, reminder, cipher, now).await?;
        tx.commit().await?;
        Ok(created)
    }

    /// Marks a reminder cancelled and settles its owed deliveries as `cancelled`. A delivery
    /// already being sent finishes; one already settled keeps its state. Returns the number
    /// of deliveries cancelled, or None when the event is unknown.
    pub async fn cancel_reminder(
        &self,
        tenant_id: TenantId,
        event_id: &EventId,
        now: DateTime<Utc>,
    ) -> Result<Option<u64>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let id: Option<uuid::Uuid> = sqlx::query_scalar(
            "UPDATE reminders SET cancelled_at = COALESCE(cancelled_at, $3)
             WHERE tenant_id = $1 AND event_id = $2 RETURNING id",
        )
        .bind(tenant_id.as_uuid())
        .bind(event_id.as_str())
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(id) = id else {
            return Ok(None);
        };
        let cancelled = sqlx::query(
            "UPDATE deliveries
             SET state = 'cancelled', settled_at = $2, updated_at = $2, next_attempt_at = NULL,
                 last_error_reason = 'cancelled_by_client'
             WHERE reminder_id = $1 AND state IN ('scheduled', 'queued', 'retry_wait')",
        )
        .bind(id)
        .bind(now)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(Some(cancelled))
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
        let paused: Option<bool> =
            sqlx::query_scalar("SELECT intake_paused FROM tenants WHERE id = $1 FOR UPDATE")
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

        let reminders: Vec<WindowReminder> = sqlx::query_as(
            "SELECT id, channels, scheduled_at, expires_at FROM reminders
             WHERE tenant_id = $1 AND scheduled_at >= $2 AND scheduled_at < $3
               AND cancelled_at IS NULL",
        )
        .bind(tenant_id.as_uuid())
        .bind(start)
        .bind(end)
        .fetch_all(&mut *tx)
        .await?;
        let created = insert_deliveries(&mut tx, tenant_id, &reminders, now).await?;
        sqlx::query("UPDATE run_intents SET deliveries_created = $2 WHERE id = $1")
            .bind(intent)
            .bind(i32::try_from(created).unwrap_or(i32::MAX))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(WindowOutcome::Materialised {
            deliveries_created: created,
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
    /// paused, not cancelled, whose time came between `since` and `now - grace`, yet that have
    /// no delivery at all. Each one gets its deliveries (they then send, or expire, visibly);
    /// returns how many reminders were repaired, which should always be 0.
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
               AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.reminder_id = r.id)
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

async fn create_reminder_in(
    tx: &mut PgConnection,
    reminder: &NewReminder,
    cipher: &DestinationCipher,
    now: DateTime<Utc>,
) -> Result<CreatedReminder, LedgerError> {
    // Shared with other creations, exclusive with a producer window: see materialise_window.
    let known: Option<bool> =
        sqlx::query_scalar("SELECT true FROM tenants WHERE id = $1 FOR SHARE")
            .bind(reminder.tenant_id.as_uuid())
            .fetch_optional(&mut *tx)
            .await?;
    if known.is_none() {
        return Err(LedgerError::UnknownTenant(reminder.tenant_id.as_uuid()));
    }
    let id = ReminderId::new();
    let content = reminder
        .content
        .as_deref()
        .map(|c| cipher.seal(c, &content_aad(reminder.tenant_id, id)))
        .transpose()?;
    let channels: Vec<&str> = reminder.channels.iter().map(|c| c.as_str()).collect();
    let inserted: Option<uuid::Uuid> = sqlx::query_scalar(
        "INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels,
                                content_ciphertext, scheduled_at, expires_at, created_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
         ON CONFLICT (tenant_id, event_id) DO NOTHING
         RETURNING id",
    )
    .bind(id.as_uuid())
    .bind(reminder.tenant_id.as_uuid())
    .bind(reminder.event_id.as_str())
    .bind(reminder.subscriber_ref.as_str())
    .bind(&channels)
    .bind(content)
    .bind(reminder.scheduled_at)
    .bind(reminder.expires_at)
    .bind(now)
    .fetch_optional(&mut *tx)
    .await
    .map_err(unknown_tenant(reminder.tenant_id))?;

    if inserted.is_some() {
        // Would a producer window still pick it up? If not, materialise it now.
        let materialise_now: bool = sqlx::query_scalar(
            "SELECT NOT t.intake_paused AND ($2 <= $3 OR EXISTS (
                 SELECT 1 FROM run_intents ri
                 WHERE ri.tenant_id = t.id AND ri.window_start <= $2 AND ri.window_end > $2))
             FROM tenants t WHERE t.id = $1",
        )
        .bind(reminder.tenant_id.as_uuid())
        .bind(reminder.scheduled_at)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let deliveries_created = if materialise_now {
            let row = WindowReminder {
                id: id.as_uuid(),
                channels: channels.iter().map(|c| (*c).to_owned()).collect(),
                scheduled_at: reminder.scheduled_at,
                expires_at: reminder.expires_at,
            };
            insert_deliveries(tx, reminder.tenant_id, &[row], now).await?
        } else {
            0
        };
        return Ok(CreatedReminder {
            id,
            created: true,
            deliveries_created,
        });
    }

    let existing: ExistingReminder = sqlx::query_as(
        "SELECT id, subscriber_ref, channels, scheduled_at, expires_at
         FROM reminders WHERE tenant_id = $1 AND event_id = $2",
    )
    .bind(reminder.tenant_id.as_uuid())
    .bind(reminder.event_id.as_str())
    .fetch_one(&mut *tx)
    .await?;
    let mut existing_channels = existing.channels.clone();
    existing_channels.sort();
    let mut wanted: Vec<String> = channels.iter().map(|c| (*c).to_owned()).collect();
    wanted.sort();
    let same = existing.subscriber_ref == reminder.subscriber_ref.as_str()
        && existing_channels == wanted
        && existing.scheduled_at == reminder.scheduled_at
        && existing.expires_at == reminder.expires_at;
    if same {
        Ok(CreatedReminder {
            id: ReminderId::from_uuid(existing.id),
            created: false,
            deliveries_created: 0,
        })
    } else {
        Err(LedgerError::EventConflict {
            tenant_id: reminder.tenant_id.as_uuid(),
        })
    }
}

/// On resume: the reminders created while the tenant was paused whose window already ran (or
/// whose time has come) get their deliveries now; later windows take the rest.
pub(crate) async fn materialise_paused_backlog(
    tx: &mut PgConnection,
    tenant_id: TenantId,
    paused_at: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<u64, LedgerError> {
    let reminders: Vec<WindowReminder> = sqlx::query_as(
        "SELECT r.id, r.channels, r.scheduled_at, r.expires_at FROM reminders r
         WHERE r.tenant_id = $1 AND r.created_at >= $2 AND r.cancelled_at IS NULL
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

/// Inserts one delivery per (reminder, channel), skipping those that exist. The idempotency
/// key comes from the domain, the one place that defines it.
async fn insert_deliveries(
    tx: &mut PgConnection,
    tenant_id: TenantId,
    reminders: &[WindowReminder],
    now: DateTime<Utc>,
) -> Result<u64, LedgerError> {
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
        return Ok(0);
    }
    let done = sqlx::query(
        "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
                                 scheduled_at, expires_at, next_attempt_at, created_at, updated_at)
         SELECT d.id, d.reminder_id, $1, d.channel, 'scheduled', d.key,
                d.scheduled_at, d.expires_at, d.scheduled_at, $2, $2
         FROM UNNEST($3::uuid[], $4::uuid[], $5::text[], $6::text[], $7::timestamptz[], $8::timestamptz[])
              AS d(id, reminder_id, channel, key, scheduled_at, expires_at)
         ON CONFLICT (reminder_id, channel) DO NOTHING",
    )
    .bind(tenant_id.as_uuid())
    .bind(now)
    .bind(&ids)
    .bind(&reminder_ids)
    .bind(&channels)
    .bind(&keys)
    .bind(&scheduled)
    .bind(&expires)
    .execute(&mut *tx)
    .await?;
    Ok(done.rows_affected())
}
