//! The end-to-end tests that must have the machine to themselves, one binary, one test at a
//! time: the admission tests and the hostile provider hold rates and latencies to tight bounds,
//! the service faults stop and restart their own PostgreSQL and RabbitMQ (a stopped server's
//! port is taken again on its restart, and a free port picked by another test meanwhile must
//! not be that one) and time the recovery, as the ledger turned read-only does. Each test takes
//! [`alone`] before it starts anything, so no other test's processes run beside it, as when
//! each file was a binary of its own.

mod admission_common;
mod admission_isolation;
mod admission_rate_zero;
mod admission_shared_bucket;
mod fair_claiming;
mod hostile_provider;
mod ledger_read_only;
mod quiet_hours;
mod service_faults;

/// Held for the whole of a test: the tests of this binary run one after another, whatever
/// `--test-threads` says.
pub async fn alone() -> tokio::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    ONE_AT_A_TIME.lock().await
}
