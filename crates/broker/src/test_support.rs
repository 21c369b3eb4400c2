//! Fixtures for tests against a real RabbitMQ (`NUDGE_TEST_AMQP_URL`, default the local guest
//! account): each test works in its own namespace, and [`Cleanup`] deletes that namespace's
//! queues and exchanges when the test ends, also when it fails.
//!
//! Compiled only with the `test-support` feature, which the workspace turns on for
//! dev-dependencies alone: it must never be part of a shipped binary. A failed unwrap here is a
//! failed test, with its location.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};
use nudge_domain::Channel;

use crate::Topology;

/// The broker the tests use.
pub fn amqp_url() -> String {
    std::env::var("NUDGE_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// Deletes the namespace's queues and exchanges.
pub async fn delete_namespace(topology: &Topology) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    for ch in Channel::ALL {
        for queue in [topology.work_queue(ch), topology.dead_queue(ch)] {
            channel
                .queue_delete(queue.into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
    }
    for exchange in [topology.work_exchange(), topology.dead_exchange()] {
        channel
            .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
    }
    connection.close(200, "test cleanup".into()).await.unwrap();
}

/// Deletes the namespace's queues and exchanges on drop, on a thread with its own runtime and
/// connection so that it also runs while a failed test unwinds.
#[derive(Debug)]
pub struct Cleanup {
    pub topology: Topology,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let topology = self.topology.clone();
        let joined = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(delete_namespace(&topology));
        })
        .join();
        if joined.is_err() && !std::thread::panicking() {
            panic!("cleaning up the test namespace failed");
        }
    }
}
