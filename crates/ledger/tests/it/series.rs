#![allow(clippy::unwrap_used, clippy::expect_used)]

use chrono::{DateTime, Utc};
use nudge_domain::series::{Series, SeriesLimits};
use nudge_domain::{Channel, ExpiresAfter, LocalTime, SubscriberRef, TenantId, Zone};
use nudge_ledger::test_support::*;
use nudge_ledger::{Destination, Ledger, LedgerTime, NewSeries, SeriesOutcome, WindowOutcome};
use sqlx::PgPool;

fn limits() -> SeriesLimits {
    SeriesLimits {
        max_ahead: chrono::TimeDelta::days(366),
        max_per_day: 24,
    }
}

/// Daily at 08:00 Berlin (07:00Z in winter) from the day after t0, ten times.
fn daily(tenant_id: TenantId, series_id: &str, subscriber: &str) -> NewSeries {
    let rule = "FREQ=DAILY;COUNT=10";
    let series = Series::parse(
        rule,
        LocalTime::parse("2026-11-30T08:00:00").unwrap(),
        Zone::parse("Europe/Berlin").unwrap(),
        &limits(),
    )
    .unwrap();
    NewSeries::new(
        tenant_id,
        series_id,
        SubscriberRef::parse(subscriber).unwrap(),
        &[Channel::Sms],
        series,
        rule,
        ExpiresAfter::from_secs(3_600).unwrap(),
    )
    .unwrap()
    .with_content(Some(br#"{"medication":"a"}"#.to_vec()))
    .unwrap()
    .with_request_digest(series_id.as_bytes().to_vec())
}

fn contacts() -> Vec<(Channel, Destination)> {
    vec![(Channel::Sms, Destination::new("+15550001111".to_owned()))]
}

fn utc(text: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(text).unwrap().to_utc()
}

async fn occurrences(pool: &PgPool) -> Vec<(String, DateTime<Utc>, DateTime<Utc>)> {
    sqlx::query_as(
        "SELECT event_id, scheduled_at, expires_at FROM reminders
         WHERE series_key IS NOT NULL ORDER BY scheduled_at",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_windows_that_reach_a_series_create_its_occurrences_once_each(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let outcome = ledger
        .create_series(
            &daily(tenant.id, "med-1", "patient-1"),
            &contacts(),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    let SeriesOutcome::Created {
        occurrences_created,
        next_at,
        ..
    } = outcome
    else {
        panic!("{outcome:?}");
    };
    // No window has run: nothing is created ahead of the producer.
    assert_eq!(occurrences_created, 0);
    assert_eq!(next_at, Some(utc("2026-11-30T07:00:00Z")));
    assert!(occurrences(&pool).await.is_empty());

    // The producer's own role expands it: a day's window takes one occurrence.
    let producer = connected_as(&pool, "nudge_producer").await;
    let window = producer
        .materialise_window(tenant.id, t0(), t0() + secs(86_400), t0())
        .await
        .unwrap();
    assert_eq!(
        window,
        WindowOutcome::Materialised {
            deliveries_created: 1,
            occurrences_created: 1,
            series_unexpandable: 0
        }
    );
    // Replayed: nothing twice.
    assert_eq!(
        producer
            .materialise_window(tenant.id, t0(), t0() + secs(86_400), t0() + secs(5))
            .await
            .unwrap(),
        WindowOutcome::AlreadyRun
    );
    let window = producer
        .materialise_window(
            tenant.id,
            t0() + secs(86_400),
            t0() + secs(3 * 86_400),
            t0() + secs(86_400),
        )
        .await
        .unwrap();
    assert_eq!(
        window,
        WindowOutcome::Materialised {
            deliveries_created: 2,
            occurrences_created: 2,
            series_unexpandable: 0
        }
    );
    let rows = occurrences(&pool).await;
    assert_eq!(
        rows.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(),
        [
            "med-1/2026-11-30T08:00:00",
            "med-1/2026-12-01T08:00:00",
            "med-1/2026-12-02T08:00:00"
        ]
    );
    assert_eq!(rows[0].1, utc("2026-11-30T07:00:00Z"));
    assert_eq!(rows[0].2, utc("2026-11-30T08:00:00Z"), "an hour to live");
    let status = ledger
        .series_status(tenant.id, "med-1", t0())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.occurrences_created, 3);
    assert_eq!(status.next_at, Some(utc("2026-12-03T07:00:00Z")));
    assert_eq!(
        status
            .upcoming
            .iter()
            .map(|o| o.local.to_string())
            .collect::<Vec<_>>(),
        [
            "2026-11-30T08:00:00",
            "2026-12-01T08:00:00",
            "2026-12-02T08:00:00",
            "2026-12-03T08:00:00",
            "2026-12-04T08:00:00"
        ]
    );

    // Its content is the series', opened at the lease as any reminder's.
    let due = claim_all(&ledger, utc("2026-11-30T07:00:01Z")).await;
    assert_eq!(due.len(), 1);
    match lease(&ledger, &due[0], utc("2026-11-30T07:00:01Z")).await {
        nudge_ledger::LeaseOutcome::Leased { material, .. } => {
            let material = material.unwrap();
            assert_eq!(
                material.content.as_deref(),
                Some(br#"{"medication":"a"}"#.as_slice())
            );
            assert_eq!(material.destination.unwrap().expose(), "+15550001111");
        }
        other => panic!("{other:?}"),
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_series_recorded_after_its_windows_ran_creates_what_they_passed(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    ledger
        .materialise_window(tenant.id, t0(), t0() + secs(2 * 86_400), t0())
        .await
        .unwrap();
    let outcome = ledger
        .create_series(
            &daily(tenant.id, "med-1", "patient-1"),
            &contacts(),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    assert!(
        matches!(
            outcome,
            SeriesOutcome::Created {
                occurrences_created: 2,
                ..
            }
        ),
        "{outcome:?}"
    );
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(deliveries, 2, "their deliveries in the same transaction");
    // The next window starts where the last ended and takes the third, only.
    let window = ledger
        .materialise_window(
            tenant.id,
            t0() + secs(2 * 86_400),
            t0() + secs(3 * 86_400),
            t0(),
        )
        .await
        .unwrap();
    assert_eq!(
        window,
        WindowOutcome::Materialised {
            deliveries_created: 1,
            occurrences_created: 1,
            series_unexpandable: 0
        }
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_same_series_again_is_one_and_another_under_its_id_is_a_conflict(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let first = ledger
        .create_series(
            &daily(tenant.id, "med-1", "patient-1"),
            &contacts(),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    let SeriesOutcome::Created { key, .. } = first else {
        panic!("{first:?}");
    };
    assert_eq!(
        ledger
            .create_series(
                &daily(tenant.id, "med-1", "patient-1"),
                &contacts(),
                &cipher(),
                t0()
            )
            .await
            .unwrap(),
        SeriesOutcome::AlreadyPresent { key }
    );
    let other = daily(tenant.id, "med-1", "patient-1").with_request_digest(b"other".to_vec());
    assert_eq!(
        ledger
            .create_series(&other, &contacts(), &cipher(), t0())
            .await
            .unwrap(),
        SeriesOutcome::Conflict
    );
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM series")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_cancelled_series_creates_nothing_more_and_its_unsent_occurrences_are_cancelled(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    ledger
        .create_series(
            &daily(tenant.id, "med-1", "patient-1"),
            &contacts(),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    ledger
        .materialise_window(tenant.id, t0(), t0() + secs(3 * 86_400), t0())
        .await
        .unwrap();
    // The first occurrence goes out: leased and fenced (its send started).
    let first_due = utc("2026-11-30T07:00:01Z");
    let due = claim_all(&ledger, first_due).await;
    let leased = leased(lease(&ledger, &due[0], first_due).await);
    let fenced: bool =
        sqlx::query_scalar("SELECT send_started_at IS NOT NULL FROM deliveries WHERE id = $1")
            .bind(leased.id.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(fenced, "its send started at the lease");

    let cancelled = ledger
        .cancel_series(tenant.id, "med-1", Some(&ops(first_due)), at(first_due))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cancelled.occurrences_sent, 1);
    assert_eq!(cancelled.occurrences_cancelled, 2);
    assert_eq!(cancelled.deliveries_cancelled, 2);
    assert!(!cancelled.already_cancelled);
    // Again, as the intake's role does it (its grants cover every statement).
    let intake = connected_as(&pool, "nudge_intake").await;
    let again = intake
        .cancel_series(tenant.id, "med-1", None, LedgerTime::Database)
        .await
        .unwrap()
        .unwrap();
    assert!(again.already_cancelled);
    assert_eq!(again.deliveries_cancelled, 0);

    // Later windows create none.
    let window = ledger
        .materialise_window(
            tenant.id,
            t0() + secs(3 * 86_400),
            t0() + secs(9 * 86_400),
            t0(),
        )
        .await
        .unwrap();
    assert_eq!(
        window,
        WindowOutcome::Materialised {
            deliveries_created: 0,
            occurrences_created: 0,
            series_unexpandable: 0
        }
    );
    let status = ledger
        .series_status(tenant.id, "med-1", first_due)
        .await
        .unwrap()
        .unwrap();
    assert!(status.upcoming.is_empty());
    assert_eq!(status.next_at, None);
    assert!(status.cancelled_at.is_some());
    assert_eq!(
        ledger
            .cancel_series(tenant.id, "no-such", None, LedgerTime::Database)
            .await
            .unwrap(),
        None
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn erasing_the_subscriber_erases_their_series(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    ledger
        .create_series(
            &daily(tenant.id, "med-1", "patient-1"),
            &contacts(),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    ledger
        .create_series(
            &daily(tenant.id, "med-2", "patient-2"),
            &contacts(),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    let intake = connected_as(&pool, "nudge_intake").await;
    let erasure = intake
        .erase_subscriber(
            tenant.id,
            &SubscriberRef::parse("patient-1").unwrap(),
            &cipher(),
            &ops(t0()),
            at(t0()),
        )
        .await
        .unwrap();
    assert_eq!(erasure.series_erased, 1);
    let rows: Vec<(String, bool, bool, bool)> = sqlx::query_as(
        "SELECT series_id, content_ciphertext IS NULL, next_at IS NULL, cancelled_at IS NOT NULL
         FROM series ORDER BY series_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [
            ("med-1".to_owned(), true, true, true),
            ("med-2".to_owned(), false, false, false)
        ]
    );
    // The windows then create only the other subscriber's occurrences.
    let window = ledger
        .materialise_window(tenant.id, t0(), t0() + secs(86_400), t0())
        .await
        .unwrap();
    assert_eq!(
        window,
        WindowOutcome::Materialised {
            deliveries_created: 1,
            occurrences_created: 1,
            series_unexpandable: 0
        }
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_series_whose_zone_no_longer_parses_waits_without_holding_the_others(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    for (id, subscriber) in [("med-1", "patient-1"), ("med-2", "patient-2")] {
        ledger
            .create_series(
                &daily(tenant.id, id, subscriber),
                &contacts(),
                &cipher(),
                t0(),
            )
            .await
            .unwrap();
    }
    // As if a later tz database had dropped the zone.
    sqlx::query("UPDATE series SET time_zone = 'Europe/Atlantis' WHERE series_id = 'med-1'")
        .execute(&pool)
        .await
        .unwrap();
    let window = ledger
        .materialise_window(tenant.id, t0(), t0() + secs(86_400), t0())
        .await
        .unwrap();
    assert_eq!(
        window,
        WindowOutcome::Materialised {
            deliveries_created: 1,
            occurrences_created: 1,
            series_unexpandable: 1
        }
    );
    let next: Option<DateTime<Utc>> =
        sqlx::query_scalar("SELECT next_at FROM series WHERE series_id = 'med-1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(next, Some(utc("2026-11-30T07:00:00Z")), "left where it was");

    // Mended after its first occurrence's window ran: the next window creates that one too,
    // and gives it its delivery although it is due before the window's start (it then sends
    // late, or expires: never silently dropped).
    sqlx::query("UPDATE series SET time_zone = 'Europe/Berlin' WHERE series_id = 'med-1'")
        .execute(&pool)
        .await
        .unwrap();
    let window = ledger
        .materialise_window(
            tenant.id,
            t0() + secs(86_400),
            t0() + secs(2 * 86_400),
            t0() + secs(86_400),
        )
        .await
        .unwrap();
    assert_eq!(
        window,
        WindowOutcome::Materialised {
            deliveries_created: 3,
            occurrences_created: 3,
            series_unexpandable: 0
        }
    );
    let med_1: Vec<String> = sqlx::query_scalar(
        "SELECT r.event_id FROM reminders r JOIN deliveries d ON d.reminder_id = r.id
         WHERE r.event_id LIKE 'med-1/%' ORDER BY r.scheduled_at",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        med_1,
        ["med-1/2026-11-30T08:00:00", "med-1/2026-12-01T08:00:00"]
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_tz_rule_that_moves_an_occurrence_earlier_cannot_skip_it(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    ledger
        .create_series(
            &daily(tenant.id, "med-1", "patient-1"),
            &contacts(),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    // As if the build that stored it had Berlin an hour further behind UTC: the stored instant
    // is later than the wall-clock time resolves to now.
    sqlx::query("UPDATE series SET next_at = next_at + interval '1 hour'")
        .execute(&pool)
        .await
        .unwrap();
    ledger
        .materialise_window(tenant.id, t0(), t0() + secs(86_400), t0())
        .await
        .unwrap();
    let rows = occurrences(&pool).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].0, "med-1/2026-11-30T08:00:00");
    assert_eq!(
        rows[0].1,
        utc("2026-11-30T07:00:00Z"),
        "at this build's instant"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_rescheduled_occurrence_sends_its_own_content_or_none_never_the_series(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    ledger
        .create_series(
            &daily(tenant.id, "med-1", "patient-1"),
            &contacts(),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    ledger
        .materialise_window(tenant.id, t0(), t0() + secs(86_400), t0())
        .await
        .unwrap();
    // A reschedule that gave it no content (the whole reminder as it should now be).
    sqlx::query("UPDATE reminders SET content_from_series = false WHERE series_key IS NOT NULL")
        .execute(&pool)
        .await
        .unwrap();
    let due_at = utc("2026-11-30T07:00:01Z");
    let due = claim_all(&ledger, due_at).await;
    match lease(&ledger, &due[0], due_at).await {
        nudge_ledger::LeaseOutcome::Leased { material, .. } => {
            assert_eq!(material.unwrap().content, None, "not the series' content");
        }
        other => panic!("{other:?}"),
    }
}
