//! `HttpProvider` against real servers on 127.0.0.1: a tiny axum app answering canned responses,
//! raw TCP listeners that misbehave, and the provider stub.

#![allow(clippy::unwrap_used, clippy::expect_used)] // A failed unwrap is a failed test, with its location.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use nudge_config::Secret;
use nudge_domain::{Channel, IdempotencyKey, IdempotencySupport, ReminderId, SendOutcome};
use nudge_provider::{
    DynProvider, HttpProvider, HttpProviderConfig, Provider, SendRequest, reason,
};
use serde_json::{Value, json};
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpListener;

const DESTINATION: &str = "+15550100";

/// One canned answer of the test server.
#[derive(Clone)]
struct Canned {
    status: u16,
    retry_after: Option<HeaderValue>,
    body: Value,
}

impl Canned {
    fn new(status: u16, body: Value) -> Self {
        Self {
            status,
            retry_after: None,
            body,
        }
    }

    fn retry_after(mut self, value: HeaderValue) -> Self {
        self.retry_after = Some(value);
        self
    }
}

/// What the test server saw of one request.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    headers: HeaderMap,
    body: Value,
}

#[derive(Clone)]
struct Server {
    base: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

/// Serves `answers` in order (the last one repeats) on 127.0.0.1:0 at any path.
async fn server(answers: Vec<Canned>) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::<Seen>::new()));
    let answers = Arc::new(answers);
    let app = Router::new().fallback({
        let seen = seen.clone();
        move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let seen = seen.clone();
            let answers = answers.clone();
            async move {
                let n = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(Seen {
                        path: uri.path().to_owned(),
                        headers,
                        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
                    });
                    seen.len() - 1
                };
                let canned = answers[n.min(answers.len() - 1)].clone();
                let mut response: Response = (
                    StatusCode::from_u16(canned.status).unwrap(),
                    axum::Json(canned.body),
                )
                    .into_response();
                if let Some(ra) = canned.retry_after {
                    response.headers_mut().insert("retry-after", ra);
                }
                response
            }
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    Server { base, seen }
}

fn config(base_url: &str) -> HttpProviderConfig {
    let mut cfg = HttpProviderConfig::new("sms-main", Channel::Sms, base_url);
    cfg.timeout_ms = 2_000;
    cfg.connect_timeout_ms = 500;
    cfg
}

fn provider(base_url: &str) -> HttpProvider {
    HttpProvider::new(&config(base_url)).unwrap()
}

fn key() -> IdempotencyKey {
    IdempotencyKey::for_delivery(ReminderId::new(), Channel::Sms)
}

async fn send(p: &HttpProvider, key: &IdempotencyKey, content: Option<&Value>) -> SendOutcome {
    p.send(SendRequest {
        idempotency_key: key,
        channel: Channel::Sms,
        destination: DESTINATION,
        content,
        correlation_id: "corr-1",
        traceparent: None,
        window: None,
    })
    .await
}

fn response(status: u16, retry_after: Option<&str>, id: Option<&str>) -> SendOutcome {
    SendOutcome::Response {
        status,
        retry_after: retry_after.map(str::to_owned),
        provider_message_id: id.map(str::to_owned),
    }
}

#[tokio::test]
async fn a_202_with_an_id_is_a_response_carrying_the_provider_message_id() {
    let s = server(vec![Canned::new(202, json!({"id": "msg_42"}))]).await;
    let outcome = send(&provider(&s.base), &key(), None).await;
    assert_eq!(outcome, response(202, None, Some("msg_42")));
}

#[tokio::test]
async fn a_2xx_without_a_usable_id_is_still_a_response() {
    let s = server(vec![
        Canned::new(200, json!({"status": "queued"})),
        Canned::new(201, json!("not an object")),
        Canned::new(202, json!({"id": ""})),
    ])
    .await;
    let p = provider(&s.base);
    for status in [200, 201, 202] {
        assert_eq!(send(&p, &key(), None).await, response(status, None, None));
    }
}

#[tokio::test]
async fn a_429_passes_every_retry_after_form_through_raw() {
    let forms = [
        "120",
        "Sun, 06 Nov 1994 08:49:37 GMT",
        "Sunday, 06-Nov-94 08:49:37 GMT",
        "Sun Nov  6 08:49:37 1994",
        "soon",
        "-5",
    ];
    let mut answers: Vec<Canned> = forms
        .iter()
        .map(|f| {
            Canned::new(429, json!({"error": "slow down"})).retry_after(HeaderValue::from_static(f))
        })
        .collect();
    answers.push(
        Canned::new(429, json!({})).retry_after(HeaderValue::from_bytes(b"\xff\xfe12").unwrap()),
    );
    answers.push(Canned::new(429, json!({})));
    let s = server(answers).await;
    let p = provider(&s.base);
    let k = key();
    for form in forms {
        assert_eq!(send(&p, &k, None).await, response(429, Some(form), None));
    }
    assert_eq!(
        send(&p, &k, None).await,
        response(429, Some("<non-utf8>"), None)
    );
    assert_eq!(send(&p, &k, None).await, response(429, None, None));
}

#[tokio::test]
async fn a_500_and_a_400_are_responses_without_a_message_id() {
    let s = server(vec![
        Canned::new(500, json!({"id": "ignored"})),
        Canned::new(400, json!({"error": "bad number"})),
        Canned::new(503, json!({})).retry_after(HeaderValue::from_static("30")),
    ])
    .await;
    let p = provider(&s.base);
    assert_eq!(send(&p, &key(), None).await, response(500, None, None));
    assert_eq!(send(&p, &key(), None).await, response(400, None, None));
    assert_eq!(
        send(&p, &key(), None).await,
        response(503, Some("30"), None)
    );
}

#[tokio::test]
async fn every_attempt_sends_the_same_idempotency_key_with_auth_and_correlation_id() {
    let s = server(vec![
        Canned::new(429, json!({})),
        Canned::new(503, json!({})),
        Canned::new(202, json!({"id": "m"})),
    ])
    .await;
    let mut cfg = config(&s.base);
    cfg.auth_token = Some(Secret::new("tok-123"));
    let p = HttpProvider::new(&cfg).unwrap();
    let k = key();
    let content = json!({"template": "appointment", "at": "2026-12-01T09:00:00Z"});
    for _ in 0..3 {
        send(&p, &k, Some(&content)).await;
    }

    let seen = s.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3);
    for req in &seen {
        assert_eq!(req.path, "/v1/messages");
        assert_eq!(req.headers["idempotency-key"], k.as_str());
        assert_eq!(req.headers["authorization"], "Bearer tok-123");
        assert_eq!(req.headers["x-correlation-id"], "corr-1");
        assert_eq!(req.headers["content-type"], "application/json");
        assert_eq!(
            req.body,
            json!({"channel": "sms", "to": DESTINATION, "content": content})
        );
    }
}

#[tokio::test]
async fn without_a_token_no_authorization_is_sent_and_no_content_is_null() {
    let s = server(vec![Canned::new(202, json!({"id": "m"}))]).await;
    let k = key();
    send(&provider(&s.base), &k, None).await;
    let seen = s.seen.lock().unwrap().clone();
    assert!(!seen[0].headers.contains_key("authorization"));
    assert_eq!(seen[0].headers["idempotency-key"], k.as_str());
    assert_eq!(
        seen[0].body,
        json!({"channel": "sms", "to": DESTINATION, "content": null})
    );
}

#[tokio::test]
async fn a_refused_connection_fails_before_send() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let outcome = send(&provider(&format!("http://{addr}")), &key(), None).await;
    assert_eq!(
        outcome,
        SendOutcome::FailedBeforeSend {
            reason: reason::CONNECT_ERROR.into()
        }
    );
}

#[tokio::test]
async fn a_connect_that_never_completes_fails_before_send_with_connect_timeout() {
    // A listener that never accepts, with its accept queue filled: the kernel then drops further
    // SYNs, so the next connect stays pending until the client's connect timeout.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut fillers = Vec::new();
    let mut saturated = false;
    for _ in 0..16 {
        match tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(Ok(stream)) => fillers.push(stream),
            Ok(Err(e)) => panic!("filler connect failed: {e}"),
            Err(_) => {
                saturated = true;
                break;
            }
        }
    }
    assert!(saturated, "the accept queue never filled");

    let mut cfg = config(&format!("http://{addr}"));
    cfg.connect_timeout_ms = 300;
    cfg.timeout_ms = 5_000;
    let p = HttpProvider::new(&cfg).unwrap();
    let start = Instant::now();
    let outcome = send(&p, &key(), None).await;
    assert_eq!(
        outcome,
        SendOutcome::FailedBeforeSend {
            reason: reason::CONNECT_TIMEOUT.into()
        }
    );
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
    drop(listener);
}

/// Accepts connections, reads what arrives, and never answers until the test ends.
async fn silent_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n) = stream.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn a_server_that_accepts_and_never_answers_leaves_the_outcome_unknown_within_the_timeout() {
    let base = silent_server().await;
    let mut cfg = config(&base);
    cfg.timeout_ms = 300;
    cfg.connect_timeout_ms = 100;
    let p = HttpProvider::new(&cfg).unwrap();
    let start = Instant::now();
    let outcome = send(&p, &key(), None).await;
    let elapsed = start.elapsed();
    assert_eq!(
        outcome,
        SendOutcome::UnknownAfterSend {
            reason: reason::TIMEOUT_AFTER_SEND.into()
        }
    );
    assert!(elapsed >= Duration::from_millis(300), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(3), "{elapsed:?}");
}

#[tokio::test]
async fn a_connection_closed_after_the_request_arrived_leaves_the_outcome_unknown() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            // Read the head of the request, then hang up without a word.
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf).await;
            drop(stream);
        }
    });
    let outcome = send(&provider(&format!("http://{addr}")), &key(), None).await;
    assert_eq!(
        outcome,
        SendOutcome::UnknownAfterSend {
            reason: reason::RESET_AFTER_SEND.into()
        }
    );
}

/// The provider stub in-process, for the end-to-end shapes of retries and dedup.
async fn stub() -> (String, provider_stub::StubState) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let state = provider_stub::StubState::new();
    tokio::spawn(provider_stub::serve(
        listener,
        state.clone(),
        std::future::pending(),
    ));
    (base, state)
}

fn script(v: Value) -> provider_stub::Script {
    serde_json::from_value(v).unwrap()
}

fn account(name: &str) -> nudge_domain::ProviderAccount {
    nudge_domain::ProviderAccount::parse(name).unwrap()
}

#[tokio::test]
async fn a_base_url_with_a_path_prefix_is_joined_with_or_without_a_trailing_slash() {
    let (base, state) = stub().await;
    for url in [
        format!("{base}/accounts/sms-main"),
        format!("{base}/accounts/sms-main/"),
    ] {
        let outcome = send(&provider(&url), &key(), None).await;
        assert!(
            matches!(outcome, SendOutcome::Response { status: 202, .. }),
            "{url}: {outcome:?}"
        );
    }
    assert_eq!(state.stats().accounts["sms-main"].requests, 2);
}

#[tokio::test]
async fn retries_against_the_stub_reuse_the_key_and_a_late_retry_gets_the_same_message_id() {
    let (base, state) = stub().await;
    state.set_script(
        account("sms-main"),
        script(json!({"sequence": [
            {"status": 429, "retry_after": "@http_date+5"},
            {"status": 503},
        ]})),
    );
    let p = provider(&format!("{base}/accounts/sms-main"));
    let k = key();

    let SendOutcome::Response {
        status: 429,
        retry_after: Some(date),
        ..
    } = send(&p, &k, None).await
    else {
        panic!("expected a 429 with a Retry-After")
    };
    assert!(httpdate::parse_http_date(&date).is_ok(), "{date}");
    assert_eq!(send(&p, &k, None).await, response(503, None, None));
    let first = send(&p, &k, None).await;
    let again = send(&p, &k, None).await;
    assert_eq!(first, response(202, None, Some("msg_1")));
    assert_eq!(again, first);

    let report = state.keys();
    let entry = report.get("sms-main", k.as_str()).unwrap();
    let statuses: Vec<u16> = entry.requests.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [429, 503, 202, 202]);
    let stats = state.stats();
    assert_eq!(stats.total.duplicates, 1);
    assert_eq!(stats.total.without_key, 0);
}

#[tokio::test]
async fn a_send_whose_answer_was_lost_is_unknown_and_the_retry_learns_it_went_out() {
    let (base, state) = stub().await;
    state.set_script(
        account("push-main"),
        script(json!({"sequence": [{"status": 202, "hang": true}]})),
    );
    let mut cfg = config(&format!("{base}/accounts/push-main"));
    cfg.channel = Channel::Push;
    cfg.account = "push-main".into();
    cfg.honours_idempotency = true;
    cfg.timeout_ms = 300;
    cfg.connect_timeout_ms = 100;
    let p = HttpProvider::new(&cfg).unwrap();
    assert_eq!(Provider::idempotency(&p), IdempotencySupport::Honoured);
    let k = IdempotencyKey::for_delivery(ReminderId::new(), Channel::Push);

    let lost = send(&p, &k, None).await;
    assert_eq!(
        lost,
        SendOutcome::UnknownAfterSend {
            reason: reason::TIMEOUT_AFTER_SEND.into()
        }
    );
    let retry = send(&p, &k, None).await;
    assert_eq!(retry, response(202, None, Some("msg_1")));
    assert_eq!(state.stats().total.accepted, 1);
}

#[tokio::test]
async fn a_provider_can_be_held_behind_dyn_dispatch() {
    let s = server(vec![Canned::new(202, json!({"id": "m-1"}))]).await;
    let p: Arc<dyn DynProvider> = Arc::new(provider(&s.base));
    assert_eq!(p.account().as_str(), "sms-main");
    assert_eq!(p.idempotency(), IdempotencySupport::NotHonoured);
    let k = key();
    let outcome = p
        .send_boxed(SendRequest {
            idempotency_key: &k,
            channel: Channel::Sms,
            destination: DESTINATION,
            content: None,
            correlation_id: "c",
            traceparent: None,
            window: None,
        })
        .await;
    assert_eq!(outcome, response(202, None, Some("m-1")));
}

#[tokio::test]
async fn debug_output_never_shows_the_token_the_destination_or_the_content() {
    let mut cfg = config("http://127.0.0.1:9/accounts/sms-main");
    cfg.auth_token = Some(Secret::new("tok-secret"));
    let p = HttpProvider::new(&cfg).unwrap();
    let k = key();
    let content = json!({"text": "your appointment"});
    let req = SendRequest {
        idempotency_key: &k,
        channel: Channel::Sms,
        destination: DESTINATION,
        content: Some(&content),
        correlation_id: "c",
        traceparent: None,
        window: None,
    };
    let debug = format!("{p:?} {cfg:?} {req:?}");
    for secret in ["tok-secret", DESTINATION, "appointment"] {
        assert!(!debug.contains(secret), "{secret} in {debug}");
    }
}

#[test]
fn a_bad_config_is_refused_naming_the_key() {
    let mut cfg = config("http://127.0.0.1:9");
    cfg.timeout_ms = 0;
    let err = HttpProvider::new(&cfg).unwrap_err();
    assert!(err.to_string().contains("timeout_ms"), "{err}");
}

#[tokio::test]
async fn a_status_outside_http_is_unknown_after_send_never_a_status_for_the_ledger() {
    // The http crate takes 100..=999; the attempt history holds 100..=599.
    for status in [600, 799, 999] {
        let s = server(vec![Canned::new(status, json!({"id": "m1"}))]).await;
        let p = provider(&s.base);
        let outcome = send(&p, &key(), None).await;
        assert_eq!(
            outcome,
            SendOutcome::UnknownAfterSend {
                reason: "status_out_of_range".into()
            },
            "{status}"
        );
        // Like a malformed or 5xx answer: resent only where the provider dedupes by key.
        assert_eq!(
            nudge_domain::classify(&outcome, IdempotencySupport::Honoured),
            nudge_domain::OutcomeClass::Retryable
        );
        assert_eq!(
            nudge_domain::classify(&outcome, IdempotencySupport::NotHonoured),
            nudge_domain::OutcomeClass::Ambiguous
        );
    }
}

#[tokio::test]
async fn a_send_whose_window_has_closed_is_never_started() {
    let s = server(vec![Canned::new(202, json!({"id": "m1"}))]).await;
    let p = provider(&s.base);
    let k = key();
    let now = chrono::Utc::now();
    // The lease ends in 2.5 s: a 2 s request and the 1 s margin do not fit.
    let window = nudge_provider::SendWindow::new(
        now,
        now + chrono::Duration::hours(1),
        now + chrono::Duration::milliseconds(2_500),
        Duration::from_secs(1),
    );
    let outcome = p
        .send(SendRequest {
            idempotency_key: &k,
            channel: Channel::Sms,
            destination: DESTINATION,
            content: None,
            correlation_id: "corr-1",
            traceparent: None,
            window: Some(&window),
        })
        .await;
    assert_eq!(
        outcome,
        SendOutcome::FailedBeforeSend {
            reason: nudge_provider::SEND_DEADLINE_PASSED.into()
        }
    );
    assert!(!window.started());
    assert!(s.seen.lock().unwrap().is_empty(), "nothing was sent");
}
