//! A push's send is bounded by its lease and its expiry, whatever its adapter waits for: FCM
//! pushes through `Worker::lease_step` and `Worker::finish_step` against a real ledger, the
//! provider stub's FCM shape in-process and a token endpoint of the test's own that hangs, then
//! recovers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use nudge_config::Secret;
use nudge_domain::{AdmissionSettings, Channel, DeliveryState, ProviderAccount, RetryPolicy};
use nudge_ledger::test_support::{self, DESTINATION_KEY as KEY, db_now, owed_from};
use nudge_ledger::{DestinationCipher, DueDelivery, Ledger, LedgerTime};
use nudge_provider::{FcmKeys, HttpProviderConfig, ProviderKind};
use nudge_worker::{Inbound, LedgerClock, Processed, Providers, Recorder, Worker, WorkerMetrics};
use provider_stub::{Shape, ShapeConfig, StubState};
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::common::envelope;

const ACCOUNT: &str = "push-fcm";
const PUSHES: usize = 64;

/// A token endpoint that holds every request until `recovers_at`, then passes it to the stub's.
#[derive(Clone)]
struct HangingTokens {
    recovers_at: Instant,
    upstream: String,
    client: reqwest::Client,
    asked: Arc<AtomicUsize>,
}

async fn token(State(t): State<HangingTokens>, body: Bytes) -> Response {
    t.asked.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep_until(t.recovers_at).await;
    let answer = t
        .client
        .post(&t.upstream)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = answer.status();
    let body = answer.bytes().await.unwrap();
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

struct Setup {
    ledger: Ledger,
    pool: PgPool,
    stub: StubState,
    base: String,
    private_pem: String,
}

async fn setup(pool: PgPool) -> Setup {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let mut shape = ShapeConfig::new(Shape::Fcm);
    shape.fcm = Some(
        provider_stub::fcm::FcmShape::from_pem(
            key.public_key_pem().as_bytes(),
            Duration::from_secs(3600),
        )
        .unwrap(),
    );
    let stub = StubState::with_shape(shape);
    tokio::spawn(provider_stub::serve(
        listener,
        stub.clone(),
        std::future::pending(),
    ));
    Setup {
        ledger: Ledger::from_pool(pool.clone()),
        pool,
        stub,
        base,
        private_pem: key.serialize_pem(),
    }
}

/// Starts the hanging token endpoint in front of the stub's, recovering `hang` from now;
/// returns its base URL and its state.
async fn hanging_tokens(setup: &Setup, hang: Duration) -> (String, HangingTokens) {
    let tokens = HangingTokens {
        recovers_at: Instant::now() + hang,
        upstream: format!("{}/accounts/{ACCOUNT}/token", setup.base),
        client: reqwest::Client::new(),
        asked: Arc::default(),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let token_base = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route(
            &format!("/accounts/{ACCOUNT}/token"),
            axum::routing::post(token),
        )
        .with_state(tokens.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (token_base, tokens)
}

/// A push worker on the FCM account, leasing for `lease_for`, whose requests time out after
/// `timeout_ms`.
fn worker(setup: &Setup, token_base: &str, lease_for: Duration, timeout_ms: u64) -> Worker {
    let mut keys = FcmKeys::new(
        "nudge-test",
        "nudge@nudge-test.iam.gserviceaccount.com",
        Secret::new(setup.private_pem.clone()),
    );
    // The assertion's audience is the token URI: the stub checks it ends with the account's
    // token route, which the hanging endpoint keeps.
    keys.token_uri = format!("{token_base}/accounts/{ACCOUNT}/token");
    let mut cfg = HttpProviderConfig::new(
        ACCOUNT,
        Channel::Push,
        format!("{}/accounts/{ACCOUNT}", setup.base),
    );
    cfg.kind = ProviderKind::Fcm;
    cfg.fcm = Some(keys);
    cfg.timeout_ms = timeout_ms;
    cfg.connect_timeout_ms = 500;
    cfg.default_for_channel = true;
    let provider = nudge_provider::build(&cfg).unwrap();
    let clock = Arc::new(LedgerClock::new(Arc::new(Utc::now)));
    let admission = AdmissionSettings::default();
    Worker {
        channel: Channel::Push,
        ledger: setup.ledger.clone(),
        cipher: DestinationCipher::new(&KEY),
        providers: Providers::new(vec![provider], ProviderAccount::parse(ACCOUNT).unwrap()),
        policy: RetryPolicy::default(),
        lease_for,
        account_recheck: Duration::from_secs(30),
        worker_id: format!("test-worker-{}", uuid::Uuid::new_v4().simple()),
        leases: Arc::default(),
        recorder: Recorder::spawn(setup.ledger.clone(), admission.max_pause),
        clock,
        admission,
        metrics: Arc::new(WorkerMetrics::new()),
        shutdown: tokio_util::sync::CancellationToken::new(),
    }
}

/// `n` push reminders due now, each to its own device, the i-th expiring `lasts(i)` from now;
/// materialised and claimed as the relay would.
async fn published(
    ledger: &Ledger,
    n: usize,
    lasts: impl Fn(usize) -> chrono::Duration,
) -> Vec<DueDelivery> {
    for i in 0..n {
        let device = format!("fcm-device-token-{i}");
        test_support::contact(ledger, &format!("patient-{i}"), Channel::Push, &device).await;
    }
    let now = db_now(ledger).await;
    for i in 0..n {
        owed_from(
            ledger,
            now,
            Channel::Push,
            &format!("visit-{i}"),
            &format!("patient-{i}"),
            chrono::Duration::seconds(-1),
            lasts(i),
        )
        .await;
    }
    let claimed = ledger
        .claim_due(Channel::Push, 1000, LedgerTime::Database)
        .await
        .unwrap();
    assert_eq!(claimed.len(), n);
    claimed
}

/// The latest instant a leased delivery may reach its provider: the end of its lease or its
/// expiry, whichever comes first.
async fn send_bound(pool: &PgPool, d: &DueDelivery) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT LEAST(lease_expires_at, expires_at) FROM deliveries WHERE id = $1")
        .bind(d.id.as_uuid())
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_hanging_token_endpoint_starts_no_push_after_its_lease_or_expiry(pool: PgPool) {
    // The token endpoint hangs for 4 s, then answers; the FCM request timeout (10 s) is longer
    // than that, so the held fetch gets its token when the endpoint recovers. Every lease is
    // 3 s; half the pushes expire after 2.5 s. Without a bound, all 64 go out at ~4 s: after
    // their leases (the reaper would hold them `ambiguous`), half after their expiry too.
    let setup = setup(pool).await;
    let deliveries = published(&setup.ledger, PUSHES, |i| {
        if i % 2 == 0 {
            // From publishing: the leases come a moment later, so these end first.
            chrono::Duration::milliseconds(2_500)
        } else {
            chrono::Duration::hours(1)
        }
    })
    .await;
    // The hang starts with the sends, so every lease (3 s) ends inside it.
    let (token_base, tokens) = hanging_tokens(&setup, Duration::from_secs(4)).await;
    let worker = worker(&setup, &token_base, Duration::from_secs(3), 10_000);
    let payloads: Vec<Vec<u8>> = deliveries.iter().map(envelope).collect();
    let inbound: Vec<Inbound<'_>> = payloads
        .iter()
        .map(|p| Inbound {
            payload: p,
            traceparent: None,
        })
        .collect();

    let steps = worker.lease_step(&inbound).await;
    let mut bounds = Vec::with_capacity(PUSHES);
    for d in &deliveries {
        bounds.push(send_bound(&setup.pool, d).await);
    }
    let ends =
        futures_util::future::join_all(steps.into_iter().map(|s| worker.finish_step(s))).await;

    // Every send has finished (sent, or given up): no request can follow.
    let keys = setup.stub.keys();
    let mut late: Vec<String> = Vec::new();
    let mut reached = 0;
    for (d, bound) in deliveries.iter().zip(&bounds) {
        let key = setup
            .ledger
            .delivery(d.id)
            .await
            .unwrap()
            .unwrap()
            .idempotency_key;
        let Some(report) = keys.get(ACCOUNT, key.as_str()) else {
            continue;
        };
        for request in &report.requests {
            reached += 1;
            // The stub's clock and PostgreSQL's are this machine's: no tolerance.
            if request.at > *bound {
                late.push(format!(
                    "{} at {} (bound {})",
                    d.id,
                    request.at.to_rfc3339(),
                    bound.to_rfc3339()
                ));
            }
        }
    }
    assert!(
        late.is_empty(),
        "{} of {reached} FCM requests arrived after their lease or expiry: {late:?}",
        late.len()
    );

    // Never sent, so never "maybe sent": each push failed before its send and waits for its
    // retry (or expired, where the retry would land after its expiry); none was reaped.
    for (d, end) in deliveries.iter().zip(&ends) {
        assert!(
            matches!(
                end,
                Processed::Attempted(DeliveryState::RetryWait | DeliveryState::Expired)
            ),
            "{}: {end:?}",
            d.id
        );
        let record = setup.ledger.delivery(d.id).await.unwrap().unwrap();
        assert_ne!(record.state, DeliveryState::Ambiguous);
        assert_ne!(record.state, DeliveryState::Sending);
    }
    assert_eq!(
        tokens.asked.load(Ordering::SeqCst),
        1,
        "one fetch serves every push waiting for a token"
    );
}
