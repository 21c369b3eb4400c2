//! The routes of patients' replies: Twilio's incoming-message webhook, and a generic
//! provider's, signed by Standard Webhooks. A reply that is a
//! keyword changes the replying number's consent (decision 0505): STOP and its synonyms opt
//! it out of SMS for every tenant that sends through the account, START and its synonyms opt
//! it back in, HELP changes nothing. Anything else is not ours to read: it is acknowledged
//! and dropped.
//!
//! Outside `/v1`: signed by the provider, verified before anything of it is read (Twilio's
//! exactly as its status callbacks are, `receipts::twilio_verified`; a generic provider's with
//! the account's Standard Webhooks secret, `receipts.generic`). Never keeps or logs
//! the number or the body: the number is kept only as its keyed digest per tenant, the body
//! only when it is a keyword (trimmed, at most 64 characters).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use nudge_domain::{Channel, ConsentState, Keyword, ProviderAccount, keyword_as_received};
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
    match apply_keyword(
        &state,
        &account,
        from,
        body_text,
        &format!("twilio:{sid}"),
        &headers,
    )
    .await
    {
        // Twilio's signature carries no time: the same message again may be a capture.
        Ok(Applied::Replay) => error_body(
            StatusCode::FORBIDDEN,
            "replayed",
            "this message was recorded before",
        ),
        Ok(_) => twiml(),
        Err(response) => response,
    }
}

/// What a patient's reply did.
enum Applied {
    /// Not a keyword, or HELP: nothing changed.
    Nothing,
    /// This message was recorded before: nothing changed.
    Replay,
    /// Recorded as `state` for this many tenants (none when no tenant sends through the
    /// account).
    Recorded { state: ConsentState, tenants: usize },
}

/// Reads a verified reply of `from` to `account`: a keyword changes the number's consent for
/// every tenant sending through the account, once per `provider_event` (the same message
/// again is [`Applied::Replay`]). The ledger's error is the `Err` answer.
async fn apply_keyword(
    state: &AppState,
    account: &ProviderAccount,
    from: &str,
    body_text: &str,
    provider_event: &str,
    headers: &HeaderMap,
) -> Result<Applied, Response> {
    let Some(keyword) = Keyword::of_body(body_text) else {
        tracing::info!(%account, "an inbound message that is not a keyword: acknowledged");
        return Ok(Applied::Nothing);
    };
    let Some(consent) = keyword.consent() else {
        tracing::info!(%account, keyword = keyword.as_str(), "an inbound HELP: nothing changed");
        return Ok(Applied::Nothing);
    };
    let received = keyword_as_received(body_text);
    let correlation = super::reminders::correlation_id(headers);
    let destination = Destination::new(from);
    let recorded = state
        .ledger()
        .record_inbound_keyword(
            state.cipher(),
            &InboundKeyword {
                account,
                channel: Channel::Sms,
                destination: &destination,
                state: consent,
                keyword: &received,
                provider_event,
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
            Ok(Applied::Recorded {
                state: consent,
                tenants,
            })
        }
        Ok(InboundRecorded::Replay) => {
            tracing::warn!(%account, "an inbound message recorded before");
            Ok(Applied::Replay)
        }
        Err(e) => Err(crate::error::ApiError::internal(e).into_response()),
    }
}

/// A patient's reply as a generic provider sends it (other fields are ignored). `Debug` shows
/// no number and no body.
#[derive(serde::Deserialize, utoipa::ToSchema)]
pub struct GenericInbound {
    /// The number the patient sent from (E.164).
    #[schema(min_length = 1, max_length = 64, example = "+15550100100")]
    pub from: String,
    /// The number or sender the message reached (not read).
    pub to: Option<String>,
    /// The message as the patient typed it: only a keyword is read (at most 64 characters
    /// after trimming); anything else is acknowledged and dropped.
    pub body: String,
}

impl std::fmt::Debug for GenericInbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GenericInbound(<redacted>)")
    }
}

/// What a generic provider's reply changed.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct GenericInboundAnswer {
    /// `opted_out` (STOP and its synonyms), `opted_in` (START, YES, UNSTOP), or null: not a
    /// keyword, or HELP.
    pub state: Option<String>,
    /// The tenants whose consent of the number changed (those sending through the account).
    pub tenants: u64,
    /// This message (its `webhook-id`) was recorded before: nothing changed. A provider's
    /// retry of a message whose answer it lost.
    pub duplicate: bool,
}

/// A patient's SMS to a number of the generic account `account`.
///
/// Signed by the provider with Standard Webhooks under the account's secret
/// (`receipts.generic`): `webhook-id` is the message's identity on the account (recorded
/// once: the same message again, a provider's retry, is answered `duplicate` and changes
/// nothing), `webhook-timestamp` within `intake.timestamp_tolerance_s` of the intake's clock
/// (either side), `webhook-signature` `v1,<base64 HMAC-SHA256 of id.timestamp.body>`. The keywords are
/// Twilio's route's: STOP and its synonyms opt `from` out of SMS for every tenant that sends
/// through the account, START, YES, UNSTOP back in, anything else changes nothing.
#[utoipa::path(post, path = "/inbound/generic/{account}", tag = "receipts", operation_id = "inbound_generic",
    params(
        ("account" = String, Path, description = "the provider account the patient's message reached"),
        ("webhook-id" = String, Header, description = "the message's identity (1 to 100 of letters, digits, `_`, `-`, `.`)"),
        ("webhook-timestamp" = i64, Header, description = "unix seconds the message was signed at"),
        ("webhook-signature" = String, Header, description = "v1,<base64 signature>, space-separated for several"),
    ),
    request_body(content = GenericInbound, content_type = "application/json"),
    responses(
        (status = 200, description = "recorded (or not a keyword, or a duplicate)", body = GenericInboundAnswer),
        (status = 400, description = "signed, but not a reply; nothing written", body = crate::error::ErrorBody),
        (status = 401, description = "a signature header is missing; nothing written", body = crate::error::ErrorBody),
        (status = 403, description = "the signature does not verify, its timestamp is outside the tolerance, or the account takes no replies; nothing written", body = crate::error::ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = crate::error::ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ))]
pub async fn generic(
    State(state): State<AppState>,
    Path(account): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let signed = ["webhook-id", "webhook-timestamp", "webhook-signature"];
    if signed.iter().any(|h| !headers.contains_key(*h)) {
        return refused(StatusCode::UNAUTHORIZED);
    }
    let Some(verifier) = state.receipts().generic_verifier(&account) else {
        return refused(StatusCode::FORBIDDEN);
    };
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    // The timestamp by the intake's clock and tolerance, then the signature over it.
    let tolerance = i64::try_from(state.limits().timestamp_tolerance_s).unwrap_or(i64::MAX);
    let Some(at) = header("webhook-timestamp")
        .and_then(|t| t.parse::<i64>().ok())
        .filter(|t| (state.now().timestamp() - t).abs() <= tolerance)
    else {
        return refused(StatusCode::FORBIDDEN);
    };
    let (Some(id), Some(signatures)) = (header("webhook-id"), header("webhook-signature")) else {
        return refused(StatusCode::FORBIDDEN);
    };
    let Ok(expected) = verifier.sign(id, at, &body) else {
        return refused(StatusCode::FORBIDDEN);
    };
    let verified = signatures
        .split(' ')
        .any(|given| constant_time_eq(given.as_bytes(), expected.as_bytes()));
    if !verified {
        return refused(StatusCode::FORBIDDEN);
    }
    let Ok(account) = ProviderAccount::parse(&account) else {
        return refused(StatusCode::FORBIDDEN);
    };
    if !crate::receipts::plain(id, 100) {
        return bad_request("webhook-id must be 1 to 100 of letters, digits, '_', '-', '.'");
    }
    let Ok(reply) = serde_json::from_slice::<GenericInbound>(&body) else {
        return bad_request("the body must be {\"from\", \"to\"?, \"body\"}");
    };
    if reply.from.trim().is_empty() || reply.from.chars().count() > 64 {
        return bad_request("from must be a number");
    }
    match apply_keyword(
        &state,
        &account,
        &reply.from,
        &reply.body,
        // A webhook-id is unique per sender, not across providers: scoped by the account.
        &format!("generic:{account}:{id}"),
        &headers,
    )
    .await
    {
        Ok(applied) => {
            let answer = match applied {
                Applied::Nothing => GenericInboundAnswer {
                    state: None,
                    tenants: 0,
                    duplicate: false,
                },
                Applied::Replay => GenericInboundAnswer {
                    state: None,
                    tenants: 0,
                    duplicate: true,
                },
                Applied::Recorded { state, tenants } => GenericInboundAnswer {
                    state: Some(state.as_str().to_owned()),
                    tenants: tenants as u64,
                    duplicate: false,
                },
            };
            (StatusCode::OK, axum::Json(answer)).into_response()
        }
        Err(response) => response,
    }
}

/// Whether two signatures are the same, in time that depends only on their lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
