//! The intake while its ledger is away: a database that turns read-only mid-run (as a primary
//! being demoted, or a standby behind an address that has not moved yet, looks to its clients)
//! gets every write answered 503 with `Retry-After` and the JSON error body, never 500, and
//! nothing half-written; once it takes writes again the same posts are accepted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode};
use nudge_intake::{AppState, IntakeMetrics, Limits, router};
use nudge_ledger::test_support::{configured, set_read_only};
use serde_json::{Value, json};
use sqlx::PgPool;
use tower::ServiceExt;

use crate::api::{assert_no_phi, cipher, now, operator, reminder, signature};

struct Answer {
    status: StatusCode,
    retry_after: Option<String>,
    body: Value,
    text: String,
}

async fn send(
    router: &axum::Router,
    method: &str,
    uri: &str,
    body: &Value,
    secret: &str,
) -> Answer {
    let bytes = if body.is_null() {
        Vec::new()
    } else {
        serde_json::to_vec(body).unwrap()
    };
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .header(
            "nudge-signature",
            signature(method, uri, &bytes, now().timestamp(), &[secret]),
        )
        .body(Body::from(bytes))
        .unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let bytes = to_bytes(response.into_body(), 1 << 20).await.unwrap();
    Answer {
        status,
        retry_after,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        text: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(pool)
        .await
        .unwrap()
}

fn assert_away(answer: &Answer, what: &str) {
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{what}: {}",
        answer.text
    );
    assert_eq!(answer.retry_after.as_deref(), Some("2"), "{what}");
    assert_eq!(answer.body["error"], "ledger_unavailable", "{what}");
    assert_no_phi(&answer.text);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_ledger_that_turns_read_only_mid_run_is_answered_503_with_retry_after_and_202_once_it_is_back(
    pool: PgPool,
) {
    // The pool a running intake has (`database.acquire_timeout_ms` short, for the test's sake).
    let ledger = configured(&pool, 4, 500).await.unwrap();
    ledger.create_tenant("clinic", &operator()).await.unwrap();
    let tenant = ledger.tenant_by_name("clinic").await.unwrap().unwrap();
    let secret = ledger
        .rotate_signing_secret(tenant.id, &cipher(), &operator())
        .await
        .unwrap();
    let secret = secret.expose().to_owned();
    let state = AppState::new(
        ledger,
        cipher(),
        Arc::new(IntakeMetrics::new()),
        Limits {
            batch_max: 3,
            timestamp_tolerance_s: 300,
            max_schedule_ahead: chrono::Duration::days(30),
        },
        Arc::new(now),
    );
    let router = router(state, 64 * 1024, Duration::from_secs(10));
    let post = "/v1/tenants/clinic/reminders";
    let first = send(&router, "POST", post, &reminder("before"), &secret).await;
    assert_eq!(first.status, StatusCode::ACCEPTED, "{}", first.text);

    set_read_only(&pool, true).await;
    let during = ["during-1", "during-2", "during-3"];
    for event in during {
        let answer = send(&router, "POST", post, &reminder(event), &secret).await;
        assert_away(&answer, event);
    }
    let batch = json!({"reminders": [reminder("batch-1"), reminder("batch-2")]});
    assert_away(&send(&router, "POST", post, &batch, &secret).await, "batch");
    let cancel = "/v1/tenants/clinic/reminders/before/cancel";
    assert_away(
        &send(&router, "POST", cancel, &Value::Null, &secret).await,
        "cancel",
    );
    let ready = send(&router, "GET", "/readyz", &Value::Null, &secret).await;
    assert_eq!(
        ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        ready.text
    );
    // Nothing half-written: the one reminder from before, its two deliveries, not cancelled.
    assert_eq!(count(&pool, "reminders").await, 1);
    assert_eq!(count(&pool, "deliveries").await, 2);
    assert_eq!(
        count(&pool, "deliveries WHERE state = 'cancelled'").await,
        0
    );

    set_read_only(&pool, false).await;
    // The pool gets rid of the sessions the server ended as it hands them out: a post may
    // still find one (503) before it reaches a new session; never anything but 503 or 202.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut tries = 0;
    loop {
        tries += 1;
        let answer = send(&router, "POST", post, &reminder(during[0]), &secret).await;
        if answer.status == StatusCode::ACCEPTED {
            break;
        }
        assert_away(&answer, "while coming back");
        assert!(
            Instant::now() < deadline && tries < 50,
            "no post accepted within 30 s of the ledger taking writes again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Each post refused during the outage is new to the ledger now.
    for event in &during[1..] {
        let answer = send(&router, "POST", post, &reminder(event), &secret).await;
        assert_eq!(
            answer.status,
            StatusCode::ACCEPTED,
            "{event}: {}",
            answer.text
        );
    }
    let answers = send(&router, "POST", post, &batch, &secret).await;
    assert_eq!(answers.status, StatusCode::OK, "{}", answers.text);
    assert_eq!(
        answers.body["results"][0]["status"], 202,
        "{}",
        answers.text
    );
    let ready = send(&router, "GET", "/readyz", &Value::Null, &secret).await;
    assert_eq!(ready.status, StatusCode::OK, "{}", ready.text);
    assert_eq!(count(&pool, "reminders").await, 6);
    assert_eq!(count(&pool, "deliveries").await, 12);
}
