//! The worker's announcement of the provider accounts it can send through (`worker_accounts`,
//! docs/decisions/0411-a-tenants-own-account-fails-closed.md): once before it consumes, then
//! every [`nudge_ledger::ANNOUNCE_EVERY`] for as long as it runs. Another worker of the channel
//! reads it for a delivery routed to an account that one lacks: left `queued` for a worker
//! that has the account, or, when none has, given back until the next look.
//!
//! It must never stop the worker: an announcement that fails is tried again at the next
//! interval (the accounts lapse after `nudge_ledger::HOLD_FOR` without one, and the deliveries
//! routed to them then wait, visibly, rather than go anywhere else).

use nudge_domain::{Channel, ProviderAccount};
use nudge_ledger::{Ledger, LedgerTime};
use nudge_telemetry::error_chain;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Announces `accounts` of `channel` every [`nudge_ledger::ANNOUNCE_EVERY`] until `stop`. A
/// failed announcement is logged once per outage; the first after one says how long it lasted.
pub async fn run(
    ledger: Ledger,
    channel: Channel,
    accounts: Vec<ProviderAccount>,
    stop: CancellationToken,
) {
    let mut ticks = tokio::time::interval(nudge_ledger::ANNOUNCE_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate; the worker announced before it started consuming.
    ticks.tick().await;
    let mut failing_since: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        match ledger
            .announce_accounts(channel, &accounts, LedgerTime::Database)
            .await
        {
            Ok(()) => {
                if let Some(since) = failing_since.take() {
                    info!(
                        failing_ms = since.elapsed().as_millis() as u64,
                        "provider accounts announced again after the ledger came back"
                    );
                }
            }
            Err(e) => {
                if failing_since.is_none() {
                    warn!(error.cause_chain = %error_chain(&e),
                          "failed to announce this worker's provider accounts; trying again \
                           every interval");
                    failing_since = Some(tokio::time::Instant::now());
                }
            }
        }
    }
}
