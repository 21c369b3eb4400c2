//! What every handler shares: the ledger, the committers of single reminders, the cipher, the
//! metrics, the request limits, the clock, the providers' receipt verifiers, and the intake's
//! cache of tenants.
//!
//! The cache holds tenants as last read (at most 1,024), so that a single
//! reminder's post whose signature matches there skips a read before its body is parsed; its
//! committer reads the tenant and verifies the signature again before anything is written
//! (see [`crate::commit`]). This module must never decide whether a request is authentic
//! ([`crate::auth`] does), and must never import a handler, the authentication or the shapes:
//! they all import it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use chrono::{DateTime, Utc};
use nudge_ledger::{DestinationCipher, IntakeTenant, Ledger};

use crate::commit::Committer;
use crate::metrics::IntakeMetrics;
use crate::receipts::Receipts;

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
    /// The providers' receipt verifiers (`[receipts]`); none until [`AppState::with_receipts`].
    receipts: Arc<Receipts>,
}

struct Inner {
    ledger: Ledger,
    committer: Committer,
    /// Tenants as last read, by name: a single post whose signature matches here skips the
    /// read before its body is parsed (its committer reads and verifies again).
    tenants: Mutex<HashMap<String, IntakeTenant>>,
    cipher: DestinationCipher,
    metrics: Arc<IntakeMetrics>,
    limits: Limits,
    clock: Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>,
    /// Requests answered 503 because the ledger is away: logged once per outage.
    outage: nudge_runtime::Outage,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

/// The request limits the handlers apply (from `[intake]`).
#[derive(Debug, Clone)]
pub struct Limits {
    pub batch_max: usize,
    pub timestamp_tolerance_s: u64,
    pub max_schedule_ahead: chrono::Duration,
}

/// The most tenants the intake keeps between requests.
const TENANTS_CACHED: usize = 1024;

impl AppState {
    /// `cipher` needs the subscriber key. `clock` is the intake's clock (signature freshness
    /// and the schedule-ahead limit); tests move it. Starts the committers of single
    /// reminders ([`Committer`]) on the current tokio runtime; they stop when the last clone
    /// of this state is dropped.
    pub fn new(
        ledger: Ledger,
        cipher: DestinationCipher,
        metrics: Arc<IntakeMetrics>,
        limits: Limits,
        clock: Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>,
    ) -> Self {
        let committer = Committer::start(ledger.clone(), cipher.clone(), clock.clone());
        Self {
            inner: Arc::new(Inner {
                ledger,
                committer,
                tenants: Mutex::new(HashMap::new()),
                cipher,
                metrics,
                limits,
                clock,
                outage: nudge_runtime::Outage::new("intake"),
            }),
            receipts: Arc::default(),
        }
    }

    /// This state, taking the providers' receipts `receipts` verifies.
    pub fn with_receipts(mut self, receipts: Receipts) -> Self {
        self.receipts = Arc::new(receipts);
        self
    }

    pub(crate) fn receipts(&self) -> &Receipts {
        &self.receipts
    }

    pub(crate) fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    pub(crate) fn outage(&self) -> &nudge_runtime::Outage {
        &self.inner.outage
    }

    pub fn metrics(&self) -> &IntakeMetrics {
        &self.inner.metrics
    }

    pub fn ledger(&self) -> &Ledger {
        &self.inner.ledger
    }

    pub(crate) fn cipher(&self) -> &DestinationCipher {
        &self.inner.cipher
    }

    /// The committers of single reminders.
    pub(crate) fn committer(&self) -> &Committer {
        &self.inner.committer
    }

    pub(crate) fn now(&self) -> DateTime<Utc> {
        (self.inner.clock)()
    }

    /// The tenant named `name` as last read, if the cache holds it.
    pub(crate) fn cached_tenant(&self, name: &str) -> Option<IntakeTenant> {
        self.inner
            .tenants
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    /// Keeps `found` as the tenant named `name` (or forgets the name when it has no tenant
    /// with a secret). At most [`TENANTS_CACHED`]: past that the cache starts again empty.
    pub(crate) fn remember_tenant(&self, name: &str, found: Option<&IntakeTenant>) {
        let mut tenants = self
            .inner
            .tenants
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match found {
            Some(tenant) if !tenant.secrets.is_empty() => {
                if tenants.len() >= TENANTS_CACHED && !tenants.contains_key(name) {
                    tenants.clear();
                }
                tenants.insert(name.to_owned(), tenant.clone());
            }
            _ => {
                tenants.remove(name);
            }
        }
    }
}
