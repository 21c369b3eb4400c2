//! nudgectl's integration tests, one binary: its commands against a fresh database each.

mod commands;
mod consent;
mod events;
mod ledger_away;
mod rates;
mod reminders_change;
mod reminders_load;
mod replication;
mod retention;
mod trace;
