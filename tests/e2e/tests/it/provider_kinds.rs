//! Each real provider kind end to end, through the real worker, producer, janitor and intake
//! processes against the provider stub speaking that provider's shape: sent, throttled (the
//! account), an invalid contact, refused credentials (the account suspended, then sent), and a
//! timeout whose receipt, signed as the provider signs it, settles the ambiguous delivery.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use nudge_config::Secret;
use nudge_domain::{Channel, DeliveryState, OutcomeClass, TenantId};
use nudge_e2e::{TestEnv, WorkerOptions, free_port};
use nudge_intake::receipts::{ReceiptsSection, SendgridReceipts, TwilioReceipts};
use nudge_ledger::{Attempt, DeliveryRecord};
use serde_json::json;

const SID: &str = "AC0123456789abcdef0123456789abcdef";
const TOKEN: &str = "e2e-twilio-token";
/// The secret scalar of the SendGrid test key.
const SENDGRID_SECRET: [u8; 32] = [5; 32];

/// PKCS#8 DER of a P-256 private key (no public key inside), as the stub takes it.
fn pkcs8_der(secret: &[u8; 32]) -> Vec<u8> {
    const PREFIX: [u8; 35] = [
        0x30, 0x41, 0x02, 0x01, 0x00, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02,
        0x01, 0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x04, 0x27, 0x30, 0x25,
        0x02, 0x01, 0x01, 0x04, 0x20,
    ];
    let mut der = PREFIX.to_vec();
    der.extend_from_slice(secret);
    der
}

/// DER SubjectPublicKeyInfo of the public key, as SendGrid shows it.
fn spki_der(secret: &[u8; 32]) -> Vec<u8> {
    const PREFIX: [u8; 26] = [
        0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08,
        0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
    ];
    let key = p256::ecdsa::SigningKey::from_bytes(&(*secret).into()).unwrap();
    let mut der = PREFIX.to_vec();
    der.extend_from_slice(
        p256::ecdsa::VerifyingKey::from(&key)
            .to_encoded_point(false)
            .as_bytes(),
    );
    der
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// What each scenario's first attempt is recorded as, per kind.
struct Expected {
    throttled: &'static str,
    invalid: &'static str,
    auth: &'static str,
    message_id_prefix: &'static str,
}

struct Kind {
    channel: Channel,
    account: &'static str,
    invalid_step: serde_json::Value,
    expected: Expected,
}

/// A reminder due now (the producer materialises it within its window), after `script`.
async fn scenario(
    env: &mut TestEnv,
    tenant: TenantId,
    kind: &Kind,
    event: &str,
    script: serde_json::Value,
    until: DeliveryState,
) -> (DeliveryRecord, Vec<Attempt>) {
    env.script(kind.account, script).await.unwrap();
    let now = Utc::now();
    let created = env
        .reminder(
            tenant,
            event,
            &[kind.channel],
            now,
            now + chrono::Duration::minutes(10),
        )
        .await
        .unwrap();
    let ledger = env.ledger.clone();
    let d = env
        .wait_for(
            &format!("{event} to be {until}"),
            Duration::from_secs(60),
            || {
                let ledger = ledger.clone();
                async move {
                    let d = ledger
                        .deliveries_of_reminder(created.id)
                        .await?
                        .into_iter()
                        .next();
                    Ok(d.filter(|d| d.state == until))
                }
            },
        )
        .await;
    let attempts = env.ledger.attempts(d.id).await.unwrap();
    (d, attempts)
}

async fn run(env: &mut TestEnv, tenant: TenantId, kind: &Kind) {
    let e = &kind.expected;

    // Sent: accepted, the provider's message id recorded.
    let (d, attempts) = scenario(
        env,
        tenant,
        kind,
        "sent",
        json!({"default": {"status": 201}}),
        DeliveryState::Delivered,
    )
    .await;
    assert_eq!(attempts.len(), 1);
    assert!(
        d.provider_message_id
            .as_deref()
            .unwrap()
            .starts_with(e.message_id_prefix),
        "{:?}",
        d.provider_message_id
    );

    // Throttled: the account's 429 is retried after its wait and slows the bucket.
    let (_, attempts) = scenario(
        env,
        tenant,
        kind,
        "throttled",
        json!({"sequence": [{"status": 429, "retry_after": "1"}], "default": {"status": 201}}),
        DeliveryState::Delivered,
    )
    .await;
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0].reason.as_deref(), Some(e.throttled));
    // A 429 while the bucket spends its burst shrinks the burst; otherwise it cuts the rate.
    let bucket = env.ledger.rate_buckets().await.unwrap().remove(0);
    let burst_cut: Option<DateTime<Utc>> =
        sqlx::query_scalar("SELECT burst_cut_at FROM rate_buckets")
            .fetch_one(env.ledger.pool())
            .await
            .unwrap();
    assert!(
        bucket.effective_rate < bucket.rate_per_second || burst_cut.is_some(),
        "the 429 fed the bucket: {bucket:?}"
    );

    // An invalid contact: dead-lettered once, the contact flagged.
    let (d, attempts) = scenario(
        env,
        tenant,
        kind,
        "invalid",
        json!({"default": kind.invalid_step}),
        DeliveryState::DeadLettered,
    )
    .await;
    assert_eq!(attempts.len(), 1);
    assert_eq!(d.last_error_reason.as_deref(), Some(e.invalid));
    let flagged: i64 =
        sqlx::query_scalar("SELECT count(*) FROM contacts WHERE invalid_at IS NOT NULL")
            .fetch_one(env.ledger.pool())
            .await
            .unwrap();
    assert_eq!(flagged, 1);

    // Refused credentials: the account is suspended for admission.max_pause_s (2 s here),
    // then the delivery is sent.
    let (_, attempts) = scenario(
        env,
        tenant,
        kind,
        "auth",
        json!({"sequence": [{"status": 401}], "default": {"status": 201}}),
        DeliveryState::Delivered,
    )
    .await;
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0].reason.as_deref(), Some(e.auth));
    let gap = attempts[1].started_at - attempts[0].finished_at;
    assert!(
        gap >= chrono::Duration::milliseconds(1_500),
        "the retry waited out the 2 s suspension (0.5 s tolerance for rounding and the ledger's round trips): {gap}"
    );

    // A timeout after the request left: ambiguous, never resent; the receipt settles it.
    let (d, attempts) = scenario(
        env,
        tenant,
        kind,
        "timeout",
        json!({"default": {"status": 201, "hang": true, "receipt_delay_ms": 3000}}),
        DeliveryState::Delivered,
    )
    .await;
    assert_eq!(attempts.len(), 1, "never resent");
    assert_eq!(attempts[0].outcome_class, OutcomeClass::Ambiguous);
    assert_eq!(d.last_error_reason.as_deref(), Some("receipt: delivered"));
    let settled: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM provider_events WHERE delivery_id = $1 AND settled",
    )
    .bind(d.id.as_uuid())
    .fetch_one(env.ledger.pool())
    .await
    .unwrap();
    assert_eq!(settled, 1);
}

fn options(kind: &Kind, table: String) -> WorkerOptions {
    let mut options = WorkerOptions::for_channel(kind.channel);
    options.accounts = vec![(kind.account.to_owned(), false, true)];
    options.kind = Some((
        match kind.channel {
            Channel::Sms => "twilio",
            _ => "sendgrid",
        }
        .to_owned(),
        table,
    ));
    options.rate = Some((50.0, 50));
    options.max_pause_s = 2;
    options.provider_timeout_ms = 1_500;
    options
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twilio_sends_throttles_flags_suspends_and_settles_by_receipt() {
    let mut env = TestEnv::start_with_stub(
        "twilio",
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
            account: "sms-twilio".into(),
            auth_token: Secret::new(TOKEN),
        }],
        sendgrid: vec![],
        generic: vec![],
    };
    env.start_intake_with("intake", config).await.unwrap();
    let tenant = env.tenant("clinic-t", 2).await.unwrap();
    let kind = Kind {
        channel: Channel::Sms,
        account: "sms-twilio",
        invalid_step: json!({"status": 400, "code": "21211"}),
        expected: Expected {
            throttled: "throttled_account: 20429",
            invalid: "contact_invalid: 21211",
            auth: "auth_failure: 20003",
            message_id_prefix: "SM",
        },
    };
    let table = format!(
        "account_sid = \"{SID}\"\nauth_token = \"{TOKEN}\"\nfrom = \"+15550001\"\nstatus_callback_url = \"{intake}/receipts/twilio/sms-twilio\""
    );
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    env.start_worker(Channel::Sms, "worker-sms", &options(&kind, table))
        .unwrap();
    run(&mut env, tenant, &kind).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sendgrid_sends_throttles_flags_suspends_and_settles_by_receipt() {
    let port = free_port();
    let intake = format!("http://127.0.0.1:{port}");
    let mut env = TestEnv::start_with_stub(
        "sendgrid",
        &[
            "--shape".to_owned(),
            "sendgrid".to_owned(),
            "--sendgrid-event-url".to_owned(),
            format!("{intake}/receipts/sendgrid/email-sendgrid"),
            "--sendgrid-signing-key".to_owned(),
            b64(&pkcs8_der(&SENDGRID_SECRET)),
        ],
    )
    .await
    .unwrap();
    let mut config = nudge_intake::IntakeConfig::default();
    config.intake.listen_addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    config.receipts = ReceiptsSection {
        public_base_url: None,
        twilio: vec![],
        sendgrid: vec![SendgridReceipts {
            account: "email-sendgrid".into(),
            verification_key: b64(&spki_der(&SENDGRID_SECRET)),
        }],
        generic: vec![],
    };
    env.start_intake_with("intake", config).await.unwrap();
    let tenant = env.tenant("clinic-s", 2).await.unwrap();
    let kind = Kind {
        channel: Channel::Email,
        account: "email-sendgrid",
        invalid_step: json!({"status": 400, "code": "invalid_to"}),
        expected: Expected {
            throttled: "throttled_account: http_429",
            invalid: "contact_invalid: http_400",
            auth: "auth_failure: http_401",
            message_id_prefix: "msg_",
        },
    };
    let table = "api_key = \"SG.e2e\"\nfrom_email = \"clinic@example.org\"".to_owned();
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    env.start_worker(Channel::Email, "worker-email", &options(&kind, table))
        .unwrap();
    run(&mut env, tenant, &kind).await;
}
