#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{
    AttemptContext, Channel, DeliveryState, FixedJitter, IdempotencySupport, Lane, OutcomeClass,
    RetryPolicy, SendOutcome, decide,
};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    AttemptRecord, DueDelivery, LeaseOutcome, LeasedDelivery, Ledger, LedgerTime, Recorded,
};
use sqlx::PgPool;

/// Publishes (claims and commits) everything due at `now`.
async fn publish_due(ledger: &Ledger, now: DateTime<Utc>) -> Vec<DueDelivery> {
    claim_all(ledger, now).await
}

async fn lease_one(ledger: &Ledger, due: &DueDelivery, now: DateTime<Utc>) -> LeasedDelivery {
    leased(lease(ledger, due, now).await)
}

/// Gives a [`lease_waiting`] lease back, due at once, and removes the bucket that held it, so
/// the next lease goes straight through.
async fn give_back_unthrottled(ledger: &Ledger, lease: &LeasedDelivery, now: DateTime<Utc>) {
    ledger.release(lease, None, at(now)).await.unwrap();
    sqlx::query("DELETE FROM rate_buckets")
        .execute(ledger.pool())
        .await
        .unwrap();
}

/// A lease whose send has not started: its bucket is paused for 400 ms, so the slot is
/// reserved ahead and the send waits for it, unfenced.
async fn lease_waiting(ledger: &Ledger, due: &DueDelivery, now: DateTime<Utc>) -> LeasedDelivery {
    ledger
        .ensure_bucket(&account("main"), due.channel, 100.0, 10, now)
        .await
        .unwrap();
    sqlx::query("UPDATE rate_buckets SET paused_until = $1")
        .bind(now + chrono::Duration::milliseconds(400))
        .execute(ledger.pool())
        .await
        .unwrap();
    match lease(ledger, due, now).await {
        LeaseOutcome::Leased {
            lease,
            slot: nudge_ledger::SendSlot::At { .. },
            ..
        } => lease,
        other => panic!("expected a lease waiting for its slot, got {other:?}"),
    }
}

fn attempt(start: DateTime<Utc>) -> AttemptRecord {
    AttemptRecord {
        started_at: start,
        finished_at: start + secs(1),
        worker: "worker-1".into(),
        correlation_id: Some("corr-1".into()),
    }
}

fn response(status: u16, retry_after: Option<&str>) -> SendOutcome {
    SendOutcome::Response {
        status,
        retry_after: retry_after.map(str::to_owned),
        provider_message_id: (status / 100 == 2).then(|| "prov-123".to_owned()),
    }
}

/// Runs the domain decision for a leased delivery and records it.
async fn settle(ledger: &Ledger, lease: &LeasedDelivery, outcome: SendOutcome, at: DateTime<Utc>) {
    let facts = attempt(at);
    let ctx = AttemptContext {
        attempt_number: lease.attempt_number,
        expires_at: lease.expires_at,
        idempotency: IdempotencySupport::Honoured,
    };
    let decision = decide(
        &ctx,
        &outcome,
        facts.finished_at,
        &RetryPolicy::default(),
        &mut FixedJitter::new(2_000),
    );
    assert_eq!(
        record(ledger, lease, &decision, &facts, facts.finished_at).await,
        Recorded::Applied
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn only_due_deliveries_are_claimed_oldest_first_and_marked_queued_with_a_new_generation(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(
        &ledger,
        tenant.id,
        "later",
        &[Channel::Sms],
        t0() + secs(30),
    )
    .await;
    owed(
        &ledger,
        tenant.id,
        "second",
        &[Channel::Sms],
        t0() - secs(5),
    )
    .await;
    owed(
        &ledger,
        tenant.id,
        "first",
        &[Channel::Sms],
        t0() - secs(10),
    )
    .await;

    let due = publish_due(&ledger, t0()).await;

    assert_eq!(due.len(), 2);
    assert!(due[0].next_attempt_at < due[1].next_attempt_at);
    for d in &due {
        assert_eq!(d.generation, 1);
        assert_eq!(d.lane, Lane::New);
        assert_eq!(
            ledger.delivery(d.id).await.unwrap().unwrap().state,
            DeliveryState::Queued
        );
    }
    assert!(
        publish_due(&ledger, t0()).await.is_empty(),
        "queued work is not claimed twice"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn relays_claiming_at_once_never_claim_the_same_delivery(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    for i in 0..60 {
        owed(
            &ledger,
            tenant.id,
            &format!("e{i}"),
            &[Channel::Sms],
            t0() - secs(i),
        )
        .await;
    }

    let relays: Vec<_> = (0..4)
        .map(|_| {
            let ledger = ledger.clone();
            tokio::spawn(async move {
                let mut mine = Vec::new();
                loop {
                    let batch = ledger.claim_due(Channel::Sms, 7, at(t0())).await.unwrap();
                    if batch.is_empty() {
                        return mine;
                    }
                    mine.extend(batch.into_iter().map(|d| d.id));
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for relay in relays {
        all.extend(relay.await.unwrap());
    }

    assert_eq!(all.len(), 60);
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 60, "no delivery was claimed twice");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_claimed_delivery_is_leasable_as_soon_as_the_claim_returns(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;

    let due = ledger
        .claim_due(Channel::Sms, 10, at(t0()))
        .await
        .unwrap()
        .remove(0);
    // A worker on another connection, as fast as it can be.
    let outcome = lease(&ledger, &due, t0()).await;

    assert!(
        matches!(outcome, LeaseOutcome::Leased { .. }),
        "{outcome:?}"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_failed_publish_is_found_for_republishing_at_the_next_pass(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let failed = ledger.claim_due(Channel::Sms, 10, at(t0())).await.unwrap();

    assert_eq!(ledger.mark_unpublished(&failed).await.unwrap(), 1);
    let again = ledger
        .unconsumed(
            Channel::Sms,
            Duration::from_secs(60),
            10,
            at(t0() + secs(1)),
        )
        .await
        .unwrap();

    assert_eq!(again.len(), 1);
    assert_eq!(again[0].id, failed[0].id);
    assert_eq!(
        again[0].generation, failed[0].generation,
        "a republished message points at the same claim"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn marking_an_old_claim_unpublished_leaves_work_that_moved_on_alone(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let claimed = ledger.claim_due(Channel::Sms, 10, at(t0())).await.unwrap();
    lease_one(&ledger, &claimed[0], t0()).await;

    assert_eq!(ledger.mark_unpublished(&claimed).await.unwrap(), 0);
    assert_eq!(
        ledger.delivery(claimed[0].id).await.unwrap().unwrap().state,
        DeliveryState::Sending
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn of_many_concurrent_leasers_of_one_delivery_exactly_one_wins(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    for i in 0..10 {
        owed(&ledger, tenant.id, &format!("e{i}"), &[Channel::Sms], t0()).await;
    }
    let due = publish_due(&ledger, t0()).await;
    assert_eq!(due.len(), 10);

    for d in due {
        let racers: Vec<_> = (0..8)
            .map(|i| {
                let ledger = ledger.clone();
                let d = d.clone();
                tokio::spawn(async move {
                    lease_as(
                        &ledger,
                        &d,
                        &format!("worker-{i}"),
                        &routes(IdempotencySupport::Honoured),
                        t0(),
                    )
                    .await
                })
            })
            .collect();
        let mut winners = 0;
        for racer in racers {
            match racer.await.unwrap() {
                LeaseOutcome::Leased { .. } => winners += 1,
                LeaseOutcome::Stale { state, .. } => assert_eq!(state, DeliveryState::Sending),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(winners, 1);
        let record = ledger.delivery(d.id).await.unwrap().unwrap();
        assert_eq!(record.attempt_count, 1);
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_message_with_an_old_generation_is_stale(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let first = publish_due(&ledger, t0()).await.remove(0);
    // Leased, given back before its send (no slot in time), and claimed again.
    let held = lease_waiting(&ledger, &first, t0()).await;
    give_back_unthrottled(&ledger, &held, t0()).await;
    let second = publish_due(&ledger, t0() + secs(1)).await.remove(0);

    assert_eq!(second.generation, first.generation + 1);
    let old = lease(&ledger, &first, t0() + secs(1)).await;
    assert!(
        matches!(
            old,
            LeaseOutcome::Stale {
                state: DeliveryState::Queued,
                generation
            } if generation == second.generation
        ),
        "{old:?}"
    );
    let new = lease(&ledger, &second, t0() + secs(1)).await;
    assert!(matches!(new, LeaseOutcome::Leased { .. }));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn recently_queued_work_is_not_republished(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    publish_due(&ledger, t0()).await;

    let again = ledger
        .unconsumed(
            Channel::Sms,
            Duration::from_secs(60),
            10,
            at(t0() + secs(30)),
        )
        .await
        .unwrap();

    assert!(again.is_empty());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_expired_delivery_is_settled_as_expired_instead_of_leased(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let due = publish_due(&ledger, t0()).await.remove(0);

    let after_expiry = t0() + secs(3600);
    let outcome = lease(&ledger, &due, after_expiry).await;

    assert!(matches!(outcome, LeaseOutcome::Expired), "{outcome:?}");
    let record = ledger.delivery(due.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Expired);
    assert_eq!(record.attempt_count, 0, "nothing was sent");
    assert!(ledger.attempts(due.id).await.unwrap().is_empty());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_delivered_outcome_settles_the_delivery_and_appends_one_attempt(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let due = publish_due(&ledger, t0()).await.remove(0);
    let lease = lease_one(&ledger, &due, t0()).await;

    settle(&ledger, &lease, response(202, None), t0()).await;

    let record = ledger.delivery(due.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Delivered);
    assert_eq!(record.provider_message_id.as_deref(), Some("prov-123"));
    assert_eq!(record.lease_holder, None);
    assert_eq!(
        record.settled_at,
        Some(t0() + secs(1)),
        "settled on the ledger's clock"
    );
    let attempts = ledger.attempts(due.id).await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].attempt_number, 1);
    assert_eq!(attempts[0].outcome_class, OutcomeClass::Delivered);
    assert_eq!(attempts[0].http_status, Some(202));
    assert_eq!(attempts[0].next_state, DeliveryState::Delivered);
    assert_eq!(attempts[0].lane, Lane::New);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_429_with_retry_after_waits_exactly_that_long_then_comes_back_on_the_retry_lane(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let due = publish_due(&ledger, t0()).await.remove(0);
    let lease = lease_one(&ledger, &due, t0()).await;

    settle(&ledger, &lease, response(429, Some("120")), t0()).await;

    let finished = t0() + secs(1);
    let record = ledger.delivery(due.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::RetryWait);
    assert_eq!(record.next_attempt_at, Some(finished + secs(120)));
    assert_eq!(record.last_error_class.as_deref(), Some("retryable"));
    let attempts = ledger.attempts(due.id).await.unwrap();
    assert_eq!(attempts[0].retry_after_seen.as_deref(), Some("120"));
    assert!(attempts[0].retry_after_valid);
    assert_eq!(attempts[0].delay_chosen, Some(Duration::from_secs(120)));

    assert!(publish_due(&ledger, finished + secs(119)).await.is_empty());
    let retry = publish_due(&ledger, finished + secs(120)).await.remove(0);
    assert_eq!(retry.lane, Lane::Retry);
    assert_eq!(retry.generation, 2);
    let second = lease_one(&ledger, &retry, finished + secs(120)).await;
    assert_eq!(second.attempt_number, 2);
    assert_eq!(
        second.idempotency_key, lease.idempotency_key,
        "the key is stable across attempts"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_permanent_400_dead_letters_with_the_status_as_reason(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Email], t0()).await;
    let due = publish_due(&ledger, t0()).await.remove(0);
    let lease = lease_one(&ledger, &due, t0()).await;

    settle(&ledger, &lease, response(400, None), t0()).await;

    let record = ledger.delivery(due.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::DeadLettered);
    assert_eq!(record.last_error_reason.as_deref(), Some("http_400"));
    assert_eq!(record.last_error_class.as_deref(), Some("terminal"));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_outcome_after_the_lease_was_lost_is_refused_and_writes_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let due = publish_due(&ledger, t0()).await.remove(0);
    let lease = lease_one(&ledger, &due, t0()).await;
    // Another party (the lease reaper) moved the delivery on.
    sqlx::query("UPDATE deliveries SET state = 'ambiguous', lease_owner = NULL, lease_expires_at = NULL, send_started_at = NULL, settled_at = now() WHERE id = $1")
        .bind(due.id.as_uuid())
        .execute(&pool)
        .await
        .unwrap();

    let decision = decide(
        &AttemptContext {
            attempt_number: 1,
            expires_at: lease.expires_at,
            idempotency: IdempotencySupport::Honoured,
        },
        &response(200, None),
        t0(),
        &RetryPolicy::default(),
        &mut FixedJitter::zero(),
    );
    let recorded = record(&ledger, &lease, &decision, &attempt(t0()), t0()).await;

    assert_eq!(recorded, Recorded::LeaseLost);
    assert_eq!(
        ledger.delivery(due.id).await.unwrap().unwrap().state,
        DeliveryState::Ambiguous
    );
    assert!(ledger.attempts(due.id).await.unwrap().is_empty());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_released_lease_waits_for_its_time_without_spending_an_attempt(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let due = publish_due(&ledger, t0()).await.remove(0);
    let lease = lease_waiting(&ledger, &due, t0()).await;

    ledger
        .release(&lease, Some(t0() + secs(10)), at(t0()))
        .await
        .unwrap();

    let record = ledger.delivery(due.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::RetryWait);
    assert_eq!(record.attempt_count, 0);
    assert_eq!(record.next_attempt_at, Some(t0() + secs(10)));
    assert!(
        ledger.release(&lease, None, at(t0())).await.is_err(),
        "a lease is released once"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_expiry_sweep_settles_only_owed_work_past_its_expiry(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(
        &ledger,
        tenant.id,
        "old",
        &[Channel::Sms],
        t0() - secs(3600),
    )
    .await;
    owed(
        &ledger,
        tenant.id,
        "sending",
        &[Channel::Push],
        t0() - secs(3590),
    )
    .await;
    owed(&ledger, tenant.id, "fresh", &[Channel::Email], t0()).await;
    let sending = publish_due(&ledger, t0() - secs(3590))
        .await
        .into_iter()
        .find(|d| d.channel == Channel::Push)
        .unwrap();
    lease_one(&ledger, &sending, t0() - secs(3590)).await;

    // Both `old` (expired at t0) and `sending` (expired at t0 + 10 s) are past their expiry
    // when the sweep runs; only the one not being sent is settled.
    let sweep_at = t0() + secs(20);
    let expired = ledger.expire_overdue(100, at(sweep_at)).await.unwrap();

    assert_eq!(expired, 1);
    let sending = ledger.delivery(sending.id).await.unwrap().unwrap();
    assert!(sending.expires_at < sweep_at, "it was a candidate by time");
    assert_eq!(
        sending.state,
        DeliveryState::Sending,
        "work being sent finishes; its outcome decides"
    );
    let state_of = |channel: &'static str| {
        sqlx::query_scalar::<_, String>("SELECT state FROM deliveries WHERE channel = $1")
            .bind(channel)
            .fetch_one(ledger.pool())
    };
    assert_eq!(state_of("sms").await.unwrap(), "expired");
    assert_eq!(
        state_of("email").await.unwrap(),
        "scheduled",
        "fresh work is untouched"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_delivery_twice_in_one_batch_is_leased_once(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let due = publish_due(&ledger, t0()).await.remove(0);
    let leaser = Leaser::new(IdempotencySupport::Honoured);
    let batch = leaser.batch(Channel::Sms, "worker-1", at(t0()));

    let result = ledger
        .lease_batch(&batch, &[due.message_pointer(), due.message_pointer()])
        .await
        .unwrap();

    assert!(matches!(result.outcomes[0], LeaseOutcome::Leased { .. }));
    assert!(matches!(result.outcomes[1], LeaseOutcome::Stale { .. }));
    assert_eq!(
        ledger
            .delivery(due.id)
            .await
            .unwrap()
            .unwrap()
            .attempt_count,
        1
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_lease_whose_send_started_is_never_given_back(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let due = publish_due(&ledger, t0()).await.remove(0);
    // No bucket: the lease is the fence, and the send has started.
    let lease = lease_one(&ledger, &due, t0()).await;

    assert!(ledger.release(&lease, None, at(t0())).await.is_err());
    let record = ledger.delivery(due.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Sending, "its outcome decides");
    assert_eq!(record.attempt_count, 1);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_released_lease_keeps_its_lane_and_a_failed_attempt_moves_it_to_retry(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let due = publish_due(&ledger, t0()).await.remove(0);
    let lease = lease_waiting(&ledger, &due, t0()).await;

    // No slot in time: given back, due at once.
    give_back_unthrottled(&ledger, &lease, t0()).await;
    let again = publish_due(&ledger, t0()).await.remove(0);
    assert_eq!(
        again.lane,
        Lane::New,
        "a throttled first attempt is still new work"
    );

    // A real attempt that fails moves it to the retry lane.
    let lease = lease_one(&ledger, &again, t0()).await;
    assert_eq!(lease.attempt_number, 1, "the give-back spent no attempt");
    settle(&ledger, &lease, response(503, None), t0()).await;
    let retry = publish_due(&ledger, t0() + secs(3)).await.remove(0);
    assert_eq!(retry.lane, Lane::Retry);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn one_batch_lease_explains_every_message_it_did_not_lease(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    for event in ["ok", "stale", "expired", "cancelled", "elsewhere"] {
        owed(&ledger, tenant.id, event, &[Channel::Sms], t0()).await;
    }
    let due = publish_due(&ledger, t0()).await;
    assert_eq!(due.len(), 5);
    // Give each message its own fate, by hand, through the database.
    let ids: Vec<uuid::Uuid> = due.iter().map(|d| d.id.as_uuid()).collect();
    sqlx::query("UPDATE deliveries SET generation = generation + 1 WHERE id = $1")
        .bind(ids[1])
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE deliveries SET scheduled_at = $2 - interval '1 minute', expires_at = $2 WHERE id = $1")
        .bind(ids[2])
        .bind(t0() - secs(1))
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE reminders SET cancelled_at = $2 FROM deliveries d WHERE d.id = $1 AND reminders.id = d.reminder_id")
        .bind(ids[3])
        .bind(t0())
        .execute(&pool)
        .await
        .unwrap();
    ledger
        .set_tenant_channel_account(
            tenant.id,
            Channel::Sms,
            Some(&account("nowhere")),
            &ops(t0()),
        )
        .await
        .unwrap();
    // Another live worker has that account.
    ledger
        .announce_accounts(Channel::Sms, &[account("nowhere")], at(t0()))
        .await
        .unwrap();
    let leaser = Leaser::new(IdempotencySupport::Honoured);
    let batch = leaser.batch(Channel::Sms, "worker-1", at(t0()));
    let messages: Vec<_> = due.iter().map(DueDelivery::message_pointer).collect();
    let result = ledger.lease_batch(&batch, &messages).await.unwrap();

    // The tenant is routed to an account this worker lacks and another has: nothing owed is
    // leased here, and it stays queued for the other.
    assert!(matches!(result.outcomes[0], LeaseOutcome::UnknownAccount(ref a) if a == "nowhere"));
    assert!(matches!(
        result.outcomes[1],
        LeaseOutcome::Stale {
            state: DeliveryState::Queued,
            ..
        }
    ));
    assert!(matches!(result.outcomes[2], LeaseOutcome::Expired));
    assert!(matches!(result.outcomes[3], LeaseOutcome::Cancelled));
    assert!(matches!(
        result.outcomes[4],
        LeaseOutcome::UnknownAccount(_)
    ));

    // Routed back to the default, the two still owed are leased in one statement.
    ledger
        .set_tenant_channel_account(tenant.id, Channel::Sms, None, &ops(t0()))
        .await
        .unwrap();
    let result = ledger
        .lease_batch(&batch, &[messages[0], messages[4]])
        .await
        .unwrap();
    for outcome in &result.outcomes {
        match outcome {
            LeaseOutcome::Leased {
                lease,
                material,
                slot,
            } => {
                assert_eq!(
                    *slot,
                    nudge_ledger::SendSlot::Now,
                    "no bucket: fenced with the lease"
                );
                assert_eq!(lease.provider_account.as_str(), "main");
                assert!(material.as_ref().unwrap().destination.is_none());
            }
            other => panic!("expected a lease, got {other:?}"),
        }
    }
    assert_eq!(result.leased_at, t0());
    assert_eq!(
        ledger.delivery(due[2].id).await.unwrap().unwrap().state,
        DeliveryState::Expired
    );
    assert_eq!(
        ledger.delivery(due[3].id).await.unwrap().unwrap().state,
        DeliveryState::Cancelled
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn status_counts_each_channel_and_the_age_of_its_oldest_eligible_work(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "a", &[Channel::Sms], t0() - secs(90)).await;
    owed(&ledger, tenant.id, "b", &[Channel::Sms], t0() + secs(90)).await;
    owed(&ledger, tenant.id, "c", &[Channel::Email], t0() - secs(10)).await;
    let email = publish_due(&ledger, t0())
        .await
        .into_iter()
        .find(|d| d.channel == Channel::Email)
        .unwrap();
    let lease = lease_one(&ledger, &email, t0()).await;
    settle(&ledger, &lease, response(400, None), t0()).await;

    let status = ledger.status(t0()).await.unwrap();

    assert_eq!(status.len(), 3);
    let sms = status.iter().find(|s| s.channel == Channel::Sms).unwrap();
    assert_eq!((sms.scheduled, sms.queued, sms.due), (1, 1, 0));
    assert_eq!(sms.oldest_eligible_age_s, Some(90));
    let email = status.iter().find(|s| s.channel == Channel::Email).unwrap();
    assert_eq!(email.dead_lettered, 1);
    assert_eq!(email.oldest_eligible_age_s, None);
    let push = status.iter().find(|s| s.channel == Channel::Push).unwrap();
    assert_eq!(
        push.scheduled + push.queued + push.sending + push.dead_lettered,
        0
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_batch_holding_an_old_copy_before_the_republished_one_leases_the_newest(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let first = publish_due(&ledger, t0()).await.remove(0);
    let held = lease_waiting(&ledger, &first, t0()).await;
    give_back_unthrottled(&ledger, &held, t0()).await;
    let second = publish_due(&ledger, t0() + secs(1)).await.remove(0);
    assert_eq!(second.generation, first.generation + 1);
    let leaser = Leaser::new(IdempotencySupport::Honoured);
    let batch = leaser.batch(Channel::Sms, "worker-1", at(t0() + secs(1)));

    // The broker delivered the stale copy first, then the republished one.
    let result = ledger
        .lease_batch(&batch, &[first.message_pointer(), second.message_pointer()])
        .await
        .unwrap();

    assert!(
        matches!(result.outcomes[0], LeaseOutcome::Stale { .. }),
        "{:?}",
        result.outcomes[0]
    );
    assert!(
        matches!(result.outcomes[1], LeaseOutcome::Leased { .. }),
        "the newest copy is the one tried: {:?}",
        result.outcomes[1]
    );
    assert_eq!(
        ledger.delivery(second.id).await.unwrap().unwrap().state,
        DeliveryState::Sending
    );
}

/// The lease finds its candidates with the transaction's clock and waits for its buckets'
/// locks after: a delivery that expires during that wait must not come back fenced.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_delivery_that_expires_while_the_lease_waits_for_its_bucket_is_not_fenced(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let db_now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    let reminder = nudge_ledger::NewReminder::new(
        tenant.id,
        nudge_domain::EventId::parse("short-lived").unwrap(),
        nudge_domain::SubscriberRef::parse("patient-0001").unwrap(),
        &[Channel::Sms],
        db_now - secs(1),
        db_now + chrono::Duration::milliseconds(1_500),
    )
    .unwrap();
    let created = ledger
        .create_reminder(&reminder, &cipher(), db_now)
        .await
        .unwrap();
    ledger
        .materialise_reminder(tenant.id, created.id, db_now)
        .await
        .unwrap();
    ledger
        .ensure_bucket(&account("main"), Channel::Sms, 100.0, 100, db_now)
        .await
        .unwrap();
    let due = ledger
        .claim_due(Channel::Sms, 10, LedgerTime::Database)
        .await
        .unwrap()
        .remove(0);

    // Another worker holds the bucket's lock while the delivery's expiry passes.
    let mut holder = ledger.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM rate_buckets FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let leasing = {
        let ledger = ledger.clone();
        let message = due.message_pointer();
        tokio::spawn(async move {
            let leaser = Leaser::new(IdempotencySupport::NotHonoured);
            let batch = leaser.batch(Channel::Sms, "worker-1", LedgerTime::Database);
            ledger
                .lease_batch(&batch, &[message])
                .await
                .unwrap()
                .outcomes
                .remove(0)
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(ledger.pool())
        .await
        .unwrap();
        let expired: bool = sqlx::query_scalar(
            "SELECT clock_timestamp() > expires_at FROM deliveries WHERE id = $1",
        )
        .bind(due.id.as_uuid())
        .fetch_one(ledger.pool())
        .await
        .unwrap();
        if waiting > 0 && expired {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the lease never waited for the bucket past the expiry"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    holder.commit().await.unwrap();

    let outcome = leasing.await.unwrap();
    let started: Option<DateTime<Utc>> =
        sqlx::query_scalar("SELECT send_started_at FROM deliveries WHERE id = $1")
            .bind(due.id.as_uuid())
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    assert_eq!(started, None, "an expired delivery's send never starts");
    let LeaseOutcome::Leased {
        lease,
        slot: nudge_ledger::SendSlot::At { reserved_at, .. },
        ..
    } = outcome
    else {
        panic!("expected a lease left to its fence, got {outcome:?}");
    };
    let fenced = ledger
        .fence(
            &lease,
            reserved_at,
            LEASE,
            std::time::Duration::from_secs(10),
            LedgerTime::Database,
        )
        .await
        .unwrap();
    assert_eq!(fenced, Err(nudge_ledger::FenceRefused::Expired));
    assert_eq!(
        ledger.delivery(due.id).await.unwrap().unwrap().state,
        DeliveryState::Expired
    );
}
