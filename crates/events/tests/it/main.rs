//! The push's integration tests: a real ledger (a fresh database per test), the pusher
//! connected as `nudge_events`, and receivers on loopback that answer as each test scripts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod push;
mod receiver;
