//! `rate set`, `rate list`, the bucket table of `status` and `estimate-drain`, against a
//! fresh database per test.

// Test code: a failed unwrap is a failed test, with its location.
#![allow(clippy::unwrap_used)]

use std::process::Command as Process;

use chrono::{DateTime, Duration, Utc};
use clap::Parser;
use nudge_domain::{Channel, EventId, ProviderAccount, SubscriberRef, TenantId};
use nudge_ledger::{DestinationCipher, Ledger, NewReminder, Operator};
use nudgectl::{Cli, Command, execute};
use serde_json::Value;
use sqlx::PgPool;

async fn run(ledger: &Ledger, command: Command) -> anyhow::Result<String> {
    let mut out = Vec::new();
    let mut err = Vec::new();
    execute(ledger, "ops@clinic", None, command, &mut out, &mut err).await?;
    Ok(String::from_utf8(out)?)
}

fn parse(args: &[&str]) -> Result<Command, clap::Error> {
    Cli::try_parse_from(std::iter::once("nudgectl").chain(args.iter().copied())).map(|c| c.command)
}

async fn ctl(ledger: &Ledger, args: &[&str]) -> anyhow::Result<String> {
    run(ledger, parse(args)?).await
}

fn account(name: &str) -> ProviderAccount {
    ProviderAccount::parse(name).unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn rate_set_creates_the_bucket_audits_old_and_new_and_says_when_it_applies(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);

    let created = ctl(
        &ledger,
        &[
            "rate",
            "set",
            "sms-main",
            "sms",
            "40",
            "--reason",
            "contracted rate",
        ],
    )
    .await
    .unwrap();
    let raised = ctl(
        &ledger,
        &[
            "rate",
            "set",
            "sms-main",
            "sms",
            "60",
            "--burst",
            "10",
            "--reason",
            "provider raised our limit",
        ],
    )
    .await
    .unwrap();

    assert!(
        created
            .starts_with("bucket sms-main/sms: rate 40/s, burst 40, effective 40/s (new bucket)"),
        "{created}"
    );
    assert!(
        raised.starts_with(
            "bucket sms-main/sms: rate 60/s, burst 10, effective 60/s (was 40/s, burst 40)"
        ),
        "{raised}"
    );
    assert!(raised.contains("takes effect within a second"), "{raised}");
    let buckets = ledger.rate_buckets().await.unwrap();
    assert_eq!(buckets.len(), 1);
    assert_eq!(buckets[0].account, account("sms-main"));
    assert_eq!(buckets[0].rate_per_second, 60.0);
    assert_eq!(buckets[0].burst, 10);
    assert_eq!(buckets[0].changed_by, "ops@clinic");
    assert_eq!(
        buckets[0].change_reason.as_deref(),
        Some("provider raised our limit")
    );
    let audit = ledger.recent_audit(2).await.unwrap();
    assert_eq!(audit[0].action, "rate_set");
    assert_eq!(audit[0].actor, "ops@clinic");
    assert_eq!(audit[0].target.as_deref(), Some("bucket:sms-main/sms"));
    assert_eq!(
        audit[0].reason.as_deref(),
        Some("provider raised our limit")
    );
    assert_eq!(
        audit[0].details,
        serde_json::json!({
            "account": "sms-main", "channel": "sms", "rate_per_second": 60.0, "burst": 10,
            "previous": {"rate_per_second": 40.0, "burst": 40, "effective_rate": 40.0},
        })
    );
    assert_eq!(audit[1].details["previous"], Value::Null);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn rate_zero_is_accepted_and_stops_the_bucket_then_a_raise_restarts_it(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ctl(
        &ledger,
        &["rate", "set", "sms-main", "sms", "40", "--reason", "start"],
    )
    .await
    .unwrap();

    let stopped = ctl(
        &ledger,
        &[
            "rate", "set", "sms-main", "sms", "0", "--burst", "0", "--reason", "rollback",
        ],
    )
    .await
    .unwrap();

    assert!(
        stopped.starts_with("bucket sms-main/sms: stopped, rate 0 (was 40/s, burst 40)"),
        "{stopped}"
    );
    assert!(
        stopped.contains("takes effect within a second"),
        "{stopped}"
    );
    let bucket = &ledger.rate_buckets().await.unwrap()[0];
    assert_eq!(
        (bucket.rate_per_second, bucket.effective_rate, bucket.burst),
        (0.0, 0.0, 0)
    );

    // Burst 0 would admit nothing at a positive rate: the raise gives the bucket one.
    let restarted = ctl(
        &ledger,
        &[
            "rate",
            "set",
            "sms-main",
            "sms",
            "2.5",
            "--reason",
            "incident over",
        ],
    )
    .await
    .unwrap();
    assert!(restarted.contains("rate 2.5/s, burst 3"), "{restarted}");
    assert_eq!(ledger.recent_audit(5).await.unwrap().len(), 3);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_negative_or_nan_rate_a_zero_burst_or_no_reason_is_refused_and_changes_nothing(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);

    for rate in ["-1", "NaN", "inf", "fast"] {
        let err = parse(&["rate", "set", "sms-main", "sms", rate, "--reason", "x"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("PER_SECOND must be a number of sends per second from 0 to 1000000"),
            "{rate}: {err}"
        );
        assert!(err.contains("0 stops sending"), "{rate}: {err}");
    }
    let zero_burst = ctl(
        &ledger,
        &[
            "rate", "set", "sms-main", "sms", "5", "--burst", "0", "--reason", "x",
        ],
    )
    .await
    .unwrap_err()
    .to_string();
    let no_reason = ctl(
        &ledger,
        &["rate", "set", "sms-main", "sms", "5", "--reason", " "],
    )
    .await
    .unwrap_err()
    .to_string();
    let bad_account = parse(&["rate", "set", "SMS", "sms", "5", "--reason", "x"]).unwrap_err();

    assert!(
        zero_burst.contains("--burst must be at least 1 unless the rate is 0"),
        "{zero_burst}"
    );
    assert!(no_reason.contains("--reason"), "{no_reason}");
    assert!(
        bad_account.to_string().contains("provider account"),
        "{bad_account}"
    );
    assert!(ledger.rate_buckets().await.unwrap().is_empty());
    assert!(ledger.recent_audit(5).await.unwrap().is_empty());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn rate_list_shows_every_bucket_as_a_table_or_json(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let empty = ctl(&ledger, &["rate", "list"]).await.unwrap();
    ctl(
        &ledger,
        &[
            "rate",
            "set",
            "sms-main",
            "sms",
            "40",
            "--reason",
            "contracted rate",
        ],
    )
    .await
    .unwrap();
    ctl(
        &ledger,
        &[
            "rate",
            "set",
            "email-main",
            "email",
            "0",
            "--reason",
            "rollback",
        ],
    )
    .await
    .unwrap();

    let table = ctl(&ledger, &["rate", "list"]).await.unwrap();
    let json: Value =
        serde_json::from_str(&ctl(&ledger, &["rate", "list", "--json"]).await.unwrap()).unwrap();

    assert!(empty.starts_with("no rate buckets"), "{empty}");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    for column in [
        "account",
        "channel",
        "rate/s",
        "effective/s",
        "burst",
        "paused_until",
        "changed_by",
        "changed_at",
        "reason",
    ] {
        assert!(lines[0].contains(column), "{table}");
    }
    // By channel, then account: email before sms.
    assert!(lines[1].starts_with("email-main email"), "{table}");
    assert!(lines[1].ends_with("rollback"), "{table}");
    assert!(lines[2].starts_with("sms-main   sms"), "{table}");
    assert!(lines[2].contains("ops@clinic"), "{table}");
    let buckets = json.as_array().unwrap();
    assert_eq!(buckets.len(), 2);
    let sms = &buckets[1];
    assert_eq!(sms["account"], "sms-main");
    assert_eq!(sms["channel"], "sms");
    assert_eq!(sms["rate_per_second"], 40.0);
    assert_eq!(sms["burst"], 40);
    assert_eq!(sms["effective_rate"], 40.0);
    assert_eq!(sms["paused_until"], Value::Null);
    assert_eq!(sms["changed_by"], "ops@clinic");
    assert!(sms["changed_at"].as_str().unwrap().contains('T'));
    assert_eq!(sms["change_reason"], "contracted rate");
    assert!(sms["reserve_new"].is_number() && sms["reserve_recovery"].is_number());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn status_shows_the_buckets_after_the_channels_and_keeps_its_json_an_array(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ctl(
        &ledger,
        &[
            "rate", "set", "sms-main", "sms", "40", "--burst", "5", "--reason", "start",
        ],
    )
    .await
    .unwrap();

    let table = ctl(&ledger, &["status"]).await.unwrap();
    let json: Value =
        serde_json::from_str(&ctl(&ledger, &["status", "--json"]).await.unwrap()).unwrap();

    let channels_at = table.find("channel ").unwrap();
    let buckets_at = table.find("rate buckets\n").unwrap();
    assert!(channels_at < buckets_at, "{table}");
    let buckets = &table[buckets_at..];
    assert!(buckets.contains("account  channel"), "{table}");
    assert!(buckets.contains("paused_until"), "{table}");
    assert!(
        buckets
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["sms-main", "sms", "40", "40", "5", "-"]),
        "{table}"
    );
    assert_eq!(json.as_array().unwrap().len(), 3, "still the channel array");
}

const KEY: [u8; 32] = [7; 32];

/// Creates a reminder for `channel`; one already due is materialised at once, one in the
/// future waits for the producer.
async fn reminder(
    ledger: &Ledger,
    tenant: TenantId,
    event: &str,
    channel: Channel,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
) {
    let reminder = NewReminder::new(
        tenant,
        EventId::parse(event).unwrap(),
        SubscriberRef::parse("patient-0001").unwrap(),
        &[channel],
        scheduled_at,
        expires_at,
    )
    .unwrap();
    ledger
        .create_reminder(
            &reminder,
            &DestinationCipher::new(&KEY)
                .with_subscriber_key(nudge_ledger::SubscriberKey::new(&KEY)),
            Utc::now(),
        )
        .await
        .unwrap();
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn estimate_drain_reports_the_floor_the_buckets_and_what_expires_first(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = ledger
        .create_tenant(
            "clinic-a",
            &Operator::new("ops@clinic", None, Utc::now()).unwrap(),
        )
        .await
        .unwrap();
    let now = Utc::now();
    let hour = Duration::hours(1);
    // Ten owed sms, then one due later in line that expires before its turn (11th at
    // 0.5/s: 22 s from now).
    for i in 0..10 {
        let due = now - Duration::seconds(60 - i);
        reminder(
            &ledger,
            tenant.id,
            &format!("owed-{i}"),
            Channel::Sms,
            due,
            due + hour,
        )
        .await;
    }
    reminder(
        &ledger,
        tenant.id,
        "late",
        Channel::Sms,
        now - Duration::seconds(30),
        now + Duration::seconds(10),
    )
    .await;
    // Three more fall due within the drain, not yet materialised.
    for i in 1..=3 {
        let at = now + Duration::seconds(5 * i);
        reminder(
            &ledger,
            tenant.id,
            &format!("soon-{i}"),
            Channel::Sms,
            at,
            at + hour,
        )
        .await;
    }
    // Email is owed but stopped; push has no bucket.
    reminder(
        &ledger,
        tenant.id,
        "mail",
        Channel::Email,
        now - hour,
        now + hour,
    )
    .await;
    reminder(
        &ledger,
        tenant.id,
        "push",
        Channel::Push,
        now - hour,
        now + hour,
    )
    .await;
    for args in [
        [
            "rate",
            "set",
            "sms-main",
            "sms",
            "0.5",
            "--reason",
            "slow provider",
        ],
        [
            "rate",
            "set",
            "sms-backup",
            "sms",
            "0",
            "--reason",
            "not contracted",
        ],
        [
            "rate",
            "set",
            "email-main",
            "email",
            "0",
            "--reason",
            "rollback",
        ],
    ] {
        ctl(&ledger, &args).await.unwrap();
    }
    let late = ledger
        .owed_in_due_order(Channel::Sms, Utc::now(), 100)
        .await
        .unwrap()[10]
        .id;

    let json: Value =
        serde_json::from_str(&ctl(&ledger, &["estimate-drain", "--json"]).await.unwrap()).unwrap();
    let report = ctl(&ledger, &["estimate-drain", "--channel", "sms"])
        .await
        .unwrap();

    assert!(json["now"].as_str().is_some());
    let channels = json["channels"].as_array().unwrap();
    assert_eq!(channels.len(), 3);
    let sms = &channels[2];
    assert_eq!(sms["channel"], "sms");
    assert_eq!(sms["backlog"], 11);
    assert_eq!(sms["backlog_due"], 11);
    assert_eq!(sms["backlog_sending"], 0);
    assert_eq!(sms["limited"], true);
    assert_eq!(sms["rate_per_second"], 0.5);
    assert_eq!(sms["arrivals"], 3);
    assert_eq!(sms["drains"], true);
    assert_eq!(sms["floor_s"], 28.0);
    assert_eq!(sms["converged"], true);
    assert_eq!(sms["capped"], false);
    assert_eq!(sms["stalled_reason"], Value::Null);
    let buckets = sms["buckets"].as_array().unwrap();
    assert_eq!(buckets[0]["account"], "sms-backup");
    assert_eq!(buckets[0]["counted"], false);
    assert_eq!(buckets[0]["note"], "stopped (rate 0)");
    assert_eq!(buckets[1]["account"], "sms-main");
    assert_eq!(buckets[1]["counted"], true);
    assert_eq!(sms["expiring"]["count"], 1);
    assert_eq!(
        sms["expiring"]["delivery_ids"],
        serde_json::json!([late.to_string()])
    );
    assert_eq!(sms["expiring"]["walked"], 11);
    assert_eq!(sms["expiring"]["complete"], true);

    let email = &channels[1];
    assert_eq!(email["backlog"], 1);
    assert_eq!(email["rate_per_second"], 0.0);
    assert_eq!(email["drains"], false);
    assert_eq!(email["floor_s"], Value::Null);
    assert_eq!(
        email["stalled_reason"],
        "admitted rate is 0: email-main stopped (rate 0)"
    );
    assert_eq!(email["expiring"]["count"], 1);

    let push = &channels[0];
    assert_eq!(push["backlog"], 1);
    assert_eq!(push["limited"], false);
    assert_eq!(push["rate_per_second"], Value::Null);
    assert_eq!(push["expiring"], Value::Null);

    assert!(
        report.starts_with("sms: 11 owed now (11 due, 0 sending)\n"),
        "{report}"
    );
    assert!(
        report.contains("admitted 0.5/s: sms-backup not counted: stopped (rate 0), sms-main 0.5/s"),
        "{report}"
    );
    assert!(
        report.contains("floor 28.0 s = (11 owed + 3 falling due during the drain) / 0.5/s"),
        "{report}"
    );
    assert!(
        report.contains(&format!("expiring before their turn: 1 (first 1: {late})")),
        "{report}"
    );
    assert!(!report.contains("patient-0001"), "{report}");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_stopped_channel_says_it_will_not_drain_and_why(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = ledger
        .create_tenant(
            "clinic-a",
            &Operator::new("ops@clinic", None, Utc::now()).unwrap(),
        )
        .await
        .unwrap();
    let now = Utc::now();
    reminder(
        &ledger,
        tenant.id,
        "mail",
        Channel::Email,
        now - Duration::minutes(5),
        now + Duration::hours(1),
    )
    .await;
    ctl(
        &ledger,
        &[
            "rate",
            "set",
            "email-main",
            "email",
            "0",
            "--reason",
            "rollback",
        ],
    )
    .await
    .unwrap();

    let report = ctl(&ledger, &["estimate-drain", "--channel", "email"])
        .await
        .unwrap();

    assert_eq!(
        report,
        "email: 1 owed now (1 due, 0 sending)\n  \
         admitted 0/s: email-main not counted: stopped (rate 0)\n  \
         will not drain: admitted rate is 0: email-main stopped (rate 0); 0 more fall due in \
         the next 7 days\n  \
         expiring before their turn: 1 (first 1: "
            .to_owned()
            + &ledger
                .owed_in_due_order(Channel::Email, now, 1)
                .await
                .unwrap()[0]
                .id
                .to_string()
            + ")\n"
    );
}

#[test]
fn rate_and_estimate_help_explain_the_rollback_switch_and_the_model() {
    for (args, words) in [
        (
            &["rate", "set", "--help"][..],
            &[
                "PER_SECOND",
                "0 stops sending",
                "rollback",
                "within a second",
                "--burst",
                "--reason",
            ][..],
        ),
        (&["rate", "list", "--help"], &["--json"]),
        (
            &["estimate-drain", "--help"],
            &[
                "(B + N) / R",
                "--channel",
                "--json",
                "expire",
                "not paused",
                "7 days",
            ],
        ),
        (&["--help"], &["rate", "estimate-drain"]),
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
async fn rate_list_shows_the_burst_learnt_from_the_provider_beside_the_configured_one(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    ctl(
        &ledger,
        &[
            "rate", "set", "sms-main", "sms", "40", "--burst", "40", "--reason", "contract",
        ],
    )
    .await
    .unwrap();
    let before = ctl(&ledger, &["rate", "list"]).await.unwrap();
    // What admission writes when a 429 came while the bucket spent its burst.
    sqlx::query("UPDATE rate_buckets SET burst_limit = 30")
        .execute(ledger.pool())
        .await
        .unwrap();

    let table = ctl(&ledger, &["rate", "list"]).await.unwrap();
    let json: Value =
        serde_json::from_str(&ctl(&ledger, &["rate", "list", "--json"]).await.unwrap()).unwrap();

    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
    let learned = header.iter().position(|c| *c == "learned").unwrap();
    let burst = header.iter().position(|c| *c == "burst").unwrap();
    assert_eq!((row[burst], row[learned]), ("40", "30"), "{table}");
    let before_row: Vec<&str> = before.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(before_row[learned], "-", "{before}");
    assert_eq!(json[0]["burst"], 40);
    assert_eq!(json[0]["learned_burst"], 30);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn status_lists_each_tenants_lateness_and_what_waits_for_an_account_nobody_has(pool: PgPool) {
    use nudge_domain::IdempotencySupport;
    use nudge_ledger::test_support::{at, db_now, lease_as, ops, owed};
    let ledger = Ledger::from_pool(pool);
    let now = db_now(&ledger).await;
    let routed = ledger.create_tenant("routed", &ops(now)).await.unwrap();
    let shared = ledger.create_tenant("shared", &ops(now)).await.unwrap();
    ledger
        .set_tenant_channel_account(
            routed.id,
            Channel::Sms,
            Some(&account("clinic-own")),
            &ops(now),
        )
        .await
        .unwrap();
    owed(&ledger, routed.id, "one", &[Channel::Sms], now).await;
    for event in ["a", "b"] {
        owed(
            &ledger,
            shared.id,
            event,
            &[Channel::Sms],
            now - Duration::seconds(90),
        )
        .await;
    }
    let due = ledger.claim_due(Channel::Sms, 10, at(now)).await.unwrap();
    let ours = due.iter().find(|d| d.tenant_id == routed.id).unwrap();
    let default_only = nudge_ledger::WorkerRoutes {
        default: account("sms-main"),
        accounts: vec![(account("sms-main"), IdempotencySupport::Honoured)],
    };
    lease_as(&ledger, ours, "worker-1", &default_only, now).await;

    let table = ctl(&ledger, &["status"]).await.unwrap();
    let json: Value = serde_json::from_str(
        &ctl(&ledger, &["status", "--json", "--tenants", "1"])
            .await
            .unwrap(),
    )
    .unwrap();

    let tenants_at = table
        .find("tenants with live work, the latest first (2 of 2)")
        .unwrap();
    let waiting_at = table
        .find("deliveries waiting for their tenant's own provider account")
        .unwrap();
    let tenants = &table[tenants_at..waiting_at];
    let rows: Vec<Vec<&str>> = tenants
        .lines()
        .skip(2)
        .map(|l| l.split_whitespace().collect())
        .filter(|r: &Vec<&str>| !r.is_empty())
        .collect();
    assert_eq!(
        rows[0][..9],
        ["shared", "sms", "(default)", "0", "2", "0", "0", "0", "0"],
        "{table}"
    );
    assert!(
        rows[0][9].parse::<i64>().unwrap() >= 90,
        "the latest first: {table}"
    );
    assert_eq!(
        rows[1],
        [
            "routed",
            "sms",
            "clinic-own",
            "0",
            "0",
            "0",
            "1",
            "1",
            "0",
            "-"
        ],
        "{table}"
    );
    let waiting = &table[waiting_at..];
    assert!(
        waiting.lines().any(|l| l.trim_start().starts_with("routed")
            && l.contains("clinic-own")
            && l.contains("no live worker has it")),
        "{table}"
    );
    let sms = json
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["channel"] == "sms")
        .unwrap();
    assert_eq!(sms["queued"], 2, "the channel's counts are as before");
    assert_eq!(
        sms["tenants"].as_array().unwrap().len(),
        1,
        "bounded by --tenants"
    );
    assert_eq!(sms["tenants"][0]["tenant"], "shared");
    assert_eq!(sms["awaiting_account"][0]["tenant"], "routed");
    assert_eq!(sms["awaiting_account"][0]["account"], "clinic-own");
    assert_eq!(sms["awaiting_account"][0]["deliveries"], 1);
    assert_eq!(sms["awaiting_account"][0]["held_now"], false);
}
