//! Delivery events (decision 0601): every client-visible change of a delivery writes its
//! event in the same statement (a trigger), through each role's own statements; the engine's
//! own steps (claim, lease) write none; a change that rolls back leaves none; the sequencer
//! numbers committed events only, so one committed late is numbered after those read before
//! and a reader paging by position never skips one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use chrono::{DateTime, Utc};
use nudge_domain::{
    AttemptContext, Channel, EventId, FixedJitter, IdempotencySupport, RetryPolicy, SendOutcome,
    TenantId, decide,
};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    AttemptRecord, DeliveryEvent, DeliveryEventKind, LeasedDelivery, Ledger, LedgerTime, Receipt,
    ReceiptOutcome, Recorded, SequencedEvents,
};
use sqlx::PgPool;

/// The sequencer's advisory lock ("nudgeEvs").
const SEQUENCER_LOCK: i64 = 0x6e75_6467_6545_7673;

async fn settle(
    worker: &Ledger,
    lease: &LeasedDelivery,
    status: u16,
    at_time: DateTime<Utc>,
) -> Recorded {
    let facts = AttemptRecord {
        started_at: at_time,
        finished_at: at_time + secs(1),
        worker: "worker-1".into(),
        correlation_id: None,
    };
    let outcome = SendOutcome::Response {
        status,
        retry_after: None,
        provider_message_id: (status / 100 == 2).then(|| "prov-123".to_owned()),
    };
    let decision = decide(
        &AttemptContext {
            attempt_number: lease.attempt_number,
            expires_at: lease.expires_at,
            idempotency: IdempotencySupport::Honoured,
        },
        &outcome,
        facts.finished_at,
        &RetryPolicy::default(),
        &mut FixedJitter::new(2_000),
    );
    record(worker, lease, &decision, &facts, facts.finished_at).await
}

async fn all_events(reader: &Ledger, tenant: TenantId) -> Vec<DeliveryEvent> {
    let mut events = Vec::new();
    let mut after = 0;
    loop {
        let page = reader.tenant_events(tenant, after, 2).await.unwrap();
        events.extend(page.events);
        after = page.next_after;
        if !page.more {
            return events;
        }
    }
}

async fn written(ledger: &Ledger) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM delivery_events")
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn each_roles_changes_write_their_events_in_order_and_the_engines_own_steps_none(
    pool: PgPool,
) {
    let owner = Ledger::from_pool(pool.clone());
    let producer = connected_as(&pool, "nudge_producer").await;
    let worker = connected_as(&pool, "nudge_worker").await;
    let janitor = connected_as(&pool, "nudge_janitor").await;
    let intake = connected_as(&pool, "nudge_intake").await;
    let tenant = tenant(&owner).await;
    let created = owner
        .create_reminder(
            &reminder(tenant.id, "appt-1", &[Channel::Sms], t0()),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    producer
        .materialise_reminder(tenant.id, created.id, t0())
        .await
        .unwrap();
    let kinds: Vec<(String, Option<String>, String)> =
        sqlx::query_as("SELECT kind, previous_state, state FROM delivery_events ORDER BY id")
            .fetch_all(owner.pool())
            .await
            .unwrap();
    assert_eq!(written(&owner).await, 1, "scheduled: {kinds:?}");

    // Claimed and leased: the engine's steps, no event.
    let due = claim_all(&producer, t0()).await.remove(0);
    let first = leased(lease(&worker, &due, t0()).await);
    assert_eq!(written(&owner).await, 1, "a claim and a lease write none");
    assert_eq!(settle(&worker, &first, 503, t0()).await, Recorded::Applied);
    let retry_at = owner
        .delivery(due.id)
        .await
        .unwrap()
        .unwrap()
        .next_attempt_at
        .unwrap();
    let again = claim_all(&producer, retry_at).await.remove(0);
    let second = leased(lease(&worker, &again, retry_at).await);
    // Settled by the owner: the worker's role refuses a settlement at the test's fixed time,
    // days before the database's (a settlement is never backdated).
    assert_eq!(
        settle(&owner, &second, 202, retry_at).await,
        Recorded::Applied
    );

    // The provider's receipt confirms it (through the intake's role): no state changes, the
    // client is told; the same receipt again tells nothing new.
    let receipt = Receipt {
        account: account("main"),
        event_key: "SM1:delivered".into(),
        delivery_key: Some(first.idempotency_key.clone()),
        status: "delivered".into(),
        outcome: ReceiptOutcome::Delivered,
        contact_flag: None,
        code: None,
        provider_message_id: Some("prov-123".into()),
    };
    for _ in 0..2 {
        intake
            .record_receipts(std::slice::from_ref(&receipt), LedgerTime::Database)
            .await
            .unwrap();
    }

    // A second reminder, cancelled through the intake's role.
    let other = intake
        .create_reminder(
            &reminder(tenant.id, "appt-2", &[Channel::Email], t0() + secs(600)),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    producer
        .materialise_reminder(tenant.id, other.id, t0())
        .await
        .unwrap();
    intake
        .cancel_reminder_by_channel(
            tenant.id,
            &EventId::parse("appt-2").unwrap(),
            LedgerTime::Database,
        )
        .await
        .unwrap()
        .expect("cancelled");

    // Nothing is readable before the sequencer numbered it.
    assert!(
        intake
            .tenant_events(tenant.id, 0, 100)
            .await
            .unwrap()
            .events
            .is_empty()
    );
    assert_eq!(
        janitor.sequence_events(1_000).await.unwrap(),
        SequencedEvents { numbered: Some(6) }
    );
    assert_eq!(
        janitor.sequence_events(1_000).await.unwrap(),
        SequencedEvents { numbered: Some(0) },
        "numbered once"
    );

    let events = all_events(&intake, tenant.id).await;
    let kinds: Vec<_> = events
        .iter()
        .map(|e| (e.event_id.as_str(), e.kind))
        .collect();
    assert_eq!(
        kinds,
        [
            ("appt-1", DeliveryEventKind::Scheduled),
            ("appt-1", DeliveryEventKind::Deferred),
            ("appt-1", DeliveryEventKind::Sent),
            ("appt-1", DeliveryEventKind::Delivered),
            ("appt-2", DeliveryEventKind::Scheduled),
            ("appt-2", DeliveryEventKind::Cancelled),
        ]
    );
    assert!(events.windows(2).all(|w| w[0].position < w[1].position));
    let sms: Vec<_> = events
        .iter()
        .filter(|e| e.delivery_id == due.id.as_uuid())
        .collect();
    assert_eq!(
        sms.iter().map(|e| e.delivery_seq).collect::<Vec<_>>(),
        [1, 2, 3, 4],
        "in order per delivery"
    );
    let confirmed = sms[3];
    assert_eq!(
        (
            confirmed.state.as_str(),
            confirmed.previous_state.as_deref()
        ),
        ("delivered", Some("delivered"))
    );
    assert_eq!(confirmed.reason.as_deref(), Some("receipt: delivered"));
    let deferred = sms[1];
    assert_eq!(deferred.state, "retry_wait");
    assert_eq!(deferred.previous_state.as_deref(), Some("sending"));
    assert_eq!(deferred.error_class.as_deref(), Some("retryable"));
    assert_eq!(deferred.next_attempt_at, Some(retry_at));
    assert_eq!(deferred.attempt_count, 1);
    let sent = sms[2];
    assert_eq!(sent.provider_message_id.as_deref(), Some("prov-123"));
    assert_eq!(
        (sent.state.as_str(), sent.lane.as_str()),
        ("delivered", "retry")
    );
    assert_eq!(sent.reminder_id, created.id.as_uuid());
    assert_eq!(sent.channel, Channel::Sms);

    // Paging: after the last position, nothing; the position is kept.
    let last = events.last().unwrap().position;
    let page = intake.tenant_events(tenant.id, last, 100).await.unwrap();
    assert!(page.events.is_empty());
    assert_eq!((page.next_after, page.more), (last, false));
    // Another tenant sees none of them.
    let stranger = owner.create_tenant("clinic-b", &ops(t0())).await.unwrap();
    assert!(
        intake
            .tenant_events(stranger.id, 0, 100)
            .await
            .unwrap()
            .events
            .is_empty()
    );
}

/// The events are written per statement (migration 20261222000001): one statement that
/// changes several deliveries writes one event for each change that is one and none for the
/// others, each counted on its own delivery; a statement whose WITH changes deliveries too
/// writes the events of both.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn one_statement_writes_an_event_for_each_delivery_it_changes_visibly(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let reminder = owed(
        &ledger,
        tenant.id,
        "appt-1",
        &[Channel::Sms, Channel::Email, Channel::Push],
        t0() + secs(600),
    )
    .await;
    assert_eq!(written(&ledger).await, 3, "materialised in one statement");

    // Sms cancelled, email moved five minutes earlier, push touched without a visible change.
    sqlx::query(
        "UPDATE deliveries
         SET state = CASE channel WHEN 'sms' THEN 'cancelled' ELSE state END,
             settled_at = CASE channel WHEN 'sms' THEN now() ELSE settled_at END,
             next_attempt_at = CASE channel WHEN 'sms' THEN NULL
                                            WHEN 'email' THEN next_attempt_at - interval '5 min'
                                            ELSE next_attempt_at END,
             scheduled_at = CASE channel WHEN 'email' THEN scheduled_at - interval '5 min'
                                         ELSE scheduled_at END,
             updated_at = now()
         WHERE reminder_id = $1",
    )
    .bind(reminder.as_uuid())
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(written(&ledger).await, 5);

    // One statement, two changes of the table: the WITH's and the outer update's.
    sqlx::query(
        "WITH email AS (
             UPDATE deliveries SET state = 'cancelled', settled_at = now(),
                                   next_attempt_at = NULL
             WHERE reminder_id = $1 AND channel = 'email' RETURNING id)
         UPDATE deliveries SET state = 'cancelled', settled_at = now(), next_attempt_at = NULL
         WHERE reminder_id = $1 AND channel = 'push' AND (SELECT count(*) FROM email) = 1",
    )
    .bind(reminder.as_uuid())
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(written(&ledger).await, 7);

    assert_eq!(ledger.sequence_events(100).await.unwrap().numbered, Some(7));
    let events = all_events(&ledger, tenant.id).await;
    let of = |channel: Channel| -> Vec<(DeliveryEventKind, i32)> {
        events
            .iter()
            .filter(|e| e.channel == channel)
            .map(|e| (e.kind, e.delivery_seq))
            .collect()
    };
    assert_eq!(
        of(Channel::Sms),
        [
            (DeliveryEventKind::Scheduled, 1),
            (DeliveryEventKind::Cancelled, 2)
        ]
    );
    assert_eq!(
        of(Channel::Email),
        [
            (DeliveryEventKind::Scheduled, 1),
            (DeliveryEventKind::Rescheduled, 2),
            (DeliveryEventKind::Cancelled, 3)
        ]
    );
    assert_eq!(
        of(Channel::Push),
        [
            (DeliveryEventKind::Scheduled, 1),
            (DeliveryEventKind::Cancelled, 2)
        ],
        "touched without a visible change: no event, not counted"
    );
    let moved = events
        .iter()
        .find(|e| e.kind == DeliveryEventKind::Rescheduled)
        .unwrap();
    assert_eq!(moved.next_attempt_at, Some(t0() + secs(300)));
    let counts: Vec<(String, i32)> = sqlx::query_as(
        "SELECT channel, event_seq FROM deliveries WHERE reminder_id = $1 ORDER BY channel",
    )
    .bind(reminder.as_uuid())
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        counts,
        [
            ("email".to_owned(), 3),
            ("push".to_owned(), 2),
            ("sms".to_owned(), 2)
        ]
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_rolled_back_change_leaves_no_event_and_one_committed_late_is_read_after(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let first = owed(
        &ledger,
        tenant.id,
        "appt-1",
        &[Channel::Sms],
        t0() + secs(600),
    )
    .await;
    let second = owed(
        &ledger,
        tenant.id,
        "appt-2",
        &[Channel::Sms],
        t0() + secs(600),
    )
    .await;
    assert_eq!(ledger.sequence_events(100).await.unwrap().numbered, Some(2));
    let cancel = "UPDATE deliveries SET state = 'cancelled', settled_at = now(), \
                  next_attempt_at = NULL WHERE reminder_id = $1";

    // Rolled back: no event.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(cancel)
        .bind(first.as_uuid())
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(written(&ledger).await, 2);

    // The first change is written and left open; a second commits meanwhile.
    let mut open = pool.begin().await.unwrap();
    sqlx::query(cancel)
        .bind(first.as_uuid())
        .execute(&mut *open)
        .await
        .unwrap();
    sqlx::query(cancel)
        .bind(second.as_uuid())
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        ledger.sequence_events(100).await.unwrap().numbered,
        Some(1),
        "the committed change is numbered; the open one's event is not seen"
    );
    let before = ledger.tenant_events(tenant.id, 0, 100).await.unwrap();
    assert_eq!(before.events.len(), 3);
    assert_eq!(before.events[2].event_id, "appt-2");
    open.commit().await.unwrap();
    assert_eq!(ledger.sequence_events(100).await.unwrap().numbered, Some(1));
    let after = ledger
        .tenant_events(tenant.id, before.next_after, 100)
        .await
        .unwrap();
    let order: Vec<_> = after
        .events
        .iter()
        .map(|e| (e.event_id.as_str(), e.kind))
        .collect();
    assert_eq!(
        order,
        [("appt-1", DeliveryEventKind::Cancelled)],
        "committed late, numbered after: a reader that stopped before still sees it"
    );

    // One sequencer at a time: while another holds it, a call numbers none.
    let mut holder = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(SEQUENCER_LOCK)
        .execute(&mut *holder)
        .await
        .unwrap();
    assert_eq!(
        ledger.sequence_events(100).await.unwrap(),
        SequencedEvents { numbered: None }
    );
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(SEQUENCER_LOCK)
        .execute(&mut *holder)
        .await
        .unwrap();
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn no_role_but_the_owner_writes_or_deletes_an_event(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "appt-1", &[Channel::Sms], t0()).await;
    for role in [
        "nudge_intake",
        "nudge_worker",
        "nudge_producer",
        "nudge_janitor",
    ] {
        for sql in [
            "UPDATE delivery_events SET kind = 'sent'",
            "DELETE FROM delivery_events",
            "SELECT nudge_delivery_event_count()",
            "SELECT nudge_delivery_events_inserted()",
            "SELECT nudge_delivery_events_updated()",
        ] {
            assert_eq!(
                as_role(&pool, role, sql).await.as_deref(),
                Some("42501"),
                "{role}: {sql}"
            );
        }
    }
    assert_eq!(
        as_role(
            &pool,
            "nudge_worker",
            "SELECT nudge_sequence_delivery_events(10)"
        )
        .await
        .as_deref(),
        Some("42501"),
        "only the janitor numbers"
    );
}
