//! What the push shapes share with the generic API: the key header and held answers.

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio_util::sync::CancellationToken;

use crate::server::MAX_HANG;
use crate::state::Reply;

/// Longest key taken, as the generic API.
const MAX_KEY_LEN: usize = 255;

/// The `Idempotency-Key` header: the key, or why it is refused.
pub(crate) fn key_header(headers: &HeaderMap) -> (Option<&str>, Option<&'static str>) {
    key_of(headers, "idempotency-key")
}

/// A header used as the script's key: the value, or why it is refused.
pub(crate) fn key_of<'h>(
    headers: &'h HeaderMap,
    name: &str,
) -> (Option<&'h str>, Option<&'static str>) {
    match headers.get(name).map(HeaderValue::to_str) {
        None => (None, None),
        Some(Ok(k)) if !k.is_empty() && k.len() <= MAX_KEY_LEN => (Some(k), None),
        Some(_) => (
            None,
            Some("the key header must be 1 to 255 visible ASCII characters"),
        ),
    }
}

/// Carries out a reply's delay or hang. A hang answers (504) only when it ends without the
/// client having gone: that answer is returned; otherwise `None`, and the caller answers.
pub(crate) async fn hold(reply: &Reply, shutdown: &CancellationToken) -> Option<Response> {
    if reply.hang {
        tokio::select! {
            () = tokio::time::sleep(MAX_HANG) => {}
            () = shutdown.cancelled() => {}
        }
        return Some(StatusCode::GATEWAY_TIMEOUT.into_response());
    }
    if let Some(delay) = reply.delay {
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.cancelled() => {}
        }
    }
    None
}
