//! The worker's one step (`Worker::process_batch`) against a real ledger (a fresh database per
//! test) and the provider stub in-process: what is sent, what is recorded, and what a skewed
//! clock, a hanging provider or a ledger outage do to it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use nudge_domain::{AdmissionSettings, Channel, DeliveryState, ProviderAccount, RetryPolicy};
use nudge_ledger::test_support::{self, DESTINATION_KEY as KEY, db_now};
use nudge_ledger::{DestinationCipher, DueDelivery, Ledger, LedgerTime};
use nudge_provider::HttpProviderConfig;
use nudge_worker::{LedgerClock, Processed, Providers, Recorder, Worker, WorkerMetrics};
use serde_json::json;
use sqlx::PgPool;
use tokio::net::TcpListener;

use crate::common::envelope;

struct Setup {
    ledger: Ledger,
    stub: provider_stub::StubState,
    base: String,
}

async fn setup(pool: PgPool) -> Setup {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stub = provider_stub::StubState::new();
    tokio::spawn(provider_stub::serve(
        listener,
        stub.clone(),
        std::future::pending(),
    ));
    Setup {
        ledger: Ledger::from_pool(pool),
        stub,
        base,
    }
}

fn account(name: &str) -> ProviderAccount {
    ProviderAccount::parse(name).unwrap()
}

/// A worker on `sms-main`, whose local clock reads `skew` away from the truth.
fn worker(
    setup: &Setup,
    honours_idempotency: bool,
    timeout_ms: u64,
    skew: chrono::Duration,
) -> Worker {
    let provider = nudge_provider::build(&HttpProviderConfig {
        kind: nudge_provider::ProviderKind::Generic,
        account: "sms-main".into(),
        channel: Channel::Sms,
        base_url: format!("{}/accounts/sms-main", setup.base),
        auth_token: None,
        timeout_ms,
        connect_timeout_ms: (timeout_ms / 2).min(1_000),
        honours_idempotency,
        default_for_channel: true,
        rate_per_second: None,
        burst: None,
        twilio: None,
        sendgrid: None,
        fcm: None,
        apns: None,
    })
    .unwrap();
    let clock = Arc::new(LedgerClock::new(Arc::new(move || Utc::now() + skew)));
    Worker {
        channel: Channel::Sms,
        ledger: setup.ledger.clone(),
        cipher: DestinationCipher::new(&KEY),
        providers: Providers::new(vec![provider], account("sms-main")),
        policy: RetryPolicy::default(),
        lease_for: Duration::from_secs(30),
        account_recheck: Duration::from_secs(30),
        worker_id: format!("test-worker-{}", uuid::Uuid::new_v4().simple()),
        recorder: Recorder::spawn(setup.ledger.clone(), AdmissionSettings::default().max_pause),
        leases: Arc::default(),
        clock,
        admission: AdmissionSettings::default(),
        metrics: Arc::new(WorkerMetrics::new()),
        shutdown: tokio_util::sync::CancellationToken::new(),
    }
}

fn script(setup: &Setup, v: serde_json::Value) {
    setup
        .stub
        .set_script(account("sms-main"), serde_json::from_value(v).unwrap());
}

/// An SMS reminder with a destination, due `due_in` from the database's now and expiring
/// `lasts` after that; materialised and claimed, as the relay would.
async fn published(
    ledger: &Ledger,
    event: &str,
    due_in: chrono::Duration,
    lasts: chrono::Duration,
) -> DueDelivery {
    let subscriber = format!("patient-{event}");
    test_support::contact(ledger, &subscriber, Channel::Sms, "+15550100").await;
    test_support::published(
        ledger,
        Channel::Sms,
        event,
        &subscriber,
        due_in,
        due_in + lasts,
    )
    .await
}

/// [`published`]: due a second ago, expiring in an hour.
async fn due_now(ledger: &Ledger, event: &str) -> DueDelivery {
    published(
        ledger,
        event,
        chrono::Duration::seconds(-1),
        chrono::Duration::hours(1),
    )
    .await
}

async fn state(ledger: &Ledger, d: &DueDelivery) -> DeliveryState {
    ledger.delivery(d.id).await.unwrap().unwrap().state
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_batch_is_leased_together_sent_and_recorded(pool: PgPool) {
    let setup = setup(pool).await;
    let worker = worker(&setup, true, 2_000, chrono::Duration::zero());
    let mut due = Vec::new();
    for i in 0..20 {
        due.push(due_now(&setup.ledger, &format!("e{i}")).await);
    }
    let payloads: Vec<Vec<u8>> = due.iter().map(envelope).collect();
    let payloads: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();

    let processed = worker.process_batch(&payloads).await;

    assert_eq!(
        processed,
        vec![Processed::Attempted(DeliveryState::Delivered); 20]
    );
    for d in &due {
        assert_eq!(state(&setup.ledger, d).await, DeliveryState::Delivered);
        assert_eq!(setup.ledger.attempts(d.id).await.unwrap().len(), 1);
    }
    let stats = setup.stub.stats();
    assert_eq!((stats.total.requests, stats.total.accepted), (20, 20));
    // The same messages again are stale: nothing more is sent.
    let again = worker.process_batch(&payloads).await;
    assert_eq!(again, vec![Processed::Stale; 20]);
    assert_eq!(setup.stub.stats().total.requests, 20);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_worker_whose_clock_is_skewed_behaves_as_one_on_time(pool: PgPool) {
    let setup = setup(pool).await;
    for (name, skew) in [
        ("behind", chrono::Duration::seconds(-30)),
        ("ahead", chrono::Duration::seconds(30)),
    ] {
        let worker = worker(&setup, true, 2_000, skew);

        // Due now: a worker behind does not drop it as not yet due.
        let on_time = due_now(&setup.ledger, &format!("{name}-due")).await;
        assert_eq!(
            worker.process_one(&envelope(&on_time)).await,
            Processed::Attempted(DeliveryState::Delivered),
            "{name}"
        );

        // Expiring in 10 s: a worker ahead does not expire it early.
        let expiring = published(
            &setup.ledger,
            &format!("{name}-soon"),
            chrono::Duration::seconds(-1),
            chrono::Duration::seconds(11),
        )
        .await;
        assert_eq!(
            worker.process_one(&envelope(&expiring)).await,
            Processed::Attempted(DeliveryState::Delivered),
            "{name}"
        );

        // Expired by the database's clock by the time its message is taken: a worker behind
        // (to which it still looks alive) does not send it.
        let expired = published(
            &setup.ledger,
            &format!("{name}-gone"),
            chrono::Duration::seconds(-1),
            chrono::Duration::seconds(2),
        )
        .await;
        let expires_at = setup
            .ledger
            .delivery(expired.id)
            .await
            .unwrap()
            .unwrap()
            .expires_at;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while db_now(&setup.ledger).await <= expires_at {
            assert!(std::time::Instant::now() < deadline, "time stood still");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let requests_before = setup.stub.stats().total.requests;
        assert_eq!(
            worker.process_one(&envelope(&expired)).await,
            Processed::Expired,
            "{name}"
        );
        assert_eq!(
            setup.stub.stats().total.requests,
            requests_before,
            "{name}: nothing sent"
        );

        // A 429 asking for 30 s: the retry is not due before 30 s by the database's clock.
        script(
            &setup,
            json!({"sequence": [{"status": 429, "retry_after": "30"}]}),
        );
        let throttled = due_now(&setup.ledger, &format!("{name}-429")).await;
        assert_eq!(
            worker.process_one(&envelope(&throttled)).await,
            Processed::Attempted(DeliveryState::RetryWait),
            "{name}"
        );
        let record = setup.ledger.delivery(throttled.id).await.unwrap().unwrap();
        let waits = record.next_attempt_at.unwrap() - db_now(&setup.ledger).await;
        // Tolerance: the time between the answer and this read, up to 10 s on a loaded
        // machine; a worker that dated the retry by its own clock would be 30 s off.
        assert!(
            waits > chrono::Duration::seconds(20) && waits <= chrono::Duration::seconds(30),
            "{name}: the retry waits {waits} of the 30 s asked"
        );
        // Exactly the 30 s asked, counted from the answer (both by the database's clock).
        let attempt = setup.ledger.attempts(throttled.id).await.unwrap().remove(0);
        let asked = record.next_attempt_at.unwrap() - attempt.finished_at;
        assert!(
            (asked - chrono::Duration::seconds(30)).abs() <= chrono::Duration::milliseconds(50),
            "{name}: the retry is {asked} after the answer"
        );
        script(&setup, json!({}));
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_hang_or_a_5xx_without_idempotency_is_held_ambiguous_and_never_resent(pool: PgPool) {
    let setup = setup(pool).await;
    let worker = worker(&setup, false, 500, chrono::Duration::zero());
    script(&setup, json!({"sequence": [{"hang": true}]}));
    let hung = due_now(&setup.ledger, "hang").await;

    assert_eq!(
        worker.process_one(&envelope(&hung)).await,
        Processed::Attempted(DeliveryState::Ambiguous)
    );

    for status in [500, 502, 504] {
        script(&setup, json!({"sequence": [{"status": status}]}));
        let failed = due_now(&setup.ledger, &format!("s{status}")).await;
        assert_eq!(
            worker.process_one(&envelope(&failed)).await,
            Processed::Attempted(DeliveryState::Ambiguous),
            "{status}"
        );
        let attempts = setup.ledger.attempts(failed.id).await.unwrap();
        assert_eq!(
            attempts[0].reason.as_deref(),
            Some(format!("maybe_sent: http_{status}").as_str())
        );
    }
    script(
        &setup,
        json!({"sequence": [{"status": 503, "retry_after": "5"}]}),
    );
    let unavailable = due_now(&setup.ledger, "s503").await;
    assert_eq!(
        worker.process_one(&envelope(&unavailable)).await,
        Processed::Attempted(DeliveryState::RetryWait),
        "a 503 with Retry-After was not taken: retryable"
    );
    let stats = setup.stub.stats();
    assert_eq!(stats.total.requests, 5, "one request each, nothing resent");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_ledger_outage_before_the_lease_sends_nothing_and_spends_no_attempt(pool: PgPool) {
    let setup = setup(pool.clone()).await;
    let worker = worker(&setup, false, 2_000, chrono::Duration::zero());
    let due = due_now(&setup.ledger, "e").await;
    pool.close().await;

    let processed = worker.process_one(&envelope(&due)).await;

    assert_eq!(processed, Processed::Dropped("ledger_unavailable"));
    assert_eq!(setup.stub.stats().total.requests, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_outcome_is_held_through_a_ledger_outage_and_recorded_when_it_returns(pool: PgPool) {
    held_through_an_outage(pool, Duration::from_secs(30), Duration::from_secs(2)).await;
}

/// A connection cut between the send and its record, for longer than the lease: the lease
/// lapses while the ledger is away, the heartbeat renews it first thing when the ledger is
/// back (nobody else took it: the reaper clears the holder when it acts), and the outcome is
/// recorded under it.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_outcome_held_through_an_outage_longer_than_its_lease_is_recorded_under_the_renewed_lease(
    pool: PgPool,
) {
    held_through_an_outage(pool, Duration::from_secs(2), Duration::from_secs(4)).await;
}

/// The provider answers 1.5 s after the request; the database is cut off while it is at the
/// provider, and stays away `outage_after_answer` after the answer. The worker's leases last
/// `lease_for` and its heartbeat beats every third of that.
async fn held_through_an_outage(pool: PgPool, lease_for: Duration, outage_after_answer: Duration) {
    let setup = setup(pool.clone()).await;
    let mut worker = worker(&setup, false, 5_000, chrono::Duration::zero());
    worker.lease_for = lease_for;
    let due = due_now(&setup.ledger, "e").await;
    script(
        &setup,
        json!({"sequence": [{"status": 202, "delay_ms": 1500}]}),
    );
    let name = pool.connect_options().get_database().unwrap().to_owned();
    let admin = sqlx::PgPool::connect(&std::env::var("DATABASE_URL").unwrap())
        .await
        .unwrap();
    let worker = Arc::new(worker);
    let stop_heartbeat = tokio_util::sync::CancellationToken::new();
    let heartbeat = tokio::spawn(nudge_worker::heartbeat::run(
        worker.leases.clone(),
        worker.ledger.clone(),
        worker.worker_id.clone(),
        worker.lease_for,
        worker.lease_for / 3,
        stop_heartbeat.clone(),
    ));
    let task = {
        let worker = worker.clone();
        let payload = envelope(&due);
        tokio::spawn(async move { worker.process_one(&payload).await })
    };
    // Wait (bounded) until the request is at the provider, then cut the database off.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while setup.stub.stats().total.requests == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the send never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS false"
    )))
    .execute(&admin)
    .await
    .unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
        .bind(&name)
        .execute(&admin)
        .await
        .unwrap();
    let cut_at = std::time::Instant::now();
    let deadline = cut_at + Duration::from_secs(10);
    while setup.stub.stats().total.accepted == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the provider never answered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The fault's length, not a wait for an effect.
    tokio::time::sleep(outage_after_answer).await;
    assert!(!task.is_finished(), "the outcome is held, not given up");
    assert!(worker.leases.len() == 1, "and its lease with it");
    let outage = cut_at.elapsed();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS true"
    )))
    .execute(&admin)
    .await
    .unwrap();

    let processed = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap()
        .unwrap();
    stop_heartbeat.cancel();
    heartbeat.await.unwrap();

    assert_eq!(processed, Processed::Attempted(DeliveryState::Delivered));
    assert!(
        worker.leases.is_empty(),
        "the lease is let go once recorded"
    );
    let ledger = Ledger::from_pool(
        sqlx::PgPool::connect_with((*pool.connect_options()).clone())
            .await
            .unwrap(),
    );
    assert_eq!(state(&ledger, &due).await, DeliveryState::Delivered);
    assert_eq!(ledger.attempts(due.id).await.unwrap().len(), 1);
    assert_eq!(setup.stub.stats().total.requests, 1, "sent once");
    assert!(
        outage > lease_for || lease_for > Duration::from_secs(10),
        "the outage ({} ms) outlasted the lease ({} ms) where the test meant it to",
        outage.as_millis(),
        lease_for.as_millis()
    );
}

/// One outcome the ledger's constraints refuse (a provider status past 599, which no adapter
/// should let through) in a group of good ones: the group is written apart, every outcome is
/// applied, the refused one without the status, and within seconds, not at the leases' end.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_outcome_the_ledger_refuses_costs_the_rest_of_its_group_nothing(pool: PgPool) {
    use nudge_domain::{
        AttemptContext, FixedJitter, IdempotencySupport, ProviderAnswer, SendOutcome, Verdict,
    };
    let setup = setup(pool).await;
    let ledger = &setup.ledger;
    let mut due = Vec::new();
    for i in 0..40 {
        due.push(due_now(ledger, &format!("g{i}")).await);
    }
    let routes = nudge_ledger::WorkerRoutes {
        default: account("sms-main"),
        accounts: vec![(account("sms-main"), IdempotencySupport::Honoured)],
    };
    let admission = AdmissionSettings::default();
    let cipher = DestinationCipher::new(&KEY);
    let lease_for = Duration::from_secs(20);
    let batch = nudge_ledger::LeaseBatch {
        channel: Channel::Sms,
        lease_holder: "recorder-test",
        lease_for,
        routes: &routes,
        account_recheck: Duration::from_secs(30),
        admission: &admission,
        cipher: &cipher,
        at: LedgerTime::Database,
    };
    let messages: Vec<_> = due.iter().map(|d| d.message_pointer()).collect();
    let leases: Vec<nudge_ledger::LeasedDelivery> = ledger
        .lease_batch(&batch, &messages)
        .await
        .unwrap()
        .outcomes
        .into_iter()
        .map(|o| match o {
            nudge_ledger::LeaseOutcome::Leased { lease, .. } => lease,
            other => panic!("expected a lease, got {other:?}"),
        })
        .collect();

    let recorder = Recorder::spawn(ledger.clone(), admission.max_pause);
    let started = std::time::Instant::now();
    let now = db_now(ledger).await;
    let answers = leases.into_iter().enumerate().map(|(i, lease)| {
        let recorder = recorder.clone();
        // Three of the forty answered with a status the table refuses.
        let status = if i % 13 == 5 { 799 } else { 200 };
        async move {
            let outcome =
                SendOutcome::Answered(ProviderAnswer::new(Verdict::Accepted, Some(status)));
            let decision = nudge_domain::decide(
                &AttemptContext {
                    attempt_number: lease.attempt_number,
                    expires_at: lease.expires_at,
                    idempotency: IdempotencySupport::Honoured,
                },
                &outcome,
                now,
                &RetryPolicy::default(),
                &mut FixedJitter::new(1_000),
            );
            let attempt = nudge_ledger::AttemptRecord {
                started_at: now,
                finished_at: now,
                worker: "recorder-test".into(),
                correlation_id: None,
            };
            (
                status,
                lease.id,
                recorder.record(lease, decision, attempt).await,
            )
        }
    });
    let results = futures_util::future::join_all(answers).await;
    let took = started.elapsed();

    assert_eq!(results.iter().filter(|r| r.0 == 799).count(), 3);
    for (status, id, recorded) in &results {
        assert_eq!(
            recorded,
            &Ok(nudge_ledger::Recorded::Applied),
            "status {status}"
        );
        let record = ledger.delivery(*id).await.unwrap().unwrap();
        assert_eq!(record.state, DeliveryState::Delivered, "status {status}");
        let attempts = ledger.attempts(*id).await.unwrap();
        assert_eq!(attempts.len(), 1);
        let expected = (*status == 200).then_some(200);
        assert_eq!(attempts[0].http_status, expected, "status {status}");
    }
    // Well inside the leases (20 s): the bad rows were found at once, not waited out.
    assert!(took < Duration::from_secs(10), "took {took:?}");
}
