//! The restore drill: a PostgreSQL server of the drill's own, the real producer, janitor and two
//! SMS workers, and N SMS deliveries (default 5,000) on a provider account that does not dedup
//! by key. Once `--backup-at` of them are delivered the ledger is backed up with `pg_dump`; the
//! run finishes; every process is stopped and the ledger restored from the dump (the database
//! dropped and created again, as after losing it). Then, as the runbook says: the janitor
//! finds the restore, a worker started on it refuses to send, `nudgectl restore reconcile`
//! (dry run, then --execute with the stub's message log as the provider's records) holds and
//! settles, and the producer and the workers start again. Reports the keys the provider saw
//! more than once (must be 0), every delivery by state (must add up to N), what the restored
//! ledger believed was owed (what would have been sent twice without the reconciliation), and
//! the times. Prints a table and writes `bench/results/restore-<time>.json` and
//! bench/results/restore-latest.md.
//!
//!   scripts/restore-test.sh [--deliveries N]   (builds the binaries, runs this)
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::collections::HashMap;
use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use chrono::{DateTime, SecondsFormat, Utc};
use clap::Parser;
use nudge_domain::Channel;
use nudge_e2e::private::{PrivatePostgres, with_private_postgres};
use nudge_e2e::{TestEnv, WorkerOptions, keys_report, until};
use serde::Serialize;

#[derive(Debug, Parser)]
#[command(about = "Backs the ledger up mid-run, restores it after the run, and reconciles")]
struct Args {
    /// SMS deliveries due at the start.
    #[arg(long, default_value_t = 5_000)]
    deliveries: usize,
    /// The share of deliveries delivered when the backup is taken.
    #[arg(long, default_value_t = 0.4)]
    backup_at: f64,
    /// Each provider answer takes this long (ms), so sends are in flight at the backup.
    #[arg(long, default_value_t = 5)]
    send_delay_ms: u64,
    /// The account's bucket rate (sends/s): paces the run so the backup lands mid-run.
    #[arg(long, default_value_t = 150.0)]
    rate: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    deliveries: usize,
    /// Delivered when the dump started, as the running ledger counted.
    delivered_at_backup: i64,
    /// The backup's point given to the reconciliation (the database's clock, after the dump).
    since: String,
    dump_ms: u128,
    first_run_s: f64,
    provider_accepted_keys_before_restore: usize,
    restore_ms: u128,
    /// The restored ledger's deliveries by state: what it believed.
    restored_states: HashMap<String, i64>,
    /// Owed in the restored ledger (scheduled, queued, sending, waiting to retry): what would
    /// have been sent again without the reconciliation.
    owed_in_restored_ledger: i64,
    /// Owed in the restored ledger yet accepted by the provider after the backup.
    owed_yet_sent_after_backup: usize,
    /// From the janitor's start until `nudgectl restore status` said restored.
    restore_found_after_ms: u128,
    /// The exit code of a worker started on the restored ledger, and its last log line.
    worker_refused_exit_code: Option<i32>,
    worker_refused_with: String,
    dry_run_held: i64,
    dry_run_created_held: i64,
    reconcile_held: i64,
    reconcile_created_held: i64,
    reconcile_settled_by_provider_records: i64,
    reconcile_settled_by_receipts: i64,
    reconcile_left_for_review: i64,
    /// From the processes' restart until nothing was owed.
    after_restart_s: f64,
    provider_requests_after_restart: u64,
    final_states: HashMap<String, i64>,
    /// Deliveries in the ledger at the end; must be `deliveries`.
    accounted_for: i64,
    keys_sent_more_than_once: usize,
}

async fn delivered(env: &TestEnv) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state = 'delivered'")
            .fetch_one(env.ledger.pool())
            .await?,
    )
}

async fn database_now(env: &TestEnv) -> anyhow::Result<DateTime<Utc>> {
    Ok(sqlx::query_scalar("SELECT now()")
        .fetch_one(env.ledger.pool())
        .await?)
}

/// Runs a PostgreSQL client program (`pg_dump`, `pg_restore`) and fails with its output.
fn client(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("failed to run {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// `nudgectl ARGS --json`, parsed; fails unless it exits 0.
fn nudgectl_json(env: &TestEnv, args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let mut all = args.to_vec();
    all.push("--json");
    let (code, out, err) = env.nudgectl(&all)?;
    anyhow::ensure!(code == 0, "nudgectl {args:?} exited {code}: {err}");
    serde_json::from_str(&out).with_context(|| format!("nudgectl {args:?} printed no JSON: {out}"))
}

fn total(report: &serde_json::Value, field: &str) -> i64 {
    report[field].as_array().map_or(0, |rows| {
        rows.iter().filter_map(|r| r["count"].as_i64()).sum()
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // Interrupted, the drill's future is dropped: its server and processes are stopped on the way.
    tokio::select! {
        result = drill(args) => result,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; server and processes stopped"),
        _ = terminate.recv() => anyhow::bail!("terminated; server and processes stopped"),
    }
}

#[allow(clippy::too_many_lines)]
async fn drill(args: Args) -> anyhow::Result<()> {
    eprintln!("starting a PostgreSQL server of the drill's own");
    let postgres = PrivatePostgres::start()?;
    let mut env = TestEnv::start_on("restore", with_private_postgres(&postgres)).await?;

    eprintln!("seeding {} SMS reminders", args.deliveries);
    let tenant = env.tenant("clinic-restore", 2).await?;
    let now = Utc::now();
    for i in 0..args.deliveries {
        env.reminder(
            tenant,
            &format!("r-{i}"),
            &[Channel::Sms],
            now,
            now + chrono::Duration::hours(2),
        )
        .await?;
    }
    env.script(
        "sms-main",
        serde_json::json!({"default": {"status": 202, "delay_ms": args.send_delay_ms}}),
    )
    .await?;
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    // The account does not dedup by key: a resend would be a second message to the patient.
    options.accounts = vec![("sms-main".into(), false, true)];
    options.lease_seconds = 15;
    options.prefetch = 32;
    options.rate = Some((args.rate, 10));

    let started = Instant::now();
    env.start_producer("producer")?;
    env.start_janitor(200, 1_000)?;
    env.start_worker(Channel::Sms, "worker-a", &options)?;
    env.start_worker(Channel::Sms, "worker-b", &options)?;

    #[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]
    let backup_when = (args.deliveries as f64 * args.backup_at) as i64;
    until(
        "the backup's share delivered",
        Duration::from_secs(900),
        || async { delivered(&env).await.is_ok_and(|d| d >= backup_when) },
    )
    .await?;
    let delivered_at_backup = delivered(&env).await?;
    let dump = env.dir.join("ledger.dump");
    let dump_arg = dump.to_string_lossy().into_owned();
    eprintln!("{delivered_at_backup} delivered: pg_dump of the ledger while it runs");
    let dump_started = Instant::now();
    client(
        "pg_dump",
        &[
            "--format=custom",
            "--file",
            &dump_arg,
            "--dbname",
            &env.db_url,
        ],
    )?;
    let dump_ms = dump_started.elapsed().as_millis();
    // After the dump: a later point than its snapshot, which only holds more.
    let since = database_now(&env)
        .await?
        .to_rfc3339_opts(SecondsFormat::Micros, true);

    until("the run to finish", Duration::from_secs(900), || async {
        env.live().await.is_ok_and(|live| live == 0)
    })
    .await?;
    let first_run_s = started.elapsed().as_secs_f64();
    let keys_before = keys_report(env.stub_keys().await?)?;
    let accepted: Vec<&provider_stub::KeyReport> = keys_before
        .keys
        .iter()
        .filter(|k| k.accepted_at.is_some())
        .collect();
    let requests_before: usize = keys_before.keys.iter().map(|k| k.requests.len()).sum();
    for (name, code) in env.stop_all(Duration::from_secs(20)) {
        eprintln!("stopped {name}: {code:?}");
    }

    eprintln!("restoring the ledger from the dump (database dropped and created again)");
    let restore_started = Instant::now();
    let admin = sqlx::PgPool::connect(&postgres.admin_url()).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {} WITH (FORCE)",
        env.db_name
    )))
    .execute(&admin)
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE {}",
        env.db_name
    )))
    .execute(&admin)
    .await?;
    admin.close().await;
    client("pg_restore", &["--dbname", &env.db_url, &dump_arg])?;
    let restore_ms = restore_started.elapsed().as_millis();
    let restored_states = env.states().await?;
    let owed_keys: Vec<String> = sqlx::query_scalar(
        "SELECT idempotency_key FROM deliveries
         WHERE state IN ('scheduled', 'queued', 'sending', 'retry_wait')",
    )
    .fetch_all(env.ledger.pool())
    .await?;
    let accepted_keys: std::collections::HashSet<&str> =
        accepted.iter().map(|k| k.key.as_str()).collect();
    let owed_yet_sent_after_backup = owed_keys
        .iter()
        .filter(|k| accepted_keys.contains(k.as_str()))
        .count();

    let janitor_started = Instant::now();
    env.start_janitor(200, 1_000)?;
    until(
        "the restore to be found",
        Duration::from_secs(60),
        || async {
            nudgectl_json(&env, &["restore", "status"])
                .is_ok_and(|s| s["observed"]["verdict"] == "restored")
        },
    )
    .await?;
    let restore_found_after_ms = janitor_started.elapsed().as_millis();

    let refused = env.start_worker(Channel::Sms, "worker-refused", &options)?;
    until("the worker to refuse", Duration::from_secs(60), || {
        let running = env.proc(refused).is_running();
        async move { !running }
    })
    .await?;
    let worker_refused_exit_code = env.proc(refused).terminate(Duration::from_secs(1));
    let worker_refused_with = env
        .proc(refused)
        .log_tail(40)
        .lines()
        .rfind(|l| l.contains("restored"))
        .unwrap_or_default()
        .to_owned();
    anyhow::ensure!(
        worker_refused_exit_code.is_some_and(|c| c != 0) && !worker_refused_with.is_empty(),
        "the worker did not refuse the restored ledger: exit {worker_refused_exit_code:?}\n{}",
        env.proc(refused).log_tail(20)
    );

    // The provider's records of its sends: the stub's log, as an operator exports Twilio's.
    let sent_file = env.dir.join("provider-log.jsonl");
    {
        let mut file = std::io::BufWriter::new(std::fs::File::create(&sent_file)?);
        for k in &accepted {
            serde_json::to_writer(
                &mut file,
                &serde_json::json!({"idempotency_key": k.key, "provider_message_id": k.message_id}),
            )?;
            writeln!(file)?;
        }
    }
    let sent_arg = sent_file.to_string_lossy().into_owned();
    let dry = nudgectl_json(
        &env,
        &[
            "restore",
            "reconcile",
            "--since",
            &since,
            "--reason",
            "restore drill",
        ],
    )?;
    let executed = nudgectl_json(
        &env,
        &[
            "restore",
            "reconcile",
            "--since",
            &since,
            "--sent",
            &sent_arg,
            "--reason",
            "restore drill",
            "--incident",
            "DRILL-restore",
            "--execute",
        ],
    )?;
    anyhow::ensure!(
        executed["executed"] == true,
        "the reconcile did not execute"
    );

    let restarted = Instant::now();
    env.start_producer("producer-2")?;
    env.start_worker(Channel::Sms, "worker-a2", &options)?;
    env.start_worker(Channel::Sms, "worker-b2", &options)?;
    until("nothing owed", Duration::from_secs(600), || async {
        env.live().await.is_ok_and(|live| live == 0)
    })
    .await?;
    // The workers are up and sending nothing: give a republish a chance to show a resend.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after_restart_s = restarted.elapsed().as_secs_f64();
    let final_states = env.states().await?;
    let keys = keys_report(env.stub_keys().await?)?;
    let requests_after: usize = keys.keys.iter().map(|k| k.requests.len()).sum();
    let report = Report {
        deliveries: args.deliveries,
        delivered_at_backup,
        since,
        dump_ms,
        first_run_s,
        provider_accepted_keys_before_restore: accepted.len(),
        restore_ms,
        owed_in_restored_ledger: ["scheduled", "queued", "sending", "retry_wait"]
            .iter()
            .map(|s| restored_states.get(*s).copied().unwrap_or(0))
            .sum(),
        restored_states,
        owed_yet_sent_after_backup,
        restore_found_after_ms,
        worker_refused_exit_code,
        worker_refused_with,
        dry_run_held: total(&dry, "held"),
        dry_run_created_held: dry["materialised_held"].as_i64().unwrap_or(0),
        reconcile_held: total(&executed, "held"),
        reconcile_created_held: executed["materialised_held"].as_i64().unwrap_or(0),
        reconcile_settled_by_provider_records: executed["settled_by_provider_records"]
            .as_i64()
            .unwrap_or(0),
        reconcile_settled_by_receipts: executed["settled_by_receipt"].as_i64().unwrap_or(0),
        reconcile_left_for_review: total(&executed, "for_review"),
        after_restart_s,
        provider_requests_after_restart: u64::try_from(
            requests_after.saturating_sub(requests_before),
        )
        .unwrap_or(u64::MAX),
        accounted_for: final_states.values().sum(),
        final_states,
        keys_sent_more_than_once: keys.keys.iter().filter(|k| k.requests.len() > 1).count(),
    };
    env.stop_all(Duration::from_secs(10));
    drop(env);
    drop(postgres);
    write_report(&report)?;
    anyhow::ensure!(
        report.keys_sent_more_than_once == 0,
        "{} keys sent more than once",
        report.keys_sent_more_than_once
    );
    anyhow::ensure!(
        report.accounted_for == i64::try_from(report.deliveries).unwrap_or(i64::MAX),
        "{} deliveries in the ledger, {} seeded",
        report.accounted_for,
        report.deliveries
    );
    Ok(())
}

fn write_report(report: &Report) -> anyhow::Result<()> {
    let sorted = |states: &HashMap<String, i64>| {
        let mut v: Vec<_> = states.iter().collect();
        v.sort();
        v.iter()
            .map(|(s, n)| format!("{s} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let table = format!(
        "| measure | value |\n|---|---|\n\
         | deliveries (SMS, an account that does not dedup by key) | {} |\n\
         | delivered when the dump started | {} |\n\
         | `pg_dump` took | {} ms |\n\
         | the run finished after | {:.1} s |\n\
         | keys the provider accepted before the restore | {} |\n\
         | restore (drop, create, `pg_restore`) took | {} ms |\n\
         | the restored ledger, by state | {} |\n\
         | owed in the restored ledger (would be sent again unreconciled) | {} |\n\
         | of those, accepted by the provider after the backup | {} |\n\
         | restore found, after the janitor started | {} ms |\n\
         | a worker started on it exited with | {:?}: `{}` |\n\
         | dry run: held / created held | {} / {} |\n\
         | reconcile: held / created held | {} / {} |\n\
         | settled by the provider's records / by receipts | {} / {} |\n\
         | left for review | {} |\n\
         | producer and workers restarted, nothing owed after | {:.1} s |\n\
         | provider requests after the restart | {} |\n\
         | final states | {} |\n\
         | deliveries accounted for | {} of {} |\n\
         | keys sent more than once | {} |\n",
        report.deliveries,
        report.delivered_at_backup,
        report.dump_ms,
        report.first_run_s,
        report.provider_accepted_keys_before_restore,
        report.restore_ms,
        sorted(&report.restored_states),
        report.owed_in_restored_ledger,
        report.owed_yet_sent_after_backup,
        report.restore_found_after_ms,
        report.worker_refused_exit_code,
        report
            .worker_refused_with
            .chars()
            .take(160)
            .collect::<String>()
            .replace('|', "/"),
        report.dry_run_held,
        report.dry_run_created_held,
        report.reconcile_held,
        report.reconcile_created_held,
        report.reconcile_settled_by_provider_records,
        report.reconcile_settled_by_receipts,
        report.reconcile_left_for_review,
        report.after_restart_s,
        report.provider_requests_after_restart,
        sorted(&report.final_states),
        report.accounted_for,
        report.deliveries,
        report.keys_sent_more_than_once,
    );
    println!("{table}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/results");
    std::fs::create_dir_all(&dir)?;
    let stamp = Utc::now().format("%Y%m%dT%H%M%SZ");
    std::fs::write(
        dir.join(format!("restore-{stamp}.json")),
        serde_json::to_string_pretty(report)?,
    )?;
    std::fs::write(
        dir.join("restore-latest.md"),
        format!(
            "# Restore drill ({stamp})\n\n`scripts/restore-test.sh --deliveries {}` (debug \
             build, one 2-core machine; the backup is a `pg_dump` taken mid-run, restored into \
             the same server after the run: the database is dropped and created again)\n\n{table}",
            report.deliveries
        ),
    )?;
    Ok(())
}
