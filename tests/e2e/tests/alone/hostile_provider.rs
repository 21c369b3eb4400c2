//! A hostile provider against the real processes: every bad form of `Retry-After`, a hang on an
//! account without idempotency, and a huge `Retry-After` on an account with a bucket while the
//! other deliveries on that account carry on.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use chrono::Utc;
use nudge_domain::{Channel, DeliveryState, OutcomeClass};
use nudge_e2e::{TestEnv, WorkerOptions, stats};
use serde_json::json;

/// Deliveries of `tenant` (by name) and their state.
async fn states_of(env: &TestEnv, tenant: &str) -> Vec<(uuid::Uuid, String)> {
    sqlx::query_as(
        "SELECT d.id, d.state FROM deliveries d JOIN tenants t ON t.id = d.tenant_id
         WHERE t.name = $1 ORDER BY d.id",
    )
    .bind(tenant)
    .fetch_all(env.ledger.pool())
    .await
    .unwrap()
}

fn settled(states: &[(uuid::Uuid, String)]) -> bool {
    states.iter().all(|(_, s)| {
        !matches!(
            s.as_str(),
            "scheduled" | "queued" | "sending" | "retry_wait"
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_provider_cannot_stop_an_account_resend_a_maybe_sent_message_or_be_retried_early()
{
    let _alone = crate::alone().await;
    let mut env = TestEnv::start("hostile").await.unwrap();
    let now = Utc::now();
    let soon = now + chrono::Duration::minutes(10);

    // SMS: one account per hostile answer, each routed to its own tenant, every one with a
    // bucket; `sms-main` is the default.
    let mut sms = WorkerOptions::for_channel(Channel::Sms);
    sms.accounts = ["sms-main", "sms-odd", "sms-far", "sms-overflow"]
        .into_iter()
        .map(|a| (a.to_owned(), true, a == "sms-main"))
        .collect();
    sms.rate = Some((50.0, 10));
    sms.max_pause_s = 3;
    env.script(
        "sms-odd",
        json!({"sequence": [
            {"status": 429, "retry_after": "+3"},
            {"status": 429, "retry_after": "soon"},
            {"status": 429, "retry_after": "Sun, 06 Nov 1994 08:49:37 GMT"}
        ]}),
    )
    .await
    .unwrap();
    env.script(
        "sms-far",
        json!({"sequence": [{"status": 429, "retry_after": "Fri, 31 Dec 9999 23:59:59 GMT"}]}),
    )
    .await
    .unwrap();
    env.script(
        "sms-overflow",
        json!({"sequence": [{"status": 429, "retry_after": "99999999999999999999999"}]}),
    )
    .await
    .unwrap();
    // The bucketed default account: each key first gets a 429 asking for three years; the
    // first two keys' answers come within a second of each other, and the second is the one
    // that pauses the bucket (one alone is about its own request, decision 0120).
    env.script(
        "sms-main",
        json!({"sequence": [{"status": 429, "retry_after": "99999999"}]}),
    )
    .await
    .unwrap();
    for (tenant, account) in [
        ("clinic-odd", "sms-odd"),
        ("clinic-far", "sms-far"),
        ("clinic-overflow", "sms-overflow"),
    ] {
        let id = env.tenant(tenant, 2).await.unwrap();
        let (code, out, err) = env
            .nudgectl(&[
                "tenant", "route", tenant, "sms", account, "--reason", "test",
            ])
            .unwrap();
        assert_eq!(code, 0, "{out}{err}");
        for i in 0..2 {
            env.reminder(id, &format!("{tenant}-{i}"), &[Channel::Sms], now, soon)
                .await
                .unwrap();
        }
    }
    // Email: an account without idempotency whose provider never answers.
    let mut email = WorkerOptions::for_channel(Channel::Email);
    email.accounts = vec![("email-main".to_owned(), false, true)];
    email.provider_timeout_ms = 1_500;
    env.script("email-main", json!({"sequence": [{"hang": true}]}))
        .await
        .unwrap();
    let hang = env.tenant("clinic-hang", 2).await.unwrap();
    env.reminder(hang, "hang-0", &[Channel::Email], now, soon)
        .await
        .unwrap();
    // The main account's first two deliveries, alone, get the huge Retry-After.
    let main = env.tenant("clinic-main", 2).await.unwrap();
    for first in ["main-first", "main-second"] {
        env.reminder(main, first, &[Channel::Sms], now, soon)
            .await
            .unwrap();
    }

    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    env.start_worker(Channel::Sms, "worker-sms", &sms).unwrap();
    env.start_worker(Channel::Email, "worker-email", &email)
        .unwrap();

    // Once the main account has answered its 429, the rest of its work arrives, and the
    // provider takes it.
    let stub_url = env.stub_url.clone();
    let http = env.http.clone();
    let answered = env
        .wait_for(
            "the huge Retry-Afters to be answered",
            Duration::from_secs(30),
            || {
                let (http, url) = (http.clone(), stub_url.clone());
                async move {
                    let s = stats(
                        http.get(format!("{url}/stats"))
                            .send()
                            .await?
                            .json()
                            .await?,
                    )?;
                    let n = s.accounts.get("sms-main").map_or(0, |a| a.requests);
                    Ok((n >= 2).then(Utc::now))
                }
            },
        )
        .await;
    env.script("sms-main", json!({})).await.unwrap();
    let (code, out, err) = env.nudgectl(&["rate", "list", "--json"]).unwrap();
    assert_eq!(code, 0, "{out}{err}");
    let buckets: serde_json::Value = serde_json::from_str(&out).unwrap();
    let main_bucket = buckets
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["account"] == "sms-main")
        .unwrap()
        .clone();
    let paused_until: chrono::DateTime<Utc> =
        serde_json::from_value(main_bucket["paused_until"].clone()).unwrap();
    // Tolerance: the 429 was answered up to a poll (50 ms) and a recording before `answered`.
    assert!(
        paused_until <= answered + chrono::Duration::seconds(4),
        "a 3-year Retry-After paused the bucket until {paused_until}"
    );
    let cause = main_bucket["pause_cause"].as_str().unwrap_or_default();
    assert!(cause.contains("max_pause_s"), "pause cause: {cause:?}");
    for i in 0..20 {
        env.reminder(
            main,
            &format!("main-{i}"),
            &[Channel::Sms],
            Utc::now(),
            soon,
        )
        .await
        .unwrap();
    }

    let ledger = env.ledger.clone();
    env.wait_for("every delivery to settle", Duration::from_secs(90), || {
        let ledger = ledger.clone();
        async move {
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM deliveries
                     WHERE state IN ('scheduled', 'queued', 'sending', 'retry_wait')",
            )
            .fetch_one(ledger.pool())
            .await?;
            Ok((open == 0).then_some(()))
        }
    })
    .await;
    let delivered_main_at = Utc::now();

    // Malformed and past-date headers: retried on the backoff, then delivered.
    let odd = states_of(&env, "clinic-odd").await;
    assert!(settled(&odd));
    for (id, state) in &odd {
        assert_eq!(state, "delivered");
        let attempts = env
            .ledger
            .attempts(nudge_domain::DeliveryId::from_uuid(*id))
            .await
            .unwrap();
        assert_eq!(attempts.len(), 4);
        assert!(!attempts[0].retry_after_valid, "+3 is malformed");
        assert!(!attempts[1].retry_after_valid, "soon is malformed");
        assert!(attempts[2].retry_after_valid, "a past date is valid: now");
        for a in &attempts[..3] {
            assert!(
                a.delay_chosen.unwrap() <= Duration::from_secs(1),
                "the capped backoff, never a long wait: {:?}",
                a.delay_chosen
            );
        }
    }
    // A far-future date and an overflowing delta: one request each, never retried early.
    for tenant in ["clinic-far", "clinic-overflow"] {
        for (id, state) in states_of(&env, tenant).await {
            assert!(
                state == "expired" || state == "dead_lettered",
                "{tenant}: {state}"
            );
            let attempts = env
                .ledger
                .attempts(nudge_domain::DeliveryId::from_uuid(id))
                .await
                .unwrap();
            assert_eq!(attempts.len(), 1, "{tenant}");
            assert!(
                attempts[0].retry_after_valid,
                "{tenant}: a valid, very long wait"
            );
        }
    }
    // The hang without idempotency: held for review, sent once.
    let hung = states_of(&env, "clinic-hang").await;
    assert_eq!(hung.len(), 1);
    assert_eq!(hung[0].1, DeliveryState::Ambiguous.as_str());
    let attempts = env
        .ledger
        .attempts(nudge_domain::DeliveryId::from_uuid(hung[0].0))
        .await
        .unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].outcome_class, OutcomeClass::Ambiguous);
    // The main account: its first two deliveries follow the retry ceiling; the 20 others went
    // through once the bounded pause was over.
    let main_states = states_of(&env, "clinic-main").await;
    assert_eq!(main_states.len(), 22);
    let delivered = main_states.iter().filter(|(_, s)| s == "delivered").count();
    assert_eq!(delivered, 20, "{main_states:?}");
    eprintln!(
        "hostile provider: bucket paused until {paused_until} (answered {answered}); the other 20 \
         delivered by {delivered_main_at}"
    );

    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    let email_requests = stub.accounts.get("email-main").map_or(0, |a| a.requests);
    assert_eq!(email_requests, 1, "the maybe-sent message was not resent");
    let far = stub.accounts.get("sms-far").map_or(0, |a| a.requests);
    let overflow = stub.accounts.get("sms-overflow").map_or(0, |a| a.requests);
    assert_eq!((far, overflow), (2, 2), "one request per delivery");
    for (name, code) in env.stop_all(Duration::from_secs(10)) {
        assert_eq!(code, Some(0), "{name} exits cleanly");
    }
}
