//! The Twilio and SendGrid adapters against the provider stub speaking each shape, with a
//! local receiver for the receipts it sends: the two sides of each contract agree, and the
//! receipts arrive signed as the providers sign them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, Uri};
use base64::Engine as _;
use nudge_config::Secret;
use nudge_domain::{Channel, IdempotencyKey, ReminderId, SendOutcome, Verdict};
use nudge_provider::sendgrid::SendgridKeys;
use nudge_provider::twilio::TwilioKeys;
use nudge_provider::{DynProvider, HttpProviderConfig, ProviderKind, SendRequest};
use provider_stub::{Shape, ShapeConfig, StubState};
use serde_json::{Value, json};
use tokio::net::TcpListener;

const SID: &str = "AC0123456789abcdef0123456789abcdef";
const TOKEN: &str = "twilio-token";

#[derive(Clone, Debug)]
struct Received {
    uri: String,
    headers: HeaderMap,
    body: Bytes,
}

/// A receiver of receipts on 127.0.0.1:0; returns its base URL and what it got.
async fn receiver() -> (String, Arc<Mutex<Vec<Received>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let got = Arc::new(Mutex::new(Vec::new()));
    let app = Router::new().fallback({
        let got = got.clone();
        move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let got = got.clone();
            async move {
                got.lock().unwrap().push(Received {
                    uri: uri.to_string(),
                    headers,
                    body,
                });
                ""
            }
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    (base, got)
}

async fn stub(shape: ShapeConfig) -> (String, StubState) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let state = StubState::with_shape(shape);
    tokio::spawn(provider_stub::serve(
        listener,
        state.clone(),
        std::future::pending(),
    ));
    (base, state)
}

async fn wait_for(got: &Arc<Mutex<Vec<Received>>>, n: usize) -> Vec<Received> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let now = got.lock().unwrap().clone();
        if now.len() >= n {
            return now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} receipts after 5 s",
            now.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn script(state: &StubState, account: &str, v: Value) {
    state.set_script(
        nudge_domain::ProviderAccount::parse(account).unwrap(),
        serde_json::from_value(v).unwrap(),
    );
}

async fn send(p: &dyn DynProvider, channel: Channel, to: &str) -> (IdempotencyKey, SendOutcome) {
    let key = IdempotencyKey::for_delivery(ReminderId::new(), channel);
    let content = json!({"body": "hello"});
    let outcome = p
        .send_boxed(SendRequest {
            idempotency_key: &key,
            channel,
            destination: to,
            content: Some(&content),
            correlation_id: "c",
            traceparent: None,
            window: None,
        })
        .await;
    (key, outcome)
}

fn verdict(o: &SendOutcome) -> Option<Verdict> {
    match o {
        SendOutcome::Answered(a) => Some(a.verdict),
        _ => None,
    }
}

#[tokio::test]
async fn the_twilio_shape_answers_what_the_adapter_maps_and_signs_its_callbacks() {
    let (receipts, got) = receiver().await;
    let (base, state) = stub(ShapeConfig {
        twilio_auth_token: Some(TOKEN.into()),
        ..ShapeConfig::new(Shape::Twilio)
    })
    .await;
    let mut cfg = HttpProviderConfig::new(
        "sms-twilio",
        Channel::Sms,
        format!("{base}/accounts/sms-twilio"),
    );
    cfg.kind = ProviderKind::Twilio;
    cfg.twilio = Some(TwilioKeys {
        account_sid: SID.into(),
        auth_token: Secret::new(TOKEN),
        from: Some("+15550001".into()),
        messaging_service_sid: None,
        status_callback_url: Some(format!("{receipts}/receipts/twilio/sms-twilio")),
    });
    let p = nudge_provider::build(&cfg).unwrap();
    let mut verdicts = Vec::new();
    for step in [
        json!({"status": 429, "retry_after": "2"}),
        json!({"status": 400, "code": "21211"}),
        json!({"status": 400, "code": "21610"}),
        json!({"status": 401}),
        json!({"status": 503}),
        json!({"status": 201, "receipt": "undelivered", "code": "30005"}),
    ] {
        script(&state, "sms-twilio", json!({"default": step}));
        let (_, outcome) = send(&*p, Channel::Sms, "+15550100").await;
        verdicts.push(verdict(&outcome));
    }
    assert_eq!(
        verdicts,
        [
            Verdict::ThrottledAccount,
            Verdict::ContactInvalid,
            Verdict::ContactOptedOut,
            Verdict::AuthFailure,
            Verdict::MaybeSent,
            Verdict::Accepted,
        ]
        .map(Some)
    );

    let got = wait_for(&got, 1).await;
    assert_eq!(got.len(), 1, "only the message taken gets a callback");
    let callback = &got[0];
    let url = format!("{receipts}{}", callback.uri);
    let params: Vec<(String, String)> = url::form_urlencoded::parse(&callback.body)
        .into_owned()
        .collect();
    assert_eq!(
        callback.headers["x-twilio-signature"].to_str().unwrap(),
        provider_stub::twilio_signature(TOKEN, &url, &params)
    );
    let get = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(get("MessageStatus").as_deref(), Some("undelivered"));
    assert_eq!(get("ErrorCode").as_deref(), Some("30005"));
    assert_eq!(get("AccountSid").as_deref(), Some(SID));
    assert!(get("MessageSid").unwrap().starts_with("SM"));
    assert!(callback.uri.contains("key=nudge-"), "{}", callback.uri);
}

#[tokio::test]
async fn a_hung_twilio_send_times_out_at_the_adapter_and_its_callback_still_comes() {
    let (receipts, got) = receiver().await;
    let (base, state) = stub(ShapeConfig {
        twilio_auth_token: Some(TOKEN.into()),
        ..ShapeConfig::new(Shape::Twilio)
    })
    .await;
    script(
        &state,
        "sms-twilio",
        json!({"default": {"hang": true, "receipt_delay_ms": 100}}),
    );
    let mut cfg = HttpProviderConfig::new(
        "sms-twilio",
        Channel::Sms,
        format!("{base}/accounts/sms-twilio"),
    );
    cfg.kind = ProviderKind::Twilio;
    // The stub hangs: the answer never comes, so the whole timeout passes. The connect timeout
    // is generous because a loaded machine can take longer than 100 ms to accept on loopback,
    // which would make the send fail before it left instead of after.
    cfg.timeout_ms = 1_500;
    cfg.connect_timeout_ms = 1_000;
    cfg.twilio = Some(TwilioKeys {
        account_sid: SID.into(),
        auth_token: Secret::new(TOKEN),
        from: None,
        messaging_service_sid: Some(format!("MG{}", "a".repeat(32))),
        status_callback_url: Some(format!("{receipts}/cb")),
    });
    let p = nudge_provider::build(&cfg).unwrap();
    let (key, outcome) = send(&*p, Channel::Sms, "+15550100").await;
    assert!(
        matches!(outcome, SendOutcome::UnknownAfterSend { .. }),
        "{outcome:?}"
    );
    let got = wait_for(&got, 1).await;
    assert!(got[0].uri.contains(key.as_str()));
}

#[tokio::test]
async fn the_sendgrid_shape_answers_what_the_adapter_maps_and_signs_its_event_batches() {
    let (receipts, got) = receiver().await;
    let signing = p256::ecdsa::SigningKey::from_bytes(&[7u8; 32].into()).unwrap();
    let (base, state) = stub(ShapeConfig {
        sendgrid_event_url: Some(url::Url::parse(&format!("{receipts}/events")).unwrap()),
        sendgrid_signing_key: Some(signing.clone()),
        ..ShapeConfig::new(Shape::Sendgrid)
    })
    .await;
    let mut cfg = HttpProviderConfig::new(
        "email-sendgrid",
        Channel::Email,
        format!("{base}/accounts/email-sendgrid"),
    );
    cfg.kind = ProviderKind::Sendgrid;
    cfg.sendgrid = Some(SendgridKeys::new("SG.key", "clinic@example.org"));
    let p = nudge_provider::build(&cfg).unwrap();

    let mut verdicts = Vec::new();
    for step in [
        json!({"status": 429, "retry_after": "30"}),
        json!({"status": 400, "code": "invalid_to"}),
        json!({"status": 401}),
        json!({"status": 502}),
        json!({"status": 202, "receipt": "bounce"}),
    ] {
        script(&state, "email-sendgrid", json!({"default": step}));
        let (_, outcome) = send(&*p, Channel::Email, "patient@example.org").await;
        if let SendOutcome::Answered(a) = &outcome
            && a.verdict == Verdict::ThrottledAccount
        {
            let ra = a.retry_after.as_deref().unwrap();
            assert!(
                httpdate::parse_http_date(ra).is_ok(),
                "the reset became a date: {ra}"
            );
        }
        if let SendOutcome::Answered(a) = &outcome
            && a.verdict == Verdict::Accepted
        {
            assert!(
                a.provider_message_id
                    .as_deref()
                    .unwrap()
                    .starts_with("msg_")
            );
        }
        verdicts.push(verdict(&outcome));
    }
    assert_eq!(
        verdicts,
        [
            Verdict::ThrottledAccount,
            Verdict::ContactInvalid,
            Verdict::AuthFailure,
            Verdict::MaybeSent,
            Verdict::Accepted,
        ]
        .map(Some)
    );

    let got = wait_for(&got, 1).await;
    let batch = &got[0];
    let ts = batch.headers["x-twilio-email-event-webhook-timestamp"]
        .to_str()
        .unwrap();
    let sig = batch.headers["x-twilio-email-event-webhook-signature"]
        .to_str()
        .unwrap();
    let der = base64::engine::general_purpose::STANDARD
        .decode(sig)
        .unwrap();
    let sig = p256::ecdsa::Signature::from_der(&der).unwrap();
    let mut signed = ts.as_bytes().to_vec();
    signed.extend_from_slice(&batch.body);
    use p256::ecdsa::signature::Verifier as _;
    p256::ecdsa::VerifyingKey::from(&signing)
        .verify(&signed, &sig)
        .unwrap();
    let events: Value = serde_json::from_slice(&batch.body).unwrap();
    assert_eq!(events[0]["event"], "bounce");
    assert!(
        events[0]["nudge_key"]
            .as_str()
            .unwrap()
            .starts_with("nudge-")
    );
    assert!(!String::from_utf8_lossy(&batch.body).contains("patient@example.org"));
}

#[tokio::test]
async fn a_status_outside_http_from_twilio_or_sendgrid_is_unknown_after_send_without_a_status() {
    // The http crate takes 100..=999; the attempt history holds 100..=599. Neither provider
    // dedupes a resend, so the delivery is held ambiguous, as for a 5xx.
    let unknown = SendOutcome::UnknownAfterSend {
        reason: "status_out_of_range".into(),
    };
    let (twilio_base, twilio) = stub(ShapeConfig {
        twilio_auth_token: Some(TOKEN.into()),
        ..ShapeConfig::new(Shape::Twilio)
    })
    .await;
    let mut cfg = HttpProviderConfig::new(
        "sms-twilio",
        Channel::Sms,
        format!("{twilio_base}/accounts/sms-twilio"),
    );
    cfg.kind = ProviderKind::Twilio;
    cfg.twilio = Some(TwilioKeys {
        account_sid: SID.into(),
        auth_token: Secret::new(TOKEN),
        from: Some("+15550001".into()),
        messaging_service_sid: None,
        status_callback_url: None,
    });
    let twilio_provider = nudge_provider::build(&cfg).unwrap();

    let (sendgrid_base, sendgrid) = stub(ShapeConfig::new(Shape::Sendgrid)).await;
    let mut cfg = HttpProviderConfig::new(
        "email-sendgrid",
        Channel::Email,
        format!("{sendgrid_base}/accounts/email-sendgrid"),
    );
    cfg.kind = ProviderKind::Sendgrid;
    cfg.sendgrid = Some(SendgridKeys::new("SG.key", "clinic@example.org"));
    let sendgrid_provider = nudge_provider::build(&cfg).unwrap();

    for status in [600, 799, 999] {
        script(
            &twilio,
            "sms-twilio",
            json!({"default": {"status": status}}),
        );
        let (_, outcome) = send(&*twilio_provider, Channel::Sms, "+15550100").await;
        assert_eq!(outcome, unknown, "twilio {status}");
        script(
            &sendgrid,
            "email-sendgrid",
            json!({"default": {"status": status}}),
        );
        let (_, outcome) = send(&*sendgrid_provider, Channel::Email, "pat@example.org").await;
        assert_eq!(outcome, unknown, "sendgrid {status}");
    }
}
