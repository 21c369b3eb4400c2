//! Recurring reminders (series) at the intake: a post recorded once (200 again, 409 for
//! another body under the id), read back without PHI, cancelled, and bad input a 400 naming
//! its field with nothing stored.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use axum::http::StatusCode;
use chrono::{DateTime, TimeZone, Utc};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::api::{assert_no_phi, intake_at};

fn clock(at: DateTime<Utc>) -> Arc<dyn Fn() -> DateTime<Utc> + Send + Sync> {
    Arc::new(move || at)
}

/// A week before New York springs forward.
fn now() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2027, 3, 7, 12, 0, 0).unwrap()
}

const SERIES: &str = "/v1/tenants/clinic/series";

fn series(series_id: &str) -> Value {
    json!({
        "series_id": series_id,
        "subscriber_ref": "patient-42",
        "channels": ["sms"],
        "time_zone": "America/New_York",
        "start_local": "2027-03-10T02:30:00",
        "rrule": "FREQ=DAILY;COUNT=10",
        "expires_after_s": 3600,
        "destinations": {"sms": "+15550100"},
        "content": {"template": "flu-shot"}
    })
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_series_is_recorded_once_read_back_without_phi_and_cancelled(pool: PgPool) {
    let intake = intake_at(pool.clone(), clock(now())).await;
    let first = intake.call("POST", SERIES, &series("med-1")).await;
    assert_eq!(first.status, StatusCode::ACCEPTED, "{}", first.text);
    assert_eq!(first.body["status"], "accepted");
    assert_no_phi(&first.text);
    // The spring-forward day's 02:30 does not exist: once, at 03:30 EDT (07:30Z).
    let upcoming = first.body["upcoming"].as_array().unwrap();
    assert_eq!(upcoming.len(), 5);
    assert_eq!(upcoming[0]["event_id"], "med-1/2027-03-10T02:30:00");
    assert_eq!(upcoming[4]["local"], "2027-03-14T02:30:00");
    assert_eq!(upcoming[4]["scheduled_at"], "2027-03-14T07:30:00Z");
    assert_eq!(upcoming[3]["scheduled_at"], "2027-03-13T07:30:00Z");

    let again = intake.call("POST", SERIES, &series("med-1")).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert_eq!(again.body["status"], "duplicate");
    let mut other = series("med-1");
    other["rrule"] = json!("FREQ=DAILY;COUNT=11");
    let conflict = intake.call("POST", SERIES, &other).await;
    assert_eq!(conflict.status, StatusCode::CONFLICT, "{}", conflict.text);
    assert_eq!(conflict.body["error"], "series_conflict");
    assert_eq!(conflict.body["series_id"], "med-1");
    assert_eq!(intake.count("series").await, 1);

    let read = intake
        .call("GET", &format!("{SERIES}/med-1"), &Value::Null)
        .await;
    assert_eq!(read.status, StatusCode::OK, "{}", read.text);
    assert_no_phi(&read.text);
    assert_eq!(read.body["time_zone"], "America/New_York");
    assert_eq!(read.body["rrule"], "FREQ=DAILY;COUNT=10");
    assert_eq!(read.body["next_at"], "2027-03-10T07:30:00Z");
    assert_eq!(read.body["occurrences_created"], 0);
    assert_eq!(read.body["channels"], json!(["sms"]));

    let cancel = intake
        .call("POST", &format!("{SERIES}/med-1/cancel"), &Value::Null)
        .await;
    assert_eq!(cancel.status, StatusCode::OK, "{}", cancel.text);
    assert_eq!(cancel.body["already_cancelled"], false);
    let read = intake
        .call("GET", &format!("{SERIES}/med-1"), &Value::Null)
        .await;
    assert_eq!(read.body["upcoming"], json!([]));
    assert_eq!(read.body["next_at"], Value::Null);
    assert!(read.body["cancelled_at"].is_string());

    let missing = intake
        .call("GET", &format!("{SERIES}/no-such"), &Value::Null)
        .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    let missing = intake
        .call("POST", &format!("{SERIES}/no-such/cancel"), &Value::Null)
        .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_bad_series_is_a_400_naming_its_field_and_stores_nothing(pool: PgPool) {
    let intake = intake_at(pool.clone(), clock(now())).await;
    let cases: Vec<(&str, Value, &str)> = vec![
        ("/time_zone", json!("Mars/Olympus_Mons"), "tz database"),
        ("/rrule", json!("FREQ=DAILY"), "must end"),
        (
            "/rrule",
            json!("FREQ=DAILY;UNTIL=20300101T000000Z"),
            "further ahead",
        ),
        (
            "/rrule",
            json!("FREQ=DAILY;BYHOUR=0,1,2,3,4,5,6,7,8,9,10,11,12;BYMINUTE=0,30;COUNT=3"),
            "times a day",
        ),
        ("/rrule", json!("FREQ=HOURLY;COUNT=3"), "is not an RRULE"),
        ("/start_local", json!("2027-03-10T02:30:00+01:00"), "offset"),
        ("/start_local", json!("2027-09-10T08:00:00"), "days ahead"),
        ("/expires_after_s", json!(0), "integer"),
        ("/series_id", json!(""), "visible ASCII"),
        ("/channels", json!([]), "at least one"),
    ];
    for (field, value, words) in cases {
        let mut body = series("med-1");
        body[&field[1..]] = value.clone();
        let answer = intake.call("POST", SERIES, &body).await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{field} {value}: {}",
            answer.text
        );
        let errors = answer.body["errors"].as_array().unwrap();
        assert!(
            errors
                .iter()
                .any(|e| e["path"].as_str().unwrap().starts_with(field)
                    && e["problem"].as_str().unwrap().contains(words)),
            "{field} {value}: {}",
            answer.text
        );
        // A rule is named by its kind, never quoted.
        if let Some(text) = value.as_str().filter(|t| !t.is_empty()) {
            assert!(!answer.text.contains(text), "{}", answer.text);
        }
        assert_no_phi(&answer.text);
    }
    let mut unknown = series("med-1");
    unknown["patient_name"] = json!("x");
    let answer = intake.call("POST", SERIES, &unknown).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert!(!answer.text.contains("patient_name"), "{}", answer.text);
    let mut ignoring = series("med-1");
    ignoring["quiet_hours"] = json!("ignore");
    let answer = intake.call("POST", SERIES, &ignoring).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.text);
    assert_eq!(answer.body["errors"][0]["path"], "/quiet_hours");
    assert_eq!(intake.count("series").await, 0);
    assert_eq!(intake.count("contacts").await, 0);
    assert_eq!(intake.count("reminders").await, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_occurrence_is_a_reminder_a_reminder_may_not_take_its_id_and_a_broken_series_reads_back(
    pool: PgPool,
) {
    let intake = intake_at(pool.clone(), clock(now())).await;
    let posted = intake.call("POST", SERIES, &series("med-1")).await;
    assert_eq!(posted.status, StatusCode::ACCEPTED, "{}", posted.text);
    // A reminder of its own may not take an id shaped like an occurrence's.
    let mut taken = crate::api::reminder("med-1/2027-03-12T02:30:00");
    taken["scheduled_at"] = json!("2027-03-12T07:30:00Z");
    taken["expires_at"] = json!("2027-03-12T09:30:00Z");
    let refused = intake.post(&taken).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.text);
    assert_eq!(refused.body["errors"][0]["path"], "/event_id");
    assert_eq!(intake.count("reminders").await, 0);

    // The producer's window reaches the first occurrence: it is a reminder like any other,
    // read and rescheduled by its event id; without content now, it never sends the series'.
    let tenant = intake
        .ledger
        .tenant_by_name("clinic")
        .await
        .unwrap()
        .unwrap();
    intake
        .ledger
        .materialise_window(
            tenant.id,
            Utc.with_ymd_and_hms(2027, 3, 10, 0, 0, 0).unwrap(),
            Utc.with_ymd_and_hms(2027, 3, 11, 0, 0, 0).unwrap(),
            now(),
        )
        .await
        .unwrap();
    let occurrence = "/v1/tenants/clinic/reminders/med-1%2F2027-03-10T02:30:00";
    let read = intake.call("GET", occurrence, &Value::Null).await;
    assert_eq!(read.status, StatusCode::OK, "{}", read.text);
    assert_eq!(read.body["scheduled_at"], "2027-03-10T07:30:00Z");
    let moved = intake
        .call(
            "PUT",
            occurrence,
            &json!({
                "revision": 1,
                "subscriber_ref": "patient-42",
                "channels": ["sms"],
                "scheduled_at": "2027-03-10T08:00:00Z",
                "expires_at": "2027-03-10T09:00:00Z",
                "destinations": {"sms": "+15550100"}
            }),
        )
        .await;
    assert_eq!(moved.status, StatusCode::OK, "{}", moved.text);
    let (from_series, own): (bool, bool) = sqlx::query_as(
        "SELECT content_from_series, content_ciphertext IS NOT NULL FROM reminders
         WHERE event_id = 'med-1/2027-03-10T02:30:00'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((from_series, own), (false, false));

    // A series whose zone this build no longer knows: shown as such, not a 500.
    sqlx::query("UPDATE series SET time_zone = 'America/Atlantis'")
        .execute(&pool)
        .await
        .unwrap();
    let read = intake
        .call("GET", &format!("{SERIES}/med-1"), &Value::Null)
        .await;
    assert_eq!(read.status, StatusCode::OK, "{}", read.text);
    assert_eq!(read.body["unexpandable"], true);
    assert_eq!(read.body["upcoming"], json!([]));
}
