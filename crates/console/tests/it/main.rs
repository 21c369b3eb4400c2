//! The console over a real ledger (a fresh database per test), connected as `nudge_console`,
//! served on loopback and driven over HTTP as a browser would (cookies, forms, redirects not
//! followed so that each answer is seen).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod console;
