//! Rate buckets in the ledger: slots taken with the lease under the row lock, the fence,
//! provider feedback and its bounds, operator changes, and lock timeouts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::drain::{self, BucketRates};
use nudge_domain::{
    AdmissionSettings, Channel, DeferReason, DeliveryState, IdempotencySupport, ProviderAccount,
    ThrottledSend,
};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    DueDelivery, Feedback, FeedbackApplied, FenceRefused, LeaseOutcome, LeasedDelivery, Ledger,
    Operator, SendSlot, Slotted,
};
use sqlx::PgPool;

fn main_account() -> ProviderAccount {
    account("main")
}

fn wait(max_wait_ms: u64) -> AdmissionSettings {
    AdmissionSettings {
        max_wait: Duration::from_millis(max_wait_ms),
        ..AdmissionSettings::default()
    }
}

/// `n` SMS deliveries due at t0, claimed (published).
async fn due(ledger: &Ledger, n: usize) -> Vec<DueDelivery> {
    let name = format!("clinic-{}", uuid::Uuid::new_v4().simple());
    let tenant = ledger.create_tenant(&name, &ops(t0())).await.unwrap();
    for i in 0..n {
        owed(ledger, tenant.id, &format!("e{i}"), &[Channel::Sms], t0()).await;
    }
    ledger
        .claim_due(Channel::Sms, 10_000, at(t0()))
        .await
        .unwrap()
}

/// Leases `messages` in one batch at `now`, as `lease_holder`, waiting at most
/// `settings.max_wait`.
async fn lease_batch(
    ledger: &Ledger,
    messages: &[DueDelivery],
    lease_holder: &str,
    settings: &AdmissionSettings,
    now: DateTime<Utc>,
) -> Vec<LeaseOutcome> {
    let routes = routes(IdempotencySupport::Honoured);
    let cipher = cipher();
    let batch = batch_of(
        Channel::Sms,
        lease_holder,
        &routes,
        settings,
        &cipher,
        at(now),
    );
    let messages: Vec<_> = messages.iter().map(DueDelivery::message_pointer).collect();
    ledger
        .lease_batch(&batch, &messages)
        .await
        .unwrap()
        .outcomes
}

/// A lease waiting for its slot: the last of `burst + 1` leased at once, with its slot's times.
async fn waiting_lease(ledger: &Ledger, burst: usize) -> (LeasedDelivery, ThrottledSend) {
    let due = due(ledger, burst + 1).await;
    let outcomes = lease_batch(ledger, &due, "worker-1", &wait(500), t0()).await;
    match outcomes.into_iter().last().unwrap() {
        LeaseOutcome::Leased {
            lease,
            slot: SendSlot::At {
                reserved_at,
                send_at,
            },
            ..
        } => (
            lease,
            ThrottledSend {
                reserved_at,
                slot_at: send_at,
            },
        ),
        other => panic!("expected a waiting lease, got {other:?}"),
    }
}

/// A send that went out at its reservation.
fn at_once(at: DateTime<Utc>) -> ThrottledSend {
    ThrottledSend {
        reserved_at: at,
        slot_at: at,
    }
}

async fn feedback(
    ledger: &Ledger,
    feedback: Feedback,
    now: DateTime<Utc>,
) -> Option<FeedbackApplied> {
    ledger
        .bucket_feedback(
            &main_account(),
            Channel::Sms,
            feedback,
            Duration::from_secs(60),
            at(now),
        )
        .await
        .unwrap()
}

/// A 429 alone, a moment before `now`: it moves nothing but makes the next one within the
/// confirmation window act (decision 0120).
async fn an_earlier_429(ledger: &Ledger, now: DateTime<Utc>) {
    let lone = feedback(
        ledger,
        Feedback::Throttled {
            retry_at: None,
            send: None,
        },
        now - chrono::Duration::milliseconds(100),
    )
    .await;
    assert_eq!(
        lone.map(|a| (a.effective_rate, a.paused_until)),
        None,
        "a lone 429 changes neither rate nor pause"
    );
}

async fn send_started_at(pool: &PgPool, lease: &LeasedDelivery) -> Option<DateTime<Utc>> {
    sqlx::query_scalar("SELECT send_started_at FROM deliveries WHERE id = $1")
        .bind(lease.id.as_uuid())
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_account_without_a_bucket_is_leased_and_fenced_in_one_statement(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let due = due(&ledger, 1).await;

    let outcome = lease_batch(&ledger, &due, "worker-1", &wait(0), t0())
        .await
        .remove(0);

    let LeaseOutcome::Leased { lease, slot, .. } = outcome else {
        panic!("expected a lease, got {outcome:?}");
    };
    assert_eq!(slot, SendSlot::Now);
    assert_eq!(
        send_started_at(&pool, &lease).await,
        Some(t0()),
        "fenced with the lease"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn replicas_leasing_at_once_share_one_bucket_exactly(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 20.0, 5, t0())
        .await
        .unwrap();
    // Eight replicas lease 30 messages each, in batches of 5, at the same instant, with a
    // 10 s horizon.
    let due = due(&ledger, 240).await;
    let slots = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = due
        .chunks(30)
        .enumerate()
        .map(|(replica, mine)| {
            let ledger = ledger.clone();
            let slots = slots.clone();
            let mine = mine.to_vec();
            tokio::spawn(async move {
                for batch in mine.chunks(5) {
                    let lease_holder = format!("replica-{replica}");
                    for outcome in
                        lease_batch(&ledger, batch, &lease_holder, &wait(10_000), t0()).await
                    {
                        match outcome {
                            LeaseOutcome::Leased {
                                slot: SendSlot::Now,
                                ..
                            } => slots.lock().unwrap().push(t0()),
                            LeaseOutcome::Leased {
                                slot: SendSlot::At { send_at, .. },
                                ..
                            } => slots.lock().unwrap().push(send_at),
                            LeaseOutcome::Released { .. } => {}
                            other => panic!("unexpected {other:?}"),
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let mut slots = slots.lock().unwrap().clone();
    slots.sort();
    // 5 at once, then one every 50 ms, up to the 10 s horizon: 5 + 200 slots.
    assert_eq!(slots.len(), 205);
    assert_eq!(slots.iter().filter(|s| **s == t0()).count(), 5);
    let busiest = slots
        .iter()
        .map(|s| {
            slots
                .iter()
                .filter(|t| *t >= s && **t < *s + chrono::Duration::seconds(1))
                .count()
        })
        .max()
        .unwrap();
    assert!(
        busiest <= 25,
        "{busiest} slots in one second from a 20/s, burst-5 bucket"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_429_with_retry_after_pauses_the_bucket_for_every_replica(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    // A burst of 1, so the 429 is about the rate: with a larger one, a 429 for a send reserved
    // while the burst was spent shrinks the burst instead (0111).
    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 20.0, 1, t0())
        .await
        .unwrap();
    let (waiting, send) = waiting_lease(&ledger, 1).await;
    let until = t0() + secs(3);
    an_earlier_429(&ledger, t0() + secs(1)).await;

    let changed = feedback(
        &ledger,
        Feedback::Throttled {
            retry_at: Some(until),
            send: Some(send),
        },
        t0() + secs(1),
    )
    .await;

    assert_eq!(
        changed.map(|a| (
            a.effective_rate,
            a.paused_until,
            a.pause_capped,
            a.burst_limit
        )),
        Some((10.0, Some(until), false, None)),
        "paused, and (a first 429) halved"
    );
    // The send that waited for its slot is not fenced: the bucket is paused.
    let fenced = ledger
        .fence(
            &waiting,
            send.reserved_at,
            LEASE,
            Duration::from_secs(10),
            at(t0() + secs(1)),
        )
        .await
        .unwrap();
    assert_eq!(fenced, Err(FenceRefused::BucketClosedUntil(until)));
    assert_eq!(send_started_at(&pool, &waiting).await, None);
    // Another replica gets no slot until the pause ends.
    let more = due(&ledger, 1).await;
    let other = lease_batch(&ledger, &more, "replica-2", &wait(500), t0() + secs(1))
        .await
        .remove(0);
    assert!(
        matches!(other, LeaseOutcome::Released { until: u, reason: DeferReason::Paused, .. } if u == until),
        "{other:?}"
    );
    assert_eq!(
        ledger
            .delivery(more[0].id)
            .await
            .unwrap()
            .unwrap()
            .next_attempt_at,
        Some(until),
        "given back, due when the pause ends"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_slot_reserved_before_a_slow_down_is_reserved_again(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 20.0, 5, t0())
        .await
        .unwrap();
    let (waiting, ThrottledSend { reserved_at, .. }) = waiting_lease(&ledger, 5).await;
    an_earlier_429(&ledger, t0() + secs(1)).await;
    feedback(
        &ledger,
        Feedback::Throttled {
            retry_at: None,
            send: None,
        },
        t0() + secs(1),
    )
    .await;

    let fenced = ledger
        .fence(
            &waiting,
            reserved_at,
            LEASE,
            Duration::from_secs(10),
            at(t0() + secs(2)),
        )
        .await
        .unwrap();
    assert_eq!(fenced, Err(FenceRefused::Slowed));

    let routes = routes(IdempotencySupport::Honoured);
    let settings = wait(500);
    let cipher = cipher();
    let batch = batch_of(
        Channel::Sms,
        "worker-1",
        &routes,
        &settings,
        &cipher,
        at(t0() + secs(2)),
    );
    let again = ledger.readmit(&batch, waiting.clone()).await.unwrap();
    assert!(
        matches!(again, Slotted::Slot(SendSlot::Now, _)),
        "a slot at the new pace: {again:?}"
    );
    assert_eq!(send_started_at(&pool, &waiting).await, Some(t0() + secs(2)));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_fence_refuses_a_send_that_expired_or_was_cancelled_while_it_waited(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 20.0, 1, t0())
        .await
        .unwrap();
    let (expiring, ThrottledSend { reserved_at, .. }) = waiting_lease(&ledger, 1).await;
    let after_expiry = expiring.expires_at + secs(1);
    let lease_for = Duration::from_secs(7200);
    // Renew the lease so only the expiry can refuse it.
    sqlx::query("UPDATE deliveries SET lease_expires_at = $2 WHERE id = $1")
        .bind(expiring.id.as_uuid())
        .bind(after_expiry + secs(60))
        .execute(&pool)
        .await
        .unwrap();

    let refused = ledger
        .fence(
            &expiring,
            reserved_at,
            lease_for,
            Duration::from_secs(10),
            at(after_expiry),
        )
        .await
        .unwrap();

    assert_eq!(refused, Err(FenceRefused::Expired));
    let record = ledger.delivery(expiring.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Expired);
    assert_eq!(record.attempt_count, 0, "nothing was sent");

    // A reminder cancelled while its send waited for a slot.
    sqlx::query("DELETE FROM rate_buckets")
        .execute(&pool)
        .await
        .unwrap();
    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 20.0, 1, t0())
        .await
        .unwrap();
    let tenant = ledger.create_tenant("clinic-b", &ops(t0())).await.unwrap();
    owed(&ledger, tenant.id, "x", &[Channel::Sms], t0()).await;
    owed(&ledger, tenant.id, "y", &[Channel::Sms], t0()).await;
    let pair = ledger.claim_due(Channel::Sms, 10, at(t0())).await.unwrap();
    let outcomes = lease_batch(&ledger, &pair, "worker-1", &wait(500), t0()).await;
    let (waiting, reserved_at) = outcomes
        .into_iter()
        .find_map(|o| match o {
            LeaseOutcome::Leased {
                lease,
                slot: SendSlot::At { reserved_at, .. },
                ..
            } => Some((lease, reserved_at)),
            _ => None,
        })
        .unwrap();
    sqlx::query("UPDATE reminders SET cancelled_at = $2 WHERE id = $1")
        .bind(waiting.reminder_id.as_uuid())
        .bind(t0())
        .execute(&pool)
        .await
        .unwrap();

    let refused = ledger
        .fence(
            &waiting,
            reserved_at,
            LEASE,
            Duration::from_secs(10),
            at(t0() + secs(1)),
        )
        .await
        .unwrap();

    assert_eq!(refused, Err(FenceRefused::Cancelled));
    assert_eq!(
        ledger.delivery(waiting.id).await.unwrap().unwrap().state,
        DeliveryState::Cancelled
    );
    // A lease that was reaped meanwhile is not this worker's any more.
    let lost = ledger
        .fence(
            &waiting,
            reserved_at,
            LEASE,
            Duration::from_secs(10),
            at(t0() + secs(1)),
        )
        .await
        .unwrap();
    assert_eq!(lost, Err(FenceRefused::LeaseLost));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_huge_retry_after_pauses_the_bucket_at_most_the_maximum_and_an_operator_can_clear_it(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 20.0, 5, t0())
        .await
        .unwrap();
    let asked = t0() + secs(99_999_999);
    an_earlier_429(&ledger, t0()).await;

    let applied = feedback(
        &ledger,
        Feedback::Throttled {
            retry_at: Some(asked),
            send: Some(at_once(t0())),
        },
        t0(),
    )
    .await
    .unwrap();

    assert_eq!(applied.paused_until, Some(t0() + secs(60)));
    assert!(applied.pause_capped);
    let bucket = &ledger.rate_buckets().await.unwrap()[0];
    assert_eq!(bucket.paused_until, Some(t0() + secs(60)));
    let cause = bucket.pause_cause.as_deref().unwrap();
    assert!(cause.contains("99999999"), "{cause}");
    assert!(cause.contains("max_pause_s"), "{cause}");
    // Past the bound, the bucket admits again (at its lowered rate).
    let later = due(&ledger, 1).await;
    let outcome = lease_batch(&ledger, &later, "w", &wait(500), t0() + secs(61))
        .await
        .remove(0);
    assert!(
        matches!(outcome, LeaseOutcome::Leased { .. }),
        "{outcome:?}"
    );

    // A second pause, cleared by an operator: the change and its audit row together.
    feedback(
        &ledger,
        Feedback::Throttled {
            retry_at: Some(t0() + secs(120)),
            send: Some(at_once(t0() + secs(62))),
        },
        t0() + secs(62),
    )
    .await;
    let oncall = Operator::new(
        "oncall",
        Some("provider confirmed recovery"),
        t0() + secs(63),
    )
    .unwrap();
    let resumed = ledger
        .resume_bucket(&main_account(), Channel::Sms, &oncall)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resumed.paused_until, None);
    assert_eq!(resumed.pause_cause, None);
    let recent = ledger.recent_audit(1).await.unwrap();
    assert_eq!(recent[0].action, "rate_resume");
    assert!(recent[0].details["paused_until"].is_string());

    assert_eq!(recent[0].actor, "oncall");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_rate_of_zero_closes_the_bucket_and_raising_it_reopens(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 20.0, 5, t0())
        .await
        .unwrap();
    let due = due(&ledger, 2).await;

    ledger
        .set_rate(&main_account(), Channel::Sms, 0.0, None, &ops(t0()))
        .await
        .unwrap();
    let closed = lease_batch(&ledger, &due[..1], "w", &wait(500), t0())
        .await
        .remove(0);
    let channel_rate = ledger.channel_rate(Channel::Sms, at(t0())).await.unwrap();
    ledger
        .set_rate(&main_account(), Channel::Sms, 20.0, None, &ops(t0()))
        .await
        .unwrap();
    let reopened = lease_batch(&ledger, &due[1..], "w", &wait(500), t0())
        .await
        .remove(0);

    assert!(
        matches!(closed, LeaseOutcome::Released { reason: DeferReason::Closed, until, .. } if until == t0() + secs(10)),
        "{closed:?}"
    );
    assert_eq!(channel_rate, Some(0.0));
    assert!(
        matches!(
            reopened,
            LeaseOutcome::Leased {
                slot: SendSlot::Now,
                ..
            }
        ),
        "{reopened:?}"
    );
    assert_eq!(
        ledger.channel_rate(Channel::Email, at(t0())).await.unwrap(),
        None,
        "no bucket: not limited"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_bucket_changed_at_run_time_keeps_its_rate_when_workers_restart(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 40.0, 10, t0())
        .await
        .unwrap();
    ledger
        .set_rate(&main_account(), Channel::Sms, 12.0, Some(3), &ops(t0()))
        .await
        .unwrap();

    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 40.0, 10, t0() + secs(60))
        .await
        .unwrap();

    let bucket = &ledger.rate_buckets().await.unwrap()[0];
    assert_eq!(
        (bucket.rate_per_second, bucket.burst, bucket.effective_rate),
        (12.0, 3, 12.0)
    );
    assert_eq!(bucket.changed_by, "ops@clinic");
}

/// The pool a process builds from its `database` section, on this test's database.
async fn configured_ledger(pool: &PgPool, lock_timeout_ms: u64) -> Ledger {
    let base = std::env::var("DATABASE_URL").unwrap();
    let name = pool.connect_options().get_database().unwrap().to_owned();
    let mut url = url::Url::parse(&base).unwrap();
    url.set_path(&name);
    Ledger::connect(&nudge_config::DatabaseConfig {
        url: nudge_config::Secret::new(url.to_string()),
        max_connections: 2,
        lock_timeout_ms,
        ..nudge_config::DatabaseConfig::default()
    })
    .await
    .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_bucket_row_held_by_a_stalled_peer_stops_a_lease_at_the_lock_timeout(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 20.0, 5, t0())
        .await
        .unwrap();
    let due = due(&ledger, 1).await;
    let worker = configured_ledger(&pool, 300).await;
    // A stalled replica holds the bucket's row lock and does nothing.
    let mut stalled = pool.begin().await.unwrap();
    sqlx::query("SELECT * FROM rate_buckets FOR UPDATE")
        .execute(&mut *stalled)
        .await
        .unwrap();

    let routes = routes(IdempotencySupport::Honoured);
    let settings = wait(500);
    let cipher = cipher();
    let batch = batch_of(
        Channel::Sms,
        "worker-1",
        &routes,
        &settings,
        &cipher,
        at(t0()),
    );
    let started = std::time::Instant::now();
    let result = worker
        .lease_batch(&batch, &[due[0].message_pointer()])
        .await;
    let waited = started.elapsed();

    assert!(
        result.is_err(),
        "the lock timeout ends the wait with an error"
    );
    // Tolerance: the 300 ms lock timeout plus scheduling on a loaded machine.
    assert!(waited < Duration::from_secs(5), "waited {waited:?}");
    assert_eq!(
        ledger.delivery(due[0].id).await.unwrap().unwrap().state,
        DeliveryState::Queued,
        "nothing was leased: the transaction rolled back"
    );
    stalled.rollback().await.unwrap();
    let result = worker
        .lease_batch(&batch, &[due[0].message_pointer()])
        .await
        .unwrap();
    assert!(matches!(result.outcomes[0], LeaseOutcome::Leased { .. }));
}

/// The fence checks its bucket in SQL, inside the send's one conditional UPDATE, and the relay's
/// `channel_rate` counts buckets with `nudge_domain::drain`: on the same rows, a bucket the
/// fence refuses is one the drain model leaves out of the admitted rate, and no other.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_fence_refuses_exactly_the_buckets_the_drain_model_leaves_out(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 20.0, 5, t0())
        .await
        .unwrap();
    let now = t0() + secs(1);
    let rates = |rate_per_second, effective_rate, paused_until| BucketRates {
        rate_per_second,
        effective_rate,
        paused_until,
    };
    let cases = [
        rates(20.0, 20.0, None),
        rates(20.0, 5.0, None),
        rates(0.0, 0.0, None),
        rates(20.0, 0.0, None),
        rates(20.0, 20.0, Some(now + secs(5))),
        rates(20.0, 20.0, Some(now - secs(5))),
        rates(20.0, 20.0, Some(now)),
    ];
    for case in cases {
        // A fresh bucket, so the next lease waits for its slot, then the case's rates.
        sqlx::query(
            "UPDATE rate_buckets SET rate_per_second = 20, effective_rate = 20,
                 paused_until = NULL, tat = NULL, tat_new = NULL, tat_recovery = NULL,
                 last_decrease_at = NULL",
        )
        .execute(&pool)
        .await
        .unwrap();
        let due = due(&ledger, 6).await;
        let (waiting, reserved_at) = lease_batch(&ledger, &due, "worker-1", &wait(500), t0())
            .await
            .into_iter()
            .find_map(|outcome| match outcome {
                LeaseOutcome::Leased {
                    lease,
                    slot: SendSlot::At { reserved_at, .. },
                    ..
                } => Some((lease, reserved_at)),
                _ => None,
            })
            .expect("the sixth lease of a burst-5 bucket waits for its slot");
        sqlx::query(
            "UPDATE rate_buckets SET rate_per_second = $1, effective_rate = $2, paused_until = $3",
        )
        .bind(case.rate_per_second)
        .bind(case.effective_rate)
        .bind(case.paused_until)
        .execute(&pool)
        .await
        .unwrap();

        let fenced = ledger
            .fence(
                &waiting,
                reserved_at,
                LEASE,
                Duration::from_secs(10),
                at(now),
            )
            .await
            .unwrap();
        let channel_rate = ledger.channel_rate(Channel::Sms, at(now)).await.unwrap();

        let idle = case.idle_at(now);
        assert_eq!(fenced.is_ok(), idle.is_none(), "{case:?}: {fenced:?}");
        if idle.is_some() {
            assert!(
                matches!(fenced, Err(FenceRefused::BucketClosedUntil(_))),
                "{case:?}: {fenced:?}"
            );
        }
        assert_eq!(channel_rate, drain::admitted_rate([case], now), "{case:?}");
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_capped_tenant_alone_gets_its_share_and_its_held_back_work_returns_at_its_pace(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    ledger
        .ensure_bucket(&main_account(), Channel::Sms, 40.0, 8, t0())
        .await
        .unwrap();
    let capped = ledger.create_tenant("capped", &ops(t0())).await.unwrap();
    let share = nudge_domain::MaxShare::new(0.25).unwrap();
    assert_eq!(
        ledger
            .set_tenant_max_share(capped.id, share, &ops(t0()))
            .await
            .unwrap(),
        Some(None),
        "no cap before"
    );
    for i in 0..12 {
        owed(&ledger, capped.id, &format!("c{i}"), &[Channel::Sms], t0()).await;
    }
    let messages = ledger.claim_due(Channel::Sms, 100, at(t0())).await.unwrap();

    let outcomes = lease_batch(&ledger, &messages, "worker-1", &wait(500), t0()).await;

    // A quarter of 40/s is 10/s, with a quarter of the burst (2): two now, the rest given back
    // one tenant interval (100 ms) apart, though the bucket itself had room for them.
    let leased = outcomes
        .iter()
        .filter(|o| matches!(o, LeaseOutcome::Leased { .. }))
        .count();
    assert_eq!(leased, 2, "{outcomes:?}");
    let untils: Vec<DateTime<Utc>> = outcomes
        .iter()
        .filter_map(|o| match o {
            LeaseOutcome::Released {
                until,
                reason: DeferReason::Capped,
                ..
            } => Some(*until),
            _ => None,
        })
        .collect();
    assert_eq!(untils.len(), 10);
    for (k, until) in untils.iter().enumerate() {
        assert_eq!(
            *until,
            t0() + chrono::Duration::milliseconds(100 * (i64::try_from(k).unwrap() + 1)),
            "the {k}-th held back"
        );
    }
    let stored: DateTime<Utc> =
        sqlx::query_scalar("SELECT tat FROM tenant_bucket_shares WHERE tenant_id = $1")
            .bind(capped.id.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(stored, t0() + chrono::Duration::milliseconds(200));

    // Another tenant on the account is not held by that cap: the bucket's own burst is left.
    let other = due(&ledger, 6).await;
    let outcomes = lease_batch(&ledger, &other, "worker-1", &wait(0), t0()).await;
    let leased = outcomes
        .iter()
        .filter(|o| matches!(o, LeaseOutcome::Leased { .. }))
        .count();
    assert_eq!(leased, 6, "{outcomes:?}");

    // Cleared with a share of 1: the tenant's next work takes the bucket's pace only.
    assert_eq!(
        ledger
            .set_tenant_max_share(capped.id, None, &ops(t0()))
            .await
            .unwrap(),
        Some(Some(0.25))
    );
}
