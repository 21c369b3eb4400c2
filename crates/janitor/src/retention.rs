//! Retention in the janitor: one run at a time, counted before it deletes, in bounded batches
//! with a pause between them, beside live traffic.
//!
//! A run starts only when the ledger says nothing blocks it (a drain, an active redrive, an
//! ownership change in progress, a schema this build was not made for), and says which when
//! something does; the same check runs again between batches, so a drain started mid-run
//! stops it. SIGTERM stops a run between batches: each batch is its own transaction, the run
//! is recorded `stopped`, and the next run counts and deletes what is left. With
//! `retention.export_dir` set, every deleted delivery's ids, state, times and outcome classes
//! are appended to `retention-<run id>.jsonl` and synced before its batch commits.
//!
//! It must never delete by itself: every row goes through the database's deletion functions,
//! which re-check the rule (see `nudge_ledger`'s retention module).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use nudge_config::RetentionConfig;
use nudge_domain::RetentionPolicy;
use nudge_ledger::{
    Blocker, DeletedDelivery, Ledger, LedgerError, LedgerTime, RetentionBatch, RunEnd, RunState,
    RunSummary,
};
use nudge_telemetry::error_chain;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// How a run proceeds: the policy and the pace.
#[derive(Debug, Clone)]
pub struct RetentionSettings {
    pub policy: RetentionPolicy,
    pub batch_size: u32,
    pub pause: Duration,
    pub export_dir: Option<PathBuf>,
}

impl RetentionSettings {
    /// From a validated `[retention]` section.
    pub fn from_config(config: &RetentionConfig) -> anyhow::Result<Self> {
        Ok(Self {
            policy: config.policy()?,
            batch_size: config.batch_size,
            pause: Duration::from_millis(config.pause_ms),
            export_dir: config.export_dir.clone(),
        })
    }
}

/// What one call of [`retention_once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetentionOutcome {
    /// Nothing ran, for these reasons.
    Refused(Vec<Blocker>),
    /// A run was recorded and ended so.
    Ran(RunSummary),
}

/// One line of the audit export.
#[derive(serde::Serialize)]
struct ExportLine<'a> {
    run_id: i64,
    #[serde(flatten)]
    delivery: &'a DeletedDelivery,
}

fn export_file(dir: &Path, run: i64) -> anyhow::Result<std::fs::File> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("failed to create retention.export_dir {}", dir.display()))?;
    let path = dir.join(format!("retention-{run}.jsonl"));
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("failed to open the retention export {}", path.display()))
}

fn write_export(
    file: &mut std::fs::File,
    run: i64,
    rows: &[DeletedDelivery],
) -> std::io::Result<()> {
    let mut buffer = Vec::new();
    for delivery in rows {
        serde_json::to_writer(
            &mut buffer,
            &ExportLine {
                run_id: run,
                delivery,
            },
        )?;
        buffer.push(b'\n');
    }
    file.write_all(&buffer)?;
    file.sync_data()
}

fn describe(blockers: &[Blocker]) -> String {
    blockers
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// One retention run, unless something blocks it: counts and records the run, deletes in
/// batches with a pause between them, and stops between batches at `shutdown` or when a
/// blocker appears. `at` is the run's instant (the database's clock in the janitor).
pub async fn retention_once(
    ledger: &Ledger,
    settings: &RetentionSettings,
    runner: &str,
    at: LedgerTime,
    shutdown: &CancellationToken,
) -> anyhow::Result<RetentionOutcome> {
    let blockers = ledger
        .retention_blockers()
        .await
        .context("failed to check what blocks retention")?;
    if !blockers.is_empty() {
        return Ok(RetentionOutcome::Refused(blockers));
    }
    let run = match ledger
        .begin_retention_run(&settings.policy, runner, at)
        .await
    {
        Ok(run) => run,
        Err(LedgerError::RetentionRunning) => {
            return Ok(RetentionOutcome::Refused(vec![Blocker::RunInProgress]));
        }
        Err(e) => return Err(e).context("failed to count and record a retention run"),
    };
    info!(
        run_id = run.id,
        policy = %settings.policy,
        planned = ?run.plan.to_delete(),
        "retention run counted; deleting"
    );
    let run_id = run.id;
    let mut export = match &settings.export_dir {
        Some(dir) => match export_file(dir, run.id) {
            Ok(file) => Some(file),
            Err(e) => {
                let reason = format!("{e:#}");
                ledger
                    .finish_retention_run(run, RunEnd::Stopped(reason))
                    .await?;
                return Err(e);
            }
        },
        None => None,
    };
    let end = loop {
        let batch = ledger
            .retention_batch(run_id, settings.batch_size, &mut |rows| match &mut export {
                Some(file) => write_export(file, run_id, rows),
                None => Ok(()),
            })
            .await;
        match batch {
            Ok(RetentionBatch::Done) => break RunEnd::Completed,
            Ok(_) => {}
            Err(LedgerError::RetentionOverrun(why)) => break RunEnd::Overrun(why),
            Err(e) => break RunEnd::Stopped(format!("{:#}", anyhow::Error::from(e))),
        }
        match ledger.retention_blockers().await {
            Ok(blockers) if !blockers.is_empty() => break RunEnd::Stopped(describe(&blockers)),
            Ok(_) => {}
            Err(e) => break RunEnd::Stopped(format!("{:#}", anyhow::Error::from(e))),
        }
        if shutdown.is_cancelled() {
            break RunEnd::Stopped("shutdown".to_owned());
        }
        tokio::select! {
            () = shutdown.cancelled() => break RunEnd::Stopped("shutdown".to_owned()),
            () = tokio::time::sleep(settings.pause) => {}
        }
    };
    let summary = ledger
        .finish_retention_run(run, end)
        .await
        .context("failed to record how the retention run ended")?;
    Ok(RetentionOutcome::Ran(summary))
}

/// Runs retention every `interval` until shutdown, logging what each run did or why it did not
/// run. The schedule is the ledger's, not the process's: a run starts `interval` after the last
/// finished run began (whichever janitor ran it), so a restarted or rescheduled janitor does
/// not count the whole ledger again before its time. After a run that did not finish (skipped,
/// stopped, failed) this janitor tries again `interval` later; one starting meanwhile, at once.
pub async fn retention_loop(
    ledger: Ledger,
    settings: RetentionSettings,
    interval: Duration,
    shutdown: CancellationToken,
) {
    match ledger.can_delete_directly().await {
        Ok(true) => warn!(
            "the janitor's database role may DELETE from deliveries directly; connect as \
             nudge_janitor so that only the retention functions can delete"
        ),
        Ok(false) => {}
        Err(e) => {
            warn!(error.cause_chain = %error_chain(&e), "failed to check the janitor's database role")
        }
    }
    let runner = format!("janitor-{}", std::process::id());
    loop {
        match ledger.retention_due_in(interval).await {
            Ok(wait) if !wait.is_zero() => {
                info!(
                    next_run_in_s = wait.as_secs(),
                    "retention: the last finished run is recent; waiting for the next"
                );
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(wait) => {}
                }
                continue;
            }
            Ok(_) => {}
            // The run itself reports the database's trouble, if it lasts.
            Err(e) => {
                warn!(error.cause_chain = %error_chain(&e), "failed to read when retention last ran")
            }
        }
        match retention_once(&ledger, &settings, &runner, LedgerTime::Database, &shutdown).await {
            Ok(RetentionOutcome::Refused(blockers)) => {
                warn!(reasons = %describe(&blockers), "retention run skipped");
            }
            Ok(RetentionOutcome::Ran(summary)) => match summary.state {
                RunState::Finished => {
                    info!(
                        run_id = summary.id,
                        deleted = ?summary.deleted,
                        "retention run finished; deleted counts agree with the plan"
                    );
                    // The next one is due an interval after this one began.
                    continue;
                }
                RunState::Stopped => info!(
                    run_id = summary.id,
                    deleted = ?summary.deleted,
                    planned = ?summary.planned,
                    "retention run stopped between batches; the next run goes on"
                ),
                RunState::Mismatch => error!(
                    run_id = summary.id,
                    deleted = ?summary.deleted,
                    planned = ?summary.planned,
                    tables = ?summary.disagreeing,
                    "retention run stopped: deleted counts disagree with its plan"
                ),
            },
            // Tried again an interval later; the ledger away is the sweep's to report.
            Err(e) if nudge_ledger::is_unavailable(e.as_ref()) => {
                warn!(error.cause_chain = %error_chain(&*e), "retention run not started: the ledger is away")
            }
            Err(e) => error!(error.cause_chain = %error_chain(&*e), "retention run failed"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}
