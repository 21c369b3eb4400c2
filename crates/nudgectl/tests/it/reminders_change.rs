//! `nudgectl reminders reschedule` and `reminders cancel`: a dry run by default, per-line and
//! per-channel answers, audited.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use nudge_ledger::{DestinationCipher, Ledger, SubscriberKey};
use nudgectl::{ChangeTarget, Command, RemindersCommand, TenantCommand, execute};
use sqlx::PgPool;

fn cipher() -> DestinationCipher {
    DestinationCipher::new(&[7u8; 32]).with_subscriber_key(SubscriberKey::new(&[8u8; 32]))
}

const REMINDERS: &str = r#"{"tenant": "clinic-a", "event_id": "appt-1", "subscriber_ref": "patient-1", "channels": ["sms"], "scheduled_at": "2099-11-30T09:00:00Z", "expires_at": "2099-11-30T10:00:00Z", "destinations": {"sms": "+15550101"}}
{"tenant": "clinic-a", "event_id": "appt-2", "subscriber_ref": "patient-2", "channels": ["sms", "email"], "scheduled_at": "2099-11-30T09:00:00Z", "expires_at": "2099-11-30T10:00:00Z", "destinations": {"sms": "+15550102", "email": "two@example.org"}, "content": {"template": "secret-template"}}
"#;

fn input_file(test: &str, contents: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "nudgectl-change-{test}-{}.jsonl",
        std::process::id()
    ));
    std::fs::write(&path, contents).unwrap();
    path
}

async fn run(ledger: &Ledger, command: Command) -> (anyhow::Result<()>, String) {
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
    let shown = format!(
        "{}{}{}",
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
        result
            .as_ref()
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default()
    );
    for sensitive in ["+1555010", "two@example.org", "patient-", "secret-template"] {
        assert!(
            !shown.contains(sensitive),
            "output shows {sensitive}:\n{shown}"
        );
    }
    (result, shown)
}

fn target(event: Option<&str>, file: Option<PathBuf>, execute: bool) -> ChangeTarget {
    ChangeTarget {
        tenant: event.map(|_| "clinic-a".to_owned()),
        event: event.map(str::to_owned),
        file,
        execute,
        json: false,
        reason: "the clinic closed for the day".to_owned(),
    }
}

async fn setup(ledger: &Ledger) {
    run(
        ledger,
        Command::Tenant(TenantCommand::Create {
            name: "clinic-a".into(),
        }),
    )
    .await
    .0
    .unwrap();
    run(
        ledger,
        Command::Reminders(RemindersCommand::Load {
            file: input_file("load", REMINDERS),
            dry_run: false,
            json: false,
            reason: None,
        }),
    )
    .await
    .0
    .unwrap();
}

async fn audited(pool: &PgPool, action: &str) -> Vec<(String, Option<String>)> {
    sqlx::query_as("SELECT actor, reason FROM audit_log WHERE action = $1")
        .bind(action)
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_cancel_from_a_file_is_a_dry_run_until_executed_and_answers_each_line(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    setup(&ledger).await;
    let file = input_file(
        "cancel",
        "{\"tenant\": \"clinic-a\", \"event_id\": \"appt-1\"}\n\n{\"tenant\": \"clinic-a\", \"event_id\": \"nope\"}\n",
    );

    let (result, shown) = run(
        &ledger,
        Command::Reminders(RemindersCommand::Cancel {
            target: target(None, Some(file.clone()), false),
        }),
    )
    .await;
    assert!(result.is_err(), "a line was rejected: {shown}");
    assert!(
        shown.contains("line 1: clinic-a/appt-1 would_cancel"),
        "{shown}"
    );
    assert!(
        shown.contains("line 3: rejected: no event clinic-a/nope"),
        "{shown}"
    );
    let cancelled: i64 =
        sqlx::query_scalar("SELECT count(*) FROM reminders WHERE cancelled_at IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(cancelled, 0, "a dry run writes nothing");

    let (_, shown) = run(
        &ledger,
        Command::Reminders(RemindersCommand::Cancel {
            target: target(None, Some(file), true),
        }),
    )
    .await;
    assert!(
        shown.contains("line 1: clinic-a/appt-1 cancelled sms=cancelled"),
        "{shown}"
    );
    assert_eq!(
        audited(&pool, "reminder_cancel").await,
        vec![(
            "ops@clinic".to_owned(),
            Some("the clinic closed for the day".to_owned())
        )]
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reschedule_by_event_id_or_from_a_file_moves_the_reminder_under_a_new_revision(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    setup(&ledger).await;

    let (result, shown) = run(
        &ledger,
        Command::Reminders(RemindersCommand::Reschedule {
            target: target(Some("appt-2"), None, true),
            at: Some("2099-12-01T09:00:00Z".parse().unwrap()),
            expires_at: None,
            revision: None,
        }),
    )
    .await;
    result.unwrap();
    assert!(
        shown.contains("clinic-a/appt-2 rescheduled email=moved sms=moved"),
        "{shown}"
    );
    let (scheduled, expires, revision): (
        chrono::DateTime<chrono::Utc>,
        chrono::DateTime<chrono::Utc>,
        i64,
    ) = sqlx::query_as(
        "SELECT scheduled_at, expires_at, revision FROM reminders WHERE event_id = 'appt-2'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        scheduled,
        "2099-12-01T09:00:00Z"
            .parse::<chrono::DateTime<chrono::Utc>>()
            .unwrap()
    );
    assert_eq!(
        expires - scheduled,
        chrono::Duration::hours(1),
        "as long as it was"
    );
    assert_eq!(revision, 1, "the current one + 1");
    let content: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT content_ciphertext FROM reminders WHERE event_id = 'appt-2'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(content.is_some(), "its content is kept");

    let line = r#"{"tenant": "clinic-a", "event_id": "appt-1", "subscriber_ref": "patient-1", "channels": ["sms"], "scheduled_at": "2099-12-02T09:00:00Z", "expires_at": "2099-12-02T10:00:00Z", "destinations": {"sms": "+15550101"}, "revision": 5}"#;
    let (result, shown) = run(
        &ledger,
        Command::Reminders(RemindersCommand::Reschedule {
            target: target(None, Some(input_file("moves", &format!("{line}\n"))), true),
            at: None,
            expires_at: None,
            revision: None,
        }),
    )
    .await;
    result.unwrap();
    assert!(
        shown.contains("line 1: clinic-a/appt-1 rescheduled sms=moved"),
        "{shown}"
    );
    let history: Vec<(String, i64, String)> = sqlx::query_as(
        "SELECT r.event_id, h.revision, h.source FROM reminder_revisions h
         JOIN reminders r ON r.id = h.reminder_id ORDER BY r.event_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        history,
        vec![
            ("appt-1".to_owned(), 5, "nudgectl".to_owned()),
            ("appt-2".to_owned(), 1, "nudgectl".to_owned()),
        ]
    );
    assert_eq!(audited(&pool, "reminder_reschedule").await.len(), 2);

    // The trace shows each reschedule: when, by whom, the revision, from and to.
    let (result, shown) = run(
        &ledger,
        Command::Trace {
            id: "clinic-a/appt-1".parse().unwrap(),
            json: false,
        },
    )
    .await;
    result.unwrap();
    assert!(shown.contains("  revision 5\n"), "{shown}");
    assert!(
        shown.contains(
            "by nudgectl to revision 5: 2099-11-30T09:00:00.000Z -> 2099-12-02T09:00:00.000Z"
        ),
        "{shown}"
    );
}
