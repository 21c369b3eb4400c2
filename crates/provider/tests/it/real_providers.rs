//! The Twilio and SendGrid adapters against a real HTTP server on 127.0.0.1 answering canned
//! answers: the request each sends (path, auth, body) and what each answer is read as.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, TimeZone, Utc};
use nudge_config::Secret;
use nudge_domain::{Channel, IdempotencyKey, ProviderAnswer, ReminderId, SendOutcome, Verdict};
use nudge_provider::sendgrid::SendgridKeys;
use nudge_provider::twilio::TwilioKeys;
use nudge_provider::{DynProvider, HttpProviderConfig, ProviderKind, SendRequest, SendWindow};
use serde_json::{Value, json};
use tokio::net::TcpListener;

const SID: &str = "AC0123456789abcdef0123456789abcdef";

#[derive(Clone)]
struct Canned {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: Value,
}

fn canned(status: u16, body: Value) -> Canned {
    Canned {
        status,
        headers: Vec::new(),
        body,
    }
}

#[derive(Clone, Debug)]
struct Seen {
    uri: String,
    headers: HeaderMap,
    body: Bytes,
}

struct Server {
    base: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

async fn server(answer: Canned) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::<Seen>::new()));
    let app = Router::new().fallback({
        let seen = seen.clone();
        move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let seen = seen.clone();
            let answer = answer.clone();
            async move {
                seen.lock().unwrap().push(Seen {
                    uri: uri.to_string(),
                    headers,
                    body,
                });
                let mut response: Response = (
                    StatusCode::from_u16(answer.status).unwrap(),
                    axum::Json(answer.body),
                )
                    .into_response();
                for (name, value) in answer.headers {
                    response.headers_mut().insert(
                        HeaderName::from_static(name),
                        HeaderValue::from_str(&value).unwrap(),
                    );
                }
                response
            }
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    Server { base, seen }
}

fn twilio_config(base: &str) -> HttpProviderConfig {
    let mut cfg = HttpProviderConfig::new("sms-twilio", Channel::Sms, base);
    cfg.kind = ProviderKind::Twilio;
    cfg.twilio = Some(TwilioKeys {
        account_sid: SID.into(),
        auth_token: Secret::new("twilio-token"),
        from: Some("+15550001".into()),
        messaging_service_sid: None,
        status_callback_url: Some("https://intake.example/receipts/twilio/sms-twilio".into()),
    });
    cfg
}

fn sendgrid_config(base: &str) -> HttpProviderConfig {
    let mut cfg = HttpProviderConfig::new("email-sendgrid", Channel::Email, base);
    cfg.kind = ProviderKind::Sendgrid;
    cfg.sendgrid = Some(SendgridKeys::new("SG.secret-key", "clinic@example.org"));
    cfg
}

async fn send(
    p: &dyn DynProvider,
    key: &IdempotencyKey,
    channel: Channel,
    destination: &str,
    content: &Value,
    window: Option<&SendWindow>,
) -> SendOutcome {
    p.send_boxed(SendRequest {
        idempotency_key: key,
        channel,
        destination,
        content: Some(content),
        correlation_id: "corr",
        traceparent: None,
        window,
    })
    .await
}

/// A window whose database clock reads `now`, for a delivery expiring at `expires_at` under a
/// lease that lasts a day.
fn window(now: DateTime<Utc>, expires_at: DateTime<Utc>) -> SendWindow {
    SendWindow::new(
        now,
        expires_at,
        now + chrono::Duration::days(1),
        std::time::Duration::from_secs(1),
    )
}

fn answer_of(outcome: SendOutcome) -> ProviderAnswer {
    match outcome {
        SendOutcome::Answered(a) => a,
        other => panic!("expected an answer, got {other:?}"),
    }
}

fn form(body: &[u8]) -> Vec<(String, String)> {
    url::form_urlencoded::parse(body).into_owned().collect()
}

#[tokio::test]
async fn twilio_gets_a_basic_auth_form_post_with_the_callback_key_and_a_capped_validity() {
    let s = server(canned(201, json!({"sid": "SM0123", "status": "queued"}))).await;
    let p = nudge_provider::build(&twilio_config(&s.base)).unwrap();
    let key = IdempotencyKey::for_delivery(ReminderId::new(), Channel::Sms);
    let now = Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap();
    let a = answer_of(
        send(
            &*p,
            &key,
            Channel::Sms,
            "+15550100",
            &json!({"body": "See you at 9"}),
            // Half a second over two hours: the whole seconds left when the request is built.
            Some(&window(
                now,
                now + chrono::Duration::milliseconds(7_200_500),
            )),
        )
        .await,
    );
    assert_eq!(a.verdict, Verdict::Accepted);
    assert_eq!(a.provider_message_id.as_deref(), Some("SM0123"));

    let seen = s.seen.lock().unwrap()[0].clone();
    assert_eq!(
        seen.uri,
        format!("/2010-04-01/Accounts/{SID}/Messages.json")
    );
    use base64::Engine as _;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{SID}:twilio-token"));
    assert_eq!(
        seen.headers["authorization"],
        format!("Basic {basic}").as_str()
    );
    assert_eq!(
        seen.headers["content-type"],
        "application/x-www-form-urlencoded"
    );
    assert!(
        seen.headers.get("idempotency-key").is_none(),
        "Twilio takes no key"
    );
    let form = form(&seen.body);
    let get = |k: &str| form.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    assert_eq!(get("To"), Some("+15550100"));
    assert_eq!(get("From"), Some("+15550001"));
    assert_eq!(get("Body"), Some("See you at 9"));
    assert_eq!(get("ValidityPeriod"), Some("7200"));
    let callback = url::Url::parse(get("StatusCallback").unwrap()).unwrap();
    assert_eq!(callback.path(), "/receipts/twilio/sms-twilio");
    assert_eq!(
        callback.query_pairs().find(|(k, _)| k == "key").unwrap().1,
        key.as_str()
    );

    // A reminder that lasts longer than Twilio keeps a message is told Twilio's maximum.
    send(
        &*p,
        &key,
        Channel::Sms,
        "+15550100",
        &json!({"body": "x"}),
        Some(&window(now, now + chrono::Duration::days(2))),
    )
    .await;
    let seen = s.seen.lock().unwrap()[1].clone();
    let form = self::form(&seen.body);
    assert!(form.contains(&("ValidityPeriod".into(), "36000".into())));
}

#[tokio::test]
async fn twilio_error_bodies_become_their_verdicts() {
    for (status, body, headers, want) in [
        (
            429,
            json!({"code": 20429, "message": "Too Many Requests", "status": 429}),
            vec![("retry-after", "3".to_owned())],
            Verdict::ThrottledAccount,
        ),
        (
            400,
            json!({"code": 21211, "message": "Invalid 'To' Phone Number", "status": 400}),
            vec![],
            Verdict::ContactInvalid,
        ),
        (
            400,
            json!({"code": 21610, "message": "Attempt to send to unsubscribed recipient", "status": 400}),
            vec![],
            Verdict::ContactOptedOut,
        ),
        (
            401,
            json!({"code": 20003, "message": "Authenticate", "status": 401}),
            vec![],
            Verdict::AuthFailure,
        ),
        (502, json!({}), vec![], Verdict::MaybeSent),
        (
            400,
            json!({"code": 21602, "message": "Message body is required.", "status": 400}),
            vec![],
            Verdict::Rejected,
        ),
    ] {
        let s = server(Canned {
            status,
            headers,
            body,
        })
        .await;
        let p = nudge_provider::build(&twilio_config(&s.base)).unwrap();
        let key = IdempotencyKey::for_delivery(ReminderId::new(), Channel::Sms);
        let a = answer_of(send(&*p, &key, Channel::Sms, "+15550100", &json!({}), None).await);
        assert_eq!(a.verdict, want, "{status}");
        if status == 429 {
            assert_eq!(a.retry_after.as_deref(), Some("3"));
            assert_eq!(a.code.unwrap().as_str(), "20429");
        }
    }
}

#[tokio::test]
async fn sendgrid_gets_a_bearer_json_mail_with_the_key_in_custom_args_and_its_id_is_kept() {
    let mut answer = canned(202, Value::Null);
    answer
        .headers
        .push(("x-message-id", "14c5d75ce93.dfd.64b469".into()));
    let s = server(answer).await;
    let p = nudge_provider::build(&sendgrid_config(&s.base)).unwrap();
    let key = IdempotencyKey::for_delivery(ReminderId::new(), Channel::Email);
    let a = answer_of(
        send(
            &*p,
            &key,
            Channel::Email,
            "patient@example.org",
            &json!({"subject": "Your appointment", "body": "Tomorrow at 9"}),
            None,
        )
        .await,
    );
    assert_eq!(a.verdict, Verdict::Accepted);
    assert_eq!(
        a.provider_message_id.as_deref(),
        Some("14c5d75ce93.dfd.64b469")
    );
    let seen = s.seen.lock().unwrap()[0].clone();
    assert_eq!(seen.uri, "/v3/mail/send");
    assert_eq!(seen.headers["authorization"], "Bearer SG.secret-key");
    let body: Value = serde_json::from_slice(&seen.body).unwrap();
    assert_eq!(
        body["personalizations"][0]["to"][0]["email"],
        "patient@example.org"
    );
    assert_eq!(body["from"]["email"], "clinic@example.org");
    assert_eq!(body["subject"], "Your appointment");
    assert_eq!(body["content"][0]["value"], "Tomorrow at 9");
    assert_eq!(body["custom_args"]["nudge_key"], key.as_str());
}

#[tokio::test]
async fn a_sendgrid_429_s_reset_time_is_its_retry_after_date() {
    let mut answer = canned(429, json!({"errors": [{"message": "too many requests"}]}));
    answer
        .headers
        .push(("x-ratelimit-reset", "1893456300".into()));
    let s = server(answer).await;
    let p = nudge_provider::build(&sendgrid_config(&s.base)).unwrap();
    let key = IdempotencyKey::for_delivery(ReminderId::new(), Channel::Email);
    let a = answer_of(send(&*p, &key, Channel::Email, "a@example.org", &json!({}), None).await);
    assert_eq!(a.verdict, Verdict::ThrottledAccount);
    assert_eq!(
        a.retry_after.as_deref(),
        Some("Tue, 01 Jan 2030 00:05:00 GMT")
    );
}

#[tokio::test]
async fn a_sendgrid_400_naming_the_recipient_is_an_invalid_contact() {
    let s = server(canned(
        400,
        json!({"errors": [{"message": "Does not contain a valid address.", "field": "personalizations.0.to.0.email"}]}),
    ))
    .await;
    let p = nudge_provider::build(&sendgrid_config(&s.base)).unwrap();
    let key = IdempotencyKey::for_delivery(ReminderId::new(), Channel::Email);
    let a = answer_of(send(&*p, &key, Channel::Email, "nope", &json!({}), None).await);
    assert_eq!(a.verdict, Verdict::ContactInvalid);
}

#[tokio::test]
async fn a_real_provider_s_timeout_after_the_request_left_is_unknown_and_its_refused_connection_never_left()
 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let p = nudge_provider::build(&twilio_config(&closed)).unwrap();
    let key = IdempotencyKey::for_delivery(ReminderId::new(), Channel::Sms);
    assert!(matches!(
        send(&*p, &key, Channel::Sms, "+1", &json!({}), None).await,
        SendOutcome::FailedBeforeSend { .. }
    ));

    // A server that takes the request and never answers.
    let hang = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", hang.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = hang.accept().await {
            held.push(sock);
        }
    });
    let mut cfg = sendgrid_config(&base);
    cfg.timeout_ms = 300;
    cfg.connect_timeout_ms = 100;
    let p = nudge_provider::build(&cfg).unwrap();
    assert!(matches!(
        send(&*p, &key, Channel::Email, "a@example.org", &json!({}), None).await,
        SendOutcome::UnknownAfterSend { .. }
    ));
}

#[test]
fn a_real_provider_s_debug_never_shows_its_credentials() {
    let p = nudge_provider::build(&twilio_config("http://127.0.0.1:9")).unwrap();
    assert_eq!(
        p.idempotency(),
        nudge_domain::IdempotencySupport::NotHonoured
    );
    let cfg = sendgrid_config("http://127.0.0.1:9");
    let s = nudge_provider::build(&cfg).unwrap();
    let _ = s;
    assert!(!format!("{cfg:?}").contains("secret-key"));
}
