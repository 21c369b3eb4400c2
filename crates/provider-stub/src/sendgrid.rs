//! The SendGrid shape: v3 Mail Send's answers and signed event webhook batches.

use std::collections::HashMap;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use chrono::Utc;
use serde::Deserialize;

use crate::server::{App, carry_out, parse_account};
use crate::state::{Incoming, Reply};

/// The `custom_args` key the delivery's key is read from (and echoed in events).
const KEY_ARG: &str = "nudge_key";

/// The event webhook's signature headers.
pub const SIGNATURE_HEADER: &str = "X-Twilio-Email-Event-Webhook-Signature";
pub const TIMESTAMP_HEADER: &str = "X-Twilio-Email-Event-Webhook-Timestamp";

/// The signature SendGrid puts on an event batch: ECDSA P-256 with SHA-256 over the timestamp
/// followed by the raw body, DER-encoded, base64.
pub fn sendgrid_signature(key: &p256::ecdsa::SigningKey, timestamp: &str, body: &[u8]) -> String {
    use p256::ecdsa::signature::Signer as _;
    let mut payload = timestamp.as_bytes().to_vec();
    payload.extend_from_slice(body);
    let signature: p256::ecdsa::Signature = key.sign(&payload);
    base64::engine::general_purpose::STANDARD.encode(signature.to_der().as_bytes())
}

#[derive(Deserialize)]
struct Mail {
    #[serde(default)]
    personalizations: Vec<Personalization>,
    #[serde(default)]
    custom_args: HashMap<String, String>,
}

#[derive(Deserialize)]
struct Personalization {
    #[serde(default)]
    to: Vec<Address>,
}

#[derive(Deserialize)]
struct Address {
    email: String,
}

pub(crate) async fn send_message(
    State(app): State<App>,
    Path(account): Path<String>,
    body: Bytes,
) -> Response {
    let account = match parse_account(&account) {
        Ok(a) => a,
        Err(r) => return r.into_response(),
    };
    // The mail holds PHI (the address, the text): only whether it is complete, and the key,
    // are kept.
    let (complete, key) = match serde_json::from_slice::<Mail>(&body) {
        Ok(mail) => (
            mail.personalizations
                .first()
                .and_then(|p| p.to.first())
                .is_some_and(|a| !a.email.is_empty()),
            mail.custom_args.get(KEY_ARG).cloned(),
        ),
        Err(_) => (false, None),
    };
    drop(body);
    let reply = app.stub.handle(
        &account,
        Incoming {
            key: key.as_deref(),
            invalid: (!complete).then_some("personalizations[0].to[0].email is required"),
            traceparent: None,
            dedupe: false,
        },
    );
    if let (Some(message_id), Some(key)) = (reply.message_id.as_deref(), key.as_deref())
        && reply.receipt.as_deref() != Some("none")
    {
        event_receipt(&app, message_id, key, &reply);
    }
    carry_out(&app, reply, render).await
}

fn event_receipt(app: &App, message_id: &str, key: &str, reply: &Reply) {
    let shape = app.stub.shape();
    let Some(url) = shape.sendgrid_event_url.clone() else {
        return;
    };
    let event = reply
        .receipt
        .clone()
        .unwrap_or_else(|| "delivered".to_owned());
    let now = Utc::now().timestamp();
    let mut item = serde_json::json!({
        // Never the real address: the stub keeps no destination.
        "email": "recipient@example.invalid",
        "timestamp": now,
        "event": event,
        "sg_event_id": format!("evt-{message_id}-{event}"),
        "sg_message_id": format!("{message_id}.filter0001.stub.0"),
        KEY_ARG: key,
    });
    if event == "bounce" {
        item["type"] = "bounce".into();
        item["reason"] = "550 5.1.1 The email account does not exist".into();
    }
    let body = serde_json::to_vec(&[item]).unwrap_or_default();
    let timestamp = now.to_string();
    let mut request = app
        .receipts
        .post(url)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = &shape.sendgrid_signing_key {
        request = request
            .header(SIGNATURE_HEADER, sendgrid_signature(key, &timestamp, &body))
            .header(TIMESTAMP_HEADER, timestamp);
    }
    crate::shape::send_receipt(reply.receipt_delay, request.body(body), "sendgrid");
}

/// When a throttled request may come back, as a Unix time: the scripted `Retry-After` (delta
/// seconds or a date) from now; a second from now when there is none.
fn reset_at(retry_after: Option<&str>) -> i64 {
    let now = Utc::now();
    let at = match retry_after {
        Some(v) => v
            .trim()
            .parse::<i64>()
            .map(|secs| now + chrono::Duration::seconds(secs))
            .or_else(|_| chrono::DateTime::parse_from_rfc2822(v).map(|d| d.with_timezone(&Utc)))
            .unwrap_or(now + chrono::Duration::seconds(1)),
        None => now + chrono::Duration::seconds(1),
    };
    at.timestamp()
}

fn errors(message: &str, field: Option<&str>) -> serde_json::Value {
    serde_json::json!({ "errors": [{ "message": message, "field": field, "help": null }] })
}

fn render(reply: Reply) -> Response {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::BAD_REQUEST);
    let mut response = match reply.status {
        200..=299 => StatusCode::ACCEPTED.into_response(),
        429 => (status, Json(errors("too many requests", None))).into_response(),
        400 if reply.code.as_deref() == Some("invalid_to") => (
            status,
            Json(errors(
                "Does not contain a valid address.",
                Some("personalizations.0.to.0.email"),
            )),
        )
            .into_response(),
        401 => (
            status,
            Json(errors(
                "The provided authorization grant is invalid, expired, or revoked",
                None,
            )),
        )
            .into_response(),
        _ => (
            status,
            Json(errors(&format!("scripted {}", reply.status), None)),
        )
            .into_response(),
    };
    let headers = response.headers_mut();
    if let Some(id) = reply.message_id.as_deref()
        && (200..=299).contains(&reply.status)
        && let Ok(v) = HeaderValue::from_str(id)
    {
        headers.insert("x-message-id", v);
    }
    if reply.status == 429 {
        headers.insert("x-ratelimit-limit", HeaderValue::from_static("600"));
        headers.insert("x-ratelimit-remaining", HeaderValue::from_static("0"));
        if let Ok(v) = HeaderValue::from_str(&reset_at(reply.retry_after.as_deref()).to_string()) {
            headers.insert("x-ratelimit-reset", v);
        }
    }
    response
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use p256::ecdsa::signature::Verifier as _;

    #[test]
    fn a_batch_signature_verifies_with_the_public_key_over_timestamp_and_body() {
        let key = p256::ecdsa::SigningKey::from_bytes(&[7u8; 32].into()).unwrap();
        let sig = sendgrid_signature(&key, "1588788367", b"[{\"event\":\"delivered\"}]");
        let der = base64::engine::general_purpose::STANDARD
            .decode(sig)
            .unwrap();
        let sig = p256::ecdsa::Signature::from_der(&der).unwrap();
        let verifying = p256::ecdsa::VerifyingKey::from(&key);
        assert!(
            verifying
                .verify(b"1588788367[{\"event\":\"delivered\"}]", &sig)
                .is_ok()
        );
        assert!(
            verifying
                .verify(b"1588788368[{\"event\":\"delivered\"}]", &sig)
                .is_err()
        );
    }
}
