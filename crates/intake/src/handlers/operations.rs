//! The operations routes: liveness and readiness. (The OpenAPI document is served by
//! [`crate::openapi`], which owns it.)
//!
//! Must never answer with, or log, anything of a tenant's; readiness asks the ledger and
//! nothing else.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use nudge_ledger::LedgerError;
use nudge_telemetry::error_chain;

use crate::state::AppState;

/// Liveness: the process answers.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "the process is up", body = String, content_type = "text/plain")))]
pub async fn healthz() -> &'static str {
    "ok"
}

/// Readiness: the ledger answers and takes writes.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "the ledger answers and takes writes", body = String, content_type = "text/plain"),
        (status = 503, description = "the ledger does not answer, or is read-only (a failover under way)", body = String, content_type = "text/plain")))]
pub async fn readyz(State(state): State<AppState>) -> Response {
    let check = state.ledger().check_writable();
    match tokio::time::timeout(std::time::Duration::from_secs(2), check).await {
        Ok(Ok(())) => (StatusCode::OK, "ready").into_response(),
        Ok(Err(LedgerError::ReadOnly)) => {
            (StatusCode::SERVICE_UNAVAILABLE, "ledger read-only").into_response()
        }
        Ok(Err(e)) => {
            tracing::warn!(error.cause_chain = %error_chain(&e), "ledger not reachable");
            (StatusCode::SERVICE_UNAVAILABLE, "ledger not reachable").into_response()
        }
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "ledger not reachable").into_response(),
    }
}
