//! What the pool keeps across a PostgreSQL failover: only connections to a server that takes
//! writes (docs/decisions/0018-the-pool-keeps-only-a-writable-primary.md).
//!
//! - A new connection is refused when its server is in recovery (a standby) or read-only
//!   (`default_transaction_read_only`): the pool tries again within `acquire_timeout_ms`, then
//!   the caller's statement fails as the ledger being away.
//! - Once any statement of the process failed with the ledger away
//!   ([`crate::LedgerError::is_unavailable`]: a cut connection, a shutdown, 25006 from a
//!   primary demoted under a live session), each pool checks its connections again before
//!   handing them out, and discards those whose server no longer takes writes, until as many
//!   checks in a row as it has connections passed.
//! - Otherwise a connection idle for a second or more gets the same check instead of a ping:
//!   one round trip either way.
//!
//! The signal is process-wide ([`unavailable_seen`]), because a statement's error is made in
//! one place (`From<sqlx::Error>`) that knows no pool: another pool of the same process then
//! checks a few connections for nothing, at one small query each.
//!
//! It must never keep a connection to a server that does not take writes once it has been
//! told to look, nor check a busy pool's connections on every hand-out while nothing failed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use sqlx::PgConnection;

use crate::{Ledger, LedgerError};

/// Bumped each time a statement fails with the ledger away.
static UNAVAILABLE_SEEN: AtomicU64 = AtomicU64::new(0);

/// Tells every pool of the process to check its connections before handing them out again.
pub(crate) fn unavailable_seen() {
    UNAVAILABLE_SEEN.fetch_add(1, Ordering::AcqRel);
}

/// Whether the server behind `conn` takes writes: not in recovery and not read-only. A
/// statement runs in a transaction of its own, whose `transaction_read_only` is the session's
/// default, forced on in recovery.
async fn read_only(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'",
    )
    .fetch_one(conn)
    .await
}

const REFUSED: &str = "the server is in recovery or read-only: not the ledger's primary";

/// The pool's `after_connect`: a connection to a server that does not take writes is refused
/// (the pool opens another within its acquire timeout).
pub(crate) async fn refuse_read_only(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    if read_only(conn).await? {
        return Err(sqlx::Error::Io(std::io::Error::other(REFUSED)));
    }
    Ok(())
}

/// One pool's state of suspicion: how many hand-outs in a row are still to be checked since
/// the last failure it heard of.
#[derive(Debug)]
pub(crate) struct Suspicion {
    heard: AtomicU64,
    to_check: AtomicU32,
    /// Checks in a row that clear a suspicion: the pool's size, so that each of its idle
    /// connections (handed out in turn) is checked once.
    clears_after: u32,
}

impl Suspicion {
    pub(crate) fn new(pool_size: u32) -> Arc<Self> {
        Arc::new(Self {
            heard: AtomicU64::new(UNAVAILABLE_SEEN.load(Ordering::Acquire)),
            to_check: AtomicU32::new(0),
            clears_after: pool_size.max(1),
        })
    }

    /// Whether the connection about to be handed out must be checked first.
    fn suspect(&self) -> bool {
        let seen = UNAVAILABLE_SEEN.load(Ordering::Acquire);
        if self.heard.swap(seen, Ordering::AcqRel) != seen {
            self.to_check.store(self.clears_after, Ordering::Release);
        }
        self.to_check.load(Ordering::Acquire) > 0
    }

    fn passed(&self) {
        let _ = self
            .to_check
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    fn failed(&self) {
        self.to_check.store(self.clears_after, Ordering::Release);
    }

    /// The pool's `before_acquire`: `Ok(false)` discards the connection (the pool hands out
    /// another, or opens one, which `after_connect` checks).
    pub(crate) async fn before_acquire(
        &self,
        conn: &mut PgConnection,
        idle_for: std::time::Duration,
    ) -> Result<bool, sqlx::Error> {
        let suspect = self.suspect();
        if !suspect && idle_for < crate::PING_AFTER_IDLE {
            return Ok(true);
        }
        match read_only(conn).await {
            Ok(false) => {
                if suspect {
                    self.passed();
                }
                Ok(true)
            }
            Ok(true) => {
                self.failed();
                tracing::debug!("discarded a pooled connection: its server no longer takes writes");
                Ok(false)
            }
            Err(e) => {
                self.failed();
                Err(e)
            }
        }
    }
}

impl Ledger {
    /// Whether the ledger takes writes now: `Err(ReadOnly)` from a standby or a read-only
    /// server, the pool's error when it cannot be reached (readiness probes). One round trip.
    pub async fn check_writable(&self) -> Result<(), LedgerError> {
        let mut conn = self.pool.acquire().await?;
        if read_only(&mut conn).await? {
            unavailable_seen();
            return Err(LedgerError::ReadOnly);
        }
        Ok(())
    }
}
