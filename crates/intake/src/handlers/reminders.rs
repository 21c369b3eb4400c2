//! The reminders of the `/v1` API: post (one or a batch), read, reschedule (replace under a
//! growing revision) and cancel; a reschedule and a cancel answer per channel what they could
//! do and what was too late (`nudge_domain::change`).
//!
//! A single reminder goes to the committers ([`crate::commit`]) and is answered once the
//! transaction holding it committed (202 new, 200 the same event again, 409 the event id with
//! another body); a batch is imported here, at once, against its tenant as the ledger has it
//! now, and answered per reminder. Every handler is authenticated by its [`SignedTenant`]
//! before its body is parsed. Must never answer before commit, write anything for a refused
//! request, or answer or log a destination, subscriber reference or content.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use nudge_domain::{CancelChange, Channel, ChannelChange, EventId, Resolution, ResolvedTimes};
use nudge_ledger::input::{ReminderInput, TenantField};
use nudge_ledger::{
    FallbackZones, ImportOutcome, ImportReminder, IntakeTenant, LedgerTime, ReminderStatus,
    ReplacedBy, Replacement, RescheduleOutcome, Rescheduled,
};
use serde_json::Value;

use crate::auth::{FromCache, SignedTenant};
use crate::commit::{Check, CommitError};
use crate::error::{ApiError, ErrorBody, InvalidRequest, Problem, Unauthorized};
use crate::extract::{ApiPath, JsonContent};
use crate::shapes::{
    Accepted, BatchAnswer, BatchItem, CORRELATION_HEADER, CancelAnswer, ChannelCancelled,
    ChannelName, ChannelRescheduled, ChannelState, LocalResolution, PostAnswer, PostReminders,
    ReminderState, RescheduleAnswer, RescheduleBody, Withheld, channel_name,
};
use crate::state::AppState;

/// Post one reminder, or `{"reminders": [...]}`.
///
/// Answered after commit. One reminder: 202 when recorded, 200 with the original reminder id
/// when the same event with the same body was recorded before, 409 when the event id is used
/// for another reminder. A batch: 200 with an answer per reminder, in order. A reminder of a
/// paused tenant or for a draining channel is recorded and held (`held` says so).
#[utoipa::path(post, path = "/v1/tenants/{tenant}/reminders", tag = "reminders",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex HMAC-SHA256 of \"<t>\\n<METHOD>\\n<path>\\n<body>\">"),
        ("X-Correlation-Id" = Option<String>, Header, description = "1 to 128 printable ASCII characters; generated when absent or invalid"),
    ),
    request_body(content = PostReminders, content_type = "application/json"),
    responses(
        (status = 202, description = "recorded", body = Accepted),
        (status = 200, description = "the same event again, or a batch's answers", body = PostAnswer),
        (status = 400, description = "invalid; nothing written", body = InvalidRequest),
        (status = 401, description = "not authenticated; nothing written", body = Unauthorized),
        (status = 408, description = "the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "the event id is used for another reminder", body = ErrorBody),
        (status = 413, description = "the body is over the limit", body = ErrorBody),
        (status = 415, description = "the body is not JSON", body = ErrorBody),
        (status = 500, description = "unexpected; may be retried", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn post_reminders(
    State(state): State<AppState>,
    ApiPath(tenant_name): ApiPath<String>,
    _: JsonContent,
    signed: SignedTenant<FromCache>,
) -> Result<Response, ApiError> {
    let correlation = correlation_id(&signed.headers);
    let value: Value = serde_json::from_slice(&signed.body).map_err(|e| {
        state.metrics().reminder("invalid");
        ApiError::Invalid(vec![Problem::json(&e)])
    })?;
    let batch = matches!(&value, Value::Object(map) if map.contains_key("reminders"));
    let mut response = if batch {
        // A batch is imported here, at once: its tenant as the ledger has it now.
        let tenant = signed.from_ledger(&state).await?;
        post_batch(&state, &tenant, value, &correlation).await?
    } else {
        let request = signed.request();
        let covered = request.signed();
        let check = Check {
            tenant: tenant_name,
            signature: signed.signature.clone(),
            method: covered.method.to_owned(),
            target: covered.target.to_owned(),
            body: signed.body.clone(),
        };
        post_one(
            &state,
            &signed.tenant,
            value,
            &signed.body,
            check,
            &correlation,
        )
        .await?
    };
    if let Ok(v) = HeaderValue::from_str(&correlation) {
        response.headers_mut().insert(CORRELATION_HEADER, v);
    }
    Ok(response)
}

/// A reminder as posted, parsed, with the text its request digest is taken over.
struct Parsed {
    input: ReminderInput,
    canonical: Vec<u8>,
}

/// A reminder checked and ready to import, with the instants its times resolved to.
struct Prepared {
    item: ImportReminder,
    times: ResolvedTimes,
}

/// Parses a reminder, or says what is wrong with it. `raw` is its text when it is the whole
/// body: read from it, an unknown field's problem says where the field ends.
fn parse(value: Value, raw: Option<&[u8]>, prefix: &str) -> Result<Parsed, Vec<Problem>> {
    let canonical = canonical(&value).map_err(|p| vec![p.under(prefix)])?;
    let input = match raw {
        Some(raw) => ReminderInput::parse(raw, TenantField::Absent),
        None => ReminderInput::from_value(value, TenantField::Absent),
    }
    .map_err(|e| vec![Problem::input(prefix, &e)])?;
    if nudge_ledger::is_occurrence_event_id(&input.event_id) {
        return Err(vec![Problem::new(
            format!("{prefix}/event_id"),
            nudge_ledger::RESERVED_EVENT_ID,
        )]);
    }
    Ok(Parsed { input, canonical })
}

/// The zones a reminder needs: none for an instant or a local time with its own `time_zone`
/// (no read: such a post costs what it did), else the subscriber's and the tenant's as the
/// ledger has them now, in one statement (not the intake's cache of tenants, which may be
/// older than a `nudgectl tenant set --time-zone`).
async fn zones(
    state: &AppState,
    tenant: &IntakeTenant,
    input: &ReminderInput,
) -> Result<FallbackZones, ApiError> {
    if !input.needs_zone() {
        return Ok(FallbackZones::default());
    }
    state
        .ledger()
        .fallback_zones(tenant.id, &input.subscriber_ref, state.cipher())
        .await
        .map_err(ApiError::internal)
}

/// A reminder that says `"quiet_hours": "ignore"` where its tenant does not allow it
/// (`nudgectl tenant set --quiet-hours-ignorable`): its problem. The tenant is read from the
/// ledger as it is now (not the intake's cache), and only for a reminder that asks.
async fn quiet_hours_refused(
    state: &AppState,
    tenant: &IntakeTenant,
    input: &ReminderInput,
    prefix: &str,
) -> Result<Option<Problem>, ApiError> {
    if !input.ignore_quiet_hours {
        return Ok(None);
    }
    let allowed = state
        .ledger()
        .tenant(tenant.id)
        .await
        .map_err(ApiError::internal)?
        .is_some_and(|t| t.quiet_hours_ignorable);
    Ok((!allowed).then(|| {
        Problem::new(
            format!("{prefix}/quiet_hours"),
            "\"ignore\" is not allowed for this tenant's reminders (an operator allows it with \
             nudgectl tenant set --quiet-hours-ignorable true)",
        )
    }))
}

/// A parsed reminder resolved to instants (its own zone, else the subscriber's, else the
/// tenant's: [`zones`]) and checked, ready to import, or its problems.
fn prepare(
    state: &AppState,
    tenant: &IntakeTenant,
    parsed: Parsed,
    zones: FallbackZones,
    correlation: &str,
    prefix: &str,
) -> Result<Prepared, Vec<Problem>> {
    let Parsed { input, canonical } = parsed;
    let times = input
        .resolve(zones.subscriber, zones.tenant)
        .map_err(|e| vec![Problem::input(prefix, &e)])?;
    within_schedule_ahead(state, &times, prefix).map_err(|p| vec![p])?;
    let mut item = input
        .into_import(tenant.id, &times)
        .map_err(|e| vec![Problem::input(prefix, &e)])?;
    let digest = state
        .cipher()
        .request_digest(tenant.id, &canonical)
        .map_err(|_| vec![Problem::new(prefix, "the reminder cannot be accepted")])?;
    item.reminder = item
        .reminder
        .with_correlation_id(correlation)
        .map_err(|_| {
            vec![Problem::new(
                "X-Correlation-Id",
                "is not a valid correlation id",
            )]
        })?
        .with_request_digest(digest);
    Ok(Prepared { item, times })
}

/// The text a reminder's request digest is taken over: its JSON, keys in order, without its
/// revision (a repeat is the same revision with the same digest, and a post's retry is the
/// same post whatever revision it gave).
fn canonical(value: &Value) -> Result<Vec<u8>, Problem> {
    let mut value = value.clone();
    if let Value::Object(map) = &mut value {
        map.remove("revision");
    }
    serde_json::to_vec(&value)
        .map_err(|_| Problem::new("", "the reminder cannot be read back as JSON"))
}

/// The schedule-ahead limit (`intake.max_schedule_ahead_days`), from the intake's clock,
/// on the resolved instant (named by the field that gave it).
fn within_schedule_ahead(
    state: &AppState,
    times: &ResolvedTimes,
    prefix: &str,
) -> Result<(), Problem> {
    let ahead = state.now() + state.limits().max_schedule_ahead;
    if times.scheduled_at > ahead {
        let field = if times.local.is_some() {
            "scheduled_local"
        } else {
            "scheduled_at"
        };
        return Err(Problem::new(
            format!("{prefix}/{field}"),
            format!(
                "is more than {} days ahead (intake.max_schedule_ahead_days)",
                state.limits().max_schedule_ahead.num_days()
            ),
        ));
    }
    Ok(())
}

/// Why a reminder of `tenant` for `channels` is withheld, if it is.
fn withheld(tenant: &IntakeTenant, channels: &[Channel]) -> Option<Withheld> {
    let draining: Vec<ChannelName> = channels
        .iter()
        .filter(|c| tenant.draining.contains(c))
        .map(|c| channel_name(*c))
        .collect();
    (tenant.intake_paused || !draining.is_empty()).then_some(Withheld {
        tenant_paused: tenant.intake_paused,
        draining_channels: draining,
    })
}

/// How a local time was read, for the answer.
fn local_resolution(times: &ResolvedTimes) -> Option<LocalResolution> {
    let (zone, source, resolved) = times.local?;
    Some(LocalResolution {
        time_zone: zone.name(),
        zone_from: source.as_str(),
        utc_offset: resolved.offset.to_string(),
        wall_clock: zone.local_at(resolved.instant).to_string(),
        resolution: match resolved.kind {
            Resolution::Exact => "exact",
            Resolution::Skipped { .. } => "moved_past_gap",
            Resolution::Repeated { .. } => "earlier_of_two",
        },
    })
}

/// The problem of a reminder naming a category its tenant does not have.
pub(crate) const UNKNOWN_CATEGORY: &str =
    "is not a category of this tenant (`general`, or one created with nudgectl category create)";

/// What one imported reminder's outcome answers: status and body, or a problem.
fn answer(
    state: &AppState,
    tenant: &IntakeTenant,
    prepared: &Prepared,
    outcome: ImportOutcome,
    correlation: &str,
) -> Result<(StatusCode, Accepted), ApiError> {
    let item = &prepared.item;
    let event_id = item.reminder.event_id().as_str().to_owned();
    let accepted = |id: nudge_domain::ReminderId,
                    status,
                    deliveries_created,
                    times: Option<&ResolvedTimes>| Accepted {
        reminder_id: id.as_uuid(),
        event_id: event_id.clone(),
        status,
        deliveries_created,
        correlation_id: correlation.to_owned(),
        withheld: withheld(tenant, item.reminder.channels()),
        scheduled_at: times.map(|t| t.scheduled_at),
        expires_at: times.map(|t| t.expires_at),
        local: times.and_then(local_resolution),
    };
    match outcome {
        ImportOutcome::Created {
            id,
            deliveries_created,
        } => {
            state.metrics().reminder("accepted");
            Ok((
                StatusCode::ACCEPTED,
                accepted(id, "accepted", deliveries_created, Some(&prepared.times)),
            ))
        }
        ImportOutcome::AlreadyPresent { id } => {
            state.metrics().reminder("duplicate");
            Ok((StatusCode::OK, accepted(id, "duplicate", 0, None)))
        }
        ImportOutcome::EventConflict => {
            state.metrics().reminder("conflict");
            Err(ApiError::EventConflict(event_id))
        }
        ImportOutcome::UnknownCategory => {
            state.metrics().reminder("invalid");
            Err(ApiError::invalid("/category", UNKNOWN_CATEGORY))
        }
        ImportOutcome::UnknownTenant => Err(ApiError::internal(anyhow::anyhow!(
            "the tenant disappeared while its reminder was imported"
        ))),
    }
}

async fn post_one(
    state: &AppState,
    tenant: &IntakeTenant,
    value: Value,
    raw: &[u8],
    check: Check,
    correlation: &str,
) -> Result<Response, ApiError> {
    let invalid = |problems| {
        state.metrics().reminder("invalid");
        ApiError::Invalid(problems)
    };
    let parsed = parse(value, Some(raw), "").map_err(invalid)?;
    if let Some(problem) = quiet_hours_refused(state, tenant, &parsed.input, "").await? {
        return Err(invalid(vec![problem]));
    }
    let zones = zones(state, tenant, &parsed.input).await?;
    let prepared = prepare(state, tenant, parsed, zones, correlation, "").map_err(invalid)?;
    // Committed together with whatever other single posts are waiting, after the committer
    // read the tenant and verified the signature again (see `commit`).
    let committed = match state.committer().import(prepared.item.clone(), check).await {
        Ok(committed) => committed,
        Err(CommitError::Refused(refusal)) => {
            state.metrics().refusal(refusal.internal());
            return Err(ApiError::Unauthorized(refusal));
        }
        Err(e) if e.is_unavailable() => return Err(ApiError::Unavailable(e.into())),
        Err(e) => return Err(ApiError::internal(e)),
    };
    let (status, accepted) = answer(
        state,
        &committed.tenant,
        &prepared,
        committed.outcome,
        correlation,
    )?;
    Ok((status, Json(accepted)).into_response())
}

async fn post_batch(
    state: &AppState,
    tenant: &IntakeTenant,
    value: Value,
    correlation: &str,
) -> Result<Response, ApiError> {
    let Value::Object(mut map) = value else {
        return Err(ApiError::invalid("", "expected a JSON object"));
    };
    if map.keys().any(|k| k != "reminders") {
        return Err(ApiError::invalid("", UNKNOWN_BATCH_FIELD));
    }
    let Some(Value::Array(items)) = map.remove("reminders") else {
        return Err(ApiError::invalid(
            "/reminders",
            "must be an array of reminders",
        ));
    };
    let max = state.limits().batch_max;
    if items.is_empty() || items.len() > max {
        return Err(ApiError::invalid(
            "/reminders",
            format!("must hold 1 to {max} reminders (intake.batch_max)"),
        ));
    }
    let mut prepared: Vec<Result<Prepared, Vec<Problem>>> = Vec::with_capacity(items.len());
    for (index, item) in items.into_iter().enumerate() {
        let prefix = format!("/reminders/{index}");
        let parsed = match parse(item, None, &prefix) {
            Ok(parsed) => parsed,
            Err(problems) => {
                prepared.push(Err(problems));
                continue;
            }
        };
        if let Some(problem) = quiet_hours_refused(state, tenant, &parsed.input, &prefix).await? {
            prepared.push(Err(vec![problem]));
            continue;
        }
        let zones = zones(state, tenant, &parsed.input).await?;
        prepared.push(prepare(state, tenant, parsed, zones, correlation, &prefix));
    }
    let valid: Vec<ImportReminder> = prepared
        .iter()
        .filter_map(|p| p.as_ref().ok())
        .map(|p| p.item.clone())
        .collect();
    let mut outcomes = state
        .ledger()
        .import_reminders(&valid, state.cipher(), state.now())
        .await
        .map_err(ApiError::internal)?
        .into_iter();
    let mut results = Vec::with_capacity(prepared.len());
    for (index, p) in prepared.into_iter().enumerate() {
        let item = match p {
            Err(errors) => {
                state.metrics().reminder("invalid");
                results.push(BatchItem {
                    index,
                    status: 400,
                    reminder: None,
                    event_id: None,
                    errors,
                });
                continue;
            }
            Ok(item) => item,
        };
        let outcome = outcomes
            .next()
            .ok_or_else(|| ApiError::internal(anyhow::anyhow!("the import answered too few")))?;
        let event_id = item.item.reminder.event_id().as_str().to_owned();
        results.push(match answer(state, tenant, &item, outcome, correlation) {
            Ok((status, accepted)) => BatchItem {
                index,
                status: status.as_u16(),
                reminder: Some(accepted),
                event_id: Some(event_id),
                errors: Vec::new(),
            },
            Err(ApiError::Invalid(errors)) => BatchItem {
                index,
                status: 400,
                reminder: None,
                errors: errors
                    .into_iter()
                    .map(|p| Problem::new(format!("/reminders/{index}{}", p.path), p.problem))
                    .collect(),
                event_id: Some(event_id),
            },
            Err(ApiError::EventConflict(event_id)) => BatchItem {
                index,
                status: 409,
                reminder: None,
                errors: vec![Problem::new(
                    format!("/reminders/{index}/event_id"),
                    "is already used for a different reminder",
                )],
                event_id: Some(event_id),
            },
            Err(other) => return Err(other),
        });
    }
    Ok((StatusCode::OK, Json(BatchAnswer { results })).into_response())
}

fn reminder_state(event_id: &EventId, status: ReminderStatus) -> ReminderState {
    ReminderState {
        reminder_id: status.id.as_uuid(),
        event_id: event_id.as_str().to_owned(),
        scheduled_at: status.scheduled_at,
        expires_at: status.expires_at,
        cancelled_at: status.cancelled_at,
        correlation_id: status.correlation_id,
        revision: status.revision,
        channels: status
            .channels
            .into_iter()
            .map(|c| ChannelState {
                channel: channel_name(c.channel),
                state: c
                    .state
                    .map_or_else(|| "pending".to_owned(), |s| s.as_str().to_owned()),
                attempts: c.attempts,
                settled_at: c.settled_at,
            })
            .collect(),
    }
}

fn event_id(text: &str) -> Result<EventId, ApiError> {
    EventId::parse(text).map_err(|e| ApiError::invalid("event_id", e.to_string()))
}

/// The request's correlation id when it is 1 to 128 printable ASCII characters, else a new one.
pub(crate) fn correlation_id(headers: &HeaderMap) -> String {
    headers
        .get(CORRELATION_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= nudge_ledger::MAX_CORRELATION_ID_BYTES
                && v.bytes().all(|b| b.is_ascii_graphic())
        })
        .map_or_else(|| uuid::Uuid::new_v4().simple().to_string(), str::to_owned)
}

// An unknown key is the client's text, and could be patient data typed as a key: never
// repeated, here as in the reminder's own fields (`InputError::UnknownField`).
const UNKNOWN_BATCH_FIELD: &str =
    "has a field other than `reminders`; its name is not repeated, as it could be patient data";

/// A reminder's state per channel (no PHI).
#[utoipa::path(get, path = "/v1/tenants/{tenant}/reminders/{event_id}", tag = "reminders",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("event_id" = String, Path, description = "the client's event id", min_length = 1, max_length = 200, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the (empty) body"),
    ),
    responses(
        (status = 200, description = "the reminder", body = ReminderState),
        (status = 400, description = "invalid event id", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 404, description = "no such event", body = ErrorBody),
        (status = 500, description = "unexpected", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn get_reminder(
    State(state): State<AppState>,
    ApiPath((_, event)): ApiPath<(String, String)>,
    SignedTenant { tenant, .. }: SignedTenant,
) -> Result<Response, ApiError> {
    let event_id = event_id(&event)?;
    let status = state
        .ledger()
        .reminder_status(tenant.id, &event_id)
        .await
        .map_err(ApiError::internal)?
        .ok_or(ApiError::NotFound)?;
    Ok(Json(reminder_state(&event_id, status)).into_response())
}

/// Cancel a reminder, answered per channel: `cancelled` (settled now, or none will be made: no
/// request will ever be made for it), `too_late` with its state (its send started, and
/// finishes but is never retried; or it was delivered, or is held as maybe sent), or
/// `already_settled` with its state. Cancelling again answers the same.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/reminders/{event_id}/cancel", tag = "reminders",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("event_id" = String, Path, description = "the client's event id", min_length = 1, max_length = 200, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the body (usually empty)"),
    ),
    responses(
        (status = 200, description = "cancelled", body = CancelAnswer),
        (status = 400, description = "invalid event id", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 404, description = "no such event", body = ErrorBody),
        (status = 408, description = "the body did not arrive in time", body = ErrorBody),
        (status = 413, description = "the body is over the limit", body = ErrorBody),
        (status = 500, description = "unexpected", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn cancel_reminder(
    State(state): State<AppState>,
    ApiPath((_, event)): ApiPath<(String, String)>,
    SignedTenant { tenant, .. }: SignedTenant,
) -> Result<Response, ApiError> {
    let event_id = event_id(&event)?;
    let cancellation = state
        .ledger()
        .cancel_reminder_by_channel(tenant.id, &event_id, LedgerTime::Database)
        .await
        .map_err(ApiError::internal)?
        .ok_or(ApiError::NotFound)?;
    Ok(Json(CancelAnswer {
        cancelled: cancellation
            .cancelled
            .iter()
            .map(|c| channel_name(*c))
            .collect(),
        channels: cancellation
            .channels
            .iter()
            .map(|(channel, change)| ChannelCancelled {
                channel: channel_name(*channel),
                answer: change.as_str(),
                state: CancelChange::state(*change).map(|s| s.as_str()),
            })
            .collect(),
        reminder: reminder_state(&event_id, cancellation.status),
    })
    .into_response())
}

/// Replace a pending reminder: its schedule, expiry, channels, destinations and content,
/// under a revision higher than its current one.
///
/// In one transaction: each owed delivery not yet being sent moves to the new time (its key
/// and attempts kept; a queued message becomes stale), a removed channel's is cancelled, an
/// added channel's is created, content and destinations are sealed again. A delivery being
/// sent or settled is not touched: its channel is answered `too_late` with its state. The
/// same revision and body again is a 200 that changed nothing.
#[utoipa::path(put, path = "/v1/tenants/{tenant}/reminders/{event_id}", tag = "reminders",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("event_id" = String, Path, description = "the client's event id", min_length = 1, max_length = 200, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the body"),
    ),
    request_body(content = RescheduleBody, content_type = "application/json"),
    responses(
        (status = 200, description = "rescheduled, or the same revision and body again", body = RescheduleAnswer),
        (status = 400, description = "invalid (a time in the past, past the expiry or beyond the schedule-ahead limit, no revision); nothing changed", body = InvalidRequest),
        (status = 401, description = "not authenticated; nothing changed", body = Unauthorized),
        (status = 404, description = "no such event (or its subscriber was erased)", body = ErrorBody),
        (status = 408, description = "the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "revision_conflict (older, or the current one with another body; names the current one), reminder_cancelled or subscriber_differs; nothing changed", body = ErrorBody),
        (status = 413, description = "the body is over the limit", body = ErrorBody),
        (status = 415, description = "the body is not JSON", body = ErrorBody),
        (status = 500, description = "unexpected; may be retried", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn put_reminder(
    State(state): State<AppState>,
    ApiPath((_, event)): ApiPath<(String, String)>,
    _: JsonContent,
    signed: SignedTenant,
) -> Result<Response, ApiError> {
    let event_id = event_id(&event)?;
    let tenant = &signed.tenant;
    let mut value: Value = serde_json::from_slice(&signed.body)
        .map_err(|e| ApiError::Invalid(vec![Problem::json(&e)]))?;
    let Value::Object(map) = &mut value else {
        return Err(ApiError::invalid("", "expected a JSON object"));
    };
    match map.get("event_id") {
        None => {
            map.insert(
                "event_id".to_owned(),
                Value::String(event_id.as_str().to_owned()),
            );
        }
        Some(Value::String(given)) if given == event_id.as_str() => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "/event_id",
                "must be the path's event id when given",
            ));
        }
    }
    let canonical = canonical(&value).map_err(|p| ApiError::Invalid(vec![p]))?;
    let input = ReminderInput::from_value(value, TenantField::Absent)
        .map_err(|e| ApiError::Invalid(vec![Problem::input("", &e)]))?;
    let revision = input.revision.ok_or_else(|| {
        ApiError::invalid(
            "/revision",
            "is required: an integer higher than the reminder's current revision",
        )
    })?;
    if let Some(problem) = quiet_hours_refused(&state, tenant, &input, "").await? {
        return Err(ApiError::Invalid(vec![problem]));
    }
    let zones = zones(&state, tenant, &input).await?;
    let times = input
        .resolve(zones.subscriber, zones.tenant)
        .map_err(|e| ApiError::Invalid(vec![Problem::input("", &e)]))?;
    within_schedule_ahead(&state, &times, "").map_err(|p| ApiError::Invalid(vec![p]))?;
    // A time in the past is named by the field the client gave it in.
    let scheduled_field = if times.local.is_some() {
        "/scheduled_local"
    } else {
        "/scheduled_at"
    };
    let expires_field = if matches!(input.times.expiry, nudge_domain::zone::Expiry::After(_)) {
        "/expires_after_s"
    } else {
        "/expires_at"
    };
    let digest = state
        .cipher()
        .request_digest(tenant.id, &canonical)
        .map_err(ApiError::internal)?;
    let mut item = input
        .into_import(tenant.id, &times)
        .map_err(|e| ApiError::Invalid(vec![Problem::input("", &e)]))?;
    item.reminder = item.reminder.with_request_digest(digest);
    let outcome = state
        .ledger()
        .reschedule_reminder(
            &Replacement { item, revision },
            state.cipher(),
            &ReplacedBy::Client,
            LedgerTime::Database,
        )
        .await
        .map_err(|e| match e {
            nudge_ledger::LedgerError::UnknownCategory(_) => {
                ApiError::invalid("/category", UNKNOWN_CATEGORY)
            }
            other => ApiError::internal(other),
        })?;
    let conflict = |error, message: String, current_revision| ApiError::Conflict {
        error,
        message,
        event_id: event_id.as_str().to_owned(),
        current_revision,
    };
    let (status, done) = match outcome {
        RescheduleOutcome::Applied(done) => ("rescheduled", done),
        RescheduleOutcome::Repeat(done) => ("unchanged", done),
        RescheduleOutcome::RevisionConflict { current } => {
            return Err(conflict(
                "revision_conflict",
                format!(
                    "revision {revision} is not newer than the reminder's current revision \
                     {current}, or is the current one with another body"
                ),
                Some(current.get()),
            ));
        }
        RescheduleOutcome::Cancelled => {
            return Err(conflict(
                "reminder_cancelled",
                "the reminder is cancelled: post a new event".to_owned(),
                None,
            ));
        }
        RescheduleOutcome::SubscriberDiffers => {
            return Err(conflict(
                "subscriber_differs",
                "the reminder is for another subscriber: post a new event".to_owned(),
                None,
            ));
        }
        RescheduleOutcome::ScheduledInThePast => {
            return Err(ApiError::invalid(scheduled_field, "is in the past"));
        }
        RescheduleOutcome::ExpiresInThePast => {
            return Err(ApiError::invalid(expires_field, "is in the past"));
        }
        RescheduleOutcome::NotFound => return Err(ApiError::NotFound),
    };
    Ok(Json(reschedule_answer(&event_id, status, done)).into_response())
}

fn reschedule_answer(
    event_id: &EventId,
    status: &'static str,
    done: Rescheduled,
) -> RescheduleAnswer {
    RescheduleAnswer {
        reminder_id: done.id.as_uuid(),
        event_id: event_id.as_str().to_owned(),
        status,
        revision: done.revision.get(),
        scheduled_at: done.scheduled_at,
        expires_at: done.expires_at,
        channels: done
            .channels
            .iter()
            .map(|(channel, change)| ChannelRescheduled {
                channel: channel_name(*channel),
                change: change.as_str(),
                state: match change {
                    ChannelChange::TooLate(state) => Some(state.as_str()),
                    _ => None,
                },
            })
            .collect(),
        deliveries_created: done.deliveries_created,
    }
}
