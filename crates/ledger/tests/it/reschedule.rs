//! Reschedule and the truthful cancel: what moves, what is too late, how revisions order, and
//! the race with the fence decided on the delivery's row.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{
    AdmissionSettings, CancelChange, Channel, ChannelChange, DeliveryState, EventId,
    IdempotencySupport, ReminderId, Revision, SubscriberRef, TenantId,
};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    Destination, DueDelivery, FenceRefused, ImportReminder, LeaseOutcome, LeasedDelivery, Ledger,
    NewReminder, ReplacedBy, Replacement, RescheduleOutcome, Rescheduled, SendSlot,
};
use sqlx::PgPool;

const SUBSCRIBER: &str = "patient-0001";

/// The reminder `event` of `tenant` as a client would send it: `channels` with a destination
/// each, at `scheduled_at` for an hour, its body told apart by `digest`.
fn body(
    tenant: TenantId,
    event: &str,
    channels: &[Channel],
    scheduled_at: DateTime<Utc>,
    digest: &[u8],
) -> ImportReminder {
    let reminder = NewReminder::new(
        tenant,
        EventId::parse(event).unwrap(),
        SubscriberRef::parse(SUBSCRIBER).unwrap(),
        channels,
        scheduled_at,
        scheduled_at + secs(3600),
    )
    .unwrap()
    .with_content(br#"{"template":"moved"}"#.to_vec())
    .unwrap()
    .with_request_digest(digest.to_vec());
    ImportReminder {
        reminder,
        contacts: channels
            .iter()
            .map(|c| (*c, Destination::new(format!("dest-{c}"))))
            .collect(),
    }
}

/// Posts `event` at `scheduled_at` (revision 0, digest `post`) and materialises it at t0.
async fn posted(
    ledger: &Ledger,
    tenant: TenantId,
    event: &str,
    channels: &[Channel],
    scheduled_at: DateTime<Utc>,
) -> ReminderId {
    let item = body(tenant, event, channels, scheduled_at, b"post");
    let created = ledger
        .import_reminder(&item.reminder, &item.contacts, &cipher(), t0())
        .await
        .unwrap();
    ledger
        .materialise_reminder(tenant, created.id, t0())
        .await
        .unwrap();
    created.id
}

async fn reschedule(
    ledger: &Ledger,
    item: ImportReminder,
    revision: i64,
    now: DateTime<Utc>,
) -> RescheduleOutcome {
    ledger
        .reschedule_reminder(
            &Replacement {
                item,
                revision: Revision::new(revision).unwrap(),
            },
            &cipher(),
            &ReplacedBy::Client,
            at(now),
        )
        .await
        .unwrap()
}

fn applied(outcome: RescheduleOutcome) -> Rescheduled {
    match outcome {
        RescheduleOutcome::Applied(done) => done,
        other => panic!("expected an applied reschedule, got {other:?}"),
    }
}

async fn deliveries_of(pool: &PgPool, reminder: ReminderId) -> Vec<(String, String, i64, i32)> {
    sqlx::query_as(
        "SELECT channel, state, generation, attempt_count FROM deliveries
         WHERE reminder_id = $1 ORDER BY channel",
    )
    .bind(reminder.as_uuid())
    .fetch_all(pool)
    .await
    .unwrap()
}

fn waiting(max_wait_ms: u64) -> AdmissionSettings {
    AdmissionSettings {
        max_wait: Duration::from_millis(max_wait_ms),
        ..AdmissionSettings::default()
    }
}

/// Leases `messages` in one SMS batch at t0 as `worker-1`.
async fn lease_all(
    ledger: &Ledger,
    messages: &[DueDelivery],
    settings: &AdmissionSettings,
) -> Vec<LeaseOutcome> {
    let routes = routes(IdempotencySupport::Honoured);
    let cipher = cipher();
    let batch = batch_of(
        Channel::Sms,
        "worker-1",
        &routes,
        settings,
        &cipher,
        at(t0()),
    );
    let pointers: Vec<_> = messages.iter().map(DueDelivery::message_pointer).collect();
    ledger
        .lease_batch(&batch, &pointers)
        .await
        .unwrap()
        .outcomes
}

/// Two SMS reminders due at t0 behind a bucket of burst 1: the second lease waits for its slot.
/// Returns that lease, when its slot was reserved, and its event id.
async fn waiting_lease(
    ledger: &Ledger,
    tenant: TenantId,
) -> (LeasedDelivery, DateTime<Utc>, String) {
    ledger
        .ensure_bucket(&account("main"), Channel::Sms, 20.0, 1, t0())
        .await
        .unwrap();
    posted(ledger, tenant, "first", &[Channel::Sms], t0()).await;
    posted(ledger, tenant, "second", &[Channel::Sms], t0()).await;
    let due = ledger.claim_due(Channel::Sms, 10, at(t0())).await.unwrap();
    let outcomes = lease_all(ledger, &due, &waiting(500)).await;
    let (lease, reserved_at) = outcomes
        .into_iter()
        .find_map(|o| match o {
            LeaseOutcome::Leased {
                lease,
                slot: SendSlot::At { reserved_at, .. },
                ..
            } => Some((lease, reserved_at)),
            _ => None,
        })
        .expect("a lease waiting for its slot");
    let event: String = sqlx::query_scalar("SELECT event_id FROM reminders WHERE id = $1")
        .bind(lease.reminder_id.as_uuid())
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    (lease, reserved_at, event)
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reschedule_moves_a_queued_delivery_and_its_message_goes_stale(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    let id = posted(&ledger, tenant, "appt-1", &[Channel::Sms], t0()).await;
    let claimed = claim_all(&ledger, t0()).await;
    assert_eq!(claimed.len(), 1);
    let before = ledger.delivery(claimed[0].id).await.unwrap().unwrap();
    let later = t0() + secs(3600);

    let done = applied(
        reschedule(
            &ledger,
            body(tenant, "appt-1", &[Channel::Sms], later, b"r1"),
            1,
            t0(),
        )
        .await,
    );

    assert_eq!(done.channels, vec![(Channel::Sms, ChannelChange::Moved)]);
    assert_eq!((done.scheduled_at, done.revision.get()), (later, 1));
    let after = ledger.delivery(claimed[0].id).await.unwrap().unwrap();
    assert_eq!(after.state, DeliveryState::Scheduled);
    assert_eq!(
        after.generation,
        before.generation + 1,
        "its message is stale"
    );
    assert_eq!(after.idempotency_key, before.idempotency_key);
    assert_eq!(after.reminder_id, id);
    assert_eq!(
        (after.scheduled_at, after.next_attempt_at),
        (later, Some(later))
    );
    assert_eq!(after.expires_at, later + secs(3600));
    let outcome = lease(&ledger, &claimed[0], t0()).await;
    assert!(
        matches!(outcome, LeaseOutcome::Stale { .. }),
        "the old message leases nothing: {outcome:?}"
    );
    assert!(
        claim_all(&ledger, t0() + secs(60)).await.is_empty(),
        "not due before its new time"
    );
    assert_eq!(
        claim_all(&ledger, later).await.len(),
        1,
        "due at its new time"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_lease_waiting_for_its_slot_loses_to_a_reschedule_and_its_fence_refuses(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    let (lease, reserved_at, event) = waiting_lease(&ledger, tenant).await;
    let later = t0() + secs(3600);

    let done = applied(
        reschedule(
            &ledger,
            body(tenant, &event, &[Channel::Sms], later, b"r1"),
            1,
            t0(),
        )
        .await,
    );
    assert_eq!(done.channels, vec![(Channel::Sms, ChannelChange::Moved)]);

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
    assert_eq!(
        fenced,
        Err(FenceRefused::LeaseLost),
        "no send after a reschedule won"
    );
    let record = ledger.delivery(lease.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Scheduled);
    assert_eq!(
        record.attempt_count, 0,
        "the attempt it never made is not counted"
    );
    assert_eq!(record.lease_holder, None);
    assert_eq!(record.next_attempt_at, Some(later));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_cancel_takes_a_lease_waiting_for_its_slot_and_its_fence_refuses(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    let (lease, reserved_at, event) = waiting_lease(&ledger, tenant).await;

    let cancellation = ledger
        .cancel_reminder_by_channel(tenant, &EventId::parse(&event).unwrap(), at(t0()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        cancellation.channels,
        vec![(Channel::Sms, CancelChange::Cancelled)]
    );
    assert_eq!(cancellation.cancelled, vec![Channel::Sms]);

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
    assert_eq!(fenced, Err(FenceRefused::LeaseLost));
    let record = ledger.delivery(lease.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Cancelled);
    assert_eq!(record.attempt_count, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_fenced_send_is_too_late_for_a_reschedule_and_for_a_cancel(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    posted(&ledger, tenant, "appt-1", &[Channel::Sms], t0()).await;
    let claimed = claim_all(&ledger, t0()).await;
    // No bucket: leased and fenced in one statement.
    let fenced = leased(lease(&ledger, &claimed[0], t0()).await);
    let later = t0() + secs(3600);

    let done = applied(
        reschedule(
            &ledger,
            body(tenant, "appt-1", &[Channel::Sms], later, b"r1"),
            1,
            t0(),
        )
        .await,
    );
    assert_eq!(
        done.channels,
        vec![(Channel::Sms, ChannelChange::TooLate(DeliveryState::Sending))]
    );
    let record = ledger.delivery(fenced.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Sending, "not touched");
    assert_eq!(record.generation, fenced.generation);
    assert_eq!(
        record.scheduled_at,
        t0(),
        "its time is the one it is being sent at"
    );

    let cancellation = ledger
        .cancel_reminder_by_channel(tenant, &EventId::parse("appt-1").unwrap(), at(t0()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        cancellation.channels,
        vec![(Channel::Sms, CancelChange::TooLate(DeliveryState::Sending))]
    );
    assert!(cancellation.cancelled.is_empty());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_cancel_answers_settled_channels_as_they_are(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    posted(
        &ledger,
        tenant,
        "appt-1",
        &[Channel::Sms, Channel::Email],
        t0(),
    )
    .await;
    sqlx::query(
        "UPDATE deliveries SET state = 'expired', settled_at = now(), next_attempt_at = NULL
         WHERE channel = 'email'",
    )
    .execute(&pool)
    .await
    .unwrap();

    let cancellation = ledger
        .cancel_reminder_by_channel(tenant, &EventId::parse("appt-1").unwrap(), at(t0()))
        .await
        .unwrap()
        .unwrap();

    assert_eq!(
        cancellation.channels,
        vec![
            (
                Channel::Email,
                CancelChange::AlreadySettled(DeliveryState::Expired)
            ),
            (Channel::Sms, CancelChange::Cancelled),
        ]
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn revisions_older_equal_and_same_equal_and_different_and_newer(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    posted(&ledger, tenant, "appt-1", &[Channel::Sms], t0() + secs(600)).await;
    let at_ = |m: i64| t0() + secs(60 * m);
    let put =
        |m: i64, digest: &'static [u8]| body(tenant, "appt-1", &[Channel::Sms], at_(m), digest);

    // Revision 0 is the post: its own body again is a repeat, another body a conflict.
    assert!(matches!(
        reschedule(&ledger, put(10, b"post"), 0, t0()).await,
        RescheduleOutcome::Repeat(_)
    ));
    assert_eq!(
        reschedule(&ledger, put(20, b"other"), 0, t0()).await,
        RescheduleOutcome::RevisionConflict {
            current: Revision::FIRST
        }
    );
    let done = applied(reschedule(&ledger, put(30, b"r1"), 1, t0()).await);
    assert_eq!(done.scheduled_at, at_(30));
    let repeat = reschedule(&ledger, put(30, b"r1"), 1, t0()).await;
    let RescheduleOutcome::Repeat(repeat) = repeat else {
        panic!("the same revision and body again is a repeat: {repeat:?}");
    };
    assert_eq!(
        repeat.channels,
        vec![(Channel::Sms, ChannelChange::Unchanged)]
    );
    let one = Revision::new(1).unwrap();
    assert_eq!(
        reschedule(&ledger, put(40, b"r1-other"), 1, t0()).await,
        RescheduleOutcome::RevisionConflict { current: one }
    );
    assert_eq!(
        reschedule(&ledger, put(40, b"post"), 0, t0()).await,
        RescheduleOutcome::RevisionConflict { current: one }
    );
    let (scheduled, revision): (DateTime<Utc>, i64) =
        sqlx::query_as("SELECT scheduled_at, revision FROM reminders")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (scheduled, revision),
        (at_(30), 1),
        "the refused ones changed nothing"
    );
    let done = applied(reschedule(&ledger, put(50, b"r7"), 7, t0()).await);
    assert_eq!((done.scheduled_at, done.revision.get()), (at_(50), 7));
    let history: Vec<(i64, DateTime<Utc>, DateTime<Utc>, String)> = sqlx::query_as(
        "SELECT revision, from_scheduled_at, to_scheduled_at, source FROM reminder_revisions
         ORDER BY revision",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        history,
        vec![
            (1, at_(10), at_(30), "intake".to_owned()),
            (7, at_(30), at_(50), "intake".to_owned()),
        ]
    );
}

/// Sessions of this database waiting for a lock.
async fn lock_waiters(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn of_two_concurrent_reschedules_the_higher_revision_wins_whichever_commits_first(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    for (round, order) in [[5_i64, 3], [3, 5]].into_iter().enumerate() {
        let event = format!("appt-{round}");
        posted(&ledger, tenant, &event, &[Channel::Sms], t0() + secs(600)).await;
        // Both wait behind a held row lock, queued in `order`, then race for it.
        let mut holder = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM reminders WHERE event_id = $1 FOR UPDATE")
            .bind(&event)
            .execute(&mut *holder)
            .await
            .unwrap();
        let mut tasks = Vec::new();
        for (i, revision) in order.into_iter().enumerate() {
            let ledger = ledger.clone();
            let item = body(
                tenant,
                &event,
                &[Channel::Sms],
                t0() + secs(60 * revision),
                format!("r{revision}").as_bytes(),
            );
            tasks.push(tokio::spawn(async move {
                reschedule(&ledger, item, revision, t0()).await
            }));
            let waiting = poll_until(Duration::from_secs(10), || async {
                lock_waiters(&pool).await > i64::try_from(i).unwrap()
            })
            .await;
            assert!(waiting, "reschedule {revision} waits for the row");
        }
        holder.commit().await.unwrap();
        let mut outcomes = Vec::new();
        for task in tasks {
            outcomes.push(task.await.unwrap());
        }
        let five = Revision::new(5).unwrap();
        match order {
            [5, 3] => {
                assert!(matches!(outcomes[0], RescheduleOutcome::Applied(_)));
                assert_eq!(
                    outcomes[1],
                    RescheduleOutcome::RevisionConflict { current: five }
                );
            }
            _ => {
                assert!(matches!(outcomes[0], RescheduleOutcome::Applied(_)));
                assert!(matches!(outcomes[1], RescheduleOutcome::Applied(_)));
            }
        }
        let (scheduled, revision): (DateTime<Utc>, i64) =
            sqlx::query_as("SELECT scheduled_at, revision FROM reminders WHERE event_id = $1")
                .bind(&event)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(
            (scheduled, revision),
            (t0() + secs(300), 5),
            "order {order:?}"
        );
    }
}

/// Polls `check` every 20 ms until it holds or `within` passes.
async fn poll_until<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reschedule_into_the_past_or_past_its_expiry_changes_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    let id = posted(&ledger, tenant, "appt-1", &[Channel::Sms], t0() + secs(600)).await;
    let now = t0() + secs(120);
    assert_eq!(
        reschedule(
            &ledger,
            body(tenant, "appt-1", &[Channel::Sms], t0() + secs(60), b"r1"),
            1,
            now
        )
        .await,
        RescheduleOutcome::ScheduledInThePast
    );
    // Kept at its time, but expiring before now.
    let mut item = body(tenant, "appt-1", &[Channel::Sms], t0() + secs(600), b"r1");
    item.reminder = NewReminder::new(
        tenant,
        EventId::parse("appt-1").unwrap(),
        SubscriberRef::parse(SUBSCRIBER).unwrap(),
        &[Channel::Sms],
        t0() + secs(600),
        t0() + secs(700),
    )
    .unwrap()
    .with_request_digest(b"r1".to_vec());
    assert_eq!(
        reschedule(&ledger, item, 1, t0() + secs(700)).await,
        RescheduleOutcome::ExpiresInThePast
    );
    let (scheduled, revision): (DateTime<Utc>, i64) =
        sqlx::query_as("SELECT scheduled_at, revision FROM reminders WHERE id = $1")
            .bind(id.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((scheduled, revision), (t0() + secs(600), 0));
    assert_eq!(
        deliveries_of(&pool, id).await,
        vec![("sms".to_owned(), "scheduled".to_owned(), 0, 0)]
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_erased_subscribers_reminder_and_an_unknown_event_are_not_found(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    posted(&ledger, tenant, "appt-1", &[Channel::Sms], t0() + secs(600)).await;
    ledger
        .erase_subscriber(
            tenant,
            &SubscriberRef::parse(SUBSCRIBER).unwrap(),
            &cipher(),
            &ops(t0()),
            at(t0()),
        )
        .await
        .unwrap();
    let later = t0() + secs(3600);
    assert_eq!(
        reschedule(
            &ledger,
            body(tenant, "appt-1", &[Channel::Sms], later, b"r1"),
            1,
            t0()
        )
        .await,
        RescheduleOutcome::NotFound
    );
    assert_eq!(
        reschedule(
            &ledger,
            body(tenant, "appt-2", &[Channel::Sms], later, b"r1"),
            1,
            t0()
        )
        .await,
        RescheduleOutcome::NotFound
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_removed_channel_is_cancelled_an_added_one_created_and_another_subscriber_refused(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    let id = posted(
        &ledger,
        tenant,
        "appt-1",
        &[Channel::Sms, Channel::Email],
        t0(),
    )
    .await;
    let soon = t0() + secs(10);

    let done = applied(
        reschedule(
            &ledger,
            body(
                tenant,
                "appt-1",
                &[Channel::Sms, Channel::Push],
                soon,
                b"r1",
            ),
            1,
            soon,
        )
        .await,
    );

    assert_eq!(
        done.channels,
        vec![
            (Channel::Push, ChannelChange::Added),
            (Channel::Email, ChannelChange::Removed),
            (Channel::Sms, ChannelChange::Moved),
        ]
    );
    assert_eq!(
        done.deliveries_created, 1,
        "its time has come: push is created now"
    );
    assert_eq!(
        deliveries_of(&pool, id).await,
        vec![
            ("email".to_owned(), "cancelled".to_owned(), 0, 0),
            ("push".to_owned(), "scheduled".to_owned(), 0, 0),
            ("sms".to_owned(), "scheduled".to_owned(), 0, 0),
        ]
    );

    let mut other = body(tenant, "appt-1", &[Channel::Sms], soon + secs(60), b"r2");
    other.reminder = NewReminder::new(
        tenant,
        EventId::parse("appt-1").unwrap(),
        SubscriberRef::parse("patient-0002").unwrap(),
        &[Channel::Sms],
        soon + secs(60),
        soon + secs(3600),
    )
    .unwrap()
    .with_request_digest(b"r2".to_vec());
    assert_eq!(
        reschedule(&ledger, other, 2, soon).await,
        RescheduleOutcome::SubscriberDiffers
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_pending_reminder_moved_to_now_gets_its_deliveries(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    let item = body(
        tenant,
        "appt-1",
        &[Channel::Sms],
        t0() + secs(86_400),
        b"post",
    );
    let created = ledger
        .import_reminder(&item.reminder, &item.contacts, &cipher(), t0())
        .await
        .unwrap();
    assert_eq!(created.deliveries_created, 0, "not due, no window ran");
    let soon = t0() + secs(30);

    let done = applied(
        reschedule(
            &ledger,
            body(tenant, "appt-1", &[Channel::Sms], soon, b"r1"),
            1,
            soon,
        )
        .await,
    );

    assert_eq!(done.channels, vec![(Channel::Sms, ChannelChange::Moved)]);
    assert_eq!(done.deliveries_created, 1);
    assert_eq!(claim_all(&ledger, soon).await.len(), 1);
}

/// Runs `first` and then `second` against a delivery row a test transaction holds locked, each
/// queued for the row in that order, then lets them go: PostgreSQL grants the row to the first
/// waiter first.
async fn race_for_the_row<A, B, FA, FB>(
    pool: &PgPool,
    delivery: uuid::Uuid,
    first: FA,
    second: FB,
) -> (A, B)
where
    FA: std::future::Future<Output = A> + Send + 'static,
    FB: std::future::Future<Output = B> + Send + 'static,
    A: Send + 'static,
    B: Send + 'static,
{
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM deliveries WHERE id = $1 FOR UPDATE")
        .bind(delivery)
        .execute(&mut *holder)
        .await
        .unwrap();
    let first = tokio::spawn(first);
    assert!(
        poll_until(Duration::from_secs(10), || async {
            lock_waiters(pool).await >= 1
        })
        .await
    );
    let second = tokio::spawn(second);
    assert!(
        poll_until(Duration::from_secs(10), || async {
            lock_waiters(pool).await >= 2
        })
        .await
    );
    holder.commit().await.unwrap();
    (first.await.unwrap(), second.await.unwrap())
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn of_a_cancel_and_a_waiting_leases_fence_whichever_takes_the_row_first_the_other_yields(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    let (lease, reserved_at, event) = waiting_lease(&ledger, tenant).await;
    let fence = {
        let (ledger, lease) = (ledger.clone(), lease.clone());
        async move {
            ledger
                .fence(
                    &lease,
                    reserved_at,
                    LEASE,
                    Duration::from_secs(10),
                    at(t0() + secs(1)),
                )
                .await
                .unwrap()
        }
    };
    let cancel = {
        let ledger = ledger.clone();
        let event = EventId::parse(&event).unwrap();
        async move {
            ledger
                .cancel_reminder_by_channel(tenant, &event, at(t0() + secs(1)))
                .await
                .unwrap()
                .unwrap()
        }
    };

    // The fence first: it stamps the send; the cancel finds it too late.
    let (fenced, cancellation) = race_for_the_row(&pool, lease.id.as_uuid(), fence, cancel).await;
    assert!(fenced.is_ok(), "the fence took the row first: {fenced:?}");
    assert_eq!(
        cancellation.channels,
        vec![(Channel::Sms, CancelChange::TooLate(DeliveryState::Sending))]
    );
    let record = ledger.delivery(lease.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Sending, "its send goes on");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn of_a_cancel_and_a_waiting_leases_fence_the_cancel_first_leaves_nothing_to_send(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    let (lease, reserved_at, event) = waiting_lease(&ledger, tenant).await;
    let fence = {
        let (ledger, lease) = (ledger.clone(), lease.clone());
        async move {
            ledger
                .fence(
                    &lease,
                    reserved_at,
                    LEASE,
                    Duration::from_secs(10),
                    at(t0() + secs(1)),
                )
                .await
                .unwrap()
        }
    };
    let cancel = {
        let ledger = ledger.clone();
        let event = EventId::parse(&event).unwrap();
        async move {
            ledger
                .cancel_reminder_by_channel(tenant, &event, at(t0() + secs(1)))
                .await
                .unwrap()
                .unwrap()
        }
    };

    let (cancellation, fenced) = race_for_the_row(&pool, lease.id.as_uuid(), cancel, fence).await;
    assert_eq!(
        cancellation.channels,
        vec![(Channel::Sms, CancelChange::Cancelled)]
    );
    assert_eq!(
        fenced,
        Err(FenceRefused::LeaseLost),
        "no send after the cancel won"
    );
    let record = ledger.delivery(lease.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Cancelled);
    assert_eq!(record.attempt_count, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn cancelling_again_answers_as_the_first_cancel(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    posted(
        &ledger,
        tenant,
        "appt-1",
        &[Channel::Sms, Channel::Email],
        t0(),
    )
    .await;
    sqlx::query(
        "UPDATE deliveries SET state = 'expired', settled_at = now(), next_attempt_at = NULL
         WHERE channel = 'email'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let event = EventId::parse("appt-1").unwrap();
    let first = ledger
        .cancel_reminder_by_channel(tenant, &event, at(t0()))
        .await
        .unwrap()
        .unwrap();
    let again = ledger
        .cancel_reminder_by_channel(tenant, &event, at(t0() + secs(5)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.channels, again.channels);
    assert_eq!(first.cancelled, again.cancelled);
    assert_eq!(again.status.cancelled_at, Some(t0()), "stamped once");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_erasure_takes_a_lease_waiting_for_its_slot_and_its_fence_refuses(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await.id;
    let (lease, reserved_at, _) = waiting_lease(&ledger, tenant).await;

    let erasure = ledger
        .erase_subscriber(
            tenant,
            &SubscriberRef::parse(SUBSCRIBER).unwrap(),
            &cipher(),
            &ops(t0()),
            at(t0()),
        )
        .await
        .unwrap();
    assert_eq!(
        erasure.deliveries_cancelled, 1,
        "the waiting one; the other's send started"
    );

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
    assert_eq!(fenced, Err(FenceRefused::LeaseLost));
    let record = ledger.delivery(lease.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Cancelled);
    assert_eq!(
        record.last_error_reason.as_deref(),
        Some("subscriber_erased")
    );
}
