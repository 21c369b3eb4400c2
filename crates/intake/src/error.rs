//! The intake's answers that are not successes, in one JSON shape each, documented in the
//! OpenAPI contract. Client errors say what is wrong by path and problem and never quote a
//! value; unexpected errors are a bare 500 whose detail goes only to the log (once, here).
//! The ledger away or read-only (a failover, a restart) is not unexpected: 503 with
//! `Retry-After`, logged once per outage by the router's `observe` layer.

use axum::Json;
use std::sync::Arc;

use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use nudge_ledger::input::InputError;
use nudge_telemetry::error_chain;
use serde::Serialize;
use utoipa::ToSchema;

use crate::signature::Refusal;

/// One problem with a request: where (a JSON pointer into the body, or the name of a path
/// parameter or header) and what, never the value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Problem {
    pub path: String,
    pub problem: String,
}

impl Problem {
    pub fn new(path: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            problem: problem.into(),
        }
    }

    /// A body that is not JSON: where it stopped being JSON and why. serde_json's syntax
    /// messages never quote the input; the position is kept.
    pub fn json(e: &serde_json::Error) -> Self {
        let text = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        let problem = text.strip_suffix(&suffix).unwrap_or(&text);
        Self::new(
            "",
            format!(
                "invalid JSON at line {} column {}: {problem}",
                e.line(),
                e.column()
            ),
        )
    }

    /// A reminder format's error (its path and problem, never a value), its path under
    /// `prefix`.
    pub fn input(prefix: &str, e: &InputError) -> Self {
        Self::new(format!("{prefix}{}", e.path()), e.to_string())
    }

    /// The same problem, its path under `prefix` (an item of a batch).
    pub fn under(mut self, prefix: &str) -> Self {
        self.path = format!("{prefix}{}", self.path);
        self
    }
}

/// 400: the request cannot be accepted as it is; nothing was written.
#[derive(Debug, Serialize, ToSchema)]
pub struct InvalidRequest {
    /// Always `invalid_request`.
    pub error: &'static str,
    pub errors: Vec<Problem>,
}

/// 401: the request is not authenticated; nothing was written.
#[derive(Debug, Serialize, ToSchema)]
pub struct Unauthorized {
    /// Always `unauthorized`.
    pub error: &'static str,
    /// `missing_signature`, `bad_signature` (also for a tenant that does not exist) or
    /// `stale_timestamp`.
    pub reason: &'static str,
}

/// How long a client is asked to wait (`Retry-After`, seconds) when the ledger is away or
/// read-only: a failover moves the primary's address within seconds, and a post again with
/// the same event id is idempotent.
pub const RETRY_AFTER_S: u64 = 2;

/// 404, 409, 408, 413, 415, 500, 503: what went wrong, as a code and a sentence without values
/// from the request other than the event id.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// `not_found`, `event_conflict`, `series_conflict`, `revision_conflict`, `reminder_cancelled`,
    /// `subscriber_differs`, `payload_too_large`, `unsupported_media_type`, `request_timeout`,
    /// `ledger_unavailable` or `internal`.
    pub error: &'static str,
    pub message: String,
    /// The event id concerned (409 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// The series id concerned (409 `series_conflict` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub series_id: Option<String>,
    /// The reminder's current revision (409 `revision_conflict` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_revision: Option<i64>,
    /// The category concerned (409 `category_required` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub category: Option<String>,
}

/// Every answer of the API that is not a success.
#[derive(Debug)]
pub enum ApiError {
    Invalid(Vec<Problem>),
    Unauthorized(Refusal),
    NotFound,
    SeriesNotFound,
    /// The subscriber holds no destination and has no preference (never posted, or erased).
    SubscriberNotFound,
    /// A required category cannot be switched off (409 naming it).
    CategoryRequired(String),
    EventConflict(String),
    /// The series id is used for another series (409).
    SeriesConflict(String),
    /// A replacement refused as it stands (409): a code, a sentence, and the current revision
    /// when that is why.
    Conflict {
        error: &'static str,
        message: String,
        event_id: String,
        current_revision: Option<i64>,
    },
    TooLarge,
    UnsupportedMediaType,
    Timeout,
    /// The ledger is away or read-only: 503 with `Retry-After`. The chain goes to the log once
    /// per outage (see [`LedgerAway`]); the client sees nothing of it.
    Unavailable(anyhow::Error),
    /// Logged where it is turned into a response, with its chain; the client sees nothing of it.
    Internal(anyhow::Error),
}

/// Carried by a 503 answered because the ledger is away: the error's chain, for the router's
/// `observe` layer to log once per outage.
#[derive(Debug, Clone)]
pub struct LedgerAway(pub Arc<anyhow::Error>);

impl ApiError {
    pub fn invalid(path: impl Into<String>, problem: impl Into<String>) -> Self {
        Self::Invalid(vec![Problem::new(path, problem)])
    }

    /// An error the client could not have avoided: 503 when it is the ledger being away
    /// (`nudge_ledger::is_unavailable` anywhere in its chain), else 500.
    pub fn internal(e: impl Into<anyhow::Error>) -> Self {
        let e = e.into();
        if nudge_ledger::is_unavailable(e.as_ref()) {
            Self::Unavailable(e)
        } else {
            Self::Internal(e)
        }
    }
}

pub fn error_body(status: StatusCode, error: &'static str, message: impl Into<String>) -> Response {
    (
        status,
        Json(ErrorBody {
            error,
            message: message.into(),
            event_id: None,
            series_id: None,
            current_revision: None,
            category: None,
        }),
    )
        .into_response()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            Self::Invalid(errors) => (
                StatusCode::BAD_REQUEST,
                Json(InvalidRequest {
                    error: "invalid_request",
                    errors,
                }),
            )
                .into_response(),
            Self::Unauthorized(refusal) => (
                StatusCode::UNAUTHORIZED,
                Json(Unauthorized {
                    error: "unauthorized",
                    reason: refusal.code(),
                }),
            )
                .into_response(),
            Self::NotFound => error_body(
                StatusCode::NOT_FOUND,
                "not_found",
                "no reminder with this event id for this tenant",
            ),
            Self::SeriesNotFound => error_body(
                StatusCode::NOT_FOUND,
                "not_found",
                "no series with this id for this tenant",
            ),
            Self::SubscriberNotFound => error_body(
                StatusCode::NOT_FOUND,
                "not_found",
                "this subscriber holds no destination and has no preference in this tenant",
            ),
            Self::CategoryRequired(category) => (
                StatusCode::CONFLICT,
                Json(ErrorBody {
                    error: "category_required",
                    message: format!(
                        "the category {category:?} is required: it cannot be switched off \
                         (a STOP from the destination still stops it)"
                    ),
                    event_id: None,
                    series_id: None,
                    current_revision: None,
                    category: Some(category),
                }),
            )
                .into_response(),
            Self::SeriesConflict(series_id) => (
                StatusCode::CONFLICT,
                Json(ErrorBody {
                    error: "series_conflict",
                    message: format!(
                        "series id {series_id:?} is already used for a different series"
                    ),
                    event_id: None,
                    series_id: Some(series_id),
                    current_revision: None,
                    category: None,
                }),
            )
                .into_response(),
            Self::EventConflict(event_id) => (
                StatusCode::CONFLICT,
                Json(ErrorBody {
                    error: "event_conflict",
                    message: format!(
                        "event id {event_id:?} is already used for a different reminder"
                    ),
                    event_id: Some(event_id),
                    series_id: None,
                    current_revision: None,
                    category: None,
                }),
            )
                .into_response(),
            Self::Conflict {
                error,
                message,
                event_id,
                current_revision,
            } => (
                StatusCode::CONFLICT,
                Json(ErrorBody {
                    error,
                    message,
                    event_id: Some(event_id),
                    series_id: None,
                    current_revision,
                    category: None,
                }),
            )
                .into_response(),
            Self::TooLarge => error_body(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "the body is larger than the intake accepts (intake.body_limit_bytes)",
            ),
            Self::UnsupportedMediaType => error_body(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send the body as application/json",
            ),
            Self::Timeout => error_body(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                "the request took too long to arrive",
            ),
            Self::Unavailable(e) => {
                let mut response = error_body(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ledger_unavailable",
                    "the ledger is away or read-only (a database failover or restart): send the \
                     request again after Retry-After seconds (a reminder's event id is recorded \
                     at most once)",
                );
                response
                    .headers_mut()
                    .insert(RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
                response.extensions_mut().insert(LedgerAway(Arc::new(e)));
                response
            }
            Self::Internal(e) => {
                tracing::error!(error.cause_chain = %error_chain(e.as_ref()), "request failed");
                error_body(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "the request could not be completed; it may be retried",
                )
            }
        }
    }
}
