//! Retention on a real ledger: every delivery state at every age (held and due-soon included),
//! the plan's counts against the rows really deleted, every row that should stay compared byte
//! for byte, and the janitor's role unable to delete anything by hand.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use nudge_ledger::test_support;

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Duration, DurationRound, Utc};
use nudge_domain::{DeliveryState, RetentionDays, RetentionPolicy};
use nudge_ledger::{
    KeepReason, Ledger, LedgerTime, RetentionBatch, RetentionTable, RunEnd, RunState,
};
use sqlx::PgPool;
use uuid::Uuid;

fn policy() -> RetentionPolicy {
    RetentionPolicy::new(RetentionDays {
        delivered: 30,
        expired: 30,
        cancelled: 30,
        dead_lettered: 90,
        reminders: 90,
        contacts: 90,
        events: 30,
        events_unacknowledged: 90,
        audit: 400,
    })
    .unwrap()
}

fn boundary_days(state: DeliveryState) -> Option<i64> {
    match state {
        // A suppressed delivery is kept as long as a cancelled one.
        DeliveryState::Delivered
        | DeliveryState::Expired
        | DeliveryState::Cancelled
        | DeliveryState::Suppressed => Some(30),
        DeliveryState::DeadLettered => Some(90),
        _ => None,
    }
}

/// Every table retention touches, each row as `(primary key, row as jsonb text)`.
async fn snapshot(pool: &PgPool) -> BTreeMap<&'static str, BTreeMap<String, String>> {
    let tables = [
        ("deliveries", "id::text"),
        ("attempts", "id::text"),
        ("dead_letters", "id::text"),
        ("redrive_items", "redrive_id || ':' || position"),
        ("redrives", "id::text"),
        ("reminders", "id::text"),
        (
            "contacts",
            "tenant_id || ':' || subscriber_ref || ':' || channel",
        ),
        ("audit_log", "id::text"),
        ("consent_history", "id::text"),
        ("delivery_events", "id::text"),
        ("tenants", "id::text"),
    ];
    let mut all = BTreeMap::new();
    for (table, key) in tables {
        let rows: Vec<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {key}, to_jsonb(t)::text FROM {table} t"
        )))
        .fetch_all(pool)
        .await
        .unwrap();
        all.insert(table, rows.into_iter().collect());
    }
    all
}

struct Seeded {
    /// Ids of the deliveries the policy lets go, decided here from the states and ages alone.
    deliveries_to_go: BTreeSet<Uuid>,
    reminders_to_go: BTreeSet<Uuid>,
    ambiguous: Uuid,
    live: Uuid,
}

/// One delivery (with its own reminder and contact) in `state`, `age` old: settled `age` ago
/// for settled and held states, scheduled `age` ago for owed ones (a negative age is due
/// soon). Returns (delivery, reminder).
#[allow(clippy::too_many_arguments)]
async fn delivery(
    pool: &PgPool,
    tenant: Uuid,
    n: usize,
    state: DeliveryState,
    now: DateTime<Utc>,
    age: Duration,
    owner: &str,
) -> (Uuid, Uuid) {
    let (reminder, id) = (Uuid::new_v4(), Uuid::new_v4());
    let settled = matches!(
        state,
        DeliveryState::Delivered
            | DeliveryState::DeadLettered
            | DeliveryState::Expired
            | DeliveryState::Cancelled
            | DeliveryState::Suppressed
            | DeliveryState::Ambiguous
    );
    let scheduled_at = if settled {
        now - age - Duration::hours(1)
    } else {
        now - age
    };
    let subscriber = format!("subscriber-{n}");
    sqlx::query(
        "INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels, scheduled_at,
             expires_at, created_at)
         VALUES ($1, $2, $3, $4, ARRAY['sms'], $5, $5 + interval '1 hour', $5)",
    )
    .bind(reminder)
    .bind(tenant)
    .bind(format!("event-{n}"))
    .bind(&subscriber)
    .bind(scheduled_at)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO contacts (tenant_id, subscriber_ref, channel, destination_ciphertext, updated_at)
         VALUES ($1, $2, 'sms', decode(repeat('ab', 40), 'hex'), $3)",
    )
    .bind(tenant)
    .bind(&subscriber)
    .bind(scheduled_at)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
             attempt_count, scheduled_at, expires_at, next_attempt_at, lease_owner,
             lease_expires_at, settled_at, created_at, updated_at, owner)
         VALUES ($1, $2, $3, 'sms', $4, 'nudge-' || $2::text || '-sms', $5, $6, $6 + interval '1 hour',
             CASE WHEN $4 IN ('scheduled', 'queued', 'retry_wait') THEN $6 END,
             CASE WHEN $4 = 'sending' THEN 'worker-1' END,
             CASE WHEN $4 = 'sending' THEN $8 + interval '1 minute' END,
             $7, $6, COALESCE($7, $6), $9)",
    )
    .bind(id)
    .bind(reminder)
    .bind(tenant)
    .bind(state.as_str())
    .bind(i32::from(state != DeliveryState::Scheduled))
    .bind(scheduled_at)
    .bind(settled.then(|| now - age))
    .bind(now)
    .bind(owner)
    .execute(pool)
    .await
    .unwrap();
    if state != DeliveryState::Scheduled {
        let class = match state {
            DeliveryState::Delivered => "delivered",
            DeliveryState::Ambiguous => "ambiguous",
            DeliveryState::DeadLettered => "terminal",
            _ => "retryable",
        };
        sqlx::query(
            "INSERT INTO attempts (delivery_id, attempt_number, generation, lane, started_at,
                 finished_at, outcome_class, next_state)
             VALUES ($1, 1, 1, 'new', $2, $2, $3, $4)",
        )
        .bind(id)
        .bind(scheduled_at)
        .bind(class)
        .bind(state.as_str())
        .execute(pool)
        .await
        .unwrap();
    }
    if state == DeliveryState::DeadLettered {
        dead_letter(pool, Some(id), now - age).await;
    }
    (id, reminder)
}

async fn dead_letter(pool: &PgPool, delivery: Option<Uuid>, at: DateTime<Utc>) {
    sqlx::query(
        "INSERT INTO dead_letters (queue, channel, death_reason, delivery_id, payload,
             payload_size, action, recorded_at)
         VALUES ('dead.sms', 'sms', 'rejected', $1, '\\x00', 1, 'recorded', $2)",
    )
    .bind(delivery)
    .bind(at)
    .execute(pool)
    .await
    .unwrap();
}

async fn redrive(pool: &PgPool, state: &str, finished: Option<DateTime<Utc>>, item: Uuid) {
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO redrives (channel, rate_per_second, state, selected, fed_until,
             running_since, actor, reason, created_at, updated_at, finished_at)
         VALUES ('sms', 1, $1, 1, $2, $2, 'ops', 'test', $2, $2, $3) RETURNING id",
    )
    .bind(state)
    .bind(finished.unwrap_or_else(Utc::now) - Duration::days(1))
    .bind(finished)
    .fetch_one(pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO redrive_items (redrive_id, position, delivery_id) VALUES ($1, 1, $2)")
        .bind(id)
        .bind(item)
        .execute(pool)
        .await
        .unwrap();
}

/// Every state at every age around its boundary, plus the cases that keep a settled row
/// (an active redrive, another owner), dead letters with and without a delivery, and audit
/// rows on both sides of the audit boundary.
async fn seed(ledger: &Ledger, now: DateTime<Utc>) -> Seeded {
    let pool = ledger.pool();
    let tenant = test_support::tenant(ledger).await.id.as_uuid();
    let mut seeded = Seeded {
        deliveries_to_go: BTreeSet::new(),
        reminders_to_go: BTreeSet::new(),
        ambiguous: Uuid::nil(),
        live: Uuid::nil(),
    };
    let mut n = 0;
    for state in DeliveryState::ALL {
        let mut ages = vec![
            Duration::minutes(-10),
            Duration::minutes(30),
            Duration::days(2),
            Duration::days(29),
            Duration::days(30),
            Duration::days(31),
            Duration::days(89) + Duration::hours(23),
            Duration::days(90),
            Duration::days(120),
            Duration::days(400),
        ];
        if boundary_days(state).is_some() {
            ages.retain(|a| *a >= Duration::zero());
        }
        for age in ages {
            n += 1;
            let (id, reminder) = delivery(pool, tenant, n, state, now, age, "nudge").await;
            if let Some(days) = boundary_days(state)
                && age >= Duration::days(days)
            {
                seeded.deliveries_to_go.insert(id);
                // Its reminder expired an hour after it was scheduled, an hour before it
                // settled: it goes with it once that is 90 days ago.
                if age >= Duration::days(90) {
                    seeded.reminders_to_go.insert(reminder);
                }
            }
            if state == DeliveryState::Ambiguous && age == Duration::days(400) {
                seeded.ambiguous = id;
            }
            if state == DeliveryState::RetryWait && age == Duration::days(400) {
                seeded.live = id;
            }
        }
    }
    // Settled long ago but kept: waiting in a paused redrive, or under another owner.
    n += 1;
    let (waiting, _) = delivery(
        pool,
        tenant,
        n,
        DeliveryState::DeadLettered,
        now,
        Duration::days(400),
        "nudge",
    )
    .await;
    redrive(pool, "paused", None, waiting).await;
    n += 1;
    delivery(
        pool,
        tenant,
        n,
        DeliveryState::Delivered,
        now,
        Duration::days(400),
        "legacy",
    )
    .await;
    // A finished redrive's item is history that goes with its delivery, and then the redrive
    // row itself on the audit boundary.
    n += 1;
    let (redriven, reminder) = delivery(
        pool,
        tenant,
        n,
        DeliveryState::DeadLettered,
        now,
        Duration::days(400),
        "nudge",
    )
    .await;
    redrive(pool, "finished", Some(now - Duration::days(500)), redriven).await;
    seeded.deliveries_to_go.insert(redriven);
    seeded.reminders_to_go.insert(reminder);
    // Dead letters that point at no delivery: old, young, and at a delivery that never was.
    dead_letter(pool, None, now - Duration::days(400)).await;
    dead_letter(pool, None, now - Duration::days(1)).await;
    dead_letter(pool, Some(Uuid::new_v4()), now - Duration::days(100)).await;
    // Audit rows, and consent history entries (a destination's and a preference's), on both
    // sides of the audit boundary (400 days).
    for days in [500, 401, 399, 10] {
        sqlx::query("INSERT INTO audit_log (at, actor, action) VALUES ($1, 'ops', 'test')")
            .bind(now - Duration::days(days))
            .execute(pool)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO consent_history (tenant_id, channel, destination_digest, state, source,
                                          actor, recorded_at)
             VALUES ($1, 'sms', sha256($2::text::bytea), 'opted_out', 'inbound_keyword',
                     'inbound:main', $3)",
        )
        .bind(tenant)
        .bind(days.to_string())
        .bind(now - Duration::days(days))
        .execute(pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO consent_history (tenant_id, channel, subject, category, state, source,
                                          actor, recorded_at)
             VALUES ($1, 'email', gen_random_uuid(), 'billing', 'opted_out', 'api', 'api:x', $2)",
        )
        .bind(tenant)
        .bind(now - Duration::days(days))
        .execute(pool)
        .await
        .unwrap();
    }
    // A patient's STOP, 500 days old: the replay guard of its message, kept.
    sqlx::query(
        "INSERT INTO consent_history (tenant_id, channel, destination_digest, state, source,
                                      actor, keyword, provider_event, recorded_at)
         VALUES ($1, 'sms', sha256('guard'::bytea), 'opted_out', 'inbound_keyword',
                 'inbound:main', 'STOP', 'twilio:SMold', $2)",
    )
    .bind(tenant)
    .bind(now - Duration::days(500))
    .execute(pool)
    .await
    .unwrap();
    // Delivery events (the deliveries above wrote theirs just now: too young). A second tenant
    // has a webhook that acknowledged through position 1,000,002; the first has none. Events
    // go past 30 days when acknowledged or without a webhook, past 90 days in any case, and
    // one not yet numbered never goes: 4 go, 2 stay unacknowledged, 1 too young.
    let pushed = ledger
        .create_tenant("clinic-pushed", &test_support::ops(now))
        .await
        .unwrap()
        .id
        .as_uuid();
    sqlx::query(
        "INSERT INTO tenant_webhooks (tenant_id, url, acked_position)
         VALUES ($1, 'https://clinic.example/events', 1000002)",
    )
    .bind(pushed)
    .execute(pool)
    .await
    .unwrap();
    for (owner, position, days) in [
        (pushed, Some(1_000_001_i64), 40),
        (pushed, Some(1_000_002), 40),
        (pushed, Some(1_000_003), 40),
        (pushed, Some(1_000_004), 100),
        (pushed, None, 100),
        (tenant, Some(1_000_005), 40),
        (tenant, Some(1_000_006), 10),
    ] {
        sqlx::query(
            "INSERT INTO delivery_events (tenant_id, delivery_id, reminder_id, event_id, channel,
                 delivery_seq, kind, state, lane, attempt_count, occurred_at, position)
             VALUES ($1, gen_random_uuid(), gen_random_uuid(), 'appt-old', 'sms', 1, 'sent',
                     'delivered', 'new', 1, $2, $3)",
        )
        .bind(owner)
        .bind(now - Duration::days(days))
        .bind(position)
        .execute(pool)
        .await
        .unwrap();
    }
    seeded
}

/// The database's clock, to the microsecond PostgreSQL keeps.
async fn db_now(ledger: &Ledger) -> DateTime<Utc> {
    ledger
        .clock(LedgerTime::Database)
        .await
        .unwrap()
        .duration_trunc(Duration::microseconds(1))
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn every_state_at_every_age_the_plan_is_what_is_deleted_and_the_rest_is_untouched(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let now = db_now(&ledger).await;
    let seeded = seed(&ledger, now).await;
    let before = snapshot(&pool).await;

    let plan = ledger
        .plan_retention(&policy(), LedgerTime::Fixed(now))
        .await
        .unwrap();
    let run = ledger
        .begin_retention_run(&policy(), "test", LedgerTime::Fixed(now))
        .await
        .unwrap();
    assert_eq!(run.plan, plan, "a run counts exactly what the plan shows");
    let planned = plan.to_delete();
    assert_eq!(
        planned[&RetentionTable::Deliveries],
        seeded.deliveries_to_go.len() as u64
    );
    assert_eq!(
        plan.tables[&RetentionTable::Deliveries].kept[&KeepReason::AwaitingRedrive],
        1
    );
    assert_eq!(
        plan.tables[&RetentionTable::Deliveries].kept[&KeepReason::OwnershipUncertain],
        1
    );
    assert_eq!(
        plan.tables[&RetentionTable::ConsentHistory].kept[&KeepReason::ReplayGuard],
        1,
        "a patient's STOP of 500 days ago stays: its message's replay guard"
    );

    // The webhook catches up while the run deletes: the run deletes what it counted, by the
    // acknowledged position it read then, and no more.
    sqlx::query("UPDATE tenant_webhooks SET acked_position = 1000004")
        .execute(&pool)
        .await
        .unwrap();

    let mut exported = Vec::new();
    let mut batches = 0;
    loop {
        let batch = ledger
            .retention_batch(run.id, 7, &mut |rows| {
                exported.extend(rows.iter().map(|r| r.delivery_id));
                Ok(())
            })
            .await
            .unwrap();
        batches += 1;
        if batch == RetentionBatch::Done {
            break;
        }
        assert!(batches < 100, "retention did not finish");
    }
    let summary = ledger
        .finish_retention_run(run, RunEnd::Completed)
        .await
        .unwrap();
    assert_eq!(summary.state, RunState::Finished, "{summary:?}");
    assert_eq!(summary.deleted, planned);

    let after = snapshot(&pool).await;
    let table_of = |t: RetentionTable| match t {
        RetentionTable::Deliveries => "deliveries",
        RetentionTable::Attempts => "attempts",
        RetentionTable::DeadLetters => "dead_letters",
        RetentionTable::RedriveItems => "redrive_items",
        RetentionTable::Reminders => "reminders",
        RetentionTable::Contacts => "contacts",
        RetentionTable::AuditLog => "audit_log",
        RetentionTable::Redrives => "redrives",
        RetentionTable::ConsentHistory => "consent_history",
        RetentionTable::DeliveryEvents => "delivery_events",
    };
    for table in RetentionTable::ALL {
        let name = table_of(table);
        let (was, is) = (&before[name], &after[name]);
        let gone = was.keys().filter(|k| !is.contains_key(*k)).count() as u64;
        assert_eq!(gone, planned[&table], "{name}: rows deleted vs planned");
        for (key, row) in is {
            assert_eq!(was.get(key), Some(row), "{name} {key} changed or appeared");
        }
    }
    assert_eq!(before["tenants"], after["tenants"]);

    let gone: BTreeSet<Uuid> = before["deliveries"]
        .keys()
        .filter(|k| !after["deliveries"].contains_key(*k))
        .map(|k| k.parse().unwrap())
        .collect();
    assert_eq!(
        gone, seeded.deliveries_to_go,
        "exactly the settled rows past their boundary"
    );
    assert_eq!(
        exported.iter().copied().collect::<BTreeSet<_>>(),
        gone,
        "every deleted delivery was handed to the export before it committed"
    );
    let reminders_gone: BTreeSet<Uuid> = before["reminders"]
        .keys()
        .filter(|k| !after["reminders"].contains_key(*k))
        .map(|k| k.parse().unwrap())
        .collect();
    assert_eq!(reminders_gone, seeded.reminders_to_go);
    assert_eq!(
        planned[&RetentionTable::AuditLog],
        2,
        "500 and 401 days old"
    );
    assert_eq!(
        planned[&RetentionTable::ConsentHistory],
        4,
        "a destination's and a preference's entry each, 500 and 401 days old"
    );
    assert_eq!(
        planned[&RetentionTable::DeliveryEvents],
        4,
        "acknowledged or without a webhook past 30 days, unacknowledged past 90"
    );
    assert_eq!(
        plan.tables[&RetentionTable::DeliveryEvents].kept[&KeepReason::Unacknowledged],
        2,
        "not acknowledged, 40 days old; not yet numbered, 100 days old"
    );
    assert_eq!(planned[&RetentionTable::Redrives], 1);
    assert_eq!(planned[&RetentionTable::RedriveItems], 1);
    assert!(after["deliveries"].contains_key(&seeded.ambiguous.to_string()));
    assert!(after["deliveries"].contains_key(&seeded.live.to_string()));

    // A second run finds nothing more at the same instant.
    let again = ledger
        .plan_retention(&policy(), LedgerTime::Fixed(now))
        .await
        .unwrap();
    let left = again.to_delete();
    assert_eq!(
        left[&RetentionTable::DeliveryEvents],
        1,
        "the event acknowledged during the run is the next run's"
    );
    assert!(
        left.iter()
            .all(|(t, n)| *n == 0 || *t == RetentionTable::DeliveryEvents),
        "{again:?}"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_export_that_fails_rolls_its_batch_back(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let now = db_now(&ledger).await;
    let tenant = test_support::tenant(&ledger).await.id.as_uuid();
    let (id, _) = delivery(
        &pool,
        tenant,
        1,
        DeliveryState::Delivered,
        now,
        Duration::days(100),
        "nudge",
    )
    .await;
    let run = ledger
        .begin_retention_run(&policy(), "test", LedgerTime::Fixed(now))
        .await
        .unwrap();
    let failed = ledger
        .retention_batch(run.id, 10, &mut |_| Err(std::io::Error::other("disk full")))
        .await;
    assert!(matches!(failed, Err(nudge_ledger::LedgerError::Export(_))));
    let still: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE id = $1")
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(still, 1);
    let summary = ledger
        .finish_retention_run(run, RunEnd::Stopped("export failed".into()))
        .await
        .unwrap();
    assert_eq!(summary.state, RunState::Stopped);
}

/// Runs `sql` as the janitor's role on its own connection; returns the SQLSTATE it failed
/// with, or `None` when it succeeded.
async fn as_janitor(pool: &PgPool, sql: &str) -> Option<String> {
    test_support::as_role(pool, "nudge_janitor", sql).await
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_janitor_role_cannot_delete_live_or_held_work_by_any_path(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let now = db_now(&ledger).await;
    let tenant = test_support::tenant(&ledger).await.id.as_uuid();
    let (live, live_reminder) = delivery(
        &pool,
        tenant,
        1,
        DeliveryState::RetryWait,
        now,
        Duration::days(400),
        "nudge",
    )
    .await;
    let (held, _) = delivery(
        &pool,
        tenant,
        2,
        DeliveryState::Ambiguous,
        now,
        Duration::days(400),
        "nudge",
    )
    .await;
    sqlx::query("INSERT INTO audit_log (at, actor, action) VALUES ($1, 'ops', 'test')")
        .bind(now - Duration::days(10))
        .execute(&pool)
        .await
        .unwrap();
    let before = snapshot(&pool).await;

    let denied = "42501"; // insufficient_privilege
    for sql in [
        format!("DELETE FROM deliveries WHERE id = '{live}'"),
        format!("DELETE FROM deliveries WHERE id = '{held}'"),
        "DELETE FROM deliveries".to_owned(),
        format!("DELETE FROM reminders WHERE id = '{live_reminder}'"),
        format!("DELETE FROM tenants WHERE id = '{tenant}'"),
        "TRUNCATE deliveries".to_owned(),
        "TRUNCATE tenants CASCADE".to_owned(),
        "TRUNCATE reminders CASCADE".to_owned(),
        "BEGIN; SET LOCAL nudge.retention = 'on'; DELETE FROM attempts; COMMIT".to_owned(),
        "BEGIN; SET LOCAL nudge.retention = 'audit'; SET LOCAL nudge.audit_before = '2999-01-01';
         DELETE FROM audit_log; COMMIT"
            .to_owned(),
        "BEGIN; SET LOCAL nudge.retention = 'audit'; SET LOCAL nudge.audit_before = '2999-01-01';
         DELETE FROM consent_history; COMMIT"
            .to_owned(),
        // Aging live work into retention by rewriting it is refused too.
        format!(
            "UPDATE deliveries SET state = 'delivered', next_attempt_at = NULL,
                 settled_at = now() - interval '400 days' WHERE id = '{live}'"
        ),
        // Nor turning held work, settled long ago, into terminal work.
        format!("UPDATE deliveries SET state = 'delivered' WHERE id = '{held}'"),
        // A run's policy cannot be changed once recorded.
        "UPDATE retention_runs SET delivered_s = 0".to_owned(),
    ] {
        let code = as_janitor(&pool, &sql).await;
        assert_eq!(code.as_deref(), Some(denied), "{sql}");
    }
    // A run recorded with a policy below the floors is refused by the table.
    let floor = as_janitor(
        &pool,
        "INSERT INTO retention_runs (started_at, runner, delivered_s, expired_s, cancelled_s,
             dead_lettered_s, reminders_s, contacts_s, audit_s, planned)
         VALUES (now(), 'x', 0, 0, 0, 0, 0, 0, 0, '{}')",
    )
    .await;
    assert_eq!(floor.as_deref(), Some("23514"), "check_violation");
    // The deletion function, through a run dated in the future with the floors as its
    // policy, still takes nothing that is owed, held or younger than the floor.
    let through_function = as_janitor(
        &pool,
        "WITH run AS (
             INSERT INTO retention_runs (started_at, runner, delivered_s, expired_s, cancelled_s,
                 dead_lettered_s, reminders_s, contacts_s, audit_s, planned)
             VALUES (now() + interval '100 years', 'x', 604800, 604800, 604800, 604800,
                 604800, 604800, 31536000,
                 '{\"deliveries\": 100, \"attempts\": 100, \"reminders\": 100}')
             RETURNING id)
         SELECT nudge_retention_delete_deliveries(run.id, 100) FROM run",
    )
    .await;
    assert_eq!(through_function, None);
    let after = snapshot(&pool).await;
    assert_eq!(before, after, "nothing deleted or changed");

    // The table owner's own retention transaction for deliveries opens attempts, never the
    // audit log.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL nudge.retention = 'on'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let audit = sqlx::query("DELETE FROM audit_log").execute(&mut *tx).await;
    assert!(
        audit.is_err(),
        "audit rows are outside a delivery retention step"
    );
    drop(tx);
    // Nor an audit step the owner sets up itself: never an entry younger than 365 days.
    sqlx::query(
        "INSERT INTO consent_history (tenant_id, channel, destination_digest, state, source,
                                      actor, recorded_at)
         VALUES ($1, 'sms', sha256('x'::bytea), 'opted_out', 'operator', 'ops', now())",
    )
    .bind(tenant)
    .execute(&pool)
    .await
    .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL nudge.retention = 'audit'")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("SET LOCAL nudge.audit_before = '2999-01-01'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let young = sqlx::query("DELETE FROM consent_history")
        .execute(&mut *tx)
        .await;
    assert!(
        young.is_err_and(|e| e.to_string().contains("consent is never removed")),
        "a young consent entry is kept"
    );
    drop(tx);
    // Nor, in the same step, a patient's STOP of 500 days ago: its message's replay guard.
    sqlx::query(
        "INSERT INTO consent_history (tenant_id, channel, destination_digest, state, source,
                                      actor, keyword, provider_event, recorded_at)
         VALUES ($1, 'sms', sha256('y'::bytea), 'opted_out', 'inbound_keyword', 'inbound:x',
                 'STOP', 'twilio:SMguard', now() - interval '500 days')",
    )
    .bind(tenant)
    .execute(&pool)
    .await
    .unwrap();
    let mut tx = pool.begin().await.unwrap();
    for setting in [
        "SET LOCAL nudge.retention = 'audit'",
        "SET LOCAL nudge.audit_before = '2999-01-01'",
    ] {
        sqlx::query(setting).execute(&mut *tx).await.unwrap();
    }
    let guard = sqlx::query("DELETE FROM consent_history WHERE provider_event IS NOT NULL")
        .execute(&mut *tx)
        .await;
    assert!(
        guard.is_err_and(|e| e.to_string().contains("consent is never removed")),
        "a replay guard is kept"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reminder_with_two_settled_deliveries_goes_with_the_last_of_them(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let now = db_now(&ledger).await;
    let tenant = test_support::tenant(&ledger).await.id.as_uuid();
    let (sms, reminder) = delivery(
        &pool,
        tenant,
        1,
        DeliveryState::Delivered,
        now,
        Duration::days(100),
        "nudge",
    )
    .await;
    // A second channel of the same reminder, settled a day later.
    sqlx::query("UPDATE reminders SET channels = ARRAY['sms', 'email'] WHERE id = $1")
        .bind(reminder)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
             scheduled_at, expires_at, settled_at, created_at, updated_at)
         SELECT gen_random_uuid(), reminder_id, tenant_id, 'email', 'delivered',
             'nudge-' || reminder_id::text || '-email', scheduled_at, expires_at,
             settled_at + interval '1 day', created_at, updated_at
         FROM deliveries WHERE id = $1",
    )
    .bind(sms)
    .execute(&pool)
    .await
    .unwrap();

    let run = ledger
        .begin_retention_run(&policy(), "test", LedgerTime::Fixed(now))
        .await
        .unwrap();
    assert_eq!(run.plan.to_delete()[&RetentionTable::Reminders], 1);
    let first = ledger
        .retention_batch(run.id, 1, &mut |_| Ok(()))
        .await
        .unwrap();
    assert!(matches!(first, RetentionBatch::Deliveries(ref d) if d.len() == 1));
    let reminders: i64 = sqlx::query_scalar("SELECT count(*) FROM reminders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(reminders, 1, "kept while its other delivery is still there");
    while ledger
        .retention_batch(run.id, 1, &mut |_| Ok(()))
        .await
        .unwrap()
        != RetentionBatch::Done
    {}
    let summary = ledger
        .finish_retention_run(run, RunEnd::Completed)
        .await
        .unwrap();
    assert_eq!(summary.state, RunState::Finished, "{summary:?}");
    assert_eq!(summary.deleted[&RetentionTable::Reminders], 1);
    assert_eq!(summary.deleted[&RetentionTable::Deliveries], 2);
}
