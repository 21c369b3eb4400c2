//! Faults against the real processes: a worker killed mid-run, two producers at once, a
//! replayed window. Each asserts counts: nothing lost, duplicates within the bound, the right
//! terminal states.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, stats};
use nudge_ledger::WindowOutcome;

async fn count(env: &TestEnv, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(env.ledger.pool())
        .await
        .unwrap()
}

async fn seed_sms(env: &TestEnv, n: usize, prefix: &str) {
    let tenant = env.tenant(&format!("clinic-{prefix}"), 2).await.unwrap();
    let now = Utc::now();
    for i in 0..n {
        env.reminder(
            tenant,
            &format!("{prefix}-{i}"),
            &[Channel::Sms],
            now,
            now + chrono::Duration::minutes(10),
        )
        .await
        .unwrap();
    }
}

/// Kills worker A with SIGKILL once `kill_after` deliveries are done, while worker B goes on.
async fn run_with_a_killed_worker(
    env: &mut TestEnv,
    honours_idempotency: bool,
    total: i64,
    kill_after: i64,
) {
    // Slow sends, so the kill lands while work is in flight.
    env.script(
        "sms-main",
        serde_json::json!({"default": {"status": 202, "delay_ms": 150}}),
    )
    .await
    .unwrap();
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.accounts = vec![("sms-main".into(), honours_idempotency, true)];
    options.lease_seconds = 5;
    // The lease must cover a send and its wait (timeout + admission wait + margin).
    options.provider_timeout_ms = 2_000;
    options.prefetch = 8;
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    let a = env
        .start_worker(Channel::Sms, "worker-a", &options)
        .unwrap();
    env.start_worker(Channel::Sms, "worker-b", &options)
        .unwrap();

    let ledger = env.ledger.clone();
    env.wait_for("the first deliveries", Duration::from_secs(60), || {
        let ledger = ledger.clone();
        async move {
            let done: i64 =
                sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state = 'delivered'")
                    .fetch_one(ledger.pool())
                    .await?;
            Ok((done >= kill_after).then_some(()))
        }
    })
    .await;
    let in_flight_at_kill = count(
        env,
        "SELECT count(*) FROM deliveries WHERE state = 'sending'",
    )
    .await;
    env.proc(a).kill();

    let ledger = env.ledger.clone();
    env.wait_for("every delivery to reach a terminal or held state", Duration::from_secs(120), || {
        let ledger = ledger.clone();
        async move {
            let settled: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM deliveries WHERE state IN ('delivered','dead_lettered','expired','ambiguous','cancelled')",
            )
            .fetch_one(ledger.pool())
            .await?;
            Ok((settled == total).then_some(()))
        }
    })
    .await;
    eprintln!(
        "e2e kill: honours_idempotency={honours_idempotency} sending_at_kill={in_flight_at_kill}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_run_loses_nothing_and_an_idempotent_account_sees_each_key_accepted_once()
 {
    let mut env = TestEnv::start("kill-idem").await.unwrap();
    seed_sms(&env, 300, "k").await;

    run_with_a_killed_worker(&mut env, true, 300, 80).await;

    let states = env.states().await.unwrap();
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    let reaped = count(
        &env,
        "SELECT count(*) FROM attempts WHERE reason LIKE 'lease_expired%'",
    )
    .await;
    eprintln!(
        "e2e kill idempotent: states={states:?} reaped_leases={reaped} stub requests={} unique_keys={} accepted={} duplicate_requests={}",
        stub.total.requests, stub.total.unique_keys, stub.total.accepted, stub.total.duplicates
    );
    assert_eq!(states.get("delivered"), Some(&300), "{states:?}");
    assert_eq!(stub.total.unique_keys, 300);
    assert_eq!(stub.total.accepted, 300, "each key accepted exactly once");
    // A resend happens only for a lease that expired after its request may have left.
    assert!(
        i64::try_from(stub.total.duplicates).unwrap() <= reaped,
        "duplicate requests {} exceed the reaped leases {reaped}",
        stub.total.duplicates
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_send_on_an_account_without_idempotency_holds_its_work_as_ambiguous() {
    let mut env = TestEnv::start("kill-ambiguous").await.unwrap();
    seed_sms(&env, 200, "a").await;

    run_with_a_killed_worker(&mut env, false, 200, 60).await;

    let states = env.states().await.unwrap();
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    let ambiguous = *states.get("ambiguous").unwrap_or(&0);
    eprintln!(
        "e2e kill non-idempotent: states={states:?} stub requests={} unique_keys={} duplicate_requests={}",
        stub.total.requests, stub.total.unique_keys, stub.total.duplicates
    );
    assert_eq!(
        states.get("delivered").unwrap_or(&0) + ambiguous,
        200,
        "{states:?}"
    );
    assert!(
        ambiguous > 0,
        "the killed worker held leases mid-send: {states:?}"
    );
    assert_eq!(
        stub.total.duplicates, 0,
        "work that may have been sent is never resent automatically"
    );
    assert_eq!(stub.total.requests, stub.total.unique_keys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_producers_at_once_and_a_replayed_window_create_each_delivery_once() {
    let mut env = TestEnv::start("producers").await.unwrap();
    let tenant = env.tenant("clinic-p", 3).await.unwrap();
    // Due over the next few seconds, so both producers' windows and relays race for them.
    let base = Utc::now() + chrono::Duration::seconds(2);
    for i in 0..240 {
        let at = base + chrono::Duration::milliseconds(i * 25);
        env.reminder(
            tenant,
            &format!("p-{i}"),
            &[Channel::Sms],
            at,
            at + chrono::Duration::minutes(10),
        )
        .await
        .unwrap();
    }
    env.start_producer("producer-1").unwrap();
    let second = env.start_producer("producer-2").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    env.start_worker(
        Channel::Sms,
        "worker-sms",
        &WorkerOptions::for_channel(Channel::Sms),
    )
    .unwrap();

    let ledger = env.ledger.clone();
    env.wait_for("all 240 to be delivered", Duration::from_secs(90), || {
        let ledger = ledger.clone();
        async move {
            let done: i64 =
                sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state = 'delivered'")
                    .fetch_one(ledger.pool())
                    .await?;
            Ok((done == 240).then_some(()))
        }
    })
    .await;

    // Restart a producer: it replays from the last window and must create nothing.
    env.proc(second).kill();
    env.start_producer("producer-2-again").unwrap();
    let intents_before = count(&env, "SELECT count(*) FROM run_intents").await;
    let first_window: (chrono::DateTime<Utc>, chrono::DateTime<Utc>) = sqlx::query_as(
        "SELECT window_start, window_end FROM run_intents ORDER BY window_start LIMIT 1",
    )
    .fetch_one(env.ledger.pool())
    .await
    .unwrap();
    let replay = env
        .ledger
        .materialise_window(tenant, first_window.0, first_window.1, Utc::now())
        .await
        .unwrap();
    let ledger = env.ledger.clone();
    env.wait_for(
        "the restarted producer to run a window",
        Duration::from_secs(30),
        || {
            let ledger = ledger.clone();
            async move {
                let n: i64 = sqlx::query_scalar("SELECT count(*) FROM run_intents")
                    .fetch_one(ledger.pool())
                    .await?;
                Ok((n > intents_before).then_some(()))
            }
        },
    )
    .await;

    let deliveries = count(&env, "SELECT count(*) FROM deliveries").await;
    let overlaps = count(
        &env,
        "SELECT count(*) FROM run_intents a JOIN run_intents b
           ON a.tenant_id = b.tenant_id AND a.id < b.id
          AND a.window_start < b.window_end AND b.window_start < a.window_end",
    )
    .await;
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    eprintln!(
        "e2e producers: deliveries={deliveries} run_intents={} overlapping_windows={overlaps} replay={replay:?} stub accepted={} duplicates={}",
        count(&env, "SELECT count(*) FROM run_intents").await,
        stub.total.accepted,
        stub.total.duplicates
    );
    assert_eq!(deliveries, 240);
    assert_eq!(overlaps, 0, "windows are contiguous and never overlap");
    assert_eq!(replay, WindowOutcome::AlreadyRun);
    assert_eq!(stub.total.accepted, 240);
    assert_eq!(stub.total.duplicates, 0);
    let stopped = env.stop_all(Duration::from_secs(15));
    assert!(
        stopped.iter().all(|(_, code)| *code == Some(0)),
        "{stopped:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_while_sends_wait_for_their_slots_hands_them_back_unsent() {
    let mut env = TestEnv::start("shutdown-handback").await.unwrap();
    seed_sms(&env, 60, "h").await;
    // A slow bucket and a long admission wait: at SIGTERM many sends wait for their slot.
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.rate = Some((4.0, 1));
    options.max_wait_ms = 8_000;
    options.prefetch = 40;
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    let first = env
        .start_worker(Channel::Sms, "worker-first", &options)
        .unwrap();
    let ledger = env.ledger.clone();
    env.wait_for("sends waiting for their slots", Duration::from_secs(30), || {
        let ledger = ledger.clone();
        async move {
            let (delivered, sending): (i64, i64) = sqlx::query_as(
                "SELECT count(*) FILTER (WHERE state = 'delivered'), count(*) FILTER (WHERE state = 'sending') FROM deliveries",
            )
            .fetch_one(ledger.pool())
            .await?;
            Ok((delivered >= 3 && sending >= 10).then_some(()))
        }
    })
    .await;

    let stopped = std::time::Instant::now();
    let code = env.proc(first).terminate(Duration::from_secs(15));
    let took = stopped.elapsed();
    let handed_back = count(
        &env,
        "SELECT count(*) FROM deliveries WHERE state = 'retry_wait' AND attempt_count = 0",
    )
    .await;
    let still_leased = count(
        &env,
        "SELECT count(*) FROM deliveries WHERE state = 'sending'",
    )
    .await;
    eprintln!(
        "e2e shutdown: exit={code:?} took_ms={} handed_back={handed_back} still_leased={still_leased}",
        took.as_millis()
    );
    assert_eq!(code, Some(0));
    assert!(
        took < Duration::from_secs(4),
        "waited out its slots instead of stopping: {took:?}"
    );
    assert!(
        handed_back >= 5,
        "waiting sends were handed back unsent: {handed_back}"
    );
    assert_eq!(still_leased, 0, "no lease left for the reaper");

    env.start_worker(Channel::Sms, "worker-second", &options)
        .unwrap();
    let ledger = env.ledger.clone();
    env.wait_for("all 60 delivered", Duration::from_secs(60), || {
        let ledger = ledger.clone();
        async move {
            let done: i64 =
                sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state = 'delivered'")
                    .fetch_one(ledger.pool())
                    .await?;
            Ok((done == 60).then_some(()))
        }
    })
    .await;
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    let reaped = count(
        &env,
        "SELECT count(*) FROM attempts WHERE reason LIKE 'lease_expired%'",
    )
    .await;
    assert_eq!(reaped, 0);
    assert_eq!((stub.total.accepted, stub.total.duplicates), (60, 0));
}
