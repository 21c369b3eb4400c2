//! Redrive: dead-lettered work sent again, as a change with a budget.
//!
//! [`Ledger::plan_redrive`] (the dry run) and [`Ledger::execute_redrive`] select with the same
//! statement, so what a dry run counts is what an execute at the same instant freezes. An
//! execute writes a `redrives` row (filters, rate, counts, operator, incident) and one numbered
//! `redrive_items` row per selected delivery, and moves nothing yet. The janitor calls
//! [`Ledger::redrive_tick`] on its interval: per running redrive it first checks the
//! auto-pause rules and the canary, then feeds the next items at the redrive's rate. A fed
//! delivery goes from `dead_lettered` to `retry_wait` in the `redrive` lane with its id,
//! idempotency key and attempt history unchanged; its next attempt is a new attempt numbered
//! after the old ones, and the retry policy's limit counts from there (`attempt_base`). From
//! then on it is ordinary owed work: the relay publishes it, and the worker admits it through
//! its bucket's recovery share, behind the reserve for new work.
//!
//! Selection, in this order of exclusion: `ambiguous` (never resent automatically), already
//! waiting in an active redrive, expired, tenant paused, older than `max_age` (counted from
//! `scheduled_at`), would expire before its turn at the redrive's rate, over the limit. The
//! eligible go earliest deadline first; the k-th (from 1) has its turn at `now + (k - 1) / rate`
//! (`nudge_domain::drain::turn_at`).
//!
//! Pacing lives in the row (`fed_until`), so a janitor that crashes loses nothing and several
//! replicas take turns (the row is locked with `SKIP LOCKED`). No credit builds up while the
//! redrive is paused, and a janitor that was away gets at most five seconds' worth.
//!
//! Only the handle's sender's dead letters are selected and fed (`deliveries.owner`); the
//! new-work rule looks at that sender's new work only.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, RedriveId, TenantId, drain};
use sqlx::PgConnection;

use crate::age::{AgeBand, age_band_sql};
use crate::deliveries::LedgerTime;
use crate::{Ledger, LedgerError, Operator, audit};

/// Which dead letters a redrive takes.
#[derive(Debug, Clone, PartialEq)]
pub struct RedriveFilter {
    pub channel: Channel,
    pub tenant: Option<TenantId>,
    /// Leave out reminders scheduled longer ago than this.
    pub max_age: Option<Duration>,
    /// Take at most this many (earliest deadline first).
    pub limit: Option<u32>,
}

/// An operator's change of a redrive: its audit action, the states it applies to, the
/// statement (binds: `$1` id, `$2` pause reason, `$3` the time or NULL for the database's).
struct RedriveChange<'a> {
    action: &'a str,
    from: &'a [RedriveState],
    sql: &'static str,
    pause_reason: Option<String>,
}

/// Why a dead-lettered or ambiguous delivery is not redriven.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Exclusion {
    /// Held for review: it may have been sent, so it is never resent automatically.
    Ambiguous,
    /// Waiting for its turn in a redrive that is running or paused.
    AlreadyInRedrive,
    Expired,
    TenantPaused,
    OlderThanMaxAge,
    /// Its expiry comes before its turn at the redrive's rate.
    WouldExpireBeforeTurn,
    OverLimit,
}

impl Exclusion {
    pub const ALL: [Exclusion; 7] = [
        Exclusion::Ambiguous,
        Exclusion::AlreadyInRedrive,
        Exclusion::Expired,
        Exclusion::TenantPaused,
        Exclusion::OlderThanMaxAge,
        Exclusion::WouldExpireBeforeTurn,
        Exclusion::OverLimit,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Exclusion::Ambiguous => "ambiguous",
            Exclusion::AlreadyInRedrive => "already_in_redrive",
            Exclusion::Expired => "expired",
            Exclusion::TenantPaused => "tenant_paused",
            Exclusion::OlderThanMaxAge => "older_than_max_age",
            Exclusion::WouldExpireBeforeTurn => "would_expire_before_turn",
            Exclusion::OverLimit => "over_limit",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        Exclusion::ALL.into_iter().find(|e| e.as_str() == name)
    }
}

/// A stored failure reason and how many eligible deliveries carry it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReasonCount {
    pub reason: String,
    pub count: u64,
}

/// What a redrive would take (dry run) or took (execute).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RedrivePlan {
    pub channel: Channel,
    /// The instant the selection was made, by the ledger's clock.
    pub now: DateTime<Utc>,
    pub rate_per_second: f64,
    pub eligible: u64,
    pub eligible_by_age: BTreeMap<AgeBand, u64>,
    pub excluded: BTreeMap<Exclusion, u64>,
    /// The eligible deliveries' stored reasons, most frequent first (at most 10).
    pub reasons: Vec<ReasonCount>,
    /// `eligible / rate` (`nudge_domain::drain::drain_s`): the least time the redrive takes to
    /// feed everything.
    pub expected_drain_s: f64,
}

/// A redrive just started: its id, and what it took.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StartedRedrive {
    pub id: RedriveId,
    pub plan: RedrivePlan,
}

/// A redrive's lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RedriveState {
    Running,
    Paused,
    Finished,
    Cancelled,
}

impl RedriveState {
    pub fn as_str(self) -> &'static str {
        match self {
            RedriveState::Running => "running",
            RedriveState::Paused => "paused",
            RedriveState::Finished => "finished",
            RedriveState::Cancelled => "cancelled",
        }
    }

    fn parse(name: &str) -> Result<Self, LedgerError> {
        match name {
            "running" => Ok(RedriveState::Running),
            "paused" => Ok(RedriveState::Paused),
            "finished" => Ok(RedriveState::Finished),
            "cancelled" => Ok(RedriveState::Cancelled),
            other => Err(LedgerError::corrupt("redrives", format!("state {other}"))),
        }
    }

    pub fn is_active(self) -> bool {
        matches!(self, RedriveState::Running | RedriveState::Paused)
    }
}

/// A redrive as the ledger holds it, with the outcome so far of what it fed.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RedriveStatus {
    pub id: RedriveId,
    pub channel: Channel,
    pub tenant_id: Option<TenantId>,
    pub max_age_s: Option<i64>,
    pub limit: Option<i32>,
    pub rate_per_second: f64,
    pub canary: Option<i32>,
    pub canary_passed_at: Option<DateTime<Utc>>,
    pub state: RedriveState,
    pub selected: u64,
    pub excluded: serde_json::Value,
    pub fed: u64,
    pub skipped: u64,
    pub pause_reason: Option<String>,
    pub actor: String,
    pub reason: String,
    pub incident: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// What the fed deliveries are now, by state (`delivered`, `retry_wait`, ...).
    pub fed_by_state: BTreeMap<String, u64>,
    /// Items passed over at their turn, by why (`expired_before_turn`, `tenant_paused`,
    /// `moved_on`).
    pub skipped_by_reason: BTreeMap<String, u64>,
    /// Items left to feed, divided by the rate.
    pub remaining_s: f64,
}

/// When a running redrive pauses itself (the janitor's `[redrive]` section).
#[derive(Debug, Clone, PartialEq)]
pub struct AutoPause {
    /// Pause when one provider account of the channel answered more than this share of its
    /// attempts with 429 over `window` (and at least `min_attempts` attempts were made).
    pub max_throttled_ratio: f64,
    pub window: Duration,
    pub min_attempts: u32,
    /// Pause when the channel's oldest due new delivery has waited longer than this.
    pub max_new_work_age: Duration,
}

/// What one tick did to one redrive.
#[derive(Debug, Clone, PartialEq)]
pub struct RedriveTick {
    pub id: RedriveId,
    pub fed: u64,
    pub skipped: u64,
    /// Set when the tick paused the redrive: why.
    pub paused: Option<String>,
    /// Its channel is draining: nothing fed, the redrive waits for the drain to end.
    pub waiting_for_drain: bool,
    /// It had paused itself for late new work, and new work has caught up: running again.
    pub resumed: bool,
    pub finished: bool,
}

/// The selection, shared by the dry run and the execute. Binds: $1 now (NULL = database
/// clock), $2 channel, $3 tenant, $4 max age in seconds, $5 rate, $6 limit, $7 owner.
///
/// "Would expire before its turn" is `expires_at <= nudge_domain::drain::turn_at(now, k, rate)`
/// for the k-th eligible, earliest deadline first, computed here in SQL so the selection stays
/// one statement that the dry run and the execute share; the redrive test
/// `the_turn_rule_in_sql_is_the_drain_models` checks the two agree.
fn selection_cte() -> String {
    let band = age_band_sql("f.scheduled_at", "f.now");
    let held = crate::dlq::HELD;
    format!(
        "WITH params AS (SELECT COALESCE($1, now()) AS now),
         c AS (
            SELECT d.id, d.scheduled_at, d.expires_at, d.last_error_reason, p.now,
                CASE WHEN d.state = 'ambiguous' THEN 'ambiguous'
                     WHEN EXISTS (
                         SELECT 1 FROM redrive_items ri JOIN redrives r ON r.id = ri.redrive_id
                         WHERE ri.delivery_id = d.id AND r.state IN ('running', 'paused')
                           AND ri.fed_at IS NULL AND ri.skipped_reason IS NULL)
                         THEN 'already_in_redrive'
                     WHEN d.expires_at <= p.now THEN 'expired'
                     WHEN t.intake_paused THEN 'tenant_paused'
                     WHEN $4::bigint IS NOT NULL
                          AND p.now - d.scheduled_at > $4::bigint * interval '1 second'
                         THEN 'older_than_max_age'
                END AS excluded
            FROM {held} d JOIN tenants t ON t.id = d.tenant_id CROSS JOIN params p
            WHERE d.channel = $2 AND d.owner = $7
              AND ($3::uuid IS NULL OR d.tenant_id = $3)),
         turns AS (
            SELECT c.*, row_number() OVER (PARTITION BY c.excluded IS NULL
                                           ORDER BY c.expires_at, c.id) AS turn
            FROM c),
         timed AS (
            -- The k-th eligible's turn, now + (k - 1) / rate, is nudge_domain::drain::turn_at.
            SELECT t.id, t.scheduled_at, t.expires_at, t.last_error_reason, t.now,
                CASE WHEN t.excluded IS NULL
                          AND t.expires_at <= t.now
                              + ((t.turn - 1)::float8 / $5::float8) * interval '1 second'
                     THEN 'would_expire_before_turn' ELSE t.excluded END AS excluded
            FROM turns t),
         ranked AS (
            SELECT x.*, row_number() OVER (PARTITION BY x.excluded IS NULL
                                           ORDER BY x.expires_at, x.id) AS position
            FROM timed x),
         f AS (
            SELECT r.id, r.scheduled_at, r.last_error_reason, r.now, r.position,
                CASE WHEN r.excluded IS NULL AND $6::bigint IS NOT NULL AND r.position > $6::bigint
                     THEN 'over_limit' ELSE r.excluded END AS excluded
            FROM ranked r),
         counted AS (
            SELECT f.excluded, {band} AS band, f.last_error_reason AS reason, f.now
            FROM f)"
    )
}

const COUNTS: &str = "SELECT excluded, band, reason, count(*) AS n,
        (SELECT now FROM params) AS now
     FROM counted GROUP BY excluded, band, reason";

#[derive(sqlx::FromRow)]
struct CountRow {
    excluded: Option<String>,
    band: String,
    reason: Option<String>,
    n: i64,
    now: DateTime<Utc>,
}

fn fold_plan(
    filter: &RedriveFilter,
    rate: f64,
    rows: Vec<CountRow>,
    now: DateTime<Utc>,
) -> Result<RedrivePlan, LedgerError> {
    let mut plan = RedrivePlan {
        channel: filter.channel,
        now: rows.first().map_or(now, |r| r.now),
        rate_per_second: rate,
        eligible: 0,
        eligible_by_age: BTreeMap::new(),
        excluded: BTreeMap::new(),
        reasons: Vec::new(),
        expected_drain_s: 0.0,
    };
    let mut reasons: BTreeMap<String, u64> = BTreeMap::new();
    for row in rows {
        let n = u64::try_from(row.n).unwrap_or(0);
        match row.excluded.as_deref() {
            None => {
                plan.eligible += n;
                let band = AgeBand::parse(&row.band)
                    .ok_or_else(|| LedgerError::corrupt("deliveries", "age band"))?;
                *plan.eligible_by_age.entry(band).or_default() += n;
                *reasons
                    .entry(row.reason.unwrap_or_else(|| "none".to_owned()))
                    .or_default() += n;
            }
            Some(name) => {
                let why = Exclusion::parse(name)
                    .ok_or_else(|| LedgerError::corrupt("deliveries", name))?;
                *plan.excluded.entry(why).or_default() += n;
            }
        }
    }
    let mut reasons: Vec<ReasonCount> = reasons
        .into_iter()
        .map(|(reason, count)| ReasonCount { reason, count })
        .collect();
    reasons.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.reason.cmp(&b.reason)));
    reasons.truncate(10);
    plan.reasons = reasons;
    plan.expected_drain_s = drain::drain_s(plan.eligible, rate);
    Ok(plan)
}

fn check_rate(rate: f64) -> Result<(), LedgerError> {
    if rate.is_finite() && rate > 0.0 && rate <= 1_000_000.0 {
        Ok(())
    } else {
        Err(LedgerError::InvalidInput(
            "a redrive rate is more than 0 and at most 1000000 per second",
        ))
    }
}

fn max_age_s(filter: &RedriveFilter) -> Option<i64> {
    filter
        .max_age
        .map(|d| i64::try_from(d.as_secs().max(1)).unwrap_or(i64::MAX))
}

#[derive(sqlx::FromRow)]
struct RedriveRow {
    id: i64,
    channel: String,
    tenant_id: Option<uuid::Uuid>,
    max_age_s: Option<i64>,
    max_deliveries: Option<i32>,
    rate_per_second: f64,
    canary: Option<i32>,
    canary_passed_at: Option<DateTime<Utc>>,
    state: String,
    selected: i32,
    excluded: serde_json::Value,
    fed: i32,
    skipped: i32,
    fed_until: DateTime<Utc>,
    running_since: DateTime<Utc>,
    pause_reason: Option<String>,
    actor: String,
    reason: String,
    incident: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    finished_at: Option<DateTime<Utc>>,
}

const REDRIVE_COLUMNS: &str = "id, channel, tenant_id, max_age_s, max_deliveries, \
     rate_per_second, canary, canary_passed_at, state, selected, excluded, fed, skipped, \
     fed_until, running_since, pause_reason, actor, reason, incident, created_at, updated_at, \
     finished_at";

fn count(n: i32) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

impl RedriveRow {
    fn remaining(&self) -> u64 {
        count(self.selected).saturating_sub(count(self.fed) + count(self.skipped))
    }

    fn status(
        self,
        fed_by_state: BTreeMap<String, u64>,
        skipped_by_reason: BTreeMap<String, u64>,
    ) -> Result<RedriveStatus, LedgerError> {
        let remaining = self.remaining();
        Ok(RedriveStatus {
            id: redrive_id(self.id)?,
            channel: self
                .channel
                .parse()
                .map_err(|e| LedgerError::corrupt("redrives", e))?,
            tenant_id: self.tenant_id.map(TenantId::from_uuid),
            max_age_s: self.max_age_s,
            limit: self.max_deliveries,
            rate_per_second: self.rate_per_second,
            canary: self.canary,
            canary_passed_at: self.canary_passed_at,
            state: RedriveState::parse(&self.state)?,
            selected: count(self.selected),
            excluded: self.excluded,
            fed: count(self.fed),
            skipped: count(self.skipped),
            pause_reason: self.pause_reason,
            actor: self.actor,
            reason: self.reason,
            incident: self.incident,
            created_at: self.created_at,
            updated_at: self.updated_at,
            finished_at: self.finished_at,
            fed_by_state,
            skipped_by_reason,
            remaining_s: drain::drain_s(remaining, self.rate_per_second),
        })
    }
}

/// A redrive's id as read back from its row (an identity column: from 1).
fn redrive_id(n: i64) -> Result<RedriveId, LedgerError> {
    RedriveId::try_from(n).map_err(|e| LedgerError::corrupt("redrives", e))
}

fn is_unique_violation(e: &sqlx::Error, constraint: &str) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.constraint() == Some(constraint))
}

impl Ledger {
    /// The dry run: what a redrive with this filter and rate would take now, and what it
    /// would leave out and why. Reads only.
    pub async fn plan_redrive(
        &self,
        filter: &RedriveFilter,
        rate_per_second: f64,
        at: LedgerTime,
    ) -> Result<RedrivePlan, LedgerError> {
        check_rate(rate_per_second)?;
        let sql = format!("{} {COUNTS}", selection_cte());
        let rows: Vec<CountRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(at.bind())
            .bind(filter.channel.as_str())
            .bind(filter.tenant.map(|t| t.as_uuid()))
            .bind(max_age_s(filter))
            .bind(rate_per_second)
            .bind(filter.limit.map(i64::from))
            .bind(&*self.sender)
            .fetch_all(&self.pool)
            .await?;
        let now = self.clock(at).await?;
        fold_plan(filter, rate_per_second, rows, now)
    }

    /// Starts a redrive: selects exactly as [`Ledger::plan_redrive`] would at this instant,
    /// freezes the selection as numbered items and records the redrive with its counts, the
    /// operator and an audit row, in one transaction. Nothing is sent until the janitor feeds
    /// the items. One redrive may be active per channel
    /// ([`LedgerError::RedriveActive`] names the one that is).
    pub async fn execute_redrive(
        &self,
        filter: &RedriveFilter,
        rate_per_second: f64,
        canary: Option<u32>,
        operator: &Operator,
        at: LedgerTime,
    ) -> Result<StartedRedrive, LedgerError> {
        check_rate(rate_per_second)?;
        let Some(reason) = operator.reason() else {
            return Err(LedgerError::InvalidInput("a redrive needs a reason"));
        };
        if canary == Some(0) || filter.limit == Some(0) {
            return Err(LedgerError::InvalidInput(
                "a canary or limit, when given, is at least 1",
            ));
        }
        let mut tx = self.pool.begin().await?;
        let inserted: Result<(i64, DateTime<Utc>), sqlx::Error> = sqlx::query_as(
            "INSERT INTO redrives (channel, tenant_id, max_age_s, max_deliveries,
                 rate_per_second, canary, state, selected, fed_until, running_since, actor,
                 reason, incident, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, 'running', 0,
                 COALESCE($10, now()) - (1.0 / $5) * interval '1 second',
                 COALESCE($10, now()), $7, $8, $9, COALESCE($10, now()), COALESCE($10, now()))
             RETURNING id, created_at",
        )
        .bind(filter.channel.as_str())
        .bind(filter.tenant.map(|t| t.as_uuid()))
        .bind(max_age_s(filter))
        .bind(filter.limit.map(|l| i32::try_from(l).unwrap_or(i32::MAX)))
        .bind(rate_per_second)
        .bind(canary.map(|c| i32::try_from(c).unwrap_or(i32::MAX)))
        .bind(operator.actor())
        .bind(reason)
        .bind(operator.incident())
        .bind(at.bind())
        .fetch_one(&mut *tx)
        .await;
        let (id, now) = match inserted {
            Ok((id, now)) => (redrive_id(id)?, now),
            Err(e) if is_unique_violation(&e, "redrives_one_active_idx") => {
                let active: i64 = sqlx::query_scalar(
                    "SELECT id FROM redrives WHERE channel = $1 AND state IN ('running', 'paused')",
                )
                .bind(filter.channel.as_str())
                .fetch_one(&self.pool)
                .await?;
                return Err(LedgerError::RedriveActive {
                    channel: filter.channel,
                    id: redrive_id(active)?,
                });
            }
            Err(e) => return Err(e.into()),
        };
        // The same selection as the dry run, with the eligible frozen as items in the same
        // statement, so the counts recorded are the items written.
        let sql = format!(
            "{}, items AS (
                INSERT INTO redrive_items (redrive_id, position, delivery_id)
                SELECT $8, f.position, f.id FROM f WHERE f.excluded IS NULL
                RETURNING 1)
             {COUNTS}",
            selection_cte()
        );
        let rows: Vec<CountRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(Some(now))
            .bind(filter.channel.as_str())
            .bind(filter.tenant.map(|t| t.as_uuid()))
            .bind(max_age_s(filter))
            .bind(rate_per_second)
            .bind(filter.limit.map(i64::from))
            .bind(&*self.sender)
            .bind(id.get())
            .fetch_all(&mut *tx)
            .await?;
        let plan = fold_plan(filter, rate_per_second, rows, now)?;
        let excluded = serde_json::to_value(&plan.excluded)
            .map_err(|e| LedgerError::corrupt("redrives", e))?;
        sqlx::query("UPDATE redrives SET selected = $2, excluded = $3 WHERE id = $1")
            .bind(id.get())
            .bind(i32::try_from(plan.eligible).unwrap_or(i32::MAX))
            .bind(&excluded)
            .execute(&mut *tx)
            .await?;
        let mut entry = operator.entry(
            "redrive_start",
            format!("redrive:{id}"),
            serde_json::json!({
                "channel": filter.channel.as_str(),
                "tenant_id": filter.tenant.map(|t| t.to_string()),
                "max_age_s": max_age_s(filter),
                "limit": filter.limit,
                "rate_per_second": rate_per_second,
                "canary": canary,
                "selected": plan.eligible,
                "excluded": excluded,
            }),
        );
        entry.at = now;
        audit::insert(&mut tx, &entry).await?;
        tx.commit().await?;
        Ok(StartedRedrive { id, plan })
    }

    /// One redrive with its progress, or `None` if there is no such id.
    pub async fn redrive_status(
        &self,
        id: RedriveId,
    ) -> Result<Option<RedriveStatus>, LedgerError> {
        let row: Option<RedriveRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {REDRIVE_COLUMNS} FROM redrives WHERE id = $1"
        )))
        .bind(id.get())
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(row) => Ok(Some(self.with_progress(row).await?)),
            None => Ok(None),
        }
    }

    /// The most recent redrives (active ones first), newest first.
    pub async fn redrives(&self, limit: u32) -> Result<Vec<RedriveStatus>, LedgerError> {
        let rows: Vec<RedriveRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {REDRIVE_COLUMNS} FROM redrives
             ORDER BY state IN ('running', 'paused') DESC, id DESC LIMIT $1"
        )))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            out.push(self.with_progress(row).await?);
        }
        Ok(out)
    }

    async fn with_progress(&self, row: RedriveRow) -> Result<RedriveStatus, LedgerError> {
        let fed: Vec<(String, i64)> = sqlx::query_as(
            "SELECT d.state, count(*) FROM redrive_items ri
             JOIN deliveries d ON d.id = ri.delivery_id
             WHERE ri.redrive_id = $1 AND ri.fed_at IS NOT NULL GROUP BY d.state",
        )
        .bind(row.id)
        .fetch_all(&self.pool)
        .await?;
        let skipped: Vec<(String, i64)> = sqlx::query_as(
            "SELECT skipped_reason, count(*) FROM redrive_items
             WHERE redrive_id = $1 AND skipped_reason IS NOT NULL GROUP BY skipped_reason",
        )
        .bind(row.id)
        .fetch_all(&self.pool)
        .await?;
        let to_map = |rows: Vec<(String, i64)>| {
            rows.into_iter()
                .map(|(k, n)| (k, u64::try_from(n).unwrap_or(0)))
                .collect()
        };
        row.status(to_map(fed), to_map(skipped))
    }

    /// Pauses a running redrive by hand; what it already fed carries on. A redrive that
    /// paused itself for late new work can be paused by hand too: it then stays paused until
    /// an operator resumes it. Audited.
    pub async fn pause_redrive(
        &self,
        id: RedriveId,
        operator: &Operator,
        at: LedgerTime,
    ) -> Result<(), LedgerError> {
        let why = format!(
            "operator: {}",
            operator.reason().unwrap_or("paused by an operator")
        );
        self.change_redrive(
            id,
            operator,
            RedriveChange {
                action: "redrive_pause",
                from: &[RedriveState::Running, RedriveState::Paused],
                sql: "UPDATE redrives SET state = 'paused', pause_reason = $2,
                 updated_at = COALESCE($3, now())
             WHERE id = $1",
                pause_reason: Some(why),
            },
            at,
        )
        .await
    }

    /// Resumes a paused redrive at its rate, with no credit for the time it was paused; its
    /// auto-pause rules look at attempts from now on. A redrive paused by a failed canary
    /// goes on past it (the operator has looked). Audited.
    /// Its pacing and rules restart at the database's clock (`at` in tests).
    pub async fn resume_redrive(
        &self,
        id: RedriveId,
        operator: &Operator,
        at: LedgerTime,
    ) -> Result<(), LedgerError> {
        self.change_redrive(
            id,
            operator,
            RedriveChange {
                action: "redrive_resume",
                from: &[RedriveState::Paused],
                sql: "UPDATE redrives SET state = 'running', pause_reason = $2,
                 updated_at = COALESCE($3, now()), running_since = COALESCE($3, now()),
                 fed_until = COALESCE($3, now()),
                 canary_passed_at = COALESCE(canary_passed_at,
                     CASE WHEN pause_reason LIKE 'canary_failed%' THEN COALESCE($3, now()) END)
             WHERE id = $1",
                pause_reason: None,
            },
            at,
        )
        .await
    }

    /// Cancels a running or paused redrive: nothing more is fed; items not yet fed stay
    /// dead-lettered (redrivable later), those fed are owed work and carry on. Audited.
    pub async fn cancel_redrive(
        &self,
        id: RedriveId,
        operator: &Operator,
        at: LedgerTime,
    ) -> Result<(), LedgerError> {
        self.change_redrive(
            id,
            operator,
            RedriveChange {
                action: "redrive_cancel",
                from: &[RedriveState::Running, RedriveState::Paused],
                sql: "UPDATE redrives SET state = 'cancelled', pause_reason = $2,
                 updated_at = COALESCE($3, now()), finished_at = COALESCE($3, now())
             WHERE id = $1",
                pause_reason: None,
            },
            at,
        )
        .await
    }

    async fn change_redrive(
        &self,
        id: RedriveId,
        operator: &Operator,
        change: RedriveChange<'_>,
        at: LedgerTime,
    ) -> Result<(), LedgerError> {
        let RedriveChange {
            action,
            from,
            sql,
            pause_reason,
        } = change;
        let mut tx = self.pool.begin().await?;
        let state: Option<String> =
            sqlx::query_scalar("SELECT state FROM redrives WHERE id = $1 FOR UPDATE")
                .bind(id.get())
                .fetch_optional(&mut *tx)
                .await?;
        let Some(state) = state else {
            return Err(LedgerError::UnknownRedrive(id));
        };
        let state = RedriveState::parse(&state)?;
        if !from.contains(&state) {
            return Err(LedgerError::RedriveState { id, state });
        }
        sqlx::query(sql)
            .bind(id.get())
            .bind(pause_reason)
            .bind(at.bind())
            .execute(&mut *tx)
            .await?;
        audit::insert(
            &mut tx,
            &operator.entry(
                action,
                format!("redrive:{id}"),
                serde_json::json!({"from": state.as_str()}),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Successful attempts per second on `channel` over the last `window`: what the
    /// redrive's default rate is half of.
    pub async fn observed_success_rate(
        &self,
        channel: Channel,
        window: Duration,
        at: LedgerTime,
    ) -> Result<f64, LedgerError> {
        let secs = window.as_secs_f64().max(1.0);
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM attempts a JOIN deliveries d ON d.id = a.delivery_id
             WHERE a.finished_at > COALESCE($3, now()) - $2 * interval '1 second'
               AND a.finished_at <= COALESCE($3, now())
               AND a.outcome_class = 'delivered' AND d.channel = $1",
        )
        .bind(channel.as_str())
        .bind(secs)
        .bind(at.bind())
        .fetch_one(&self.pool)
        .await?;
        Ok(n as f64 / secs)
    }

    /// The janitor's step: for each running redrive, pause it if a rule says so, hold it
    /// behind an unsettled canary, or feed the items its rate allows since the last feed (at
    /// most `batch`). Each redrive is its own transaction, its row locked with `SKIP LOCKED`.
    pub async fn redrive_tick(
        &self,
        rules: &AutoPause,
        batch: u32,
        at: LedgerTime,
    ) -> Result<Vec<RedriveTick>, LedgerError> {
        let ids: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT id FROM redrives WHERE state = 'running'
                    OR (state = 'paused' AND pause_reason LIKE '{NEW_WORK_WAITING}%')
                 ORDER BY id"
        )))
        .fetch_all(&self.pool)
        .await?;
        let mut ticks = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(tick) = self.tick_one(redrive_id(id)?, rules, batch, at).await? {
                ticks.push(tick);
            }
        }
        Ok(ticks)
    }

    async fn tick_one(
        &self,
        id: RedriveId,
        rules: &AutoPause,
        batch: u32,
        at: LedgerTime,
    ) -> Result<Option<RedriveTick>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        // The janitor's role may not update redrives: the lock, like every change below, is
        // taken by the feeder's functions (migration 20261208000002).
        let locked: bool = sqlx::query_scalar("SELECT nudge_redrive_lock_for_tick($1)")
            .bind(id.get())
            .fetch_one(&mut *tx)
            .await?;
        if !locked {
            return Ok(None);
        }
        let row: Option<(RedriveRow, DateTime<Utc>)> = {
            let sql = format!(
                "SELECT {REDRIVE_COLUMNS}, COALESCE($2, now()) AS tick_now FROM redrives
                 WHERE id = $1"
            );
            let found = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id.get())
                .bind(at.bind())
                .fetch_optional(&mut *tx)
                .await?;
            match found {
                Some(r) => {
                    use sqlx::{FromRow, Row};
                    Some((RedriveRow::from_row(&r)?, r.try_get("tick_now")?))
                }
                None => None,
            }
        };
        let Some((row, now)) = row else {
            return Ok(None);
        };
        let mut tick = RedriveTick {
            id,
            fed: 0,
            skipped: 0,
            paused: None,
            waiting_for_drain: false,
            resumed: false,
            finished: false,
        };
        let channel: Channel = row
            .channel
            .parse()
            .map_err(|e| LedgerError::corrupt("redrives", e))?;
        // Paused because new work was late: it goes on by itself once new work has caught up
        // (its oldest due delivery waits less than half the limit), counting from then.
        if row.state == "paused" {
            let waited = oldest_new_work_age(&mut tx, channel, &self.sender, now).await?;
            if waited.is_none_or(|w| w * 2 <= rules.max_new_work_age) {
                // Audited (`redrive_auto_resume`, with what it was paused for) by the function.
                sqlx::query("SELECT nudge_redrive_auto_resume($1, $2, $3)")
                    .bind(id.get())
                    .bind(format!(
                        "new work caught up: the oldest due new {channel} delivery waits {}s",
                        waited.unwrap_or_default().as_secs()
                    ))
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                tick.resumed = true;
            }
            tx.commit().await?;
            return Ok(Some(tick));
        }
        // A draining channel's redrive lane is closed: wait, with no credit for the time.
        let draining: bool =
            sqlx::query_scalar("SELECT draining FROM channel_controls WHERE channel = $1")
                .bind(channel.as_str())
                .fetch_one(&mut *tx)
                .await?;
        if draining {
            sqlx::query("SELECT nudge_redrive_hold($1, $2)")
                .bind(id.get())
                .bind(now)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            tick.waiting_for_drain = true;
            return Ok(Some(tick));
        }

        if let Some(why) =
            auto_pause_reason(&mut tx, &row, channel, &self.sender, rules, now).await?
        {
            pause_in_tx(&mut tx, &row, &why, now).await?;
            tx.commit().await?;
            tick.paused = Some(why);
            return Ok(Some(tick));
        }

        let done = count(row.fed) + count(row.skipped);
        let mut allowance = row.remaining();
        if let (Some(canary), None) = (row.canary, row.canary_passed_at) {
            let canary = count(canary);
            if done < canary {
                allowance = allowance.min(canary - done);
            } else {
                match canary_verdict(&mut tx, &row).await? {
                    Canary::Failed(why) => {
                        pause_in_tx(&mut tx, &row, &why, now).await?;
                        tx.commit().await?;
                        tick.paused = Some(why);
                        return Ok(Some(tick));
                    }
                    Canary::Waiting => {
                        tx.commit().await?;
                        return Ok(Some(tick));
                    }
                    Canary::Passed => {
                        sqlx::query("SELECT nudge_redrive_canary_passed($1, $2)")
                            .bind(id.get())
                            .bind(now)
                            .execute(&mut *tx)
                            .await?;
                    }
                }
            }
        }

        // Pacing: the credit since fed_until, which advances by exactly what was fed (the
        // fraction of an item left over carries to the next tick, so a rate below one a second
        // or a tick slower than a second still feeds at the rate). A janitor that was away
        // gets at most five seconds' worth (two items at a rate below 0.4/s): no burst.
        let cap = micros((2.0 / row.rate_per_second).max(5.0));
        let credit_from = row.fed_until.max(now - cap);
        let elapsed = (now - credit_from).num_microseconds().unwrap_or(0) as f64 / 1e6;
        let credit = (elapsed * row.rate_per_second).floor().max(0.0) as u64;
        let take = credit.min(allowance).min(u64::from(batch)).min(10_000);
        // Feeds, adds the counts, moves fed_until by exactly what was fed and finishes the
        // redrive once every item was fed or skipped, in one call.
        let (fed, skipped, finished): (i64, i64, bool) = sqlx::query_as(
            "SELECT fed, skipped, finished FROM nudge_redrive_feed($1, $2, $3, $4, $5)",
        )
        .bind(id.get())
        .bind(i64::try_from(take).unwrap_or(i64::MAX))
        .bind(now)
        .bind(credit_from)
        .bind(&*self.sender)
        .fetch_one(&mut *tx)
        .await?;
        tick.fed = u64::try_from(fed).unwrap_or(0);
        tick.skipped = u64::try_from(skipped).unwrap_or(0);
        tx.commit().await?;
        tick.finished = finished;
        Ok(Some(tick))
    }
}

fn micros(seconds: f64) -> chrono::Duration {
    chrono::Duration::microseconds((seconds * 1e6).round() as i64)
}

/// Why a running redrive should pause now, if it should.
async fn auto_pause_reason(
    conn: &mut PgConnection,
    row: &RedriveRow,
    channel: Channel,
    sender: &str,
    rules: &AutoPause,
    now: DateTime<Utc>,
) -> Result<Option<String>, LedgerError> {
    let window_start = (now - micros(rules.window.as_secs_f64())).max(row.running_since);
    let throttled: Vec<(Option<String>, i64, i64)> = sqlx::query_as(
        "SELECT a.provider_account, count(*),
                count(*) FILTER (WHERE a.http_status = 429)
         FROM attempts a JOIN deliveries d ON d.id = a.delivery_id
         WHERE a.finished_at > $2 AND a.finished_at <= $3 AND d.channel = $1
         GROUP BY a.provider_account ORDER BY a.provider_account",
    )
    .bind(channel.as_str())
    .bind(window_start)
    .bind(now)
    .fetch_all(&mut *conn)
    .await?;
    for (account, attempts, n429) in throttled {
        if attempts < i64::from(rules.min_attempts) || attempts == 0 {
            continue;
        }
        let ratio = n429 as f64 / attempts as f64;
        if ratio > rules.max_throttled_ratio {
            return Ok(Some(format!(
                "throttled: account {} answered 429 to {n429} of {attempts} attempts since \
                 {} (ratio {ratio:.2} > {:.2})",
                account.as_deref().unwrap_or("unknown"),
                window_start.to_rfc3339(),
                rules.max_throttled_ratio,
            )));
        }
    }
    if let Some(waited) = oldest_new_work_age(conn, channel, sender, now).await?
        && waited > rules.max_new_work_age
    {
        return Ok(Some(format!(
            "{NEW_WORK_WAITING}: the oldest due new {channel} delivery has waited {}s \
             (more than {}s)",
            waited.as_secs(),
            rules.max_new_work_age.as_secs()
        )));
    }
    Ok(None)
}

/// The pause reason the janitor lifts by itself once new work has caught up.
const NEW_WORK_WAITING: &str = "new_work_waiting";

/// How long the channel's oldest due new delivery (first attempt, not being sent) has
/// waited, if any is due.
async fn oldest_new_work_age(
    conn: &mut PgConnection,
    channel: Channel,
    sender: &str,
    now: DateTime<Utc>,
) -> Result<Option<Duration>, LedgerError> {
    let oldest: Option<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT min(next_attempt_at) FROM deliveries
         WHERE channel = $1 AND lane = 'new' AND state IN ('scheduled', 'queued', 'retry_wait')
           AND next_attempt_at <= $2 AND owner = $3",
    )
    .bind(channel.as_str())
    .bind(now)
    .bind(sender)
    .fetch_one(&mut *conn)
    .await?;
    Ok(oldest.map(|t| (now - t).to_std().unwrap_or_default()))
}

enum Canary {
    Passed,
    Failed(String),
    Waiting,
}

/// The canary's items: failed as soon as one was answered 429 or 5xx (or may have been
/// sent), or once all settled and one was not delivered (dead-lettered again, expired,
/// cancelled: the rest would likely fare no better); passed once all were delivered.
async fn canary_verdict(conn: &mut PgConnection, row: &RedriveRow) -> Result<Canary, LedgerError> {
    let (total, settled, delivered, failed): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*),
                count(*) FILTER (WHERE d.state IN ('delivered', 'dead_lettered', 'expired',
                                                   'cancelled', 'suppressed', 'ambiguous')),
                count(*) FILTER (WHERE d.state = 'delivered'),
                count(*) FILTER (WHERE EXISTS (
                    SELECT 1 FROM attempts a
                    WHERE a.delivery_id = d.id AND a.lane = 'redrive'
                      AND a.started_at >= ri.fed_at
                      AND (a.http_status = 429 OR a.http_status >= 500
                           OR a.outcome_class = 'ambiguous')))
         FROM redrive_items ri JOIN deliveries d ON d.id = ri.delivery_id
         WHERE ri.redrive_id = $1 AND ri.fed_at IS NOT NULL AND ri.position <= $2",
    )
    .bind(row.id)
    .bind(row.canary.unwrap_or(0))
    .fetch_one(&mut *conn)
    .await?;
    Ok(if failed > 0 {
        Canary::Failed(format!(
            "canary_failed: {failed} of {total} canary deliveries were answered 429 or 5xx \
             or may have been sent"
        ))
    } else if settled == total && delivered < total {
        Canary::Failed(format!(
            "canary_failed: {} of {total} canary deliveries settled without being delivered",
            total - delivered
        ))
    } else if settled == total {
        Canary::Passed
    } else {
        Canary::Waiting
    })
}

async fn pause_in_tx(
    conn: &mut PgConnection,
    row: &RedriveRow,
    why: &str,
    now: DateTime<Utc>,
) -> Result<(), LedgerError> {
    // Audited (`redrive_auto_pause`, with what was fed of what was selected) by the function.
    sqlx::query("SELECT nudge_redrive_auto_pause($1, $2, $3)")
        .bind(row.id)
        .bind(why)
        .bind(now)
        .execute(&mut *conn)
        .await?;
    Ok(())
}
