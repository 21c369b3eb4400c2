//! nudgectl's integration tests, one binary: its commands against a fresh database each.

mod commands;
mod rates;
mod reminders_change;
mod reminders_load;
mod replication;
mod retention;
mod trace;
