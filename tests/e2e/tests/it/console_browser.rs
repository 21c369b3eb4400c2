//! The console in a real browser: the real binaries seed a ledger (five SMS answered 400 and
//! dead-lettered, three emails delivered, four push reminders waiting for later), then
//! `nudge-console` serves it and `tests/browser/console.mjs` drives Debian's Chromium through
//! playwright-core: the operator reads every page (axe-core: no serious violation), runs a
//! redrive's dry run and executes it; the viewer reads every page without JavaScript, is
//! offered no action, and their POST is refused. Screenshots go to NUDGE_CONSOLE_SCREENSHOTS
//! (default `target/console-screenshots`; `docs/console/` holds the committed ones).
//! scripts/browser.sh installs the browser and the npm packages (scripts/test.sh runs it).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, states_in};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn node() -> String {
    std::env::var("NUDGE_TEST_NODE").unwrap_or_else(|_| {
        panic!("NUDGE_TEST_NODE is not set: run the tests with scripts/test.sh, which installs the browser test's packages (scripts/browser.sh)")
    })
}

fn token(env: &TestEnv, name: &str, role: &str) -> String {
    let (code, out, err) = env
        .nudgectl(&[
            "console",
            "token",
            "create",
            "--name",
            name,
            "--role",
            role,
            "--expires-in",
            "1h",
            "--reason",
            "browser test",
        ])
        .unwrap();
    assert_eq!(code, 0, "nudgectl console token create: {err}");
    out.trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_answers_the_on_call_questions_in_a_real_browser() {
    let mut env = TestEnv::start("console").await.unwrap();
    let big = env.tenant("big-clinic", 2).await.unwrap();
    let small = env.tenant("small-clinic", 2).await.unwrap();
    env.script("sms-main", serde_json::json!({"default": {"status": 400}}))
        .await
        .unwrap();
    let now = Utc::now();
    for i in 0..5 {
        env.reminder(
            big,
            &format!("sms-{i}"),
            &[Channel::Sms],
            now,
            now + chrono::Duration::hours(1),
        )
        .await
        .unwrap();
    }
    for i in 0..3 {
        env.reminder(
            small,
            &format!("mail-{i}"),
            &[Channel::Email],
            now,
            now + chrono::Duration::hours(1),
        )
        .await
        .unwrap();
    }
    let later = now + chrono::Duration::hours(2);
    for i in 0..4 {
        env.reminder(
            small,
            &format!("later-{i}"),
            &[Channel::Push],
            later,
            later + chrono::Duration::hours(1),
        )
        .await
        .unwrap();
    }
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    for channel in [Channel::Sms, Channel::Email] {
        env.start_worker(
            channel,
            &format!("worker-{channel}"),
            &WorkerOptions::for_channel(channel),
        )
        .unwrap();
    }
    let ledger = env.ledger.clone();
    env.wait_for(
        "5 dead letters and 3 deliveries",
        Duration::from_secs(90),
        || {
            let ledger = ledger.clone();
            async move {
                let states = states_in(&ledger).await?;
                let dead = states.get("dead_lettered").copied().unwrap_or(0);
                let delivered = states.get("delivered").copied().unwrap_or(0);
                Ok((dead == 5 && delivered == 3).then_some(()))
            }
        },
    )
    .await;
    // What the pages show stays put from here: only the console runs.
    let stopped = env.stop_all(Duration::from_secs(15));
    assert!(
        stopped.iter().all(|(_, code)| *code == Some(0)),
        "{stopped:?}"
    );
    let dead: uuid::Uuid = sqlx::query_scalar(
        "SELECT id FROM deliveries WHERE state = 'dead_lettered' ORDER BY id LIMIT 1",
    )
    .fetch_one(env.ledger.pool())
    .await
    .unwrap();

    let (_, base) = env.start_console("console", "").await.unwrap();
    let operator = token(&env, "otto", "operator");
    let viewer = token(&env, "vera", "viewer");
    let shots = std::env::var("NUDGE_CONSOLE_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo().join("target/console-screenshots"));
    let mut command = tokio::process::Command::new(node());
    command
        .arg(repo().join("tests/browser/console.mjs"))
        .env("NUDGE_CONSOLE_URL", &base)
        .env("NUDGE_CONSOLE_OPERATOR_TOKEN", &operator)
        .env("NUDGE_CONSOLE_VIEWER_TOKEN", &viewer)
        .env("NUDGE_CONSOLE_TRACE_ID", dead.to_string())
        .env("NUDGE_CONSOLE_TENANT", "small-clinic")
        .env("NUDGE_CONSOLE_SCREENSHOTS", &shots)
        .kill_on_drop(true);
    let ran = tokio::time::timeout(Duration::from_secs(180), command.output())
        .await
        .expect("the browser test finishes within 180 s")
        .unwrap();
    let out = String::from_utf8_lossy(&ran.stdout);
    let err = String::from_utf8_lossy(&ran.stderr);
    eprintln!("console browser test: {out}");
    assert!(
        ran.status.success(),
        "the browser test failed: {err}\n{out}"
    );

    // What the browser did is in the ledger: one redrive of the five, by the operator; the
    // viewer wrote nothing.
    let (selected, actor, incident): (i32, String, Option<String>) =
        sqlx::query_as("SELECT selected, actor, incident FROM redrives")
            .fetch_one(env.ledger.pool())
            .await
            .unwrap();
    assert_eq!(selected, 5);
    assert!(actor.starts_with("console:otto#"), "{actor}");
    assert_eq!(incident.as_deref(), Some("INC-BROWSER"));
    let viewer_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE actor LIKE 'console:vera#%'")
            .fetch_one(env.ledger.pool())
            .await
            .unwrap();
    assert_eq!(viewer_rows, 0, "the viewer wrote nothing");
    let summary: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(summary["redrive"]["planned"], 5);
    assert_eq!(summary["viewer"]["post_status"], 403);
    for page in [
        "overview",
        "tenants",
        "dead-letters",
        "redrives",
        "trace",
        "audit",
    ] {
        assert!(
            summary["pages"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == page),
            "{page} was read"
        );
        assert!(shots.join(format!("{page}.png")).is_file(), "{page}.png");
    }
    let stopped = env.stop_all(Duration::from_secs(15));
    assert!(
        stopped.iter().all(|(_, code)| *code == Some(0)),
        "{stopped:?}"
    );
}
