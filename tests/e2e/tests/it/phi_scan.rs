//! No PHI anywhere it could leak: a reminder posted to the intake with a subscriber reference,
//! a destination per channel and content, each carrying a marker, is delivered by SMS,
//! dead-lettered by push (a 400), left queued on email (no worker), and one of its messages is
//! sent to the wrong queue so that it lands in a dead-letter queue. Then every process's log,
//! every `/metrics` page, every message body still queued or dead-lettered, and the recorded
//! dead letters are searched for the markers: none is found.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use chrono::Utc;
use nudge_broker::lapin::options::{BasicGetOptions, BasicNackOptions};
use nudge_broker::{Broker, OutgoingMessage, Topology};
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, amqp_url};
use serde_json::json;

const SUBSCRIBER: &str = "phi-subscriber-q7x";
const SMS: &str = "+15550142777";
const EMAIL: &str = "phi.patient.q7x@example.org";
const PUSH: &str = "phi-push-token-q7x";
const CONTENT: &str = "phi-content-q7x";

/// Every message body in `queue` (read, then handed back to the queue).
async fn bodies(namespace: &str, queue: &str) -> Vec<Vec<u8>> {
    let conn = nudge_broker::lapin::Connection::connect(
        &amqp_url(),
        nudge_broker::lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let mut found = Vec::new();
    for _ in 0..1_000 {
        let Some(message) = channel
            .basic_get(
                format!("{namespace}{queue}").into(),
                BasicGetOptions::default(),
            )
            .await
            .unwrap()
        else {
            break;
        };
        found.push(message.delivery.data.clone());
    }
    // Unacknowledged: closing the channel gives them back.
    let _ = channel
        .basic_nack(
            0,
            BasicNackOptions {
                multiple: true,
                requeue: true,
            },
        )
        .await;
    let _ = conn.close(0, "phi scan".into()).await;
    found
}

fn hits(haystack: &[u8]) -> Vec<&'static str> {
    [SUBSCRIBER, SMS, EMAIL, PUSH, CONTENT]
        .into_iter()
        .filter(|marker| {
            haystack
                .windows(marker.len())
                .any(|w| w == marker.as_bytes())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_metrics_page_or_queued_or_dead_lettered_message_holds_a_destination_subscriber_or_content()
 {
    let mut env = TestEnv::start("phi-scan").await.unwrap();
    env.admin_listeners = true;
    env.tenant("clinic-phi", 2).await.unwrap();
    let secret = env.rotate_secret("clinic-phi").unwrap();
    env.script("push-main", json!({"default": {"status": 400}}))
        .await
        .unwrap();
    let (_, url) = env.start_intake("intake").await.unwrap();
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    env.start_worker(
        Channel::Sms,
        "sms",
        &WorkerOptions::for_channel(Channel::Sms),
    )
    .unwrap();
    env.start_worker(
        Channel::Push,
        "push",
        &WorkerOptions::for_channel(Channel::Push),
    )
    .unwrap();

    let now = Utc::now();
    let body = serde_json::to_vec(&json!({
        "event_id": "appt-phi",
        "subscriber_ref": SUBSCRIBER,
        "channels": ["sms", "email", "push"],
        "scheduled_at": now.to_rfc3339(),
        "expires_at": (now + chrono::Duration::minutes(10)).to_rfc3339(),
        "destinations": {"sms": SMS, "email": EMAIL, "push": PUSH},
        "content": {"text": CONTENT}
    }))
    .unwrap();
    let answer = env
        .signed(
            reqwest::Method::POST,
            &format!("{url}/v1/tenants/clinic-phi/reminders"),
            &secret,
            body,
        )
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status().as_u16(), 202);

    let ledger = env.ledger.clone();
    env.wait_for(
        "sms delivered, push dead-lettered, email queued",
        Duration::from_secs(60),
        || {
            let ledger = ledger.clone();
            async move {
                let states: Vec<(String, String)> =
                    sqlx::query_as("SELECT channel, state FROM deliveries ORDER BY channel")
                        .fetch_all(ledger.pool())
                        .await?;
                let want = [
                    ("email", "queued"),
                    ("push", "dead_lettered"),
                    ("sms", "delivered"),
                ];
                Ok((states.len() == 3
                    && states
                        .iter()
                        .zip(want)
                        .all(|((c, s), (wc, ws))| c == wc && s == ws))
                .then_some(()))
            }
        },
    )
    .await;

    // The email delivery's message, sent to the push queue: the push worker dead-letters it
    // (wrong channel) and the janitor records it from dead.push.
    let queued = bodies(&env.namespace, "work.email").await;
    assert_eq!(queued.len(), 1, "the email message waits in its queue");
    let broker = Broker::connect(
        &amqp_url(),
        Duration::from_secs(10),
        Topology::new(&env.namespace, 3).unwrap(),
    )
    .await
    .unwrap();
    let results = broker
        .publisher()
        .await
        .unwrap()
        .publish_batch(&[OutgoingMessage {
            channel: Channel::Push,
            payload: queued[0].clone(),
            message_id: "phi-scan-misrouted".to_owned(),
            correlation_id: "phi-scan".to_owned(),
            traceparent: None,
        }])
        .await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    broker.close().await;
    env.wait_for(
        "the misrouted message to be recorded as a dead letter",
        Duration::from_secs(30),
        || {
            let ledger = ledger.clone();
            async move {
                let n: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters")
                    .fetch_one(ledger.pool())
                    .await?;
                Ok((n >= 1).then_some(()))
            }
        },
    )
    .await;

    let mut scanned: Vec<(String, Vec<u8>)> = Vec::new();
    for name in ["intake", "producer", "janitor", "sms", "push"] {
        scanned.push((
            format!("{name} /metrics"),
            env.scrape(name).await.unwrap().into_bytes(),
        ));
    }
    // The intake's API address serves no metrics: they are on the admin address, scanned above.
    let api_metrics = env.http.get(format!("{url}/metrics")).send().await.unwrap();
    assert_eq!(api_metrics.status().as_u16(), 404);
    for queue in [
        "work.email",
        "work.push",
        "work.sms",
        "dead.email",
        "dead.push",
        "dead.sms",
    ] {
        for body in bodies(&env.namespace, queue).await {
            scanned.push((format!("a message in {queue}"), body));
        }
    }
    let recorded: Vec<Vec<u8>> = sqlx::query_scalar("SELECT payload FROM dead_letters")
        .fetch_all(env.ledger.pool())
        .await
        .unwrap();
    for payload in recorded {
        scanned.push(("a recorded dead letter".to_owned(), payload));
    }
    // Logs last, once every process has stopped and written its final lines.
    for (name, code) in env.stop_all(Duration::from_secs(15)) {
        assert_eq!(code, Some(0), "{name} stopped cleanly on SIGTERM");
    }
    for entry in std::fs::read_dir(&env.dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "log" || e == "out") {
            scanned.push((path.display().to_string(), std::fs::read(&path).unwrap()));
        }
    }
    assert!(scanned.len() > 15, "{} things scanned", scanned.len());
    let found: Vec<(String, Vec<&str>)> = scanned
        .iter()
        .map(|(what, bytes)| (what.clone(), hits(bytes)))
        .filter(|(_, hits)| !hits.is_empty())
        .collect();
    assert!(found.is_empty(), "PHI found: {found:?}");
}
