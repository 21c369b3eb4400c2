//! The rollback switch: a rate of 0 stops new sends; raising it resumes them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use crate::admission_common::{limited, wait_delivered};
use chrono::{DateTime, Utc};
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, keys_report};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_of_zero_stops_new_sends_and_raising_it_resumes() {
    let _alone = crate::alone().await;
    let mut env = TestEnv::start("rate-zero").await.unwrap();
    let tenant = env.tenant("clinic-z", 2).await.unwrap();
    let now = Utc::now();
    for i in 0..200 {
        env.reminder(
            tenant,
            &format!("z-{i}"),
            &[Channel::Sms],
            now,
            now + chrono::Duration::minutes(10),
        )
        .await
        .unwrap();
    }
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    env.start_worker(Channel::Sms, "worker-sms", &limited(Channel::Sms, 20.0, 5))
        .unwrap();
    wait_delivered(&mut env, Channel::Sms, 40, Duration::from_secs(60)).await;

    let (code, out, err) = env
        .nudgectl(&[
            "rate",
            "set",
            "sms-main",
            "sms",
            "0",
            "--reason",
            "provider incident",
        ])
        .unwrap();
    assert_eq!(code, 0, "{out}{err}");
    let stopped_at = Utc::now();
    // Sends already on the wire finish; nothing new starts. Wait until the workers have been
    // seen honouring the closed bucket twice, one recheck apart: a delivery handed back to the
    // ledger (`retry_wait`) after the change, then, once republished, handed back again.
    let watched = env.ledger.clone();
    let released_after = |since: DateTime<Utc>| {
        let ledger = watched.clone();
        move || {
            let ledger = ledger.clone();
            async move {
                let at: Option<DateTime<Utc>> = sqlx::query_scalar(
                    "SELECT max(updated_at) FROM deliveries
                     WHERE state = 'retry_wait' AND attempt_count = 0 AND updated_at > $1",
                )
                .bind(since)
                .fetch_one(ledger.pool())
                .await?;
                Ok(at)
            }
        }
    };
    let first = env
        .wait_for(
            "a delivery handed back while the rate is 0",
            Duration::from_secs(20),
            released_after(stopped_at),
        )
        .await;
    env.wait_for(
        "a second hand-back, one recheck later",
        Duration::from_secs(20),
        released_after(first + chrono::Duration::milliseconds(900)),
    )
    .await;
    // The bucket is closed until the command below commits: sends before this instant cannot
    // have been let through by the resume.
    let resumed_at = Utc::now();
    let (code, out, err) = env
        .nudgectl(&[
            "rate",
            "set",
            "sms-main",
            "sms",
            "20",
            "--reason",
            "incident over",
        ])
        .unwrap();
    assert_eq!(code, 0, "{out}{err}");
    wait_delivered(&mut env, Channel::Sms, 200, Duration::from_secs(90)).await;

    let keys = keys_report(env.stub_keys().await.unwrap()).unwrap();
    let times: Vec<DateTime<Utc>> = keys
        .keys
        .iter()
        .flat_map(|k| k.requests.iter().map(|r| r.at))
        .collect();
    let grace = chrono::Duration::milliseconds(500);
    let while_closed = times
        .iter()
        .filter(|t| **t > stopped_at + grace && **t < resumed_at)
        .count();
    let after = times.iter().filter(|t| **t >= resumed_at).count();
    let before = times.iter().filter(|t| **t <= stopped_at + grace).count();
    eprintln!(
        "e2e rate zero: sent before={before} while_closed={while_closed} after_resume={after}"
    );
    assert_eq!(while_closed, 0, "no sends while the rate was 0");
    assert!(after > 0 && before + after == times.len());
    let audit: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE action = 'rate_set'")
        .fetch_one(env.ledger.pool())
        .await
        .unwrap();
    assert_eq!(audit, 2, "both changes audited");
}
