//! A webhook receiver beside the providers, for what nudge sends to a client rather than to a
//! provider: the delivery events nudge-events pushes (decision 0602). The compose stack's end
//! to end run points a tenant's webhook here and reads back what arrived.
//!
//! | route | what |
//! |---|---|
//! | `POST /webhooks/{name}` | kept as it came (its Standard Webhooks headers and its body, byte for byte), answered `204` |
//! | `GET /stats/webhooks/{name}` | [`WebhookReport`]: every request kept under `name`, in arrival order (none yet: an empty list) |
//!
//! It verifies nothing: a client's check (the signature, the order, duplicates) is the
//! reader's, on exactly what was sent. Unlike a provider request, the body is kept: a delivery
//! events batch names ids, states, classes and times, never a destination, content or
//! subscriber reference. Of the headers only [`KEPT_HEADERS`] are kept (no credential a sender
//! might add). What is kept is bounded ([`KEPT_BYTES_MAX`] in all): past it a request is
//! answered `507` and not kept, a failure the sender retries like any other.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing};
use chrono::{DateTime, SubsecRound as _, Utc};
use serde::{Deserialize, Serialize};

use crate::server::{App, error};
use crate::state::StubState;
use crate::stats::rfc3339_ms;

/// The headers kept with each request: the three a Standard Webhooks receiver verifies, and
/// what says what the body is and who sent it.
pub const KEPT_HEADERS: [&str; 5] = [
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "content-type",
    "user-agent",
];

/// The most bytes (bodies, kept headers and names) kept over all webhooks until a reset.
pub const KEPT_BYTES_MAX: usize = 64 * 1024 * 1024;

/// The name a webhook is posted and read under: 1 to 64 of `a-z`, `0-9`, `-` and `_`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct WebhookName(String);

impl WebhookName {
    pub fn parse(raw: &str) -> Result<Self, WebhookNameError> {
        let allowed =
            |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_';
        if raw.is_empty() || raw.len() > 64 || !raw.chars().all(allowed) {
            return Err(WebhookNameError);
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for WebhookName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a webhook name is 1 to 64 of a-z, 0-9, '-' and '_'")]
pub struct WebhookNameError;

/// `GET /stats/webhooks/{name}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookReport {
    pub name: String,
    /// Every request kept, in arrival order.
    pub requests: Vec<WebhookRequest>,
    /// Requests answered `507` because [`KEPT_BYTES_MAX`] was reached (not kept).
    pub refused_full: u64,
}

/// One request as it came.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookRequest {
    /// When it arrived (server clock, UTC, ms).
    #[serde(with = "rfc3339_ms")]
    pub at: DateTime<Utc>,
    /// Those of [`KEPT_HEADERS`] it had, by lower-case name.
    pub headers: BTreeMap<String, String>,
    /// The body, exactly as sent (it must be UTF-8: a signature is checked over these bytes).
    pub body: String,
}

impl WebhookRequest {
    fn kept_bytes(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
    }
}

/// What every webhook was sent.
#[derive(Debug, Default)]
pub(crate) struct Webhooks {
    by_name: BTreeMap<WebhookName, Kept>,
    kept_bytes: usize,
}

#[derive(Debug, Default)]
struct Kept {
    requests: Vec<WebhookRequest>,
    refused_full: u64,
}

/// [`KEPT_BYTES_MAX`] is reached: the request was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

impl Webhooks {
    fn keep(&mut self, name: &WebhookName, request: WebhookRequest) -> Result<(), Full> {
        let size = request.kept_bytes() + name.as_str().len();
        let fits = self
            .kept_bytes
            .checked_add(size)
            .is_some_and(|total| total <= KEPT_BYTES_MAX);
        let kept = self.by_name.entry(name.clone()).or_default();
        if !fits {
            kept.refused_full += 1;
            return Err(Full);
        }
        self.kept_bytes += size;
        kept.requests.push(request);
        Ok(())
    }

    fn report(&self, name: &WebhookName) -> WebhookReport {
        let kept = self.by_name.get(name);
        WebhookReport {
            name: name.to_string(),
            requests: kept.map(|k| k.requests.clone()).unwrap_or_default(),
            refused_full: kept.map_or(0, |k| k.refused_full),
        }
    }
}

impl StubState {
    /// Keeps one request to webhook `name`; `Err(Full)` when it would pass [`KEPT_BYTES_MAX`].
    pub(crate) fn keep_webhook(
        &self,
        name: &WebhookName,
        request: WebhookRequest,
    ) -> Result<(), Full> {
        self.lock().webhooks.keep(name, request)
    }

    /// What webhook `name` was sent since the start or the last reset.
    pub fn webhook(&self, name: &WebhookName) -> WebhookReport {
        self.lock().webhooks.report(name)
    }
}

pub(crate) fn routes() -> Router<App> {
    Router::new()
        .route("/webhooks/{name}", routing::post(receive))
        .route("/stats/webhooks/{name}", routing::get(report))
}

async fn receive(
    State(app): State<App>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let name = match WebhookName::parse(&name) {
        Ok(n) => n,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let Ok(body) = String::from_utf8(body.to_vec()) else {
        return error(StatusCode::BAD_REQUEST, "the body must be UTF-8");
    };
    let body_bytes = body.len();
    let request = WebhookRequest {
        at: Utc::now().trunc_subsecs(3),
        headers: KEPT_HEADERS
            .iter()
            .filter_map(|&kept| {
                let value = headers.get(kept)?.to_str().ok()?;
                Some((kept.to_owned(), value.to_owned()))
            })
            .collect(),
        body,
    };
    match app.stub.keep_webhook(&name, request) {
        Ok(()) => {
            tracing::debug!(webhook = %name, body_bytes, "webhook request kept");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(Full) => {
            tracing::warn!(webhook = %name, body_bytes, "webhook request not kept: the receiver is full");
            error(
                StatusCode::INSUFFICIENT_STORAGE,
                "the receiver keeps no more (POST /admin/reset empties it)",
            )
        }
    }
}

async fn report(State(app): State<App>, Path(name): Path<String>) -> Response {
    match WebhookName::parse(&name) {
        Ok(name) => Json(app.stub.webhook(&name)).into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.

    use super::*;

    fn request(body: &str) -> WebhookRequest {
        WebhookRequest {
            at: Utc::now(),
            headers: BTreeMap::from([("webhook-id".to_owned(), "msg_1".to_owned())]),
            body: body.to_owned(),
        }
    }

    #[test]
    fn a_name_is_short_lower_case_letters_digits_dashes_and_underscores() {
        for good in ["demo-events", "a", "tenant_2", &"x".repeat(64)] {
            assert_eq!(WebhookName::parse(good).unwrap().as_str(), good);
        }
        for bad in ["", "Demo", "a/b", "a b", "é", "a.b", &"x".repeat(65)] {
            assert_eq!(WebhookName::parse(bad), Err(WebhookNameError), "{bad:?}");
        }
    }

    #[test]
    fn requests_are_kept_per_name_in_arrival_order() {
        let mut hooks = Webhooks::default();
        let a = WebhookName::parse("a").unwrap();
        let b = WebhookName::parse("b").unwrap();
        hooks.keep(&a, request("1")).unwrap();
        hooks.keep(&b, request("2")).unwrap();
        hooks.keep(&a, request("3")).unwrap();
        let bodies = |n: &WebhookName| -> Vec<String> {
            hooks
                .report(n)
                .requests
                .into_iter()
                .map(|r| r.body)
                .collect()
        };
        assert_eq!(bodies(&a), ["1", "3"]);
        assert_eq!(bodies(&b), ["2"]);
        let unseen = hooks.report(&WebhookName::parse("c").unwrap());
        assert!(unseen.requests.is_empty());
        assert_eq!(unseen.refused_full, 0);
    }

    #[test]
    fn past_the_bound_a_request_is_refused_and_counted_not_kept() {
        let mut hooks = Webhooks::default();
        let name = WebhookName::parse("big").unwrap();
        let half = "x".repeat(KEPT_BYTES_MAX / 2);
        hooks.keep(&name, request(&half)).unwrap();
        assert_eq!(hooks.keep(&name, request(&half)), Err(Full));
        hooks.keep(&name, request("small")).unwrap();
        let report = hooks.report(&name);
        assert_eq!(report.requests.len(), 2);
        assert_eq!(report.refused_full, 1);
    }
}
