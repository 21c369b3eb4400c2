//! The end-to-end tests that can share a process, one binary: each starts its own processes,
//! database and broker namespace ([`nudge_e2e::TestEnv`]), and none measures a rate or a
//! latency against a bound tight enough that another test's load beside it would move it, or
//! stops a service. They run two at a time, as the tests of one file always did.
//!
//! Kept apart: `alone` (the tests that need the machine to themselves, one at a time),
//! `faults` and `recovery_drill` (their tests run two at a time beside each other only, as
//! their bounds were set); each says why at its top.

mod config_example;
mod consent;
mod console_browser;
mod deploy_configs;
mod events_push;
mod fail_closed;
mod intake;
mod observability;
mod observability_catalog;
mod phi_scan;
mod pipeline;
mod provider_kinds;
mod push_providers;
mod reschedule_race;
mod restore_refusal;
mod retries;
mod series;
mod traces;
