//! FCM and APNs end to end: the real `nudge-push` worker against the provider stub speaking each
//! push provider's shape (FCM's OAuth token endpoint and HTTP v1 send; APNs over TLS and HTTP/2
//! with ES256 provider tokens). One tenant per provider account, one reminder each: accepted,
//! throttled then accepted (the account's quota, FCM's `UNAVAILABLE`, one busy device, APNs
//! calling our token churn), an invalid device token (terminal, contact flagged), refused
//! credentials (auth failure: the account's bucket suspended, the delivery kept), a lost answer
//! (ambiguous, never resent).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::path::PathBuf;
use std::time::Duration;

use chrono::Utc;
use nudge_config::Secret;
use nudge_domain::{Channel, OutcomeClass, ProviderAccount, TenantId};
use nudge_e2e::{Addressed, TestEnv, WorkerOptions};
use nudge_provider::{ApnsKeys, FcmKeys, HttpProviderConfig, ProviderKind};
use serde_json::{Value, json};

/// A key pair as PEM: the private half for nudge, the public half for the stub.
struct KeyPair {
    private_pem: String,
    public_pem: String,
}

fn key_pair(alg: &'static rcgen::SignatureAlgorithm) -> KeyPair {
    let key = rcgen::KeyPair::generate_for(alg).unwrap();
    KeyPair {
        private_pem: key.serialize_pem(),
        public_pem: key.public_key_pem(),
    }
}

fn write(env: &TestEnv, name: &str, text: &str) -> PathBuf {
    let path = env.dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A push account of `kind` on the stub, with a bucket (so an auth failure can suspend it).
fn account(env: &TestEnv, name: &str, kind: ProviderKind, default: bool) -> HttpProviderConfig {
    let mut cfg = HttpProviderConfig::new(name, Channel::Push, env.account_url(name));
    cfg.kind = kind;
    cfg.timeout_ms = 1_500;
    cfg.connect_timeout_ms = 500;
    cfg.default_for_channel = default;
    cfg.rate_per_second = Some(50.0);
    cfg
}

/// One tenant per account, routed to it, with one reminder.
async fn tenant_for(env: &TestEnv, account: &str, destination: &str) -> TenantId {
    let tenant = env.tenant(&format!("clinic-{account}"), 2).await.unwrap();
    let by = nudge_ledger::Operator::new("e2e", Some("test setup"), Utc::now()).unwrap();
    env.ledger
        .set_tenant_channel_account(
            tenant,
            Channel::Push,
            Some(&ProviderAccount::parse(account).unwrap()),
            &by,
        )
        .await
        .unwrap();
    let content =
        json!({"title": "Appointment", "body": "Tomorrow at 9:00", "template": "appointment"});
    let now = Utc::now();
    env.reminder_to(
        tenant,
        &format!("ev-{account}"),
        Addressed {
            channel: Channel::Push,
            destination,
            content: &content,
        },
        now,
        now + chrono::Duration::minutes(10),
    )
    .await
    .unwrap();
    tenant
}

/// The push delivery's state and attempts of `tenant`.
async fn delivery_of(
    env: &TestEnv,
    tenant: TenantId,
) -> anyhow::Result<(String, Vec<nudge_ledger::Attempt>)> {
    let (id, state): (uuid::Uuid, String) =
        sqlx::query_as("SELECT id, state FROM deliveries WHERE tenant_id = $1")
            .bind(tenant.as_uuid())
            .fetch_one(env.ledger.pool())
            .await?;
    let attempts = env
        .ledger
        .attempts(nudge_domain::DeliveryId::from_uuid(id))
        .await?;
    Ok((state, attempts))
}

async fn contact_invalid(env: &TestEnv, tenant: TenantId) -> bool {
    sqlx::query_scalar("SELECT invalid_at IS NOT NULL FROM contacts WHERE tenant_id = $1")
        .bind(tenant.as_uuid())
        .fetch_one(env.ledger.pool())
        .await
        .unwrap()
}

async fn bucket(env: &TestEnv, account: &str) -> nudge_ledger::RateBucket {
    env.ledger
        .rate_buckets()
        .await
        .unwrap()
        .into_iter()
        .find(|b| b.account.as_str() == account)
        .unwrap()
}

async fn stub_get(env: &TestEnv, path: &str) -> Value {
    env.http
        .get(format!("{}{path}", env.stub_url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Waits until every tenant's delivery has reached what the test expects of it.
async fn wait_settled(env: &mut TestEnv, tenants: &[(TenantId, &'static str)], auth: TenantId) {
    let ledger = env.ledger.clone();
    let wanted: Vec<(TenantId, &'static str)> = tenants.to_vec();
    env.wait_for(
        "each push delivery to reach its outcome",
        Duration::from_secs(90),
        || {
            let ledger = ledger.clone();
            let wanted = wanted.clone();
            async move {
                for (tenant, state) in &wanted {
                    let now: String =
                        sqlx::query_scalar("SELECT state FROM deliveries WHERE tenant_id = $1")
                            .bind(tenant.as_uuid())
                            .fetch_one(ledger.pool())
                            .await?;
                    if now != *state {
                        return Ok(None);
                    }
                }
                let auth_attempts: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM attempts a JOIN deliveries d ON d.id = a.delivery_id
                     WHERE d.tenant_id = $1",
                )
                .bind(auth.as_uuid())
                .fetch_one(ledger.pool())
                .await?;
                Ok((auth_attempts >= 1).then_some(()))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fcm_sends_throttles_invalidates_suspends_on_refused_credentials_and_holds_a_lost_answer() {
    let mut env = TestEnv::start("push-fcm").await.unwrap();
    let service_account = key_pair(&rcgen::PKCS_RSA_SHA256);
    let public = write(&env, "fcm-public.pem", &service_account.public_pem);
    env.replace_stub(
        &[
            "--shape".into(),
            "fcm".into(),
            "--fcm-public-key".into(),
            public.display().to_string(),
        ],
        None,
    )
    .unwrap();
    env.script(
        "fcm-quota",
        json!({"sequence": [{"status": 429, "retry_after": "1"}], "default": {"status": 200}}),
    )
    .await
    .unwrap();
    env.script(
        "fcm-unavailable",
        json!({"sequence": [{"status": 503, "retry_after": "1"}], "default": {"status": 200}}),
    )
    .await
    .unwrap();
    env.script("fcm-gone", json!({"default": {"status": 404}}))
        .await
        .unwrap();
    env.script(
        "fcm-hang",
        json!({"sequence": [{"status": 200, "hang": true}]}),
    )
    .await
    .unwrap();

    let wrong_key = key_pair(&rcgen::PKCS_RSA_SHA256);
    let mut providers = Vec::new();
    for (name, key) in [
        ("fcm-ok", &service_account),
        ("fcm-quota", &service_account),
        ("fcm-unavailable", &service_account),
        ("fcm-gone", &service_account),
        ("fcm-auth", &wrong_key),
        ("fcm-hang", &service_account),
    ] {
        let mut cfg = account(&env, name, ProviderKind::Fcm, name == "fcm-ok");
        let mut keys = FcmKeys::new(
            "nudge-e2e",
            "nudge@nudge-e2e.iam.gserviceaccount.com",
            Secret::new(key.private_pem.clone()),
        );
        keys.token_uri = format!("{}/token", env.account_url(name));
        cfg.fcm = Some(keys);
        providers.push(cfg);
    }

    let ok = tenant_for(&env, "fcm-ok", "fcm-registration-token-ok").await;
    let quota = tenant_for(&env, "fcm-quota", "fcm-registration-token-quota").await;
    let unavailable = tenant_for(&env, "fcm-unavailable", "fcm-registration-token-busy").await;
    let gone = tenant_for(&env, "fcm-gone", "fcm-registration-token-gone").await;
    let auth = tenant_for(&env, "fcm-auth", "fcm-registration-token-auth").await;
    let hang = tenant_for(&env, "fcm-hang", "fcm-registration-token-hang").await;

    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    env.start_worker_with_providers(
        Channel::Push,
        "worker-push",
        &WorkerOptions::for_channel(Channel::Push),
        &providers,
    )
    .unwrap();

    wait_settled(
        &mut env,
        &[
            (ok, "delivered"),
            (quota, "delivered"),
            (unavailable, "delivered"),
            (gone, "dead_lettered"),
            (hang, "ambiguous"),
        ],
        auth,
    )
    .await;

    let (_, attempts) = delivery_of(&env, ok).await.unwrap();
    assert_eq!(attempts.len(), 1);
    let id = attempts[0].provider_message_id.as_deref().unwrap();
    assert!(id.starts_with("projects/nudge-e2e/messages/msg_"), "{id}");

    let (_, attempts) = delivery_of(&env, quota).await.unwrap();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(attempts[0].outcome_class, OutcomeClass::Retryable);
    assert_eq!(attempts[0].http_status, Some(429));
    assert_eq!(
        attempts[0].reason.as_deref(),
        Some("throttled_account: QUOTA_EXCEEDED")
    );
    assert!(attempts[0].retry_after_valid);
    let slowed = bucket(&env, "fcm-quota").await;
    // Fed to the account's bucket as a 429 (alone, it moves only its own delivery: 0120).
    assert!(
        slowed.last_throttled_at.is_some(),
        "QUOTA_EXCEEDED was fed to the account's bucket: {slowed:?}"
    );
    assert_eq!(attempts[1].outcome_class, OutcomeClass::Delivered);

    let (_, attempts) = delivery_of(&env, unavailable).await.unwrap();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(
        attempts[0].reason.as_deref(),
        Some("retry_later: UNAVAILABLE")
    );
    assert_eq!(attempts[1].outcome_class, OutcomeClass::Delivered);
    let untouched = bucket(&env, "fcm-unavailable").await;
    assert!(
        untouched.pause_cause.is_none(),
        "UNAVAILABLE is not fed to the bucket: {untouched:?}"
    );

    let (_, attempts) = delivery_of(&env, gone).await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].outcome_class, OutcomeClass::Terminal);
    assert_eq!(
        attempts[0].reason.as_deref(),
        Some("contact_invalid: UNREGISTERED")
    );
    assert!(
        contact_invalid(&env, gone).await,
        "the device token is flagged"
    );
    assert!(!contact_invalid(&env, ok).await);

    let (state, attempts) = delivery_of(&env, auth).await.unwrap();
    assert_ne!(
        state, "dead_lettered",
        "an auth failure does not burn the delivery"
    );
    assert_eq!(attempts[0].outcome_class, OutcomeClass::Retryable);
    assert_eq!(
        attempts[0].reason.as_deref(),
        Some("auth_failure: token_refused")
    );
    let suspended = bucket(&env, "fcm-auth").await;
    assert!(
        suspended.paused_until.is_some_and(|t| t > Utc::now()),
        "the account's bucket is suspended: {suspended:?}"
    );

    let (_, attempts) = delivery_of(&env, hang).await.unwrap();
    assert_eq!(attempts.len(), 1, "a lost answer is never resent");
    assert_eq!(attempts[0].outcome_class, OutcomeClass::Ambiguous);

    let fcm = stub_get(&env, "/stats/fcm").await;
    assert_eq!(
        fcm["accounts"]["fcm-ok"]["tokens_issued"], 1,
        "one access token for the account: {fcm}"
    );
    assert!(fcm["accounts"]["fcm-auth"]["assertions_refused"].as_u64() >= Some(1));
    let stats = stub_get(&env, "/stats").await;
    assert!(
        stats["accounts"].get("fcm-auth").is_none(),
        "nothing was sent with refused credentials: {stats}"
    );
}

const DEVICE: &str = "00fc13adff785122b4ad28809a3420982341241421348097878e577c991de8f";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apns_sends_over_tls_with_one_provider_token_and_maps_each_answer() {
    let mut env = TestEnv::start("push-apns").await.unwrap();
    let signing = key_pair(&rcgen::PKCS_ECDSA_P256_SHA256);
    let public = write(&env, "apns-public.pem", &signing.public_pem);
    let ca = env.dir.join("apns-ca.pem");
    env.replace_stub(
        &[
            "--shape".into(),
            "apns".into(),
            "--apns-public-key".into(),
            public.display().to_string(),
            "--tls-ca-out".into(),
            ca.display().to_string(),
        ],
        Some(&ca),
    )
    .unwrap();
    assert!(env.stub_url.starts_with("https://"), "{}", env.stub_url);
    env.script(
        "apns-busy",
        json!({"sequence": [{"status": 429, "retry_after": "1"}], "default": {"status": 200}}),
    )
    .await
    .unwrap();
    env.script(
        "apns-churn",
        json!({
            "sequence": [{"status": 429, "code": "TooManyProviderTokenUpdates"}],
            "default": {"status": 200}
        }),
    )
    .await
    .unwrap();
    env.script("apns-gone", json!({"default": {"status": 410}}))
        .await
        .unwrap();
    env.script(
        "apns-hang",
        json!({"sequence": [{"status": 200, "hang": true}]}),
    )
    .await
    .unwrap();

    let wrong_key = key_pair(&rcgen::PKCS_ECDSA_P256_SHA256);
    let mut providers = Vec::new();
    for (name, key) in [
        ("apns-ok", &signing),
        ("apns-busy", &signing),
        ("apns-churn", &signing),
        ("apns-gone", &signing),
        ("apns-auth", &wrong_key),
        ("apns-hang", &signing),
    ] {
        let mut cfg = account(&env, name, ProviderKind::Apns, name == "apns-ok");
        let mut keys = ApnsKeys::new(
            "TEAM123456",
            "KEY1234567",
            Secret::new(key.private_pem.clone()),
            "org.example.reminders",
        );
        keys.ca_file = Some(ca.clone());
        cfg.apns = Some(keys);
        providers.push(cfg);
    }

    let ok = tenant_for(&env, "apns-ok", &format!("{DEVICE}1")).await;
    let busy = tenant_for(&env, "apns-busy", &format!("{DEVICE}2")).await;
    let churn = tenant_for(&env, "apns-churn", &format!("{DEVICE}6")).await;
    let gone = tenant_for(&env, "apns-gone", &format!("{DEVICE}3")).await;
    let auth = tenant_for(&env, "apns-auth", &format!("{DEVICE}4")).await;
    let hang = tenant_for(&env, "apns-hang", &format!("{DEVICE}5")).await;

    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    env.start_worker_with_providers(
        Channel::Push,
        "worker-push",
        &WorkerOptions::for_channel(Channel::Push),
        &providers,
    )
    .unwrap();

    wait_settled(
        &mut env,
        &[
            (ok, "delivered"),
            (busy, "delivered"),
            (churn, "delivered"),
            (gone, "dead_lettered"),
            (hang, "ambiguous"),
        ],
        auth,
    )
    .await;

    let (_, attempts) = delivery_of(&env, ok).await.unwrap();
    assert_eq!(attempts.len(), 1);
    // The apns-id sent (the reminder's id) is echoed and recorded.
    let apns_id = attempts[0].provider_message_id.as_deref().unwrap();
    assert!(uuid::Uuid::parse_str(apns_id).is_ok(), "{apns_id}");

    let (_, attempts) = delivery_of(&env, busy).await.unwrap();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(attempts[0].outcome_class, OutcomeClass::Retryable);
    assert_eq!(
        attempts[0].reason.as_deref(),
        Some("throttled_recipient: TooManyRequests")
    );
    let busy_bucket = bucket(&env, "apns-busy").await;
    assert!(
        busy_bucket.pause_cause.is_none()
            && busy_bucket.effective_rate == busy_bucket.rate_per_second,
        "one device's 429 never slows the account: {busy_bucket:?}"
    );
    assert_eq!(attempts[1].outcome_class, OutcomeClass::Delivered);

    let (_, attempts) = delivery_of(&env, churn).await.unwrap();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(
        attempts[0].reason.as_deref(),
        Some("own_fault: TooManyProviderTokenUpdates")
    );
    let churn_bucket = bucket(&env, "apns-churn").await;
    assert!(
        churn_bucket.pause_cause.is_none()
            && churn_bucket.effective_rate == churn_bucket.rate_per_second,
        "our own token fault is never fed to the bucket: {churn_bucket:?}"
    );

    let (_, attempts) = delivery_of(&env, gone).await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(
        attempts[0].reason.as_deref(),
        Some("contact_invalid: Unregistered")
    );
    assert!(
        contact_invalid(&env, gone).await,
        "the device token is flagged"
    );

    let (state, attempts) = delivery_of(&env, auth).await.unwrap();
    assert_ne!(
        state, "dead_lettered",
        "an auth failure does not burn the delivery"
    );
    assert_eq!(attempts[0].http_status, Some(403));
    assert_eq!(
        attempts[0].reason.as_deref(),
        Some("auth_failure: InvalidProviderToken")
    );
    let suspended = bucket(&env, "apns-auth").await;
    assert!(
        suspended.paused_until.is_some_and(|t| t > Utc::now()),
        "the account's bucket is suspended: {suspended:?}"
    );

    let (_, attempts) = delivery_of(&env, hang).await.unwrap();
    assert_eq!(attempts.len(), 1, "a lost answer is never resent");
    assert_eq!(attempts[0].outcome_class, OutcomeClass::Ambiguous);

    // Every send of an account used the one provider token made at start (Apple's 20-minute
    // rule: the stub refuses a second one sooner, and none was refused).
    let apns = stub_get(&env, "/stats/apns").await;
    for name in [
        "apns-ok",
        "apns-busy",
        "apns-churn",
        "apns-gone",
        "apns-hang",
    ] {
        assert_eq!(
            apns["accounts"][name]["provider_tokens"], 1,
            "{name}: {apns}"
        );
        assert!(
            apns["accounts"][name]["token_updates_refused"].as_u64() == Some(0),
            "{name}: {apns}"
        );
    }
    assert!(apns["accounts"]["apns-auth"]["provider_token_refused"].as_u64() >= Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_account_with_an_unusable_key_stops_the_worker_at_start_naming_the_key_not_the_value()
 {
    let mut env = TestEnv::start("push-bad-key").await.unwrap();
    let mut fcm = account(&env, "fcm-main", ProviderKind::Fcm, true);
    fcm.fcm = Some(FcmKeys::new(
        "nudge-e2e",
        "nudge@nudge-e2e.iam.gserviceaccount.com",
        Secret::new("-----BEGIN PRIVATE KEY-----\nhunter2\n-----END PRIVATE KEY-----\n"),
    ));
    let index = env
        .start_worker_with_providers(
            Channel::Push,
            "worker-push",
            &WorkerOptions::for_channel(Channel::Push),
            &[fcm],
        )
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while env.proc(index).is_running() {
        assert!(
            std::time::Instant::now() < deadline,
            "the worker did not stop: {}",
            env.proc(index).log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = std::fs::read_to_string(&env.proc(index).log).unwrap();
    assert!(
        log.contains("providers[0].fcm.private_key"),
        "the error names the key: {log}"
    );
    assert!(
        !log.contains("hunter2"),
        "the value is never printed: {log}"
    );
}
