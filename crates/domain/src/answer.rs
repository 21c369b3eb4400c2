//! What a provider's answer means, in words every provider adapter shares, and what it does
//! besides moving the delivery: to the account's rate bucket, to the contact, to the operators.
//!
//! The generic adapter reports a bare status code ([`crate::SendOutcome::Response`]) and the
//! classification reads the code. An adapter that knows its provider's contract (Twilio's error
//! codes, SendGrid's headers, FCM's and APNs' reasons) reads the whole answer and says what it
//! means with a [`Verdict`] ([`crate::SendOutcome::Answered`]); `classify` and `decide` then treat
//! every provider alike. [`Effects`] are computed by `decide` with the next state and applied by
//! the worker and the ledger: the contact flag and an account suspension in the outcome's own
//! transaction, the throttle through the bucket's feedback.
//!
//! Nothing here carries a destination, a message body or a token: a verdict, a status, a
//! bounded header value, a bounded message id and a short, charset-limited provider code.

use std::fmt;

use chrono::{DateTime, Utc};

/// What the provider's answer means for this one delivery and for the account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// The provider took the message (its id, when it gave one, is recorded).
    Accepted,
    /// The account is over its limit: the whole bucket slows (and pauses when the answer says
    /// until when); this delivery retries honouring `Retry-After`.
    ThrottledAccount,
    /// One recipient is receiving too fast (APNs' per-device 429): this delivery retries, the
    /// bucket is never told (other recipients are fine).
    ThrottledRecipient,
    /// The provider could not take it now and said so before acting on it (FCM `UNAVAILABLE`,
    /// a 503 with `Retry-After`): retry, honouring `Retry-After`; the bucket is not told.
    RetryLater,
    /// The destination cannot receive (invalid number, unregistered device token): terminal,
    /// and the contact is flagged invalid on this channel.
    ContactInvalid,
    /// The recipient opted out (replied STOP, unsubscribed): terminal, and the contact is flagged
    /// opted out on this channel; later deliveries to it settle `cancelled` without a send.
    ContactOptedOut,
    /// The provider refused this message for good (bad argument, payload too large): terminal.
    Rejected,
    /// The account's credentials were refused: every send through it would fail the same way.
    /// The account's bucket is suspended (bounded) and operators alerted; this delivery retries
    /// after, rather than every delivery burning its attempts.
    AuthFailure,
    /// A fault of ours, not the provider's nor the recipient's (APNs' token churn): operators
    /// are alerted, the bucket is never told, this delivery retries.
    OwnFault,
    /// The provider may have acted on it (a 5xx after the request arrived): held `ambiguous`
    /// where the account does not dedupe a resend, retried where it does.
    MaybeSent,
}

impl Verdict {
    pub const ALL: [Verdict; 10] = [
        Verdict::Accepted,
        Verdict::ThrottledAccount,
        Verdict::ThrottledRecipient,
        Verdict::RetryLater,
        Verdict::ContactInvalid,
        Verdict::ContactOptedOut,
        Verdict::Rejected,
        Verdict::AuthFailure,
        Verdict::OwnFault,
        Verdict::MaybeSent,
    ];

    /// A stable name: the start of the attempt's reason, and a metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Verdict::Accepted => "accepted",
            Verdict::ThrottledAccount => "throttled_account",
            Verdict::ThrottledRecipient => "throttled_recipient",
            Verdict::RetryLater => "retry_later",
            Verdict::ContactInvalid => "contact_invalid",
            Verdict::ContactOptedOut => "contact_opted_out",
            Verdict::Rejected => "rejected",
            Verdict::AuthFailure => "auth_failure",
            Verdict::OwnFault => "own_fault",
            Verdict::MaybeSent => "maybe_sent",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A provider's own error code or reason (`21211`, `UNREGISTERED`, `TooManyRequests`), kept
/// only if it is short and plain: 1 to 48 characters of ASCII letters, digits, `_`, `-`, `.`.
/// It goes into the attempt's reason and may be a metric label, so nothing else gets in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProviderCode(String);

impl ProviderCode {
    pub const MAX_CHARS: usize = 48;

    /// `None` for anything that is not a plain short code (the answer keeps its verdict).
    pub fn parse(raw: &str) -> Option<Self> {
        let ok = !raw.is_empty()
            && raw.len() <= Self::MAX_CHARS
            && raw
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        ok.then(|| Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ProviderCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A provider's answer as an adapter read it. Build with [`ProviderAnswer::new`] and the
/// `with_*` methods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderAnswer {
    pub verdict: Verdict,
    /// The HTTP status (HTTP/2 `:status` for APNs), when there was one.
    pub http_status: Option<u16>,
    /// When to come back, as a `Retry-After` value: delta-seconds or an HTTP-date. An adapter
    /// whose provider says it otherwise (SendGrid's `X-RateLimit-Reset` Unix time) converts it
    /// with [`crate::RetryAfter`]-compatible formatting (see [`retry_after_at`]).
    pub retry_after: Option<String>,
    pub provider_message_id: Option<String>,
    pub code: Option<ProviderCode>,
}

impl ProviderAnswer {
    pub fn new(verdict: Verdict, http_status: Option<u16>) -> Self {
        Self {
            verdict,
            http_status,
            retry_after: None,
            provider_message_id: None,
            code: None,
        }
    }

    pub fn with_retry_after(mut self, value: Option<String>) -> Self {
        self.retry_after = value;
        self
    }

    pub fn with_message_id(mut self, id: Option<String>) -> Self {
        self.provider_message_id = id;
        self
    }

    /// Keeps `code` if it is a plain short code ([`ProviderCode::parse`]), else drops it.
    pub fn with_code(mut self, code: Option<&str>) -> Self {
        self.code = code.and_then(ProviderCode::parse);
        self
    }
}

/// A `Retry-After` value (an IMF-fixdate) for an absolute instant, for providers that say
/// "come back at" as a Unix time. Instants before 1970 are the epoch (a date in the past: retry
/// now).
pub fn retry_after_at(at: DateTime<Utc>) -> String {
    let secs = u64::try_from(at.timestamp()).unwrap_or(0);
    httpdate::fmt_http_date(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
}

/// What a throttling answer does to the account's bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketSignal {
    /// Over the account's limit: slow the bucket, and pause it until `retry_at` when the answer
    /// said (capped at `admission.max_pause_s` by the ledger).
    Throttled { retry_at: Option<DateTime<Utc>> },
    /// The account cannot send at all (credentials refused): pause the bucket for
    /// `admission.max_pause_s` without lowering its rate; after it, one send probes.
    Suspend,
}

/// What an answer says about the recipient's contact on the delivery's channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ContactFlag {
    /// The destination cannot receive on this channel.
    Invalid,
    /// The recipient opted out of this channel.
    OptedOut,
}

impl ContactFlag {
    pub const fn as_str(self) -> &'static str {
        match self {
            ContactFlag::Invalid => "invalid",
            ContactFlag::OptedOut => "opted_out",
        }
    }
}

/// What operators must hear about, whatever happens to the delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Alert {
    /// The provider refused the account's credentials.
    AuthFailure,
    /// A fault of ours (e.g. provider tokens renewed too often).
    OwnFault,
}

impl Alert {
    pub const fn as_str(self) -> &'static str {
        match self {
            Alert::AuthFailure => "auth_failure",
            Alert::OwnFault => "own_fault",
        }
    }
}

/// What an attempt does besides moving its delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Effects {
    pub bucket: Option<BucketSignal>,
    pub contact: Option<ContactFlag>,
    pub alert: Option<Alert>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use proptest::prelude::*;

    #[test]
    fn a_provider_code_is_kept_only_when_short_and_plain() {
        for good in ["21211", "UNREGISTERED", "TooManyRequests", "a.b-c_d"] {
            assert_eq!(ProviderCode::parse(good).unwrap().as_str(), good);
        }
        for bad in [
            "",
            "has space",
            "+15550100",
            "a@b.example",
            &"x".repeat(49),
            "é",
        ] {
            assert!(ProviderCode::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn an_instant_becomes_an_http_date_that_parses_back_to_it() {
        let at = Utc.with_ymd_and_hms(2030, 1, 1, 0, 5, 0).unwrap();
        let value = retry_after_at(at);
        assert_eq!(value, "Tue, 01 Jan 2030 00:05:00 GMT");
        let now = Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap();
        assert_eq!(crate::RetryAfter::parse(&value).unwrap().resolve(now), at);
    }

    #[test]
    fn verdict_names_are_distinct() {
        let names: std::collections::HashSet<&str> =
            Verdict::ALL.iter().map(|v| v.as_str()).collect();
        assert_eq!(names.len(), Verdict::ALL.len());
    }

    proptest! {
        #[test]
        fn a_kept_provider_code_never_holds_anything_but_its_charset(raw in ".{0,60}") {
            if let Some(code) = ProviderCode::parse(&raw) {
                prop_assert!(code.as_str().len() <= ProviderCode::MAX_CHARS);
                prop_assert!(code.as_str().bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b)));
            }
        }
    }
}
