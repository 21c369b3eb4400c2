//! The retention benchmark: delete a large settled history (deliveries with their attempts)
//! while the pipeline delivers at a steady rate, and compare the delivery rate with and
//! without retention running.
//!
//! One fresh database, broker namespace and provider stub. The history is bulk SQL shaped as
//! the ledger writes it: N deliveries settled 100 days ago (70% delivered, 10% each expired,
//! cancelled and dead-lettered), each with its reminder and one attempt. Live traffic: SMS
//! reminders due now through the ledger's import, sent by one `nudge-sms` worker through a
//! bucket at `--rate`, with the real producer and janitor.
//!
//! 1. For the partitioning question, the same history copied into a table partitioned by
//!    `settled_at` and the old partition dropped: how long a DROP takes against the batched
//!    deletion. Then the live reminders are loaded, and the tables' and indexes' sizes taken.
//! 2. Without retention (`retention.enabled = false`): delivered per second over `--window-s`.
//! 3. With retention (a janitor whose first run starts at once, `--batch-size`, `--pause-ms`):
//!    delivered per second over the same window while the run deletes, and the run's deletion
//!    rate, until it finishes or `--max-run-s` passes.
//! 4. Sizes again, and after a plain VACUUM.
//!
//!   scripts/bench-retention.sh [--deliveries N] [--rate R] [--window-s W] [--batch-size B]
//!                              [--pause-ms P] [--max-run-s S]
//!
//! Writes `bench/results/retention-<stamp>.json` and `bench/results/retention-latest.md`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use chrono::Utc;
use clap::Parser;
use nudge_domain::{Channel, EventId, SubscriberRef, TenantId};
use nudge_e2e::{TestEnv, WorkerOptions};
use nudge_ledger::{Destination, ImportReminder, NewReminder};
use serde::Serialize;

#[derive(Debug, Parser)]
#[command(about = "Delete a settled history beside live deliveries; compare delivery rates.")]
struct Args {
    /// Settled deliveries in the history to delete (each with one attempt).
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u32).range(1_000..=5_000_000))]
    deliveries: u32,
    /// The live SMS bucket's rate (deliveries per second offered by the pipeline).
    #[arg(long, default_value_t = 300.0)]
    rate: f64,
    /// The measured window of each phase, in seconds.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(10..=600))]
    window_s: u64,
    /// retention.batch_size of the janitor under test.
    #[arg(long, default_value_t = 500)]
    batch_size: u32,
    /// retention.pause_ms of the janitor under test.
    #[arg(long, default_value_t = 200)]
    pause_ms: u64,
    /// Stop waiting for the retention run after this long (it is then reported unfinished).
    #[arg(long, default_value_t = 1_800)]
    max_run_s: u64,
    /// Where the results go (default: the repository's bench/results).
    #[arg(long, value_name = "DIR")]
    results: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
struct Size {
    table_mib: f64,
    indexes_mib: f64,
    rows: i64,
}

#[derive(Debug, Serialize)]
struct Report {
    stamp: String,
    args: BTreeMap<String, String>,
    load_average_before: String,
    seed_s: f64,
    sizes_before: BTreeMap<String, Size>,
    partition_copy_s: f64,
    partition_drop_s: f64,
    delivered_per_s_without: f64,
    delivered_per_s_during: f64,
    during_vs_without: f64,
    deleted_during_window: i64,
    deleted_per_s_during_window: f64,
    run_state: String,
    run_seconds: f64,
    run_deleted: serde_json::Value,
    run_planned: serde_json::Value,
    run_deliveries_per_s: f64,
    sizes_after: BTreeMap<String, Size>,
    sizes_after_vacuum: BTreeMap<String, Size>,
    load_average_after: String,
}

const TABLES: [&str; 4] = ["deliveries", "attempts", "reminders", "dead_letters"];

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

async fn sizes(pool: &sqlx::PgPool) -> anyhow::Result<BTreeMap<String, Size>> {
    let mut out = BTreeMap::new();
    for table in TABLES {
        let (table_bytes, index_bytes, rows): (i64, i64, i64) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT pg_table_size('{table}'), pg_indexes_size('{table}'),
                        (SELECT count(*) FROM {table})"
            )))
            .fetch_one(pool)
            .await?;
        out.insert(
            table.to_owned(),
            Size {
                table_mib: table_bytes as f64 / 1_048_576.0,
                indexes_mib: index_bytes as f64 / 1_048_576.0,
                rows,
            },
        );
    }
    Ok(out)
}

/// The settled history, in chunks of 100,000, 100 days old.
async fn seed_history(pool: &sqlx::PgPool, tenant: TenantId, n: u32) -> anyhow::Result<()> {
    let chunk = 100_000;
    let mut first = 0;
    while first < n {
        let last = (first + chunk).min(n) - 1;
        sqlx::query(
            "WITH r AS (
                 INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels,
                     scheduled_at, expires_at, created_at)
                 SELECT gen_random_uuid(), $1, 'history-' || i, 'history-' || (i % 1000),
                     ARRAY['sms'], now() - interval '100 days' - (i % 3600) * interval '1 second',
                     now() - interval '100 days' + interval '1 hour', now() - interval '100 days'
                 FROM generate_series($2::int, $3::int) i
                 RETURNING id, scheduled_at, expires_at, event_id),
             d AS (
                 INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state,
                     idempotency_key, attempt_count, generation, scheduled_at, expires_at,
                     settled_at, created_at, updated_at, provider_account, provider_message_id)
                 SELECT gen_random_uuid(), r.id, $1, 'sms',
                     CASE (substr(r.event_id, 9)::int % 10) WHEN 7 THEN 'expired'
                          WHEN 8 THEN 'cancelled' WHEN 9 THEN 'dead_lettered' ELSE 'delivered' END,
                     'nudge-' || r.id || '-sms', 1, 1, r.scheduled_at, r.expires_at,
                     r.scheduled_at + interval '5 seconds', r.scheduled_at, r.scheduled_at,
                     'sms-main', 'msg-' || r.id
                 FROM r
                 RETURNING id, state, scheduled_at)
             INSERT INTO attempts (delivery_id, attempt_number, generation, lane, started_at,
                 finished_at, outcome_class, http_status, next_state, provider_account, worker)
             SELECT d.id, 1, 1, 'new', d.scheduled_at, d.scheduled_at + interval '1 second',
                 CASE d.state WHEN 'delivered' THEN 'delivered' WHEN 'dead_lettered' THEN 'terminal'
                      ELSE 'retryable' END,
                 CASE d.state WHEN 'delivered' THEN 200 WHEN 'dead_lettered' THEN 400 ELSE 429 END,
                 d.state, 'sms-main', 'history'
             FROM d",
        )
        .bind(tenant.as_uuid())
        .bind(i32::try_from(first)?)
        .bind(i32::try_from(last)?)
        .execute(pool)
        .await?;
        first = last + 1;
        eprintln!("bench: history {first}/{n}");
    }
    sqlx::raw_sql("VACUUM ANALYZE deliveries, attempts, reminders")
        .execute(pool)
        .await?;
    Ok(())
}

/// `n` SMS reminders of `tenant` due now, through the ledger's batched import.
async fn due_now(env: &TestEnv, tenant: TenantId, n: usize, tag: &str) -> anyhow::Result<()> {
    let due = Utc::now();
    for start in (0..n).step_by(500) {
        let mut items = Vec::new();
        for i in start..(start + 500).min(n) {
            let event = format!("{tag}-{i}");
            items.push(ImportReminder {
                reminder: NewReminder::new(
                    tenant,
                    EventId::parse(&event)?,
                    SubscriberRef::parse(&format!("sub-{event}"))?,
                    &[Channel::Sms],
                    due,
                    due + chrono::Duration::hours(2),
                )?
                .with_content(br#"{"template":"appointment"}"#.to_vec())?,
                contacts: vec![(Channel::Sms, Destination::new(format!("+1555{i:07}")))],
            });
        }
        env.ledger
            .import_reminders(&items, &env.cipher, Utc::now())
            .await?;
    }
    Ok(())
}

async fn delivered(env: &TestEnv, tenant: TenantId) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM deliveries WHERE tenant_id = $1 AND state = 'delivered'",
    )
    .bind(tenant.as_uuid())
    .fetch_one(env.ledger.pool())
    .await?)
}

/// Delivered per second over `window`, starting once deliveries flow; fails when the backlog
/// ran out before the window ended (the rate would then be the load's, not the pipeline's).
async fn delivery_rate(env: &TestEnv, tenant: TenantId, window: Duration) -> anyhow::Result<f64> {
    let start = delivered(env, tenant).await?;
    let clock = Instant::now();
    tokio::time::sleep(window).await;
    let end = delivered(env, tenant).await?;
    let owed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deliveries WHERE tenant_id = $1
           AND state IN ('scheduled', 'queued', 'sending', 'retry_wait')",
    )
    .bind(tenant.as_uuid())
    .fetch_one(env.ledger.pool())
    .await?;
    anyhow::ensure!(
        owed > 0,
        "the live backlog ran out during the window: load more"
    );
    Ok((end - start) as f64 / clock.elapsed().as_secs_f64())
}

async fn wait_until_flowing(env: &TestEnv, tenant: TenantId) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let base = delivered(env, tenant).await?;
    while delivered(env, tenant).await? < base + 100 {
        anyhow::ensure!(Instant::now() < deadline, "deliveries did not start");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

#[derive(sqlx::FromRow)]
struct RunRow {
    state: String,
    planned: serde_json::Value,
    deleted: serde_json::Value,
    seconds: f64,
}

async fn run_row(env: &TestEnv) -> anyhow::Result<Option<RunRow>> {
    Ok(sqlx::query_as(
        "SELECT state, planned, deleted,
                extract(epoch FROM COALESCE(finished_at, now()) - started_at)::float8 AS seconds
         FROM retention_runs ORDER BY id DESC LIMIT 1",
    )
    .fetch_optional(env.ledger.pool())
    .await?)
}

fn deleted_deliveries(row: &RunRow) -> i64 {
    row.deleted
        .get("deliveries")
        .and_then(serde_json::Value::as_i64)
        .unwrap_or(0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let results = args
        .results
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/results"));
    let load_average_before = load_average();
    let mut env = TestEnv::start("retention-bench").await?;
    let pool = env.ledger.pool().clone();
    let history = env.tenant("history", 60).await?;
    let live = env.tenant("live", 60).await?;

    let clock = Instant::now();
    seed_history(&pool, history, args.deliveries).await?;
    let seed_s = clock.elapsed().as_secs_f64();

    // Partitioning by settled_at, measured on a copy: what a DROP of the old partition costs.
    let clock = Instant::now();
    sqlx::raw_sql(
        "CREATE TABLE bench_partitioned (LIKE deliveries INCLUDING DEFAULTS)
             PARTITION BY RANGE (settled_at);
         CREATE TABLE bench_partitioned_old PARTITION OF bench_partitioned
             FOR VALUES FROM (MINVALUE) TO (now() - interval '30 days');
         CREATE TABLE bench_partitioned_new PARTITION OF bench_partitioned DEFAULT;
         INSERT INTO bench_partitioned SELECT * FROM deliveries;
         CREATE INDEX ON bench_partitioned (state, settled_at);",
    )
    .execute(&pool)
    .await?;
    let partition_copy_s = clock.elapsed().as_secs_f64();
    let clock = Instant::now();
    sqlx::raw_sql("DROP TABLE bench_partitioned_old")
        .execute(&pool)
        .await?;
    let partition_drop_s = clock.elapsed().as_secs_f64();
    sqlx::raw_sql("DROP TABLE bench_partitioned")
        .execute(&pool)
        .await?;

    // The live pipeline: enough due work for both windows and the start-up between them.
    let per_phase = (args.rate * (args.window_s as f64 + 60.0)) as usize;
    due_now(&env, live, per_phase * 2, "live").await?;
    // Before and after both hold the live reminders (owed before, delivered after).
    let sizes_before = sizes(&pool).await?;
    eprintln!("bench: sizes before {sizes_before:?}");
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.rate = Some((args.rate, (args.rate / 10.0).ceil().max(1.0) as u32));
    env.start_worker(Channel::Sms, "worker", &options)?;
    let quiet = env.start_janitor_sections("janitor-quiet", "[retention]\nenabled = false\n")?;
    env.start_with_defaults("nudge-producer", "producer")?;
    wait_until_flowing(&env, live).await?;
    let window = Duration::from_secs(args.window_s);
    let delivered_per_s_without = delivery_rate(&env, live, window).await?;
    eprintln!("bench: without retention {delivered_per_s_without:.1}/s");

    env.proc(quiet).terminate(Duration::from_secs(10));
    env.start_janitor_sections(
        "janitor-retention",
        &format!(
            "[retention]\nenabled = true\nbatch_size = {}\npause_ms = {}\n",
            args.batch_size, args.pause_ms
        ),
    )?;
    // The window starts once the run has counted and recorded itself.
    let deadline = Instant::now() + Duration::from_secs(600);
    while run_row(&env).await?.is_none() {
        anyhow::ensure!(Instant::now() < deadline, "no retention run started");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let deleted_before = run_row(&env).await?.map_or(0, |r| deleted_deliveries(&r));
    let clock = Instant::now();
    let delivered_per_s_during = delivery_rate(&env, live, window).await?;
    let deleted_after = run_row(&env).await?.map_or(0, |r| deleted_deliveries(&r));
    let deleted_during_window = deleted_after - deleted_before;
    let deleted_per_s_during_window = deleted_during_window as f64 / clock.elapsed().as_secs_f64();
    eprintln!(
        "bench: during retention {delivered_per_s_during:.1}/s, deleting {deleted_per_s_during_window:.0}/s"
    );

    let deadline = Instant::now() + Duration::from_secs(args.max_run_s);
    let run = loop {
        let row = run_row(&env).await?.expect("the run row");
        if row.state != "running" || Instant::now() >= deadline {
            break row;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    env.stop_all(Duration::from_secs(15));
    let sizes_after = sizes(&pool).await?;
    sqlx::raw_sql("VACUUM deliveries, attempts, reminders")
        .execute(&pool)
        .await?;
    let sizes_after_vacuum = sizes(&pool).await?;

    let report = Report {
        stamp: Utc::now().format("%Y%m%dT%H%M%SZ").to_string(),
        args: [
            ("deliveries", args.deliveries.to_string()),
            ("rate", args.rate.to_string()),
            ("window_s", args.window_s.to_string()),
            ("batch_size", args.batch_size.to_string()),
            ("pause_ms", args.pause_ms.to_string()),
            ("max_run_s", args.max_run_s.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect(),
        load_average_before,
        seed_s,
        sizes_before,
        partition_copy_s,
        partition_drop_s,
        delivered_per_s_without,
        delivered_per_s_during,
        during_vs_without: delivered_per_s_during / delivered_per_s_without,
        deleted_during_window,
        deleted_per_s_during_window,
        run_state: run.state.clone(),
        run_seconds: run.seconds,
        run_deliveries_per_s: deleted_deliveries(&run) as f64 / run.seconds.max(0.001),
        run_deleted: run.deleted.clone(),
        run_planned: run.planned.clone(),
        sizes_after,
        sizes_after_vacuum,
        load_average_after: load_average(),
    };
    std::fs::create_dir_all(&results)?;
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(
        results.join(format!("retention-{}.json", report.stamp)),
        &json,
    )?;
    let markdown = markdown(&report);
    std::fs::write(results.join("retention-latest.md"), &markdown)?;
    println!("{markdown}");
    Ok(())
}

fn markdown(r: &Report) -> String {
    let mut md = format!(
        "# Retention benchmark ({stamp})\n\n`scripts/bench-retention.sh {args}` (release build; \
         load average before {lb}, after {la})\n\n\
         | measure | value |\n|---|---|\n\
         | settled history seeded | {n} deliveries with one attempt each ({seed:.0} s) |\n\
         | delivered/s without retention | {without:.1} |\n\
         | delivered/s while retention deletes | {during:.1} ({ratio:.1}% of without; target within 10%) |\n\
         | deliveries deleted/s during that window | {window_rate:.0} |\n\
         | retention run | {state} after {secs:.0} s: {run_rate:.0} deliveries/s overall |\n\
         | planned / deleted | {planned} / {deleted} |\n\
         | partitioned copy: DROP of the old partition | {drop:.3} s (copy took {copy:.1} s) |\n\n\
         | table | before (table + indexes MiB, rows) | after | after VACUUM |\n|---|---|---|---|\n",
        stamp = r.stamp,
        args = r
            .args
            .iter()
            .map(|(k, v)| format!("--{} {v}", k.replace('_', "-")))
            .collect::<Vec<_>>()
            .join(" "),
        lb = r.load_average_before,
        la = r.load_average_after,
        n = r.args["deliveries"],
        seed = r.seed_s,
        without = r.delivered_per_s_without,
        during = r.delivered_per_s_during,
        ratio = r.during_vs_without * 100.0,
        window_rate = r.deleted_per_s_during_window,
        state = r.run_state,
        secs = r.run_seconds,
        run_rate = r.run_deliveries_per_s,
        planned = r.run_planned,
        deleted = r.run_deleted,
        drop = r.partition_drop_s,
        copy = r.partition_copy_s,
    );
    for table in TABLES {
        let cell = |s: &BTreeMap<String, Size>| {
            s.get(table).map_or_else(String::new, |x| {
                format!("{:.1} + {:.1}, {}", x.table_mib, x.indexes_mib, x.rows)
            })
        };
        md.push_str(&format!(
            "| {table} | {} | {} | {} |\n",
            cell(&r.sizes_before),
            cell(&r.sizes_after),
            cell(&r.sizes_after_vacuum)
        ));
    }
    md
}
