//! `nudgectl trace` and `nudgectl dlq`, through the binary, against a fresh database per test:
//! the JSON documents scripts read, the report operators read, and that neither ever holds a
//! destination, subscriber reference or message content.

// The helpers below are test code too: a failed unwrap is a failed test, with its location.
#![allow(clippy::unwrap_used)]

use std::process::Command as Process;
use std::time::Duration;

use chrono::{DateTime, DurationRound, Utc};
use nudge_domain::{
    AdmissionSettings, AttemptContext, Channel, DeliveryId, EventId, FixedJitter,
    IdempotencySupport, ProviderAccount, RetryPolicy, SendOutcome, SubscriberRef, decide,
};
use nudge_ledger::{
    AttemptRecord, Destination, DestinationCipher, LeaseBatch, LeaseOutcome, Ledger, LedgerTime,
    NewReminder, Operator, OutcomeToRecord, SubscriberKey, WorkerRoutes,
};
use sqlx::{ConnectOptions, PgPool};

/// What the reminder below was created with; none of it may be printed.
const SUBSCRIBER: &str = "patient-secret-4242";
const PHONE: &str = "+15550142";
const CONTENT: &str = "colonoscopy-prep";

fn cipher() -> DestinationCipher {
    DestinationCipher::new(&[7u8; 32]).with_subscriber_key(SubscriberKey::new(&[8u8; 32]))
}

fn response(status: u16, retry_after: Option<&str>) -> SendOutcome {
    SendOutcome::Response {
        status,
        retry_after: retry_after.map(str::to_owned),
        provider_message_id: None,
    }
}

/// Claims the one sms delivery due at `at`, leases it as `worker-1`, and records `outcome`
/// one second later.
async fn send_once(ledger: &Ledger, at: DateTime<Utc>, outcome: SendOutcome) -> DeliveryId {
    let due = ledger
        .claim_due(Channel::Sms, 10, LedgerTime::Fixed(at))
        .await
        .unwrap()
        .remove(0);
    let main = ProviderAccount::parse("main").unwrap();
    let routes = WorkerRoutes {
        default: main.clone(),
        accounts: vec![(main, IdempotencySupport::Honoured)],
    };
    let admission = AdmissionSettings::default();
    let cipher = cipher();
    let batch = LeaseBatch {
        channel: Channel::Sms,
        lease_holder: "worker-1",
        lease_for: Duration::from_secs(60),
        routes: &routes,
        account_recheck: Duration::from_secs(30),
        admission: &admission,
        cipher: &cipher,
        at: LedgerTime::Fixed(at),
    };
    let LeaseOutcome::Leased { lease, .. } = ledger
        .lease_batch(&batch, &[due.message_pointer()])
        .await
        .unwrap()
        .outcomes
        .remove(0)
    else {
        panic!("expected a lease");
    };
    let facts = AttemptRecord {
        started_at: at,
        finished_at: at + chrono::Duration::seconds(1),
        worker: "worker-1".into(),
        correlation_id: None,
    };
    let decision = decide(
        &AttemptContext {
            attempt_number: lease.attempt_number,
            expires_at: lease.expires_at,
            idempotency: IdempotencySupport::Honoured,
        },
        &outcome,
        facts.finished_at,
        &RetryPolicy::default(),
        &mut FixedJitter::zero(),
    );
    ledger
        .record_outcomes(
            &[OutcomeToRecord {
                lease: &lease,
                decision: &decision,
                attempt: &facts,
            }],
            std::time::Duration::from_secs(60),
            LedgerTime::Fixed(facts.finished_at),
        )
        .await
        .unwrap();
    due.id
}

/// A reminder (with a destination and content) scheduled two hours ago: a 429 with
/// `Retry-After: 30`, then a 400 that dead-letters it.
async fn dead_lettered_after_a_throttle(ledger: &Ledger) -> DeliveryId {
    let scheduled = Utc::now()
        .duration_trunc(chrono::Duration::seconds(1))
        .unwrap()
        - chrono::Duration::hours(2);
    let operator = Operator::new("ops@clinic", Some("test"), scheduled).unwrap();
    let tenant = ledger.create_tenant("clinic-a", &operator).await.unwrap();
    let reminder = NewReminder::new(
        tenant.id,
        EventId::parse("appt/2026/42").unwrap(),
        SubscriberRef::parse(SUBSCRIBER).unwrap(),
        &[Channel::Sms],
        scheduled,
        scheduled + chrono::Duration::days(1),
    )
    .unwrap()
    .with_content(format!(r#"{{"template": "{CONTENT}"}}"#).into_bytes())
    .unwrap();
    let created = ledger
        .import_reminder(
            &reminder,
            &[(Channel::Sms, Destination::new(PHONE))],
            &cipher(),
            scheduled - chrono::Duration::minutes(5),
        )
        .await
        .unwrap();
    ledger
        .materialise_reminder(tenant.id, created.id, scheduled)
        .await
        .unwrap();
    let id = send_once(ledger, scheduled, response(429, Some("30"))).await;
    send_once(
        ledger,
        scheduled + chrono::Duration::seconds(31),
        response(400, None),
    )
    .await;
    id
}

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn nudgectl(pool: &PgPool, args: &[&str]) -> Run {
    let out = Process::new(env!("CARGO_BIN_EXE_nudgectl"))
        .args(args)
        .env(
            "NUDGE_DATABASE__URL",
            pool.connect_options().to_url_lossy().to_string(),
        )
        .env_remove("NUDGE_CONFIG")
        .output()
        .unwrap();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

fn assert_nothing_sensitive(run: &Run) {
    for secret in [SUBSCRIBER, PHONE, CONTENT] {
        assert!(
            !run.stdout.contains(secret) && !run.stderr.contains(secret),
            "{secret} was printed:\n{}{}",
            run.stdout,
            run.stderr
        );
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn trace_json_shows_each_attempt_and_never_the_destination_or_subscriber(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let id = dead_lettered_after_a_throttle(&ledger).await;

    let run = nudgectl(&pool, &["trace", "clinic-a/appt/2026/42", "--json"]);

    assert_eq!(run.code, Some(0), "{}{}", run.stdout, run.stderr);
    assert_nothing_sensitive(&run);
    let doc: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(doc["matched_as"], "event");
    assert_eq!(doc["reminder"]["event_id"], "appt/2026/42");
    let delivery = &doc["deliveries"][0];
    assert_eq!(delivery["id"], id.to_string());
    assert_eq!(delivery["state"], "dead_lettered");
    assert_eq!(delivery["last_error_reason"], "http_400");
    assert_eq!(delivery["attempt_count"], 2);
    let attempts = delivery["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0]["http_status"], 429);
    assert_eq!(attempts[0]["retry_after_seen"], "30");
    assert_eq!(attempts[0]["delay_chosen_ms"], 30_000);
    assert_eq!(attempts[0]["worker"], "worker-1");
    assert_eq!(attempts[0]["provider_account"], "main");
    assert_eq!(delivery["findings"]["throttled_attempts"], 1);
    assert_eq!(delivery["findings"]["scheduling_delay_ms"], 0);
    assert_eq!(
        delivery["findings"]["leased_before_eligible"],
        serde_json::json!([])
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn trace_prints_a_report_and_an_unknown_id_fails_naming_what_was_tried(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let id = dead_lettered_after_a_throttle(&ledger).await;
    let nobody = DeliveryId::new().to_string();

    let report = nudgectl(&pool, &["trace", &id.to_string()]);
    let unknown = nudgectl(&pool, &["trace", &nobody]);
    let no_event = nudgectl(&pool, &["trace", "clinic-a/appt-0"]);
    let malformed = nudgectl(&pool, &["trace", "appt-0"]);

    assert_eq!(report.code, Some(0), "{}{}", report.stdout, report.stderr);
    assert_nothing_sensitive(&report);
    for expected in [
        "(matched as delivery id)",
        "state           dead_lettered",
        "attempts        2 (base 0: 2 count toward the retry limit)",
        "provider throttling 1 attempt answered 429",
        "early leases        none",
    ] {
        assert!(
            report.stdout.contains(expected),
            "{expected}:\n{}",
            report.stdout
        );
    }
    assert_eq!(unknown.code, Some(1));
    assert!(
        unknown
            .stderr
            .contains("tried it as a delivery id, then as a reminder id"),
        "{}",
        unknown.stderr
    );
    assert_eq!(no_event.code, Some(1));
    assert!(
        no_event.stderr.contains("no reminder with event id"),
        "{}",
        no_event.stderr
    );
    assert_ne!(malformed.code, Some(0));
    assert!(
        malformed.stderr.contains("TENANT/EVENT_ID"),
        "{}",
        malformed.stderr
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn dlq_list_json_counts_the_dead_lettered_delivery_by_reason_and_age(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let id = dead_lettered_after_a_throttle(&ledger).await;

    let list = nudgectl(&pool, &["dlq", "list", "--json"]);
    let email = nudgectl(&pool, &["dlq", "list", "--channel", "email", "--json"]);
    let table = nudgectl(&pool, &["dlq", "list"]);
    let show = nudgectl(&pool, &["dlq", "show", &id.to_string(), "--json"]);

    assert_eq!(list.code, Some(0), "{}{}", list.stdout, list.stderr);
    for run in [&list, &email, &table, &show] {
        assert_nothing_sensitive(run);
    }
    let doc: serde_json::Value = serde_json::from_str(&list.stdout).unwrap();
    assert_eq!(
        doc["deliveries"],
        serde_json::json!([{
            "channel": "sms",
            "state": "dead_lettered",
            "reason": "http_400",
            "count": 1,
            "by_age": {"1h-6h": 1},
            "redrive_pending": 0,
            "sample_ids": [id.to_string()],
        }])
    );
    assert_eq!(doc["dead_letters"], serde_json::json!([]));
    let email: serde_json::Value = serde_json::from_str(&email.stdout).unwrap();
    assert_eq!(email["deliveries"], serde_json::json!([]));
    assert!(table.stdout.contains("http_400"), "{}", table.stdout);
    let show: serde_json::Value = serde_json::from_str(&show.stdout).unwrap();
    assert_eq!(show["matched_as"], "delivery");
    assert_eq!(
        show["deliveries"][0]["attempts"].as_array().unwrap().len(),
        2
    );
}
