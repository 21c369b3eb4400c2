//! The dead-letter listing (`nudgectl dlq list`): dead-lettered and ambiguous deliveries
//! counted by channel, state, reason and age band, a few sample ids per reason, how many are
//! already waiting in an active redrive, and the raw dead-letter records (a message that did
//! not decode has no delivery, so only its record shows it).
//!
//! Read-only, and every count is a `GROUP BY` in PostgreSQL: listing a large dead-letter
//! backlog never fetches its rows. Ages count from `scheduled_at`, in the bands of
//! [`AgeBand`] that the redrive plan uses too.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, DeliveryId, DeliveryState};

use crate::age::{AgeBand, age_band_sql};
use crate::deliveries::parse;
use crate::{Ledger, LedgerError};

/// Sample delivery ids kept per (channel, state, reason).
const SAMPLES: i64 = 3;

/// The dead-lettered and ambiguous deliveries, each state through its own index
/// (`deliveries_settled_by_state_idx`, `deliveries_ambiguous_idx`): a single
/// `state IN ('dead_lettered', 'ambiguous')` has no one index and would read the whole table.
pub(crate) const HELD: &str = "(SELECT * FROM deliveries WHERE state = 'dead_lettered' \
     UNION ALL SELECT * FROM deliveries WHERE state = 'ambiguous')";

/// Dead-lettered and ambiguous deliveries of one channel, state and reason.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DlqGroup {
    pub channel: Channel,
    pub state: DeliveryState,
    /// The delivery's `last_error_reason` (`http_400`, `poison_message: delivery_limit`, ...).
    pub reason: Option<String>,
    pub count: u64,
    /// Counts per age band (bands with none are left out).
    pub by_age: BTreeMap<AgeBand, u64>,
    /// Already waiting in a running or paused redrive (neither fed nor skipped yet): a new
    /// redrive would feed them twice.
    pub redrive_pending: u64,
    /// Up to three of them, the most recently settled first.
    pub sample_ids: Vec<DeliveryId>,
}

/// Raw dead-letter records of one queue and recorder action.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeadLetterCount {
    pub queue: String,
    /// What the recorder did: `delivery_dead_lettered`, or `recorded` (stale, unknown or
    /// undecodable: no delivery changed).
    pub action: String,
    pub count: u64,
    pub latest_recorded_at: DateTime<Utc>,
}

/// What `dlq list` shows.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DlqReport {
    pub now: DateTime<Utc>,
    /// The channel filter, if any.
    pub channel: Option<Channel>,
    /// By channel, state (dead-lettered first), then the largest group first.
    pub deliveries: Vec<DlqGroup>,
    pub dead_letters: Vec<DeadLetterCount>,
}

#[derive(sqlx::FromRow)]
struct GroupRow {
    channel: String,
    state: String,
    reason: Option<String>,
    age_band: String,
    n: i64,
    redrive_pending: i64,
}

#[derive(sqlx::FromRow)]
struct SampleRow {
    channel: String,
    state: String,
    reason: Option<String>,
    id: uuid::Uuid,
}

#[derive(sqlx::FromRow)]
struct DeadLetterRow {
    queue: String,
    action: String,
    n: i64,
    latest: DateTime<Utc>,
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

impl Ledger {
    /// Dead-lettered and ambiguous deliveries (of `channel`, or all), counted as of `now`,
    /// and the dead-letter records.
    pub async fn dlq_report(
        &self,
        channel: Option<Channel>,
        now: DateTime<Utc>,
    ) -> Result<DlqReport, LedgerError> {
        let band = age_band_sql("d.scheduled_at", "$1::timestamptz");
        let rows: Vec<GroupRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT d.channel, d.state, d.last_error_reason AS reason, {band} AS age_band,
                    count(*) AS n,
                    count(*) FILTER (WHERE EXISTS (
                        SELECT 1 FROM redrive_items ri JOIN redrives r ON r.id = ri.redrive_id
                        WHERE ri.delivery_id = d.id AND ri.fed_at IS NULL
                          AND ri.skipped_reason IS NULL AND r.state IN ('running', 'paused')
                    )) AS redrive_pending
             FROM {HELD} d
             WHERE ($2::text IS NULL OR d.channel = $2)
             GROUP BY d.channel, d.state, d.last_error_reason, age_band"
        )))
        .bind(now)
        .bind(channel.map(|c| c.as_str()))
        .fetch_all(&self.pool)
        .await?;
        let samples: Vec<SampleRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT channel, state, reason, id FROM (
                 SELECT channel, state, last_error_reason AS reason, id,
                        row_number() OVER (PARTITION BY channel, state, last_error_reason
                                           ORDER BY settled_at DESC, id) AS rank
                 FROM {HELD} d
                 WHERE ($1::text IS NULL OR channel = $1)
             ) ranked
             WHERE rank <= $2
             ORDER BY channel, state, reason, rank"
        )))
        .bind(channel.map(|c| c.as_str()))
        .bind(SAMPLES)
        .fetch_all(&self.pool)
        .await?;
        // A message whose envelope did not decode may carry no channel: its queue names it.
        let letters: Vec<DeadLetterRow> = sqlx::query_as(
            "SELECT queue, action, count(*) AS n, max(recorded_at) AS latest
             FROM dead_letters
             WHERE $1::text IS NULL OR channel = $1 OR (channel IS NULL AND queue = 'dead.' || $1)
             GROUP BY queue, action
             ORDER BY queue, action",
        )
        .bind(channel.map(|c| c.as_str()))
        .fetch_all(&self.pool)
        .await?;

        type Key = (Channel, DeliveryState, Option<String>);
        let mut groups: BTreeMap<Key, DlqGroup> = BTreeMap::new();
        for row in rows {
            let key: Key = (parse(&row.channel)?, parse(&row.state)?, row.reason);
            let band = AgeBand::parse(&row.age_band)
                .ok_or_else(|| LedgerError::corrupt("deliveries", "unknown age band"))?;
            let group = groups.entry(key.clone()).or_insert_with(|| DlqGroup {
                channel: key.0,
                state: key.1,
                reason: key.2,
                count: 0,
                by_age: BTreeMap::new(),
                redrive_pending: 0,
                sample_ids: Vec::new(),
            });
            group.count += count(row.n);
            group.redrive_pending += count(row.redrive_pending);
            *group.by_age.entry(band).or_default() += count(row.n);
        }
        for row in samples {
            let key: Key = (parse(&row.channel)?, parse(&row.state)?, row.reason);
            if let Some(group) = groups.get_mut(&key) {
                group.sample_ids.push(DeliveryId::from_uuid(row.id));
            }
        }
        let mut deliveries: Vec<DlqGroup> = groups.into_values().collect();
        deliveries.sort_by(|a, b| {
            (a.channel, a.state)
                .cmp(&(b.channel, b.state))
                .then(b.count.cmp(&a.count))
                .then_with(|| a.reason.cmp(&b.reason))
        });
        Ok(DlqReport {
            now,
            channel,
            deliveries,
            dead_letters: letters
                .into_iter()
                .map(|row| DeadLetterCount {
                    queue: row.queue,
                    action: row.action,
                    count: count(row.n),
                    latest_recorded_at: row.latest,
                })
                .collect(),
        })
    }
}
