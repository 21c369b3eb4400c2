//! Faults of the services and of the processes themselves, with deliveries in flight: RabbitMQ
//! restarted, PostgreSQL restarted, a proxy that cuts and delays every connection, each binary
//! SIGKILLed in turn, and one of two workers SIGKILLed and not restarted. Each test asserts
//! counts (every delivery delivered, each key accepted exactly once by an account that dedups by
//! key: the key's bound), that every process is back at work with no restart by hand (a killed
//! process is restarted the way a supervisor does), and the patient's view: how long after the
//! fault ended the last delivery owed at the fault was settled.
//!
//! "Owed at the fault" is what a fault can strand: the deliveries published (`queued`) or being
//! sent (`sending`) when it struck, whose messages, leases and outcomes a crash or a cut loses.
//! The bucket (50/s; 25/s for the ten kills in turn) keeps about a second of work in flight, so
//! that set is what recovery decides; the rest is paced by the bucket whatever happens.
//!
//! A test that stops a service stops its own ([`nudge_e2e::private`]): the machine's shared
//! PostgreSQL and RabbitMQ stay up for every other test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::{Duration, Instant};

use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::private::{PrivatePostgres, RabbitNode, with_private_postgres, with_private_rabbit};
use nudge_e2e::{Services, TestEnv, WorkerOptions, count_in, stats};
use nudge_testkit::FaultProxy;

/// Sends are slowed so that work is in flight whenever a fault lands.
const SEND_DELAY_MS: u64 = 60;
/// Generous: after a fault ends, reconnects back off up to 5 s and a loaded 2-core machine
/// answers slowly. Measured recoveries are printed; this is only the bound that fails a test.
const RECOVERY_BOUND: Duration = Duration::from_secs(60);

/// How long PostgreSQL stays down once every process has seen it go.
const PG_OUTAGE: Duration = Duration::from_secs(3);

/// The patient's view: every delivery owed at a fault is settled within this long of the
/// fault's end...
const PATIENT_TARGET: Duration = Duration::from_secs(10);
/// ...give or take this, for a loaded 2-core machine (process start-up, reconnect backoff).
const PATIENT_TOLERANCE: Duration = Duration::from_secs(5);

/// The deliveries owed at a fault (see the module docs), read when it strikes.
async fn owed_at_fault(env: &TestEnv) -> Vec<uuid::Uuid> {
    sqlx::query_scalar("SELECT id FROM deliveries WHERE state IN ('queued', 'sending')")
        .fetch_all(env.ledger.pool())
        .await
        .unwrap()
}

/// How long after `ended` the last of `owed` was settled (delivered, or held or settled
/// otherwise: anything but owed), asserted within [`PATIENT_TARGET`] + [`PATIENT_TOLERANCE`].
async fn patient_view(
    env: &mut TestEnv,
    fault: &str,
    owed: &[uuid::Uuid],
    ended: Instant,
) -> Duration {
    let ledger = env.ledger.clone();
    let owed = owed.to_vec();
    let bound = (PATIENT_TARGET + PATIENT_TOLERANCE) * 4;
    let settled = env
        .wait_for(
            &format!(
                "the {} deliveries owed at the fault ({fault}) settled",
                owed.len()
            ),
            bound.saturating_sub(ended.elapsed()),
            || {
                let (ledger, owed) = (ledger.clone(), owed.clone());
                async move {
                    let still: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM deliveries WHERE id = ANY($1)
                           AND state IN ('scheduled', 'queued', 'sending', 'retry_wait')",
                    )
                    .bind(&owed)
                    .fetch_one(ledger.pool())
                    .await?;
                    Ok((still == 0).then(|| ended.elapsed()))
                }
            },
        )
        .await;
    eprintln!(
        "fault {fault}: owed_at_fault={} last_owed_settled_ms={} (target {} ms + {} ms)",
        owed.len(),
        settled.as_millis(),
        PATIENT_TARGET.as_millis(),
        PATIENT_TOLERANCE.as_millis()
    );
    assert!(
        settled <= PATIENT_TARGET + PATIENT_TOLERANCE,
        "fault {fault}: the last of {} deliveries owed at the fault settled {} ms after it ended",
        owed.len(),
        settled.as_millis()
    );
    settled
}

/// The processes of one pipeline, by index in the environment.
struct Pipeline {
    procs: Vec<usize>,
    total: i64,
}

async fn delivered(env: &TestEnv) -> anyhow::Result<i64> {
    count_in(&env.ledger, "delivered").await
}

/// Seeds `total` SMS reminders due now and starts a producer, a janitor and `workers` SMS
/// workers with admin listeners, against an account that dedups by key, its bucket at `rate`
/// per second.
async fn start_pipeline(env: &mut TestEnv, total: usize, workers: usize, rate: f64) -> Pipeline {
    env.admin_listeners = true;
    let tenant = env.tenant("clinic-faults", 2).await.unwrap();
    let now = Utc::now();
    for i in 0..total {
        env.reminder(
            tenant,
            &format!("f-{i}"),
            &[Channel::Sms],
            now,
            now + chrono::Duration::minutes(20),
        )
        .await
        .unwrap();
    }
    env.script(
        "sms-main",
        serde_json::json!({"default": {"status": 202, "delay_ms": SEND_DELAY_MS}}),
    )
    .await
    .unwrap();
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.prefetch = 4;
    options.provider_timeout_ms = 2_000;
    options.rate = Some((rate, 10));
    let mut procs = vec![
        env.start_producer("producer").unwrap(),
        env.start_janitor(200, 1_000).unwrap(),
    ];
    for w in 0..workers {
        procs.push(
            env.start_worker(Channel::Sms, &format!("worker-{w}"), &options)
                .unwrap(),
        );
    }
    Pipeline {
        procs,
        total: i64::try_from(total).unwrap(),
    }
}

/// Waits until `at_least` deliveries are delivered (the pipeline is working before a fault).
async fn wait_delivered(env: &mut TestEnv, at_least: i64, within: Duration) {
    let ledger = env.ledger.clone();
    env.wait_for(&format!("{at_least} deliveries delivered"), within, || {
        let ledger = ledger.clone();
        async move {
            let done = count_in(&ledger, "delivered").await?;
            Ok((done >= at_least).then_some(()))
        }
    })
    .await;
}

/// After a fault ended at `ended` with `before` deliveries delivered: how long until deliveries
/// move again and every process answers ready (the later of the two). Fails past
/// [`RECOVERY_BOUND`], with the processes' logs.
async fn recovery(env: &mut TestEnv, names: &[String], before: i64, ended: Instant) -> Duration {
    let ledger = env.ledger.clone();
    let http = env.http.clone();
    let ready_urls: Vec<String> = names
        .iter()
        .map(|name| format!("{}/readyz", env.admin_url(name).unwrap()))
        .collect();
    let progressed = std::sync::Arc::new(std::sync::Mutex::new(None::<Duration>));
    let ready = std::sync::Arc::new(std::sync::Mutex::new(None::<Duration>));
    let remaining = RECOVERY_BOUND.saturating_sub(ended.elapsed());
    env.wait_for("every process back at work", remaining, || {
        let (ledger, http, ready_urls) = (ledger.clone(), http.clone(), ready_urls.clone());
        let (progressed, ready) = (progressed.clone(), ready.clone());
        async move {
            if progressed.lock().unwrap().is_none() {
                let done = count_in(&ledger, "delivered").await?;
                if done > before {
                    *progressed.lock().unwrap() = Some(ended.elapsed());
                }
            }
            if ready.lock().unwrap().is_none() {
                let mut all = true;
                for url in &ready_urls {
                    let ok = http
                        .get(url)
                        .timeout(Duration::from_secs(2))
                        .send()
                        .await
                        .is_ok_and(|r| r.status().is_success());
                    all &= ok;
                }
                if all {
                    *ready.lock().unwrap() = Some(ended.elapsed());
                }
            }
            let both = (*progressed.lock().unwrap()).zip(*ready.lock().unwrap());
            Ok(both.map(|(p, r)| p.max(r)))
        }
    })
    .await
}

/// Waits until no process answers `/readyz` with 200 (each has seen the outage).
async fn wait_all_unready(env: &mut TestEnv, names: &[String]) {
    let http = env.http.clone();
    let ready_urls: Vec<String> = names
        .iter()
        .map(|name| format!("{}/readyz", env.admin_url(name).unwrap()))
        .collect();
    env.wait_for("every process to see the outage", RECOVERY_BOUND, || {
        let (http, ready_urls) = (http.clone(), ready_urls.clone());
        async move {
            for url in &ready_urls {
                let ready = http
                    .get(url)
                    .timeout(Duration::from_secs(5))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if ready {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        }
    })
    .await;
}

/// Waits for every delivery to be delivered and checks the counts: each key accepted exactly
/// once, every process still running (none restarted by hand). Returns the duplicate requests
/// the provider saw (resends the key made harmless).
async fn finish(env: &mut TestEnv, pipeline: &Pipeline, fault: &str) -> u64 {
    let total = pipeline.total;
    wait_delivered(env, total, Duration::from_secs(240)).await;
    let states = env.states().await.unwrap();
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    for &index in &pipeline.procs {
        let proc = env.proc(index);
        assert!(
            proc.is_running(),
            "{} exited: {}",
            proc.name,
            proc.log_tail(20)
        );
    }
    eprintln!(
        "fault {fault}: states={states:?} provider requests={} unique_keys={} accepted={} duplicate_requests={}",
        stub.total.requests, stub.total.unique_keys, stub.total.accepted, stub.total.duplicates
    );
    assert_eq!(states.get("delivered"), Some(&total), "{states:?}");
    assert_eq!(i64::try_from(stub.total.unique_keys).unwrap(), total);
    assert_eq!(
        i64::try_from(stub.total.accepted).unwrap(),
        total,
        "each key accepted exactly once"
    );
    stub.total.duplicates
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_restarted_mid_run_loses_nothing_and_every_process_reconnects_on_its_own() {
    let _alone = crate::alone().await;
    let mut node = RabbitNode::start("restart").unwrap();
    let mut env = TestEnv::start_on("broker-restart", with_private_rabbit(&node))
        .await
        .unwrap();
    let pipeline = start_pipeline(&mut env, 400, 1, 50.0).await;
    let names = env.proc_names();
    wait_delivered(&mut env, 60, Duration::from_secs(90)).await;

    let owed = owed_at_fault(&env).await;
    let down = Instant::now();
    node.stop().unwrap();
    let before = delivered(&env).await.unwrap();
    node.restart().unwrap();
    let outage = down.elapsed();
    let ended = Instant::now();
    let back = recovery(&mut env, &names, before, ended).await;
    patient_view(&mut env, "rabbitmq-restart", &owed, ended).await;
    let duplicates = finish(&mut env, &pipeline, "rabbitmq-restart").await;
    eprintln!(
        "fault rabbitmq-restart: outage_ms={} recovered_ms={} delivered_before={before} duplicate_requests={duplicates}",
        outage.as_millis(),
        back.as_millis()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_restarted_mid_run_loses_nothing_and_every_process_reconnects_on_its_own() {
    let _alone = crate::alone().await;
    let postgres = PrivatePostgres::start().unwrap();
    let mut env = TestEnv::start_on("pg-restart", with_private_postgres(&postgres))
        .await
        .unwrap();
    let pipeline = start_pipeline(&mut env, 400, 1, 50.0).await;
    let names = env.proc_names();
    wait_delivered(&mut env, 60, Duration::from_secs(90)).await;

    let before = delivered(&env).await.unwrap();
    let owed = owed_at_fault(&env).await;
    let down = Instant::now();
    postgres.stop().unwrap();
    // Down until every process has noticed (each `/readyz` fails while the ledger is away),
    // and then for the outage's stated length: a parameter of the fault, not a wait for an
    // effect, so that sends in flight finish and their outcomes wait for the ledger.
    wait_all_unready(&mut env, &names).await;
    tokio::time::sleep(PG_OUTAGE).await;
    postgres.restart().unwrap();
    let outage = down.elapsed();
    let ended = Instant::now();
    let back = recovery(&mut env, &names, before, ended).await;
    patient_view(&mut env, "postgresql-restart", &owed, ended).await;
    let duplicates = finish(&mut env, &pipeline, "postgresql-restart").await;
    eprintln!(
        "fault postgresql-restart: outage_ms={} recovered_ms={} delivered_before={before} duplicate_requests={duplicates}",
        outage.as_millis(),
        back.as_millis()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_and_delayed_between_the_processes_and_both_services_lose_nothing() {
    let _alone = crate::alone().await;
    let services = Services::shared();
    let amqp_upstream = services
        .amqp_url
        .rsplit('@')
        .next()
        .and_then(|rest| rest.split('/').next())
        .unwrap()
        .to_owned();
    let pg_upstream = services
        .admin_url
        .rsplit('@')
        .next()
        .and_then(|rest| rest.split('/').next())
        .unwrap()
        .to_owned();
    let amqp_proxy = FaultProxy::start(amqp_upstream.clone()).await.unwrap();
    let pg_proxy = FaultProxy::start(pg_upstream.clone()).await.unwrap();
    let mut env = TestEnv::start_on("proxy-faults", services).await.unwrap();
    env.process_db_url = env.db_url.replacen(&pg_upstream, &pg_proxy.addr(), 1);
    env.process_amqp_urls =
        vec![
            env.services
                .amqp_url
                .replacen(&amqp_upstream, &amqp_proxy.addr(), 1),
        ];
    let pipeline = start_pipeline(&mut env, 500, 1, 50.0).await;
    let names = env.proc_names();
    wait_delivered(&mut env, 40, Duration::from_secs(90)).await;

    let mut recoveries = Vec::new();
    for round in 0..3 {
        // Slow links for a while (each chunk each way), then every connection cut at once.
        amqp_proxy.set_latency(Duration::from_millis(40));
        pg_proxy.set_latency(Duration::from_millis(40));
        let before_slow = delivered(&env).await.unwrap();
        wait_delivered(&mut env, before_slow + 20, Duration::from_secs(60)).await;
        amqp_proxy.set_latency(Duration::ZERO);
        pg_proxy.set_latency(Duration::ZERO);
        let before = delivered(&env).await.unwrap();
        let owed = owed_at_fault(&env).await;
        let cut = (amqp_proxy.cut(), pg_proxy.cut());
        let ended = Instant::now();
        let back = recovery(&mut env, &names, before, ended).await;
        patient_view(&mut env, &format!("proxy-cut-{round}"), &owed, ended).await;
        eprintln!(
            "fault proxy round {round}: cut amqp={} postgres={} connections, recovered_ms={}",
            cut.0,
            cut.1,
            back.as_millis()
        );
        assert!(cut.0 > 0 && cut.1 > 0, "the cut found connections: {cut:?}");
        recoveries.push(back.as_millis());
    }
    let duplicates = finish(&mut env, &pipeline, "proxy").await;
    eprintln!("fault proxy: recovered_ms={recoveries:?} duplicate_requests={duplicates}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_binary_sigkilled_in_turn_and_restarted_loses_nothing() {
    let _alone = crate::alone().await;
    let mut env = TestEnv::start("kill-loop").await.unwrap();
    // Ten kills, each waiting for its owed deliveries (a worker's a lease length): the bucket
    // paces the run to last through all of them.
    let pipeline = start_pipeline(&mut env, 1_200, 2, 25.0).await;
    let (intake, _) = env.start_intake("intake").await.unwrap();
    let mut procs = pipeline.procs.clone();
    procs.push(intake);
    let names = env.proc_names();
    wait_delivered(&mut env, 40, Duration::from_secs(90)).await;

    let mut recoveries = Vec::new();
    for round in 0..2 {
        for &index in &procs {
            let name = env.proc(index).name.clone();
            let before = delivered(&env).await.unwrap();
            let owed = owed_at_fault(&env).await;
            env.proc(index).kill();
            env.restart(index).unwrap();
            let ended = Instant::now();
            let back = recovery(&mut env, &names, before, ended).await;
            patient_view(&mut env, &format!("sigkill-{round}-{name}"), &owed, ended).await;
            eprintln!(
                "fault sigkill round {round}: {name} recovered_ms={}",
                back.as_millis()
            );
            recoveries.push((name, back.as_millis()));
        }
    }
    let duplicates = finish(
        &mut env,
        &Pipeline {
            procs,
            total: pipeline.total,
        },
        "sigkill",
    )
    .await;
    eprintln!("fault sigkill: recovered_ms={recoveries:?} duplicate_requests={duplicates}");
}

/// One of two workers SIGKILLed and not restarted (a node lost): its leases lapse one lease
/// length after its last heartbeat, the reaper hands them on, and the other worker sends them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_sigkilled_and_not_restarted_strands_nothing_beyond_a_lease_length() {
    let _alone = crate::alone().await;
    let mut env = TestEnv::start("kill-one").await.unwrap();
    let pipeline = start_pipeline(&mut env, 500, 2, 50.0).await;
    wait_delivered(&mut env, 60, Duration::from_secs(90)).await;
    let killed = *pipeline.procs.last().unwrap();

    let leased_by_killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deliveries WHERE state = 'sending' AND lease_owner LIKE $1",
    )
    .bind(format!("sms-{}-%", env.proc(killed).pid()))
    .fetch_one(env.ledger.pool())
    .await
    .unwrap();
    let owed = owed_at_fault(&env).await;
    env.proc(killed).kill();
    let ended = Instant::now();
    patient_view(&mut env, "worker-sigkill", &owed, ended).await;
    let survivors = Pipeline {
        procs: pipeline.procs[..pipeline.procs.len() - 1].to_vec(),
        total: pipeline.total,
    };
    let duplicates = finish(&mut env, &survivors, "worker-sigkill").await;
    eprintln!(
        "fault worker-sigkill: leases held by the killed worker at the kill={leased_by_killed} duplicate_requests={duplicates}"
    );
}
