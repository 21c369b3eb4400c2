//! The janitor's integration tests, one binary: the sweep, redrive, retention and the dead-letter
//! recorder, each against a fresh database.

mod common;
mod dead_letters;
mod redrive;
mod retention;
mod sweep;
