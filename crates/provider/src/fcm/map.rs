//! FCM HTTP v1's answers mapped onto [`ProviderAnswer`]s: a pure function of the status, the
//! headers and the body, so every documented error body is tested without a server.
//!
//! An error body is Google's `{"error": {"code", "message", "status", "details": [...]}}`; the FCM
//! error code is the `errorCode` of the `details` entry typed
//! `type.googleapis.com/google.firebase.fcm.v1.FcmError`, and `error.status` (the canonical gRPC
//! status) stands in when there is none.
//!
//! | answer | verdict |
//! |---|---|
//! | 200 | accepted; `name` (`projects/{p}/messages/{id}`) is the message id |
//! | `UNREGISTERED` (404) | contact invalid: the app instance is gone |
//! | `SENDER_ID_MISMATCH` (403) | contact invalid: the token belongs to another sender |
//! | `INVALID_ARGUMENT` (400) with a field violation on `message.token` | contact invalid |
//! | `INVALID_ARGUMENT` (400), other | rejected (terminal) |
//! | `QUOTA_EXCEEDED` (429), or a 429 without a code | throttled account (feeds the bucket) |
//! | `UNAVAILABLE` (503) | retry later, honouring `Retry-After` |
//! | `THIRD_PARTY_AUTH_ERROR` (401), `UNAUTHENTICATED` (401), `PERMISSION_DENIED` (403) | auth failure of the account |
//! | `INTERNAL` (500), any other 5xx | maybe sent (ambiguous: FCM honours no idempotency key) |
//! | a 503 that is not FCM's (no FCM body) | maybe sent, unless it carries a valid `Retry-After` (retry later) |
//! | any other status | rejected (terminal) |
//!
//! The code recorded is FCM's (`UNREGISTERED`, ...), `other` for a code FCM does not document,
//! none when the body named none.
//!
//! Only FCM's own codes flag a contact: a bare 404 (a wrong project or base URL) is rejected,
//! never taken as a dead device, so a misconfiguration cannot mark every contact invalid.

use reqwest::header::HeaderMap;
use serde::Deserialize;

use nudge_domain::{ProviderAnswer, Verdict};

use crate::push::{answer, has_valid_retry_after, retry_after};

/// The longest message id kept; FCM's names are far shorter.
const MAX_MESSAGE_ID_LEN: usize = 256;

const FCM_ERROR_TYPE: &str = "type.googleapis.com/google.firebase.fcm.v1.FcmError";
const BAD_REQUEST_TYPE: &str = "type.googleapis.com/google.rpc.BadRequest";

#[derive(Deserialize)]
struct ErrorEnvelope {
    error: ErrorBody,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    details: Vec<Detail>,
}

#[derive(Deserialize)]
struct Detail {
    #[serde(rename = "@type", default)]
    kind: Option<String>,
    #[serde(rename = "errorCode", default)]
    error_code: Option<String>,
    #[serde(rename = "fieldViolations", default)]
    field_violations: Vec<FieldViolation>,
}

#[derive(Deserialize)]
struct FieldViolation {
    #[serde(default)]
    field: Option<String>,
}

#[derive(Deserialize)]
struct SendResponse {
    name: Option<String>,
}

/// The FCM error code (or canonical status) of an error body, as one of the documented codes;
/// `None` when the body is not Google's error shape.
fn error_code(body: &[u8]) -> Option<(&'static str, bool)> {
    let envelope: ErrorEnvelope = serde_json::from_slice(body).ok()?;
    let fcm_code = envelope
        .error
        .details
        .iter()
        .filter(|d| d.kind.as_deref() == Some(FCM_ERROR_TYPE))
        .find_map(|d| d.error_code.as_deref());
    let token_violation = envelope
        .error
        .details
        .iter()
        .filter(|d| d.kind.as_deref() == Some(BAD_REQUEST_TYPE))
        .flat_map(|d| &d.field_violations)
        .any(|v| v.field.as_deref() == Some("message.token"));
    let raw = fcm_code.or(envelope.error.status.as_deref())?;
    Some((known_code(raw), token_violation))
}

/// The documented codes, FCM's and the canonical statuses it answers with; anything else is
/// `other`, so a provider's text never becomes a metric label.
fn known_code(raw: &str) -> &'static str {
    const KNOWN: [&str; 12] = [
        "UNSPECIFIED_ERROR",
        "INVALID_ARGUMENT",
        "UNREGISTERED",
        "SENDER_ID_MISMATCH",
        "QUOTA_EXCEEDED",
        "UNAVAILABLE",
        "INTERNAL",
        "THIRD_PARTY_AUTH_ERROR",
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
        "NOT_FOUND",
        "RESOURCE_EXHAUSTED",
    ];
    KNOWN.into_iter().find(|k| *k == raw).unwrap_or("other")
}

/// What an FCM answer means. `body` is the (bounded) response body; an unreadable or foreign
/// body is mapped by the status alone.
pub fn map_response(status: u16, headers: &HeaderMap, body: &[u8]) -> ProviderAnswer {
    let retry_after = retry_after(headers);
    if (200..=299).contains(&status) {
        let message_id = serde_json::from_slice::<SendResponse>(body)
            .ok()
            .and_then(|r| r.name)
            .filter(|n| !n.is_empty() && n.len() <= MAX_MESSAGE_ID_LEN);
        return ProviderAnswer::new(Verdict::Accepted, Some(status)).with_message_id(message_id);
    }
    let (code, token_violation) = match error_code(body) {
        Some((c, v)) => (Some(c), v),
        None => (None, false),
    };
    let verdict = match code {
        Some("UNREGISTERED" | "SENDER_ID_MISMATCH") => Verdict::ContactInvalid,
        Some("INVALID_ARGUMENT") if token_violation => Verdict::ContactInvalid,
        Some("QUOTA_EXCEEDED" | "RESOURCE_EXHAUSTED") => Verdict::ThrottledAccount,
        Some("UNAVAILABLE") => Verdict::RetryLater,
        Some("THIRD_PARTY_AUTH_ERROR" | "UNAUTHENTICATED" | "PERMISSION_DENIED") => {
            Verdict::AuthFailure
        }
        _ => match status {
            429 => Verdict::ThrottledAccount,
            401 => Verdict::AuthFailure,
            503 if has_valid_retry_after(retry_after.as_deref()) => Verdict::RetryLater,
            500..=599 => Verdict::MaybeSent,
            _ => Verdict::Rejected,
        },
    };
    let code = match code {
        Some("RESOURCE_EXHAUSTED") => Some("QUOTA_EXCEEDED"),
        c => c,
    };
    let answer = answer(verdict, status, code);
    match verdict {
        Verdict::ThrottledAccount | Verdict::RetryLater => answer.with_retry_after(retry_after),
        _ => answer,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;
    use reqwest::header::{HeaderValue, RETRY_AFTER};

    fn verdict(v: Verdict, status: u16, code: Option<&str>) -> ProviderAnswer {
        answer(v, status, code)
    }

    fn fcm_error(code: u16, status: &str, error_code: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "error": {
                "code": code,
                "message": "x",
                "status": status,
                "details": [{
                    "@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError",
                    "errorCode": error_code
                }]
            }
        }))
        .unwrap()
    }

    fn none() -> HeaderMap {
        HeaderMap::new()
    }

    fn with_retry_after(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn a_200_is_accepted_with_the_message_name_as_its_id() {
        let body =
            br#"{"name": "projects/myproject-b5ae1/messages/0:1500415314455276%31bd1c9631bd1c96"}"#;
        assert_eq!(
            map_response(200, &none(), body),
            ProviderAnswer::new(Verdict::Accepted, Some(200)).with_message_id(Some(
                "projects/myproject-b5ae1/messages/0:1500415314455276%31bd1c9631bd1c96".to_owned()
            ))
        );
        assert_eq!(
            map_response(200, &none(), b"not json"),
            ProviderAnswer::new(Verdict::Accepted, Some(200))
        );
    }

    #[test]
    fn unregistered_invalidates_the_device_token() {
        let body = fcm_error(404, "NOT_FOUND", "UNREGISTERED");
        assert_eq!(
            map_response(404, &none(), &body),
            verdict(Verdict::ContactInvalid, 404, Some("UNREGISTERED"))
        );
    }

    #[test]
    fn a_token_of_another_sender_invalidates_the_device_token() {
        let body = fcm_error(403, "PERMISSION_DENIED", "SENDER_ID_MISMATCH");
        assert_eq!(
            map_response(403, &none(), &body),
            verdict(Verdict::ContactInvalid, 403, Some("SENDER_ID_MISMATCH"))
        );
    }

    #[test]
    fn invalid_argument_is_terminal_and_flags_the_contact_only_for_the_token_field() {
        // The documented example of an invalid value in a data message.
        let data_violation = serde_json::to_vec(&serde_json::json!({
            "error": {
                "code": 400,
                "message": "Invalid value at 'message.data[0].value' (TYPE_STRING), 12",
                "status": "INVALID_ARGUMENT",
                "details": [{
                    "@type": "type.googleapis.com/google.rpc.BadRequest",
                    "fieldViolations": [{
                        "field": "message.data[0].value",
                        "description": "Invalid value at 'message.data[0].value' (TYPE_STRING), 12"
                    }]
                }]
            }
        }))
        .unwrap();
        assert_eq!(
            map_response(400, &none(), &data_violation),
            verdict(Verdict::Rejected, 400, Some("INVALID_ARGUMENT"))
        );
        // The documented example of an invalid registration token.
        assert_eq!(
            map_response(
                400,
                &none(),
                &fcm_error(400, "INVALID_ARGUMENT", "INVALID_ARGUMENT")
            ),
            verdict(Verdict::Rejected, 400, Some("INVALID_ARGUMENT"))
        );
        let token_violation = serde_json::to_vec(&serde_json::json!({
            "error": {"code": 400, "status": "INVALID_ARGUMENT", "details": [{
                "@type": "type.googleapis.com/google.rpc.BadRequest",
                "fieldViolations": [{"field": "message.token", "description": "Invalid registration token"}]
            }]}
        }))
        .unwrap();
        assert_eq!(
            map_response(400, &none(), &token_violation),
            verdict(Verdict::ContactInvalid, 400, Some("INVALID_ARGUMENT"))
        );
    }

    #[test]
    fn quota_exceeded_throttles_the_account_with_its_retry_after() {
        let body = fcm_error(429, "RESOURCE_EXHAUSTED", "QUOTA_EXCEEDED");
        assert_eq!(
            map_response(429, &with_retry_after("30"), &body),
            verdict(Verdict::ThrottledAccount, 429, Some("QUOTA_EXCEEDED"))
                .with_retry_after(Some("30".to_owned()))
        );
        // A bare 429 (a front end's, no FCM body) throttles the account too.
        assert_eq!(
            map_response(429, &none(), b""),
            verdict(Verdict::ThrottledAccount, 429, None)
        );
    }

    #[test]
    fn unavailable_is_retried_honouring_retry_after() {
        let body = fcm_error(503, "UNAVAILABLE", "UNAVAILABLE");
        assert_eq!(
            map_response(
                503,
                &with_retry_after("Sun, 06 Nov 1994 08:49:37 GMT"),
                &body
            ),
            verdict(Verdict::RetryLater, 503, Some("UNAVAILABLE"))
                .with_retry_after(Some("Sun, 06 Nov 1994 08:49:37 GMT".to_owned()))
        );
        assert_eq!(
            map_response(503, &none(), &body),
            verdict(Verdict::RetryLater, 503, Some("UNAVAILABLE"))
        );
    }

    #[test]
    fn auth_errors_are_failures_of_the_account() {
        for (status, canonical, code, reason) in [
            (
                401,
                "UNAUTHENTICATED",
                "THIRD_PARTY_AUTH_ERROR",
                "THIRD_PARTY_AUTH_ERROR",
            ),
            (
                403,
                "PERMISSION_DENIED",
                "PERMISSION_DENIED",
                "PERMISSION_DENIED",
            ),
        ] {
            assert_eq!(
                map_response(status, &none(), &fcm_error(status, canonical, code)),
                verdict(Verdict::AuthFailure, status, Some(reason)),
                "{code}"
            );
        }
        // Google's answer to an expired or revoked access token has no FcmError detail.
        let body = br#"{"error": {"code": 401, "message": "Request had invalid authentication credentials.", "status": "UNAUTHENTICATED"}}"#;
        assert_eq!(
            map_response(401, &none(), body),
            verdict(Verdict::AuthFailure, 401, Some("UNAUTHENTICATED"))
        );
        assert_eq!(
            map_response(401, &none(), b"<html>"),
            verdict(Verdict::AuthFailure, 401, None)
        );
    }

    #[test]
    fn internal_errors_and_foreign_5xx_are_ambiguous() {
        assert_eq!(
            map_response(500, &none(), &fcm_error(500, "INTERNAL", "INTERNAL")),
            verdict(Verdict::MaybeSent, 500, Some("INTERNAL"))
        );
        for status in [502, 503, 504] {
            assert_eq!(
                map_response(status, &none(), b"<html>bad gateway</html>"),
                verdict(Verdict::MaybeSent, status, None),
                "{status}"
            );
        }
        // A gateway's 503 that says when to come back did not take the request.
        assert_eq!(
            map_response(503, &with_retry_after("5"), b""),
            verdict(Verdict::RetryLater, 503, None).with_retry_after(Some("5".to_owned()))
        );
        assert_eq!(
            map_response(503, &with_retry_after("soon"), b""),
            verdict(Verdict::MaybeSent, 503, None)
        );
    }

    #[test]
    fn an_unknown_code_is_reported_as_other_and_mapped_by_status() {
        assert_eq!(
            map_response(
                400,
                &none(),
                &fcm_error(400, "FAILED_PRECONDITION", "SOMETHING_NEW")
            ),
            verdict(Verdict::Rejected, 400, Some("other"))
        );
    }
}
