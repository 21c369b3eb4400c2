//! Rate buckets in the ledger: admission under the row lock, feedback, checks, rates.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::*;
use nudge_domain::{Admission, AdmissionSettings, Channel, DeferReason, Lane, ProviderAccount};
use nudge_ledger::{BucketCheck, Feedback, Ledger};
use sqlx::PgPool;

fn account() -> ProviderAccount {
    ProviderAccount::parse("sms-main").unwrap()
}

fn settings(max_wait_ms: u64) -> AdmissionSettings {
    AdmissionSettings {
        max_wait: Duration::from_millis(max_wait_ms),
        ..AdmissionSettings::default()
    }
}

fn at(t: DateTime<Utc>) -> impl Fn() -> DateTime<Utc> + Send + Sync {
    move || t
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_account_without_a_bucket_is_admitted_at_once(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let admitted = ledger
        .admit(&account(), Channel::Sms, Lane::New, &at(t0()), &settings(0))
        .await
        .unwrap();
    assert_eq!(admitted.admission, Admission::Admitted { send_at: t0() });
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn replicas_admitting_at_once_share_one_bucket_exactly(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger
        .ensure_bucket(&account(), Channel::Sms, 20.0, 5, t0())
        .await
        .unwrap();
    // Eight replicas ask for 30 slots each at the same instant, with a 10 s horizon.
    let slots = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let ledger = ledger.clone();
            let slots = slots.clone();
            tokio::spawn(async move {
                for _ in 0..30 {
                    let a = ledger
                        .admit(
                            &account(),
                            Channel::Sms,
                            Lane::New,
                            &at(t0()),
                            &settings(10_000),
                        )
                        .await
                        .unwrap();
                    if let Admission::Admitted { send_at } = a.admission {
                        slots.lock().unwrap().push(send_at);
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
    let ledger = Ledger::from_pool(pool);
    ledger
        .ensure_bucket(&account(), Channel::Sms, 20.0, 5, t0())
        .await
        .unwrap();
    let reserved = t0();
    let until = t0() + secs(3);

    let changed = ledger
        .bucket_feedback(
            &account(),
            Channel::Sms,
            Feedback::Throttled {
                retry_at: Some(until),
                reserved_at: Some(reserved),
            },
            t0() + secs(1),
        )
        .await
        .unwrap();

    assert_eq!(
        changed,
        Some((10.0, Some(until))),
        "paused, and (a first 429) halved"
    );
    let check = ledger
        .bucket_check(
            &account(),
            Channel::Sms,
            t0() + secs(1),
            reserved,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(check, BucketCheck::ClosedUntil(until));
    let other_replica = ledger
        .admit(
            &account(),
            Channel::Sms,
            Lane::New,
            &at(t0() + secs(1)),
            &settings(500),
        )
        .await
        .unwrap();
    assert_eq!(
        other_replica.admission,
        Admission::Deferred {
            until,
            reason: DeferReason::Paused
        }
    );
    let after = ledger
        .bucket_check(
            &account(),
            Channel::Sms,
            t0() + secs(4),
            t0() + secs(4),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(after, BucketCheck::Open);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_slot_reserved_before_a_slow_down_is_reserved_again(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger
        .ensure_bucket(&account(), Channel::Sms, 20.0, 5, t0())
        .await
        .unwrap();
    ledger
        .bucket_feedback(
            &account(),
            Channel::Sms,
            Feedback::Throttled {
                retry_at: None,
                reserved_at: None,
            },
            t0() + secs(1),
        )
        .await
        .unwrap();

    let before = ledger
        .bucket_check(
            &account(),
            Channel::Sms,
            t0() + secs(2),
            t0(),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let after = ledger
        .bucket_check(
            &account(),
            Channel::Sms,
            t0() + secs(2),
            t0() + secs(1) + chrono::Duration::milliseconds(1),
            Duration::from_secs(10),
        )
        .await
        .unwrap();

    assert_eq!(before, BucketCheck::Slowed);
    assert_eq!(after, BucketCheck::Open);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_rate_of_zero_closes_the_bucket_and_raising_it_reopens(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger
        .ensure_bucket(&account(), Channel::Sms, 20.0, 5, t0())
        .await
        .unwrap();

    ledger
        .set_rate(&account(), Channel::Sms, 0.0, None, &ops(t0()))
        .await
        .unwrap();
    let closed = ledger
        .admit(
            &account(),
            Channel::Sms,
            Lane::New,
            &at(t0()),
            &settings(500),
        )
        .await
        .unwrap();
    let check = ledger
        .bucket_check(
            &account(),
            Channel::Sms,
            t0(),
            t0(),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let channel_rate = ledger.channel_rate(Channel::Sms, t0()).await.unwrap();
    ledger
        .set_rate(&account(), Channel::Sms, 20.0, None, &ops(t0()))
        .await
        .unwrap();
    let reopened = ledger
        .admit(
            &account(),
            Channel::Sms,
            Lane::New,
            &at(t0()),
            &settings(500),
        )
        .await
        .unwrap();

    assert!(matches!(
        closed.admission,
        Admission::Deferred {
            reason: DeferReason::Closed,
            ..
        }
    ));
    assert_eq!(check, BucketCheck::ClosedUntil(t0() + secs(10)));
    assert_eq!(channel_rate, Some(0.0));
    assert_eq!(reopened.admission, Admission::Admitted { send_at: t0() });
    assert_eq!(
        ledger.channel_rate(Channel::Email, t0()).await.unwrap(),
        None,
        "no bucket: not limited"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_bucket_changed_at_run_time_keeps_its_rate_when_workers_restart(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger
        .ensure_bucket(&account(), Channel::Sms, 40.0, 10, t0())
        .await
        .unwrap();
    ledger
        .set_rate(&account(), Channel::Sms, 12.0, Some(3), &ops(t0()))
        .await
        .unwrap();

    ledger
        .ensure_bucket(&account(), Channel::Sms, 40.0, 10, t0() + secs(60))
        .await
        .unwrap();

    let bucket = &ledger.rate_buckets().await.unwrap()[0];
    assert_eq!(
        (bucket.rate_per_second, bucket.burst, bucket.effective_rate),
        (12.0, 3, 12.0)
    );
    assert_eq!(bucket.changed_by, "ops@clinic");
}
