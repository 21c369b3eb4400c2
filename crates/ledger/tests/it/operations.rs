#![allow(clippy::unwrap_used, clippy::expect_used)]

//! Channel drain and ownership: a draining channel gets no new delivery until the drain ends,
//! its attempts carry the drain's incident; work handed to another sender is neither claimed
//! nor leased by nudge; the incident export pages through its attempts.

use nudge_domain::{
    AttemptContext, Channel, FixedJitter, IdempotencySupport, RetryPolicy, SendOutcome, decide,
};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    AttemptRecord, AutoPause, LeaseOutcome, Ledger, Operator, ProducerAck, RedriveFilter,
    StartedRedrive, WindowOutcome,
};
use sqlx::PgPool;

fn incident_ops(incident: &str) -> Operator {
    Operator::new("ops@clinic", Some("provider incident"), t0())
        .unwrap()
        .with_incident(Some(incident))
        .unwrap()
}

async fn deliveries_on(ledger: &Ledger, channel: Channel) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE channel = $1")
        .bind(channel.as_str())
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

async fn deliver(ledger: &Ledger, channel: Channel, now: chrono::DateTime<chrono::Utc>) -> usize {
    let due = ledger.claim_due(channel, 100, at(now)).await.unwrap();
    for d in &due {
        let lease = leased(lease(ledger, d, now).await);
        let decision = decide(
            &AttemptContext {
                attempt_number: 1,
                expires_at: lease.expires_at,
                idempotency: IdempotencySupport::Honoured,
            },
            &SendOutcome::Response {
                status: 202,
                retry_after: None,
                provider_message_id: None,
            },
            now,
            &RetryPolicy::default(),
            &mut FixedJitter::zero(),
        );
        let attempt = AttemptRecord {
            started_at: now,
            finished_at: now,
            worker: "worker-1".into(),
            correlation_id: None,
        };
        record(ledger, &lease, &decision, &attempt, now).await;
    }
    due.len()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_draining_channel_gets_nothing_new_until_the_drain_ends(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    // Owed before the drain: it finishes during it.
    owed(&ledger, a.id, "before", &[Channel::Sms], t0()).await;

    let change = ledger
        .set_draining(Channel::Sms, true, &incident_ops("INC-9"), at(t0()))
        .await
        .unwrap();
    assert!(change.changed);
    assert!(
        !ledger
            .set_draining(Channel::Sms, true, &incident_ops("INC-9"), at(t0()))
            .await
            .unwrap()
            .changed,
        "turning it on twice changes nothing"
    );

    // Created during the drain: a due reminder for sms and email, and one in a window. The
    // creation says what it really scheduled: email only.
    let during = ledger
        .create_reminder(
            &reminder(a.id, "during", &[Channel::Sms, Channel::Email], t0()),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    assert_eq!(during.deliveries_created, 1);
    let reminder = reminder(a.id, "windowed", &[Channel::Sms], t0() + secs(30));
    ledger
        .create_reminder(&reminder, &cipher(), t0())
        .await
        .unwrap();
    let window = ledger
        .materialise_window(a.id, t0(), t0() + secs(60), t0())
        .await
        .unwrap();
    assert_eq!(
        window,
        WindowOutcome::Materialised {
            deliveries_created: 0,
            occurrences_created: 0,
            series_unexpandable: 0
        }
    );
    assert_eq!(
        deliveries_on(&ledger, Channel::Sms).await,
        1,
        "only the one from before"
    );
    assert_eq!(
        deliveries_on(&ledger, Channel::Email).await,
        1,
        "email is not draining"
    );
    // The drain estimate counts no withheld reminder as arriving work.
    assert_eq!(
        ledger
            .arrivals(Channel::Sms, t0() + secs(1), t0() + secs(60))
            .await
            .unwrap(),
        0
    );

    // The owed work finishes, its attempt tagged with the drain's incident.
    assert_eq!(deliver(&ledger, Channel::Sms, t0() + secs(1)).await, 1);
    let tagged: Vec<Option<String>> = sqlx::query_scalar("SELECT incident FROM attempts")
        .fetch_all(ledger.pool())
        .await
        .unwrap();
    assert_eq!(tagged, vec![Some("INC-9".to_owned())]);
    let status = ledger.status(t0()).await.unwrap();
    let sms = status.iter().find(|s| s.channel == Channel::Sms).unwrap();
    assert!(sms.draining);
    assert_eq!(sms.drain_incident.as_deref(), Some("INC-9"));

    // A redrive waits for the drain.
    sqlx::query("UPDATE deliveries SET state = 'dead_lettered' WHERE channel = 'sms'")
        .execute(ledger.pool())
        .await
        .unwrap();
    let filter = RedriveFilter {
        channel: Channel::Sms,
        tenant: None,
        max_age: None,
        limit: None,
    };
    let StartedRedrive { id, .. } = ledger
        .execute_redrive(
            &filter,
            10.0,
            None,
            &incident_ops("INC-9"),
            at(t0() + secs(2)),
        )
        .await
        .unwrap();
    let rules = AutoPause {
        max_throttled_ratio: 0.5,
        window: std::time::Duration::from_secs(60),
        min_attempts: 100,
        max_new_work_age: std::time::Duration::from_secs(3600),
    };
    let ticks = ledger
        .redrive_tick(&rules, 100, at(t0() + secs(4)))
        .await
        .unwrap();
    assert!(ticks[0].waiting_for_drain && ticks[0].fed == 0, "{ticks:?}");

    // Off: the withheld deliveries whose time has come or whose window ran are created at once.
    let off = ledger
        .set_draining(Channel::Sms, false, &incident_ops("INC-9"), at(t0()))
        .await
        .unwrap();
    assert_eq!(off.released, 2, "the due one and the windowed one");
    assert_eq!(deliveries_on(&ledger, Channel::Sms).await, 3);
    assert_eq!(
        ledger
            .arrivals(Channel::Sms, t0() + secs(1), t0() + secs(60))
            .await
            .unwrap(),
        1,
        "the windowed one, now scheduled"
    );
    let ticks = ledger
        .redrive_tick(&rules, 100, at(t0() + secs(5)))
        .await
        .unwrap();
    assert_eq!(ticks[0].fed, 1, "the redrive goes on after the drain: {id}");
    let actions: Vec<String> = ledger
        .recent_audit(10)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.action)
        .collect();
    assert!(actions.contains(&"drain_on".to_owned()));
    assert_eq!(actions[..2], ["drain_release", "drain_off"]);
    // Off again: nothing changes, nothing is withheld.
    let again = ledger
        .set_draining(Channel::Sms, false, &incident_ops("INC-9"), at(t0()))
        .await
        .unwrap();
    assert_eq!((again.changed, again.released), (false, 0));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn work_handed_to_another_sender_is_neither_claimed_nor_leased(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    owed(&ledger, a.id, "queued", &[Channel::Sms], t0()).await;
    let queued = ledger.claim_due(Channel::Sms, 10, at(t0())).await.unwrap();
    owed(&ledger, a.id, "scheduled", &[Channel::Sms], t0()).await;

    let change = ledger
        .set_channel_owner(Channel::Sms, "legacy", &ops(t0()))
        .await
        .unwrap();
    assert_eq!((change.previous.as_str(), change.moved), ("nudge", 2));
    // New work follows the channel's owner.
    owed(&ledger, a.id, "new", &[Channel::Sms], t0()).await;
    let owners: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT owner FROM deliveries WHERE channel = 'sms'")
            .fetch_all(ledger.pool())
            .await
            .unwrap();
    assert_eq!(owners, vec!["legacy".to_owned()]);

    // nudge's relay claims none of it; its worker leases none of it.
    assert!(
        ledger
            .claim_due(Channel::Sms, 10, at(t0()))
            .await
            .unwrap()
            .is_empty()
    );
    assert!(matches!(
        lease(&ledger, &queued[0], t0()).await,
        LeaseOutcome::OwnedBy(owner) if owner == "legacy"
    ));
    // Nor does a redrive take a dead letter of theirs.
    sqlx::query(
        "UPDATE deliveries SET state = 'dead_lettered', settled_at = now(), next_attempt_at = NULL
         WHERE id = (SELECT d.id FROM deliveries d JOIN reminders r ON r.id = d.reminder_id
                     WHERE r.event_id = 'scheduled')",
    )
    .execute(ledger.pool())
    .await
    .unwrap();
    let filter = RedriveFilter {
        channel: Channel::Sms,
        tenant: None,
        max_age: None,
        limit: None,
    };
    let plan = ledger.plan_redrive(&filter, 1.0, at(t0())).await.unwrap();
    assert_eq!(plan.eligible, 0);
    sqlx::query(
        "UPDATE deliveries SET state = 'scheduled', settled_at = NULL, next_attempt_at = $1
         WHERE state = 'dead_lettered'",
    )
    .bind(t0())
    .execute(ledger.pool())
    .await
    .unwrap();
    // The other sender's handle does.
    let legacy = ledger.clone().for_sender("legacy").unwrap();
    assert_eq!(
        legacy
            .claim_due(Channel::Sms, 10, at(t0()))
            .await
            .unwrap()
            .len(),
        2
    );

    // Handed back: the previous owner is remembered, nothing else was touched.
    let back = ledger
        .set_channel_owner(Channel::Sms, "nudge", &ops(t0()))
        .await
        .unwrap();
    assert_eq!((back.previous.as_str(), back.moved), ("legacy", 3));
    let controls = ledger.channel_controls().await.unwrap();
    let sms = controls.iter().find(|c| c.channel == Channel::Sms).unwrap();
    assert_eq!(
        (sms.owner.as_str(), sms.previous_owner.as_deref()),
        ("nudge", Some("legacy"))
    );
    assert!(
        ledger
            .set_channel_owner(Channel::Sms, "Not An Owner", &ops(t0()))
            .await
            .is_err()
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_incident_export_pages_through_its_attempts_only(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    // Five sent before the incident, three owed when the drain starts.
    for i in 0..5 {
        owed(&ledger, a.id, &format!("r{i}"), &[Channel::Sms], t0()).await;
    }
    deliver(&ledger, Channel::Sms, t0()).await;
    owed(&ledger, a.id, "tagged-0", &[Channel::Sms], t0()).await;
    owed(&ledger, a.id, "tagged-1", &[Channel::Sms], t0()).await;
    owed(&ledger, a.id, "tagged-2", &[Channel::Sms], t0()).await;
    ledger
        .set_draining(Channel::Sms, true, &incident_ops("INC-3"), at(t0()))
        .await
        .unwrap();
    assert_eq!(deliver(&ledger, Channel::Sms, t0() + secs(1)).await, 3);

    let first = ledger.incident_attempts("INC-3", 0, 2).await.unwrap();
    assert_eq!(first.len(), 2);
    let rest = ledger
        .incident_attempts("INC-3", first[1].id, 2)
        .await
        .unwrap();
    assert_eq!(rest.len(), 1);
    assert!(
        first
            .iter()
            .chain(&rest)
            .all(|a| a.incident == "INC-3" && a.outcome_class == "delivered" && a.channel == "sms")
    );
    assert!(
        ledger
            .incident_attempts("INC-other", 0, 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn producers_acknowledge_their_latest_pass_only_forward(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger
        .ack_producer_pass("p-1", t0() + secs(5))
        .await
        .unwrap();
    ledger.ack_producer_pass("p-1", t0()).await.unwrap();
    ledger.ack_producer_pass("p-2", t0()).await.unwrap();
    let acks = ledger.producer_acks(t0() - secs(30)).await.unwrap();
    let ack = |instance: &str, pass_started_at| ProducerAck {
        instance: instance.to_owned(),
        pass_started_at,
    };
    assert_eq!(acks, vec![ack("p-1", t0() + secs(5)), ack("p-2", t0())]);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn work_withheld_by_a_drain_that_ends_while_its_tenant_is_paused_is_scheduled_on_resume(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    ledger
        .set_draining(Channel::Sms, true, &incident_ops("INC-5"), at(t0()))
        .await
        .unwrap();
    // Due now, for sms and email: email goes, sms is held.
    owed(&ledger, a.id, "both", &[Channel::Sms, Channel::Email], t0()).await;
    assert_eq!(deliveries_on(&ledger, Channel::Sms).await, 0);
    // The tenant is paused before the drain ends: the release leaves its reminder alone...
    ledger
        .set_intake_paused(a.id, true, &ops(t0() + secs(1)))
        .await
        .unwrap();
    let off = ledger
        .set_draining(
            Channel::Sms,
            false,
            &incident_ops("INC-5"),
            at(t0() + secs(2)),
        )
        .await
        .unwrap();
    assert_eq!(off.released, 0);
    // ...and the watchdog skips a paused tenant, so the resume must create it.
    ledger
        .set_intake_paused(a.id, false, &ops(t0() + secs(3)))
        .await
        .unwrap();
    assert_eq!(deliveries_on(&ledger, Channel::Sms).await, 1);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_watchdog_repairs_a_missing_channel_but_not_one_withheld_by_a_drain(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    let both = owed(&ledger, a.id, "both", &[Channel::Sms, Channel::Email], t0()).await;
    // The sms delivery lost (as a bug would lose it: settled, then deleted); email is still
    // there.
    for statement in [
        "UPDATE deliveries SET state = 'cancelled', settled_at = now(), next_attempt_at = NULL
         WHERE reminder_id = $1 AND channel = 'sms'",
        "DELETE FROM deliveries WHERE reminder_id = $1 AND channel = 'sms'",
    ] {
        sqlx::query(statement)
            .bind(both.as_uuid())
            .execute(ledger.pool())
            .await
            .unwrap();
    }
    ledger
        .set_draining(Channel::Email, true, &incident_ops("INC-6"), at(t0()))
        .await
        .unwrap();
    let held = owed(&ledger, a.id, "held", &[Channel::Email], t0()).await;
    let repaired = ledger
        .repair_orphaned_reminders(
            t0() - secs(3600),
            t0() + secs(600),
            std::time::Duration::from_secs(120),
            100,
        )
        .await
        .unwrap();
    assert_eq!(repaired, 1, "the sms one only");
    assert_eq!(ledger.deliveries_of_reminder(both).await.unwrap().len(), 2);
    assert!(
        ledger
            .deliveries_of_reminder(held)
            .await
            .unwrap()
            .is_empty()
    );
}
