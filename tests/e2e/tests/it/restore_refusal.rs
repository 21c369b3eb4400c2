//! A ledger restored from a backup, seen by the real binaries: an SMS worker and the producer
//! refuse to start on it (non-zero exit, the reason and what to run in their log), and start
//! once `nudgectl restore reconcile --execute` has run (docs/decisions/0017-restored-ledger.md).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::{Duration, Instant};

use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions};

/// Waits until process `index` has exited; returns its exit code.
async fn exit_code(env: &mut TestEnv, index: usize, within: Duration) -> Option<i32> {
    let deadline = Instant::now() + within;
    while env.proc(index).is_running() {
        assert!(
            Instant::now() < deadline,
            "still running after {within:?}:\n{}",
            env.proc(index).log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    env.proc(index).terminate(Duration::from_secs(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_and_the_producer_refuse_a_restored_ledger_until_it_is_reconciled() {
    let mut env = TestEnv::start("restore-refusal").await.unwrap();
    let tenant = env.tenant("clinic-restored", 2).await.unwrap();
    let now = Utc::now();
    env.reminder(
        tenant,
        "owed-at-the-backup",
        &[Channel::Sms],
        now,
        now + chrono::Duration::hours(1),
    )
    .await
    .unwrap();
    let reminder_id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM reminders")
        .fetch_one(env.ledger.pool())
        .await
        .unwrap();
    // The backup's identity was another cluster's, and its last heartbeat an hour old: what a
    // dump restored into a new cluster finds.
    env.ledger.observe_identity().await.unwrap();
    sqlx::query(
        "UPDATE ledger_identity SET system_identifier = system_identifier + 1,
                heartbeat_at = now() - interval '1 hour'",
    )
    .execute(env.ledger.pool())
    .await
    .unwrap();
    // The backup's point: after the reminder was posted (the copy holds it), and no earlier
    // than the copy's heartbeat.
    let since = Utc::now();

    let options = WorkerOptions::for_channel(Channel::Sms);
    let worker = env
        .start_worker(Channel::Sms, "worker-refused", &options)
        .unwrap();
    let code = exit_code(&mut env, worker, Duration::from_secs(30)).await;
    assert!(code.is_some_and(|c| c != 0), "worker exit {code:?}");
    let log = env.proc(worker).log_tail(20);
    assert!(
        log.contains("restored from a backup") && log.contains("nudgectl restore reconcile"),
        "{log}"
    );
    let producer = env.start_producer("producer-refused").unwrap();
    let code = exit_code(&mut env, producer, Duration::from_secs(30)).await;
    assert!(code.is_some_and(|c| c != 0), "producer exit {code:?}");
    assert_eq!(env.consumers(Channel::Sms).await.unwrap(), 0);

    let since = since.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let (code, out, err) = env
        .nudgectl(&[
            "restore",
            "reconcile",
            "--since",
            &since,
            "--reason",
            "restored after disk loss",
            "--execute",
        ])
        .unwrap();
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("RECONCILED"), "{out}");
    let state: String = sqlx::query_scalar("SELECT state FROM deliveries WHERE reminder_id = $1")
        .bind(reminder_id)
        .fetch_one(env.ledger.pool())
        .await
        .unwrap();
    assert_eq!(state, "ambiguous", "owed at the backup: held, not sent");

    let started = env.start_worker(Channel::Sms, "worker", &options).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while env.consumers(Channel::Sms).await.unwrap_or(0) != 1 {
        assert!(
            Instant::now() < deadline,
            "the worker does not consume:\n{}",
            env.proc(started).log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stats = nudge_e2e::stats(env.stub_stats().await.unwrap()).unwrap();
    assert_eq!(stats.total.requests, 0, "nothing held was sent");
}
