//! The fairness benchmark (issue 24): several tenants' SMS on one provider account, through the
//! real producer, janitor and two SMS workers (as `tests/e2e/tests/alone/fair_claiming.rs`
//! runs them) against the provider stub's token bucket. A tenant's lateness is the provider's
//! accept time minus the reminder's scheduled time (the stub's `/stats/keys` against the
//! ledger's reminders).
//!
//! - `two`: tenant `big` with 9,000 SMS due at once and tenant `small` with 20 due 15 s later,
//!   one account at 40/s (our bucket 40/s burst 5, the stub's 40/s burst 10, as the drain
//!   benchmark's "bucket = provider limit" case). Small's lateness p50/p99/max (target: p99 at
//!   most 2 s), big's drain against its floor of 9,000 / 40 = 225 s (target: within 3%), 429s
//!   (target: none) and requests.
//! - `hundred`: 100 tenants with 100 SMS each, all due at once, one account at 200/s (our bucket
//!   200/s burst 25, the stub's 200/s burst 50: the same eighth and quarter of a second of the
//!   rate as in `two`). Each tenant's last delivery (min, median and max across tenants, and the
//!   spread max/min - 1: target at most 10%), each tenant's p99 lateness (mean across tenants,
//!   max, and max/mean: target at most 1.2), the drain against its floor (10,000 / 200 = 50 s)
//!   and 429s.
//!
//! `--scale small` runs a tenth (900 + 20; 10 tenants x 100) for a quick check. Each case runs
//! `--runs` times (default 3), the cases interleaved, each run on a fresh database, broker
//! namespace and stub; the table gives each figure's median and worst run beside its target.
//! Writes `fairness-<scale>-<UTC stamp>.json` (every run, with each tenant's figures) and
//! `fairness-<scale>-latest.md` under `--results` (default `bench/results/`).
//!
//!   scripts/bench-fairness.sh [--case two|hundred|all] [--scale full|small] [--runs N] [--results DIR]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::{Parser, ValueEnum};
use nudge_domain::{Channel, EventId, SubscriberRef, TenantId};
use nudge_e2e::{TestEnv, WorkerOptions, keys_report, percentile, stats};
use nudge_ledger::{Destination, ImportReminder, NewReminder};
use serde::Serialize;

/// The one provider account every tenant's SMS goes through.
const ACCOUNT: &str = "sms-main";
/// Reminders per import transaction while seeding, and import transactions at once (the
/// harness's ledger pool has 8 connections).
const SEED_BATCH: usize = 500;
const SEED_STREAMS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    Two,
    Hundred,
    All,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Scale {
    /// Issue 24's sizes: 9,000 + 20; 100 tenants x 100.
    Full,
    /// A tenth: 900 + 20; 10 tenants x 100.
    Small,
    /// A smoke test of the benchmark itself (90 + 5; 5 tenants x 40): its figures say nothing.
    #[value(hide = true)]
    Quick,
}

impl Scale {
    fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Small => "small",
            Self::Quick => "quick",
        }
    }
}

#[derive(Debug, Parser)]
#[command(about = "Measures fairness across tenants on one shared provider account (issue 24)")]
struct Args {
    /// Which case to run.
    #[arg(long, value_enum, default_value_t = Which::All)]
    case: Which,
    /// full: issue 24's sizes; small: a tenth of them.
    #[arg(long, value_enum, default_value_t = Scale::Full)]
    scale: Scale,
    /// Runs of each case (interleaved); the table gives the median and the worst.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Where the results go (default: the repository's bench/results).
    #[arg(long, value_name = "DIR")]
    results: Option<PathBuf>,
}

/// The two-tenant case's shape.
#[derive(Debug, Clone, Copy, Serialize)]
struct TwoShape {
    big: usize,
    small: usize,
    /// Small's reminders fall due this long after big's.
    small_after_s: i64,
    rate: f64,
    bucket_burst: u32,
    provider_burst: u32,
}

/// The hundred-tenant case's shape.
#[derive(Debug, Clone, Copy, Serialize)]
struct HundredShape {
    tenants: usize,
    each: usize,
    rate: f64,
    bucket_burst: u32,
    provider_burst: u32,
}

fn two_shape(scale: Scale) -> TwoShape {
    let (big, small, small_after_s) = match scale {
        Scale::Full => (9_000, 20, 15),
        Scale::Small => (900, 20, 15),
        Scale::Quick => (90, 5, 1),
    };
    TwoShape {
        big,
        small,
        small_after_s,
        rate: 40.0,
        bucket_burst: 5,
        provider_burst: 10,
    }
}

fn hundred_shape(scale: Scale) -> HundredShape {
    let (tenants, each) = match scale {
        Scale::Full => (100, 100),
        Scale::Small => (10, 100),
        Scale::Quick => (5, 40),
    };
    HundredShape {
        tenants,
        each,
        rate: 200.0,
        bucket_burst: 25,
        provider_burst: 50,
    }
}

/// One run of the two-tenant case.
#[derive(Debug, Clone, Default, Serialize)]
struct TwoRun {
    run: usize,
    /// Why the run failed (setup, or not every delivery settled delivered in time).
    failure: Option<String>,
    /// Small's deliveries accepted by the provider (of `small`).
    small_accepted: usize,
    small_late_p50_s: f64,
    small_late_p99_s: f64,
    small_late_max_s: f64,
    /// From the batch's due time to big's last accept.
    big_drain_s: f64,
    /// big / rate.
    big_floor_s: f64,
    big_over_floor_pct: f64,
    requests: u64,
    accepted: u64,
    status_429: u64,
    max_requests_in_any_second: u64,
}

/// One tenant's figures in one run of the hundred-tenant case.
#[derive(Debug, Clone, Serialize)]
struct TenantFigures {
    tenant: String,
    accepted: usize,
    /// Its last accept, from the common due time.
    last_s: f64,
    late_p50_s: f64,
    late_p99_s: f64,
}

/// One run of the hundred-tenant case.
#[derive(Debug, Clone, Default, Serialize)]
struct HundredRun {
    run: usize,
    failure: Option<String>,
    last_min_s: f64,
    last_median_s: f64,
    last_max_s: f64,
    /// max / min - 1 of the tenants' last deliveries, in %.
    last_spread_pct: f64,
    /// Mean, across tenants, of each tenant's p99 lateness.
    p99_mean_s: f64,
    p99_max_s: f64,
    p99_max_over_mean: f64,
    /// From the due time to the last accept of any tenant.
    drain_s: f64,
    /// tenants x each / rate.
    floor_s: f64,
    over_floor_pct: f64,
    requests: u64,
    accepted: u64,
    status_429: u64,
    max_requests_in_any_second: u64,
    tenants: Vec<TenantFigures>,
}

/// One delivery as it ended: its tenant, its reminder's scheduled time, and when the provider
/// first accepted its key.
struct Outcome {
    tenant: uuid::Uuid,
    scheduled_at: DateTime<Utc>,
    accepted_at: Option<DateTime<Utc>>,
}

/// The provider's counters for the account.
struct Counters {
    requests: u64,
    accepted: u64,
    status_429: u64,
    max_requests_in_any_second: u64,
}

fn seconds(d: chrono::Duration) -> f64 {
    d.num_milliseconds() as f64 / 1000.0
}

fn sorted(mut values: Vec<f64>) -> Vec<f64> {
    values.sort_by(f64::total_cmp);
    values
}

/// Imports `(tenant, prefix, count, due)` as SMS reminders, [`SEED_BATCH`] per transaction,
/// [`SEED_STREAMS`] transactions at once.
async fn seed(
    env: &TestEnv,
    jobs: &[(TenantId, String, usize, DateTime<Utc>)],
) -> anyhow::Result<()> {
    let mut batches: Vec<(TenantId, &str, usize, usize, DateTime<Utc>)> = Vec::new();
    for (tenant, prefix, count, due) in jobs {
        for first in (0..*count).step_by(SEED_BATCH) {
            batches.push((
                *tenant,
                prefix.as_str(),
                first,
                (first + SEED_BATCH).min(*count),
                *due,
            ));
        }
    }
    let batches = &batches;
    let stream = |offset: usize| async move {
        for (tenant, prefix, first, end, due) in batches.iter().skip(offset).step_by(SEED_STREAMS) {
            let mut items = Vec::with_capacity(end - first);
            for i in *first..*end {
                let event = format!("{prefix}-{i}");
                items.push(ImportReminder {
                    reminder: NewReminder::new(
                        *tenant,
                        EventId::parse(&event)?,
                        SubscriberRef::parse(&format!("sub-{event}"))?,
                        &[Channel::Sms],
                        *due,
                        *due + chrono::Duration::hours(2),
                    )?
                    .with_content(br#"{"template":"appointment"}"#.to_vec())?,
                    contacts: vec![(Channel::Sms, Destination::new(format!("+1555{i:07}")))],
                });
            }
            env.ledger
                .import_reminders(&items, &env.cipher, Utc::now())
                .await?;
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

/// Scripts the stub's bucket, seeds `jobs`, starts the producer, the janitor and two SMS
/// workers whose bucket is `rate`/`bucket_burst`, waits for `due` and then until every
/// delivery is settled (at most `within`). Returns each delivery's outcome and the account's
/// counters; fails when a delivery settled other than delivered.
async fn drive(
    env: &mut TestEnv,
    jobs: &[(TenantId, String, usize, DateTime<Utc>)],
    due: DateTime<Utc>,
    (rate, bucket_burst, provider_burst): (f64, u32, u32),
    within: Duration,
) -> anyhow::Result<(Vec<Outcome>, Counters)> {
    env.script(
        ACCOUNT,
        serde_json::json!({"rate_limit": {"per_second": rate as u32, "burst": provider_burst, "retry_after": "delta"}}),
    )
    .await?;
    seed(env, jobs).await?;
    env.start_producer("producer")?;
    env.start_janitor(200, 1_000)?;
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.rate = Some((rate, bucket_burst));
    options.prefetch = 32;
    env.start_worker(Channel::Sms, "worker-a", &options)?;
    env.start_worker(Channel::Sms, "worker-b", &options)?;
    anyhow::ensure!(
        Utc::now() < due,
        "setup took longer than its lead: the machine is too busy"
    );
    let total: i64 = jobs.iter().map(|(_, _, n, _)| *n as i64).sum();
    let ledger = env.ledger.clone();
    nudge_e2e::until("every delivery settled", within, || {
        let ledger = ledger.clone();
        async move {
            match nudge_e2e::states_in(&ledger).await {
                Ok(states) => nudge_e2e::settled(&states) == total,
                Err(_) => false,
            }
        }
    })
    .await?;
    let delivered = nudge_e2e::count_in(&env.ledger, "delivered").await?;
    anyhow::ensure!(
        delivered == total,
        "{} of {total} deliveries settled other than delivered: {:?}",
        total - delivered,
        env.states().await?
    );

    let keys = keys_report(env.stub_keys().await?)?;
    let accepted_at: HashMap<&str, DateTime<Utc>> = keys
        .keys
        .iter()
        .filter(|k| k.account == ACCOUNT)
        .filter_map(|k| k.accepted_at.map(|at| (k.key.as_str(), at)))
        .collect();
    let rows: Vec<(String, uuid::Uuid, DateTime<Utc>)> = sqlx::query_as(
        "SELECT d.idempotency_key, d.tenant_id, r.scheduled_at
         FROM deliveries d JOIN reminders r ON r.id = d.reminder_id",
    )
    .fetch_all(env.ledger.pool())
    .await?;
    anyhow::ensure!(
        rows.len() as i64 == total,
        "{} deliveries in the ledger, {total} expected",
        rows.len()
    );
    let outcomes = rows
        .into_iter()
        .map(|(key, tenant, scheduled_at)| Outcome {
            tenant,
            scheduled_at,
            accepted_at: accepted_at.get(key.as_str()).copied(),
        })
        .collect();
    let stub = stats(env.stub_stats().await?)?;
    let account = stub
        .accounts
        .get(ACCOUNT)
        .ok_or_else(|| anyhow::anyhow!("the stub saw no request for {ACCOUNT}"))?;
    let counters = Counters {
        requests: account.requests,
        accepted: account.accepted,
        status_429: account.by_status.get(&429).copied().unwrap_or(0),
        max_requests_in_any_second: account.max_requests_in_any_second,
    };
    env.stop_all(Duration::from_secs(15));
    Ok((outcomes, counters))
}

/// How long before the work falls due everything is created and started: the imports (a few
/// thousand a second in one release build on two cores, far fewer in a debug one) and the
/// processes' start-up, on a busy machine.
fn lead(total: usize) -> chrono::Duration {
    chrono::Duration::seconds(30 + total as i64 / 300)
}

async fn run_two(shape: TwoShape, run: usize) -> anyhow::Result<TwoRun> {
    let mut env = TestEnv::start("fairness-bench").await?;
    let big = env.tenant("big", 2).await?;
    let small = env.tenant("small", 2).await?;
    let start = Utc::now() + lead(shape.big + shape.small);
    let small_due = start + chrono::Duration::seconds(shape.small_after_s);
    let jobs = [
        (big, "big".to_owned(), shape.big, start),
        (small, "small".to_owned(), shape.small, small_due),
    ];
    let big_floor_s = shape.big as f64 / shape.rate;
    let within =
        Duration::from_secs_f64((shape.big + shape.small) as f64 / shape.rate * 3.0 + 60.0)
            + lead(shape.big + shape.small).to_std()?;
    let (outcomes, counters) = drive(
        &mut env,
        &jobs,
        start,
        (shape.rate, shape.bucket_burst, shape.provider_burst),
        within,
    )
    .await?;
    // Only small's deliveries count for small's lateness, only big's for big's drain.
    let small_late = sorted(
        outcomes
            .iter()
            .filter(|o| o.tenant == small.as_uuid())
            .filter_map(|o| o.accepted_at.map(|at| seconds(at - o.scheduled_at)))
            .collect(),
    );
    let big_last = outcomes
        .iter()
        .filter(|o| o.tenant == big.as_uuid())
        .filter_map(|o| o.accepted_at)
        .max()
        .ok_or_else(|| anyhow::anyhow!("none of big's deliveries was accepted"))?;
    anyhow::ensure!(
        small_late.len() == shape.small,
        "{} of small's {} deliveries accepted by the provider",
        small_late.len(),
        shape.small
    );
    let big_drain_s = seconds(big_last - start);
    Ok(TwoRun {
        run,
        failure: None,
        small_accepted: small_late.len(),
        small_late_p50_s: percentile(&small_late, 50.0),
        small_late_p99_s: percentile(&small_late, 99.0),
        small_late_max_s: small_late.last().copied().unwrap_or(f64::NAN),
        big_drain_s,
        big_floor_s,
        big_over_floor_pct: (big_drain_s / big_floor_s - 1.0) * 100.0,
        requests: counters.requests,
        accepted: counters.accepted,
        status_429: counters.status_429,
        max_requests_in_any_second: counters.max_requests_in_any_second,
    })
}

async fn run_hundred(shape: HundredShape, run: usize) -> anyhow::Result<HundredRun> {
    let mut env = TestEnv::start("fairness-bench").await?;
    let total = shape.tenants * shape.each;
    let start = Utc::now() + lead(total);
    let mut names = HashMap::new();
    let mut jobs = Vec::with_capacity(shape.tenants);
    for t in 0..shape.tenants {
        let name = format!("clinic-{t:03}");
        let tenant = env.tenant(&name, 2).await?;
        names.insert(tenant.as_uuid(), name.clone());
        jobs.push((tenant, name, shape.each, start));
    }
    let floor_s = total as f64 / shape.rate;
    let within = Duration::from_secs_f64(floor_s * 3.0 + 60.0) + lead(total).to_std()?;
    let (outcomes, counters) = drive(
        &mut env,
        &jobs,
        start,
        (shape.rate, shape.bucket_burst, shape.provider_burst),
        within,
    )
    .await?;
    let mut by_tenant: HashMap<uuid::Uuid, (Vec<f64>, DateTime<Utc>)> = HashMap::new();
    for o in &outcomes {
        let Some(at) = o.accepted_at else {
            anyhow::bail!("a delivery of {} was never accepted", names[&o.tenant]);
        };
        let entry = by_tenant.entry(o.tenant).or_insert((Vec::new(), at));
        entry.0.push(seconds(at - o.scheduled_at));
        entry.1 = entry.1.max(at);
    }
    anyhow::ensure!(
        by_tenant.len() == shape.tenants,
        "{} of {} tenants had a delivery accepted",
        by_tenant.len(),
        shape.tenants
    );
    let mut tenants: Vec<TenantFigures> = by_tenant
        .into_iter()
        .map(|(id, (late, last))| {
            let late = sorted(late);
            TenantFigures {
                tenant: names[&id].clone(),
                accepted: late.len(),
                last_s: seconds(last - start),
                late_p50_s: percentile(&late, 50.0),
                late_p99_s: percentile(&late, 99.0),
            }
        })
        .collect();
    tenants.sort_by(|a, b| a.tenant.cmp(&b.tenant));
    let lasts = sorted(tenants.iter().map(|t| t.last_s).collect());
    let p99s: Vec<f64> = tenants.iter().map(|t| t.late_p99_s).collect();
    let p99_mean_s = p99s.iter().sum::<f64>() / p99s.len() as f64;
    let p99_max_s = p99s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let last_min_s = lasts[0];
    let last_max_s = lasts[lasts.len() - 1];
    Ok(HundredRun {
        run,
        failure: None,
        last_min_s,
        last_median_s: percentile(&lasts, 50.0),
        last_max_s,
        last_spread_pct: (last_max_s / last_min_s - 1.0) * 100.0,
        p99_mean_s,
        p99_max_s,
        p99_max_over_mean: p99_max_s / p99_mean_s,
        drain_s: last_max_s,
        floor_s,
        over_floor_pct: (last_max_s / floor_s - 1.0) * 100.0,
        requests: counters.requests,
        accepted: counters.accepted,
        status_429: counters.status_429,
        max_requests_in_any_second: counters.max_requests_in_any_second,
        tenants,
    })
}

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
    /// The target: at most (worse = higher) or at least (lower) this.
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

fn figure(
    case: &'static str,
    figure: &'static str,
    worse: Worse,
    target: Option<f64>,
    target_text: &'static str,
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
        Worse::Higher => v <= t,
        Worse::Lower => v >= t,
    };
    Figure {
        case,
        figure,
        worse,
        target,
        target_text,
        runs_within_target: target.map(|t| values.iter().filter(|v| within(**v, t)).count()),
        median: percentile(&ordered, 50.0),
        worst,
        values,
        failed_runs,
    }
}

fn two_figures(runs: &[TwoRun]) -> Vec<Figure> {
    let ok: Vec<&TwoRun> = runs.iter().filter(|r| r.failure.is_none()).collect();
    let failed = runs.len() - ok.len();
    let f = |name, worse, target, text, get: fn(&TwoRun) -> f64| {
        figure(
            "two",
            name,
            worse,
            target,
            text,
            ok.iter().map(|r| get(r)).collect(),
            failed,
        )
    };
    vec![
        f("small's lateness p50 (s)", Worse::Higher, None, "", |r| {
            r.small_late_p50_s
        }),
        f(
            "small's lateness p99 (s)",
            Worse::Higher,
            Some(2.0),
            "<= 2 s",
            |r| r.small_late_p99_s,
        ),
        f("small's lateness max (s)", Worse::Higher, None, "", |r| {
            r.small_late_max_s
        }),
        f("big's drain (s)", Worse::Higher, None, "", |r| {
            r.big_drain_s
        }),
        f(
            "big's drain / its floor",
            Worse::Higher,
            Some(1.03),
            "<= 1.03 (within 3%)",
            |r| r.big_drain_s / r.big_floor_s,
        ),
        f("429s", Worse::Higher, Some(0.0), "0", |r| {
            r.status_429 as f64
        }),
        f("requests", Worse::Higher, None, "", |r| r.requests as f64),
        f("max requests in any 1 s", Worse::Higher, None, "", |r| {
            r.max_requests_in_any_second as f64
        }),
    ]
}

fn hundred_figures(runs: &[HundredRun]) -> Vec<Figure> {
    let ok: Vec<&HundredRun> = runs.iter().filter(|r| r.failure.is_none()).collect();
    let failed = runs.len() - ok.len();
    let f = |name, worse, target, text, get: fn(&HundredRun) -> f64| {
        figure(
            "hundred",
            name,
            worse,
            target,
            text,
            ok.iter().map(|r| get(r)).collect(),
            failed,
        )
    };
    vec![
        f(
            "a tenant's last delivery, min across tenants (s)",
            Worse::Lower,
            None,
            "",
            |r| r.last_min_s,
        ),
        f(
            "a tenant's last delivery, median across tenants (s)",
            Worse::Higher,
            None,
            "",
            |r| r.last_median_s,
        ),
        f(
            "a tenant's last delivery, max across tenants (s)",
            Worse::Higher,
            None,
            "",
            |r| r.last_max_s,
        ),
        f(
            "spread of the last deliveries, max/min - 1 (%)",
            Worse::Higher,
            Some(10.0),
            "<= 10%",
            |r| r.last_spread_pct,
        ),
        f(
            "a tenant's p99 lateness, mean across tenants (s)",
            Worse::Higher,
            None,
            "",
            |r| r.p99_mean_s,
        ),
        f(
            "a tenant's p99 lateness, max across tenants (s)",
            Worse::Higher,
            None,
            "",
            |r| r.p99_max_s,
        ),
        f(
            "p99 lateness max / mean",
            Worse::Higher,
            Some(1.2),
            "<= 1.2",
            |r| r.p99_max_over_mean,
        ),
        f("drain (s)", Worse::Higher, None, "", |r| r.drain_s),
        f("drain / its floor", Worse::Higher, None, "", |r| {
            r.drain_s / r.floor_s
        }),
        f("429s", Worse::Higher, None, "", |r| r.status_429 as f64),
        f("requests", Worse::Higher, None, "", |r| r.requests as f64),
        f("max requests in any 1 s", Worse::Higher, None, "", |r| {
            r.max_requests_in_any_second as f64
        }),
    ]
}

fn number(v: f64) -> String {
    if v.is_infinite() {
        "failed".to_owned()
    } else if v.is_nan() {
        "-".to_owned()
    } else if v.fract() == 0.0 {
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    let dir = args
        .results
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/results"));
    let two = two_shape(args.scale);
    let hundred = hundred_shape(args.scale);
    let run_two_case = matches!(args.case, Which::Two | Which::All);
    let run_hundred_case = matches!(args.case, Which::Hundred | Which::All);
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // On a signal the running run's future is dropped, and with it its environment, which stops
    // its processes and drops its database and broker namespace.
    let run_all = async {
        let mut twos = Vec::new();
        let mut hundreds = Vec::new();
        for run in 1..=args.runs {
            if run_two_case {
                eprintln!("two run {run}: starting");
                let result = run_two(two, run).await.unwrap_or_else(|e| TwoRun {
                    run,
                    failure: Some(format!("{e:#}")),
                    ..TwoRun::default()
                });
                eprintln!(
                    "two run {run}: small p99 {:.2} s max {:.2} s late; big drained in {:.1} s (floor {:.1} s); {} x 429{}",
                    result.small_late_p99_s,
                    result.small_late_max_s,
                    result.big_drain_s,
                    result.big_floor_s,
                    result.status_429,
                    result
                        .failure
                        .as_ref()
                        .map(|f| format!("; failed: {f}"))
                        .unwrap_or_default()
                );
                twos.push(result);
            }
            if run_hundred_case {
                eprintln!("hundred run {run}: starting");
                let result = run_hundred(hundred, run)
                    .await
                    .unwrap_or_else(|e| HundredRun {
                        run,
                        failure: Some(format!("{e:#}")),
                        ..HundredRun::default()
                    });
                eprintln!(
                    "hundred run {run}: last deliveries {:.1}..{:.1} s (spread {:.1}%); p99 mean {:.2} s max {:.2} s; drained in {:.1} s (floor {:.1} s); {} x 429{}",
                    result.last_min_s,
                    result.last_max_s,
                    result.last_spread_pct,
                    result.p99_mean_s,
                    result.p99_max_s,
                    result.drain_s,
                    result.floor_s,
                    result.status_429,
                    result
                        .failure
                        .as_ref()
                        .map(|f| format!("; failed: {f}"))
                        .unwrap_or_default()
                );
                hundreds.push(result);
            }
        }
        (twos, hundreds)
    };
    let (twos, hundreds) = tokio::select! {
        results = run_all => results,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; the current run was cleaned up"),
        _ = terminate.recv() => anyhow::bail!("terminated; the current run was cleaned up"),
    };

    let two_summary = run_two_case.then(|| two_figures(&twos));
    let hundred_summary = run_hundred_case.then(|| hundred_figures(&hundreds));
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
        "# Fairness benchmark (issue 24)\n\n\
         Run {stamp} on {cores} cores ({cpu}), {build}, `--scale {scale}`, {runs} run(s) of each \
         case (interleaved), each on a fresh database, broker namespace and provider stub. \
         Produced by `scripts/bench-fairness.sh`; `fairness-{scale}-{stamp}.json` has every run \
         (and each tenant's figures in the hundred-tenant case).\n\n\
         The real producer, janitor and two SMS workers (prefetch 32) send every tenant's SMS \
         through one provider account. Lateness: the provider's first accept of a delivery's \
         key minus its reminder's scheduled time. Worst run: the highest value over the runs \
         (the lowest for the earliest last delivery); a failed run is the worst.\n",
        runs = args.runs,
    );
    if let Some(figures) = &two_summary {
        md.push_str(&format!(
            "\n## Two tenants\n\n\
             Tenant `big`: {big} SMS due at once; tenant `small`: {small} due {after} s later. The \
             account at {rate}/s: our bucket {rate}/s burst {bb}, the stub's token bucket {rate}/s \
             burst {pb} (the drain benchmark's \"bucket = provider limit\" pair), 429s with \
             `Retry-After`. Big's floor: {big} / {rate} = {floor:.1} s, its drain from the batch's \
             due time to its last accept.\n\n{table}",
            big = two.big,
            small = two.small,
            after = two.small_after_s,
            rate = two.rate,
            bb = two.bucket_burst,
            pb = two.provider_burst,
            floor = two.big as f64 / two.rate,
            table = table(figures),
        ));
        for r in twos.iter().filter(|r| r.failure.is_some()) {
            md.push_str(&format!(
                "\nRun {} failed: {}\n",
                r.run,
                r.failure.as_deref().unwrap_or_default()
            ));
        }
    }
    if let Some(figures) = &hundred_summary {
        md.push_str(&format!(
            "\n## {tenants} tenants\n\n\
             {tenants} tenants with {each} SMS each, all due at once. The account at {rate}/s: our \
             bucket {rate}/s burst {bb}, the stub's token bucket {rate}/s burst {pb} (the same \
             eighth and quarter of a second of the rate as the two-tenant case), 429s with \
             `Retry-After`. Floor: {total} / {rate} = {floor:.1} s. Times are from the common \
             due time.\n\n{table}",
            tenants = hundred.tenants,
            each = hundred.each,
            rate = hundred.rate,
            bb = hundred.bucket_burst,
            pb = hundred.provider_burst,
            total = hundred.tenants * hundred.each,
            floor = (hundred.tenants * hundred.each) as f64 / hundred.rate,
            table = table(figures),
        ));
        for r in hundreds.iter().filter(|r| r.failure.is_some()) {
            md.push_str(&format!(
                "\nRun {} failed: {}\n",
                r.run,
                r.failure.as_deref().unwrap_or_default()
            ));
        }
    }
    println!("{md}");

    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join(format!("fairness-{scale}-{stamp}.json")),
        serde_json::to_string_pretty(&serde_json::json!({
            "at": Utc::now(),
            "cpu": cpu,
            "cores": cores,
            "build": build,
            "scale": args.scale,
            "runs": args.runs,
            "two": run_two_case.then_some(serde_json::json!({
                "shape": two,
                "summary": two_summary,
                "runs": twos,
            })),
            "hundred": run_hundred_case.then_some(serde_json::json!({
                "shape": hundred,
                "summary": hundred_summary,
                "runs": hundreds,
            })),
        }))?,
    )?;
    std::fs::write(dir.join(format!("fairness-{scale}-latest.md")), md)?;
    Ok(())
}
