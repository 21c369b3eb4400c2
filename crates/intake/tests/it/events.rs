//! The events API: a tenant's delivery events by position, paged, signed like every `/v1`
//! route, with no destination, subscriber reference or content in them; a bad query is a 400
//! naming its parameter.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use axum::http::StatusCode;
use nudge_domain::EventId;
use nudge_ledger::LedgerTime;
use serde_json::Value;
use sqlx::PgPool;

use crate::api::{assert_no_phi, intake_at, now, reminder};

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_tenants_events_are_read_by_position_in_pages_without_phi(pool: PgPool) {
    let intake = intake_at(pool, Arc::new(now)).await;
    let posted = intake.post(&reminder("appt-1")).await;
    assert_eq!(posted.status, StatusCode::ACCEPTED, "{}", posted.text);
    let tenant = intake
        .ledger
        .tenant_by_name("clinic")
        .await
        .unwrap()
        .unwrap();
    intake
        .ledger
        .cancel_reminder_by_channel(
            tenant.id,
            &EventId::parse("appt-1").unwrap(),
            LedgerTime::Database,
        )
        .await
        .unwrap();

    let empty = intake
        .call("GET", "/v1/tenants/clinic/events", &Value::Null)
        .await;
    assert_eq!(empty.status, StatusCode::OK, "{}", empty.text);
    assert_eq!(
        empty.body["events"],
        Value::Array(vec![]),
        "not numbered yet"
    );
    assert_eq!(
        (
            empty.body["next_after"].as_i64(),
            empty.body["more"].as_bool()
        ),
        (Some(0), Some(false))
    );

    assert_eq!(
        intake.ledger.sequence_events(100).await.unwrap().numbered,
        Some(4),
        "two deliveries scheduled, then cancelled"
    );
    let first = intake
        .call("GET", "/v1/tenants/clinic/events?limit=3", &Value::Null)
        .await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert_no_phi(&first.text);
    let events = first.body["events"].as_array().unwrap();
    assert_eq!(events.len(), 3);
    assert_eq!(first.body["more"], true);
    assert_eq!(events[0]["kind"], "scheduled");
    assert_eq!(events[0]["event_id"], "appt-1");
    assert_eq!(events[0]["delivery_seq"], 1);
    assert_eq!(events[0]["previous_state"], Value::Null);
    let next = first.body["next_after"].as_i64().unwrap();
    assert_eq!(Some(next), events[2]["position"].as_i64());

    let rest = intake
        .call(
            "GET",
            &format!("/v1/tenants/clinic/events?after={next}&limit=3"),
            &Value::Null,
        )
        .await;
    assert_eq!(rest.status, StatusCode::OK, "{}", rest.text);
    let tail = rest.body["events"].as_array().unwrap();
    assert_eq!(tail.len(), 1);
    assert_eq!(rest.body["more"], false);
    let all: Vec<&Value> = events.iter().chain(tail).collect();
    let mut kinds: Vec<(String, String)> = all
        .iter()
        .map(|e| {
            (
                e["channel"].as_str().unwrap().to_owned(),
                e["kind"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            ("email".to_owned(), "cancelled".to_owned()),
            ("email".to_owned(), "scheduled".to_owned()),
            ("sms".to_owned(), "cancelled".to_owned()),
            ("sms".to_owned(), "scheduled".to_owned()),
        ]
    );
    let cancelled = all.iter().find(|e| e["kind"] == "cancelled").unwrap();
    assert_eq!(cancelled["delivery_seq"], 2);
    assert_eq!(cancelled["previous_state"], "scheduled");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_bad_events_query_is_a_400_naming_it_and_a_forged_one_a_401(pool: PgPool) {
    let intake = intake_at(pool, Arc::new(now)).await;
    for (query, pointer) in [
        ("after=-1", "after"),
        ("after=x", "after"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("since=3", ""),
    ] {
        let answer = intake
            .call(
                "GET",
                &format!("/v1/tenants/clinic/events?{query}"),
                &Value::Null,
            )
            .await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{query}: {}",
            answer.text
        );
        assert!(answer.text.contains(pointer), "{query}: {}", answer.text);
    }
    let forged = intake
        .call_with_headers(
            "GET",
            "/v1/tenants/clinic/events",
            &Value::Null,
            &[("nudge-signature", "t=1,v2=00")],
        )
        .await;
    assert_eq!(forged.status, StatusCode::UNAUTHORIZED, "{}", forged.text);
}
