//! The patient's time at the intake: `scheduled_local` read in the reminder's zone, else the
//! subscriber's, else the tenant's, answered with the instant it resolved to; `expires_after_s`;
//! a subscriber's zone from `PUT .../contacts`; and every bad combination a 400 naming its
//! field, with nothing stored.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use axum::http::StatusCode;
use chrono::{DateTime, TimeZone, Utc};
use nudge_domain::Zone;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::api::{Intake, assert_no_phi, intake_at, operator};

fn clock(at: DateTime<Utc>) -> Arc<dyn Fn() -> DateTime<Utc> + Send + Sync> {
    Arc::new(move || at)
}

/// Two weeks before New York springs forward (2027-03-14, 02:00 -> 03:00).
fn before_spring() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2027, 3, 1, 12, 0, 0).unwrap()
}

fn local_reminder(event_id: &str, local: &str, zone: Option<&str>) -> Value {
    let mut body = json!({
        "event_id": event_id,
        "subscriber_ref": "patient-42",
        "channels": ["sms"],
        "scheduled_local": local,
        "expires_after_s": 3600,
        "destinations": {"sms": "+15550100"},
    });
    if let Some(zone) = zone {
        body["time_zone"] = json!(zone);
    }
    body
}

async fn stored_times(intake: &Intake, event_id: &str) -> (DateTime<Utc>, DateTime<Utc>) {
    sqlx::query_as("SELECT scheduled_at, expires_at FROM reminders WHERE event_id = $1")
        .bind(event_id)
        .fetch_one(intake.ledger.pool())
        .await
        .unwrap()
}

async fn subscriber_zones(intake: &Intake) -> Vec<Option<String>> {
    sqlx::query_scalar("SELECT time_zone FROM contacts ORDER BY channel")
        .fetch_all(intake.ledger.pool())
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_local_time_in_the_spring_forward_gap_is_answered_with_the_instant_after_the_gap(
    pool: PgPool,
) {
    let intake = intake_at(pool, clock(before_spring())).await;
    let answer = intake
        .post(&local_reminder(
            "appt-gap",
            "2027-03-14T02:30:00",
            Some("America/New_York"),
        ))
        .await;
    assert_eq!(answer.status, StatusCode::ACCEPTED, "{}", answer.text);
    assert_eq!(answer.body["scheduled_at"], "2027-03-14T07:30:00Z");
    assert_eq!(answer.body["expires_at"], "2027-03-14T08:30:00Z");
    assert_eq!(
        answer.body["local"],
        json!({
            "time_zone": "America/New_York",
            "zone_from": "reminder",
            "utc_offset": "-04:00",
            "wall_clock": "2027-03-14T03:30:00",
            "resolution": "moved_past_gap",
        })
    );
    assert_no_phi(&answer.text);
    let (scheduled_at, expires_at) = stored_times(&intake, "appt-gap").await;
    assert_eq!(scheduled_at.to_rfc3339(), "2027-03-14T07:30:00+00:00");
    assert_eq!(expires_at.to_rfc3339(), "2027-03-14T08:30:00+00:00");
    // The reminder's zone is the subscriber's from then on.
    assert_eq!(
        subscriber_zones(&intake).await,
        [Some("America/New_York".to_owned())]
    );

    // The same post again is a duplicate, answered without times.
    let again = intake
        .post(&local_reminder(
            "appt-gap",
            "2027-03-14T02:30:00",
            Some("America/New_York"),
        ))
        .await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert!(again.body.get("scheduled_at").is_none(), "{}", again.text);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_local_time_without_a_zone_is_read_in_the_subscribers_zone_else_the_tenants_and_none_is_refused(
    pool: PgPool,
) {
    let intake = intake_at(pool, clock(before_spring())).await;
    // No zone anywhere: refused, naming the field, nothing stored.
    let refused = intake
        .post(&local_reminder("appt-1", "2027-03-10T09:00:00", None))
        .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.text);
    assert_eq!(refused.body["errors"][0]["path"], "/time_zone");
    assert_eq!(intake.count("reminders").await, 0);
    assert_eq!(intake.count("contacts").await, 0);

    // The tenant's zone (set after the intake cached the tenant: read as the ledger has it).
    let tenant = intake
        .ledger
        .tenant_by_name("clinic")
        .await
        .unwrap()
        .unwrap();
    intake
        .ledger
        .set_tenant_time_zone(tenant.id, Zone::parse("Europe/London").ok(), &operator())
        .await
        .unwrap();
    let by_tenant = intake
        .post(&local_reminder("appt-1", "2027-03-10T09:00:00", None))
        .await;
    assert_eq!(by_tenant.status, StatusCode::ACCEPTED, "{}", by_tenant.text);
    assert_eq!(by_tenant.body["scheduled_at"], "2027-03-10T09:00:00Z");
    assert_eq!(by_tenant.body["local"]["zone_from"], "tenant");

    // The subscriber's zone, from their contacts, wins over the tenant's.
    let contacts = intake
        .call(
            "PUT",
            "/v1/tenants/clinic/subscribers/patient-42/contacts",
            &json!({"destinations": {"sms": "+15550100"}, "time_zone": "Australia/Lord_Howe"}),
        )
        .await;
    assert_eq!(contacts.status, StatusCode::OK, "{}", contacts.text);
    assert_eq!(contacts.body["time_zone"], "Australia/Lord_Howe");
    let by_subscriber = intake
        .post(&local_reminder("appt-2", "2027-03-10T09:00:00", None))
        .await;
    assert_eq!(
        by_subscriber.status,
        StatusCode::ACCEPTED,
        "{}",
        by_subscriber.text
    );
    // Lord Howe is on daylight time (+11:00) in March.
    assert_eq!(by_subscriber.body["scheduled_at"], "2027-03-09T22:00:00Z");
    assert_eq!(by_subscriber.body["local"]["zone_from"], "subscriber");
    assert_eq!(by_subscriber.body["local"]["utc_offset"], "+11:00");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn bad_times_and_zones_are_a_400_naming_the_field_and_store_nothing(pool: PgPool) {
    let intake = intake_at(pool, clock(before_spring())).await;
    let base = local_reminder("appt-bad", "2027-03-10T09:00:00", Some("Europe/Berlin"));
    let cases = [
        (json!({"time_zone": "Europe/Atlantis"}), "/time_zone"),
        (json!({"time_zone": "utc"}), "/time_zone"),
        (json!({"time_zone": ""}), "/time_zone"),
        (
            json!({"scheduled_at": "2027-03-10T08:00:00Z"}),
            "/scheduled_local",
        ),
        (json!({"scheduled_local": null}), "/scheduled_at"),
        (
            json!({"scheduled_local": "2027-03-10T09:00:00+01:00"}),
            "/scheduled_local",
        ),
        (
            json!({"scheduled_local": "2027-03-32T09:00:00"}),
            "/scheduled_local",
        ),
        (
            json!({"expires_at": "2027-03-11T00:00:00Z"}),
            "/expires_after_s",
        ),
        (json!({"expires_after_s": null}), "/expires_at"),
        (json!({"expires_after_s": 0}), "/expires_after_s"),
        (json!({"expires_after_s": 40_000_000}), "/expires_after_s"),
        // Beyond intake.max_schedule_ahead_days (30) once resolved.
        (
            json!({"scheduled_local": "2027-05-01T09:00:00"}),
            "/scheduled_local",
        ),
    ];
    for (patch, path) in cases {
        let mut body = base.clone();
        for (k, v) in patch.as_object().unwrap() {
            if v.is_null() {
                body.as_object_mut().unwrap().remove(k);
            } else {
                body[k] = v.clone();
            }
        }
        let answer = intake.post(&body).await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{patch}: {}",
            answer.text
        );
        assert_eq!(answer.body["errors"][0]["path"], path, "{}", answer.text);
        assert!(!answer.text.contains("Atlantis"), "{}", answer.text);
        assert_no_phi(&answer.text);
    }
    let contacts = intake
        .call(
            "PUT",
            "/v1/tenants/clinic/subscribers/patient-42/contacts",
            &json!({"destinations": {"sms": "+15550100"}, "time_zone": "Mars/Olympus_Mons"}),
        )
        .await;
    assert_eq!(
        contacts.status,
        StatusCode::BAD_REQUEST,
        "{}",
        contacts.text
    );
    assert_eq!(contacts.body["errors"][0]["path"], "/time_zone");
    assert_eq!(intake.count("reminders").await, 0);
    assert_eq!(intake.count("contacts").await, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reschedule_to_a_local_time_that_happens_twice_takes_the_earlier_instant(pool: PgPool) {
    // A week before London falls back (2027-10-31, 02:00 BST -> 01:00 GMT).
    let intake = intake_at(
        pool,
        clock(Utc.with_ymd_and_hms(2027, 10, 24, 12, 0, 0).unwrap()),
    )
    .await;
    let posted = intake
        .post(&json!({
            "event_id": "appt-9",
            "subscriber_ref": "patient-42",
            "channels": ["sms"],
            "scheduled_at": "2027-10-30T12:00:00Z",
            "expires_at": "2027-10-30T13:00:00Z",
            "destinations": {"sms": "+15550100"},
        }))
        .await;
    assert_eq!(posted.status, StatusCode::ACCEPTED, "{}", posted.text);
    let moved = intake
        .call(
            "PUT",
            "/v1/tenants/clinic/reminders/appt-9",
            &json!({
                "revision": 1,
                "subscriber_ref": "patient-42",
                "channels": ["sms"],
                "scheduled_local": "2027-10-31T01:30:00",
                "time_zone": "Europe/London",
                "expires_after_s": 600,
                "destinations": {"sms": "+15550100"},
            }),
        )
        .await;
    assert_eq!(moved.status, StatusCode::OK, "{}", moved.text);
    assert_eq!(moved.body["scheduled_at"], "2027-10-31T00:30:00Z");
    assert_eq!(moved.body["expires_at"], "2027-10-31T00:40:00Z");
    let (scheduled_at, _) = stored_times(&intake, "appt-9").await;
    assert_eq!(scheduled_at.to_rfc3339(), "2027-10-31T00:30:00+00:00");
    assert_eq!(
        subscriber_zones(&intake).await,
        [Some("Europe/London".to_owned())]
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_batch_answers_each_local_time_with_its_instant_or_the_field_at_fault(pool: PgPool) {
    let intake = intake_at(pool, clock(before_spring())).await;
    let answer = intake
        .post(&json!({"reminders": [
            local_reminder("appt-a", "2027-03-14T02:30:00", Some("America/New_York")),
            local_reminder("appt-b", "2027-03-14T02:30:00", Some("America/Gotham")),
        ]}))
        .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
    let results = &answer.body["results"];
    assert_eq!(results[0]["status"], 202);
    assert_eq!(
        results[0]["reminder"]["scheduled_at"],
        "2027-03-14T07:30:00Z"
    );
    assert_eq!(results[1]["status"], 400);
    assert_eq!(results[1]["errors"][0]["path"], "/reminders/1/time_zone");
    assert_eq!(intake.count("reminders").await, 1);
}
