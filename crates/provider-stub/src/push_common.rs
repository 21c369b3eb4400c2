//! What the push shapes share: the header their script's key is read from.

use axum::http::{HeaderMap, HeaderValue};

/// Longest key taken, as the generic API.
const MAX_KEY_LEN: usize = 255;

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
