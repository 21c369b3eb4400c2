//! The throughput benchmark: how fast the real processes deliver SMS that are all due at once,
//! and what each delivery costs in commits, statements, CPU and memory.
//!
//! Every run gets a fresh database, broker namespace and provider stub (whose `sms-main`
//! account accepts everything at once), and N SMS reminders due now, loaded before anything
//! starts (not timed with the deliveries). Cases: one and two `nudge-sms` workers, each
//! without a rate bucket and with one far above the load (100,000/s), so admission runs but
//! never waits. `nudge-producer` and `nudge-janitor` run with their default configuration.
//! Each run also times `nudgectl reminders load` of a file of `--load-lines` reminders due now
//! (100,000 by default) into a fresh database of its own.
//! `--scale` adds the scale cases: the one-worker bucket case with a large ledger of future
//! reminders, and one producer window in which a large number of reminders fall due.
//!
//!   scripts/bench-throughput.sh [--deliveries N] [--runs R] [--scale]
//!
//! Prints a table against the targets and writes `bench/results/throughput-<stamp>.json` and
//! `bench/results/throughput-latest.md`. Everything a run starts is stopped and dropped at its
//! end, on failure and on Ctrl-C or SIGTERM too.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr
)]

mod load;
mod probe;
mod report;
mod run;
mod scale;

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use nudge_e2e::TestEnv;
use nudge_ledger::Ledger;

use crate::load::LoadSample;
use crate::run::{RunSample, Shape};
use crate::scale::WindowSample;

#[derive(Debug, Parser)]
#[command(about = "Deliveries per second of the real nudge processes, and their cost.")]
struct Args {
    /// SMS deliveries due now in each run.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(100..=1_000_000))]
    deliveries: u32,
    /// Runs per case; the median run is reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=9))]
    runs: u32,
    /// Unacknowledged messages each worker takes at once (`amqp.prefetch`); default: the
    /// configuration's default.
    #[arg(long, default_value_t = nudge_config::AmqpConfig::default().prefetch,
          value_parser = clap::value_parser!(u16).range(1..))]
    prefetch: u16,
    /// Lines of the file `nudgectl reminders load` is timed on, once per run.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u32).range(100..=10_000_000))]
    load_lines: u32,
    /// Also run the scale cases (about ten more minutes at the default sizes).
    #[arg(long)]
    scale: bool,
    /// Future reminders in the ledger for the large-ledger case.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u32).range(1_000..=10_000_000))]
    ledger_reminders: u32,
    /// Reminders falling due in the one large producer window.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u32).range(1_000..=1_000_000))]
    window_reminders: u32,
    /// Where the results go (default: the repository's bench/results).
    #[arg(long, value_name = "DIR")]
    results: Option<PathBuf>,
    /// Whether the delivery cases write delivery events (`off` disables the ledger's event
    /// triggers in each case's database, to measure what the events cost the pipeline; the
    /// timed `reminders load` keeps them). Either way the loaded reminders' events are numbered
    /// before the timed window, as the janitor numbers them while reminders wait.
    #[arg(long, value_enum, default_value_t = Events::On)]
    events: Events,
}

/// `--events`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Events {
    On,
    Off,
}

/// The delivery cases, in the order they run (and are reported).
const CASES: [(&str, Shape); 4] = [
    (
        "1 worker, bucket 100000/s",
        Shape {
            workers: 1,
            bucket: true,
        },
    ),
    (
        "1 worker, no bucket",
        Shape {
            workers: 1,
            bucket: false,
        },
    ),
    (
        "2 workers, bucket 100000/s",
        Shape {
            workers: 2,
            bucket: true,
        },
    ),
    (
        "2 workers, no bucket",
        Shape {
            workers: 2,
            bucket: false,
        },
    ),
];

/// Everything measured, as written to the JSON file.
#[derive(Debug, serde::Serialize)]
pub struct Results {
    deliveries: u32,
    runs: u32,
    prefetch: u16,
    load_lines: u32,
    statements_loaded: bool,
    events: Events,
    cases: Vec<(String, Vec<RunSample>)>,
    load: Vec<LoadSample>,
    large_ledger: Option<(u32, Vec<RunSample>)>,
    /// How long the large ledger's retention run took (before the timed runs).
    large_ledger_retention_s: Option<f64>,
    window: Option<WindowSample>,
    seconds: f64,
}

pub async fn open_ledger(env: &TestEnv) -> anyhow::Result<Ledger> {
    Ok(Ledger::connect(&nudge_config::DatabaseConfig {
        url: nudge_config::Secret::new(env.db_url.clone()),
        max_connections: 8,
        acquire_timeout_ms: 10_000,
        ..nudge_config::DatabaseConfig::default()
    })
    .await?)
}

async fn bench(args: &Args) -> anyhow::Result<Results> {
    let clock = Instant::now();
    let n = args.deliveries as usize;
    let mut admin = probe::Admin::connect().await?;
    let statements_loaded = admin.statements_loaded().await?;
    admin.close().await;
    if !statements_loaded {
        eprintln!("pg_stat_statements is not loaded: statements per delivery are not measured");
    }
    let mut cases: Vec<(String, Vec<RunSample>)> = CASES
        .iter()
        .map(|(name, _)| ((*name).to_owned(), Vec::new()))
        .collect();
    let mut loads = Vec::new();
    // Runs interleave the cases, so a slow minute on a shared machine spreads over all.
    for run in 0..args.runs {
        {
            let env = TestEnv::start("throughput-load").await?;
            env.ledger
                .create_tenant("bench-clinic", &scale::bench_operator()?)
                .await?;
            env.ledger.pool().close().await;
            let load = load::nudgectl_load(&env, "bench-clinic", args.load_lines as usize)?;
            eprintln!(
                "run {}: nudgectl reminders load of {} lines: {:.0} reminders/s",
                run + 1,
                args.load_lines,
                load.per_second
            );
            loads.push(load);
        }
        for (index, (name, shape)) in CASES.iter().enumerate() {
            let mut env = TestEnv::start("throughput-bench").await?;
            env.ledger.pool().close().await;
            let ledger = open_ledger(&env).await?;
            let tenant = ledger
                .create_tenant("bench-clinic", &scale::bench_operator()?)
                .await?;
            if args.events == Events::Off {
                sqlx::query(
                    "ALTER TABLE deliveries DISABLE TRIGGER deliveries_event_count, \
                     DISABLE TRIGGER deliveries_events_inserted, \
                     DISABLE TRIGGER deliveries_events_updated",
                )
                .execute(ledger.pool())
                .await?;
                sqlx::query(
                    "ALTER TABLE provider_events DISABLE TRIGGER provider_events_delivered_event",
                )
                .execute(ledger.pool())
                .await?;
            }
            load::due_now(&ledger, &env.cipher, tenant.id, n, "due").await?;
            load::number_events(&ledger).await?;
            ledger.pool().close().await;
            let sample = run::measure(
                &mut env,
                tenant.id,
                n,
                *shape,
                args.prefetch,
                statements_loaded,
            )
            .await?;
            eprintln!(
                "run {}: {name}: {:.0} deliveries/s, {:.2} commits/delivery",
                run + 1,
                sample.per_second,
                sample.commits_per_delivery
            );
            cases[index].1.push(sample);
        }
    }
    let (large_ledger, large_ledger_retention_s, window) = if args.scale {
        eprintln!(
            "scale: {} future reminders in the ledger",
            args.ledger_reminders
        );
        let (large, retention_s) = scale::large_ledger(
            n,
            args.runs as usize,
            args.ledger_reminders as usize,
            CASES[0].1,
            args.prefetch,
            statements_loaded,
        )
        .await?;
        eprintln!("scale: one window of {} reminders", args.window_reminders);
        let window = scale::large_window(args.window_reminders as usize).await?;
        (
            Some((args.ledger_reminders, large)),
            Some(retention_s),
            Some(window),
        )
    } else {
        (None, None, None)
    };
    Ok(Results {
        deliveries: args.deliveries,
        runs: args.runs,
        load_lines: args.load_lines,
        prefetch: args.prefetch,
        statements_loaded,
        events: args.events,
        cases,
        load: loads,
        large_ledger,
        large_ledger_retention_s,
        window,
        seconds: clock.elapsed().as_secs_f64(),
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // On a signal the benchmark's future is dropped, and with it the run's environment, which
    // stops its processes and drops its database and broker namespace.
    let results = tokio::select! {
        results = bench(&args) => results?,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; the current run was cleaned up"),
        _ = terminate.recv() => anyhow::bail!("terminated; the current run was cleaned up"),
    };
    let dir = args
        .results
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/results"));
    report::write(&results, &dir)
}
