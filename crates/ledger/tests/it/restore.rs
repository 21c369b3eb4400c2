//! A ledger restored from a backup: detection from the database's identity and heartbeat, the
//! refusal to send, and the reconciliation (docs/decisions/0017-restored-ledger.md).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use nudge_domain::{Channel, DeliveryState, IdempotencyKey, ReminderId};
use nudge_ledger::test_support::*;
use nudge_ledger::{ConfirmedSend, IdentityVerdict, Ledger, SendingRefused};
use sqlx::PgPool;

/// Makes the recorded identity another cluster's, whose last heartbeat is `heartbeat_age`
/// old: what the server finds after a dump of that cluster is restored into it.
async fn recorded_as_another_cluster(ledger: &Ledger, heartbeat_age: &str) {
    sqlx::query(
        "UPDATE ledger_identity SET system_identifier = system_identifier + 1,
                heartbeat_at = now() - $1::interval",
    )
    .bind(heartbeat_age)
    .execute(ledger.pool())
    .await
    .unwrap();
}

async fn recorded_heartbeat(ledger: &Ledger) -> chrono::DateTime<chrono::Utc> {
    sqlx::query_scalar("SELECT heartbeat_at FROM ledger_identity")
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

async fn state_of(ledger: &Ledger, reminder: ReminderId, channel: Channel) -> DeliveryState {
    let state: String =
        sqlx::query_scalar("SELECT state FROM deliveries WHERE reminder_id = $1 AND channel = $2")
            .bind(reminder.as_uuid())
            .bind(channel.as_str())
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    state.parse().unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_first_start_records_the_identity_and_is_not_a_restore(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let first = ledger.observe_identity().await.unwrap();
    assert_eq!(first.verdict, IdentityVerdict::FirstStart);
    let again = ledger.ensure_not_restored().await.unwrap();
    assert_eq!(again.verdict, IdentityVerdict::Same);
    assert!(again.heartbeat_at >= first.heartbeat_at);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_promoted_replica_with_a_fresh_heartbeat_is_a_failover_not_a_restore(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger.observe_identity().await.unwrap();
    // The primary's timeline was another; its last heartbeat reached the replica 5 s ago.
    sqlx::query(
        "UPDATE ledger_identity SET timeline_id = timeline_id + 7,
                heartbeat_at = now() - interval '5 seconds'",
    )
    .execute(ledger.pool())
    .await
    .unwrap();

    let seen = ledger.ensure_not_restored().await.unwrap();
    assert_eq!(seen.verdict, IdentityVerdict::Failover);
    // Adopted: the next look finds it the same.
    assert_eq!(
        ledger.observe_identity().await.unwrap().verdict,
        IdentityVerdict::Same
    );
    let events: Vec<String> =
        sqlx::query_scalar("SELECT event FROM ledger_identity_events ORDER BY id")
            .fetch_all(ledger.pool())
            .await
            .unwrap();
    assert_eq!(events, ["first_start", "failover"]);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn another_identity_with_an_old_heartbeat_is_restored_until_reconciled(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger.observe_identity().await.unwrap();
    recorded_as_another_cluster(&ledger, "2 hours").await;
    let backup_heartbeat = recorded_heartbeat(&ledger).await;

    let refused = ledger.ensure_not_restored().await.unwrap_err();
    let SendingRefused::Restored { reason } = refused else {
        panic!("expected a restore, got {refused:?}");
    };
    assert!(reason.contains("another cluster"), "{reason}");
    // Every later look, a fresh one included, still finds it restored, and none stamps the
    // heartbeat: the backup's stays, for the operator's --since.
    for _ in 0..3 {
        assert_eq!(
            ledger.observe_identity().await.unwrap().verdict,
            IdentityVerdict::Restored
        );
    }
    assert_eq!(recorded_heartbeat(&ledger).await, backup_heartbeat);
    let status = ledger.restore_status().await.unwrap();
    assert_eq!(status.observed.verdict, IdentityVerdict::Restored);
    assert_eq!(status.events[0].event, "restored");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_database_created_again_is_restored_even_with_a_fresh_heartbeat(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger.observe_identity().await.unwrap();
    // A dump restored into the same cluster minutes after it was taken: replication never
    // changes a database's OID.
    sqlx::query("UPDATE ledger_identity SET database_oid = 1, heartbeat_at = now()")
        .execute(ledger.pool())
        .await
        .unwrap();
    let seen = ledger.observe_identity().await.unwrap();
    assert_eq!(seen.verdict, IdentityVerdict::Restored);
    assert!(seen.reason.contains("created again"), "{}", seen.reason);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_binarys_role_may_look_at_the_identity_but_never_clear_a_restore(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger.observe_identity().await.unwrap();
    recorded_as_another_cluster(&ledger, "1 hour").await;
    let mut conn = ledger.pool().acquire().await.unwrap();
    for role in ["nudge_worker", "nudge_producer", "nudge_janitor"] {
        sqlx::query(sqlx::AssertSqlSafe(format!("SET ROLE {role}")))
            .execute(&mut *conn)
            .await
            .unwrap();
        let verdict: String = sqlx::query_scalar("SELECT verdict FROM nudge_ledger_observe()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(verdict, "restored", "{role}");
        let cleared = sqlx::query("UPDATE ledger_identity SET restored_at = NULL")
            .execute(&mut *conn)
            .await;
        assert!(cleared.is_err(), "{role} could clear a restore");
        sqlx::query("RESET ROLE").execute(&mut *conn).await.unwrap();
    }
}

/// The ledger as restored: one delivery of each kind the reconciliation must tell apart.
struct Restored {
    leased: ReminderId,
    queued: ReminderId,
    due: ReminderId,
    confirmed: ReminderId,
    not_yet_due: ReminderId,
    delivered: ReminderId,
    never_materialised: ReminderId,
    posted_after: ReminderId,
    since: chrono::DateTime<chrono::Utc>,
}

async fn restored_ledger(ledger: &Ledger) -> Restored {
    let tenant = tenant(ledger).await;
    let sms = &[Channel::Sms];
    let leased = owed(ledger, tenant.id, "leased", sms, t0()).await;
    let queued = owed(ledger, tenant.id, "queued", sms, t0()).await;
    let delivered = owed(ledger, tenant.id, "delivered", sms, t0()).await;
    let claimed = claim_all(ledger, t0()).await;
    assert_eq!(claimed.len(), 3);
    let to_lease = claimed
        .iter()
        .find(|d| d.reminder_id == leased)
        .expect("claimed");
    assert!(matches!(
        lease(ledger, to_lease, t0()).await,
        nudge_ledger::LeaseOutcome::Leased { .. }
    ));
    sqlx::query(
        "UPDATE deliveries SET state = 'delivered', settled_at = now(), next_attempt_at = NULL
         WHERE reminder_id = $1",
    )
    .bind(delivered.as_uuid())
    .execute(ledger.pool())
    .await
    .unwrap();
    let due = owed(ledger, tenant.id, "due", sms, t0()).await;
    let confirmed = owed(ledger, tenant.id, "confirmed", sms, t0()).await;
    let later = chrono::Utc::now() + chrono::Duration::days(30);
    let not_yet_due = owed(ledger, tenant.id, "not-yet-due", sms, later).await;
    // Not due yet when it was posted, so left to a producer window that the backup never saw.
    let never_materialised = ledger
        .create_reminder(
            &reminder(tenant.id, "orphan", sms, t0() + secs(30)),
            &cipher(),
            t0(),
        )
        .await
        .unwrap()
        .id;
    let since = t0() + secs(60);
    // Posted after the restore: created after the backup's point, sent as new.
    let posted_after = ledger
        .create_reminder(
            &reminder(tenant.id, "posted-after", &[Channel::Email], t0()),
            &cipher(),
            since + secs(60),
        )
        .await
        .unwrap()
        .id;
    ledger
        .materialise_reminder(tenant.id, posted_after, since + secs(60))
        .await
        .unwrap();
    ledger
        .claim_due(Channel::Email, 10, at(since + secs(60)))
        .await
        .unwrap();

    ledger.observe_identity().await.unwrap();
    sqlx::query(
        "UPDATE ledger_identity SET system_identifier = system_identifier + 1, heartbeat_at = $1",
    )
    .bind(since - secs(3))
    .execute(ledger.pool())
    .await
    .unwrap();
    assert_eq!(
        ledger.observe_identity().await.unwrap().verdict,
        IdentityVerdict::Restored
    );
    Restored {
        leased,
        queued,
        due,
        confirmed,
        not_yet_due,
        delivered,
        never_materialised,
        posted_after,
        since,
    }
}

async fn audit_rows(ledger: &Ledger) -> Vec<(String, String, Option<String>)> {
    sqlx::query_as("SELECT actor, action, reason FROM audit_log WHERE action = 'restore_reconcile'")
        .fetch_all(ledger.pool())
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_dry_run_counts_what_the_execute_holds_and_changes_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let r = restored_ledger(&ledger).await;
    let ops = ops(t0());

    let plan = ledger
        .reconcile_restore(r.since, &[], &ops, false)
        .await
        .unwrap();
    assert!(!plan.executed && plan.was_restored);
    let by_state = |report: &nudge_ledger::RestoreReconciliation, state: &str| {
        report
            .held
            .iter()
            .filter(|c| c.state == state)
            .map(|c| c.count)
            .sum::<i64>()
    };
    assert_eq!(by_state(&plan, "sending"), 1);
    assert_eq!(by_state(&plan, "queued"), 1);
    assert_eq!(by_state(&plan, "scheduled"), 2, "{:?}", plan.held);
    assert_eq!(plan.materialised_held, 1);
    assert_eq!(plan.review_total(), 5);
    assert_eq!(plan.reminders_after_since, 1);
    assert_eq!(
        state_of(&ledger, r.leased, Channel::Sms).await,
        DeliveryState::Sending
    );
    assert_eq!(
        ledger.observe_identity().await.unwrap().verdict,
        IdentityVerdict::Restored
    );
    assert!(audit_rows(&ledger).await.is_empty());
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries")
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    assert_eq!(deliveries, 7, "the dry run created no delivery");
    // Events' positions move on past what the lost history gave only when a reconciliation
    // commits (migration 20261224000001): the dry run leaves the sequence where it was.
    let positions = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END
             FROM delivery_event_positions",
        )
        .fetch_one(ledger.pool())
        .await
        .unwrap()
    };
    let before = positions().await;
    assert!(before < 1 << 40, "{before}");

    let executed = ledger
        .reconcile_restore(r.since, &[], &ops, true)
        .await
        .unwrap();
    assert!(executed.executed);
    assert_eq!(positions().await, before + (1 << 40));
    assert_eq!(executed.held, plan.held);
    assert_eq!(executed.materialised_held, plan.materialised_held);
    assert_eq!(executed.for_review, plan.for_review);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_execute_holds_what_could_have_been_sent_settles_what_the_provider_confirms_and_lets_the_workers_start(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let r = restored_ledger(&ledger).await;
    assert!(matches!(
        ledger.ensure_not_restored().await,
        Err(SendingRefused::Restored { .. })
    ));
    let sent = [
        ConfirmedSend {
            idempotency_key: IdempotencyKey::for_delivery(r.confirmed, Channel::Sms),
            provider_message_id: Some("SM-after-the-backup".to_owned()),
        },
        // Sent before the backup, already delivered in the copy: names no held delivery.
        ConfirmedSend {
            idempotency_key: IdempotencyKey::for_delivery(r.delivered, Channel::Sms),
            provider_message_id: None,
        },
    ];
    let report = ledger
        .reconcile_restore(r.since, &sent, &ops(t0()), true)
        .await
        .unwrap();

    assert_eq!(report.settled_by_provider_records, 1);
    assert_eq!(report.provider_records_unmatched, 1);
    assert_eq!(report.review_total(), 4);
    assert_eq!(report.for_review[0].tenant, "clinic-a");
    for held in [r.leased, r.queued, r.due, r.never_materialised] {
        assert_eq!(
            state_of(&ledger, held, Channel::Sms).await,
            DeliveryState::Ambiguous
        );
    }
    let reason: String =
        sqlx::query_scalar("SELECT last_error_reason FROM deliveries WHERE reminder_id = $1")
            .bind(r.leased.as_uuid())
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    assert!(reason.starts_with("restored: "), "{reason}");
    let (state, message_id): (String, Option<String>) =
        sqlx::query_as("SELECT state, provider_message_id FROM deliveries WHERE reminder_id = $1")
            .bind(r.confirmed.as_uuid())
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    assert_eq!(state, "delivered");
    assert_eq!(message_id.as_deref(), Some("SM-after-the-backup"));
    assert_eq!(
        state_of(&ledger, r.not_yet_due, Channel::Sms).await,
        DeliveryState::Scheduled
    );
    assert_eq!(
        state_of(&ledger, r.delivered, Channel::Sms).await,
        DeliveryState::Delivered
    );
    assert_eq!(
        state_of(&ledger, r.posted_after, Channel::Email).await,
        DeliveryState::Queued
    );

    let audit = audit_rows(&ledger).await;
    assert_eq!(
        audit,
        [(
            "ops@clinic".to_owned(),
            "restore_reconcile".to_owned(),
            Some("test".to_owned())
        )]
    );
    let seen = ledger.ensure_not_restored().await.unwrap();
    assert_eq!(seen.verdict, IdentityVerdict::Same);
    let events: Vec<String> =
        sqlx::query_scalar("SELECT event FROM ledger_identity_events ORDER BY id")
            .fetch_all(ledger.pool())
            .await
            .unwrap();
    assert_eq!(events, ["first_start", "restored", "reconciled"]);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_since_before_the_copys_own_heartbeat_is_refused(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let r = restored_ledger(&ledger).await;
    let refused = ledger
        .reconcile_restore(r.since - secs(60), &[], &ops(t0()), true)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("heartbeat"), "{refused}");
    assert_eq!(
        ledger.observe_identity().await.unwrap().verdict,
        IdentityVerdict::Restored
    );
}
