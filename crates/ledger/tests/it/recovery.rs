#![allow(clippy::unwrap_used, clippy::expect_used)]

//! The ledger's recovery paths: expired leases and dead-lettered messages.

use nudge_domain::{Channel, DeliveryState, FixedJitter, IdempotencySupport, RetryPolicy};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    DeadLetter, DeadLetterAction, LeaseOutcome, Ledger, MessagePointer, Reaped, SendSlot,
};
use sqlx::PgPool;

/// A delivery leased by a worker that then vanished, through an account with `idem`
/// (None: a lease from before the capability was recorded).
async fn leased_via(
    ledger: &Ledger,
    event: &str,
    idem: Option<IdempotencySupport>,
) -> nudge_domain::DeliveryId {
    let tenant = ledger.create_tenant(event, &ops(t0())).await.unwrap();
    owed(ledger, tenant.id, event, &[Channel::Sms], t0()).await;
    let due = ledger
        .claim_due(Channel::Sms, 10, at(t0()))
        .await
        .unwrap()
        .remove(0);
    let routes = routes(idem.unwrap_or(IdempotencySupport::NotHonoured));
    let outcome = lease_as(ledger, &due, "crashed-worker", &routes, t0()).await;
    assert!(matches!(outcome, LeaseOutcome::Leased { .. }));
    if idem.is_none() {
        sqlx::query("UPDATE deliveries SET lease_idempotent = NULL WHERE id = $1")
            .bind(due.id.as_uuid())
            .execute(ledger.pool())
            .await
            .unwrap();
    }
    due.id
}

async fn reap(ledger: &Ledger, now: chrono::DateTime<chrono::Utc>) -> Reaped {
    ledger
        .reap_expired_leases(
            100,
            &RetryPolicy::default(),
            &mut FixedJitter::zero(),
            at(now),
        )
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_expired_lease_is_retried_only_when_the_account_honours_idempotency_keys(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let safe = leased_via(&ledger, "safe", Some(IdempotencySupport::Honoured)).await;
    let unsafe_ = leased_via(&ledger, "unsafe", Some(IdempotencySupport::NotHonoured)).await;
    let unknown = leased_via(&ledger, "unknown", None).await;

    let before = reap(&ledger, t0() + secs(59)).await;
    let reaped = reap(&ledger, t0() + secs(61)).await;

    assert_eq!(
        before,
        Reaped::default(),
        "a lease is not reaped before it expires"
    );
    assert!(
        reaped.unsent.is_empty(),
        "every one of these sends had started"
    );
    assert_eq!(reaped.decided.len(), 3);
    let state = |id| reaped.decided.iter().find(|(d, _)| *d == id).unwrap().1;
    assert_eq!(state(safe), DeliveryState::RetryWait);
    assert_eq!(state(unsafe_), DeliveryState::Ambiguous);
    assert_eq!(
        state(unknown),
        DeliveryState::Ambiguous,
        "unknown capability is treated as unsafe"
    );
    let attempts = ledger.attempts(safe).await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert!(
        attempts[0]
            .reason
            .as_deref()
            .unwrap()
            .starts_with("lease_expired")
    );
    let record = ledger.delivery(unsafe_).await.unwrap().unwrap();
    assert!(record.settled_at.is_some());
    assert_eq!(record.lease_holder, None);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reaped_lease_past_its_expiry_is_expired_not_retried(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let id = leased_via(&ledger, "e", Some(IdempotencySupport::Honoured)).await;

    let reaped = reap(&ledger, t0() + secs(3600)).await;

    assert_eq!(reaped.decided, vec![(id, DeliveryState::Expired)]);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_lease_whose_send_never_started_is_given_back_unsent_not_held_ambiguous(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    // A bucket of 2/s, burst 1: of two leases taken at once, the second waits 500 ms for its
    // slot, unfenced; its worker dies in that wait.
    ledger
        .ensure_bucket(&account("main"), Channel::Sms, 2.0, 1, t0())
        .await
        .unwrap();
    owed(&ledger, tenant.id, "a", &[Channel::Sms], t0()).await;
    owed(&ledger, tenant.id, "b", &[Channel::Sms], t0()).await;
    let due = ledger.claim_due(Channel::Sms, 10, at(t0())).await.unwrap();
    let leaser = Leaser::new(IdempotencySupport::NotHonoured);
    let batch = leaser.batch(Channel::Sms, "doomed-worker", at(t0()));
    let messages: Vec<_> = due.iter().map(|d| d.message_pointer()).collect();
    let result = ledger.lease_batch(&batch, &messages).await.unwrap();
    let (mut sent, mut waiting) = (None, None);
    for (d, outcome) in due.iter().zip(&result.outcomes) {
        match outcome {
            LeaseOutcome::Leased {
                slot: SendSlot::Now,
                ..
            } => sent = Some(d.id),
            LeaseOutcome::Leased {
                slot: SendSlot::At { send_at, .. },
                ..
            } => {
                assert_eq!(*send_at, t0() + chrono::Duration::milliseconds(500));
                waiting = Some(d.id);
            }
            other => panic!("expected leases, got {other:?}"),
        }
    }
    let (sent, waiting) = (sent.unwrap(), waiting.unwrap());

    let reaped = reap(&ledger, t0() + secs(61)).await;

    assert_eq!(reaped.unsent, vec![waiting]);
    assert_eq!(reaped.decided, vec![(sent, DeliveryState::Ambiguous)]);
    let unsent = ledger.delivery(waiting).await.unwrap().unwrap();
    assert_eq!(unsent.state, DeliveryState::RetryWait);
    assert_eq!(
        unsent.next_attempt_at,
        Some(t0()),
        "due again at once, at its place in line: the time it was due"
    );
    assert_eq!(unsent.attempt_count, 0, "no attempt spent");
    assert_eq!(unsent.lane, nudge_domain::Lane::New, "on its own lane");
    assert!(ledger.attempts(waiting).await.unwrap().is_empty());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_poison_message_for_owed_work_dead_letters_that_delivery(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let due = ledger
        .claim_due(Channel::Sms, 10, at(t0()))
        .await
        .unwrap()
        .remove(0);
    let letter = |generation| DeadLetter {
        queue: "dead.sms".into(),
        channel: Some(Channel::Sms),
        death_reason: "delivery_limit".into(),
        decode_error: None,
        delivery: Some(MessagePointer {
            delivery_id: due.id,
            generation,
        }),
        delivery_count: 3,
        payload: vec![1, 2, 3],
    };

    let stale = ledger
        .record_dead_letter(&letter(due.generation - 1), t0())
        .await
        .unwrap();
    let live = ledger
        .record_dead_letter(&letter(due.generation), t0())
        .await
        .unwrap();

    assert_eq!(stale, DeadLetterAction::Recorded);
    assert_eq!(live, DeadLetterAction::DeliveryDeadLettered);
    let record = ledger.delivery(due.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::DeadLettered);
    assert_eq!(
        record.last_error_reason.as_deref(),
        Some("poison_message: delivery_limit")
    );
    assert_eq!(
        ledger.dead_letter_count(Some(Channel::Sms)).await.unwrap(),
        2
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_undecodable_dead_letter_is_recorded_with_its_bytes_capped(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());

    let action = ledger
        .record_dead_letter(
            &DeadLetter {
                queue: "dead.sms".into(),
                channel: Some(Channel::Sms),
                death_reason: "rejected".into(),
                decode_error: Some("undecodable".into()),
                delivery: None,
                delivery_count: 0,
                payload: vec![0xff; 10_000],
            },
            t0(),
        )
        .await
        .unwrap();

    assert_eq!(action, DeadLetterAction::Recorded);
    let (kept, size): (i32, i32) =
        sqlx::query_as("SELECT length(payload), payload_size FROM dead_letters")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((kept, size), (4096, 10_000));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_schedule_is_replaced_not_duplicated(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;

    ledger
        .set_schedule(tenant.id, "0 * * * * *", 60, &ops(t0()))
        .await
        .unwrap();
    ledger
        .set_schedule(tenant.id, "*/5 * * * * *", 5, &ops(t0()))
        .await
        .unwrap();

    let schedules = ledger.schedules().await.unwrap();
    assert_eq!(schedules.len(), 1);
    assert_eq!(schedules[0].cron, "*/5 * * * * *");
    assert_eq!(schedules[0].window_seconds, 5);
    assert!(
        ledger
            .set_schedule(tenant.id, " ", 5, &ops(t0()))
            .await
            .is_err()
    );
    assert!(
        ledger
            .set_schedule(tenant.id, "* * * * * *", 0, &ops(t0()))
            .await
            .is_err()
    );
}
