//! A subscriber's preferences through the API: every channel by every category, a change
//! recorded with its source and correlation id, a required category refused with 409 naming
//! it, an unknown one a 400 at its path, and a reminder naming a category the tenant does not
//! have refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use axum::http::StatusCode;
use nudge_domain::Category;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::api::{Intake, assert_no_phi, intake_at, now, operator};

const PREFERENCES: &str = "/v1/tenants/clinic/subscribers/patient-42/preferences";

async fn categories(intake: &Intake) {
    let tenant = intake
        .ledger
        .tenant_by_name("clinic")
        .await
        .unwrap()
        .unwrap();
    for (name, required) in [("appointment", true), ("billing", false)] {
        intake
            .ledger
            .create_category(
                tenant.id,
                &Category::parse(name).unwrap(),
                required,
                &operator(),
            )
            .await
            .unwrap();
    }
}

fn entry<'a>(answer: &'a Value, channel: &str, category: &str) -> &'a Value {
    answer["preferences"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["channel"] == channel && p["category"] == category)
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn preferences_are_read_and_changed_and_a_required_category_stays_on(pool: PgPool) {
    let intake = intake_at(pool, Arc::new(now)).await;
    categories(&intake).await;
    let missing = intake.call("GET", PREFERENCES, &Value::Null).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND, "{}", missing.text);
    let put = intake
        .call(
            "PUT",
            "/v1/tenants/clinic/subscribers/patient-42/contacts",
            &json!({"destinations": {"sms": "+15550100100"}}),
        )
        .await;
    assert_eq!(put.status, StatusCode::OK, "{}", put.text);

    let read = intake.call("GET", PREFERENCES, &Value::Null).await;
    assert_eq!(read.status, StatusCode::OK, "{}", read.text);
    let body: Value = serde_json::from_str(&read.text).unwrap();
    assert_eq!(body["preferences"].as_array().unwrap().len(), 3 * 3);
    let appointment = entry(&body, "sms", "appointment");
    assert_eq!(appointment["required"], true);
    assert_eq!(appointment["state"], "opted_in");
    assert_eq!(appointment["source"], Value::Null);

    // A required category: 409 naming it, and nothing written (the billing change with it).
    let refused = intake
        .call(
            "PUT",
            PREFERENCES,
            &json!({"preferences": [
                {"channel": "sms", "category": "billing", "state": "opted_out"},
                {"channel": "sms", "category": "appointment", "state": "opted_out"},
            ]}),
        )
        .await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text);
    let problem: Value = serde_json::from_str(&refused.text).unwrap();
    assert_eq!(problem["error"], "category_required");
    assert_eq!(problem["category"], "appointment");
    let unknown = intake
        .call(
            "PUT",
            PREFERENCES,
            &json!({"preferences": [
                {"channel": "email", "category": "general", "state": "opted_out"},
                {"channel": "sms", "category": "marketing", "state": "opted_out"},
            ]}),
        )
        .await;
    assert_eq!(unknown.status, StatusCode::BAD_REQUEST, "{}", unknown.text);
    assert!(
        unknown.text.contains("/preferences/1/category"),
        "{}",
        unknown.text
    );
    for bad in [
        json!({"preferences": []}),
        json!({"preferences": [{"channel": "fax", "category": "billing", "state": "opted_out"}]}),
        json!({"preferences": [{"channel": "sms", "category": "Billing", "state": "opted_out"}]}),
        json!({"preferences": [{"channel": "sms", "category": "billing", "state": "off"}]}),
        json!({"preferences": [{"channel": "sms", "category": "billing", "state": "opted_out", "x": 1}]}),
        json!({"prefs": []}),
    ] {
        let answer = intake.call("PUT", PREFERENCES, &bad).await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{bad}: {}",
            answer.text
        );
    }
    let unchanged = intake.call("GET", PREFERENCES, &Value::Null).await;
    let unchanged: Value = serde_json::from_str(&unchanged.text).unwrap();
    assert!(
        unchanged["preferences"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["state"] == "opted_in" && p["source"].is_null()),
        "nothing written: {unchanged}"
    );

    let changed = intake
        .call_with_headers(
            "PUT",
            PREFERENCES,
            &json!({"preferences": [
                {"channel": "sms", "category": "billing", "state": "opted_out"},
            ]}),
            &[("x-correlation-id", "pref-change-1")],
        )
        .await;
    assert_eq!(changed.status, StatusCode::OK, "{}", changed.text);
    assert_no_phi(&changed.text);
    let changed: Value = serde_json::from_str(&changed.text).unwrap();
    let billing = entry(&changed, "sms", "billing");
    assert_eq!(billing["state"], "opted_out");
    assert_eq!(billing["source"], "api");
    assert_eq!(entry(&changed, "email", "billing")["state"], "opted_in");

    let history = intake
        .call(
            "GET",
            "/v1/tenants/clinic/subscribers/patient-42/consent-history",
            &Value::Null,
        )
        .await;
    assert_eq!(history.status, StatusCode::OK, "{}", history.text);
    let history: Value = serde_json::from_str(&history.text).unwrap();
    let entries = history["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{history}");
    assert_eq!(entries[0]["category"], "billing");
    assert_eq!(entries[0]["source"], "api");
    assert_eq!(entries[0]["actor"], "api:clinic");
    assert_eq!(entries[0]["correlation_id"], "pref-change-1");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reminder_naming_a_category_the_tenant_does_not_have_is_refused(pool: PgPool) {
    let intake = intake_at(pool, Arc::new(now)).await;
    categories(&intake).await;
    let reminder = |event: &str, category: Value| {
        json!({
            "event_id": event,
            "subscriber_ref": "patient-42",
            "channels": ["sms"],
            "scheduled_at": "2026-11-30T09:00:00Z",
            "expires_at": "2026-11-30T10:00:00Z",
            "destinations": {"sms": "+15550100100"},
            "category": category,
        })
    };
    let url = "/v1/tenants/clinic/reminders";
    let unknown = intake
        .call("POST", url, &reminder("r1", json!("marketing")))
        .await;
    assert_eq!(unknown.status, StatusCode::BAD_REQUEST, "{}", unknown.text);
    assert!(unknown.text.contains("/category"), "{}", unknown.text);
    let malformed = intake
        .call("POST", url, &reminder("r2", json!("Not A Name")))
        .await;
    assert_eq!(
        malformed.status,
        StatusCode::BAD_REQUEST,
        "{}",
        malformed.text
    );
    for (event, category) in [("r3", json!("appointment")), ("r4", Value::Null)] {
        let ok = intake.call("POST", url, &reminder(event, category)).await;
        assert_eq!(ok.status, StatusCode::ACCEPTED, "{}", ok.text);
    }
    let stored: Vec<(String, String)> =
        sqlx::query_as("SELECT event_id, category FROM reminders ORDER BY event_id")
            .fetch_all(intake.ledger.pool())
            .await
            .unwrap();
    assert_eq!(
        stored,
        [
            ("r3".to_owned(), "appointment".to_owned()),
            ("r4".to_owned(), "general".to_owned())
        ]
    );
    // In a batch, the unknown one is a 400 of its own; the others are written.
    let batch = intake
        .call(
            "POST",
            url,
            &json!({"reminders": [reminder("b1", json!("billing")), reminder("b2", json!("nope"))]}),
        )
        .await;
    assert_eq!(batch.status, StatusCode::OK, "{}", batch.text);
    let results = batch.body["results"].as_array().unwrap();
    assert_eq!(results[0]["status"], 202, "{}", batch.text);
    assert_eq!(results[1]["status"], 400, "{}", batch.text);
    assert!(
        results[1]["errors"][0]["path"] == "/reminders/1/category",
        "{}",
        batch.text
    );
}
