//! The guard of the binaries that send or publish owed work (the workers, the producer's
//! relay): they do not start on a ledger restored from a backup and not reconciled, and they
//! stop if the ledger turns out restored while they run (docs/decisions/0017-restored-ledger.md).
//!
//! Refusing is exiting non-zero with the reason, not waiting unready: nothing that sends is
//! built, the orchestrator shows a crash loop whose last line says what to do, and no
//! readiness state of its own is needed. Once `nudgectl restore reconcile --execute` has run,
//! the next restart starts.
//!
//! It must never let a binary run its sends while the ledger says it is restored, and never
//! treat a ledger it cannot reach as restored (the pool's own errors say that).

use std::time::Duration;

use anyhow::Context;
use nudge_ledger::{IdentityVerdict, Ledger, SendingRefused};
use nudge_telemetry::error_chain;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info};

/// How often a running binary looks at the ledger's identity again (each look that finds the
/// recorded identity also stamps the heartbeat).
pub const WATCH_EVERY: Duration = Duration::from_secs(5);

/// The start-up check: `Err` (the process exits non-zero with it) on a restored, unreconciled
/// ledger or a standby.
pub async fn check_at_start(ledger: &Ledger) -> anyhow::Result<()> {
    let observed = ledger
        .ensure_not_restored()
        .await
        .context("refusing to start sending")?;
    match observed.verdict {
        IdentityVerdict::FirstStart | IdentityVerdict::Failover => {
            info!(verdict = observed.verdict.as_str(), reason = %observed.reason,
                  "ledger identity recorded");
        }
        _ => debug!(
            verdict = observed.verdict.as_str(),
            "ledger identity checked"
        ),
    }
    Ok(())
}

/// Watches the ledger's identity every [`WATCH_EVERY`] until `shutdown`; when the ledger turns
/// out restored, cancels `shutdown` and ends with why. Await it after the binary's loop
/// returned: `Some` is the error to exit with.
pub fn watch(ledger: Ledger, shutdown: CancellationToken) -> JoinHandle<Option<anyhow::Error>> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return None,
                () = tokio::time::sleep(WATCH_EVERY) => {}
            }
            match ledger.ensure_not_restored().await {
                Ok(_) => {}
                Err(SendingRefused::Ledger(e)) => {
                    // The ledger away is the pool's business; a restore is decided only on an
                    // answer.
                    debug!(error.cause_chain = %error_chain(&e), "ledger identity not checked");
                }
                Err(refused) => {
                    error!(error.cause_chain = %error_chain(&refused),
                           "stopping: the ledger may not be sent from");
                    shutdown.cancel();
                    return Some(anyhow::Error::new(refused).context("stopped sending"));
                }
            }
        }
    })
}

/// The end of a [`watch`]: the error it stopped the binary with, if it did.
pub async fn finish(watch: JoinHandle<Option<anyhow::Error>>) -> anyhow::Result<()> {
    match watch.await {
        Ok(Some(e)) => Err(e),
        Ok(None) => Ok(()),
        Err(e) => Err(anyhow::Error::new(e).context("the ledger identity watch failed")),
    }
}
