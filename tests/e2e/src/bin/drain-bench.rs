//! The drain benchmark: a backlog of B eligible SMS deliveries plus N falling due during the
//! drain, through the real producer, janitor and two SMS workers, against the provider stub
//! limited to 40 requests/s. The floor is (B + N) / R. Prints a table and writes the results
//! under bench/results/.
//!
//! `--scale seed` (the default) runs the seed scenario: B = 9,000, N = 3,000, the bucket at the
//! provider's 40/s (floor 300 s); then the same with 2,000 dead letters redriven at 20/s on the
//! same bucket, where the new reminders' scheduled-to-delivered latency is compared with the
//! run without. `--scale small` runs a tenth of it (floor 30 s) in five cases: the bucket at
//! the provider's rate (burst 5 under the provider's 10); at twice the provider's rate, with
//! and without `Retry-After` on the 429s; at the provider's rate with a burst of 50 against
//! a provider whose own burst is 40, where the first 429s must not cost more than they save;
//! and at the provider's rate with the provider's own burst of 40 (issue 24: one 429 at the
//! limit costs at most 2% of the drain, in every run).
//!
//! `--runs N` (default 1) runs every case N times, the cases interleaved so that a busy moment
//! of the machine does not fall on one case alone. The table gives each case's median run in
//! the columns of one run, and beside them the worst run's drain, drain over floor and 429s,
//! and whether the worst run is within the case's target: at most 2% over the floor for the
//! cases at the provider's rate (issue 24), a 429 ratio under 1% for the cases at twice it
//! (decision 0111); the seed cases have none. The JSON keeps every run under `results` (each
//! with its `run`) and the medians and worst runs under `summaries`; `--results DIR` writes
//! them elsewhere than `bench/results/`.
//!
//!   scripts/bench-drain.sh [--scale seed|small] [--runs N] [--results DIR] [--case TEXT]
//!   (builds the release binaries, runs this)
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use clap::{Parser, ValueEnum};
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, keys_report, percentile, stats};
use serde::Serialize;

const PROVIDER_LIMIT: f64 = 40.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scale {
    /// The seed scenario: B = 9,000, N = 3,000, with and without a redrive.
    Seed,
    /// A tenth of it, in five cases of bucket, burst and 429 form.
    Small,
    /// The small cases at a tenth of their size: a smoke test of the benchmark itself, whose
    /// figures say nothing.
    #[value(hide = true)]
    Quick,
}

#[derive(Debug, Parser)]
#[command(about = "Measures a rate-limited drain against its floor")]
struct Args {
    #[arg(long, value_enum, default_value_t = Scale::Seed)]
    scale: Scale,
    /// Runs of each case (interleaved); the table gives the median and the worst run.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Where the results go (default: the repository's bench/results).
    #[arg(long, value_name = "DIR")]
    results: Option<std::path::PathBuf>,
    /// Runs only the cases whose name contains this text (for a closer look at one case; the
    /// latest table then holds only those).
    #[arg(long, value_name = "TEXT")]
    case: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
struct CaseResult {
    case: String,
    /// Which run of the case this was (1-based).
    run: usize,
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
    /// The case's target for every run: at most this far over the floor (%)...
    max_over_floor_pct: Option<f64>,
    /// ...and a 429 ratio at most this (%).
    max_429_ratio_pct: Option<f64>,
}

async fn run_case(case: Case, run: usize) -> anyhow::Result<CaseResult> {
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
        ..
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
    // busy machine (25 s was too short for 1,200 at a load average of 17 on two cores); the
    // smoke test's hundred or so take 20 s.
    let created = backlog + arrival_count + redrive;
    let lead_s = if created < 1_000 { 20 } else { 60 } + created as i64 / 200;
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
        "{name} (run {run}): drained in {:.1} s (wall)",
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
        run,
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

/// One case over its runs: the median of each column, the worst run's drain, drain over floor
/// and 429s, and the runs within the case's target.
#[derive(Debug, Clone, Serialize)]
struct Summary {
    case: String,
    runs: usize,
    bucket_rate: f64,
    bucket_burst: u32,
    provider_limit: f64,
    provider_burst: u32,
    backlog: usize,
    arrivals: usize,
    floor_s: f64,
    drain_s_median: f64,
    drain_s_worst: f64,
    over_floor_pct_median: f64,
    over_floor_pct_worst: f64,
    redriven: usize,
    redrive_done_s_median: Option<f64>,
    requests_median: f64,
    status_429_median: f64,
    status_429_worst: u64,
    ratio_429_pct_median: f64,
    ratio_429_pct_worst: f64,
    max_requests_in_any_second_median: f64,
    new_p50_s_median: f64,
    new_p99_s_median: f64,
    max_over_floor_pct: Option<f64>,
    max_429_ratio_pct: Option<f64>,
    /// Runs within the target; None for a case without one.
    runs_within_target: Option<usize>,
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut sorted: Vec<f64> = values.collect();
    sorted.sort_by(f64::total_cmp);
    percentile(&sorted, 50.0)
}

fn worst(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(f64::NEG_INFINITY, f64::max)
}

fn within_target(case: &Case, r: &CaseResult) -> bool {
    case.max_over_floor_pct
        .is_none_or(|max| r.over_floor_pct <= max)
        && case
            .max_429_ratio_pct
            .is_none_or(|max| r.ratio_429_pct <= max)
}

fn summarise(case: &Case, runs: &[&CaseResult]) -> Summary {
    let first = runs[0];
    let redrive_done: Vec<f64> = runs.iter().filter_map(|r| r.redrive_done_s).collect();
    Summary {
        case: case.name.to_owned(),
        runs: runs.len(),
        bucket_rate: first.bucket_rate,
        bucket_burst: first.bucket_burst,
        provider_limit: first.provider_limit,
        provider_burst: first.provider_burst,
        backlog: first.backlog,
        arrivals: first.arrivals,
        floor_s: first.floor_s,
        drain_s_median: median(runs.iter().map(|r| r.drain_s)),
        drain_s_worst: worst(runs.iter().map(|r| r.drain_s)),
        over_floor_pct_median: median(runs.iter().map(|r| r.over_floor_pct)),
        over_floor_pct_worst: worst(runs.iter().map(|r| r.over_floor_pct)),
        redriven: first.redriven,
        redrive_done_s_median: (!redrive_done.is_empty())
            .then(|| median(redrive_done.iter().copied())),
        requests_median: median(runs.iter().map(|r| r.requests as f64)),
        status_429_median: median(runs.iter().map(|r| r.status_429 as f64)),
        status_429_worst: runs.iter().map(|r| r.status_429).max().unwrap_or(0),
        ratio_429_pct_median: median(runs.iter().map(|r| r.ratio_429_pct)),
        ratio_429_pct_worst: worst(runs.iter().map(|r| r.ratio_429_pct)),
        max_requests_in_any_second_median: median(
            runs.iter().map(|r| r.max_requests_in_any_second as f64),
        ),
        new_p50_s_median: median(runs.iter().map(|r| r.new_p50_s)),
        new_p99_s_median: median(runs.iter().map(|r| r.new_p99_s)),
        max_over_floor_pct: case.max_over_floor_pct,
        max_429_ratio_pct: case.max_429_ratio_pct,
        runs_within_target: (case.max_over_floor_pct.is_some() || case.max_429_ratio_pct.is_some())
            .then(|| runs.iter().filter(|r| within_target(case, r)).count()),
    }
}

fn target_text(s: &Summary) -> String {
    let mut parts = Vec::new();
    if let Some(max) = s.max_over_floor_pct {
        parts.push(format!("over floor <= {max}%"));
    }
    if let Some(max) = s.max_429_ratio_pct {
        parts.push(format!("429 ratio <= {max}%"));
    }
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(", ")
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    let scale = match args.scale {
        Scale::Seed => "seed",
        Scale::Small => "small",
        Scale::Quick => "quick",
    };
    let tenth = if args.scale == Scale::Quick { 10 } else { 1 };
    // Issue 24: one 429 at the provider's limit costs at most 2% of a drain, in every run;
    // decision 0111: configured above the limit, the bucket converges with under 1% 429s.
    let at_limit = Some(2.0);
    let above_limit = Some(1.0);
    let small = |name, bucket_rate, bucket_burst, provider_burst, retry_after_form| Case {
        name,
        bucket_rate,
        bucket_burst,
        provider_burst,
        retry_after_form,
        backlog: 900 / tenth,
        arrivals: 300 / tenth,
        redrive: 0,
        redrive_rate: 0.0,
        max_over_floor_pct: if bucket_rate <= PROVIDER_LIMIT {
            at_limit
        } else {
            None
        },
        max_429_ratio_pct: if bucket_rate > PROVIDER_LIMIT {
            above_limit
        } else {
            None
        },
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
        max_over_floor_pct: None,
        max_429_ratio_pct: None,
    };
    // Our burst of 5 under the provider's 10 leaves room for the send path's jitter; the
    // fourth small case's burst over the provider's makes the provider's bucket, not ours, the
    // first limit; the fifth's equals the provider's (issue 24's point 5).
    let cases = if args.scale != Scale::Seed {
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
            small(
                "bucket = provider limit, burst 40 = the provider's",
                40.0,
                40,
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
    let cases: Vec<Case> = cases
        .into_iter()
        .filter(|c| {
            args.case
                .as_deref()
                .is_none_or(|text| c.name.contains(text))
        })
        .collect();
    anyhow::ensure!(!cases.is_empty(), "no case's name contains {:?}", args.case);
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // On a signal the running case's future is dropped, and with it its environment, which
    // stops its processes and drops its database and broker namespace.
    let run_all = async {
        let mut results = Vec::new();
        for run in 1..=args.runs {
            for case in &cases {
                results.push(run_case(*case, run).await?);
            }
        }
        anyhow::Ok(results)
    };
    let results = tokio::select! {
        results = run_all => results?,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; the current case was cleaned up"),
        _ = terminate.recv() => anyhow::bail!("terminated; the current case was cleaned up"),
    };
    let summaries: Vec<Summary> = cases
        .iter()
        .map(|case| {
            let runs: Vec<&CaseResult> = results.iter().filter(|r| r.case == case.name).collect();
            summarise(case, &runs)
        })
        .collect();

    // One row per case: the median run in the columns of one run, then the worst run.
    let mut table = String::new();
    table.push_str("| case | bucket/s | provider/s | B | N | floor s | drain s | over floor | redriven | redrive done s | requests | 429s | 429 ratio | max req in 1 s | N p50 s | N p99 s | runs | drain s worst | over floor worst | 429s worst | 429 ratio worst | target (every run) | runs within target |\n");
    table.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for s in &summaries {
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {:+.1}% | {} | {} | {} | {} | {:.2}% | {} | {:.1} | {:.1} | {} | {:.1} | {:+.1}% | {} | {:.2}% | {} | {} |\n",
            s.case,
            s.bucket_rate,
            s.provider_limit,
            s.backlog,
            s.arrivals,
            s.floor_s,
            s.drain_s_median,
            s.over_floor_pct_median,
            s.redriven,
            s.redrive_done_s_median
                .map_or_else(|| "-".to_owned(), |v| format!("{v:.1}")),
            s.requests_median,
            s.status_429_median,
            s.ratio_429_pct_median,
            s.max_requests_in_any_second_median,
            s.new_p50_s_median,
            s.new_p99_s_median,
            s.runs,
            s.drain_s_worst,
            s.over_floor_pct_worst,
            s.status_429_worst,
            s.ratio_429_pct_worst,
            target_text(s),
            s.runs_within_target
                .map_or_else(|| "-".to_owned(), |n| format!("{n} of {}", s.runs)),
        ));
    }
    // With more than one run, every run in the columns of one.
    let mut every = String::new();
    if args.runs > 1 {
        every.push_str("| case | run | floor s | drain s | over floor | redrive done s | requests | 429s | 429 ratio | max req in 1 s | N p50 s | N p99 s |\n");
        every.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for r in &results {
            every.push_str(&format!(
                "| {} | {} | {:.1} | {:.1} | {:+.1}% | {} | {} | {} | {:.2}% | {} | {:.1} | {:.1} |\n",
                r.case,
                r.run,
                r.floor_s,
                r.drain_s,
                r.over_floor_pct,
                r.redrive_done_s
                    .map_or_else(|| "-".to_owned(), |v| format!("{v:.1}")),
                r.requests,
                r.status_429,
                r.ratio_429_pct,
                r.max_requests_in_any_second,
                r.new_p50_s,
                r.new_p99_s,
            ));
        }
    }
    println!("{table}\n{every}");

    let dir = args.results.clone().unwrap_or_else(|| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/results")
    });
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
        serde_json::to_string_pretty(&serde_json::json!({
            "at": Utc::now(),
            "cpu": host,
            "cores": cores,
            "build": nudge_e2e::build_profile(),
            "runs": args.runs,
            "results": results,
            "summaries": summaries,
        }))?,
    )?;
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let runs_text = if args.runs == 1 {
        "one run per case".to_owned()
    } else {
        format!(
            "{} runs per case (interleaved); each case's row gives the median of each column, \
             then the worst run's figures, and every run follows",
            args.runs
        )
    };
    std::fs::write(
        dir.join(format!("drain-{scale}-latest.md")),
        format!(
            "# Drain benchmark\n\nRun {stamp} on {cores} cores ({host}), {profile} build, `--scale {scale}`, {runs_text}.\n\
             Produced by `scripts/bench-drain.sh`; the JSON next to this file has the same figures. \
             Targets, for every run: at the provider's rate at most 2% over the floor (issue 24), \
             at twice it a 429 ratio of at most 1% (decision 0111).\n\n{table}{every_section}",
            every_section = if every.is_empty() {
                String::new()
            } else {
                format!("\n## Every run\n\n{every}")
            },
        ),
    )?;
    Ok(())
}
