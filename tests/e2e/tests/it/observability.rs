//! Every long-running binary serves `/metrics`, `/healthz` and `/readyz` on its admin
//! address, and the series the dashboards and alerts read exist and move with the work: a
//! reminder posted to the intake, throttled once and then delivered, shows up in the intake's,
//! the producer's, the worker's and the janitor's metrics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, count_in};
use serde_json::json;

/// The value of the sample `series` (name and labels exactly as encoded) in a scrape.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
}

/// Waits until the scrape of `name` has `series` at `want` (at least, when `at_least`).
async fn wait_sample(env: &mut TestEnv, name: &str, series: &str, want: f64, at_least: bool) {
    let scrape = {
        let (http, url) = (env.http.clone(), env.admin_url(name).unwrap());
        move || {
            let (http, url) = (http.clone(), url.clone());
            async move {
                Ok::<_, anyhow::Error>(
                    http.get(format!("{url}/metrics"))
                        .send()
                        .await?
                        .text()
                        .await?,
                )
            }
        }
    };
    let what = format!("{name}'s {series} to reach {want}");
    let series = series.to_owned();
    env.wait_for(&what, Duration::from_secs(60), || {
        let (scrape, series) = (scrape.clone(), series.clone());
        async move {
            let text = scrape().await?;
            Ok(sample(&text, &series)
                .filter(|v| if at_least { *v >= want } else { *v == want })
                .map(|_| ()))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_binary_serves_health_readiness_and_metrics_that_move_with_a_delivery() {
    let mut env = TestEnv::start("observability").await.unwrap();
    env.admin_listeners = true;
    let tenant = env.tenant("clinic-obs", 2).await.unwrap();
    let secret = env.rotate_secret("clinic-obs").unwrap();
    // Each reminder's first answer is a 429 that asks for three seconds (the stub's sequence is
    // per message); the second comes before the first one's three seconds have passed, so it
    // pauses the bucket (decision 0120). The retries are accepted.
    env.script(
        "sms-main",
        json!({
            "sequence": [{"status": 429, "retry_after": "3"}],
            "default": {"status": 202}
        }),
    )
    .await
    .unwrap();
    let (_, url) = env.start_intake("intake").await.unwrap();
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.rate = Some((50.0, 10));
    env.start_worker(Channel::Sms, "sms", &options).unwrap();

    for name in ["intake", "producer", "janitor", "sms"] {
        let base = env.admin_url(name).unwrap();
        let http = env.http.clone();
        env.wait_for(
            &format!("{name} to answer /healthz and /readyz"),
            Duration::from_secs(30),
            || {
                let (http, base) = (http.clone(), base.clone());
                async move {
                    let health = http.get(format!("{base}/healthz")).send().await?;
                    let ready = http.get(format!("{base}/readyz")).send().await?;
                    Ok((health.status().is_success() && ready.status().is_success()).then_some(()))
                }
            },
        )
        .await;
    }

    let now = Utc::now();
    for event in ["appt-obs-1", "appt-obs-2"] {
        let body = serde_json::to_vec(&json!({
            "event_id": event,
            "subscriber_ref": "patient-obs",
            "channels": ["sms"],
            "scheduled_at": now.to_rfc3339(),
            "expires_at": (now + chrono::Duration::minutes(10)).to_rfc3339(),
            "destinations": {"sms": "+15550199"},
            "content": {"template": "appointment"}
        }))
        .unwrap();
        let answer = env
            .signed(
                reqwest::Method::POST,
                &format!("{url}/v1/tenants/clinic-obs/reminders"),
                &secret,
                body,
            )
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status().as_u16(), 202);
    }

    let ledger = env.ledger.clone();
    env.wait_for(
        "both reminders to be delivered after one 429 each",
        Duration::from_secs(60),
        || {
            let ledger = ledger.clone();
            async move {
                let delivered = count_in(&ledger, "delivered").await?;
                Ok((delivered == 2).then_some(()))
            }
        },
    )
    .await;

    // The intake counted the accepted reminders.
    wait_sample(
        &mut env,
        "intake",
        "nudge_intake_reminders_total{outcome=\"accepted\"}",
        2.0,
        false,
    )
    .await;
    // The producer ran windows and published the first attempts and the retries (and again
    // any lease the pause gave back).
    wait_sample(
        &mut env,
        "producer",
        "nudge_relay_published_total{channel=\"sms\"}",
        4.0,
        true,
    )
    .await;
    // The tenant's windows run every second (empty ones too: the intake materialised the
    // reminder itself, as its time had come).
    let producer = env.scrape("producer").await.unwrap();
    let windows: f64 = producer
        .lines()
        .filter(|l| l.starts_with("nudge_windows_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(windows >= 1.0, "{producer}");
    // The worker: two 429s (valid Retry-Afters; the second paused the bucket), then two 2xx.
    for (series, want) in [
        (
            "nudge_attempts_total{provider_account=\"sms-main\",channel=\"sms\",response_class=\"429\",outcome_class=\"retryable\",next_state=\"retry_wait\"}",
            2.0,
        ),
        (
            "nudge_attempts_total{provider_account=\"sms-main\",channel=\"sms\",response_class=\"2xx\",outcome_class=\"delivered\",next_state=\"delivered\"}",
            2.0,
        ),
        (
            "nudge_retry_after_total{provider_account=\"sms-main\",channel=\"sms\",validity=\"valid\"}",
            2.0,
        ),
        (
            "nudge_bucket_pauses_total{provider_account=\"sms-main\",channel=\"sms\"}",
            1.0,
        ),
        (
            "nudge_bucket_rate{provider_account=\"sms-main\",channel=\"sms\"}",
            50.0,
        ),
        (
            "nudge_scheduled_to_delivered_seconds_count{channel=\"sms\"}",
            2.0,
        ),
        (
            "nudge_provider_request_duration_seconds_count{provider_account=\"sms-main\",channel=\"sms\"}",
            4.0,
        ),
    ] {
        wait_sample(&mut env, "sms", series, want, false).await;
    }
    // The janitor's picture of the ledger: nothing left owed, the bucket known, not draining.
    for (series, want) in [
        (
            "nudge_ledger_deliveries{channel=\"sms\",state=\"due\"}",
            0.0,
        ),
        (
            "nudge_ledger_deliveries{channel=\"sms\",state=\"ambiguous\"}",
            0.0,
        ),
        (
            "nudge_ledger_oldest_eligible_age_seconds{channel=\"sms\"}",
            0.0,
        ),
        ("nudge_channel_draining{channel=\"sms\"}", 0.0),
        (
            "nudge_bucket_paused{provider_account=\"sms-main\",channel=\"sms\"}",
            0.0,
        ),
    ] {
        wait_sample(&mut env, "janitor", series, want, false).await;
    }
    let janitor = env.scrape("janitor").await.unwrap();
    assert!(
        sample(&janitor, "nudge_ledger_gauges_refreshed_timestamp_seconds")
            .is_some_and(|t| t > 0.0),
        "{janitor}"
    );
    // No tenant has live work any more: once the janitor reads the ledger after the delivery,
    // the tenant's series are gone.
    let (http, admin) = (env.http.clone(), env.admin_url("janitor").unwrap());
    let tenant_label = format!("tenant_id=\"{tenant}\"");
    env.wait_for(
        "the tenant's series to drop out of the janitor's metrics",
        Duration::from_secs(30),
        || {
            let (http, admin, tenant_label) = (http.clone(), admin.clone(), tenant_label.clone());
            async move {
                let text = http
                    .get(format!("{admin}/metrics"))
                    .send()
                    .await?
                    .text()
                    .await?;
                Ok((!text.contains(&tenant_label)).then_some(()))
            }
        },
    )
    .await;

    let exits = env.stop_all(Duration::from_secs(15));
    for (name, code) in exits {
        assert_eq!(code, Some(0), "{name} stopped cleanly on SIGTERM");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_janitor_reports_waiting_work_per_channel_and_tenant_and_the_pause_and_drain_flags() {
    let mut env = TestEnv::start("observability-gauges").await.unwrap();
    env.admin_listeners = true;
    let tenant = env.tenant("clinic-gauges", 2).await.unwrap();
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    // No email worker: the delivery is published and waits in the queue.
    let now = Utc::now();
    env.reminder(
        tenant,
        "waits",
        &[Channel::Email],
        now - chrono::Duration::seconds(30),
        now + chrono::Duration::minutes(10),
    )
    .await
    .unwrap();

    wait_sample(
        &mut env,
        "janitor",
        "nudge_ledger_deliveries{channel=\"email\",state=\"queued\"}",
        1.0,
        false,
    )
    .await;
    wait_sample(
        &mut env,
        "janitor",
        &format!(
            "nudge_ledger_tenant_deliveries{{tenant_id=\"{tenant}\",channel=\"email\",state=\"queued\"}}"
        ),
        1.0,
        false,
    )
    .await;
    // Its time came 30 s before the reminder was imported: it has waited at least that long.
    wait_sample(
        &mut env,
        "janitor",
        "nudge_ledger_oldest_eligible_age_seconds{channel=\"email\"}",
        30.0,
        true,
    )
    .await;
    wait_sample(
        &mut env,
        "janitor",
        &format!(
            "nudge_ledger_tenant_oldest_eligible_age_seconds{{tenant_id=\"{tenant}\",channel=\"email\"}}"
        ),
        30.0,
        true,
    )
    .await;

    let (code, _, err) = env
        .nudgectl(&[
            "tenant",
            "pause",
            "clinic-gauges",
            "--reason",
            "e2e",
            "--ack-timeout",
            "20s",
        ])
        .unwrap();
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = env
        .nudgectl(&[
            "drain",
            "on",
            "--channel",
            "email",
            "--reason",
            "e2e",
            "--incident",
            "INC-1",
        ])
        .unwrap();
    assert_eq!(code, 0, "{err}");
    wait_sample(
        &mut env,
        "janitor",
        &format!("nudge_tenant_paused{{tenant_id=\"{tenant}\"}}"),
        1.0,
        false,
    )
    .await;
    wait_sample(
        &mut env,
        "janitor",
        "nudge_channel_draining{channel=\"email\"}",
        1.0,
        false,
    )
    .await;

    let exits = env.stop_all(Duration::from_secs(15));
    for (name, code) in exits {
        assert_eq!(code, Some(0), "{name} stopped cleanly on SIGTERM");
    }
}
