//! The events push benchmark (issue 28, "Measured"): how fast `nudge-events` pushes a tenant's
//! delivery events to a fast local endpoint while the pipeline delivers beside it, and how long
//! after a change its event is POSTed.
//!
//! Every run gets a fresh database, broker namespace and provider stub (whose `sms-main` account
//! accepts everything at once), one tenant whose webhook points (`nudgectl tenant webhook set
//! --from 0`) at a receiver inside this process, and the real `nudge-janitor` (which numbers the
//! events every `janitor.events_interval_ms`), `nudge-events`, one `nudge-sms` worker without a
//! rate bucket, and `nudge-producer` (producer and the janitor's other keys at their defaults).
//!
//! - `rate`: N SMS reminders due now (20,000), imported before anything starts (the ledger's own
//!   batch import, 500 a transaction; each writes its delivery and its `scheduled` event), so
//!   the push starts with N events waiting and the `sent` events follow at the pipeline's rate.
//!   Deliveries/s as the throughput benchmark measures it (delivered over the span from the
//!   first attempt's start to the last attempt's finish); events pushed/s: events received
//!   over the span from the first receive to the last (target: at least the deliveries/s);
//!   how long after the last change (its event's `occurred_at`) the last event arrived.
//! - `lag`: reminders 1 ms apart (1,000 deliveries/s) for 20 s, falling due a while after
//!   they are all imported, made into deliveries by the producer's windows, sent as they fall
//!   due. Lag of each event: its receive instant minus its `occurred_at` (the database's
//!   `clock_timestamp()` when the change's statement ran, just before its commit), p50, p99
//!   (target: under 1 s) and max, and events received/s.
//!
//! In both cases every event the ledger holds for the tenant must arrive, in position order:
//! the run fails when one is missing or when one arrives that the ledger does not hold;
//! duplicates (delivery is at least once), gaps between batches (a batch whose `after` is past
//! the previous one's `through`) and events below one already received are counted.
//!
//! The receiver is an axum server on 127.0.0.1: it records each event's position, kind, `occurred_at` and the instant its request's
//! body was read (`Utc::now()`), and answers 204 at once. It does not verify the Standard
//! Webhooks signatures: the end-to-end tests do (`tests/it/events_push.rs`); here the check
//! would only add its cost to the lag.
//!
//! `--scale quick` (hidden) is a smoke test of the benchmark (500 due; 3 s of the schedule): its
//! figures say nothing. Each case runs `--runs` times (default 3), the cases interleaved; the
//! table gives each figure's median and worst run beside its target. Writes
//! `events-<scale>-<UTC stamp>.json` (every run) and `events-<scale>-latest.md` under
//! `--results` (default `bench/results/`).
//!
//!   scripts/bench-events.sh [--case rate|lag|all] [--runs N] [--results DIR]
//!                           [--events-interval-ms MS] [--poll-interval-ms MS] [--batch-max N]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::{Parser, ValueEnum};
use nudge_domain::{Channel, EventId, SubscriberRef, TenantId};
use nudge_e2e::{TestEnv, WorkerOptions, percentile};
use nudge_ledger::{Destination, ImportOutcome, ImportReminder, NewReminder};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The tenant every run's reminders belong to.
const TENANT: &str = "clinic";
/// Reminders per import transaction while loading, and import transactions at once (the
/// harness's ledger pool has 8 connections).
const LOAD_BATCH: usize = 500;
const LOAD_STREAMS: usize = 4;
/// How far ahead the `lag` case's tenant's producer windows look (they run every second).
const WINDOW_SECONDS: u32 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    Rate,
    Lag,
    All,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Scale {
    /// Issue 28's sizes: 20,000 due at once; 1,000/s for 20 s.
    Full,
    /// A smoke test of the benchmark itself (500 due; 1,000/s for 3 s): its figures say nothing.
    #[value(hide = true)]
    Quick,
}

impl Scale {
    fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Quick => "quick",
        }
    }
}

#[derive(Debug, Parser)]
#[command(about = "Measures nudge-events' push rate and lag beside the pipeline (issue 28)")]
struct Args {
    /// Which case to run.
    #[arg(long, value_enum, default_value_t = Which::All)]
    case: Which,
    /// full: issue 28's sizes.
    #[arg(long, value_enum, default_value_t = Scale::Full)]
    scale: Scale,
    /// Runs of each case (interleaved); the table gives the median and the worst.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=9))]
    runs: u32,
    /// Where the results go (default: the repository's bench/results).
    #[arg(long, value_name = "DIR")]
    results: Option<PathBuf>,
    /// `janitor.events_interval_ms`: how often the janitor numbers new events.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    events_interval_ms: u64,
    /// `events.poll_interval_ms`: how often nudge-events looks for webhooks with events due.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    poll_interval_ms: u64,
    /// `events.batch_max`: events per POST (default: the configuration's default).
    #[arg(long, default_value_t = nudge_events::EventsSection::default().batch_max,
          value_parser = clap::value_parser!(u32).range(1..=1_000))]
    batch_max: u32,
}

/// What every run configures.
#[derive(Debug, Clone, Copy, Serialize)]
struct Settings {
    events_interval_ms: u64,
    poll_interval_ms: u64,
    batch_max: u32,
    worker_prefetch: u16,
}

/// The `rate` case's shape.
#[derive(Debug, Clone, Copy, Serialize)]
struct RateShape {
    deliveries: usize,
}

/// The `lag` case's shape: `per_second` reminders a second, evenly spaced, for `seconds`.
#[derive(Debug, Clone, Copy, Serialize)]
struct LagShape {
    per_second: usize,
    seconds: usize,
}

impl LagShape {
    fn reminders(self) -> usize {
        self.per_second * self.seconds
    }
}

fn rate_shape(scale: Scale) -> RateShape {
    RateShape {
        deliveries: match scale {
            Scale::Full => 20_000,
            Scale::Quick => 500,
        },
    }
}

fn lag_shape(scale: Scale) -> LagShape {
    LagShape {
        per_second: 1_000,
        seconds: match scale {
            Scale::Full => 20,
            Scale::Quick => 3,
        },
    }
}

// ---------------------------------------------------------------------------------------------
// The receiver.

/// One event as it first arrived.
#[derive(Debug, Clone)]
struct Arrival {
    kind: String,
    occurred_at: DateTime<Utc>,
    received_at: DateTime<Utc>,
}

/// What the receiver saw.
#[derive(Debug, Default)]
struct Log {
    requests: u64,
    /// Requests it could not read as a batch (answered 400).
    malformed: u64,
    /// Events received, duplicates included.
    events: u64,
    /// Each position's first arrival.
    first: HashMap<i64, Arrival>,
    /// Events whose position had arrived before.
    duplicates: u64,
    /// Events whose position is new but below one already received.
    out_of_order: u64,
    /// Batches whose `after` is past the previous batch's `through`.
    gaps: u64,
    /// The previous batch's `through` (0 before the first: the webhook starts at 0).
    last_through: i64,
    highest: i64,
}

impl Log {
    fn record(&mut self, body: &[u8], received_at: DateTime<Utc>) -> Result<(), String> {
        let batch: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
        let data = &batch["data"];
        let (Some(after), Some(through), Some(events)) = (
            data["after"].as_i64(),
            data["through"].as_i64(),
            data["events"].as_array(),
        ) else {
            return Err("no data.after, data.through or data.events".to_owned());
        };
        let mut parsed = Vec::with_capacity(events.len());
        for event in events {
            let position = event["position"]
                .as_i64()
                .ok_or("an event without a position")?;
            let occurred_at = event["occurred_at"]
                .as_str()
                .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                .ok_or("an event without an RFC 3339 occurred_at")?
                .with_timezone(&Utc);
            let kind = event["kind"].as_str().unwrap_or_default().to_owned();
            parsed.push((position, kind, occurred_at));
        }
        self.requests += 1;
        if after > self.last_through {
            self.gaps += 1;
        }
        self.last_through = through;
        for (position, kind, occurred_at) in parsed {
            self.events += 1;
            if self.first.contains_key(&position) {
                self.duplicates += 1;
                continue;
            }
            if position < self.highest {
                self.out_of_order += 1;
            }
            self.highest = self.highest.max(position);
            self.first.insert(
                position,
                Arrival {
                    kind,
                    occurred_at,
                    received_at,
                },
            );
        }
        Ok(())
    }
}

/// The endpoint the tenant's webhook points at; stops serving when dropped.
struct Receiver {
    url: String,
    log: Arc<Mutex<Log>>,
    task: JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        // The accept loop owns the connections' tasks: aborting it drops and aborts them too.
        self.task.abort();
    }
}

impl Receiver {
    async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .context("failed to bind the receiver on loopback")?;
        let url = format!("http://{}/events", listener.local_addr()?);
        let log = Arc::new(Mutex::new(Log::default()));
        let app = axum::Router::new()
            .route("/events", axum::routing::post(receive))
            .with_state(log.clone());
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("receiver: {e}");
            }
        });
        Ok(Self { url, log, task })
    }

    fn distinct(&self) -> usize {
        self.log.lock().unwrap().first.len()
    }

    /// Stops serving and hands back what was received.
    fn finish(self) -> Log {
        self.task.abort();
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

/// One request: recorded, then answered 204 (400 when it is not a batch).
async fn receive(
    axum::extract::State(log): axum::extract::State<Arc<Mutex<Log>>>,
    body: axum::body::Bytes,
) -> axum::http::StatusCode {
    let received_at = Utc::now();
    let mut log = log.lock().unwrap();
    match log.record(&body, received_at) {
        Ok(()) => axum::http::StatusCode::NO_CONTENT,
        Err(e) => {
            log.malformed += 1;
            eprintln!("receiver: a request that is not a batch: {e}");
            axum::http::StatusCode::BAD_REQUEST
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One run.

/// Imports `n` SMS reminders of `tenant`, the `i`-th falling due at `due(i)`, with the ledger's
/// batch import: [`LOAD_BATCH`] per transaction, [`LOAD_STREAMS`] transactions at once. Fails
/// unless every one is new.
async fn load(
    env: &TestEnv,
    tenant: TenantId,
    n: usize,
    due: impl Fn(usize) -> DateTime<Utc> + Sync,
) -> anyhow::Result<()> {
    let batches: Vec<(usize, usize)> = (0..n)
        .step_by(LOAD_BATCH)
        .map(|first| (first, (first + LOAD_BATCH).min(n)))
        .collect();
    let (batches, due) = (&batches, &due);
    let stream = |offset: usize| async move {
        for (first, end) in batches.iter().skip(offset).step_by(LOAD_STREAMS) {
            let mut items = Vec::with_capacity(end - first);
            for i in *first..*end {
                let event = format!("bench-{i}");
                let at = due(i);
                items.push(ImportReminder {
                    reminder: NewReminder::new(
                        tenant,
                        EventId::parse(&event)?,
                        SubscriberRef::parse(&format!("sub-{event}"))?,
                        &[Channel::Sms],
                        at,
                        at + chrono::Duration::hours(2),
                    )?
                    .with_content(br#"{"template":"appointment"}"#.to_vec())?,
                    contacts: vec![(Channel::Sms, Destination::new(format!("+1555{i:07}")))],
                });
            }
            let outcomes = env
                .ledger
                .import_reminders(&items, &env.cipher, Utc::now())
                .await?;
            anyhow::ensure!(
                outcomes
                    .iter()
                    .all(|o| matches!(o, ImportOutcome::Created { .. })),
                "an imported reminder was not created: {outcomes:?}"
            );
        }
        anyhow::Ok(())
    };
    let (a, b, c, d) = tokio::join!(stream(0), stream(1), stream(2), stream(3));
    a?;
    b?;
    c?;
    d?;
    Ok(())
}

/// A tenant whose webhook points at a new receiver, from position 0.
async fn tenant_with_receiver(env: &TestEnv) -> anyhow::Result<(TenantId, Receiver)> {
    let tenant = env.tenant(TENANT, WINDOW_SECONDS).await?;
    let receiver = Receiver::start().await?;
    let (code, out, err) = env.nudgectl(&[
        "tenant",
        "webhook",
        "set",
        TENANT,
        "--url",
        &receiver.url,
        "--allow-http",
        "--from",
        "0",
        "--reason",
        "events benchmark",
    ])?;
    anyhow::ensure!(
        code == 0 && out.trim().starts_with("whsec_"),
        "nudgectl tenant webhook set failed (exit {code}): {}",
        err.lines().rev().take(5).collect::<Vec<_>>().join("\n")
    );
    Ok((tenant, receiver))
}

/// Starts the janitor (numbering events every `events_interval_ms`), nudge-events, one SMS
/// worker without a bucket, waits until it consumes, then starts the producer.
async fn start_pipeline(env: &mut TestEnv, settings: Settings) -> anyhow::Result<()> {
    env.start_janitor_sections(
        "janitor",
        &format!(
            "[janitor]\nevents_interval_ms = {}\n",
            settings.events_interval_ms
        ),
    )?;
    env.start_events(
        "events",
        &format!(
            "poll_interval_ms = {}\nbatch_max = {}\nallow_http = true\n\
             allow_addresses = [\"127.0.0.0/8\"]",
            settings.poll_interval_ms, settings.batch_max
        ),
    )?;
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.rate = None;
    options.prefetch = settings.worker_prefetch;
    env.start_worker(Channel::Sms, "worker-sms", &options)?;
    nudge_e2e::until(
        "the SMS worker consuming",
        Duration::from_secs(60),
        || async { env.consumers(Channel::Sms).await.unwrap_or(0) >= 1 },
    )
    .await?;
    env.start_with_defaults("nudge-producer", "producer")?;
    Ok(())
}

/// Waits (at most `within`) until all `n` deliveries are settled; fails unless each is
/// delivered.
async fn drained(env: &TestEnv, n: usize, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let states = nudge_e2e::states_in(&env.ledger).await?;
        if nudge_e2e::settled(&states) >= n as i64 {
            let delivered = states.get("delivered").copied().unwrap_or(0);
            anyhow::ensure!(
                delivered == n as i64,
                "{} of {n} deliveries settled other than delivered: {states:?}",
                n as i64 - delivered
            );
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "not every delivery settled within {within:?}: {states:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Delivered deliveries and the span from the first attempt's start to the last attempt's
/// finish, in seconds (the throughput benchmark's rate).
async fn delivery_span(env: &TestEnv, tenant: TenantId) -> anyhow::Result<(i64, f64)> {
    let (delivered, first, last): (i64, Option<DateTime<Utc>>, Option<DateTime<Utc>>) =
        sqlx::query_as(
            "SELECT count(*) FILTER (WHERE a.outcome_class = 'delivered'),
                    min(a.started_at), max(a.finished_at)
             FROM attempts a JOIN deliveries d ON d.id = a.delivery_id
             WHERE d.tenant_id = $1",
        )
        .bind(tenant.as_uuid())
        .fetch_one(env.ledger.pool())
        .await?;
    let (Some(first), Some(last)) = (first, last) else {
        anyhow::bail!("no attempts recorded");
    };
    Ok((delivered, micros(last - first) / 1e6))
}

/// What the ledger wrote for the tenant, once every event of it has been received.
struct Written {
    events: i64,
    by_kind: BTreeMap<String, i64>,
    /// The newest event's `occurred_at`: the last change.
    last_change: DateTime<Utc>,
}

/// Waits (at most `within`) until every event the ledger holds for `tenant` is numbered and
/// has reached `receiver`, then checks that the positions received are exactly the ledger's.
async fn all_events_arrived(
    env: &TestEnv,
    tenant: TenantId,
    receiver: &Receiver,
    within: Duration,
) -> anyhow::Result<Written> {
    let deadline = Instant::now() + within;
    loop {
        let (written, numbered): (i64, i64) = sqlx::query_as(
            "SELECT count(*), count(position) FROM delivery_events WHERE tenant_id = $1",
        )
        .bind(tenant.as_uuid())
        .fetch_one(env.ledger.pool())
        .await?;
        let received = receiver.distinct() as i64;
        if written == numbered && received >= written {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "not every event arrived within {within:?}: {written} written, {numbered} \
             numbered, {received} received"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let positions: Vec<i64> =
        sqlx::query_scalar("SELECT position FROM delivery_events WHERE tenant_id = $1")
            .bind(tenant.as_uuid())
            .fetch_all(env.ledger.pool())
            .await?;
    let ledger: HashSet<i64> = positions.into_iter().collect();
    {
        let log = receiver.log.lock().unwrap();
        let missing = ledger.iter().filter(|p| !log.first.contains_key(p)).count();
        let unknown = log.first.keys().filter(|p| !ledger.contains(p)).count();
        anyhow::ensure!(
            missing == 0 && unknown == 0,
            "{missing} of the ledger's {} events never arrived; {unknown} arrived that it \
             does not hold",
            ledger.len()
        );
    }
    let by_kind: Vec<(String, i64)> = sqlx::query_as(
        "SELECT kind, count(*) FROM delivery_events WHERE tenant_id = $1 GROUP BY kind",
    )
    .bind(tenant.as_uuid())
    .fetch_all(env.ledger.pool())
    .await?;
    let last_change: DateTime<Utc> =
        sqlx::query_scalar("SELECT max(occurred_at) FROM delivery_events WHERE tenant_id = $1")
            .bind(tenant.as_uuid())
            .fetch_one(env.ledger.pool())
            .await?;
    Ok(Written {
        events: ledger.len() as i64,
        by_kind: by_kind.into_iter().collect(),
        last_change,
    })
}

fn micros(d: chrono::Duration) -> f64 {
    d.num_microseconds().unwrap_or(i64::MAX) as f64
}

/// Lag percentiles of a set of events, in ms.
#[derive(Debug, Clone, Default, Serialize)]
struct Lags {
    events: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

fn lags<'a>(arrivals: impl Iterator<Item = &'a Arrival>) -> Lags {
    let mut values: Vec<f64> = arrivals
        .map(|a| micros(a.received_at - a.occurred_at) / 1e3)
        .collect();
    values.sort_by(f64::total_cmp);
    Lags {
        events: values.len(),
        p50_ms: percentile(&values, 50.0),
        p99_ms: percentile(&values, 99.0),
        max_ms: values.last().copied().unwrap_or(f64::NAN),
    }
}

/// The receiver's counters, as a run reports them.
#[derive(Debug, Clone, Default, Serialize)]
struct Received {
    requests: u64,
    /// Events received, duplicates included.
    events: u64,
    distinct: usize,
    duplicates: u64,
    out_of_order: u64,
    gaps: u64,
    malformed: u64,
    /// From the first receive to the last, in s.
    span_s: f64,
    /// Distinct events over the span.
    per_second: f64,
    last_received_at: Option<DateTime<Utc>>,
}

fn received(log: &Log) -> Received {
    let first = log.first.values().map(|a| a.received_at).min();
    let last = log.first.values().map(|a| a.received_at).max();
    let span_s = first
        .zip(last)
        .map_or(0.0, |(first, last)| micros(last - first) / 1e6);
    Received {
        requests: log.requests,
        events: log.events,
        distinct: log.first.len(),
        duplicates: log.duplicates,
        out_of_order: log.out_of_order,
        gaps: log.gaps,
        malformed: log.malformed,
        span_s,
        per_second: log.first.len() as f64 / span_s.max(1e-3),
        last_received_at: last,
    }
}

/// Lag of each kind of event.
fn lags_by_kind(log: &Log) -> BTreeMap<String, Lags> {
    let kinds: HashSet<&str> = log.first.values().map(|a| a.kind.as_str()).collect();
    kinds
        .into_iter()
        .map(|kind| {
            (
                kind.to_owned(),
                lags(log.first.values().filter(|a| a.kind == kind)),
            )
        })
        .collect()
}

/// One run of the `rate` case.
#[derive(Debug, Clone, Default, Serialize)]
struct RateRun {
    run: u32,
    /// Why the run failed (setup, a delivery not delivered, an event missing, a deadline).
    failure: Option<String>,
    load_s: f64,
    deliveries: i64,
    /// From the first attempt's start to the last attempt's finish.
    delivery_span_s: f64,
    deliveries_per_second: f64,
    events_written: i64,
    events_by_kind: BTreeMap<String, i64>,
    received: Received,
    /// Events received per second over deliveries per second.
    push_over_delivery: f64,
    /// The last event's receive after the last change's `occurred_at`.
    last_event_after_last_change_s: f64,
    lags_by_kind: BTreeMap<String, Lags>,
    exit_codes: BTreeMap<String, Option<i32>>,
}

async fn run_rate(shape: RateShape, settings: Settings, run: u32) -> anyhow::Result<RateRun> {
    let n = shape.deliveries;
    let mut env = TestEnv::start("events-bench-rate").await?;
    let (tenant, receiver) = tenant_with_receiver(&env).await?;
    let clock = Instant::now();
    let due = Utc::now();
    load(&env, tenant, n, |_| due).await?;
    let load_s = clock.elapsed().as_secs_f64();
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries")
        .fetch_one(env.ledger.pool())
        .await?;
    anyhow::ensure!(
        deliveries == n as i64,
        "{deliveries} deliveries after importing {n} reminders due now"
    );
    start_pipeline(&mut env, settings).await?;
    // Bounded by a floor of 100 deliveries/s, far below anything this code has done.
    drained(&env, n, Duration::from_secs(60 + n as u64 / 100)).await?;
    let written = all_events_arrived(
        &env,
        tenant,
        &receiver,
        Duration::from_secs(60 + 2 * n as u64 / 100),
    )
    .await?;
    let (delivered, delivery_span_s) = delivery_span(&env, tenant).await?;
    let exit_codes = env.stop_all(Duration::from_secs(20)).into_iter().collect();
    let log = receiver.finish();
    let received = received(&log);
    let deliveries_per_second = delivered as f64 / delivery_span_s.max(1e-3);
    Ok(RateRun {
        run,
        failure: None,
        load_s,
        deliveries: delivered,
        delivery_span_s,
        deliveries_per_second,
        events_written: written.events,
        events_by_kind: written.by_kind,
        push_over_delivery: received.per_second / deliveries_per_second,
        last_event_after_last_change_s: received
            .last_received_at
            .map_or(f64::NAN, |at| micros(at - written.last_change) / 1e6),
        lags_by_kind: lags_by_kind(&log),
        received,
        exit_codes,
    })
}

/// One run of the `lag` case.
#[derive(Debug, Clone, Default, Serialize)]
struct LagRun {
    run: u32,
    failure: Option<String>,
    load_s: f64,
    /// How long before the first reminder fell due everything had started.
    started_before_due_s: f64,
    deliveries: i64,
    delivery_span_s: f64,
    deliveries_per_second: f64,
    events_written: i64,
    events_by_kind: BTreeMap<String, i64>,
    received: Received,
    lag: Lags,
    lags_by_kind: BTreeMap<String, Lags>,
    exit_codes: BTreeMap<String, Option<i32>>,
}

/// How long after the `lag` case's clock starts its first reminder falls due: the import
/// (a few thousand a second in a release build on two cores, fewer in a debug one) and the
/// processes' start-up, on a busy machine.
fn lead(reminders: usize) -> chrono::Duration {
    chrono::Duration::seconds(15 + reminders as i64 / 400)
}

async fn run_lag(shape: LagShape, settings: Settings, run: u32) -> anyhow::Result<LagRun> {
    let n = shape.reminders();
    let mut env = TestEnv::start("events-bench-lag").await?;
    let (tenant, receiver) = tenant_with_receiver(&env).await?;
    let start = Utc::now() + lead(n);
    let spacing_us = 1_000_000 / shape.per_second as i64;
    let clock = Instant::now();
    load(&env, tenant, n, |i| {
        start + chrono::Duration::microseconds(i as i64 * spacing_us)
    })
    .await?;
    let load_s = clock.elapsed().as_secs_f64();
    start_pipeline(&mut env, settings).await?;
    let started_before_due_s = micros(start - Utc::now()) / 1e6;
    anyhow::ensure!(
        started_before_due_s > 0.0,
        "setup took longer than its lead of {} s (the import {load_s:.1} s): the machine is \
         too busy",
        lead(n).num_seconds()
    );
    let until_done = started_before_due_s + shape.seconds as f64;
    drained(
        &env,
        n,
        Duration::from_secs_f64(until_done + 60.0 + n as f64 / 100.0),
    )
    .await?;
    let written = all_events_arrived(
        &env,
        tenant,
        &receiver,
        Duration::from_secs(60 + 2 * n as u64 / 100),
    )
    .await?;
    let (delivered, delivery_span_s) = delivery_span(&env, tenant).await?;
    let exit_codes = env.stop_all(Duration::from_secs(20)).into_iter().collect();
    let log = receiver.finish();
    Ok(LagRun {
        run,
        failure: None,
        load_s,
        started_before_due_s,
        deliveries: delivered,
        delivery_span_s,
        deliveries_per_second: delivered as f64 / delivery_span_s.max(1e-3),
        events_written: written.events,
        events_by_kind: written.by_kind,
        received: received(&log),
        lag: lags(log.first.values()),
        lags_by_kind: lags_by_kind(&log),
        exit_codes,
    })
}

// ---------------------------------------------------------------------------------------------
// The summary.

/// Which way a figure gets worse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Worse {
    Higher,
    Lower,
}

/// One figure over a case's runs: its median, its worst run and its target.
#[derive(Debug, Clone, Serialize)]
struct Figure {
    case: &'static str,
    figure: &'static str,
    worse: Worse,
    /// The target: below (worse = higher) or at least (lower) this.
    target: Option<f64>,
    target_text: &'static str,
    /// One value per run that finished, in run order.
    values: Vec<f64>,
    failed_runs: usize,
    median: f64,
    worst: f64,
    /// Runs within the target (a failed run is not); None without a target.
    runs_within_target: Option<usize>,
}

fn sorted(mut values: Vec<f64>) -> Vec<f64> {
    values.sort_by(f64::total_cmp);
    values
}

fn figure(
    case: &'static str,
    figure: &'static str,
    worse: Worse,
    target: Option<(f64, &'static str)>,
    values: Vec<f64>,
    failed_runs: usize,
) -> Figure {
    let ordered = sorted(values.clone());
    let worst = if failed_runs > 0 {
        match worse {
            Worse::Higher => f64::INFINITY,
            Worse::Lower => f64::NEG_INFINITY,
        }
    } else {
        match worse {
            Worse::Higher => ordered.last().copied().unwrap_or(f64::NAN),
            Worse::Lower => ordered.first().copied().unwrap_or(f64::NAN),
        }
    };
    let within = |v: f64, t: f64| match worse {
        Worse::Higher => v < t,
        Worse::Lower => v >= t,
    };
    Figure {
        case,
        figure,
        worse,
        target: target.map(|(t, _)| t),
        target_text: target.map_or("", |(_, text)| text),
        runs_within_target: target.map(|(t, _)| values.iter().filter(|v| within(**v, t)).count()),
        median: percentile(&ordered, 50.0),
        worst,
        values,
        failed_runs,
    }
}

fn rate_figures(runs: &[RateRun]) -> Vec<Figure> {
    let ok: Vec<&RateRun> = runs.iter().filter(|r| r.failure.is_none()).collect();
    let failed = runs.len() - ok.len();
    let f = |name, worse, target, get: fn(&RateRun) -> f64| {
        figure(
            "rate",
            name,
            worse,
            target,
            ok.iter().map(|r| get(r)).collect(),
            failed,
        )
    };
    vec![
        f("deliveries/s (pipeline)", Worse::Lower, None, |r| {
            r.deliveries_per_second
        }),
        f("events pushed/s", Worse::Lower, None, |r| {
            r.received.per_second
        }),
        f(
            "events pushed/s over deliveries/s",
            Worse::Lower,
            Some((1.0, ">= 1 (issue 28)")),
            |r| r.push_over_delivery,
        ),
        f(
            "last event received after the last change (s)",
            Worse::Higher,
            None,
            |r| r.last_event_after_last_change_s,
        ),
        f("`sent` events' lag p99 (ms)", Worse::Higher, None, |r| {
            r.lags_by_kind.get("sent").map_or(f64::NAN, |l| l.p99_ms)
        }),
        f("events (distinct)", Worse::Higher, None, |r| {
            r.received.distinct as f64
        }),
        f("events per request", Worse::Lower, None, |r| {
            r.received.events as f64 / r.received.requests.max(1) as f64
        }),
        f("duplicates", Worse::Higher, None, |r| {
            r.received.duplicates as f64
        }),
        f(
            "gaps between batches",
            Worse::Higher,
            Some((1.0, "0")),
            |r| r.received.gaps as f64,
        ),
        f(
            "events below one already received",
            Worse::Higher,
            Some((1.0, "0")),
            |r| r.received.out_of_order as f64,
        ),
    ]
}

fn lag_figures(runs: &[LagRun]) -> Vec<Figure> {
    let ok: Vec<&LagRun> = runs.iter().filter(|r| r.failure.is_none()).collect();
    let failed = runs.len() - ok.len();
    let f = |name, worse, target, get: fn(&LagRun) -> f64| {
        figure(
            "lag",
            name,
            worse,
            target,
            ok.iter().map(|r| get(r)).collect(),
            failed,
        )
    };
    vec![
        f(
            "deliveries/s (over the attempts' span)",
            Worse::Lower,
            None,
            |r| r.deliveries_per_second,
        ),
        f("events received/s", Worse::Lower, None, |r| {
            r.received.per_second
        }),
        f("lag p50 (ms)", Worse::Higher, None, |r| r.lag.p50_ms),
        f(
            "lag p99 (ms)",
            Worse::Higher,
            Some((1000.0, "< 1 s (issue 28)")),
            |r| r.lag.p99_ms,
        ),
        f("lag max (ms)", Worse::Higher, None, |r| r.lag.max_ms),
        f("`sent` events' lag p99 (ms)", Worse::Higher, None, |r| {
            r.lags_by_kind.get("sent").map_or(f64::NAN, |l| l.p99_ms)
        }),
        f("events (distinct)", Worse::Higher, None, |r| {
            r.received.distinct as f64
        }),
        f("events per request", Worse::Lower, None, |r| {
            r.received.events as f64 / r.received.requests.max(1) as f64
        }),
        f("duplicates", Worse::Higher, None, |r| {
            r.received.duplicates as f64
        }),
        f(
            "gaps between batches",
            Worse::Higher,
            Some((1.0, "0")),
            |r| r.received.gaps as f64,
        ),
        f(
            "events below one already received",
            Worse::Higher,
            Some((1.0, "0")),
            |r| r.received.out_of_order as f64,
        ),
    ]
}

fn number(v: f64) -> String {
    if v.is_infinite() {
        "failed".to_owned()
    } else if v.is_nan() {
        "-".to_owned()
    } else if v.fract() == 0.0 || v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn table(figures: &[Figure]) -> String {
    let mut t = String::from(
        "| figure | target | median | worst run | runs within target | every run |\n\
         |---|---|---|---|---|---|\n",
    );
    for f in figures {
        let mut every: Vec<String> = f.values.iter().map(|v| number(*v)).collect();
        every.extend(std::iter::repeat_n("failed".to_owned(), f.failed_runs));
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            f.figure,
            if f.target_text.is_empty() {
                "-"
            } else {
                f.target_text
            },
            number(f.median),
            number(f.worst),
            f.runs_within_target.map_or_else(
                || "-".to_owned(),
                |n| format!("{n} of {}", f.values.len() + f.failed_runs)
            ),
            every.join(", "),
        ));
    }
    t
}

fn failures<'a>(md: &mut String, failed: impl Iterator<Item = (u32, &'a str)>) {
    for (run, failure) in failed {
        md.push_str(&format!("\nRun {run} failed: {failure}\n"));
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = args
        .results
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/results"));
    let settings = Settings {
        events_interval_ms: args.events_interval_ms,
        poll_interval_ms: args.poll_interval_ms,
        batch_max: args.batch_max,
        worker_prefetch: nudge_config::AmqpConfig::default().prefetch,
    };
    let rate = rate_shape(args.scale);
    let lag = lag_shape(args.scale);
    let run_rate_case = matches!(args.case, Which::Rate | Which::All);
    let run_lag_case = matches!(args.case, Which::Lag | Which::All);
    let clock = Instant::now();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // On a signal the running run's future is dropped, and with it its environment (which
    // stops its processes and drops its database and broker namespace) and its receiver.
    let run_all = async {
        let mut rates = Vec::new();
        let mut lags = Vec::new();
        for run in 1..=args.runs {
            if run_rate_case {
                eprintln!("rate run {run}: starting");
                let result = run_rate(rate, settings, run)
                    .await
                    .unwrap_or_else(|e| RateRun {
                        run,
                        failure: Some(format!("{e:#}")),
                        ..RateRun::default()
                    });
                eprintln!(
                    "rate run {run}: {:.0} deliveries/s, {:.0} events pushed/s, last event {:.2} s after the last change{}",
                    result.deliveries_per_second,
                    result.received.per_second,
                    result.last_event_after_last_change_s,
                    result
                        .failure
                        .as_ref()
                        .map(|f| format!("; failed: {f}"))
                        .unwrap_or_default()
                );
                rates.push(result);
            }
            if run_lag_case {
                eprintln!("lag run {run}: starting");
                let result = run_lag(lag, settings, run)
                    .await
                    .unwrap_or_else(|e| LagRun {
                        run,
                        failure: Some(format!("{e:#}")),
                        ..LagRun::default()
                    });
                eprintln!(
                    "lag run {run}: lag p50 {:.0} ms p99 {:.0} ms max {:.0} ms, {:.0} events/s, {:.0} deliveries/s{}",
                    result.lag.p50_ms,
                    result.lag.p99_ms,
                    result.lag.max_ms,
                    result.received.per_second,
                    result.deliveries_per_second,
                    result
                        .failure
                        .as_ref()
                        .map(|f| format!("; failed: {f}"))
                        .unwrap_or_default()
                );
                lags.push(result);
            }
        }
        (rates, lags)
    };
    let (rates, lags) = tokio::select! {
        results = run_all => results,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; the current run was cleaned up"),
        _ = terminate.recv() => anyhow::bail!("terminated; the current run was cleaned up"),
    };

    let rate_summary = run_rate_case.then(|| rate_figures(&rates));
    let lag_summary = run_lag_case.then(|| lag_figures(&lags));
    let scale = args.scale.name();
    let stamp = Utc::now().format("%Y%m%dT%H%M%SZ").to_string();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let build = nudge_e2e::build_profile();
    let mut md = format!(
        "# Events push benchmark (issue 28)\n\n\
         Run {stamp} on {cores} cores ({cpu}), {build}, `--scale {scale}`, {runs} run(s) of \
         each case (interleaved), {secs:.0} s in all, each run on a fresh database, broker \
         namespace and provider stub. Produced by `scripts/bench-events.sh`; \
         `events-{scale}-{stamp}.json` has every run (with each kind's lag).\n\n\
         One tenant; its webhook (from position 0) points at a receiver in the benchmark's \
         process on 127.0.0.1, which records each event's arrival and answers 204 at once \
         without verifying the signatures (the end-to-end tests do). Beside it the real \
         janitor (`janitor.events_interval_ms` = {ei}; its other keys at their defaults), \
         `nudge-events` (`events.poll_interval_ms` = {pi}, `events.batch_max` = {bm}), one \
         SMS worker without a rate bucket (`amqp.prefetch` = {pf}) against the stub, which \
         accepts at once, and the producer at its defaults. Every event the ledger holds for \
         the tenant must arrive, or the run fails. Lag: an event's receive instant \
         (`Utc::now()` once its request's body is read) minus its `occurred_at` (the \
         database's `clock_timestamp()` when its change's statement ran); one clock. Worst \
         run: the highest value over the runs (the lowest for a rate); a failed run is the \
         worst.\n",
        runs = args.runs,
        secs = clock.elapsed().as_secs_f64(),
        ei = settings.events_interval_ms,
        pi = settings.poll_interval_ms,
        bm = settings.batch_max,
        pf = settings.worker_prefetch,
    );
    if let Some(figures) = &rate_summary {
        md.push_str(&format!(
            "\n## Push rate\n\n\
             {n} SMS reminders due now, imported before anything starts (each with its delivery \
             and `scheduled` event), then the pipeline and the push start together: the push \
             begins {n} events behind and the `sent` events follow at the pipeline's rate. \
             Deliveries/s: delivered over the span from the first attempt's start to the last \
             attempt's finish (as the throughput benchmark); events pushed/s: distinct events \
             received over the span from the first receive to the last.\n\n{table}",
            n = rate.deliveries,
            table = table(figures),
        ));
        failures(
            &mut md,
            rates
                .iter()
                .filter_map(|r| r.failure.as_deref().map(|f| (r.run, f))),
        );
    }
    if let Some(figures) = &lag_summary {
        md.push_str(&format!(
            "\n## Lag at {per}/s\n\n\
             {n} SMS reminders {gap} ms apart ({per}/s for {s} s), imported before the first \
             falls due; the producer's windows (every second, {w} s ahead) make their \
             deliveries (`scheduled` events), the worker sends each as it falls due (`sent` \
             events). Every event's lag counts.\n\n{table}",
            per = lag.per_second,
            n = lag.reminders(),
            gap = 1000.0 / lag.per_second as f64,
            s = lag.seconds,
            w = WINDOW_SECONDS,
            table = table(figures),
        ));
        failures(
            &mut md,
            lags.iter()
                .filter_map(|r| r.failure.as_deref().map(|f| (r.run, f))),
        );
    }
    println!("{md}");

    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join(format!("events-{scale}-{stamp}.json")),
        serde_json::to_string_pretty(&serde_json::json!({
            "at": Utc::now(),
            "cpu": cpu,
            "cores": cores,
            "build": build,
            "scale": args.scale,
            "runs": args.runs,
            "settings": settings,
            "rate": run_rate_case.then_some(serde_json::json!({
                "shape": rate,
                "summary": rate_summary,
                "runs": rates,
            })),
            "lag": run_lag_case.then_some(serde_json::json!({
                "shape": lag,
                "summary": lag_summary,
                "runs": lags,
            })),
        }))?,
    )?;
    std::fs::write(dir.join(format!("events-{scale}-latest.md")), md)?;
    Ok(())
}
