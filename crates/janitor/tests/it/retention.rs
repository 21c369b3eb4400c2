//! The janitor's retention runs on a real ledger, connected as the `nudge_janitor` role the
//! migration creates: what it deletes and exports, what stops it between batches, and what
//! keeps it from starting (each named).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, RedriveId, RetentionDays, RetentionPolicy};
use nudge_janitor::retention::{RetentionOutcome, RetentionSettings, retention_once};
use nudge_ledger::{Blocker, Ledger, LedgerTime, Operator, RetentionTable, RunState};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::common::as_janitor;

fn settings(batch_size: u32, export_dir: Option<std::path::PathBuf>) -> RetentionSettings {
    RetentionSettings {
        policy: RetentionPolicy::new(RetentionDays {
            delivered: 30,
            expired: 30,
            cancelled: 30,
            dead_lettered: 90,
            reminders: 90,
            contacts: 90,
            events: 30,
            events_unacknowledged: 90,
            audit: 400,
        })
        .unwrap(),
        batch_size,
        pause: Duration::ZERO,
        export_dir,
    }
}

async fn tenant(pool: &PgPool) -> Uuid {
    let ledger = Ledger::from_pool(pool.clone());
    let ops = Operator::new("ops", Some("test"), Utc::now()).unwrap();
    ledger
        .create_tenant("clinic", &ops)
        .await
        .unwrap()
        .id
        .as_uuid()
}

/// `n` SMS deliveries in `state`, settled (or, for owed states, due) `days_ago`, each with its
/// own reminder and one attempt.
async fn deliveries(pool: &PgPool, tenant: Uuid, state: &str, n: usize, days_ago: i64) {
    for _ in 0..n {
        let (reminder, id) = (Uuid::new_v4(), Uuid::new_v4());
        sqlx::query(
            "INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels,
                 scheduled_at, expires_at, created_at)
             VALUES ($1, $2, $1::text, 'subscriber', ARRAY['sms'],
                 now() - make_interval(days => $3), now() - make_interval(days => $3) + interval '1 hour',
                 now() - make_interval(days => $3))",
        )
        .bind(reminder)
        .bind(tenant)
        .bind(i32::try_from(days_ago).unwrap())
        .execute(pool)
        .await
        .unwrap();
        let settled = !matches!(state, "scheduled" | "queued" | "retry_wait");
        sqlx::query(
            "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
                 attempt_count, scheduled_at, expires_at, next_attempt_at, settled_at, created_at,
                 updated_at)
             SELECT $1, $2, $3, 'sms', $4, 'nudge-' || $2::text || '-sms', 1, r.scheduled_at, r.expires_at,
                 CASE WHEN NOT $5 THEN r.scheduled_at END,
                 CASE WHEN $5 THEN r.scheduled_at END, r.scheduled_at, r.scheduled_at
             FROM reminders r WHERE r.id = $2",
        )
        .bind(id)
        .bind(reminder)
        .bind(tenant)
        .bind(state)
        .bind(settled)
        .execute(pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO attempts (delivery_id, attempt_number, generation, lane, started_at,
                 finished_at, outcome_class, next_state)
             SELECT $1, 1, 1, 'new', created_at, created_at, 'delivered', state
             FROM deliveries WHERE id = $1",
        )
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    }
}

async fn count(pool: &PgPool, state: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state = $1")
        .bind(state)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn db_now(pool: &PgPool) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT now()")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_run_as_the_janitor_role_deletes_what_it_counted_and_exports_ids_states_and_times(
    pool: PgPool,
) {
    let tenant = tenant(&pool).await;
    deliveries(&pool, tenant, "delivered", 12, 100).await;
    deliveries(&pool, tenant, "delivered", 3, 5).await;
    deliveries(&pool, tenant, "retry_wait", 2, 400).await;
    deliveries(&pool, tenant, "ambiguous", 2, 400).await;
    let janitor = as_janitor(&pool).await;
    assert!(!janitor.can_delete_directly().await.unwrap());
    let dir = std::env::temp_dir().join(format!("nudge-retention-{}", Uuid::new_v4()));

    let outcome = retention_once(
        &janitor,
        &settings(5, Some(dir.clone())),
        "janitor-test",
        LedgerTime::Database,
        &CancellationToken::new(),
    )
    .await
    .unwrap();

    let RetentionOutcome::Ran(summary) = outcome else {
        panic!("refused: {outcome:?}");
    };
    assert_eq!(summary.state, RunState::Finished);
    assert_eq!(summary.deleted[&RetentionTable::Deliveries], 12);
    assert_eq!(summary.deleted[&RetentionTable::Attempts], 12);
    assert_eq!(summary.deleted, summary.planned);
    assert_eq!(count(&pool, "delivered").await, 3, "too young to go");
    assert_eq!(count(&pool, "retry_wait").await, 2);
    assert_eq!(count(&pool, "ambiguous").await, 2);

    let text =
        std::fs::read_to_string(dir.join(format!("retention-{}.jsonl", summary.id))).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 12);
    let mut keys: Vec<&str> = lines[0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "attempt_count",
            "channel",
            "created_at",
            "delivery_id",
            "outcome_classes",
            "reminder_id",
            "run_id",
            "scheduled_at",
            "settled_at",
            "state",
            "tenant_id"
        ],
        "ids, states, times and outcome classes only"
    );
    assert_eq!(
        lines[0]["outcome_classes"],
        serde_json::json!(["delivered"])
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_shutdown_stops_a_run_between_batches_and_the_next_run_finishes_it(pool: PgPool) {
    let tenant = tenant(&pool).await;
    deliveries(&pool, tenant, "delivered", 10, 100).await;
    let janitor = as_janitor(&pool).await;
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    let hour = Duration::from_secs(3_600);
    assert_eq!(
        janitor.retention_due_in(hour).await.unwrap(),
        Duration::ZERO,
        "no run has finished: one is due at once"
    );

    let first = retention_once(
        &janitor,
        &settings(4, None),
        "j",
        LedgerTime::Database,
        &shutdown,
    )
    .await
    .unwrap();
    let RetentionOutcome::Ran(first) = first else {
        panic!("{first:?}");
    };
    assert_eq!(first.state, RunState::Stopped);
    assert_eq!(
        first.deleted[&RetentionTable::Deliveries],
        4,
        "one batch, then stop"
    );
    assert_eq!(count(&pool, "delivered").await, 6);
    assert_eq!(
        janitor.retention_due_in(hour).await.unwrap(),
        Duration::ZERO,
        "a stopped run does not put the next one off"
    );

    let second = retention_once(
        &janitor,
        &settings(4, None),
        "j",
        LedgerTime::Database,
        &CancellationToken::new(),
    )
    .await
    .unwrap();
    let RetentionOutcome::Ran(second) = second else {
        panic!("{second:?}");
    };
    assert_eq!(second.state, RunState::Finished);
    assert_eq!(second.planned[&RetentionTable::Deliveries], 6);
    assert_eq!(second.deleted, second.planned);
    assert_eq!(count(&pool, "delivered").await, 0);
    // The next run is due an interval after the finished one began, whichever process asks
    // (a restarted janitor waits too). Tolerance: the minute this test may take.
    let due = janitor.retention_due_in(hour).await.unwrap();
    assert!(
        due > hour - Duration::from_secs(60) && due <= hour,
        "next run due in {due:?}"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_drain_a_redrive_an_ownership_change_a_foreign_schema_or_another_run_blocks_a_run_by_name(
    pool: PgPool,
) {
    let tenant = tenant(&pool).await;
    deliveries(&pool, tenant, "delivered", 3, 100).await;
    deliveries(&pool, tenant, "retry_wait", 1, 1).await;
    let owner = Ledger::from_pool(pool.clone());
    let janitor = as_janitor(&pool).await;
    let run = |ledger: Ledger| async move {
        retention_once(
            &ledger,
            &settings(10, None),
            "j",
            LedgerTime::Database,
            &CancellationToken::new(),
        )
        .await
        .unwrap()
    };
    let ops = || Operator::new("ops", Some("test"), Utc::now()).unwrap();

    owner
        .set_draining(
            Channel::Sms,
            true,
            &ops(),
            nudge_ledger::LedgerTime::Database,
        )
        .await
        .unwrap();
    owner
        .set_channel_owner(Channel::Email, "legacy", &ops())
        .await
        .unwrap();
    // Owed SMS work still under the previous owner: the hand-over is not complete.
    sqlx::query("UPDATE deliveries SET owner = 'legacy' WHERE state = 'retry_wait'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO redrives (channel, rate_per_second, state, selected, fed_until,
             running_since, actor, reason, created_at, updated_at)
         VALUES ('push', 1, 'paused', 0, $1, $1, 'ops', 'test', $1, $1)",
    )
    .bind(db_now(&pool).await)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (29991231000001, 'from a newer build', true, '\\x00', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();

    let RetentionOutcome::Refused(blockers) = run(janitor.clone()).await else {
        panic!("a run started");
    };
    let expected = nudge_ledger::MIGRATOR
        .iter()
        .map(|m| m.version)
        .max()
        .unwrap();
    assert_eq!(
        blockers,
        [
            Blocker::SchemaVersion {
                found: Some(29_991_231_000_001),
                expected
            },
            Blocker::Draining {
                channel: Channel::Sms
            },
            Blocker::Redrive {
                id: RedriveId::try_from(1).unwrap(),
                channel: Channel::Push
            },
            Blocker::OwnershipChange {
                channel: Channel::Sms,
                deliveries: 1
            },
        ]
    );
    assert!(blockers[0].to_string().contains("this build expects"));
    assert_eq!(count(&pool, "delivered").await, 3, "nothing deleted");

    // Clear them all: the run goes ahead, unless another run holds the lock.
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = 29991231000001")
        .execute(&pool)
        .await
        .unwrap();
    owner
        .set_draining(
            Channel::Sms,
            false,
            &ops(),
            nudge_ledger::LedgerTime::Database,
        )
        .await
        .unwrap();
    sqlx::query("UPDATE redrives SET state = 'cancelled', finished_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE deliveries SET owner = 'nudge' WHERE state = 'retry_wait'")
        .execute(&pool)
        .await
        .unwrap();
    let held = owner
        .begin_retention_run(
            &settings(1, None).policy,
            "other-replica",
            LedgerTime::Database,
        )
        .await
        .unwrap();
    assert_eq!(
        run(janitor.clone()).await,
        RetentionOutcome::Refused(vec![Blocker::RunInProgress])
    );
    owner
        .finish_retention_run(held, nudge_ledger::RunEnd::Stopped("test".into()))
        .await
        .unwrap();
    let RetentionOutcome::Ran(summary) = run(janitor).await else {
        panic!("still refused");
    };
    assert_eq!(summary.state, RunState::Finished);
    assert_eq!(count(&pool, "delivered").await, 0);
}

/// A recorded run `ago` before the database's now, in `state`.
async fn recorded_run(pool: &PgPool, ago: Duration, state: &str) {
    sqlx::query(
        "INSERT INTO retention_runs (started_at, runner, delivered_s, expired_s, cancelled_s,
             dead_lettered_s, reminders_s, contacts_s, audit_s, planned, state, finished_at)
         VALUES (now() - make_interval(secs => $1), 'j', 604800, 604800, 604800, 604800,
             604800, 604800, 31536000, '{}', $2, now() - make_interval(secs => $1) + interval '1 s')",
    )
    .bind(ago.as_secs_f64())
    .bind(state)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_next_run_is_due_an_interval_after_the_last_finished_run_began_and_unfinished_runs_put_none_off(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let hour = Duration::from_secs(3_600);
    assert_eq!(ledger.retention_due_in(hour).await.unwrap(), Duration::ZERO);

    recorded_run(&pool, Duration::from_secs(2 * 3_600), "finished").await;
    assert_eq!(
        ledger.retention_due_in(hour).await.unwrap(),
        Duration::ZERO,
        "the last finished run is older than the interval"
    );
    recorded_run(&pool, Duration::from_secs(120), "stopped").await;
    recorded_run(&pool, Duration::from_secs(60), "mismatch").await;
    assert_eq!(
        ledger.retention_due_in(hour).await.unwrap(),
        Duration::ZERO,
        "stopped and mismatched runs put no run off"
    );

    recorded_run(&pool, Duration::from_secs(600), "finished").await;
    // 50 minutes left; tolerance: the minute this test may take.
    let due = ledger.retention_due_in(hour).await.unwrap();
    assert!(
        due > Duration::from_secs(49 * 60) && due <= Duration::from_secs(50 * 60),
        "next run due in {due:?}"
    );
}
