//! Builders shared by the ledger's tests. Each test gets its own fresh database from
//! `#[sqlx::test]`, migrated with the real schema.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use nudge_domain::{Channel, EventId, ReminderId, SubscriberRef, TenantId};
use nudge_ledger::{DestinationCipher, Ledger, NewReminder, Operator, Tenant};

pub fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 29, 9, 0, 0).unwrap()
}

pub fn secs(n: i64) -> chrono::Duration {
    chrono::Duration::seconds(n)
}

pub const LEASE: Duration = Duration::from_secs(60);

pub fn cipher() -> DestinationCipher {
    DestinationCipher::new(&[42u8; 32])
}

/// The operator behind the tests' changes, acting at `at`.
pub fn ops(at: DateTime<Utc>) -> Operator {
    Operator::new("ops@clinic", Some("test"), at).unwrap()
}

pub async fn tenant(ledger: &Ledger) -> Tenant {
    ledger.create_tenant("clinic-a", &ops(t0())).await.unwrap()
}

pub fn reminder(
    tenant_id: TenantId,
    event: &str,
    channels: &[Channel],
    scheduled_at: DateTime<Utc>,
) -> NewReminder {
    NewReminder::new(
        tenant_id,
        EventId::parse(event).unwrap(),
        SubscriberRef::parse("patient-0001").unwrap(),
        channels,
        scheduled_at,
        scheduled_at + secs(3600),
    )
    .unwrap()
}

/// Creates a reminder and materialises its deliveries; returns the reminder id.
pub async fn owed(
    ledger: &Ledger,
    tenant_id: TenantId,
    event: &str,
    channels: &[Channel],
    scheduled_at: DateTime<Utc>,
) -> ReminderId {
    let created = ledger
        .create_reminder(
            &reminder(tenant_id, event, channels, scheduled_at),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    ledger
        .materialise_reminder(tenant_id, created.id, t0())
        .await
        .unwrap();
    created.id
}
