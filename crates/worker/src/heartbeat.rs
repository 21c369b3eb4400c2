//! The worker's heartbeat: every lease this worker holds is renewed together, every
//! `worker.heartbeat_ms`, for as long as something here still needs it.
//!
//! A lease is held by a [`HeldLease`] from the lease step until its message is done: through
//! the wait for a slot, the request, and the outcome held by the recorder while the ledger is
//! away. Dropping it (wherever the delivery's story ends, a panic included) stops its renewal,
//! so the book never renews a lease nobody here will finish: the lease lapses within
//! `worker.lease_seconds` and the reaper takes it. Each renewal moves the lease's [`LeaseEnd`],
//! which the send's window reads (`nudge_provider::SendWindow::renewed`).
//!
//! The heartbeat is one statement for all of a worker's leases ([`Ledger::renew_leases`]). It
//! never gives up while the worker runs: after the ledger was away it renews at once, before
//! the janitor's reaper may act (the reaper waits a grace after the ledger comes back).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nudge_domain::DeliveryId;
use nudge_ledger::{LeasedDelivery, Ledger, LedgerTime, MessagePointer};
use nudge_provider::LeaseEnd;
use nudge_telemetry::error_chain;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The leases this worker holds, by delivery.
#[derive(Debug, Default)]
pub struct LeaseBook {
    held: Mutex<HashMap<DeliveryId, Entry>>,
}

#[derive(Debug)]
struct Entry {
    generation: u64,
    end: Arc<LeaseEnd>,
}

/// One lease this worker holds; renewed by the heartbeat until dropped.
#[derive(Debug)]
pub struct HeldLease {
    book: Arc<LeaseBook>,
    id: DeliveryId,
    end: Arc<LeaseEnd>,
}

impl HeldLease {
    /// The lease's end as last renewed (by the heartbeat, the fence or a new slot).
    pub fn end(&self) -> Arc<LeaseEnd> {
        self.end.clone()
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        self.book.lock().remove(&self.id);
    }
}

impl LeaseBook {
    /// Starts holding `lease`: the heartbeat renews it until the returned guard is dropped.
    pub fn hold(self: &Arc<Self>, lease: &LeasedDelivery) -> HeldLease {
        let end = Arc::new(LeaseEnd::new(lease.lease_expires_at));
        self.lock().insert(
            lease.id,
            Entry {
                generation: lease.generation,
                end: end.clone(),
            },
        );
        HeldLease {
            book: self.clone(),
            id: lease.id,
            end,
        }
    }

    /// How many leases are held now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<DeliveryId, Entry>> {
        // A panic while the map was held left it whole (every operation is one call).
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn pointers(&self) -> Vec<MessagePointer> {
        self.lock()
            .iter()
            .map(|(id, entry)| MessagePointer {
                delivery_id: *id,
                generation: entry.generation,
            })
            .collect()
    }

    /// Renews every lease held, in one statement; returns how many the ledger renewed.
    pub async fn renew(
        &self,
        ledger: &Ledger,
        holder: &str,
        lease_for: Duration,
    ) -> Result<usize, nudge_ledger::LedgerError> {
        let held = self.pointers();
        let renewed = ledger
            .renew_leases(holder, &held, lease_for, LedgerTime::Database)
            .await?;
        let book = self.lock();
        for lease in &renewed {
            if let Some(entry) = book.get(&lease.delivery_id) {
                entry.end.renewed(lease.lease_expires_at);
            }
        }
        Ok(renewed.len())
    }
}

/// Renews the book's leases every `every` until `stop`. A failed beat is logged once per
/// outage and tried again at the next; the first beat after one says how long it lasted.
pub async fn run(
    book: Arc<LeaseBook>,
    ledger: Ledger,
    holder: String,
    lease_for: Duration,
    every: Duration,
    stop: CancellationToken,
) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing_since: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        if book.is_empty() {
            continue;
        }
        match book.renew(&ledger, &holder, lease_for).await {
            Ok(renewed) => {
                if let Some(since) = failing_since.take() {
                    info!(
                        renewed,
                        failing_ms = since.elapsed().as_millis() as u64,
                        "leases renewed again after the ledger came back"
                    );
                }
            }
            Err(e) => {
                if failing_since.is_none() {
                    warn!(error.cause_chain = %error_chain(&e), held = book.len(),
                          "failed to renew this worker's leases; trying again every beat");
                    failing_since = Some(tokio::time::Instant::now());
                }
            }
        }
    }
}
