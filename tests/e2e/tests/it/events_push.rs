//! Delivery events end to end, as a clinic integrates: the client examples in `clients/` (Python
//! and Node, with the `standardwebhooks` packages from PyPI and npm) sign a reminder to the real
//! `nudge-intake`, the real producer, janitor and SMS worker deliver it, and the real
//! `nudge-events` pushes its events to each clinic's endpoint, the example's receiver, which
//! verifies every request before it records an event. `scripts/test.sh` installs the packages
//! (`scripts/clients.sh`) and names the interpreter (`NUDGE_TEST_PYTHON`, `NUDGE_TEST_NODE`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, free_port};
use serde_json::{Value, json};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tool(variable: &str) -> String {
    std::env::var(variable).unwrap_or_else(|_| {
        panic!("{variable} is not set: run the tests with scripts/test.sh, which installs the client examples' packages (scripts/clients.sh)")
    })
}

/// One example client: how to run it.
struct Client {
    name: &'static str,
    program: String,
    script: PathBuf,
}

impl Client {
    fn python() -> Self {
        Self {
            name: "python",
            program: tool("NUDGE_TEST_PYTHON"),
            script: repo().join("clients/python/nudge_client.py"),
        }
    }

    fn node() -> Self {
        Self {
            name: "node",
            program: tool("NUDGE_TEST_NODE"),
            script: repo().join("clients/node/nudge-client.mjs"),
        }
    }

    fn command(&self) -> Command {
        let mut command = Command::new(&self.program);
        command.arg(&self.script);
        command
    }
}

/// A receiver process, killed when dropped.
struct Receiver(Child);

impl Drop for Receiver {
    fn drop(&mut self) {
        self.0.kill().ok();
        self.0.wait().ok();
    }
}

fn recorded(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_examples_sign_a_reminder_and_verify_its_pushed_events() {
    let clients = [Client::python(), Client::node()];
    let mut env = TestEnv::start("events-push").await.unwrap();
    let (_, intake) = env.start_intake("intake").await.unwrap();
    env.start_producer("producer").unwrap();
    env.start_janitor(1_000, 10_000).unwrap();
    env.start_worker(
        Channel::Sms,
        "worker-sms",
        &WorkerOptions::for_channel(Channel::Sms),
    )
    .unwrap();
    env.start_events(
        "events",
        "poll_interval_ms = 50\nallow_http = true\nallow_addresses = [\"127.0.0.0/8\"]",
    )
    .unwrap();

    let mut receivers = Vec::new();
    for client in &clients {
        let tenant = format!("clinic-{}", client.name);
        env.tenant(&tenant, 2).await.unwrap();
        let intake_secret = env.rotate_secret(&tenant).unwrap();
        let port = free_port();
        let (code, out, err) = env
            .nudgectl(&[
                "tenant",
                "webhook",
                "set",
                &tenant,
                "--url",
                &format!("http://127.0.0.1:{port}/nudge-events"),
                "--allow-http",
                "--reason",
                "e2e",
            ])
            .unwrap();
        assert_eq!(code, 0, "{err}");
        let webhook_secret = out.trim().to_owned();
        assert!(webhook_secret.starts_with("whsec_"), "{out}");
        let record = env.dir.join(format!("{}-events.jsonl", client.name));
        let receiver = client
            .command()
            .args([
                "receive",
                "--port",
                &port.to_string(),
                "--secret",
                &webhook_secret,
            ])
            .arg("--record")
            .arg(&record)
            .stderr(
                std::fs::File::create(env.dir.join(format!("{}-receiver.log", client.name)))
                    .unwrap(),
            )
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        receivers.push(Receiver(receiver));

        let now = Utc::now();
        let body = env.dir.join(format!("{}-reminder.json", client.name));
        std::fs::write(
            &body,
            serde_json::to_vec(&json!({
                "event_id": format!("appt-{}", client.name),
                "subscriber_ref": "patient-7",
                "channels": ["sms"],
                "scheduled_at": now.to_rfc3339(),
                "expires_at": (now + chrono::Duration::minutes(10)).to_rfc3339(),
                "destinations": {"sms": "+15550177"},
                "content": {"template": "appointment"}
            }))
            .unwrap(),
        )
        .unwrap();
        let posted = client
            .command()
            .args([
                "post",
                "--url",
                &intake,
                "--tenant",
                &tenant,
                "--secret",
                &intake_secret,
            ])
            .arg("--body")
            .arg(&body)
            .output()
            .unwrap();
        assert!(
            posted.status.success(),
            "{} post: {}{}",
            client.name,
            String::from_utf8_lossy(&posted.stdout),
            String::from_utf8_lossy(&posted.stderr)
        );
        assert!(String::from_utf8_lossy(&posted.stdout).starts_with("202"));

        // Its events reach the receiver, verified: scheduled, then sent.
        let events = env
            .wait_for(
                &format!(
                    "the {} receiver to record the reminder's events",
                    client.name
                ),
                Duration::from_secs(60),
                || {
                    let record = record.clone();
                    async move {
                        let events = recorded(&record);
                        Ok(events.iter().any(|e| e["kind"] == "sent").then_some(events))
                    }
                },
            )
            .await;
        let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["scheduled", "sent"], "{}: {events:?}", client.name);
        let positions: Vec<i64> = events
            .iter()
            .map(|e| e["position"].as_i64().unwrap())
            .collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");
        assert_eq!(events[0]["delivery_seq"], 1);
        assert_eq!(events[1]["delivery_seq"], 2);
        for event in &events {
            assert_eq!(event["event_id"], format!("appt-{}", client.name));
            assert!(event["webhook_id"].as_str().unwrap().starts_with("nudge_"));
            let text = event.to_string();
            assert!(
                !text.contains("+15550177") && !text.contains("patient-7"),
                "{text}"
            );
        }
        // The endpoint's 204 moves the tenant's acknowledged position to its newest event.
        let acknowledged = format!("acknowledged:      {}", positions[1]);
        nudge_e2e::until(
            "the last batch to be acknowledged",
            Duration::from_secs(10),
            || {
                let shown = env.nudgectl(&["tenant", "webhook", "show", &tenant]);
                let acknowledged = acknowledged.clone();
                async move { shown.is_ok_and(|(_, out, _)| out.contains(&acknowledged)) }
            },
        )
        .await
        .unwrap();
        let log = std::fs::read_to_string(env.dir.join(format!("{}-receiver.log", client.name)))
            .unwrap_or_default();
        assert!(
            !log.contains("refused"),
            "{} refused a request: {log}",
            client.name
        );
    }
    drop(receivers);
}

/// One request as the scripted endpoint saw it.
#[derive(Debug, Clone)]
struct Seen {
    at: std::time::Instant,
    status: u16,
    id: String,
    positions: Vec<i64>,
    kinds: Vec<String>,
    event_ids: Vec<String>,
}

/// An endpoint on `port` answering its first request 429 with `Retry-After: 5`, every later
/// one 204, recording each; served until the test ends.
async fn throttle_once_then_accept(port: u16) -> std::sync::Arc<std::sync::Mutex<Vec<Seen>>> {
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::IntoResponse;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Seen>::new()));
    let shared = seen.clone();
    let app = axum::Router::new().fallback(move |headers: HeaderMap, body: axum::body::Bytes| {
        let seen = shared.clone();
        async move {
            let batch: Value = serde_json::from_slice(&body).unwrap();
            let events = batch["data"]["events"].as_array().unwrap().clone();
            let mut seen = seen.lock().unwrap();
            let status = if seen.is_empty() { 429 } else { 204 };
            seen.push(Seen {
                at: std::time::Instant::now(),
                status,
                id: headers["webhook-id"].to_str().unwrap().to_owned(),
                positions: events
                    .iter()
                    .map(|e| e["position"].as_i64().unwrap())
                    .collect(),
                kinds: events
                    .iter()
                    .map(|e| e["kind"].as_str().unwrap().to_owned())
                    .collect(),
                event_ids: events
                    .iter()
                    .map(|e| e["id"].as_str().unwrap().to_owned())
                    .collect(),
            });
            if status == 429 {
                (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "5")]).into_response()
            } else {
                StatusCode::NO_CONTENT.into_response()
            }
        }
    });
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.ok() });
    seen
}

/// The endpoint is down for two minutes while reminders are delivered, then answers 429 with
/// `Retry-After: 5`, then accepts: every event arrives, in position order, each id at least
/// once, none for a change that rolled back; the patient's view is how long after the endpoint
/// came back the last event was acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_down_for_two_minutes_then_throttling_gets_every_event_in_order() {
    const DOWN: Duration = Duration::from_secs(120);
    let mut env = TestEnv::start("events-down").await.unwrap();
    let tenant = env.tenant("clinic", 2).await.unwrap();
    env.start_producer("producer").unwrap();
    env.start_janitor(1_000, 10_000).unwrap();
    env.start_worker(
        Channel::Sms,
        "worker-sms",
        &WorkerOptions::for_channel(Channel::Sms),
    )
    .unwrap();
    // Retries back off to at most 10 s, so the endpoint's return is noticed within 10 s.
    env.start_events(
        "events",
        "poll_interval_ms = 50\nbatch_max = 7\nretry_base_ms = 500\nretry_max_ms = 10000\n\
         allow_http = true\nallow_addresses = [\"127.0.0.0/8\"]",
    )
    .unwrap();
    let port = free_port();
    let (code, _, err) = env
        .nudgectl(&[
            "tenant",
            "webhook",
            "set",
            "clinic",
            "--url",
            &format!("http://127.0.0.1:{port}/events"),
            "--allow-http",
            "--from",
            "0",
            "--reason",
            "e2e",
        ])
        .unwrap();
    assert_eq!(code, 0, "{err}");
    let down_since = std::time::Instant::now();
    let now = Utc::now();
    for i in 0..20 {
        env.reminder(
            tenant,
            &format!("appt-{i}"),
            &[Channel::Sms],
            now,
            now + chrono::Duration::minutes(30),
        )
        .await
        .unwrap();
    }
    let ledger = env.ledger.clone();
    let delivered = env
        .wait_for(
            "the 20 reminders to be sent",
            Duration::from_secs(60),
            || {
                let ledger = ledger.clone();
                async move {
                    let n = nudge_e2e::count_in(&ledger, "delivered").await?;
                    Ok((n == 20).then_some(n))
                }
            },
        )
        .await;
    assert_eq!(delivered, 20);
    // A change that rolls back: its event is written in its transaction, then gone with it.
    let mut tx = env.ledger.pool().begin().await.unwrap();
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM delivery_events")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE deliveries SET scheduled_at = scheduled_at + interval '1 minute' \
         WHERE id = (SELECT id FROM deliveries ORDER BY id LIMIT 1)",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    let during: i64 = sqlx::query_scalar("SELECT count(*) FROM delivery_events")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(
        during,
        before + 1,
        "the move wrote its event in its transaction"
    );
    tx.rollback().await.unwrap();
    let failing = env
        .nudgectl(&["tenant", "webhook", "show", "clinic"])
        .unwrap()
        .1;
    assert!(failing.contains("last error:        connect:"), "{failing}");
    tokio::time::sleep(DOWN.saturating_sub(down_since.elapsed())).await;

    let seen = throttle_once_then_accept(port).await;
    let up = std::time::Instant::now();
    // 20 scheduled and 20 sent: every numbered event of the tenant.
    let positions: Vec<i64> = sqlx::query_scalar(
        "SELECT position FROM delivery_events e JOIN tenants t ON t.id = e.tenant_id \
         WHERE t.name = 'clinic' AND position IS NOT NULL ORDER BY position",
    )
    .fetch_all(env.ledger.pool())
    .await
    .unwrap();
    assert_eq!(positions.len(), 40);
    let newest = *positions.last().unwrap();
    let acknowledged = format!("acknowledged:      {newest}");
    nudge_e2e::until("every event acknowledged", Duration::from_secs(60), || {
        let shown = env.nudgectl(&["tenant", "webhook", "show", "clinic"]);
        let acknowledged = acknowledged.clone();
        async move { shown.is_ok_and(|(_, out, _)| out.contains(&acknowledged)) }
    })
    .await
    .unwrap();
    let caught_up = up.elapsed();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0].status, 429);
    assert_eq!(
        seen[1].id, seen[0].id,
        "the throttled batch is retried as it was"
    );
    let waited = seen[1].at - seen[0].at;
    assert!(
        waited >= Duration::from_millis(4_900),
        "Retry-After: 5 honoured: {waited:?}"
    );
    let accepted: Vec<&Seen> = seen.iter().filter(|s| s.status == 204).collect();
    let pushed: Vec<i64> = accepted.iter().flat_map(|s| s.positions.clone()).collect();
    assert_eq!(pushed, positions, "every event once, in position order");
    let ids: std::collections::HashSet<&String> =
        accepted.iter().flat_map(|s| &s.event_ids).collect();
    assert_eq!(ids.len(), 40);
    assert!(
        accepted
            .iter()
            .all(|s| s.kinds.iter().all(|k| k != "rescheduled"))
    );
    // The patient's view: the endpoint's first retry comes within the 10 s backoff cap, then
    // 5 s of Retry-After, then the batches (7 events each) at once. 10 s of tolerance.
    assert!(
        caught_up < Duration::from_secs(25),
        "caught up {caught_up:?} after the endpoint came back"
    );
    eprintln!("events: endpoint down {DOWN:?}, caught up {caught_up:?} after it came back");
}
