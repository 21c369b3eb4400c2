//! The redrive feeder (`redrive_once`) on a real ledger, connected as the janitor's restricted
//! role: it may not update redrives itself (migration 20261208000002), so every change goes
//! through the feeder's functions, and a redrive waits while its channel drains, feeds once
//! the drain ends, and finishes when every item is fed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chrono::Utc;
use nudge_domain::{Channel, DeliveryState, EventId, SubscriberRef};
use nudge_janitor::redrive_once;
use nudge_ledger::{
    AutoPause, DestinationCipher, Ledger, LedgerTime, NewReminder, Operator, RedriveFilter,
    RedriveState, StartedRedrive, SubscriberKey,
};
use sqlx::PgPool;

use crate::common::as_janitor;

fn ops() -> Operator {
    Operator::new("ops", Some("provider back"), Utc::now()).unwrap()
}

fn rules() -> AutoPause {
    AutoPause {
        max_throttled_ratio: 0.2,
        window: Duration::from_secs(60),
        min_attempts: 5,
        max_new_work_age: Duration::from_secs(600),
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_feeder_waits_feeds_and_finishes_a_redrive_as_the_janitors_role(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let cipher = DestinationCipher::new(&[1; 32]).with_subscriber_key(SubscriberKey::new(&[2; 32]));
    let tenant = owner.create_tenant("clinic", &ops()).await.unwrap();
    let now = Utc::now();
    let created = owner
        .create_reminder(
            &NewReminder::new(
                tenant.id,
                EventId::parse("evt-1").unwrap(),
                SubscriberRef::parse("patient-1").unwrap(),
                &[Channel::Sms],
                now,
                now + chrono::Duration::hours(6),
            )
            .unwrap(),
            &cipher,
            now,
        )
        .await
        .unwrap();
    owner
        .materialise_reminder(tenant.id, created.id, now)
        .await
        .unwrap();
    // A dead letter, as a worker's terminal answer leaves it.
    sqlx::query(
        "UPDATE deliveries SET state = 'dead_lettered', settled_at = now(),
             last_error_class = 'terminal'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let filter = RedriveFilter {
        channel: Channel::Sms,
        tenant: None,
        max_age: None,
        limit: None,
    };
    let StartedRedrive { id, .. } = owner
        .execute_redrive(&filter, 10.0, None, &ops(), LedgerTime::Database)
        .await
        .unwrap();
    let janitor = as_janitor(&pool).await;

    owner
        .set_draining(Channel::Sms, true, &ops(), LedgerTime::Database)
        .await
        .unwrap();
    redrive_once(&janitor, &rules(), 100, LedgerTime::Database)
        .await
        .unwrap();
    let waiting = owner.redrive_status(id).await.unwrap().unwrap();
    assert_eq!((waiting.state, waiting.fed), (RedriveState::Running, 0));

    owner
        .set_draining(Channel::Sms, false, &ops(), LedgerTime::Database)
        .await
        .unwrap();
    // Fed at 10/s from the tick's credit: poll until the one item went (a tick a second).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        redrive_once(&janitor, &rules(), 100, LedgerTime::Database)
            .await
            .unwrap();
        let status = owner.redrive_status(id).await.unwrap().unwrap();
        if status.state != RedriveState::Running || std::time::Instant::now() > deadline {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(status.state, RedriveState::Finished);
    assert_eq!((status.fed, status.skipped), (1, 0));
    let deliveries = owner.deliveries_of_reminder(created.id).await.unwrap();
    assert_eq!(deliveries[0].state, DeliveryState::RetryWait);
}
