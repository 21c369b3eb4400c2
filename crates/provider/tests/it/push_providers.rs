//! `FcmProvider` and `ApnsProvider` against the provider stub's FCM and APNs shapes, served
//! in-process on 127.0.0.1: the OAuth flow and the provider token, TLS with HTTP/2 and a trusted
//! authority, and each answer's verdict.

#![allow(clippy::unwrap_used, clippy::expect_used)] // A failed unwrap is a failed test, with its location.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use nudge_config::Secret;
use nudge_domain::{
    Channel, IdempotencyKey, ProviderAccount, ProviderAnswer, ReminderId, SendOutcome, Verdict,
};
use nudge_provider::apns::ApnsProvider;
use nudge_provider::fcm::FcmProvider;
use nudge_provider::{ApnsKeys, FcmKeys, HttpProviderConfig, Provider, ProviderKind, SendRequest};
use provider_stub::{Script, Shape, ShapeConfig, Step, StubState};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const APNS_DEVICE: &str = "00fc13adff785122b4ad28809a3420982341241421348097878e577c991de8f0";

fn account(name: &str) -> ProviderAccount {
    ProviderAccount::parse(name).unwrap()
}

fn message<'a>(key: &'a IdempotencyKey, destination: &'a str) -> SendRequest<'a> {
    SendRequest {
        idempotency_key: key,
        channel: Channel::Push,
        destination,
        content: None,
        correlation_id: "corr-1",
        traceparent: None,
        window: None,
    }
}

fn answered(verdict: Verdict, status: Option<u16>, code: Option<&str>) -> SendOutcome {
    SendOutcome::Answered(ProviderAnswer::new(verdict, status).with_code(code))
}

fn accepted_id(outcome: &SendOutcome) -> Option<&str> {
    match outcome {
        SendOutcome::Answered(ProviderAnswer {
            verdict: Verdict::Accepted,
            provider_message_id,
            ..
        }) => provider_message_id.as_deref(),
        _ => None,
    }
}

fn new_key() -> IdempotencyKey {
    IdempotencyKey::for_delivery(ReminderId::new(), Channel::Push)
}

fn every(step: Step) -> Script {
    Script {
        default: Some(step),
        ..Script::default()
    }
}

struct Stub {
    base: String,
    state: StubState,
    stop: CancellationToken,
    ca_file: Option<PathBuf>,
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(path) = &self.ca_file {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Stub {
    async fn stats<T: serde::de::DeserializeOwned>(
        &self,
        client: &reqwest::Client,
        path: &str,
    ) -> T {
        client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

// ---------------------------------------------------------------- FCM

struct RsaKeys {
    private_pem: String,
    public_pem: String,
}

fn rsa_keys() -> RsaKeys {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256).unwrap();
    RsaKeys {
        private_pem: key.serialize_pem(),
        public_pem: key.public_key_pem(),
    }
}

async fn fcm_stub(public_pem: &str, token_lifetime: Duration) -> Stub {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let mut shape = ShapeConfig::new(Shape::Fcm);
    shape.fcm = Some(
        provider_stub::fcm::FcmShape::from_pem(public_pem.as_bytes(), token_lifetime).unwrap(),
    );
    let state = StubState::with_shape(shape);
    let stop = CancellationToken::new();
    let until = stop.clone();
    tokio::spawn(provider_stub::serve(listener, state.clone(), async move {
        until.cancelled().await;
    }));
    Stub {
        base,
        state,
        stop,
        ca_file: None,
    }
}

fn fcm_config(stub: &Stub, name: &str, private_pem: &str) -> HttpProviderConfig {
    let mut keys = FcmKeys::new(
        "nudge-test",
        "nudge@nudge-test.iam.gserviceaccount.com",
        Secret::new(private_pem),
    );
    keys.token_uri = format!("{}/accounts/{name}/token", stub.base);
    keys.private_key_id = Some("key-1".into());
    let mut cfg = HttpProviderConfig::new(
        name,
        Channel::Push,
        format!("{}/accounts/{name}", stub.base),
    );
    cfg.kind = ProviderKind::Fcm;
    cfg.fcm = Some(keys);
    cfg.timeout_ms = 1_000;
    cfg.connect_timeout_ms = 500;
    cfg.validate("providers.0").unwrap();
    cfg
}

fn fcm(cfg: &HttpProviderConfig) -> FcmProvider {
    FcmProvider::new(cfg).unwrap()
}

#[tokio::test]
async fn concurrent_fcm_sends_share_one_access_token_and_are_accepted_with_their_names() {
    let keys = rsa_keys();
    let stub = fcm_stub(&keys.public_pem, Duration::from_secs(3600)).await;
    let provider = fcm(&fcm_config(&stub, "fcm-main", &keys.private_pem));
    let sends = (0..20).map(|_| {
        let provider = &provider;
        async move {
            let key = new_key();
            let content = json!({"title": "Appointment", "body": "Tomorrow 9:00"});
            let mut msg = message(&key, "fcm-registration-token");
            msg.content = Some(&content);
            provider.send(msg).await
        }
    });
    let outcomes = futures_util::future::join_all(sends).await;
    for o in &outcomes {
        let id = accepted_id(o).unwrap_or_else(|| panic!("{o:?}"));
        assert!(id.starts_with("projects/nudge-test/messages/msg_"), "{id}");
    }
    assert_eq!(provider.access_tokens_fetched(), 1);
    let stats: provider_stub::fcm::FcmStats =
        stub.stats(&reqwest::Client::new(), "/stats/fcm").await;
    assert_eq!(stats.accounts["fcm-main"].tokens_issued, 1);
    assert_eq!(stub.state.stats().accounts["fcm-main"].accepted, 20);
}

#[tokio::test]
async fn an_access_token_is_fetched_again_once_it_is_within_the_margin_of_its_expiry() {
    let keys = rsa_keys();
    // Tokens live 30 s and are replaced 60 s before expiry: each send needs a new one.
    let stub = fcm_stub(&keys.public_pem, Duration::from_secs(30)).await;
    let provider = fcm(&fcm_config(&stub, "fcm-main", &keys.private_pem));
    for _ in 0..3 {
        let key = new_key();
        assert!(accepted_id(&provider.send(message(&key, "tok")).await).is_some());
    }
    assert_eq!(provider.access_tokens_fetched(), 3);
}

#[tokio::test]
async fn an_assertion_signed_with_the_wrong_key_is_an_auth_failure_and_nothing_is_sent() {
    let keys = rsa_keys();
    let other = rsa_keys();
    let stub = fcm_stub(&keys.public_pem, Duration::from_secs(3600)).await;
    let provider = fcm(&fcm_config(&stub, "fcm-main", &other.private_pem));
    let key = new_key();
    assert_eq!(
        provider.send(message(&key, "tok")).await,
        answered(Verdict::AuthFailure, Some(400), Some("token_refused"))
    );
    let stats: provider_stub::fcm::FcmStats =
        stub.stats(&reqwest::Client::new(), "/stats/fcm").await;
    assert_eq!(stats.accounts["fcm-main"].assertions_refused, 1);
    assert_eq!(stub.state.stats().total.requests, 0);
}

#[tokio::test]
async fn each_scripted_fcm_error_gets_its_verdict() {
    let keys = rsa_keys();
    let stub = fcm_stub(&keys.public_pem, Duration::from_secs(3600)).await;
    let cases: Vec<(&str, Step, SendOutcome)> = vec![
        (
            "fcm-gone",
            Step::status(404).unwrap(),
            answered(Verdict::ContactInvalid, Some(404), Some("UNREGISTERED")),
        ),
        (
            "fcm-quota",
            Step::status(429)
                .unwrap()
                .with_retry_after("30".parse().unwrap()),
            SendOutcome::Answered(
                ProviderAnswer::new(Verdict::ThrottledAccount, Some(429))
                    .with_code(Some("QUOTA_EXCEEDED"))
                    .with_retry_after(Some("30".into())),
            ),
        ),
        (
            "fcm-unavailable",
            Step::status(503)
                .unwrap()
                .with_retry_after("7".parse().unwrap()),
            SendOutcome::Answered(
                ProviderAnswer::new(Verdict::RetryLater, Some(503))
                    .with_code(Some("UNAVAILABLE"))
                    .with_retry_after(Some("7".into())),
            ),
        ),
        (
            "fcm-invalid",
            Step::status(400).unwrap(),
            answered(Verdict::Rejected, Some(400), Some("INVALID_ARGUMENT")),
        ),
        (
            "fcm-internal",
            Step::status(500).unwrap(),
            answered(Verdict::MaybeSent, Some(500), Some("INTERNAL")),
        ),
        (
            "fcm-thirdparty",
            Step::status(401).unwrap(),
            answered(
                Verdict::AuthFailure,
                Some(401),
                Some("THIRD_PARTY_AUTH_ERROR"),
            ),
        ),
        (
            "fcm-hang",
            Step {
                hang: true,
                ..Step::default()
            },
            SendOutcome::UnknownAfterSend {
                reason: "timeout_after_send".into(),
            },
        ),
    ];
    for (name, step, want) in cases {
        stub.state.set_script(account(name), every(step));
        let provider = fcm(&fcm_config(&stub, name, &keys.private_pem));
        let key = new_key();
        assert_eq!(provider.send(message(&key, "tok")).await, want, "{name}");
    }
}

#[tokio::test]
async fn a_401_from_fcm_drops_the_access_token_so_the_next_send_fetches_another() {
    let keys = rsa_keys();
    let stub = fcm_stub(&keys.public_pem, Duration::from_secs(3600)).await;
    stub.state.set_script(
        account("fcm-main"),
        Script {
            sequence: vec![Step::status(401).unwrap()],
            ..Script::default()
        },
    );
    let provider = fcm(&fcm_config(&stub, "fcm-main", &keys.private_pem));
    let key = new_key();
    assert_eq!(
        provider.send(message(&key, "tok")).await,
        answered(
            Verdict::AuthFailure,
            Some(401),
            Some("THIRD_PARTY_AUTH_ERROR")
        )
    );
    assert_eq!(provider.access_tokens_fetched(), 1);
    // The same delivery again: its second request is accepted, with a new token.
    assert!(accepted_id(&provider.send(message(&key, "tok")).await).is_some());
    assert_eq!(
        provider.access_tokens_fetched(),
        2,
        "the refused token was not reused"
    );
}

#[tokio::test]
async fn a_payload_over_the_limit_is_refused_and_never_reaches_fcm() {
    let keys = rsa_keys();
    let stub = fcm_stub(&keys.public_pem, Duration::from_secs(3600)).await;
    let provider = fcm(&fcm_config(&stub, "fcm-main", &keys.private_pem));
    let key = new_key();
    let content = json!({"body": "x".repeat(5000)});
    let mut msg = message(&key, "tok");
    msg.content = Some(&content);
    assert_eq!(
        provider.send(msg).await,
        answered(Verdict::Rejected, None, Some("payload_too_large"))
    );
    assert_eq!(stub.state.stats().total.requests, 0);
    assert_eq!(provider.access_tokens_fetched(), 0);
}

#[tokio::test]
async fn a_token_endpoint_that_cannot_be_reached_means_the_push_never_left() {
    let keys = rsa_keys();
    let stub = fcm_stub(&keys.public_pem, Duration::from_secs(3600)).await;
    let mut cfg = fcm_config(&stub, "fcm-main", &keys.private_pem);
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    cfg.fcm.as_mut().unwrap().token_uri = format!("http://{}/token", closed.local_addr().unwrap());
    drop(closed);
    let provider = fcm(&cfg);
    let key = new_key();
    assert_eq!(
        provider.send(message(&key, "tok")).await,
        SendOutcome::FailedBeforeSend {
            reason: "token_unavailable".into()
        }
    );
    assert_eq!(stub.state.stats().total.requests, 0);
}

/// A token endpoint of the test's own on 127.0.0.1 that holds every request until
/// `recovers_at`, then passes it on to `upstream` (the stub's token route). Returns its URL
/// and how many requests it was asked.
async fn hanging_token_endpoint(
    upstream: String,
    recovers_at: tokio::time::Instant,
) -> (String, Arc<AtomicUsize>) {
    let asked = Arc::new(AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/accounts/fcm-main/token",
        listener.local_addr().unwrap()
    );
    let counted = asked.clone();
    let client = reqwest::Client::new();
    let app = axum::Router::new().route(
        "/accounts/fcm-main/token",
        axum::routing::post(move |body: axum::body::Bytes| {
            let (counted, client, upstream) = (counted.clone(), client.clone(), upstream.clone());
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep_until(recovers_at).await;
                let answer = client
                    .post(upstream)
                    .header("content-type", "application/x-www-form-urlencoded")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                let status = answer.status().as_u16();
                let body = answer.bytes().await.unwrap();
                (
                    axum::http::StatusCode::from_u16(status).unwrap(),
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    body,
                )
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, asked)
}

#[tokio::test]
async fn a_failed_token_fetch_answers_every_push_waiting_for_it_at_once() {
    // The token endpoint hangs for 2.5 s, past the account's 1 s timeout, then recovers. The
    // one fetch in flight fails at 1 s, and all 64 pushes waiting for it fail with it: none
    // asks again in turn (which would hold the last for a timeout per push ahead of it and
    // send the rest once the endpoint recovered, long after their fence).
    let keys = rsa_keys();
    let stub = fcm_stub(&keys.public_pem, Duration::from_secs(3600)).await;
    let started = tokio::time::Instant::now();
    let (token_uri, asked) = hanging_token_endpoint(
        format!("{}/accounts/fcm-main/token", stub.base),
        started + Duration::from_millis(2_500),
    )
    .await;
    let mut cfg = fcm_config(&stub, "fcm-main", &keys.private_pem);
    cfg.fcm.as_mut().unwrap().token_uri = token_uri;
    let provider = fcm(&cfg);
    let keys: Vec<IdempotencyKey> = (0..64).map(|_| new_key()).collect();
    let outcomes =
        futures_util::future::join_all(keys.iter().map(|k| provider.send(message(k, "tok")))).await;
    let took = started.elapsed();
    let unavailable = SendOutcome::FailedBeforeSend {
        reason: "token_unavailable".into(),
    };
    assert!(outcomes.iter().all(|o| *o == unavailable), "{outcomes:?}");
    assert_eq!(asked.load(Ordering::SeqCst), 1, "one fetch for all 64");
    assert_eq!(stub.state.stats().total.requests, 0, "no push left");
    // One timeout (1 s) and the sends' own work; 1.2 s of tolerance for a loaded machine,
    // well below the endpoint's recovery at 2.5 s.
    assert!(took < Duration::from_millis(2_200), "took {took:?}");
}

// ---------------------------------------------------------------- APNs

struct EcKeys {
    private_pem: String,
    public_pem: String,
}

fn ec_keys() -> EcKeys {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    EcKeys {
        private_pem: key.serialize_pem(),
        public_pem: key.public_key_pem(),
    }
}

async fn apns_stub(public_pem: &str, min_token_interval: Duration) -> Stub {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("https://{}", listener.local_addr().unwrap());
    let ca_file = std::env::temp_dir().join(format!("nudge-apns-ca-{}.pem", uuid::Uuid::new_v4()));
    let tls = provider_stub::tls::generate(&ca_file).unwrap();
    let mut shape = ShapeConfig::new(Shape::Apns);
    shape.apns = Some(
        provider_stub::apns::ApnsShape::from_pem(public_pem.as_bytes(), min_token_interval)
            .unwrap(),
    );
    let state = StubState::with_shape(shape);
    let stop = CancellationToken::new();
    let until = stop.clone();
    tokio::spawn(provider_stub::serve_tls(
        listener,
        state.clone(),
        tls,
        async move {
            until.cancelled().await;
        },
    ));
    Stub {
        base,
        state,
        stop,
        ca_file: Some(ca_file),
    }
}

fn apns_config(stub: &Stub, name: &str, private_pem: &str) -> HttpProviderConfig {
    let mut keys = ApnsKeys::new(
        "TEAM123456",
        "KEY1234567",
        Secret::new(private_pem),
        "org.example.reminders",
    );
    keys.ca_file = stub.ca_file.clone();
    let mut cfg = HttpProviderConfig::new(
        name,
        Channel::Push,
        format!("{}/accounts/{name}", stub.base),
    );
    cfg.kind = ProviderKind::Apns;
    cfg.apns = Some(keys);
    cfg.timeout_ms = 1_000;
    cfg.connect_timeout_ms = 500;
    cfg.validate("providers.0").unwrap();
    cfg
}

fn apns(cfg: &HttpProviderConfig) -> ApnsProvider {
    ApnsProvider::new(cfg).unwrap()
}

fn apns_client(stub: &Stub) -> reqwest::Client {
    let pem = std::fs::read(stub.ca_file.as_ref().unwrap()).unwrap();
    reqwest::Client::builder()
        .tls_certs_only(reqwest::Certificate::from_pem_bundle(&pem).unwrap())
        .http2_prior_knowledge()
        .build()
        .unwrap()
}

#[tokio::test]
async fn apns_sends_go_over_tls_and_http2_share_one_provider_token_and_echo_the_apns_id() {
    let keys = ec_keys();
    let stub = apns_stub(&keys.public_pem, Duration::from_secs(20 * 60)).await;
    let provider = apns(&apns_config(&stub, "apns-main", &keys.private_pem));
    let sends = (0..20).map(|_| {
        let provider = &provider;
        async move {
            let key = new_key();
            let content = json!({"title": "Appointment", "body": "Tomorrow 9:00"});
            let mut msg = message(&key, APNS_DEVICE);
            msg.content = Some(&content);
            (key.reminder_id(), provider.send(msg).await)
        }
    });
    for (reminder, outcome) in futures_util::future::join_all(sends).await {
        assert_eq!(
            accepted_id(&outcome),
            Some(reminder.as_uuid().hyphenated().to_string().as_str()),
            "{outcome:?}"
        );
    }
    assert_eq!(provider.provider_tokens_made(), 1);
    let stats: provider_stub::apns::ApnsStats =
        stub.stats(&apns_client(&stub), "/stats/apns").await;
    assert_eq!(stats.accounts["apns-main"].provider_tokens, 1);
    assert_eq!(stub.state.stats().accounts["apns-main"].accepted, 20);
}

#[tokio::test]
async fn each_scripted_apns_error_gets_its_verdict() {
    let keys = ec_keys();
    let stub = apns_stub(&keys.public_pem, Duration::ZERO).await;
    let cases: Vec<(&str, Step, SendOutcome)> = vec![
        (
            "apns-gone",
            Step::status(410).unwrap(),
            answered(Verdict::ContactInvalid, Some(410), Some("Unregistered")),
        ),
        (
            "apns-bad-token",
            Step::status(400).unwrap(),
            answered(Verdict::ContactInvalid, Some(400), Some("BadDeviceToken")),
        ),
        (
            "apns-device-busy",
            Step::status(429).unwrap(),
            answered(
                Verdict::ThrottledRecipient,
                Some(429),
                Some("TooManyRequests"),
            ),
        ),
        (
            "apns-auth",
            Step::status(403).unwrap(),
            answered(
                Verdict::AuthFailure,
                Some(403),
                Some("InvalidProviderToken"),
            ),
        ),
        (
            "apns-internal",
            Step::status(500).unwrap(),
            answered(Verdict::MaybeSent, Some(500), Some("InternalServerError")),
        ),
        (
            "apns-hang",
            Step {
                hang: true,
                ..Step::default()
            },
            SendOutcome::UnknownAfterSend {
                reason: "timeout_after_send".into(),
            },
        ),
    ];
    for (name, step, want) in cases {
        stub.state.set_script(account(name), every(step));
        let provider = apns(&apns_config(&stub, name, &keys.private_pem));
        let key = new_key();
        assert_eq!(
            provider.send(message(&key, APNS_DEVICE)).await,
            want,
            "{name}"
        );
    }
}

#[tokio::test]
async fn a_token_signed_with_another_key_is_refused_as_an_auth_failure() {
    let keys = ec_keys();
    let stub = apns_stub(&keys.public_pem, Duration::ZERO).await;
    let other = ec_keys();
    let provider = apns(&apns_config(&stub, "apns-main", &other.private_pem));
    let key = new_key();
    assert_eq!(
        provider.send(message(&key, APNS_DEVICE)).await,
        answered(
            Verdict::AuthFailure,
            Some(403),
            Some("InvalidProviderToken")
        )
    );
    assert_eq!(stub.state.stats().total.requests, 0);
}

#[tokio::test]
async fn a_second_token_within_20_minutes_is_refused_as_too_many_token_updates() {
    let keys = ec_keys();
    let stub = apns_stub(&keys.public_pem, Duration::from_secs(20 * 60)).await;
    // Two providers for one account make two tokens, as two replicas would (another key id,
    // so the tokens differ even when made within the same second).
    let first = apns(&apns_config(&stub, "apns-main", &keys.private_pem));
    let mut cfg = apns_config(&stub, "apns-main", &keys.private_pem);
    cfg.apns.as_mut().unwrap().key_id = "KEY7654321".into();
    let second = apns(&cfg);
    let key = new_key();
    assert!(accepted_id(&first.send(message(&key, APNS_DEVICE)).await).is_some());
    let key = new_key();
    assert_eq!(
        second.send(message(&key, APNS_DEVICE)).await,
        answered(
            Verdict::OwnFault,
            Some(429),
            Some("TooManyProviderTokenUpdates")
        )
    );
}

#[tokio::test]
async fn a_device_token_that_is_not_hex_is_refused_before_sending() {
    let keys = ec_keys();
    let stub = apns_stub(&keys.public_pem, Duration::ZERO).await;
    let provider = apns(&apns_config(&stub, "apns-main", &keys.private_pem));
    let key = new_key();
    assert_eq!(
        provider.send(message(&key, "../../admin/reset")).await,
        answered(Verdict::Rejected, None, Some("invalid_device_token"))
    );
    assert_eq!(stub.state.stats().total.requests, 0);
}

#[tokio::test]
async fn without_the_stub_authority_trusted_the_tls_handshake_fails_before_sending() {
    let keys = ec_keys();
    let stub = apns_stub(&keys.public_pem, Duration::ZERO).await;
    let mut cfg = apns_config(&stub, "apns-main", &keys.private_pem);
    let unrelated =
        std::env::temp_dir().join(format!("nudge-apns-other-{}.pem", uuid::Uuid::new_v4()));
    provider_stub::tls::generate(&unrelated).unwrap();
    cfg.apns.as_mut().unwrap().ca_file = Some(unrelated.clone());
    let provider = apns(&cfg);
    std::fs::remove_file(&unrelated).unwrap();
    let key = new_key();
    assert_eq!(
        provider.send(message(&key, APNS_DEVICE)).await,
        SendOutcome::FailedBeforeSend {
            reason: "connect_error".into()
        }
    );
    assert_eq!(stub.state.stats().total.requests, 0);
}

#[tokio::test]
async fn a_status_outside_http_from_fcm_or_apns_is_unknown_after_send_without_a_status() {
    // The http crate takes 100..=999 (HTTP/2's `:status` too); the attempt history holds
    // 100..=599. Neither provider dedupes a resend, so the delivery is held ambiguous, as for
    // a 5xx.
    let unknown = SendOutcome::UnknownAfterSend {
        reason: "status_out_of_range".into(),
    };
    let rsa = rsa_keys();
    let fcm_stub = fcm_stub(&rsa.public_pem, Duration::from_secs(3600)).await;
    let ec = ec_keys();
    let apns_stub = apns_stub(&ec.public_pem, Duration::ZERO).await;
    for status in [600, 799, 999] {
        let step = every(Step::status(status).unwrap());
        fcm_stub.state.set_script(account("fcm-main"), step.clone());
        let provider = fcm(&fcm_config(&fcm_stub, "fcm-main", &rsa.private_pem));
        let key = new_key();
        assert_eq!(
            provider.send(message(&key, "tok")).await,
            unknown,
            "fcm {status}"
        );

        apns_stub.state.set_script(account("apns-main"), step);
        let provider = apns(&apns_config(&apns_stub, "apns-main", &ec.private_pem));
        let key = new_key();
        assert_eq!(
            provider.send(message(&key, APNS_DEVICE)).await,
            unknown,
            "apns {status}"
        );
    }
    assert_eq!(
        nudge_domain::classify(&unknown, nudge_domain::IdempotencySupport::NotHonoured),
        nudge_domain::OutcomeClass::Ambiguous
    );
}

/// Sends `n` pushes one after the other and returns their verdicts.
async fn verdicts<P: Provider>(provider: &P, device: &str, n: usize) -> Vec<Option<Verdict>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let key = new_key();
        out.push(match provider.send(message(&key, device)).await {
            SendOutcome::Answered(a) => Some(a.verdict),
            _ => None,
        });
    }
    out
}

#[tokio::test]
async fn bad_device_tokens_on_most_of_an_apns_accounts_answers_are_the_accounts_fault() {
    // Sandbox tokens sent to production: every answer is 400 BadDeviceToken. With the
    // defaults (at least 5 such answers, half of the last 50), the first four flag their
    // contacts and every one after is the account's (alert, suspension), not its contacts'.
    let keys = ec_keys();
    let stub = apns_stub(&keys.public_pem, Duration::from_secs(20 * 60)).await;
    stub.state
        .set_script(account("apns-main"), every(Step::status(400).unwrap()));
    let provider = apns(&apns_config(&stub, "apns-main", &keys.private_pem));
    let mut want = vec![Some(Verdict::ContactInvalid); 4];
    want.extend([Some(Verdict::AuthFailure); 4]);
    assert_eq!(verdicts(&provider, APNS_DEVICE, 8).await, want);
    let key = new_key();
    assert_eq!(
        provider.send(message(&key, APNS_DEVICE)).await,
        answered(Verdict::AuthFailure, Some(400), Some("BadDeviceToken"))
    );
}

#[tokio::test]
async fn a_bad_device_token_among_accepted_apns_pushes_stays_the_contacts() {
    // One answer in four is BadDeviceToken: below half of the window, each is one contact's.
    let keys = ec_keys();
    let stub = apns_stub(&keys.public_pem, Duration::from_secs(20 * 60)).await;
    let provider = apns(&apns_config(&stub, "apns-main", &keys.private_pem));
    let mut got = Vec::new();
    for i in 0..24 {
        let step = if i % 4 == 3 {
            Step::status(400).unwrap()
        } else {
            Step::default()
        };
        stub.state.set_script(account("apns-main"), every(step));
        got.extend(verdicts(&provider, APNS_DEVICE, 1).await);
    }
    let invalid = got
        .iter()
        .filter(|v| **v == Some(Verdict::ContactInvalid))
        .count();
    assert_eq!(invalid, 6, "{got:?}");
    assert!(!got.contains(&Some(Verdict::AuthFailure)), "{got:?}");
}

#[tokio::test]
async fn sender_id_mismatch_on_most_of_an_fcm_accounts_answers_is_the_accounts_fault() {
    // Another project's credential: every answer is 403 SENDER_ID_MISMATCH. The defaults, as
    // for APNs: the first four flag their contacts, the rest are the account's.
    let rsa = rsa_keys();
    let stub = fcm_stub(&rsa.public_pem, Duration::from_secs(3600)).await;
    stub.state
        .set_script(account("fcm-main"), every(Step::status(403).unwrap()));
    let provider = fcm(&fcm_config(&stub, "fcm-main", &rsa.private_pem));
    let mut want = vec![Some(Verdict::ContactInvalid); 4];
    want.extend([Some(Verdict::AuthFailure); 4]);
    assert_eq!(verdicts(&provider, "tok", 8).await, want);
    let key = new_key();
    assert_eq!(
        provider.send(message(&key, "tok")).await,
        answered(Verdict::AuthFailure, Some(403), Some("SENDER_ID_MISMATCH"))
    );
}

#[tokio::test]
async fn an_apns_410_flags_the_contact_only_with_apples_reasons_for_it() {
    let keys = ec_keys();
    let stub = apns_stub(&keys.public_pem, Duration::from_secs(20 * 60)).await;
    let provider = apns(&apns_config(&stub, "apns-main", &keys.private_pem));
    for (reason, want) in [
        ("Unregistered", Verdict::ContactInvalid),
        ("ExpiredToken", Verdict::ContactInvalid),
        ("BadTopic", Verdict::Rejected),
        ("SomethingNew", Verdict::Rejected),
    ] {
        let step = Step {
            code: Some(reason.into()),
            ..Step::status(410).unwrap()
        };
        stub.state.set_script(account("apns-main"), every(step));
        assert_eq!(
            verdicts(&provider, APNS_DEVICE, 1).await,
            [Some(want)],
            "410 {reason}"
        );
    }
}
