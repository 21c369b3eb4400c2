//! A tenant's delivery events (decision 0601), for clients that poll or catch up: what
//! happened to each of their deliveries, in the order the ledger numbered the changes, from a
//! position on. Written by the ledger with each change (an outbox), never here.
//!
//! Authenticated by its [`SignedTenant`]; answers ids, states, classes and times only.

use axum::Json;
use axum::extract::State;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};

use crate::auth::SignedTenant;
use crate::error::{ApiError, ErrorBody, InvalidRequest, Unauthorized};
use crate::extract::ApiPath;
use crate::shapes::{DeliveryEventShape, EventsAnswer, channel_name, event_kind_name};
use crate::state::AppState;

/// How many events one page holds unless `limit` says fewer.
const EVENTS_PAGE: u32 = 100;

/// The tenant's delivery events after a position, oldest first: every client-visible change
/// of every delivery (`scheduled`, `deferred`, `sent`, `delivered`, `failed`, `expired`,
/// `cancelled`, `suppressed`, `held_ambiguous`, `redriven`, `rescheduled`), each written in
/// the transaction of its change, so none is missing and none is for a change that rolled
/// back. Start with `after=0` (or omitted) and keep the answer's `next_after`; an event is
/// readable here within about `janitor.events_interval_ms` of its change. The same event read
/// again has the same `id`.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/events", tag = "events",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("after" = Option<i64>, Query, description = "the position of the last event seen (`next_after`); 0 or omitted for the first kept", minimum = 0),
        ("limit" = Option<u32>, Query, description = "events per page, 1 to 1000 (default 100)", minimum = 1, maximum = 1000),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path with its query and the (empty) body"),
    ),
    responses(
        (status = 200, description = "one page of events", body = EventsAnswer),
        (status = 400, description = "invalid query", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 500, description = "unexpected", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn get_events(
    State(state): State<AppState>,
    ApiPath(_): ApiPath<String>,
    uri: Uri,
    SignedTenant { tenant, .. }: SignedTenant,
) -> Result<Response, ApiError> {
    let (after, limit) = super::page_query(
        &uri,
        "a position",
        EVENTS_PAGE,
        nudge_ledger::EVENTS_PAGE_MAX,
    )?;
    let after = after.unwrap_or(0);
    let page = state
        .ledger()
        .tenant_events(tenant.id, after, limit)
        .await
        .map_err(ApiError::internal)?;
    Ok(Json(EventsAnswer {
        events: page.events.into_iter().map(shape).collect(),
        next_after: page.next_after,
        more: page.more,
    })
    .into_response())
}

/// The API's typed form of an event (its OpenAPI schema): the same JSON as
/// [`DeliveryEvent::wire`], which `nudgectl events` and nudge-events write.
///
/// [`DeliveryEvent::wire`]: nudge_ledger::DeliveryEvent::wire
fn shape(e: nudge_ledger::DeliveryEvent) -> DeliveryEventShape {
    DeliveryEventShape {
        position: e.position,
        id: e.id,
        kind: event_kind_name(e.kind),
        delivery_id: e.delivery_id,
        delivery_seq: e.delivery_seq,
        reminder_id: e.reminder_id,
        event_id: e.event_id,
        channel: channel_name(e.channel),
        state: e.state,
        previous_state: e.previous_state,
        lane: e.lane,
        attempts: e.attempt_count,
        error_class: e.error_class,
        reason: e.reason,
        next_attempt_at: e.next_attempt_at,
        provider_message_id: e.provider_message_id,
        occurred_at: e.occurred_at,
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone as _;
    use nudge_ledger::{DeliveryEvent, DeliveryEventKind};

    fn event(kind: DeliveryEventKind, filled: bool) -> DeliveryEvent {
        let at = chrono::Utc.with_ymd_and_hms(2026, 12, 3, 9, 0, 0).unwrap();
        DeliveryEvent {
            position: 42,
            id: uuid::Uuid::from_u128(1),
            kind,
            delivery_id: uuid::Uuid::from_u128(2),
            delivery_seq: 3,
            reminder_id: uuid::Uuid::from_u128(4),
            event_id: "appt-1".into(),
            channel: nudge_domain::Channel::Sms,
            state: "retry_wait".into(),
            previous_state: filled.then(|| "sending".into()),
            lane: "retry".into(),
            attempt_count: 2,
            error_class: filled.then(|| "server_error".into()),
            reason: filled.then(|| "503".into()),
            next_attempt_at: filled.then_some(at),
            provider_message_id: filled.then(|| "SM1".into()),
            occurred_at: at,
        }
    }

    /// One JSON for an event wherever a client reads it: the API, `nudgectl events`, the push.
    #[test]
    fn the_apis_event_is_the_wire_form_every_reader_gets() {
        for kind in DeliveryEventKind::ALL {
            for filled in [false, true] {
                let e = event(kind, filled);
                assert_eq!(
                    serde_json::to_value(super::shape(e.clone())).unwrap(),
                    e.wire(),
                    "{kind:?}"
                );
            }
        }
    }
}
