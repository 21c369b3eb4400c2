//! Retention: what the policy lets go, counted first, deleted by the database's own functions.
//!
//! Protocol (migration `20261202000001_retention`):
//! 1. [`Ledger::retention_blockers`]: a run starts only when no channel drains, no redrive is
//!    running or paused, no owed delivery sits under an owner other than its channel's (an
//!    ownership change still in progress), and the ledger's schema is the one this build
//!    carries ([`MIGRATOR`](crate::MIGRATOR)).
//! 2. [`Ledger::begin_retention_run`] counts, at one instant, what the run may delete per
//!    table, and writes the `retention_runs` row (instant, policy, counts) in the same
//!    transaction, before anything is deleted. [`Ledger::plan_retention`] is the same count
//!    without the row (`nudgectl retention plan`), by table, state and age band, with what
//!    stays and why.
//! 3. [`Ledger::retention_batch`] deletes one bounded batch through
//!    `nudge_retention_delete_deliveries` (then, once no delivery is left to go,
//!    `nudge_retention_delete_rest`), each its own short transaction: the functions re-check
//!    state and age under `FOR UPDATE SKIP LOCKED`, add to the run's deleted counts and refuse
//!    to delete more than the run counted. A delivery batch's rows are handed to the caller
//!    before the batch commits (the audit export), and an error there rolls it back.
//! 4. [`Ledger::finish_retention_run`] records how the run ended: `finished` when every count
//!    agrees, `mismatch` (naming the tables) when not, `stopped` when the caller stopped
//!    between batches (shutdown, a blocker appeared). A stopped run's rest is counted and
//!    deleted by the next run.
//!
//! What stays, and why ([`KeepReason`]), is defined once, in SQL functions the plan and the
//! deletions share, so the counts and the deletions cannot disagree on the rule.
//! Ages count from `settled_at` for settled and held deliveries, and from `scheduled_at` for
//! owed ones (so "due soon" shows as under an hour).

mod run;

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use nudge_domain::{DeliveryState, RetentionDays, RetentionPolicy};
use sqlx::PgConnection;

use crate::age::{AgeBand, age_band_sql};
use crate::deliveries::LedgerTime;
use crate::{Ledger, LedgerError};

pub use run::{
    Blocker, DeletedDelivery, RetentionBatch, RetentionRun, RunEnd, RunState, RunSummary,
};

/// The tables retention deletes from.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum RetentionTable {
    Deliveries,
    Attempts,
    DeadLetters,
    RedriveItems,
    Reminders,
    Contacts,
    AuditLog,
    Redrives,
    /// Entries of the consent history older than the audit log's boundary (a destination's
    /// current consent is never deleted).
    ConsentHistory,
    /// Delivery events past their boundary (`events_days` once acknowledged by the tenant's
    /// webhook or of a tenant without one, `events_unacknowledged_days` otherwise).
    DeliveryEvents,
}

impl RetentionTable {
    pub const ALL: [RetentionTable; 10] = [
        RetentionTable::Deliveries,
        RetentionTable::Attempts,
        RetentionTable::DeadLetters,
        RetentionTable::RedriveItems,
        RetentionTable::Reminders,
        RetentionTable::Contacts,
        RetentionTable::AuditLog,
        RetentionTable::Redrives,
        RetentionTable::ConsentHistory,
        RetentionTable::DeliveryEvents,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RetentionTable::Deliveries => "deliveries",
            RetentionTable::Attempts => "attempts",
            RetentionTable::DeadLetters => "dead_letters",
            RetentionTable::RedriveItems => "redrive_items",
            RetentionTable::Reminders => "reminders",
            RetentionTable::Contacts => "contacts",
            RetentionTable::AuditLog => "audit_log",
            RetentionTable::Redrives => "redrives",
            RetentionTable::ConsentHistory => "consent_history",
            RetentionTable::DeliveryEvents => "delivery_events",
        }
    }

    pub(super) fn parse(name: &str) -> Result<Self, LedgerError> {
        RetentionTable::ALL
            .into_iter()
            .find(|t| t.as_str() == name)
            .ok_or_else(|| LedgerError::corrupt("retention_runs", format!("table {name}")))
    }
}

impl std::fmt::Display for RetentionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a row stays.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum KeepReason {
    /// Scheduled, queued, being sent or waiting to retry: still owed.
    Owed,
    /// `ambiguous`: held for review, never deleted.
    Held,
    /// A dead letter named by a running or paused redrive.
    AwaitingRedrive,
    /// Owned by a sender other than its channel's current owner.
    OwnershipUncertain,
    /// Settled (or written) more recently than its boundary.
    TooYoung,
    /// A reminder with a delivery that stays.
    HasDelivery,
    /// A contact named by a reminder that stays.
    InUse,
    /// Goes with (or stays with) the delivery it belongs to.
    WithDelivery,
    /// A reminder withheld by an operator (its tenant paused or its channel draining): it may
    /// still be materialised. Named `held_by_operator` in the ledger and the CLI's output.
    #[serde(rename = "held_by_operator")]
    WithheldByOperator,
    /// A consent history entry a patient's inbound message wrote (a STOP or a START): the
    /// replay guard of that message, never deleted.
    ReplayGuard,
    /// A delivery event its tenant's webhook has not acknowledged (or not yet numbered),
    /// younger than the unacknowledged boundary.
    Unacknowledged,
}

impl KeepReason {
    fn parse(name: &str) -> Result<Self, LedgerError> {
        Ok(match name {
            "owed" => KeepReason::Owed,
            "held" => KeepReason::Held,
            "awaiting_redrive" => KeepReason::AwaitingRedrive,
            "ownership_uncertain" => KeepReason::OwnershipUncertain,
            "too_young" => KeepReason::TooYoung,
            "has_delivery" => KeepReason::HasDelivery,
            "in_use" => KeepReason::InUse,
            "with_delivery" => KeepReason::WithDelivery,
            "held_by_operator" => KeepReason::WithheldByOperator,
            "replay_guard" => KeepReason::ReplayGuard,
            "unacknowledged" => KeepReason::Unacknowledged,
            other => return Err(LedgerError::corrupt("retention", format!("reason {other}"))),
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            KeepReason::Owed => "owed",
            KeepReason::Held => "held",
            KeepReason::AwaitingRedrive => "awaiting_redrive",
            KeepReason::OwnershipUncertain => "ownership_uncertain",
            KeepReason::TooYoung => "too_young",
            KeepReason::HasDelivery => "has_delivery",
            KeepReason::InUse => "in_use",
            KeepReason::WithDelivery => "with_delivery",
            KeepReason::WithheldByOperator => "held_by_operator",
            KeepReason::ReplayGuard => "replay_guard",
            KeepReason::Unacknowledged => "unacknowledged",
        }
    }
}

/// Deliveries of one state and age band, and whether they go.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeliveryCount {
    pub state: DeliveryState,
    pub age_band: AgeBand,
    /// `None`: the policy lets them go.
    pub kept: Option<KeepReason>,
    pub count: u64,
}

/// One table's rows: how many go, and how many stay by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TableCount {
    pub delete: u64,
    pub kept: BTreeMap<KeepReason, u64>,
}

/// What a run at `at` would delete, and what it keeps and why.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RetentionPlan {
    /// The instant every age is counted to (the database's clock unless fixed).
    pub at: DateTime<Utc>,
    pub policy: RetentionDays,
    /// Deliveries by state, age band and verdict.
    pub deliveries: Vec<DeliveryCount>,
    /// Every table (deliveries included).
    pub tables: BTreeMap<RetentionTable, TableCount>,
}

impl RetentionPlan {
    /// Rows to delete per table (every table listed, zeros included).
    pub fn to_delete(&self) -> BTreeMap<RetentionTable, u64> {
        RetentionTable::ALL
            .into_iter()
            .map(|t| (t, self.tables.get(&t).map_or(0, |c| c.delete)))
            .collect()
    }
}

const DAY_S: i64 = 86_400;

pub(super) fn seconds(days: u32) -> i64 {
    i64::from(days) * DAY_S
}

/// `ROW(...)::nudge_retention_policy` from binds `$1` (instant) to `$8`; the events'
/// boundaries are `$9` and `$10`.
const POLICY_ROW: &str = "ROW($1::timestamptz, $2::bigint, $3::bigint, $4::bigint, $5::bigint, \
     $6::bigint, $7::bigint, $8::bigint)::nudge_retention_policy";

fn bind_policy<'q>(
    query: sqlx::query::QueryAs<'q, sqlx::Postgres, CountRow, sqlx::postgres::PgArguments>,
    at: DateTime<Utc>,
    d: &RetentionDays,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, CountRow, sqlx::postgres::PgArguments> {
    query
        .bind(at)
        .bind(seconds(d.delivered))
        .bind(seconds(d.expired))
        .bind(seconds(d.cancelled))
        .bind(seconds(d.dead_lettered))
        .bind(seconds(d.reminders))
        .bind(seconds(d.contacts))
        .bind(seconds(d.audit))
        .bind(seconds(d.events))
        .bind(seconds(d.events_unacknowledged))
}

#[derive(sqlx::FromRow)]
struct CountRow {
    tbl: String,
    state: Option<String>,
    band: Option<String>,
    keep: Option<String>,
    n: i64,
}

fn plan_sql() -> String {
    let band = age_band_sql("COALESCE(d.settled_at, d.scheduled_at)", "(pp.p).at");
    format!(
        "WITH pp AS (SELECT {POLICY_ROW} AS p),
         dk AS MATERIALIZED (
             SELECT d.id, d.reminder_id, d.state, {band} AS band,
                    nudge_retention_delivery_keep(d, pp.p) AS keep
             FROM deliveries d CROSS JOIN pp),
         -- Reminders with a delivery that stays after the run, then the reminders' verdicts,
         -- then the contacts a staying reminder names: joins, not a lookup per row.
         staying AS (SELECT DISTINCT dk.reminder_id FROM dk WHERE dk.keep IS NOT NULL),
         rk AS MATERIALIZED (
             SELECT r.tenant_id, r.subscriber_ref, r.channels,
                    nudge_retention_reminder_keep(r, pp.p, s.reminder_id IS NOT NULL) AS keep
             FROM reminders r CROSS JOIN pp LEFT JOIN staying s ON s.reminder_id = r.id),
         named AS (
             SELECT DISTINCT rk.tenant_id, rk.subscriber_ref, unnest(rk.channels) AS channel
             FROM rk WHERE rk.keep IS NOT NULL)
         SELECT 'deliveries' AS tbl, dk.state, dk.band, dk.keep, count(*) AS n
           FROM dk GROUP BY dk.state, dk.band, dk.keep
         UNION ALL
         SELECT 'attempts', NULL, NULL, dk.keep, count(*)
           FROM attempts a JOIN dk ON dk.id = a.delivery_id GROUP BY dk.keep
         UNION ALL
         SELECT 'redrive_items', NULL, NULL,
                CASE WHEN r.state IN ('running', 'paused') THEN 'awaiting_redrive' ELSE dk.keep END,
                count(*)
           FROM redrive_items ri JOIN redrives r ON r.id = ri.redrive_id
           JOIN dk ON dk.id = ri.delivery_id GROUP BY 4
         UNION ALL
         SELECT 'dead_letters', NULL, NULL,
                CASE WHEN dk.id IS NOT NULL
                     THEN CASE WHEN dk.keep IS NOT NULL THEN 'with_delivery' END
                     ELSE nudge_retention_dead_letter_keep(l, pp.p) END,
                count(*)
           FROM dead_letters l CROSS JOIN pp LEFT JOIN dk ON dk.id = l.delivery_id GROUP BY 4
         UNION ALL
         SELECT 'reminders', NULL, NULL, rk.keep, count(*) FROM rk GROUP BY 4
         UNION ALL
         SELECT 'contacts', NULL, NULL,
                nudge_retention_contact_keep(c, pp.p, n.channel IS NOT NULL), count(*)
           FROM contacts c CROSS JOIN pp
           LEFT JOIN named n ON n.tenant_id = c.tenant_id AND n.subscriber_ref = c.subscriber_ref
                            AND n.channel = c.channel
           GROUP BY 4
         UNION ALL
         SELECT 'audit_log', NULL, NULL,
                CASE WHEN a.at > (pp.p).at - make_interval(secs => (pp.p).audit_s)
                     THEN 'too_young' END, count(*)
           FROM audit_log a CROSS JOIN pp GROUP BY 4
         UNION ALL
         SELECT 'consent_history', NULL, NULL,
                CASE WHEN h.provider_event IS NOT NULL THEN 'replay_guard'
                     WHEN h.recorded_at > (pp.p).at - make_interval(secs => (pp.p).audit_s)
                     THEN 'too_young' END, count(*)
           FROM consent_history h CROSS JOIN pp GROUP BY 4
         UNION ALL
         SELECT 'redrives', NULL, NULL,
                CASE WHEN r.state IN ('running', 'paused') THEN 'awaiting_redrive'
                     WHEN r.finished_at > (pp.p).at - make_interval(secs => (pp.p).audit_s)
                         THEN 'too_young'
                     WHEN EXISTS (SELECT 1 FROM redrive_items ri JOIN dk ON dk.id = ri.delivery_id
                                  WHERE ri.redrive_id = r.id AND dk.keep IS NOT NULL)
                         THEN 'has_delivery' END,
                count(*)
           FROM redrives r CROSS JOIN pp GROUP BY 4
         UNION ALL
         SELECT 'delivery_events', NULL, NULL,
                nudge_retention_event_keep(e, (pp.p).at, $9::bigint, $10::bigint,
                                           w.acked_position),
                count(*)
           FROM delivery_events e CROSS JOIN pp
           LEFT JOIN tenant_webhooks w ON w.tenant_id = e.tenant_id
           GROUP BY 4"
    )
}

fn fold(
    at: DateTime<Utc>,
    policy: &RetentionPolicy,
    rows: Vec<CountRow>,
) -> Result<RetentionPlan, LedgerError> {
    let mut plan = RetentionPlan {
        at,
        policy: policy.days(),
        deliveries: Vec::new(),
        tables: RetentionTable::ALL
            .into_iter()
            .map(|t| (t, TableCount::default()))
            .collect(),
    };
    for row in rows {
        let table = RetentionTable::parse(&row.tbl)?;
        let kept = row.keep.as_deref().map(KeepReason::parse).transpose()?;
        let n = u64::try_from(row.n).unwrap_or(0);
        let entry = plan.tables.entry(table).or_default();
        match kept {
            None => entry.delete += n,
            Some(why) => *entry.kept.entry(why).or_default() += n,
        }
        if table == RetentionTable::Deliveries {
            let state = row
                .state
                .as_deref()
                .unwrap_or_default()
                .parse()
                .map_err(|e| LedgerError::corrupt("deliveries", e))?;
            let age_band = row
                .band
                .as_deref()
                .and_then(AgeBand::parse)
                .ok_or_else(|| LedgerError::corrupt("deliveries", "age band"))?;
            plan.deliveries.push(DeliveryCount {
                state,
                age_band,
                kept,
                count: n,
            });
        }
    }
    plan.deliveries
        .sort_by_key(|c| (c.state.as_str(), c.age_band, c.kept));
    Ok(plan)
}

/// How long the counting statement may run: it reads every row of the ledger's tables once,
/// in one snapshot and without a row lock, which on a large ledger takes longer than the
/// `database.statement_timeout_ms` meant for the pipeline's statements (1,000,000 deliveries:
/// about 16 s on two cores).
const PLAN_TIMEOUT: &str = "SET LOCAL statement_timeout = '15min'";

/// Counts inside the caller's transaction (the timeout is set for that transaction only).
pub(super) async fn plan_on(
    conn: &mut PgConnection,
    policy: &RetentionPolicy,
    at: DateTime<Utc>,
) -> Result<RetentionPlan, LedgerError> {
    sqlx::query(PLAN_TIMEOUT).execute(&mut *conn).await?;
    let sql = plan_sql();
    let rows: Vec<CountRow> =
        bind_policy(sqlx::query_as(sqlx::AssertSqlSafe(sql)), at, &policy.days())
            .fetch_all(&mut *conn)
            .await?;
    fold(at, policy, rows)
}

impl Ledger {
    /// What a run would delete at `at` under `policy`, by table (deliveries by state and age
    /// band), with what stays and why. Reads only, in one snapshot.
    pub async fn plan_retention(
        &self,
        policy: &RetentionPolicy,
        at: LedgerTime,
    ) -> Result<RetentionPlan, LedgerError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await?;
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT COALESCE($1, now())")
            .bind(at.bind())
            .fetch_one(&mut *tx)
            .await?;
        let plan = plan_on(&mut tx, policy, now).await?;
        tx.commit().await?;
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_withheld_reminder_keeps_its_public_name_held_by_operator() {
        let reason = KeepReason::WithheldByOperator;
        assert_eq!(reason.as_str(), "held_by_operator");
        assert_eq!(KeepReason::parse("held_by_operator").unwrap(), reason);
        assert_eq!(
            serde_json::to_string(&reason).unwrap(),
            "\"held_by_operator\""
        );
    }
}
