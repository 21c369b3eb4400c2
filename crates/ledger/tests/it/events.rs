//! Delivery events (decision 0601): every client-visible change of a delivery writes its
//! event in the same statement (a trigger), through each role's own statements; the engine's
//! own steps (claim, lease) write none; a change that rolls back leaves none; the sequencer
//! numbers committed events only, so one committed late is numbered after those read before
//! and a reader paging by position never skips one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use chrono::{DateTime, Utc};
use nudge_domain::{
    AttemptContext, Channel, DeliveryState, EventId, FixedJitter, IdempotencySupport, RetryPolicy,
    SendOutcome, TenantId, decide,
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

fn delivered_receipt(key: &str, status: &str, lease: &LeasedDelivery) -> Receipt {
    Receipt {
        account: account("main"),
        event_key: key.into(),
        delivery_key: Some(lease.idempotency_key.clone()),
        status: status.into(),
        outcome: ReceiptOutcome::Delivered,
        contact_flag: None,
        code: None,
        provider_message_id: Some("prov-123".into()),
    }
}

async fn kinds_of(
    ledger: &Ledger,
    tenant: TenantId,
    event_id: &str,
) -> Vec<(DeliveryEventKind, i32)> {
    all_events(ledger, tenant)
        .await
        .into_iter()
        .filter(|e| e.event_id == event_id)
        .map(|e| (e.kind, e.delivery_seq))
        .collect()
}

/// A receipt saying delivered is told once per delivery (migration 20261224000001): one that
/// arrives before the send is recorded (the delivery still `sending`) is told right after the
/// `sent`, and a later receipt saying the same (`read` after `delivered`), in its own batch or
/// in one with the first, tells nothing more.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_delivery_is_told_delivered_once_whether_its_receipt_comes_before_or_after_its_send(
    pool: PgPool,
) {
    let owner = Ledger::from_pool(pool.clone());
    let worker = connected_as(&pool, "nudge_worker").await;
    let intake = connected_as(&pool, "nudge_intake").await;
    let tenant = tenant(&owner).await;
    let early = owed(&owner, tenant.id, "early", &[Channel::Sms], t0()).await;
    let late = owed(&owner, tenant.id, "late", &[Channel::Sms], t0()).await;
    let both = owed(&owner, tenant.id, "both", &[Channel::Sms], t0()).await;
    let mut leases = Vec::new();
    for due in claim_all(&owner, t0()).await {
        leases.push(leased(lease(&worker, &due, t0()).await));
    }
    let of = |reminder: nudge_domain::ReminderId| -> LeasedDelivery {
        leases
            .iter()
            .find(|l| l.reminder_id == reminder)
            .unwrap()
            .clone()
    };
    let (early, late, both) = (of(early), of(late), of(both));

    // Before its send is recorded: nothing to tell yet.
    intake
        .record_receipts(
            &[delivered_receipt("SM-early:delivered", "delivered", &early)],
            LedgerTime::Database,
        )
        .await
        .unwrap();
    assert_eq!(written(&owner).await, 3, "only the three scheduled");

    // Settled by the owner: the worker's role refuses a settlement at the test's fixed time.
    for lease in [&early, &late, &both] {
        assert_eq!(settle(&owner, lease, 202, t0()).await, Recorded::Applied);
    }
    intake
        .record_receipts(
            &[delivered_receipt("SM-late:delivered", "delivered", &late)],
            LedgerTime::Database,
        )
        .await
        .unwrap();
    intake
        .record_receipts(
            &[
                delivered_receipt("SM-both:delivered", "delivered", &both),
                delivered_receipt("SM-both:read", "read", &both),
            ],
            LedgerTime::Database,
        )
        .await
        .unwrap();
    // Said again later: told already.
    for lease in [&early, &late] {
        intake
            .record_receipts(
                &[delivered_receipt(
                    &format!("{}:read", lease.id.as_uuid()),
                    "read",
                    lease,
                )],
                LedgerTime::Database,
            )
            .await
            .unwrap();
    }

    owner.sequence_events(100).await.unwrap();
    let told = [
        (DeliveryEventKind::Scheduled, 1),
        (DeliveryEventKind::Sent, 2),
        (DeliveryEventKind::Delivered, 3),
    ];
    for event_id in ["early", "late", "both"] {
        assert_eq!(
            kinds_of(&owner, tenant.id, event_id).await,
            told,
            "{event_id}"
        );
    }
    let confirmed: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT e.event_id, e.reason FROM delivery_events e
         WHERE e.kind = 'delivered' ORDER BY e.event_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        confirmed,
        ["both", "early", "late"].map(|id| (id.to_owned(), Some("receipt: delivered".to_owned())))
    );
    let counts: Vec<i32> =
        sqlx::query_scalar("SELECT event_seq FROM deliveries ORDER BY event_seq")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(counts, [3, 3, 3], "each delivery counts what it told");
}

/// The statement trigger returns at once for a statement none of whose rows is an event (no
/// row's `event_seq` counted one, migration 20261224000001): a statement that changes no state
/// writes nothing, alone or in a transaction with one that does, and one that writes
/// `event_seq` itself makes the trigger look and find nothing.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_transaction_writes_the_events_of_its_changes_whatever_came_before_them(pool: PgPool) {
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
    let touch = "UPDATE deliveries SET updated_at = now() WHERE reminder_id = $1";
    let cancel = "UPDATE deliveries SET state = 'cancelled', settled_at = now(), \
                  next_attempt_at = NULL WHERE reminder_id = $1";

    sqlx::query(touch)
        .bind(first.as_uuid())
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(written(&ledger).await, 2, "a touch alone: none");

    let mut tx = pool.begin().await.unwrap();
    for (sql, reminder) in [
        (touch, first),
        (cancel, first),
        (touch, second),
        (cancel, second),
    ] {
        sqlx::query(sql)
            .bind(reminder.as_uuid())
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    assert_eq!(
        written(&ledger).await,
        4,
        "both cancellations, nothing for the touches"
    );

    let first_seq: i32 =
        sqlx::query_scalar("SELECT event_seq FROM deliveries WHERE reminder_id = $1")
            .bind(first.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();
    sqlx::query("UPDATE deliveries SET event_seq = event_seq + 5 WHERE reminder_id = $1")
        .bind(first.as_uuid())
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        written(&ledger).await,
        4,
        "a count written by hand is no event"
    );
    assert_eq!(first_seq, 2, "scheduled, cancelled");
}

/// The gate of migration 20261225000001: a statement's rows add up to the same event count
/// before and after exactly when none is an event, which holds because a count never goes
/// down. A large statement of no event writes none; one whose every row is an event writes
/// each, and one event among many non-events is found.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_gate_finds_every_event_of_a_large_statement_and_a_count_never_goes_down(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "appt-0", &[Channel::Sms], t0()).await;
    bulk_due_sms(&pool, tenant.id, 3000, t0(), 0).await;
    let scheduled = written(&ledger).await;
    assert_eq!(scheduled, 3001, "one scheduled event per delivery");

    // 3,001 rows, none an event (queued is no event): nothing written.
    sqlx::query("UPDATE deliveries SET state = 'queued', generation = generation + 1")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(written(&ledger).await, scheduled, "queued is no event");

    // One event among 3,001 rows: found, and only it.
    let one: uuid::Uuid = sqlx::query_scalar::<_, Option<uuid::Uuid>>(
        "UPDATE deliveries SET state = CASE WHEN event_id_rank = 1 THEN 'cancelled' ELSE state END,
                settled_at = CASE WHEN event_id_rank = 1 THEN $1 END,
                next_attempt_at = CASE WHEN event_id_rank = 1 THEN NULL ELSE next_attempt_at END,
                updated_at = $1
         FROM (SELECT id AS ranked_id, row_number() OVER (ORDER BY id) AS event_id_rank
               FROM deliveries) ranked
         WHERE deliveries.id = ranked.ranked_id
         RETURNING CASE WHEN event_id_rank = 1 THEN deliveries.id END",
    )
    .bind(t0())
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .flatten()
    .next()
    .unwrap();
    let cancelled: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT delivery_id, kind FROM delivery_events WHERE kind <> 'scheduled'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(cancelled, vec![(one, "cancelled".to_owned())]);

    // Every remaining row an event: each written.
    sqlx::query(
        "UPDATE deliveries SET state = 'expired', settled_at = $1, next_attempt_at = NULL,
                updated_at = $1
         WHERE state = 'queued'",
    )
    .bind(t0())
    .execute(&pool)
    .await
    .unwrap();
    let expired: i64 =
        sqlx::query_scalar("SELECT count(*) FROM delivery_events WHERE kind = 'expired'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(expired, 3000);

    // A count written lower is refused, and changes nothing.
    let lowered = sqlx::query("UPDATE deliveries SET event_seq = event_seq - 1 WHERE id = $1")
        .bind(one)
        .execute(&pool)
        .await
        .unwrap_err();
    assert!(lowered.to_string().contains("never goes down"), "{lowered}");
    let seq: i32 = sqlx::query_scalar("SELECT event_seq FROM deliveries WHERE id = $1")
        .bind(one)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(seq, 2, "scheduled, cancelled");
}

/// The state a case's delivery is set to, with the columns its CHECKs tie to that state, from
/// the case's columns `{side}_state`, `{side}_reason` (`old` or `new`), for the cases of one
/// group (`counts`). The second update (`second`) shifts `scheduled_at` for the cases that move
/// it and, in the group that `counts`, raises the count itself, by the mapping, as a statement
/// may (the row trigger counts whatever the statement wrote).
fn set_case_state(side: &str, second: bool, counts: bool) -> String {
    let count = if second && counts {
        ", event_seq = d.event_seq
             + CASE WHEN nudge_delivery_event_kind(d.state, c.new_state, d.scheduled_at,
                                                   d.scheduled_at + CASE WHEN c.moved
                                                       THEN interval '1 second'
                                                       ELSE interval '0' END,
                                                   d.last_error_reason, c.new_reason)
                    IS NULL THEN 0 ELSE 1 END"
    } else {
        ""
    };
    format!(
        "UPDATE deliveries d
         SET state = c.{side}_state,
             lease_owner = CASE WHEN c.{side}_state = 'sending' THEN 'worker-1' END,
             lease_expires_at = CASE WHEN c.{side}_state = 'sending'
                                     THEN now() + interval '1 minute' END,
             send_started_at = NULL,
             settled_at = CASE WHEN c.{side}_state IN ('delivered', 'dead_lettered', 'expired',
                                                       'cancelled', 'suppressed', 'ambiguous')
                               THEN now() END,
             next_attempt_at = CASE WHEN c.{side}_state IN ('scheduled', 'retry_wait', 'queued')
                                    THEN now() END,
             last_error_reason = c.{side}_reason,
             scheduled_at = d.scheduled_at
                 + CASE WHEN {second} AND c.moved THEN interval '1 second' ELSE interval '0' END
             {count}
         FROM event_cases c WHERE c.delivery_id = d.id AND c.counts = {counts}"
    )
}

/// One case's change, what was counted and what the statement trigger wrote.
#[derive(Debug, sqlx::FromRow)]
struct CaseOutcome {
    old_state: String,
    new_state: String,
    moved: bool,
    old_reason: Option<String>,
    new_reason: Option<String>,
    counted: i32,
    /// The mapping's kind for the change.
    kind: Option<String>,
    written: Option<String>,
}

/// Every pair of states, the time moved or not, and the reasons that make a repeated wait for
/// a missing account no event, on the deliveries `counts` marks, each case's change in one
/// statement; what was counted and written for each.
async fn run_event_cases(conn: &mut sqlx::PgConnection, counts: bool) -> Vec<CaseOutcome> {
    sqlx::query(sqlx::AssertSqlSafe(set_case_state("old", false, counts)))
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE event_cases c SET seq_before = d.event_seq
         FROM deliveries d WHERE d.id = c.delivery_id AND c.counts = $1",
    )
    .bind(counts)
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(set_case_state("new", true, counts)))
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query_as(
        "SELECT c.old_state, c.new_state, c.moved, c.old_reason, c.new_reason,
                d.event_seq - c.seq_before AS counted,
                nudge_delivery_event_kind(c.old_state, c.new_state, d.scheduled_at
                    - CASE WHEN c.moved THEN interval '1 second' ELSE interval '0' END,
                    d.scheduled_at, c.old_reason, c.new_reason) AS kind,
                (SELECT string_agg(e.kind, ',') FROM delivery_events e
                 WHERE e.delivery_id = d.id AND e.delivery_seq > c.seq_before) AS written
         FROM event_cases c JOIN deliveries d ON d.id = c.delivery_id
         WHERE c.counts = $1",
    )
    .bind(counts)
    .fetch_all(&mut *conn)
    .await
    .unwrap()
}

/// The row trigger that counts an event (`deliveries_event_count`) counts exactly the changes
/// the mapping (`nudge_delivery_event_kind`) names an event, and the statement trigger writes
/// exactly those, of that kind; a statement that raises the counts itself gets the same
/// events, each counted once. The trigger's condition (decision 0607) is no
/// narrower than the mapping, and calls no function: preparing one parses its body for every
/// statement.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_count_trigger_counts_exactly_the_changes_the_mapping_names_events(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    // Every state the domain knows, so a new one is a new case here.
    let states: Vec<&str> = DeliveryState::ALL.iter().map(|s| s.as_str()).collect();
    // 10 x 10 states x moved or not x 4 pairs of reasons, counted by the trigger and by the
    // statement.
    let cases = (states.len() * states.len() * 2 * 4) as i64;
    bulk_due_sms(&pool, tenant.id, 2 * cases, t0(), 1000).await;
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query(
        "CREATE TEMP TABLE event_cases AS
         SELECT d.id AS delivery_id, c.old_state, c.new_state, c.moved, c.old_reason,
                c.new_reason, c.counts, 0 AS seq_before
         FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM deliveries) d
         JOIN (SELECT row_number() OVER () AS n, o AS old_state, nw AS new_state, moved,
                      r.old_reason, r.new_reason, counts
               FROM unnest(ARRAY[false, true]) counts, unnest($1::text[]) o,
                    unnest($1::text[]) nw, unnest(ARRAY[false, true]) moved,
                    (VALUES (NULL, NULL), ('account_unavailable', 'account_unavailable'),
                            ('account_unavailable', NULL), (NULL, 'account_unavailable'))
                        r(old_reason, new_reason)) c ON c.n = d.n",
    )
    .bind(&states)
    .execute(&mut *conn)
    .await
    .unwrap();
    let made: i64 = sqlx::query_scalar("SELECT count(*) FROM event_cases")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(made, 2 * cases);

    for counts in [false, true] {
        let outcomes = run_event_cases(&mut conn, counts).await;
        assert_eq!(outcomes.len() as i64, cases);
        let wrong: Vec<&CaseOutcome> = outcomes
            .iter()
            .filter(|o| o.counted != i32::from(o.kind.is_some()) || o.written != o.kind)
            .collect();
        assert!(
            wrong.is_empty(),
            "counted or written against the mapping (the statement counts: {counts}): {wrong:?}"
        );
        let events = outcomes.iter().filter(|o| o.kind.is_some()).count();
        assert!(
            events > 100 && events + 100 < outcomes.len(),
            "both events and changes of none among the cases: {events} of {}",
            outcomes.len()
        );
        // The repeated wait for a missing account is no event (it passes the condition: the
        // function's mapping decides).
        let unavailable = Some("account_unavailable");
        assert!(outcomes.iter().any(|o| {
            o.old_state == "queued"
                && o.new_state == "retry_wait"
                && !o.moved
                && o.old_reason.as_deref() == unavailable
                && o.new_reason.as_deref() == unavailable
                && o.counted == 0
        }));
    }

    // A function call in the stored condition is a FUNCEXPR node (operators are OPEXPR).
    let (definition, calls): (String, bool) = sqlx::query_as(
        "SELECT pg_get_triggerdef(t.oid), t.tgqual::text LIKE '%{FUNCEXPR%'
         FROM pg_trigger t
         WHERE t.tgrelid = 'deliveries'::regclass AND t.tgname = 'deliveries_event_count'
           AND t.tgqual IS NOT NULL",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert!(!calls, "the condition calls a function: {definition}");
}

/// An adopted failover moves the positions on (migration 20261224000001): the promoted
/// replica may have missed commits that numbered events a client has read, so every event
/// numbered after it comes after any position given before.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn positions_move_on_after_an_adopted_failover(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    ledger.observe_identity().await.unwrap();
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "appt-1", &[Channel::Sms], t0()).await;
    ledger.sequence_events(100).await.unwrap();
    let before = all_events(&ledger, tenant.id).await;
    assert_eq!(before.len(), 1);

    // A replica took over: a new timeline, the primary's last heartbeat 5 s old.
    sqlx::query(
        "UPDATE ledger_identity SET timeline_id = timeline_id + 1,
                heartbeat_at = now() - interval '5 seconds'",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        ledger.ensure_not_restored().await.unwrap().verdict,
        nudge_ledger::IdentityVerdict::Failover
    );
    owed(&ledger, tenant.id, "appt-2", &[Channel::Sms], t0()).await;
    ledger.sequence_events(100).await.unwrap();
    let after = ledger
        .tenant_events(tenant.id, before[0].position, 100)
        .await
        .unwrap();
    assert_eq!(after.events.len(), 1);
    assert_eq!(after.events[0].position, before[0].position + (1 << 40) + 1);

    // Seen the same afterwards: no further move.
    assert_eq!(
        ledger.observe_identity().await.unwrap().verdict,
        nudge_ledger::IdentityVerdict::Same
    );
    owed(&ledger, tenant.id, "appt-3", &[Channel::Sms], t0()).await;
    ledger.sequence_events(100).await.unwrap();
    let last = all_events(&ledger, tenant.id).await;
    assert_eq!(last[2].position, last[1].position + 1);
}

/// The plan PostgreSQL picks for `sql` with sequential scans off (the test's table is tiny).
async fn plan_of(conn: &mut sqlx::PgConnection, sql: &str) -> String {
    let lines: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {sql}")))
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    lines.join("\n")
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn positions_are_unique_and_indexed_for_numbered_events_only(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    for event in ["appt-1", "appt-2", "appt-3"] {
        owed(&ledger, tenant.id, event, &[Channel::Sms], t0() + secs(600)).await;
    }
    assert_eq!(ledger.sequence_events(2).await.unwrap().numbered, Some(2));

    // One index on `position`: unique, over the numbered events.
    let indexes: Vec<(String, bool, Option<String>)> = sqlx::query_as(
        "SELECT c.relname::text, i.indisunique, pg_get_expr(i.indpred, i.indrelid)
         FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
         WHERE i.indrelid = 'delivery_events'::regclass AND i.indnatts = 1
           AND a.attname = 'position'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        indexes,
        [(
            "delivery_events_position_idx".to_owned(),
            true,
            Some("(\"position\" IS NOT NULL)".to_owned())
        )]
    );

    // A second event given a position already given is refused.
    let taken = sqlx::query(
        "UPDATE delivery_events SET position = (SELECT min(position) FROM delivery_events)
         WHERE position IS NULL",
    )
    .execute(&pool)
    .await
    .expect_err("a position given twice");
    assert_eq!(
        taken.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("23505"),
        "{taken}"
    );

    // The readers of all tenants' positions (retention's bound and its deletion order) are
    // served by it.
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET enable_seqscan = off")
        .execute(&mut *conn)
        .await
        .unwrap();
    for sql in [
        "SELECT max(position) FROM delivery_events WHERE occurred_at <= now()",
        "SELECT x.id FROM retention_runs rr
         JOIN delivery_events x ON x.position <= rr.events_through
         WHERE rr.id = 1 ORDER BY x.position LIMIT 10",
    ] {
        let plan = plan_of(&mut conn, sql).await;
        assert!(
            plan.contains("delivery_events_position_idx"),
            "{sql}:\n{plan}"
        );
    }

    // The unnumbered event is numbered next, after the others.
    let numbered_before: i64 = sqlx::query_scalar("SELECT max(position) FROM delivery_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(ledger.sequence_events(10).await.unwrap().numbered, Some(1));
    let events = all_events(&ledger, tenant.id).await;
    assert_eq!(events.len(), 3);
    let last = &events[2];
    assert_eq!(last.event_id, "appt-3");
    assert!(last.position > numbered_before, "{events:?}");
}
