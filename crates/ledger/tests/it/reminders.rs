#![allow(clippy::unwrap_used, clippy::expect_used)]

use nudge_domain::{Channel, DeliveryState, EventId, IdempotencyKey, SubscriberRef, TenantId};
use nudge_ledger::test_support::*;
use nudge_ledger::{Ledger, LedgerError, LedgerTime, NewReminder, WindowOutcome};
use sqlx::PgPool;

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_same_event_posted_twice_is_one_reminder(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let r = reminder(tenant.id, "evt-1", &[Channel::Sms, Channel::Email], t0());

    let first = ledger.create_reminder(&r, &cipher(), t0()).await.unwrap();
    let second = ledger
        .create_reminder(&r, &cipher(), t0() + secs(5))
        .await
        .unwrap();

    assert!(first.created);
    assert!(!second.created);
    assert_eq!(first.id, second.id);
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM reminders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn reusing_an_event_id_for_a_different_reminder_is_a_conflict(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    ledger
        .create_reminder(
            &reminder(tenant.id, "evt-1", &[Channel::Sms], t0()),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();

    let other_time = reminder(tenant.id, "evt-1", &[Channel::Sms], t0() + secs(60));
    let err = ledger
        .create_reminder(&other_time, &cipher(), t0())
        .await
        .unwrap_err();

    assert!(matches!(err, LedgerError::EventConflict { .. }), "{err:?}");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reminder_for_an_unknown_tenant_is_refused_by_name(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let stranger = TenantId::new();
    let err = ledger
        .create_reminder(
            &reminder(stranger, "evt-1", &[Channel::Sms], t0()),
            &cipher(),
            t0(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, LedgerError::UnknownTenant(id) if id == stranger.as_uuid()),
        "{err:?}"
    );
}

#[test]
fn a_reminder_without_channels_or_expiring_before_its_time_is_not_constructible() {
    let make = |channels: &[Channel], expires: i64| {
        NewReminder::new(
            TenantId::new(),
            EventId::parse("e").unwrap(),
            SubscriberRef::parse("s").unwrap(),
            channels,
            t0(),
            t0() + secs(expires),
        )
    };
    assert!(make(&[], 60).is_err());
    assert!(make(&[Channel::Sms, Channel::Sms], 60).is_err());
    assert!(make(&[Channel::Sms], 0).is_err());
    assert!(make(&[Channel::Sms], -5).is_err());
    assert!(make(&[Channel::Sms], 60).is_ok());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_window_materialises_one_scheduled_delivery_per_channel_due_at_its_schedule(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let at = t0() + secs(30);
    let created = ledger
        .create_reminder(
            &reminder(tenant.id, "evt-1", &Channel::ALL, at),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();

    let outcome = ledger
        .materialise_window(tenant.id, t0(), t0() + secs(60), t0())
        .await
        .unwrap();

    assert_eq!(
        outcome,
        WindowOutcome::Materialised {
            deliveries_created: 3,
            occurrences_created: 0,
            series_unexpandable: 0
        }
    );
    let deliveries = ledger.deliveries_of_reminder(created.id).await.unwrap();
    assert_eq!(deliveries.len(), 3);
    for d in &deliveries {
        assert_eq!(d.state, DeliveryState::Scheduled);
        assert_eq!(d.next_attempt_at, Some(at));
        assert_eq!(
            d.idempotency_key,
            IdempotencyKey::for_delivery(created.id, d.channel)
        );
        assert_eq!(d.attempt_count, 0);
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_window_larger_than_one_batch_materialises_every_reminder_once(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    // Two whole batches and one more reminder, imported in one go.
    let count = 2 * nudge_ledger::WINDOW_BATCH + 1;
    let items: Vec<nudge_ledger::ImportReminder> = (0..count)
        .map(|i| nudge_ledger::ImportReminder {
            reminder: reminder(
                tenant.id,
                &format!("evt-{i}"),
                &[Channel::Sms],
                t0() + secs(1 + (i % 50) as i64),
            ),
            contacts: Vec::new(),
        })
        .collect();
    ledger
        .import_reminders(&items, &cipher(), t0())
        .await
        .unwrap();

    let outcome = ledger
        .materialise_window(tenant.id, t0(), t0() + secs(60), t0())
        .await
        .unwrap();

    assert_eq!(
        outcome,
        WindowOutcome::Materialised {
            deliveries_created: count as u64,
            occurrences_created: 0,
            series_unexpandable: 0
        }
    );
    let (deliveries, reminders): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT reminder_id) FROM deliveries")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((deliveries, reminders), (count as i64, count as i64));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_replayed_window_creates_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    ledger
        .create_reminder(
            &reminder(tenant.id, "evt-1", &[Channel::Sms], t0()),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    let (start, end) = (t0(), t0() + secs(60));

    ledger
        .materialise_window(tenant.id, start, end, t0())
        .await
        .unwrap();
    let replay = ledger
        .materialise_window(tenant.id, start, end, t0() + secs(600))
        .await
        .unwrap();

    assert_eq!(replay, WindowOutcome::AlreadyRun);
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn two_producers_running_the_same_window_at_once_create_each_delivery_once(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    for i in 0..50 {
        ledger
            .create_reminder(
                &reminder(
                    tenant.id,
                    &format!("evt-{i}"),
                    &Channel::ALL,
                    t0() + secs(i),
                ),
                &cipher(),
                an_hour_before(),
            )
            .await
            .unwrap();
    }
    let run = |l: Ledger| async move {
        l.materialise_window(tenant.id, t0(), t0() + secs(60), t0())
            .await
            .unwrap()
    };

    let (a, b) = tokio::join!(
        tokio::spawn(run(ledger.clone())),
        tokio::spawn(run(ledger.clone()))
    );
    let outcomes = [a.unwrap(), b.unwrap()];

    let materialised = outcomes
        .iter()
        .filter(|o| {
            matches!(
                o,
                WindowOutcome::Materialised {
                    deliveries_created: 150,
                    occurrences_created: 0,
                    series_unexpandable: 0
                }
            )
        })
        .count();
    assert_eq!(materialised, 1, "{outcomes:?}");
    assert!(outcomes.contains(&WindowOutcome::AlreadyRun));
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 150);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_window_takes_only_reminders_in_its_half_open_range_and_skips_cancelled_ones(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let (start, end) = (t0(), t0() + secs(60));
    for (event, at) in [
        ("before", -1),
        ("at-start", 0),
        ("inside", 59),
        ("at-end", 60),
        ("cancelled", 10),
    ] {
        ledger
            .create_reminder(
                &reminder(tenant.id, event, &[Channel::Sms], t0() + secs(at)),
                &cipher(),
                an_hour_before(),
            )
            .await
            .unwrap();
    }
    ledger
        .cancel_reminder(
            tenant.id,
            &EventId::parse("cancelled").unwrap(),
            LedgerTime::Fixed(t0()),
        )
        .await
        .unwrap();

    let outcome = ledger
        .materialise_window(tenant.id, start, end, t0())
        .await
        .unwrap();

    assert_eq!(
        outcome,
        WindowOutcome::Materialised {
            deliveries_created: 2,
            occurrences_created: 0,
            series_unexpandable: 0
        }
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn materialising_a_reminder_again_keeps_the_existing_deliveries(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let id = owed(
        &ledger,
        tenant.id,
        "evt-1",
        &[Channel::Push, Channel::Sms],
        t0(),
    )
    .await;
    let before = ledger.deliveries_of_reminder(id).await.unwrap();

    let again = ledger
        .materialise_reminder(tenant.id, id, t0() + secs(9))
        .await
        .unwrap();

    assert_eq!(again, 0);
    assert_eq!(ledger.deliveries_of_reminder(id).await.unwrap(), before);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn cancelling_a_reminder_settles_its_owed_deliveries_as_cancelled(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let id = owed(
        &ledger,
        tenant.id,
        "evt-1",
        &[Channel::Push, Channel::Sms],
        t0(),
    )
    .await;

    let cancelled = ledger
        .cancel_reminder(
            tenant.id,
            &EventId::parse("evt-1").unwrap(),
            LedgerTime::Fixed(t0()),
        )
        .await
        .unwrap();
    let unknown = ledger
        .cancel_reminder(
            tenant.id,
            &EventId::parse("nope").unwrap(),
            LedgerTime::Fixed(t0()),
        )
        .await
        .unwrap();

    assert_eq!(cancelled, Some(2));
    assert_eq!(unknown, None);
    for d in ledger.deliveries_of_reminder(id).await.unwrap() {
        assert_eq!(d.state, DeliveryState::Cancelled);
        assert!(d.settled_at.is_some());
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_paused_tenant_flag_is_stored_and_read_back(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    assert!(!tenant.intake_paused);

    assert!(
        ledger
            .set_intake_paused(tenant.id, true, &ops(t0()))
            .await
            .unwrap()
    );
    assert!(
        ledger
            .tenant(tenant.id)
            .await
            .unwrap()
            .unwrap()
            .intake_paused
    );
    assert!(
        !ledger
            .set_intake_paused(TenantId::new(), true, &ops(t0()))
            .await
            .unwrap()
    );
}

fn an_hour_before() -> chrono::DateTime<chrono::Utc> {
    t0() - secs(3600)
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reminder_whose_time_has_come_gets_its_deliveries_at_once(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;

    let late = ledger
        .create_reminder(
            &reminder(
                tenant.id,
                "late",
                &[Channel::Sms, Channel::Push],
                t0() - secs(5),
            ),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    let future = ledger
        .create_reminder(
            &reminder(tenant.id, "future", &[Channel::Sms], t0() + secs(600)),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();

    assert_eq!(late.deliveries_created, 2);
    assert_eq!(future.deliveries_created, 0, "a future window will take it");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reminder_arriving_after_its_window_ran_is_not_left_behind(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    ledger
        .materialise_window(tenant.id, t0(), t0() + secs(600), t0())
        .await
        .unwrap();

    let created = ledger
        .create_reminder(
            &reminder(
                tenant.id,
                "late-arrival",
                &[Channel::Email],
                t0() + secs(300),
            ),
            &cipher(),
            t0() + secs(1),
        )
        .await
        .unwrap();

    assert_eq!(created.deliveries_created, 1);
    let d = &ledger.deliveries_of_reminder(created.id).await.unwrap()[0];
    assert_eq!(
        d.next_attempt_at,
        Some(t0() + secs(300)),
        "still due at its own time"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_paused_tenant_gets_no_run_intent_and_its_window_runs_after_resume(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    ledger
        .create_reminder(
            &reminder(tenant.id, "e", &[Channel::Sms], t0() + secs(10)),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    ledger
        .set_intake_paused(tenant.id, true, &ops(t0()))
        .await
        .unwrap();
    let late = ledger
        .create_reminder(
            &reminder(tenant.id, "late", &[Channel::Sms], t0() - secs(10)),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();

    let paused = ledger
        .materialise_window(tenant.id, t0(), t0() + secs(60), t0())
        .await
        .unwrap();
    ledger
        .set_intake_paused(tenant.id, false, &ops(t0()))
        .await
        .unwrap();
    let resumed = ledger
        .materialise_window(tenant.id, t0(), t0() + secs(60), t0())
        .await
        .unwrap();

    assert_eq!(
        late.deliveries_created, 0,
        "a paused tenant creates no sends"
    );
    assert_eq!(paused, WindowOutcome::Paused);
    assert_eq!(
        resumed,
        WindowOutcome::Materialised {
            deliveries_created: 1,
            occurrences_created: 0,
            series_unexpandable: 0
        }
    );
    assert_eq!(
        ledger.last_window_end(tenant.id).await.unwrap(),
        Some(t0() + secs(60))
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_import_writes_the_reminder_and_its_destinations_together_or_not_at_all(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let phone = nudge_ledger::Destination::new("+15550100");
    let ok = reminder(tenant.id, "ok", &[Channel::Sms], t0());
    ledger
        .import_reminder(&ok, &[(Channel::Sms, phone.clone())], &cipher(), t0())
        .await
        .unwrap();

    // The same event id with other times conflicts: the new destination must not be kept either.
    let conflicting = reminder(tenant.id, "ok", &[Channel::Sms], t0() + secs(1));
    let other = NewReminder::new(
        tenant.id,
        EventId::parse("ok").unwrap(),
        SubscriberRef::parse("patient-0002").unwrap(),
        &[Channel::Sms],
        t0(),
        t0() + secs(60),
    )
    .unwrap();
    assert!(
        ledger
            .import_reminder(
                &conflicting,
                &[(Channel::Email, phone.clone())],
                &cipher(),
                t0()
            )
            .await
            .is_err()
    );
    assert!(
        ledger
            .import_reminder(&other, &[(Channel::Sms, phone)], &cipher(), t0())
            .await
            .is_err()
    );

    let contacts: i64 = sqlx::query_scalar("SELECT count(*) FROM contacts")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(contacts, 1);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn reminders_created_while_their_window_runs_never_end_up_without_deliveries(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    // Bounded: 12 windows, 40 concurrent creations each, the window run in their midst.
    for round in 0..12i64 {
        let start = t0() + secs(round * 60);
        let mut creations = Vec::new();
        for i in 0..40i64 {
            let creator = ledger.clone();
            creations.push(tokio::spawn(async move {
                let r = reminder(
                    tenant.id,
                    &format!("r{round}-{i}"),
                    &[Channel::Sms],
                    start + secs(i % 60),
                );
                creator
                    .create_reminder(&r, &cipher(), an_hour_before())
                    .await
                    .unwrap()
            }));
            if i == 20 {
                let producer = ledger.clone();
                creations.push(tokio::spawn(async move {
                    producer
                        .materialise_window(tenant.id, start, start + secs(60), an_hour_before())
                        .await
                        .unwrap();
                    nudge_ledger::CreatedReminder {
                        id: nudge_domain::ReminderId::new(),
                        created: false,
                        deliveries_created: 0,
                    }
                }));
            }
        }
        for creation in creations {
            creation.await.unwrap();
        }
    }

    let orphans: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM reminders r WHERE NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.reminder_id = r.id)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM reminders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(total, 480);
    assert_eq!(orphans, 0, "reminders left without deliveries");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reminder_created_during_a_pause_for_a_window_that_already_ran_is_materialised_on_resume(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    ledger
        .materialise_window(tenant.id, t0(), t0() + secs(3600), t0())
        .await
        .unwrap();
    ledger
        .set_intake_paused(tenant.id, true, &ops(t0() + secs(1)))
        .await
        .unwrap();
    let during = ledger
        .create_reminder(
            &reminder(
                tenant.id,
                "during-pause",
                &[Channel::Sms],
                t0() + secs(1800),
            ),
            &cipher(),
            t0() + secs(2),
        )
        .await
        .unwrap();
    let later = ledger
        .create_reminder(
            &reminder(tenant.id, "next-window", &[Channel::Sms], t0() + secs(7200)),
            &cipher(),
            t0() + secs(3),
        )
        .await
        .unwrap();
    assert_eq!(
        during.deliveries_created, 0,
        "a paused tenant creates no sends"
    );

    ledger
        .set_intake_paused(tenant.id, false, &ops(t0() + secs(10)))
        .await
        .unwrap();

    assert_eq!(
        ledger
            .deliveries_of_reminder(during.id)
            .await
            .unwrap()
            .len(),
        1
    );
    assert!(
        ledger
            .deliveries_of_reminder(later.id)
            .await
            .unwrap()
            .is_empty(),
        "a reminder of a window not yet run waits for that window"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_watchdog_gives_deliveries_to_reminders_whose_time_came_without_any(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let paused = ledger
        .create_tenant("paused-clinic", &ops(t0()))
        .await
        .unwrap();
    ledger
        .set_intake_paused(paused.id, true, &ops(t0()))
        .await
        .unwrap();
    // Rows written straight into the table, as a materialisation bug would leave them.
    let orphan = |tenant_id: nudge_domain::TenantId,
                  event: &'static str,
                  at: chrono::DateTime<chrono::Utc>,
                  cancelled: bool| {
        let pool = pool.clone();
        async move {
            let id = uuid::Uuid::now_v7();
            sqlx::query(
                "INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels, scheduled_at, expires_at, cancelled_at, created_at)
                 VALUES ($1, $2, $3, 'p', ARRAY['sms', 'push'], $4, $4 + interval '1 hour', $5, $4)",
            )
            .bind(id)
            .bind(tenant_id.as_uuid())
            .bind(event)
            .bind(at)
            .bind(cancelled.then_some(at))
            .execute(&pool)
            .await
            .unwrap();
            nudge_domain::ReminderId::from_uuid(id)
        }
    };
    let lost = orphan(tenant.id, "lost", t0() - secs(600), false).await;
    let too_recent = orphan(tenant.id, "recent", t0() - secs(30), false).await;
    let cancelled = orphan(tenant.id, "cancelled", t0() - secs(600), true).await;
    let held = orphan(paused.id, "held", t0() - secs(600), false).await;
    let ancient = orphan(tenant.id, "ancient", t0() - secs(10 * 86_400), false).await;

    let repaired = ledger
        .repair_orphaned_reminders(
            t0() - secs(2 * 86_400),
            t0(),
            std::time::Duration::from_secs(120),
            100,
        )
        .await
        .unwrap();

    assert_eq!(repaired, 1);
    assert_eq!(
        ledger.deliveries_of_reminder(lost).await.unwrap().len(),
        2,
        "one per channel"
    );
    for untouched in [too_recent, cancelled, held, ancient] {
        assert!(
            ledger
                .deliveries_of_reminder(untouched)
                .await
                .unwrap()
                .is_empty()
        );
    }
    let again = ledger
        .repair_orphaned_reminders(
            t0() - secs(2 * 86_400),
            t0(),
            std::time::Duration::from_secs(120),
            100,
        )
        .await
        .unwrap();
    assert_eq!(again, 0, "repaired once");
}
