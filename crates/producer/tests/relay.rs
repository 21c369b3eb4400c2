//! The relay against a fresh database (`#[sqlx::test]`) and the real RabbitMQ
//! (`NUDGE_TEST_AMQP_URL`, default the local guest account), each test in its own broker
//! namespace, deleted when the test ends. No worker consumes: what the relay leaves in a work
//! queue stays there, so its depth is exactly what the relay published.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use chrono::Utc;
use nudge_broker::lapin::options::QueuePurgeOptions;
use nudge_broker::lapin::{Connection, ConnectionProperties};
use nudge_broker::test_support::{Cleanup, amqp_url};
use nudge_broker::{Broker, Topology};
use nudge_domain::{Channel, EventId, SubscriberRef, TenantId};
use nudge_ledger::{DestinationCipher, Ledger, NewReminder, SubscriberKey};
use nudge_producer::{ProducerSection, Relay};
use nudge_testkit::FaultProxy;
use sqlx::PgPool;

/// A fresh namespace whose queues and exchanges are deleted on drop, failed test included.
struct Namespace {
    topology: Topology,
    _cleanup: Cleanup,
}

impl Namespace {
    fn new() -> Self {
        let id = &uuid::Uuid::new_v4().simple().to_string()[..10];
        let topology = Topology::new(&format!("relay-{id}."), 3).unwrap();
        Self {
            _cleanup: Cleanup {
                topology: topology.clone(),
            },
            topology,
        }
    }
}

/// `n` SMS deliveries, due a minute ago.
async fn seed_due_sms(ledger: &Ledger, tenant: TenantId, prefix: &str, n: usize) {
    let cipher =
        DestinationCipher::new(&[7u8; 32]).with_subscriber_key(SubscriberKey::new(&[8u8; 32]));
    let now = Utc::now();
    let at = now - chrono::Duration::minutes(1);
    for i in 0..n {
        let reminder = NewReminder::new(
            tenant,
            EventId::parse(&format!("{prefix}-{i}")).unwrap(),
            SubscriberRef::parse("patient-0001").unwrap(),
            &[Channel::Sms],
            at,
            at + chrono::Duration::hours(1),
        )
        .unwrap();
        let created = ledger
            .create_reminder(&reminder, &cipher, now)
            .await
            .unwrap();
        ledger
            .materialise_reminder(tenant, created.id, now)
            .await
            .unwrap();
    }
}

fn settings(max_in_flight: u32, publish_timeout_ms: u64) -> ProducerSection {
    ProducerSection {
        // Every queued delivery is a republish candidate at once: each pass is a chance to grow.
        republish_after_s: 0,
        publish_timeout_ms,
        min_in_flight_per_channel: 1,
        max_in_flight_per_channel: max_in_flight,
        ..ProducerSection::default()
    }
}

/// The ready messages of `work.sms`, read on a connection of the test's own.
async fn depth(topology: &Topology) -> u32 {
    let broker = Broker::connect(&amqp_url(), Duration::from_secs(10), topology.clone())
        .await
        .unwrap();
    let n = broker.ready_messages(Channel::Sms).await.unwrap();
    broker.close().await;
    n
}

async fn count(ledger: &Ledger, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_long_worker_outage_keeps_the_work_queue_within_the_in_flight_bound_and_lost_messages_are_still_republished(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let ns = Namespace::new();
    let tenant = ledger
        .create_tenant(
            "clinic-a",
            &nudge_ledger::Operator::new("ops", Some("test"), Utc::now()).unwrap(),
        )
        .await
        .unwrap()
        .id;
    seed_due_sms(&ledger, tenant, "outage", 60).await;
    let broker = Broker::connect(&amqp_url(), Duration::from_secs(10), ns.topology.clone())
        .await
        .unwrap();
    let bound = 25;
    let mut relay = Relay::new(ledger.clone(), broker.clone(), settings(bound, 5_000));

    let first = relay
        .relay_once(nudge_ledger::LedgerTime::Database)
        .await
        .unwrap();
    assert_eq!(
        (first.published, first.republished, first.failed),
        (25, 0, 0)
    );

    // No worker: with a republish timeout of 0 every pass finds every queued delivery "not
    // consumed in time", as ten minutes of passes would with the default timeout.
    let mut republished = 0;
    for _ in 0..40 {
        let report = relay
            .relay_once(nudge_ledger::LedgerTime::Database)
            .await
            .unwrap();
        republished += report.republished;
        assert_eq!(report.published, 0, "the in-flight window is full");
        let ready = depth(&ns.topology).await;
        assert!(
            ready <= bound,
            "the queue grew to {ready} past the bound {bound}"
        );
    }
    assert_eq!(
        republished, 0,
        "the queue still held a message per queued delivery"
    );
    assert_eq!(depth(&ns.topology).await, 25);

    // The broker loses the messages (a purge stands in for a restart of a non-durable queue):
    // the next pass republishes exactly what is missing, and no more after that.
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let purged = channel
        .queue_purge(
            ns.topology.work_queue(Channel::Sms).into(),
            QueuePurgeOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(purged, 25);
    let _ = connection.close(200, "purged".into()).await;

    let again = relay
        .relay_once(nudge_ledger::LedgerTime::Database)
        .await
        .unwrap();
    assert_eq!(again.republished, 25);
    let after = relay
        .relay_once(nudge_ledger::LedgerTime::Database)
        .await
        .unwrap();
    assert_eq!(after.republished, 0);
    assert_eq!(depth(&ns.topology).await, 25);
    assert_eq!(
        count(
            &ledger,
            "SELECT count(*) FROM deliveries WHERE state = 'queued'"
        )
        .await,
        25
    );
    broker.close().await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_publish_the_broker_never_confirms_times_out_and_its_batch_is_handed_back_for_a_later_pass(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let ns = Namespace::new();
    let tenant = ledger
        .create_tenant(
            "clinic-a",
            &nudge_ledger::Operator::new("ops", Some("test"), Utc::now()).unwrap(),
        )
        .await
        .unwrap()
        .id;
    // Holds the broker's answers back, as a broker in a memory or disk alarm does.
    let proxy = FaultProxy::start("127.0.0.1:5672").await.unwrap();
    let proxy_url = format!("amqp://guest:guest@{}/%2f", proxy.addr());
    let broker = Broker::connect(&proxy_url, Duration::from_secs(10), ns.topology.clone())
        .await
        .unwrap();
    let publish_timeout = Duration::from_millis(500);
    let mut relay = Relay::new(ledger.clone(), broker.clone(), settings(100, 500));

    seed_due_sms(&ledger, tenant, "before", 10).await;
    let first = relay
        .relay_once(nudge_ledger::LedgerTime::Database)
        .await
        .unwrap();
    assert_eq!((first.published, first.failed), (10, 0));

    // The broker stops answering mid-life: the publisher's open channel gets no confirm.
    seed_due_sms(&ledger, tenant, "during", 10).await;
    proxy.pause(true);
    let started = Instant::now();
    let blocked = tokio::time::timeout(
        Duration::from_secs(20),
        relay.relay_once(nudge_ledger::LedgerTime::Database),
    )
    .await
    .expect("the relay stalled on a broker that does not answer")
    .unwrap();
    let took = started.elapsed();
    assert_eq!((blocked.published, blocked.failed), (0, 10));
    // One publish and one queue-depth read, each bounded by the 500 ms timeout; the rest is
    // tolerance for a busy machine. Without the bound the pass stalls.
    assert!(
        took < publish_timeout * 2 + Duration::from_secs(3),
        "the blocked pass took {took:?}"
    );
    assert_eq!(
        count(
            &ledger,
            "SELECT count(*) FROM deliveries WHERE state = 'queued' AND queued_at = 'epoch'"
        )
        .await,
        10,
        "the unconfirmed batch is handed back to the ledger"
    );

    // The connection is lost for good; the relay reconnects and republishes what is missing.
    proxy.cut();
    proxy.pause(false);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut republished = 0;
    while republished < 10 {
        assert!(
            Instant::now() < deadline,
            "republished only {republished} of 10"
        );
        republished += relay
            .relay_once(nudge_ledger::LedgerTime::Database)
            .await
            .unwrap()
            .republished;
    }
    assert_eq!(republished, 10);
    assert_eq!(depth(&ns.topology).await, 20);
    broker.close().await;
}
