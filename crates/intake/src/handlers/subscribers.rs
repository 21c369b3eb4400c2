//! The subscribers of the `/v1` API: store their destinations, read and set their
//! preferences, read their consent and its history, erase them.
//!
//! Every handler is authenticated by its [`SignedTenant`] (its tenant as the ledger has it
//! now) before its body is parsed. Must never answer, log or quote a destination or
//! subscriber reference (not even an unknown key of a body: it could be one), or write
//! anything for a refused request.

use axum::Json;
use axum::extract::State;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use nudge_domain::{Channel, QuietHours, SubscriberRef, Zone};
use nudge_ledger::input;
use nudge_ledger::{LedgerTime, Operator, SubscriberQuietHours};
use serde_json::Value;

use crate::auth::SignedTenant;
use crate::error::{ApiError, ErrorBody, InvalidRequest, Problem, Unauthorized};
use crate::extract::{ApiPath, JsonContent};
use crate::shapes::{
    ConsentHistoryAnswer, ConsentHistoryEntry, ConsentNow, ContactsAnswer, ContactsBody,
    ErasureAnswer, PreferenceShape, PreferencesAnswer, PreferencesBody, channel_name,
};
use crate::state::AppState;

fn subscriber_ref(text: &str) -> Result<SubscriberRef, ApiError> {
    // The message names the field and a position, never the text.
    SubscriberRef::parse(text).map_err(|e| ApiError::invalid("subscriber_ref", e.to_string()))
}

// An unknown key is the client's text, and could be patient data typed as a key: never
// repeated, here as in the reminder's own fields (`InputError::UnknownField`).
const UNKNOWN_CONTACTS_FIELD: &str = "has a field other than `destinations`, `time_zone` and \
                                      `quiet_hours`; its name is not repeated, as it could be \
                                      patient data";

/// `quiet_hours` of a contacts body: `"tenant"`, `"none"`, or `{"from": "HH:MM", "to": "HH:MM"}`.
fn quiet_hours(value: Value) -> Result<Option<SubscriberQuietHours>, ApiError> {
    const SHAPE: &str = "must be \"tenant\", \"none\" or {\"from\": \"HH:MM\", \"to\": \"HH:MM\"}";
    match value {
        Value::Null => Ok(None),
        Value::String(text) => match text.as_str() {
            "tenant" => Ok(Some(SubscriberQuietHours::Tenant)),
            "none" => Ok(Some(SubscriberQuietHours::Off)),
            _ => Err(ApiError::invalid("/quiet_hours", SHAPE)),
        },
        Value::Object(mut window) => {
            if window.keys().any(|k| k != "from" && k != "to") {
                return Err(ApiError::invalid("/quiet_hours", SHAPE));
            }
            let mut time = |field: &'static str| match window.remove(field) {
                Some(Value::String(text)) => Ok(text),
                _ => Err(ApiError::invalid(
                    if field == "from" {
                        "/quiet_hours/from"
                    } else {
                        "/quiet_hours/to"
                    },
                    "must be a wall-clock time HH:MM or HH:MM:SS",
                )),
            };
            let (from, to) = (time("from")?, time("to")?);
            let from = QuietHours::parse_time(&from)
                .map_err(|e| ApiError::invalid("/quiet_hours/from", e.to_string()))?;
            let to = QuietHours::parse_time(&to)
                .map_err(|e| ApiError::invalid("/quiet_hours/to", e.to_string()))?;
            let hours = QuietHours::new(from, to)
                .map_err(|e| ApiError::invalid("/quiet_hours", e.to_string()))?;
            Ok(Some(SubscriberQuietHours::Own(hours)))
        }
        _ => Err(ApiError::invalid("/quiet_hours", SHAPE)),
    }
}

/// Store a subscriber's destinations for the channels given.
#[utoipa::path(put, path = "/v1/tenants/{tenant}/subscribers/{subscriber_ref}/contacts", tag = "subscribers",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("subscriber_ref" = String, Path, description = "the client's reference of the subscriber", min_length = 1, max_length = 128, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the body"),
    ),
    request_body(content = ContactsBody, content_type = "application/json"),
    responses(
        (status = 200, description = "stored", body = ContactsAnswer),
        (status = 400, description = "invalid; nothing written", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 408, description = "the body did not arrive in time", body = ErrorBody),
        (status = 413, description = "the body is over the limit", body = ErrorBody),
        (status = 415, description = "the body is not JSON", body = ErrorBody),
        (status = 500, description = "unexpected", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn put_contacts(
    State(state): State<AppState>,
    ApiPath((_, subscriber)): ApiPath<(String, String)>,
    _: JsonContent,
    SignedTenant { tenant, body, .. }: SignedTenant,
) -> Result<Response, ApiError> {
    let subscriber = subscriber_ref(&subscriber)?;
    let value: Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::Invalid(vec![Problem::json(&e)]))?;
    let Value::Object(mut map) = value else {
        return Err(ApiError::invalid("", "expected a JSON object"));
    };
    if map
        .keys()
        .any(|k| k != "destinations" && k != "time_zone" && k != "quiet_hours")
    {
        return Err(ApiError::invalid("", UNKNOWN_CONTACTS_FIELD));
    }
    let time_zone = match map.remove("time_zone") {
        None | Some(Value::Null) => None,
        Some(Value::String(name)) => {
            Some(Zone::parse(&name).map_err(|e| ApiError::invalid("/time_zone", e.to_string()))?)
        }
        Some(_) => return Err(ApiError::invalid("/time_zone", "must be a string")),
    };
    let quiet = quiet_hours(map.remove("quiet_hours").unwrap_or(Value::Null))?;
    // A window is read in the subscriber's zone, else the tenant's: with neither it would
    // never apply, so it is refused rather than stored to be ignored.
    if matches!(quiet, Some(SubscriberQuietHours::Own(_))) && time_zone.is_none() {
        let zones = state
            .ledger()
            .fallback_zones(tenant.id, &subscriber, state.cipher())
            .await
            .map_err(ApiError::internal)?;
        if zones.subscriber.is_none() && zones.tenant.is_none() {
            return Err(ApiError::invalid(
                "/quiet_hours",
                "needs a zone to be read in: give time_zone (the subscriber's), or the tenant \
                 needs a default zone (nudgectl tenant set --time-zone)",
            ));
        }
    }
    let destinations = map
        .remove("destinations")
        .ok_or_else(|| ApiError::invalid("/destinations", "missing field"))?;
    let Some(given) = destinations.as_object() else {
        return Err(ApiError::invalid(
            "/destinations",
            "must be an object of channel name to destination",
        ));
    };
    let mut channels = Vec::with_capacity(given.len());
    for key in given.keys() {
        // Not quoted: it could be a destination typed in the wrong place.
        let channel: Channel = key.parse().map_err(|_| {
            ApiError::invalid(
                "/destinations",
                "has a key that is not one of push, email, sms",
            )
        })?;
        channels.push(channel);
    }
    if channels.is_empty() {
        return Err(ApiError::invalid(
            "/destinations",
            "must give at least one channel",
        ));
    }
    let parsed = input::destinations(&destinations, &channels)
        .map_err(|e| ApiError::Invalid(vec![Problem::input("", &e)]))?;
    state
        .ledger()
        .set_contacts(
            tenant.id,
            &subscriber,
            &parsed,
            time_zone,
            quiet,
            state.cipher(),
            state.now(),
        )
        .await
        .map_err(ApiError::internal)?;
    channels.sort();
    Ok(Json(ContactsAnswer {
        channels: channels.into_iter().map(channel_name).collect(),
        time_zone: time_zone.map(|z| z.name()),
        quiet_hours: quiet.map(|q| match q {
            SubscriberQuietHours::Tenant => "tenant".to_owned(),
            SubscriberQuietHours::Off => "none".to_owned(),
            SubscriberQuietHours::Own(hours) => hours.to_string(),
        }),
    })
    .into_response())
}

/// Erase a subscriber: their destinations are deleted, their owed deliveries cancelled, and
/// their reminders keep only ids, states, times and classes. Erasing again answers zeros.
#[utoipa::path(delete, path = "/v1/tenants/{tenant}/subscribers/{subscriber_ref}", tag = "subscribers",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("subscriber_ref" = String, Path, description = "the client's reference of the subscriber", min_length = 1, max_length = 128, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the (empty) body"),
    ),
    responses(
        (status = 200, description = "erased", body = ErasureAnswer),
        (status = 400, description = "invalid reference", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 500, description = "unexpected", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn erase_subscriber(
    State(state): State<AppState>,
    ApiPath((tenant_name, subscriber)): ApiPath<(String, String)>,
    SignedTenant { tenant, .. }: SignedTenant,
) -> Result<Response, ApiError> {
    let subscriber = subscriber_ref(&subscriber)?;
    let by = Operator::new(
        &format!("nudge-intake:{tenant_name}"),
        Some("erasure requested by the tenant over the API"),
        state.now(),
    )
    .map_err(ApiError::internal)?;
    let erasure = state
        .ledger()
        .erase_subscriber(
            tenant.id,
            &subscriber,
            state.cipher(),
            &by,
            LedgerTime::Database,
        )
        .await
        .map_err(ApiError::internal)?;
    Ok(Json(ErasureAnswer {
        contacts_deleted: erasure.contacts_deleted,
        reminders_erased: erasure.reminders_erased,
        series_erased: erasure.series_erased,
        deliveries_cancelled: erasure.deliveries_cancelled,
        preferences_deleted: erasure.preferences_deleted,
    })
    .into_response())
}

/// How many history entries one page holds unless `limit` says fewer.
const CONSENT_PAGE: u32 = 100;

/// A subscriber's consent: each of their destinations' as it stands (a patient's STOP or
/// START, a provider's opt-out), and one page of those destinations' history, oldest first,
/// with who changed it, when and from what. No destination in it.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/subscribers/{subscriber_ref}/consent-history", tag = "subscribers",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("subscriber_ref" = String, Path, description = "the client's reference of the subscriber", min_length = 1, max_length = 128, pattern = "^[!-~]+$"),
        ("after" = Option<i64>, Query, description = "the last entry id of the previous page (`next_after`)", minimum = 0),
        ("limit" = Option<u32>, Query, description = "entries per page, 1 to 500 (default 100)", minimum = 1, maximum = 500),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path with its query and the (empty) body"),
    ),
    responses(
        (status = 200, description = "the subscriber's consent", body = ConsentHistoryAnswer),
        (status = 400, description = "invalid reference or query", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 404, description = "the subscriber holds no destination and has no preference (never posted, or erased)", body = ErrorBody),
        (status = 500, description = "unexpected", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn get_consent_history(
    State(state): State<AppState>,
    ApiPath((_, subscriber)): ApiPath<(String, String)>,
    uri: Uri,
    SignedTenant { tenant, .. }: SignedTenant,
) -> Result<Response, ApiError> {
    let subscriber = subscriber_ref(&subscriber)?;
    let (after, limit) = super::page_query(
        &uri,
        "an entry id",
        CONSENT_PAGE,
        nudge_ledger::CONSENT_PAGE_MAX,
    )?;
    let consent = state
        .ledger()
        .subscriber_consent(state.cipher(), tenant.id, &subscriber, after, limit)
        .await
        .map_err(ApiError::internal)?
        .ok_or(ApiError::SubscriberNotFound)?;
    Ok(Json(ConsentHistoryAnswer {
        current: consent
            .current
            .into_iter()
            .map(|(channel, now)| ConsentNow {
                channel: channel_name(channel),
                state: now.state.as_str().to_owned(),
                source: now.source.as_str().to_owned(),
                changed_at: now.changed_at,
            })
            .collect(),
        entries: consent
            .entries
            .into_iter()
            .map(|(id, channel, e)| ConsentHistoryEntry {
                id,
                channel: channel_name(channel),
                category: e.category,
                state: e.state.as_str().to_owned(),
                source: e.source.as_str().to_owned(),
                actor: e.actor,
                keyword: e.keyword,
                correlation_id: e.correlation_id,
                recorded_at: e.recorded_at,
            })
            .collect(),
        next_after: consent.next_after,
    })
    .into_response())
}

fn consent_now(channel: Channel, now: nudge_ledger::DestinationConsent) -> ConsentNow {
    ConsentNow {
        channel: channel_name(channel),
        state: now.state.as_str().to_owned(),
        source: now.source.as_str().to_owned(),
        changed_at: now.changed_at,
    }
}

/// A subscriber's preferences: every channel with every category of the tenant (`general`
/// first), whether they want it and its last change, and the consent of the destinations they
/// hold. A destination opted out (a STOP) is never sent to, whatever its preferences say.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/subscribers/{subscriber_ref}/preferences", tag = "subscribers",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("subscriber_ref" = String, Path, description = "the client's reference of the subscriber", min_length = 1, max_length = 128, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the (empty) body"),
    ),
    responses(
        (status = 200, description = "the subscriber's preferences", body = PreferencesAnswer),
        (status = 400, description = "invalid reference", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 404, description = "the subscriber holds no destination and has no preference (never posted, or erased)", body = ErrorBody),
        (status = 500, description = "unexpected", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn get_preferences(
    State(state): State<AppState>,
    ApiPath((_, subscriber)): ApiPath<(String, String)>,
    SignedTenant { tenant, .. }: SignedTenant,
) -> Result<Response, ApiError> {
    let subscriber = subscriber_ref(&subscriber)?;
    let preferences = state
        .ledger()
        .subscriber_preferences(state.cipher(), tenant.id, &subscriber)
        .await
        .map_err(ApiError::internal)?
        .ok_or(ApiError::SubscriberNotFound)?;
    Ok(Json(preferences_answer(preferences)).into_response())
}

fn preferences_answer(preferences: nudge_ledger::Preferences) -> PreferencesAnswer {
    PreferencesAnswer {
        preferences: preferences
            .entries
            .into_iter()
            .map(|p| PreferenceShape {
                channel: channel_name(p.channel),
                category: p.category.to_string(),
                required: p.required,
                state: p.state.as_str().to_owned(),
                source: p.source.map(|s| s.as_str().to_owned()),
                changed_at: p.changed_at,
            })
            .collect(),
        destinations: preferences
            .destinations
            .into_iter()
            .map(|(channel, now)| consent_now(channel, now))
            .collect(),
    }
}

// An unknown key is the client's text: never repeated.
const UNKNOWN_PREFERENCES_FIELD: &str = "has a field other than `preferences`; its name is not \
                                         repeated, as it could be patient data";
const UNKNOWN_PREFERENCE_FIELD: &str = "has a field other than `channel`, `category` and \
                                        `state`; its name is not repeated, as it could be \
                                        patient data";

/// The changes of a preferences body, each checked, every problem named by its path.
fn preference_changes(body: &[u8]) -> Result<Vec<nudge_ledger::PreferenceChange>, ApiError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::Invalid(vec![Problem::json(&e)]))?;
    let Value::Object(mut map) = value else {
        return Err(ApiError::invalid("", "expected a JSON object"));
    };
    if map.keys().any(|k| k != "preferences") {
        return Err(ApiError::invalid("", UNKNOWN_PREFERENCES_FIELD));
    }
    let Some(Value::Array(items)) = map.remove("preferences") else {
        return Err(ApiError::invalid(
            "/preferences",
            "missing, or not an array of {channel, category, state}",
        ));
    };
    if items.is_empty() || items.len() > nudge_ledger::MAX_PREFERENCE_CHANGES {
        return Err(ApiError::invalid(
            "/preferences",
            format!(
                "must list 1 to {} changes",
                nudge_ledger::MAX_PREFERENCE_CHANGES
            ),
        ));
    }
    let mut problems = Vec::new();
    let mut changes = Vec::with_capacity(items.len());
    for (index, item) in items.into_iter().enumerate() {
        let at = |field: &str| format!("/preferences/{index}{field}");
        let Value::Object(item) = item else {
            problems.push(Problem::new(at(""), "must be an object"));
            continue;
        };
        if item
            .keys()
            .any(|k| k != "channel" && k != "category" && k != "state")
        {
            problems.push(Problem::new(at(""), UNKNOWN_PREFERENCE_FIELD));
            continue;
        }
        let channel = match item.get("channel") {
            Some(Value::String(name)) => name.parse::<Channel>().ok(),
            _ => None,
        };
        if channel.is_none() {
            problems.push(Problem::new(
                at("/channel"),
                "must be one of push, email, sms",
            ));
        }
        let category = match item.get("category") {
            Some(Value::String(name)) => match nudge_domain::Category::parse(name) {
                Ok(category) => Some(category),
                Err(e) => {
                    problems.push(Problem::new(at("/category"), e.to_string()));
                    None
                }
            },
            _ => {
                problems.push(Problem::new(at("/category"), "must be a string"));
                None
            }
        };
        let wanted = match item.get("state") {
            Some(Value::String(text)) => nudge_domain::ConsentState::parse(text),
            _ => None,
        };
        if wanted.is_none() {
            problems.push(Problem::new(at("/state"), "must be opted_in or opted_out"));
        }
        if let (Some(channel), Some(category), Some(state)) = (channel, category, wanted) {
            changes.push(nudge_ledger::PreferenceChange {
                channel,
                category,
                state,
            });
        }
    }
    if !problems.is_empty() {
        return Err(ApiError::Invalid(problems));
    }
    Ok(changes)
}

/// Change a subscriber's preferences: all the changes or none. A required category cannot be
/// switched off (409 `category_required`, naming it); an unknown one is a 400 at its path.
/// Each change is recorded with its source (`api`), the request's correlation id and the
/// database's time, in the consent history. Answers the preferences as they now stand.
#[utoipa::path(put, path = "/v1/tenants/{tenant}/subscribers/{subscriber_ref}/preferences", tag = "subscribers",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("subscriber_ref" = String, Path, description = "the client's reference of the subscriber", min_length = 1, max_length = 128, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the body"),
        ("X-Correlation-Id" = Option<String>, Header, description = "recorded with each change (1 to 128 printable ASCII characters; one is made when absent)"),
    ),
    request_body(content = PreferencesBody, content_type = "application/json"),
    responses(
        (status = 200, description = "changed; the preferences as they now stand", body = PreferencesAnswer),
        (status = 400, description = "invalid, or a category the tenant does not have; nothing written", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 408, description = "the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "a required category would be switched off (`category_required`, naming it); nothing written", body = ErrorBody),
        (status = 413, description = "the body is over the limit", body = ErrorBody),
        (status = 415, description = "the body is not JSON", body = ErrorBody),
        (status = 500, description = "unexpected", body = ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ),
    security(("signature" = [])))]
pub async fn put_preferences(
    State(state): State<AppState>,
    ApiPath((tenant_name, subscriber)): ApiPath<(String, String)>,
    _: JsonContent,
    SignedTenant {
        tenant,
        body,
        headers,
        ..
    }: SignedTenant,
) -> Result<Response, ApiError> {
    let subscriber = subscriber_ref(&subscriber)?;
    let changes = preference_changes(&body)?;
    let correlation = crate::handlers::reminders::correlation_id(&headers);
    // The actor is at most 200 characters: a tenant's name may be as long, its id never is.
    let actor = if tenant_name.chars().count() <= 196 {
        format!("api:{tenant_name}")
    } else {
        format!("api:{}", tenant.id)
    };
    let author = nudge_ledger::PreferenceAuthor {
        source: nudge_domain::ConsentSource::Api,
        actor: &actor,
        correlation_id: Some(&correlation),
    };
    state
        .ledger()
        .set_preferences(
            state.cipher(),
            tenant.id,
            &subscriber,
            &changes,
            &author,
            LedgerTime::Database,
        )
        .await
        .map_err(|e| match e {
            nudge_ledger::LedgerError::CategoryRequired(category) => {
                ApiError::CategoryRequired(category)
            }
            nudge_ledger::LedgerError::UnknownCategory(category) => {
                let index = changes
                    .iter()
                    .position(|c| c.category.as_str() == category)
                    .unwrap_or(0);
                ApiError::invalid(
                    format!("/preferences/{index}/category"),
                    crate::handlers::reminders::UNKNOWN_CATEGORY,
                )
            }
            other => ApiError::internal(other),
        })?;
    let preferences = state
        .ledger()
        .subscriber_preferences(state.cipher(), tenant.id, &subscriber)
        .await
        .map_err(ApiError::internal)?
        .ok_or_else(|| {
            ApiError::internal(anyhow::anyhow!("the preferences just written are gone"))
        })?;
    let mut response = Json(preferences_answer(preferences)).into_response();
    if let Ok(value) = axum::http::HeaderValue::from_str(&correlation) {
        response
            .headers_mut()
            .insert(crate::shapes::CORRELATION_HEADER, value);
    }
    Ok(response)
}
