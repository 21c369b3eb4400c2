//! `nudgectl reminders load`: the bulk import, against a fresh database per test.

// The helpers below are test code too: a failed unwrap is a failed test, with its location.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Command as Process, Stdio};

use nudge_ledger::{DestinationCipher, Ledger, SubscriberKey};
use nudgectl::{Command, RemindersCommand, TenantCommand, execute};
use sqlx::{ConnectOptions, PgPool};

/// base64 of the 32 bytes `[7; 32]`, the destination key of [`cipher`].
const KEY_BASE64: &str = "BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwc=";
/// base64 of the 32 bytes `[8; 32]`, the subscriber key of [`cipher`].
const SUBSCRIBER_KEY_BASE64: &str = "CAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAg=";

fn cipher() -> DestinationCipher {
    DestinationCipher::new(&[7u8; 32]).with_subscriber_key(SubscriberKey::new(&[8u8; 32]))
}

/// Every destination, subscriber reference and content value the files below use.
const SENSITIVE: &[&str] = &[
    "+15550101",
    "one@example.org",
    "push-token-2",
    "+15550105",
    "+15550106",
    "six@example.org",
    "+15550107",
    "+15550109",
    "patient-1",
    "patient-2",
    "patient-5",
    "patient-6",
    "patient-7",
    "patient-9",
    "appointment-reminder",
];

/// Lines 1 and 2 are good; 8 repeats line 1; every other non-blank line is bad.
const MIXED: &str = r#"{"tenant": "clinic-a", "event_id": "appt-1", "subscriber_ref": "patient-1", "channels": ["sms", "email"], "scheduled_at": "2099-11-30T09:00:00Z", "expires_at": "2099-11-30T10:00:00Z", "destinations": {"sms": "+15550101", "email": "one@example.org"}, "content": {"template": "appointment-reminder", "clinic": "A"}}
{"tenant": "clinic-b", "event_id": "appt-2", "subscriber_ref": "patient-2", "channels": ["push"], "scheduled_at": "2020-01-01T09:00:00+01:00", "expires_at": "2099-01-01T09:00:00Z", "destinations": {"push": "push-token-2"}}
{"tenant": "clinic-a", "event_id" "appt-3"}

{"tenant": "clinic-x", "event_id": "appt-5", "subscriber_ref": "patient-5", "channels": ["sms"], "scheduled_at": "2099-11-30T09:00:00Z", "expires_at": "2099-11-30T10:00:00Z", "destinations": {"sms": "+15550105"}}
{"tenant": "clinic-a", "event_id": "appt-6", "subscriber_ref": "patient-6", "channels": ["sms", "email"], "scheduled_at": "2099-11-30T09:00:00Z", "expires_at": "2099-11-30T10:00:00Z", "destinations": {"email": "six@example.org"}}
{"tenant": "clinic-a", "event_id": "appt-7", "subscriber_ref": "patient-7", "channels": ["sms"], "scheduled_at": "2099-11-30T09:00:00Z", "expires_at": "2099-11-30T08:00:00Z", "destinations": {"sms": "+15550107"}}
{"tenant": "clinic-a", "event_id": "appt-1", "subscriber_ref": "patient-1", "channels": ["sms", "email"], "scheduled_at": "2099-11-30T09:00:00Z", "expires_at": "2099-11-30T10:00:00Z", "destinations": {"sms": "+15550101", "email": "one@example.org"}, "content": {"template": "appointment-reminder", "clinic": "A"}}
{"tenant": "clinic-a", "event_id": "appt-1", "subscriber_ref": "patient-9", "channels": ["sms"], "scheduled_at": "2099-11-30T09:00:00Z", "expires_at": "2099-11-30T10:00:00Z", "destinations": {"sms": "+15550109"}}
"#;

/// Writes `contents` to a file of its own for one test.
fn input_file(test: &str, contents: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("nudgectl-{test}-{}.jsonl", std::process::id()));
    std::fs::write(&path, contents).unwrap();
    path
}

struct Outcome {
    result: anyhow::Result<()>,
    out: String,
    err: String,
}

impl Outcome {
    /// Everything the operator could see: stdout, stderr and the error chain.
    fn everything_shown(&self) -> String {
        let error = self
            .result
            .as_ref()
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        format!("{}{}{error}", self.out, self.err)
    }
}

async fn load(ledger: &Ledger, file: PathBuf, dry_run: bool, json: bool) -> Outcome {
    let command = Command::Reminders(RemindersCommand::Load {
        file,
        dry_run,
        json,
        reason: Some("migration from the old system".into()),
    });
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let result = execute(
        ledger,
        "ops@clinic",
        Some(&cipher()),
        command,
        &mut out,
        &mut err,
    )
    .await;
    Outcome {
        result,
        out: String::from_utf8(out).unwrap(),
        err: String::from_utf8(err).unwrap(),
    }
}

async fn create_tenants(ledger: &Ledger, names: &[&str]) {
    for name in names {
        let command = Command::Tenant(TenantCommand::Create {
            name: (*name).into(),
        });
        execute(
            ledger,
            "ops@clinic",
            None,
            command,
            &mut Vec::new(),
            &mut Vec::new(),
        )
        .await
        .unwrap();
    }
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

fn assert_nothing_sensitive(shown: &str) {
    for value in SENSITIVE {
        assert!(!shown.contains(value), "output shows {value}:\n{shown}");
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn good_lines_load_and_bad_lines_are_reported_by_number_without_writing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenants(&ledger, &["clinic-a", "clinic-b"]).await;

    let outcome = load(&ledger, input_file("mixed", MIXED), false, false).await;

    let error = outcome.result.as_ref().unwrap_err().to_string();
    assert!(error.contains("5 of 8 lines rejected"), "{error}");
    assert_eq!(
        outcome.out,
        "loaded 2 new, 1 already present, 5 rejected (of 8 lines)\n\
         deliveries created at once: 1 (reminders already due, or in a window the producer \
         has run)\n"
    );
    let rejected: Vec<&str> = outcome.err.lines().collect();
    assert_eq!(rejected.len(), 5, "{}", outcome.err);
    assert_eq!(
        rejected[0],
        "line 3: invalid JSON at column 35: expected `:`"
    );
    assert_eq!(rejected[1], "line 5: unknown tenant \"clinic-x\"");
    assert_eq!(rejected[2], "line 6: destinations.sms is missing");
    assert_eq!(rejected[3], "line 7: expires_at must be after scheduled_at");
    assert_eq!(
        rejected[4],
        "line 9: event_id \"appt-1\" of tenant \"clinic-a\" is already used for a different reminder"
    );
    assert_nothing_sensitive(&outcome.everything_shown());

    assert_eq!(count(&pool, "SELECT count(*) FROM reminders").await, 2);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM reminders WHERE event_id IN ('appt-1', 'appt-2') \
             AND subscriber_ref_keyed AND subscriber_ref NOT LIKE 'patient-%'"
        )
        .await,
        2,
        "subscriber references are stored as a keyed hash"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM contacts").await, 3);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM contacts c WHERE NOT EXISTS \
             (SELECT 1 FROM reminders r WHERE r.subscriber_ref = c.subscriber_ref)"
        )
        .await,
        0,
        "a rejected line left a contact behind"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM reminders WHERE content_ciphertext IS NOT NULL"
        )
        .await,
        1
    );

    let audit = ledger.recent_audit(1).await.unwrap();
    assert_eq!(audit[0].action, "reminders_load");
    assert_eq!(audit[0].actor, "ops@clinic");
    assert_eq!(
        audit[0].reason.as_deref(),
        Some("migration from the old system")
    );
    let details = &audit[0].details;
    assert!(details["file"].as_str().unwrap().ends_with(".jsonl"));
    assert_eq!(details["lines"], 8);
    assert_eq!(details["loaded"], 2);
    assert_eq!(details["already_present"], 1);
    assert_eq!(details["rejected"], 5);
    assert_eq!(
        details["loaded_per_tenant"],
        serde_json::json!({"clinic-a": 1, "clinic-b": 1})
    );
    assert_nothing_sensitive(&details.to_string());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_clean_file_loads_with_success_and_loading_it_again_changes_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenants(&ledger, &["clinic-a", "clinic-b"]).await;
    let good: String = MIXED.lines().take(2).map(|l| format!("{l}\n")).collect();
    let file = input_file("clean", &good);

    let first = load(&ledger, file.clone(), false, true).await;
    let again = load(&ledger, file, false, true).await;

    assert!(first.result.is_ok(), "{:?}", first.result);
    assert!(again.result.is_ok(), "{:?}", again.result);
    assert_eq!(first.err, "");
    let first: serde_json::Value = serde_json::from_str(&first.out).unwrap();
    let again: serde_json::Value = serde_json::from_str(&again.out).unwrap();
    assert_eq!(first["loaded"], 2);
    assert_eq!(first["rejected"], 0);
    assert_eq!(first["deliveries_created"], 1);
    assert_eq!(again["loaded"], 0);
    assert_eq!(again["already_present"], 2);
    assert_eq!(count(&pool, "SELECT count(*) FROM reminders").await, 2);
    assert_eq!(count(&pool, "SELECT count(*) FROM deliveries").await, 1);
    let audit = ledger.recent_audit(2).await.unwrap();
    assert!(audit.iter().all(|a| a.action == "reminders_load"));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_dry_run_checks_every_line_and_writes_nothing(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenants(&ledger, &["clinic-a", "clinic-b"]).await;
    let audit_before = ledger.recent_audit(10).await.unwrap().len();

    let outcome = load(&ledger, input_file("dry-run", MIXED), true, false).await;

    assert!(outcome.result.is_err());
    assert_eq!(
        outcome.out,
        "dry run: 4 valid, 4 rejected (of 8 lines); nothing written\n"
    );
    let numbers: Vec<&str> = outcome
        .err
        .lines()
        .map(|l| l.split(':').next().unwrap())
        .collect();
    assert_eq!(numbers, ["line 3", "line 5", "line 6", "line 7"]);
    assert_nothing_sensitive(&outcome.everything_shown());
    assert_eq!(count(&pool, "SELECT count(*) FROM reminders").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM contacts").await, 0);
    assert_eq!(ledger.recent_audit(10).await.unwrap().len(), audit_before);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_long_load_reports_progress_every_thousand_lines(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    create_tenants(&ledger, &["clinic-a"]).await;
    let lines: String = (0..2001)
        .map(|i| {
            format!(
                "{{\"tenant\": \"clinic-a\", \"event_id\": \"e-{i}\", \"subscriber_ref\": \"p-{i}\", \
                 \"channels\": [\"sms\"], \"scheduled_at\": \"2099-01-01T00:00:00Z\", \
                 \"expires_at\": \"2099-01-02T00:00:00Z\", \"destinations\": {{\"sms\": \"+1555{i:04}\"}}}}\n"
            )
        })
        .collect();

    let outcome = load(&ledger, input_file("progress", &lines), true, false).await;

    assert!(outcome.result.is_ok(), "{:?}", outcome.result);
    assert_eq!(
        outcome.err,
        "progress: 1000 lines read, 0 new, 0 already present, 0 rejected\n\
         progress: 2000 lines read, 0 new, 0 already present, 0 rejected\n"
    );
    assert_eq!(
        outcome.out,
        "dry run: 2001 valid, 0 rejected (of 2001 lines); nothing written\n"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_load_without_the_destination_key_fails_naming_it(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenants(&ledger, &["clinic-a", "clinic-b"]).await;
    let command = Command::Reminders(RemindersCommand::Load {
        file: input_file("no-key", MIXED),
        dry_run: false,
        json: false,
        reason: None,
    });

    let result = execute(
        &ledger,
        "ops@clinic",
        None,
        command,
        &mut Vec::new(),
        &mut Vec::new(),
    )
    .await;

    let error = result.unwrap_err().to_string();
    assert!(error.contains("crypto.destination_key"), "{error}");
    assert_eq!(count(&pool, "SELECT count(*) FROM reminders").await, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_binary_reads_stdin_and_exits_non_zero_when_a_line_is_rejected(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenants(&ledger, &["clinic-a", "clinic-b"]).await;
    let url = pool.connect_options().to_url_lossy().to_string();

    let mut child = Process::new(env!("CARGO_BIN_EXE_nudgectl"))
        .args(["--actor", "ops@clinic", "reminders", "load", "-"])
        .env("NUDGE_DATABASE__URL", url)
        .env("NUDGE_CRYPTO__DESTINATION_KEY", KEY_BASE64)
        .env("NUDGE_CRYPTO__SUBSCRIBER_KEY", SUBSCRIBER_KEY_BASE64)
        .env_remove("NUDGE_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(MIXED.as_bytes()).unwrap();
    }
    let output = child.wait_with_output().unwrap();

    let stdout = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stdout.starts_with("loaded 2 new, 1 already present, 5 rejected (of 8 lines)\n"),
        "{stdout}"
    );
    assert!(
        stderr.contains("line 6: destinations.sms is missing\n"),
        "{stderr}"
    );
    assert!(stderr.contains("error: 5 of 8 lines rejected"), "{stderr}");
    assert_nothing_sensitive(&format!("{stdout}{stderr}"));
    assert_eq!(
        ledger.recent_audit(1).await.unwrap()[0].details["file"],
        "<stdin>"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_database_failure_stops_the_load_and_says_at_which_line(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenants(&ledger, &["clinic-a", "clinic-b"]).await;
    pool.close().await;

    let outcome = load(&ledger, input_file("stopped", MIXED), false, false).await;

    let error = format!("{:#}", outcome.result.as_ref().unwrap_err());
    assert!(error.starts_with("load stopped at line 1;"), "{error}");
    assert!(error.contains("failed to look up a tenant"), "{error}");
    assert_eq!(
        outcome.out,
        "loaded 0 new, 0 already present, 0 rejected (of 0 lines)\n\
         stopped at line 1, before the end of the input\n"
    );
    assert_eq!(outcome.err, "");
    assert_nothing_sensitive(&outcome.everything_shown());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_oversized_line_destination_or_content_is_rejected_by_line_and_field_and_the_rest_loads(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenants(&ledger, &["clinic-a"]).await;
    let good = |i: u32, destination: &str, content: &str| {
        format!(
            "{{\"tenant\": \"clinic-a\", \"event_id\": \"e-{i}\", \"subscriber_ref\": \"patient-{i}\", \
             \"channels\": [\"sms\"], \"scheduled_at\": \"2099-01-01T00:00:00Z\", \
             \"expires_at\": \"2099-01-02T00:00:00Z\", \"destinations\": {{\"sms\": \"{destination}\"}}, \
             \"content\": {{\"note\": \"{content}\"}}}}\n"
        )
    };
    // Line 2 is 10 MB of one line, read without holding it whole.
    let huge_line = format!("{{\"tenant\": \"{}\"}}\n", "9".repeat(10_000_000));
    let input = [
        good(1, "+15550101", "appointment-reminder"),
        huge_line,
        good(3, &"5".repeat(2_000), "x"),
        good(4, "+15550106", &"7".repeat(20_000)),
        good(5, "+15550105", "y"),
    ]
    .concat();

    let outcome = load(&ledger, input_file("oversized", &input), false, false).await;

    assert!(outcome.result.is_err());
    assert_eq!(
        outcome.err,
        "line 2: line is longer than 65536 bytes\n\
         line 3: destinations.sms is longer than 1024 bytes\n\
         line 4: content is longer than 16384 bytes (as JSON text)\n"
    );
    assert!(
        outcome
            .out
            .starts_with("loaded 2 new, 0 already present, 3 rejected (of 5 lines)")
    );
    assert!(!outcome.everything_shown().contains("5555555555"));
    assert!(!outcome.everything_shown().contains("7777777777"));
    assert_eq!(count(&pool, "SELECT count(*) FROM reminders").await, 2);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_load_without_the_subscriber_key_fails_naming_it(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenants(&ledger, &["clinic-a", "clinic-b"]).await;
    let command = Command::Reminders(RemindersCommand::Load {
        file: input_file("no-subscriber-key", MIXED),
        dry_run: false,
        json: false,
        reason: None,
    });

    let result = execute(
        &ledger,
        "ops@clinic",
        Some(&DestinationCipher::new(&[7u8; 32])),
        command,
        &mut Vec::new(),
        &mut Vec::new(),
    )
    .await;

    let error = result.unwrap_err().to_string();
    assert!(error.contains("crypto.subscriber_key"), "{error}");
    assert_eq!(count(&pool, "SELECT count(*) FROM reminders").await, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_file_of_many_chunks_loads_every_line_once_and_again_as_already_present(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenants(&ledger, &["clinic-a"]).await;
    // 1,201 lines: three chunks, the last partial; a few reminders already due.
    let lines: String = (0..1201)
        .map(|i| {
            let at = if i % 400 == 0 { "2020-01-01T00:00:00Z" } else { "2099-01-01T00:00:00Z" };
            format!(
                "{{\"tenant\": \"clinic-a\", \"event_id\": \"e-{i}\", \"subscriber_ref\": \"p-{}\", \
                 \"channels\": [\"sms\"], \"scheduled_at\": \"{at}\", \
                 \"expires_at\": \"2099-01-02T00:00:00Z\", \"destinations\": {{\"sms\": \"+1555{i:04}\"}}}}\n",
                i % 700
            )
        })
        .collect();
    let file = input_file("chunks", &lines);

    let first = load(&ledger, file.clone(), false, true).await;
    let again = load(&ledger, file, false, true).await;

    assert!(first.result.is_ok(), "{:?} {}", first.result, first.err);
    let first: serde_json::Value = serde_json::from_str(&first.out).unwrap();
    assert_eq!(first["loaded"], 1201);
    assert_eq!(first["deliveries_created"], 4);
    let again: serde_json::Value = serde_json::from_str(&again.out).unwrap();
    assert_eq!(again["already_present"], 1201);
    assert_eq!(count(&pool, "SELECT count(*) FROM reminders").await, 1201);
    assert_eq!(count(&pool, "SELECT count(*) FROM contacts").await, 700);
    assert_eq!(count(&pool, "SELECT count(*) FROM deliveries").await, 4);
}

/// Local times in three zones and two refusals, loaded by the binary under a host zone of its
/// own (`TZ=Asia/Tokyo`, +09:00 without daylight time): the instants are the patient's zone's,
/// never the host's.
const LOCAL_TIMES: &str = r#"{"tenant": "clinic-a", "event_id": "gap-ny", "subscriber_ref": "patient-1", "channels": ["sms"], "scheduled_local": "2027-03-14T02:30:00", "time_zone": "America/New_York", "expires_after_s": 3600, "destinations": {"sms": "+15550101"}}
{"tenant": "clinic-a", "event_id": "gap-lhi", "subscriber_ref": "patient-2", "channels": ["push"], "scheduled_local": "2027-10-03T02:15:00", "expires_after_s": 600, "destinations": {"push": "push-token-2"}}
{"tenant": "clinic-a", "event_id": "twice-london", "subscriber_ref": "patient-5", "channels": ["sms"], "scheduled_local": "2027-10-31T01:30:00", "time_zone": "Europe/London", "expires_at": "2027-10-31T06:00:00Z", "destinations": {"sms": "+15550105"}}
{"tenant": "clinic-b", "event_id": "no-zone", "subscriber_ref": "patient-6", "channels": ["sms"], "scheduled_local": "2027-03-14T09:00:00", "expires_after_s": 600, "destinations": {"sms": "+15550106"}}
{"tenant": "clinic-a", "event_id": "both", "subscriber_ref": "patient-7", "channels": ["sms"], "scheduled_local": "2027-03-14T09:00:00", "scheduled_at": "2027-03-14T09:00:00Z", "expires_after_s": 600, "destinations": {"sms": "+15550107"}}
"#;

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn local_times_load_in_the_patients_zone_whatever_the_hosts_zone_is(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenants(&ledger, &["clinic-a", "clinic-b"]).await;
    let clinic_a = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();
    let by = nudge_ledger::Operator::new("ops@clinic", Some("test"), chrono::Utc::now()).unwrap();
    ledger
        .set_tenant_time_zone(
            clinic_a.id,
            nudge_domain::Zone::parse("Australia/Lord_Howe").ok(),
            &by,
        )
        .await
        .unwrap();
    let url = pool.connect_options().to_url_lossy().to_string();

    let mut child = Process::new(env!("CARGO_BIN_EXE_nudgectl"))
        .args(["--actor", "ops@clinic", "reminders", "load", "-"])
        .env("TZ", "Asia/Tokyo")
        .env("NUDGE_DATABASE__URL", url)
        .env("NUDGE_CRYPTO__DESTINATION_KEY", KEY_BASE64)
        .env("NUDGE_CRYPTO__SUBSCRIBER_KEY", SUBSCRIBER_KEY_BASE64)
        .env_remove("NUDGE_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(LOCAL_TIMES.as_bytes()).unwrap();
    }
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stdout.starts_with("loaded 3 new, 0 already present, 2 rejected (of 5 lines)\n"),
        "{stdout}"
    );
    assert!(
        stderr.contains("line 4: time_zone is required with scheduled_local"),
        "{stderr}"
    );
    assert!(
        stderr.contains("line 5: give scheduled_local or scheduled_at, not both"),
        "{stderr}"
    );
    assert_nothing_sensitive(&format!("{stdout}{stderr}"));

    let stored: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT event_id,
                to_char(scheduled_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),
                to_char(expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')
         FROM reminders ORDER BY event_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let expected = [
        // Lord Howe (the tenant's zone) springs forward 30 minutes over 02:15: 02:45 +11:00.
        ("gap-lhi", "2027-10-02T15:45:00Z", "2027-10-02T15:55:00Z"),
        // New York springs forward over 02:30: it happens at 03:30 EDT.
        ("gap-ny", "2027-03-14T07:30:00Z", "2027-03-14T08:30:00Z"),
        // London falls back over 01:30: the earlier, in BST.
        (
            "twice-london",
            "2027-10-31T00:30:00Z",
            "2027-10-31T06:00:00Z",
        ),
    ];
    let stored: Vec<(&str, &str, &str)> = stored
        .iter()
        .map(|(e, s, x)| (e.as_str(), s.as_str(), x.as_str()))
        .collect();
    assert_eq!(stored, expected);
}

/// A reminder and two series (one good, one whose rule never ends), then the good series again
/// with another rule under its id.
const WITH_SERIES: &str = r#"{"tenant": "clinic-a", "event_id": "appt-1", "subscriber_ref": "patient-1", "channels": ["sms"], "scheduled_at": "2099-11-30T09:00:00Z", "expires_at": "2099-11-30T10:00:00Z", "destinations": {"sms": "+15550101"}}
{"tenant": "clinic-a", "series_id": "med-1", "subscriber_ref": "patient-2", "channels": ["sms"], "time_zone": "Europe/Berlin", "start_local": "2027-01-04T08:00:00", "rrule": "FREQ=WEEKLY;BYDAY=MO;COUNT=8", "expires_after_s": 3600, "destinations": {"sms": "+15550105"}, "content": {"template": "appointment-reminder"}}
{"tenant": "clinic-a", "series_id": "med-2", "subscriber_ref": "patient-5", "channels": ["sms"], "time_zone": "Mars/Base", "start_local": "2027-01-04T08:00:00", "rrule": "FREQ=DAILY", "expires_after_s": 0, "destinations": {"sms": "+15550106"}}
{"tenant": "clinic-a", "series_id": "med-1", "subscriber_ref": "patient-2", "channels": ["sms"], "time_zone": "Europe/Berlin", "start_local": "2027-01-04T08:00:00", "rrule": "FREQ=WEEKLY;BYDAY=MO;COUNT=9", "expires_after_s": 3600, "destinations": {"sms": "+15550105"}, "content": {"template": "appointment-reminder"}}
"#;

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn series_lines_load_beside_reminders_and_loading_again_finds_them_present(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    create_tenants(&ledger, &["clinic-a"]).await;
    // Far enough ahead of any clock this test runs under for the series to start in the
    // future, near enough for the schedule-ahead limit: computed from now.
    let start = (chrono::Utc::now() + chrono::Duration::days(30))
        .format("%Y-%m-%dT08:00:00")
        .to_string();
    let text = WITH_SERIES.replace("2027-01-04T08:00:00", &start);
    let file = input_file("series", &text);

    let outcome = load(&ledger, file.clone(), false, false).await;
    assert!(outcome.result.is_err(), "two lines are rejected");
    assert!(
        outcome
            .out
            .starts_with("loaded 2 new, 0 already present, 2 rejected (of 4 lines)"),
        "{}",
        outcome.out
    );
    let rejected: Vec<&str> = outcome.err.lines().collect();
    assert_eq!(rejected.len(), 2, "{}", outcome.err);
    assert!(rejected[0].starts_with("line 3: "), "{}", rejected[0]);
    for field in ["time_zone:", "expires_after_s:"] {
        assert!(rejected[0].contains(field), "{}", rejected[0]);
    }
    assert_eq!(
        rejected[1],
        "line 4: series_id \"med-1\" of tenant \"clinic-a\" is already used for a different series"
    );
    assert_nothing_sensitive(&outcome.everything_shown());
    assert_eq!(count(&pool, "SELECT count(*) FROM series").await, 1);

    // Again: the reminder and the series are already present.
    let again = load(&ledger, file, false, false).await;
    assert!(
        again
            .out
            .starts_with("loaded 0 new, 2 already present, 2 rejected (of 4 lines)"),
        "{}",
        again.out
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM series").await, 1);
}
