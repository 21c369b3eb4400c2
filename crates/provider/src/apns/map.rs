//! APNs's answers mapped onto [`ProviderAnswer`]s: a pure function of the status, the headers and the
//! body (`{"reason": "..."}`, with `timestamp` on a 410), so every documented reason is tested
//! without a server.
//!
//! | answer | verdict |
//! |---|---|
//! | 200 | accepted; the `apns-id` header is the message id |
//! | 410 `Unregistered` or `ExpiredToken` | contact invalid: the device token is no longer active for the topic (Apple's two documented reasons for a 410) |
//! | 410 with any other reason, or none | rejected (terminal, the contact left alone: only Apple's reasons flag it) |
//! | 400 `BadDeviceToken` | contact invalid, unless most of the account's recent answers are (a sandbox token sent to production, or the reverse: see the adapter's `misconfigured_*` keys) |
//! | 400 other (`DeviceTokenNotForTopic`, `BadTopic`, `BadExpirationDate`, ...), 404, 405, 413 | rejected (terminal; a wrong topic is ours, not the contact's) |
//! | 403 `InvalidProviderToken`, `ExpiredProviderToken`, `MissingProviderToken`, `BadCertificate`, `Forbidden`, ... | auth failure of the account |
//! | 429 `TooManyProviderTokenUpdates` | own fault (our token churn): alert, retry the delivery, never slow the bucket |
//! | 429 `TooManyRequests` (or any other 429) | throttled recipient: retry that delivery only |
//! | 500, 503 and any other 5xx | maybe sent (ambiguous: APNs honours no idempotency key), unless a 503 carries a valid `Retry-After` (retry later) |
//! | any other status | rejected (terminal) |
//!
//! The code recorded is APNs's reason, `other` for one Apple does not document, none when the
//! body named none.

use reqwest::header::HeaderMap;
use serde::Deserialize;

use nudge_domain::{ProviderAnswer, Verdict};

use crate::push::{answer, has_valid_retry_after, retry_after};

/// `apns-id` is a UUID; anything much longer is not one.
const MAX_APNS_ID_LEN: usize = 64;

#[derive(Deserialize)]
struct ErrorBody {
    reason: Option<String>,
}

/// Apple's documented reasons; anything else is `other`, so a provider's text never becomes a
/// metric label.
fn known_reason(raw: &str) -> &'static str {
    const KNOWN: [&str; 30] = [
        "BadCollapseId",
        "BadDeviceToken",
        "BadExpirationDate",
        "BadMessageId",
        "BadPriority",
        "BadTopic",
        "DeviceTokenNotForTopic",
        "DuplicateHeaders",
        "IdleTimeout",
        "InvalidPushType",
        "MissingDeviceToken",
        "MissingTopic",
        "PayloadEmpty",
        "TopicDisallowed",
        "BadCertificate",
        "BadCertificateEnvironment",
        "ExpiredProviderToken",
        "Forbidden",
        "InvalidProviderToken",
        "MissingProviderToken",
        "UnrelatedKeyIdInToken",
        "BadPath",
        "MethodNotAllowed",
        "ExpiredToken",
        "Unregistered",
        "PayloadTooLarge",
        "TooManyProviderTokenUpdates",
        "TooManyRequests",
        "InternalServerError",
        "ServiceUnavailable",
    ];
    if raw == "Shutdown" {
        return "Shutdown";
    }
    KNOWN.into_iter().find(|k| *k == raw).unwrap_or("other")
}

/// The reason of an error body; `None` when the body is not APNs's shape.
fn reason_of(body: &[u8]) -> Option<&'static str> {
    let parsed: ErrorBody = serde_json::from_slice(body).ok()?;
    parsed.reason.as_deref().map(known_reason)
}

/// Whether an answer says the provider token itself is bad (so a new one may help).
pub(crate) fn is_provider_token_refusal(answer: &ProviderAnswer) -> bool {
    answer.verdict == Verdict::AuthFailure
        && answer
            .code
            .as_ref()
            .is_some_and(|c| matches!(c.as_str(), "InvalidProviderToken" | "ExpiredProviderToken"))
}

/// What an APNs answer means. `body` is the (bounded) response body.
pub fn map_response(status: u16, headers: &HeaderMap, body: &[u8]) -> ProviderAnswer {
    if status == 200 {
        let message_id = headers
            .get("apns-id")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && v.len() <= MAX_APNS_ID_LEN)
            .map(str::to_owned);
        return ProviderAnswer::new(Verdict::Accepted, Some(status)).with_message_id(message_id);
    }
    let reason = reason_of(body);
    let retry_after = retry_after(headers);
    let verdict = match (status, reason) {
        (410, Some("Unregistered" | "ExpiredToken")) | (400, Some("BadDeviceToken")) => {
            Verdict::ContactInvalid
        }
        (429, Some("TooManyProviderTokenUpdates")) => Verdict::OwnFault,
        (429, _) => Verdict::ThrottledRecipient,
        (403, _) => Verdict::AuthFailure,
        (503, _) if has_valid_retry_after(retry_after.as_deref()) => Verdict::RetryLater,
        (500..=599, _) => Verdict::MaybeSent,
        _ => Verdict::Rejected,
    };
    let answer = answer(verdict, status, reason);
    match verdict {
        Verdict::ThrottledRecipient | Verdict::RetryLater => answer.with_retry_after(retry_after),
        _ => answer,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    fn verdict(v: Verdict, status: u16, code: Option<&str>) -> ProviderAnswer {
        answer(v, status, code)
    }

    fn body(reason: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({ "reason": reason })).unwrap()
    }

    fn none() -> HeaderMap {
        HeaderMap::new()
    }

    #[test]
    fn a_200_is_accepted_with_its_apns_id() {
        let mut h = HeaderMap::new();
        h.insert(
            "apns-id",
            HeaderValue::from_static("eabeae54-14a8-11e5-b60b-1697f925ec7b"),
        );
        assert_eq!(
            map_response(200, &h, b""),
            ProviderAnswer::new(Verdict::Accepted, Some(200))
                .with_message_id(Some("eabeae54-14a8-11e5-b60b-1697f925ec7b".to_owned()))
        );
    }

    #[test]
    fn unregistered_and_a_bad_device_token_invalidate_the_token() {
        let gone = br#"{"reason": "Unregistered", "timestamp": 1454402113000}"#;
        assert_eq!(
            map_response(410, &none(), gone),
            verdict(Verdict::ContactInvalid, 410, Some("Unregistered"))
        );
        assert_eq!(
            map_response(410, &none(), &body("ExpiredToken")),
            verdict(Verdict::ContactInvalid, 410, Some("ExpiredToken"))
        );
        assert_eq!(
            map_response(400, &none(), &body("BadDeviceToken")),
            verdict(Verdict::ContactInvalid, 400, Some("BadDeviceToken"))
        );
    }

    #[test]
    fn a_410_flags_the_contact_only_with_one_of_apples_reasons_for_it() {
        for body in [
            &b""[..],
            b"<html>Gone</html>",
            &self::body("BadTopic"),
            &self::body("Whatever"),
        ] {
            let got = map_response(410, &none(), body);
            assert_eq!(
                got.verdict,
                Verdict::Rejected,
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn other_bad_requests_are_terminal_without_flagging_the_contact() {
        for (status, reason) in [
            (400, "DeviceTokenNotForTopic"),
            (400, "BadTopic"),
            (400, "BadExpirationDate"),
            (400, "PayloadEmpty"),
            (404, "BadPath"),
            (405, "MethodNotAllowed"),
            (413, "PayloadTooLarge"),
        ] {
            assert_eq!(
                map_response(status, &none(), &body(reason)),
                verdict(Verdict::Rejected, status, Some(reason)),
                "{reason}"
            );
        }
    }

    #[test]
    fn a_refused_provider_token_is_an_auth_failure_of_the_account() {
        for reason in [
            "InvalidProviderToken",
            "ExpiredProviderToken",
            "MissingProviderToken",
            "BadCertificate",
            "Forbidden",
        ] {
            let v = map_response(403, &none(), &body(reason));
            assert_eq!(
                v,
                verdict(Verdict::AuthFailure, 403, Some(reason)),
                "{reason}"
            );
        }
        assert!(is_provider_token_refusal(&map_response(
            403,
            &none(),
            &body("ExpiredProviderToken")
        )));
        assert!(!is_provider_token_refusal(&map_response(
            403,
            &none(),
            &body("Forbidden")
        )));
    }

    #[test]
    fn too_many_token_updates_is_our_bug_and_too_many_requests_throttles_one_device() {
        assert_eq!(
            map_response(429, &none(), &body("TooManyProviderTokenUpdates")),
            verdict(Verdict::OwnFault, 429, Some("TooManyProviderTokenUpdates"))
        );
        assert_eq!(
            map_response(429, &none(), &body("TooManyRequests")),
            verdict(Verdict::ThrottledRecipient, 429, Some("TooManyRequests"))
        );
    }

    #[test]
    fn server_errors_are_ambiguous_unless_a_503_says_when_to_come_back() {
        assert_eq!(
            map_response(500, &none(), &body("InternalServerError")),
            verdict(Verdict::MaybeSent, 500, Some("InternalServerError"))
        );
        assert_eq!(
            map_response(503, &none(), &body("ServiceUnavailable")),
            verdict(Verdict::MaybeSent, 503, Some("ServiceUnavailable"))
        );
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("10"));
        assert_eq!(
            map_response(503, &h, &body("Shutdown")),
            verdict(Verdict::RetryLater, 503, Some("Shutdown")).with_retry_after(Some("10".into()))
        );
    }

    #[test]
    fn an_unknown_reason_is_reported_as_other() {
        assert_eq!(
            map_response(400, &none(), &body("SomethingNew")),
            verdict(Verdict::Rejected, 400, Some("other"))
        );
        assert_eq!(
            map_response(400, &none(), b"<html>"),
            verdict(Verdict::Rejected, 400, None)
        );
    }
}
