#![allow(clippy::unwrap_used, clippy::expect_used)]

//! Redrive: the dry run counts what the execute freezes, feeding is paced, ids and history are
//! kept, and a redrive pauses itself on 429s, on late new work and on a failed canary.

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{
    AttemptContext, Channel, DeliveryId, DeliveryState, EventId, FixedJitter, IdempotencySupport,
    Lane, RetryPolicy, SendOutcome, SubscriberRef, decide,
};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    AttemptRecord, AutoPause, Exclusion, LeasedDelivery, Ledger, NewReminder, Operator, Recorded,
    RedriveFilter, RedriveState, StartedRedrive,
};
use sqlx::PgPool;

fn response(status: u16) -> SendOutcome {
    SendOutcome::Response {
        status,
        retry_after: None,
        provider_message_id: (status / 100 == 2).then(|| "prov-1".to_owned()),
    }
}

/// Decides `outcome` for a held lease at `now` and records it.
async fn answer(ledger: &Ledger, lease: &LeasedDelivery, outcome: SendOutcome, now: DateTime<Utc>) {
    answer_with(ledger, lease, outcome, &RetryPolicy::default(), now).await;
}

/// [`answer`] under `policy`, counting attempts from the last redrive as the worker does;
/// returns the decision recorded.
async fn answer_with(
    ledger: &Ledger,
    lease: &LeasedDelivery,
    outcome: SendOutcome,
    policy: &RetryPolicy,
    now: DateTime<Utc>,
) -> nudge_domain::Decision {
    let ctx = AttemptContext {
        attempt_number: lease.attempt_number - lease.attempt_base,
        expires_at: lease.expires_at,
        idempotency: IdempotencySupport::Honoured,
    };
    let decision = decide(&ctx, &outcome, now, policy, &mut FixedJitter::new(1_000));
    let attempt = AttemptRecord {
        started_at: now,
        finished_at: now,
        worker: "worker-1".into(),
        correlation_id: None,
    };
    assert_eq!(
        record(ledger, lease, &decision, &attempt, now).await,
        Recorded::Applied
    );
    decision
}

fn sms() -> RedriveFilter {
    RedriveFilter {
        channel: Channel::Sms,
        tenant: None,
        max_age: None,
        limit: None,
    }
}

fn rules() -> AutoPause {
    AutoPause {
        max_throttled_ratio: 0.2,
        window: Duration::from_secs(60),
        min_attempts: 5,
        max_new_work_age: Duration::from_secs(600),
    }
}

fn incident_ops(now: DateTime<Utc>) -> Operator {
    Operator::new("ops@clinic", Some("provider back"), now)
        .unwrap()
        .with_incident(Some("INC-42"))
        .unwrap()
}

async fn state_of(ledger: &Ledger, id: DeliveryId) -> DeliveryState {
    ledger.delivery(id).await.unwrap().unwrap().state
}

/// Now, for the tests below: an hour after the dead letters were made.
fn now() -> DateTime<Utc> {
    t0() + secs(3600)
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_dry_run_counts_what_the_execute_freezes(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    let day = secs(86_400);
    for i in 0..5 {
        dead_letter(&ledger, a.id, &format!("fresh-{i}"), t0(), day).await;
    }
    // Expired before the redrive.
    dead_letter(&ledger, a.id, "expired", t0(), secs(60)).await;
    // Scheduled two days before now: older than a one-day max age.
    dead_letter(
        &ledger,
        a.id,
        "old",
        now() - secs(2 * 86_400),
        secs(3 * 86_400),
    )
    .await;
    // Expiring 15 s after now: at 0.1/s, the soonest-expiring go first, at now and now + 10 s;
    // the third's turn, at now + 20 s, comes after its expiry.
    for i in 1..=3 {
        dead_letter(&ledger, a.id, &format!("soon-{i}"), t0(), secs(3600 + 15)).await;
    }
    // A paused tenant's dead letter.
    let b = ledger.create_tenant("clinic-b", &ops(t0())).await.unwrap();
    dead_letter(&ledger, b.id, "paused", t0(), day).await;
    ledger
        .set_intake_paused(b.id, true, &ops(t0()))
        .await
        .unwrap();
    // A send that may have happened: held, never redriven.
    sqlx::query(
        "UPDATE deliveries SET state = 'ambiguous', last_error_reason = 'maybe_sent: http_500'
         WHERE id = (SELECT d.id FROM deliveries d JOIN reminders r ON r.id = d.reminder_id
                     WHERE r.event_id = 'fresh-4')",
    )
    .execute(ledger.pool())
    .await
    .unwrap();

    let filter = RedriveFilter {
        max_age: Some(Duration::from_secs(86_400)),
        ..sms()
    };
    let plan = ledger.plan_redrive(&filter, 0.1, at(now())).await.unwrap();
    // fresh-0..3 and two of the soon-*.
    assert_eq!(plan.eligible, 6, "{plan:?}");
    let excluded = |e| plan.excluded.get(&e).copied().unwrap_or(0);
    assert_eq!(excluded(Exclusion::Ambiguous), 1);
    assert_eq!(excluded(Exclusion::Expired), 1);
    assert_eq!(excluded(Exclusion::OlderThanMaxAge), 1);
    assert_eq!(excluded(Exclusion::TenantPaused), 1);
    assert_eq!(excluded(Exclusion::WouldExpireBeforeTurn), 1);
    assert_eq!(plan.reasons[0].reason, "http_400");
    assert!((plan.expected_drain_s - 60.0).abs() < 1e-9);
    // The dry run wrote nothing.
    assert!(ledger.redrives(10).await.unwrap().is_empty());

    let StartedRedrive { id, plan: executed } = ledger
        .execute_redrive(&filter, 0.1, None, &incident_ops(now()), at(now()))
        .await
        .unwrap();
    assert_eq!(executed.eligible, plan.eligible);
    assert_eq!(executed.excluded, plan.excluded);
    assert_eq!(executed.eligible_by_age, plan.eligible_by_age);
    let status = ledger.redrive_status(id).await.unwrap().unwrap();
    assert_eq!(status.selected, 6);
    assert_eq!(status.state, RedriveState::Running);
    assert_eq!(status.incident.as_deref(), Some("INC-42"));
    let items: i64 = sqlx::query_scalar("SELECT count(*) FROM redrive_items WHERE redrive_id = $1")
        .bind(id.get())
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    assert_eq!(items, 6);
    // Nothing moves until the janitor feeds it.
    let still_dead: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state = 'dead_lettered'")
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    assert_eq!(still_dead, 10);

    // The items waiting in it are not selected twice, and a second redrive on the channel is
    // refused while this one is active.
    let again = ledger.plan_redrive(&sms(), 0.1, at(now())).await.unwrap();
    assert_eq!(again.excluded.get(&Exclusion::AlreadyInRedrive), Some(&6));
    let refused = ledger
        .execute_redrive(&sms(), 1.0, None, &incident_ops(now()), at(now()))
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains(&format!("redrive {id}")),
        "{refused}"
    );

    let audit = ledger.recent_audit(1).await.unwrap().remove(0);
    assert_eq!(audit.action, "redrive_start");
    assert_eq!(audit.incident.as_deref(), Some("INC-42"));
    assert_eq!(audit.details["selected"], 6);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn feeding_is_paced_and_keeps_ids_keys_and_history(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(dead_letter(&ledger, a.id, &format!("dl-{i}"), t0(), secs(86_400)).await);
    }
    let keys: Vec<_> = {
        let mut keys = Vec::new();
        for id in &ids {
            keys.push(ledger.delivery(*id).await.unwrap().unwrap().idempotency_key);
        }
        keys
    };
    let StartedRedrive { id, .. } = ledger
        .execute_redrive(&sms(), 2.0, None, &incident_ops(now()), at(now()))
        .await
        .unwrap();

    // At 2/s: one at once, then two a second; a tick that comes late gets at most five
    // seconds' worth, never all the time it missed.
    let mut fed_by = Vec::new();
    for t in [0, 1, 2, 10] {
        let ticks = ledger
            .redrive_tick(&rules(), 1000, at(now() + secs(t)))
            .await
            .unwrap();
        fed_by.push(ticks.iter().map(|t| t.fed).sum::<u64>());
    }
    assert_eq!(fed_by, vec![1, 2, 2, 10]);
    let status = ledger.redrive_status(id).await.unwrap().unwrap();
    assert_eq!(status.fed, 15);
    assert_eq!(status.fed_by_state.get("retry_wait"), Some(&15));
    assert!((status.remaining_s - 2.5).abs() < 1e-9);

    for t in 11..=13 {
        ledger
            .redrive_tick(&rules(), 1000, at(now() + secs(t)))
            .await
            .unwrap();
    }
    let status = ledger.redrive_status(id).await.unwrap().unwrap();
    assert_eq!((status.fed, status.state), (20, RedriveState::Finished));

    for (id, key) in ids.iter().zip(&keys) {
        let d = ledger.delivery(*id).await.unwrap().unwrap();
        assert_eq!(d.state, DeliveryState::RetryWait);
        assert_eq!(d.lane, Lane::Redrive);
        assert_eq!(&d.idempotency_key, key, "the key survives the redrive");
        assert_eq!(d.attempt_count, 1);
        assert!(d.settled_at.is_none());
        assert!(d.next_attempt_at.unwrap() <= now() + secs(13));
    }

    // The next attempt is a new one, numbered after the first, with a fresh budget, and it
    // carries the redrive's incident.
    let later = now() + secs(14);
    let due = ledger
        .claim_due(Channel::Sms, 100, at(later))
        .await
        .unwrap();
    assert_eq!(due.len(), 20);
    assert!(due.iter().all(|d| d.lane == Lane::Redrive));
    let lease = leased(lease(&ledger, &due[0], later).await);
    assert_eq!((lease.attempt_number, lease.attempt_base), (2, 1));
    answer(&ledger, &lease, response(202), later).await;
    let history = ledger.attempts(lease.id).await.unwrap();
    assert_eq!(history.len(), 2);
    assert_eq!(history[1].lane, Lane::Redrive);
    let incident: Option<String> = sqlx::query_scalar(
        "SELECT incident FROM attempts WHERE delivery_id = $1 AND attempt_number = 2",
    )
    .bind(lease.id.as_uuid())
    .fetch_one(ledger.pool())
    .await
    .unwrap();
    assert_eq!(incident.as_deref(), Some("INC-42"));
    assert_eq!(state_of(&ledger, lease.id).await, DeliveryState::Delivered);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_redrive_pauses_itself_on_429s_and_resumes_without_catching_up(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    for i in 0..30 {
        dead_letter(&ledger, a.id, &format!("dl-{i}"), t0(), secs(86_400)).await;
    }
    let StartedRedrive { id, .. } = ledger
        .execute_redrive(&sms(), 10.0, None, &incident_ops(now()), at(now()))
        .await
        .unwrap();
    let t1 = now() + secs(1);
    ledger.redrive_tick(&rules(), 1000, at(t1)).await.unwrap();
    // The provider answers 429 to all eleven sent (a second and the first item's tenth).
    let due = ledger.claim_due(Channel::Sms, 100, at(t1)).await.unwrap();
    assert_eq!(due.len(), 11);
    for d in &due {
        let lease = leased(lease(&ledger, d, t1).await);
        answer(&ledger, &lease, response(429), t1).await;
    }
    let t2 = t1 + secs(1);
    let ticks = ledger.redrive_tick(&rules(), 1000, at(t2)).await.unwrap();
    let why = ticks[0].paused.clone().expect("paused by the 429s");
    assert!(
        why.starts_with("throttled: account main answered 429 to 11 of 11"),
        "{why}"
    );
    assert_eq!(ticks[0].fed, 0);
    // Paused: nothing more is fed, however long it waits.
    assert!(
        ledger
            .redrive_tick(&rules(), 1000, at(t2 + secs(30)))
            .await
            .unwrap()
            .is_empty()
    );
    let status = ledger.redrive_status(id).await.unwrap().unwrap();
    assert_eq!((status.state, status.fed), (RedriveState::Paused, 11));
    assert_eq!(status.pause_reason.as_deref(), Some(why.as_str()));
    let audit = ledger.recent_audit(1).await.unwrap().remove(0);
    assert_eq!(audit.action, "redrive_auto_pause");

    // Resumed: the 429s before the resume no longer count, and no credit came from the pause.
    let t3 = t2 + secs(60);
    ledger
        .resume_redrive(id, &incident_ops(t3), at(t3))
        .await
        .unwrap();
    let ticks = ledger
        .redrive_tick(&rules(), 1000, at(t3 + secs(1)))
        .await
        .unwrap();
    assert_eq!((ticks[0].fed, ticks[0].paused.as_deref()), (10, None));
    // Cancelled: what was not fed stays dead-lettered, what was fed carries on.
    ledger
        .cancel_redrive(id, &incident_ops(t3), at(t3))
        .await
        .unwrap();
    let status = ledger.redrive_status(id).await.unwrap().unwrap();
    assert_eq!(status.state, RedriveState::Cancelled);
    let dead: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state = 'dead_lettered'")
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    assert_eq!(dead, 9);
    let again = ledger.plan_redrive(&sms(), 10.0, at(t3)).await.unwrap();
    assert_eq!(
        again.eligible, 9,
        "a cancelled redrive's leftovers can be redriven"
    );
    assert!(
        ledger
            .resume_redrive(id, &incident_ops(t3), at(t3))
            .await
            .unwrap_err()
            .to_string()
            .contains("cancelled")
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_redrive_pauses_while_new_work_waits_too_long(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    dead_letter(&ledger, a.id, "dl", t0(), secs(86_400)).await;
    // New work due 11 minutes before now, not yet sent.
    owed(
        &ledger,
        a.id,
        "late-new",
        &[Channel::Sms],
        now() - secs(660),
    )
    .await;
    let StartedRedrive { id, .. } = ledger
        .execute_redrive(&sms(), 1.0, None, &incident_ops(now()), at(now()))
        .await
        .unwrap();
    let ticks = ledger
        .redrive_tick(&rules(), 1000, at(now()))
        .await
        .unwrap();
    let why = ticks[0].paused.clone().expect("paused for late new work");
    assert!(why.starts_with("new_work_waiting"), "{why}");
    let status = ledger.redrive_status(id).await.unwrap().unwrap();
    assert_eq!((status.state, status.fed), (RedriveState::Paused, 0));

    // An operator can take such a pause over: then only an operator resumes it.
    ledger
        .pause_redrive(id, &incident_ops(now()), at(now()))
        .await
        .unwrap();
    let status = ledger.redrive_status(id).await.unwrap().unwrap();
    assert!(status.pause_reason.unwrap().starts_with("operator:"));
    assert!(
        ledger
            .redrive_tick(&rules(), 1000, at(now() + secs(1)))
            .await
            .unwrap()
            .is_empty()
    );
    sqlx::query("UPDATE redrives SET pause_reason = 'new_work_waiting: again' WHERE id = $1")
        .bind(id.get())
        .execute(ledger.pool())
        .await
        .unwrap();

    // Still late: it stays paused. Once the new work is sent, it resumes by itself, and
    // feeds from the next tick on.
    let ticks = ledger
        .redrive_tick(&rules(), 1000, at(now() + secs(1)))
        .await
        .unwrap();
    assert!(!ticks[0].resumed);
    let late = ledger
        .claim_due(Channel::Sms, 10, at(now() + secs(1)))
        .await
        .unwrap();
    assert_eq!(late.len(), 1);
    let lease = leased(lease(&ledger, &late[0], now() + secs(1)).await);
    answer(&ledger, &lease, response(202), now() + secs(1)).await;
    let ticks = ledger
        .redrive_tick(&rules(), 1000, at(now() + secs(2)))
        .await
        .unwrap();
    assert!(ticks[0].resumed, "{ticks:?}");
    let ticks = ledger
        .redrive_tick(&rules(), 1000, at(now() + secs(4)))
        .await
        .unwrap();
    assert_eq!((ticks[0].fed, ticks[0].finished), (1, true));
    let audit = ledger.recent_audit(1).await.unwrap();
    assert_eq!(audit[0].action, "redrive_auto_resume");
    // A redrive paused for 429s is not resumed by itself.
    let StartedRedrive { id: throttled, .. } = ledger
        .execute_redrive(&sms(), 1.0, None, &incident_ops(now()), at(now() + secs(5)))
        .await
        .unwrap();
    sqlx::query(
        "UPDATE redrives SET state = 'paused', pause_reason = 'throttled: test' WHERE id = $1",
    )
    .bind(throttled.get())
    .execute(ledger.pool())
    .await
    .unwrap();
    assert!(
        ledger
            .redrive_tick(&rules(), 1000, at(now() + secs(6)))
            .await
            .unwrap()
            .is_empty()
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_canary_holds_the_rest_until_it_settles_and_stops_it_on_a_5xx(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    for i in 0..6 {
        dead_letter(&ledger, a.id, &format!("dl-{i}"), t0(), secs(86_400)).await;
    }
    let filter = RedriveFilter {
        limit: Some(3),
        ..sms()
    };
    let StartedRedrive { id: first, .. } = ledger
        .execute_redrive(&filter, 100.0, Some(2), &incident_ops(now()), at(now()))
        .await
        .unwrap();
    let t1 = now() + secs(1);
    let ticks = ledger.redrive_tick(&rules(), 1000, at(t1)).await.unwrap();
    assert_eq!(ticks[0].fed, 2, "only the canary is fed");
    let t2 = t1 + secs(1);
    let ticks = ledger.redrive_tick(&rules(), 1000, at(t2)).await.unwrap();
    assert_eq!(
        (ticks[0].fed, ticks[0].paused.as_deref()),
        (0, None),
        "the rest waits for the canary"
    );
    // Both canaries delivered: the rest goes.
    for d in ledger.claim_due(Channel::Sms, 100, at(t2)).await.unwrap() {
        let lease = leased(lease(&ledger, &d, t2).await);
        answer(&ledger, &lease, response(202), t2).await;
    }
    let t3 = t2 + secs(1);
    let ticks = ledger.redrive_tick(&rules(), 1000, at(t3)).await.unwrap();
    assert_eq!((ticks[0].fed, ticks[0].finished), (1, true));
    assert!(
        ledger
            .redrive_status(first)
            .await
            .unwrap()
            .unwrap()
            .canary_passed_at
            .is_some()
    );

    for d in ledger.claim_due(Channel::Sms, 100, at(t3)).await.unwrap() {
        let lease = leased(lease(&ledger, &d, t3).await);
        answer(&ledger, &lease, response(202), t3).await;
    }

    // A second redrive whose canary is answered 503: paused, nothing more sent.
    let StartedRedrive { id: second, .. } = ledger
        .execute_redrive(&sms(), 100.0, Some(1), &incident_ops(t3), at(t3))
        .await
        .unwrap();
    let t4 = t3 + secs(1);
    ledger.redrive_tick(&rules(), 1000, at(t4)).await.unwrap();
    let due = ledger.claim_due(Channel::Sms, 100, at(t4)).await.unwrap();
    assert_eq!(due.len(), 1);
    // Released until later by a 503 that honours the key: still owed, but the canary failed.
    let lease = leased(lease(&ledger, &due[0], t4).await);
    answer(&ledger, &lease, response(503), t4).await;
    let ticks = ledger
        .redrive_tick(&rules(), 1000, at(t4 + secs(1)))
        .await
        .unwrap();
    let why = ticks[0].paused.clone().expect("paused by the canary");
    assert!(why.starts_with("canary_failed: 1 of 1"), "{why}");
    // The operator looked and resumes: it goes on past the canary.
    ledger
        .resume_redrive(second, &incident_ops(t4 + secs(2)), at(t4 + secs(2)))
        .await
        .unwrap();
    let ticks = ledger
        .redrive_tick(&rules(), 1000, at(t4 + secs(3)))
        .await
        .unwrap();
    assert_eq!((ticks[0].fed, ticks[0].finished), (2, true));
    let status = ledger.redrive_status(second).await.unwrap().unwrap();
    assert_eq!((status.fed, status.state), (3, RedriveState::Finished));
}

/// The selection's "would expire before its turn" is SQL; on the same dead letters it must
/// exclude exactly those the drain model's `turn_at` says miss their turn: the k-th eligible,
/// earliest deadline first, is excluded when it expires at or before `turn_at(now, k, rate)`.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_turn_rule_in_sql_is_the_drain_models(pool: PgPool) {
    use nudge_domain::drain::turn_at;

    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    // Seconds from now to each expiry: at 0.5/s the turns are 2 s apart (0, 2, 4, ...), so
    // some expire exactly at their turn, some just before, some after; one has expired.
    for (i, s) in [1, 2, 2, 5, 7, 8, 13, 20, 600, -10].into_iter().enumerate() {
        dead_letter(&ledger, a.id, &format!("dl-{i}"), t0(), secs(3600 + s)).await;
    }
    let mut dead: Vec<(uuid::Uuid, DateTime<Utc>)> =
        sqlx::query_as("SELECT id, expires_at FROM deliveries WHERE state = 'dead_lettered'")
            .fetch_all(ledger.pool())
            .await
            .unwrap();
    dead.sort_by_key(|&(id, expires_at)| (expires_at, id));
    // Turns are numbered among those no earlier rule excludes (here: the expired one).
    let candidates: Vec<_> = dead.iter().filter(|(_, e)| *e > now()).collect();
    let model = |rate: f64| -> Vec<uuid::Uuid> {
        (1u64..)
            .zip(&candidates)
            .filter(|(k, (_, expires_at))| {
                turn_at(now(), *k, rate).is_some_and(|turn| *expires_at > turn)
            })
            .map(|(_, (id, _))| *id)
            .collect()
    };

    for rate in [0.5, 0.1, 3.0] {
        let plan = ledger.plan_redrive(&sms(), rate, at(now())).await.unwrap();
        let eligible = model(rate);
        assert_eq!(
            plan.eligible,
            eligible.len() as u64,
            "at {rate}/s: {plan:?}"
        );
        assert_eq!(
            plan.excluded
                .get(&Exclusion::WouldExpireBeforeTurn)
                .copied()
                .unwrap_or(0),
            (candidates.len() - eligible.len()) as u64,
            "at {rate}/s: {plan:?}"
        );
    }

    let StartedRedrive { id, .. } = ledger
        .execute_redrive(&sms(), 0.5, None, &incident_ops(now()), at(now()))
        .await
        .unwrap();
    let mut selected: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT delivery_id FROM redrive_items WHERE redrive_id = $1")
            .bind(id.get())
            .fetch_all(ledger.pool())
            .await
            .unwrap();
    selected.sort();
    let mut eligible = model(0.5);
    eligible.sort();
    // Turns at 0, 2, 4, ... s: 1 s is after the first (now), 13 s, 20 s and 600 s after the
    // 7th, 8th and 9th (12, 14 and 16 s); 2 s is exactly the second's turn and misses it.
    assert_eq!(eligible.len(), 4);
    assert_eq!(selected, eligible);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_attempt_limit_dead_letters_with_the_deadline_kept_and_a_redrive_gets_a_fresh_budget(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    let policy = RetryPolicy::new(
        Duration::from_secs(1),
        Duration::from_secs(1),
        3,
        Duration::from_secs(60),
    )
    .unwrap();
    let created = ledger
        .create_reminder(
            &NewReminder::new(
                a.id,
                EventId::parse("limited").unwrap(),
                SubscriberRef::parse("patient-0001").unwrap(),
                &[Channel::Sms],
                t0(),
                t0() + secs(86_400),
            )
            .unwrap(),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    ledger
        .materialise_reminder(a.id, created.id, t0())
        .await
        .unwrap();
    // Three 503s, the clock moved past each backoff instead of sleeping.
    let mut clock = t0();
    let mut last = None;
    for _ in 0..3 {
        let due = ledger.claim_due(Channel::Sms, 10, at(clock)).await.unwrap();
        assert_eq!(due.len(), 1, "due again at {clock}");
        let lease = leased(lease(&ledger, &due[0], clock).await);
        last = Some(answer_with(&ledger, &lease, response(503), &policy, clock).await);
        clock += secs(2);
    }
    let last = last.unwrap();
    assert_eq!(last.next_state, DeliveryState::DeadLettered);
    assert_eq!(
        last.facts.reason.as_deref(),
        Some("attempts_exhausted: http_503")
    );
    let id = ledger.deliveries_of_reminder(created.id).await.unwrap()[0].id;
    let dead = ledger.delivery(id).await.unwrap().unwrap();
    assert_eq!(dead.expires_at, t0() + secs(86_400), "the deadline is kept");

    // Redriven: the same deadline, a fourth attempt, and a fresh budget of three.
    let StartedRedrive { id: redrive, .. } = ledger
        .execute_redrive(&sms(), 10.0, None, &incident_ops(clock), at(clock))
        .await
        .unwrap();
    ledger
        .redrive_tick(&rules(), 100, at(clock + secs(1)))
        .await
        .unwrap();
    clock += secs(2);
    let due = ledger.claim_due(Channel::Sms, 10, at(clock)).await.unwrap();
    let lease = leased(lease(&ledger, &due[0], clock).await);
    assert_eq!((lease.attempt_number, lease.attempt_base), (4, 3));
    assert_eq!(lease.expires_at, t0() + secs(86_400));
    let decision = answer_with(&ledger, &lease, response(503), &policy, clock).await;
    assert_eq!(
        decision.next_state,
        DeliveryState::RetryWait,
        "the first attempt of the redrive is 1 of 3, not 4 of 3"
    );
    assert_eq!(ledger.attempts(id).await.unwrap().len(), 4, "history kept");
    let status = ledger.redrive_status(redrive).await.unwrap().unwrap();
    assert_eq!(status.fed_by_state.get("retry_wait"), Some(&1));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_slow_rate_with_slow_ticks_still_feeds_at_the_rate(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    for i in 0..10 {
        dead_letter(&ledger, a.id, &format!("dl-{i}"), t0(), secs(86_400)).await;
    }
    // Half an item a second, the janitor passing every 1.5 s: the fraction carries over.
    ledger
        .execute_redrive(&sms(), 0.5, None, &incident_ops(now()), at(now()))
        .await
        .unwrap();
    let mut fed = Vec::new();
    for tick in 0..=4 {
        let t = now() + chrono::Duration::milliseconds(1_500 * tick);
        let ticks = ledger.redrive_tick(&rules(), 1000, at(t)).await.unwrap();
        fed.push(ticks[0].fed);
    }
    // 0 s: the first at once; then one every 2 s (at 3 s and 4.5 s, carrying 0.5 s over).
    assert_eq!(fed, vec![1, 0, 1, 1, 1]);
    // A janitor away for a minute gets five seconds' worth, not thirty items.
    let ticks = ledger
        .redrive_tick(&rules(), 1000, at(now() + secs(66)))
        .await
        .unwrap();
    assert_eq!(ticks[0].fed, 2);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_canary_that_is_dead_lettered_again_stops_the_redrive(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    for i in 0..3 {
        dead_letter(&ledger, a.id, &format!("dl-{i}"), t0(), secs(86_400)).await;
    }
    let StartedRedrive { id, .. } = ledger
        .execute_redrive(&sms(), 100.0, Some(1), &incident_ops(now()), at(now()))
        .await
        .unwrap();
    let t1 = now() + secs(1);
    ledger.redrive_tick(&rules(), 1000, at(t1)).await.unwrap();
    // The provider still refuses it (400): settled, but not delivered.
    for d in ledger.claim_due(Channel::Sms, 10, at(t1)).await.unwrap() {
        let lease = leased(lease(&ledger, &d, t1).await);
        answer(&ledger, &lease, response(400), t1).await;
    }
    let ticks = ledger
        .redrive_tick(&rules(), 1000, at(t1 + secs(1)))
        .await
        .unwrap();
    let why = ticks[0].paused.clone().expect("paused by the canary");
    assert!(why.starts_with("canary_failed: 1 of 1"), "{why}");
    let status = ledger.redrive_status(id).await.unwrap().unwrap();
    assert_eq!((status.state, status.fed), (RedriveState::Paused, 1));
}
