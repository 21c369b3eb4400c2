//! An operator change and its audit row commit together, or neither does.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use nudge_domain::{Channel, ProviderAccount};
use nudge_ledger::test_support::*;
use nudge_ledger::{Ledger, LedgerError, Operator};
use sqlx::PgPool;

fn account() -> ProviderAccount {
    ProviderAccount::parse("sms-backup").unwrap()
}

/// From here on the database refuses every audit row, as it would a row it cannot store.
async fn refuse_audit_rows(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_audit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'audit row refused'; END; $$;
         CREATE TRIGGER refuse_audit BEFORE INSERT ON audit_log
             FOR EACH ROW EXECUTE FUNCTION refuse_audit();",
    )
    .execute(pool)
    .await
    .unwrap();
}

fn refused<T: std::fmt::Debug>(result: Result<T, LedgerError>) {
    let err = result.unwrap_err();
    let LedgerError::Database(db) = &err else {
        panic!("expected the audit insert to fail, got {err:?}");
    };
    assert!(db.to_string().contains("audit row refused"), "{db}");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_change_whose_audit_row_is_refused_leaves_nothing_changed(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let paused = ledger
        .create_tenant("clinic-paused", &ops(t0()))
        .await
        .unwrap();
    ledger
        .set_intake_paused(paused.id, true, &ops(t0()))
        .await
        .unwrap();
    let audit_before = ledger.recent_audit(100).await.unwrap();
    refuse_audit_rows(&pool).await;
    let by = ops(t0() + secs(60));

    refused(ledger.create_tenant("clinic-b", &by).await);
    refused(ledger.set_intake_paused(tenant.id, true, &by).await);
    refused(ledger.set_intake_paused(paused.id, false, &by).await);
    refused(
        ledger
            .set_tenant_channel_account(tenant.id, Channel::Sms, Some(&account()), &by)
            .await,
    );
    refused(ledger.set_schedule(tenant.id, "0 * * * * *", 60, &by).await);
    refused(
        ledger
            .set_rate(&account(), Channel::Sms, 0.0, None, &by)
            .await,
    );

    assert_eq!(ledger.tenant_by_name("clinic-b").await.unwrap(), None);
    assert!(
        !ledger
            .tenant(tenant.id)
            .await
            .unwrap()
            .unwrap()
            .intake_paused
    );
    assert!(
        ledger
            .tenant(paused.id)
            .await
            .unwrap()
            .unwrap()
            .intake_paused
    );
    assert_eq!(
        ledger
            .tenant_channel_account(tenant.id, Channel::Sms)
            .await
            .unwrap(),
        None
    );
    assert!(ledger.schedules().await.unwrap().is_empty());
    assert!(ledger.rate_buckets().await.unwrap().is_empty());
    assert_eq!(ledger.recent_audit(100).await.unwrap(), audit_before);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn each_change_writes_one_row_with_who_why_and_what_it_replaced(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let by = Operator::new("ops@clinic", Some("onboarding"), t0()).unwrap();
    let tenant = ledger.create_tenant("clinic-a", &by).await.unwrap();
    let again = ledger.create_tenant("clinic-a", &by).await.unwrap();
    ledger
        .set_schedule(tenant.id, " 0 * * * * * ", 60, &by)
        .await
        .unwrap();
    ledger
        .set_schedule(tenant.id, "*/5 * * * * *", 5, &by)
        .await
        .unwrap();
    ledger
        .set_tenant_channel_account(tenant.id, Channel::Sms, Some(&account()), &by)
        .await
        .unwrap();
    ledger
        .set_tenant_channel_account(tenant.id, Channel::Sms, None, &by)
        .await
        .unwrap();
    ledger
        .set_intake_paused(tenant.id, true, &by)
        .await
        .unwrap();
    ledger
        .set_rate(&account(), Channel::Sms, 10.0, Some(2), &by)
        .await
        .unwrap();

    let mut audit = ledger.recent_audit(100).await.unwrap();
    audit.reverse();
    assert_eq!(again, tenant);
    let summary: Vec<(&str, Option<&str>, serde_json::Value)> = audit
        .iter()
        .map(|a| (a.action.as_str(), a.target.as_deref(), a.details.clone()))
        .collect();
    let target = format!("tenant:{}", tenant.id);
    let target = Some(target.as_str());
    assert_eq!(
        summary,
        [
            (
                "tenant_create",
                target,
                serde_json::json!({"name": "clinic-a", "created": true})
            ),
            (
                "tenant_create",
                target,
                serde_json::json!({"name": "clinic-a", "created": false})
            ),
            (
                "schedule_set",
                target,
                serde_json::json!({"cron": "0 * * * * *", "window_seconds": 60, "previous": null})
            ),
            (
                "schedule_set",
                target,
                serde_json::json!({"cron": "*/5 * * * * *", "window_seconds": 5,
                    "previous": {"cron": "0 * * * * *", "window_seconds": 60}})
            ),
            (
                "tenant_route",
                target,
                serde_json::json!({"channel": "sms", "account": "sms-backup", "previous": null})
            ),
            (
                "tenant_route",
                target,
                serde_json::json!({"channel": "sms", "account": null, "previous": "sms-backup"})
            ),
            (
                "intake_pause",
                target,
                serde_json::json!({"intake_paused": true, "previous": false,
                    "deliveries_materialised": 0})
            ),
            (
                "rate_set",
                Some("bucket:sms-backup/sms"),
                serde_json::json!({"account": "sms-backup", "channel": "sms",
                    "rate_per_second": 10.0, "burst": 2, "previous": null})
            ),
        ]
    );
    assert!(audit.iter().all(|a| a.actor == "ops@clinic"
        && a.reason.as_deref() == Some("onboarding")
        && a.at == t0()));
    let bucket = &ledger.rate_buckets().await.unwrap()[0];
    assert_eq!(
        (bucket.changed_by.as_str(), bucket.change_reason.as_deref()),
        ("ops@clinic", Some("onboarding"))
    );
}

#[test]
fn an_operator_needs_an_actor_the_audit_log_accepts_and_a_reason_that_says_something() {
    let long = "a".repeat(201);
    for (actor, reason) in [
        ("", None),
        ("   ", Some("incident")),
        (long.as_str(), Some("incident")),
        ("ops@clinic", Some(" ")),
    ] {
        assert!(
            matches!(
                Operator::new(actor, reason, t0()),
                Err(LedgerError::InvalidInput(_))
            ),
            "{actor:?} {reason:?}"
        );
    }
    let longest = "é".repeat(200);
    let by = Operator::new(&longest, None, t0()).unwrap();
    assert_eq!(
        (by.actor(), by.reason(), by.at()),
        (longest.as_str(), None, t0())
    );
}
