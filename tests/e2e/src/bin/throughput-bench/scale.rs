//! The scale cases: delivery rate with a large ledger, and one very large producer window.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use nudge_config::RetentionConfig;
use nudge_domain::TenantId;
use nudge_e2e::TestEnv;
use nudge_janitor::retention::{RetentionOutcome, RetentionSettings};
use nudge_ledger::{LedgerTime, RunState};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::probe::{self, Observer};
use crate::run::{self, RunSample, Shape};
use crate::{load, open_ledger};

/// Deliveries of `n` due reminders with `ledger_size` more scheduled over the next seven days
/// (materialised, as a seven-day look-ahead leaves them), one run per `runs`, each on a new
/// tenant in the same growing ledger.
pub async fn large_ledger(
    n: usize,
    runs: usize,
    ledger_size: usize,
    shape: Shape,
    prefetch: u16,
    statements_loaded: bool,
) -> anyhow::Result<(Vec<RunSample>, f64)> {
    let mut env = TestEnv::start("throughput-scale").await?;
    env.ledger.pool().close().await;
    let ledger = open_ledger(&env).await?;
    let bulk = ledger
        .create_tenant("future-clinic", &bench_operator()?)
        .await?;
    let clock = Instant::now();
    load::bulk_materialised(
        &ledger,
        bulk.id,
        ledger_size,
        Utc::now() + chrono::Duration::minutes(10),
        chrono::Duration::days(7),
    )
    .await?;
    eprintln!(
        "  ledger: {ledger_size} future reminders and deliveries in {:.0} s",
        clock.elapsed().as_secs_f64()
    );
    // A running ledger has had its hourly retention run; the janitor schedules the next one
    // an interval after it (the ledger's schedule, not the process's), so it does not count
    // the whole ledger again when the janitor starts with each run below.
    let clock = Instant::now();
    let retention = nudge_janitor::retention::retention_once(
        &ledger,
        &RetentionSettings::from_config(&RetentionConfig::default())?,
        "throughput-bench",
        LedgerTime::Database,
        &CancellationToken::new(),
    )
    .await?;
    let retention_s = clock.elapsed().as_secs_f64();
    anyhow::ensure!(
        matches!(&retention, RetentionOutcome::Ran(summary)
            if summary.state == RunState::Finished && summary.deleted.values().all(|n| *n == 0)),
        "the large ledger's retention run did not finish deleting nothing: {retention:?}"
    );
    eprintln!("  ledger: a retention run counted it (deleting nothing) in {retention_s:.1} s");
    ledger.pool().close().await;
    let mut samples = Vec::new();
    for run in 0..runs {
        let ledger = open_ledger(&env).await?;
        let tenant = ledger
            .create_tenant(&format!("bench-clinic-{run}"), &bench_operator()?)
            .await?;
        load::due_now(&ledger, &env.cipher, tenant.id, n, &format!("due{run}")).await?;
        ledger.pool().close().await;
        let sample =
            run::measure(&mut env, tenant.id, n, shape, prefetch, statements_loaded).await?;
        eprintln!(
            "  large ledger, run {}: {:.0} deliveries/s",
            run + 1,
            sample.per_second
        );
        samples.push(sample);
    }
    Ok((samples, retention_s))
}

#[derive(Debug, Clone, Serialize)]
pub struct WindowSample {
    pub reminders: usize,
    pub deliveries_created: i32,
    /// From the tick that ran the window to its commit being seen.
    pub seconds: f64,
    pub producer_peak_rss_mib_before: f64,
    pub producer_peak_rss_mib_after: f64,
    /// Windows of another tenant (every second, one-second look-ahead) that ran meanwhile.
    pub other_windows_meanwhile: usize,
    /// The longest time between two of the other tenant's windows around the large one.
    pub other_longest_gap_s: f64,
}

/// One producer window in which `count` reminders fall due, beside another tenant whose
/// windows run every second.
pub async fn large_window(count: usize) -> anyhow::Result<WindowSample> {
    let mut env = TestEnv::start("throughput-window").await?;
    env.ledger.pool().close().await;
    let ledger = open_ledger(&env).await?;
    let large = ledger
        .create_tenant("window-clinic", &bench_operator()?)
        .await?;
    let other = ledger
        .create_tenant("other-clinic", &bench_operator()?)
        .await?;
    ledger
        .set_schedule(other.id, "* * * * * *", 1, &bench_operator()?)
        .await?;
    load::bulk_unmaterialised(
        &ledger,
        large.id,
        count,
        Utc::now() + chrono::Duration::minutes(10),
    )
    .await?;
    ledger.pool().close().await;

    let producer = env.start_with_defaults("nudge-producer", "producer")?;
    let pid = env.proc(producer).pid();
    let mut observer = Observer::connect(&env.db_url).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while windows(&mut observer, other.id).await?.len() < 3 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the producer ran no windows in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = probe::peak_rss_kib(pid).unwrap_or(0) as f64 / 1024.0;

    let setter = open_ledger(&env).await?;
    setter
        .set_schedule(large.id, "* * * * * *", 900, &bench_operator()?)
        .await?;
    setter.pool().close().await;
    let deadline = Instant::now() + Duration::from_secs(60 + count as u64 / 500);
    let (started, created, seen) = loop {
        let row: Option<(DateTime<Utc>, i32)> = sqlx::query_as(
            "SELECT created_at, deliveries_created FROM run_intents WHERE tenant_id = $1",
        )
        .bind(large.id.as_uuid())
        .fetch_optional(observer.conn())
        .await?;
        if let Some((started, created)) = row {
            break (started, created, Utc::now());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the window of {count} reminders did not commit in time"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let after = probe::peak_rss_kib(pid).unwrap_or(0) as f64 / 1024.0;
    // Wait for the other tenant's first window after the large one, which closes the gap.
    let deadline = Instant::now() + Duration::from_secs(30);
    let others = loop {
        let others = windows(&mut observer, other.id).await?;
        if others.last().is_some_and(|last| *last > seen) {
            break others;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the other tenant's windows stopped"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    observer.close().await;
    env.stop_all(Duration::from_secs(20));

    let meanwhile = others
        .iter()
        .filter(|t| **t > started && **t < seen)
        .count();
    let longest = others
        .windows(2)
        .filter(|pair| pair[1] >= started)
        .map(|pair| (pair[1] - pair[0]).num_milliseconds() as f64 / 1000.0)
        .fold(0.0, f64::max);
    Ok(WindowSample {
        reminders: count,
        deliveries_created: created,
        seconds: (seen - started).num_milliseconds() as f64 / 1000.0,
        producer_peak_rss_mib_before: before,
        producer_peak_rss_mib_after: after,
        other_windows_meanwhile: meanwhile,
        other_longest_gap_s: longest,
    })
}

async fn windows(observer: &mut Observer, tenant: TenantId) -> anyhow::Result<Vec<DateTime<Utc>>> {
    Ok(sqlx::query_scalar(
        "SELECT created_at FROM run_intents WHERE tenant_id = $1 ORDER BY created_at",
    )
    .bind(tenant.as_uuid())
    .fetch_all(observer.conn())
    .await?)
}

/// The operator behind the bench's own setup changes.
pub(crate) fn bench_operator() -> anyhow::Result<nudge_ledger::Operator> {
    Ok(nudge_ledger::Operator::new(
        "throughput-bench",
        Some("benchmark setup"),
        Utc::now(),
    )?)
}
