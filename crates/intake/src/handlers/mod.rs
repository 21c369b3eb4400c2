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

use axum::http::Uri;

use crate::error::ApiError;

/// `after` and `limit` of a paged query (the events and a subscriber's consent history): a
/// cursor of 0 or more (`after_is`: what it is, for the 400's message) and a page size of 1
/// to `max`, `limit` unless given. Anything else, or a value that is not a whole number in
/// range, is a 400 naming the parameter.
pub(crate) fn page_query(
    uri: &Uri,
    after_is: &str,
    limit: u32,
    max: u32,
) -> Result<(Option<i64>, u32), ApiError> {
    let mut after = None;
    let mut limit = limit;
    for (key, value) in url::form_urlencoded::parse(uri.query().unwrap_or("").as_bytes()) {
        match key.as_ref() {
            "after" => {
                after = Some(
                    value
                        .parse::<i64>()
                        .ok()
                        .filter(|v| *v >= 0)
                        .ok_or_else(|| {
                            ApiError::invalid(
                                "after",
                                format!("must be {after_is} (a whole number, 0 or more)"),
                            )
                        })?,
                );
            }
            "limit" => {
                limit = value
                    .parse::<u32>()
                    .ok()
                    .filter(|v| (1..=max).contains(v))
                    .ok_or_else(|| ApiError::invalid("limit", format!("must be 1 to {max}")))?;
            }
            _ => {
                return Err(ApiError::invalid(
                    "",
                    "the query takes only `after` and `limit`",
                ));
            }
        }
    }
    Ok((after, limit))
}
