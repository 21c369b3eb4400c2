//! The pipeline end to end: producer, janitor and the three channel workers as separate
//! processes, against real PostgreSQL and RabbitMQ and the provider stub.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::collections::HashMap;
use std::time::Duration;

use chrono::Utc;
use nudge_domain::{Channel, IdempotencyKey};
use nudge_e2e::{TestEnv, WorkerOptions, keys_report, settled, states_in, stats};

fn start_all(env: &mut TestEnv) {
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    for channel in Channel::ALL {
        env.start_worker(
            channel,
            &format!("worker-{channel}"),
            &WorkerOptions::for_channel(channel),
        )
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_reminders_across_three_channels_are_each_delivered_once_and_never_early() {
    let mut env = TestEnv::start("thousand").await.unwrap();
    let tenant = env.tenant("clinic-a", 2).await.unwrap();
    let start = Utc::now() + chrono::Duration::seconds(3);
    let mut scheduled = HashMap::new();
    for i in 0..1000 {
        let channel = Channel::ALL[i % 3];
        let at = start + chrono::Duration::milliseconds((i % 40) as i64 * 100);
        let created = env
            .reminder(
                tenant,
                &format!("evt-{i}"),
                &[channel],
                at,
                at + chrono::Duration::minutes(10),
            )
            .await
            .unwrap();
        scheduled.insert(
            IdempotencyKey::for_delivery(created.id, channel).to_string(),
            at,
        );
    }
    start_all(&mut env);

    let ledger = env.ledger.clone();
    env.wait_for("every delivery to settle", Duration::from_secs(180), || {
        let ledger = ledger.clone();
        async move {
            let states = states_in(&ledger).await?;
            let total: i64 = states.values().sum();
            let live = total - settled(&states);
            Ok((total == 1000 && live == 0).then_some(()))
        }
    })
    .await;

    let states = env.states().await.unwrap();
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    let keys = keys_report(env.stub_keys().await.unwrap()).unwrap();
    eprintln!(
        "e2e thousand: states={states:?} stub requests={} unique_keys={} accepted={} duplicates={}",
        stub.total.requests, stub.total.unique_keys, stub.total.accepted, stub.total.duplicates
    );
    assert_eq!(states.get("delivered"), Some(&1000), "{states:?}");
    assert_eq!(stub.total.accepted, 1000);
    assert_eq!(stub.total.unique_keys, 1000);
    assert_eq!(stub.total.duplicates, 0, "no key was sent twice");
    assert_eq!(
        stub.total.without_key, 0,
        "every request carried its idempotency key"
    );
    let mut early = 0;
    for report in &keys.keys {
        let due = scheduled[&report.key];
        if report.requests.iter().any(|r| r.at < due) {
            early += 1;
        }
    }
    assert_eq!(
        early, 0,
        "no delivery reached the provider before its scheduled_at"
    );
    for channel in Channel::ALL {
        let account = format!("{channel}-main");
        let per = &stub.accounts[&account];
        assert!(
            (333..=334).contains(&per.accepted),
            "{account}: {}",
            per.accepted
        );
    }

    let stopped = env.stop_all(Duration::from_secs(15));
    assert!(
        stopped.iter().all(|(_, code)| *code == Some(0)),
        "graceful exits: {stopped:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_400_dead_letters_the_delivery_and_an_expired_one_is_never_sent() {
    let mut env = TestEnv::start("terminal").await.unwrap();
    let tenant = env.tenant("clinic-b", 2).await.unwrap();
    env.script(
        "email-main",
        serde_json::json!({"default": {"status": 400}}),
    )
    .await
    .unwrap();
    let now = Utc::now();
    let rejected = env
        .reminder(
            tenant,
            "bad-address",
            &[Channel::Email],
            now,
            now + chrono::Duration::minutes(10),
        )
        .await
        .unwrap();
    let expired = env
        .reminder(
            tenant,
            "too-late",
            &[Channel::Sms],
            now - chrono::Duration::minutes(10),
            now - chrono::Duration::seconds(1),
        )
        .await
        .unwrap();
    start_all(&mut env);

    let ledger = env.ledger.clone();
    env.wait_for("both deliveries to settle", Duration::from_secs(60), || {
        let ledger = ledger.clone();
        let ids = [rejected.id, expired.id];
        async move {
            let mut settled = 0;
            for id in ids {
                let d = ledger.deliveries_of_reminder(id).await?;
                settled += d.iter().filter(|d| d.settled_at.is_some()).count();
            }
            Ok((settled == 2).then_some(()))
        }
    })
    .await;

    let bad = &env
        .ledger
        .deliveries_of_reminder(rejected.id)
        .await
        .unwrap()[0];
    assert_eq!(bad.state.as_str(), "dead_lettered");
    assert_eq!(bad.last_error_reason.as_deref(), Some("http_400"));
    assert_eq!(
        env.ledger.attempts(bad.id).await.unwrap().len(),
        1,
        "a 400 is not retried"
    );
    let late = &env.ledger.deliveries_of_reminder(expired.id).await.unwrap()[0];
    assert_eq!(late.state.as_str(), "expired");
    assert_eq!(late.attempt_count, 0);

    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    assert_eq!(
        stub.accounts.get("sms-main").map_or(0, |a| a.requests),
        0,
        "the expired reminder never reached the provider"
    );
    assert_eq!(stub.accounts["email-main"].by_status.get(&400), Some(&1));

    let (code, out, err) = env.nudgectl(&["status", "--json"]).unwrap();
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    let email = status
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["channel"] == "email")
        .unwrap();
    assert_eq!(email["dead_lettered"], 1, "{out}");
    eprintln!("e2e terminal: email={email} sms requests=0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_sms_queue_is_dead_lettered_and_recorded_while_delivery_goes_on() {
    let mut env = TestEnv::start("poison").await.unwrap();
    let tenant = env.tenant("clinic-c", 2).await.unwrap();
    start_all(&mut env);
    let broker = nudge_broker::Broker::connect(
        &std::env::var("NUDGE_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
        Duration::from_secs(10),
        nudge_broker::Topology::new(&env.namespace, 3).unwrap(),
    )
    .await
    .unwrap();
    let publisher = broker.publisher().await.unwrap();
    let garbage = nudge_broker::OutgoingMessage {
        channel: Channel::Sms,
        payload: b"\xff\x00 definitely not a protobuf envelope \x13\x37".to_vec(),
        message_id: "garbage-1".into(),
        correlation_id: "garbage-1".into(),
        traceparent: None,
    };
    let published = publisher
        .publish_batch(std::slice::from_ref(&garbage))
        .await;
    assert!(published.iter().all(Result::is_ok), "{published:?}");

    let ledger = env.ledger.clone();
    env.wait_for("the garbage to be recorded as a dead letter", Duration::from_secs(60), || {
        let ledger = ledger.clone();
        async move { Ok((ledger.dead_letter_count(Some(Channel::Sms)).await? == 1).then_some(())) }
    })
    .await;
    let (reason, decode_error): (String, Option<String>) =
        sqlx::query_as("SELECT death_reason, decode_error FROM dead_letters")
            .fetch_one(env.ledger.pool())
            .await
            .unwrap();
    assert_eq!(reason, "rejected");
    assert!(decode_error.is_some());

    // The worker is still delivering.
    let now = Utc::now();
    let after = env
        .reminder(
            tenant,
            "after-poison",
            &[Channel::Sms],
            now,
            now + chrono::Duration::minutes(5),
        )
        .await
        .unwrap();
    let ledger = env.ledger.clone();
    env.wait_for(
        "a reminder after the poison message to be delivered",
        Duration::from_secs(60),
        || {
            let ledger = ledger.clone();
            async move {
                let d = ledger.deliveries_of_reminder(after.id).await?;
                Ok((d.first().map(|d| d.state.as_str()) == Some("delivered")).then_some(()))
            }
        },
    )
    .await;
    eprintln!(
        "e2e poison: dead_letters=1 reason={reason} decode_error={decode_error:?}; next delivery delivered"
    );
    broker.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_envelope_for_a_queued_delivery_is_dead_lettered_with_its_reason_and_nothing_is_leased_or_sent()
 {
    let mut env = TestEnv::start("corrupted").await.unwrap();
    let tenant = env.tenant("clinic-d", 2).await.unwrap();
    let now = Utc::now();
    let reminder = env
        .reminder(
            tenant,
            "corrupted-1",
            &[Channel::Sms],
            now,
            now + chrono::Duration::minutes(10),
        )
        .await
        .unwrap();
    // Claimed as the relay claims (queued, next generation), but its only message is corrupt:
    // the ids and generation are intact, the correlation id is not, so a worker that acted on
    // the ids before validating the whole envelope would lease and send it.
    let (delivery_id, generation): (uuid::Uuid, i64) = sqlx::query_as(
        "UPDATE deliveries SET state = 'queued', generation = generation + 1, queued_at = now()
          WHERE reminder_id = $1 RETURNING id, generation",
    )
    .bind(reminder.id.as_uuid())
    .fetch_one(env.ledger.pool())
    .await
    .unwrap();
    let envelope = nudge_proto::Envelope {
        delivery_id: nudge_domain::DeliveryId::from_uuid(delivery_id),
        reminder_id: reminder.id,
        tenant_id: tenant,
        channel: Channel::Sms,
        generation: u64::try_from(generation).unwrap(),
        lane: nudge_domain::Lane::New,
        correlation_id: "corr-intact".into(),
        enqueued_at: now,
    };
    let mut payload = envelope.encode();
    let at = payload
        .windows(b"corr-intact".len())
        .position(|w| w == b"corr-intact")
        .unwrap();
    payload[at + 4] = b' ';
    assert!(matches!(
        nudge_proto::Envelope::decode(&payload),
        Err(nudge_proto::EnvelopeError::InvalidField {
            field: "correlation_id",
            ..
        })
    ));

    // Workers and the janitor, but no producer yet: nothing else points at the delivery.
    env.start_janitor(200, 1_000).unwrap();
    env.start_worker(
        Channel::Sms,
        "worker-sms",
        &WorkerOptions::for_channel(Channel::Sms),
    )
    .unwrap();
    let broker = nudge_broker::Broker::connect(
        &std::env::var("NUDGE_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
        Duration::from_secs(10),
        nudge_broker::Topology::new(&env.namespace, 3).unwrap(),
    )
    .await
    .unwrap();
    let publisher = broker.publisher().await.unwrap();
    let corrupted = nudge_broker::OutgoingMessage {
        channel: Channel::Sms,
        payload,
        message_id: format!("{delivery_id}:{generation}"),
        correlation_id: "corrupted-1".into(),
        traceparent: None,
    };
    let published = publisher
        .publish_batch(std::slice::from_ref(&corrupted))
        .await;
    assert!(published.iter().all(Result::is_ok), "{published:?}");
    broker.close().await;

    let ledger = env.ledger.clone();
    env.wait_for("the corrupted message to be recorded as a dead letter", Duration::from_secs(60), || {
        let ledger = ledger.clone();
        async move { Ok((ledger.dead_letter_count(Some(Channel::Sms)).await? == 1).then_some(())) }
    })
    .await;
    let (reason, decode_error, recorded_delivery): (String, Option<String>, Option<uuid::Uuid>) =
        sqlx::query_as("SELECT death_reason, decode_error, delivery_id FROM dead_letters")
            .fetch_one(env.ledger.pool())
            .await
            .unwrap();
    assert_eq!(reason, "rejected");
    assert_eq!(decode_error.as_deref(), Some("invalid_field"));
    assert_eq!(
        recorded_delivery, None,
        "an undecodable envelope names no delivery"
    );

    // Nothing acted on it: still queued at its generation, never leased, never sent.
    let (state, now_generation, attempts, lease_owner): (String, i64, i32, Option<String>) =
        sqlx::query_as(
            "SELECT state, generation, attempt_count, lease_owner FROM deliveries WHERE id = $1",
        )
        .bind(delivery_id)
        .fetch_one(env.ledger.pool())
        .await
        .unwrap();
    assert_eq!(
        (state.as_str(), now_generation, attempts, lease_owner),
        ("queued", generation, 0, None)
    );
    let attempt_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM attempts WHERE delivery_id = $1")
            .bind(delivery_id)
            .fetch_one(env.ledger.pool())
            .await
            .unwrap();
    assert_eq!(attempt_rows, 0);
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    assert_eq!(stub.total.requests, 0, "nothing reached the provider");

    // The relay finds the queued delivery's message missing and republishes it.
    env.start_producer("producer").unwrap();
    let ledger = env.ledger.clone();
    env.wait_for(
        "the delivery to be republished and delivered",
        Duration::from_secs(60),
        || {
            let ledger = ledger.clone();
            async move {
                let d = ledger.deliveries_of_reminder(reminder.id).await?;
                Ok((d.first().map(|d| d.state.as_str()) == Some("delivered")).then_some(()))
            }
        },
    )
    .await;
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    assert_eq!((stub.total.accepted, stub.total.duplicates), (1, 0));
}
