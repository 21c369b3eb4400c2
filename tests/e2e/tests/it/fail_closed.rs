//! A tenant on its own provider account fails closed, through the real binaries and the
//! provider stub (docs/decisions/0411-a-tenants-own-account-fails-closed.md): while no worker
//! has the tenant's account its deliveries wait, visibly, and the other tenant on the default
//! is served; once a worker with the account starts they go out through it (the worker
//! without it leaving them to that one); not one request of the tenant goes through the
//! default account, nor through its own while an operator has closed its bucket. The
//! suspended and paused cases are the ledger's tests (`crates/ledger/tests/it/fail_closed.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::collections::HashSet;
use std::time::Duration;

use chrono::Utc;
use nudge_domain::{Channel, IdempotencyKey, ProviderAccount, TenantId};
use nudge_e2e::{TestEnv, WorkerOptions, keys_report, stats, until};
use nudge_ledger::Ledger;

/// Deliveries of `tenant` in `state` whose `last_error_reason` is `reason` (any when None).
async fn count_of(ledger: &Ledger, tenant: TenantId, state: &str, reason: Option<&str>) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM deliveries
         WHERE tenant_id = $1 AND state = $2
           AND ($3::text IS NULL OR last_error_reason = $3)",
    )
    .bind(tenant.as_uuid())
    .bind(state)
    .bind(reason)
    .fetch_one(ledger.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_on_its_own_account_waits_for_it_and_never_goes_through_the_default() {
    let mut env = TestEnv::start("fail_closed").await.unwrap();
    env.admin_listeners = true;
    let routed = env.tenant("routed", 2).await.unwrap();
    let shared = env.tenant("shared", 2).await.unwrap();
    let by = nudge_ledger::Operator::new("e2e", Some("own account"), Utc::now()).unwrap();
    env.ledger
        .set_tenant_channel_account(
            routed,
            Channel::Sms,
            Some(&ProviderAccount::parse("sms-own").unwrap()),
            &by,
        )
        .await
        .unwrap();
    let at = Utc::now() + chrono::Duration::seconds(1);
    let mut routed_keys = HashSet::new();
    for i in 0..4 {
        for (tenant, name) in [(routed, "routed"), (shared, "shared")] {
            let created = env
                .reminder(
                    tenant,
                    &format!("{name}-{i}"),
                    &[Channel::Sms],
                    at,
                    at + chrono::Duration::minutes(10),
                )
                .await
                .unwrap();
            if tenant == routed {
                routed_keys
                    .insert(IdempotencyKey::for_delivery(created.id, Channel::Sms).to_string());
            }
        }
    }

    // Only a worker with the default account runs.
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    let options = WorkerOptions {
        max_pause_s: 2,
        ..WorkerOptions::for_channel(Channel::Sms)
    };
    env.start_worker(Channel::Sms, "worker-main", &options)
        .unwrap();
    let ledger = env.ledger.clone();
    env.wait_for(
        "the shared tenant delivered and the routed one waiting for its account",
        Duration::from_secs(60),
        || {
            let ledger = ledger.clone();
            async move {
                let delivered = count_of(&ledger, shared, "delivered", None).await;
                let waiting =
                    count_of(&ledger, routed, "retry_wait", Some("account_unavailable")).await;
                Ok((delivered == 4 && waiting == 4).then_some(()))
            }
        },
    )
    .await;

    // What an operator sees: status and the janitor's gauge.
    let (code, out, err) = env.nudgectl(&["status", "--json"]).unwrap();
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    let sms = status
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["channel"] == "sms")
        .unwrap();
    let waiting = &sms["awaiting_account"][0];
    assert_eq!(waiting["tenant"], "routed", "{sms}");
    assert_eq!(waiting["account"], "sms-own");
    assert_eq!(waiting["deliveries"], 4);
    assert_eq!(waiting["held_now"], false);
    let gauge = format!(
        "nudge_ledger_tenant_awaiting_account_deliveries{{tenant_id=\"{routed}\",channel=\"sms\"}} 4"
    );
    until("the janitor's gauge", Duration::from_secs(10), || async {
        env.scrape("janitor")
            .await
            .is_ok_and(|text| text.contains(&gauge))
    })
    .await
    .unwrap();

    // A worker with the tenant's account starts beside the one without it, while an operator
    // has closed that account's bucket (rate 0): the deliveries wait for the bucket now.
    let (code, _, err) = env
        .nudgectl(&[
            "rate",
            "set",
            "sms-own",
            "sms",
            "0",
            "--reason",
            "closed for the test",
        ])
        .unwrap();
    assert_eq!(code, 0, "{err}");
    let with_own = WorkerOptions {
        accounts: vec![
            ("sms-main".to_owned(), true, true),
            ("sms-own".to_owned(), true, false),
        ],
        ..options
    };
    env.start_worker(Channel::Sms, "worker-own", &with_own)
        .unwrap();
    let closed = "nudge_admission_deferrals_total{provider_account=\"sms-own\",channel=\"sms\",reason=\"bucket_closed\"}";
    until(
        "the closed bucket deferring the tenant's deliveries",
        Duration::from_secs(30),
        || async {
            env.scrape("worker-own")
                .await
                .is_ok_and(|text| text.contains(closed))
        },
    )
    .await
    .unwrap();
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    assert_eq!(
        stub.accounts.get("sms-own").map_or(0, |a| a.requests),
        0,
        "nothing through the closed account"
    );
    assert_eq!(count_of(&ledger, routed, "delivered", None).await, 0);

    // Reopened: the deliveries go out through the tenant's account, whichever worker their
    // messages reach first.
    let (code, _, err) = env
        .nudgectl(&[
            "rate", "set", "sms-own", "sms", "50", "--reason", "reopened",
        ])
        .unwrap();
    assert_eq!(code, 0, "{err}");
    env.wait_for(
        "the routed tenant delivered through its account",
        Duration::from_secs(90),
        || {
            let ledger = ledger.clone();
            async move {
                Ok((count_of(&ledger, routed, "delivered", None).await == 4).then_some(()))
            }
        },
    )
    .await;

    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    let keys = keys_report(env.stub_keys().await.unwrap()).unwrap();
    eprintln!(
        "e2e fail_closed: sms-main {:?} sms-own {:?}",
        stub.accounts
            .get("sms-main")
            .map(|a| (a.requests, &a.by_status)),
        stub.accounts
            .get("sms-own")
            .map(|a| (a.requests, &a.by_status)),
    );
    let through = |account: &str| {
        keys.keys
            .iter()
            .filter(|k| k.account == account && routed_keys.contains(&k.key))
            .map(|k| k.requests.len())
            .sum::<usize>()
    };
    assert_eq!(
        through("sms-main"),
        0,
        "nothing of the tenant through the default"
    );
    assert_eq!(through("sms-own"), 4, "each once, through its own account");
    assert_eq!(stub.accounts["sms-own"].accepted, 4);
    assert_eq!(stub.accounts["sms-main"].accepted, 4, "the shared tenant's");
    let through_default: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM attempts a JOIN deliveries d ON d.id = a.delivery_id
         WHERE d.tenant_id = $1 AND a.provider_account <> 'sms-own'",
    )
    .bind(routed.as_uuid())
    .fetch_one(env.ledger.pool())
    .await
    .unwrap();
    assert_eq!(through_default, 0);
    let (_, out, _) = env.nudgectl(&["status", "--json"]).unwrap();
    assert!(out.contains("\"awaiting_account\": []"), "{out}");
}
