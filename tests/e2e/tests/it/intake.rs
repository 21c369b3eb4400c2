//! The intake end to end: a signed POST to the real `nudge-intake` becomes a delivered
//! reminder through the real producer and SMS worker, carrying the client's correlation id.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_post_becomes_a_delivered_reminder_with_its_correlation_id() {
    let mut env = TestEnv::start("intake").await.unwrap();
    env.tenant("clinic", 2).await.unwrap();
    let secret = env.rotate_secret("clinic").unwrap();
    assert!(secret.starts_with("nsk_"), "one secret printed on stdout");
    let (_, url) = env.start_intake("intake").await.unwrap();
    env.start_producer("producer").unwrap();
    env.start_worker(
        Channel::Sms,
        "worker-sms",
        &WorkerOptions::for_channel(Channel::Sms),
    )
    .unwrap();

    let now = Utc::now();
    let body = serde_json::to_vec(&json!({
        "event_id": "appt-e2e",
        "subscriber_ref": "patient-7",
        "channels": ["sms"],
        "scheduled_at": now.to_rfc3339(),
        "expires_at": (now + chrono::Duration::minutes(10)).to_rfc3339(),
        "destinations": {"sms": "+15550177"},
        "content": {"template": "appointment"}
    }))
    .unwrap();
    let reminders = format!("{url}/v1/tenants/clinic/reminders");
    // Unsigned: refused, nothing written.
    let refused = env
        .http
        .post(&reminders)
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 401);
    let answer = env
        .signed(reqwest::Method::POST, &reminders, &secret, body.clone())
        .header("x-correlation-id", "clinic-req-42")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status().as_u16(), 202);
    let accepted: serde_json::Value = answer.json().await.unwrap();
    assert_eq!(accepted["correlation_id"], "clinic-req-42");

    let status_url = format!("{url}/v1/tenants/clinic/reminders/appt-e2e");
    let http = env.http.clone();
    let state = env
        .wait_for(
            "the reminder to be delivered",
            Duration::from_secs(60),
            || {
                let signature =
                    nudge_e2e::intake_signature(&reqwest::Method::GET, &status_url, &secret, b"");
                let request = http.get(&status_url).header("nudge-signature", signature);
                async move {
                    let answer: serde_json::Value = request.send().await?.json().await?;
                    Ok((answer["channels"][0]["state"] == "delivered").then_some(answer))
                }
            },
        )
        .await;
    assert_eq!(state["channels"][0]["attempts"], 1);
    let correlation: Vec<Option<String>> =
        sqlx::query_scalar("SELECT correlation_id FROM attempts")
            .fetch_all(env.ledger.pool())
            .await
            .unwrap();
    assert_eq!(correlation, [Some("clinic-req-42".to_owned())]);

    // Posting the same event again: the original answer, no second delivery.
    let again = env
        .signed(reqwest::Method::POST, &reminders, &secret, body)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status().as_u16(), 200);
    assert_eq!(env.states().await.unwrap().get("delivered"), Some(&1));

    let exits = env.stop_all(Duration::from_secs(15));
    for (name, code) in exits {
        assert_eq!(code, Some(0), "{name} stopped cleanly on SIGTERM");
    }
}

/// The intake, the producer and the worker run with a host zone of their own (`TZ=Asia/Tokyo`,
/// fourteen hours from New York's clock): a local time posted for a patient in New York is
/// stored, answered and sent at New York's instant, as if the host had no zone at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_time_is_the_patients_whatever_zone_the_hosts_processes_run_in() {
    let mut env = TestEnv::start("intake-tz").await.unwrap();
    env.host_zone = Some("Asia/Tokyo".to_owned());
    env.tenant("clinic", 2).await.unwrap();
    let secret = env.rotate_secret("clinic").unwrap();
    let (_, url) = env.start_intake("intake").await.unwrap();
    env.start_producer("producer").unwrap();
    env.start_worker(
        Channel::Sms,
        "worker-sms",
        &WorkerOptions::for_channel(Channel::Sms),
    )
    .unwrap();

    // A few seconds from now on New York's wall clock, to the second.
    let new_york = nudge_domain::Zone::parse("America/New_York").unwrap();
    let due = chrono::DateTime::from_timestamp(Utc::now().timestamp() + 3, 0).unwrap();
    let local = new_york.local_at(due);
    let body = serde_json::to_vec(&json!({
        "event_id": "appt-tz",
        "subscriber_ref": "patient-8",
        "channels": ["sms"],
        "scheduled_local": local.to_string(),
        "time_zone": "America/New_York",
        "expires_after_s": 600,
        "destinations": {"sms": "+15550178"},
    }))
    .unwrap();
    let reminders = format!("{url}/v1/tenants/clinic/reminders");
    let answer = env
        .signed(reqwest::Method::POST, &reminders, &secret, body)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status().as_u16(), 202);
    let accepted: serde_json::Value = answer.json().await.unwrap();
    let due_text = due.format("%Y-%m-%dT%H:%M:%SZ").to_string();
    assert_eq!(accepted["scheduled_at"], due_text.as_str(), "{accepted}");
    assert_eq!(
        accepted["local"]["utc_offset"],
        new_york.offset_at(due).to_string().as_str()
    );
    let stored: chrono::DateTime<Utc> =
        sqlx::query_scalar("SELECT scheduled_at FROM reminders WHERE event_id = 'appt-tz'")
            .fetch_one(env.ledger.pool())
            .await
            .unwrap();
    assert_eq!(stored, due);

    let ledger = env.ledger.clone();
    let states = env
        .wait_for(
            "the reminder to be delivered",
            Duration::from_secs(60),
            || {
                let ledger = ledger.clone();
                async move {
                    let states = nudge_e2e::states_in(&ledger).await?;
                    Ok((states.get("delivered") == Some(&1)).then_some(states))
                }
            },
        )
        .await;
    assert_eq!(states.get("delivered"), Some(&1));
    // Sent at New York's instant, not before it.
    let sent: chrono::DateTime<Utc> = sqlx::query_scalar("SELECT min(started_at) FROM attempts")
        .fetch_one(env.ledger.pool())
        .await
        .unwrap();
    assert!(sent >= due, "sent at {sent}, due at {due}");

    let exits = env.stop_all(Duration::from_secs(15));
    for (name, code) in exits {
        assert_eq!(code, Some(0), "{name} stopped cleanly on SIGTERM");
    }
}
