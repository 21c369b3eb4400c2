//! Recurring reminders (series) of the `/v1` API: post, read and cancel. A series is recorded
//! at once against its tenant as the ledger has it; its occurrences become reminders as the
//! producer's windows reach them (`nudge_ledger` series). Must never answer before commit,
//! write anything for a refused request, or answer or log a destination, subscriber
//! reference or content; a refused rule is named by its kind, never quoted.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use nudge_domain::series::{Occurrence, SeriesLimits};
use nudge_ledger::input::TenantField;
use nudge_ledger::input::series::{MAX_PER_DAY, SeriesInput, SeriesProblem};
use nudge_ledger::{LedgerTime, NewSeries, SeriesOutcome, occurrence_event_id};
use serde_json::Value;

use crate::auth::{FromCache, SignedTenant};
use crate::error::{ApiError, ErrorBody, InvalidRequest, Problem, Unauthorized};
use crate::extract::{ApiPath, JsonContent};
use crate::shapes::{
    CORRELATION_HEADER, OccurrenceShape, SeriesAccepted, SeriesBody, SeriesCancelAnswer,
    SeriesState, channel_name,
};
use crate::state::AppState;

/// Record a recurring reminder (series).
///
/// Answered after commit: 202 when recorded, 200 when the same series (same body) was recorded
/// before, 409 when the series id is used for another. Occurrences before the post are not
/// created; those the producer's horizon already passed are created with the post; the rest
/// as the producer's windows reach them.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/series", tag = "series",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex HMAC-SHA256 of \"<t>\\n<METHOD>\\n<path>\\n<body>\">"),
        ("X-Correlation-Id" = Option<String>, Header, description = "1 to 128 printable ASCII characters; generated when absent or invalid"),
    ),
    request_body(content = SeriesBody, content_type = "application/json"),
    responses(
        (status = 202, description = "recorded", body = SeriesAccepted),
        (status = 200, description = "the same series again", body = SeriesAccepted),
        (status = 400, description = "invalid (an unknown zone, a rule that never ends, goes too far ahead or happens too often); nothing written", body = InvalidRequest),
        (status = 401, description = "not authenticated; nothing written", body = Unauthorized),
        (status = 408, description = "the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "the series id is used for another series", body = ErrorBody),
        (status = 413, description = "the body is over the limit", body = ErrorBody),
        (status = 415, description = "the body is not JSON", body = ErrorBody),
        (status = 500, description = "unexpected; may be retried", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn post_series(
    State(state): State<AppState>,
    ApiPath(_tenant): ApiPath<String>,
    _: JsonContent,
    signed: SignedTenant<FromCache>,
) -> Result<Response, ApiError> {
    let correlation = super::reminders::correlation_id(&signed.headers);
    let value: Value = serde_json::from_slice(&signed.body)
        .map_err(|e| ApiError::Invalid(vec![Problem::json(&e)]))?;
    let tenant = signed.from_ledger(&state).await?;
    let canonical = serde_json::to_vec(&value).map_err(ApiError::internal)?;
    let parsed = parse(&state, tenant.id, value)?;
    if parsed.ignore_quiet_hours {
        let allowed = state
            .ledger()
            .tenant(tenant.id)
            .await
            .map_err(ApiError::internal)?
            .is_some_and(|t| t.quiet_hours_ignorable);
        if !allowed {
            return Err(ApiError::invalid(
                "/quiet_hours",
                "\"ignore\" is not allowed for this tenant's reminders (an operator allows it \
                 with nudgectl tenant set --quiet-hours-ignorable true)",
            ));
        }
    }
    let digest = state
        .cipher()
        .request_digest(tenant.id, &canonical)
        .map_err(ApiError::internal)?;
    let new = parsed
        .series
        .with_request_digest(digest)
        .with_correlation_id(&correlation)
        .map_err(|_| ApiError::invalid("X-Correlation-Id", "is not a valid correlation id"))?;
    let outcome = state
        .ledger()
        .create_series(&new, &parsed.contacts, state.cipher(), state.now())
        .await
        .map_err(ApiError::internal)?;
    let (status, label, created) = match outcome {
        SeriesOutcome::Created {
            occurrences_created,
            ..
        } => (StatusCode::ACCEPTED, "accepted", occurrences_created),
        SeriesOutcome::AlreadyPresent { .. } => (StatusCode::OK, "duplicate", 0),
        SeriesOutcome::Conflict => {
            return Err(ApiError::SeriesConflict(new.series_id().to_owned()));
        }
        SeriesOutcome::UnknownCategory => {
            return Err(ApiError::invalid(
                "/category",
                crate::handlers::reminders::UNKNOWN_CATEGORY,
            ));
        }
        SeriesOutcome::UnknownTenant => {
            return Err(ApiError::internal(anyhow::anyhow!(
                "the tenant disappeared while its series was recorded"
            )));
        }
    };
    let upcoming = new
        .series()
        .upcoming(state.now(), nudge_ledger::SHOWN_OCCURRENCES);
    let mut response = (
        status,
        Json(SeriesAccepted {
            series_id: new.series_id().to_owned(),
            status: label,
            occurrences_created: created,
            correlation_id: correlation.clone(),
            upcoming: shapes(new.series_id(), &upcoming),
        }),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&correlation) {
        response.headers_mut().insert(CORRELATION_HEADER, v);
    }
    Ok(response)
}

/// A series: its rule, how many occurrences were created and sent, and the next ones (no
/// PHI).
#[utoipa::path(get, path = "/v1/tenants/{tenant}/series/{series_id}", tag = "series",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("series_id" = String, Path, description = "the client's series id", min_length = 1, max_length = 180, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the (empty) body"),
    ),
    responses(
        (status = 200, description = "the series", body = SeriesState),
        (status = 400, description = "invalid series id", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 404, description = "no such series", body = ErrorBody),
        (status = 500, description = "unexpected", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn get_series(
    State(state): State<AppState>,
    ApiPath((_, series_id)): ApiPath<(String, String)>,
    SignedTenant { tenant, .. }: SignedTenant,
) -> Result<Response, ApiError> {
    check_id(&series_id)?;
    let status = state
        .ledger()
        .series_status(tenant.id, &series_id, state.now())
        .await
        .map_err(ApiError::internal)?
        .ok_or(ApiError::SeriesNotFound)?;
    Ok(Json(SeriesState {
        upcoming: shapes(&status.series_id, &status.upcoming),
        series_id: status.series_id,
        channels: status.channels.into_iter().map(channel_name).collect(),
        time_zone: status.time_zone,
        start_local: status.start_local.format("%Y-%m-%dT%H:%M:%S").to_string(),
        rrule: status.rrule,
        expires_after_s: status.expires_after_s,
        created_at: status.created_at,
        cancelled_at: status.cancelled_at,
        next_at: status.next_at,
        occurrences_created: status.occurrences_created,
        occurrences_sent: status.occurrences_sent,
        unexpandable: status.unexpandable,
    })
    .into_response())
}

/// Cancel a series: no occurrence is created any more, every occurrence created and not sent
/// is cancelled with its deliveries (one whose send started finishes and is counted as sent).
/// Cancelling again answers `already_cancelled`.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/series/{series_id}/cancel", tag = "series",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("series_id" = String, Path, description = "the client's series id", min_length = 1, max_length = 180, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the body (usually empty)"),
    ),
    responses(
        (status = 200, description = "cancelled", body = SeriesCancelAnswer),
        (status = 400, description = "invalid series id", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 404, description = "no such series", body = ErrorBody),
        (status = 408, description = "the body did not arrive in time", body = ErrorBody),
        (status = 413, description = "the body is over the limit", body = ErrorBody),
        (status = 500, description = "unexpected", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn cancel_series(
    State(state): State<AppState>,
    ApiPath((_, series_id)): ApiPath<(String, String)>,
    SignedTenant { tenant, .. }: SignedTenant,
) -> Result<Response, ApiError> {
    check_id(&series_id)?;
    let done = state
        .ledger()
        .cancel_series(tenant.id, &series_id, None, LedgerTime::Database)
        .await
        .map_err(ApiError::internal)?
        .ok_or(ApiError::SeriesNotFound)?;
    Ok(Json(SeriesCancelAnswer {
        series_id,
        occurrences_cancelled: done.occurrences_cancelled,
        deliveries_cancelled: done.deliveries_cancelled,
        occurrences_sent: done.occurrences_sent,
        already_cancelled: done.already_cancelled,
    })
    .into_response())
}

fn check_id(series_id: &str) -> Result<(), ApiError> {
    nudge_ledger::check_series_id(series_id)
        .map_err(|_| ApiError::invalid("series_id", "is 1 to 180 visible ASCII characters"))
}

/// A series' body, checked, with the destinations it brings.
struct Parsed {
    series: NewSeries,
    contacts: Vec<(nudge_domain::Channel, nudge_ledger::Destination)>,
    ignore_quiet_hours: bool,
}

/// Reads a series' body (the format shared with `reminders load`): every problem found, each
/// by its field, never quoting a value.
fn parse(
    state: &AppState,
    tenant_id: nudge_domain::TenantId,
    value: Value,
) -> Result<Parsed, ApiError> {
    let problems = |found: Vec<SeriesProblem>| {
        ApiError::Invalid(
            found
                .into_iter()
                .map(|p| Problem::new(p.path, p.problem))
                .collect(),
        )
    };
    let input = SeriesInput::from_value(value, TenantField::Absent).map_err(problems)?;
    let ignore_quiet_hours = input.ignore_quiet_hours;
    let ahead = state.limits().max_schedule_ahead;
    let limits = SeriesLimits {
        max_ahead: ahead,
        max_per_day: MAX_PER_DAY,
    };
    let (series, contacts) = input
        .into_new(tenant_id, &limits, state.now() + ahead)
        .map_err(problems)?;
    Ok(Parsed {
        series,
        contacts,
        ignore_quiet_hours,
    })
}

fn shapes(series_id: &str, occurrences: &[Occurrence]) -> Vec<OccurrenceShape> {
    occurrences
        .iter()
        .map(|o| OccurrenceShape {
            event_id: occurrence_event_id(series_id, o.local)
                .map(|e| e.as_str().to_owned())
                .unwrap_or_default(),
            local: o.local.to_string(),
            scheduled_at: o.instant(),
        })
        .collect()
}
