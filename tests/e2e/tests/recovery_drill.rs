//! The recovery drill, against the real processes: a provider rejects a batch of reminders
//! (they dead-letter), comes back, and the operator redrives them with `nudgectl`. The dry run
//! counts what the execute then takes; the redrive pauses itself when the provider starts
//! answering 429 again, resumes by hand, and finishes with every reminder delivered once:
//! no key accepted twice, nothing sent after its expiry, the attempts tagged with the incident.
//!
//! A test binary of its own, not a module of `it`: that the redrive pauses on the 429s before it
//! has fed every reminder is a race between the feeder and the provider's answers, won with
//! only these tests (two at a time) on the machine; another test's load beside them would move it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, count_in, keys_report, stats};
use serde_json::Value;

const REMINDERS: i64 = 30;

/// Runs nudgectl and parses its JSON answer; fails with its stderr.
fn ctl_json(env: &TestEnv, args: &[&str]) -> Value {
    let (code, out, err) = env.nudgectl(args).unwrap();
    assert_eq!(code, 0, "nudgectl {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("nudgectl {args:?}: {e}: {out}"))
}

/// The producer, the janitor and one SMS worker whose bucket admits `rate` a second.
fn start_sms_pipeline(env: &mut TestEnv, rate: f64) {
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    let options = WorkerOptions {
        rate: Some((rate, 5)),
        ..WorkerOptions::for_channel(Channel::Sms)
    };
    env.start_worker(Channel::Sms, "worker-sms", &options)
        .unwrap();
}

/// Waits, up to `within`, until `count(*)` of deliveries `WHERE where_clause` is `n`.
async fn wait_count(env: &mut TestEnv, what: &str, where_clause: &str, n: i64, within: Duration) {
    let ledger = env.ledger.clone();
    let sql = format!("SELECT count(*) FROM deliveries WHERE {where_clause}");
    env.wait_for(what, within, || {
        let (ledger, sql) = (ledger.clone(), sql.clone());
        async move {
            let seen: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .fetch_one(ledger.pool())
                .await?;
            Ok((seen == n).then_some(()))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_pauses_on_429s_resumes_and_delivers_every_dead_letter_once() {
    let mut env = TestEnv::start("redrive-drill").await.unwrap();
    let tenant = env.tenant("clinic-d", 2).await.unwrap();
    // The incident: the provider rejects every request.
    env.script("sms-main", serde_json::json!({"default": {"status": 400}}))
        .await
        .unwrap();
    let now = Utc::now();
    for i in 0..REMINDERS {
        env.reminder(
            tenant,
            &format!("d{i}"),
            &[Channel::Sms],
            now,
            now + chrono::Duration::minutes(30),
        )
        .await
        .unwrap();
    }
    start_sms_pipeline(&mut env, 50.0);
    wait_count(
        &mut env,
        "every reminder to be dead-lettered by the 400s",
        "state = 'dead_lettered'",
        REMINDERS,
        Duration::from_secs(60),
    )
    .await;

    // The dead-letter queue names them, by reason.
    let dlq = ctl_json(&env, &["dlq", "list", "--channel", "sms", "--json"]);
    assert!(dlq.to_string().contains("http_400"), "{dlq}");

    // The dry run, then the execute: the same count. The provider has come back, but
    // throttles at first.
    let plan = ctl_json(
        &env,
        &["redrive", "--channel", "sms", "--rate", "10", "--json"],
    );
    let eligible = plan["channels"][0]["plan"]["eligible"].as_u64().unwrap();
    assert_eq!(eligible, REMINDERS as u64, "{plan}");
    env.script(
        "sms-main",
        serde_json::json!({"default": {"status": 429, "retry_after": "1"}}),
    )
    .await
    .unwrap();
    let started = ctl_json(
        &env,
        &[
            "redrive",
            "--channel",
            "sms",
            "--rate",
            "10",
            "--execute",
            "--reason",
            "provider back",
            "--incident",
            "INC-7",
            "--json",
        ],
    );
    assert_eq!(started["plan"]["eligible"].as_u64(), Some(eligible));
    let id = started["id"].as_i64().unwrap().to_string();

    // The 429s pause it, with why.
    let paused = {
        let env_ref = &env;
        let mut found = None;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            let status = ctl_json(env_ref, &["redrive", "status", &id, "--json"]);
            if status["state"] == "paused" {
                found = Some(status);
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        found.expect("the redrive paused itself within 30 s of the 429s")
    };
    let why = paused["pause_reason"].as_str().unwrap();
    assert!(why.starts_with("throttled: account sms-main"), "{why}");
    let fed_when_paused = paused["fed"].as_u64().unwrap();
    assert!(
        fed_when_paused < REMINDERS as u64,
        "paused before feeding everything ({fed_when_paused})"
    );
    // Paused means paused: a feeder pass (the janitor's own step, run here on the live
    // ledger) takes nothing for it, and its count stands.
    let rules = nudge_ledger::AutoPause {
        max_throttled_ratio: 0.2,
        window: Duration::from_secs(30),
        min_attempts: 5,
        max_new_work_age: Duration::from_secs(600),
    };
    let ticks = env
        .ledger
        .redrive_tick(&rules, 1000, nudge_ledger::LedgerTime::Database)
        .await
        .unwrap();
    assert!(
        ticks.iter().all(|t| t.id.to_string() != id),
        "a paused redrive is not fed: {ticks:?}"
    );
    let still = ctl_json(&env, &["redrive", "status", &id, "--json"]);
    assert_eq!(still["fed"].as_u64(), Some(fed_when_paused));

    // The provider recovers; the operator resumes.
    env.script("sms-main", serde_json::json!({"default": {"status": 202}}))
        .await
        .unwrap();
    let (code, out, err) = env
        .nudgectl(&[
            "redrive",
            "resume",
            &id,
            "--reason",
            "provider recovered",
            "--incident",
            "INC-7",
        ])
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("resumed"), "{out}");
    wait_count(
        &mut env,
        "every redriven reminder to be delivered",
        "state = 'delivered'",
        REMINDERS,
        Duration::from_secs(90),
    )
    .await;
    let done = ctl_json(&env, &["redrive", "status", &id, "--json"]);
    assert_eq!(done["state"], "finished", "{done}");
    assert_eq!(done["fed"].as_u64(), Some(REMINDERS as u64));

    // Every key accepted once; nothing sent after its expiry; history kept and tagged.
    let totals = stats(env.stub_stats().await.unwrap()).unwrap().total;
    assert_eq!(totals.duplicates, 0, "no key accepted twice: {totals:?}");
    assert_eq!(totals.accepted, REMINDERS as u64);
    let keys = keys_report(env.stub_keys().await.unwrap()).unwrap();
    let expiry = now + chrono::Duration::minutes(30);
    assert!(
        keys.keys
            .iter()
            .flat_map(|k| &k.requests)
            .all(|r| r.at < expiry)
    );
    assert_eq!(count_in(&env.ledger, "expired").await.unwrap(), 0);
    let (first_lanes, redrive_tagged): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE attempt_number = 1 AND lane = 'new' AND http_status = 400),
                count(*) FILTER (WHERE lane = 'redrive' AND incident = 'INC-7')
         FROM attempts",
    )
    .fetch_one(env.ledger.pool())
    .await
    .unwrap();
    assert_eq!(first_lanes, REMINDERS, "the 400s stay in the history");
    assert!(
        redrive_tagged >= REMINDERS,
        "every redriven attempt carries the incident ({redrive_tagged})"
    );
    let audit: Vec<String> =
        sqlx::query_scalar("SELECT action FROM audit_log WHERE target = $1 ORDER BY id")
            .bind(format!("redrive:{id}"))
            .fetch_all(env.ledger.pool())
            .await
            .unwrap();
    assert_eq!(
        audit,
        vec!["redrive_start", "redrive_auto_pause", "redrive_resume"]
    );

    let exits = env.stop_all(Duration::from_secs(10));
    assert!(
        exits.iter().all(|(_, code)| *code == Some(0)),
        "every process stops cleanly: {exits:?}"
    );
}

async fn sms_delivered(env: &TestEnv) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM deliveries WHERE channel = 'sms' AND state = 'delivered'",
    )
    .fetch_one(env.ledger.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_finishes_due_work_while_nothing_new_is_scheduled_then_rollback_hands_it_back() {
    let mut env = TestEnv::start("drain-drill").await.unwrap();
    let tenant = env.tenant("clinic-e", 2).await.unwrap();
    env.script("sms-main", serde_json::json!({"default": {"status": 202}}))
        .await
        .unwrap();
    let now = Utc::now();
    let expires = now + chrono::Duration::minutes(30);
    for i in 0..40 {
        env.reminder(tenant, &format!("owed{i}"), &[Channel::Sms], now, expires)
            .await
            .unwrap();
    }
    let (code, out, err) = env
        .nudgectl(&[
            "drain",
            "on",
            "--channel",
            "sms",
            "--reason",
            "provider incident",
            "--incident",
            "INC-D",
        ])
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("sms: draining"), "{out}");
    // Arriving during the drain: recorded, held.
    for i in 0..10 {
        env.reminder(tenant, &format!("held{i}"), &[Channel::Sms], now, expires)
            .await
            .unwrap();
    }
    start_sms_pipeline(&mut env, 20.0);
    wait_count(
        &mut env,
        "the 40 owed to be delivered during the drain",
        "channel = 'sms' AND state = 'delivered'",
        40,
        Duration::from_secs(60),
    )
    .await;
    // Nothing new was scheduled: the ten held have no delivery, and status says so.
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM reminders r
         WHERE r.event_id LIKE 'held%' AND NOT EXISTS (
             SELECT 1 FROM deliveries d WHERE d.reminder_id = r.id)",
    )
    .fetch_one(env.ledger.pool())
    .await
    .unwrap();
    assert_eq!(held, 10);
    let (_, status, _) = env.nudgectl(&["status"]).unwrap();
    assert!(status.contains("sms draining since"), "{status}");
    assert!(status.contains("(incident INC-D)"), "{status}");
    // The incident's attempts, exported without PHI.
    let (code, export, err) = env
        .nudgectl(&["export", "attempts", "--incident", "INC-D"])
        .unwrap();
    assert_eq!(code, 0, "{err}");
    let lines: Vec<Value> = export
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 40);
    assert!(lines.iter().all(|l| l["outcome_class"] == "delivered"));
    assert!(
        !export.contains("dest-") && !export.contains("sub-"),
        "no PHI"
    );

    // The drain ends: the held ten are scheduled and delivered.
    let (code, out, err) = env
        .nudgectl(&[
            "drain",
            "off",
            "--channel",
            "sms",
            "--reason",
            "provider back",
        ])
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("10 withheld deliveries scheduled now"),
        "{out}"
    );
    wait_count(
        &mut env,
        "the held ten to be delivered",
        "channel = 'sms' AND state = 'delivered'",
        50,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(sms_delivered(&env).await, 50);

    // A team that came from another sender rolls the channel back to it.
    for to in ["legacy", "nudge"] {
        let (code, _, err) = env
            .nudgectl(&[
                "owner",
                "set",
                "--channel",
                "sms",
                "--to",
                to,
                "--reason",
                "migration",
            ])
            .unwrap();
        assert_eq!(code, 0, "{err}");
    }
    let (code, out, err) = env
        .nudgectl(&[
            "rollback",
            "--channel",
            "sms",
            "--reason",
            "back to legacy",
            "--wait",
            "30s",
        ])
        .unwrap();
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("rolled back to legacy"), "{out}");
    for i in 0..5 {
        env.reminder(
            tenant,
            &format!("after{i}"),
            &[Channel::Sms],
            Utc::now(),
            expires,
        )
        .await
        .unwrap();
    }
    let owners: Vec<(String, String)> = sqlx::query_as(
        "SELECT d.owner, d.state FROM deliveries d JOIN reminders r ON r.id = d.reminder_id
         WHERE r.event_id LIKE 'after%'",
    )
    .fetch_all(env.ledger.pool())
    .await
    .unwrap();
    assert_eq!(owners.len(), 5);
    assert!(
        owners
            .iter()
            .all(|(owner, state)| owner == "legacy" && state == "scheduled")
    );

    // nudge's relay cannot claim them (this handle works for nudge, as the relay does).
    assert!(
        env.ledger
            .claim_due(Channel::Sms, 100, nudge_ledger::LedgerTime::Database)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        stats(env.stub_stats().await.unwrap())
            .unwrap()
            .total
            .accepted,
        50
    );

    // Rolling back again returns the channel to nudge: its buckets are left alone, and the
    // five are sent.
    let (code, out, err) = env
        .nudgectl(&[
            "rollback",
            "--channel",
            "sms",
            "--reason",
            "back to nudge",
            "--wait",
            "30s",
        ])
        .unwrap();
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("its rate buckets are left as they are"),
        "{out}"
    );
    assert!(
        out.contains("at rate 0, so sending nothing yet: sms-main"),
        "{out}"
    );
    let (code, _, err) = env
        .nudgectl(&[
            "rate",
            "set",
            "sms-main",
            "sms",
            "20",
            "--reason",
            "nudge sends again",
        ])
        .unwrap();
    assert_eq!(code, 0, "{err}");
    wait_count(
        &mut env,
        "the five to be delivered by nudge",
        "channel = 'sms' AND state = 'delivered'",
        55,
        Duration::from_secs(60),
    )
    .await;

    let totals = stats(env.stub_stats().await.unwrap()).unwrap().total;
    assert_eq!(totals.duplicates, 0);
    assert_eq!(totals.accepted, 55);
    let exits = env.stop_all(Duration::from_secs(10));
    assert!(
        exits.iter().all(|(_, code)| *code == Some(0)),
        "every process stops cleanly: {exits:?}"
    );
}
