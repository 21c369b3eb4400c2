//! `nudgectl retention plan`: counts by table, state and age band with what stays and why, as
//! tables or JSON, and deletes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use clap::Parser;
use nudge_config::RetentionConfig;
use nudge_ledger::{Ledger, Operator};
use nudgectl::{Cli, Command, RetentionCommand, execute};
use sqlx::PgPool;

async fn run(ledger: &Ledger, json: bool) -> String {
    let mut out = Vec::new();
    let mut err = Vec::new();
    let policy = Some(RetentionConfig::default().policy().unwrap());
    execute(
        ledger,
        "ops@clinic",
        None,
        Command::Retention(RetentionCommand::Plan { json, policy }),
        &mut out,
        &mut err,
    )
    .await
    .unwrap();
    String::from_utf8(out).unwrap()
}

/// One SMS delivery in `state`, settled (or due) `days_ago`, with its reminder.
async fn delivery(pool: &PgPool, tenant: uuid::Uuid, state: &str, days_ago: i32) {
    let reminder = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels, scheduled_at,
             expires_at, created_at)
         VALUES ($1, $2, $1::text, 'subscriber', ARRAY['sms'], now() - make_interval(days => $3),
             now() - make_interval(days => $3) + interval '1 hour', now() - make_interval(days => $3))",
    )
    .bind(reminder)
    .bind(tenant)
    .bind(days_ago)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
             scheduled_at, expires_at, next_attempt_at, settled_at, created_at, updated_at)
         SELECT gen_random_uuid(), r.id, r.tenant_id, 'sms', $2, 'nudge-' || r.id::text || '-sms', r.scheduled_at,
             r.expires_at, CASE WHEN $2 = 'retry_wait' THEN r.scheduled_at END,
             CASE WHEN $2 <> 'retry_wait' THEN r.scheduled_at END, r.scheduled_at, r.scheduled_at
         FROM reminders r WHERE r.id = $1",
    )
    .bind(reminder)
    .bind(state)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_plan_counts_what_goes_and_why_the_rest_stays_and_deletes_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let ops = Operator::new("ops", Some("test"), chrono::Utc::now()).unwrap();
    let tenant = ledger
        .create_tenant("clinic", &ops)
        .await
        .unwrap()
        .id
        .as_uuid();
    delivery(&pool, tenant, "delivered", 100).await;
    delivery(&pool, tenant, "delivered", 100).await;
    delivery(&pool, tenant, "delivered", 2).await;
    delivery(&pool, tenant, "ambiguous", 400).await;
    delivery(&pool, tenant, "retry_wait", 400).await;

    let json: serde_json::Value = serde_json::from_str(&run(&ledger, true).await).unwrap();
    let deliveries = &json["tables"]["deliveries"];
    assert_eq!(deliveries["delete"], 2);
    assert_eq!(
        deliveries["kept"],
        serde_json::json!({"owed": 1, "held": 1, "too_young": 1})
    );
    assert_eq!(json["policy"]["delivered"], 30);
    let old_delivered = json["deliveries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["state"] == "delivered" && c["age_band"] == ">7d")
        .unwrap();
    assert_eq!(old_delivered["count"], 2);
    assert!(old_delivered["kept"].is_null());

    let text = run(&ledger, false).await;
    assert!(text.contains("policy: delivered 30d"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("deliveries") && l.contains(" 2 ") && l.contains("held 1")),
        "{text}"
    );
    assert!(text.contains("keep: too_young"), "{text}");

    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 5, "a plan deletes nothing");
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM retention_runs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(runs, 0, "and records no run");
}

#[test]
fn retention_plan_parses_with_and_without_json() {
    for args in [
        &["nudgectl", "retention", "plan"][..],
        &["nudgectl", "retention", "plan", "--json"],
    ] {
        let cli = Cli::try_parse_from(args).unwrap();
        assert!(matches!(
            cli.command,
            Command::Retention(RetentionCommand::Plan { policy: None, .. })
        ));
    }
}
