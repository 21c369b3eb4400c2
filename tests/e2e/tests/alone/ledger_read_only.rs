//! The whole system against a ledger that turns read-only for a few seconds mid-run, as a
//! PostgreSQL failover looks to its clients (a primary demoted, a standby behind an address
//! that has not moved yet): every process's `/readyz` turns 503, the intake answers 503 with
//! `Retry-After`, the producer and the janitor log the outage once and go on by themselves once
//! the ledger takes writes again; 0 deliveries lost, 0 keys sent twice, no process restarted.
//!
//! Only this test's own database is made read-only (`ALTER DATABASE ... SET
//! default_transaction_read_only` and its sessions ended): the shared server is not touched.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::{Duration, Instant};

use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, count_in, stats};
use nudge_ledger::test_support::set_read_only;
use serde_json::json;

const TOTAL: usize = 300;
/// Sends are slowed so that work is in flight when the ledger turns read-only.
const SEND_DELAY_MS: u64 = 60;
/// How long the ledger stays read-only once every process has seen it: a parameter of the
/// fault, not a wait for an effect.
const READ_ONLY_FOR: Duration = Duration::from_secs(3);
/// After the ledger takes writes again: deliveries move and every process is ready within this.
const RECOVERY_BOUND: Duration = Duration::from_secs(60);

/// The outage line of `nudge_runtime::Outage`, and the per-pass errors it replaces.
const AWAY: &str = "the ledger is away or read-only; waiting for it";
const BACK: &str = "the ledger is back";
const PER_PASS_ERRORS: [&str; 5] = [
    "relay pass failed",
    "clock tick failed",
    "failed to read the database's clock",
    "sweep failed",
    "failed to read the ledger's gauges",
];

fn reminder_body(event: &str) -> Vec<u8> {
    let now = Utc::now();
    serde_json::to_vec(&json!({
        "event_id": event,
        "subscriber_ref": format!("patient-{event}"),
        "channels": ["sms"],
        "scheduled_at": now.to_rfc3339(),
        "expires_at": (now + chrono::Duration::minutes(20)).to_rfc3339(),
        "destinations": {"sms": "+15550142"},
        "content": {"template": "appointment"}
    }))
    .unwrap()
}

/// Whether every URL answers other than 200 (`true`) or every one answers 200 (`false`);
/// `None` while they disagree.
async fn all_ready(http: &reqwest::Client, urls: &[String]) -> Option<bool> {
    let mut ready = 0;
    for url in urls {
        let ok = http
            .get(url)
            .timeout(Duration::from_secs(8))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        ready += usize::from(ok);
    }
    match ready {
        0 => Some(false),
        n if n == urls.len() => Some(true),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_read_only_for_seconds_mid_run_loses_nothing_sends_no_key_twice_and_every_process_recovers_on_its_own()
 {
    let _alone = crate::alone().await;
    let mut env = TestEnv::start("ledger-read-only").await.unwrap();
    env.admin_listeners = true;
    let tenant = env.tenant("clinic", 2).await.unwrap();
    let secret = env.rotate_secret("clinic").unwrap();
    let now = Utc::now();
    for i in 0..TOTAL {
        env.reminder(
            tenant,
            &format!("ro-{i}"),
            &[Channel::Sms],
            now,
            now + chrono::Duration::minutes(20),
        )
        .await
        .unwrap();
    }
    env.script(
        "sms-main",
        json!({"default": {"status": 202, "delay_ms": SEND_DELAY_MS}}),
    )
    .await
    .unwrap();
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.prefetch = 4;
    // Longer than the outage: an outcome the recorder holds through it is recorded, not
    // decided by the reaper (which would send its key again).
    options.lease_seconds = 30;
    options.provider_timeout_ms = 2_000;
    let (intake, intake_url) = env.start_intake("intake").await.unwrap();
    let mut procs = vec![
        intake,
        env.start_producer("producer").unwrap(),
        env.start_janitor(200, 1_000).unwrap(),
        env.start_worker(Channel::Sms, "worker-a", &options)
            .unwrap(),
    ];
    procs.push(
        env.start_worker(Channel::Sms, "worker-b", &options)
            .unwrap(),
    );
    let names = env.proc_names();
    let ready_urls: Vec<String> = names
        .iter()
        .map(|name| format!("{}/readyz", env.admin_url(name).unwrap()))
        .collect();
    let ledger = env.ledger.clone();
    env.wait_for("60 deliveries delivered", Duration::from_secs(90), || {
        let ledger = ledger.clone();
        async move { Ok((count_in(&ledger, "delivered").await? >= 60).then_some(())) }
    })
    .await;
    let (http, urls) = (env.http.clone(), ready_urls.clone());
    env.wait_for("every process ready", RECOVERY_BOUND, || {
        let (http, urls) = (http.clone(), urls.clone());
        async move { Ok((all_ready(&http, &urls).await == Some(true)).then_some(())) }
    })
    .await;

    // A pool of the test's own, outside the processes' (whose sessions are ended).
    let admin = sqlx::PgPool::connect(&env.db_url).await.unwrap();
    let before = count_in(&env.ledger, "delivered").await.unwrap();
    let turned = Instant::now();
    set_read_only(&admin, true).await;
    let (http, urls) = (env.http.clone(), ready_urls.clone());
    env.wait_for(
        "every process to answer /readyz 503",
        RECOVERY_BOUND,
        || {
            let (http, urls) = (http.clone(), urls.clone());
            async move { Ok((all_ready(&http, &urls).await == Some(false)).then_some(())) }
        },
    )
    .await;
    let unready_after = turned.elapsed();
    let reminders = format!("{intake_url}/v1/tenants/clinic/reminders");
    let refused = env
        .signed(
            reqwest::Method::POST,
            &reminders,
            &secret,
            reminder_body("posted-while-read-only"),
        )
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 503);
    assert_eq!(
        refused
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned())
            .as_deref(),
        Some("2")
    );
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"], "ledger_unavailable", "{body}");
    tokio::time::sleep(READ_ONLY_FOR).await;
    set_read_only(&admin, false).await;
    let read_only_for = turned.elapsed();
    admin.close().await;

    // Back at work: deliveries move and every process answers ready, with no restart.
    let back = Instant::now();
    let (http, urls, ledger) = (env.http.clone(), ready_urls.clone(), env.ledger.clone());
    let moved = std::sync::Arc::new(std::sync::Mutex::new(None::<Duration>));
    let ready = std::sync::Arc::new(std::sync::Mutex::new(None::<Duration>));
    let recovered = env
        .wait_for("every process back at work", RECOVERY_BOUND, || {
            let (http, urls, ledger) = (http.clone(), urls.clone(), ledger.clone());
            let (moved, ready) = (moved.clone(), ready.clone());
            async move {
                if moved.lock().unwrap().is_none()
                    && count_in(&ledger, "delivered").await.unwrap_or(0) > before
                {
                    *moved.lock().unwrap() = Some(back.elapsed());
                }
                if ready.lock().unwrap().is_none() && all_ready(&http, &urls).await == Some(true) {
                    *ready.lock().unwrap() = Some(back.elapsed());
                }
                let both = (*moved.lock().unwrap()).zip(*ready.lock().unwrap());
                Ok(both.map(|(m, r)| m.max(r)))
            }
        })
        .await;
    let accepted = env
        .signed(
            reqwest::Method::POST,
            &reminders,
            &secret,
            reminder_body("posted-while-read-only"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(
        accepted.status().as_u16(),
        202,
        "the post refused before is new"
    );
    let total = i64::try_from(TOTAL).unwrap() + 1;
    let ledger = env.ledger.clone();
    env.wait_for("every delivery delivered", Duration::from_secs(240), || {
        let ledger = ledger.clone();
        async move { Ok((count_in(&ledger, "delivered").await? >= total).then_some(())) }
    })
    .await;

    let states = env.states().await.unwrap();
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    eprintln!(
        "fault ledger-read-only: unready_after_ms={} read_only_ms={} recovered_ms={} delivered_before={before} states={states:?} requests={} unique_keys={} accepted={} duplicate_requests={}",
        unready_after.as_millis(),
        read_only_for.as_millis(),
        recovered.as_millis(),
        stub.total.requests,
        stub.total.unique_keys,
        stub.total.accepted,
        stub.total.duplicates
    );
    assert_eq!(states.get("delivered"), Some(&total), "0 lost: {states:?}");
    assert_eq!(i64::try_from(stub.total.unique_keys).unwrap(), total);
    assert_eq!(
        stub.total.requests, stub.total.unique_keys,
        "no key sent twice"
    );
    for &index in &procs {
        let proc = env.proc(index);
        assert!(
            proc.is_running(),
            "{} exited: {}",
            proc.name,
            proc.log_tail(20)
        );
    }
    // The producer and the janitor logged the outage once per loop, not an error per pass.
    for name in ["producer", "janitor"] {
        let index = names.iter().position(|n| n == name).unwrap();
        let log = std::fs::read_to_string(&env.proc(index).log).unwrap();
        let away = log.lines().filter(|l| l.contains(AWAY)).count();
        let back = log.lines().filter(|l| l.contains(BACK)).count();
        assert!(
            (1..=6).contains(&away),
            "{name} logged the outage {away} times"
        );
        assert!(back >= 1, "{name} never logged the ledger back");
        for error in PER_PASS_ERRORS {
            // As a line's message (the outage's line may quote one as its cause).
            assert!(
                !log.contains(&format!("\"message\":\"{error}")),
                "{name} logged `{error}` during the outage"
            );
        }
    }
}
