//! Quiet hours at the intake: a subscriber's own window, `"none"` or `"tenant"` from `PUT
//! .../contacts` (written to all their contacts), a reminder's `"quiet_hours": "ignore"` only
//! where the tenant allows it, and bad input a 400 naming its field with nothing stored.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use axum::http::StatusCode;
use chrono::{DateTime, TimeZone, Utc};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::api::{assert_no_phi, intake_at, operator};

fn clock(at: DateTime<Utc>) -> Arc<dyn Fn() -> DateTime<Utc> + Send + Sync> {
    Arc::new(move || at)
}

fn now() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2027, 3, 1, 12, 0, 0).unwrap()
}

const CONTACTS: &str = "/v1/tenants/clinic/subscribers/patient-42/contacts";

type QuietRow = (
    String,
    Option<chrono::NaiveTime>,
    Option<chrono::NaiveTime>,
    bool,
);

async fn quiet_rows(pool: &PgPool) -> Vec<QuietRow> {
    sqlx::query_as("SELECT channel, quiet_from, quiet_to, quiet_off FROM contacts ORDER BY channel")
        .fetch_all(pool)
        .await
        .unwrap()
}

fn hm(h: u32, m: u32) -> Option<chrono::NaiveTime> {
    chrono::NaiveTime::from_hms_opt(h, m, 0)
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_subscribers_quiet_hours_are_their_own_window_none_or_the_tenants_on_every_contact(
    pool: PgPool,
) {
    let intake = intake_at(pool.clone(), clock(now())).await;
    let both = json!({"sms": "+15550100", "email": "a@example.org"});
    // No zone to read a window in (neither given, nor the subscriber's, nor the tenant's):
    // refused rather than stored to be ignored.
    let zoneless = intake
        .call(
            "PUT",
            CONTACTS,
            &json!({"destinations": both, "quiet_hours": {"from": "22:00", "to": "07:30"}}),
        )
        .await;
    assert_eq!(
        zoneless.status,
        StatusCode::BAD_REQUEST,
        "{}",
        zoneless.text
    );
    assert_eq!(zoneless.body["errors"][0]["path"], "/quiet_hours");
    assert_eq!(intake.count("contacts").await, 0);
    let own = intake
        .call(
            "PUT",
            CONTACTS,
            &json!({"destinations": both, "time_zone": "Europe/Paris",
                    "quiet_hours": {"from": "22:00", "to": "07:30"}}),
        )
        .await;
    assert_eq!(own.status, StatusCode::OK, "{}", own.text);
    assert_eq!(own.body["quiet_hours"], "22:00-07:30");
    assert_eq!(
        quiet_rows(&pool).await,
        vec![
            ("email".to_owned(), hm(22, 0), hm(7, 30), false),
            ("sms".to_owned(), hm(22, 0), hm(7, 30), false),
        ]
    );
    // One channel's write sets it for the subscriber's every contact.
    let off = intake
        .call(
            "PUT",
            CONTACTS,
            &json!({"destinations": {"sms": "+15550100"}, "quiet_hours": "none"}),
        )
        .await;
    assert_eq!(off.status, StatusCode::OK, "{}", off.text);
    assert_eq!(off.body["quiet_hours"], "none");
    assert!(quiet_rows(&pool).await.iter().all(|r| r.1.is_none() && r.3));
    // Without the field, nothing changes.
    let kept = intake
        .call(
            "PUT",
            CONTACTS,
            &json!({"destinations": {"sms": "+15550100"}}),
        )
        .await;
    assert_eq!(kept.status, StatusCode::OK, "{}", kept.text);
    assert!(kept.body.get("quiet_hours").is_none(), "{}", kept.text);
    assert!(quiet_rows(&pool).await.iter().all(|r| r.3));
    let tenant = intake
        .call(
            "PUT",
            CONTACTS,
            &json!({"destinations": {"email": "a@example.org"}, "quiet_hours": "tenant"}),
        )
        .await;
    assert_eq!(tenant.status, StatusCode::OK, "{}", tenant.text);
    assert!(
        quiet_rows(&pool)
            .await
            .iter()
            .all(|r| r.1.is_none() && r.2.is_none() && !r.3)
    );

    // Bad windows: a 400 naming the field, nothing written.
    for (quiet, path) in [
        (json!("always"), "/quiet_hours"),
        (json!(7), "/quiet_hours"),
        (json!({"from": "22:00"}), "/quiet_hours/to"),
        (json!({"from": "25:00", "to": "07:00"}), "/quiet_hours/from"),
        (json!({"from": "22:00", "to": "7:00"}), "/quiet_hours/to"),
        (json!({"from": "22:00", "to": "22:00"}), "/quiet_hours"),
        (json!({"from": "00:00:01", "to": "7"}), "/quiet_hours/to"),
        (
            json!({"from": "22:00", "to": "07:00", "days": "mon"}),
            "/quiet_hours",
        ),
    ] {
        let refused = intake
            .call(
                "PUT",
                CONTACTS,
                &json!({"destinations": {"sms": "+15559999"}, "quiet_hours": quiet}),
            )
            .await;
        assert_eq!(
            refused.status,
            StatusCode::BAD_REQUEST,
            "{quiet}: {}",
            refused.text
        );
        assert_eq!(
            refused.body["errors"][0]["path"], path,
            "{quiet}: {}",
            refused.text
        );
        assert_no_phi(&refused.text);
    }
    assert!(
        quiet_rows(&pool)
            .await
            .iter()
            .all(|r| r.1.is_none() && !r.3),
        "a refused write changed nothing"
    );
}

fn urgent(event_id: &str, quiet: Value) -> Value {
    json!({
        "event_id": event_id,
        "subscriber_ref": "patient-42",
        "channels": ["sms"],
        "scheduled_at": "2027-03-01T13:00:00Z",
        "expires_after_s": 3600,
        "destinations": {"sms": "+15550100"},
        "quiet_hours": quiet,
    })
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reminder_ignores_quiet_hours_only_where_its_tenant_allows_it(pool: PgPool) {
    let intake = intake_at(pool.clone(), clock(now())).await;
    let refused = intake.post(&urgent("appt-1", json!("ignore"))).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.text);
    assert_eq!(refused.body["errors"][0]["path"], "/quiet_hours");
    assert_eq!(intake.count("reminders").await, 0);
    let bad = intake.post(&urgent("appt-1", json!("sometimes"))).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.text);
    assert_eq!(bad.body["errors"][0]["path"], "/quiet_hours");

    let tenant = intake
        .ledger
        .tenant_by_name("clinic")
        .await
        .unwrap()
        .unwrap();
    intake
        .ledger
        .set_tenant_quiet_hours_ignorable(tenant.id, true, &operator())
        .await
        .unwrap();
    for (event, quiet, ignores) in [
        ("appt-1", json!("ignore"), true),
        ("appt-2", json!("respect"), false),
        ("appt-3", Value::Null, false),
    ] {
        let accepted = intake.post(&urgent(event, quiet)).await;
        assert_eq!(accepted.status, StatusCode::ACCEPTED, "{}", accepted.text);
        let stored: bool =
            sqlx::query_scalar("SELECT ignore_quiet_hours FROM reminders WHERE event_id = $1")
                .bind(event)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(stored, ignores, "{event}");
    }
}
