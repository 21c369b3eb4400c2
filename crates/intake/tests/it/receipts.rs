//! Providers' delivery receipts through the intake's router, against a real database (a fresh
//! one per test): signed as each provider signs them, refused (and nothing written) otherwise,
//! recorded once, settling an ambiguous delivery, flagging the contact.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use base64::Engine as _;
use chrono::Utc;
use nudge_config::Secret;
use nudge_domain::{
    AttemptContext, Channel, DeliveryState, EventId, FixedJitter, IdempotencySupport,
    ProviderAccount, ProviderAnswer, RetryPolicy, SendOutcome, SubscriberRef, Verdict, decide,
};
use nudge_intake::receipts::{GenericReceipts, ReceiptsSection, SendgridReceipts, TwilioReceipts};
use nudge_intake::{AppState, IntakeMetrics, Limits, router};
use nudge_ledger::{
    AttemptRecord, Destination, DestinationCipher, LeaseBatch, LeaseOutcome, LeasedDelivery,
    Ledger, LedgerTime, NewReminder, Operator, OutcomeToRecord, SubscriberKey, WorkerRoutes,
};
use sqlx::PgPool;
use tower::ServiceExt;

const BASE: &str = "https://intake.example.org";
pub(crate) const TOKEN: &str = "twilio-token";
/// The Standard Webhooks secret of the generic account `sms-generic`.
pub(crate) const GENERIC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

pub(crate) fn cipher() -> DestinationCipher {
    DestinationCipher::new(&[7; 32]).with_subscriber_key(SubscriberKey::new(&[9; 32]))
}

fn signing_key() -> p256::ecdsa::SigningKey {
    p256::ecdsa::SigningKey::from_bytes(&[5u8; 32].into()).unwrap()
}

/// The public key as SendGrid shows it: DER SubjectPublicKeyInfo of an uncompressed P-256 point.
fn spki_der(key: &p256::ecdsa::VerifyingKey) -> Vec<u8> {
    const PREFIX: [u8; 26] = [
        0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08,
        0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
    ];
    let mut der = PREFIX.to_vec();
    der.extend_from_slice(key.to_encoded_point(false).as_bytes());
    der
}

pub(crate) fn app(ledger: &Ledger) -> axum::Router {
    let public = spki_der(&p256::ecdsa::VerifyingKey::from(&signing_key()));
    let receipts = ReceiptsSection {
        public_base_url: Some(BASE.into()),
        twilio: vec![TwilioReceipts {
            account: "sms-twilio".into(),
            auth_token: Secret::new(TOKEN),
        }],
        sendgrid: vec![SendgridReceipts {
            account: "email-sendgrid".into(),
            verification_key: base64::engine::general_purpose::STANDARD.encode(public),
        }],
        generic: vec![GenericReceipts {
            account: "sms-generic".into(),
            secret: Secret::new(GENERIC_SECRET),
        }],
    }
    .build()
    .unwrap();
    let state = AppState::new(
        ledger.clone(),
        cipher(),
        Arc::new(IntakeMetrics::new()),
        Limits {
            batch_max: 3,
            timestamp_tolerance_s: 300,
            max_schedule_ahead: chrono::Duration::days(30),
        },
        Arc::new(Utc::now),
    )
    .with_receipts(receipts);
    router(state, 64 * 1024, Duration::from_secs(10))
}

/// A delivery through `account` on `channel`, sent once and held ambiguous (a 502).
async fn ambiguous(ledger: &Ledger, account: &str, channel: Channel) -> LeasedDelivery {
    let now = ledger.clock(LedgerTime::Database).await.unwrap();
    let op = Operator::new("test", Some("test"), now).unwrap();
    let tenant = ledger.create_tenant("clinic", &op).await.unwrap();
    let subscriber = SubscriberRef::parse("patient-1").unwrap();
    ledger
        .upsert_contact(
            tenant.id,
            &subscriber,
            channel,
            &Destination::new("x@example.org"),
            &cipher(),
            now,
        )
        .await
        .unwrap();
    let created = ledger
        .create_reminder(
            &NewReminder::new(
                tenant.id,
                EventId::parse("e1").unwrap(),
                subscriber,
                &[channel],
                now - chrono::Duration::seconds(1),
                now + chrono::Duration::hours(1),
            )
            .unwrap(),
            &cipher(),
            now,
        )
        .await
        .unwrap();
    ledger
        .materialise_reminder(tenant.id, created.id, now)
        .await
        .unwrap();
    let due = ledger
        .claim_due(channel, 10, LedgerTime::Database)
        .await
        .unwrap()
        .remove(0);
    let account = ProviderAccount::parse(account).unwrap();
    let routes = WorkerRoutes {
        default: account.clone(),
        accounts: vec![(account, IdempotencySupport::NotHonoured)],
    };
    let admission = nudge_domain::AdmissionSettings::default();
    let cipher = cipher();
    let batch = LeaseBatch {
        channel,
        lease_holder: "worker",
        lease_for: Duration::from_secs(60),
        routes: &routes,
        account_recheck: Duration::from_secs(30),
        admission: &admission,
        cipher: &cipher,
        at: LedgerTime::Database,
    };
    let lease = match ledger
        .lease_batch(&batch, &[due.message_pointer()])
        .await
        .unwrap()
        .outcomes
        .remove(0)
    {
        LeaseOutcome::Leased { lease, .. } => lease,
        other => panic!("{other:?}"),
    };
    let decision = decide(
        &AttemptContext {
            attempt_number: 1,
            expires_at: lease.expires_at,
            idempotency: IdempotencySupport::NotHonoured,
        },
        &SendOutcome::Answered(ProviderAnswer::new(Verdict::MaybeSent, Some(502))),
        now,
        &RetryPolicy::default(),
        &mut FixedJitter::new(0),
    );
    let attempt = AttemptRecord {
        started_at: now,
        finished_at: now,
        worker: "worker".into(),
        correlation_id: None,
    };
    ledger
        .record_outcomes(
            &[OutcomeToRecord {
                lease: &lease,
                decision: &decision,
                attempt: &attempt,
            }],
            Duration::from_secs(60),
            LedgerTime::Database,
        )
        .await
        .unwrap();
    assert_eq!(
        ledger.delivery(lease.id).await.unwrap().unwrap().state,
        DeliveryState::Ambiguous
    );
    lease
}

pub(crate) fn twilio_request(
    target: &str,
    params: &[(&str, &str)],
    signature: Option<String>,
) -> Request<Body> {
    let mut form = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in params {
        form.append_pair(k, v);
    }
    let mut r = Request::post(target).header("content-type", "application/x-www-form-urlencoded");
    if let Some(s) = signature {
        r = r.header("x-twilio-signature", s);
    }
    r.body(Body::from(form.finish())).unwrap()
}

pub(crate) fn twilio_signed(target: &str, params: &[(&str, &str)], token: &str) -> Request<Body> {
    let owned: Vec<(String, String)> = params
        .iter()
        .map(|(k, v)| ((*k).into(), (*v).into()))
        .collect();
    let sig = provider_stub::twilio_signature(token, &format!("{BASE}{target}"), &owned);
    twilio_request(target, params, Some(sig))
}

async fn events(ledger: &Ledger) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM provider_events")
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_signed_twilio_delivered_callback_settles_the_ambiguous_delivery_once(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let lease = ambiguous(&ledger, "sms-twilio", Channel::Sms).await;
    let app = app(&ledger);
    let target = format!(
        "/receipts/twilio/sms-twilio?key={}",
        lease.idempotency_key.as_str()
    );
    let params = [
        ("MessageSid", "SM1"),
        ("MessageStatus", "delivered"),
        ("To", "+15550100"),
    ];
    for _ in 0..2 {
        let r = app
            .clone()
            .oneshot(twilio_signed(&target, &params, TOKEN))
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
    }
    let d = ledger.delivery(lease.id).await.unwrap().unwrap();
    assert_eq!(d.state, DeliveryState::Delivered);
    assert_eq!(d.last_error_reason.as_deref(), Some("receipt: delivered"));
    assert_eq!(events(&ledger).await, 1, "the replay recorded nothing");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_unsigned_or_badly_signed_twilio_callback_is_refused_and_writes_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let lease = ambiguous(&ledger, "sms-twilio", Channel::Sms).await;
    let app = app(&ledger);
    let target = format!(
        "/receipts/twilio/sms-twilio?key={}",
        lease.idempotency_key.as_str()
    );
    let params = [("MessageSid", "SM1"), ("MessageStatus", "delivered")];
    let r = app
        .clone()
        .oneshot(twilio_request(&target, &params, None))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let r = app
        .clone()
        .oneshot(twilio_signed(&target, &params, "wrong-token"))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    // Signed for another key: the signature covers the URL.
    let other = "/receipts/twilio/sms-twilio?key=nudge-00000000-0000-0000-0000-000000000000-sms";
    let owned: Vec<(String, String)> = params
        .iter()
        .map(|(k, v)| ((*k).into(), (*v).into()))
        .collect();
    let sig = provider_stub::twilio_signature(TOKEN, &format!("{BASE}{other}"), &owned);
    let r = app
        .clone()
        .oneshot(twilio_request(&target, &params, Some(sig)))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    // An account that takes no receipts looks the same as a bad signature.
    let r = app
        .clone()
        .oneshot(twilio_signed(
            "/receipts/twilio/sms-other?key=x",
            &params,
            TOKEN,
        ))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert_eq!(events(&ledger).await, 0);
    assert_eq!(
        ledger.delivery(lease.id).await.unwrap().unwrap().state,
        DeliveryState::Ambiguous
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_twilio_failure_naming_an_unknown_destination_settles_it_failed_and_flags_the_contact(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let lease = ambiguous(&ledger, "sms-twilio", Channel::Sms).await;
    let app = app(&ledger);
    let target = format!(
        "/receipts/twilio/sms-twilio?key={}",
        lease.idempotency_key.as_str()
    );
    let params = [
        ("MessageSid", "SM1"),
        ("MessageStatus", "undelivered"),
        ("ErrorCode", "30005"),
    ];
    let r = app
        .oneshot(twilio_signed(&target, &params, TOKEN))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let d = ledger.delivery(lease.id).await.unwrap().unwrap();
    assert_eq!(d.state, DeliveryState::DeadLettered);
    assert_eq!(
        d.last_error_reason.as_deref(),
        Some("receipt: undelivered: 30005")
    );
    let invalid: Option<chrono::DateTime<Utc>> =
        sqlx::query_scalar("SELECT invalid_at FROM contacts")
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    assert!(invalid.is_some());
}

fn sendgrid_request(
    body: &str,
    timestamp: i64,
    key: Option<&p256::ecdsa::SigningKey>,
) -> Request<Body> {
    let mut r = Request::post("/receipts/sendgrid/email-sendgrid")
        .header("content-type", "application/json");
    if let Some(key) = key {
        let ts = timestamp.to_string();
        r = r
            .header(
                provider_stub::SIGNATURE_HEADER,
                provider_stub::sendgrid_signature(key, &ts, body.as_bytes()),
            )
            .header(provider_stub::TIMESTAMP_HEADER, ts);
    }
    r.body(Body::from(body.to_owned())).unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_signed_sendgrid_bounce_settles_the_ambiguous_delivery_failed_and_flags_the_contact(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let lease = ambiguous(&ledger, "email-sendgrid", Channel::Email).await;
    let app = app(&ledger);
    let body = serde_json::json!([
        {"email": "x@example.org", "event": "processed", "sg_event_id": "e1", "sg_message_id": "m1.filter", "nudge_key": lease.idempotency_key.as_str()},
        {"email": "x@example.org", "event": "bounce", "type": "bounce", "sg_event_id": "e2", "sg_message_id": "m1.filter", "nudge_key": lease.idempotency_key.as_str()}
    ])
    .to_string();
    let now = Utc::now().timestamp();
    // Unsigned, signed by another key, or stale: refused, nothing written.
    let r = app
        .clone()
        .oneshot(sendgrid_request(&body, now, None))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let other = p256::ecdsa::SigningKey::from_bytes(&[6u8; 32].into()).unwrap();
    let r = app
        .clone()
        .oneshot(sendgrid_request(&body, now, Some(&other)))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let r = app
        .clone()
        .oneshot(sendgrid_request(&body, now - 3_600, Some(&signing_key())))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert_eq!(events(&ledger).await, 0);

    for _ in 0..2 {
        let r = app
            .clone()
            .oneshot(sendgrid_request(&body, now, Some(&signing_key())))
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
    }
    assert_eq!(events(&ledger).await, 2, "two events, recorded once each");
    let d = ledger.delivery(lease.id).await.unwrap().unwrap();
    assert_eq!(d.state, DeliveryState::DeadLettered);
    assert_eq!(d.last_error_reason.as_deref(), Some("receipt: bounce"));
    let invalid: Option<chrono::DateTime<Utc>> =
        sqlx::query_scalar("SELECT invalid_at FROM contacts")
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    assert!(invalid.is_some());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_sendgrid_timestamp_at_either_end_of_the_integers_is_refused_as_stale(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let lease = ambiguous(&ledger, "email-sendgrid", Channel::Email).await;
    let app = app(&ledger);
    let body = serde_json::json!([
        {"email": "x@example.org", "event": "delivered", "sg_event_id": "e1", "sg_message_id": "m1.filter", "nudge_key": lease.idempotency_key.as_str()}
    ])
    .to_string();
    // Signed with the right key: only the freshness check stands between them and the ledger,
    // and its arithmetic must neither overflow nor wrap into "fresh".
    for timestamp in [i64::MIN, i64::MIN + 1, i64::MAX] {
        let r = app
            .clone()
            .oneshot(sendgrid_request(&body, timestamp, Some(&signing_key())))
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::FORBIDDEN, "timestamp {timestamp}");
    }
    assert_eq!(events(&ledger).await, 0);
    assert_eq!(
        ledger.delivery(lease.id).await.unwrap().unwrap().state,
        DeliveryState::Ambiguous
    );
}
