//! The intake's HTTP API against a real database (a fresh one per test), through the router
//! with `tower::ServiceExt::oneshot`: authentication, idempotency, bad input, cancellation,
//! contacts, erasure and correlation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode};
use chrono::{DateTime, TimeZone, Timelike, Utc};
use nudge_domain::Channel;
use nudge_intake::signature::{Signed, header_value};
use nudge_intake::{AppState, IntakeMetrics, Limits, router};
use nudge_ledger::{DestinationCipher, Ledger, LedgerTime, Operator, SubscriberKey};
use serde_json::{Value, json};
use sqlx::PgPool;
use tower::ServiceExt;

/// The intake's clock in these tests: reminders are due at or after it.
pub(crate) fn now() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 12, 1, 9, 0, 0).unwrap()
}

pub(crate) struct Intake {
    pub(crate) ledger: Ledger,
    clock: Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>,
    router: axum::Router,
    secret: String,
    metrics: Arc<IntakeMetrics>,
}

pub(crate) fn cipher() -> DestinationCipher {
    DestinationCipher::new(&[7; 32]).with_subscriber_key(SubscriberKey::new(&[9; 32]))
}

pub(crate) fn operator() -> Operator {
    Operator::new("test", Some("test"), Utc::now()).unwrap()
}

async fn intake(pool: PgPool) -> Intake {
    intake_at(pool, Arc::new(now)).await
}

/// The intake of tenant `clinic`, its clock `clock`.
pub(crate) async fn intake_at(
    pool: PgPool,
    clock: Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>,
) -> Intake {
    let ledger = Ledger::from_pool(pool);
    ledger.create_tenant("clinic", &operator()).await.unwrap();
    let tenant = ledger.tenant_by_name("clinic").await.unwrap().unwrap();
    let secret = ledger
        .rotate_signing_secret(tenant.id, &cipher(), &operator())
        .await
        .unwrap();
    let metrics = Arc::new(IntakeMetrics::new());
    let state = AppState::new(
        ledger.clone(),
        cipher(),
        metrics.clone(),
        Limits {
            batch_max: 3,
            timestamp_tolerance_s: 300,
            max_schedule_ahead: chrono::Duration::days(30),
        },
        clock.clone(),
    );
    Intake {
        ledger,
        clock,
        router: router(state, 64 * 1024, Duration::from_secs(10)),
        secret: secret.expose().to_owned(),
        metrics,
    }
}

/// A `Nudge-Signature` value for this request, as a client computes it.
pub(crate) fn signature(
    method: &str,
    target: &str,
    body: &[u8],
    t: i64,
    secrets: &[&str],
) -> String {
    let secrets: Vec<&[u8]> = secrets.iter().map(|s| s.as_bytes()).collect();
    header_value(
        &secrets,
        t,
        &Signed {
            method,
            target,
            body,
        },
    )
}

pub(crate) fn reminder(event_id: &str) -> Value {
    json!({
        "event_id": event_id,
        "subscriber_ref": "patient-42",
        "channels": ["sms", "email"],
        "scheduled_at": "2026-12-01T08:00:00Z",
        "expires_at": "2026-12-01T12:00:00Z",
        "destinations": {"sms": "+15550100", "email": "pat@example.org"},
        "content": {"template": "flu-shot"}
    })
}

pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) body: Value,
    pub(crate) text: String,
    correlation: Option<String>,
}

impl Intake {
    fn signed(
        &self,
        method: &str,
        uri: &str,
        body: &[u8],
        t: i64,
        secrets: &[&str],
    ) -> Request<Body> {
        let signature = signature(method, uri, body, t, secrets);
        Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .header("nudge-signature", signature)
            .body(Body::from(body.to_vec()))
            .unwrap()
    }

    async fn send(&self, request: Request<Body>) -> Answer {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let correlation = response
            .headers()
            .get("x-correlation-id")
            .map(|v| v.to_str().unwrap().to_owned());
        let bytes = to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        Answer {
            status,
            body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            text,
            correlation,
        }
    }

    pub(crate) async fn post(&self, body: &Value) -> Answer {
        let bytes = serde_json::to_vec(body).unwrap();
        let request = self.signed(
            "POST",
            "/v1/tenants/clinic/reminders",
            &bytes,
            (self.clock)().timestamp(),
            &[&self.secret],
        );
        self.send(request).await
    }

    pub(crate) async fn call(&self, method: &str, uri: &str, body: &Value) -> Answer {
        let bytes = if body.is_null() {
            Vec::new()
        } else {
            serde_json::to_vec(body).unwrap()
        };
        let request = self.signed(
            method,
            uri,
            &bytes,
            (self.clock)().timestamp(),
            &[&self.secret],
        );
        self.send(request).await
    }

    /// [`Intake::call`] with extra headers (signed as the request is: headers are not).
    pub(crate) async fn call_with_headers(
        &self,
        method: &str,
        uri: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> Answer {
        let bytes = if body.is_null() {
            Vec::new()
        } else {
            serde_json::to_vec(body).unwrap()
        };
        let mut request = self.signed(
            method,
            uri,
            &bytes,
            (self.clock)().timestamp(),
            &[&self.secret],
        );
        for (name, value) in headers {
            request.headers_mut().insert(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                axum::http::HeaderValue::from_str(value).unwrap(),
            );
        }
        self.send(request).await
    }

    pub(crate) async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(self.ledger.pool())
            .await
            .unwrap()
    }
}

pub(crate) fn assert_no_phi(text: &str) {
    for secret in ["+15550100", "pat@example.org", "patient-42", "flu-shot"] {
        assert!(!text.contains(secret), "answer shows {secret}: {text}");
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_signed_reminder_is_accepted_after_commit_and_posting_it_again_answers_200_with_the_same_id(
    pool: PgPool,
) {
    let intake = intake(pool).await;
    let first = intake.post(&reminder("appt-1")).await;
    assert_eq!(first.status, StatusCode::ACCEPTED, "{}", first.text);
    assert_eq!(first.body["status"], "accepted");
    assert_eq!(
        first.body["deliveries_created"], 2,
        "due now: both channels"
    );
    assert!(first.body.get("held").is_none());
    assert_no_phi(&first.text);
    // Committed before the answer: another connection sees it.
    assert_eq!(intake.count("reminders").await, 1);
    assert_eq!(intake.count("deliveries").await, 2);
    assert_eq!(intake.count("contacts").await, 2);

    let again = intake.post(&reminder("appt-1")).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert_eq!(again.body["status"], "duplicate");
    assert_eq!(again.body["reminder_id"], first.body["reminder_id"]);
    assert_eq!(intake.count("reminders").await, 1);
    assert_eq!(intake.count("deliveries").await, 2);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_same_event_id_with_another_body_is_a_409_naming_the_event_id(pool: PgPool) {
    let intake = intake(pool).await;
    assert_eq!(
        intake.post(&reminder("appt-1")).await.status,
        StatusCode::ACCEPTED
    );
    // Only the content differs: the ledger's own comparison (subscriber, channels, times)
    // would call it the same; the request digest does not.
    let mut other = reminder("appt-1");
    other["content"] = json!({"template": "dentist"});
    let answer = intake.post(&other).await;
    assert_eq!(answer.status, StatusCode::CONFLICT, "{}", answer.text);
    assert_eq!(answer.body["error"], "event_conflict");
    assert_eq!(answer.body["event_id"], "appt-1");
    assert_eq!(intake.count("reminders").await, 1);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn times_with_nanoseconds_post_again_as_the_same_reminder(pool: PgPool) {
    // PostgreSQL keeps microseconds; the retry must still compare equal.
    let intake = intake(pool).await;
    let mut r = reminder("nanos");
    r["scheduled_at"] = json!("2026-12-01T08:00:00.123456789Z");
    assert_eq!(intake.post(&r).await.status, StatusCode::ACCEPTED);
    let again = intake.post(&r).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn concurrent_duplicate_posts_create_one_reminder(pool: PgPool) {
    let intake = Arc::new(intake(pool).await);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let intake = intake.clone();
        tasks.push(tokio::spawn(async move {
            intake.post(&reminder("appt-race")).await
        }));
    }
    let mut statuses = Vec::new();
    let mut ids = Vec::new();
    for task in tasks {
        let answer = task.await.unwrap();
        statuses.push(answer.status.as_u16());
        ids.push(answer.body["reminder_id"].clone());
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 200, 200, 202]);
    assert!(ids.iter().all(|id| *id == ids[0] && id.is_string()));
    assert_eq!(intake.count("reminders").await, 1);
    assert_eq!(intake.count("deliveries").await, 2);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn refusals_are_401_with_a_reason_and_write_nothing_and_an_unknown_tenant_looks_like_a_bad_signature(
    pool: PgPool,
) {
    let intake = intake(pool).await;
    let body = serde_json::to_vec(&reminder("appt-1")).unwrap();
    let t = now().timestamp();
    let uri = "/v1/tenants/clinic/reminders";
    let mut unsigned = intake.signed("POST", uri, &body, t, &[&intake.secret]);
    unsigned.headers_mut().remove("nudge-signature");
    let cases = [
        (unsigned, "missing_signature"),
        (
            intake.signed("POST", uri, &body, t, &["nsk_wrong"]),
            "bad_signature",
        ),
        (
            intake.signed("POST", uri, &body, t - 301, &[&intake.secret]),
            "stale_timestamp",
        ),
        (
            intake.signed("POST", uri, &body, t + 301, &[&intake.secret]),
            "stale_timestamp",
        ),
    ];
    let mut bad_signature_text = String::new();
    for (request, reason) in cases {
        let answer = intake.send(request).await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED, "{reason}");
        assert_eq!(answer.body["reason"], reason);
        if reason == "bad_signature" {
            bad_signature_text = answer.text.clone();
        }
    }
    // A tampered body under a good signature.
    let mut tampered = intake.signed("POST", uri, &body, t, &[&intake.secret]);
    *tampered.body_mut() = Body::from(serde_json::to_vec(&reminder("appt-2")).unwrap());
    assert_eq!(intake.send(tampered).await.body["reason"], "bad_signature");
    // A tenant that does not exist, signed with the real secret: the same answer, byte for byte.
    let unknown = intake
        .send(intake.signed(
            "POST",
            "/v1/tenants/nobody/reminders",
            &body,
            t,
            &[&intake.secret],
        ))
        .await;
    assert_eq!(unknown.status, StatusCode::UNAUTHORIZED);
    assert_eq!(unknown.text, bad_signature_text);
    assert_eq!(intake.count("reminders").await, 0);
    assert_eq!(intake.count("contacts").await, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn during_a_rotation_both_secrets_sign_and_after_retirement_only_the_new_one(pool: PgPool) {
    let intake = intake(pool).await;
    let tenant = intake
        .ledger
        .tenant_by_name("clinic")
        .await
        .unwrap()
        .unwrap();
    let old = intake.secret.clone();
    let new = intake
        .ledger
        .rotate_signing_secret(tenant.id, &cipher(), &operator())
        .await
        .unwrap();
    let new = new.expose().to_owned();
    assert_ne!(old, new);
    // A third is refused while two are active.
    assert!(
        intake
            .ledger
            .rotate_signing_secret(tenant.id, &cipher(), &operator())
            .await
            .is_err()
    );
    let t = now().timestamp();
    let uri = "/v1/tenants/clinic/reminders";
    let post = |event: &str, secrets: &[&str]| {
        let body = serde_json::to_vec(&reminder(event)).unwrap();
        intake.signed("POST", uri, &body, t, secrets)
    };
    assert_eq!(
        intake.send(post("a", &[&old])).await.status,
        StatusCode::ACCEPTED
    );
    assert_eq!(
        intake.send(post("b", &[&new])).await.status,
        StatusCode::ACCEPTED
    );
    assert_eq!(
        intake.send(post("c", &[&old, &new])).await.status,
        StatusCode::ACCEPTED
    );

    assert_eq!(
        intake
            .ledger
            .retire_signing_secret(tenant.id, &operator())
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        intake.send(post("d", &[&old])).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        intake.send(post("e", &[&new])).await.status,
        StatusCode::ACCEPTED
    );
    // The secrets are stored only sealed.
    let stored: Vec<Vec<u8>> = sqlx::query_scalar("SELECT secret_ciphertext FROM tenant_secrets")
        .fetch_all(intake.ledger.pool())
        .await
        .unwrap();
    assert!(
        stored
            .iter()
            .all(|c| !String::from_utf8_lossy(c).contains(&new))
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn bad_input_is_a_400_listing_paths_and_problems_without_values_and_writes_nothing(
    pool: PgPool,
) {
    let intake = intake(pool).await;
    let mut cases: Vec<(Value, &str)> = Vec::new();
    let mut r = reminder("e");
    r["destinations"] = json!({"sms": "+15550100"});
    cases.push((r, "/destinations/email"));
    let mut r = reminder("e");
    r["channels"] = json!(["sms", "fax"]);
    cases.push((r, "/channels/1"));
    let mut r = reminder("e");
    r["expires_at"] = json!("2026-12-01T07:00:00Z");
    cases.push((r, "/expires_at"));
    let mut r = reminder("e");
    r["scheduled_at"] = json!("2027-06-01T08:00:00Z");
    r["expires_at"] = json!("2027-06-02T08:00:00Z");
    cases.push((r, "/scheduled_at"));
    let mut r = reminder("e");
    r["subscriber_ref"] = json!("x".repeat(129));
    cases.push((r, "/subscriber_ref"));
    let mut r = reminder("e");
    r["event_id"] = json!("");
    cases.push((r, "/event_id"));
    // An unknown field is placed at the reminder, its name never repeated.
    let mut r = reminder("e");
    r["nickname"] = json!("pat");
    cases.push((r, ""));
    let mut r = reminder("e");
    r["subscriber_ref"] = json!(15550100);
    cases.push((r, "/subscriber_ref"));
    for (body, path) in cases {
        let answer = intake.post(&body).await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{path}: {}",
            answer.text
        );
        assert_eq!(answer.body["error"], "invalid_request");
        assert_eq!(answer.body["errors"][0]["path"], path, "{}", answer.text);
        assert!(answer.body["errors"][0]["problem"].is_string());
        assert_no_phi(&answer.text);
    }
    // Malformed JSON.
    let broken = intake
        .send(intake.signed(
            "POST",
            "/v1/tenants/clinic/reminders",
            b"{\"event_id\": ",
            now().timestamp(),
            &[&intake.secret],
        ))
        .await;
    assert_eq!(broken.status, StatusCode::BAD_REQUEST);
    assert_eq!(broken.body["errors"][0]["path"], "");
    assert_eq!(intake.count("reminders").await, 0);
    assert_eq!(intake.count("contacts").await, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn another_content_type_is_415_and_a_body_over_the_limit_is_413(pool: PgPool) {
    let intake = intake(pool).await;
    let body = serde_json::to_vec(&reminder("e")).unwrap();
    let mut text = intake.signed(
        "POST",
        "/v1/tenants/clinic/reminders",
        &body,
        now().timestamp(),
        &[&intake.secret],
    );
    text.headers_mut()
        .insert("content-type", "text/plain".parse().unwrap());
    let answer = intake.send(text).await;
    assert_eq!(answer.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(answer.body["error"], "unsupported_media_type");

    let big = vec![b' '; 65 * 1024];
    let answer = intake
        .send(intake.signed(
            "POST",
            "/v1/tenants/clinic/reminders",
            &big,
            now().timestamp(),
            &[&intake.secret],
        ))
        .await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(answer.body["error"], "payload_too_large");
    assert_eq!(intake.count("reminders").await, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_batch_answers_each_reminder_on_its_own(pool: PgPool) {
    let intake = intake(pool).await;
    assert_eq!(
        intake.post(&reminder("old")).await.status,
        StatusCode::ACCEPTED
    );
    let mut conflicting = reminder("old");
    conflicting["channels"] = json!(["sms"]);
    conflicting["destinations"] = json!({"sms": "+15550100"});
    let mut invalid = reminder("bad");
    invalid["channels"] = json!([]);
    let answer = intake
        .post(&json!({"reminders": [reminder("new"), conflicting, invalid]}))
        .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
    let results = answer.body["results"].as_array().unwrap();
    let statuses: Vec<u64> = results
        .iter()
        .map(|r| r["status"].as_u64().unwrap())
        .collect();
    assert_eq!(statuses, [202, 409, 400]);
    assert_eq!(results[1]["event_id"], "old");
    assert_eq!(results[2]["errors"][0]["path"], "/reminders/2/channels");
    assert_eq!(intake.count("reminders").await, 2);

    let too_many = intake
        .post(&json!({"reminders": [reminder("a"), reminder("b"), reminder("c"), reminder("d")]}))
        .await;
    assert_eq!(too_many.status, StatusCode::BAD_REQUEST);
    assert_eq!(too_many.body["errors"][0]["path"], "/reminders");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_paused_tenant_or_a_draining_channel_records_and_holds_and_the_answer_says_so(
    pool: PgPool,
) {
    let intake = intake(pool).await;
    let tenant = intake
        .ledger
        .tenant_by_name("clinic")
        .await
        .unwrap()
        .unwrap();
    intake
        .ledger
        .set_draining(
            Channel::Sms,
            true,
            &operator(),
            nudge_ledger::LedgerTime::Database,
        )
        .await
        .unwrap();
    let answer = intake.post(&reminder("drain")).await;
    assert_eq!(answer.status, StatusCode::ACCEPTED, "{}", answer.text);
    assert_eq!(answer.body["held"]["tenant_paused"], false);
    assert_eq!(answer.body["held"]["draining_channels"], json!(["sms"]));
    assert_eq!(answer.body["deliveries_created"], 1, "email only");
    intake
        .ledger
        .set_draining(
            Channel::Sms,
            false,
            &operator(),
            nudge_ledger::LedgerTime::Database,
        )
        .await
        .unwrap();

    intake
        .ledger
        .set_intake_paused(tenant.id, true, &operator())
        .await
        .unwrap();
    let answer = intake.post(&reminder("paused")).await;
    assert_eq!(answer.status, StatusCode::ACCEPTED, "{}", answer.text);
    assert_eq!(answer.body["held"]["tenant_paused"], true);
    assert_eq!(answer.body["deliveries_created"], 0);
    let state = intake
        .call("GET", "/v1/tenants/clinic/reminders/paused", &Value::Null)
        .await;
    assert_eq!(state.status, StatusCode::OK);
    assert_eq!(state.body["channels"][0]["state"], "pending");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn cancellation_settles_owed_deliveries_and_lists_per_channel_what_had_already_gone(
    pool: PgPool,
) {
    let intake = intake(pool).await;
    let posted = intake.post(&reminder("appt-c")).await;
    assert_eq!(posted.status, StatusCode::ACCEPTED);
    // The email delivery was sent before the cancellation.
    sqlx::query(
        "UPDATE deliveries SET state = 'delivered', settled_at = now() WHERE channel = 'email'",
    )
    .execute(intake.ledger.pool())
    .await
    .unwrap();
    let answer = intake
        .call(
            "POST",
            "/v1/tenants/clinic/reminders/appt-c/cancel",
            &Value::Null,
        )
        .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
    assert_eq!(answer.body["cancelled"], json!(["sms"]));
    let channels = &answer.body["reminder"]["channels"];
    assert_eq!(channels[0]["channel"], "email");
    assert_eq!(channels[0]["state"], "delivered");
    assert_eq!(channels[1]["state"], "cancelled");
    assert!(answer.body["reminder"]["cancelled_at"].is_string());
    assert_no_phi(&answer.text);

    let unknown = intake
        .call(
            "POST",
            "/v1/tenants/clinic/reminders/nope/cancel",
            &Value::Null,
        )
        .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn contacts_are_stored_sealed_and_erasure_leaves_no_trace_of_the_subscriber(pool: PgPool) {
    let intake = intake(pool).await;
    let put = intake
        .call(
            "PUT",
            "/v1/tenants/clinic/subscribers/patient-42/contacts",
            &json!({"destinations": {"push": "tok-abc"}}),
        )
        .await;
    assert_eq!(put.status, StatusCode::OK, "{}", put.text);
    assert_eq!(put.body["channels"], json!(["push"]));
    let mut later = reminder("later");
    later["scheduled_at"] = json!("2026-12-20T08:00:00Z");
    later["expires_at"] = json!("2026-12-20T12:00:00Z");
    assert_eq!(
        intake.post(&reminder("now")).await.status,
        StatusCode::ACCEPTED
    );
    assert_eq!(intake.post(&later).await.status, StatusCode::ACCEPTED);
    let tenant = intake
        .ledger
        .tenant_by_name("clinic")
        .await
        .unwrap()
        .unwrap();
    let ciphertexts: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT destination_ciphertext FROM contacts UNION ALL
         SELECT content_ciphertext FROM reminders WHERE content_ciphertext IS NOT NULL",
    )
    .fetch_all(intake.ledger.pool())
    .await
    .unwrap();
    assert_eq!(ciphertexts.len(), 3 + 2, "push, sms, email; two contents");
    let stored_ref: String = sqlx::query_scalar("SELECT DISTINCT subscriber_ref FROM contacts")
        .fetch_one(intake.ledger.pool())
        .await
        .unwrap();
    let digests: Vec<Vec<u8>> = sqlx::query_scalar("SELECT request_digest FROM reminders")
        .fetch_all(intake.ledger.pool())
        .await
        .unwrap();

    let erased = intake
        .call(
            "DELETE",
            "/v1/tenants/clinic/subscribers/patient-42",
            &Value::Null,
        )
        .await;
    assert_eq!(erased.status, StatusCode::OK, "{}", erased.text);
    assert_eq!(erased.body["contacts_deleted"], 3);
    assert_eq!(erased.body["reminders_erased"], 2);
    assert_eq!(
        erased.body["deliveries_cancelled"], 2,
        "the due reminder's two"
    );

    // Nothing owed remains for the subscriber.
    let owed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deliveries WHERE state IN ('scheduled', 'queued', 'retry_wait')",
    )
    .fetch_one(intake.ledger.pool())
    .await
    .unwrap();
    assert_eq!(owed, 0);
    // No row of any table holds the reference (raw or stored), a ciphertext or a digest.
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' AND tablename NOT LIKE '\\_sqlx%'",
    )
    .fetch_all(intake.ledger.pool())
    .await
    .unwrap();
    let mut needles: Vec<String> = vec!["patient-42".into(), stored_ref.clone()];
    for bytes in ciphertexts.iter().chain(&digests) {
        needles.push(bytes.iter().map(|b| format!("{b:02x}")).collect());
    }
    for table in tables {
        let rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT row_to_json(t)::text FROM {table} t"
        )))
        .fetch_all(intake.ledger.pool())
        .await
        .unwrap();
        for row in rows {
            for needle in &needles {
                assert!(
                    !row.contains(needle.as_str()),
                    "{table} still holds a trace: {row}"
                );
            }
        }
    }
    // The reminders keep their ids, times and states; the trail is audited without the ref.
    let state = intake
        .call("GET", "/v1/tenants/clinic/reminders/now", &Value::Null)
        .await;
    assert_eq!(state.status, StatusCode::OK);
    assert_eq!(state.body["channels"][0]["state"], "cancelled");
    let _ = tenant;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_correlation_id_is_kept_with_the_reminder_and_handed_to_the_relay(pool: PgPool) {
    let intake = intake(pool).await;
    let body = serde_json::to_vec(&reminder("corr")).unwrap();
    let mut request = intake.signed(
        "POST",
        "/v1/tenants/clinic/reminders",
        &body,
        now().timestamp(),
        &[&intake.secret],
    );
    request
        .headers_mut()
        .insert("x-correlation-id", "req-7f3a".parse().unwrap());
    let answer = intake.send(request).await;
    assert_eq!(answer.status, StatusCode::ACCEPTED);
    assert_eq!(answer.correlation.as_deref(), Some("req-7f3a"));
    assert_eq!(answer.body["correlation_id"], "req-7f3a");
    let due = intake
        .ledger
        .claim_due(Channel::Sms, 10, LedgerTime::Fixed(now()))
        .await
        .unwrap();
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].correlation_id.as_deref(), Some("req-7f3a"));

    // An invalid one is replaced by a generated one.
    let body = serde_json::to_vec(&reminder("corr-2")).unwrap();
    let mut request = intake.signed(
        "POST",
        "/v1/tenants/clinic/reminders",
        &body,
        now().timestamp(),
        &[&intake.secret],
    );
    request
        .headers_mut()
        .insert("x-correlation-id", "has space".parse().unwrap());
    let answer = intake.send(request).await;
    let generated = answer.correlation.unwrap();
    assert_ne!(generated, "has space");
    assert_eq!(generated.len(), 32);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn health_readiness_and_the_contract_are_served_without_a_signature_and_metrics_are_not(
    pool: PgPool,
) {
    let intake = intake(pool).await;
    for (uri, needle) in [
        ("/healthz", "ok"),
        ("/readyz", "ready"),
        ("/openapi.json", "\"openapi\": \"3.1"),
    ] {
        let answer = intake
            .send(Request::builder().uri(uri).body(Body::empty()).unwrap())
            .await;
        assert_eq!(answer.status, StatusCode::OK, "{uri}");
        assert!(answer.text.contains(needle), "{uri}: {}", answer.text);
    }
    let _ = intake.post(&reminder("m")).await;
    // Metrics are for the admin address (telemetry.metrics_addr), not the public listener.
    let public = intake
        .send(
            Request::builder()
                .uri("/metrics")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(public.status, StatusCode::NOT_FOUND);
    let metrics = intake.metrics.encode().unwrap();
    assert!(
        metrics.contains("nudge_intake_reminders_total{outcome=\"accepted\"} 1"),
        "{metrics}"
    );
    assert_no_phi(&metrics);
}

#[test]
fn the_committed_openapi_document_is_the_one_the_code_generates() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    let generated = nudge_intake::openapi_json();
    if std::env::var_os("NUDGE_WRITE_OPENAPI").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    assert!(
        committed == generated,
        "docs/openapi.json is not what the code generates: run \
         `NUDGE_WRITE_OPENAPI=1 cargo test -p nudge-intake --test api the_committed_openapi` and commit it"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_signature_replayed_to_another_path_or_method_is_refused_and_writes_nothing(
    pool: PgPool,
) {
    let intake = intake(pool).await;
    for event in ["appt-a", "appt-b"] {
        assert_eq!(
            intake.post(&reminder(event)).await.status,
            StatusCode::ACCEPTED
        );
    }
    let owed = || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM deliveries WHERE state IN ('scheduled', 'queued', 'retry_wait')",
        )
        .fetch_one(intake.ledger.pool())
        .await
        .unwrap();
        n
    };
    assert_eq!(owed().await, 4);
    let t = now().timestamp();
    let request = |method: &str, uri: &str, body: &[u8], header: &str| {
        Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .header("nudge-signature", header)
            .body(Body::from(body.to_vec()))
            .unwrap()
    };
    // A captured cancellation of appt-a, replayed against appt-b.
    let cancel_a = signature(
        "POST",
        "/v1/tenants/clinic/reminders/appt-a/cancel",
        b"",
        t,
        &[&intake.secret],
    );
    let replayed = intake
        .send(request(
            "POST",
            "/v1/tenants/clinic/reminders/appt-b/cancel",
            b"",
            &cancel_a,
        ))
        .await;
    assert_eq!(
        replayed.status,
        StatusCode::UNAUTHORIZED,
        "{}",
        replayed.text
    );
    assert_eq!(replayed.body["reason"], "bad_signature");
    // A captured read of appt-a, sent as its cancellation.
    let read_a = signature(
        "GET",
        "/v1/tenants/clinic/reminders/appt-a",
        b"",
        t,
        &[&intake.secret],
    );
    let as_cancel = intake
        .send(request(
            "POST",
            "/v1/tenants/clinic/reminders/appt-a/cancel",
            b"",
            &read_a,
        ))
        .await;
    assert_eq!(as_cancel.body["reason"], "bad_signature");
    // A captured erasure of `patient.42`, against `patient` with the rest moved into the body:
    // the same bytes with dots between the parts, refused with line breaks between them.
    let put = intake
        .call(
            "PUT",
            "/v1/tenants/clinic/subscribers/patient/contacts",
            &json!({"destinations": {"push": "tok-keep"}}),
        )
        .await;
    assert_eq!(put.status, StatusCode::OK, "{}", put.text);
    let erase_dotted = signature(
        "DELETE",
        "/v1/tenants/clinic/subscribers/patient.42",
        b"",
        t,
        &[&intake.secret],
    );
    let shifted = intake
        .send(request(
            "DELETE",
            "/v1/tenants/clinic/subscribers/patient",
            b"42.",
            &erase_dotted,
        ))
        .await;
    assert_eq!(shifted.body["reason"], "bad_signature", "{}", shifted.text);
    // The first scheme's signature (`v1`, over "<t>.<body>") is no longer enough.
    let v1 = {
        use hmac::Mac;
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(intake.secret.as_bytes()).unwrap();
        mac.update(format!("{t}.").as_bytes());
        let digest = mac.finalize().into_bytes();
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        format!("t={t},v1={hex}")
    };
    let old_scheme = intake
        .send(request(
            "POST",
            "/v1/tenants/clinic/reminders/appt-b/cancel",
            b"",
            &v1,
        ))
        .await;
    assert_eq!(old_scheme.status, StatusCode::UNAUTHORIZED);
    assert_eq!(old_scheme.body["reason"], "missing_signature");

    // Nothing was written: every delivery still owed, no reminder cancelled, the contact kept.
    assert_eq!(owed().await, 4);
    let cancelled: i64 =
        sqlx::query_scalar("SELECT count(*) FROM reminders WHERE cancelled_at IS NOT NULL")
            .fetch_one(intake.ledger.pool())
            .await
            .unwrap();
    assert_eq!(cancelled, 0);
    assert_eq!(intake.count("contacts").await, 3, "sms, email and push");

    // The captured request itself, on its own path, still does what it was signed for.
    let own = intake
        .send(request(
            "POST",
            "/v1/tenants/clinic/reminders/appt-a/cancel",
            b"",
            &cancel_a,
        ))
        .await;
    assert_eq!(own.status, StatusCode::OK, "{}", own.text);
    assert_eq!(owed().await, 2);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_unknown_field_is_answered_by_position_and_its_name_is_never_repeated(pool: PgPool) {
    let intake = intake(pool).await;
    // Keys a client might type by mistake: a phone number, an address, a reference.
    let keys = ["+15550199", "pat.doe@example.org", "patient-77"];
    for key in keys {
        // A single reminder: placed at the reminder, with where the field ends.
        let mut r = reminder("e");
        r[key] = json!(1);
        let answer = intake.post(&r).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.text);
        assert_eq!(answer.body["errors"][0]["path"], "");
        let problem = answer.body["errors"][0]["problem"].as_str().unwrap();
        assert!(problem.contains("line 1 column"), "{problem}");
        assert!(!answer.text.contains(key), "{}", answer.text);

        // A reminder of a batch: placed at that reminder.
        let answer = intake
            .post(&json!({"reminders": [reminder("ok"), r]}))
            .await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
        assert_eq!(
            answer.body["results"][1]["errors"][0]["path"],
            "/reminders/1"
        );
        assert!(!answer.text.contains(key), "{}", answer.text);

        // Next to `reminders`, and next to `destinations`.
        let mut batch = json!({"reminders": [reminder("ok")]});
        batch[key] = json!(1);
        let answer = intake.post(&batch).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);
        assert_eq!(answer.body["errors"][0]["path"], "");
        assert!(!answer.text.contains(key), "{}", answer.text);
        let answer = intake
            .call(
                "PUT",
                "/v1/tenants/clinic/subscribers/patient-42/contacts",
                &{
                    let mut body = json!({"destinations": {"sms": "+15550100"}});
                    body[key] = json!(1);
                    body
                },
            )
            .await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);
        assert_eq!(answer.body["errors"][0]["path"], "");
        assert!(!answer.text.contains(key), "{}", answer.text);
    }
    assert_eq!(intake.count("reminders").await, 1, "only the batches' `ok`");
    assert_eq!(
        intake.count("contacts").await,
        2,
        "the batch's sms and email"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn cancellation_and_erasure_are_stamped_with_the_databases_clock(pool: PgPool) {
    // The intake's clock in these tests is fixed (`now()`); the database's runs.
    let intake = intake(pool).await;
    assert_eq!(
        intake.post(&reminder("clock")).await.status,
        StatusCode::ACCEPTED
    );
    let before: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(intake.ledger.pool())
        .await
        .unwrap();
    let cancelled = intake
        .call(
            "POST",
            "/v1/tenants/clinic/reminders/clock/cancel",
            &Value::Null,
        )
        .await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.text);
    let erased = intake
        .call(
            "DELETE",
            "/v1/tenants/clinic/subscribers/patient-42",
            &Value::Null,
        )
        .await;
    assert_eq!(erased.status, StatusCode::OK, "{}", erased.text);
    let stamps: Vec<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT cancelled_at FROM reminders UNION ALL SELECT erased_at FROM reminders
         UNION ALL SELECT settled_at FROM deliveries
         UNION ALL SELECT at FROM audit_log WHERE action = 'subscriber_erase'",
    )
    .fetch_all(intake.ledger.pool())
    .await
    .unwrap();
    assert_eq!(stamps.len(), 5);
    for stamp in stamps {
        assert!(stamp >= before, "{stamp} is not the database's time");
        assert_ne!(stamp, now());
    }
}

/// `reminder(event_id)` at `scheduled_at` for two hours, under `revision`.
fn replacement(event_id: &str, scheduled_at: DateTime<Utc>, revision: Value) -> Value {
    let mut body = reminder(event_id);
    body["scheduled_at"] = json!(scheduled_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
    body["expires_at"] = json!(
        (scheduled_at + chrono::Duration::hours(2))
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    );
    body["revision"] = revision;
    body
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reschedule_moves_every_owed_channel_and_orders_revisions(pool: PgPool) {
    let intake = intake(pool).await;
    let posted = intake.post(&reminder("appt-r")).await;
    assert_eq!(posted.status, StatusCode::ACCEPTED, "{}", posted.text);
    let uri = "/v1/tenants/clinic/reminders/appt-r";
    // The ledger's clock is the database's: an hour from its now is ahead.
    let later = (Utc::now() + chrono::Duration::hours(1))
        .with_nanosecond(0)
        .unwrap();

    let moved = intake
        .call("PUT", uri, &replacement("appt-r", later, json!(1)))
        .await;
    assert_eq!(moved.status, StatusCode::OK, "{}", moved.text);
    assert_eq!(moved.body["status"], "rescheduled");
    assert_eq!(moved.body["revision"], 1);
    assert_eq!(moved.body["reminder_id"], posted.body["reminder_id"]);
    assert_eq!(
        moved.body["channels"],
        json!([{"channel": "email", "change": "moved"}, {"channel": "sms", "change": "moved"}])
    );
    assert_no_phi(&moved.text);
    let moved_at: DateTime<Utc> = moved.body["scheduled_at"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(moved_at, later);

    let again = intake
        .call("PUT", uri, &replacement("appt-r", later, json!(1)))
        .await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert_eq!(again.body["status"], "unchanged");

    let elsewhere = later + chrono::Duration::hours(1);
    for (revision, why) in [
        (1, "the current revision with another body"),
        (0, "an older one"),
    ] {
        let refused = intake
            .call(
                "PUT",
                uri,
                &replacement("appt-r", elsewhere, json!(revision)),
            )
            .await;
        assert_eq!(
            refused.status,
            StatusCode::CONFLICT,
            "{why}: {}",
            refused.text
        );
        assert_eq!(refused.body["error"], "revision_conflict");
        assert_eq!(refused.body["current_revision"], 1);
    }

    let mut unrevised = replacement("appt-r", elsewhere, Value::Null);
    unrevised.as_object_mut().unwrap().remove("revision");
    let past = later - chrono::Duration::days(2);
    let ahead = now() + chrono::Duration::days(31);
    let mut expiring_first = replacement("appt-r", elsewhere, json!(2));
    expiring_first["expires_at"] = json!("2026-12-01T07:00:00Z");
    for (body, path) in [
        (unrevised, "/revision"),
        (replacement("appt-r", past, json!(2)), "/scheduled_at"),
        (replacement("appt-r", ahead, json!(2)), "/scheduled_at"),
        (expiring_first, "/expires_at"),
        (replacement("appt-r", elsewhere, json!(-1)), "/revision"),
        (replacement("appt-other", elsewhere, json!(2)), "/event_id"),
    ] {
        let refused = intake.call("PUT", uri, &body).await;
        assert_eq!(
            refused.status,
            StatusCode::BAD_REQUEST,
            "{path}: {}",
            refused.text
        );
        assert_eq!(refused.body["errors"][0]["path"], path, "{}", refused.text);
    }
    let state = intake.call("GET", uri, &Value::Null).await;
    let state_at: DateTime<Utc> = state.body["scheduled_at"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(state_at, later, "nothing refused changed anything");
    assert_eq!(state.body["revision"], 1);

    // The client's retry of its first post is still that post.
    let retried = intake.post(&reminder("appt-r")).await;
    assert_eq!(retried.status, StatusCode::OK, "{}", retried.text);
    assert_eq!(retried.body["status"], "duplicate");

    // A post that gives its revision starts there.
    let mut numbered = reminder("appt-n");
    numbered["revision"] = json!(3);
    assert_eq!(intake.post(&numbered).await.status, StatusCode::ACCEPTED);
    let numbered_uri = "/v1/tenants/clinic/reminders/appt-n";
    let repeat = intake.call("PUT", numbered_uri, &numbered).await;
    assert_eq!(repeat.status, StatusCode::OK, "{}", repeat.text);
    assert_eq!(
        repeat.body["status"], "unchanged",
        "revision 3 with its own body"
    );
    let older = intake
        .call("PUT", numbered_uri, &replacement("appt-n", later, json!(2)))
        .await;
    assert_eq!(older.status, StatusCode::CONFLICT, "{}", older.text);
    assert_eq!(older.body["current_revision"], 3);

    let unknown = intake
        .call(
            "PUT",
            "/v1/tenants/clinic/reminders/nope",
            &replacement("nope", later, json!(1)),
        )
        .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reschedule_of_an_erased_subscribers_reminder_is_not_found_and_a_cancel_answers_per_channel(
    pool: PgPool,
) {
    let intake = intake(pool).await;
    assert_eq!(
        intake.post(&reminder("appt-e")).await.status,
        StatusCode::ACCEPTED
    );
    assert_eq!(
        intake.post(&reminder("appt-k")).await.status,
        StatusCode::ACCEPTED
    );
    sqlx::query(
        "UPDATE deliveries d SET state = 'delivered', settled_at = now()
         FROM reminders r WHERE r.id = d.reminder_id AND r.event_id = 'appt-k'
           AND d.channel = 'email'",
    )
    .execute(intake.ledger.pool())
    .await
    .unwrap();
    let cancelled = intake
        .call(
            "POST",
            "/v1/tenants/clinic/reminders/appt-k/cancel",
            &Value::Null,
        )
        .await;
    assert_eq!(cancelled.status, StatusCode::OK, "{}", cancelled.text);
    assert_eq!(
        cancelled.body["channels"],
        json!([
            {"channel": "email", "answer": "too_late", "state": "delivered"},
            {"channel": "sms", "answer": "cancelled"},
        ])
    );
    let later = Utc::now() + chrono::Duration::hours(1);
    let refused = intake
        .call(
            "PUT",
            "/v1/tenants/clinic/reminders/appt-k",
            &replacement("appt-k", later, json!(1)),
        )
        .await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text);
    assert_eq!(refused.body["error"], "reminder_cancelled");

    let erased = intake
        .call(
            "DELETE",
            "/v1/tenants/clinic/subscribers/patient-42",
            &Value::Null,
        )
        .await;
    assert_eq!(erased.status, StatusCode::OK, "{}", erased.text);
    let gone = intake
        .call(
            "PUT",
            "/v1/tenants/clinic/reminders/appt-e",
            &replacement("appt-e", later, json!(1)),
        )
        .await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND, "{}", gone.text);
}
