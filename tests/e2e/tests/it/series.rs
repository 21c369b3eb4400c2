//! A recurring reminder end to end: a signed POST of a series to the real `nudge-intake`
//! (run, with the producer and the SMS worker, under `TZ=Asia/Tokyo`: the host's zone must
//! change nothing), its first occurrence created by the producer's window and delivered
//! through the worker with the series' content, read back and cancelled.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use chrono::Utc;
use nudge_domain::{Channel, LocalTime, Zone};
use nudge_e2e::{TestEnv, WorkerOptions};
use serde_json::{Value, json};

/// The first occurrence is this far after the post, on the patient's wall clock.
const FIRST_IN_S: i64 = 4;
/// It is accepted by the provider within this long after its time...
const SENT_WITHIN_S: f64 = 2.0;
/// ...give or take this on a loaded 2-core machine (a window's tick, the relay's pass).
const TOLERANCE_S: f64 = 1.5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_series_occurrence_is_created_by_the_producer_and_delivered_with_the_series_content() {
    let mut env = TestEnv::start("series").await.unwrap();
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

    // Chatham Islands: +13:45 in its summer, a zone no host is set to.
    let chatham = Zone::parse("Pacific/Chatham").unwrap();
    let first = chrono::DateTime::from_timestamp(Utc::now().timestamp() + FIRST_IN_S, 0).unwrap();
    let start_local = chatham.local_at(first).to_string();
    let body = serde_json::to_vec(&json!({
        "series_id": "med-e2e",
        "subscriber_ref": "patient-8",
        "channels": ["sms"],
        "time_zone": "Pacific/Chatham",
        "start_local": start_local,
        "rrule": "FREQ=DAILY;COUNT=3",
        "expires_after_s": 600,
        "destinations": {"sms": "+15550188"},
        "content": {"template": "medication"}
    }))
    .unwrap();
    let series_url = format!("{url}/v1/tenants/clinic/series");
    let answer = env
        .signed(reqwest::Method::POST, &series_url, &secret, body)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status().as_u16(), 202);
    let accepted: Value = answer.json().await.unwrap();
    assert_eq!(
        accepted["upcoming"][0]["event_id"],
        format!("med-e2e/{start_local}")
    );
    assert_eq!(accepted["upcoming"].as_array().unwrap().len(), 3);

    let ledger = env.ledger.clone();
    env.wait_for(
        "the first occurrence delivered",
        Duration::from_secs(60),
        || {
            let ledger = ledger.clone();
            async move {
                let states = nudge_e2e::states_in(&ledger).await?;
                Ok((states.get("delivered") == Some(&1)).then_some(()))
            }
        },
    )
    .await;
    let report = nudge_e2e::keys_report(env.stub_keys().await.unwrap()).unwrap();
    assert_eq!(report.keys.len(), 1, "one occurrence reached the provider");
    let accepted_at = report.keys[0].accepted_at.unwrap();
    let late = (accepted_at - first).num_milliseconds() as f64 / 1000.0;
    eprintln!("series occurrence at {start_local} Pacific/Chatham: accepted {late} s after it");
    assert!(late >= 0.0, "sent {late} s before its time");
    assert!(
        late <= SENT_WITHIN_S + TOLERANCE_S,
        "sent {late} s after its time (bound {SENT_WITHIN_S} s + {TOLERANCE_S} s)"
    );
    // Its content was the series' (sealed once, bound to the series): a content that did not
    // open would have dead-lettered the delivery, not delivered it.
    let (event_id, from_series): (String, bool) = sqlx::query_as(
        "SELECT r.event_id, r.content_from_series
         FROM reminders r JOIN series s ON s.id = r.series_key",
    )
    .fetch_one(env.ledger.pool())
    .await
    .unwrap();
    assert_eq!(event_id, format!("med-e2e/{start_local}"));
    assert!(from_series, "the occurrence's content is the series'");

    let read_url = format!("{series_url}/med-e2e");
    let signature = nudge_e2e::intake_signature(&reqwest::Method::GET, &read_url, &secret, b"");
    let read: Value = env
        .http
        .get(&read_url)
        .header("nudge-signature", signature)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(read["occurrences_created"], 1, "{read}");
    assert_eq!(read["occurrences_sent"], 1, "{read}");
    let tomorrow = chatham
        .resolve(
            LocalTime::new(chatham.local_at(first).naive() + chrono::Duration::days(1)).unwrap(),
        )
        .instant;
    assert_eq!(
        read["next_at"],
        json!(tomorrow.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
        "tomorrow's is not created yet: {read}"
    );

    let (code, out, err) = env
        .nudgectl(&[
            "series",
            "cancel",
            "clinic",
            "med-e2e",
            "--reason",
            "course ended",
        ])
        .unwrap();
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("0 occurrences cancelled"), "{out}");
    assert!(out.contains("1 already sent"), "{out}");
}
