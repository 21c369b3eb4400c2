//! The Twilio shape: the Messages resource's answers, signed status callbacks, and a patient's
//! reply sent, signed, to an incoming-message webhook on request (`POST /admin/inbound`).

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use hmac::{Hmac, Mac};

use crate::server::{App, carry_out, parse_account};
use crate::state::{Incoming, Reply};

/// The `X-Twilio-Signature` of a callback: base64 HMAC-SHA1, keyed by the auth token, of the
/// full URL followed by each POST parameter's name and value, sorted by name.
pub fn twilio_signature(auth_token: &str, url: &str, params: &[(String, String)]) -> String {
    let mut sorted: Vec<&(String, String)> = params.iter().collect();
    sorted.sort();
    let mut data = url.to_owned();
    for (k, v) in sorted {
        data.push_str(k);
        data.push_str(v);
    }
    let mut mac = <Hmac<sha1::Sha1> as Mac>::new_from_slice(auth_token.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
    mac.update(data.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
}

/// `SM` and 32 hex digits, from the stub's message id.
fn message_sid(message_id: &str) -> String {
    let n: u64 = message_id
        .trim_start_matches("msg_")
        .parse()
        .unwrap_or_default();
    format!("SM{n:032x}")
}

pub(crate) async fn send_message(
    State(app): State<App>,
    Path((account, account_sid)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let account = match parse_account(&account) {
        Ok(a) => a,
        Err(r) => return r.into_response(),
    };
    // The form holds PHI (To, Body): only whether it is complete, and the callback, are kept.
    let (complete, callback) = {
        let form: Vec<(String, String)> = url::form_urlencoded::parse(&body).into_owned().collect();
        let has = |name: &str| form.iter().any(|(k, v)| k == name && !v.is_empty());
        let complete = has("To") && (has("From") || has("MessagingServiceSid"));
        let callback = form
            .iter()
            .find(|(k, _)| k == "StatusCallback")
            .and_then(|(_, v)| url::Url::parse(v).ok());
        (complete, callback)
    };
    drop(body);
    let key = callback.as_ref().and_then(|u| {
        u.query_pairs()
            .find(|(k, _)| k == "key")
            .map(|(_, v)| v.into_owned())
    });
    let reply = app.stub.handle(
        &account,
        Incoming {
            key: key.as_deref(),
            invalid: (!complete).then_some("To and From or MessagingServiceSid are required"),
            traceparent: None,
            dedupe: false,
        },
    );
    if let (Some(callback), Some(message_id)) = (callback, reply.message_id.as_deref())
        && reply.receipt.as_deref() != Some("none")
    {
        callback_receipt(&app, &account_sid, callback, message_id, &reply);
    }
    carry_out(&app, reply, |r| render(r, &account_sid)).await
}

fn callback_receipt(app: &App, account_sid: &str, url: url::Url, message_id: &str, reply: &Reply) {
    let status = reply
        .receipt
        .clone()
        .unwrap_or_else(|| "delivered".to_owned());
    let mut params = vec![
        ("AccountSid".to_owned(), account_sid.to_owned()),
        ("ApiVersion".to_owned(), "2010-04-01".to_owned()),
        ("MessageSid".to_owned(), message_sid(message_id)),
        ("MessageStatus".to_owned(), status.clone()),
    ];
    if matches!(status.as_str(), "failed" | "undelivered") {
        let code = reply.code.clone().unwrap_or_else(|| "30003".to_owned());
        params.push(("ErrorCode".to_owned(), code));
    }
    let mut form = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in &params {
        form.append_pair(k, v);
    }
    let mut request = app
        .receipts
        .post(url.clone())
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(form.finish());
    if let Some(token) = &app.stub.shape().twilio_auth_token {
        request = request.header(
            "X-Twilio-Signature",
            twilio_signature(token, url.as_str(), &params),
        );
    }
    crate::shape::send_receipt(reply.receipt_delay, request, "twilio");
}

fn default_code(status: u16) -> u32 {
    match status {
        401 => 20003,
        404 => 20404,
        429 => 20429,
        500..=599 => 20500,
        _ => 21604,
    }
}

fn render(reply: Reply, account_sid: &str) -> Response {
    let mut response = if (200..=299).contains(&reply.status) {
        let sid = reply
            .message_id
            .as_deref()
            .map(message_sid)
            .unwrap_or_default();
        (
            StatusCode::CREATED,
            Json(serde_json::json!({
                "sid": sid, "account_sid": account_sid, "status": "queued",
                "api_version": "2010-04-01",
            })),
        )
            .into_response()
    } else {
        let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::BAD_REQUEST);
        let code = reply
            .code
            .as_deref()
            .and_then(|c| c.parse::<u32>().ok())
            .unwrap_or_else(|| default_code(reply.status));
        (
            status,
            Json(serde_json::json!({
                "code": code,
                "message": format!("scripted {}", reply.status),
                "more_info": format!("https://www.twilio.com/docs/errors/{code}"),
                "status": reply.status,
            })),
        )
            .into_response()
    };
    if let Some(ra) = reply.retry_after.as_deref()
        && let Ok(value) = HeaderValue::from_str(ra)
    {
        response.headers_mut().insert(header::RETRY_AFTER, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_matches_twilio_s_documented_example() {
        // Twilio's security documentation example (auth token 12345).
        let params: Vec<(String, String)> = [
            ("CallSid", "CA1234567890ABCDE"),
            ("Caller", "+12349013030"),
            ("Digits", "1234"),
            ("From", "+12349013030"),
            ("To", "+18005551212"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        assert_eq!(
            twilio_signature(
                "12345",
                "https://mycompany.com/myapp.php?foo=1&bar=2",
                &params
            ),
            "0/KCTR6DLpKmkAf8muzZqo1nDgQ="
        );
    }
}

/// A patient's reply for the stub to send to an incoming-message webhook, as Twilio would.
#[derive(Debug, serde::Deserialize)]
pub(crate) struct InboundRequest {
    /// The webhook's URL (loopback only).
    url: String,
    /// The patient's number.
    from: String,
    /// The number the patient replied to.
    to: String,
    body: String,
    /// The message's sid; a fresh one when absent (the same one again is a replay).
    message_sid: Option<String>,
}

/// `POST /admin/inbound`: sends `request` as Twilio's incoming-message webhook, signed with the
/// auth token, and answers what the webhook answered (`{"status", "body", "message_sid"}`).
/// 409 when the stub has no auth token, 400 for a URL that is not loopback.
pub(crate) async fn send_inbound(
    State(app): State<App>,
    Json(request): Json<InboundRequest>,
) -> Response {
    let Some(token) = app.stub.shape().twilio_auth_token.clone() else {
        return crate::server::error(
            StatusCode::CONFLICT,
            "the stub has no --twilio-auth-token to sign with",
        );
    };
    let url = match url::Url::parse(&request.url) {
        Ok(u) if matches!(u.host_str(), Some("127.0.0.1" | "localhost" | "[::1]")) => u,
        _ => return crate::server::error(StatusCode::BAD_REQUEST, "url must be a loopback URL"),
    };
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let sid = request.message_sid.unwrap_or_else(|| {
        format!(
            "SM{:032x}",
            (1u64 << 40) + NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        )
    });
    let params = vec![
        (
            "AccountSid".to_owned(),
            "AC00000000000000000000000000000000".to_owned(),
        ),
        ("ApiVersion".to_owned(), "2010-04-01".to_owned()),
        ("Body".to_owned(), request.body),
        ("From".to_owned(), request.from),
        ("MessageSid".to_owned(), sid.clone()),
        ("NumMedia".to_owned(), "0".to_owned()),
        ("To".to_owned(), request.to),
    ];
    let form = {
        let mut form = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in &params {
            form.append_pair(k, v);
        }
        form.finish()
    };
    let sent = app
        .receipts
        .post(url.clone())
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .header(
            "X-Twilio-Signature",
            twilio_signature(&token, url.as_str(), &params),
        )
        .body(form)
        .send()
        .await;
    match sent {
        Ok(answer) => {
            let status = answer.status().as_u16();
            let body = answer.text().await.unwrap_or_default();
            tracing::info!(status, "inbound message sent");
            Json(serde_json::json!({"status": status, "body": body, "message_sid": sid}))
                .into_response()
        }
        Err(e) => crate::server::error(
            StatusCode::BAD_GATEWAY,
            format!("the webhook did not answer: {}", e.without_url()),
        ),
    }
}
