//! Builders shared by the ledger's tests. Each test gets its own fresh database from
//! `#[sqlx::test]`, migrated with the real schema.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use nudge_domain::{
    AdmissionSettings, Channel, Decision, EventId, IdempotencySupport, ProviderAccount, ReminderId,
    SubscriberRef, TenantId,
};
use nudge_ledger::{
    AttemptRecord, DestinationCipher, DueDelivery, LeaseBatch, LeaseOutcome, LeasedDelivery,
    Ledger, LedgerTime, NewReminder, Operator, OutcomeToRecord, Recorded, SubscriberKey, Tenant,
    WorkerRoutes,
};

pub fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 29, 9, 0, 0).unwrap()
}

pub fn secs(n: i64) -> chrono::Duration {
    chrono::Duration::seconds(n)
}

pub const LEASE: Duration = Duration::from_secs(60);

pub fn cipher() -> DestinationCipher {
    DestinationCipher::new(&[42u8; 32]).with_subscriber_key(SubscriberKey::new(&[43u8; 32]))
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

/// The fixed instant a statement evaluates its time conditions at, in place of the database's
/// clock: the same statements production runs, with time moved by the test.
pub fn at(t: DateTime<Utc>) -> LedgerTime {
    LedgerTime::Fixed(t)
}

pub fn account(name: &str) -> ProviderAccount {
    ProviderAccount::parse(name).unwrap()
}

/// A worker's accounts: `main` (the default) and `other`, with the idempotency given.
pub fn routes(idempotency: IdempotencySupport) -> WorkerRoutes {
    WorkerRoutes {
        default: account("main"),
        accounts: vec![
            (account("main"), idempotency),
            (account("other"), idempotency),
        ],
    }
}

pub fn settings() -> AdmissionSettings {
    AdmissionSettings::default()
}

/// Claims everything due at `now` on every channel (the relay claims per channel).
pub async fn claim_all(ledger: &Ledger, now: DateTime<Utc>) -> Vec<DueDelivery> {
    let mut all = Vec::new();
    for channel in Channel::ALL {
        all.extend(ledger.claim_due(channel, 1000, at(now)).await.unwrap());
    }
    all.sort_by_key(|d| d.next_attempt_at);
    all
}

/// A worker's batch lease: `lease_holder` with `routes`, holding leases for [`LEASE`], at `now`.
pub fn batch_of<'a>(
    channel: Channel,
    lease_holder: &'a str,
    routes: &'a WorkerRoutes,
    admission: &'a AdmissionSettings,
    cipher: &'a DestinationCipher,
    at: LedgerTime,
) -> LeaseBatch<'a> {
    LeaseBatch {
        channel,
        lease_holder,
        lease_for: LEASE,
        routes,
        admission,
        cipher,
        at,
    }
}

/// Leases one message through the worker's batch lease, as `lease_holder`, with `routes`.
pub async fn lease_as(
    ledger: &Ledger,
    due: &DueDelivery,
    lease_holder: &str,
    routes: &WorkerRoutes,
    now: DateTime<Utc>,
) -> LeaseOutcome {
    let settings = settings();
    let cipher = cipher();
    let batch = batch_of(
        due.channel,
        lease_holder,
        routes,
        &settings,
        &cipher,
        at(now),
    );
    ledger
        .lease_batch(&batch, &[due.message_pointer()])
        .await
        .unwrap()
        .outcomes
        .remove(0)
}

/// Leases one message as `worker-1` on an idempotent default account.
pub async fn lease(ledger: &Ledger, due: &DueDelivery, now: DateTime<Utc>) -> LeaseOutcome {
    lease_as(
        ledger,
        due,
        "worker-1",
        &routes(IdempotencySupport::Honoured),
        now,
    )
    .await
}

/// The lease of a `Leased` outcome; panics otherwise.
pub fn leased(outcome: LeaseOutcome) -> LeasedDelivery {
    match outcome {
        LeaseOutcome::Leased { lease, .. } => lease,
        other => panic!("expected a lease, got {other:?}"),
    }
}

/// Records one outcome through the group-commit statement.
pub async fn record(
    ledger: &Ledger,
    lease: &LeasedDelivery,
    decision: &Decision,
    attempt: &AttemptRecord,
    now: DateTime<Utc>,
) -> Recorded {
    ledger
        .record_outcomes(
            &[OutcomeToRecord {
                lease,
                decision,
                attempt,
            }],
            std::time::Duration::from_secs(60),
            at(now),
        )
        .await
        .unwrap()
        .remove(0)
}
