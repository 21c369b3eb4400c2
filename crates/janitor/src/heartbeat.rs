//! The ledger's heartbeat: every few seconds the janitor observes the database's identity
//! (`Ledger::observe_identity`), which stamps the heartbeat with the database's clock while the
//! identity is the recorded one. A standby promoted after a synchronous primary died carries a
//! heartbeat seconds old and is adopted; a restored backup carries the backup's and is found
//! restored (docs/decisions/0017-restored-ledger.md).
//!
//! It must never stamp a restored ledger (the function refuses to) nor stop the janitor's other
//! work because of one: expiry, reaping and dead letters go on; the binaries that send stop.

use std::time::Duration;

use nudge_ledger::{IdentityVerdict, Ledger};
use nudge_telemetry::error_chain;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// How often the heartbeat is stamped: well inside `ledger_identity.failover_max_gap` (60 s by
/// default), so a failover's promoted replica is always within it.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

/// Stamps the heartbeat every `every` until `shutdown`, logging each change of verdict once.
pub async fn heartbeat_loop(ledger: Ledger, every: Duration, shutdown: CancellationToken) {
    let mut last: Option<IdentityVerdict> = None;
    loop {
        match ledger.observe_identity().await {
            Ok(observed) => {
                if last != Some(observed.verdict) {
                    match observed.verdict {
                        IdentityVerdict::Restored => error!(
                            reason = %observed.reason,
                            "the ledger was restored from a backup: the workers and the \
                             producer refuse to start until `nudgectl restore reconcile`"
                        ),
                        IdentityVerdict::InRecovery => {
                            warn!("the database is a standby in recovery: no heartbeat");
                        }
                        IdentityVerdict::FirstStart | IdentityVerdict::Failover => {
                            info!(verdict = observed.verdict.as_str(), reason = %observed.reason,
                                  "ledger identity recorded");
                        }
                        IdentityVerdict::Same => debug!("ledger heartbeat stamped"),
                    }
                }
                last = Some(observed.verdict);
            }
            Err(e) => debug!(error.cause_chain = %error_chain(&e), "ledger heartbeat not stamped"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}
