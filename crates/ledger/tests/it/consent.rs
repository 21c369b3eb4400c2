//! Consent of a destination (decision 0505): an inbound STOP reaches every tenant that sends
//! through the account, a provider's opt-out is the destination's, neither a repost nor an
//! erasure clears one, the fence stops a send that waited for its slot, and the history is
//! append-only.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{
    AdmissionSettings, AttemptContext, Channel, ConsentSource, ConsentState, ContactFlag,
    DeliveryState, FixedJitter, IdempotencySupport, ProviderAnswer, RetryPolicy, SendOutcome,
    SubscriberRef, TenantId, Verdict, decide,
};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    AttemptRecord, Destination, FenceRefused, InboundKeyword, InboundRecorded, LeaseOutcome,
    LeasedDelivery, Ledger, Operator, SendSlot,
};
use sqlx::PgPool;

const NUMBER: &str = "+15550100100";

async fn contact_of(ledger: &Ledger, tenant: TenantId, subscriber: &str, destination: &str) {
    ledger
        .upsert_contact(
            tenant,
            &SubscriberRef::parse(subscriber).unwrap(),
            Channel::Sms,
            &Destination::new(destination),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
}

async fn keyword(
    ledger: &Ledger,
    account_name: &str,
    from: &str,
    state: ConsentState,
    word: &str,
    sid: &str,
) -> InboundRecorded {
    let account = account(account_name);
    let destination = Destination::new(from);
    ledger
        .record_inbound_keyword(
            &cipher(),
            &InboundKeyword {
                account: &account,
                channel: Channel::Sms,
                destination: &destination,
                state,
                keyword: word,
                provider_event: &format!("twilio:{sid}"),
                correlation_id: Some("corr-1"),
            },
            at(t0() + secs(1)),
        )
        .await
        .unwrap()
}

async fn consent(ledger: &Ledger, tenant: TenantId, destination: &str) -> Option<ConsentState> {
    ledger
        .destination_consent(
            &cipher(),
            tenant,
            Channel::Sms,
            &Destination::new(destination),
        )
        .await
        .unwrap()
        .map(|c| c.state)
}

/// The contact flag the lease of the tenant's next SMS reminder (for `subscriber`, due at
/// `now`, materialised before: created owed, its consent read by the lease) carries.
async fn next_flag(
    ledger: &Ledger,
    tenant: TenantId,
    event: &str,
    subscriber: &str,
    now: DateTime<Utc>,
) -> Option<ContactFlag> {
    let created = ledger
        .create_reminder(
            &nudge_ledger::NewReminder::new(
                tenant,
                nudge_domain::EventId::parse(event).unwrap(),
                SubscriberRef::parse(subscriber).unwrap(),
                &[Channel::Sms],
                now,
                now + secs(3600),
            )
            .unwrap(),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    ledger
        .materialise_reminder(tenant, created.id, t0())
        .await
        .unwrap();
    let due = claim_all(ledger, now)
        .await
        .into_iter()
        .find(|d| d.reminder_id == created.id)
        .unwrap();
    match lease(ledger, &due, now).await {
        LeaseOutcome::Leased { material, .. } => material.unwrap().contact_flag,
        other => panic!("expected a lease, got {other:?}"),
    }
}

async fn history_len(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM consent_history")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_stop_reaches_every_tenant_sending_through_the_account_and_a_start_undoes_it(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let by = ops(t0());
    // `main` is a worker's default: `plain` (no route of its own) and `routed` (routed to
    // `main`) send through it; `elsewhere` is routed to `other` and is not reached.
    ledger
        .announce_default_account(Channel::Sms, &account("main"), at(t0()))
        .await
        .unwrap();
    let plain = ledger.create_tenant("plain", &by).await.unwrap();
    let routed = ledger.create_tenant("routed", &by).await.unwrap();
    let elsewhere = ledger.create_tenant("elsewhere", &by).await.unwrap();
    ledger
        .set_tenant_channel_account(routed.id, Channel::Sms, Some(&account("main")), &by)
        .await
        .unwrap();
    ledger
        .set_tenant_channel_account(elsewhere.id, Channel::Sms, Some(&account("other")), &by)
        .await
        .unwrap();
    for t in [&plain, &routed, &elsewhere] {
        contact_of(&ledger, t.id, "patient-0001", "+1 (555) 010-0100").await;
    }

    let got = keyword(
        &ledger,
        "main",
        NUMBER,
        ConsentState::OptedOut,
        "Stop",
        "SM1",
    )
    .await;
    assert_eq!(got, InboundRecorded::Recorded { tenants: 2 });
    assert_eq!(
        consent(&ledger, plain.id, NUMBER).await,
        Some(ConsentState::OptedOut)
    );
    assert_eq!(
        consent(&ledger, routed.id, NUMBER).await,
        Some(ConsentState::OptedOut)
    );
    assert_eq!(consent(&ledger, elsewhere.id, NUMBER).await, None);
    // Whatever spelling the clinic posted the number in, the lease sees the opt-out.
    assert_eq!(
        next_flag(&ledger, plain.id, "a1", "patient-0001", t0() + secs(2)).await,
        Some(ContactFlag::OptedOut)
    );
    assert_eq!(
        next_flag(&ledger, elsewhere.id, "c1", "patient-0001", t0() + secs(2)).await,
        None
    );

    // The same message again changes nothing and writes nothing.
    let before = history_len(&pool).await;
    assert_eq!(
        keyword(
            &ledger,
            "main",
            NUMBER,
            ConsentState::OptedIn,
            "Stop",
            "SM1"
        )
        .await,
        InboundRecorded::Replay
    );
    assert_eq!(history_len(&pool).await, before);
    assert_eq!(
        consent(&ledger, plain.id, NUMBER).await,
        Some(ConsentState::OptedOut)
    );

    assert_eq!(
        keyword(
            &ledger,
            "main",
            NUMBER,
            ConsentState::OptedIn,
            "start",
            "SM2"
        )
        .await,
        InboundRecorded::Recorded { tenants: 2 }
    );
    assert_eq!(
        next_flag(&ledger, plain.id, "a2", "patient-0001", t0() + secs(3)).await,
        None
    );
    let history = ledger
        .destination_consent_history(&cipher(), plain.id, Channel::Sms, &Destination::new(NUMBER))
        .await
        .unwrap();
    let seen: Vec<(ConsentState, ConsentSource, Option<&str>, &str)> = history
        .iter()
        .map(|e| (e.state, e.source, e.keyword.as_deref(), e.actor.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            (
                ConsentState::OptedOut,
                ConsentSource::InboundKeyword,
                Some("Stop"),
                "inbound:main"
            ),
            (
                ConsentState::OptedIn,
                ConsentSource::InboundKeyword,
                Some("start"),
                "inbound:main"
            ),
        ]
    );
    assert!(
        history
            .iter()
            .all(|e| e.correlation_id.as_deref() == Some("corr-1"))
    );
    // An account no tenant sends through reaches nobody.
    assert_eq!(
        keyword(
            &ledger,
            "nowhere",
            NUMBER,
            ConsentState::OptedOut,
            "STOP",
            "SM3"
        )
        .await,
        InboundRecorded::Recorded { tenants: 0 }
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn neither_a_repost_nor_an_erasure_clears_an_opt_out(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let clinic = tenant(&ledger).await;
    ledger
        .announce_default_account(Channel::Sms, &account("main"), at(t0()))
        .await
        .unwrap();
    contact_of(&ledger, clinic.id, "patient-0001", NUMBER).await;
    keyword(
        &ledger,
        "main",
        NUMBER,
        ConsentState::OptedOut,
        "STOP",
        "SM1",
    )
    .await;

    // The same patient posted again, the same number for another subscriber.
    contact_of(&ledger, clinic.id, "patient-0001", NUMBER).await;
    contact_of(&ledger, clinic.id, "patient-0002", NUMBER).await;
    assert_eq!(
        next_flag(&ledger, clinic.id, "e1", "patient-0001", t0() + secs(2)).await,
        Some(ContactFlag::OptedOut)
    );
    assert_eq!(
        next_flag(&ledger, clinic.id, "e2", "patient-0002", t0() + secs(2)).await,
        Some(ContactFlag::OptedOut)
    );

    // Erased, then posted again under a new reference.
    ledger
        .erase_subscriber(
            clinic.id,
            &SubscriberRef::parse("patient-0001").unwrap(),
            &cipher(),
            &Operator::new("ops", Some("erasure request"), t0()).unwrap(),
            at(t0() + secs(3)),
        )
        .await
        .unwrap();
    contact_of(&ledger, clinic.id, "patient-0003", NUMBER).await;
    assert_eq!(
        next_flag(&ledger, clinic.id, "e3", "patient-0003", t0() + secs(4)).await,
        Some(ContactFlag::OptedOut)
    );
    // Another number of the same patient is not opted out.
    contact_of(&ledger, clinic.id, "patient-0004", "+15550100199").await;
    assert_eq!(
        next_flag(&ledger, clinic.id, "e4", "patient-0004", t0() + secs(4)).await,
        None
    );
}

fn throttled(max_wait: Duration) -> AdmissionSettings {
    AdmissionSettings {
        max_wait,
        ..AdmissionSettings::default()
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_opt_out_while_fifty_sends_wait_for_their_slots_stops_all_fifty(pool: PgPool) {
    const WAITING: usize = 50;
    let ledger = Ledger::from_pool(pool);
    let clinic = tenant(&ledger).await;
    ledger
        .announce_default_account(Channel::Sms, &account("main"), at(t0()))
        .await
        .unwrap();
    // 10/s with a burst of 1: the first send goes now, the other fifty wait up to 5 s.
    ledger
        .ensure_bucket(&account("main"), Channel::Sms, 10.0, 1, t0())
        .await
        .unwrap();
    contact_of(&ledger, clinic.id, "patient-0001", NUMBER).await;
    for i in 0..=WAITING {
        owed(&ledger, clinic.id, &format!("e{i}"), &[Channel::Sms], t0()).await;
    }
    let due = claim_all(&ledger, t0()).await;
    assert_eq!(due.len(), WAITING + 1);
    let routes = routes(IdempotencySupport::Honoured);
    let settings = throttled(Duration::from_secs(10));
    let cipher = cipher();
    let batch = batch_of(
        Channel::Sms,
        "worker-1",
        &routes,
        &settings,
        &cipher,
        at(t0()),
    );
    let pointers: Vec<_> = due.iter().map(|d| d.message_pointer()).collect();
    let outcomes = ledger
        .lease_batch(&batch, &pointers)
        .await
        .unwrap()
        .outcomes;
    let waiting: Vec<(LeasedDelivery, DateTime<Utc>)> = outcomes
        .into_iter()
        .filter_map(|o| match o {
            LeaseOutcome::Leased {
                lease,
                slot: SendSlot::At { reserved_at, .. },
                material,
            } => {
                assert_eq!(material.unwrap().contact_flag, None);
                Some((lease, reserved_at))
            }
            _ => None,
        })
        .collect();
    assert_eq!(waiting.len(), WAITING, "fifty leases wait for their slots");

    keyword(
        &ledger,
        "main",
        NUMBER,
        ConsentState::OptedOut,
        "STOP",
        "SM1",
    )
    .await;

    let mut refused = 0;
    for (lease, reserved_at) in &waiting {
        let fenced = ledger
            .fence(
                lease,
                *reserved_at,
                LEASE,
                Duration::from_secs(10),
                at(t0() + secs(6)),
            )
            .await
            .unwrap();
        assert_eq!(fenced, Err(FenceRefused::OptedOut));
        let record = ledger.delivery(lease.id).await.unwrap().unwrap();
        assert_eq!(record.state, DeliveryState::Suppressed);
        assert_eq!(
            record.last_error_reason.as_deref(),
            Some("contact_opted_out")
        );
        assert_eq!(record.attempt_count, 0, "no attempt was made");
        refused += 1;
    }
    assert_eq!(refused, WAITING, "0 of the 50 waiting sends were fenced");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_providers_opt_out_is_the_destinations_for_every_later_subscriber(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let clinic = tenant(&ledger).await;
    contact_of(&ledger, clinic.id, "patient-0001", NUMBER).await;
    owed(&ledger, clinic.id, "first", &[Channel::Sms], t0()).await;
    let due = claim_all(&ledger, t0()).await.remove(0);
    let first = leased(lease(&ledger, &due, t0()).await);
    let outcome = SendOutcome::Answered(ProviderAnswer::new(Verdict::ContactOptedOut, Some(400)));
    let decision = decide(
        &AttemptContext {
            attempt_number: first.attempt_number,
            expires_at: first.expires_at,
            idempotency: IdempotencySupport::Honoured,
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
        correlation_id: Some("corr-21610".into()),
    };
    record(&ledger, &first, &decision, &attempt, t0() + secs(1)).await;

    let stored = ledger
        .destination_consent(
            &cipher(),
            clinic.id,
            Channel::Sms,
            &Destination::new(NUMBER),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.state, ConsentState::OptedOut);
    assert_eq!(stored.source, ConsentSource::ProviderStop);
    assert_eq!(stored.actor, "provider:main");
    assert_eq!(history_len(&pool).await, 1);
    // Another subscriber posted with the same number is not sent to.
    contact_of(&ledger, clinic.id, "patient-0009", NUMBER).await;
    assert_eq!(
        next_flag(&ledger, clinic.id, "later", "patient-0009", t0() + secs(2)).await,
        Some(ContactFlag::OptedOut)
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn consent_is_never_removed_and_its_history_never_rewritten(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    tenant(&ledger).await;
    ledger
        .announce_default_account(Channel::Sms, &account("main"), at(t0()))
        .await
        .unwrap();
    keyword(
        &ledger,
        "main",
        NUMBER,
        ConsentState::OptedOut,
        "STOP",
        "SM1",
    )
    .await;
    assert_eq!(history_len(&pool).await, 1);

    for sql in [
        "UPDATE consent_history SET state = 'opted_in'",
        "DELETE FROM consent_history",
        "TRUNCATE consent_history",
        "DELETE FROM destination_consent",
        "TRUNCATE destination_consent",
    ] {
        let err = sqlx::query(sql).execute(&pool).await.unwrap_err();
        assert!(
            err.to_string().contains("consent is never removed"),
            "{sql}: {err}"
        );
    }
    // The binaries' roles cannot either, and have no right to the history but reading.
    for role in ["nudge_intake", "nudge_worker", "nudge_janitor"] {
        for sql in [
            "UPDATE consent_history SET state = 'opted_in'",
            "DELETE FROM consent_history",
            "DELETE FROM destination_consent",
        ] {
            assert!(
                as_role(&pool, role, sql).await.is_some(),
                "{role} may {sql}"
            );
        }
    }
    assert_eq!(history_len(&pool).await, 1);
    let state: String = sqlx::query_scalar("SELECT state FROM consent_history")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(state, "opted_out");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_contact_flagged_before_digests_stays_opted_out_until_a_start(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let clinic = tenant(&ledger).await;
    ledger
        .announce_default_account(Channel::Sms, &account("main"), at(t0()))
        .await
        .unwrap();
    contact_of(&ledger, clinic.id, "patient-0001", NUMBER).await;
    // As a provider's flag was kept before consent was the destination's: on the contact,
    // and the contact without its digest.
    sqlx::query("UPDATE contacts SET opted_out_at = $1, destination_digest = NULL")
        .bind(t0())
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        next_flag(&ledger, clinic.id, "e1", "patient-0001", t0() + secs(1)).await,
        Some(ContactFlag::OptedOut)
    );
    // Posted again with the same number: it gets its digest and keeps its flag.
    contact_of(&ledger, clinic.id, "patient-0001", NUMBER).await;
    assert_eq!(
        next_flag(&ledger, clinic.id, "e2", "patient-0001", t0() + secs(2)).await,
        Some(ContactFlag::OptedOut)
    );
    // The patient's START clears it with the destination's consent.
    keyword(
        &ledger,
        "main",
        NUMBER,
        ConsentState::OptedIn,
        "START",
        "SM1",
    )
    .await;
    assert_eq!(
        next_flag(&ledger, clinic.id, "e3", "patient-0001", t0() + secs(3)).await,
        None
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_stop_committed_while_the_lease_waits_for_its_bucket_leaves_the_send_unstamped(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let clinic = tenant(&ledger).await;
    ledger
        .announce_default_account(Channel::Sms, &account("main"), at(t0()))
        .await
        .unwrap();
    ledger
        .ensure_bucket(&account("main"), Channel::Sms, 100.0, 10, t0())
        .await
        .unwrap();
    contact_of(&ledger, clinic.id, "patient-0001", NUMBER).await;
    owed(&ledger, clinic.id, "e1", &[Channel::Sms], t0()).await;
    let due = claim_all(&ledger, t0()).await.remove(0);

    // Another transaction holds the bucket: the lease finds its candidate, then waits.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM rate_buckets FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let leasing = {
        let ledger = ledger.clone();
        tokio::spawn(async move { lease(&ledger, &due, t0() + secs(1)).await })
    };
    let waited = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            if waiting > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "the lease never waited for the bucket");
    keyword(
        &ledger,
        "main",
        NUMBER,
        ConsentState::OptedOut,
        "STOP",
        "SM1",
    )
    .await;
    holder.commit().await.unwrap();

    let (lease, reserved_at) = match leasing.await.unwrap() {
        LeaseOutcome::Leased {
            lease,
            slot: SendSlot::At { reserved_at, .. },
            ..
        } => (lease, reserved_at),
        other => panic!("expected an unstamped lease, got {other:?}"),
    };
    let fenced = ledger
        .fence(
            &lease,
            reserved_at,
            LEASE,
            Duration::from_secs(10),
            at(t0() + secs(1)),
        )
        .await
        .unwrap();
    assert_eq!(fenced, Err(FenceRefused::OptedOut));
    let record = ledger.delivery(lease.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Suppressed);
}
