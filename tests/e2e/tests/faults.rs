//! Faults against the real processes: a worker killed mid-run, two producers at once, a
//! replayed window. Each asserts counts: nothing lost, duplicates within the bound, the right
//! terminal states.
//!
//! A test binary of its own, not a module of `it`: a SIGTERMed worker must stop within 4 s and
//! the duplicates and reaped leases a kill leaves depend on timing, bounds set with only these
//! tests (two at a time) on the machine; another test's processes beside them would move them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::collections::HashSet;
use std::time::Duration;

use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, count_in, keys_report, settled, states_in, stats};

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

/// Kills worker A with SIGKILL once `kill_after` deliveries are done, while worker B goes on;
/// returns the deliveries A held leases on when it died.
async fn run_with_a_killed_worker(
    env: &mut TestEnv,
    honours_idempotency: bool,
    total: i64,
    kill_after: i64,
) -> HashSet<uuid::Uuid> {
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

    let a_pid = env.proc(a).pid();
    let ledger = env.ledger.clone();
    // The kill must land mid-send: wait for the first deliveries and for a send of worker a
    // under way (its fence stamped; each send takes 150 ms at the stub, so the kill, a few
    // milliseconds after the check, finds it still in flight).
    env.wait_for(
        "the first deliveries and a send of worker a in flight",
        Duration::from_secs(60),
        || {
            let ledger = ledger.clone();
            async move {
                let (done, in_flight): (i64, bool) = sqlx::query_as(
                    "SELECT count(*) FILTER (WHERE state = 'delivered'),
                            COALESCE(bool_or(state = 'sending' AND send_started_at IS NOT NULL
                                             AND lease_owner LIKE $1), false)
                     FROM deliveries",
                )
                .bind(format!("sms-{a_pid}-%"))
                .fetch_one(ledger.pool())
                .await?;
                Ok((done >= kill_after && in_flight).then_some(()))
            }
        },
    )
    .await;
    env.proc(a).kill();
    // Worker ids are `<channel>-<pid>-<random>`; a lease lasts 5 s, far longer than this read.
    let held_by_a: HashSet<uuid::Uuid> = sqlx::query_scalar(
        "SELECT id FROM deliveries WHERE state = 'sending' AND lease_owner LIKE $1",
    )
    .bind(format!("sms-{a_pid}-%"))
    .fetch_all(env.ledger.pool())
    .await
    .unwrap()
    .into_iter()
    .collect();

    let ledger = env.ledger.clone();
    env.wait_for(
        "every delivery to reach a terminal or held state",
        Duration::from_secs(120),
        || {
            let ledger = ledger.clone();
            async move {
                let settled = settled(&states_in(&ledger).await?);
                Ok((settled == total).then_some(()))
            }
        },
    )
    .await;
    eprintln!(
        "e2e kill: honours_idempotency={honours_idempotency} held_by_killed_worker={}",
        held_by_a.len()
    );
    held_by_a
}

/// The deliveries the janitor's lease reaper decided, from its attempt rows.
async fn reaped(env: &TestEnv) -> HashSet<uuid::Uuid> {
    sqlx::query_scalar(
        "SELECT delivery_id FROM attempts
          WHERE worker = 'lease-reaper' AND reason LIKE 'lease_expired%'",
    )
    .fetch_all(env.ledger.pool())
    .await
    .unwrap()
    .into_iter()
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_run_loses_nothing_and_an_idempotent_account_sees_each_key_accepted_once()
 {
    let mut env = TestEnv::start("kill-idem").await.unwrap();
    seed_sms(&env, 300, "k").await;

    let held = run_with_a_killed_worker(&mut env, true, 300, 80).await;

    let states = env.states().await.unwrap();
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    let reaped = reaped(&env).await;
    // Deliveries whose key the stub saw more than once.
    let keys = keys_report(env.stub_keys().await.unwrap()).unwrap();
    let resent: HashSet<String> = keys
        .keys
        .iter()
        .filter(|k| k.requests.len() > 1)
        .map(|k| k.key.clone())
        .collect();
    let reaped_keys: HashSet<String> =
        sqlx::query_scalar("SELECT idempotency_key FROM deliveries WHERE id = ANY($1)")
            .bind(reaped.iter().copied().collect::<Vec<_>>())
            .fetch_all(env.ledger.pool())
            .await
            .unwrap()
            .into_iter()
            .collect();
    eprintln!(
        "e2e kill idempotent: states={states:?} held_by_killed_worker={} reaped_leases={} resent_keys={} stub requests={} unique_keys={} accepted={} duplicate_requests={}",
        held.len(),
        reaped.len(),
        resent.len(),
        stub.total.requests,
        stub.total.unique_keys,
        stub.total.accepted,
        stub.total.duplicates
    );
    assert_eq!(states.get("delivered"), Some(&300), "{states:?}");
    assert_eq!(stub.total.unique_keys, 300);
    assert_eq!(stub.total.accepted, 300, "each key accepted exactly once");
    // The reaper really ran: it decided leases, and only leases of the killed worker.
    assert!(
        !held.is_empty(),
        "the kill landed while worker A held leases"
    );
    assert!(!reaped.is_empty(), "no lease was reaped");
    assert!(
        reaped.is_subset(&held),
        "the reaper decided a lease the killed worker did not hold"
    );
    // Every resend is one of those reaped leases, sent again: nothing else sent a key twice.
    // (A reaped lease whose request had not yet left is retried without a duplicate.)
    assert!(
        resent.is_subset(&reaped_keys),
        "keys resent without a reaped lease: {:?}",
        resent.difference(&reaped_keys).collect::<Vec<_>>()
    );
    assert!(
        !resent.is_empty() && resent.len() <= reaped.len(),
        "resent keys {} against reaped leases {}",
        resent.len(),
        reaped.len()
    );
    assert_eq!(
        usize::try_from(stub.total.duplicates).unwrap(),
        resent.len(),
        "each reaped key was sent at most once more"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_send_on_an_account_without_idempotency_holds_its_work_as_ambiguous() {
    let mut env = TestEnv::start("kill-ambiguous").await.unwrap();
    seed_sms(&env, 200, "a").await;

    let held = run_with_a_killed_worker(&mut env, false, 200, 60).await;

    let states = env.states().await.unwrap();
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    let ambiguous = *states.get("ambiguous").unwrap_or(&0);
    let reaped = reaped(&env).await;
    let ambiguous_ids: HashSet<uuid::Uuid> =
        sqlx::query_scalar("SELECT id FROM deliveries WHERE state = 'ambiguous'")
            .fetch_all(env.ledger.pool())
            .await
            .unwrap()
            .into_iter()
            .collect();
    eprintln!(
        "e2e kill non-idempotent: states={states:?} held_by_killed_worker={} reaped_leases={} stub requests={} unique_keys={} duplicate_requests={}",
        held.len(),
        reaped.len(),
        stub.total.requests,
        stub.total.unique_keys,
        stub.total.duplicates
    );
    assert!(!reaped.is_empty(), "no lease was reaped");
    assert!(
        reaped.is_subset(&held),
        "the reaper decided a lease the killed worker did not hold"
    );
    assert_eq!(
        ambiguous_ids, reaped,
        "exactly the reaped leases are held as ambiguous"
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
    let first_producer = env.start_producer("producer-1").unwrap();
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
            let done = count_in(&ledger, "delivered").await?;
            Ok((done == 240).then_some(()))
        }
    })
    .await;

    // Both producers stop, and the clock's memory of this tenant's windows is lost (as after a
    // restore of the run intents): the restarted producer replays every window from the
    // tenant's first, over reminders whose deliveries exist and were sent, and must create
    // nothing.
    let first = env
        .proc(first_producer)
        .terminate(Duration::from_secs(15))
        .expect("producer-1 exits on SIGTERM");
    assert_eq!(first, 0);
    env.proc(second).kill();
    sqlx::query("DELETE FROM run_intents WHERE tenant_id = $1")
        .bind(tenant.as_uuid())
        .execute(env.ledger.pool())
        .await
        .unwrap();
    env.start_producer("producer-2-again").unwrap();
    let ledger = env.ledger.clone();
    env.wait_for(
        "the restarted producer to replay windows over every reminder",
        Duration::from_secs(30),
        || {
            let ledger = ledger.clone();
            async move {
                let covered: bool = sqlx::query_scalar(
                    "SELECT coalesce(min(i.window_start) <= min(r.scheduled_at)
                                 AND max(i.window_end) > max(r.scheduled_at), false)
                     FROM run_intents i, reminders r",
                )
                .fetch_one(ledger.pool())
                .await?;
                Ok(covered.then_some(()))
            }
        },
    )
    .await;
    let replayed_created = count(
        &env,
        "SELECT coalesce(sum(deliveries_created), 0)::bigint FROM run_intents",
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
        "e2e producers: deliveries={deliveries} run_intents={} overlapping_windows={overlaps} replayed_created={replayed_created} stub accepted={} duplicates={}",
        count(&env, "SELECT count(*) FROM run_intents").await,
        stub.total.accepted,
        stub.total.duplicates
    );
    assert_eq!(deliveries, 240);
    assert_eq!(overlaps, 0, "windows are contiguous and never overlap");
    assert_eq!(
        replayed_created, 0,
        "the restarted producer's replayed windows created nothing"
    );
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
    env.wait_for(
        "sends waiting for their slots",
        Duration::from_secs(30),
        || {
            let ledger = ledger.clone();
            async move {
                let states = states_in(&ledger).await?;
                let at = |state: &str| states.get(state).copied().unwrap_or(0);
                let (delivered, sending) = (at("delivered"), at("sending"));
                Ok((delivered >= 3 && sending >= 10).then_some(()))
            }
        },
    )
    .await;

    let stopped = std::time::Instant::now();
    let code = env.proc(first).terminate(Duration::from_secs(15));
    let took = stopped.elapsed();
    let handed_back = count(
        &env,
        "SELECT count(*) FROM deliveries WHERE state = 'retry_wait' AND attempt_count = 0",
    )
    .await;
    let still_leased = count_in(&env.ledger, "sending").await.unwrap();
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
            let done = count_in(&ledger, "delivered").await?;
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
