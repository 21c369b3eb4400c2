//! The group commit of single reminders against a real database: posts committed together
//! are each answered with their own outcome, one that fails its batch answers alone, and one
//! whose signature no longer matches the tenant's secrets is refused and writes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use chrono::{DateTime, TimeZone, Utc};
use nudge_domain::{Channel, EventId, SubscriberRef, TenantId};
use nudge_intake::commit::{Check, CommitError, Committed, Committer};
use nudge_intake::signature::{SignatureHeader, Signed, header_value};
use nudge_ledger::{
    Destination, DestinationCipher, ImportOutcome, ImportReminder, Ledger, NewReminder, Operator,
    SubscriberKey,
};
use sqlx::PgPool;

fn now() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 12, 1, 9, 0, 0).unwrap()
}

fn reminder(tenant: TenantId, event: &str, subscriber: &str, destination: &str) -> ImportReminder {
    ImportReminder {
        reminder: NewReminder::new(
            tenant,
            EventId::parse(event).unwrap(),
            SubscriberRef::parse(subscriber).unwrap(),
            &[Channel::Sms],
            now() + chrono::Duration::hours(1),
            now() + chrono::Duration::hours(2),
        )
        .unwrap(),
        contacts: vec![(Channel::Sms, Destination::new(destination))],
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn posts_committed_together_are_each_answered_with_their_own_outcome_and_a_stale_signature_is_refused(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let operator = Operator::new("test", Some("test"), Utc::now()).unwrap();
    ledger.create_tenant("clinic", &operator).await.unwrap();
    let tenant = ledger.tenant_by_name("clinic").await.unwrap().unwrap().id;
    let cipher = DestinationCipher::new(&[7; 32]).with_subscriber_key(SubscriberKey::new(&[9; 32]));
    let secret = ledger
        .rotate_signing_secret(tenant, &cipher, &operator)
        .await
        .unwrap();
    let committer = Committer::start(ledger.clone(), cipher, Arc::new(now));
    // What each post's signature covered, signed under `key`.
    let check = |event: &str, key: &str| {
        let body = axum::body::Bytes::from(event.to_owned());
        let signed = Signed {
            method: "POST",
            target: "/v1/tenants/clinic/reminders",
            body: &body,
        };
        let header = header_value(&[key.as_bytes()], now().timestamp(), &signed);
        Check {
            tenant: "clinic".to_owned(),
            signature: SignatureHeader::parse(&header).unwrap(),
            method: "POST".to_owned(),
            target: "/v1/tenants/clinic/reminders".to_owned(),
            body: body.clone(),
        }
    };

    // 30 new events; 5 posted twice alike; 4 posted twice for different subscribers; one
    // whose destination the ledger refuses, which fails any batch it is part of.
    let mut posts: Vec<(String, ImportReminder)> = Vec::new();
    for i in 0..30 {
        posts.push((
            format!("a{i}"),
            reminder(tenant, &format!("a{i}"), "p", "+1555"),
        ));
    }
    for i in 0..5 {
        for _ in 0..2 {
            posts.push((
                format!("b{i}"),
                reminder(tenant, &format!("b{i}"), "p", "+1555"),
            ));
        }
    }
    for i in 0..4 {
        for subscriber in ["p", "q"] {
            posts.push((
                format!("c{i}"),
                reminder(tenant, &format!("c{i}"), subscriber, "+1555"),
            ));
        }
    }
    let too_long = "1".repeat(2000);
    posts.push(("d".to_owned(), reminder(tenant, "d", "p", &too_long)));
    // One signed under a secret the tenant no longer has (authenticated from a stale cache).
    posts.push(("e".to_owned(), reminder(tenant, "e", "p", "+1555")));

    // The tenant row held: the first batch's import waits on it, and the posts behind it queue
    // up; the committers take them in batches once it is released.
    let mut hold = ledger.pool().begin().await.unwrap();
    sqlx::query("SELECT id FROM tenants WHERE id = $1 FOR UPDATE")
        .bind(tenant.as_uuid())
        .execute(&mut *hold)
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for (event, item) in posts {
        let committer = committer.clone();
        let key = if event == "e" {
            "nsk_retired".to_owned()
        } else {
            secret.expose().to_owned()
        };
        let check = check(&event, &key);
        tasks.push(tokio::spawn(async move {
            let answer = committer
                .import(item, check)
                .await
                .map(|Committed { outcome, .. }| outcome);
            (event, answer)
        }));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(ledger.pool())
        .await
        .unwrap();
        if waiting >= 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the committers did not reach the held row: {waiting} waiting"
        );
        tokio::task::yield_now().await;
    }
    hold.commit().await.unwrap();
    let mut answers: Vec<(String, Result<ImportOutcome, CommitError>)> = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }

    let of = |event: &str| -> Vec<&Result<ImportOutcome, CommitError>> {
        answers
            .iter()
            .filter(|(e, _)| e == event)
            .map(|(_, r)| r)
            .collect()
    };
    for i in 0..30 {
        assert!(
            matches!(
                of(&format!("a{i}"))[..],
                [Ok(ImportOutcome::Created { .. })]
            ),
            "a{i}"
        );
    }
    for i in 0..5 {
        let pair = of(&format!("b{i}"));
        let ids: Vec<_> = pair
            .iter()
            .map(|r| match r {
                Ok(ImportOutcome::Created { id, .. } | ImportOutcome::AlreadyPresent { id }) => *id,
                other => panic!("b{i}: {other:?}"),
            })
            .collect();
        assert_eq!(ids[0], ids[1], "b{i}: one reminder");
        let created = pair
            .iter()
            .filter(|r| matches!(r, Ok(ImportOutcome::Created { .. })))
            .count();
        assert_eq!(created, 1, "b{i}");
    }
    for i in 0..4 {
        let pair = of(&format!("c{i}"));
        let conflicts = pair
            .iter()
            .filter(|r| matches!(r, Ok(ImportOutcome::EventConflict)))
            .count();
        let created = pair
            .iter()
            .filter(|r| matches!(r, Ok(ImportOutcome::Created { .. })))
            .count();
        assert_eq!((created, conflicts), (1, 1), "c{i}");
    }
    assert!(
        matches!(of("d")[..], [Err(CommitError::Ledger(_))]),
        "{:?}",
        of("d")
    );

    assert!(
        matches!(
            of("e")[..],
            [Err(CommitError::Refused(
                nudge_intake::signature::Refusal::BadSignature
            ))]
        ),
        "{:?}",
        of("e")
    );

    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM reminders")
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    assert_eq!(stored, 30 + 5 + 4);
}
