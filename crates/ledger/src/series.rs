//! Recurring reminders (series): recorded once, expanded into one reminder per occurrence by
//! the producer's window that reaches it (decision 0504), read and cancelled.
//!
//! A series row holds `next_at`, the instant of its first occurrence not created yet. The
//! window `[start, end)` of its tenant creates every occurrence before `end` in the window's
//! own transaction (after its run intent, before it reads its reminders), so the window then
//! materialises their deliveries like any reminder's, a replayed window creates nothing (its
//! intent exists; and an occurrence's event id, `{series_id}/{local date-time}`, is unique),
//! and a series never holds more rows than its occurrences inside the producer's horizon.
//! A series recorded after its tenant's windows ran past its first occurrences creates those
//! in its own transaction, as a reminder does.
//!
//! An occurrence's content is the series' (sealed once, bound to the series' id); the lease
//! reads it from the series unless a reschedule gave the occurrence its own.

use chrono::{DateTime, NaiveDateTime, Utc};
use nudge_domain::series::{Occurrence, Series, SeriesLimits};
use nudge_domain::{
    Channel, DeliveryState, EventId, ExpiresAfter, LocalTime, SubscriberRef, TenantId, Zone,
};
use sqlx::PgConnection;

use crate::audit::{self, Operator};
use crate::contacts::{SubscriberZone, seal_contact, set_subscriber_zones, upsert_contacts};
use crate::crypto::{Destination, DestinationCipher};
use crate::deliveries::LedgerTime;
use crate::reminders::{MAX_CONTENT_BYTES, WindowReminder};
use crate::{Ledger, LedgerError};

/// The longest series id: its occurrences' event ids (`{series_id}/YYYY-MM-DDTHH:MM:SS`) must
/// fit [`EventId::MAX_LEN`].
pub const MAX_SERIES_ID_LEN: usize = EventId::MAX_LEN - 20;

/// How many upcoming occurrences a series' status shows.
pub const SHOWN_OCCURRENCES: usize = 5;

/// What a stored series is read back with: it passed the intake's stricter limits when it was
/// recorded, and must still expand if an operator lowers them later.
const STORED: SeriesLimits = SeriesLimits {
    max_ahead: chrono::TimeDelta::days(100 * 366),
    max_per_day: 24 * 60,
};

/// What sealed series content is bound to: its tenant and the series' id.
pub(crate) fn series_content_aad(tenant_id: TenantId, series_key: uuid::Uuid) -> Vec<u8> {
    format!("series-content:{tenant_id}:{series_key}").into_bytes()
}

/// A series as the clinic app describes it, checked: its rule parsed against the limits, its
/// id fit to name occurrences, at least one channel and none twice.
#[derive(Debug, Clone)]
pub struct NewSeries {
    tenant_id: TenantId,
    series_id: String,
    subscriber_ref: SubscriberRef,
    channels: Vec<Channel>,
    series: Series,
    rule: String,
    expires_after: ExpiresAfter,
    content: Option<Vec<u8>>,
    ignore_quiet_hours: bool,
    category: nudge_domain::Category,
    correlation_id: Option<String>,
    request_digest: Option<Vec<u8>>,
}

impl NewSeries {
    /// `rule` is the text `series` was parsed from, stored as given.
    pub fn new(
        tenant_id: TenantId,
        series_id: &str,
        subscriber_ref: SubscriberRef,
        channels: &[Channel],
        series: Series,
        rule: &str,
        expires_after: ExpiresAfter,
    ) -> Result<Self, LedgerError> {
        check_series_id(series_id)?;
        if channels.is_empty() {
            return Err(LedgerError::InvalidInput(
                "a series needs at least one channel",
            ));
        }
        let mut sorted = channels.to_vec();
        sorted.sort();
        sorted.dedup();
        if sorted.len() != channels.len() {
            return Err(LedgerError::InvalidInput("a channel is listed twice"));
        }
        Ok(Self {
            tenant_id,
            series_id: series_id.to_owned(),
            subscriber_ref,
            channels: sorted,
            series,
            rule: rule.to_owned(),
            expires_after,
            content: None,
            ignore_quiet_hours: false,
            category: nudge_domain::Category::general(),
            correlation_id: None,
            request_digest: None,
        })
    }

    /// Message content for every occurrence: a JSON object of at most [`MAX_CONTENT_BYTES`].
    pub fn with_content(mut self, content: Option<Vec<u8>>) -> Result<Self, LedgerError> {
        if let Some(content) = &content {
            if content.len() > MAX_CONTENT_BYTES {
                return Err(LedgerError::InvalidInput(
                    "content is larger than 16384 bytes",
                ));
            }
            if !matches!(
                serde_json::from_slice::<serde_json::Value>(content),
                Ok(serde_json::Value::Object(_))
            ) {
                return Err(LedgerError::InvalidInput("content must be a JSON object"));
            }
        }
        self.content = content;
        Ok(self)
    }

    pub fn ignoring_quiet_hours(mut self, ignore: bool) -> Self {
        self.ignore_quiet_hours = ignore;
        self
    }

    /// Its occurrences' category (`general` unless given): refused when its tenant does not
    /// have it ([`SeriesOutcome::UnknownCategory`]).
    pub fn with_category(mut self, category: nudge_domain::Category) -> Self {
        self.category = category;
        self
    }

    pub fn category(&self) -> &nudge_domain::Category {
        &self.category
    }

    pub fn with_correlation_id(mut self, id: &str) -> Result<Self, LedgerError> {
        self.correlation_id = Some(crate::reminders::checked_correlation_id(id)?);
        Ok(self)
    }

    /// A digest of the request that posted it: the same series posted again is the same
    /// series only with the same digest.
    pub fn with_request_digest(mut self, digest: Vec<u8>) -> Self {
        self.request_digest = Some(digest);
        self
    }

    pub fn series_id(&self) -> &str {
        &self.series_id
    }

    pub fn tenant_id(&self) -> TenantId {
        self.tenant_id
    }

    pub fn channels(&self) -> &[Channel] {
        &self.channels
    }

    pub fn series(&self) -> &Series {
        &self.series
    }
}

/// A series id: what an event id may be (visible ASCII), short enough to name occurrences.
pub fn check_series_id(series_id: &str) -> Result<(), LedgerError> {
    if series_id.is_empty()
        || series_id.len() > MAX_SERIES_ID_LEN
        || !series_id.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(LedgerError::InvalidInput(
            "a series id is 1 to 180 visible ASCII characters",
        ));
    }
    Ok(())
}

/// An occurrence's event id: the series id and the wall-clock time the rule gave.
pub fn occurrence_event_id(series_id: &str, local: LocalTime) -> Result<EventId, LedgerError> {
    EventId::parse(&format!("{series_id}/{local}"))
        .map_err(|_| LedgerError::InvalidInput("a series id is 1 to 180 visible ASCII characters"))
}

/// Whether an event id has an occurrence's shape (`{series_id}/YYYY-MM-DDTHH:MM:SS`): reserved
/// for the occurrences of series, so a reminder posted on its own can never take the id an
/// occurrence will need (which would leave the occurrence uncreated).
pub fn is_occurrence_event_id(event_id: &EventId) -> bool {
    event_id
        .as_str()
        .rsplit_once('/')
        .is_some_and(|(series, local)| {
            !series.is_empty()
                && local.len() == 19
                && NaiveDateTime::parse_from_str(local, "%Y-%m-%dT%H:%M:%S").is_ok()
        })
}

/// The problem with a reminder's event id that has an occurrence's shape.
pub const RESERVED_EVENT_ID: &str = "ends like a series occurrence's event id \
    ({series_id}/YYYY-MM-DDTHH:MM:SS), which only the occurrences of a series may have";

/// What recording a series did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeriesOutcome {
    /// Recorded now; `occurrences_created` of its occurrences were due before the tenant's
    /// last window's end (or now) and were created with it.
    Created {
        key: uuid::Uuid,
        occurrences_created: u64,
        next_at: Option<DateTime<Utc>>,
    },
    /// The same series (same request) was recorded before.
    AlreadyPresent {
        key: uuid::Uuid,
    },
    /// The series id is used for a different series: nothing written.
    Conflict,
    UnknownTenant,
    /// Its tenant has no such category: nothing written.
    UnknownCategory,
}

/// A series as `GET .../series/{series_id}` and `nudgectl series show` read it: no subscriber,
/// destination or content.
#[derive(Debug, Clone, PartialEq)]
pub struct SeriesStatus {
    pub key: uuid::Uuid,
    pub series_id: String,
    pub channels: Vec<Channel>,
    pub time_zone: String,
    pub start_local: NaiveDateTime,
    pub rrule: String,
    pub expires_after_s: u32,
    pub created_at: DateTime<Utc>,
    pub cancelled_at: Option<DateTime<Utc>>,
    /// The first occurrence not created yet (none: all created, or cancelled).
    pub next_at: Option<DateTime<Utc>>,
    pub occurrences_created: u64,
    /// Occurrences with a delivery that went to a provider (sent, delivered or maybe sent).
    pub occurrences_sent: u64,
    /// Up to [`SHOWN_OCCURRENCES`] occurrences from now on, created or not (none once
    /// cancelled, or when it cannot be expanded).
    pub upcoming: Vec<Occurrence>,
    /// Its stored zone or rule no longer parses (a zone this build's tz database lacks): its
    /// occurrences wait (0504).
    pub unexpandable: bool,
}

/// A series in `nudgectl series list`.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct SeriesSummary {
    pub series_id: String,
    pub time_zone: String,
    pub created_at: DateTime<Utc>,
    pub cancelled_at: Option<DateTime<Utc>>,
    pub next_at: Option<DateTime<Utc>>,
    pub occurrences_created: i32,
}

/// What cancelling a series did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeriesCancellation {
    /// Occurrences created and not sent, cancelled now (with their deliveries).
    pub occurrences_cancelled: u64,
    pub deliveries_cancelled: u64,
    /// Occurrences a provider was already given (sent, delivered, or a send in flight).
    pub occurrences_sent: u64,
    /// It had been cancelled before: nothing changed.
    pub already_cancelled: bool,
}

#[derive(sqlx::FromRow)]
struct StoredSeries {
    id: uuid::Uuid,
    series_id: String,
    subscriber_ref: String,
    channels: Vec<String>,
    time_zone: String,
    start_local: NaiveDateTime,
    rrule: String,
    expires_after_s: i32,
    ignore_quiet_hours: bool,
    category: String,
    correlation_id: Option<String>,
    next_at: Option<DateTime<Utc>>,
    next_local: Option<NaiveDateTime>,
}

impl StoredSeries {
    fn series(&self) -> Result<Series, LedgerError> {
        let zone = Zone::parse(&self.time_zone)
            .map_err(|_| LedgerError::corrupt("series", "a zone the tz database lacks"))?;
        let start = LocalTime::new(self.start_local)
            .map_err(|_| LedgerError::corrupt("series", "start_local"))?;
        Series::parse(&self.rrule, start, zone, &STORED)
            .map_err(|_| LedgerError::corrupt("series", "a rule that no longer parses"))
    }
}

const STORED_COLUMNS: &str = "id, series_id, subscriber_ref, channels, time_zone, start_local, \
                              rrule, expires_after_s, ignore_quiet_hours, category, correlation_id, \
                              next_at, next_local";

impl Ledger {
    /// Records a series, idempotently on `(tenant, series_id)`, with the subscriber's
    /// destinations (encrypted) and the series' zone as the subscriber's, in one transaction.
    /// Its occurrences from now until the tenant's last window's end are created with it (and
    /// get their deliveries unless the tenant is paused: its resume takes them); later ones
    /// are created by the windows that reach them.
    pub async fn create_series(
        &self,
        new: &NewSeries,
        contacts: &[(Channel, Destination)],
        cipher: &DestinationCipher,
        now: DateTime<Utc>,
    ) -> Result<SeriesOutcome, LedgerError> {
        let mut tx = self.pool.begin().await?;
        // Shared with reminder creations, exclusive with the tenant's window (0403).
        let tenant: Option<(bool, bool)> = sqlx::query_as(
            "SELECT t.intake_paused,
                    $2 = 'general' OR EXISTS (SELECT 1 FROM categories c
                                             WHERE c.tenant_id = t.id AND c.name = $2)
             FROM tenants t WHERE t.id = $1 FOR SHARE OF t",
        )
        .bind(new.tenant_id.as_uuid())
        .bind(new.category.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let Some((paused, category_known)) = tenant else {
            return Ok(SeriesOutcome::UnknownTenant);
        };
        if !category_known {
            return Ok(SeriesOutcome::UnknownCategory);
        }
        let key = uuid::Uuid::now_v7();
        let stored_ref = cipher.stored_ref(new.tenant_id, &new.subscriber_ref)?;
        let content = new
            .content
            .as_deref()
            .map(|c| cipher.seal(c, &series_content_aad(new.tenant_id, key)))
            .transpose()?;
        let channels: Vec<&str> = new.channels.iter().map(|c| c.as_str()).collect();
        let inserted: Option<uuid::Uuid> = sqlx::query_scalar(
            "INSERT INTO series (id, tenant_id, series_id, subscriber_ref, channels,
                                 content_ciphertext, time_zone, start_local, rrule,
                                 expires_after_s, ignore_quiet_hours, correlation_id,
                                 request_digest, created_at, category)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
             ON CONFLICT (tenant_id, series_id) DO NOTHING
             RETURNING id",
        )
        .bind(key)
        .bind(new.tenant_id.as_uuid())
        .bind(&new.series_id)
        .bind(&stored_ref)
        .bind(&channels)
        .bind(content.as_deref())
        .bind(new.series.zone().name())
        .bind(new.series.start().naive())
        .bind(&new.rule)
        .bind(i32::try_from(new.expires_after.secs()).unwrap_or(i32::MAX))
        .bind(new.ignore_quiet_hours)
        .bind(new.correlation_id.as_deref())
        .bind(new.request_digest.as_deref())
        .bind(now)
        .bind(new.category.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        if inserted.is_none() {
            let (existing, digest): (uuid::Uuid, Option<Vec<u8>>) = sqlx::query_as(
                "SELECT id, request_digest FROM series WHERE tenant_id = $1 AND series_id = $2",
            )
            .bind(new.tenant_id.as_uuid())
            .bind(&new.series_id)
            .fetch_one(&mut *tx)
            .await?;
            let same = digest.is_some() && digest == new.request_digest;
            return Ok(if same {
                SeriesOutcome::AlreadyPresent { key: existing }
            } else {
                SeriesOutcome::Conflict
            });
        }

        let mut sealed = Vec::with_capacity(contacts.len());
        for (channel, destination) in contacts {
            if destination.expose().len() > crate::reminders::MAX_DESTINATION_BYTES {
                return Err(LedgerError::InvalidInput(
                    "a destination is larger than 1024 bytes",
                ));
            }
            sealed.push(
                seal_contact(
                    cipher,
                    new.tenant_id,
                    stored_ref.clone(),
                    *channel,
                    destination,
                )?
                .with_time_zone(Some(new.series.zone())),
            );
        }
        upsert_contacts(&mut tx, &sealed, now).await?;
        set_subscriber_zones(
            &mut tx,
            &[SubscriberZone {
                tenant_id: new.tenant_id.as_uuid(),
                stored_ref: stored_ref.clone(),
                zone: new.series.zone(),
            }],
        )
        .await?;

        // What the windows already passed (or now, if they are behind) is created here.
        let last_end: Option<DateTime<Utc>> =
            sqlx::query_scalar("SELECT max(window_end) FROM run_intents WHERE tenant_id = $1")
                .bind(new.tenant_id.as_uuid())
                .fetch_one(&mut *tx)
                .await?;
        let reached = last_end.map_or(now, |end| end.max(now));
        let stored = StoredSeries {
            id: key,
            series_id: new.series_id.clone(),
            subscriber_ref: stored_ref,
            channels: channels.iter().map(|c| (*c).to_owned()).collect(),
            time_zone: new.series.zone().name().to_owned(),
            start_local: new.series.start().naive(),
            rrule: new.rule.clone(),
            expires_after_s: i32::try_from(new.expires_after.secs()).unwrap_or(i32::MAX),
            ignore_quiet_hours: new.ignore_quiet_hours,
            category: new.category.as_str().to_owned(),
            correlation_id: new.correlation_id.clone(),
            next_at: None,
            next_local: None,
        };
        let occurrences = new.series.between(now, reached);
        let created =
            insert_occurrences(&mut tx, new.tenant_id, &stored, &occurrences, now).await?;
        let next = new.series.next_from(reached);
        let next_at = next.map(|o| o.instant());
        advance(&mut tx, key, next, created.len()).await?;
        if !paused {
            crate::reminders::insert_deliveries(&mut tx, new.tenant_id, &created, now).await?;
        }
        tx.commit().await?;
        Ok(SeriesOutcome::Created {
            key,
            occurrences_created: created.len() as u64,
            next_at,
        })
    }

    /// A series as the clinic may read it (no subscriber, destination or content), with its
    /// next occurrences from `now`; `None` when the tenant has no such series.
    pub async fn series_status(
        &self,
        tenant_id: TenantId,
        series_id: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<SeriesStatus>, LedgerError> {
        #[derive(sqlx::FromRow)]
        struct Row {
            id: uuid::Uuid,
            series_id: String,
            channels: Vec<String>,
            time_zone: String,
            start_local: NaiveDateTime,
            rrule: String,
            expires_after_s: i32,
            created_at: DateTime<Utc>,
            cancelled_at: Option<DateTime<Utc>>,
            next_at: Option<DateTime<Utc>>,
            occurrences_created: i32,
            occurrences_sent: i64,
        }
        let row: Option<Row> = sqlx::query_as(
            "SELECT s.id, s.series_id, s.channels, s.time_zone, s.start_local, s.rrule,
                    s.expires_after_s, s.created_at, s.cancelled_at, s.next_at,
                    s.occurrences_created,
                    (SELECT count(DISTINCT r.id) FROM reminders r
                     JOIN deliveries d ON d.reminder_id = r.id
                     WHERE r.series_key = s.id
                       AND (d.send_started_at IS NOT NULL
                            OR d.state IN ('delivered', 'ambiguous'))) AS occurrences_sent
             FROM series s WHERE s.tenant_id = $1 AND s.series_id = $2",
        )
        .bind(tenant_id.as_uuid())
        .bind(series_id)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let mut channels = Vec::with_capacity(row.channels.len());
        for name in &row.channels {
            channels.push(
                name.parse()
                    .map_err(|_| LedgerError::corrupt("series", "unknown channel"))?,
            );
        }
        // A series whose stored zone or rule no longer parses is shown as such, not refused.
        let parsed = LocalTime::new(row.start_local)
            .ok()
            .zip(Zone::parse(&row.time_zone).ok())
            .and_then(|(start, zone)| Series::parse(&row.rrule, start, zone, &STORED).ok());
        let unexpandable = parsed.is_none();
        let upcoming = match parsed {
            Some(series) if row.cancelled_at.is_none() => series.upcoming(now, SHOWN_OCCURRENCES),
            _ => Vec::new(),
        };
        Ok(Some(SeriesStatus {
            key: row.id,
            series_id: row.series_id,
            channels,
            time_zone: row.time_zone,
            start_local: row.start_local,
            rrule: row.rrule,
            expires_after_s: u32::try_from(row.expires_after_s).unwrap_or(0),
            created_at: row.created_at,
            cancelled_at: row.cancelled_at,
            next_at: row.next_at,
            occurrences_created: u64::try_from(row.occurrences_created).unwrap_or(0),
            occurrences_sent: u64::try_from(row.occurrences_sent).unwrap_or(0),
            upcoming,
            unexpandable,
        }))
    }

    /// A tenant's series, newest first, at most `limit`.
    pub async fn list_series(
        &self,
        tenant_id: TenantId,
        limit: u32,
    ) -> Result<Vec<SeriesSummary>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT series_id, time_zone, created_at, cancelled_at, next_at, occurrences_created
             FROM series WHERE tenant_id = $1 ORDER BY created_at DESC, series_id LIMIT $2",
        )
        .bind(tenant_id.as_uuid())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?)
    }

    /// Cancels a series: no occurrence is created any more, and every occurrence created and
    /// not sent is cancelled with its owed deliveries (as a reminder's cancel does, each
    /// delivery under its lock: one whose send started is left to finish and counted as
    /// sent). `None` when the tenant has no such series. Audited when an operator did it.
    pub async fn cancel_series(
        &self,
        tenant_id: TenantId,
        series_id: &str,
        by: Option<&Operator>,
        at: LedgerTime,
    ) -> Result<Option<SeriesCancellation>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let row: Option<(uuid::Uuid, bool, DateTime<Utc>)> = sqlx::query_as(
            "WITH before AS (
                 SELECT id, cancelled_at IS NOT NULL AS cancelled FROM series
                 WHERE tenant_id = $1 AND series_id = $2 FOR UPDATE)
             UPDATE series s SET cancelled_at = COALESCE(s.cancelled_at, $3, now()),
                                 next_at = NULL, next_local = NULL
             FROM before b WHERE s.id = b.id
             RETURNING s.id, b.cancelled, COALESCE($3, now())",
        )
        .bind(tenant_id.as_uuid())
        .bind(series_id)
        .bind(at.bind())
        .fetch_optional(&mut *tx)
        .await?;
        let Some((key, already_cancelled, now)) = row else {
            return Ok(None);
        };
        let open: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT id FROM reminders WHERE series_key = $1 AND cancelled_at IS NULL
             ORDER BY id FOR NO KEY UPDATE",
        )
        .bind(key)
        .fetch_all(&mut *tx)
        .await?;
        let (mut occurrences_cancelled, mut deliveries_cancelled) = (0u64, 0u64);
        let mut cancelled_reminders = Vec::new();
        for reminder in open {
            let locked = crate::reschedule::lock_deliveries(&mut tx, reminder).await?;
            let mut movable = Vec::new();
            let mut started = false;
            for delivery in &locked {
                let found = delivery.found()?;
                if found.movable() {
                    movable.push(delivery.id);
                } else if !matches!(
                    found.state,
                    DeliveryState::Cancelled | DeliveryState::Expired | DeliveryState::Suppressed
                ) {
                    started = true;
                }
            }
            crate::reschedule::cancel_locked(&mut tx, &movable, "cancelled_by_client", now).await?;
            deliveries_cancelled += movable.len() as u64;
            cancelled_reminders.push(reminder);
            if !started {
                occurrences_cancelled += 1;
            }
        }
        sqlx::query("UPDATE reminders SET cancelled_at = $2 WHERE id = ANY($1)")
            .bind(&cancelled_reminders)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        let occurrences_sent: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT r.id) FROM reminders r
             JOIN deliveries d ON d.reminder_id = r.id
             WHERE r.series_key = $1
               AND (d.send_started_at IS NOT NULL OR d.state IN ('delivered', 'ambiguous'))",
        )
        .bind(key)
        .fetch_one(&mut *tx)
        .await?;
        let cancellation = SeriesCancellation {
            occurrences_cancelled,
            deliveries_cancelled,
            occurrences_sent: u64::try_from(occurrences_sent).unwrap_or(0),
            already_cancelled,
        };
        if let Some(by) = by {
            let mut entry = by.entry(
                "series_cancel",
                format!("series:{key}"),
                serde_json::json!({
                    "occurrences_cancelled": cancellation.occurrences_cancelled,
                    "deliveries_cancelled": cancellation.deliveries_cancelled,
                    "occurrences_sent": cancellation.occurrences_sent,
                }),
            );
            entry.at = now;
            audit::insert(&mut tx, &entry).await?;
        }
        tx.commit().await?;
        Ok(Some(cancellation))
    }
}

/// What a window's expansion did.
#[derive(Default)]
pub(crate) struct Expanded {
    pub(crate) occurrences_created: u64,
    /// Series whose stored rule or zone no longer parses (a zone the tz database dropped):
    /// left where they are, for the producer to report.
    pub(crate) unexpandable: u64,
    /// Occurrences created due before the window's start (a newer tz database moved them
    /// earlier, or a series mended after it could not be expanded): the window's read does
    /// not reach them, so the window gives them their deliveries itself.
    pub(crate) early: Vec<WindowReminder>,
}

/// Series a window expands at a time (its memory is bounded by this, not by how many of the
/// tenant's series have an occurrence in it).
const EXPAND_BATCH: i64 = 1_000;

/// The window's part (`Ledger::materialise_window`, after its run intent): every occurrence
/// of the tenant's series before `end` that is not created yet is created now, and each series'
/// next occurrence moves past `end`. The expansion resumes from the wall-clock time stored
/// (`next_local`) resolved under this build's tz rules, or the stored instant if that is
/// earlier, so a rule change cannot skip an occurrence. A series whose stored rule or zone no
/// longer parses is left where it is, so it does not hold the tenant's window, and counted for
/// the producer's error log and metric. Series are read [`EXPAND_BATCH`] at a time, in id order
/// (the order every other writer of several series locks them in).
pub(crate) async fn expand_series(
    tx: &mut PgConnection,
    tenant_id: TenantId,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<Expanded, LedgerError> {
    let mut expanded = Expanded::default();
    let mut after = uuid::Uuid::nil();
    loop {
        let rows: Vec<StoredSeries> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {STORED_COLUMNS} FROM series
             WHERE tenant_id = $1 AND next_at IS NOT NULL AND next_at < $2 AND id > $3
             ORDER BY id LIMIT {EXPAND_BATCH} FOR NO KEY UPDATE"
        )))
        .bind(tenant_id.as_uuid())
        .bind(end)
        .bind(after)
        .fetch_all(&mut *tx)
        .await?;
        let Some(last) = rows.last() else {
            break;
        };
        after = last.id;
        let full = rows.len() == usize::try_from(EXPAND_BATCH).unwrap_or(usize::MAX);
        for row in rows {
            let Some(stored_at) = row.next_at else {
                continue;
            };
            let Ok(series) = row.series() else {
                expanded.unexpandable += 1;
                continue;
            };
            let from = row
                .next_local
                .and_then(|n| LocalTime::new(n).ok())
                .map_or(stored_at, |local| {
                    series.zone().resolve(local).instant.min(stored_at)
                });
            let occurrences = series.between(from, end);
            let inserted = insert_occurrences(tx, tenant_id, &row, &occurrences, now).await?;
            advance(tx, row.id, series.next_from(end), inserted.len()).await?;
            expanded.occurrences_created += inserted.len() as u64;
            expanded
                .early
                .extend(inserted.into_iter().filter(|r| r.scheduled_at < start));
        }
        if !full {
            break;
        }
    }
    Ok(expanded)
}

/// Creates the given occurrences of a series as reminders (an occurrence that exists is kept
/// as it is) and returns those created, for their deliveries.
async fn insert_occurrences(
    tx: &mut PgConnection,
    tenant_id: TenantId,
    series: &StoredSeries,
    occurrences: &[Occurrence],
    now: DateTime<Utc>,
) -> Result<Vec<WindowReminder>, LedgerError> {
    if occurrences.is_empty() {
        return Ok(Vec::new());
    }
    let lifetime = chrono::TimeDelta::seconds(i64::from(series.expires_after_s));
    let mut ids = Vec::with_capacity(occurrences.len());
    let mut event_ids = Vec::with_capacity(occurrences.len());
    let mut scheduled = Vec::with_capacity(occurrences.len());
    let mut expires = Vec::with_capacity(occurrences.len());
    for o in occurrences {
        ids.push(uuid::Uuid::now_v7());
        event_ids.push(
            occurrence_event_id(&series.series_id, o.local)?
                .as_str()
                .to_owned(),
        );
        scheduled.push(o.instant());
        expires.push(o.instant() + lifetime);
    }
    let created: Vec<WindowReminder> = sqlx::query_as(
        "INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, subscriber_ref_keyed,
                                channels, scheduled_at, expires_at, created_at, correlation_id,
                                revision, ignore_quiet_hours, series_key, content_from_series,
                                category)
         SELECT o.id, $1, o.event_id, $2, true, $3, o.scheduled_at, o.expires_at, $4, $5, 0,
                $6, $7, true, $12
         FROM UNNEST($8::uuid[], $9::text[], $10::timestamptz[], $11::timestamptz[])
              AS o(id, event_id, scheduled_at, expires_at)
         ORDER BY o.event_id
         ON CONFLICT (tenant_id, event_id) DO NOTHING
         RETURNING id, channels, scheduled_at, expires_at",
    )
    .bind(tenant_id.as_uuid())
    .bind(&series.subscriber_ref)
    .bind(&series.channels)
    .bind(now)
    .bind(series.correlation_id.as_deref())
    .bind(series.ignore_quiet_hours)
    .bind(series.id)
    .bind(&ids)
    .bind(&event_ids)
    .bind(&scheduled)
    .bind(&expires)
    .bind(&series.category)
    .fetch_all(&mut *tx)
    .await?;
    Ok(created)
}

async fn advance(
    tx: &mut PgConnection,
    key: uuid::Uuid,
    next: Option<Occurrence>,
    created: usize,
) -> Result<(), LedgerError> {
    sqlx::query(
        "UPDATE series SET next_at = $2, next_local = $3,
                           occurrences_created = occurrences_created + $4
         WHERE id = $1 AND cancelled_at IS NULL",
    )
    .bind(key)
    .bind(next.map(|o| o.instant()))
    .bind(next.map(|o| o.local.naive()))
    .bind(i32::try_from(created).unwrap_or(i32::MAX))
    .execute(&mut *tx)
    .await?;
    Ok(())
}
