//! Replicas share one bucket: two SMS workers together stay within its rate plus burst.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use crate::admission_common::{limited, wait_delivered};
use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, stats};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_on_one_bucket_never_exceed_its_rate_plus_burst() {
    let _alone = crate::alone().await;
    let mut env = TestEnv::start("shared-bucket").await.unwrap();
    let tenant = env.tenant("clinic-s", 2).await.unwrap();
    // Due once the workers are up: the bucket's bound is exact at admission, and what the
    // provider sees adds only the send path's jitter, not a cold start's.
    let due = Utc::now() + chrono::Duration::seconds(4);
    for i in 0..240 {
        env.reminder(
            tenant,
            &format!("s-{i}"),
            &[Channel::Sms],
            due,
            due + chrono::Duration::minutes(10),
        )
        .await
        .unwrap();
    }
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    let ports = [nudge_e2e::free_port(), nudge_e2e::free_port()];
    for (name, port) in ["worker-a", "worker-b"].into_iter().zip(ports) {
        let mut options = limited(Channel::Sms, 20.0, 5);
        options.metrics_port = Some(port);
        env.start_worker(Channel::Sms, name, &options).unwrap();
    }

    wait_delivered(&mut env, Channel::Sms, 240, Duration::from_secs(90)).await;

    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    let sms = &stub.accounts["sms-main"];
    let span = (sms.last_request_at.unwrap() - sms.first_request_at.unwrap()).num_milliseconds()
        as f64
        / 1000.0;
    let workers: i64 = sqlx::query_scalar("SELECT count(DISTINCT worker) FROM attempts")
        .fetch_one(env.ledger.pool())
        .await
        .unwrap();
    eprintln!(
        "e2e shared bucket: requests={} max_in_any_second={} span_s={span:.2} rate={:.1}/s workers_sending={workers}",
        sms.requests,
        sms.max_requests_in_any_second,
        f64::from(u32::try_from(sms.requests).unwrap()) / span
    );
    assert_eq!(workers, 2, "both replicas sent");

    // Each replica exposes the bucket's rates and its own attempts on /metrics.
    let mut attempts = 0.0;
    for port in ports {
        let text = env
            .http
            .get(format!("http://127.0.0.1:{port}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            text.contains(
                r#"nudge_bucket_effective_rate{provider_account="sms-main",channel="sms"} 20.0"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"nudge_bucket_rate{provider_account="sms-main",channel="sms"} 20.0"#),
            "{text}"
        );
        attempts += text
            .lines()
            .filter(|l| {
                l.starts_with("nudge_attempts_total{") && l.contains(r#"next_state="delivered""#)
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    assert_eq!(
        attempts, 240.0,
        "the replicas' attempt counters add up to the deliveries"
    );
    assert!(
        sms.max_requests_in_any_second <= 25,
        "{} > 20/s + burst 5",
        sms.max_requests_in_any_second
    );
    assert!(
        span >= (240.0 - 5.0) / 20.0 - 0.5,
        "paced, not bunched: {span:.2} s"
    );
}
