use std::process::Command as Process;

use nudge_ledger::Ledger;
use nudgectl::{Command, TenantCommand, execute};
use sqlx::PgPool;

async fn run(ledger: &Ledger, command: Command) -> anyhow::Result<String> {
    let mut out = Vec::new();
    execute(ledger, "ops@clinic", command, &mut out).await?;
    Ok(String::from_utf8(out)?)
}

#[sqlx::test(migrations = false)]
async fn migrate_applies_the_schema_and_is_safe_to_repeat(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());

    run(&ledger, Command::Migrate).await.unwrap();
    run(&ledger, Command::Migrate).await.unwrap();

    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables WHERE table_name IN ('deliveries', 'attempts', 'run_intents')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(tables, 3);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn pausing_a_tenant_sets_the_flag_and_audits_who_and_why(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let id = run(
        &ledger,
        Command::Tenant(TenantCommand::Create {
            name: "clinic-a".into(),
        }),
    )
    .await
    .unwrap();

    let printed = run(
        &ledger,
        Command::Tenant(TenantCommand::Pause {
            name: "clinic-a".into(),
            reason: "sms provider incident".into(),
        }),
    )
    .await
    .unwrap();

    assert_eq!(printed, "tenant clinic-a: intake paused\n");
    let tenant = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();
    assert!(tenant.intake_paused);
    assert_eq!(tenant.id.to_string(), id.trim());
    let audit = ledger.recent_audit(5).await.unwrap();
    assert_eq!(audit[0].action, "intake_pause");
    assert_eq!(audit[0].actor, "ops@clinic");
    assert_eq!(audit[0].reason.as_deref(), Some("sms provider incident"));
    assert_eq!(audit[1].action, "tenant_create");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_pause_without_a_reason_or_for_an_unknown_tenant_changes_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    run(
        &ledger,
        Command::Tenant(TenantCommand::Create {
            name: "clinic-a".into(),
        }),
    )
    .await
    .unwrap();

    let blank = run(
        &ledger,
        Command::Tenant(TenantCommand::Pause {
            name: "clinic-a".into(),
            reason: "  ".into(),
        }),
    )
    .await;
    let unknown = run(
        &ledger,
        Command::Tenant(TenantCommand::Pause {
            name: "nope".into(),
            reason: "x".into(),
        }),
    )
    .await;

    assert!(blank.unwrap_err().to_string().contains("--reason"));
    assert!(unknown.unwrap_err().to_string().contains("no tenant named"));
    assert!(
        !ledger
            .tenant_by_name("clinic-a")
            .await
            .unwrap()
            .unwrap()
            .intake_paused
    );
    assert_eq!(
        ledger.recent_audit(5).await.unwrap().len(),
        1,
        "only the create was audited"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn status_as_json_lists_every_channel(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);

    let printed = run(&ledger, Command::Status { json: true }).await.unwrap();

    let parsed: serde_json::Value = serde_json::from_str(&printed).unwrap();
    let channels: Vec<&str> = parsed
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["channel"].as_str().unwrap())
        .collect();
    assert_eq!(channels, ["push", "email", "sms"]);
}

#[test]
fn help_explains_each_command() {
    let out = Process::new(env!("CARGO_BIN_EXE_nudgectl"))
        .arg("--help")
        .output()
        .unwrap();

    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for word in ["migrate", "tenant", "status", "NUDGE_CONFIG", "--actor"] {
        assert!(
            help.contains(word),
            "--help does not mention {word}:\n{help}"
        );
    }
}

#[test]
fn a_bad_configuration_value_fails_naming_the_key_without_echoing_secrets() {
    let out = Process::new(env!("CARGO_BIN_EXE_nudgectl"))
        .arg("status")
        .env("NUDGE_DATABASE__URL", "mysql://admin:hunter2@db/nudge")
        .env_remove("NUDGE_CONFIG")
        .output()
        .unwrap();

    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("database.url"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}
