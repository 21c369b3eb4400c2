//! `nudge-janitor`: the ledger's recovery paths.
//!
//! - Expiry sweep: owed deliveries (`scheduled`, `queued`, `retry_wait`) whose `expires_at`
//!   has passed are settled `expired`, so they are never sent.
//! - Lease reaper: a delivery whose lease expired without an outcome is given back due, with
//!   no attempt spent, when its send never started (no fence stamp: its worker died or lost
//!   the ledger before the request); when its send started (the worker crashed or was cut off
//!   mid-send) it is decided as a timeout after send: retried when the account honours
//!   idempotency keys, held `ambiguous` when it does not.
//! - Dead-letter recorder: every message that reaches `dead.<channel>` (poison: undecodable,
//!   wrong schema, or redelivered past the delivery limit) is recorded in the ledger; if it
//!   pointed at owed work with its current generation, that delivery is dead-lettered so an
//!   operator sees it and can redrive it.
//!
//! - Redrive feeder: each running redrive (`nudgectl redrive --execute`) is fed its next
//!   dead letters at its rate, paused when its channel's provider answers too many 429s or
//!   new work waits too long (`[redrive]`; the latter resumes by itself once new work has
//!   caught up), waiting while its channel drains, and behind its canary until that settles.
//!
//! - Orphan watchdog (every minute): a reminder whose time came two minutes ago or more, of a
//!   tenant that is not paused, missing a delivery on a channel that is not draining, is
//!   materialised and logged as a bug.
//!
//! - Retention ([`retention`], `[retention]`): `retention.interval_s` after the last finished
//!   run began (the ledger's record, not this process's start), unless a drain, an
//!   active redrive, an ownership change or a foreign schema blocks it (logged by name), a run
//!   counts what the policy lets go, records it, then deletes it in bounded batches through
//!   the database's retention functions.
//!
//! The ledger away (a failover, a restart, a server turned read-only) is an outage, not an
//! error per pass: each loop logs it once at warn when it begins and once when it ends, backs
//! off up to a few seconds and goes on by itself ([`nudge_runtime::Outage`]).
//!
//! It must never delete anything except through those functions (the role it should connect
//! as, `nudge_janitor`, has no DELETE at all), touch a delivery that a live lease holds, or
//! acknowledge a dead letter before it is recorded.

mod heartbeat;
pub mod metrics;
pub mod retention;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use nudge_broker::{Broker, QueueKind};
use nudge_config::{
    AmqpConfig, ConfigError, DatabaseConfig, RetentionConfig, RetryConfig, TelemetryConfig,
    Validate,
};
use nudge_domain::{Channel, RandJitter, RetryPolicy};
use nudge_ledger::{AutoPause, DeadLetter, Ledger, LedgerTime, MessagePointer};
use nudge_proto::Envelope;
use nudge_runtime::Outage;
use nudge_telemetry::error_chain;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

pub use metrics::JanitorMetrics;

/// Configuration of `nudge-janitor`.
///
/// Keys, beyond the shared `database.*`, `amqp.*` and `telemetry.*`:
/// - `janitor.interval_ms` (default 1000): how often the sweep and the reaper run.
/// - `janitor.reaper_grace_ms` (default 5000, 0..=600000): after the janitor starts, and after
///   the ledger comes back from being away, the reaper waits this long before it settles
///   lapsed leases: workers that lost the ledger too renew theirs first (every
///   `worker.heartbeat_ms`), so a send whose answer a live worker holds is never decided by
///   the reaper. The expiry sweep does not wait.
/// - `janitor.batch_size` (default 1000): deliveries settled per pass of each.
/// - `janitor.metrics_interval_ms` (default 15000): how often the ledger's gauges are read
///   for `/metrics` (see [`metrics`]).
/// - `janitor.events_interval_ms` (default 200, 10..=60000): how often delivery events are
///   numbered for their readers (`Ledger::sequence_events`, decision 0601); a pass that numbers
///   a whole batch runs again at once. One janitor numbers at a time; replicas skip.
/// - `redrive.*`: when a running redrive pauses itself (see [`RedriveSection`]).
/// - `retry.*`: the retry policy, which must match the workers' (the reaper decides an
///   expired lease with it): `base_delay_ms`, `max_delay_ms`, `max_attempts`,
///   `max_retry_after_s`, with the workers' defaults.
/// - `retention.*`: the retention policy and pace ([`RetentionConfig`]); a boundary below its
///   safety floor stops the janitor at start-up, naming the key.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JanitorConfig {
    pub database: DatabaseConfig,
    pub amqp: AmqpConfig,
    pub telemetry: TelemetryConfig,
    pub janitor: JanitorSection,
    pub redrive: RedriveSection,
    pub retry: RetryConfig,
    pub retention: RetentionConfig,
}

impl nudge_runtime::ServiceConfig for JanitorConfig {
    const SECTIONS: &'static [&'static str] = Self::SECTIONS;

    fn database(&self) -> &DatabaseConfig {
        &self.database
    }

    fn telemetry(&self) -> &TelemetryConfig {
        &self.telemetry
    }

    fn amqp(&self) -> Option<&AmqpConfig> {
        Some(&self.amqp)
    }
}

impl JanitorConfig {
    pub const SECTIONS: &'static [&'static str] = &[
        "database",
        "amqp",
        "telemetry",
        "janitor",
        "redrive",
        "retry",
        "retention",
    ];

    pub fn retry_policy(&self) -> Result<RetryPolicy, ConfigError> {
        self.retry.policy()
    }
}

impl Validate for JanitorConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.database.validate()?;
        self.amqp.validate()?;
        self.telemetry.validate()?;
        if !(50..=600_000).contains(&self.janitor.interval_ms) {
            return Err(ConfigError::invalid(
                "janitor.interval_ms",
                "must be between 50 and 600000",
            ));
        }
        if self.janitor.reaper_grace_ms > 600_000 {
            return Err(ConfigError::invalid(
                "janitor.reaper_grace_ms",
                "must be at most 600000",
            ));
        }
        if !(100..=3_600_000).contains(&self.janitor.metrics_interval_ms) {
            return Err(ConfigError::invalid(
                "janitor.metrics_interval_ms",
                "must be between 100 and 3600000",
            ));
        }
        if !(10..=60_000).contains(&self.janitor.events_interval_ms) {
            return Err(ConfigError::invalid(
                "janitor.events_interval_ms",
                "must be between 10 and 60000",
            ));
        }
        if !(1..=100_000).contains(&self.janitor.batch_size) {
            return Err(ConfigError::invalid(
                "janitor.batch_size",
                "must be between 1 and 100000",
            ));
        }
        self.redrive.validate()?;
        self.retention.validate()?;
        self.retry_policy().map(|_| ())
    }
}

/// When a running redrive pauses itself, recording why (`nudgectl redrive status` shows it;
/// `nudgectl redrive resume` goes on).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedriveSection {
    /// Pause when one provider account of the redrive's channel answered more than this
    /// share of its attempts with 429 (0 < ratio <= 1)...
    pub max_throttled_ratio: f64,
    /// ...over the last `window_s` seconds since the redrive started or resumed...
    pub window_s: u64,
    /// ...and made at least this many attempts in that window (fewer say nothing).
    pub min_attempts: u32,
    /// Pause when the channel's oldest due new delivery has waited longer than this; resume by
    /// itself once it waits less than half of it.
    pub max_new_work_age_s: u64,
}

impl Default for RedriveSection {
    fn default() -> Self {
        Self {
            max_throttled_ratio: 0.1,
            window_s: 60,
            min_attempts: 20,
            max_new_work_age_s: 600,
        }
    }
}

impl RedriveSection {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(self.max_throttled_ratio > 0.0 && self.max_throttled_ratio <= 1.0) {
            return Err(ConfigError::invalid(
                "redrive.max_throttled_ratio",
                "must be more than 0 and at most 1",
            ));
        }
        if !(1..=3_600).contains(&self.window_s) {
            return Err(ConfigError::invalid(
                "redrive.window_s",
                "must be between 1 and 3600",
            ));
        }
        if !(1..=1_000_000).contains(&self.min_attempts) {
            return Err(ConfigError::invalid(
                "redrive.min_attempts",
                "must be between 1 and 1000000",
            ));
        }
        if !(1..=604_800).contains(&self.max_new_work_age_s) {
            return Err(ConfigError::invalid(
                "redrive.max_new_work_age_s",
                "must be between 1 and 604800",
            ));
        }
        Ok(())
    }

    /// The rules as the ledger applies them.
    pub fn rules(&self) -> AutoPause {
        AutoPause {
            max_throttled_ratio: self.max_throttled_ratio,
            window: Duration::from_secs(self.window_s),
            min_attempts: self.min_attempts,
            max_new_work_age: Duration::from_secs(self.max_new_work_age_s),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JanitorSection {
    pub interval_ms: u64,
    pub reaper_grace_ms: u64,
    pub batch_size: u32,
    pub metrics_interval_ms: u64,
    pub events_interval_ms: u64,
}

impl Default for JanitorSection {
    fn default() -> Self {
        Self {
            interval_ms: 1_000,
            reaper_grace_ms: 5_000,
            batch_size: 1_000,
            metrics_interval_ms: 15_000,
            events_interval_ms: 200,
        }
    }
}

#[derive(Debug, clap::Parser)]
#[command(
    version,
    about = "Expire overdue work, reap expired leases, record dead-lettered messages, delete settled history by policy.",
    long_about = "Expire overdue work, reap expired leases, record dead-lettered messages, feed \
                  redrives, and delete settled history by the [retention] policy (counted \
                  first, in batches, through the database's retention functions).\n\n\
                  Configuration: defaults, then the TOML file given by --config or NUDGE_CONFIG, \
                  then NUDGE_* environment variables. Safe to run as several replicas. SIGTERM \
                  or Ctrl-C finishes the current pass (a retention run stops between batches) \
                  and exits 0. Connect as the nudge_janitor database role (database.url), \
                  which cannot delete except through the retention functions."
)]
pub struct Cli {
    /// TOML configuration file (overrides NUDGE_CONFIG).
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
}

pub async fn main() -> ExitCode {
    use clap::Parser;
    let cli = Cli::parse();
    nudge_runtime::exit_code("janitor", run_binary(cli).await)
}

async fn run_binary(cli: Cli) -> anyhow::Result<()> {
    let config: JanitorConfig = nudge_runtime::load_config(cli.config.as_deref())?;
    let metrics = Arc::new(JanitorMetrics::new());
    let app =
        nudge_runtime::Application::build("nudge-janitor", config, metrics.registry()).await?;
    let (config, ledger, broker, shutdown) = (
        &app.config,
        app.ledger.clone(),
        app.broker()?,
        app.shutdown.clone(),
    );
    let policy = config.retry_policy()?;
    let mut tasks = Vec::new();
    for channel in Channel::ALL {
        tasks.push(tokio::spawn(record_dead_letters(
            ledger.clone(),
            broker.clone(),
            channel,
            metrics.clone(),
            shutdown.clone(),
        )));
    }
    tasks.push(tokio::spawn(heartbeat::heartbeat_loop(
        ledger.clone(),
        heartbeat::HEARTBEAT_EVERY,
        shutdown.clone(),
    )));
    tasks.push(tokio::spawn(gauges_loop(
        ledger.clone(),
        metrics.clone(),
        Duration::from_millis(config.janitor.metrics_interval_ms),
        shutdown.clone(),
    )));
    tasks.push(tokio::spawn(events_loop(
        ledger.clone(),
        metrics.clone(),
        Duration::from_millis(config.janitor.events_interval_ms),
        shutdown.clone(),
    )));
    if config.retention.enabled {
        tasks.push(tokio::spawn(retention::retention_loop(
            ledger.clone(),
            retention::RetentionSettings::from_config(&config.retention)?,
            Duration::from_secs(config.retention.interval_s),
            shutdown.clone(),
        )));
    } else {
        info!("retention.enabled is false: nothing is deleted");
    }
    sweep_loop(
        &ledger,
        &metrics,
        &policy,
        &config.redrive.rules(),
        &config.janitor,
        shutdown.clone(),
    )
    .await;
    for task in tasks {
        if let Err(e) = task.await {
            warn!(error.cause_chain = %error_chain(&e), "dead-letter recorder task failed");
        }
    }
    app.stop().await;
    Ok(())
}

/// What one sweep pass settled.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    pub expired: u64,
    /// Leases whose send had started, decided like a timeout after send.
    pub reaped: usize,
    /// Leases whose send never started, given back due without an attempt.
    pub returned_unsent: usize,
}

/// One pass of the expiry sweep and the lease reaper.
pub async fn sweep_once(
    ledger: &Ledger,
    policy: &RetryPolicy,
    batch_size: u32,
    at: LedgerTime,
) -> anyhow::Result<SweepReport> {
    sweep_pass(ledger, policy, batch_size, at, Reaper::Reap).await
}

/// Whether a sweep pass runs the lease reaper too (see `janitor.reaper_grace_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reaper {
    Reap,
    Wait,
}

async fn sweep_pass(
    ledger: &Ledger,
    policy: &RetryPolicy,
    batch_size: u32,
    at: LedgerTime,
    reaper: Reaper,
) -> anyhow::Result<SweepReport> {
    let expired = ledger
        .expire_overdue(batch_size, at)
        .await
        .context("expiry sweep failed")?;
    if reaper == Reaper::Wait {
        return Ok(SweepReport {
            expired,
            ..SweepReport::default()
        });
    }
    let mut jitter = RandJitter::from_entropy();
    let reaped = ledger
        .reap_expired_leases(batch_size, policy, &mut jitter, at)
        .await
        .context("lease reaper failed")?;
    for delivery_id in &reaped.unsent {
        warn!(%delivery_id, "lease expired before its send started: due again, no attempt spent");
    }
    for (delivery_id, state) in &reaped.decided {
        warn!(%delivery_id, next_state = %state, "lease expired after its send started: reaped");
    }
    Ok(SweepReport {
        expired,
        reaped: reaped.decided.len(),
        returned_unsent: reaped.unsent.len(),
    })
}

/// One pass of the redrive feeder over every running redrive.
pub async fn redrive_once(
    ledger: &Ledger,
    rules: &AutoPause,
    batch_size: u32,
    at: LedgerTime,
) -> anyhow::Result<()> {
    let ticks = ledger
        .redrive_tick(rules, batch_size, at)
        .await
        .context("redrive feeder failed")?;
    for tick in ticks {
        if let Some(why) = &tick.paused {
            warn!(redrive_id = tick.id.get(), reason = %why, "redrive paused itself");
        }
        if tick.resumed {
            info!(
                redrive_id = tick.id.get(),
                "new work caught up: redrive resumed itself"
            );
        }
        if tick.skipped > 0 {
            info!(
                redrive_id = tick.id.get(),
                skipped = tick.skipped,
                "redrive passed over items at their turn (expired, tenant paused or moved on)"
            );
        }
        if tick.finished {
            info!(
                redrive_id = tick.id.get(),
                fed = tick.fed,
                "redrive fed its last items"
            );
        } else if tick.fed > 0 {
            debug!(redrive_id = tick.id.get(), fed = tick.fed, "redrive fed");
        }
    }
    Ok(())
}

/// How often the orphan watchdog runs, how far back it looks, and how long after a
/// reminder's time it waits before calling it orphaned (windows and relays are seconds apart).
const ORPHAN_EVERY: Duration = Duration::from_secs(60);
const ORPHAN_LOOKBACK: chrono::Duration = chrono::Duration::days(2);
const ORPHAN_GRACE: Duration = Duration::from_secs(120);

/// One pass of the orphan watchdog: reminders whose time came with no delivery at all are
/// materialised, loudly. It should find none; any it finds is a bug worth an alert.
pub async fn watch_orphans_once(ledger: &Ledger, batch_size: u32) -> anyhow::Result<u64> {
    let now = ledger
        .clock(LedgerTime::Database)
        .await
        .context("failed to read the database's clock")?;
    let repaired = ledger
        .repair_orphaned_reminders(now - ORPHAN_LOOKBACK, now, ORPHAN_GRACE, batch_size)
        .await
        .context("orphan watchdog failed")?;
    if repaired > 0 {
        warn!(
            repaired,
            "reminders whose time had come had no delivery: materialised them (this is a bug)"
        );
    }
    Ok(repaired)
}

/// Reads the ledger's gauges every `every` until shutdown (the first read at once).
async fn gauges_loop(
    ledger: Ledger,
    metrics: Arc<JanitorMetrics>,
    every: Duration,
    shutdown: CancellationToken,
) {
    let outage = Outage::new("gauges");
    loop {
        match metrics::refresh_gauges(&ledger, &metrics, LedgerTime::Database).await {
            Ok(()) => outage.back(),
            Err(e) if outage.away(&e) => {}
            Err(e) => {
                warn!(error.cause_chain = %error_chain(&e), "failed to read the ledger's gauges; retrying")
            }
        }
        // The console's sparklines: one sample a minute, whichever janitor writes it first.
        match ledger.record_ledger_sample(LedgerTime::Database).await {
            Ok(_) => {}
            Err(e) if outage.away(&e) => {}
            Err(e) => {
                warn!(error.cause_chain = %error_chain(&e), "failed to record the minute's ledger sample; retrying")
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// The most events one pass numbers; a full pass runs again at once.
const EVENTS_BATCH: u32 = 5_000;

/// Numbers the delivery events written since the last pass (decision 0601), so that the
/// events API and the events process can read them by position.
async fn events_loop(
    ledger: Ledger,
    metrics: Arc<JanitorMetrics>,
    every: Duration,
    shutdown: CancellationToken,
) {
    let outage = Outage::new("events");
    loop {
        let full = match ledger.sequence_events(EVENTS_BATCH).await {
            Ok(done) => {
                outage.back();
                if let Some(numbered) = done.numbered {
                    metrics.events_sequenced(numbered);
                }
                done.numbered == Some(EVENTS_BATCH)
            }
            Err(e) if outage.away(&e) => false,
            Err(e) => {
                warn!(error.cause_chain = %error_chain(&e), "failed to number delivery events; retrying");
                false
            }
        };
        if full && !shutdown.is_cancelled() {
            continue;
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

async fn sweep_loop(
    ledger: &Ledger,
    metrics: &JanitorMetrics,
    policy: &RetryPolicy,
    redrive: &AutoPause,
    section: &JanitorSection,
    shutdown: CancellationToken,
) {
    let every = Duration::from_millis(section.interval_ms);
    let reaper_grace = Duration::from_millis(section.reaper_grace_ms);
    let batch_size = section.batch_size;
    let mut last_orphan_watch: Option<std::time::Instant> = None;
    // The reaper's grace: from the start, and again from the first pass after the ledger was
    // away, the workers renew their leases before any lapsed one is settled.
    let mut reap_from = std::time::Instant::now() + reaper_grace;
    // The ledger away is logged once, when the sweep first finds it, and its end once; the
    // redrive feeder and the orphan watchdog fail the same way meanwhile, and say nothing.
    let outage = Outage::new("sweep");
    loop {
        let reaper = if std::time::Instant::now() >= reap_from {
            Reaper::Reap
        } else {
            Reaper::Wait
        };
        let swept = sweep_pass(ledger, policy, batch_size, LedgerTime::Database, reaper).await;
        if let Ok(report) = &swept {
            metrics.expired(report.expired);
            metrics.lease_expiries(report.returned_unsent, report.reaped);
            if outage.is_away() {
                reap_from = std::time::Instant::now() + reaper_grace;
                info!(
                    grace_ms = reaper_grace.as_millis() as u64,
                    "the lease reaper waits its grace for the workers to renew their leases"
                );
            }
            outage.back();
        }
        match swept {
            Ok(report) if report.expired > 0 || report.reaped > 0 || report.returned_unsent > 0 => {
                info!(
                    expired = report.expired,
                    reaped = report.reaped,
                    returned_unsent = report.returned_unsent,
                    "sweep"
                );
            }
            Ok(_) => {}
            Err(e) if outage.away(e.as_ref()) => {}
            Err(e) => error!(error.cause_chain = %error_chain(&*e), "sweep failed; retrying"),
        }
        if let Err(e) = redrive_once(ledger, redrive, batch_size, LedgerTime::Database).await
            && !outage.away(e.as_ref())
        {
            error!(error.cause_chain = %error_chain(&*e), "redrive feeder failed; retrying");
        }
        if last_orphan_watch.is_none_or(|at| at.elapsed() >= ORPHAN_EVERY) {
            last_orphan_watch = Some(std::time::Instant::now());
            match watch_orphans_once(ledger, batch_size).await {
                Ok(repaired) => metrics.orphaned(repaired),
                Err(e) if outage.away(e.as_ref()) => {}
                Err(e) => {
                    error!(error.cause_chain = %error_chain(&*e), "orphan watchdog failed; retrying")
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(outage.pause(every)) => {}
        }
    }
}

/// Consumes `dead.<channel>` until shutdown, recording every message before acking it.
///
/// A message the ledger cannot take now is held, unacknowledged, and recorded again with a
/// growing pause (up to `DEAD_LETTER_RETRY_MAX`) until the ledger takes it; it is requeued
/// only at shutdown. Requeueing it at each failure, as before, counted a delivery each time:
/// on RabbitMQ 4.x, whose quorum queues have a default delivery limit of 20 and no
/// dead-letter target for `dead.<channel>`, a ledger outage of about 20 seconds dropped dead
/// letters (docs/decisions/0201-dead-letters-are-held-not-requeued.md).
pub async fn record_dead_letters(
    ledger: Ledger,
    broker: Broker,
    channel: Channel,
    metrics: Arc<JanitorMetrics>,
    shutdown: CancellationToken,
) {
    let queue = broker.topology().dead_queue(channel);
    let tag = format!("janitor-dead-{channel}-{}", std::process::id());
    let outage = Outage::new("dead letters");
    broker
        .consume_until(QueueKind::Dead(channel), 16, &tag, &shutdown, |incoming| {
            record_one(
                &ledger, &queue, channel, &metrics, incoming, &outage, &shutdown,
            )
        })
        .await;
}

/// The longest pause between two attempts to record a dead letter kept unacknowledged.
const DEAD_LETTER_RETRY_MAX: Duration = Duration::from_secs(5);

/// Records one dead letter, then acks it; while the ledger cannot take it, it stays unacknowledged.
async fn record_one(
    ledger: &Ledger,
    queue: &str,
    channel: Channel,
    metrics: &JanitorMetrics,
    incoming: nudge_broker::Incoming,
    outage: &Outage,
    shutdown: &CancellationToken,
) {
    let payload = incoming.payload().to_vec();
    let (decode_error, delivery) = match Envelope::decode(&payload) {
        Ok(envelope) => (
            None,
            Some(MessagePointer {
                delivery_id: envelope.delivery_id,
                generation: envelope.generation,
            }),
        ),
        Err(e) => (Some(e.reason_code().to_owned()), None),
    };
    let letter = DeadLetter {
        queue: queue.to_owned(),
        channel: Some(channel),
        death_reason: incoming
            .death_reason()
            .unwrap_or_else(|| "unknown".to_owned()),
        decode_error,
        delivery,
        delivery_count: incoming.delivery_count(),
        payload,
    };
    let mut pause = Duration::from_millis(250);
    let action = loop {
        let recorded = match ledger.clock(LedgerTime::Database).await {
            Ok(now) => ledger.record_dead_letter(&letter, now).await,
            Err(e) => Err(e),
        };
        match recorded {
            Ok(action) => {
                outage.back();
                break action;
            }
            Err(e) => {
                if !outage.away(&e) {
                    error!(error.cause_chain = %error_chain(&e), retry_in_ms = pause.as_millis() as u64,
                           "failed to record a dead letter; holding it and trying again");
                }
                tokio::select! {
                    () = shutdown.cancelled() => {
                        // Back to the queue for the next janitor: one delivery counted.
                        if let Err(e) = incoming.requeue().await {
                            warn!(error.cause_chain = %error_chain(&e), "failed to requeue a dead letter");
                        }
                        return;
                    }
                    () = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(DEAD_LETTER_RETRY_MAX);
            }
        }
    };
    metrics.dead_letter(channel, &letter.death_reason);
    warn!(%channel, death_reason = %letter.death_reason,
          decode_error = letter.decode_error.as_deref(),
          delivery_id = letter.delivery.map(|m| m.delivery_id.to_string()),
          ?action, "dead letter recorded");
    if let Err(e) = incoming.ack().await {
        warn!(error.cause_chain = %error_chain(&e), "failed to ack a recorded dead letter; it will be recorded again");
    }
}
