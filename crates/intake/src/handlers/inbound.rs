//! The route of patients' replies: Twilio's incoming-message webhook. A reply that is a
//! keyword changes the replying number's consent (decision 0505): STOP and its synonyms opt
//! it out of SMS for every tenant that sends through the account, START and its synonyms opt
//! it back in, HELP changes nothing. Anything else is not ours to read: it is acknowledged
//! and dropped.
//!
//! Outside `/v1`: signed by the provider, verified exactly as its status callbacks are
//! (`receipts::twilio_verified`) before anything of it is read. Never keeps or logs
//! the number or the body: the number is kept only as its keyed digest per tenant, the body
//! only when it is a keyword (trimmed, at most 64 characters).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use nudge_domain::{Channel, Keyword, ProviderAccount, keyword_as_received};
use nudge_ledger::{Destination, InboundKeyword, InboundRecorded, LedgerTime};

use super::receipts::{refused, twilio_verified};
use crate::error::error_body;
use crate::state::AppState;

/// What Twilio is answered: an empty TwiML document (no reply is sent to the patient; the
/// carrier's own STOP and HELP answers stand).
const EMPTY_TWIML: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Response></Response>";

fn twiml() -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/xml; charset=utf-8")],
        EMPTY_TWIML,
    )
        .into_response()
}

fn bad_request(message: &'static str) -> Response {
    error_body(StatusCode::BAD_REQUEST, "invalid_inbound", message)
}

/// A patient's SMS to a number of `account` (Twilio's incoming-message webhook).
///
/// Verified with `X-Twilio-Signature` as the status callbacks are. A body that is STOP,
/// STOPALL, UNSUBSCRIBE, CANCEL, END or QUIT (any case, surrounding spaces ignored) opts the
/// sending number (`From`) out of SMS for every tenant that sends through the account (those
/// routed to it, and, for a worker's default account, every tenant without its own); START,
/// YES or UNSTOP opts it back in; HELP and anything else change nothing. Each change is kept
/// in the consent history with the keyword as received. A message (its `MessageSid`) is
/// recorded once: sent again, it is refused (403) and changes nothing.
#[utoipa::path(post, path = "/inbound/twilio/{account}", tag = "receipts", operation_id = "inbound_twilio",
    params(
        ("account" = String, Path, description = "the provider account the patient's message reached"),
        ("X-Twilio-Signature" = String, Header, description = "Twilio's signature of the request"),
    ),
    request_body(content = String, content_type = "application/x-www-form-urlencoded",
                 description = "Twilio's incoming-message parameters (MessageSid, From, To, Body, ...)"),
    responses(
        (status = 200, description = "recorded (or not a keyword): an empty TwiML document",
            content_type = "text/xml", body = String),
        (status = 400, description = "signed, but not an incoming message; nothing written", body = crate::error::ErrorBody),
        (status = 401, description = "no signature; nothing written", body = crate::error::ErrorBody),
        (status = 403, description = "the signature does not verify, the account takes no webhooks, or this message was recorded before; nothing written", body = crate::error::ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = crate::error::ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ))]
pub async fn twilio(
    State(state): State<AppState>,
    Path(account): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let params = match twilio_verified(&state, &account, &uri, &headers, &body) {
        Ok(params) => params,
        Err(status) => return refused(status),
    };
    let Ok(account) = ProviderAccount::parse(&account) else {
        return refused(StatusCode::FORBIDDEN);
    };
    let get = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let (Some(sid), Some(from)) = (get("MessageSid"), get("From")) else {
        return bad_request("MessageSid and From are required");
    };
    if sid.is_empty()
        || sid.len() > 64
        || !sid.bytes().all(|b| b.is_ascii_alphanumeric())
        || from.trim().is_empty()
        || from.len() > 64
    {
        return bad_request("MessageSid must be a plain word and From a number");
    }
    let body_text = get("Body").unwrap_or("");
    let Some(keyword) = Keyword::of_body(body_text) else {
        tracing::info!(%account, "an inbound message that is not a keyword: acknowledged");
        return twiml();
    };
    let Some(consent) = keyword.consent() else {
        tracing::info!(%account, keyword = keyword.as_str(), "an inbound HELP: nothing changed");
        return twiml();
    };
    let received = keyword_as_received(body_text);
    let correlation = super::reminders::correlation_id(&headers);
    let provider_event = format!("twilio:{sid}");
    let destination = Destination::new(from);
    let recorded = state
        .ledger()
        .record_inbound_keyword(
            state.cipher(),
            &InboundKeyword {
                account: &account,
                channel: Channel::Sms,
                destination: &destination,
                state: consent,
                keyword: &received,
                provider_event: &provider_event,
                correlation_id: Some(&correlation),
            },
            LedgerTime::Database,
        )
        .await;
    match recorded {
        Ok(InboundRecorded::Recorded { tenants }) => {
            if tenants == 0 {
                tracing::warn!(%account, keyword = keyword.as_str(),
                    "an inbound keyword to an account no tenant sends through: nothing changed");
            } else {
                tracing::info!(%account, keyword = keyword.as_str(), tenants,
                    consent = consent.as_str(), "an inbound keyword recorded");
            }
            twiml()
        }
        Ok(InboundRecorded::Replay) => {
            tracing::warn!(%account, "an inbound message recorded before: refused");
            error_body(
                StatusCode::FORBIDDEN,
                "replayed",
                "this message was recorded before",
            )
        }
        Err(e) => crate::error::ApiError::internal(e).into_response(),
    }
}
