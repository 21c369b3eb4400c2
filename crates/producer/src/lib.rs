//! `nudge-producer`: the clock and the relay.
//!
//! The clock: for each tenant schedule (a cron expression with a seconds field, and a
//! look-ahead window), it materialises the deliveries of reminders whose time falls in the
//! next window. Windows are contiguous: each starts where the tenant's last one ended (the
//! first at [`FIRST_WINDOW_START`]) and ends one look-ahead after the schedule's next tick,
//! so missed ticks are caught up and no reminder falls between two windows. The run intent
//! `(tenant, window_start)` is unique: a replayed or concurrent tick creates nothing.
//! Tenants' windows run side by side ([`WINDOWS_AT_ONCE`] at a time, each in its own
//! transaction, its reminders streamed in batches by the ledger), and a pass does not wait for
//! them: a tenant whose window is still running is skipped by the next passes until it ends,
//! so one very large window does not hold back other tenants' windows. A pass is acknowledged
//! (`producer_acks`) once its own windows have ended; a tenant it skipped is covered by its
//! running window, which holds the tenant row until it commits (a flag change waits for it).
//!
//! The relay: claims due deliveries (first attempts and retries whose `next_attempt_at` has
//! come) in the ledger, publishes their envelopes with publisher confirms, and hands failed
//! publishes back; it also republishes `queued` work whose message was lost.
//!
//! The ledger away (a failover, a restart, a server turned read-only) is an outage, not an
//! error per pass: the clock and the relay each log it once at warn when it begins and once
//! when it ends, back off up to a few seconds and go on by themselves
//! ([`nudge_runtime::Outage`]).
//!
//! It must never: create deliveries outside a run intent's transaction (the ledger's
//! `materialise_window` does both), publish a message before its claim is committed, or
//! treat a publish as done without the broker's confirm.

mod config;
mod metrics;

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, NaiveDate, NaiveTime, Utc};
use nudge_broker::{Broker, OutgoingMessage, Publisher};
use nudge_domain::{Channel, TenantId};
use nudge_ledger::{DueDelivery, Ledger, LedgerTime, Schedule, WindowOutcome};
use nudge_proto::Envelope;
use nudge_runtime::Outage;
use nudge_telemetry::error_chain;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, error, info, warn};

pub use config::{ProducerConfig, ProducerSection};
pub use metrics::ProducerMetrics;

/// Where a tenant's first window starts: early enough that a reminder created before the
/// producer ever ran is still covered.
/// Midnight UTC of that day.
pub const FIRST_WINDOW_START: NaiveDate = match NaiveDate::from_ymd_opt(2000, 1, 1) {
    Some(date) => date,
    // Evaluated while compiling: a date that does not exist fails the build, never a run.
    None => panic!("the first window's start is a calendar date"),
};

fn first_window_start() -> DateTime<Utc> {
    FIRST_WINDOW_START.and_time(NaiveTime::MIN).and_utc()
}

#[derive(Debug, clap::Parser)]
#[command(
    version,
    about = "The clock and the relay: materialise deliveries per tenant schedule window, \
             publish due work to RabbitMQ with confirms.",
    long_about = "The clock and the relay: materialise deliveries per tenant schedule window, \
                  publish due work to RabbitMQ with confirms.\n\nConfiguration: defaults, then \
                  the TOML file given by --config or NUDGE_CONFIG, then NUDGE_* environment \
                  variables. Several producers may run at once: run intents and claims are \
                  exclusive in the ledger. SIGTERM or Ctrl-C finishes the current batch and \
                  exits 0."
)]
pub struct Cli {
    /// TOML configuration file (overrides NUDGE_CONFIG).
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
}

pub async fn main() -> ExitCode {
    use clap::Parser;
    let cli = Cli::parse();
    nudge_runtime::exit_code("producer", run_binary(cli).await)
}

async fn run_binary(cli: Cli) -> anyhow::Result<()> {
    let config: ProducerConfig = nudge_runtime::load_config(cli.config.as_deref())?;
    let metrics = Arc::new(ProducerMetrics::new());
    let app =
        nudge_runtime::Application::build("nudge-producer", config, metrics.registry()).await?;
    // The relay publishes owed work: not from a restored ledger (nudge_runtime::restore_guard).
    nudge_runtime::restore_guard::check_at_start(&app.ledger).await?;
    let identity_watch =
        nudge_runtime::restore_guard::watch(app.ledger.clone(), app.shutdown.clone());
    let broker = app.broker()?;
    let clock = Clock::new(app.ledger.clone()).with_metrics(metrics.clone());
    let relay =
        Relay::new(app.ledger.clone(), broker, app.config.producer.clone()).with_metrics(metrics);
    tokio::join!(
        clock.run(
            Duration::from_millis(app.config.producer.schedule_interval_ms),
            app.shutdown.clone()
        ),
        relay.run(app.shutdown.clone()),
    );
    app.stop().await;
    nudge_runtime::restore_guard::finish(identity_watch).await
}

/// Waits for a pass's windows, counts and logs what each did, then acknowledges the pass.
/// The ledger away is the clock's `outage`, logged once; the acknowledgement, a write, ends it.
async fn finish_pass(
    pass: Pass,
    ledger: Ledger,
    instance: String,
    metrics: Arc<ProducerMetrics>,
    outage: Arc<Outage>,
) {
    let now = pass.now;
    let outcomes = match pass.outcomes().await {
        Ok(outcomes) => outcomes,
        Err(e) => {
            if !outage.away(e.as_ref()) {
                error!(error.cause_chain = %error_chain(&*e), "clock tick failed; retrying");
            }
            return;
        }
    };
    // Every flag committed before `now` was read by this pass (each window locks its tenant
    // row; a tenant skipped has a window running that holds it): say so, for `nudgectl tenant
    // pause` to wait on.
    match ledger.ack_producer_pass(&instance, now).await {
        Ok(()) => outage.back(),
        Err(e) if outage.away(&e) => {}
        Err(e) => warn!(error.cause_chain = %error_chain(&e),
                        "failed to acknowledge the schedule pass"),
    }
    for (schedule, outcome) in outcomes {
        let (label, created, occurrences) = match &outcome {
            Ok(WindowOutcome::Materialised {
                deliveries_created: 0,
                occurrences_created,
                ..
            }) => (Some("empty"), 0, *occurrences_created),
            Ok(WindowOutcome::Materialised {
                deliveries_created,
                occurrences_created,
                ..
            }) => (
                Some("materialised"),
                *deliveries_created,
                *occurrences_created,
            ),
            Ok(WindowOutcome::Paused) => (Some("paused"), 0, 0),
            Ok(WindowOutcome::AlreadyRun) => (None, 0, 0),
            Err(_) => (Some("bad_schedule"), 0, 0),
        };
        if let Some(label) = label {
            metrics.window(label, created, occurrences);
        }
        if let Ok(WindowOutcome::Materialised {
            series_unexpandable: unexpandable @ 1..,
            ..
        }) = &outcome
        {
            metrics.series_unexpandable(*unexpandable);
            error!(tenant_id = %schedule.tenant_id, series = unexpandable,
                   "series could not be expanded (a stored zone or rule no longer parses, such \
                    as a zone the tz database dropped): their occurrences wait until mended");
        }
        match outcome {
            // Most windows of a quiet tenant are empty: not worth a line
            // per tick in production logs.
            Ok(WindowOutcome::Materialised {
                deliveries_created: 0,
                occurrences_created: 0,
                ..
            }) => debug!(tenant_id = %schedule.tenant_id, "empty window"),
            Ok(WindowOutcome::Materialised {
                deliveries_created,
                occurrences_created,
                ..
            }) => info!(
                tenant_id = %schedule.tenant_id, deliveries_created, occurrences_created,
                "window materialised"),
            Ok(WindowOutcome::Paused) => {
                debug!(tenant_id = %schedule.tenant_id, "tenant paused: window withheld")
            }
            Ok(WindowOutcome::AlreadyRun) => {}
            Err(bad) => warn!(error.cause_chain = %error_chain(&bad), "schedule skipped"),
        }
    }
}

/// A schedule's cron expression could not be used.
#[derive(Debug, thiserror::Error)]
#[error("invalid cron expression for tenant {tenant_id}: {reason}")]
pub struct BadSchedule {
    pub tenant_id: uuid::Uuid,
    pub reason: String,
}

/// Tenants' windows materialised at the same time, each on its own connection.
pub const WINDOWS_AT_ONCE: usize = 2;

/// What one tenant's window did in a pass.
pub type WindowResult = (Schedule, Result<WindowOutcome, BadSchedule>);

/// The clock: advances every tenant's windows.
#[derive(Debug)]
pub struct Clock {
    ledger: Ledger,
    parsed: HashMap<String, cron::Schedule>,
    /// This process's name in `producer_acks`.
    instance: String,
    metrics: Arc<ProducerMetrics>,
    /// Tenants whose window is being materialised: passes skip them until it ends.
    running: Arc<Mutex<HashSet<TenantId>>>,
    permits: Arc<tokio::sync::Semaphore>,
    /// The ledger away, as the clock's passes see it.
    outage: Arc<Outage>,
}

/// The windows one pass started, running in the background.
#[derive(Debug)]
pub struct Pass {
    now: DateTime<Utc>,
    windows: Vec<(Schedule, WindowRun)>,
}

#[derive(Debug)]
enum WindowRun {
    Done(Result<WindowOutcome, BadSchedule>),
    Running(tokio::task::JoinHandle<Result<WindowOutcome, nudge_ledger::LedgerError>>),
}

impl Pass {
    /// Waits for the pass's windows; what each did, in schedule order. A window that failed
    /// is an error (the others still ran; the next pass retries it).
    pub async fn outcomes(self) -> anyhow::Result<Vec<WindowResult>> {
        let mut outcomes = Vec::with_capacity(self.windows.len());
        let mut failed = None;
        for (schedule, run) in self.windows {
            let outcome = match run {
                WindowRun::Done(outcome) => outcome,
                WindowRun::Running(handle) => match handle.await {
                    Ok(Ok(outcome)) => Ok(outcome),
                    Ok(Err(e)) => {
                        failed.get_or_insert(anyhow::Error::new(e));
                        continue;
                    }
                    Err(e) => {
                        failed.get_or_insert(anyhow::Error::new(e));
                        continue;
                    }
                },
            };
            outcomes.push((schedule, outcome));
        }
        match failed {
            Some(e) => Err(e.context("a window failed")),
            None => Ok(outcomes),
        }
    }
}

/// Takes a tenant out of the running set when its window task ends, however it ends.
struct RunningGuard {
    running: Arc<Mutex<HashSet<TenantId>>>,
    tenant: TenantId,
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        if let Ok(mut running) = self.running.lock() {
            running.remove(&self.tenant);
        }
    }
}

impl Clock {
    pub fn new(ledger: Ledger) -> Self {
        let host = std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty() && h.len() <= 150)
            .unwrap_or_else(|| "producer".to_owned());
        Self {
            ledger,
            parsed: HashMap::new(),
            instance: format!("{host}:{}", std::process::id()),
            metrics: Arc::new(ProducerMetrics::new()),
            running: Arc::new(Mutex::new(HashSet::new())),
            permits: Arc::new(tokio::sync::Semaphore::new(WINDOWS_AT_ONCE)),
            outage: Arc::new(Outage::new("clock")),
        }
    }

    /// Counts windows into `metrics` (served on `/metrics`) instead of a private registry.
    pub fn with_metrics(mut self, metrics: Arc<ProducerMetrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// One pass over every schedule at `now`, waiting for its windows. Returns what each
    /// tenant's window did (a tenant whose earlier window is still running is left out).
    pub async fn tick(&mut self, now: DateTime<Utc>) -> anyhow::Result<Vec<WindowResult>> {
        self.start_pass(now).await?.outcomes().await
    }

    /// Starts a pass over every schedule at `now`: each tenant's window that is due runs in
    /// the background ([`WINDOWS_AT_ONCE`] at a time); a tenant whose earlier window is still
    /// running is skipped.
    pub async fn start_pass(&mut self, now: DateTime<Utc>) -> anyhow::Result<Pass> {
        let schedules = self
            .ledger
            .schedules()
            .await
            .context("failed to read schedules")?;
        let mut windows = Vec::with_capacity(schedules.len());
        for schedule in schedules {
            if self
                .running
                .lock()
                .map_err(|_| anyhow::anyhow!("the running windows' lock is poisoned"))?
                .contains(&schedule.tenant_id)
            {
                continue;
            }
            let run = match self.window_end(&schedule, now) {
                Err(bad) => WindowRun::Done(Err(bad)),
                Ok(end) => {
                    let start = self
                        .ledger
                        .last_window_end(schedule.tenant_id)
                        .await?
                        .unwrap_or_else(first_window_start);
                    if start >= end {
                        WindowRun::Done(Ok(WindowOutcome::AlreadyRun))
                    } else {
                        WindowRun::Running(self.spawn_window(
                            schedule.tenant_id,
                            start,
                            end,
                            now,
                        )?)
                    }
                }
            };
            windows.push((schedule, run));
        }
        Ok(Pass { now, windows })
    }

    fn spawn_window(
        &self,
        tenant_id: TenantId,
        start: DateTime<Utc>,
        end: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> anyhow::Result<tokio::task::JoinHandle<Result<WindowOutcome, nudge_ledger::LedgerError>>>
    {
        self.running
            .lock()
            .map_err(|_| anyhow::anyhow!("the running windows' lock is poisoned"))?
            .insert(tenant_id);
        let guard = RunningGuard {
            running: self.running.clone(),
            tenant: tenant_id,
        };
        let ledger = self.ledger.clone();
        let permits = self.permits.clone();
        let span = tracing::info_span!("window run",
            tenant_id = %tenant_id,
            window_start = %start,
            window_end = %end);
        Ok(tokio::spawn(
            async move {
                let _guard = guard;
                // Never closed, so the permit always comes.
                let _permit = permits.acquire_owned().await.ok();
                ledger.materialise_window(tenant_id, start, end, now).await
            }
            .instrument(span),
        ))
    }

    /// Where the window materialised at `now` ends: one look-ahead after the next tick.
    fn window_end(
        &mut self,
        schedule: &Schedule,
        now: DateTime<Utc>,
    ) -> Result<DateTime<Utc>, BadSchedule> {
        let bad = |reason: String| BadSchedule {
            tenant_id: schedule.tenant_id.as_uuid(),
            reason,
        };
        if !self.parsed.contains_key(&schedule.cron) {
            let parsed =
                cron::Schedule::from_str(&schedule.cron).map_err(|e| bad(e.to_string()))?;
            self.parsed.insert(schedule.cron.clone(), parsed);
        }
        let cron = self
            .parsed
            .get(&schedule.cron)
            .ok_or_else(|| bad("unparsed".into()))?;
        let next_tick = cron
            .after(&now)
            .next()
            .ok_or_else(|| bad("the expression never fires again".into()))?;
        Ok(next_tick + chrono::Duration::seconds(i64::from(schedule.window_seconds)))
    }

    async fn run(mut self, every: Duration, shutdown: CancellationToken) {
        loop {
            // Windows are reckoned on the database's clock, like every other time condition.
            let now = match self.ledger.clock(LedgerTime::Database).await {
                Ok(now) => now,
                Err(e) => {
                    if !self.outage.away(&e) {
                        error!(error.cause_chain = %error_chain(&e), "failed to read the database's clock; retrying");
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(self.outage.pause(every)) => continue,
                    }
                }
            };
            match self.start_pass(now).await {
                Ok(pass) => {
                    // Its windows finish in the background: the next pass does not wait.
                    tokio::spawn(finish_pass(
                        pass,
                        self.ledger.clone(),
                        self.instance.clone(),
                        self.metrics.clone(),
                        self.outage.clone(),
                    ));
                }
                Err(e) => {
                    if !self.outage.away(e.as_ref()) {
                        error!(error.cause_chain = %error_chain(&*e), "clock tick failed; retrying")
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.outage.pause(every)) => {}
            }
        }
    }
}

/// The relay: publishes claimed work with confirms.
#[derive(Debug)]
pub struct Relay {
    ledger: Ledger,
    broker: Broker,
    settings: ProducerSection,
    publisher: Option<Publisher>,
    metrics: Arc<ProducerMetrics>,
    /// The ledger away, as the relay's passes see it.
    outage: Outage,
}

/// What one relay pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelayReport {
    pub published: usize,
    pub failed: usize,
    pub republished: usize,
}

impl Relay {
    pub fn new(ledger: Ledger, broker: Broker, settings: ProducerSection) -> Self {
        Self {
            ledger,
            broker,
            settings,
            publisher: None,
            metrics: Arc::new(ProducerMetrics::new()),
            outage: Outage::new("relay"),
        }
    }

    /// Counts publishes into `metrics` (served on `/metrics`) instead of a private registry.
    pub fn with_metrics(mut self, metrics: Arc<ProducerMetrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Publishes one batch of due work per channel, within the channel's in-flight window,
    /// then, per channel, republishes work whose message was lost.
    pub async fn relay_once(&mut self, at: LedgerTime) -> anyhow::Result<RelayReport> {
        let mut report = RelayReport::default();
        let now = self
            .ledger
            .clock(at)
            .await
            .context("failed to read the database's clock")?;
        for channel in Channel::ALL {
            let room = self.room(channel, at).await?;
            if room == 0 {
                continue;
            }
            let due = self
                .ledger
                .claim_due(channel, room.min(self.settings.batch_size), at)
                .await
                .context("failed to claim due deliveries")?;
            let (ok, failed) = self.publish(&due, now, false).await?;
            self.metrics.published(channel, false, ok, failed);
            report.published += ok;
            report.failed += failed;
        }
        for channel in Channel::ALL {
            let (ok, failed) = self.republish(channel, now, at).await?;
            self.metrics.published(channel, true, ok, failed);
            report.republished += ok;
            report.failed += failed;
        }
        Ok(report)
    }

    /// Republishes `queued` deliveries of `channel` whose message was not consumed within
    /// `producer.republish_after_s`, but only as many as `work.<channel>` is missing: the
    /// channel's `queued` count less the messages ready in the queue. A queue that nobody
    /// consumes (every worker down) therefore keeps one message per `queued` delivery however
    /// long the outage lasts, instead of gaining a copy of each at every pass; a message that
    /// really was lost (broker restart, failed publish, relay crash) is missing from the queue
    /// and is republished.
    ///
    /// The queue depth is read before the `queued` count: a worker consuming in between makes
    /// the difference smaller, never larger. Messages a consumer holds unsettled are not
    /// counted as ready, so a few of those may be republished: harmless duplicates of the same
    /// generation, of which only one can lease.
    async fn republish(
        &mut self,
        channel: Channel,
        now: DateTime<Utc>,
        at: LedgerTime,
    ) -> anyhow::Result<(usize, usize)> {
        let candidates = self
            .ledger
            .unconsumed(
                channel,
                Duration::from_secs(self.settings.republish_after_s),
                self.settings.batch_size,
                at,
            )
            .await
            .context("failed to read unconsumed deliveries")?;
        if candidates.is_empty() {
            return Ok((0, 0));
        }
        let ready = match tokio::time::timeout(
            self.publish_timeout(),
            self.broker.ready_messages(channel),
        )
        .await
        {
            Ok(Ok(ready)) => u64::from(ready),
            Ok(Err(e)) => {
                warn!(%channel, error.cause_chain = %error_chain(&e), "could not read the work queue's depth; not republishing");
                return Ok((0, 0));
            }
            Err(_elapsed) => {
                warn!(%channel, timeout_ms = self.settings.publish_timeout_ms,
                    "reading the work queue's depth timed out; not republishing");
                return Ok((0, 0));
            }
        };
        let queued = self
            .ledger
            .queued(channel)
            .await
            .context("failed to count queued deliveries")?;
        let missing = usize::try_from(queued.saturating_sub(ready)).unwrap_or(usize::MAX);
        let lost = &candidates[..missing.min(candidates.len())];
        if lost.is_empty() {
            debug!(%channel, queued, ready, "queued work not consumed yet; its messages are still in the queue");
            return Ok((0, 0));
        }
        warn!(
            %channel,
            count = lost.len(),
            queued,
            ready,
            "republishing queued deliveries whose message is missing from the queue"
        );
        self.publish(lost, now, true).await
    }

    /// How many more deliveries of `channel` may be published now: about
    /// `in_flight_seconds` of what the channel's buckets admit, less what is in flight.
    async fn room(&self, channel: Channel, at: LedgerTime) -> anyhow::Result<u32> {
        let s = &self.settings;
        let window = match self.ledger.channel_rate(channel, at).await? {
            None => s.max_in_flight_per_channel,
            Some(rate) => {
                // Saturating float-to-int; clamped to the configured bounds right after.
                let by_rate = (rate * s.in_flight_seconds).ceil() as u32;
                by_rate.clamp(s.min_in_flight_per_channel, s.max_in_flight_per_channel)
            }
        };
        let in_flight = self.ledger.in_flight(channel).await?;
        Ok(u32::try_from(u64::from(window).saturating_sub(in_flight)).unwrap_or(0))
    }

    fn publish_timeout(&self) -> Duration {
        Duration::from_millis(self.settings.publish_timeout_ms)
    }

    /// Publishes `items` with confirms; what is not confirmed within `publish_timeout_ms` is
    /// handed back to the ledger (`mark_unpublished`) and republished at a later pass. The
    /// bound matters when the broker blocks publishers (memory or disk alarm): it then stops
    /// reading without an error, and an unbounded publish would stall the relay of every
    /// channel until the alarm clears.
    async fn publish(
        &mut self,
        items: &[DueDelivery],
        now: DateTime<Utc>,
        republish: bool,
    ) -> anyhow::Result<(usize, usize)> {
        if items.is_empty() {
            return Ok((0, 0));
        }
        let correlations: Vec<String> = items.iter().map(correlation_id).collect();
        let spans: Vec<tracing::Span> = items
            .iter()
            .zip(&correlations)
            .map(|(d, correlation)| publish_span(d, correlation, republish))
            .collect();
        let messages: Vec<OutgoingMessage> = items
            .iter()
            .zip(correlations)
            .zip(&spans)
            .map(|((d, correlation), span)| message(d, correlation, span, now))
            .collect();
        let timeout = self.publish_timeout();
        let attempt = tokio::time::timeout(timeout, async {
            let publisher = self.publisher().await?;
            anyhow::Ok(publisher.publish_batch(&messages).await)
        })
        .await;
        let results = match attempt {
            Ok(Ok(results)) => results,
            Ok(Err(e)) => {
                spans.iter().for_each(|s| {
                    s.record("error.type", "no_publisher");
                });
                warn!(error.cause_chain = %error_chain(&*e), "no publisher; handing the batch back");
                self.ledger.mark_unpublished(items).await?;
                return Ok((0, items.len()));
            }
            Err(_elapsed) => {
                spans.iter().for_each(|s| {
                    s.record("error.type", "timeout");
                });
                warn!(
                    timeout_ms = self.settings.publish_timeout_ms,
                    count = items.len(),
                    "publish not confirmed in time (is the broker blocking publishers?); \
                     handing the batch back"
                );
                // The channel may be blocked mid-batch: the next pass opens another.
                self.publisher = None;
                self.ledger.mark_unpublished(items).await?;
                return Ok((0, items.len()));
            }
        };
        let mut failed = Vec::new();
        for ((item, result), span) in items.iter().zip(results).zip(&spans) {
            if let Err(e) = result {
                span.record("error.type", "not_confirmed");
                debug!(delivery_id = %item.id, error.cause_chain = %error_chain(&e), "publish failed");
                failed.push(item.clone());
            }
        }
        if !failed.is_empty() {
            warn!(
                failed = failed.len(),
                of = items.len(),
                "publishes not confirmed; they are republished at the next pass"
            );
            // A broken channel is replaced at the next pass.
            self.publisher = None;
            self.ledger.mark_unpublished(&failed).await?;
        }
        Ok((items.len() - failed.len(), failed.len()))
    }

    async fn publisher(&mut self) -> anyhow::Result<&Publisher> {
        if self.publisher.is_none() {
            self.publisher = Some(self.broker.publisher().await?);
        }
        self.publisher.as_ref().context("publisher vanished")
    }

    async fn run(mut self, shutdown: CancellationToken) {
        let idle = Duration::from_millis(self.settings.relay_interval_ms);
        let mut failures = 0u32;
        while !shutdown.is_cancelled() {
            let pause = match self.relay_once(LedgerTime::Database).await {
                Ok(report) => {
                    failures = 0;
                    self.outage.back();
                    if report.published + report.republished > 0 {
                        debug!(?report, "relay pass");
                    }
                    let full = report.published + report.failed
                        >= usize::try_from(self.settings.batch_size).unwrap_or(usize::MAX);
                    if full && report.failed == 0 {
                        Duration::ZERO
                    } else {
                        idle
                    }
                }
                // Logged once per outage; the pause doubles up to a few seconds.
                Err(e) if self.outage.away(e.as_ref()) => self.outage.pause(idle),
                Err(e) => {
                    failures = failures.saturating_add(1);
                    error!(error.cause_chain = %error_chain(&*e), failures, "relay pass failed; backing off");
                    idle * 2u32.saturating_pow(failures.min(5))
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
        }
    }
}

/// The correlation id every envelope of a delivery carries: the reminder's (the intake's
/// `X-Correlation-Id`), else a fresh one.
fn correlation_id(d: &DueDelivery) -> String {
    d.correlation_id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}

/// The messaging "send" span of one publish (OpenTelemetry conventions), in the delivery's
/// trace: its trace id is the delivery id, so every attempt of a delivery is one trace.
fn publish_span(d: &DueDelivery, correlation_id: &str, republish: bool) -> tracing::Span {
    let span = tracing::info_span!("publish",
        otel.name = %format_args!("publish {}", d.channel),
        otel.kind = "producer",
        messaging.system = "rabbitmq",
        messaging.operation.type = "send",
        messaging.operation.name = "publish",
        messaging.destination.name = "nudge.work",
        messaging.rabbitmq.destination.routing_key = %d.channel,
        messaging.message.id = %format_args!("{}:{}", d.id, d.generation),
        error.type = tracing::field::Empty,
        delivery_id = %d.id,
        channel = %d.channel,
        generation = d.generation,
        lane = %d.lane,
        correlation_id,
        republish);
    nudge_telemetry::set_delivery_parent(&span, *d.id.as_uuid().as_bytes());
    span
}

/// The envelope of one publish, with its span's W3C context as `traceparent` (the worker's
/// process span joins it). Without trace export the header still names the delivery's trace
/// (trace id = delivery id), for whoever reads it downstream.
fn message(
    d: &DueDelivery,
    correlation_id: String,
    span: &tracing::Span,
    now: DateTime<Utc>,
) -> OutgoingMessage {
    let envelope = Envelope {
        delivery_id: d.id,
        reminder_id: d.reminder_id,
        tenant_id: d.tenant_id,
        channel: d.channel,
        generation: d.generation,
        lane: d.lane,
        correlation_id,
        enqueued_at: now,
    };
    let traceparent = nudge_telemetry::traceparent_of(span).unwrap_or_else(|| {
        let span_id = &uuid::Uuid::new_v4().simple().to_string()[..16];
        format!("00-{}-{span_id}-01", d.id.as_uuid().simple())
    });
    OutgoingMessage {
        channel: d.channel,
        payload: envelope.encode(),
        message_id: format!("{}:{}", d.id, d.generation),
        correlation_id: envelope.correlation_id.clone(),
        traceparent: Some(traceparent),
    }
}
