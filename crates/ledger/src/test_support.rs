//! Fixtures for the tests of the ledger and of the crates built on it (the worker's, the
//! janitor's): a tenant, a reminder owed, claimed as the relay claims it, leased as a worker
//! leases it and its outcome recorded, against the database `#[sqlx::test]` gives each test,
//! migrated with the real schema. Time is either fixed ([`t0`], [`at`]) or the database's
//! ([`db_now`], [`published`]).
//!
//! Compiled only with the `test-support` feature, which the workspace turns on for
//! dev-dependencies alone: it must never be part of a shipped binary. A failed unwrap here is a
//! failed test, with its location.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use nudge_domain::{
    AdmissionSettings, Channel, Decision, EventId, IdempotencySupport, ProviderAccount, ReminderId,
    SubscriberRef, TenantId,
};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::{
    AttemptRecord, Destination, DestinationCipher, DueDelivery, LeaseBatch, LeaseOutcome,
    LeasedDelivery, Ledger, LedgerTime, NewReminder, Operator, OutcomeToRecord, Recorded,
    SubscriberKey, Tenant, WorkerRoutes,
};

/// The fixed instant the tests that move time start from.
pub fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 29, 9, 0, 0).unwrap()
}

pub fn secs(n: i64) -> chrono::Duration {
    chrono::Duration::seconds(n)
}

pub const LEASE: Duration = Duration::from_secs(60);

/// How long a delivery routed to an account no live worker has waits before its next look.
pub const ACCOUNT_RECHECK: Duration = Duration::from_secs(30);

/// The destination key of [`cipher`]: a worker opening what the fixtures sealed is given it.
pub const DESTINATION_KEY: [u8; 32] = [42; 32];

/// Seals destinations with [`DESTINATION_KEY`] and keys subscriber references.
pub fn cipher() -> DestinationCipher {
    DestinationCipher::new(&DESTINATION_KEY).with_subscriber_key(SubscriberKey::new(&[43u8; 32]))
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

/// `n` SMS deliveries of `tenant`, `scheduled`, in one statement (reminder and delivery each,
/// no contact): the g-th due at `due - g x step_ms` milliseconds, expiring a day after `due`.
/// For tests that need a large batch, as a bulk import leaves it.
pub async fn bulk_due_sms(
    pool: &PgPool,
    tenant_id: TenantId,
    n: i64,
    due: DateTime<Utc>,
    step_ms: i64,
) {
    sqlx::query(
        "WITH r AS (
             INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels,
                                    scheduled_at, expires_at, created_at)
             SELECT gen_random_uuid(), $1, 'bulk-' || g, 'p', ARRAY['sms'],
                    $2 - g * $4 * interval '1 millisecond', $2 + interval '1 day', $2
             FROM generate_series(1, $3::bigint) g
             RETURNING id, tenant_id, scheduled_at, expires_at)
         INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
             scheduled_at, expires_at, next_attempt_at, created_at, updated_at)
         SELECT gen_random_uuid(), r.id, r.tenant_id, 'sms', 'scheduled',
                'nudge-' || r.id::text || '-sms', r.scheduled_at, r.expires_at, r.scheduled_at,
                $2, $2
         FROM r",
    )
    .bind(tenant_id.as_uuid())
    .bind(due)
    .bind(n)
    .bind(step_ms)
    .execute(pool)
    .await
    .unwrap();
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
        account_recheck: ACCOUNT_RECHECK,
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

/// A worker's leasing kit, owned (its routes on [`routes`], the default admission settings and
/// [`cipher`]), so that a test borrows a [`LeaseBatch`] from it in a line.
#[derive(Debug)]
pub struct Leaser {
    pub routes: WorkerRoutes,
    pub admission: AdmissionSettings,
    pub cipher: DestinationCipher,
}

impl Leaser {
    /// A worker on the accounts `main` (its default) and `other`, with `idempotency`.
    pub fn new(idempotency: IdempotencySupport) -> Self {
        Leaser {
            routes: routes(idempotency),
            admission: settings(),
            cipher: cipher(),
        }
    }

    /// Its batch lease of `channel` as `lease_holder`, holding leases for [`LEASE`], at `at`.
    pub fn batch<'a>(
        &'a self,
        channel: Channel,
        lease_holder: &'a str,
        at: LedgerTime,
    ) -> LeaseBatch<'a> {
        batch_of(
            channel,
            lease_holder,
            &self.routes,
            &self.admission,
            &self.cipher,
            at,
        )
    }
}

/// The same database as `pool`, connected as `role` (one of the roles the migrations create
/// for each binary).
pub async fn connected_as(pool: &PgPool, role: &str) -> Ledger {
    let options = (*pool.connect_options()).clone().username(role);
    let connected = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    Ledger::from_pool(connected)
}

/// Runs `sql` as `role` on its own connection of `pool`; the SQLSTATE it failed with, or `None`
/// when it succeeded.
pub async fn as_role(pool: &PgPool, role: &str, sql: &str) -> Option<String> {
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SET ROLE {role}")))
        .execute(&mut *conn)
        .await
        .unwrap();
    let result = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut *conn)
        .await;
    // A statement that failed inside BEGIN leaves the transaction open and aborted.
    sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.ok();
    sqlx::query("RESET ROLE").execute(&mut *conn).await.unwrap();
    result.err().map(|e| match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()).unwrap_or_default(),
        other => other.to_string(),
    })
}

/// The database's clock, which the workers' statements use.
pub async fn db_now(ledger: &Ledger) -> DateTime<Utc> {
    ledger.clock(LedgerTime::Database).await.unwrap()
}

/// The tenant `clinic`, created on first use.
pub async fn clinic(ledger: &Ledger) -> Tenant {
    if let Some(tenant) = ledger.tenant_by_name("clinic").await.unwrap() {
        return tenant;
    }
    let now = db_now(ledger).await;
    ledger
        .create_tenant("clinic", &Operator::new("ops", Some("test"), now).unwrap())
        .await
        .unwrap()
}

/// `subscriber`'s contact in [`clinic`] on `channel`: `destination`, sealed with [`cipher`].
pub async fn contact(ledger: &Ledger, subscriber: &str, channel: Channel, destination: &str) {
    let tenant = clinic(ledger).await;
    ledger
        .upsert_contact(
            tenant.id,
            &SubscriberRef::parse(subscriber).unwrap(),
            channel,
            &Destination::new(destination),
            &cipher(),
            db_now(ledger).await,
        )
        .await
        .unwrap();
}

/// A reminder of [`clinic`] for `subscriber` on `channel`, due `due_in` from `now` and expiring
/// `expires_in` from `now`, created and materialised at `now`; returns its id.
pub async fn owed_from(
    ledger: &Ledger,
    now: DateTime<Utc>,
    channel: Channel,
    event: &str,
    subscriber: &str,
    due_in: chrono::Duration,
    expires_in: chrono::Duration,
) -> ReminderId {
    let tenant = clinic(ledger).await;
    let created = ledger
        .create_reminder(
            &NewReminder::new(
                tenant.id,
                EventId::parse(event).unwrap(),
                SubscriberRef::parse(subscriber).unwrap(),
                &[channel],
                now + due_in,
                now + expires_in,
            )
            .unwrap(),
            &cipher(),
            now,
        )
        .await
        .unwrap();
    ledger
        .materialise_reminder(tenant.id, created.id, now)
        .await
        .unwrap();
    created.id
}

/// [`owed_from`] the database's now, due by then and claimed, as the relay would: its delivery.
pub async fn published(
    ledger: &Ledger,
    channel: Channel,
    event: &str,
    subscriber: &str,
    due_in: chrono::Duration,
    expires_in: chrono::Duration,
) -> DueDelivery {
    let now = db_now(ledger).await;
    let reminder = owed_from(ledger, now, channel, event, subscriber, due_in, expires_in).await;
    let mut claimed = ledger
        .claim_due(channel, 100, LedgerTime::Database)
        .await
        .unwrap();
    claimed
        .iter()
        .position(|d| d.reminder_id == reminder)
        .map(|i| claimed.swap_remove(i))
        .expect("claimed")
}

/// The ledger a process builds from its `database` section ([`Ledger::connect`]: the pool that
/// refuses and discards read-only connections), on the database `pool` is connected to.
pub async fn configured(
    pool: &PgPool,
    max_connections: u32,
    acquire_timeout_ms: u64,
) -> Result<Ledger, crate::LedgerError> {
    use sqlx::ConnectOptions;
    let url = pool.connect_options().to_url_lossy().to_string();
    Ledger::connect(&nudge_config::DatabaseConfig {
        url: nudge_config::Secret::new(url),
        max_connections,
        acquire_timeout_ms,
        ..nudge_config::DatabaseConfig::default()
    })
    .await
}

/// Turns the database `pool` is connected to read-only (`on`) or back (a server demoted and
/// promoted again, as far as its clients can tell): `ALTER DATABASE ... SET
/// default_transaction_read_only`, then every other session of that database is ended, so that
/// every client reconnects and finds the new setting (a session keeps the one it started with).
///
/// Only ever this test's own database: it refuses the database `DATABASE_URL` names (the one
/// shared by every test to create theirs) and PostgreSQL's own.
pub async fn set_read_only(pool: &PgPool, on: bool) {
    let mut conn = pool.acquire().await.unwrap();
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let shared = std::env::var("DATABASE_URL")
        .ok()
        .and_then(|url| url.parse::<sqlx::postgres::PgConnectOptions>().ok())
        .and_then(|o| o.get_database().map(str::to_owned));
    assert!(
        Some(&name) != shared.as_ref() && name != "postgres" && !name.starts_with("template"),
        "refusing to turn the shared database {name} read-only"
    );
    // This session may have started read-only itself.
    sqlx::query("SET default_transaction_read_only = off")
        .execute(&mut *conn)
        .await
        .unwrap();
    let quoted = format!("\"{}\"", name.replace('"', "\"\""));
    let change = if on {
        format!("ALTER DATABASE {quoted} SET default_transaction_read_only = on")
    } else {
        format!("ALTER DATABASE {quoted} RESET default_transaction_read_only")
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(change))
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    // Back to the pool as it was: a connection that started writable stays so.
    sqlx::query("RESET default_transaction_read_only")
        .execute(&mut *conn)
        .await
        .unwrap();
}

/// A reminder of `tenant` due at `scheduled_at`, expiring `ttl` later, whose SMS was answered
/// 400 (terminal) at `scheduled_at`: a dead letter with one attempt, as a redrive finds it.
pub async fn dead_letter(
    ledger: &Ledger,
    tenant: TenantId,
    event: &str,
    scheduled_at: DateTime<Utc>,
    ttl: chrono::Duration,
) -> nudge_domain::DeliveryId {
    use nudge_domain::{AttemptContext, FixedJitter, RetryPolicy, SendOutcome, decide};
    let reminder = NewReminder::new(
        tenant,
        EventId::parse(event).unwrap(),
        SubscriberRef::parse("patient-0001").unwrap(),
        &[Channel::Sms],
        scheduled_at,
        scheduled_at + ttl,
    )
    .unwrap();
    let created = ledger
        .create_reminder(&reminder, &cipher(), scheduled_at)
        .await
        .unwrap();
    ledger
        .materialise_reminder(tenant, created.id, scheduled_at)
        .await
        .unwrap();
    let due = ledger
        .claim_due(Channel::Sms, 10, at(scheduled_at))
        .await
        .unwrap()
        .remove(0);
    let lease = leased(lease(ledger, &due, scheduled_at).await);
    let ctx = AttemptContext {
        attempt_number: lease.attempt_number - lease.attempt_base,
        expires_at: lease.expires_at,
        idempotency: IdempotencySupport::Honoured,
    };
    let outcome = SendOutcome::Response {
        status: 400,
        retry_after: None,
        provider_message_id: None,
    };
    let decision = decide(
        &ctx,
        &outcome,
        scheduled_at,
        &RetryPolicy::default(),
        &mut FixedJitter::new(1_000),
    );
    let attempt = AttemptRecord {
        started_at: scheduled_at,
        finished_at: scheduled_at,
        worker: "worker-1".into(),
        correlation_id: None,
    };
    assert_eq!(
        record(ledger, &lease, &decision, &attempt, scheduled_at).await,
        Recorded::Applied
    );
    due.id
}
