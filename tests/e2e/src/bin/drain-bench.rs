//! The drain benchmark: the seed scenario scaled to one machine. A backlog of B = 900 eligible
//! SMS deliveries plus N = 300 falling due during the drain, through the real producer, janitor
//! and two SMS workers, against the provider stub limited to 40 requests/s. The floor is
//! (B + N) / R = 30 s. Prints a table and writes the results under bench/results/.
//!
//! Cases: the bucket at the provider's rate (burst 5 under the provider's 10); the bucket at
//! twice the provider's rate, with and without `Retry-After` on the 429s; and the bucket at
//! the provider's rate with a burst of 50 against a provider whose own burst is 40, where the
//! first 429s must not cost more than they save.
//!
//!   scripts/bench-drain.sh            (builds the binaries, then runs this)
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, keys_report, stats};
use serde::Serialize;

const BACKLOG: usize = 900;
const ARRIVALS: usize = 300;
const PROVIDER_LIMIT: f64 = 40.0;

#[derive(Debug, Clone, Serialize)]
struct CaseResult {
    case: String,
    bucket_rate: f64,
    bucket_burst: u32,
    provider_limit: f64,
    provider_burst: u32,
    provider_429_form: String,
    backlog: usize,
    arrivals: usize,
    floor_s: f64,
    drain_s: f64,
    over_floor_pct: f64,
    requests: u64,
    accepted: u64,
    status_429: u64,
    ratio_429_pct: f64,
    max_requests_in_any_second: u64,
}

/// One scenario: our bucket's rate and burst, the provider's burst and 429 form.
#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    bucket_rate: f64,
    bucket_burst: u32,
    provider_burst: u32,
    retry_after_form: &'static str,
}

async fn run_case(case: Case) -> anyhow::Result<CaseResult> {
    let Case {
        name,
        bucket_rate,
        bucket_burst,
        provider_burst,
        retry_after_form,
    } = case;
    let mut env = TestEnv::start("drain-bench").await?;
    let tenant = env.tenant("bench-clinic", 2).await?;
    env.script(
        "sms-main",
        serde_json::json!({"rate_limit": {"per_second": PROVIDER_LIMIT as u32, "burst": provider_burst, "retry_after": retry_after_form}}),
    )
    .await?;
    // Everything is created first, due from `start_at` on; the processes start meanwhile and are
    // warm when the backlog falls due, as a real drain's running workers would be. The backlog
    // falls due at `start_at`; the arrivals at a steady pace over the next floor.
    let floor_s = (BACKLOG + ARRIVALS) as f64 / PROVIDER_LIMIT.min(bucket_rate);
    // The lead covers the 1,200 imports and the processes' start-up, also in a debug build on
    // a busy machine (25 s was too short at a load average of 17 on two cores).
    let start_at = Utc::now() + chrono::Duration::seconds(60);
    for i in 0..BACKLOG {
        env.reminder(
            tenant,
            &format!("b-{i}"),
            &[Channel::Sms],
            start_at,
            start_at + chrono::Duration::hours(2),
        )
        .await?;
    }
    let spacing_ms = (floor_s * 1000.0 / ARRIVALS as f64) as i64;
    for i in 0..ARRIVALS {
        let at = start_at + chrono::Duration::milliseconds(i as i64 * spacing_ms);
        env.reminder(
            tenant,
            &format!("n-{i}"),
            &[Channel::Sms],
            at,
            at + chrono::Duration::hours(2),
        )
        .await?;
    }
    env.start_producer("producer")?;
    env.start_janitor(1_000, 5_000)?;
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.rate = Some((bucket_rate, bucket_burst));
    options.prefetch = 64;
    options.retry_base_ms = 1_000;
    options.retry_max_ms = 5_000;
    env.start_worker(Channel::Sms, "worker-a", &options)?;
    env.start_worker(Channel::Sms, "worker-b", &options)?;
    anyhow::ensure!(
        Utc::now() < start_at,
        "setup took longer than the lead time"
    );
    while Utc::now() < start_at {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started: DateTime<Utc> = start_at;

    let total = (BACKLOG + ARRIVALS) as i64;
    let ledger = env.ledger.clone();
    let clock = Instant::now();
    env.wait_for(
        "the drain",
        Duration::from_secs((floor_s * 4.0) as u64 + 60),
        || {
            let ledger = ledger.clone();
            async move {
                let done: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state = 'delivered'")
                        .fetch_one(ledger.pool())
                        .await?;
                Ok((done == total).then_some(()))
            }
        },
    )
    .await;
    eprintln!(
        "{name}: drained in {:.1} s (wall)",
        clock.elapsed().as_secs_f64()
    );

    let keys = keys_report(env.stub_keys().await?)?;
    let last = keys
        .keys
        .iter()
        .filter_map(|k| k.accepted_at)
        .max()
        .expect("accepted");
    let drain_s = (last - started).num_milliseconds() as f64 / 1000.0;
    let stub = stats(env.stub_stats().await?)?;
    let sms = &stub.accounts["sms-main"];
    let status_429 = sms.by_status.get(&429).copied().unwrap_or(0);
    env.stop_all(Duration::from_secs(15));
    Ok(CaseResult {
        case: name.to_owned(),
        bucket_rate,
        bucket_burst,
        provider_limit: PROVIDER_LIMIT,
        provider_burst,
        provider_429_form: retry_after_form.to_owned(),
        backlog: BACKLOG,
        arrivals: ARRIVALS,
        floor_s,
        drain_s,
        over_floor_pct: (drain_s / floor_s - 1.0) * 100.0,
        requests: sms.requests,
        accepted: sms.accepted,
        status_429,
        ratio_429_pct: status_429 as f64 * 100.0 / sms.requests.max(1) as f64,
        max_requests_in_any_second: sms.max_requests_in_any_second,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    // Our burst of 5 under the provider's 10 leaves room for the send path's jitter; the last
    // case's burst over the provider's makes the provider's bucket, not ours, the first limit.
    let cases = [
        Case {
            name: "bucket = provider limit",
            bucket_rate: 40.0,
            bucket_burst: 5,
            provider_burst: 10,
            retry_after_form: "delta",
        },
        Case {
            name: "bucket 2x provider, 429 without Retry-After",
            bucket_rate: 80.0,
            bucket_burst: 5,
            provider_burst: 10,
            retry_after_form: "none",
        },
        Case {
            name: "bucket 2x provider, 429 with Retry-After",
            bucket_rate: 80.0,
            bucket_burst: 5,
            provider_burst: 10,
            retry_after_form: "delta",
        },
        Case {
            name: "bucket = provider limit, burst 50 over the provider's 40",
            bucket_rate: 40.0,
            bucket_burst: 50,
            provider_burst: 40,
            retry_after_form: "delta",
        },
    ];
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // On a signal the running case's future is dropped, and with it its environment, which
    // stops its processes and drops its database and broker namespace.
    let run_all = async {
        let mut results = Vec::new();
        for case in cases {
            results.push(run_case(case).await?);
        }
        anyhow::Ok(results)
    };
    let results = tokio::select! {
        results = run_all => results?,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; the current case was cleaned up"),
        _ = terminate.recv() => anyhow::bail!("terminated; the current case was cleaned up"),
    };

    let mut table = String::new();
    table.push_str("| case | bucket/s | provider/s | B | N | floor s | drain s | over floor | requests | 429s | 429 ratio | max req in 1 s |\n");
    table.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in &results {
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {:+.1}% | {} | {} | {:.2}% | {} |\n",
            r.case,
            r.bucket_rate,
            r.provider_limit,
            r.backlog,
            r.arrivals,
            r.floor_s,
            r.drain_s,
            r.over_floor_pct,
            r.requests,
            r.status_429,
            r.ratio_429_pct,
            r.max_requests_in_any_second
        ));
    }
    println!("{table}");

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/results");
    std::fs::create_dir_all(&dir)?;
    let stamp = Utc::now().format("%Y%m%dT%H%M%SZ");
    let host = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    std::fs::write(
        dir.join(format!("drain-{stamp}.json")),
        serde_json::to_string_pretty(
            &serde_json::json!({"at": Utc::now(), "cpu": host, "cores": cores, "results": results}),
        )?,
    )?;
    std::fs::write(
        dir.join("drain-latest.md"),
        format!(
            "# Drain benchmark\n\nRun {stamp} on {cores} cores ({host}), debug build, one run per case.\n\
             Produced by `scripts/bench-drain.sh`; the JSON next to this file has the same figures.\n\n{table}"
        ),
    )?;
    Ok(())
}
