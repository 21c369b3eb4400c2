//! Every route's handler, by resource: [`reminders`], [`subscribers`] and [`events`] (the
//! signed `/v1` API), [`receipts`] (providers' delivery receipts), [`inbound`] (patients' replies: STOP,
//! START) and [`operations`] (liveness and
//! readiness). Each states its checks in its arguments, in the order they run: its path
//! ([`crate::extract::ApiPath`]), its content type ([`crate::extract::JsonContent`]), then its
//! verified tenant and body ([`crate::auth::SignedTenant`]); a handler body starts from a
//! request that passed them all.
//!
//! A handler must never answer 2xx before the ledger committed, write anything for a refused
//! request, or answer, log or count a destination, subscriber reference or content. Nothing
//! outside `lib.rs` (the router) and [`crate::openapi`] (the document) imports a handler.

pub mod events;
pub mod inbound;
pub mod operations;
pub mod receipts;
pub mod reminders;
pub mod series;
pub mod subscribers;
