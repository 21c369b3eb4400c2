#![allow(clippy::unwrap_used, clippy::expect_used)]

//! The holder's heartbeat: a lease lives as long as its holder renews it, and the reaper takes
//! it one lease length after the last renewal, never before.

use std::time::Duration;

use nudge_domain::{Channel, DeliveryState, FixedJitter, IdempotencySupport, RetryPolicy};
use nudge_ledger::test_support::*;
use nudge_ledger::{DueDelivery, LeasedDelivery, Ledger, MessagePointer, Reaped};
use sqlx::PgPool;

const BEAT_LEASE: Duration = Duration::from_secs(5);

/// A delivery owed at `t0()`, published and leased by `holder` at `t0()`.
async fn leased_by(ledger: &Ledger, event: &str, holder: &str) -> (DueDelivery, LeasedDelivery) {
    let tenant = ledger.create_tenant(event, &ops(t0())).await.unwrap();
    owed(ledger, tenant.id, event, &[Channel::Sms], t0()).await;
    let due = ledger
        .claim_due(Channel::Sms, 10, at(t0()))
        .await
        .unwrap()
        .remove(0);
    let lease = leased(
        lease_as(
            ledger,
            &due,
            holder,
            &routes(IdempotencySupport::NotHonoured),
            t0(),
        )
        .await,
    );
    (due, lease)
}

fn pointer(lease: &LeasedDelivery) -> MessagePointer {
    MessagePointer {
        delivery_id: lease.id,
        generation: lease.generation,
    }
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
async fn a_renewed_lease_outlives_its_length_and_is_reaped_one_length_after_the_last_beat(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let (_, lease) = leased_by(&ledger, "beat", "worker-1").await;
    // The lease test_support takes is 60 s; beats every 50 s of 5 s leases would lapse, so
    // beat as a worker does: often, each renewing 5 s from the database's clock.
    let mut last = t0();
    for s in (55..=120).step_by(2) {
        last = t0() + secs(s);
        let renewed = ledger
            .renew_leases("worker-1", &[pointer(&lease)], BEAT_LEASE, at(last))
            .await
            .unwrap();
        assert_eq!(renewed.len(), 1, "renewed at {s} s");
        assert_eq!(renewed[0].lease_expires_at, last + secs(5));
        assert_eq!(
            reap(&ledger, last + secs(1)).await,
            Reaped::default(),
            "reaped while its holder beats, at {s} s"
        );
    }
    assert_eq!(reap(&ledger, last + secs(4)).await, Reaped::default());
    // Fenced at the lease (no bucket), through an account that honours no key: maybe sent.
    let reaped = reap(&ledger, last + secs(5)).await;
    assert_eq!(
        reaped.decided,
        vec![(lease.id, DeliveryState::Ambiguous)],
        "one lease length after the last beat"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_heartbeat_renews_only_its_holders_leases_at_their_generation(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let (_, lease) = leased_by(&ledger, "mine", "worker-1").await;
    let now = t0() + secs(10);
    let other = ledger
        .renew_leases("worker-2", &[pointer(&lease)], BEAT_LEASE, at(now))
        .await
        .unwrap();
    assert!(other.is_empty(), "another holder renews nothing");
    let stale = MessagePointer {
        generation: lease.generation + 1,
        ..pointer(&lease)
    };
    let wrong_generation = ledger
        .renew_leases("worker-1", &[stale], BEAT_LEASE, at(now))
        .await
        .unwrap();
    assert!(
        wrong_generation.is_empty(),
        "another generation renews nothing"
    );
    let none = ledger
        .renew_leases("worker-1", &[], BEAT_LEASE, at(now))
        .await
        .unwrap();
    assert!(none.is_empty());
    let lease_end: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT lease_expires_at FROM deliveries WHERE id = $1")
            .bind(lease.id.as_uuid())
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    assert_eq!(
        lease_end, lease.lease_expires_at,
        "the lease is as it was taken"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_lapsed_lease_not_yet_reaped_is_renewed_by_its_holder_and_a_reaped_one_is_not(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let (_, kept) = leased_by(&ledger, "kept", "worker-1").await;
    let (_, lost) = leased_by(&ledger, "lost", "worker-1").await;
    // Both lapse at 60 s (the ledger was away, say); the reaper gets to `lost` first.
    sqlx::query("UPDATE deliveries SET lease_expires_at = $2 WHERE id = $1")
        .bind(kept.id.as_uuid())
        .bind(t0() + secs(1_000))
        .execute(ledger.pool())
        .await
        .unwrap();
    let reaped = reap(&ledger, t0() + secs(70)).await;
    assert_eq!(reaped.decided, vec![(lost.id, DeliveryState::Ambiguous)]);
    sqlx::query("UPDATE deliveries SET lease_expires_at = $2 WHERE id = $1")
        .bind(kept.id.as_uuid())
        .bind(t0() + secs(60))
        .execute(ledger.pool())
        .await
        .unwrap();

    let renewed = ledger
        .renew_leases(
            "worker-1",
            &[pointer(&kept), pointer(&lost)],
            BEAT_LEASE,
            at(t0() + secs(71)),
        )
        .await
        .unwrap();
    assert_eq!(
        renewed.iter().map(|r| r.delivery_id).collect::<Vec<_>>(),
        vec![kept.id],
        "the lapsed lease is still its holder's; the reaped one is not"
    );
    assert_eq!(reap(&ledger, t0() + secs(72)).await, Reaped::default());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_dead_holders_sent_lease_is_retried_at_its_place_in_line_without_a_backoff(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = ledger.create_tenant("dead", &ops(t0())).await.unwrap();
    owed(&ledger, tenant.id, "dead", &[Channel::Sms], t0()).await;
    let due = ledger
        .claim_due(Channel::Sms, 10, at(t0()))
        .await
        .unwrap()
        .remove(0);
    // Fenced at the lease (no bucket), through an account that honours the key.
    let lease = leased(
        lease_as(
            &ledger,
            &due,
            "dead-worker",
            &routes(IdempotencySupport::Honoured),
            t0() + secs(30),
        )
        .await,
    );

    let reaped = reap(&ledger, lease.lease_expires_at + secs(1)).await;

    assert_eq!(reaped.decided, vec![(lease.id, DeliveryState::RetryWait)]);
    let record = ledger.delivery(lease.id).await.unwrap().unwrap();
    assert_eq!(
        record.next_attempt_at,
        Some(t0()),
        "due at the time it was due, ahead of what fell due while its holder was dying"
    );
    assert_eq!(
        record.attempt_count, 1,
        "the attempt that may have reached the provider counts"
    );
}
