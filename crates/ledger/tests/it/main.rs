//! The ledger's integration tests, one binary: each test gets its own fresh database from
//! `#[sqlx::test]`, migrated with the real schema.

mod audit;
mod buckets;
mod consent;
mod deliveries;
mod estimate;
mod events;
mod fail_closed;
mod failover;
mod fairness;
mod gauges;
mod heartbeat;
mod operations;
mod preferences;
mod provider_effects;
mod quiet_hours;
mod recovery;
mod redrive;
mod reminders;
mod reschedule;
mod restore;
mod retention;
mod roles;
mod schema;
mod series;
mod subscribers;
mod tenant_secrets;
mod trace;
mod webhooks;
mod zones;
