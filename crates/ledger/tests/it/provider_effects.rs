//! What a provider's answer does besides moving its delivery, written with the outcome: the
//! contact flagged (and what the next lease sees of it), and an account suspended when its
//! credentials are refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{
    AttemptContext, Channel, ContactFlag, DeliveryState, FixedJitter, IdempotencySupport,
    ProviderAnswer, RetryPolicy, SendOutcome, SubscriberRef, Verdict, decide,
};
use nudge_ledger::test_support::*;
use nudge_ledger::{AttemptRecord, Destination, LeaseOutcome, LeasedDelivery, Ledger, Recorded};
use sqlx::PgPool;

const SUSPEND: Duration = Duration::from_secs(60);

async fn contact(ledger: &Ledger, tenant: nudge_domain::TenantId, destination: &str) {
    ledger
        .upsert_contact(
            tenant,
            &SubscriberRef::parse("patient-0001").unwrap(),
            Channel::Sms,
            &Destination::new(destination),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
}

async fn leased_now(ledger: &Ledger, now: DateTime<Utc>) -> (LeasedDelivery, Option<ContactFlag>) {
    let due = claim_all(ledger, now).await.remove(0);
    match lease(ledger, &due, now).await {
        LeaseOutcome::Leased {
            lease, material, ..
        } => (lease, material.unwrap().contact_flag),
        other => panic!("expected a lease, got {other:?}"),
    }
}

async fn answer(
    ledger: &Ledger,
    lease: &LeasedDelivery,
    verdict: Verdict,
    status: u16,
) -> Recorded {
    let outcome = SendOutcome::Answered(ProviderAnswer::new(verdict, Some(status)));
    let decision = decide(
        &AttemptContext {
            attempt_number: lease.attempt_number,
            expires_at: lease.expires_at,
            idempotency: IdempotencySupport::NotHonoured,
        },
        &outcome,
        t0() + secs(1),
        &RetryPolicy::default(),
        &mut FixedJitter::new(1_000),
    );
    let attempt = AttemptRecord {
        started_at: t0(),
        finished_at: t0() + secs(1),
        worker: "worker-1".into(),
        correlation_id: None,
    };
    ledger
        .record_outcomes(
            &[nudge_ledger::OutcomeToRecord {
                lease,
                decision: &decision,
                attempt: &attempt,
            }],
            SUSPEND,
            at(t0() + secs(1)),
        )
        .await
        .unwrap()
        .remove(0)
}

async fn flags(ledger: &Ledger) -> (Option<DateTime<Utc>>, Option<DateTime<Utc>>) {
    sqlx::query_as("SELECT invalid_at, opted_out_at FROM contacts")
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_opted_out_answer_flags_the_contact_and_the_next_lease_of_it_carries_the_flag(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    contact(&ledger, tenant.id, "+15550100").await;
    owed(&ledger, tenant.id, "first", &[Channel::Sms], t0()).await;
    let (first, flag) = leased_now(&ledger, t0()).await;
    assert_eq!(flag, None);

    assert_eq!(
        answer(&ledger, &first, Verdict::ContactOptedOut, 400).await,
        Recorded::Applied
    );
    let record = ledger.delivery(first.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::DeadLettered);
    assert_eq!(
        record.last_error_reason.as_deref(),
        Some("contact_opted_out: http_400")
    );
    assert_eq!(flags(&ledger).await, (None, Some(t0() + secs(1))));

    owed(
        &ledger,
        tenant.id,
        "second",
        &[Channel::Sms],
        t0() + secs(10),
    )
    .await;
    let (_, flag) = leased_now(&ledger, t0() + secs(10)).await;
    assert_eq!(flag, Some(ContactFlag::OptedOut));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_invalid_answer_flags_the_contact_and_a_new_destination_clears_it(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    contact(&ledger, tenant.id, "+15550100").await;
    owed(&ledger, tenant.id, "first", &[Channel::Sms], t0()).await;
    let (first, _) = leased_now(&ledger, t0()).await;
    answer(&ledger, &first, Verdict::ContactInvalid, 400).await;
    assert_eq!(flags(&ledger).await, (Some(t0() + secs(1)), None));

    contact(&ledger, tenant.id, "+15550199").await;
    assert_eq!(flags(&ledger).await, (None, None));
    owed(
        &ledger,
        tenant.id,
        "second",
        &[Channel::Sms],
        t0() + secs(10),
    )
    .await;
    let (_, flag) = leased_now(&ledger, t0() + secs(10)).await;
    assert_eq!(flag, None);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_answer_whose_lease_was_lost_flags_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    contact(&ledger, tenant.id, "+15550100").await;
    owed(&ledger, tenant.id, "first", &[Channel::Sms], t0()).await;
    let (mut first, _) = leased_now(&ledger, t0()).await;
    first.lease_holder = "someone-else".into();
    assert_eq!(
        answer(&ledger, &first, Verdict::ContactOptedOut, 400).await,
        Recorded::LeaseLost
    );
    assert_eq!(flags(&ledger).await, (None, None));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn refused_credentials_suspend_only_that_account_s_bucket_and_keep_its_rate(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    contact(&ledger, tenant.id, "+15550100").await;
    for (name, channel) in [
        ("main", Channel::Sms),
        ("main", Channel::Email),
        ("other", Channel::Sms),
    ] {
        ledger
            .ensure_bucket(&account(name), channel, 40.0, 40, t0())
            .await
            .unwrap();
    }
    owed(&ledger, tenant.id, "first", &[Channel::Sms], t0()).await;
    let (first, _) = leased_now(&ledger, t0()).await;

    assert_eq!(
        answer(&ledger, &first, Verdict::AuthFailure, 401).await,
        Recorded::Applied
    );
    let record = ledger.delivery(first.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::RetryWait);
    let buckets = ledger.rate_buckets().await.unwrap();
    assert_eq!(buckets.len(), 3);
    for b in buckets {
        if b.account == account("main") && b.channel == Channel::Sms {
            assert_eq!(b.paused_until, Some(t0() + secs(1) + secs(60)));
            assert_eq!(
                b.effective_rate, 40.0,
                "a refusal of credentials is not congestion"
            );
            assert!(b.pause_cause.unwrap().contains("credentials"));
        } else {
            assert_eq!(b.paused_until, None, "{} {}", b.account, b.channel);
        }
    }
}

fn receipt(
    key: &nudge_domain::IdempotencyKey,
    event: &str,
    outcome: nudge_ledger::ReceiptOutcome,
    flag: Option<ContactFlag>,
) -> nudge_ledger::Receipt {
    nudge_ledger::Receipt {
        account: account("main"),
        event_key: event.into(),
        delivery_key: Some(key.clone()),
        status: "undelivered".into(),
        outcome,
        contact_flag: flag,
        code: Some("30005".into()),
        provider_message_id: Some("SM1".into()),
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_failure_receipt_settles_an_ambiguous_delivery_once_and_flags_the_contact(pool: PgPool) {
    use nudge_ledger::{ReceiptOutcome, ReceiptRecorded};
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    contact(&ledger, tenant.id, "+15550100").await;
    owed(&ledger, tenant.id, "first", &[Channel::Sms], t0()).await;
    let (first, _) = leased_now(&ledger, t0()).await;
    answer(&ledger, &first, Verdict::MaybeSent, 502).await;
    assert_eq!(
        ledger.delivery(first.id).await.unwrap().unwrap().state,
        DeliveryState::Ambiguous
    );

    let r = receipt(
        &first.idempotency_key,
        "SM1:undelivered",
        ReceiptOutcome::Failed,
        Some(ContactFlag::Invalid),
    );
    let got = ledger
        .record_receipts(std::slice::from_ref(&r), at(t0() + secs(5)))
        .await
        .unwrap();
    assert_eq!(
        got,
        [ReceiptRecorded::New {
            matched: true,
            settled: true
        }]
    );
    let record = ledger.delivery(first.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::DeadLettered);
    assert_eq!(
        record.last_error_reason.as_deref(),
        Some("receipt: undelivered: 30005")
    );
    assert_eq!(flags(&ledger).await.0, Some(t0() + secs(5)));

    // The same event again changes nothing.
    let got = ledger
        .record_receipts(&[r], at(t0() + secs(9)))
        .await
        .unwrap();
    assert_eq!(got, [ReceiptRecorded::Replay]);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM provider_events")
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    assert_eq!(n, 1);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_delivered_receipt_settles_an_ambiguous_delivery_and_leaves_others_alone(pool: PgPool) {
    use nudge_ledger::{ReceiptOutcome, ReceiptRecorded};
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    contact(&ledger, tenant.id, "+15550100").await;
    owed(&ledger, tenant.id, "first", &[Channel::Sms], t0()).await;
    let (first, _) = leased_now(&ledger, t0()).await;
    answer(&ledger, &first, Verdict::MaybeSent, 502).await;
    owed(
        &ledger,
        tenant.id,
        "second",
        &[Channel::Sms],
        t0() + secs(10),
    )
    .await;
    let (second, _) = leased_now(&ledger, t0() + secs(10)).await;
    answer(&ledger, &second, Verdict::ThrottledAccount, 429).await;

    let mut other_account = receipt(
        &first.idempotency_key,
        "SM1:delivered",
        ReceiptOutcome::Delivered,
        None,
    );
    other_account.account = account("other");
    let got = ledger
        .record_receipts(
            &[
                receipt(
                    &first.idempotency_key,
                    "SM1:delivered",
                    ReceiptOutcome::Delivered,
                    None,
                ),
                receipt(
                    &second.idempotency_key,
                    "SM2:delivered",
                    ReceiptOutcome::Delivered,
                    None,
                ),
                other_account,
            ],
            at(t0() + secs(20)),
        )
        .await
        .unwrap();
    assert_eq!(
        got,
        [
            ReceiptRecorded::New {
                matched: true,
                settled: true
            },
            ReceiptRecorded::New {
                matched: true,
                settled: false
            },
            ReceiptRecorded::New {
                matched: false,
                settled: false
            },
        ]
    );
    assert_eq!(
        ledger.delivery(first.id).await.unwrap().unwrap().state,
        DeliveryState::Delivered
    );
    assert_eq!(
        ledger.delivery(second.id).await.unwrap().unwrap().state,
        DeliveryState::RetryWait
    );
    assert_eq!(flags(&ledger).await, (None, None));
}

/// Posts a reminder with its subscriber's SMS destination, as the intake does, and
/// materialises it.
async fn post(
    ledger: &Ledger,
    tenant: nudge_domain::TenantId,
    event: &str,
    destination: &str,
    scheduled_at: DateTime<Utc>,
) -> nudge_ledger::CreatedReminder {
    let created = ledger
        .import_reminder(
            &reminder(tenant, event, &[Channel::Sms], scheduled_at),
            &[(Channel::Sms, Destination::new(destination))],
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    if created.created {
        ledger
            .materialise_reminder(tenant, created.id, t0())
            .await
            .unwrap();
    }
    created
}

/// What the next lease of a new reminder of the subscriber sees: the destination stored and
/// the contact's flag.
async fn stored(
    ledger: &Ledger,
    tenant: nudge_domain::TenantId,
    event: &str,
    now: DateTime<Utc>,
) -> (String, Option<ContactFlag>) {
    owed(ledger, tenant, event, &[Channel::Sms], now).await;
    let due = claim_all(ledger, now).await.remove(0);
    match lease(ledger, &due, now).await {
        LeaseOutcome::Leased { material, .. } => {
            let material = material.unwrap();
            (
                material.destination.unwrap().expose().to_owned(),
                material.contact_flag,
            )
        }
        other => panic!("expected a lease, got {other:?}"),
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_repeated_post_changes_nothing_neither_the_destination_nor_the_opt_out(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    assert!(
        post(&ledger, tenant.id, "first", "+15550100", t0())
            .await
            .created
    );
    let (first, _) = leased_now(&ledger, t0()).await;
    answer(&ledger, &first, Verdict::ContactOptedOut, 400).await;
    assert_eq!(flags(&ledger).await, (None, Some(t0() + secs(1))));

    // The clinic's app retries the old event, with the number it had then.
    let again = post(&ledger, tenant.id, "first", "+15550199", t0()).await;
    assert!(!again.created, "the same event is a duplicate");

    assert_eq!(flags(&ledger).await, (None, Some(t0() + secs(1))));
    assert_eq!(
        stored(&ledger, tenant.id, "second", t0() + secs(10)).await,
        ("+15550100".to_owned(), Some(ContactFlag::OptedOut))
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_next_appointment_to_the_same_number_keeps_the_patient_s_stop(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    post(&ledger, tenant.id, "first", "+15550100", t0()).await;
    let (first, _) = leased_now(&ledger, t0()).await;
    answer(&ledger, &first, Verdict::ContactOptedOut, 400).await;

    // A new event, the same number written another way.
    let next = post(&ledger, tenant.id, "next", "+1 555-0100", t0() + secs(5)).await;
    assert!(next.created);

    assert_eq!(flags(&ledger).await, (None, Some(t0() + secs(1))));
    let due = claim_all(&ledger, t0() + secs(5)).await.remove(0);
    match lease(&ledger, &due, t0() + secs(5)).await {
        LeaseOutcome::Leased { material, .. } => {
            assert_eq!(material.unwrap().contact_flag, Some(ContactFlag::OptedOut));
        }
        other => panic!("expected a lease, got {other:?}"),
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_new_appointment_with_a_new_number_clears_the_old_number_s_flag(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    post(&ledger, tenant.id, "first", "+15550100", t0()).await;
    let (first, _) = leased_now(&ledger, t0()).await;
    answer(&ledger, &first, Verdict::ContactInvalid, 400).await;
    assert_eq!(flags(&ledger).await, (Some(t0() + secs(1)), None));

    post(&ledger, tenant.id, "next", "+15550199", t0() + secs(5)).await;

    assert_eq!(flags(&ledger).await, (None, None));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_answer_about_the_number_replaced_since_flags_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    contact(&ledger, tenant.id, "+15550100").await;
    owed(&ledger, tenant.id, "first", &[Channel::Sms], t0()).await;
    let (first, _) = leased_now(&ledger, t0()).await;
    // While the send to the old number is under way, the patient's new number is stored.
    contact(&ledger, tenant.id, "+15550199").await;

    assert_eq!(
        answer(&ledger, &first, Verdict::ContactOptedOut, 400).await,
        Recorded::Applied
    );

    assert_eq!(
        ledger.delivery(first.id).await.unwrap().unwrap().state,
        DeliveryState::DeadLettered,
        "the delivery itself still settles by its answer"
    );
    assert_eq!(flags(&ledger).await, (None, None));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_late_bounce_for_the_number_replaced_since_flags_nothing(pool: PgPool) {
    use nudge_ledger::ReceiptOutcome;
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    contact(&ledger, tenant.id, "+15550100").await;
    owed(&ledger, tenant.id, "first", &[Channel::Sms], t0()).await;
    let (first, _) = leased_now(&ledger, t0()).await;
    answer(&ledger, &first, Verdict::MaybeSent, 502).await;
    contact(&ledger, tenant.id, "+15550199").await;

    let r = receipt(
        &first.idempotency_key,
        "SM1:undelivered",
        ReceiptOutcome::Failed,
        Some(ContactFlag::Invalid),
    );
    ledger
        .record_receipts(std::slice::from_ref(&r), at(t0() + secs(5)))
        .await
        .unwrap();

    assert_eq!(
        ledger.delivery(first.id).await.unwrap().unwrap().state,
        DeliveryState::DeadLettered
    );
    assert_eq!(flags(&ledger).await, (None, None));
}
