//! Quiet hours at the lease and the fence: a delivery due inside its window goes back until
//! its end (or expires when its expiry comes first), with the reason `quiet_hours`; a lease
//! taken just before a window is not fenced inside it; the subscriber's window, zone and
//! switch, and a reminder that ignores them. Time is fixed per statement (`LedgerTime`): the
//! same statements production runs with the database's clock.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use chrono::{DateTime, Duration, Utc};
use nudge_domain::{Channel, DeferReason, QuietHours, Zone};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    FenceRefused, LeaseOutcome, Ledger, LedgerError, SendSlot, SubscriberQuietHours,
};
use sqlx::PgPool;

/// Berlin is UTC+1 at [`t0`] (2026-11-29 09:00 UTC, 10:00 in Berlin).
async fn berlin_tenant(ledger: &Ledger, from: &str, to: &str) -> nudge_ledger::Tenant {
    let tenant = tenant(ledger).await;
    ledger
        .set_tenant_time_zone(
            tenant.id,
            Some(Zone::parse("Europe/Berlin").unwrap()),
            &ops(t0()),
        )
        .await
        .unwrap();
    ledger
        .set_tenant_quiet_hours(
            tenant.id,
            Channel::Sms,
            Some(QuietHours::parse(from, to).unwrap()),
            &ops(t0()),
        )
        .await
        .unwrap()
        .expect("the tenant exists");
    tenant
}

async fn row(
    ledger: &Ledger,
    id: nudge_domain::DeliveryId,
) -> (String, Option<DateTime<Utc>>, Option<String>, i32) {
    sqlx::query_as(
        "SELECT state, next_attempt_at, last_error_reason, attempt_count FROM deliveries
         WHERE id = $1",
    )
    .bind(id.as_uuid())
    .fetch_one(ledger.pool())
    .await
    .unwrap()
}

fn minutes(n: i64) -> Duration {
    Duration::minutes(n)
}

#[sqlx::test(migrations = "../../migrations")]
async fn a_delivery_due_inside_its_quiet_hours_goes_back_until_they_end_then_is_sent(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    // 09:30-10:30 in Berlin: t0 (10:00) is inside; the window ends at 09:30 UTC, before the
    // reminder's expiry (an hour after t0).
    let tenant = berlin_tenant(&ledger, "09:30", "10:30").await;
    owed(&ledger, tenant.id, "evt-1", &[Channel::Sms], t0()).await;
    let due = claim_all(&ledger, t0()).await.remove(0);
    let end = t0() + minutes(30);
    match lease(&ledger, &due, t0()).await {
        LeaseOutcome::Released { until, reason, .. } => {
            assert_eq!((until, reason), (end, DeferReason::QuietHours));
        }
        other => panic!("expected it given back for its quiet hours, got {other:?}"),
    }
    assert_eq!(
        row(&ledger, due.id).await,
        (
            "retry_wait".into(),
            Some(end),
            Some("quiet_hours".into()),
            0
        ),
        "no attempt spent, due at the window's end, the reason recorded"
    );
    // Counted as deferred by quiet hours, per tenant and per channel, and not as eligible.
    let gauges = ledger.gauges(at(t0())).await.unwrap();
    let work = gauges
        .work
        .iter()
        .find(|w| w.channel == Channel::Sms)
        .unwrap();
    assert_eq!(
        (work.quiet_hours, work.due, work.oldest_eligible_age_s),
        (1, 0, None)
    );
    let status = ledger.status(t0()).await.unwrap();
    let sms = status.iter().find(|s| s.channel == Channel::Sms).unwrap();
    assert_eq!((sms.quiet_hours, sms.due), (1, 0));
    // Not claimed before the end; claimed and sent at it, the reason cleared.
    assert!(
        claim_all(&ledger, end - Duration::seconds(1))
            .await
            .is_empty()
    );
    let again = claim_all(&ledger, end).await.remove(0);
    let lease = leased(lease(&ledger, &again, end).await);
    assert_eq!(lease.attempt_number, 1);
    let (state, _, reason, _) = row(&ledger, due.id).await;
    assert_eq!((state.as_str(), reason), ("sending", None));
}

#[sqlx::test(migrations = "../../migrations")]
async fn a_delivery_whose_quiet_hours_outlast_its_expiry_expires_with_that_reason(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    // 09:30-11:30 in Berlin ends at 10:30 UTC, after the expiry (10:00 UTC).
    let tenant = berlin_tenant(&ledger, "09:30", "11:30").await;
    owed(&ledger, tenant.id, "evt-1", &[Channel::Sms], t0()).await;
    let due = claim_all(&ledger, t0()).await.remove(0);
    assert!(matches!(
        lease(&ledger, &due, t0()).await,
        LeaseOutcome::QuietHoursExpired
    ));
    let (state, next, reason, attempts) = row(&ledger, due.id).await;
    assert_eq!(
        (state.as_str(), next, reason.as_deref(), attempts),
        ("expired", None, Some("quiet_hours"), 0)
    );
    let settled: Option<DateTime<Utc>> =
        sqlx::query_scalar("SELECT settled_at FROM deliveries WHERE id = $1")
            .bind(due.id.as_uuid())
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    assert_eq!(settled, Some(t0()));
    let status = ledger.status(t0()).await.unwrap();
    let sms = status.iter().find(|s| s.channel == Channel::Sms).unwrap();
    assert_eq!(sms.expired_quiet_hours, 1, "its own count in status");
}

/// Leased at 10:29:59.900 in Berlin, its slot 0.2 s later: the fence at 10:30:00.100 refuses
/// it (the window 10:30-11:00 has begun) and gives it back until 11:00; the same lease fenced
/// at 10:29:59.950 is sent.
#[sqlx::test(migrations = "../../migrations")]
async fn a_send_whose_slot_comes_after_the_window_starts_is_not_fenced(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = berlin_tenant(&ledger, "10:30", "11:00").await;
    let start = t0() + minutes(30);
    let leased_at = start - Duration::milliseconds(100);
    for (event, fence_at, sent) in [
        ("evt-late", start + Duration::milliseconds(100), false),
        ("evt-early", start - Duration::milliseconds(50), true),
    ] {
        owed(&ledger, tenant.id, event, &[Channel::Sms], leased_at).await;
        let due = claim_all(&ledger, leased_at).await.remove(0);
        ledger
            .ensure_bucket(&account("main"), Channel::Sms, 100.0, 10, leased_at)
            .await
            .unwrap();
        sqlx::query("UPDATE rate_buckets SET paused_until = $1")
            .bind(leased_at + Duration::milliseconds(200))
            .execute(ledger.pool())
            .await
            .unwrap();
        let LeaseOutcome::Leased {
            lease,
            slot: SendSlot::At { reserved_at, .. },
            ..
        } = lease(&ledger, &due, leased_at).await
        else {
            panic!("expected a lease waiting for its slot");
        };
        assert_eq!(lease.quiet.map(|q| q.next_start), Some(start));
        sqlx::query("UPDATE rate_buckets SET paused_until = NULL")
            .execute(ledger.pool())
            .await
            .unwrap();
        let fenced = ledger
            .fence(
                &lease,
                reserved_at,
                LEASE,
                std::time::Duration::from_secs(10),
                at(fence_at),
            )
            .await
            .unwrap();
        if sent {
            assert!(fenced.is_ok(), "{event}: {fenced:?}");
            assert_eq!(row(&ledger, due.id).await.0, "sending");
        } else {
            let end = t0() + minutes(60);
            assert_eq!(fenced, Err(FenceRefused::QuietHours { until: Some(end) }));
            assert_eq!(
                row(&ledger, due.id).await,
                (
                    "retry_wait".into(),
                    Some(end),
                    Some("quiet_hours".into()),
                    0
                )
            );
        }
    }
}

/// The subscriber's own zone and window decide over the tenant's; a subscriber who switched
/// them off, and a reminder that ignores them, are sent inside the tenant's window.
#[sqlx::test(migrations = "../../migrations")]
async fn the_subscribers_zone_and_window_decide_and_a_switch_or_the_reminder_can_lift_them(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    // The tenant's 09:30-10:30 in Berlin covers t0; in New York (04:00 at t0) it does not.
    let tenant = berlin_tenant(&ledger, "09:30", "10:30").await;
    let subscriber = nudge_domain::SubscriberRef::parse("patient-0001").unwrap();
    ledger
        .upsert_contact(
            tenant.id,
            &subscriber,
            Channel::Sms,
            &nudge_ledger::Destination::new("+15550001"),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    let set = |sql: &'static str| {
        let pool = ledger.pool().clone();
        async move { sqlx::query(sql).execute(&pool).await.unwrap() }
    };
    set("UPDATE contacts SET time_zone = 'America/New_York'").await;
    owed(&ledger, tenant.id, "evt-zone", &[Channel::Sms], t0()).await;
    let due = claim_all(&ledger, t0()).await.remove(0);
    let lease1 = leased(lease(&ledger, &due, t0()).await);
    // The next window in New York: 09:30 there, 14:30 UTC.
    assert_eq!(
        lease1.quiet.map(|q| q.next_start),
        Some(t0() + minutes(330))
    );

    // Their own window 03:00-04:30 covers 04:00 in New York: back until 04:30 there. Given
    // with their email contact, it is the subscriber's, so it holds for the SMS too.
    let quiet = |setting: SubscriberQuietHours, at: DateTime<Utc>| {
        let ledger = ledger.clone();
        let subscriber = subscriber.clone();
        async move {
            ledger
                .set_contacts(
                    tenant.id,
                    &subscriber,
                    &[(
                        Channel::Email,
                        nudge_ledger::Destination::new("a@example.org"),
                    )],
                    None,
                    Some(setting),
                    &cipher(),
                    at,
                )
                .await
                .unwrap();
        }
    };
    quiet(
        SubscriberQuietHours::Own(QuietHours::parse("03:00", "04:30").unwrap()),
        t0(),
    )
    .await;
    owed(&ledger, tenant.id, "evt-own", &[Channel::Sms], t0()).await;
    let due = claim_all(&ledger, t0()).await.remove(0);
    match lease(&ledger, &due, t0()).await {
        LeaseOutcome::Released { until, reason, .. } => {
            assert_eq!(
                (until, reason),
                (t0() + minutes(30), DeferReason::QuietHours)
            );
        }
        other => panic!("expected it given back until 04:30 in New York, got {other:?}"),
    }

    // Switched off: sent, though the tenant's window in the tenant's zone would cover it.
    set("UPDATE contacts SET time_zone = NULL").await;
    quiet(SubscriberQuietHours::Off, t0() + Duration::seconds(1)).await;
    owed(&ledger, tenant.id, "evt-off", &[Channel::Sms], t0()).await;
    let due = claim_all(&ledger, t0()).await.remove(0);
    assert!(leased(lease(&ledger, &due, t0()).await).quiet.is_none());

    // Back to the tenant's window; the reminder ignores quiet hours, which counts only while
    // the tenant allows it.
    quiet(SubscriberQuietHours::Tenant, t0() + Duration::seconds(2)).await;
    for (event, allowed) in [("evt-urgent-1", false), ("evt-urgent-2", true)] {
        ledger
            .set_tenant_quiet_hours_ignorable(tenant.id, allowed, &ops(t0()))
            .await
            .unwrap();
        let id = owed(&ledger, tenant.id, event, &[Channel::Sms], t0()).await;
        sqlx::query("UPDATE reminders SET ignore_quiet_hours = true WHERE id = $1")
            .bind(id.as_uuid())
            .execute(ledger.pool())
            .await
            .unwrap();
        let due = claim_all(&ledger, t0()).await.remove(0);
        match lease(&ledger, &due, t0()).await {
            LeaseOutcome::Leased { lease, .. } => {
                assert!(allowed, "{event}: sent though the tenant does not allow it");
                assert!(lease.quiet.is_none());
            }
            LeaseOutcome::Released { reason, .. } => {
                assert!(!allowed, "{event}: held though the tenant allows it");
                assert_eq!(reason, DeferReason::QuietHours);
            }
            other => panic!("{event}: {other:?}"),
        }
    }
}

#[sqlx::test(migrations = "../../migrations")]
async fn quiet_hours_need_the_tenants_zone_and_each_change_is_audited(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    let hours = QuietHours::parse("21:00", "08:00").unwrap();
    let refused = ledger
        .set_tenant_quiet_hours(tenant.id, Channel::Sms, Some(hours), &ops(t0()))
        .await;
    assert!(
        matches!(refused, Err(LedgerError::InvalidInput(_))),
        "{refused:?}"
    );
    assert!(
        ledger
            .tenant_quiet_hours(tenant.id)
            .await
            .unwrap()
            .is_empty()
    );

    ledger
        .set_tenant_time_zone(
            tenant.id,
            Some(Zone::parse("Europe/London").unwrap()),
            &ops(t0()),
        )
        .await
        .unwrap();
    assert_eq!(
        ledger
            .set_tenant_quiet_hours(tenant.id, Channel::Sms, Some(hours), &ops(t0()))
            .await
            .unwrap(),
        Some(None)
    );
    // The zone cannot go while a window is read in it.
    let cleared = ledger
        .set_tenant_time_zone(tenant.id, None, &ops(t0()))
        .await;
    assert!(
        matches!(cleared, Err(LedgerError::InvalidInput(_))),
        "{cleared:?}"
    );
    let later = QuietHours::parse("22:00", "07:30").unwrap();
    assert_eq!(
        ledger
            .set_tenant_quiet_hours(tenant.id, Channel::Sms, Some(later), &ops(t0()))
            .await
            .unwrap(),
        Some(Some(hours))
    );
    assert_eq!(
        ledger.tenant_quiet_hours(tenant.id).await.unwrap(),
        vec![(Channel::Sms, later)]
    );
    assert_eq!(
        ledger
            .set_tenant_quiet_hours(tenant.id, Channel::Sms, None, &ops(t0()))
            .await
            .unwrap(),
        Some(Some(later))
    );
    assert!(
        ledger
            .set_tenant_time_zone(tenant.id, None, &ops(t0()))
            .await
            .unwrap()
            .is_some(),
        "without windows the zone may go"
    );
    let audited: Vec<serde_json::Value> = sqlx::query_scalar(
        "SELECT details FROM audit_log WHERE action = 'tenant_quiet_hours' ORDER BY id",
    )
    .fetch_all(ledger.pool())
    .await
    .unwrap();
    assert_eq!(
        audited,
        vec![
            serde_json::json!({"channel": "sms", "quiet_hours": "21:00-08:00", "previous": null}),
            serde_json::json!({"channel": "sms", "quiet_hours": "22:00-07:30", "previous": "21:00-08:00"}),
            serde_json::json!({"channel": "sms", "quiet_hours": null, "previous": "22:00-07:30"}),
        ]
    );
    assert_eq!(
        ledger
            .set_tenant_quiet_hours_ignorable(tenant.id, true, &ops(t0()))
            .await
            .unwrap(),
        Some(false)
    );
    assert!(
        ledger
            .tenant(tenant.id)
            .await
            .unwrap()
            .unwrap()
            .quiet_hours_ignorable
    );
}
