//! The intake's integration tests, one binary: the HTTP API, the commit path, provider receipts and
//! the server's limits, each against a fresh database.

mod api;
mod away;
mod commit;
mod consent;
mod events;
mod inbound;
mod preferences;
mod quiet_hours;
mod receipts;
mod series;
mod server;
mod zones;
