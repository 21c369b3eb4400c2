//! The routes of providers' delivery receipts: Twilio status callbacks and SendGrid event
//! webhooks, each verified as its provider signs it (with the verifiers of
//! [`crate::receipts`]) before anything of it is read, then recorded against its delivery.
//!
//! Outside `/v1`: signed by the provider, not by a tenant, so [`crate::auth`] does not apply.
//! An account not configured is refused exactly as a bad signature is (403), a request
//! without its signature header is 401. Must never write anything for a refused request, nor
//! keep or log anything of a receipt but statuses, codes, ids and the delivery key (Twilio's
//! `To` and SendGrid's `email` are PHI).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use nudge_domain::{IdempotencyKey, ProviderAccount};
use nudge_ledger::{LedgerTime, Receipt};

use crate::error::error_body;
use crate::receipts::{MAX_EVENTS, SendgridEvent, plain, sendgrid_meaning, twilio_meaning};
use crate::state::AppState;

pub(crate) fn refused(status: StatusCode) -> Response {
    match status {
        StatusCode::UNAUTHORIZED => error_body(
            status,
            "missing_signature",
            "the provider's signature header is missing",
        ),
        _ => error_body(
            StatusCode::FORBIDDEN,
            "bad_signature",
            "the signature does not verify",
        ),
    }
}

fn bad_request(message: &'static str) -> Response {
    error_body(StatusCode::BAD_REQUEST, "invalid_receipt", message)
}

/// A Twilio status callback for a message sent through `account`.
///
/// Verified with `X-Twilio-Signature` (base64 HMAC-SHA1, keyed by the account's auth token, of
/// the URL Twilio called followed by each form parameter's name and value, sorted by name).
/// The `key` query parameter is the delivery's key, which nudge put in the `StatusCallback`.
/// Recorded once per message and status; a receipt for a delivery held ambiguous settles it.
#[utoipa::path(post, path = "/receipts/twilio/{account}", tag = "receipts",
    params(
        ("account" = String, Path, description = "the provider account the message went through"),
        ("key" = Option<String>, Query, description = "the delivery's key"),
        ("X-Twilio-Signature" = String, Header, description = "Twilio's signature of the request"),
    ),
    request_body(content = String, content_type = "application/x-www-form-urlencoded",
                 description = "Twilio's status callback parameters (MessageSid, MessageStatus, ErrorCode, ...)"),
    responses(
        (status = 204, description = "recorded (or seen before)"),
        (status = 400, description = "signed, but not a status callback; nothing written", body = crate::error::ErrorBody),
        (status = 401, description = "no signature; nothing written", body = crate::error::ErrorBody),
        (status = 403, description = "the signature does not verify, or the account takes no receipts; nothing written", body = crate::error::ErrorBody),
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

    let get = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let (Some(status), Some(sid)) = (get("MessageStatus"), get("MessageSid")) else {
        return bad_request("MessageStatus and MessageSid are required");
    };
    if !plain(status, 64) || !plain(sid, 64) {
        return bad_request("MessageStatus and MessageSid must be plain words");
    }
    let code = get("ErrorCode").filter(|c| plain(c, 16));
    let key = uri.query().and_then(|q| {
        url::form_urlencoded::parse(q.as_bytes())
            .find(|(k, _)| k == "key")
            .and_then(|(_, v)| IdempotencyKey::parse(&v).ok())
    });
    let (outcome, contact_flag) = twilio_meaning(status, code);
    let Ok(account) = ProviderAccount::parse(&account) else {
        return refused(StatusCode::FORBIDDEN);
    };
    record(
        &state,
        vec![Receipt {
            account,
            event_key: format!("{sid}:{status}"),
            delivery_key: key,
            status: status.to_owned(),
            outcome,
            contact_flag,
            code: code.map(str::to_owned),
            provider_message_id: Some(sid.to_owned()),
        }],
    )
    .await
}

/// A SendGrid event webhook batch for mail sent through `account`.
///
/// Verified with `X-Twilio-Email-Event-Webhook-Signature` (base64 DER ECDSA P-256 with SHA-256
/// over `X-Twilio-Email-Event-Webhook-Timestamp` followed by the raw body, under the account's
/// verification key), the timestamp within `intake.timestamp_tolerance_s`. Each event's
/// `nudge_key` (a custom argument nudge set) names its delivery; recorded once per
/// `sg_event_id`.
#[utoipa::path(post, path = "/receipts/sendgrid/{account}", tag = "receipts",
    params(
        ("account" = String, Path, description = "the provider account the mail went through"),
        ("X-Twilio-Email-Event-Webhook-Signature" = String, Header, description = "SendGrid's signature of the batch"),
        ("X-Twilio-Email-Event-Webhook-Timestamp" = String, Header, description = "Unix seconds, signed with the body"),
    ),
    request_body(content = Vec<Object>, content_type = "application/json",
                 description = "SendGrid's events (event, sg_event_id, sg_message_id, nudge_key, type, reason, ...)"),
    responses(
        (status = 204, description = "recorded (or seen before)"),
        (status = 400, description = "signed, but not a batch of events; nothing written", body = crate::error::ErrorBody),
        (status = 401, description = "no signature; nothing written", body = crate::error::ErrorBody),
        (status = 403, description = "the signature does not verify, is stale, or the account takes no receipts; nothing written", body = crate::error::ErrorBody),
        (status = 503, description = "the ledger is away or read-only (a database failover or restart); send again after Retry-After seconds", body = crate::error::ErrorBody,
            headers(("Retry-After" = u64, description = "seconds to wait before sending the request again"))),
    ))]
pub async fn sendgrid(
    State(state): State<AppState>,
    Path(account): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let receipts = state.receipts();
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let (Some(signature), Some(timestamp)) = (
        header("x-twilio-email-event-webhook-signature"),
        header("x-twilio-email-event-webhook-timestamp"),
    ) else {
        return refused(StatusCode::UNAUTHORIZED);
    };
    let Some(key) = receipts.sendgrid_key(&account) else {
        return refused(StatusCode::FORBIDDEN);
    };
    let Ok(at) = timestamp.parse::<i64>() else {
        return refused(StatusCode::FORBIDDEN);
    };
    // `abs_diff`: the timestamp is the sender's to choose, and a difference of two `i64`s
    // can overflow (and, unchecked, wrap into "fresh").
    if state.now().timestamp().abs_diff(at) > state.limits().timestamp_tolerance_s {
        return refused(StatusCode::FORBIDDEN);
    }
    let Some(signature) = base64::engine::general_purpose::STANDARD
        .decode(signature)
        .ok()
        .and_then(|der| p256::ecdsa::Signature::from_der(&der).ok())
    else {
        return refused(StatusCode::FORBIDDEN);
    };
    let mut signed = timestamp.as_bytes().to_vec();
    signed.extend_from_slice(&body);
    use p256::ecdsa::signature::Verifier as _;
    if key.verify(&signed, &signature).is_err() {
        return refused(StatusCode::FORBIDDEN);
    }

    let Ok(events) = serde_json::from_slice::<Vec<SendgridEvent>>(&body) else {
        return bad_request("the body must be a JSON array of events");
    };
    if events.len() > MAX_EVENTS {
        return bad_request("too many events in one batch");
    }
    let Ok(account) = ProviderAccount::parse(&account) else {
        return refused(StatusCode::FORBIDDEN);
    };
    let mut batch = Vec::with_capacity(events.len());
    for e in &events {
        let Some(status) = e.event.as_deref().filter(|s| plain(s, 64)) else {
            continue;
        };
        let message_id = e.sg_message_id.as_deref().filter(|m| plain(m, 256));
        let event_key = match e.sg_event_id.as_deref().filter(|id| plain(id, 200)) {
            Some(id) => id.to_owned(),
            None => match message_id {
                Some(m) => format!("{m}:{status}").chars().take(200).collect(),
                None => continue,
            },
        };
        let (outcome, contact_flag) = sendgrid_meaning(e);
        batch.push(Receipt {
            account: account.clone(),
            event_key,
            delivery_key: e
                .nudge_key
                .as_deref()
                .and_then(|k| IdempotencyKey::parse(k).ok()),
            status: status.to_owned(),
            outcome,
            contact_flag,
            code: None,
            // X-Message-Id is the part before the first dot.
            provider_message_id: message_id.map(|m| m.split('.').next().unwrap_or(m).to_owned()),
        });
    }
    record(&state, batch).await
}

/// The form parameters of a Twilio request to `account`, once `X-Twilio-Signature` verifies:
/// base64 HMAC-SHA1, keyed by the account's auth token, of the URL Twilio called (the
/// configured public base and the request's path and query) followed by each form
/// parameter's name and value, sorted by name. Otherwise the status to refuse it with (see
/// [`refused`]): 401 without the header, 403 for an account that takes none or a signature
/// that does not verify.
pub(crate) fn twilio_verified(
    state: &AppState,
    account: &str,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Vec<(String, String)>, StatusCode> {
    let receipts = state.receipts();
    let Some(signature) = headers
        .get("x-twilio-signature")
        .and_then(|v| v.to_str().ok())
    else {
        return Err(StatusCode::UNAUTHORIZED);
    };
    let (Some(token), Some(base)) = (receipts.twilio_token(account), receipts.public_base()) else {
        return Err(StatusCode::FORBIDDEN);
    };
    let params: Vec<(String, String)> = url::form_urlencoded::parse(body).into_owned().collect();
    let url = format!(
        "{}{}",
        base.as_str().trim_end_matches('/'),
        uri.path_and_query().map_or("", |p| p.as_str())
    );
    let mut sorted: Vec<&(String, String)> = params.iter().collect();
    sorted.sort();
    let mut signed = url;
    for (k, v) in sorted {
        signed.push_str(k);
        signed.push_str(v);
    }
    let Ok(mut mac) = <Hmac<sha1::Sha1> as Mac>::new_from_slice(token.expose().as_bytes()) else {
        return Err(StatusCode::FORBIDDEN);
    };
    mac.update(signed.as_bytes());
    let given = base64::engine::general_purpose::STANDARD
        .decode(signature)
        .unwrap_or_default();
    if mac.verify_slice(&given).is_err() {
        return Err(StatusCode::FORBIDDEN);
    }
    Ok(params)
}

async fn record(state: &AppState, batch: Vec<Receipt>) -> Response {
    match state
        .ledger()
        .record_receipts(&batch, LedgerTime::Database)
        .await
    {
        Ok(recorded) => {
            let settled = recorded
                .iter()
                .filter(|r| matches!(r, nudge_ledger::ReceiptRecorded::New { settled: true, .. }))
                .count();
            tracing::info!(
                receipts = batch.len(),
                settled,
                "provider receipts recorded"
            );
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => crate::error::ApiError::internal(e).into_response(),
    }
}
