//! The intake benchmark: signed single-reminder posts to the real `nudge-intake` (release
//! build) from 50 concurrent clients on this machine, PostgreSQL beside it. Each post is a new
//! reminder for one SMS, scheduled an hour ahead (the usual case: recorded with its encrypted
//! contact, materialised later by the producer's window). Reports accepted posts per second
//! and the latency of each post as the client saw it (p50, p99, max), then writes
//! bench/results/intake-*.json and bench/results/intake-latest.md.
//!
//!   scripts/bench-intake.sh [--posts N] [--clients C]   (builds the release binaries)
//!
//! The clients share the two cores with the intake and the database, so the figures are
//! those of the whole machine under this load, not of the intake alone.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use nudge_e2e::{TestEnv, intake_signature, percentile};
use serde::Serialize;

/// The longest the timed run may take, whatever `--posts` asks.
const MAX_RUN: Duration = Duration::from_secs(300);

#[derive(Debug, Serialize)]
struct Result {
    clients: usize,
    posts: usize,
    accepted: usize,
    other_status: usize,
    errors: usize,
    elapsed_s: f64,
    accepted_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

fn arg(args: &[String], name: &str, default: usize) -> anyhow::Result<usize> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => Ok(args
            .get(i + 1)
            .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))?
            .parse()?),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let posts = arg(&args, "--posts", 20_000)?;
    let clients = arg(&args, "--clients", 50)?;
    anyhow::ensure!(
        posts > 0 && clients > 0,
        "--posts and --clients must be above 0"
    );

    let mut env = TestEnv::start("intake-bench").await?;
    env.tenant("bench", 60).await?;
    let secret = env.rotate_secret("bench")?;
    let (_, url) = env.start_intake("intake").await?;
    let endpoint = format!("{url}/v1/tenants/bench/reminders");
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(clients)
        .build()?;
    let scheduled = Utc::now() + chrono::Duration::hours(1);
    let body = move |i: usize| {
        serde_json::to_vec(&serde_json::json!({
            "event_id": format!("bench-{i}"),
            "subscriber_ref": format!("patient-{}", i % 5_000),
            "channels": ["sms"],
            "scheduled_at": scheduled.to_rfc3339(),
            "expires_at": (scheduled + chrono::Duration::hours(1)).to_rfc3339(),
            "destinations": {"sms": format!("+1555{:07}", i % 5_000)},
            "content": {"template": "appointment"}
        }))
        .unwrap()
    };
    // Warm the connections and the intake's pool.
    for i in 0..clients {
        let b = body(posts + i);
        let signature = intake_signature(&reqwest::Method::POST, &endpoint, &secret, &b);
        let answer = http
            .post(&endpoint)
            .header("content-type", "application/json")
            .header("nudge-signature", signature)
            .body(b)
            .send()
            .await?;
        anyhow::ensure!(
            answer.status().as_u16() == 202,
            "warm-up post answered {}",
            answer.status()
        );
    }

    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(clients);
    for _ in 0..clients {
        let (http, endpoint, secret, next) =
            (http.clone(), endpoint.clone(), secret.clone(), next.clone());
        let bodies = body;
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let (mut other, mut errors) = (0usize, 0usize);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= posts || started.elapsed() > MAX_RUN {
                    break;
                }
                let b = bodies(i);
                let signature = intake_signature(&reqwest::Method::POST, &endpoint, &secret, &b);
                let sent = Instant::now();
                let answer = http
                    .post(&endpoint)
                    .header("content-type", "application/json")
                    .header("nudge-signature", signature)
                    .body(b)
                    .send()
                    .await;
                let took = sent.elapsed().as_secs_f64() * 1000.0;
                match answer {
                    Ok(a) if a.status().as_u16() == 202 => seen.push(took),
                    Ok(_) => other += 1,
                    Err(_) => errors += 1,
                }
            }
            (seen, other, errors)
        }));
    }
    let mut latencies = Vec::with_capacity(posts);
    let (mut other, mut errors) = (0, 0);
    for task in tasks {
        let (seen, o, e) = task.await?;
        latencies.extend(seen);
        other += o;
        errors += e;
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM reminders")
        .fetch_one(env.ledger.pool())
        .await?;
    let result = Result {
        clients,
        posts,
        accepted: latencies.len(),
        other_status: other,
        errors,
        elapsed_s: elapsed,
        accepted_per_s: latencies.len() as f64 / elapsed,
        p50_ms: percentile(&latencies, 50.0),
        p99_ms: percentile(&latencies, 99.0),
        max_ms: latencies.last().copied().unwrap_or(f64::NAN),
    };
    env.stop_all(Duration::from_secs(10));
    anyhow::ensure!(
        stored as usize == result.accepted + clients,
        "{stored} reminders stored for {} accepted posts (+{clients} warm-up)",
        result.accepted
    );

    let table = format!(
        "| clients | posts | accepted | other status | errors | seconds | accepted/s | p50 ms | p99 ms | max ms |\n\
         |---|---|---|---|---|---|---|---|---|---|\n\
         | {} | {} | {} | {} | {} | {:.1} | {:.0} | {:.1} | {:.1} | {:.1} |\n",
        result.clients,
        result.posts,
        result.accepted,
        result.other_status,
        result.errors,
        result.elapsed_s,
        result.accepted_per_s,
        result.p50_ms,
        result.p99_ms,
        result.max_ms
    );
    println!("{table}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/results");
    std::fs::create_dir_all(&dir)?;
    let stamp = Utc::now().format("%Y%m%dT%H%M%SZ");
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    std::fs::write(
        dir.join(format!("intake-{stamp}.json")),
        serde_json::to_string_pretty(&serde_json::json!({
            "at": Utc::now(), "cores": cores, "profile": profile,
            "loadavg_after": load.trim(), "result": result,
        }))?,
    )?;
    std::fs::write(
        dir.join("intake-latest.md"),
        format!(
            "# Intake benchmark\n\nRun {stamp} on {cores} cores, {profile} build; load average \
             after the run: {}. Produced by `scripts/bench-intake.sh`: signed single-reminder \
             posts from concurrent clients on the same machine, PostgreSQL beside them; every \
             accepted post was checked to be stored.\n\n{table}",
            load.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        ),
    )?;
    Ok(())
}
