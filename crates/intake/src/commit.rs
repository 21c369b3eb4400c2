//! Group commit of single reminders: concurrent posts of one reminder each are imported
//! together, in one transaction of the ledger's batch import, and each post is answered from
//! its own outcome once that transaction has committed.
//!
//! Why: a post's cost was its commit. Under load the database spent its time waiting for the
//! WAL flush of each post's transaction (sampled during the benchmark: most active backends in
//! `WALWrite`/`WALSync` on `COMMIT`), and a transaction of one reminder is six statements
//! where one of fifty is barely more. The import's rules are the same for a batch as for one
//! reminder (idempotent on `(tenant, event_id)`, within a batch too: the first occurrence wins,
//! the others answer as duplicates or conflicts), so a post answers exactly as it would alone.
//!
//! Protocol: a few committer tasks share one bounded queue. A free committer waits for the
//! first post, takes whatever else is already queued (up to [`BATCH_MAX`]) without waiting
//! for more, reads each of their tenants from the ledger once and verifies each post's
//! signature again against the secrets read (a post authenticated from the intake's cache of
//! tenants is refused here, writing nothing, if its secret was retired since; the answer's
//! pause and drain flags are those read), imports the rest and answers each. Nothing is held back for a batch to fill: a lone
//! post is committed at once, and batches grow only while the committers are busy. When a
//! batch fails as a whole, each of its reminders is imported again on its own, so a failure
//! answers only the post it belongs to.
//!
//! Must never: answer a post before the transaction holding its reminder committed; answer a
//! post with another's outcome or error. The committers end when every handle is dropped,
//! after answering what they hold.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use chrono::{DateTime, Utc};
use nudge_ledger::{
    DestinationCipher, ImportOutcome, ImportReminder, IntakeTenant, Ledger, LedgerError,
};
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::signature::{self, Refusal, SignatureHeader, Signed};

/// The most reminders imported in one transaction.
pub const BATCH_MAX: usize = 64;

/// How many transactions may be committing at once (each holds one connection).
pub const COMMITTERS: usize = 4;

/// Posts waiting for a committer; beyond this a post waits to be queued.
const QUEUE: usize = 1024;

/// Why a post got no outcome.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("failed to import the reminder")]
    Ledger(#[from] LedgerError),
    #[error("the import answered nothing for the reminder")]
    NoOutcome,
    #[error("the committers have stopped")]
    Stopped,
    #[error("failed to read the tenant: {0}")]
    Tenant(String),
    /// The ledger is away or read-only (`LedgerError::is_unavailable`): nothing was imported.
    #[error("the ledger is away: {0}")]
    Away(String),
    /// The signature does not match the tenant's secrets as read before the import.
    #[error("refused: {}", .0.internal())]
    Refused(Refusal),
}

impl CommitError {
    /// Whether the post failed because the ledger is away or read-only: the client is asked
    /// to come back (503), not told of a fault (500).
    pub fn is_unavailable(&self) -> bool {
        match self {
            CommitError::Away(_) => true,
            CommitError::Ledger(e) => e.is_unavailable(),
            _ => false,
        }
    }

    fn from_ledger(e: &LedgerError) -> Self {
        let chain = nudge_telemetry::error_chain(e);
        if e.is_unavailable() {
            CommitError::Away(chain)
        } else {
            CommitError::Tenant(chain)
        }
    }
}

/// What a post's signature covered, to verify it again against its tenant as read just
/// before the import.
#[derive(Debug, Clone)]
pub struct Check {
    pub tenant: String,
    pub signature: SignatureHeader,
    pub method: String,
    pub target: String,
    pub body: Bytes,
}

/// A post's outcome, with its tenant as read just before the import.
#[derive(Debug, Clone)]
pub struct Committed {
    pub outcome: ImportOutcome,
    pub tenant: IntakeTenant,
}

struct Job {
    item: ImportReminder,
    check: Check,
    answer: oneshot::Sender<Result<Committed, CommitError>>,
}

type Clock = Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>;

/// A handle on the committers. Cloning it shares them.
#[derive(Clone)]
pub struct Committer {
    queue: mpsc::Sender<Job>,
}

impl std::fmt::Debug for Committer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Committer").finish_non_exhaustive()
    }
}

impl Committer {
    /// Starts [`COMMITTERS`] tasks on the current tokio runtime. `clock` gives the time the
    /// import is told it is (as for a single import).
    pub fn start(ledger: Ledger, cipher: DestinationCipher, clock: Clock) -> Self {
        let (queue, receiver) = mpsc::channel(QUEUE);
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..COMMITTERS {
            tokio::spawn(run(
                ledger.clone(),
                cipher.clone(),
                clock.clone(),
                receiver.clone(),
            ));
        }
        Self { queue }
    }

    /// Imports `item`, with whatever other posts are waiting, once `check` passes against
    /// its tenant as read then, and answers its own outcome after the commit.
    pub async fn import(
        &self,
        item: ImportReminder,
        check: Check,
    ) -> Result<Committed, CommitError> {
        let (answer, outcome) = oneshot::channel();
        self.queue
            .send(Job {
                item,
                check,
                answer,
            })
            .await
            .map_err(|_| CommitError::Stopped)?;
        outcome.await.map_err(|_| CommitError::Stopped)?
    }
}

async fn run(
    ledger: Ledger,
    cipher: DestinationCipher,
    clock: Clock,
    receiver: Arc<Mutex<mpsc::Receiver<Job>>>,
) {
    loop {
        let mut jobs = Vec::new();
        {
            let mut receiver = receiver.lock().await;
            match receiver.recv().await {
                Some(job) => jobs.push(job),
                None => return,
            }
            while jobs.len() < BATCH_MAX {
                match receiver.try_recv() {
                    Ok(job) => jobs.push(job),
                    Err(_) => break,
                }
            }
        }
        commit(&ledger, &cipher, clock(), jobs).await;
    }
}

/// Reads the jobs' tenants, refuses the jobs whose signature no longer matches, imports the
/// rest in one transaction and answers each; when that fails, each on its own.
async fn commit(ledger: &Ledger, cipher: &DestinationCipher, now: DateTime<Utc>, jobs: Vec<Job>) {
    let mut tenants: HashMap<String, Result<Option<IntakeTenant>, LedgerError>> = HashMap::new();
    for job in &jobs {
        if !tenants.contains_key(&job.check.tenant) {
            let read = ledger.intake_tenant(&job.check.tenant, cipher).await;
            tenants.insert(job.check.tenant.clone(), read);
        }
    }
    let mut items = Vec::with_capacity(jobs.len());
    let mut waiting = Vec::with_capacity(jobs.len());
    for job in jobs {
        let tenant = match tenants.get(&job.check.tenant) {
            Some(Ok(tenant)) => tenant.as_ref(),
            Some(Err(e)) => {
                let _ = job.answer.send(Err(CommitError::from_ledger(e)));
                continue;
            }
            None => None,
        };
        let signed = Signed {
            method: &job.check.method,
            target: &job.check.target,
            body: &job.check.body,
        };
        let matched = signature::verify(&job.check.signature, tenant, &signed);
        match tenant {
            Some(tenant) if matched && tenant.id == job.item.reminder.tenant_id() => {
                items.push(job.item);
                waiting.push((job.answer, tenant.clone()));
            }
            Some(tenant) if !tenant.secrets.is_empty() => {
                let _ = job
                    .answer
                    .send(Err(CommitError::Refused(Refusal::BadSignature)));
            }
            _ => {
                let _ = job
                    .answer
                    .send(Err(CommitError::Refused(Refusal::UnknownTenant)));
            }
        }
    }
    if items.is_empty() {
        return;
    }
    let together = ledger.import_reminders(&items, cipher, now).await;
    match together {
        Ok(outcomes) if outcomes.len() == items.len() => {
            for ((answer, tenant), outcome) in waiting.into_iter().zip(outcomes) {
                // A post whose client has gone is committed all the same.
                let _ = answer.send(Ok(Committed { outcome, tenant }));
            }
        }
        // The ledger away fails each reminder alone the same way: every post is told so at
        // once, and none waits for its own try.
        Err(e) if e.is_unavailable() => {
            let chain = nudge_telemetry::error_chain(&e);
            for (answer, _) in waiting {
                let _ = answer.send(Err(CommitError::Away(chain.clone())));
            }
        }
        together => {
            if let ([_], [_]) = (items.as_slice(), waiting.as_slice()) {
                let result = together
                    .map_err(CommitError::from)
                    .and_then(|o| o.first().copied().ok_or(CommitError::NoOutcome));
                if let Some((answer, tenant)) = waiting.into_iter().next() {
                    let _ = answer.send(result.map(|outcome| Committed { outcome, tenant }));
                }
                return;
            }
            for (item, (answer, tenant)) in items.iter().zip(waiting) {
                let result = ledger
                    .import_reminders(std::slice::from_ref(item), cipher, now)
                    .await
                    .map_err(CommitError::from)
                    .and_then(|o| o.first().copied().ok_or(CommitError::NoOutcome));
                let _ = answer.send(result.map(|outcome| Committed { outcome, tenant }));
            }
        }
    }
}
