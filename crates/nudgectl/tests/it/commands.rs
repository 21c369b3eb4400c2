use std::process::Command as Process;

use clap::Parser;
use nudge_domain::{Channel, ProviderAccount};
use nudge_ledger::Ledger;
use nudgectl::{Cli, Command, TenantCommand, execute};
use sqlx::PgPool;

async fn run(ledger: &Ledger, command: Command) -> anyhow::Result<String> {
    let mut out = Vec::new();
    let mut err = Vec::new();
    execute(ledger, "ops@clinic", None, command, &mut out, &mut err).await?;
    Ok(String::from_utf8(out)?)
}

/// Parses a command line as the binary does, so the tests cover the argument checks too.
fn parse(args: &[&str]) -> Result<Command, clap::Error> {
    Cli::try_parse_from(std::iter::once("nudgectl").chain(args.iter().copied())).map(|c| c.command)
}

#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
async fn create_tenant(ledger: &Ledger, name: &str) {
    run(
        ledger,
        Command::Tenant(TenantCommand::Create { name: name.into() }),
    )
    .await
    .unwrap();
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
            incident: Some("INC-1".into()),
            ack_timeout: std::time::Duration::from_secs(2),
        }),
    )
    .await
    .unwrap();

    assert_eq!(
        printed,
        "tenant clinic-a: intake paused\n\
         no producer has run in the last 30 s: the change applies when one starts\n"
    );
    let tenant = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();
    assert!(tenant.intake_paused);
    assert_eq!(tenant.id.to_string(), id.trim());
    let audit = ledger.recent_audit(5).await.unwrap();
    assert_eq!(audit[0].action, "intake_pause");
    assert_eq!(audit[0].actor, "ops@clinic");
    assert_eq!(audit[0].reason.as_deref(), Some("sms provider incident"));
    assert_eq!(audit[0].incident.as_deref(), Some("INC-1"));
    assert_eq!(audit[1].action, "tenant_create");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_pause_waits_for_every_running_producer_to_acknowledge_it(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    create_tenant(&ledger, "clinic-a").await;
    let now = ledger
        .clock(nudge_ledger::LedgerTime::Database)
        .await
        .unwrap();
    // Two producers ran a pass a moment ago; one of them stops before the pause.
    ledger.ack_producer_pass("p-1", now).await.unwrap();
    ledger.ack_producer_pass("p-2", now).await.unwrap();
    let pause = |name: &str, timeout_ms| {
        Command::Tenant(TenantCommand::Pause {
            name: name.into(),
            reason: "incident".into(),
            incident: None,
            ack_timeout: std::time::Duration::from_millis(timeout_ms),
        })
    };
    // p-1 keeps running its passes; p-2 has stopped.
    let stop = simulated::Stop::default();
    let acker = producer(&ledger, "clinic-a", &["p-1"], &stop);
    let printed = run(&ledger, pause("clinic-a", 1_000)).await.unwrap();
    stop.set();
    acker.await.unwrap();
    assert!(
        printed.contains("not yet acknowledged after 1 s by: p-2"),
        "{printed}"
    );
    // Once p-2 runs again too, the next pause is acknowledged by both.
    create_tenant(&ledger, "clinic-b").await;
    let stop = simulated::Stop::default();
    let acker = producer(&ledger, "clinic-b", &["p-1", "p-2"], &stop);
    let printed = run(&ledger, pause("clinic-b", 10_000)).await.unwrap();
    stop.set();
    acker.await.unwrap();
    assert!(
        printed.contains("acknowledged by 2 producer(s) within"),
        "{printed}"
    );
}

mod simulated {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Tells a simulated producer to stop its passes.
    #[derive(Debug, Clone, Default)]
    pub struct Stop(Arc<AtomicBool>);

    impl Stop {
        pub fn set(&self) {
            self.0.store(true, Ordering::SeqCst);
        }
        pub fn is_set(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
    }
}

/// Producers `instances` as the real one behaves: once `tenant`'s pause has committed (polled,
/// with a deadline), a schedule pass every 50 ms acknowledging the database's time, until told
/// to stop.
#[allow(clippy::unwrap_used)]
fn producer(
    ledger: &Ledger,
    tenant: &str,
    instances: &'static [&'static str],
    stop: &simulated::Stop,
) -> tokio::task::JoinHandle<()> {
    let (ledger, tenant, stop) = (ledger.clone(), tenant.to_owned(), stop.clone());
    tokio::spawn(async move {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !ledger
            .tenant_by_name(&tenant)
            .await
            .unwrap()
            .unwrap()
            .intake_paused
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the pause never committed"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        while !stop.is_set() {
            let now = ledger
                .clock(nudge_ledger::LedgerTime::Database)
                .await
                .unwrap();
            for instance in instances {
                ledger.ack_producer_pass(instance, now).await.unwrap();
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
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
            incident: None,
            ack_timeout: std::time::Duration::ZERO,
        }),
    )
    .await;
    let unknown = run(
        &ledger,
        Command::Tenant(TenantCommand::Pause {
            name: "nope".into(),
            reason: "x".into(),
            incident: None,
            ack_timeout: std::time::Duration::ZERO,
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
async fn a_pause_by_an_empty_actor_is_refused_and_the_tenant_is_not_paused(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    create_tenant(&ledger, "clinic-a").await;

    let err = execute(
        &ledger,
        "",
        None,
        parse(&["tenant", "pause", "clinic-a", "--reason", "incident"]).unwrap(),
        &mut Vec::new(),
        &mut Vec::new(),
    )
    .await
    .unwrap_err();

    assert!(format!("{err:#}").contains("--actor"), "{err:#}");
    let tenant = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();
    assert!(!tenant.intake_paused);
    assert_eq!(ledger.recent_audit(5).await.unwrap().len(), 1);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn status_as_json_lists_every_channel(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);

    let printed = run(
        &ledger,
        Command::Status {
            json: true,
            tenants: 20,
        },
    )
    .await
    .unwrap();

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
    for word in [
        "migrate",
        "tenant",
        "reminders",
        "schedule",
        "status",
        "NUDGE_CONFIG",
        "--actor",
    ] {
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

#[test]
fn each_new_command_explains_itself_in_its_help() {
    for (args, words) in [
        (
            &["reminders", "load", "--help"][..],
            &[
                "JSON Lines",
                "--dry-run",
                "`-` reads stdin",
                "line N: reason",
                "already present",
                "crypto.destination_key",
            ][..],
        ),
        (
            &["schedule", "set", "--help"],
            &["--cron", "seconds first", "--window-seconds", "--reason"],
        ),
        (
            &["tenant", "route", "--help"],
            &["ACCOUNT", "--default", "push, email or sms", "--reason"],
        ),
    ] {
        let out = Process::new(env!("CARGO_BIN_EXE_nudgectl"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success());
        let help = String::from_utf8(out.stdout).unwrap();
        for word in words {
            assert!(
                help.contains(word),
                "{args:?} does not mention {word}:\n{help}"
            );
        }
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn schedule_set_refuses_text_that_is_not_cron_and_shows_an_example(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    create_tenant(&ledger, "clinic-a").await;

    let refused = parse(&[
        "schedule",
        "set",
        "clinic-a",
        "--cron",
        "not a cron",
        "--window-seconds",
        "300",
        "--reason",
        "onboarding",
    ])
    .unwrap_err()
    .to_string();

    assert!(refused.contains("not a cron expression"), "{refused}");
    assert!(refused.contains("\"0 * * * * *\""), "{refused}");
    assert!(ledger.schedules().await.unwrap().is_empty());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn schedule_set_stores_a_seconds_first_expression_and_audits_it(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    create_tenant(&ledger, "clinic-a").await;
    let command = parse(&[
        "schedule",
        "set",
        "clinic-a",
        "--cron",
        "*/5 * * * * *",
        "--window-seconds",
        "300",
        "--reason",
        "onboarding",
    ])
    .unwrap();

    let printed = run(&ledger, command).await.unwrap();

    assert!(
        printed.starts_with("tenant clinic-a: schedule \"*/5 * * * * *\" with a 300 s window"),
        "{printed}"
    );
    let tenant = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();
    let schedules = ledger.schedules().await.unwrap();
    assert_eq!(schedules.len(), 1);
    assert_eq!(schedules[0].tenant_id, tenant.id);
    assert_eq!(schedules[0].cron, "*/5 * * * * *");
    assert_eq!(schedules[0].window_seconds, 300);
    let audit = ledger.recent_audit(1).await.unwrap();
    assert_eq!(audit[0].action, "schedule_set");
    assert_eq!(audit[0].actor, "ops@clinic");
    assert_eq!(audit[0].reason.as_deref(), Some("onboarding"));
    assert_eq!(audit[0].details["cron"], "*/5 * * * * *");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn schedule_set_refuses_a_window_out_of_range_and_an_unknown_tenant(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let base = ["schedule", "set", "clinic-a", "--cron", "0 * * * * *"];
    let long = [&base[..], &["--window-seconds", "604801", "--reason", "x"]].concat();

    assert!(parse(&long).is_err());
    let unknown = [&base[..], &["--window-seconds", "60", "--reason", "x"]].concat();
    let err = run(&ledger, parse(&unknown).unwrap()).await.unwrap_err();
    assert!(
        err.to_string().contains("no tenant named \"clinic-a\""),
        "{err}"
    );
    assert!(ledger.recent_audit(1).await.unwrap().is_empty());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_tenants_weight_is_set_with_a_reason_audited_and_out_of_range_refused(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    create_tenant(&ledger, "clinic-a").await;

    let set = run(
        &ledger,
        parse(&[
            "tenant",
            "set",
            "clinic-a",
            "--weight",
            "3",
            "--reason",
            "largest clinic",
        ])
        .unwrap(),
    )
    .await
    .unwrap();

    assert_eq!(set, "tenant clinic-a: weight 3 (was 1)\n");
    let audit = ledger.recent_audit(1).await.unwrap();
    assert_eq!(audit[0].action, "tenant_weight");
    assert_eq!(audit[0].reason.as_deref(), Some("largest clinic"));
    for refused in [
        vec![
            "tenant", "set", "clinic-a", "--weight", "0", "--reason", "r",
        ],
        vec![
            "tenant", "set", "clinic-a", "--weight", "1001", "--reason", "r",
        ],
        vec!["tenant", "set", "clinic-a", "--weight", "2"],
    ] {
        assert!(parse(&refused).is_err(), "{refused:?}");
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_tenants_max_share_is_set_and_cleared_audited_and_out_of_range_refused(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    create_tenant(&ledger, "clinic-a").await;
    let set = |share: &'static str| {
        parse(&[
            "tenant",
            "set",
            "clinic-a",
            "--max-share",
            share,
            "--reason",
            "trial tenant",
        ])
        .unwrap()
    };

    let capped = run(&ledger, set("0.5")).await.unwrap();
    assert_eq!(capped, "tenant clinic-a: max share 0.5 (was none)\n");
    let audit = ledger.recent_audit(1).await.unwrap();
    assert_eq!(audit[0].action, "tenant_max_share");
    assert_eq!(audit[0].reason.as_deref(), Some("trial tenant"));
    let cleared = run(&ledger, set("1")).await.unwrap();
    assert_eq!(cleared, "tenant clinic-a: max share none (was 0.5)\n");

    let audited = ledger.recent_audit(100).await.unwrap().len();
    for bad in ["0", "1.5", "NaN"] {
        let refused = run(&ledger, set(bad)).await.unwrap_err();
        assert!(
            format!("{refused:#}").contains("maximum share"),
            "{bad}: {refused:#}"
        );
    }
    assert!(
        parse(&["tenant", "set", "clinic-a", "--reason", "r"]).is_err(),
        "at least one setting"
    );
    assert_eq!(
        ledger.recent_audit(100).await.unwrap().len(),
        audited,
        "refusals write nothing"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_tenants_time_zone_is_set_and_cleared_with_a_reason_audited_and_an_unknown_one_refused(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    create_tenant(&ledger, "clinic-a").await;
    let tzdb = nudge_domain::TZDB_VERSION;

    let set = run(
        &ledger,
        parse(&[
            "tenant",
            "set",
            "clinic-a",
            "--time-zone",
            "Europe/Berlin",
            "--reason",
            "clinic in Berlin",
        ])
        .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(
        set,
        format!("tenant clinic-a: time zone Europe/Berlin (was none; tz database {tzdb})\n")
    );
    let tenant = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();
    assert_eq!(tenant.time_zone.map(|z| z.name()), Some("Europe/Berlin"));
    let audit = ledger.recent_audit(1).await.unwrap();
    assert_eq!(audit[0].action, "tenant_time_zone");
    assert_eq!(audit[0].reason.as_deref(), Some("clinic in Berlin"));
    assert_eq!(audit[0].details["time_zone"], "Europe/Berlin");

    // Both settings at once: each audited.
    let both = run(
        &ledger,
        parse(&[
            "tenant",
            "set",
            "clinic-a",
            "--weight",
            "2",
            "--clear-time-zone",
            "--reason",
            "r",
        ])
        .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(
        both,
        format!(
            "tenant clinic-a: weight 2 (was 1)\n\
             tenant clinic-a: time zone none (was Europe/Berlin; tz database {tzdb})\n"
        )
    );
    let tenant = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();
    assert_eq!(tenant.time_zone, None);

    let before = ledger.recent_audit(100).await.unwrap().len();
    for refused in [
        vec![
            "tenant",
            "set",
            "clinic-a",
            "--time-zone",
            "Europe/Atlantis",
            "--reason",
            "r",
        ],
        vec![
            "tenant",
            "set",
            "clinic-a",
            "--time-zone",
            "europe/berlin",
            "--reason",
            "r",
        ],
        vec![
            "tenant",
            "set",
            "clinic-a",
            "--time-zone",
            "UTC",
            "--clear-time-zone",
            "--reason",
            "r",
        ],
        vec!["tenant", "set", "clinic-a", "--time-zone", "UTC"],
        vec!["tenant", "set", "clinic-a", "--reason", "nothing to set"],
    ] {
        assert!(parse(&refused).is_err(), "{refused:?}");
    }
    assert_eq!(ledger.recent_audit(100).await.unwrap().len(), before);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_channel_is_routed_to_an_account_then_back_to_the_default(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    create_tenant(&ledger, "clinic-a").await;
    let tenant = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();

    let routed = run(
        &ledger,
        parse(&[
            "tenant",
            "route",
            "clinic-a",
            "sms",
            "twilio-backup",
            "--reason",
            "primary sms account suspended",
        ])
        .unwrap(),
    )
    .await
    .unwrap();

    assert_eq!(
        routed,
        "tenant clinic-a: sms routed to account twilio-backup\n"
    );
    assert_eq!(
        ledger
            .tenant_channel_account(tenant.id, Channel::Sms)
            .await
            .unwrap(),
        Some(ProviderAccount::parse("twilio-backup").unwrap())
    );

    let back = run(
        &ledger,
        parse(&[
            "tenant",
            "route",
            "clinic-a",
            "sms",
            "--default",
            "--reason",
            "primary account restored",
        ])
        .unwrap(),
    )
    .await
    .unwrap();

    assert_eq!(
        back,
        "tenant clinic-a: sms routed to the channel's default account\n"
    );
    assert_eq!(
        ledger
            .tenant_channel_account(tenant.id, Channel::Sms)
            .await
            .unwrap(),
        None
    );
    let audit = ledger.recent_audit(2).await.unwrap();
    assert_eq!(audit[0].action, "tenant_route");
    assert_eq!(audit[0].reason.as_deref(), Some("primary account restored"));
    assert_eq!(
        audit[0].details,
        serde_json::json!({"channel": "sms", "account": null, "previous": "twilio-backup"})
    );
    assert_eq!(audit[1].action, "tenant_route");
    assert_eq!(
        audit[1].details,
        serde_json::json!({"channel": "sms", "account": "twilio-backup", "previous": null})
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_route_needs_exactly_one_of_an_account_or_default_and_a_reason(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    create_tenant(&ledger, "clinic-a").await;

    let neither = parse(&["tenant", "route", "clinic-a", "sms", "--reason", "x"]);
    let both = parse(&[
        "tenant",
        "route",
        "clinic-a",
        "sms",
        "acct",
        "--default",
        "--reason",
        "x",
    ]);
    let bad_account = parse(&[
        "tenant", "route", "clinic-a", "sms", "Acct", "--reason", "x",
    ]);
    let blank_reason = run(
        &ledger,
        Command::Tenant(TenantCommand::Route {
            name: "clinic-a".into(),
            channel: Channel::Sms,
            account: None,
            default: true,
            reason: " ".into(),
        }),
    )
    .await;

    assert!(neither.is_err());
    assert!(both.is_err());
    assert!(
        bad_account
            .unwrap_err()
            .to_string()
            .contains("provider account")
    );
    assert!(blank_reason.unwrap_err().to_string().contains("--reason"));
    assert_eq!(
        ledger.recent_audit(5).await.unwrap().len(),
        1,
        "only the create"
    );
}

/// Runs the real binary with its clock `offset` away from the truth (faketime, installed by
/// `scripts/services.sh`), against the test's database.
#[allow(clippy::unwrap_used, clippy::expect_used)]
fn nudgectl_with_clock(pool: &PgPool, offset: &str, args: &[&str]) -> std::process::Output {
    let skewed = Process::new("faketime")
        .args(["-f", offset, "date", "+%Y"])
        .output()
        .expect("faketime is installed (scripts/services.sh)");
    let real = Process::new("date").arg("+%Y").output().unwrap();
    assert_ne!(
        skewed.stdout, real.stdout,
        "faketime must move the clock of the processes it runs"
    );
    Process::new("faketime")
        .args(["-f", offset, env!("CARGO_BIN_EXE_nudgectl")])
        .args(args)
        .env(
            "NUDGE_DATABASE__URL",
            sqlx::ConnectOptions::to_url_lossy(&*pool.connect_options()).to_string(),
        )
        .env_remove("NUDGE_CONFIG")
        .env("NUDGE_ACTOR", "ops@clinic")
        .output()
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
#[allow(clippy::unwrap_used)]
async fn an_operator_whose_clock_is_years_behind_dates_the_change_and_its_audit_row_by_the_database(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenant(&ledger, "clinic-a").await;
    let before: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&pool)
        .await
        .unwrap();

    let out = nudgectl_with_clock(
        &pool,
        "-1000d",
        &[
            "tenant",
            "pause",
            "clinic-a",
            "--reason",
            "provider incident",
            "--ack-timeout",
            "0s",
        ],
    );

    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&pool)
        .await
        .unwrap();
    let audit = ledger.recent_audit(1).await.unwrap();
    assert_eq!(audit[0].action, "intake_pause");
    assert!(
        before <= audit[0].at && audit[0].at <= after,
        "the audit row is dated {} by the operator's clock, not between {before} and {after}",
        audit[0].at
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
#[allow(clippy::unwrap_used)]
async fn status_counts_what_is_due_by_the_database_s_clock_not_the_operator_s(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenant(&ledger, "clinic-a").await;
    let tenant = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();
    let now = ledger
        .clock(nudge_ledger::LedgerTime::Database)
        .await
        .unwrap();
    let cipher = nudge_ledger::DestinationCipher::new(&[1; 32])
        .with_subscriber_key(nudge_ledger::SubscriberKey::new(&[2; 32]));
    let created = ledger
        .create_reminder(
            &nudge_ledger::NewReminder::new(
                tenant.id,
                nudge_domain::EventId::parse("due-now").unwrap(),
                nudge_domain::SubscriberRef::parse("patient-1").unwrap(),
                &[Channel::Sms],
                now - chrono::Duration::seconds(5),
                now + chrono::Duration::hours(1),
            )
            .unwrap(),
            &cipher,
            now,
        )
        .await
        .unwrap();
    ledger
        .materialise_reminder(tenant.id, created.id, now)
        .await
        .unwrap();

    let out = nudgectl_with_clock(&pool, "-1000d", &["status", "--json"]);

    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let sms = status
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["channel"] == "sms")
        .unwrap();
    assert_eq!(sms["due"], 1, "{sms}");
}

/// `migrate` with the tenant secret key seals again, under it, the signing secrets sealed
/// before it existed; without it, it says how many remain.
#[allow(clippy::unwrap_used)]
#[sqlx::test(migrations = false)]
async fn migrate_seals_old_signing_secrets_again_under_the_tenant_secret_key(pool: PgPool) {
    use nudge_ledger::DestinationCipher;
    let ledger = Ledger::from_pool(pool.clone());
    run(&ledger, Command::Migrate).await.unwrap();
    create_tenant(&ledger, "clinic-a").await;
    let tenant = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();
    let destination_only = DestinationCipher::new(&[7; 32]);
    let by = nudge_ledger::Operator::new("ops", Some("test"), chrono::Utc::now()).unwrap();
    let secret = ledger
        .rotate_signing_secret(tenant.id, &destination_only, &by)
        .await
        .unwrap();

    let (mut out, mut err) = (Vec::new(), Vec::new());
    execute(
        &ledger,
        "ops",
        Some(&destination_only),
        Command::Migrate,
        &mut out,
        &mut err,
    )
    .await
    .unwrap();
    let said = String::from_utf8(err).unwrap();
    assert!(
        said.contains("1 tenant secrets (signing or webhook) are sealed with the destination key"),
        "{said}"
    );

    let both = DestinationCipher::new(&[7; 32]).with_tenant_secret_key(&[9; 32]);
    let (mut out, mut err) = (Vec::new(), Vec::new());
    execute(
        &ledger,
        "ops",
        Some(&both),
        Command::Migrate,
        &mut out,
        &mut err,
    )
    .await
    .unwrap();
    let said = String::from_utf8(out).unwrap();
    assert!(
        said.contains("sealed again under crypto.tenant_secret_key: 1"),
        "{said}"
    );
    assert_eq!(
        ledger
            .tenant_secrets_sealed_with_destination_key()
            .await
            .unwrap(),
        0
    );
    let opened = ledger
        .intake_tenant("clinic-a", &both)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(opened.secrets.first(), Some(&secret));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
#[allow(clippy::unwrap_used)]
async fn series_list_show_and_cancel_read_and_cancel_a_tenants_series_audited(pool: PgPool) {
    use nudge_domain::series::{Series, SeriesLimits};
    use nudge_domain::{ExpiresAfter, LocalTime, SubscriberRef, Zone};
    use nudge_ledger::test_support::cipher;

    let ledger = Ledger::from_pool(pool);
    create_tenant(&ledger, "clinic-a").await;
    let tenant = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();
    let series = Series::parse(
        "FREQ=WEEKLY;BYDAY=MO;COUNT=4",
        LocalTime::parse("2030-01-07T09:00:00").unwrap(),
        Zone::parse("Europe/London").unwrap(),
        &SeriesLimits {
            max_ahead: chrono::TimeDelta::days(366),
            max_per_day: 24,
        },
    )
    .unwrap();
    let new = nudge_ledger::NewSeries::new(
        tenant.id,
        "inhaler-7",
        SubscriberRef::parse("patient-7").unwrap(),
        &[Channel::Email],
        series,
        "FREQ=WEEKLY;BYDAY=MO;COUNT=4",
        ExpiresAfter::from_secs(600).unwrap(),
    )
    .unwrap();
    let contacts = [(
        Channel::Email,
        nudge_ledger::Destination::new("p7@example.org".to_owned()),
    )];
    ledger
        .create_series(&new, &contacts, &cipher(), chrono::Utc::now())
        .await
        .unwrap();

    let listed = run(&ledger, parse(&["series", "list", "clinic-a"]).unwrap())
        .await
        .unwrap();
    assert!(listed.contains("inhaler-7"), "{listed}");
    assert!(listed.contains("Europe/London"), "{listed}");
    assert!(listed.contains("2030-01-07T09:00:00Z"), "{listed}");
    let shown = run(
        &ledger,
        parse(&["series", "show", "clinic-a", "inhaler-7"]).unwrap(),
    )
    .await
    .unwrap();
    assert!(shown.contains("FREQ=WEEKLY;BYDAY=MO;COUNT=4"), "{shown}");
    assert!(shown.contains("2030-01-28T09:00:00"), "{shown}");
    assert!(!shown.contains("p7@example.org") && !shown.contains("patient-7"));

    assert!(
        parse(&["series", "cancel", "clinic-a", "inhaler-7"]).is_err(),
        "--reason is required"
    );
    let cancelled = run(
        &ledger,
        parse(&[
            "series",
            "cancel",
            "clinic-a",
            "inhaler-7",
            "--reason",
            "course ended",
        ])
        .unwrap(),
    )
    .await
    .unwrap();
    assert!(
        cancelled.starts_with("series inhaler-7 cancelled"),
        "{cancelled}"
    );
    let audit = ledger.recent_audit(1).await.unwrap();
    assert_eq!(audit[0].action, "series_cancel");
    assert_eq!(audit[0].reason.as_deref(), Some("course ended"));
    let shown = run(
        &ledger,
        parse(&["series", "show", "clinic-a", "inhaler-7"]).unwrap(),
    )
    .await
    .unwrap();
    assert!(shown.contains("upcoming      none"), "{shown}");
    let unknown = run(
        &ledger,
        parse(&["series", "show", "clinic-a", "nope"]).unwrap(),
    )
    .await
    .unwrap_err();
    assert!(unknown.to_string().contains("no series"), "{unknown}");
}
