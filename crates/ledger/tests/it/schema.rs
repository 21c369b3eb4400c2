#![allow(clippy::unwrap_used, clippy::expect_used)]

use nudge_domain::{Channel, DeliveryState, Lane, OutcomeClass, SubscriberRef};
use nudge_ledger::test_support::*;
use nudge_ledger::{AuditEntry, Destination, DestinationCipher, LeaseOutcome, Ledger, LedgerError};
use sqlx::PgPool;

/// Inserts a bare delivery row in the given state, satisfying the other constraints, under a
/// reminder of its own; returns the delivery's id.
async fn insert_in_state(
    pool: &PgPool,
    ledger: &Ledger,
    state: &str,
    n: usize,
) -> Result<uuid::Uuid, sqlx::Error> {
    let tenant = ledger.create_tenant("schema", &ops(t0())).await.unwrap();
    // A bare reminder: its deliveries are the rows under test, not materialised ones.
    let reminder: uuid::Uuid = sqlx::query_scalar(
        "INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels, scheduled_at,
             expires_at, created_at)
         VALUES (gen_random_uuid(), $1, $2, 'p', ARRAY['sms'], $3, $3 + interval '1 hour', $3)
         RETURNING id",
    )
    .bind(tenant.id.as_uuid())
    .bind(format!("schema-{n}"))
    .bind(t0())
    .fetch_one(pool)
    .await?;
    let settled = matches!(
        state,
        "delivered" | "dead_lettered" | "expired" | "cancelled" | "suppressed" | "ambiguous"
    );
    let leased = state == "sending";
    sqlx::query_scalar(
        "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
             scheduled_at, expires_at, next_attempt_at, lease_owner, lease_expires_at, settled_at,
             created_at, updated_at)
         VALUES (gen_random_uuid(), $1, $2, 'sms', $3, $4, $5, $6, $5, $7, $8, $9, $5, $5)
         RETURNING id",
    )
    .bind(reminder)
    .bind(tenant.id.as_uuid())
    .bind(state)
    .bind(format!("nudge-{reminder}-sms"))
    .bind(t0())
    .bind(t0() + secs(60))
    .bind(leased.then_some("w"))
    .bind(leased.then(|| t0() + secs(60)))
    .bind(settled.then(t0))
    .fetch_one(pool)
    .await
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_schema_accepts_exactly_the_domain_states(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    for (n, state) in DeliveryState::ALL.iter().enumerate() {
        insert_in_state(&pool, &ledger, state.as_str(), n)
            .await
            .unwrap_or_else(|e| panic!("{state} refused: {e}"));
    }
    assert!(insert_in_state(&pool, &ledger, "lost", 99).await.is_err());
    assert!(
        insert_in_state(&pool, &ledger, "Delivered", 98)
            .await
            .is_err()
    );
}

/// Deletes one delivery as retention does: inside a transaction that set `nudge.retention`,
/// which lets the attempts' history go with its delivery.
async fn delete_as_retention(pool: &PgPool, id: uuid::Uuid) -> Result<u64, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL nudge.retention = 'on'")
        .execute(&mut *tx)
        .await?;
    let deleted = sqlx::query("DELETE FROM deliveries WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    tx.commit().await?;
    Ok(deleted)
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn only_a_settled_delivery_can_be_deleted_even_inside_retention(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    for (n, state) in DeliveryState::ALL.iter().enumerate() {
        let id = insert_in_state(&pool, &ledger, state.as_str(), n)
            .await
            .unwrap();

        let as_retention = delete_as_retention(&pool, id).await;
        let plain = sqlx::query("DELETE FROM deliveries WHERE id = $1")
            .bind(id)
            .execute(&pool)
            .await;

        if state.is_retention_deletable() {
            assert_eq!(as_retention.unwrap(), 1, "{state} is settled history");
        } else {
            for refused in [as_retention.map(|_| ()), plain.map(|_| ())] {
                let err = refused.unwrap_err();
                assert!(
                    err.to_string()
                        .contains(&format!("is {state}: only delivered")),
                    "{state}: {err}"
                );
            }
        }
    }
    let left: Vec<String> =
        sqlx::query_scalar("SELECT state FROM deliveries ORDER BY created_at, state")
            .fetch_all(&pool)
            .await
            .unwrap();
    let mut left: Vec<&str> = left.iter().map(String::as_str).collect();
    left.sort_unstable();
    assert_eq!(
        left,
        ["ambiguous", "queued", "retry_wait", "scheduled", "sending"],
        "owed and held work stays"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn deliveries_cannot_be_truncated_directly_or_through_a_cascade(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    insert_in_state(&pool, &ledger, "delivered", 1)
        .await
        .unwrap();
    insert_in_state(&pool, &ledger, "queued", 2).await.unwrap();

    // Named with the attempts it cascades to, or through a table that cascades to it.
    for statement in [
        "TRUNCATE deliveries, attempts",
        "TRUNCATE deliveries CASCADE",
        "TRUNCATE reminders CASCADE",
        "TRUNCATE tenants CASCADE",
    ] {
        let err = sqlx::query(statement).execute(&pool).await.unwrap_err();
        // Refused by the deliveries' own trigger, or before it: by a table that must not
        // lose its rows either, or by a foreign key from one (redrive items).
        let err = err.to_string();
        assert!(
            err.contains("deliveries may lose owed work: TRUNCATE refused")
                || err.contains("is append-only: TRUNCATE refused")
                || err.contains("cannot truncate a table referenced in a foreign key"),
            "{statement}: {err}"
        );
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM deliveries").await, 2);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn deleting_a_tenant_or_reminder_with_owed_or_held_work_fails_and_keeps_it(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let owed_reminder = owed(&ledger, tenant.id, "owed", &[Channel::Sms], t0()).await;
    let held = insert_in_state(&pool, &ledger, "ambiguous", 1)
        .await
        .unwrap();
    let held_reminder: uuid::Uuid =
        sqlx::query_scalar("SELECT reminder_id FROM deliveries WHERE id = $1")
            .bind(held)
            .fetch_one(&pool)
            .await
            .unwrap();
    // Not materialised yet: scheduled tomorrow, so only the reminder row stands for it.
    ledger
        .create_reminder(
            &reminder(tenant.id, "tomorrow", &[Channel::Sms], t0() + secs(86_400)),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    let before = (
        count(&pool, "SELECT count(*) FROM deliveries").await,
        count(&pool, "SELECT count(*) FROM reminders").await,
        count(&pool, "SELECT count(*) FROM tenants").await,
    );
    assert_eq!(before, (2, 3, 2));

    for (sql, id) in [
        (
            "DELETE FROM reminders WHERE id = $1",
            owed_reminder.as_uuid(),
        ),
        ("DELETE FROM reminders WHERE id = $1", held_reminder),
        ("DELETE FROM tenants WHERE id = $1", tenant.id.as_uuid()),
        ("DELETE FROM tenants WHERE id <> $1", uuid::Uuid::nil()),
    ] {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("SET LOCAL nudge.retention = 'on'")
            .execute(&mut *tx)
            .await
            .unwrap();
        let err = sqlx::query(sql)
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap_err();
        assert!(
            err.as_database_error()
                .is_some_and(|e| e.is_foreign_key_violation()),
            "{sql}: {err}"
        );
    }

    let after = (
        count(&pool, "SELECT count(*) FROM deliveries").await,
        count(&pool, "SELECT count(*) FROM reminders").await,
        count(&pool, "SELECT count(*) FROM tenants").await,
    );
    assert_eq!(after, before, "nothing cascaded");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn settled_history_goes_delivery_first_then_its_reminder_then_the_tenant(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let delivery = one_attempt(&ledger).await;
    let (reminder, tenant): (uuid::Uuid, uuid::Uuid) =
        sqlx::query_as("SELECT reminder_id, tenant_id FROM deliveries WHERE id = $1")
            .bind(delivery.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();

    let early = sqlx::query("DELETE FROM reminders WHERE id = $1")
        .bind(reminder)
        .execute(&pool)
        .await
        .unwrap_err();
    assert!(
        early
            .as_database_error()
            .is_some_and(|e| e.is_foreign_key_violation()),
        "a reminder does not take its settled deliveries with it: {early}"
    );

    assert_eq!(
        delete_as_retention(&pool, delivery.as_uuid())
            .await
            .unwrap(),
        1
    );
    sqlx::query("DELETE FROM reminders WHERE id = $1")
        .bind(reminder)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM tenants WHERE id = $1")
        .bind(tenant)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM attempts").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM tenants").await, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_schema_check_lists_match_the_domain_names(pool: PgPool) {
    let constraint = |table: &'static str, column: &'static str| {
        let pool = pool.clone();
        async move {
            let defs: Vec<String> = sqlx::query_scalar(
                "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c
                 JOIN pg_class t ON t.oid = c.conrelid
                 WHERE t.relname = $1 AND c.contype = 'c'",
            )
            .bind(table)
            .fetch_all(&pool)
            .await
            .unwrap();
            defs.into_iter()
                .find(|d| d.starts_with(&format!("CHECK (({column} = ANY")))
                .unwrap_or_else(|| panic!("no CHECK on {table}.{column}"))
        }
    };
    let names_in = |def: &str| -> Vec<String> {
        def.split('\'')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    };

    let states: Vec<String> = DeliveryState::ALL
        .iter()
        .map(|s| s.as_str().to_owned())
        .collect();
    assert_eq!(names_in(&constraint("deliveries", "state").await), states);
    assert_eq!(
        names_in(&constraint("attempts", "next_state").await),
        states
    );
    let channels: Vec<String> = Channel::ALL.iter().map(|c| c.as_str().to_owned()).collect();
    assert_eq!(
        names_in(&constraint("deliveries", "channel").await),
        channels
    );
    assert_eq!(names_in(&constraint("contacts", "channel").await), channels);
    let lanes: Vec<String> = Lane::ALL.iter().map(|l| l.as_str().to_owned()).collect();
    assert_eq!(names_in(&constraint("deliveries", "lane").await), lanes);
    assert_eq!(names_in(&constraint("attempts", "lane").await), lanes);
    let classes: Vec<String> = OutcomeClass::ALL
        .iter()
        .map(|c| c.as_str().to_owned())
        .collect();
    assert_eq!(
        names_in(&constraint("attempts", "outcome_class").await),
        classes
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_same_reminder_and_channel_cannot_have_two_deliveries(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let reminder = owed(&ledger, tenant.id, "e", &[Channel::Sms], t0()).await;

    let dup = sqlx::query(
        "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
             scheduled_at, expires_at, next_attempt_at, created_at, updated_at)
         VALUES (gen_random_uuid(), $1, $2, 'sms', 'scheduled', 'nudge-' || $1::text || '-sms', $3, $4, $3, $3, $3)",
    )
    .bind(reminder.as_uuid())
    .bind(tenant.id.as_uuid())
    .bind(t0())
    .bind(t0() + secs(60))
    .execute(&pool)
    .await
    .unwrap_err();

    assert!(dup.as_database_error().unwrap().is_unique_violation());
}

/// The key a provider sees is the one its reminder and channel make, so no two deliveries can
/// share one: the database holds every row to it.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_delivery_cannot_carry_a_key_other_than_its_reminder_and_channel_make(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let reminder = owed(&ledger, tenant.id, "k", &[Channel::Sms], t0()).await;
    let insert = |channel: &'static str, key: String| {
        sqlx::query(
            "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
                 scheduled_at, expires_at, next_attempt_at, created_at, updated_at)
             VALUES (gen_random_uuid(), $1, $2, $3, 'scheduled', $4, $5, $6, $5, $5, $5)",
        )
        .bind(reminder.as_uuid())
        .bind(tenant.id.as_uuid())
        .bind(channel)
        .bind(key)
        .bind(t0())
        .bind(t0() + secs(60))
        .execute(&pool)
    };

    // Another channel's key on an email delivery, or a key of the caller's own making.
    let email_key = nudge_domain::IdempotencyKey::for_delivery(reminder, Channel::Email)
        .as_str()
        .to_owned();
    let sms_key = nudge_domain::IdempotencyKey::for_delivery(reminder, Channel::Sms)
        .as_str()
        .to_owned();
    for (channel, key) in [("email", sms_key), ("email", "my-own-key".to_owned())] {
        let refused = insert(channel, key).await.unwrap_err();
        assert_eq!(
            refused.as_database_error().unwrap().constraint(),
            Some("deliveries_idempotency_key_derived")
        );
    }
    insert("email", email_key).await.unwrap();
}

async fn one_attempt(ledger: &Ledger) -> nudge_domain::DeliveryId {
    let tenant = tenant(ledger).await;
    owed(ledger, tenant.id, "e", &[Channel::Sms], t0()).await;
    let due = ledger
        .claim_due(Channel::Sms, 10, at(t0()))
        .await
        .unwrap()
        .remove(0);
    let lease = leased(lease(ledger, &due, t0()).await);
    let decision = nudge_domain::decide(
        &nudge_domain::AttemptContext {
            attempt_number: 1,
            expires_at: lease.expires_at,
            idempotency: nudge_domain::IdempotencySupport::Honoured,
        },
        &nudge_domain::SendOutcome::Response {
            status: 200,
            retry_after: None,
            provider_message_id: None,
        },
        t0(),
        &nudge_domain::RetryPolicy::default(),
        &mut nudge_domain::FixedJitter::zero(),
    );
    let attempt = nudge_ledger::AttemptRecord {
        started_at: t0(),
        finished_at: t0(),
        worker: "w".into(),
        correlation_id: None,
    };
    assert_eq!(
        record(ledger, &lease, &decision, &attempt, t0()).await,
        nudge_ledger::Recorded::Applied
    );
    due.id
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_database_refuses_to_change_or_delete_an_attempt(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    one_attempt(&ledger).await;

    let update = sqlx::query("UPDATE attempts SET reason = 'rewritten'")
        .execute(&pool)
        .await;
    let delete = sqlx::query("DELETE FROM attempts").execute(&pool).await;
    let truncate = sqlx::query("TRUNCATE attempts").execute(&pool).await;

    for refused in [update, delete, truncate] {
        let err = refused.unwrap_err();
        assert!(err.to_string().contains("append-only"), "{err}");
    }
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn retention_may_delete_attempts_inside_its_own_transaction_only(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let delivery = one_attempt(&ledger).await;

    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL nudge.retention = 'on'")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("DELETE FROM deliveries WHERE id = $1")
        .bind(delivery.as_uuid())
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 0, "the attempt history went with its delivery");
    // The setting was local to that transaction.
    let again = one_attempt_in_new_tenant(&ledger, &pool).await;
    assert!(again.is_err());
}

async fn one_attempt_in_new_tenant(ledger: &Ledger, pool: &PgPool) -> Result<u64, sqlx::Error> {
    let tenant = ledger.create_tenant("another", &ops(t0())).await.unwrap();
    owed(ledger, tenant.id, "e2", &[Channel::Sms], t0()).await;
    sqlx::query("INSERT INTO attempts (delivery_id, attempt_number, generation, lane, started_at, finished_at, outcome_class, next_state)
                 SELECT id, 1, 0, 'new', $1, $1, 'retryable', 'retry_wait' FROM deliveries WHERE tenant_id = $2")
        .bind(t0())
        .bind(tenant.id.as_uuid())
        .execute(pool)
        .await?;
    sqlx::query("DELETE FROM attempts")
        .execute(pool)
        .await
        .map(|r| r.rows_affected())
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_audit_log_is_append_only(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    ledger
        .record_audit(&AuditEntry {
            at: t0(),
            actor: "ops@clinic".into(),
            action: "pause_intake".into(),
            target: Some("tenant:clinic-a".into()),
            reason: Some("provider incident".into()),
            incident: Some("inc-1".into()),
            details: serde_json::json!({"paused": true}),
        })
        .await
        .unwrap();

    assert!(
        sqlx::query("UPDATE audit_log SET reason = 'x'")
            .execute(&pool)
            .await
            .is_err()
    );
    assert!(
        sqlx::query("DELETE FROM audit_log")
            .execute(&pool)
            .await
            .is_err()
    );
    let recent = ledger.recent_audit(10).await.unwrap();
    assert_eq!(recent.len(), 1);
    assert_eq!(recent[0].reason.as_deref(), Some("provider incident"));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_destination_is_stored_only_encrypted_and_opens_for_the_leased_delivery(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let subscriber = SubscriberRef::parse("patient-0001").unwrap();
    let phone = Destination::new("+15550100");
    ledger
        .upsert_contact(
            tenant.id,
            &subscriber,
            Channel::Sms,
            &phone,
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    owed(
        &ledger,
        tenant.id,
        "e",
        &[Channel::Sms, Channel::Push],
        t0(),
    )
    .await;

    let dump: Vec<String> = sqlx::query_scalar("SELECT c::text FROM contacts c")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(
        dump.iter().all(|row| !row.contains("5550100")),
        "no plaintext in any column"
    );

    let routes = routes(nudge_domain::IdempotencySupport::Honoured);
    let settings = settings();
    for due in claim_all(&ledger, t0()).await {
        for (key, opens) in [
            (cipher(), true),
            (DestinationCipher::new(&[1u8; 32]), false),
        ] {
            if !opens {
                // Give the delivery back so the wrong key gets a lease of its own.
                sqlx::query(
                    "UPDATE deliveries SET state = 'queued', lease_owner = NULL,
                         lease_expires_at = NULL, send_started_at = NULL WHERE id = $1",
                )
                .bind(due.id.as_uuid())
                .execute(&pool)
                .await
                .unwrap();
            }
            let batch = batch_of(due.channel, "w", &routes, &settings, &key, at(t0()));
            let outcome = ledger
                .lease_batch(&batch, &[due.message_pointer()])
                .await
                .unwrap()
                .outcomes
                .remove(0);
            let LeaseOutcome::Leased { material, .. } = outcome else {
                panic!("not leased: {outcome:?}");
            };
            match (due.channel, opens) {
                (Channel::Sms, true) => {
                    let material = material.unwrap();
                    assert_eq!(material.destination, Some(phone.clone()));
                    assert_eq!(material.content, None, "these reminders carry no content");
                }
                (Channel::Sms, false) => {
                    assert!(matches!(material, Err(LedgerError::Crypto)));
                }
                (_, true) => {
                    assert_eq!(material.unwrap().destination, None, "no push token on file");
                }
                (_, false) => {}
            }
        }
    }
}

/// The relay's "what is due now", per channel, must stay an index scan however much settled
/// history, future work and other channels' backlog the table holds.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn finding_due_work_uses_the_partial_index_on_a_large_ledger(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let reminder = owed(&ledger, tenant.id, "seed", &[Channel::Sms], t0()).await;
    // 60,000 settled deliveries and 20,000 scheduled for tomorrow, next to a few due now.
    sqlx::query(
        "INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels, scheduled_at, expires_at, created_at)
         SELECT gen_random_uuid(), $1, 'bulk-' || g, 'p', ARRAY['sms'], $2, $2 + interval '1 day', $2
         FROM generate_series(1, 80000) g",
    )
    .bind(tenant.id.as_uuid())
    .bind(t0())
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
             scheduled_at, expires_at, next_attempt_at, settled_at, created_at, updated_at)
         SELECT gen_random_uuid(), r.id, r.tenant_id, 'sms',
                CASE WHEN n % 4 = 0 THEN 'scheduled' ELSE 'delivered' END,
                'nudge-' || r.id::text || '-sms', r.scheduled_at, r.expires_at + interval '1 day',
                r.scheduled_at + interval '1 day',
                CASE WHEN n % 4 = 0 THEN NULL ELSE r.scheduled_at END, r.created_at, r.created_at
         FROM (SELECT *, row_number() OVER () AS n FROM reminders WHERE event_id LIKE 'bulk-%') r",
    )
    .execute(&pool)
    .await
    .unwrap();
    // And a backlog of 20,000 emails due an hour ago: claiming SMS must not walk through it.
    sqlx::query(
        "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
             scheduled_at, expires_at, next_attempt_at, created_at, updated_at)
         SELECT gen_random_uuid(), r.id, r.tenant_id, 'email', 'scheduled',
                'nudge-' || r.id::text || '-email', r.scheduled_at - interval '1 hour', r.expires_at,
                r.scheduled_at - interval '1 hour', r.created_at, r.created_at
         FROM (SELECT *, row_number() OVER () AS n FROM reminders WHERE event_id LIKE 'bulk-%') r
         WHERE n % 4 = 1",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE deliveries")
        .execute(&pool)
        .await
        .unwrap();

    // The relay's own statement, per channel: each tenant (a table of tenants, not of
    // deliveries, which it may read whole) is probed for due work and offers its oldest
    // through the partial index; no delivery is read beyond that.
    let plan = ledger
        .explain_claim_due(Channel::Sms, 100, at(t0()))
        .await
        .unwrap();
    assert!(plan.contains("deliveries_due_tenant_idx"), "{plan}");
    assert!(!plan.contains("Seq Scan on deliveries"), "{plan}");

    let oldest: Vec<String> = sqlx::query_scalar(
        "EXPLAIN SELECT min(next_attempt_at) FROM deliveries
         WHERE channel = 'sms' AND state IN ('scheduled', 'queued', 'retry_wait')",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let oldest = oldest.join("\n");
    assert!(oldest.contains("deliveries_eligible_idx"), "{oldest}");

    let claimed = ledger.claim_due(Channel::Sms, 100, at(t0())).await.unwrap();
    assert_eq!(
        claimed.len(),
        1,
        "only the one due SMS delivery of {reminder}"
    );
}

/// A batch of due work in a table whose statistics are stale (analysed before the batch, or
/// never: autovacuum off or behind): the claim still takes each offered row where the offer
/// read it. Found again through a join with every due row instead, the lock became a nested
/// loop of 10,000 x 500 rows, a second per claim (decision 0414).
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_claim_takes_the_offered_rows_where_they_are_whatever_the_statistics_say(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "seed", &[Channel::Sms], t0()).await;
    bulk_due_sms(&pool, tenant.id, 10000, t0(), 1).await;
    let analysed: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
        "SELECT GREATEST(last_analyze, last_autoanalyze) FROM pg_stat_user_tables
         WHERE relname = 'deliveries'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        analysed, None,
        "the batch came after the last analyse (none)"
    );

    // With the database's clock, as every process claims.
    let plan = ledger
        .explain_claim_due(Channel::Sms, 500, nudge_ledger::LedgerTime::Database)
        .await
        .unwrap();
    // The offered rows come from the partial index; the lock and the update each take them
    // where the offer read them (one TID scan each), never through a scan of the due rows.
    assert!(plan.contains("deliveries_due_tenant_idx"), "{plan}");
    assert_eq!(plan.matches("Tid Scan on deliveries").count(), 2, "{plan}");
    assert!(!plan.contains("Bitmap Heap Scan on deliveries"), "{plan}");
    assert!(!plan.contains("Seq Scan on deliveries"), "{plan}");

    // And it claims what it should: the 500 oldest.
    let claimed = ledger.claim_due(Channel::Sms, 500, at(t0())).await.unwrap();
    assert_eq!(claimed.len(), 500);
    let oldest: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT id FROM deliveries WHERE channel = 'sms'
         ORDER BY next_attempt_at, id LIMIT 500",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut got: Vec<uuid::Uuid> = claimed.iter().map(|d| d.id.as_uuid()).collect();
    let mut want = oldest;
    got.sort();
    want.sort();
    assert_eq!(got, want, "the 500 oldest due, no other");
}
