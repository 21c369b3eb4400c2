//! Delivery receipts from providers: Twilio status callbacks and SendGrid event webhooks,
//! verified as each provider signs them, recorded against their delivery in the ledger
//! (`Ledger::record_receipts`: replays change nothing, an ambiguous delivery is settled by what
//! the receipt shows, bounces and opt-outs flag the contact).
//!
//! These routes are outside `/v1`: they are signed by the provider, not by a tenant, so the
//! tenant scheme (`Nudge-Signature`) does not apply. A request for an account not configured
//! here is refused exactly as a bad signature is (403), a request without its signature header
//! is 401, and a refused request writes nothing. Receipts carry PHI (Twilio's `To`, SendGrid's
//! `email`): only statuses, codes, ids and the delivery key are read; nothing else is kept or
//! logged.
//!
//! # Keys (`[receipts]`)
//!
//! | key | default | rule |
//! |-----|---------|------|
//! | `receipts.public_base_url` | unset | `http(s)://host[:port]` the providers call the intake at (Twilio signs the full URL it called); required when `receipts.twilio` has an entry |
//! | `receipts.twilio` | `[]` | accounts whose callbacks are taken at `POST /receipts/twilio/{account}`: `{ account, auth_token (secret) }` |
//! | `receipts.sendgrid` | `[]` | accounts whose event batches are taken at `POST /receipts/sendgrid/{account}`: `{ account, verification_key }`, the key as SendGrid shows it (base64 DER SubjectPublicKeyInfo, P-256) |

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use nudge_config::{ConfigError, Secret};
use nudge_domain::{ContactFlag, IdempotencyKey, ProviderAccount};
use nudge_ledger::{LedgerTime, Receipt, ReceiptOutcome};
use serde::{Deserialize, Serialize};

use crate::api::AppState;
use crate::error::error_body;

/// The `[receipts]` section.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReceiptsSection {
    pub public_base_url: Option<String>,
    pub twilio: Vec<TwilioReceipts>,
    pub sendgrid: Vec<SendgridReceipts>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TwilioReceipts {
    pub account: String,
    pub auth_token: Secret,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendgridReceipts {
    pub account: String,
    pub verification_key: String,
}

/// The verifiers built from `[receipts]`.
#[derive(Default)]
pub struct Receipts {
    public_base: Option<url::Url>,
    twilio: HashMap<String, Secret>,
    sendgrid: HashMap<String, p256::ecdsa::VerifyingKey>,
}

impl std::fmt::Debug for Receipts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receipts")
            .field("twilio", &self.twilio.keys().collect::<Vec<_>>())
            .field("sendgrid", &self.sendgrid.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl ReceiptsSection {
    /// Checks every rule and builds the verifiers; errors name the key, never a value.
    pub fn build(&self) -> Result<Receipts, ConfigError> {
        let public_base = self
            .public_base_url
            .as_deref()
            .map(|raw| {
                let url = url::Url::parse(raw).map_err(|e| {
                    ConfigError::invalid("receipts.public_base_url", format!("not a URL ({e})"))
                })?;
                if !matches!(url.scheme(), "http" | "https")
                    || url.host().is_none()
                    || url.query().is_some()
                    || url.fragment().is_some()
                {
                    return Err(ConfigError::invalid(
                        "receipts.public_base_url",
                        "expected http(s)://host[:port][/path] without query or fragment",
                    ));
                }
                Ok(url)
            })
            .transpose()?;
        if !self.twilio.is_empty() && public_base.is_none() {
            return Err(ConfigError::invalid(
                "receipts.public_base_url",
                "required to verify Twilio callbacks (Twilio signs the URL it called)",
            ));
        }
        let mut twilio = HashMap::new();
        for (i, t) in self.twilio.iter().enumerate() {
            ProviderAccount::parse(&t.account).map_err(|e| {
                ConfigError::invalid(format!("receipts.twilio.{i}.account"), e.to_string())
            })?;
            if t.auth_token.expose().is_empty() {
                return Err(ConfigError::invalid(
                    format!("receipts.twilio.{i}.auth_token"),
                    "must not be empty",
                ));
            }
            twilio.insert(t.account.clone(), t.auth_token.clone());
        }
        let mut sendgrid = HashMap::new();
        for (i, s) in self.sendgrid.iter().enumerate() {
            ProviderAccount::parse(&s.account).map_err(|e| {
                ConfigError::invalid(format!("receipts.sendgrid.{i}.account"), e.to_string())
            })?;
            let key = verifying_key(&s.verification_key).ok_or_else(|| {
                ConfigError::invalid(
                    format!("receipts.sendgrid.{i}.verification_key"),
                    "must be a base64 DER P-256 public key (SubjectPublicKeyInfo)",
                )
            })?;
            sendgrid.insert(s.account.clone(), key);
        }
        Ok(Receipts {
            public_base,
            twilio,
            sendgrid,
        })
    }
}

fn verifying_key(b64: &str) -> Option<p256::ecdsa::VerifyingKey> {
    use p256::pkcs8::DecodePublicKey as _;
    let der = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    p256::ecdsa::VerifyingKey::from_public_key_der(&der).ok()
}

fn refused(status: StatusCode) -> Response {
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

/// A plain word: 1 to `max` characters of ASCII letters, digits, `_`, `-`, `.`.
fn plain(value: &str, max: usize) -> bool {
    !value.is_empty()
        && value.len() <= max
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// What Twilio's `MessageStatus` and `ErrorCode` mean.
fn twilio_meaning(status: &str, code: Option<&str>) -> (ReceiptOutcome, Option<ContactFlag>) {
    let outcome = match status {
        "delivered" | "read" => ReceiptOutcome::Delivered,
        "failed" | "undelivered" | "canceled" => ReceiptOutcome::Failed,
        _ => ReceiptOutcome::Progress,
    };
    let flag = match code {
        // The recipient replied STOP.
        Some("21610") => Some(ContactFlag::OptedOut),
        // Invalid number, not a mobile, unknown destination, landline.
        Some("21211" | "21614" | "30005" | "30006") => Some(ContactFlag::Invalid),
        _ => None,
    };
    (outcome, flag.filter(|_| outcome == ReceiptOutcome::Failed))
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
    ))]
pub async fn twilio(
    State(state): State<AppState>,
    Path(account): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let receipts = state.receipts();
    let Some(signature) = headers
        .get("x-twilio-signature")
        .and_then(|v| v.to_str().ok())
    else {
        return refused(StatusCode::UNAUTHORIZED);
    };
    let (Some(token), Some(base)) = (receipts.twilio.get(&account), receipts.public_base.as_ref())
    else {
        return refused(StatusCode::FORBIDDEN);
    };
    let params: Vec<(String, String)> = url::form_urlencoded::parse(&body).into_owned().collect();
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
        return refused(StatusCode::FORBIDDEN);
    };
    mac.update(signed.as_bytes());
    let given = base64::engine::general_purpose::STANDARD
        .decode(signature)
        .unwrap_or_default();
    if mac.verify_slice(&given).is_err() {
        return refused(StatusCode::FORBIDDEN);
    }

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

/// The fields of a SendGrid event that nudge reads; the rest (the address among them) is
/// skipped without being kept.
#[derive(Deserialize)]
struct SendgridEvent {
    event: Option<String>,
    sg_event_id: Option<String>,
    sg_message_id: Option<String>,
    nudge_key: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    reason: Option<String>,
}

/// The most events taken from one batch (SendGrid batches by size; a larger one is refused).
const MAX_EVENTS: usize = 1000;

/// What a SendGrid event means.
fn sendgrid_meaning(e: &SendgridEvent) -> (ReceiptOutcome, Option<ContactFlag>) {
    match e.event.as_deref().unwrap_or_default() {
        "delivered" => (ReceiptOutcome::Delivered, None),
        // It arrived; the recipient does not want more.
        "spamreport" | "unsubscribe" | "group_unsubscribe" => {
            (ReceiptOutcome::Delivered, Some(ContactFlag::OptedOut))
        }
        "bounce" if e.kind.as_deref() == Some("blocked") => (ReceiptOutcome::Failed, None),
        "bounce" => (ReceiptOutcome::Failed, Some(ContactFlag::Invalid)),
        "dropped" => {
            let reason = e.reason.as_deref().unwrap_or_default().to_ascii_lowercase();
            let flag = if reason.contains("unsubscribe") || reason.contains("spam") {
                Some(ContactFlag::OptedOut)
            } else if reason.contains("bounce") || reason.contains("invalid") {
                Some(ContactFlag::Invalid)
            } else {
                None
            };
            (ReceiptOutcome::Failed, flag)
        }
        _ => (ReceiptOutcome::Progress, None),
    }
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
    let Some(key) = receipts.sendgrid.get(&account) else {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn twilio_statuses_and_codes_map_to_outcomes_and_flags() {
        assert_eq!(
            twilio_meaning("delivered", None),
            (ReceiptOutcome::Delivered, None)
        );
        assert_eq!(
            twilio_meaning("sent", None),
            (ReceiptOutcome::Progress, None)
        );
        assert_eq!(
            twilio_meaning("undelivered", Some("30005")),
            (ReceiptOutcome::Failed, Some(ContactFlag::Invalid))
        );
        assert_eq!(
            twilio_meaning("failed", Some("21610")),
            (ReceiptOutcome::Failed, Some(ContactFlag::OptedOut))
        );
        assert_eq!(
            twilio_meaning("undelivered", Some("30003")),
            (ReceiptOutcome::Failed, None)
        );
    }

    fn event(name: &str, kind: Option<&str>, reason: Option<&str>) -> SendgridEvent {
        SendgridEvent {
            event: Some(name.into()),
            sg_event_id: None,
            sg_message_id: None,
            nudge_key: None,
            kind: kind.map(str::to_owned),
            reason: reason.map(str::to_owned),
        }
    }

    #[test]
    fn sendgrid_events_map_to_outcomes_and_flags() {
        use ReceiptOutcome::*;
        assert_eq!(
            sendgrid_meaning(&event("delivered", None, None)),
            (Delivered, None)
        );
        assert_eq!(
            sendgrid_meaning(&event("processed", None, None)),
            (Progress, None)
        );
        assert_eq!(
            sendgrid_meaning(&event("bounce", Some("bounce"), None)),
            (Failed, Some(ContactFlag::Invalid))
        );
        assert_eq!(
            sendgrid_meaning(&event("bounce", Some("blocked"), None)),
            (Failed, None)
        );
        assert_eq!(
            sendgrid_meaning(&event("unsubscribe", None, None)),
            (Delivered, Some(ContactFlag::OptedOut))
        );
        assert_eq!(
            sendgrid_meaning(&event("dropped", None, Some("Unsubscribed Address"))),
            (Failed, Some(ContactFlag::OptedOut))
        );
        assert_eq!(
            sendgrid_meaning(&event("dropped", None, Some("Bounced Address"))),
            (Failed, Some(ContactFlag::Invalid))
        );
    }
}
