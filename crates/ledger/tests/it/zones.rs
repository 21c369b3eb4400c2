//! The patient's time in the ledger: a tenant's default zone (set, audited, read with the
//! tenant), and a subscriber's zone, kept on all their contacts, given by a reminder or by
//! their contacts, and gone with an erasure.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use nudge_domain::{Channel, EventId, SubscriberRef, TenantId, Zone};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    Destination, ImportOutcome, ImportReminder, Ledger, LedgerTime, NewReminder, Operator,
};
use sqlx::PgPool;

fn zone(name: &str) -> Zone {
    Zone::parse(name).unwrap()
}

fn subscriber() -> SubscriberRef {
    SubscriberRef::parse("patient-0042").unwrap()
}

fn item(tenant: TenantId, event: &str, channel: Channel, zone: Option<Zone>) -> ImportReminder {
    ImportReminder {
        reminder: NewReminder::new(
            tenant,
            EventId::parse(event).unwrap(),
            subscriber(),
            &[channel],
            t0() + secs(3600),
            t0() + secs(7200),
        )
        .unwrap()
        .with_time_zone(zone),
        contacts: vec![(channel, Destination::new("dest-0042"))],
    }
}

/// Every contact row's zone of the subscriber, by channel.
async fn stored_zones(pool: &PgPool) -> Vec<(String, Option<String>)> {
    sqlx::query_as("SELECT channel, time_zone FROM contacts ORDER BY channel")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_tenants_zone_is_set_cleared_and_audited_and_read_with_the_tenant(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    assert_eq!(tenant.time_zone, None);
    let by = Operator::new("ops@clinic", Some("clinic moved"), t0()).unwrap();
    let previous = ledger
        .set_tenant_time_zone(tenant.id, Some(zone("Europe/Berlin")), &by)
        .await
        .unwrap();
    assert_eq!(previous, Some(None));
    let read = ledger.tenant_by_name("clinic-a").await.unwrap().unwrap();
    assert_eq!(read.time_zone, Some(zone("Europe/Berlin")));
    let fallback = ledger
        .fallback_zones(tenant.id, &subscriber(), &cipher())
        .await
        .unwrap();
    assert_eq!(fallback.tenant, Some(zone("Europe/Berlin")));
    assert_eq!(fallback.subscriber, None);

    let previous = ledger
        .set_tenant_time_zone(tenant.id, None, &by)
        .await
        .unwrap();
    assert_eq!(previous, Some(Some(zone("Europe/Berlin"))));
    assert_eq!(
        ledger.tenant(tenant.id).await.unwrap().unwrap().time_zone,
        None
    );

    let audit = ledger.recent_audit(10).await.unwrap();
    let zones: Vec<_> = audit
        .iter()
        .filter(|a| a.action == "tenant_time_zone")
        .map(|a| {
            (
                a.details["time_zone"].clone(),
                a.details["previous"].clone(),
            )
        })
        .collect();
    assert_eq!(
        zones,
        [
            (serde_json::Value::Null, serde_json::json!("Europe/Berlin")),
            (serde_json::json!("Europe/Berlin"), serde_json::Value::Null),
        ]
    );
    assert!(
        ledger
            .set_tenant_time_zone(TenantId::new(), None, &by)
            .await
            .unwrap()
            .is_none()
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reminders_zone_becomes_the_subscribers_on_every_contact_until_another_is_given(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    // An email contact stored before, without a zone.
    ledger
        .set_contacts(
            tenant.id,
            &subscriber(),
            &[(Channel::Email, Destination::new("a@example.org"))],
            None,
            None,
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    assert_eq!(
        ledger
            .subscriber_zone(tenant.id, &subscriber(), &cipher())
            .await
            .unwrap(),
        None
    );

    // A reminder for sms gives a zone: both contacts take it.
    let ny = zone("America/New_York");
    ledger
        .import_reminders(
            &[item(tenant.id, "e-1", Channel::Sms, Some(ny))],
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    let ny_name = Some(ny.name().to_owned());
    assert_eq!(
        stored_zones(&pool).await,
        [
            ("email".to_owned(), ny_name.clone()),
            ("sms".to_owned(), ny_name.clone())
        ]
    );
    assert_eq!(
        ledger
            .subscriber_zone(tenant.id, &subscriber(), &cipher())
            .await
            .unwrap(),
        Some(ny)
    );

    // One without a zone keeps it; a push contact added then has none of its own, and the
    // subscriber's zone is still read.
    ledger
        .import_reminders(
            &[item(tenant.id, "e-2", Channel::Push, None)],
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    assert_eq!(
        ledger
            .subscriber_zone(tenant.id, &subscriber(), &cipher())
            .await
            .unwrap(),
        Some(ny)
    );

    // The contacts' own write gives another: every contact takes it, the push one too.
    let london = zone("Europe/London");
    ledger
        .set_contacts(
            tenant.id,
            &subscriber(),
            &[(Channel::Email, Destination::new("a@example.org"))],
            Some(london),
            None,
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    let london_name = Some(london.name().to_owned());
    assert_eq!(
        stored_zones(&pool).await,
        [
            ("email".to_owned(), london_name.clone()),
            ("push".to_owned(), london_name.clone()),
            ("sms".to_owned(), london_name.clone())
        ]
    );

    // The first reminder posted again (its zone with it) is a duplicate: nothing changes.
    let again = ledger
        .import_reminders(
            &[item(tenant.id, "e-1", Channel::Sms, Some(ny))],
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    assert!(matches!(again[0], ImportOutcome::AlreadyPresent { .. }));
    assert_eq!(
        ledger
            .subscriber_zone(tenant.id, &subscriber(), &cipher())
            .await
            .unwrap(),
        Some(london)
    );

    // An erasure takes the zone with the contacts.
    ledger
        .erase_subscriber(
            tenant.id,
            &subscriber(),
            &cipher(),
            &ops(t0()),
            LedgerTime::Database,
        )
        .await
        .unwrap();
    assert_eq!(
        ledger
            .subscriber_zone(tenant.id, &subscriber(), &cipher())
            .await
            .unwrap(),
        None
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_schema_refuses_a_zone_that_is_not_shaped_like_a_name(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let refused = sqlx::query("UPDATE tenants SET time_zone = 'Europe/Berlin; DROP' WHERE id = $1")
        .bind(tenant.id.as_uuid())
        .execute(&pool)
        .await;
    assert!(refused.is_err());
}
