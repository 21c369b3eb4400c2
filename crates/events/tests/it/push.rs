//! The push end to end against a real ledger: batches in position order, signed (verified
//! here with the `standardwebhooks` crate), the acknowledged position moved only by a 2xx, a
//! failed batch retried as it was after the endpoint's `Retry-After`, one tenant's hanging
//! endpoint never delaying another's, and refused addresses and redirects named without a
//! request reaching them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nudge_domain::{Channel, TenantId};
use nudge_events::{EventsMetrics, EventsSection, Pusher};
use nudge_ledger::test_support::*;
use nudge_ledger::{Ledger, TenantWebhook, WebhookSecret};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::receiver::{Answer, Receiver, wait_for};

fn section(allow_addresses: &[&str]) -> EventsSection {
    EventsSection {
        poll_interval_ms: 20,
        batch_max: 3,
        lease_s: 10,
        connect_timeout_ms: 1_000,
        request_timeout_ms: 2_000,
        retry_base_ms: 100,
        retry_max_ms: 400,
        allow_http: true,
        allow_addresses: allow_addresses.iter().map(|a| (*a).to_owned()).collect(),
        ..EventsSection::default()
    }
}

/// `n` scheduled events of `tenant`, numbered.
async fn events(owner: &Ledger, tenant: TenantId, prefix: &str, n: usize) {
    for i in 0..n {
        owed(
            owner,
            tenant,
            &format!("{prefix}-{i}"),
            &[Channel::Sms],
            t0(),
        )
        .await;
    }
    owner.sequence_events(10_000).await.unwrap();
}

async fn webhook(owner: &Ledger, tenant: TenantId, url: &str) -> WebhookSecret {
    owner
        .set_tenant_webhook(tenant, url, Some(0), &cipher(), &ops(t0()))
        .await
        .unwrap()
        .secret
        .unwrap()
}

async fn state(owner: &Ledger, tenant: TenantId) -> TenantWebhook {
    owner.tenant_webhook(tenant).await.unwrap().unwrap()
}

struct Running {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    metrics: Arc<EventsMetrics>,
}

impl Running {
    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("the pusher stops within its request timeout")
            .unwrap();
    }

    /// `nudge_events_push_failures_total{class}` as exported.
    fn failures(&self, class: &str) -> u64 {
        let text = self.metrics.encode().unwrap();
        let prefix = format!("nudge_events_push_failures_total{{class=\"{class}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no {prefix} in {text}"))
            .parse()
            .unwrap()
    }
}

/// A pusher connected as `nudge_events`.
async fn start(pool: &PgPool, section: &EventsSection) -> Running {
    let ledger = connected_as(pool, "nudge_events").await;
    let metrics = Arc::new(EventsMetrics::new());
    let pusher = Pusher::new(ledger, cipher(), section, metrics.clone()).unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { pusher.run(stop).await }
    });
    Running {
        stop,
        task,
        metrics,
    }
}

fn verify(secret: &WebhookSecret, received: &crate::receiver::Received) {
    let webhook = standardwebhooks::Webhook::new(secret.expose()).unwrap();
    webhook
        .verify(&received.body, &received.headers)
        .unwrap_or_else(|e| panic!("request {} does not verify: {e:?}", received.id()));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_failed_batch_is_retried_as_it_was_after_retry_after_and_every_event_arrives_in_order(
    pool: PgPool,
) {
    let owner = Ledger::from_pool(pool.clone());
    let tenant = tenant(&owner).await;
    events(&owner, tenant.id, "appt", 7).await;
    let positions: Vec<i64> = owner
        .tenant_events(tenant.id, 0, 100)
        .await
        .unwrap()
        .events
        .iter()
        .map(|e| e.position)
        .collect();
    assert_eq!(positions.len(), 7);
    // The endpoint is down (nothing listens on its port) when the push begins.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let secret = webhook(
        &owner,
        tenant.id,
        &format!("http://127.0.0.1:{port}/events"),
    )
    .await;
    let running = start(&pool, &section(&["127.0.0.0/8"])).await;
    assert!(
        wait_for(Duration::from_secs(10), async || running
            .failures("connect")
            >= 2)
        .await,
        "the push tried the endpoint while it was down"
    );
    let down = state(&owner, tenant.id).await;
    assert_eq!(down.acked_position, 0, "nothing acknowledged while down");
    assert_eq!(
        down.pending_through,
        Some(positions[2]),
        "the first batch is kept"
    );
    assert!(
        down.last_error.as_deref().unwrap().starts_with("connect:"),
        "{down:?}"
    );

    // Up: a 503, then a 429 asking for 1 s, then 2xx for everything.
    let receiver = Receiver::start(port, |n| match n {
        0 => Answer::Status(503),
        1 => Answer::RetryAfter(429, 1),
        _ => Answer::Status(204),
    })
    .await;
    let newest = *positions.last().unwrap();
    assert!(
        wait_for(Duration::from_secs(30), async || {
            state(&owner, tenant.id).await.acked_position == newest
        })
        .await,
        "every event acknowledged: {:?}",
        state(&owner, tenant.id).await
    );
    assert_eq!(running.failures("server_error"), 1);
    assert_eq!(running.failures("throttled"), 1);
    running.stop().await;
    let received = receiver.received();
    assert!(
        received.len() >= 5,
        "503, 429, then three batches: {}",
        received.len()
    );
    // The 503 and the 429 were for the first batch, retried as it was.
    let (first, throttled, accepted) = (&received[0], &received[1], &received[2]);
    assert_eq!(
        (first.status, throttled.status, accepted.status),
        (503, 429, 204)
    );
    assert_eq!(first.id(), throttled.id());
    assert_eq!(first.id(), accepted.id());
    assert_eq!(
        first.body, accepted.body,
        "a retry is byte for byte the batch"
    );
    assert_eq!(accepted.positions(), positions[..3].to_vec());
    // Retry-After: 1 honoured (the pusher's poll is 20 ms; 50 ms of tolerance for the clocks
    // of two tasks), and not overshot by more than 2 s.
    let waited = accepted.at - throttled.at;
    assert!(
        waited >= Duration::from_millis(950) && waited < Duration::from_secs(3),
        "waited {waited:?} after Retry-After: 1"
    );
    // Every acknowledged batch in position order, every event exactly once among them.
    let delivered: Vec<i64> = received
        .iter()
        .filter(|r| r.status / 100 == 2)
        .flat_map(|r| r.positions())
        .collect();
    assert_eq!(delivered, positions);
    for r in &received {
        verify(&secret, r);
        let body = r.json();
        assert_eq!(body["type"], "delivery.events");
        assert_eq!(body["data"]["tenant_id"], tenant.id.to_string());
        for event in body["data"]["events"].as_array().unwrap() {
            assert_eq!(event["kind"], "scheduled");
            assert!(event.get("destination").is_none());
        }
    }
    let after = state(&owner, tenant.id).await;
    assert_eq!(
        (after.failures, after.pending_through, after.last_error),
        (0, None, None)
    );
    assert_eq!(received.iter().filter(|r| r.status / 100 != 2).count(), 2);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_hanging_endpoint_never_delays_another_tenants_events(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let hanging_tenant = tenant(&owner).await;
    let other = owner.create_tenant("clinic-b", &ops(t0())).await.unwrap();
    let hanging = Receiver::start(0, |_| Answer::Hang).await;
    let healthy = Receiver::start(0, |_| Answer::Status(200)).await;
    webhook(&owner, hanging_tenant.id, &hanging.url("/hook")).await;
    let secret = webhook(&owner, other.id, &healthy.url("/hook")).await;
    let running = start(&pool, &section(&["127.0.0.0/8"])).await;
    // The hanging endpoint's first batch is in flight (held for the 2 s request timeout)...
    events(&owner, hanging_tenant.id, "h", 3).await;
    assert!(
        wait_for(Duration::from_secs(5), async || hanging.received().len()
            == 1)
        .await,
        "the hanging endpoint got its batch"
    );
    // ...when the other tenant's events are written: they arrive at the normal lag.
    let began = Instant::now();
    events(&owner, other.id, "b", 5).await;
    let newest = owner.tenant_events_newest(other.id).await.unwrap();
    assert!(
        wait_for(Duration::from_secs(10), async || {
            state(&owner, other.id).await.acked_position == newest
        })
        .await
    );
    let lag = began.elapsed();
    // The hanging request holds its tenant for 2 s; the other tenant's 5 events (two batches)
    // took a few polls of 20 ms. 1 s of tolerance for a loaded machine, still under the 2 s
    // the hanging request is held.
    assert!(
        lag < Duration::from_secs(1),
        "the other tenant waited {lag:?}"
    );
    assert_eq!(
        hanging.received().len(),
        1,
        "still the one request, hanging"
    );
    assert_eq!(state(&owner, hanging_tenant.id).await.acked_position, 0);
    for r in healthy.received() {
        verify(&secret, &r);
    }
    // The hanging request times out and is recorded as such; its events wait.
    assert!(
        wait_for(Duration::from_secs(10), async || {
            state(&owner, hanging_tenant.id)
                .await
                .last_error
                .is_some_and(|e| e.starts_with("timeout:"))
        })
        .await,
        "{:?}",
        state(&owner, hanging_tenant.id).await
    );
    running.stop().await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn private_link_local_and_loopback_endpoints_are_refused_and_named(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let private = tenant(&owner).await;
    let metadata = owner.create_tenant("clinic-b", &ops(t0())).await.unwrap();
    let named = owner.create_tenant("clinic-c", &ops(t0())).await.unwrap();
    // A live receiver on loopback, reached by name: "localhost" resolves to loopback, which
    // this pusher does not allow, so the receiver must see nothing.
    let receiver = Receiver::start(0, |_| Answer::Status(200)).await;
    webhook(&owner, private.id, "http://10.0.0.1:9/hook").await;
    webhook(
        &owner,
        metadata.id,
        "http://169.254.169.254/latest/meta-data",
    )
    .await;
    webhook(
        &owner,
        named.id,
        &format!("http://localhost:{}/hook", receiver.addr.port()),
    )
    .await;
    for t in [private.id, metadata.id, named.id] {
        events(&owner, t, "x", 1).await;
    }
    let running = start(&pool, &section(&[])).await;
    for (t, range) in [
        (private.id, "private (RFC 1918)"),
        (metadata.id, "link-local (metadata services)"),
        (named.id, "loopback"),
    ] {
        assert!(
            wait_for(Duration::from_secs(10), async || {
                state(&owner, t).await.last_error.is_some()
            })
            .await
        );
        let error = state(&owner, t).await.last_error.unwrap();
        assert!(
            error.starts_with("address_refused:") && error.contains(range),
            "{error}"
        );
    }
    assert!(running.failures("address_refused") >= 3);
    assert_eq!(running.failures("connect"), 0, "no connection was tried");
    running.stop().await;
    assert!(
        receiver.received().is_empty(),
        "nothing reached the loopback receiver"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_redirect_is_not_followed_and_is_named(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let tenant = tenant(&owner).await;
    let target = Receiver::start(0, |_| Answer::Status(200)).await;
    let to = target.url("/elsewhere");
    let redirecting = Receiver::start(0, move |_| Answer::Redirect(to.clone())).await;
    webhook(&owner, tenant.id, &redirecting.url("/hook")).await;
    events(&owner, tenant.id, "r", 2).await;
    let running = start(&pool, &section(&["127.0.0.0/8"])).await;
    assert!(
        wait_for(Duration::from_secs(10), async || {
            state(&owner, tenant.id).await.last_error.is_some()
        })
        .await
    );
    running.stop().await;
    let error = state(&owner, tenant.id).await.last_error.unwrap();
    assert!(
        error.starts_with("redirect_refused:") && error.contains("307"),
        "{error}"
    );
    assert!(!redirecting.received().is_empty());
    assert!(
        target.received().is_empty(),
        "the redirect was not followed"
    );
    assert_eq!(state(&owner, tenant.id).await.acked_position, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_operators_disable_stops_the_push_before_its_next_batch_and_enable_resumes_it(
    pool: PgPool,
) {
    let owner = Ledger::from_pool(pool.clone());
    let tenant = tenant(&owner).await;
    // Each answer takes 300 ms, so the push is mid-stream when the operator acts.
    let receiver = Receiver::start(0, |_| Answer::Slow(200, Duration::from_millis(300))).await;
    let secret = webhook(&owner, tenant.id, &receiver.url("/hook")).await;
    events(&owner, tenant.id, "s", 30).await;
    let running = start(&pool, &section(&["127.0.0.0/8"])).await;
    assert!(
        wait_for(Duration::from_secs(10), async || receiver.received().len()
            >= 2)
        .await
    );
    assert!(
        owner
            .set_tenant_webhook_enabled(tenant.id, false, &ops(t0()))
            .await
            .unwrap()
    );
    let at_disable = receiver.received().len();
    // The request in flight finishes; no batch is sent after it.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let after_disable = receiver.received().len();
    assert!(
        after_disable <= at_disable + 1,
        "{at_disable} then {after_disable}"
    );
    assert!(
        state(&owner, tenant.id).await.acked_position
            < owner.tenant_events_newest(tenant.id).await.unwrap()
    );
    assert!(
        owner
            .set_tenant_webhook_enabled(tenant.id, true, &ops(t0()))
            .await
            .unwrap()
    );
    let newest = owner.tenant_events_newest(tenant.id).await.unwrap();
    assert!(
        wait_for(Duration::from_secs(30), async || {
            state(&owner, tenant.id).await.acked_position == newest
        })
        .await
    );
    running.stop().await;
    let delivered: Vec<i64> = receiver
        .received()
        .iter()
        .flat_map(|r| {
            verify(&secret, r);
            r.positions()
        })
        .collect();
    let all: Vec<i64> = owner
        .tenant_events(tenant.id, 0, 100)
        .await
        .unwrap()
        .events
        .iter()
        .map(|e| e.position)
        .collect();
    assert_eq!(delivered, all, "in order, none skipped, none twice");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_retry_after_of_zero_waits_the_backoffs_base_and_410_disables_at_once(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let eager = tenant(&owner).await;
    let gone = owner.create_tenant("clinic-b", &ops(t0())).await.unwrap();
    let hammered = Receiver::start(0, |n| {
        if n == 0 {
            Answer::RetryAfter(429, 0)
        } else {
            Answer::Status(204)
        }
    })
    .await;
    let leaving = Receiver::start(0, |_| Answer::Status(410)).await;
    webhook(&owner, eager.id, &hammered.url("/hook")).await;
    webhook(&owner, gone.id, &leaving.url("/hook")).await;
    events(&owner, eager.id, "e", 2).await;
    events(&owner, gone.id, "g", 2).await;
    let section = EventsSection {
        retry_base_ms: 1_000,
        retry_max_ms: 2_000,
        ..section(&["127.0.0.0/8"])
    };
    let running = start(&pool, &section).await;
    let newest = owner.tenant_events_newest(eager.id).await.unwrap();
    assert!(
        wait_for(Duration::from_secs(15), async || {
            state(&owner, eager.id).await.acked_position == newest
        })
        .await
    );
    assert!(
        wait_for(Duration::from_secs(10), async || !state(&owner, gone.id)
            .await
            .enabled)
        .await
    );
    running.stop().await;
    let seen = hammered.received();
    let waited = seen[1].at - seen[0].at;
    // At least retry_base_ms (1 s); 50 ms of tolerance for two tasks' clocks.
    assert!(
        waited >= Duration::from_millis(950),
        "retried after {waited:?}"
    );
    let off = state(&owner, gone.id).await;
    assert_eq!(off.disabled_by.as_deref(), Some("failing"));
    assert!(off.last_error.unwrap().starts_with("gone:"));
    assert_eq!(leaving.received().len(), 1, "no retry after 410");
}
