//! One measured delivery run: due reminders already in the ledger, then the janitor and the
//! workers start, then the producer (whose relay starts the work), and the run ends when the
//! stub has accepted every delivery and the ledger says each is delivered.
//!
//! Rate: deliveries over the span from the first attempt's start to the last attempt's finish
//! (the `attempts` table). Commits: `pg_stat_database.xact_commit` of the run's database from
//! before any process started until all of them have exited, less the bench's own queries.
//! Statements: the same with `pg_stat_statements`. CPU: each process's user + system time over
//! its whole life (start-up included), read just before it is stopped; PostgreSQL's share is
//! that of the client backends serving the run's database.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use nudge_domain::{Channel, TenantId};
use nudge_e2e::{TestEnv, WorkerOptions, stats};
use serde::Serialize;

use crate::probe::{self, Admin, Observer};

/// A bucket rate far above anything the machine can send: admission runs, never limits.
pub const BUCKET_RATE: f64 = 100_000.0;
const ACCOUNT: &str = "sms-main";

/// What is measured in one run.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub workers: usize,
    pub bucket: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct RunSample {
    pub deliveries: i64,
    pub attempts: i64,
    pub span_s: f64,
    pub per_second: f64,
    pub commits: i64,
    pub commits_per_delivery: f64,
    pub statements: Option<i64>,
    pub statements_per_delivery: Option<f64>,
    /// CPU seconds per process over its life, and per 1,000 deliveries.
    pub cpu_s: BTreeMap<String, f64>,
    pub cpu_s_per_1000: BTreeMap<String, f64>,
    pub peak_rss_mib: BTreeMap<String, f64>,
    pub worker_peak_rss_mib: f64,
    pub load_average_before: String,
    pub exit_codes: BTreeMap<String, Option<i32>>,
}

/// Runs `shape` over the `n` due deliveries of `tenant`, already in `env`'s ledger. Nothing
/// may be connected to the database when this starts (the baseline of the commit count).
pub async fn measure(
    env: &mut TestEnv,
    tenant: TenantId,
    n: usize,
    shape: Shape,
    prefetch: u16,
    statements_loaded: bool,
) -> anyhow::Result<RunSample> {
    let load_average_before = probe::load_average();
    let mut admin = Admin::connect().await?;
    let commits_before = admin.settled_commits(&env.db_name).await?;
    let mut observer = Observer::connect(&env.db_url).await?;
    let statements_before = if statements_loaded {
        observer.enable_statements().await?;
        Some(observer.statements().await?)
    } else {
        None
    };

    let janitor = env.start_with_defaults("nudge-janitor", "janitor")?;
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.prefetch = prefetch;
    if shape.bucket {
        options.rate = Some((BUCKET_RATE, BUCKET_RATE as u32));
    }
    let mut workers = Vec::new();
    for i in 0..shape.workers {
        workers.push(env.start_worker(Channel::Sms, &format!("worker-{}", i + 1), &options)?);
    }
    let ready = Instant::now() + Duration::from_secs(60);
    loop {
        let consumers = env.consumers(Channel::Sms).await.unwrap_or(0);
        if consumers as usize >= shape.workers {
            break;
        }
        anyhow::ensure!(Instant::now() < ready, "workers not consuming after 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let producer = env.start_with_defaults("nudge-producer", "producer")?;

    // Bounded by a floor of 100 deliveries/s, far below anything this code has done.
    let deadline = Instant::now() + Duration::from_secs(60 + n as u64 / 100);
    loop {
        let stub = stats(env.stub_stats().await?)?;
        let accepted = stub.accounts.get(ACCOUNT).map_or(0, |a| a.accepted);
        if accepted >= n as u64 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {accepted} of {n} deliveries reached the provider in time"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let delivered: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM deliveries WHERE tenant_id = $1 AND state = 'delivered'",
        )
        .bind(tenant.as_uuid())
        .fetch_one(observer.conn())
        .await?;
        if delivered >= n as i64 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the provider accepted all {n} but the ledger has {delivered} delivered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Before anything stops: CPU, memory, the statement count.
    let mut cpu_s = BTreeMap::new();
    let mut peak_rss_mib = BTreeMap::new();
    let mut named: Vec<(String, u32)> = vec![
        ("producer".into(), env.proc(producer).pid()),
        ("janitor".into(), env.proc(janitor).pid()),
        ("provider-stub".into(), env.stub_pid()),
    ];
    for (i, index) in workers.iter().enumerate() {
        named.push((format!("worker-{}", i + 1), env.proc(*index).pid()));
    }
    for (name, pid) in &named {
        cpu_s.insert(
            name.clone(),
            probe::cpu_seconds(*pid).with_context(|| format!("{name} is not running"))?,
        );
        peak_rss_mib.insert(
            name.clone(),
            probe::peak_rss_kib(*pid).unwrap_or(0) as f64 / 1024.0,
        );
    }
    let backends = admin.backends(&env.db_name).await?;
    let postgres_cpu: f64 = backends
        .iter()
        .filter_map(|pid| probe::cpu_seconds(*pid))
        .sum();
    cpu_s.insert("postgres".into(), postgres_cpu);

    let (attempts, delivered, first, last): (
        i64,
        i64,
        Option<DateTime<Utc>>,
        Option<DateTime<Utc>>,
    ) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE a.outcome_class = 'delivered'),
                    min(a.started_at), max(a.finished_at)
             FROM attempts a JOIN deliveries d ON d.id = a.delivery_id
             WHERE d.tenant_id = $1",
    )
    .bind(tenant.as_uuid())
    .fetch_one(observer.conn())
    .await?;
    let observer_queries = observer.queries();
    let observed = observer_queries;
    observer.close().await;

    let exit_codes = env.stop_all(Duration::from_secs(20)).into_iter().collect();
    // Read by a connection of its own once everything has stopped: its read is not in its
    // own figure, and its transaction is taken out of the commits below.
    let (statements_after, observed) = if statements_loaded {
        let mut last = Observer::connect(&env.db_url).await?;
        let after = last.statements().await?;
        last.close().await;
        (Some(after), observed + 1)
    } else {
        (None, observed)
    };
    let commits_after = admin.settled_commits(&env.db_name).await?;
    admin.close().await;

    let (Some(first), Some(last)) = (first, last) else {
        anyhow::bail!("no attempts recorded");
    };
    let span_s = (last - first).num_microseconds().unwrap_or(0) as f64 / 1e6;
    let commits = commits_after - commits_before - observed;
    let statements = statements_before
        .zip(statements_after)
        .map(|(before, after)| after - before - observer_queries);
    let per_1000 = 1000.0 / delivered.max(1) as f64;
    let worker_peak_rss_mib = peak_rss_mib
        .iter()
        .filter(|(name, _)| name.starts_with("worker"))
        .map(|(_, mib)| *mib)
        .fold(0.0, f64::max);
    Ok(RunSample {
        deliveries: delivered,
        attempts,
        span_s,
        per_second: delivered as f64 / span_s.max(1e-3),
        commits,
        commits_per_delivery: commits as f64 / delivered.max(1) as f64,
        statements,
        statements_per_delivery: statements.map(|s| s as f64 / delivered.max(1) as f64),
        cpu_s_per_1000: cpu_s
            .iter()
            .map(|(k, v)| (k.clone(), v * per_1000))
            .collect(),
        cpu_s,
        peak_rss_mib,
        worker_peak_rss_mib,
        load_average_before,
        exit_codes,
    })
}
