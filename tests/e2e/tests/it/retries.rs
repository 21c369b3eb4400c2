//! 429s with every form of Retry-After, against the real processes: the next attempt never
//! comes earlier than the header said, missing or malformed headers fall back to the capped
//! backoff, and every attempt carries the same idempotency key.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use chrono::Utc;
use nudge_domain::{Channel, IdempotencyKey, OutcomeClass, RetryAfter};
use nudge_e2e::{TestEnv, WorkerOptions, count_in, keys_report};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_form_of_retry_after_is_honoured_and_bad_ones_fall_back_to_the_capped_backoff() {
    let mut env = TestEnv::start("retry-after").await.unwrap();
    let tenant = env.tenant("clinic-r", 2).await.unwrap();
    // Per idempotency key, in turn: delta-seconds, IMF-fixdate, none, malformed, RFC 850,
    // asctime; then accepted.
    env.script(
        "sms-main",
        serde_json::json!({
            "sequence": [
                {"status": 429, "retry_after": "2"},
                {"status": 429, "retry_after": "@http_date+3"},
                {"status": 429},
                {"status": 429, "retry_after": "soon"},
                {"status": 429, "retry_after": "@rfc850+2"},
                {"status": 429, "retry_after": "@asctime+2"}
            ],
            "default": {"status": 202}
        }),
    )
    .await
    .unwrap();
    let now = Utc::now();
    let mut reminders = Vec::new();
    for i in 0..3 {
        let created = env
            .reminder(
                tenant,
                &format!("r{i}"),
                &[Channel::Sms],
                now,
                now + chrono::Duration::minutes(10),
            )
            .await
            .unwrap();
        reminders.push(created.id);
    }
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    let options = WorkerOptions::for_channel(Channel::Sms); // backoff: base 200 ms, cap 1 s
    env.start_worker(Channel::Sms, "worker-sms", &options)
        .unwrap();

    let ledger = env.ledger.clone();
    env.wait_for(
        "all three to be delivered after six 429s each",
        Duration::from_secs(120),
        || {
            let ledger = ledger.clone();
            async move {
                let delivered = count_in(&ledger, "delivered").await?;
                Ok((delivered == 3).then_some(()))
            }
        },
    )
    .await;

    let keys = keys_report(env.stub_keys().await.unwrap()).unwrap();
    assert_eq!(
        keys.keys.len(),
        3,
        "one idempotency key per delivery, reused on every attempt"
    );
    for reminder in reminders {
        let delivery = &env.ledger.deliveries_of_reminder(reminder).await.unwrap()[0];
        let key = IdempotencyKey::for_delivery(reminder, Channel::Sms);
        let seen = keys
            .get("sms-main", key.as_str())
            .expect("the stub saw the key");
        let attempts = env.ledger.attempts(delivery.id).await.unwrap();
        assert_eq!(attempts.len(), 7);
        assert_eq!(seen.requests.len(), 7, "the same key on all seven requests");
        assert_eq!(attempts[6].outcome_class, OutcomeClass::Delivered);

        for (n, attempt) in attempts.iter().take(6).enumerate() {
            assert_eq!(attempt.outcome_class, OutcomeClass::Retryable);
            assert_eq!(attempt.http_status, Some(429));
            let delay = attempt.delay_chosen.expect("a retry records its delay");
            let next_request = seen.requests[n + 1].at;
            match n {
                // No header, then a malformed one: full-jitter backoff under its cap.
                2 | 3 => {
                    assert!(
                        !attempt.retry_after_valid,
                        "attempt {}: {:?}",
                        n + 1,
                        attempt.retry_after_seen
                    );
                    let cap = Duration::from_millis((200u64 << n).min(1_000));
                    assert!(
                        delay <= cap,
                        "attempt {}: {delay:?} above the cap {cap:?}",
                        n + 1
                    );
                    assert_eq!(
                        attempt.retry_after_seen.as_deref(),
                        if n == 3 { Some("soon") } else { None }
                    );
                }
                // Valid headers: never earlier than they said.
                _ => {
                    assert!(
                        attempt.retry_after_valid,
                        "attempt {}: {:?}",
                        n + 1,
                        attempt.retry_after_seen
                    );
                    let header = attempt.retry_after_seen.as_deref().unwrap();
                    let not_before = RetryAfter::parse(header)
                        .unwrap()
                        .resolve(attempt.finished_at);
                    assert!(
                        next_request >= not_before,
                        "attempt {} said {header:?} (not before {not_before}) but the next request came at {next_request}",
                        n + 1
                    );
                    assert_eq!(attempt.next_attempt_at, Some(not_before));
                }
            }
        }
        let gaps: Vec<i64> = seen
            .requests
            .windows(2)
            .map(|w| (w[1].at - w[0].at).num_milliseconds())
            .collect();
        eprintln!(
            "e2e retry-after: {} headers={:?} gaps_ms={gaps:?} delays_ms={:?}",
            key,
            attempts
                .iter()
                .map(|a| a.retry_after_seen.clone())
                .collect::<Vec<_>>(),
            attempts
                .iter()
                .map(|a| a.delay_chosen.map(|d| d.as_millis()))
                .collect::<Vec<_>>()
        );
        assert!(gaps[0] >= 2_000, "delta-seconds 2 was honoured: {gaps:?}");
    }
    let stopped = env.stop_all(Duration::from_secs(15));
    assert!(
        stopped.iter().all(|(_, code)| *code == Some(0)),
        "{stopped:?}"
    );
}
