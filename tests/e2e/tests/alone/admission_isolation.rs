//! A throttled channel never slows another: an SMS storm of 429s next to push delivery.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use crate::admission_common::{limited, wait_delivered};
use chrono::{DateTime, Utc};
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, keys_report, stats};

/// Mean time from scheduled_at (or from `started`, when the processes started after it: the
/// setup's own speed is not the system's) to the provider's acceptance, over one account's keys.
async fn mean_latency_ms(
    env: &TestEnv,
    account: &str,
    scheduled: &std::collections::HashMap<String, DateTime<Utc>>,
    started: DateTime<Utc>,
) -> f64 {
    let keys = keys_report(env.stub_keys().await.unwrap()).unwrap();
    let latencies: Vec<i64> = keys
        .keys
        .iter()
        .filter(|k| k.account == account)
        .filter_map(|k| Some((k.accepted_at? - scheduled[&k.key].max(started)).num_milliseconds()))
        .collect();
    assert_eq!(latencies.len(), scheduled.len());
    latencies.iter().sum::<i64>() as f64 / latencies.len() as f64
}

/// 200 push reminders behind a 20/s bucket, optionally next to an SMS storm against a
/// provider that allows 1 request/s and answers 429 past it. Returns the push mean latency.
async fn push_latency(with_sms_storm: bool) -> f64 {
    let mut env = TestEnv::start(if with_sms_storm {
        "isolation-storm"
    } else {
        "isolation-calm"
    })
    .await
    .unwrap();
    let tenant = env.tenant("clinic-i", 2).await.unwrap();
    if with_sms_storm {
        env.script("sms-main", serde_json::json!({"rate_limit": {"per_second": 1, "burst": 1, "retry_after": "delta"}}))
            .await
            .unwrap();
    }
    // The storm's reminders are made first, due as soon as the producer runs, so that the push
    // reminders' setup (from `due` to the processes' start) is the same in both runs.
    if with_sms_storm {
        let sms_due = Utc::now();
        for i in 0..400 {
            env.reminder(
                tenant,
                &format!("sms-{i}"),
                &[Channel::Sms],
                sms_due,
                sms_due + chrono::Duration::minutes(10),
            )
            .await
            .unwrap();
        }
    }
    let due = Utc::now() + chrono::Duration::seconds(3);
    let mut scheduled = std::collections::HashMap::new();
    for i in 0..200 {
        let created = env
            .reminder(
                tenant,
                &format!("push-{i}"),
                &[Channel::Push],
                due,
                due + chrono::Duration::minutes(10),
            )
            .await
            .unwrap();
        scheduled.insert(
            nudge_domain::IdempotencyKey::for_delivery(created.id, Channel::Push).to_string(),
            due,
        );
    }
    let started = Utc::now();
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    env.start_worker(
        Channel::Push,
        "worker-push",
        &limited(Channel::Push, 20.0, 5),
    )
    .unwrap();
    if with_sms_storm {
        env.start_worker(Channel::Sms, "worker-sms", &limited(Channel::Sms, 20.0, 5))
            .unwrap();
    }
    wait_delivered(&mut env, Channel::Push, 200, Duration::from_secs(90)).await;
    let latency = mean_latency_ms(&env, "push-main", &scheduled, started).await;
    if with_sms_storm {
        let stub = stats(env.stub_stats().await.unwrap()).unwrap();
        let sms = &stub.accounts["sms-main"];
        eprintln!(
            "e2e isolation: sms storm requests={} rate_limited={} accepted={}",
            sms.requests, sms.rate_limited, sms.accepted
        );
        assert!(
            sms.rate_limited > 0,
            "the SMS provider really was throttling"
        );
    }
    latency
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sms_storm_of_429s_does_not_slow_push_delivery() {
    let _alone = crate::alone().await;
    let calm = push_latency(false).await;
    let storm = push_latency(true).await;

    let change = (storm - calm) / calm;
    eprintln!(
        "e2e isolation: push mean latency calm={calm:.0} ms storm={storm:.0} ms change={:.1}%",
        change * 100.0
    );
    // Tolerance 25%: the push bucket (20/s, 200 pushes) sets a mean of a few seconds either
    // way, and the storm run has one more process (the SMS worker) on a machine of two cores,
    // which moved the mean by more than 10% under load with nothing wrong. A storm that
    // reached push's admission would hold pushes behind 400 SMS at 1/s: minutes, not 25%.
    assert!(
        change.abs() <= 0.25,
        "push latency moved by {:.1}% (calm {calm:.0} ms, storm {storm:.0} ms)",
        change * 100.0
    );
}
