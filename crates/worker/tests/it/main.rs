//! The worker's integration tests, one binary: its one step against a real ledger (a fresh database
//! per test) and a provider in-process.

mod answers;
mod common;
mod process;
mod push_window;
