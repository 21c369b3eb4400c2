//! What a push provider's answer means, before any policy is applied: the result of the pure
//! mapping functions of [`crate::fcm`] and [`crate::apns`].
//!
//! Each variant says what the provider told us and what must follow from it (the delivery, the
//! contact, the account's bucket, an alert); the caller turns that into ledger changes. Reasons are
//! short stable codes (metric-label safe): a provider's own reason string is kept only when it is
//! one of the documented ones, otherwise `other`.

/// The meaning of one push attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushVerdict {
    /// The provider took the message; its id is recorded when it gave one.
    Accepted { message_id: Option<String> },
    /// Refused before any request left (the payload is over the provider's limit, the device
    /// token cannot be put into a request): terminal, and nothing was sent.
    RefusedBeforeSend { reason: &'static str },
    /// The device token is no longer (or never was) valid for us: terminal, and the contact's
    /// push destination is flagged invalid so later reminders do not try it again.
    DestinationInvalid { status: u16, reason: &'static str },
    /// The provider refused this request as it is (bad argument, payload too large, bad topic):
    /// terminal, the contact is left alone.
    Rejected { status: u16, reason: &'static str },
    /// The account is over its quota: retry the delivery later (honouring `retry_after`) and
    /// slow the account's shared bucket, like any 429.
    AccountThrottled {
        status: u16,
        reason: &'static str,
        retry_after: Option<String>,
    },
    /// One device gets too many notifications: retry this delivery later (honouring
    /// `retry_after`); the account's bucket is not slowed, other devices are not affected.
    DestinationThrottled {
        status: u16,
        reason: &'static str,
        retry_after: Option<String>,
    },
    /// The provider says it did not take the request and when to come back: retryable,
    /// honouring `retry_after`.
    Unavailable {
        status: u16,
        reason: &'static str,
        retry_after: Option<String>,
    },
    /// Our credentials were refused (the provider's 401/403, or the OAuth token endpoint's
    /// refusal): the account stops sending and operators are alerted; the delivery is not burnt.
    AuthFailed { status: u16, reason: &'static str },
    /// The provider says our own provider token is misused (APNs's
    /// `TooManyProviderTokenUpdates`): a bug on our side, alerted; the delivery is retried and the
    /// bucket is not slowed (the provider is not throttling our traffic).
    TokenMisuse { status: u16, reason: &'static str },
    /// The request never left (connect failure, or the access token could not be obtained):
    /// retryable, nothing can have been sent.
    FailedBeforeSend { reason: &'static str },
    /// The provider may have taken the message (5xx, timeout or reset after the request left) and
    /// honours no idempotency key: held for review, never resent automatically.
    Ambiguous {
        status: Option<u16>,
        reason: &'static str,
    },
}

impl PushVerdict {
    /// The HTTP status the provider answered with, if it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Accepted { .. } => Some(200),
            Self::RefusedBeforeSend { .. } | Self::FailedBeforeSend { .. } => None,
            Self::DestinationInvalid { status, .. }
            | Self::Rejected { status, .. }
            | Self::AccountThrottled { status, .. }
            | Self::DestinationThrottled { status, .. }
            | Self::Unavailable { status, .. }
            | Self::AuthFailed { status, .. }
            | Self::TokenMisuse { status, .. } => Some(*status),
            Self::Ambiguous { status, .. } => *status,
        }
    }

    /// The stable reason code (`accepted` for an accepted message).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Accepted { .. } => "accepted",
            Self::RefusedBeforeSend { reason }
            | Self::FailedBeforeSend { reason }
            | Self::DestinationInvalid { reason, .. }
            | Self::Rejected { reason, .. }
            | Self::AccountThrottled { reason, .. }
            | Self::DestinationThrottled { reason, .. }
            | Self::Unavailable { reason, .. }
            | Self::AuthFailed { reason, .. }
            | Self::TokenMisuse { reason, .. }
            | Self::Ambiguous { reason, .. } => reason,
        }
    }
}

/// Transport failures, mapped onto whether the request can have left (as the generic adapter
/// does): a connect failure or a request that could not be built never left; anything after the
/// connection was up may have been taken.
pub(crate) fn verdict_of_transport_error(e: &reqwest::Error) -> PushVerdict {
    use crate::reason;
    if e.is_connect() {
        PushVerdict::FailedBeforeSend {
            reason: if e.is_timeout() {
                reason::CONNECT_TIMEOUT
            } else {
                reason::CONNECT_ERROR
            },
        }
    } else if e.is_builder() {
        PushVerdict::FailedBeforeSend {
            reason: reason::REQUEST_BUILD_ERROR,
        }
    } else if e.is_timeout() {
        PushVerdict::Ambiguous {
            status: None,
            reason: reason::TIMEOUT_AFTER_SEND,
        }
    } else if e.is_body() {
        PushVerdict::Ambiguous {
            status: None,
            reason: reason::BODY_ERROR,
        }
    } else {
        PushVerdict::Ambiguous {
            status: None,
            reason: reason::RESET_AFTER_SEND,
        }
    }
}

/// The `Retry-After` header as text; a value that is not UTF-8 is passed on as one that parses
/// as malformed, so the retry policy's backoff applies.
pub(crate) fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<String> {
    headers
        .get(reqwest::header::RETRY_AFTER)
        .map(|v| match std::str::from_utf8(v.as_bytes()) {
            Ok(s) => s.to_owned(),
            Err(_) => crate::NON_UTF8_RETRY_AFTER.to_owned(),
        })
}

/// Whether `retry_after` is present and parses (delta-seconds or an HTTP date).
pub(crate) fn has_valid_retry_after(retry_after: Option<&str>) -> bool {
    retry_after.is_some_and(|v| nudge_domain::RetryAfter::parse(v).is_ok())
}

/// `e` and its sources joined with `": "`, for one log line.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

/// Reads at most `max` bytes of a response body; `None` when it is longer or cannot be read.
pub(crate) async fn read_bounded(mut response: reqwest::Response, max: usize) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > max {
                    return None;
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Some(body),
            Err(_) => return None,
        }
    }
}

/// One push notification to send, borrowed from the worker for the attempt.
///
/// `destination` (the device token) and `content` are PHI: adapters send them and drop them,
/// never log them.
#[derive(Clone, Copy)]
pub struct PushMessage<'a> {
    pub idempotency_key: &'a nudge_domain::IdempotencyKey,
    /// The device's registration token (FCM) or device token (APNs).
    pub destination: &'a str,
    /// The reminder's content object: `title` and `body` (strings) become the visible
    /// notification, every other key travels as data.
    pub content: Option<&'a serde_json::Value>,
    /// After this instant the notification is worthless: providers are told not to deliver it
    /// later (FCM's Android `ttl`, APNs's `apns-expiration`).
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Opaque id tying the attempt to our traces; sent as `X-Correlation-Id`.
    pub correlation_id: &'a str,
    /// W3C trace context of the attempt's provider span, sent as `traceparent` when set.
    pub traceparent: Option<&'a str>,
}

impl std::fmt::Debug for PushMessage<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushMessage")
            .field("idempotency_key", &self.idempotency_key.as_str())
            .field("destination", &"<redacted>")
            .field("content", &self.content.map(|_| "<redacted>"))
            .field("expires_at", &self.expires_at)
            .field("correlation_id", &self.correlation_id)
            .field("traceparent", &self.traceparent)
            .finish()
    }
}

/// The visible part and the data part of a reminder's content, as both push providers take them.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct PushContent {
    pub(crate) title: Option<String>,
    pub(crate) body: Option<String>,
    /// Every other key, string values as they are and other values as their JSON text (FCM's
    /// `data` holds strings only).
    pub(crate) data: serde_json::Map<String, serde_json::Value>,
}

impl PushContent {
    pub(crate) fn of(content: Option<&serde_json::Value>) -> Self {
        let mut out = Self::default();
        let Some(serde_json::Value::Object(map)) = content else {
            return out;
        };
        for (k, v) in map {
            match (k.as_str(), v) {
                ("title", serde_json::Value::String(s)) => out.title = Some(s.clone()),
                ("body", serde_json::Value::String(s)) => out.body = Some(s.clone()),
                (_, serde_json::Value::String(s)) => {
                    out.data
                        .insert(k.clone(), serde_json::Value::String(s.clone()));
                }
                (_, other) => {
                    out.data
                        .insert(k.clone(), serde_json::Value::String(other.to_string()));
                }
            }
        }
        out
    }
}

/// Whole seconds from `now` until `expires_at`, at least 0.
pub(crate) fn seconds_left(
    expires_at: chrono::DateTime<chrono::Utc>,
    now: chrono::DateTime<chrono::Utc>,
) -> i64 {
    (expires_at - now).num_seconds().max(0)
}

/// Timeouts of a push account's HTTP client (the same rules as the generic adapter's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// The whole request, from connect to the last byte of the answer.
    pub timeout_ms: u64,
    /// Connecting alone; below `timeout_ms`, so a slow connect is told from a lost answer.
    pub connect_timeout_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            timeout_ms: 10_000,
            connect_timeout_ms: 2_000,
        }
    }
}

impl Timeouts {
    pub(crate) fn client_builder(&self) -> reqwest::ClientBuilder {
        reqwest::Client::builder()
            .timeout(std::time::Duration::from_millis(self.timeout_ms))
            .connect_timeout(std::time::Duration::from_millis(self.connect_timeout_ms))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
    }
}

/// A URL key's value, checked like the generic adapter's `base_url`: http(s), a host, no
/// credentials, query or fragment. The message never repeats the URL.
pub(crate) fn parse_base_url(raw: &str) -> Result<url::Url, String> {
    let url = url::Url::parse(raw).map_err(|e| format!("not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "expected an http:// or https:// URL, found scheme `{}`",
            url.scheme()
        ));
    }
    if url.host().is_none() {
        return Err("expected a host".to_owned());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must not contain credentials".to_owned());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err("must not have a query or fragment".to_owned());
    }
    Ok(url)
}

/// `base` with `path` appended to its own path (any prefix kept, one slash between).
pub(crate) fn join_path(base: &url::Url, path: &str) -> url::Url {
    let mut url = base.clone();
    let joined = format!(
        "{}/{}",
        base.path().trim_end_matches('/'),
        path.trim_start_matches('/')
    );
    url.set_path(&joined);
    url
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn title_and_body_are_the_notification_and_every_other_key_is_string_data() {
        let c = serde_json::json!({"title": "Appointment", "body": "Tomorrow 9:00", "template": "appt", "slot": 3, "title2": null});
        let p = PushContent::of(Some(&c));
        assert_eq!(p.title.as_deref(), Some("Appointment"));
        assert_eq!(p.body.as_deref(), Some("Tomorrow 9:00"));
        assert_eq!(p.data.len(), 3);
        assert_eq!(p.data["template"], "appt");
        assert_eq!(p.data["slot"], "3");
        assert_eq!(p.data["title2"], "null");
        assert_eq!(PushContent::of(None), PushContent::default());
    }

    #[test]
    fn a_path_is_joined_to_a_base_url_with_or_without_its_prefix_and_slash() {
        for (base, want) in [
            ("http://127.0.0.1:9", "http://127.0.0.1:9/v1/x:send"),
            ("http://127.0.0.1:9/", "http://127.0.0.1:9/v1/x:send"),
            (
                "http://127.0.0.1:9/accounts/a",
                "http://127.0.0.1:9/accounts/a/v1/x:send",
            ),
            (
                "http://127.0.0.1:9/accounts/a/",
                "http://127.0.0.1:9/accounts/a/v1/x:send",
            ),
        ] {
            let url = parse_base_url(base).unwrap();
            assert_eq!(join_path(&url, "/v1/x:send").as_str(), want, "{base}");
        }
        for bad in ["ftp://h/", "http://u:p@h/", "http://h/?q", "nope"] {
            assert!(parse_base_url(bad).is_err(), "{bad}");
        }
    }
}
