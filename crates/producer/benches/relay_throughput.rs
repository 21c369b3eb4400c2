//! How fast the relay moves due work into RabbitMQ: N deliveries due now, no worker, the relay
//! of `nudge-producer` looping `relay_once` until every one is published and confirmed.
//!
//! `cargo bench -p nudge-producer --bench relay_throughput` (optimised build). Needs
//! PostgreSQL (`DATABASE_URL`, the server; a fresh database is created and dropped) and
//! RabbitMQ (`NUDGE_TEST_AMQP_URL`, default the local guest account; a fresh namespace is
//! created and deleted). `RELAY_BENCH_N` (default 20000) and `RELAY_BENCH_BATCH` (default the
//! configured default) change the run. Prints one line of figures.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use chrono::Utc;
use nudge_broker::test_support::delete_namespace;
use nudge_broker::{Broker, Topology};
use nudge_domain::Channel;
use nudge_ledger::Ledger;
use nudge_producer::{ProducerSection, Relay};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() {
    let n: u32 = env_or("RELAY_BENCH_N", 20_000);
    let defaults = ProducerSection::default();
    let batch: u32 = env_or("RELAY_BENCH_BATCH", defaults.batch_size);
    let admin_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let amqp_url = std::env::var("NUDGE_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let db_name = format!("nudge_bench_relay_{id}");
    let admin = sqlx::PgPool::connect(&admin_url).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db_name}")))
        .execute(&admin)
        .await
        .unwrap();
    let db_url = format!("{}/{db_name}", &admin_url[..admin_url.rfind('/').unwrap()]);
    let ledger = Ledger::connect(&nudge_config::DatabaseConfig {
        url: nudge_config::Secret::new(db_url.clone()),
        max_connections: 8,
        acquire_timeout_ms: 10_000,
        ..nudge_config::DatabaseConfig::default()
    })
    .await
    .unwrap();
    ledger.migrate().await.unwrap();
    let tenant = ledger
        .create_tenant(
            "bench",
            &nudge_ledger::Operator::new("ops", Some("test"), Utc::now()).unwrap(),
        )
        .await
        .unwrap();
    // Bulk-inserted rather than imported one by one: the import path is not what is measured.
    let seeded = sqlx::query(
        "WITH r AS (
             INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels,
                                    scheduled_at, expires_at, created_at)
             SELECT gen_random_uuid(), $1, 'bench-' || i, 'sub-' || i, ARRAY['sms'],
                    now() - interval '1 minute', now() + interval '1 hour', now()
             FROM generate_series(1, $2) AS i
             RETURNING id, scheduled_at, expires_at)
         INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
                                 scheduled_at, expires_at, next_attempt_at, created_at, updated_at)
         SELECT gen_random_uuid(), r.id, $1, 'sms', 'scheduled', 'nudge-' || r.id || '-sms',
                r.scheduled_at, r.expires_at, r.scheduled_at, now(), now()
         FROM r",
    )
    .bind(tenant.id.as_uuid())
    .bind(i64::from(n))
    .execute(ledger.pool())
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(seeded, u64::from(n));
    sqlx::query("ANALYZE deliveries")
        .execute(ledger.pool())
        .await
        .unwrap();

    let topology = Topology::new(&format!("bench-{id}."), 5).unwrap();
    let broker = Broker::connect(&amqp_url, Duration::from_secs(10), topology.clone())
        .await
        .unwrap();
    let settings = ProducerSection {
        batch_size: batch,
        max_in_flight_per_channel: n,
        ..defaults
    };
    let mut relay = Relay::new(ledger.clone(), broker.clone(), settings);
    let started = Instant::now();
    let mut published = 0;
    let mut passes = 0;
    while published < n as usize {
        let report = relay
            .relay_once(nudge_ledger::LedgerTime::Database)
            .await
            .unwrap();
        assert_eq!(report.failed, 0, "{report:?}");
        published += report.published;
        passes += 1;
    }
    let took = started.elapsed();
    let ready = broker.ready_messages(Channel::Sms).await.unwrap();
    println!(
        "relay_throughput: n={n} batch={batch} passes={passes} took_ms={} published_per_s={:.0} queue_ready={ready}",
        took.as_millis(),
        f64::from(n) / took.as_secs_f64()
    );
    assert_eq!(ready, n, "every published message is in the queue");

    broker.close().await;
    ledger.pool().close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db_name} WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .unwrap();
    delete_namespace(&topology).await;
}
