//! Group commit of outcomes, and holding on to them while the ledger is away.
//!
//! Concurrent sends hand their outcome to one recorder task, which writes whatever has
//! gathered in one statement ([`Ledger::record_outcomes`]), so a busy worker commits once per
//! group, not once per send. A finished send's outcome is the most valuable thing a worker
//! holds (a 2xx with the provider's message id): when the write fails (PostgreSQL restarting,
//! a connection cut), the recorder keeps the outcomes and tries again, backing off, for as
//! long as the worker runs: each send waits for its reply holding its lease, which the
//! heartbeat renews (and renews first when the ledger comes back, before the reaper may act),
//! so the reaper never decides a delivery whose answer is held here. Only a write that finds
//! the lease gone ends the wait (`Recorded::LeaseLost`). A group
//! the ledger refuses for its data (a constraint broken by one outcome) is written one
//! outcome at a time instead, so one bad row never costs the others their outcome.

use std::time::Duration;

use nudge_domain::Decision;
use nudge_ledger::{AttemptRecord, LeasedDelivery, Ledger, LedgerTime, OutcomeToRecord, Recorded};
use nudge_telemetry::error_chain;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info, warn};

/// The most outcomes written in one statement.
const MAX_GROUP: usize = 256;
/// First and longest pause between two tries of a failed write.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// Why an outcome was not recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotRecorded {
    /// The worker is stopping and the recorder is gone.
    #[error("the recorder stopped")]
    Stopped,
    /// The ledger refused the outcome's data, even without the answer's details: the
    /// reaper decides.
    #[error("the ledger refused the outcome")]
    Refused,
}

struct Job {
    lease: LeasedDelivery,
    decision: Decision,
    attempt: AttemptRecord,
    reply: oneshot::Sender<Result<Recorded, NotRecorded>>,
}

/// A handle on the recorder task; cheap to clone.
#[derive(Debug, Clone)]
pub struct Recorder {
    jobs: mpsc::Sender<Job>,
}

impl Recorder {
    /// Starts the recorder task. It ends when every handle is dropped and its queue is empty.
    /// `suspend_for` is how long an outcome that refused the account's credentials suspends
    /// the account's bucket (`admission.max_pause_s`), in the outcome's transaction.
    pub fn spawn(ledger: Ledger, suspend_for: Duration) -> Self {
        let (jobs, rx) = mpsc::channel(4 * MAX_GROUP);
        tokio::spawn(run(ledger, suspend_for, rx));
        Self { jobs }
    }

    /// Records one outcome, in whatever group it joins; waits until it is written (or given up).
    pub async fn record(
        &self,
        lease: LeasedDelivery,
        decision: Decision,
        attempt: AttemptRecord,
    ) -> Result<Recorded, NotRecorded> {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            lease,
            decision,
            attempt,
            reply,
        };
        if self.jobs.send(job).await.is_err() {
            return Err(NotRecorded::Stopped);
        }
        answer.await.unwrap_or(Err(NotRecorded::Stopped))
    }
}

async fn run(ledger: Ledger, suspend_for: Duration, mut rx: mpsc::Receiver<Job>) {
    let mut group: Vec<Job> = Vec::with_capacity(MAX_GROUP);
    while let Some(first) = rx.recv().await {
        group.push(first);
        while group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        write(&ledger, suspend_for, &mut group).await;
    }
}

/// Writes a group, retrying while the ledger fails; replies to every job. When the ledger
/// refuses the group's data (one outcome breaks a constraint: the whole statement fails, and
/// would fail again until every lease in it lapsed), the outcomes are written one at a time,
/// so one bad row never holds the others; one refused on its own is written once more
/// without the answer's details (its state and attempt are what matter).
async fn write(ledger: &Ledger, suspend_for: Duration, group: &mut Vec<Job>) {
    if !write_retrying(ledger, suspend_for, group).await {
        return;
    }
    warn!(
        outcomes = group.len(),
        "the ledger refused a group of outcomes; writing them one at a time"
    );
    for job in std::mem::take(group) {
        let mut alone = vec![job];
        if !write_retrying(ledger, suspend_for, &mut alone).await {
            continue;
        }
        let Some(mut job) = alone.pop() else {
            continue;
        };
        warn!(delivery_id = %job.lease.id,
              "the ledger refused an outcome; recording it without the answer's details");
        job.decision.facts.http_status = None;
        job.decision.facts.retry_after_seen = None;
        alone.push(job);
        if write_retrying(ledger, suspend_for, &mut alone).await {
            for job in alone {
                error!(delivery_id = %job.lease.id,
                       "the ledger refused an outcome even without the answer's details; the reaper settles it");
                let _ = job.reply.send(Err(NotRecorded::Refused));
            }
        }
    }
}

/// Writes a group, retrying while the ledger fails, and replies to every job; or returns
/// `true` without replying, the group untouched, when the ledger refused its data.
async fn write_retrying(ledger: &Ledger, suspend_for: Duration, group: &mut Vec<Job>) -> bool {
    let mut delay = RETRY_FIRST;
    let mut failures = 0u32;
    loop {
        let outcomes: Vec<OutcomeToRecord<'_>> = group
            .iter()
            .map(|j| OutcomeToRecord {
                lease: &j.lease,
                decision: &j.decision,
                attempt: &j.attempt,
            })
            .collect();
        match ledger
            .record_outcomes(&outcomes, suspend_for, LedgerTime::Database)
            .await
        {
            Ok(recorded) => {
                if failures > 0 {
                    info!(
                        failures,
                        outcomes = group.len(),
                        "outcomes recorded after the ledger came back"
                    );
                }
                for (job, recorded) in group.drain(..).zip(recorded) {
                    let _ = job.reply.send(Ok(recorded));
                }
                return false;
            }
            Err(e) if e.is_data_refused() => {
                warn!(error.cause_chain = %error_chain(&e), outcomes = group.len(),
                      "the ledger refused the outcomes' data");
                return true;
            }
            Err(e) => {
                failures += 1;
                if failures == 1 {
                    warn!(error.cause_chain = %error_chain(&e), outcomes = group.len(),
                          "failed to record outcomes; holding them and trying again");
                }
                // Not cut short at shutdown on purpose: the outcomes held are worth writing
                // while the worker's shutdown grace lasts; past it the process exits and the
                // reaper decides them as it would any lease whose holder died.
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RETRY_MAX);
            }
        }
    }
}
