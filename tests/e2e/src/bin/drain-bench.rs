//! The drain benchmark: a backlog of B eligible SMS deliveries plus N falling due during the
//! drain, through the real producer, janitor and two SMS workers, against the provider stub
//! limited to 40 requests/s. The floor is (B + N) / R. Prints a table and writes the results
//! under bench/results/.
//!
//! `--scale seed` (the default) runs the seed scenario: B = 9,000, N = 3,000, the bucket at the
//! provider's 40/s (floor 300 s); then the same with 2,000 dead letters redriven at 20/s on the
//! same bucket, where the new reminders' scheduled-to-delivered latency is compared with the
//! run without. `--scale small` runs a tenth of it (floor 30 s) in four cases: the bucket at
//! the provider's rate (burst 5 under the provider's 10); at twice the provider's rate, with
//! and without `Retry-After` on the 429s; and at the provider's rate with a burst of 50 against
//! a provider whose own burst is 40, where the first 429s must not cost more than they save.
//!
//!   scripts/bench-drain.sh [--scale seed|small]   (builds the release binaries, runs this)
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, keys_report, percentile, stats};
use serde::Serialize;

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
    redriven: usize,
    redrive_rate: f64,
    /// When the last redriven delivery was accepted, from the drain's start.
    redrive_done_s: Option<f64>,
    /// Scheduled-to-accepted latency of the N reminders that fell due during the drain.
    new_p50_s: f64,
    new_p99_s: f64,
}

/// One scenario: our bucket's rate and burst, the provider's burst and 429 form.
#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    bucket_rate: f64,
    bucket_burst: u32,
    provider_burst: u32,
    retry_after_form: &'static str,
    backlog: usize,
    arrivals: usize,
    /// Dead letters redriven from the drain's start, and the redrive's rate.
    redrive: usize,
    redrive_rate: f64,
}

async fn run_case(case: Case) -> anyhow::Result<CaseResult> {
    let Case {
        name,
        bucket_rate,
        bucket_burst,
        provider_burst,
        retry_after_form,
        backlog,
        arrivals: arrival_count,
        redrive,
        redrive_rate,
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
    let floor_s = (backlog + arrival_count) as f64 / PROVIDER_LIMIT.min(bucket_rate);
    // The lead covers the imports (a few hundred a second, one transaction each) and the processes' start-up, on a
    // busy machine (25 s was too short for 1,200 at a load average of 17 on two cores).
    let lead_s = 60 + (backlog + arrival_count + redrive) as i64 / 200;
    let start_at = Utc::now() + chrono::Duration::seconds(lead_s);
    for i in 0..backlog {
        env.reminder(
            tenant,
            &format!("b-{i}"),
            &[Channel::Sms],
            start_at,
            start_at + chrono::Duration::hours(2),
        )
        .await?;
    }
    let spacing_ms = (floor_s * 1000.0 / arrival_count as f64) as i64;
    let mut arrivals = Vec::with_capacity(arrival_count);
    for i in 0..arrival_count {
        let at = start_at + chrono::Duration::milliseconds(i as i64 * spacing_ms);
        let created = env
            .reminder(
                tenant,
                &format!("n-{i}"),
                &[Channel::Sms],
                at,
                at + chrono::Duration::hours(2),
            )
            .await?;
        arrivals.push((
            nudge_domain::IdempotencyKey::for_delivery(created.id, Channel::Sms)
                .as_str()
                .to_owned(),
            at,
        ));
    }
    // Dead letters from an earlier incident: created due an hour ago and settled
    // dead-lettered before any process starts, so none is sent until the redrive feeds it.
    let mut redriven_keys = std::collections::HashSet::new();
    for i in 0..redrive {
        let at = Utc::now() - chrono::Duration::hours(1);
        let created = env
            .reminder(
                tenant,
                &format!("d-{i}"),
                &[Channel::Sms],
                at,
                start_at + chrono::Duration::hours(2),
            )
            .await?;
        redriven_keys.insert(
            nudge_domain::IdempotencyKey::for_delivery(created.id, Channel::Sms)
                .as_str()
                .to_owned(),
        );
    }
    if redrive > 0 {
        sqlx::query(
            "UPDATE deliveries d SET state = 'dead_lettered', settled_at = now(),
                 next_attempt_at = NULL, attempt_count = 1, last_error_class = 'retryable',
                 last_error_reason = 'attempts_exhausted: http_503'
             FROM reminders r
             WHERE r.id = d.reminder_id AND r.event_id LIKE 'd-%' AND d.state = 'scheduled'",
        )
        .execute(env.ledger.pool())
        .await?;
    }
    env.start_producer("producer")?;
    // A redrive yields to late new work: it pauses while the oldest due new delivery has
    // waited more than 30 s, and goes on by itself once that is under 15 s.
    env.start_janitor_with(1_000, 5_000, 30)?;
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
    if redrive > 0 {
        let rate = redrive_rate.to_string();
        let (code, out, err) = env.nudgectl(&[
            "redrive",
            "--channel",
            "sms",
            "--rate",
            &rate,
            "--execute",
            "--reason",
            "drain benchmark",
            "--incident",
            "BENCH",
        ])?;
        anyhow::ensure!(code == 0, "redrive failed: {out}{err}");
    }

    let total = (backlog + arrival_count + redrive) as i64;
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
    let since_start = |t: DateTime<Utc>| (t - started).num_milliseconds() as f64 / 1000.0;
    // The drain is of the new work (B + N); the redrive's own end is reported beside it.
    let last = keys
        .keys
        .iter()
        .filter(|k| !redriven_keys.contains(&k.key))
        .filter_map(|k| k.accepted_at)
        .max()
        .expect("accepted");
    let drain_s = since_start(last);
    let redrive_done_s = keys
        .keys
        .iter()
        .filter(|k| redriven_keys.contains(&k.key))
        .filter_map(|k| k.accepted_at)
        .max()
        .map(since_start);
    let accepted_at: std::collections::HashMap<&str, DateTime<Utc>> = keys
        .keys
        .iter()
        .filter_map(|k| k.accepted_at.map(|at| (k.key.as_str(), at)))
        .collect();
    let mut latencies: Vec<f64> = arrivals
        .iter()
        .filter_map(|(key, due)| {
            accepted_at
                .get(key.as_str())
                .map(|at| (*at - *due).num_milliseconds() as f64 / 1000.0)
        })
        .collect();
    latencies.sort_by(f64::total_cmp);
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
        backlog,
        arrivals: arrival_count,
        floor_s,
        drain_s,
        over_floor_pct: (drain_s / floor_s - 1.0) * 100.0,
        requests: sms.requests,
        accepted: sms.accepted,
        status_429,
        ratio_429_pct: status_429 as f64 * 100.0 / sms.requests.max(1) as f64,
        max_requests_in_any_second: sms.max_requests_in_any_second,
        redriven: redrive,
        redrive_rate,
        redrive_done_s,
        new_p50_s: percentile(&latencies, 50.0),
        new_p99_s: percentile(&latencies, 99.0),
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scale = match args.as_slice() {
        [] => "seed",
        [flag, value] if flag == "--scale" && (value == "seed" || value == "small") => value,
        _ => anyhow::bail!("usage: drain-bench [--scale seed|small]"),
    };
    let small = |name, bucket_rate, bucket_burst, provider_burst, retry_after_form| Case {
        name,
        bucket_rate,
        bucket_burst,
        provider_burst,
        retry_after_form,
        backlog: 900,
        arrivals: 300,
        redrive: 0,
        redrive_rate: 0.0,
    };
    let seed = |name, redrive, redrive_rate| Case {
        name,
        bucket_rate: 40.0,
        bucket_burst: 5,
        provider_burst: 10,
        retry_after_form: "delta",
        backlog: 9_000,
        arrivals: 3_000,
        redrive,
        redrive_rate,
    };
    // Our burst of 5 under the provider's 10 leaves room for the send path's jitter; the last
    // small case's burst over the provider's makes the provider's bucket, not ours, the first
    // limit.
    let cases = if scale == "small" {
        vec![
            small("bucket = provider limit", 40.0, 5, 10, "delta"),
            small(
                "bucket 2x provider, 429 without Retry-After",
                80.0,
                5,
                10,
                "none",
            ),
            small(
                "bucket 2x provider, 429 with Retry-After",
                80.0,
                5,
                10,
                "delta",
            ),
            small(
                "bucket = provider limit, burst 50 over the provider's 40",
                40.0,
                50,
                40,
                "delta",
            ),
        ]
    } else {
        vec![
            seed("seed: bucket = provider limit", 0, 0.0),
            seed("seed + 2,000 dead letters redriven at 20/s", 2_000, 20.0),
        ]
    };
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
    table.push_str("| case | bucket/s | provider/s | B | N | floor s | drain s | over floor | redriven | redrive done s | requests | 429s | 429 ratio | max req in 1 s | N p50 s | N p99 s |\n");
    table.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in &results {
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {:+.1}% | {} | {} | {} | {} | {:.2}% | {} | {:.1} | {:.1} |\n",
            r.case,
            r.bucket_rate,
            r.provider_limit,
            r.backlog,
            r.arrivals,
            r.floor_s,
            r.drain_s,
            r.over_floor_pct,
            r.redriven,
            r.redrive_done_s
                .map_or_else(|| "-".to_owned(), |s| format!("{s:.1}")),
            r.requests,
            r.status_429,
            r.ratio_429_pct,
            r.max_requests_in_any_second,
            r.new_p50_s,
            r.new_p99_s,
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
        dir.join(format!("drain-{scale}-{stamp}.json")),
        serde_json::to_string_pretty(
            &serde_json::json!({"at": Utc::now(), "cpu": host, "cores": cores, "results": results}),
        )?,
    )?;
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    std::fs::write(
        dir.join(format!("drain-{scale}-latest.md")),
        format!(
            "# Drain benchmark\n\nRun {stamp} on {cores} cores ({host}), {profile} build, `--scale {scale}`, one run per case.\n\
             Produced by `scripts/bench-drain.sh`; the JSON next to this file has the same figures.\n\n{table}"
        ),
    )?;
    Ok(())
}
