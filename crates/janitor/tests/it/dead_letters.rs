//! The dead-letter recorder against a real RabbitMQ (3.10 here) and a ledger that goes away:
//! a dead letter the ledger cannot take is held, not requeued, so its delivery count does not
//! grow while the ledger is out (on RabbitMQ 4.x a quorum queue drops a message past 20
//! deliveries by default), and it is recorded once the ledger is back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use nudge_broker::lapin::options::BasicPublishOptions;
use nudge_broker::lapin::{BasicProperties, Connection, ConnectionProperties};
use nudge_broker::test_support::{amqp_url, delete_namespace};
use nudge_broker::{Broker, Topology};
use nudge_domain::Channel;
use nudge_janitor::{JanitorMetrics, record_dead_letters};
use nudge_ledger::Ledger;
use nudge_testkit::FaultProxy;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

async fn recorded(pool: &PgPool) -> Option<i64> {
    sqlx::query_scalar("SELECT delivery_count FROM dead_letters LIMIT 1")
        .fetch_optional(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_dead_letter_is_held_while_the_ledger_is_away_and_recorded_once_it_is_back(pool: PgPool) {
    let options = (*pool.connect_options()).clone();
    let proxy = FaultProxy::start(format!("{}:{}", options.get_host(), options.get_port()))
        .await
        .unwrap();
    let away = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(options.host("127.0.0.1").port(proxy.port()));
    proxy.refuse(true);

    let namespace = format!("t-{}.", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let topology = Topology::new(&namespace, 3).unwrap();
    let broker = Broker::connect(&amqp_url(), Duration::from_secs(10), topology.clone())
        .await
        .unwrap();
    let amqp = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let publisher = amqp.create_channel().await.unwrap();
    publisher
        .basic_publish(
            topology.dead_exchange().into(),
            "sms".into(),
            BasicPublishOptions::default(),
            b"not an envelope",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    let shutdown = CancellationToken::new();
    let recorder = tokio::spawn(record_dead_letters(
        Ledger::from_pool(away),
        broker,
        Channel::Sms,
        Arc::new(JanitorMetrics::new()),
        shutdown.clone(),
    ));
    // Several attempts fail meanwhile (a requeue after each would count one delivery each):
    // wait until the ledger was refused a few times, the recorder retrying between them.
    let deadline = Instant::now() + Duration::from_secs(20);
    while proxy.refused() < 4 {
        assert!(
            Instant::now() < deadline,
            "the recorder never tried the ledger"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(recorded(&pool).await, None, "the ledger was away");
    proxy.refuse(false);

    let deadline = Instant::now() + Duration::from_secs(20);
    let count = loop {
        if let Some(count) = recorded(&pool).await {
            break Some(count);
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    shutdown.cancel();
    recorder.await.unwrap();
    amqp.close(200, "test done".into()).await.unwrap();
    delete_namespace(&topology).await;
    assert_eq!(
        count,
        Some(0),
        "recorded once the ledger was back, never redelivered meanwhile"
    );
}
