//! A patient's STOP end to end (decision 0505): the provider stub, speaking Twilio, sends the
//! patient's reply, signed, to the real intake's incoming-message webhook; the real producer
//! and SMS worker then settle every later reminder to that number `suppressed`
//! (`contact_opted_out`) without a request, whichever subscriber it was posted for, while
//! another number is sent to; START restores sending, HELP changes nothing, and the same
//! message sent again is refused.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use chrono::Utc;
use nudge_config::Secret;
use nudge_domain::{Channel, DeliveryState, IdempotencyKey, ReminderId, TenantId};
use nudge_e2e::{Addressed, TestEnv, WorkerOptions, free_port, keys_report};
use nudge_intake::receipts::{ReceiptsSection, TwilioReceipts};
use serde_json::{Value, json};

const SID: &str = "AC0123456789abcdef0123456789abcdef";
const TOKEN: &str = "e2e-twilio-token";
const ACCOUNT: &str = "sms-twilio";
const PATIENT: &str = "+15550100100";
const OTHER: &str = "+15550100199";

/// The patient's reply, sent by the stub to the intake's webhook; the webhook's answer.
async fn reply(env: &TestEnv, intake: &str, body: &str, sid: Option<&str>) -> (u16, String) {
    let answer: Value = reqwest::Client::new()
        .post(format!("{}/admin/inbound", env.stub_url))
        .json(&json!({
            "url": format!("{intake}/inbound/twilio/{ACCOUNT}"),
            "from": PATIENT,
            "to": "+15550001",
            "body": body,
            "message_sid": sid,
        }))
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .json()
        .await
        .unwrap();
    (
        u16::try_from(answer["status"].as_u64().unwrap()).unwrap(),
        answer["body"].as_str().unwrap().to_owned(),
    )
}

/// Reminders due now to `to`, one subscriber each; returns their ids.
async fn due_now(
    env: &TestEnv,
    tenant: TenantId,
    prefix: &str,
    to: &str,
    n: usize,
) -> Vec<ReminderId> {
    let content = json!({"template": "appointment"});
    let mut ids = Vec::new();
    for i in 0..n {
        let now = Utc::now();
        let created = env
            .reminder_to(
                tenant,
                &format!("{prefix}-{i}"),
                Addressed {
                    channel: Channel::Sms,
                    destination: to,
                    content: &content,
                },
                now,
                now + chrono::Duration::hours(1),
            )
            .await
            .unwrap();
        ids.push(created.id);
    }
    ids
}

async fn settle(env: &mut TestEnv, ids: &[ReminderId]) -> Vec<(DeliveryState, Option<String>)> {
    let ledger = env.ledger.clone();
    let ids = ids.to_vec();
    env.wait_for(
        "the reminders settled",
        Duration::from_secs(60),
        move || {
            let ledger = ledger.clone();
            let ids = ids.clone();
            async move {
                let mut out = Vec::new();
                for id in &ids {
                    let row: Option<(String, Option<String>)> = sqlx::query_as(
                        "SELECT state, last_error_reason FROM deliveries
                         WHERE reminder_id = $1 AND channel = 'sms'",
                    )
                    .bind(id.as_uuid())
                    .fetch_optional(ledger.pool())
                    .await?;
                    let Some((state, reason)) = row else {
                        return Ok(None);
                    };
                    let state: DeliveryState = state.parse()?;
                    if !state.is_terminal() {
                        return Ok(None);
                    }
                    out.push((state, reason));
                }
                Ok(Some(out))
            }
        },
    )
    .await
}

/// The requests the stub received for these reminders' deliveries.
async fn requests_for(env: &TestEnv, ids: &[ReminderId]) -> usize {
    let keys: Vec<String> = ids
        .iter()
        .map(|id| {
            IdempotencyKey::for_delivery(*id, Channel::Sms)
                .as_str()
                .to_owned()
        })
        .collect();
    keys_report(env.stub_keys().await.unwrap())
        .unwrap()
        .keys
        .iter()
        .filter(|k| keys.contains(&k.key))
        .map(|k| k.requests.len())
        .sum()
}

/// The provider stub speaking Twilio, the real intake (its webhooks verified with the stub's
/// token), the producer and an SMS worker whose default account the tenant `clinic` sends
/// through, announced. Returns the environment, the intake's URL and the tenant.
async fn system(name: &str) -> (TestEnv, String, TenantId) {
    let mut env = TestEnv::start_with_stub(
        name,
        &["--shape", "twilio", "--twilio-auth-token", TOKEN].map(str::to_owned),
    )
    .await
    .unwrap();
    let port = free_port();
    let intake = format!("http://127.0.0.1:{port}");
    let mut config = nudge_intake::IntakeConfig::default();
    config.intake.listen_addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    config.receipts = ReceiptsSection {
        public_base_url: Some(intake.clone()),
        twilio: vec![TwilioReceipts {
            account: ACCOUNT.into(),
            auth_token: Secret::new(TOKEN),
        }],
        sendgrid: vec![],
        generic: vec![],
    };
    env.start_intake_with("intake", config).await.unwrap();
    let tenant = env.tenant("clinic", 2).await.unwrap();
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    // The tenant has no account of its own: the worker's default reaches it.
    options.accounts = vec![(ACCOUNT.to_owned(), false, true)];
    options.kind = Some((
        "twilio".to_owned(),
        format!(
            "account_sid = \"{SID}\"\nauth_token = \"{TOKEN}\"\nfrom = \"+15550001\"\nstatus_callback_url = \"{intake}/receipts/twilio/{ACCOUNT}\""
        ),
    ));
    env.start_producer("producer").unwrap();
    env.start_worker(Channel::Sms, "worker-sms", &options)
        .unwrap();
    // The worker announces its default before it consumes: wait for that.
    let ledger = env.ledger.clone();
    env.wait_for(
        "the worker's default account",
        Duration::from_secs(30),
        || {
            let ledger = ledger.clone();
            async move {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM worker_accounts WHERE default_announced_at IS NOT NULL",
                )
                .fetch_one(ledger.pool())
                .await?;
                Ok((n == 1).then_some(()))
            }
        },
    )
    .await;
    (env, intake, tenant)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patients_stop_stops_every_later_reminder_to_the_number_and_start_restores_it() {
    let (mut env, intake, tenant) = system("consent").await;
    let (status, body) = reply(
        &env,
        &intake,
        " Stop ",
        Some("SM00000000000000000000000000000001"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("<Response></Response>"), "{body}");
    let (status, _) = reply(&env, &intake, "HELP", None).await;
    assert_eq!(status, 200);

    let stopped = due_now(&env, tenant, "stopped", PATIENT, 3).await;
    let others = due_now(&env, tenant, "other", OTHER, 1).await;
    let settled = settle(&mut env, &stopped).await;
    assert!(
        settled
            .iter()
            .all(|(s, r)| *s == DeliveryState::Suppressed
                && r.as_deref() == Some("contact_opted_out")),
        "{settled:?}"
    );
    let sent = settle(&mut env, &others).await;
    assert_eq!(sent, [(DeliveryState::Delivered, None)]);
    assert_eq!(
        requests_for(&env, &stopped).await,
        0,
        "a request to the opted-out number"
    );

    // A replay of the STOP is refused; then START restores sending.
    let (status, body) = reply(
        &env,
        &intake,
        " Stop ",
        Some("SM00000000000000000000000000000001"),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    let (status, _) = reply(&env, &intake, "start", None).await;
    assert_eq!(status, 200);
    let restored = due_now(&env, tenant, "restored", PATIENT, 1).await;
    let settled = settle(&mut env, &restored).await;
    assert_eq!(settled, [(DeliveryState::Delivered, None)]);
    assert_eq!(requests_for(&env, &restored).await, 1);

    let history: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT state, keyword FROM consent_history WHERE tenant_id = $1 ORDER BY id",
    )
    .bind(tenant.as_uuid())
    .fetch_all(env.ledger.pool())
    .await
    .unwrap();
    assert_eq!(
        history,
        [
            ("opted_out".to_owned(), Some("Stop".to_owned())),
            ("opted_in".to_owned(), Some("start".to_owned())),
        ]
    );
    eprintln!(
        "consent: 3 reminders to the opted-out number settled with 0 requests; history {history:?}"
    );
}

/// A signed call to the intake's `/v1` API: (status, body).
async fn api(
    env: &TestEnv,
    secret: &str,
    method: reqwest::Method,
    url: &str,
    body: &Value,
) -> (u16, Value) {
    let bytes = if body.is_null() {
        Vec::new()
    } else {
        serde_json::to_vec(body).unwrap()
    };
    let answer = env.signed(method, url, secret, bytes).send().await.unwrap();
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap_or(Value::Null))
}

/// A reminder of `category` to the patient, due now, posted through the intake: its id.
async fn post(
    env: &TestEnv,
    secret: &str,
    intake: &str,
    event: &str,
    category: &str,
) -> ReminderId {
    let now = Utc::now();
    let (status, body) = api(
        env,
        secret,
        reqwest::Method::POST,
        &format!("{intake}/v1/tenants/clinic/reminders"),
        &json!({
            "event_id": event,
            "subscriber_ref": "patient-7",
            "channels": ["sms"],
            "scheduled_at": now.to_rfc3339(),
            "expires_at": (now + chrono::Duration::hours(1)).to_rfc3339(),
            "destinations": {"sms": PATIENT},
            "content": {"template": "appointment"},
            "category": category,
        }),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    ReminderId::from_uuid(body["reminder_id"].as_str().unwrap().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_category_cannot_be_switched_off_but_a_stop_still_stops_its_sms() {
    let (mut env, intake, tenant) = system("consent-categories").await;
    for args in [
        [
            "category",
            "create",
            "clinic",
            "appointment",
            "--required",
            "--reason",
            "legal notices",
        ]
        .as_slice(),
        [
            "category", "create", "clinic", "billing", "--reason", "invoices",
        ]
        .as_slice(),
    ] {
        let (code, out, err) = env.nudgectl(args).unwrap();
        assert_eq!(code, 0, "{out}{err}");
    }
    let (code, listed, err) = env.nudgectl(&["category", "list", "clinic"]).unwrap();
    assert_eq!(code, 0, "{err}");
    for name in ["general", "appointment", "billing"] {
        assert!(listed.contains(name), "{listed}");
    }
    let secret = env.rotate_secret("clinic").unwrap();
    let preferences = format!("{intake}/v1/tenants/clinic/subscribers/patient-7/preferences");
    // Posted once (a reminder far ahead) so the subscriber exists.
    let later = Utc::now() + chrono::Duration::days(2);
    let (status, body) = api(
        &env,
        &secret,
        reqwest::Method::POST,
        &format!("{intake}/v1/tenants/clinic/reminders"),
        &json!({
            "event_id": "later",
            "subscriber_ref": "patient-7",
            "channels": ["sms"],
            "scheduled_at": later.to_rfc3339(),
            "expires_after_s": 3600,
            "destinations": {"sms": PATIENT},
        }),
    )
    .await;
    assert_eq!(status, 202, "{body}");

    let (status, body) = api(
        &env,
        &secret,
        reqwest::Method::PUT,
        &preferences,
        &json!({"preferences": [{"channel": "sms", "category": "appointment", "state": "opted_out"}]}),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"], "category_required");
    assert_eq!(body["category"], "appointment");
    let (status, body) = api(
        &env,
        &secret,
        reqwest::Method::PUT,
        &preferences,
        &json!({"preferences": [{"channel": "sms", "category": "billing", "state": "opted_out"}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");

    let billing = post(&env, &secret, &intake, "bill-1", "billing").await;
    let appointment = post(&env, &secret, &intake, "appt-1", "appointment").await;
    assert_eq!(
        settle(&mut env, &[billing]).await,
        [(
            DeliveryState::Suppressed,
            Some("contact_opted_out".to_owned())
        )]
    );
    assert_eq!(
        settle(&mut env, &[appointment]).await,
        [(DeliveryState::Delivered, None)]
    );
    assert_eq!(requests_for(&env, &[billing]).await, 0);

    // The patient texts STOP: the required category's SMS stops too.
    let (status, body) = reply(&env, &intake, "STOP", None).await;
    assert_eq!(status, 200, "{body}");
    let stopped = post(&env, &secret, &intake, "appt-2", "appointment").await;
    assert_eq!(
        settle(&mut env, &[stopped]).await,
        [(
            DeliveryState::Suppressed,
            Some("contact_opted_out".to_owned())
        )]
    );
    assert_eq!(requests_for(&env, &[stopped]).await, 0);

    let (code, shown, err) = env
        .nudgectl(&["consent", "show", "clinic", "patient-7"])
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(shown.contains("billing"), "{shown}");
    assert!(shown.contains("opted_out"), "{shown}");
    assert!(!shown.contains(PATIENT), "{shown}");
    let (status, body) = api(
        &env,
        &secret,
        reqwest::Method::GET,
        &preferences,
        &Value::Null,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["destinations"][0]["state"], "opted_out", "{body}");
    let entries: i64 =
        sqlx::query_scalar("SELECT count(*) FROM consent_history WHERE tenant_id = $1")
            .bind(tenant.as_uuid())
            .fetch_one(env.ledger.pool())
            .await
            .unwrap();
    assert_eq!(entries, 2, "the billing preference and the STOP");
    eprintln!(
        "consent categories: 409 for the required category; billing suppressed with 0 requests; \
         after STOP the required category suppressed with 0 requests"
    );
}
