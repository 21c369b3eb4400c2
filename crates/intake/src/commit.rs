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
//! for more, imports them and answers each. Nothing is held back for a batch to fill: a lone
//! post is committed at once, and batches grow only while the committers are busy. When a
//! batch fails as a whole, each of its reminders is imported again on its own, so a failure
//! answers only the post it belongs to.
//!
//! Must never: answer a post before the transaction holding its reminder committed; answer a
//! post with another's outcome or error. The committers end when every handle is dropped,
//! after answering what they hold.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use nudge_ledger::{DestinationCipher, ImportOutcome, ImportReminder, Ledger, LedgerError};
use tokio::sync::{Mutex, mpsc, oneshot};

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
}

struct Job {
    item: ImportReminder,
    answer: oneshot::Sender<Result<ImportOutcome, CommitError>>,
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

    /// Imports `item`, with whatever other posts are waiting, and answers its own outcome
    /// after the commit.
    pub async fn import(&self, item: ImportReminder) -> Result<ImportOutcome, CommitError> {
        let (answer, outcome) = oneshot::channel();
        self.queue
            .send(Job { item, answer })
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

/// Imports the jobs' reminders in one transaction and answers each; when that fails, each on
/// its own.
async fn commit(ledger: &Ledger, cipher: &DestinationCipher, now: DateTime<Utc>, jobs: Vec<Job>) {
    let (items, answers): (Vec<ImportReminder>, Vec<_>) =
        jobs.into_iter().map(|j| (j.item, j.answer)).unzip();
    let together = ledger.import_reminders(&items, cipher, now).await;
    match together {
        Ok(outcomes) if outcomes.len() == items.len() => {
            for (answer, outcome) in answers.into_iter().zip(outcomes) {
                // A post whose client has gone is committed all the same.
                let _ = answer.send(Ok(outcome));
            }
        }
        together => {
            if let ([_], [_]) = (items.as_slice(), answers.as_slice()) {
                let result = together
                    .map_err(CommitError::from)
                    .and_then(|o| o.first().copied().ok_or(CommitError::NoOutcome));
                if let Some(answer) = answers.into_iter().next() {
                    let _ = answer.send(result);
                }
                return;
            }
            for (item, answer) in items.iter().zip(answers) {
                let result = ledger
                    .import_reminders(std::slice::from_ref(item), cipher, now)
                    .await
                    .map_err(CommitError::from)
                    .and_then(|o| o.first().copied().ok_or(CommitError::NoOutcome));
                let _ = answer.send(result);
            }
        }
    }
}
