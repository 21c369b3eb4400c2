//! Patients' replies through the intake's router (Twilio's incoming-message webhook), against a
//! real database: STOP opts the number out for every tenant sending through the account, START
//! opts it back in, HELP and other words change nothing, and a forged, unsigned or replayed
//! request is refused with nothing written.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use axum::http::StatusCode;
use chrono::Utc;
use nudge_domain::{Channel, ConsentState, ProviderAccount, TenantId};
use nudge_ledger::{Destination, Ledger, LedgerTime, Operator};
use sqlx::PgPool;
use tower::ServiceExt;

use crate::receipts::{GENERIC_SECRET, TOKEN, app, cipher, twilio_request, twilio_signed};

const ACCOUNT: &str = "sms-twilio";
const TARGET: &str = "/inbound/twilio/sms-twilio";
const PATIENT: &str = "+15550100100";

/// Two tenants: `clinic` routed to the account, `other` routed elsewhere.
async fn tenants(ledger: &Ledger) -> (TenantId, TenantId) {
    let op = Operator::new("test", Some("test"), Utc::now()).unwrap();
    let clinic = ledger.create_tenant("clinic", &op).await.unwrap();
    let other = ledger.create_tenant("other", &op).await.unwrap();
    ledger
        .set_tenant_channel_account(
            clinic.id,
            Channel::Sms,
            Some(&ProviderAccount::parse(ACCOUNT).unwrap()),
            &op,
        )
        .await
        .unwrap();
    ledger
        .set_tenant_channel_account(
            other.id,
            Channel::Sms,
            Some(&ProviderAccount::parse("sms-elsewhere").unwrap()),
            &op,
        )
        .await
        .unwrap();
    (clinic.id, other.id)
}

fn message<'a>(sid: &'a str, body: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("MessageSid", sid),
        ("AccountSid", "AC123"),
        ("From", PATIENT),
        ("To", "+15550199999"),
        ("Body", body),
    ]
}

async fn consent(ledger: &Ledger, tenant: TenantId) -> Option<ConsentState> {
    ledger
        .destination_consent(&cipher(), tenant, Channel::Sms, &Destination::new(PATIENT))
        .await
        .unwrap()
        .map(|c| c.state)
}

async fn history(ledger: &Ledger) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM consent_history")
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

async fn send(
    ledger: &Ledger,
    request: axum::http::Request<axum::body::Body>,
) -> (StatusCode, String) {
    let response = app(ledger).oneshot(request).await.unwrap();
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
        .await
        .unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn stop_opts_the_number_out_start_back_in_and_help_changes_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let (clinic, other) = tenants(&ledger).await;

    let (status, body) = send(
        &ledger,
        twilio_signed(TARGET, &message("SM0001", "  stop "), TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("<Response></Response>"), "{body}");
    assert_eq!(consent(&ledger, clinic).await, Some(ConsentState::OptedOut));
    assert_eq!(
        consent(&ledger, other).await,
        None,
        "another account's tenant"
    );

    for (sid, body) in [("SM0002", "HELP"), ("SM0003", "what time is it?")] {
        let (status, _) = send(&ledger, twilio_signed(TARGET, &message(sid, body), TOKEN)).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(consent(&ledger, clinic).await, Some(ConsentState::OptedOut));
    }
    assert_eq!(history(&ledger).await, 1, "HELP and chatter write nothing");

    let (status, _) = send(
        &ledger,
        twilio_signed(TARGET, &message("SM0004", "Unstop"), TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(consent(&ledger, clinic).await, Some(ConsentState::OptedIn));
    let entries = ledger
        .destination_consent_history(&cipher(), clinic, Channel::Sms, &Destination::new(PATIENT))
        .await
        .unwrap();
    let words: Vec<Option<&str>> = entries.iter().map(|e| e.keyword.as_deref()).collect();
    assert_eq!(words, [Some("stop"), Some("Unstop")]);
    let now = ledger.clock(LedgerTime::Database).await.unwrap();
    assert!(entries.iter().all(|e| e.recorded_at <= now));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_forged_unsigned_or_replayed_inbound_message_is_refused_and_writes_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let (clinic, _) = tenants(&ledger).await;

    let (status, body) = send(
        &ledger,
        twilio_request(TARGET, &message("SM0001", "STOP"), None),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    let (status, body) = send(
        &ledger,
        twilio_signed(TARGET, &message("SM0001", "STOP"), "not-the-token"),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    // Signed for another account's URL, sent to this one.
    let (status, _) = send(
        &ledger,
        twilio_signed(
            "/inbound/twilio/unknown-account",
            &message("SM0001", "STOP"),
            TOKEN,
        ),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(history(&ledger).await, 0);
    assert_eq!(consent(&ledger, clinic).await, None);

    let (status, _) = send(
        &ledger,
        twilio_signed(TARGET, &message("SM0001", "STOP"), TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = send(
        &ledger,
        twilio_signed(TARGET, &message("SM0002", "START"), TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(history(&ledger).await, 2);

    // The STOP replayed word for word: refused, the patient stays opted in.
    let (status, body) = send(
        &ledger,
        twilio_signed(TARGET, &message("SM0001", "STOP"), TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(body.contains("replayed"), "{body}");
    assert_eq!(history(&ledger).await, 2);
    assert_eq!(consent(&ledger, clinic).await, Some(ConsentState::OptedIn));

    // Signed, but not an incoming message.
    let (status, _) = send(&ledger, twilio_signed(TARGET, &[("Body", "STOP")], TOKEN)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(history(&ledger).await, 2);
}

const GENERIC: &str = "/inbound/generic/sms-generic";

/// A generic provider's reply, signed with `secret` at `at` (unix seconds) under `id`.
fn generic_request(
    id: &str,
    body: &str,
    secret: &str,
    at: i64,
) -> axum::http::Request<axum::body::Body> {
    let payload =
        serde_json::json!({"from": PATIENT, "to": "+15550199999", "body": body}).to_string();
    let signature = standardwebhooks::Webhook::new(secret)
        .unwrap()
        .sign(id, at, payload.as_bytes())
        .unwrap();
    axum::http::Request::post(GENERIC)
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", at.to_string())
        .header("webhook-signature", signature)
        .body(axum::body::Body::from(payload))
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_generic_providers_signed_reply_changes_consent_as_twilios_does(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let op = Operator::new("test", Some("test"), Utc::now()).unwrap();
    let clinic = ledger.create_tenant("clinic", &op).await.unwrap().id;
    ledger
        .set_tenant_channel_account(
            clinic,
            Channel::Sms,
            Some(&ProviderAccount::parse("sms-generic").unwrap()),
            &op,
        )
        .await
        .unwrap();
    let now = Utc::now().timestamp();

    let (status, body) = send(
        &ledger,
        generic_request("msg_1", " STOP", GENERIC_SECRET, now),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["state"], "opted_out");
    assert_eq!(answer["tenants"], 1);
    assert_eq!(consent(&ledger, clinic).await, Some(ConsentState::OptedOut));

    // The same message again (a provider's retry of a lost answer): acknowledged, nothing
    // changed. Refused, nothing written: a wrong secret, an old or a future signature, an
    // account that takes no replies, a missing header.
    let before = history(&ledger).await;
    let replay = send(
        &ledger,
        generic_request("msg_1", "START", GENERIC_SECRET, now),
    )
    .await;
    assert_eq!(replay.0, StatusCode::OK, "{}", replay.1);
    assert!(replay.1.contains("\"duplicate\":true"), "{}", replay.1);
    let future = send(
        &ledger,
        generic_request("msg_8", "START", GENERIC_SECRET, now + 600),
    )
    .await;
    assert_eq!(future.0, StatusCode::FORBIDDEN);
    let forged = send(
        &ledger,
        generic_request(
            "msg_2",
            "START",
            "whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
            now,
        ),
    )
    .await;
    assert_eq!(forged.0, StatusCode::FORBIDDEN);
    let stale = send(
        &ledger,
        generic_request("msg_3", "START", GENERIC_SECRET, now - 600),
    )
    .await;
    assert_eq!(stale.0, StatusCode::FORBIDDEN);
    let mut elsewhere = generic_request("msg_4", "START", GENERIC_SECRET, now);
    *elsewhere.uri_mut() = "/inbound/generic/sms-other".parse().unwrap();
    assert_eq!(send(&ledger, elsewhere).await.0, StatusCode::FORBIDDEN);
    let mut unsigned = generic_request("msg_5", "START", GENERIC_SECRET, now);
    unsigned.headers_mut().remove("webhook-signature");
    assert_eq!(send(&ledger, unsigned).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(history(&ledger).await, before, "nothing written");
    assert_eq!(consent(&ledger, clinic).await, Some(ConsentState::OptedOut));

    let (status, body) = send(
        &ledger,
        generic_request("msg_6", "help", GENERIC_SECRET, now),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("\"state\":null"), "{body}");
    let (status, _) = send(
        &ledger,
        generic_request("msg_7", "start", GENERIC_SECRET, now),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(consent(&ledger, clinic).await, Some(ConsentState::OptedIn));
    let events: Vec<Option<String>> =
        sqlx::query_scalar("SELECT provider_event FROM consent_history ORDER BY id")
            .fetch_all(ledger.pool())
            .await
            .unwrap();
    assert_eq!(
        events,
        [
            Some("generic:sms-generic:msg_1".to_owned()),
            Some("generic:sms-generic:msg_7".to_owned())
        ]
    );
}
