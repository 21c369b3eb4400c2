//! The channel worker behind `nudge-push`, `nudge-email` and `nudge-sms`.
//!
//! Messages are taken in batches of whatever has arrived (up to `worker.batch_size`): decode
//! the envelopes (poison goes to the dead-letter queue), lease the batch in one transaction
//! that also returns routing and send material and takes the send slots from the rate buckets
//! (stale and duplicate messages are dropped), then send each through the tenant's provider
//! account with the delivery's idempotency key, concurrently; a send that waits for its slot
//! is fenced first. Outcomes are recorded in groups (one statement for many sends), and each
//! message is acknowledged once its own outcome is written.
//!
//! It must never: send without a lease; send after `expires_at`; sleep through a backoff
//! (a retry is a `next_attempt_at` in the ledger, the message is acknowledged); log a
//! destination, subscriber reference or content; treat the queue as the authority (on any
//! doubt it acknowledges and leaves the delivery to the ledger, which republishes or reaps).

mod accounts;
mod clock;
mod config;
pub mod heartbeat;
mod metrics;
mod process;
mod recorder;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use nudge_broker::{Broker, Incoming, QueueKind};
use nudge_domain::{Channel, ProviderAccount};
use nudge_ledger::{DestinationCipher, Ledger};
use nudge_telemetry::error_chain;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

pub use clock::{Clock, LedgerClock};
pub use config::{AdmissionSection, WorkerConfig, WorkerSection};
pub use metrics::{AttemptLabelsIn, SCHEDULED_TO_DELIVERED_BUCKETS, WorkerMetrics};
pub use process::{Inbound, Processed, Providers, Step, ToSend, Worker};
pub use recorder::{NotRecorded, Recorder};

/// Command line of a channel worker binary.
#[derive(Debug, clap::Parser)]
#[command(
    version,
    about = "Deliver reminders of one channel: consume work.<channel>, send through the \
             provider, record the outcome in the ledger.",
    long_about = "Deliver reminders of one channel: consume work.<channel>, send through the \
                  provider, record the outcome in the ledger.\n\nConfiguration: defaults, then \
                  the TOML file given by --config or NUDGE_CONFIG, then NUDGE_* environment \
                  variables. See config/nudge.example.toml. SIGTERM or Ctrl-C stops consuming, \
                  lets in-flight sends finish (worker.shutdown_grace_ms) and exits 0."
)]
pub struct Cli {
    /// TOML configuration file (overrides NUDGE_CONFIG).
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
}

/// The whole of a channel worker's `main`: parse, configure, run until a signal.
pub async fn main_for(channel: Channel) -> ExitCode {
    use clap::Parser;
    let cli = Cli::parse();
    nudge_runtime::exit_code("worker", run_binary(channel, cli).await)
}

async fn run_binary(channel: Channel, cli: Cli) -> anyhow::Result<()> {
    let config: WorkerConfig = nudge_runtime::load_config(cli.config.as_deref())?;
    config
        .validate_for(channel)
        .context("invalid configuration")?;
    let service = match channel {
        Channel::Push => "nudge-push",
        Channel::Email => "nudge-email",
        Channel::Sms => "nudge-sms",
    };
    let metrics = Arc::new(WorkerMetrics::new());
    let app = nudge_runtime::Application::build(service, config, metrics.registry()).await?;
    nudge_runtime::restore_guard::check_at_start(&app.ledger).await?;
    let identity_watch =
        nudge_runtime::restore_guard::watch(app.ledger.clone(), app.shutdown.clone());
    let worker = Arc::new(
        build(
            &app.config,
            channel,
            app.ledger.clone(),
            metrics,
            app.shutdown.clone(),
        )
        .await?,
    );
    info!(%channel, worker_id = %worker.worker_id, prefetch = app.config.amqp.prefetch,
          batch_size = app.config.worker.batch_size, "worker started");
    run(
        worker,
        app.broker()?,
        RunSettings {
            prefetch: app.config.amqp.prefetch,
            batch_size: app.config.worker.batch_size,
            grace: Duration::from_millis(app.config.worker.shutdown_grace_ms),
            heartbeat: Duration::from_millis(app.config.worker.heartbeat_ms),
        },
        app.shutdown.clone(),
    )
    .await;
    app.stop().await;
    nudge_runtime::restore_guard::finish(identity_watch).await
}

/// Builds a worker for `channel` from its configuration, over `ledger` (already scoped to
/// `worker.owner`, as [`nudge_runtime::Application::build`] connects it).
/// `shutdown` is the process's shutdown token (see [`Worker::shutdown`]).
pub async fn build(
    config: &WorkerConfig,
    channel: Channel,
    ledger: Ledger,
    metrics: Arc<WorkerMetrics>,
    shutdown: CancellationToken,
) -> anyhow::Result<Worker> {
    let key = config
        .crypto
        .destination_key_bytes()?
        .context("crypto.destination_key is required")?;
    let mut providers = Vec::new();
    let mut default = None;
    for (i, cfg) in config
        .providers
        .iter()
        .filter(|p| p.channel == channel)
        .enumerate()
    {
        let provider = nudge_provider::build(cfg)
            .with_context(|| format!("failed to build provider account providers[{i}]"))?;
        if let Some(rate) = cfg.rate_per_second {
            let now = ledger
                .clock(nudge_ledger::LedgerTime::Database)
                .await
                .context("failed to read the database's clock")?;
            ledger
                .ensure_bucket(
                    &ProviderAccount::parse(&cfg.account)?,
                    channel,
                    rate,
                    cfg.starting_burst(),
                    now,
                )
                .await
                .with_context(|| format!("failed to create the rate bucket of providers[{i}]"))?;
        }
        if cfg.default_for_channel {
            default = Some(ProviderAccount::parse(&cfg.account)?);
        }
        providers.push(provider);
    }
    let default = default.context("no default provider account for this channel")?;
    let accounts: Vec<ProviderAccount> = providers.iter().map(|p| p.account().clone()).collect();
    // Before the first message: a worker of the channel that lacks one of these accounts then
    // leaves a delivery routed to it for this one (0411).
    ledger
        .announce_accounts(channel, &accounts, nudge_ledger::LedgerTime::Database)
        .await
        .context("failed to announce the provider accounts")?;
    // An inbound STOP to the default account reaches the tenants without one of their own.
    ledger
        .announce_default_account(channel, &default, nudge_ledger::LedgerTime::Database)
        .await
        .context("failed to announce the default provider account")?;
    let clock = Arc::new(LedgerClock::new(Arc::new(chrono::Utc::now)));
    let admission = config.admission.settings();
    let recorder = Recorder::spawn(ledger.clone(), admission.max_pause);
    Ok(Worker {
        channel,
        ledger,
        cipher: DestinationCipher::new(&key),
        providers: Providers::new(providers, default),
        policy: config.retry_policy()?,
        lease_for: Duration::from_secs(config.worker.lease_seconds),
        account_recheck: Duration::from_millis(config.worker.account_recheck_ms),
        leases: Arc::default(),
        worker_id: format!(
            "{}-{}-{}",
            channel,
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ),
        clock,
        recorder,
        admission,
        metrics,
        shutdown,
    })
}

/// How [`run`] consumes.
#[derive(Debug, Clone, Copy)]
pub struct RunSettings {
    /// Unacknowledged messages the broker hands this worker at once (`amqp.prefetch`): the
    /// bound on sends in flight.
    pub prefetch: u16,
    /// The most messages leased in one transaction (`worker.batch_size`).
    pub batch_size: usize,
    /// How long in-flight sends may finish after shutdown (`worker.shutdown_grace_ms`).
    pub grace: Duration,
    /// How often the worker's leases are renewed (`worker.heartbeat_ms`).
    pub heartbeat: Duration,
}

/// Consumes `work.<channel>` until `shutdown`. Messages that have arrived are leased together
/// (up to `batch_size`; a lone message is not held back to wait for company), and each leased
/// delivery is sent as its own task, so a slow send never holds up the rest of its batch; at
/// most `prefetch` messages are unacknowledged at once. On shutdown it stops taking messages,
/// lets in-flight ones finish within `grace`, and returns; messages it had not started are
/// redelivered by the broker to another worker.
pub async fn run(
    worker: Arc<Worker>,
    broker: Broker,
    settings: RunSettings,
    shutdown: CancellationToken,
) {
    let tracker = TaskTracker::new();
    // The heartbeat outlives the consume loop: sends finishing in the shutdown grace, and
    // outcomes held for the ledger, keep their leases until they are done.
    let stop_heartbeat = CancellationToken::new();
    let heartbeat = tokio::spawn(heartbeat::run(
        worker.leases.clone(),
        worker.ledger.clone(),
        worker.worker_id.clone(),
        worker.lease_for,
        settings.heartbeat,
        stop_heartbeat.clone(),
    ));
    let announcer = tokio::spawn(accounts::run(
        worker.ledger.clone(),
        worker.channel,
        worker.providers.accounts(),
        stop_heartbeat.clone(),
    ));
    let queue = QueueKind::Work(worker.channel);
    let (tx, mut rx) = mpsc::channel::<Incoming>(usize::from(settings.prefetch).max(1));
    let batcher = {
        let worker = worker.clone();
        let tracker = tracker.clone();
        let batch_size = settings.batch_size.max(1);
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(batch_size);
            while rx.recv_many(&mut batch, batch_size).await > 0 {
                if worker.shutdown.is_cancelled() {
                    // Not leased, not acknowledged: the broker hands them to another worker.
                    break;
                }
                let incoming = std::mem::take(&mut batch);
                let messages: Vec<Inbound<'_>> = incoming
                    .iter()
                    .map(|m| Inbound {
                        payload: m.payload(),
                        traceparent: m.traceparent(),
                    })
                    .collect();
                let steps = worker.lease_step(&messages).await;
                for (incoming, step) in incoming.into_iter().zip(steps) {
                    let worker = worker.clone();
                    tracker.spawn(async move {
                        let processed = worker.finish_step(step).await;
                        settle(incoming, &processed).await;
                    });
                }
            }
        })
    };
    broker
        .consume_until(
            queue,
            settings.prefetch,
            &worker.worker_id,
            &shutdown,
            |incoming| {
                let tx = tx.clone();
                async move {
                    // The batcher lives as long as this loop; bounded by the prefetch anyway.
                    let _ = tx.send(incoming).await;
                }
            },
        )
        .await;
    drop(tx);
    if let Err(e) = batcher.await {
        warn!(error.cause_chain = %error_chain(&e), "the batching task failed");
    }
    tracker.close();
    if tokio::time::timeout(settings.grace, tracker.wait())
        .await
        .is_err()
    {
        warn!(
            grace_ms = settings.grace.as_millis() as u64,
            "in-flight sends did not finish in time; their leases will be reaped"
        );
    }
    stop_heartbeat.cancel();
    if let Err(e) = heartbeat.await {
        warn!(error.cause_chain = %error_chain(&e), "the heartbeat task failed");
    }
    if let Err(e) = announcer.await {
        warn!(error.cause_chain = %error_chain(&e), "the account announcing task failed");
    }
}

async fn settle(incoming: Incoming, processed: &Processed) {
    let settled = if processed.dead_letter() {
        incoming.dead_letter().await
    } else {
        incoming.ack().await
    };
    if let Err(e) = settled {
        // The ledger holds the truth; a message we could not settle is redelivered and
        // dropped as stale, or republished if it was lost.
        warn!(error.cause_chain = %error_chain(&e), ?processed, "failed to settle a message");
    }
}
