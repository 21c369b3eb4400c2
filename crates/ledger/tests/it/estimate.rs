//! The drain estimate's queries: what a channel owes now, in send order, and what falls due.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use nudge_domain::{Channel, DeliveryId, EventId, ReminderId};
use nudge_ledger::test_support::*;
use nudge_ledger::{Backlog, LeaseOutcome, Ledger, LedgerTime};
use sqlx::PgPool;

async fn delivery_of(ledger: &Ledger, reminder: ReminderId, channel: Channel) -> DeliveryId {
    ledger
        .deliveries_of_reminder(reminder)
        .await
        .unwrap()
        .into_iter()
        .find(|d| d.channel == channel)
        .unwrap()
        .id
}

/// Creates a reminder due at `at` without materialising it (the producer has not run).
async fn pending(
    ledger: &Ledger,
    tenant_id: nudge_domain::TenantId,
    event: &str,
    channels: &[Channel],
    at: chrono::DateTime<chrono::Utc>,
) -> ReminderId {
    let created = ledger
        .create_reminder(&reminder(tenant_id, event, channels, at), &cipher(), t0())
        .await
        .unwrap();
    assert!(
        ledger
            .deliveries_of_reminder(created.id)
            .await
            .unwrap()
            .is_empty(),
        "a reminder in the future is not materialised at creation"
    );
    created.id
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_backlog_counts_what_is_due_and_in_flight_on_the_channel_only(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let now = t0() + secs(60);
    for i in 0..3 {
        owed(
            &ledger,
            tenant.id,
            &format!("due-{i}"),
            &[Channel::Sms],
            t0() + secs(i),
        )
        .await;
    }
    owed(&ledger, tenant.id, "later", &[Channel::Sms], now + secs(1)).await;
    owed(&ledger, tenant.id, "email", &[Channel::Email], t0()).await;
    let queued = ledger.claim_due(Channel::Sms, 2, at(now)).await.unwrap();
    let LeaseOutcome::Leased { .. } = lease(&ledger, &queued[0], now).await else {
        panic!("expected a lease");
    };

    let backlog = ledger.backlog(Channel::Sms, now).await.unwrap();

    assert_eq!(backlog, Backlog { due: 2, sending: 1 });
    assert_eq!(backlog.total(), 3);
    assert_eq!(
        ledger.backlog(Channel::Push, now).await.unwrap(),
        Backlog::default()
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn owed_deliveries_come_in_flight_first_then_by_due_time(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let now = t0() + secs(60);
    let third = owed(
        &ledger,
        tenant.id,
        "third",
        &[Channel::Sms],
        t0() + secs(30),
    )
    .await;
    let second = owed(
        &ledger,
        tenant.id,
        "second",
        &[Channel::Sms],
        t0() + secs(10),
    )
    .await;
    let in_flight = owed(
        &ledger,
        tenant.id,
        "flying",
        &[Channel::Sms],
        t0() + secs(20),
    )
    .await;
    owed(
        &ledger,
        tenant.id,
        "not-yet",
        &[Channel::Sms],
        now + secs(5),
    )
    .await;
    owed(&ledger, tenant.id, "email", &[Channel::Email], t0()).await;
    let flying = delivery_of(&ledger, in_flight, Channel::Sms).await;
    let claimed = ledger.claim_due(Channel::Sms, 10, at(now)).await.unwrap();
    let flying_claim = claimed.iter().find(|d| d.id == flying).unwrap();
    leased(lease(&ledger, flying_claim, now).await);

    let owed = ledger
        .owed_in_due_order(Channel::Sms, now, 100)
        .await
        .unwrap();

    let ids: Vec<DeliveryId> = owed.iter().map(|d| d.id).collect();
    assert_eq!(
        ids,
        [
            flying,
            delivery_of(&ledger, second, Channel::Sms).await,
            delivery_of(&ledger, third, Channel::Sms).await,
        ]
    );
    assert!(owed[0].in_flight && !owed[1].in_flight && !owed[2].in_flight);
    assert_eq!(owed[1].next_attempt_at, t0() + secs(10));
    assert_eq!(owed[1].expires_at, t0() + secs(10) + secs(3600));
    let first_two = ledger
        .owed_in_due_order(Channel::Sms, now, 2)
        .await
        .unwrap();
    assert_eq!(first_two.iter().map(|d| d.id).collect::<Vec<_>>(), ids[..2]);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn deliveries_due_at_the_same_time_are_ordered_by_id(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let mut expected = Vec::new();
    for i in 0..5 {
        let r = owed(
            &ledger,
            tenant.id,
            &format!("same-{i}"),
            &[Channel::Push],
            t0(),
        )
        .await;
        expected.push(delivery_of(&ledger, r, Channel::Push).await);
    }
    expected.sort();

    let owed = ledger
        .owed_in_due_order(Channel::Push, t0() + secs(1), 10)
        .await
        .unwrap();

    assert_eq!(owed.iter().map(|d| d.id).collect::<Vec<_>>(), expected);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn arrivals_count_later_deliveries_and_reminders_not_yet_materialised(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let other = ledger.create_tenant("clinic-b", &ops(t0())).await.unwrap();
    let now = t0() + secs(60);
    // Already owed at `now`: the backlog, not an arrival.
    owed(&ledger, tenant.id, "owed", &[Channel::Sms], now).await;
    // Materialised, falling due in (now, now + 100].
    owed(
        &ledger,
        tenant.id,
        "soon",
        &[Channel::Sms, Channel::Email],
        now + secs(10),
    )
    .await;
    owed(&ledger, other.id, "edge", &[Channel::Sms], now + secs(100)).await;
    owed(
        &ledger,
        tenant.id,
        "too-late",
        &[Channel::Sms],
        now + secs(101),
    )
    .await;
    // Not materialised yet, in both tenants.
    pending(&ledger, tenant.id, "p1", &[Channel::Sms], now + secs(50)).await;
    pending(
        &ledger,
        other.id,
        "p2",
        &[Channel::Sms, Channel::Push],
        now + secs(20),
    )
    .await;
    pending(&ledger, other.id, "p3", &[Channel::Email], now + secs(20)).await;
    pending(&ledger, tenant.id, "p4", &[Channel::Sms], now + secs(500)).await;
    pending(&ledger, tenant.id, "p5", &[Channel::Sms], now + secs(30)).await;
    ledger
        .cancel_reminder(
            tenant.id,
            &EventId::parse("p5").unwrap(),
            LedgerTime::Fixed(now),
        )
        .await
        .unwrap();
    // A materialised reminder counts once, by its delivery.
    let both = pending(&ledger, tenant.id, "p6", &[Channel::Sms], now + secs(40)).await;
    ledger
        .materialise_reminder(tenant.id, both, now)
        .await
        .unwrap();

    let sms = ledger
        .arrivals(Channel::Sms, now, now + secs(100))
        .await
        .unwrap();
    let email = ledger
        .arrivals(Channel::Email, now, now + secs(100))
        .await
        .unwrap();

    // soon, edge, p6 (deliveries) + p1, p2 (reminders).
    assert_eq!(sms, 5);
    // soon (delivery) + p3 (reminder).
    assert_eq!(email, 2);
    assert_eq!(
        ledger.arrivals(Channel::Sms, now, now).await.unwrap(),
        0,
        "an empty interval"
    );
    assert_eq!(
        ledger
            .arrivals(Channel::Sms, now, now + secs(1000))
            .await
            .unwrap(),
        7
    );
}
