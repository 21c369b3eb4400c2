//! How the benchmark fills the ledger, outside the timed part of a run.
//!
//! - Reminders due now go through the ledger's own import (`Ledger::import_reminder`, what
//!   `nudgectl reminders load` calls per line), several at once: reminder, encrypted
//!   destination and encrypted content, and the delivery created in the same transaction
//!   because the reminder is already due. Or through `nudgectl reminders load` itself, timed.
//! - The scale cases' large volumes are bulk SQL (`generate_series`), shaped like what the
//!   intake and the producer write (the idempotency key is checked against the domain's):
//!   keyed subscriber references (64 hex digits), sealed-size content and a contact per
//!   subscriber (random bytes in place of ciphertext: these are never sent during the
//!   benchmark), and `scheduled` deliveries under a run intent.

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use chrono::{DateTime, Utc};
use nudge_domain::{Channel, EventId, IdempotencyKey, ReminderId, SubscriberRef, TenantId};
use nudge_e2e::TestEnv;
use nudge_ledger::{Destination, DestinationCipher, Ledger, NewReminder, SEQUENCE_BATCH_MAX};
use serde::Serialize;
use tokio::task::JoinSet;

/// Concurrent importers for the due-now load.
const IMPORTERS: usize = 8;
/// Rows per bulk statement.
const BULK_BATCH: usize = 50_000;

/// `n` SMS reminders of `tenant`, due now, expiring in two hours, each with its own
/// subscriber, destination and content. Event ids are `<tag>-<i>`.
pub async fn due_now(
    ledger: &Ledger,
    cipher: &DestinationCipher,
    tenant: TenantId,
    n: usize,
    tag: &str,
) -> anyhow::Result<()> {
    let due = Utc::now();
    let mut tasks = JoinSet::new();
    for first in 0..IMPORTERS {
        let ledger = ledger.clone();
        let cipher = cipher.clone();
        let tag = tag.to_owned();
        tasks.spawn(async move {
            for i in (first..n).step_by(IMPORTERS) {
                let event = format!("{tag}-{i}");
                let reminder = NewReminder::new(
                    tenant,
                    EventId::parse(&event)?,
                    SubscriberRef::parse(&format!("sub-{event}"))?,
                    &[Channel::Sms],
                    due,
                    due + chrono::Duration::hours(2),
                )?
                .with_content(br#"{"template":"appointment"}"#.to_vec())?;
                let destination = Destination::new(format!("+1555{i:07}"));
                let created = ledger
                    .import_reminder(
                        &reminder,
                        &[(Channel::Sms, destination)],
                        &cipher,
                        Utc::now(),
                    )
                    .await?;
                anyhow::ensure!(
                    created.deliveries_created == 1,
                    "a reminder due now was created without its delivery"
                );
            }
            Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.context("an importer panicked")??;
    }
    Ok(())
}

/// `nudgectl reminders load` of `n` lines like [`due_now`]'s, timed from start to exit.
#[derive(Debug, Clone, Serialize)]
pub struct LoadSample {
    pub lines: usize,
    pub seconds: f64,
    pub per_second: f64,
}

pub fn nudgectl_load(env: &TestEnv, tenant: &str, n: usize) -> anyhow::Result<LoadSample> {
    let due = Utc::now();
    let expires = due + chrono::Duration::hours(2);
    let path = env.dir.join("reminders.jsonl");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path)?);
    for i in 0..n {
        let line = serde_json::json!({
            "tenant": tenant,
            "event_id": format!("load-{i}"),
            "subscriber_ref": format!("sub-load-{i}"),
            "channels": ["sms"],
            "scheduled_at": due.to_rfc3339(),
            "expires_at": expires.to_rfc3339(),
            "destinations": {"sms": format!("+1555{i:07}")},
            "content": {"template": "appointment"},
        });
        serde_json::to_writer(&mut file, &line)?;
        file.write_all(b"\n")?;
    }
    file.flush()?;
    drop(file);
    let path_text = path.to_string_lossy().into_owned();
    let clock = Instant::now();
    let (code, out, err) = env.nudgectl(&[
        "reminders",
        "load",
        &path_text,
        "--reason",
        "throughput benchmark",
    ])?;
    let seconds = clock.elapsed().as_secs_f64();
    anyhow::ensure!(
        code == 0 && out.contains(&format!("loaded {n} new")),
        "nudgectl reminders load failed (exit {code}): {out}\n{}",
        err.lines().rev().take(5).collect::<Vec<_>>().join("\n")
    );
    Ok(LoadSample {
        lines: n,
        seconds,
        per_second: n as f64 / seconds,
    })
}

/// `count` SMS reminders of `tenant` spread evenly over `[from, from + span)`, with their
/// deliveries `scheduled` (as a producer window covering that span leaves them) and the run
/// intent of that window, so the ledger is what the producer would have made.
pub async fn bulk_materialised(
    ledger: &Ledger,
    tenant: TenantId,
    count: usize,
    from: DateTime<Utc>,
    span: chrono::Duration,
) -> anyhow::Result<()> {
    let step_ms = span.num_milliseconds() as f64 / count.max(1) as f64;
    let now = Utc::now();
    let mut start = 0;
    while start < count {
        let end = (start + BULK_BATCH).min(count);
        sqlx::query(
            "WITH r AS (
                 INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref,
                                        subscriber_ref_keyed, channels, content_ciphertext,
                                        scheduled_at, expires_at, created_at)
                 SELECT gen_random_uuid(), $1, 'future-' || i,
                        encode(sha256(('future-sub-' || i)::bytea), 'hex'), true, ARRAY['sms'],
                        decode(repeat(md5(i::text), 3), 'hex'),
                        $2 + i * $3 * interval '1 millisecond',
                        $2 + i * $3 * interval '1 millisecond' + interval '1 day', $4
                 FROM generate_series($5::bigint, $6::bigint) AS i
                 RETURNING id, tenant_id, subscriber_ref, scheduled_at, expires_at),
             c AS (
                 INSERT INTO contacts (tenant_id, subscriber_ref, subscriber_ref_keyed, channel,
                                       destination_ciphertext, updated_at)
                 SELECT r.tenant_id, r.subscriber_ref, true, 'sms',
                        decode(md5(r.id::text) || md5(r.subscriber_ref), 'hex'), $4
                 FROM r)
             INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
                                     scheduled_at, expires_at, next_attempt_at, created_at, updated_at)
             SELECT gen_random_uuid(), r.id, r.tenant_id, 'sms', 'scheduled',
                    'nudge-' || r.id::text || '-sms', r.scheduled_at, r.expires_at,
                    r.scheduled_at, $4, $4
             FROM r",
        )
        .bind(tenant.as_uuid())
        .bind(from)
        .bind(step_ms)
        .bind(now)
        .bind(i64::try_from(start)?)
        .bind(i64::try_from(end)? - 1)
        .execute(ledger.pool())
        .await
        .context("failed to insert future reminders")?;
        start = end;
        eprintln!("  ledger: {end} of {count} future reminders written");
    }
    sqlx::query(
        "INSERT INTO run_intents (tenant_id, window_start, window_end, deliveries_created, created_at)
         VALUES ($1, '2000-01-01T00:00:00Z', $2, $3, $4)",
    )
    .bind(tenant.as_uuid())
    .bind(from + span + chrono::Duration::hours(1))
    .bind(i32::try_from(count)?)
    .bind(now)
    .execute(ledger.pool())
    .await?;
    check_key_format(ledger, tenant).await?;
    analyze(ledger).await
}

/// `count` SMS reminders of `tenant` (no deliveries yet: the producer's window makes them),
/// spread over the minute that starts at `from`.
pub async fn bulk_unmaterialised(
    ledger: &Ledger,
    tenant: TenantId,
    count: usize,
    from: DateTime<Utc>,
) -> anyhow::Result<()> {
    let now = Utc::now();
    let mut start = 0;
    while start < count {
        let end = (start + BULK_BATCH).min(count);
        sqlx::query(
            "WITH r AS (
                 INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref,
                                        subscriber_ref_keyed, channels, content_ciphertext,
                                        scheduled_at, expires_at, created_at)
                 SELECT gen_random_uuid(), $1, 'window-' || i,
                        encode(sha256(('window-sub-' || i)::bytea), 'hex'), true, ARRAY['sms'],
                        decode(repeat(md5(i::text), 3), 'hex'),
                        $2 + (i % 60) * interval '1 second',
                        $2 + (i % 60) * interval '1 second' + interval '1 day', $3
                 FROM generate_series($4::bigint, $5::bigint) AS i
                 RETURNING tenant_id, subscriber_ref)
             INSERT INTO contacts (tenant_id, subscriber_ref, subscriber_ref_keyed, channel,
                                   destination_ciphertext, updated_at)
             SELECT r.tenant_id, r.subscriber_ref, true, 'sms',
                    decode(md5(r.subscriber_ref) || md5(r.tenant_id::text), 'hex'), $3
             FROM r",
        )
        .bind(tenant.as_uuid())
        .bind(from)
        .bind(now)
        .bind(i64::try_from(start)?)
        .bind(i64::try_from(end)? - 1)
        .execute(ledger.pool())
        .await
        .context("failed to insert window reminders")?;
        start = end;
    }
    analyze(ledger).await
}

/// The bulk rows must carry the key the domain would have given them.
async fn check_key_format(ledger: &Ledger, tenant: TenantId) -> anyhow::Result<()> {
    let (reminder, key): (uuid::Uuid, String) = sqlx::query_as(
        "SELECT reminder_id, idempotency_key FROM deliveries WHERE tenant_id = $1 LIMIT 1",
    )
    .bind(tenant.as_uuid())
    .fetch_one(ledger.pool())
    .await?;
    let expected = IdempotencyKey::for_delivery(ReminderId::from_uuid(reminder), Channel::Sms);
    anyhow::ensure!(
        key == expected.as_str(),
        "bulk idempotency keys differ from the domain's ({key} vs {})",
        expected.as_str()
    );
    Ok(())
}

/// The loaded rows' `scheduled` events numbered, and their table vacuumed, as the janitor and
/// autovacuum leave them while reminders posted ahead of their time wait: a timed window then
/// holds what sending writes, not the numbering of what the load wrote (`--events off` loads
/// none). The delivery cases call this alone: their due rows stay unanalysed, as a batch that
/// has just fallen due is until the next analyse, so the pipeline's plans are measured without
/// fresh statistics.
pub async fn number_events(ledger: &Ledger) -> anyhow::Result<()> {
    loop {
        match ledger.sequence_events(SEQUENCE_BATCH_MAX).await?.numbered {
            Some(0) => break,
            Some(_) => {}
            None => anyhow::bail!("the events' sequencer is held by another caller"),
        }
    }
    sqlx::query("VACUUM ANALYZE delivery_events")
        .execute(ledger.pool())
        .await?;
    Ok(())
}

/// The loaded rows as a long-running ledger has them: events numbered ([`number_events`]) and
/// planner statistics taken (autovacuum would analyse soon).
async fn analyze(ledger: &Ledger) -> anyhow::Result<()> {
    number_events(ledger).await?;
    for table in ["reminders", "deliveries", "contacts", "run_intents"] {
        sqlx::query(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {table}")))
            .execute(ledger.pool())
            .await?;
    }
    Ok(())
}
