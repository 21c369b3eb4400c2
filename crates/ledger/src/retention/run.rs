//! A retention run's lifecycle: what blocks it, the one-run lock, the counted start, the
//! batches through the database's deletion functions, and the end with its counts compared
//! (the protocol is the parent module's).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, RedriveId, RetentionPolicy};

use super::{RetentionPlan, RetentionTable, plan_on, seconds};
use crate::deliveries::LedgerTime;
use crate::{Ledger, LedgerError, MIGRATOR};

/// Why a run must not start now.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "blocker", rename_all = "snake_case")]
pub enum Blocker {
    Draining {
        channel: Channel,
    },
    Redrive {
        id: RedriveId,
        channel: Channel,
    },
    /// Owed deliveries of the channel under an owner other than the channel's.
    OwnershipChange {
        channel: Channel,
        deliveries: u64,
    },
    /// Another retention run is in progress (another janitor replica).
    RunInProgress,
    /// The ledger's applied migrations are not the ones this build was made for.
    SchemaVersion {
        found: Option<i64>,
        expected: i64,
    },
}

impl std::fmt::Display for Blocker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Blocker::Draining { channel } => write!(f, "channel {channel} is draining"),
            Blocker::Redrive { id, channel } => {
                write!(f, "redrive {id} on {channel} is running or paused")
            }
            Blocker::OwnershipChange {
                channel,
                deliveries,
            } => write!(
                f,
                "ownership change on {channel} in progress ({deliveries} owed deliveries under another owner)"
            ),
            Blocker::RunInProgress => f.write_str("another retention run is in progress"),
            Blocker::SchemaVersion { found, expected } => write!(
                f,
                "ledger schema is at migration {}, this build expects {expected}",
                found.map_or_else(|| "none (or a failed one)".to_owned(), |v| v.to_string())
            ),
        }
    }
}

/// A run whose row is written: its id and plan, and the session lock that makes it the only
/// run (released when this is dropped, or when its process dies and the connection closes).
#[derive(Debug)]
pub struct RetentionRun {
    pub id: i64,
    pub plan: RetentionPlan,
    lock: sqlx::PgConnection,
}

/// The advisory lock key of retention runs: one run at a time across every janitor replica,
/// so two runs never split one set of rows between them (each would then disagree with its
/// own counts).
const RUN_LOCK_KEY: i64 = 0x6e75_6467_6552_6574; // "nudgeRet"

/// What an export keeps of one deleted delivery: ids, state, times and outcome classes, never
/// a destination, content or subscriber reference.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct DeletedDelivery {
    pub delivery_id: uuid::Uuid,
    pub reminder_id: uuid::Uuid,
    pub tenant_id: uuid::Uuid,
    pub channel: String,
    pub state: String,
    pub scheduled_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub settled_at: DateTime<Utc>,
    pub attempt_count: i32,
    /// Each attempt's outcome class, in attempt order.
    pub outcome_classes: Vec<String>,
}

/// What one batch deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetentionBatch {
    /// Deliveries (with their attempts, dead letters, finished redrive items and emptied
    /// reminders).
    Deliveries(Vec<DeletedDelivery>),
    /// Rows of another table.
    Rows { table: RetentionTable, deleted: u64 },
    /// Nothing left that the run may delete.
    Done,
}

/// How a run ended, as the caller saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnd {
    /// Batches ran until nothing was left: the counts must agree.
    Completed,
    /// Stopped between batches (shutdown, a blocker appeared, an error): the next run goes on.
    Stopped(String),
    /// The database refused a batch that would have deleted more than the run counted.
    Overrun(String),
}

/// A run's final state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Finished,
    Stopped,
    /// Completed, but the deleted counts are not the planned ones.
    Mismatch,
}

/// A run's counts once it ended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RunSummary {
    pub id: i64,
    pub state: RunState,
    pub planned: BTreeMap<RetentionTable, u64>,
    pub deleted: BTreeMap<RetentionTable, u64>,
    /// Tables whose deleted count differs from the planned one (a completed run only).
    pub disagreeing: Vec<RetentionTable>,
}

fn counts(value: &serde_json::Value) -> BTreeMap<RetentionTable, u64> {
    RetentionTable::ALL
        .into_iter()
        .map(|t| {
            (
                t,
                value
                    .get(t.as_str())
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0),
            )
        })
        .collect()
}

/// A deletion function refusing to go past the run's counts.
fn overran(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) if db.message().contains("more than the") => {
            Some(db.message().to_owned())
        }
        _ => None,
    }
}

impl Ledger {
    /// Whether this connection's role may DELETE from `deliveries` directly: the janitor
    /// should connect as `nudge_janitor`, which may not.
    pub async fn can_delete_directly(&self) -> Result<bool, LedgerError> {
        Ok(
            sqlx::query_scalar("SELECT has_table_privilege('deliveries', 'DELETE')")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    /// How long until a retention run is due: `interval` after the start of the last run that
    /// finished, compared with the database's clock (the instant a run records: the janitor's
    /// runs record the database's), zero when that time has passed or no run has finished yet.
    /// A run that stopped or disagreed with its plan does not count: it puts no run off.
    pub async fn retention_due_in(&self, interval: Duration) -> Result<Duration, LedgerError> {
        let seconds: Option<f64> = sqlx::query_scalar(
            "SELECT extract(epoch FROM max(started_at) + make_interval(secs => $1) - now())::float8
             FROM retention_runs WHERE state = 'finished'",
        )
        .bind(interval.as_secs_f64())
        .fetch_one(&self.pool)
        .await?;
        Ok(seconds.filter(|s| *s > 0.0).map_or(Duration::ZERO, |s| {
            Duration::from_secs_f64(s.min(interval.as_secs_f64()))
        }))
    }

    /// Why a run must not start now; empty when it may.
    pub async fn retention_blockers(&self) -> Result<Vec<Blocker>, LedgerError> {
        let mut blockers = Vec::new();
        let expected = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
        let (found, failed): (Option<i64>, bool) = sqlx::query_as(
            "SELECT max(version) FILTER (WHERE success), bool_or(NOT success) IS TRUE
             FROM _sqlx_migrations",
        )
        .fetch_one(&self.pool)
        .await?;
        if failed || found != Some(expected) {
            blockers.push(Blocker::SchemaVersion {
                found: found.filter(|_| !failed),
                expected,
            });
        }
        let draining: Vec<String> = sqlx::query_scalar(
            "SELECT channel FROM channel_controls WHERE draining ORDER BY channel",
        )
        .fetch_all(&self.pool)
        .await?;
        for channel in draining {
            blockers.push(Blocker::Draining {
                channel: channel
                    .parse()
                    .map_err(|e| LedgerError::corrupt("channel_controls", e))?,
            });
        }
        let redrives: Vec<(i64, String)> = sqlx::query_as(
            "SELECT id, channel FROM redrives WHERE state IN ('running', 'paused') ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await?;
        for (id, channel) in redrives {
            blockers.push(Blocker::Redrive {
                id: RedriveId::try_from(id).map_err(|e| LedgerError::corrupt("redrives", e))?,
                channel: channel
                    .parse()
                    .map_err(|e| LedgerError::corrupt("redrives", e))?,
            });
        }
        // Two arms, each the predicate of a partial index (owed work, leases), so the check
        // reads the live set only, however much settled history the table holds.
        let moving: Vec<(String, i64)> = sqlx::query_as(
            "SELECT channel, sum(n)::bigint FROM (
                 SELECT d.channel, count(*) AS n FROM deliveries d
                 JOIN channel_controls c ON c.channel = d.channel
                 WHERE d.state IN ('scheduled', 'queued', 'retry_wait') AND d.owner <> c.owner
                 GROUP BY d.channel
                 UNION ALL
                 SELECT d.channel, count(*) FROM deliveries d
                 JOIN channel_controls c ON c.channel = d.channel
                 WHERE d.state = 'sending' AND d.owner <> c.owner
                 GROUP BY d.channel) x
             GROUP BY channel ORDER BY channel",
        )
        .fetch_all(&self.pool)
        .await?;
        for (channel, n) in moving {
            blockers.push(Blocker::OwnershipChange {
                channel: channel
                    .parse()
                    .map_err(|e| LedgerError::corrupt("deliveries", e))?,
                deliveries: u64::try_from(n).unwrap_or(0),
            });
        }
        Ok(blockers)
    }

    /// Counts what a run may delete at `at` and records the run (instant, policy, counts,
    /// `runner`) before anything is deleted, in one transaction. Only one run at a time:
    /// [`LedgerError::RetentionRunning`] when another holds the lock. A run left `running` by
    /// a janitor that died is recorded `stopped` first.
    pub async fn begin_retention_run(
        &self,
        policy: &RetentionPolicy,
        runner: &str,
        at: LedgerTime,
    ) -> Result<RetentionRun, LedgerError> {
        if runner.is_empty() || runner.chars().count() > 200 {
            return Err(LedgerError::InvalidInput("a runner is 1 to 200 characters"));
        }
        // A connection of its own, closed (not returned to the pool) when the run is dropped,
        // so the session lock cannot outlive the run.
        let mut lock = self.pool.acquire().await?.detach();
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(RUN_LOCK_KEY)
            .fetch_one(&mut lock)
            .await?;
        if !locked {
            return Err(LedgerError::RetentionRunning);
        }
        sqlx::query(
            "UPDATE retention_runs SET state = 'stopped', finished_at = now(),
                 stop_reason = 'abandoned: its janitor stopped during the run'
             WHERE state = 'running'",
        )
        .execute(&self.pool)
        .await?;
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await?;
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT COALESCE($1, now())")
            .bind(at.bind())
            .fetch_one(&mut *tx)
            .await?;
        let plan = plan_on(&mut tx, policy, now).await?;
        let planned: serde_json::Value = plan
            .to_delete()
            .into_iter()
            .map(|(t, n)| (t.as_str().to_owned(), serde_json::Value::from(n)))
            .collect::<serde_json::Map<_, _>>()
            .into();
        let d = policy.days();
        let id: i64 = sqlx::query_scalar(
            // What the events' deletions read instead of the webhooks as they move: the last
            // position of an event old enough to go, and each webhook's acknowledged position,
            // in the snapshot the count read.
            "INSERT INTO retention_runs (started_at, runner, delivered_s, expired_s, cancelled_s,
                 dead_lettered_s, reminders_s, contacts_s, audit_s, planned, events_s,
                 events_unacknowledged_s, events_through, event_acks)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12,
                     (SELECT max(e.position) FROM delivery_events e
                      WHERE e.occurred_at <= $1 - make_interval(secs => $11)),
                     (SELECT COALESCE(jsonb_object_agg(w.tenant_id::text, w.acked_position),
                                      '{}'::jsonb)
                      FROM tenant_webhooks w))
             RETURNING id",
        )
        .bind(now)
        .bind(runner)
        .bind(seconds(d.delivered))
        .bind(seconds(d.expired))
        .bind(seconds(d.cancelled))
        .bind(seconds(d.dead_lettered))
        .bind(seconds(d.reminders))
        .bind(seconds(d.contacts))
        .bind(seconds(d.audit))
        .bind(planned)
        .bind(seconds(d.events))
        .bind(seconds(d.events_unacknowledged))
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(RetentionRun { id, plan, lock })
    }

    /// Deletes one batch of at most `limit` rows for run `run` through the database's
    /// deletion functions, deliveries first. A delivery batch is passed to `before_commit`
    /// before it commits (the audit export); an error from it rolls the batch back.
    pub async fn retention_batch(
        &self,
        run: i64,
        limit: u32,
        before_commit: &mut (dyn FnMut(&[DeletedDelivery]) -> std::io::Result<()> + Send),
    ) -> Result<RetentionBatch, LedgerError> {
        let limit = i32::try_from(limit).unwrap_or(i32::MAX);
        let mut tx = self.pool.begin().await?;
        let deleted: Vec<DeletedDelivery> = sqlx::query_as(
            "SELECT delivery_id, reminder_id, tenant_id, channel, state, scheduled_at, created_at,
                    settled_at, attempt_count, outcome_classes
             FROM nudge_retention_delete_deliveries($1, $2)",
        )
        .bind(run)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| overran(&e).map_or(LedgerError::Database(e), LedgerError::RetentionOverrun))?;
        if !deleted.is_empty() {
            before_commit(&deleted).map_err(LedgerError::Export)?;
            tx.commit().await?;
            return Ok(RetentionBatch::Deliveries(deleted));
        }
        let rest: Option<(String, i64)> =
            sqlx::query_as("SELECT table_name, deleted FROM nudge_retention_delete_rest($1, $2)")
                .bind(run)
                .bind(limit)
                .fetch_optional(&mut *tx)
                .await
                .map_err(|e| {
                    overran(&e).map_or(LedgerError::Database(e), LedgerError::RetentionOverrun)
                })?;
        tx.commit().await?;
        match rest {
            Some((table, n)) => Ok(RetentionBatch::Rows {
                table: RetentionTable::parse(&table)?,
                deleted: u64::try_from(n).unwrap_or(0),
            }),
            None => Ok(RetentionBatch::Done),
        }
    }

    /// Records how `run` ended and compares its counts: a completed run whose deleted counts
    /// are not its planned ones ends `mismatch`, naming the tables. Releases the run's lock.
    pub async fn finish_retention_run(
        &self,
        run: RetentionRun,
        end: RunEnd,
    ) -> Result<RunSummary, LedgerError> {
        let RetentionRun { id: run, lock, .. } = run;
        let summary = self.record_run_end(run, end).await;
        // Unlocked explicitly: a dropped connection's lock lasts until the server notices.
        let mut lock = lock;
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(RUN_LOCK_KEY)
            .execute(&mut lock)
            .await?;
        sqlx::Connection::close(lock).await?;
        summary
    }

    async fn record_run_end(&self, run: i64, end: RunEnd) -> Result<RunSummary, LedgerError> {
        let (planned, deleted): (serde_json::Value, serde_json::Value) =
            sqlx::query_as("SELECT planned, deleted FROM retention_runs WHERE id = $1")
                .bind(run)
                .fetch_one(&self.pool)
                .await?;
        let planned = counts(&planned);
        let deleted = counts(&deleted);
        let disagreeing: Vec<RetentionTable> = RetentionTable::ALL
            .into_iter()
            .filter(|t| planned.get(t) != deleted.get(t))
            .collect();
        let (state, reason) = match end {
            RunEnd::Completed if disagreeing.is_empty() => (RunState::Finished, None),
            RunEnd::Completed => (
                RunState::Mismatch,
                Some(format!(
                    "deleted counts differ from planned for {}",
                    disagreeing
                        .iter()
                        .map(|t| t.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
            ),
            RunEnd::Stopped(why) => (RunState::Stopped, Some(why)),
            RunEnd::Overrun(why) => (RunState::Mismatch, Some(why)),
        };
        let state_name = match state {
            RunState::Finished => "finished",
            RunState::Stopped => "stopped",
            RunState::Mismatch => "mismatch",
        };
        let reason = reason.map(|r| r.chars().take(500).collect::<String>());
        sqlx::query(
            "UPDATE retention_runs SET state = $2, stop_reason = $3, finished_at = now()
             WHERE id = $1 AND state = 'running'",
        )
        .bind(run)
        .bind(state_name)
        .bind(reason)
        .execute(&self.pool)
        .await?;
        Ok(RunSummary {
            id: run,
            state,
            planned,
            deleted,
            disagreeing: if matches!(state, RunState::Stopped) {
                Vec::new()
            } else {
                disagreeing
            },
        })
    }
}
