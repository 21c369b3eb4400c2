//! The PostgreSQL failover drill: a primary and a hot standby of this machine's Debian
//! PostgreSQL (their own ports and data directories; the shared server is not touched), the
//! standby synchronous (`synchronous_standby_names` names it, `synchronous_commit = on`) or,
//! with `--replication async`, not. A loopback TCP proxy stands in for the read-write Service:
//! the real producer, janitor and two SMS workers (each as its own database role) and the
//! harness reach the ledger only through it. N SMS deliveries (default 10,000) go to a provider
//! account that does not dedup by key. Once a quarter are delivered the primary is killed
//! (SIGKILL to every process of it, as in a lost machine), the standby promoted
//! (`pg_ctl promote`) and the proxy pointed at it, its old links cut.
//!
//! The standby streams from the primary through a second loopback proxy (its
//! `primary_conninfo`), the replication link. `--standby-lag-ms` before the kill the drill
//! stalls that link (bytes held, no error), as on a slow or congested network: an asynchronous
//! standby then lacks the last seconds of what the primary committed when it is promoted, and
//! the drill counts the outcomes it lacked and what became of each. A synchronous primary's
//! commits wait for the stalled standby instead: the workers stall, and nothing they were told
//! was committed is missing. The held bytes are dropped with the primary.
//!
//! Reports what was lost, how many keys the provider saw more than once (the account does not
//! dedup: the ledger is the only guard), how many deliveries were held `ambiguous`, how long
//! after the promotion deliveries moved again, and the patient's view: how long after the
//! promotion the last delivery owed at the fault was settled (delivered, or held for review).
//! Also what each process logged (warnings and errors by message) from the fault on. Prints a
//! table and writes `bench/results/pg-failover-<mode>-<time>.json` and
//! bench/results/pg-failover-latest.md (the newest run of each mode and stall).
//!
//!   scripts/postgres-failover-test.sh [--replication sync|async] [--deliveries N]
//!       [--standby-lag-ms MS]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use clap::{Parser, ValueEnum};
use nudge_domain::Channel;
use nudge_e2e::private::PrivatePostgres;
use nudge_e2e::{
    Services, TestEnv, WorkerOptions, keys_report, poll_within as within, stats, until,
};
use nudge_testkit::FaultProxy;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The standby's name in the primary's `synchronous_standby_names` and `pg_stat_replication`.
const STANDBY_NAME: &str = "standby1";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Replication {
    /// The primary's commits wait until the standby has flushed them.
    Sync,
    /// The primary's commits return at once; the standby follows when it can.
    Async,
}

impl Replication {
    fn name(self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::Async => "async",
        }
    }
}

#[derive(Debug, Parser)]
#[command(about = "Kills the PostgreSQL primary mid-run and promotes its standby")]
struct Args {
    /// Synchronous (the standby confirms each commit) or asynchronous replication.
    #[arg(long, value_enum, default_value = "sync")]
    replication: Replication,
    /// SMS deliveries due at the start.
    #[arg(long, default_value_t = 10_000)]
    deliveries: usize,
    /// Each provider answer takes this long (ms), so sends are in flight at the kill.
    #[arg(long, default_value_t = 5)]
    send_delay_ms: u64,
    /// The account's bucket rate (sends/s): paces the run so the kill lands mid-run.
    #[arg(long, default_value_t = 150.0)]
    rate: f64,
    /// How long after the promotion the drill waits for every delivery to settle before it
    /// reports what is still owed.
    #[arg(long, default_value_t = 600)]
    settle_within_s: u64,
    /// The replication link is stalled this long (ms) before the primary is killed: an
    /// asynchronous standby lags by that much of what the primary committed; a synchronous
    /// primary's commits wait for it. 0: no stall (the standby keeps up on loopback).
    #[arg(long, default_value_t = 3_000)]
    standby_lag_ms: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Report {
    replication: Replication,
    deliveries: usize,
    /// `synchronous_standby_names` on the primary, and the standby's `sync_state` before the run.
    synchronous_standby_names: String,
    standby_sync_state: String,
    /// How long the replication link was stalled before the kill (0 in runs made before the
    /// link could be stalled).
    #[serde(default)]
    standby_lag_ms: u64,
    /// Delivered on the primary when the link was stalled; compared with
    /// `delivered_before_kill`, what the workers recorded while the standby got nothing.
    #[serde(default)]
    delivered_at_stall: Option<i64>,
    /// Delivered, read on the primary just before the kill.
    delivered_before_kill: i64,
    /// From reading every delivery's state on the primary until the kill: what happened on
    /// the primary meanwhile is not counted among the missing outcomes.
    #[serde(default)]
    states_read_before_kill_ms: Option<i64>,
    /// WAL the primary had written (read just before the kill) that the standby had not
    /// replayed when it was promoted, in bytes.
    #[serde(default)]
    wal_missing_at_promotion_bytes: Option<i64>,
    /// Deliveries settled (delivered, held or otherwise final) on the primary just before the
    /// kill but not settled on the standby at its promotion: outcomes lost with the primary.
    #[serde(default)]
    outcomes_missing_at_promotion: Option<usize>,
    /// What became of those deliveries: sent again (the provider saw their key more than
    /// once), held `ambiguous` (sent once), delivered with one request; the rest are in
    /// another state.
    #[serde(default)]
    missing_outcomes_sent_again: Option<usize>,
    #[serde(default)]
    missing_outcomes_held_ambiguous: Option<usize>,
    #[serde(default)]
    missing_outcomes_delivered_once: Option<usize>,
    /// Delivered on the promoted standby when its promotion returned: fewer than before the
    /// kill means outcomes the primary had committed were lost with it.
    delivered_at_promotion: i64,
    /// From the kill until `pg_ctl promote -w` returned.
    promotion_took_ms: u128,
    /// From the promotion until a delivery was recorded delivered on the new primary; None:
    /// not within the settle time.
    deliveries_resumed_after_ms: Option<u128>,
    /// From the promotion until every process answered `/readyz`.
    processes_ready_after_ms: Option<u128>,
    /// The patient's view: from the promotion until the last delivery owed at the fault was
    /// delivered or held for review; None: some were still owed after the settle time.
    last_owed_settled_after_ms: Option<u128>,
    /// Still scheduled, queued, sending or waiting to retry when the drill stopped waiting.
    still_owed: i64,
    total_s: f64,
    states: HashMap<String, i64>,
    /// Deliveries not delivered (any other state, `ambiguous` included); `lost -
    /// held_ambiguous` were neither delivered nor held for review.
    lost: i64,
    /// Deliveries not delivered whose key the provider never saw: no reminder reached the
    /// patient.
    #[serde(default)]
    never_sent: Option<usize>,
    provider_requests: u64,
    provider_unique_keys: u64,
    keys_sent_more_than_once: usize,
    /// The keys sent more than once that are not among the missing outcomes, by their state on
    /// the primary at the kill and on the standby at its promotion.
    #[serde(default)]
    sent_again_unsettled_at_kill: Option<BTreeMap<String, usize>>,
    held_ambiguous: i64,
    /// The deliveries not delivered, by their state on the primary at the kill and on the
    /// standby at its promotion, their state at the end and how many requests the provider saw.
    #[serde(default)]
    not_delivered_by_path: Option<BTreeMap<String, usize>>,
    /// Warnings and errors each process logged from the kill on: message -> count.
    logged_after_fault: BTreeMap<String, BTreeMap<String, usize>>,
    /// Which binaries were used.
    build: String,
}

/// A loopback TCP proxy to one upstream that can be pointed at another, as a Kubernetes
/// Service follows the promoted instance. Dropping it cuts every link and stops listening.
#[derive(Debug)]
struct SwitchProxy {
    port: u16,
    upstream: Arc<Mutex<String>>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl SwitchProxy {
    async fn start(upstream: String) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let upstream = Arc::new(Mutex::new(upstream));
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let upstream = Arc::clone(&upstream);
            let links = Arc::clone(&links);
            tokio::spawn(async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    let target = upstream
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clone();
                    let link = tokio::spawn(async move {
                        // A refused upstream (the primary is gone) closes the client's link.
                        let Ok(mut server) = TcpStream::connect(target.as_str()).await else {
                            return;
                        };
                        let _ = client.set_nodelay(true);
                        let _ = server.set_nodelay(true);
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    });
                    let mut links = links.lock().unwrap_or_else(PoisonError::into_inner);
                    links.retain(|l| !l.is_finished());
                    links.push(link);
                }
            })
        };
        Ok(Self {
            port,
            upstream,
            links,
            accept,
        })
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// New connections go to `upstream`; every link to the old one is cut. Returns how many.
    fn retarget(&self, upstream: String) -> usize {
        *self.upstream.lock().unwrap_or_else(PoisonError::into_inner) = upstream;
        let mut links = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        let live = links.iter().filter(|l| !l.is_finished()).count();
        for link in links.drain(..) {
            link.abort();
        }
        live
    }
}

impl Drop for SwitchProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for link in self
            .links
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
        {
            link.abort();
        }
    }
}

async fn delivered(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state = 'delivered'")
            .fetch_one(pool)
            .await?,
    )
}

/// Every delivery's state by idempotency key, `sending` split by whether its send was fenced
/// as started.
async fn states_by_key(pool: &PgPool) -> anyhow::Result<HashMap<String, String>> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT idempotency_key, CASE WHEN send_started_at IS NOT NULL \
                THEN state || ' (send started)' ELSE state END \
         FROM deliveries",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// The keys of `states` in a settled state (terminal or held).
fn settled(states: &HashMap<String, String>) -> HashSet<&str> {
    const SETTLED: [&str; 5] = [
        "delivered",
        "dead_lettered",
        "expired",
        "cancelled",
        "ambiguous",
    ];
    states
        .iter()
        .filter(|(_, state)| SETTLED.contains(&state.as_str()))
        .map(|(key, _)| key.as_str())
        .collect()
}

async fn live(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM deliveries \
         WHERE state IN ('scheduled','queued','sending','retry_wait')",
    )
    .fetch_one(pool)
    .await?)
}

/// A small pool straight to one server (not through the proxy), for the drill's own reads.
async fn direct_pool(url: &str) -> anyhow::Result<PgPool> {
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(3))
        .connect(url)
        .await?)
}

async fn all_ready(env: &TestEnv, names: &[String]) -> bool {
    for name in names {
        let Some(url) = env.admin_url(name) else {
            return false;
        };
        let ok = env
            .http
            .get(format!("{url}/readyz"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if !ok {
            return false;
        }
    }
    true
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // Interrupted, the drill's future is dropped: its servers and processes are stopped on the way.
    tokio::select! {
        result = drill(args) => result,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; servers and processes stopped"),
        _ = terminate.recv() => anyhow::bail!("terminated; servers and processes stopped"),
    }
}

/// Sets the primary's replication mode and waits until the standby streams in it; returns
/// `synchronous_standby_names` and the standby's `sync_state`.
async fn replicate(primary: &PgPool, mode: Replication) -> anyhow::Result<(String, String)> {
    let names = match mode {
        Replication::Sync => format!("\"{STANDBY_NAME}\""),
        Replication::Async => String::new(),
    };
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER SYSTEM SET synchronous_standby_names = '{names}'"
    )))
    .execute(primary)
    .await?;
    sqlx::query("ALTER SYSTEM SET synchronous_commit = 'on'")
        .execute(primary)
        .await?;
    sqlx::query("SELECT pg_reload_conf()")
        .execute(primary)
        .await?;
    let expected = match mode {
        Replication::Sync => "sync",
        Replication::Async => "async",
    };
    until("the standby to stream", Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, String>(
            "SELECT sync_state FROM pg_stat_replication \
                 WHERE application_name = $1 AND state = 'streaming'",
        )
        .bind(STANDBY_NAME)
        .fetch_optional(primary)
        .await
        .ok()
        .flatten()
        .is_some_and(|state| state == expected)
    })
    .await?;
    // A new session reads the reloaded setting.
    let mut conn = primary.acquire().await?;
    let names: String = sqlx::query_scalar("SELECT current_setting('synchronous_standby_names')")
        .fetch_one(&mut *conn)
        .await?;
    Ok((names, expected.to_owned()))
}

async fn drill(args: Args) -> anyhow::Result<()> {
    // Declared first, dropped last: the processes and the test database go before the servers.
    eprintln!("starting a PostgreSQL primary and its standby");
    let primary = PrivatePostgres::start()?;
    // The replication link: the standby streams through it, so the drill can stall it.
    let link = FaultProxy::start(primary.addr()).await?;
    let standby = PrivatePostgres::standby_streaming_from(&primary, STANDBY_NAME, link.port())?;
    let primary_admin = direct_pool(&primary.admin_url()).await?;
    let (standby_names, sync_state) = replicate(&primary_admin, args.replication).await?;
    eprintln!("standby streaming ({sync_state}; synchronous_standby_names = '{standby_names}')");
    let proxy = SwitchProxy::start(primary.addr()).await?;
    let mut env = TestEnv::start_on(
        "pgfailover",
        Services {
            admin_url: format!("postgres://postgres@{}/postgres", proxy.addr()),
            ..Services::shared()
        },
    )
    .await?;
    env.admin_listeners = true;

    eprintln!("seeding {} SMS reminders", args.deliveries);
    let tenant = env.tenant("clinic-pgfailover", 2).await?;
    let now = Utc::now();
    for i in 0..args.deliveries {
        env.reminder(
            tenant,
            &format!("f-{i}"),
            &[Channel::Sms],
            now,
            now + chrono::Duration::hours(1),
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
    let names = env.proc_names();

    let primary_db = direct_pool(&primary.url(&env.db_name)).await?;
    let quarter = i64::try_from(args.deliveries / 4).unwrap_or(i64::MAX);
    until("a quarter delivered", Duration::from_secs(600), || async {
        delivered(&primary_db).await.is_ok_and(|d| d >= quarter)
    })
    .await?;
    let lag = Duration::from_millis(args.standby_lag_ms);
    let delivered_at_stall = if lag.is_zero() {
        None
    } else {
        let at_stall = delivered(&primary_db).await?;
        link.pause(true);
        eprintln!(
            "replication link stalled ({at_stall} delivered); killing the primary in {} ms",
            lag.as_millis()
        );
        // The fault itself lasts this long: nothing is awaited here.
        tokio::time::sleep(lag).await;
        Some(at_stall)
    };
    let log_offsets = nudge_e2e::log_sizes(&env.dir, &names);
    // Every delivery's state on the primary, read as close to the kill as the drill can: what
    // the workers do on the primary between this read and the kill is not among them.
    let read_at = Utc::now();
    let before_kill = states_by_key(&primary_db).await?;
    let primary_lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&primary_db)
        .await?;
    let delivered_before_kill = i64::try_from(
        before_kill
            .values()
            .filter(|state| *state == "delivered")
            .count(),
    )?;
    let killed_at = Instant::now();
    primary.kill()?;
    // Once the SIGKILLs are sent: a request after this had no primary behind it.
    let killed_at_utc = Utc::now();
    eprintln!("killed the primary ({delivered_before_kill} delivered); promoting the standby");
    // Their connections went with the primary: nothing to close gracefully.
    drop(primary_db);
    drop(primary_admin);
    // What the stalled link held is lost with the primary's machine.
    link.refuse(true);
    link.cut();
    tokio::task::block_in_place(|| standby.promote())?;
    let promoted_at = Instant::now();
    let cut = proxy.retarget(standby.addr());
    let promotion_took = promoted_at - killed_at;
    eprintln!(
        "promoted in {} ms; the proxy now reaches the standby ({cut} links cut)",
        promotion_took.as_millis()
    );

    let new_primary = direct_pool(&standby.url(&env.db_name)).await?;
    let delivered_at_promotion = delivered(&new_primary).await?;
    let at_promotion = states_by_key(&new_primary).await?;
    let missing: HashSet<String> = settled(&before_kill)
        .difference(&settled(&at_promotion))
        .map(|key| (*key).to_owned())
        .collect();
    // Static after the promotion: the last WAL record the standby replayed.
    let wal_missing: Option<i64> =
        sqlx::query_scalar("SELECT pg_wal_lsn_diff($1::pg_lsn, pg_last_wal_replay_lsn())::bigint")
            .bind(&primary_lsn)
            .fetch_one(&new_primary)
            .await?;
    eprintln!(
        "{} outcomes settled on the primary are missing on the promoted standby ({:?} bytes of WAL)",
        missing.len(),
        wal_missing
    );
    let settle = Duration::from_secs(args.settle_within_s);
    let resumed = within(settle, || async {
        delivered(&new_primary)
            .await
            .is_ok_and(|d| d > delivered_at_promotion)
    })
    .await
    .map(|_| promoted_at.elapsed());
    let ready = within(settle.saturating_sub(promoted_at.elapsed()), || async {
        all_ready(&env, &names).await
    })
    .await
    .map(|_| promoted_at.elapsed());
    eprintln!(
        "deliveries moved again {:?} ms after the promotion; every process ready after {:?} ms",
        resumed.map(|d| d.as_millis()),
        ready.map(|d| d.as_millis())
    );
    // No reminder is added after the seeding, so whatever is owed now was owed at the fault.
    let settled = within(settle.saturating_sub(promoted_at.elapsed()), || async {
        live(&new_primary).await.is_ok_and(|n| n == 0)
    })
    .await
    .map(|_| promoted_at.elapsed());
    let total_s = started.elapsed().as_secs_f64();
    let still_owed = live(&new_primary).await?;
    let states = env.states().await?;
    let stub = stats(env.stub_stats().await?)?;
    let keys = keys_report(env.stub_keys().await?)?;
    let requests: HashMap<&str, usize> = keys
        .keys
        .iter()
        .map(|k| (k.key.as_str(), k.requests.len()))
        .collect();
    let final_states: HashMap<String, String> =
        sqlx::query_as::<_, (String, String)>("SELECT idempotency_key, state FROM deliveries")
            .fetch_all(&new_primary)
            .await?
            .into_iter()
            .collect();
    let sent_again = |key: &String| requests.get(key.as_str()).is_some_and(|n| *n > 1);
    let held = |key: &String| final_states.get(key).is_some_and(|s| s == "ambiguous");
    let missing_sent_again = missing.iter().filter(|k| sent_again(k)).count();
    let missing_held = missing.iter().filter(|k| !sent_again(k) && held(k)).count();
    let missing_delivered_once = missing
        .iter()
        .filter(|k| !sent_again(k) && final_states.get(*k).is_some_and(|s| s == "delivered"))
        .count();
    let mut unsettled_sent_again: BTreeMap<String, usize> = BTreeMap::new();
    for key in keys.keys.iter().filter(|k| k.requests.len() > 1) {
        if missing.contains(&key.key) {
            continue;
        }
        let state = |states: &HashMap<String, String>| {
            states.get(&key.key).cloned().unwrap_or_else(|| "?".into())
        };
        // When the provider first saw the key (the stub's clock is this machine's).
        let first = match key.requests.first().map(|r| r.at) {
            Some(at) if at < read_at => "first sent before the states were read",
            Some(at) if at < killed_at_utc => {
                "first sent after the states were read, before the kill"
            }
            Some(_) => "first sent after the kill",
            None => "?",
        };
        *unsettled_sent_again
            .entry(format!(
                "{} on the primary, {} on the standby, {first}",
                state(&before_kill),
                state(&at_promotion)
            ))
            .or_default() += 1;
    }
    let mut not_delivered: BTreeMap<String, usize> = BTreeMap::new();
    for (key, state) in final_states.iter().filter(|(_, s)| *s != "delivered") {
        let at = |states: &HashMap<String, String>| {
            states.get(key).cloned().unwrap_or_else(|| "?".into())
        };
        *not_delivered
            .entry(format!(
                "{state}: {} on the primary, {} on the standby, {} requests",
                at(&before_kill),
                at(&at_promotion),
                requests.get(key.as_str()).copied().unwrap_or(0)
            ))
            .or_default() += 1;
    }
    let never_sent = final_states
        .iter()
        .filter(|(key, state)| *state != "delivered" && !requests.contains_key(key.as_str()))
        .count();
    new_primary.close().await;
    let total = i64::try_from(args.deliveries).unwrap_or(i64::MAX);
    let delivered_total = states.get("delivered").copied().unwrap_or(0);
    let report = Report {
        replication: args.replication,
        deliveries: args.deliveries,
        synchronous_standby_names: standby_names,
        standby_sync_state: sync_state,
        standby_lag_ms: args.standby_lag_ms,
        delivered_at_stall,
        delivered_before_kill,
        states_read_before_kill_ms: Some((killed_at_utc - read_at).num_milliseconds()),
        wal_missing_at_promotion_bytes: wal_missing,
        outcomes_missing_at_promotion: Some(missing.len()),
        missing_outcomes_sent_again: Some(missing_sent_again),
        missing_outcomes_held_ambiguous: Some(missing_held),
        missing_outcomes_delivered_once: Some(missing_delivered_once),
        delivered_at_promotion,
        promotion_took_ms: promotion_took.as_millis(),
        deliveries_resumed_after_ms: resumed.map(|d| d.as_millis()),
        processes_ready_after_ms: ready.map(|d| d.as_millis()),
        last_owed_settled_after_ms: settled.map(|d| d.as_millis()),
        still_owed,
        total_s,
        lost: total - delivered_total,
        never_sent: Some(never_sent),
        held_ambiguous: states.get("ambiguous").copied().unwrap_or(0),
        states,
        provider_requests: stub.total.requests,
        provider_unique_keys: stub.total.unique_keys,
        keys_sent_more_than_once: keys.keys.iter().filter(|k| k.requests.len() > 1).count(),
        sent_again_unsettled_at_kill: Some(unsettled_sent_again),
        not_delivered_by_path: Some(not_delivered),
        logged_after_fault: nudge_e2e::logged_since(&env.dir, &names, &log_offsets),
        build: nudge_e2e::build_profile(),
    };
    env.stop_all(Duration::from_secs(10));
    drop(env);
    drop(proxy);
    drop(link);
    drop(standby);
    drop(primary);
    write_report(&report)?;
    if args.replication == Replication::Sync {
        // A delivery held `ambiguous` is not lost: it waits for review (invariant 4), and a
        // fence whose commit was in doubt at the kill (on the standby, never confirmed to the
        // worker, so nothing was sent) is held so too (invariant 9). The table shows them.
        anyhow::ensure!(
            report.lost - report.held_ambiguous == 0,
            "{} deliveries neither delivered nor held for review",
            report.lost - report.held_ambiguous
        );
        anyhow::ensure!(
            report.keys_sent_more_than_once == 0,
            "{} keys sent more than once",
            report.keys_sent_more_than_once
        );
        anyhow::ensure!(
            report.outcomes_missing_at_promotion == Some(0),
            "{:?} outcomes committed on the primary were missing on the promoted standby",
            report.outcomes_missing_at_promotion
        );
        anyhow::ensure!(
            report
                .deliveries_resumed_after_ms
                .is_some_and(|ms| ms <= 15_000),
            "deliveries did not move again within 15 s of the promotion"
        );
    }
    Ok(())
}

fn ms(value: Option<u128>) -> String {
    value.map_or_else(
        || "not within the settle time".to_owned(),
        |ms| format!("{ms} ms"),
    )
}

fn table(report: &Report) -> String {
    let mut logged = String::new();
    for (name, counts) in &report.logged_after_fault {
        let lines: Vec<String> = counts.iter().map(|(m, n)| format!("{m} ×{n}")).collect();
        logged.push_str(&format!(
            "| {name} logged after the kill | {} |\n",
            if lines.is_empty() {
                "no warning or error".to_owned()
            } else {
                lines.join("; ")
            }
        ));
    }
    let opt = |v: Option<usize>| v.map_or_else(|| "not measured".to_owned(), |n| n.to_string());
    let stall = match (report.standby_lag_ms, report.delivered_at_stall) {
        (0, _) => "none (the standby kept up on loopback)".to_owned(),
        (ms, Some(at)) => format!(
            "{ms} ms before the kill; {at} delivered on the primary when it began, {} at the \
             kill",
            report.delivered_before_kill
        ),
        (ms, None) => format!("{ms} ms before the kill"),
    };
    let missing = match report.outcomes_missing_at_promotion {
        None => "not measured".to_owned(),
        Some(n) => format!(
            "{n} (of them: sent again {}, held ambiguous {}, delivered with one request {}); \
             WAL not replayed: {} bytes; states read on the primary {} before the kill",
            opt(report.missing_outcomes_sent_again),
            opt(report.missing_outcomes_held_ambiguous),
            opt(report.missing_outcomes_delivered_once),
            report
                .wal_missing_at_promotion_bytes
                .map_or_else(|| "not measured".to_owned(), |b| b.to_string()),
            report
                .states_read_before_kill_ms
                .map_or_else(|| "not measured".to_owned(), |ms| format!("{ms} ms")),
        ),
    };
    let not_delivered = match &report.not_delivered_by_path {
        Some(paths) if !paths.is_empty() => {
            let parts: Vec<String> = paths.iter().map(|(p, n)| format!("{p} ×{n}")).collect();
            format!(" (every delivery not delivered: {})", parts.join("; "))
        }
        _ => String::new(),
    };
    let sent_again = match &report.sent_again_unsettled_at_kill {
        Some(by_state) if !by_state.is_empty() => {
            let parts: Vec<String> = by_state.iter().map(|(s, n)| format!("{s} ×{n}")).collect();
            format!(
                " ({} not among the missing outcomes: {})",
                by_state.values().sum::<usize>(),
                parts.join("; ")
            )
        }
        _ => String::new(),
    };
    format!(
        "| measure | value |\n|---|---|\n\
         | replication | {} (`synchronous_standby_names = '{}'`, standby `{}`) |\n\
         | deliveries | {} |\n\
         | replication link stalled | {stall} |\n\
         | delivered before the kill (on the primary) | {} |\n\
         | delivered on the standby at its promotion | {} |\n\
         | outcomes settled on the primary, missing on the standby at its promotion | {missing} |\n\
         | kill to promotion done (`pg_ctl promote -w`) | {} ms |\n\
         | deliveries moved again, after the promotion | {} |\n\
         | every process ready again, after the promotion | {} |\n\
         | last delivery owed at the fault settled, after the promotion | {} |\n\
         | still owed when the drill stopped waiting | {} |\n\
         | whole run | {:.1} s |\n\
         | states | {:?} |\n\
         | not delivered / held ambiguous / neither (lost) / never sent to the provider | {} / {} / {} / {} |\n\
         | provider requests / unique keys | {} / {} |\n\
         | keys sent more than once | {}{sent_again} |\n\
         | held ambiguous | {}{not_delivered} |\n\
         {logged}\
         | binaries | {} |\n",
        report.replication.name(),
        report.synchronous_standby_names,
        report.standby_sync_state,
        report.deliveries,
        report.delivered_before_kill,
        report.delivered_at_promotion,
        report.promotion_took_ms,
        ms(report.deliveries_resumed_after_ms),
        ms(report.processes_ready_after_ms),
        ms(report.last_owed_settled_after_ms),
        report.still_owed,
        report.total_s,
        report.states,
        report.lost,
        report.held_ambiguous,
        report.lost - report.held_ambiguous,
        opt(report.never_sent),
        report.provider_requests,
        report.provider_unique_keys,
        report.keys_sent_more_than_once,
        report.held_ambiguous,
        report.build,
    )
}

fn write_report(report: &Report) -> anyhow::Result<()> {
    println!("{}", table(report));
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/results");
    std::fs::create_dir_all(&dir)?;
    let stamp = Utc::now().format("%Y%m%dT%H%M%SZ");
    let mode = report.replication.name();
    std::fs::write(
        dir.join(format!("pg-failover-{mode}-{stamp}.json")),
        serde_json::to_string_pretty(report)?,
    )?;
    // The newest run of each mode and stall, side by side.
    let mut newest: BTreeMap<(u8, u64), (String, Report)> = BTreeMap::new();
    for (order, mode) in [Replication::Sync, Replication::Async]
        .into_iter()
        .enumerate()
    {
        let prefix = format!("pg-failover-{}-", mode.name());
        let mut files: Vec<String> = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .filter(|n| n.starts_with(&prefix) && n.ends_with(".json"))
            .collect();
        files.sort();
        for file in files {
            let run: Report = serde_json::from_str(&std::fs::read_to_string(dir.join(&file))?)
                .with_context(|| format!("failed to read {file}"))?;
            let order = u8::try_from(order).unwrap_or(u8::MAX);
            newest.insert((order, run.standby_lag_ms), (file, run));
        }
    }
    let mut latest = String::from(
        "# PostgreSQL failover drill\n\nThe newest run of each replication mode and replication \
         link stall (`--standby-lag-ms`; 0: not stalled, the standby kept up on loopback).\n",
    );
    for (file, run) in newest.values() {
        latest.push_str(&format!(
            "\n## {} replication, link stalled {} ms ({file})\n\n\
             `scripts/postgres-failover-test.sh --replication {} --deliveries {} \
             --standby-lag-ms {}` (a primary and a standby on one 2-core machine)\n\n{}",
            match run.replication {
                Replication::Sync => "Synchronous",
                Replication::Async => "Asynchronous",
            },
            run.standby_lag_ms,
            run.replication.name(),
            run.deliveries,
            run.standby_lag_ms,
            table(run)
        ));
    }
    std::fs::write(dir.join("pg-failover-latest.md"), latest)?;
    Ok(())
}
