//! Against a real RabbitMQ (`NUDGE_TEST_AMQP_URL`, default the local guest account). Every test
//! works in its own random namespace and a guard deletes that namespace's queues and exchanges
//! when the test ends, also when it fails. Tests that force-close a connection or inspect queue
//! types shell out to `rabbitmqctl`, so they need the broker on this machine.

// Test helpers: a failed unwrap is a failed test, with its location.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use nudge_broker::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use nudge_broker::lapin::types::FieldTable;
use nudge_broker::lapin::{self, Connection, ConnectionProperties};
use nudge_broker::test_support::{Cleanup, amqp_url};
use nudge_broker::{
    Broker, BrokerError, Consumer, Incoming, OutgoingMessage, PublishError, QueueKind, Topology,
    declare,
};
use nudge_domain::Channel;
use nudge_testkit::FaultProxy;
use tokio::time::{Instant, timeout};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Generous: quorum queues on a busy 2-core machine can take a while to answer.
const DEADLINE: Duration = Duration::from_secs(30);
const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// A fresh namespace, its cleanup guard, and a broker connected under a name unique to it.
async fn setup(delivery_limit: u32) -> (Broker, Cleanup, String) {
    let simple = uuid::Uuid::new_v4().simple().to_string();
    let namespace = format!("t-{}.", &simple[..8]);
    let topology = Topology::new(&namespace, delivery_limit).unwrap();
    let cleanup = Cleanup {
        topology: topology.clone(),
    };
    let connection_name = format!("nudge-broker-test {namespace}");
    let broker = Broker::connect_named(&[&amqp_url()], CONNECT_TIMEOUT, topology, &connection_name)
        .await
        .unwrap();
    (broker, cleanup, connection_name)
}

/// A side connection for inspecting and breaking things behind the broker's back.
async fn side_channel() -> (Connection, lapin::Channel) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    (connection, channel)
}

/// Messages ready in a queue; fails if the queue does not exist.
async fn ready_count(channel: &lapin::Channel, queue: &str) -> Result<u32, lapin::Error> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .map(|q| q.message_count())
}

fn message(channel: Channel, n: u32) -> OutgoingMessage {
    OutgoingMessage {
        channel,
        payload: format!("payload-{n}").into_bytes(),
        message_id: format!("m-{n}"),
        correlation_id: format!("c-{n}"),
        traceparent: Some(TRACEPARENT.to_owned()),
    }
}

async fn next_within(consumer: &mut Consumer, wait: Duration) -> Option<Incoming> {
    match timeout(wait, consumer.next()).await {
        Ok(Some(Ok(incoming))) => Some(incoming),
        Ok(Some(Err(error))) => panic!("consumer failed: {error}"),
        Ok(None) => panic!("consumer ended"),
        Err(_elapsed) => None,
    }
}

fn rabbitmqctl(args: &[&str]) -> String {
    let output = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl must be installed for this test");
    assert!(
        output.status.success(),
        "rabbitmqctl {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Force-closes only the connections carrying `connection_name` (other tests share the broker).
/// Returns how many were closed.
fn force_close_connections(connection_name: &str) -> usize {
    // Tab-separated rather than JSON: the JSON formatter prints pids in a form that
    // `close_connection` does not accept.
    let listing = rabbitmqctl(&[
        "list_connections",
        "pid",
        "client_properties",
        "--quiet",
        "--no-table-headers",
    ]);
    let mut closed = 0;
    for line in listing.lines() {
        if let Some((pid, properties)) = line.split_once('\t')
            && properties.contains(connection_name)
        {
            rabbitmqctl(&["close_connection", pid, "test forces a reconnect"]);
            closed += 1;
        }
    }
    closed
}

#[tokio::test]
async fn declaring_the_topology_twice_succeeds_and_makes_quorum_queues() {
    let (broker, _cleanup, _) = setup(5).await;
    let topology = broker.topology().clone();
    let (side, channel) = side_channel().await;
    // `connect` declared once already; twice more on a plain channel must be a no-op.
    declare(&channel, &topology).await.unwrap();
    declare(&channel, &topology).await.unwrap();

    let listing = rabbitmqctl(&[
        "list_queues",
        "name",
        "type",
        "arguments",
        "--formatter",
        "json",
        "--quiet",
    ]);
    let queues: Vec<serde_json::Value> = serde_json::from_str(&listing).unwrap();
    for ch in Channel::ALL {
        for name in [topology.work_queue(ch), topology.dead_queue(ch)] {
            let queue = queues
                .iter()
                .find(|q| q["name"] == name.as_str())
                .unwrap_or_else(|| panic!("{name} not declared"));
            assert_eq!(queue["type"], "quorum", "{name}");
        }
        let work = queues
            .iter()
            .find(|q| q["name"] == topology.work_queue(ch).as_str())
            .unwrap();
        let arguments = work["arguments"].to_string();
        for expected in [
            "x-delivery-limit",
            "x-dead-letter-exchange",
            &topology.dead_exchange(),
            "x-dead-letter-routing-key",
            "x-dead-letter-strategy",
            "at-least-once",
            "x-overflow",
            "reject-publish",
        ] {
            assert!(
                arguments.contains(expected),
                "{expected} missing in {arguments}"
            );
        }
    }
    side.close(200, "done".into()).await.unwrap();
    broker.close().await;
}

#[tokio::test]
async fn a_published_message_arrives_on_its_channels_queue_only_with_its_ids_and_traceparent() {
    let (broker, _cleanup, _) = setup(5).await;
    let publisher = broker.publisher().await.unwrap();
    let results = publisher.publish_batch(&[message(Channel::Sms, 1)]).await;
    assert!(matches!(results.as_slice(), [Ok(())]), "{results:?}");

    let mut consumer = broker
        .consume(QueueKind::Work(Channel::Sms), 10, "test-sms")
        .await
        .unwrap();
    let incoming = next_within(&mut consumer, DEADLINE).await.unwrap();
    assert_eq!(incoming.payload(), b"payload-1");
    assert_eq!(incoming.correlation_id(), Some("c-1"));
    assert_eq!(incoming.message_id(), Some("m-1"));
    assert_eq!(incoming.traceparent(), Some(TRACEPARENT));
    assert!(!incoming.redelivered());
    assert_eq!(incoming.delivery_count(), 0);
    assert_eq!(incoming.death_reason(), None);
    incoming.ack().await.unwrap();

    let (side, channel) = side_channel().await;
    let topology = broker.topology();
    for ch in [Channel::Email, Channel::Push] {
        assert_eq!(
            ready_count(&channel, &topology.work_queue(ch))
                .await
                .unwrap(),
            0
        );
    }
    side.close(200, "done".into()).await.unwrap();
    broker.close().await;
}

#[tokio::test]
async fn a_message_for_a_channel_without_a_queue_is_reported_unroutable_and_others_still_publish() {
    let (broker, _cleanup, _) = setup(5).await;
    let (side, channel) = side_channel().await;
    channel
        .queue_delete(
            broker.topology().work_queue(Channel::Push).into(),
            QueueDeleteOptions::default(),
        )
        .await
        .unwrap();

    let publisher = broker.publisher().await.unwrap();
    let results = publisher
        .publish_batch(&[message(Channel::Push, 1), message(Channel::Sms, 2)])
        .await;
    assert!(
        matches!(results.as_slice(), [Err(PublishError::Unroutable), Ok(())]),
        "{results:?}"
    );
    // The channel is still good for the next batch.
    let again = publisher.publish_batch(&[message(Channel::Email, 3)]).await;
    assert!(matches!(again.as_slice(), [Ok(())]), "{again:?}");
    side.close(200, "done".into()).await.unwrap();
    broker.close().await;
}

#[tokio::test]
async fn dead_lettering_a_message_moves_it_to_the_dead_queue_as_rejected() {
    let (broker, _cleanup, _) = setup(5).await;
    let publisher = broker.publisher().await.unwrap();
    let results = publisher.publish_batch(&[message(Channel::Sms, 1)]).await;
    assert!(matches!(results.as_slice(), [Ok(())]), "{results:?}");

    let mut work = broker
        .consume(QueueKind::Work(Channel::Sms), 1, "test-work")
        .await
        .unwrap();
    let incoming = next_within(&mut work, DEADLINE).await.unwrap();
    incoming.dead_letter().await.unwrap();

    let mut dead = broker
        .consume(QueueKind::Dead(Channel::Sms), 1, "test-dead")
        .await
        .unwrap();
    let dead_letter = next_within(&mut dead, DEADLINE).await.unwrap();
    assert_eq!(dead_letter.payload(), b"payload-1");
    assert_eq!(dead_letter.death_reason().as_deref(), Some("rejected"));
    assert_eq!(
        dead_letter.death_queue(),
        Some(broker.topology().work_queue(Channel::Sms))
    );
    assert_eq!(dead_letter.correlation_id(), Some("c-1"));
    assert_eq!(dead_letter.traceparent(), Some(TRACEPARENT));
    dead_letter.ack().await.unwrap();
    broker.close().await;
}

/// RabbitMQ 3.10 counts every return to the queue (`x-delivery-count`, absent on the first
/// delivery) and dead-letters the message instead of redelivering it once the count would go
/// past the limit: with a limit of 2 the message is delivered 3 times (counts 0, 1, 2) and the
/// third requeue sends it to the dead queue with the reason `delivery_limit`.
#[tokio::test]
async fn a_message_requeued_past_the_delivery_limit_lands_in_the_dead_queue() {
    let (broker, _cleanup, _) = setup(2).await;
    let publisher = broker.publisher().await.unwrap();
    let results = publisher.publish_batch(&[message(Channel::Email, 1)]).await;
    assert!(matches!(results.as_slice(), [Ok(())]), "{results:?}");

    let mut work = broker
        .consume(QueueKind::Work(Channel::Email), 1, "test-work")
        .await
        .unwrap();
    let mut dead = broker
        .consume(QueueKind::Dead(Channel::Email), 1, "test-dead")
        .await
        .unwrap();
    let mut counts = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    let dead_letter = loop {
        tokio::select! {
            next = work.next() => {
                let incoming = next.unwrap().unwrap();
                counts.push((incoming.delivery_count(), incoming.redelivered()));
                incoming.requeue().await.unwrap();
            }
            next = dead.next() => break next.unwrap().unwrap(),
            () = tokio::time::sleep_until(deadline) => panic!("not dead-lettered; deliveries: {counts:?}"),
        }
    };
    assert_eq!(counts, vec![(0, false), (1, true), (2, true)]);
    assert_eq!(
        dead_letter.death_reason().as_deref(),
        Some("delivery_limit")
    );
    assert_eq!(
        dead_letter.death_queue(),
        Some(broker.topology().work_queue(Channel::Email))
    );
    assert_eq!(dead_letter.payload(), b"payload-1");
    dead_letter.ack().await.unwrap();
    // Nothing is left behind in the work queue.
    assert!(
        next_within(&mut work, Duration::from_millis(300))
            .await
            .is_none()
    );
    broker.close().await;
}

#[tokio::test]
async fn after_the_connection_is_forced_closed_the_broker_reconnects_and_redeclares() {
    let (broker, _cleanup, connection_name) = setup(5).await;
    let topology = broker.topology().clone();
    let publisher = broker.publisher().await.unwrap();
    let mut consumer = broker
        .consume(QueueKind::Work(Channel::Push), 10, "test-before")
        .await
        .unwrap();

    // Remove a queue behind the broker's back: only a redeclare after reconnecting restores it.
    let (side, channel) = side_channel().await;
    channel
        .queue_delete(
            topology.work_queue(Channel::Push).into(),
            QueueDeleteOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(force_close_connections(&connection_name), 1);

    // The old consumer ends (an error, or None once cancelled).
    match timeout(DEADLINE, consumer.next()).await {
        Ok(None | Some(Err(_))) => {}
        Ok(Some(Ok(incoming))) => panic!("unexpected delivery {incoming:?}"),
        Err(_) => panic!("the old consumer did not notice the closed connection"),
    }

    // The same publisher recovers on its own: poll until a batch is confirmed.
    let deadline = Instant::now() + DEADLINE;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let results = publisher.publish_batch(&[message(Channel::Push, 1)]).await;
        match results.as_slice() {
            [Ok(())] => break,
            [Err(PublishError::Broker(_))] if Instant::now() < deadline => {}
            other => panic!("publish after reconnect failed: {other:?} (attempt {attempts})"),
        }
    }
    assert!(broker.is_connected().await);
    assert_eq!(
        ready_count(&channel, &topology.work_queue(Channel::Push))
            .await
            .unwrap(),
        1
    );

    let mut consumer = broker
        .consume(QueueKind::Work(Channel::Push), 10, "test-after")
        .await
        .unwrap();
    let incoming = next_within(&mut consumer, DEADLINE).await.unwrap();
    assert_eq!(incoming.correlation_id(), Some("c-1"));
    incoming.ack().await.unwrap();
    side.close(200, "done".into()).await.unwrap();
    broker.close().await;
}

/// `host:port` of the test broker.
fn broker_addr() -> String {
    let url = amqp_url();
    let after_credentials = url.rsplit('@').next().unwrap();
    let without_scheme = after_credentials.trim_start_matches("amqp://");
    without_scheme.split('/').next().unwrap().to_owned()
}

/// The test broker's URL with `proxy` in place of its address.
fn via(proxy: &FaultProxy) -> String {
    amqp_url().replacen(&broker_addr(), &proxy.addr(), 1)
}

#[tokio::test]
async fn with_several_addresses_a_dead_first_node_is_skipped_and_a_lost_node_fails_over_to_the_next()
 {
    let first = FaultProxy::start(broker_addr()).await.unwrap();
    let second = FaultProxy::start(broker_addr()).await.unwrap();
    let simple = uuid::Uuid::new_v4().simple().to_string();
    let topology = Topology::new(&format!("t-{}.", &simple[..8]), 5).unwrap();
    let _cleanup = Cleanup {
        topology: topology.clone(),
    };

    // The first node is down at start-up: the second takes the connection.
    first.refuse(true);
    let urls = [via(&first), via(&second)];
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let broker = Broker::connect_named(&urls, CONNECT_TIMEOUT, topology.clone(), "failover")
        .await
        .unwrap();
    assert_eq!((first.connections(), second.connections()), (0, 1));

    // The second node drops the connection and would take it again at once: the next call
    // reconnects to the node after the one it lost (the first), not to the lost one.
    first.refuse(false);
    assert_eq!(second.cut(), 1);
    let publisher = match timeout(DEADLINE, broker.publisher()).await {
        Ok(Ok(publisher)) => publisher,
        Ok(Err(error)) => panic!("failing over did not give a publisher: {error}"),
        Err(_) => panic!("no publisher within {DEADLINE:?}"),
    };
    let results = publisher.publish_batch(&[message(Channel::Sms, 1)]).await;
    assert!(matches!(results.as_slice(), [Ok(())]), "{results:?}");
    assert_eq!((first.connections(), second.connections()), (1, 0));
    assert!(broker.is_connected().await);
    broker.close().await;
}

#[tokio::test]
async fn a_caller_that_gives_up_on_a_hanging_node_leaves_the_next_reconnect_to_the_node_after_it() {
    let lost = FaultProxy::start(broker_addr()).await.unwrap();
    let hanging = FaultProxy::start(broker_addr()).await.unwrap();
    let healthy = FaultProxy::start(broker_addr()).await.unwrap();
    let simple = uuid::Uuid::new_v4().simple().to_string();
    let topology = Topology::new(&format!("t-{}.", &simple[..8]), 5).unwrap();
    let _cleanup = Cleanup {
        topology: topology.clone(),
    };
    let urls = [via(&lost), via(&hanging), via(&healthy)];
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let broker = Broker::connect_named(&urls, CONNECT_TIMEOUT, topology, "hanging-node")
        .await
        .unwrap();
    assert_eq!(lost.connections(), 1);

    // The node after the lost one takes connections but never answers (a machine gone
    // silent), and the caller's own timeout is shorter than the connect timeout.
    hanging.pause(true);
    lost.refuse(true);
    assert_eq!(lost.cut(), 1);
    let gave_up = timeout(Duration::from_millis(500), broker.publisher()).await;
    assert!(gave_up.is_err(), "the hanging node answered");

    // The next call starts after the hanging node: the healthy one answers within the deadline.
    let publisher = timeout(DEADLINE, broker.publisher())
        .await
        .unwrap()
        .unwrap();
    let results = publisher.publish_batch(&[message(Channel::Sms, 1)]).await;
    assert!(matches!(results.as_slice(), [Ok(())]), "{results:?}");
    assert_eq!(healthy.connections(), 1);
    broker.close().await;
}

#[tokio::test]
async fn concurrent_callers_after_a_drop_share_one_reconnect() {
    let (broker, _cleanup, connection_name) = setup(5).await;
    assert_eq!(force_close_connections(&connection_name), 1);
    let deadline = Instant::now() + DEADLINE;
    while broker.is_connected().await {
        assert!(Instant::now() < deadline, "the drop was never noticed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let consumers = futures_join(
        (0..4)
            .map(|i| {
                let broker = broker.clone();
                tokio::spawn(async move {
                    broker
                        .consume(QueueKind::Work(Channel::Sms), 1, &format!("test-{i}"))
                        .await
                })
            })
            .collect(),
    )
    .await;
    for consumer in consumers {
        consumer.unwrap();
    }
    // One connection, not four.
    let listing = rabbitmqctl(&[
        "list_connections",
        "client_properties",
        "--formatter",
        "json",
        "--quiet",
    ]);
    let connections: Vec<serde_json::Value> = serde_json::from_str(&listing).unwrap();
    let ours = connections
        .iter()
        .filter(|c| {
            c["client_properties"]
                .to_string()
                .contains(&connection_name)
        })
        .count();
    assert_eq!(ours, 1);
    broker.close().await;
}

async fn futures_join<T>(handles: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        out.push(handle.await.unwrap());
    }
    out
}

#[tokio::test]
async fn a_closed_broker_handle_refuses_further_work() {
    let (broker, _cleanup, _) = setup(5).await;
    let publisher = broker.publisher().await.unwrap();
    broker.close().await;
    assert!(matches!(
        broker.consume(QueueKind::Work(Channel::Sms), 1, "t").await,
        Err(BrokerError::Closed)
    ));
    let results = publisher.publish_batch(&[message(Channel::Sms, 1)]).await;
    assert!(
        matches!(
            results.as_slice(),
            [Err(PublishError::Broker(BrokerError::Closed))]
        ),
        "{results:?}"
    );
}

#[tokio::test]
async fn connecting_to_a_closed_port_fails_fast_with_a_clear_error_and_no_password() {
    let topology = Topology::new("t-closed.", 5).unwrap();
    let timeout = Duration::from_secs(2);
    let started = Instant::now();
    let error = Broker::connect("amqp://guest:s3cret@127.0.0.1:1/%2f", timeout, topology)
        .await
        .unwrap_err();
    assert!(started.elapsed() < timeout + Duration::from_millis(500));
    assert!(
        matches!(
            error,
            BrokerError::Connect(_) | BrokerError::ConnectTimeout { .. }
        ),
        "{error:?}"
    );
    let chain = format!("{error} / {:?}", std::error::Error::source(&error));
    assert!(chain.contains("connect"), "{chain}");
    assert!(!chain.contains("s3cret"), "{chain}");
}

#[tokio::test]
async fn a_broker_that_never_answers_fails_after_the_connect_timeout() {
    // Accepts TCP (the kernel backlog does) but never speaks AMQP.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("amqp://guest:s3cret@{}/%2f", listener.local_addr().unwrap());
    let topology = Topology::new("t-silent.", 5).unwrap();
    let started = Instant::now();
    let error = Broker::connect(&url, Duration::from_millis(500), topology)
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(
        matches!(error, BrokerError::ConnectTimeout { .. }),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "could not connect to RabbitMQ within 500 ms"
    );
}

#[tokio::test]
async fn an_unparseable_url_is_refused_without_echoing_it() {
    let topology = Topology::new("t-url.", 5).unwrap();
    let error = Broker::connect("http://guest:s3cret@host", CONNECT_TIMEOUT, topology)
        .await
        .unwrap_err();
    assert!(matches!(error, BrokerError::InvalidUrl), "{error:?}");
    assert!(!error.to_string().contains("s3cret"));
}
