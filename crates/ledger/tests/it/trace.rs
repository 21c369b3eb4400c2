#![allow(clippy::unwrap_used, clippy::expect_used)]

//! The operator's read-only views: a reminder's trace (resolution, attempts, findings) and the
//! dead-letter listing (counts by reason and age band, samples, redrive-pending work).

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{
    AttemptContext, Channel, DeliveryId, DeliveryState, EventId, FixedJitter, IdempotencySupport,
    RetryPolicy, SendOutcome, SubscriberRef, TenantId, decide,
};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    AgeBand, AttemptRecord, DeadLetter, DueDelivery, LeasedDelivery, Ledger, MatchedAs,
    NewReminder, Recorded, TraceError, TraceId,
};
use sqlx::PgPool;

/// Creates a reminder of one channel scheduled at `scheduled_at`, expiring 30 days later, and
/// materialises its delivery.
async fn owed_at(
    ledger: &Ledger,
    tenant_id: TenantId,
    event: &str,
    channel: Channel,
    scheduled_at: DateTime<Utc>,
) -> nudge_domain::ReminderId {
    let reminder = NewReminder::new(
        tenant_id,
        EventId::parse(event).unwrap(),
        SubscriberRef::parse("patient-0001").unwrap(),
        &[channel],
        scheduled_at,
        scheduled_at + secs(30 * 86_400),
    )
    .unwrap();
    let created = ledger
        .create_reminder(&reminder, &cipher(), t0())
        .await
        .unwrap();
    ledger
        .materialise_reminder(tenant_id, created.id, t0())
        .await
        .unwrap();
    created.id
}

/// Claims the delivery of `reminder` at `now` (everything due is claimed; the rest is kept
/// for the next call).
async fn claim(
    ledger: &Ledger,
    pending: &mut Vec<DueDelivery>,
    reminder: nudge_domain::ReminderId,
    now: DateTime<Utc>,
) -> DueDelivery {
    pending.extend(claim_all(ledger, now).await);
    let at = pending
        .iter()
        .position(|d| d.reminder_id == reminder)
        .expect("the reminder's delivery is due");
    pending.remove(at)
}

/// Leases `due` at `started`, sends, and records `outcome` one second later, with the retry
/// decision of the domain (jitter fixed at 2 s) through an account with `idempotency`.
async fn attempt(
    ledger: &Ledger,
    due: &DueDelivery,
    outcome: SendOutcome,
    idempotency: IdempotencySupport,
    started: DateTime<Utc>,
) -> LeasedDelivery {
    let lease = leased(lease_as(ledger, due, "worker-7", &routes(idempotency), started).await);
    let facts = AttemptRecord {
        started_at: started,
        finished_at: started + secs(1),
        worker: "worker-7".into(),
        correlation_id: None,
    };
    let decision = decide(
        &AttemptContext {
            attempt_number: lease.attempt_number,
            expires_at: lease.expires_at,
            idempotency,
        },
        &outcome,
        facts.finished_at,
        &RetryPolicy::default(),
        &mut FixedJitter::new(2_000),
    );
    assert_eq!(
        record(ledger, &lease, &decision, &facts, facts.finished_at).await,
        Recorded::Applied
    );
    lease
}

fn response(status: u16, retry_after: Option<&str>) -> SendOutcome {
    SendOutcome::Response {
        status,
        retry_after: retry_after.map(str::to_owned),
        provider_message_id: (status / 100 == 2).then(|| "prov-123".to_owned()),
    }
}

/// A 429 with `Retry-After: 120` at t0 + 30 s, then delivered when it came due again.
async fn throttled_then_delivered(ledger: &Ledger, tenant_id: TenantId, event: &str) -> DeliveryId {
    let reminder = owed_at(ledger, tenant_id, event, Channel::Sms, t0()).await;
    let mut pending = Vec::new();
    let first = claim(ledger, &mut pending, reminder, t0() + secs(30)).await;
    attempt(
        ledger,
        &first,
        response(429, Some("120")),
        IdempotencySupport::Honoured,
        t0() + secs(30),
    )
    .await;
    let eligible = t0() + secs(31 + 120);
    let second = claim(ledger, &mut pending, reminder, eligible).await;
    attempt(
        ledger,
        &second,
        response(200, None),
        IdempotencySupport::Honoured,
        eligible,
    )
    .await;
    first.id
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_trace_resolves_a_delivery_id_a_reminder_id_and_tenant_slash_event_id(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let reminder = owed(
        &ledger,
        tenant.id,
        "appt/2026/11/29",
        &[Channel::Sms, Channel::Email],
        t0(),
    )
    .await;
    let sms = ledger
        .deliveries_of_reminder(reminder)
        .await
        .unwrap()
        .into_iter()
        .find(|d| d.channel == Channel::Sms)
        .unwrap()
        .id;

    let by_delivery = ledger
        .trace(&TraceId::parse(&sms.to_string()).unwrap(), t0())
        .await
        .unwrap();
    let by_reminder = ledger
        .trace(&TraceId::parse(&reminder.to_string()).unwrap(), t0())
        .await
        .unwrap();
    let by_event = ledger
        .trace(&TraceId::parse("clinic-a/appt/2026/11/29").unwrap(), t0())
        .await
        .unwrap();

    assert_eq!(by_delivery.matched_as, MatchedAs::Delivery);
    assert_eq!(
        by_delivery.deliveries.len(),
        1,
        "just the delivery asked for"
    );
    assert_eq!(by_delivery.deliveries[0].id, sms);
    assert_eq!(by_reminder.matched_as, MatchedAs::Reminder);
    assert_eq!(by_event.matched_as, MatchedAs::Event);
    for trace in [&by_delivery, &by_reminder, &by_event] {
        assert_eq!(trace.reminder.id, reminder);
        assert_eq!(trace.reminder.tenant_name, "clinic-a");
        assert_eq!(trace.reminder.event_id, "appt/2026/11/29");
    }
    let channels: Vec<_> = by_event.deliveries.iter().map(|d| d.channel).collect();
    assert_eq!(channels.len(), 2);
    assert!(channels.contains(&Channel::Sms) && channels.contains(&Channel::Email));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_id_that_matches_nothing_says_what_was_tried(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    tenant(&ledger).await;
    let nobody = uuid::Uuid::now_v7();

    let unknown_id = ledger
        .trace(&TraceId::Uuid(nobody), t0())
        .await
        .unwrap_err();
    let unknown_tenant = ledger
        .trace(&TraceId::parse("clinic-z/appt-1").unwrap(), t0())
        .await
        .unwrap_err();
    let unknown_event = ledger
        .trace(&TraceId::parse("clinic-a/appt-1").unwrap(), t0())
        .await
        .unwrap_err();

    assert!(matches!(unknown_id, TraceError::UnknownId(id) if id == nobody));
    let said = unknown_id.to_string();
    assert!(
        said.contains("delivery id") && said.contains("reminder id"),
        "{said}"
    );
    assert!(matches!(unknown_tenant, TraceError::UnknownTenant(ref t) if t == "clinic-z"));
    assert!(
        unknown_event
            .to_string()
            .contains("no reminder with event id \"appt-1\""),
        "{unknown_event}"
    );
    assert!(
        ledger
            .trace_delivery(DeliveryId::from_uuid(nobody), t0())
            .await
            .unwrap()
            .is_none()
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_trace_lists_every_attempt_with_its_retry_after_delay_account_and_worker(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let id = throttled_then_delivered(&ledger, tenant.id, "e").await;

    let trace = ledger
        .trace_delivery(id, t0() + secs(600))
        .await
        .unwrap()
        .unwrap();

    let delivery = &trace.deliveries[0];
    assert_eq!(delivery.state, DeliveryState::Delivered);
    assert_eq!(delivery.attempt_count, 2);
    assert_eq!(delivery.attempt_base, 0);
    assert_eq!(delivery.lease, None);
    assert_eq!(delivery.provider_account.as_deref(), Some("main"));
    assert_eq!(delivery.provider_message_id.as_deref(), Some("prov-123"));
    assert_eq!(delivery.scheduled_at, t0());
    assert_eq!(delivery.first_attempt_at, Some(t0() + secs(30)));
    assert_eq!(delivery.last_attempt_at, Some(t0() + secs(151)));
    assert_eq!(delivery.settled_at, Some(t0() + secs(152)));
    assert!(delivery.redrives.is_empty());
    let numbers: Vec<_> = delivery.attempts.iter().map(|a| a.attempt_number).collect();
    assert_eq!(numbers, [1, 2]);
    let throttled = &delivery.attempts[0];
    assert_eq!(throttled.http_status, Some(429));
    assert_eq!(throttled.retry_after_seen.as_deref(), Some("120"));
    assert!(throttled.retry_after_valid);
    assert_eq!(throttled.delay_chosen, Some(Duration::from_secs(120)));
    assert_eq!(throttled.next_attempt_at, Some(t0() + secs(151)));
    assert_eq!(throttled.next_state, DeliveryState::RetryWait);
    assert_eq!(throttled.provider_account.as_deref(), Some("main"));
    assert_eq!(throttled.worker.as_deref(), Some("worker-7"));
    assert_eq!(throttled.incident, None);
    assert_eq!(delivery.attempts[1].next_state, DeliveryState::Delivered);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn findings_tell_scheduling_delay_from_provider_throttling(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let id = throttled_then_delivered(&ledger, tenant.id, "e").await;

    let trace = ledger
        .trace_delivery(id, t0() + secs(600))
        .await
        .unwrap()
        .unwrap();

    let found = &trace.deliveries[0].findings;
    assert_eq!(found.first_attempt_delay_ms, Some(30_000));
    assert_eq!(
        found.scheduling_delay_ms, 30_000,
        "the retry started as soon as it was eligible"
    );
    assert_eq!(found.throttled_attempts, 1);
    assert_eq!(found.throttle_delay_ms, 120_000);
    assert!(found.leased_before_eligible.is_empty());
    assert_eq!(found.waiting_now_ms, None);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn owed_work_past_its_time_shows_its_wait_so_far_as_scheduling_delay(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let reminder = owed(&ledger, tenant.id, "e", &[Channel::Push], t0()).await;

    let trace = ledger
        .trace(&TraceId::Uuid(reminder.as_uuid()), t0() + secs(45))
        .await
        .unwrap();

    let found = &trace.deliveries[0].findings;
    assert_eq!(trace.deliveries[0].state, DeliveryState::Scheduled);
    assert_eq!(found.waiting_now_ms, Some(45_000));
    assert_eq!(found.scheduling_delay_ms, 45_000);
    assert_eq!(found.first_attempt_delay_ms, None);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_attempt_started_before_its_delivery_was_eligible_is_flagged(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let reminder = owed_at(&ledger, tenant.id, "e", Channel::Sms, t0()).await;
    let mut pending = Vec::new();
    let due = claim(&ledger, &mut pending, reminder, t0()).await;
    attempt(
        &ledger,
        &due,
        response(429, Some("120")),
        IdempotencySupport::Honoured,
        t0(),
    )
    .await;
    // The ledger's lease refuses work that is not due, so the bug is written directly: a
    // second attempt 5 s after the 429, while the delivery was waiting until t0 + 121 s.
    sqlx::query(
        "INSERT INTO attempts (delivery_id, attempt_number, generation, lane, started_at,
             finished_at, outcome_class, http_status, next_state, next_attempt_at, reason,
             provider_account, worker)
         VALUES ($1, 2, 2, 'retry', $2, $3, 'retryable', 429, 'retry_wait', $4, 'http_429',
             'main', 'rogue-worker')",
    )
    .bind(due.id.as_uuid())
    .bind(t0() + secs(5))
    .bind(t0() + secs(6))
    .bind(t0() + secs(200))
    .execute(ledger.pool())
    .await
    .unwrap();

    let trace = ledger
        .trace_delivery(due.id, t0() + secs(10))
        .await
        .unwrap()
        .unwrap();

    let early = &trace.deliveries[0].findings.leased_before_eligible;
    assert_eq!(early.len(), 1, "{early:?}");
    assert_eq!(early[0].attempt_number, Some(2));
    assert_eq!(early[0].started_at, t0() + secs(5));
    assert_eq!(early[0].eligible_at, t0() + secs(121));
    assert_eq!(early[0].early_by_ms, 116_000);
    assert_eq!(
        trace.deliveries[0].attempts[1].worker.as_deref(),
        Some("rogue-worker")
    );
}

/// A running redrive of sms holding `pending` (not yet fed) and `fed` (fed already), and a
/// finished one whose unfed item no longer waits.
async fn redrives(ledger: &Ledger, pending: DeliveryId, fed: DeliveryId, finished: DeliveryId) {
    let running: i64 = sqlx::query_scalar(
        "INSERT INTO redrives (channel, rate_per_second, state, selected, fed_until,
             running_since, actor, reason, incident, created_at, updated_at)
         VALUES ('sms', 1, 'running', 2, $1, $1, 'ops@clinic', 'provider fixed', 'INC-7', $1,
             $1)
         RETURNING id",
    )
    .bind(t0())
    .fetch_one(ledger.pool())
    .await
    .unwrap();
    let done: i64 = sqlx::query_scalar(
        "INSERT INTO redrives (channel, rate_per_second, state, selected, fed_until,
             running_since, actor, reason, created_at, updated_at, finished_at)
         VALUES ('sms', 1, 'finished', 1, $1, $1, 'ops@clinic', 'earlier', $1, $1, $1)
         RETURNING id",
    )
    .bind(t0())
    .fetch_one(ledger.pool())
    .await
    .unwrap();
    for (redrive, position, id, fed_at) in [
        (running, 1, pending, None),
        (running, 2, fed, Some(t0())),
        (done, 1, finished, None),
    ] {
        sqlx::query(
            "INSERT INTO redrive_items (redrive_id, position, delivery_id, fed_at)
             VALUES ($1, $2, $3, $4)",
        )
        .bind(redrive)
        .bind(position)
        .bind(id.as_uuid())
        .bind(fed_at)
        .execute(ledger.pool())
        .await
        .unwrap();
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_dead_letter_listing_counts_by_reason_and_age_band_with_samples_and_redrive_pending(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let now = t0() + secs(10 * 86_400);
    let op = now - secs(600);
    // Scheduled 30 min, 2 h, 2 h and 2 days before `now`: four answered 400.
    let mut rejected = Vec::new();
    for (event, age) in [("a", 1_800), ("b", 7_200), ("c", 7_200), ("d", 172_800)] {
        rejected.push(owed_at(&ledger, tenant.id, event, Channel::Sms, now - secs(age)).await);
    }
    let poisoned = owed_at(
        &ledger,
        tenant.id,
        "p",
        Channel::Sms,
        now - secs(8 * 86_400),
    )
    .await;
    let maybe_sent = owed_at(&ledger, tenant.id, "m", Channel::Email, now - secs(1_800)).await;
    let delivered = owed_at(&ledger, tenant.id, "ok", Channel::Sms, now - secs(1_800)).await;
    let retrying = owed_at(&ledger, tenant.id, "r", Channel::Sms, now - secs(1_800)).await;
    let mut pending = Vec::new();
    let mut dead = Vec::new();
    for reminder in &rejected {
        let due = claim(&ledger, &mut pending, *reminder, op).await;
        attempt(
            &ledger,
            &due,
            response(400, None),
            IdempotencySupport::Honoured,
            op,
        )
        .await;
        dead.push(due.id);
    }
    let due = claim(&ledger, &mut pending, maybe_sent, op).await;
    attempt(
        &ledger,
        &due,
        response(500, None),
        IdempotencySupport::NotHonoured,
        op,
    )
    .await;
    let due = claim(&ledger, &mut pending, delivered, op).await;
    attempt(
        &ledger,
        &due,
        response(200, None),
        IdempotencySupport::Honoured,
        op,
    )
    .await;
    let due = claim(&ledger, &mut pending, retrying, op).await;
    attempt(
        &ledger,
        &due,
        response(503, None),
        IdempotencySupport::Honoured,
        op,
    )
    .await;
    let poison = claim(&ledger, &mut pending, poisoned, op).await;
    let letter = |delivery, decode_error: Option<&str>| DeadLetter {
        queue: "dead.sms".into(),
        channel: Some(Channel::Sms),
        death_reason: "delivery_limit".into(),
        decode_error: decode_error.map(str::to_owned),
        delivery,
        delivery_count: 3,
        payload: vec![1, 2, 3],
    };
    ledger
        .record_dead_letter(&letter(Some(poison.message_pointer()), None), op)
        .await
        .unwrap();
    ledger
        .record_dead_letter(&letter(None, Some("undecodable")), op)
        .await
        .unwrap();
    redrives(&ledger, dead[1], dead[2], dead[3]).await;

    let report = ledger.dlq_report(None, now).await.unwrap();
    let sms_only = ledger.dlq_report(Some(Channel::Sms), now).await.unwrap();
    let email_only = ledger.dlq_report(Some(Channel::Email), now).await.unwrap();

    let shape: Vec<_> = report
        .deliveries
        .iter()
        .map(|g| {
            (
                g.channel,
                g.state,
                g.reason.as_deref().unwrap_or("-"),
                g.count,
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (
                Channel::Email,
                DeliveryState::Ambiguous,
                "maybe_sent: http_500",
                1
            ),
            (Channel::Sms, DeliveryState::DeadLettered, "http_400", 4),
            (
                Channel::Sms,
                DeliveryState::DeadLettered,
                "poison_message: delivery_limit",
                1
            ),
        ]
    );
    let http_400 = &report.deliveries[1];
    assert_eq!(
        http_400
            .by_age
            .iter()
            .map(|(b, n)| (*b, *n))
            .collect::<Vec<_>>(),
        [
            (AgeBand::UnderHour, 1),
            (AgeBand::HoursOneToSix, 2),
            (AgeBand::DaysOneToSeven, 1)
        ]
    );
    assert_eq!(http_400.sample_ids.len(), 3, "at most three samples");
    assert!(http_400.sample_ids.iter().all(|id| dead.contains(id)));
    assert_eq!(
        http_400.redrive_pending, 1,
        "the fed item and the finished redrive's item do not wait"
    );
    assert_eq!(
        report.deliveries[2].by_age.get(&AgeBand::OverWeek),
        Some(&1)
    );
    assert_eq!(report.deliveries[2].sample_ids, [poison.id]);
    assert_eq!(report.deliveries[0].redrive_pending, 0);
    let letters: Vec<_> = report
        .dead_letters
        .iter()
        .map(|l| (l.queue.as_str(), l.action.as_str(), l.count))
        .collect();
    assert_eq!(
        letters,
        [
            ("dead.sms", "delivery_dead_lettered", 1),
            ("dead.sms", "recorded", 1)
        ]
    );
    assert_eq!(report.dead_letters[0].latest_recorded_at, op);
    assert_eq!(sms_only.deliveries.len(), 2);
    assert_eq!(sms_only.dead_letters.len(), 2);
    assert_eq!(email_only.deliveries.len(), 1);
    assert!(email_only.dead_letters.is_empty());

    let trace = ledger.trace_delivery(dead[1], now).await.unwrap().unwrap();
    let membership = &trace.deliveries[0].redrives;
    assert_eq!(membership.len(), 1);
    assert!(membership[0].pending);
    assert_eq!(membership[0].redrive_state, "running");
    assert_eq!(membership[0].incident.as_deref(), Some("INC-7"));
}
