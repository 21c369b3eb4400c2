//! What a provider's answer means for a delivery, before any policy is applied.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::answer::{ProviderAnswer, Verdict};
use crate::ids::IdError;

/// What happened when a worker tried to send, as reported by a provider adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendOutcome {
    /// The provider answered. `retry_after` is the raw header value, if any.
    Response {
        status: u16,
        retry_after: Option<String>,
        provider_message_id: Option<String>,
    },
    /// The provider answered, and the adapter, which knows the provider's contract, says what
    /// the answer means (see [`crate::answer`]). The generic adapter never reports this.
    Answered(ProviderAnswer),
    /// Connect, DNS or TLS failure: the request never left, so the provider cannot have sent it.
    FailedBeforeSend { reason: String },
    /// Timeout or reset after the request left: the provider may or may not have sent it.
    UnknownAfterSend { reason: String },
}

/// Whether a provider account dedups sends by our `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IdempotencySupport {
    Honoured,
    NotHonoured,
}

impl From<bool> for IdempotencySupport {
    fn from(honoured: bool) -> Self {
        if honoured {
            IdempotencySupport::Honoured
        } else {
            IdempotencySupport::NotHonoured
        }
    }
}

/// The class of an attempt's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutcomeClass {
    Delivered,
    /// Worth trying again later (subject to attempts, expiry and Retry-After).
    Retryable,
    /// Trying again would get the same answer.
    Terminal,
    /// The send may have happened and a resend could duplicate it.
    Ambiguous,
}

impl OutcomeClass {
    pub const ALL: [OutcomeClass; 4] = [
        OutcomeClass::Delivered,
        OutcomeClass::Retryable,
        OutcomeClass::Terminal,
        OutcomeClass::Ambiguous,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            OutcomeClass::Delivered => "delivered",
            OutcomeClass::Retryable => "retryable",
            OutcomeClass::Terminal => "terminal",
            OutcomeClass::Ambiguous => "ambiguous",
        }
    }
}

impl fmt::Display for OutcomeClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for OutcomeClass {
    type Err = IdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        OutcomeClass::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or(IdError::UnknownOutcomeClass)
    }
}

/// Classifies an outcome. Statuses we do not expect from a send (1xx, 3xx, out of range) are
/// terminal: retrying a misconfigured endpoint only burns the rate budget.
///
/// A 5xx from a provider that does not honour our idempotency key may have come after the
/// message went out (a gateway timing out on a slow backend), so a resend could duplicate a
/// clinical reminder: it is ambiguous, held for review. The exception is a 503 that carries a
/// valid `Retry-After`: the provider is saying it did not take the request and when to come
/// back. 429 and 408 say the request was not processed, whatever the provider supports.
pub fn classify(outcome: &SendOutcome, idem: IdempotencySupport) -> OutcomeClass {
    match outcome {
        SendOutcome::Response {
            status,
            retry_after,
            ..
        } => match (status, idem) {
            (200..=299, _) => OutcomeClass::Delivered,
            (408 | 429, _) | (500..=599, IdempotencySupport::Honoured) => OutcomeClass::Retryable,
            (503, IdempotencySupport::NotHonoured)
                if retry_after
                    .as_deref()
                    .is_some_and(|v| crate::RetryAfter::parse(v).is_ok()) =>
            {
                OutcomeClass::Retryable
            }
            (500..=599, IdempotencySupport::NotHonoured) => OutcomeClass::Ambiguous,
            _ => OutcomeClass::Terminal,
        },
        SendOutcome::Answered(answer) => classify_verdict(answer.verdict, idem),
        SendOutcome::FailedBeforeSend { .. } => OutcomeClass::Retryable,
        // Only a provider that dedups by key makes a resend of an unknown outcome safe.
        SendOutcome::UnknownAfterSend { .. } => match idem {
            IdempotencySupport::Honoured => OutcomeClass::Retryable,
            IdempotencySupport::NotHonoured => OutcomeClass::Ambiguous,
        },
    }
}

/// The class of a [`Verdict`]: accepted is delivered; the three that refuse for good
/// (invalid contact, opted out, rejected) are terminal; "maybe sent" is ambiguous unless the
/// account dedupes a resend; everything else (throttles, retry later, an auth failure, our own
/// fault) says the message was not taken and is retryable.
pub fn classify_verdict(verdict: Verdict, idem: IdempotencySupport) -> OutcomeClass {
    match verdict {
        Verdict::Accepted => OutcomeClass::Delivered,
        Verdict::ContactInvalid | Verdict::ContactOptedOut | Verdict::Rejected => {
            OutcomeClass::Terminal
        }
        Verdict::MaybeSent => match idem {
            IdempotencySupport::Honoured => OutcomeClass::Retryable,
            IdempotencySupport::NotHonoured => OutcomeClass::Ambiguous,
        },
        Verdict::ThrottledAccount
        | Verdict::ThrottledRecipient
        | Verdict::RetryLater
        | Verdict::AuthFailure
        | Verdict::OwnFault => OutcomeClass::Retryable,
    }
}

/// The class of a provider's answer, a metric label: `2xx`, `3xx`, `4xx` (other than 429),
/// `429`, `5xx`, `timeout` (no answer after the request left) or `network` (the request never
/// left). Nothing of the answer beyond its status is used.
pub fn response_class(outcome: &SendOutcome) -> &'static str {
    match outcome {
        SendOutcome::Response { status: 429, .. } => "429",
        SendOutcome::Answered(ProviderAnswer {
            http_status: None, ..
        }) => "other",
        SendOutcome::Answered(ProviderAnswer {
            http_status: Some(429),
            ..
        }) => "429",
        SendOutcome::Response { status, .. }
        | SendOutcome::Answered(ProviderAnswer {
            http_status: Some(status),
            ..
        }) => match status {
            200..=299 => "2xx",
            300..=399 => "3xx",
            400..=499 => "4xx",
            500..=599 => "5xx",
            _ => "other",
        },
        SendOutcome::FailedBeforeSend { .. } => "network",
        SendOutcome::UnknownAfterSend { .. } => "timeout",
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn response_classes_name_the_status_family_429_and_transport_failures() {
        for (code, class) in [
            (200, "2xx"),
            (202, "2xx"),
            (301, "3xx"),
            (400, "4xx"),
            (408, "4xx"),
            (429, "429"),
            (500, "5xx"),
            (503, "5xx"),
        ] {
            assert_eq!(response_class(&status(code)), class, "{code}");
        }
        let reason = String::from("x");
        assert_eq!(
            response_class(&SendOutcome::FailedBeforeSend {
                reason: reason.clone()
            }),
            "network"
        );
        assert_eq!(
            response_class(&SendOutcome::UnknownAfterSend { reason }),
            "timeout"
        );
    }

    fn status(status: u16) -> SendOutcome {
        SendOutcome::Response {
            status,
            retry_after: None,
            provider_message_id: None,
        }
    }

    fn both(outcome: &SendOutcome) -> [OutcomeClass; 2] {
        [
            classify(outcome, IdempotencySupport::Honoured),
            classify(outcome, IdempotencySupport::NotHonoured),
        ]
    }

    #[test]
    fn any_2xx_is_delivered() {
        for s in [200, 201, 202, 204, 299] {
            assert_eq!(both(&status(s)), [OutcomeClass::Delivered; 2], "{s}");
        }
    }

    fn with_retry_after(status: u16, value: &str) -> SendOutcome {
        SendOutcome::Response {
            status,
            retry_after: Some(value.to_owned()),
            provider_message_id: None,
        }
    }

    #[test]
    fn throttling_and_request_timeout_are_retryable_whatever_the_provider_supports() {
        for s in [429, 408] {
            assert_eq!(both(&status(s)), [OutcomeClass::Retryable; 2], "{s}");
        }
    }

    #[test]
    fn server_errors_are_retryable_only_where_the_key_makes_a_resend_safe() {
        for s in [500, 502, 503, 504, 599] {
            assert_eq!(
                both(&status(s)),
                [OutcomeClass::Retryable, OutcomeClass::Ambiguous],
                "{s}"
            );
        }
    }

    #[test]
    fn a_503_with_a_valid_retry_after_stays_retryable_without_idempotency() {
        assert_eq!(
            both(&with_retry_after(503, "30")),
            [OutcomeClass::Retryable; 2]
        );
        // A malformed header is no promise that the request was not taken.
        assert_eq!(
            both(&with_retry_after(503, "soon")),
            [OutcomeClass::Retryable, OutcomeClass::Ambiguous]
        );
        // Only a 503 says "not taken, come back then".
        assert_eq!(
            both(&with_retry_after(502, "30")),
            [OutcomeClass::Retryable, OutcomeClass::Ambiguous]
        );
    }

    #[test]
    fn other_client_errors_and_unexpected_statuses_are_terminal() {
        for s in [
            400,
            401,
            403,
            404,
            409,
            410,
            422,
            499,
            100,
            199,
            301,
            304,
            0,
            99,
            600,
            u16::MAX,
        ] {
            assert_eq!(both(&status(s)), [OutcomeClass::Terminal; 2], "{s}");
        }
    }

    #[test]
    fn a_failure_before_the_request_left_is_retryable_whatever_the_provider_supports() {
        let o = SendOutcome::FailedBeforeSend {
            reason: "connection refused".into(),
        };
        assert_eq!(both(&o), [OutcomeClass::Retryable; 2]);
    }

    #[test]
    fn an_unknown_outcome_is_retryable_only_when_the_provider_honours_idempotency() {
        let o = SendOutcome::UnknownAfterSend {
            reason: "timeout".into(),
        };
        assert_eq!(both(&o), [OutcomeClass::Retryable, OutcomeClass::Ambiguous]);
    }

    #[test]
    fn outcome_class_names_round_trip() {
        for c in OutcomeClass::ALL {
            assert_eq!(c.as_str().parse::<OutcomeClass>(), Ok(c));
            assert_eq!(c.to_string(), c.as_str());
        }
        assert_eq!(
            "Delivered".parse::<OutcomeClass>(),
            Err(IdError::UnknownOutcomeClass)
        );
    }

    fn answered(verdict: Verdict, http_status: Option<u16>) -> SendOutcome {
        SendOutcome::Answered(ProviderAnswer::new(verdict, http_status))
    }

    #[test]
    fn each_verdict_has_the_class_its_meaning_implies() {
        use Verdict::*;
        for (v, want) in [
            (Accepted, [OutcomeClass::Delivered; 2]),
            (ContactInvalid, [OutcomeClass::Terminal; 2]),
            (ContactOptedOut, [OutcomeClass::Terminal; 2]),
            (Rejected, [OutcomeClass::Terminal; 2]),
            (ThrottledAccount, [OutcomeClass::Retryable; 2]),
            (ThrottledRecipient, [OutcomeClass::Retryable; 2]),
            (RetryLater, [OutcomeClass::Retryable; 2]),
            (AuthFailure, [OutcomeClass::Retryable; 2]),
            (OwnFault, [OutcomeClass::Retryable; 2]),
            (
                MaybeSent,
                [OutcomeClass::Retryable, OutcomeClass::Ambiguous],
            ),
        ] {
            assert_eq!(both(&answered(v, Some(400))), want, "{v}");
        }
    }

    #[test]
    fn an_answer_is_classed_by_its_verdict_never_by_its_status() {
        // A 200 that the adapter read as a refusal is a refusal; a 401 read as accepted is not.
        assert_eq!(
            both(&answered(Verdict::Rejected, Some(200))),
            [OutcomeClass::Terminal; 2]
        );
        assert_eq!(
            both(&answered(Verdict::AuthFailure, Some(401))),
            [OutcomeClass::Retryable; 2]
        );
    }

    #[test]
    fn an_answer_s_response_class_is_its_status_family() {
        assert_eq!(
            response_class(&answered(Verdict::ThrottledAccount, Some(429))),
            "429"
        );
        assert_eq!(
            response_class(&answered(Verdict::Accepted, Some(201))),
            "2xx"
        );
        assert_eq!(
            response_class(&answered(Verdict::ContactInvalid, Some(400))),
            "4xx"
        );
        assert_eq!(
            response_class(&answered(Verdict::MaybeSent, Some(502))),
            "5xx"
        );
        assert_eq!(response_class(&answered(Verdict::MaybeSent, None)), "other");
    }

    proptest! {
        #[test]
        fn only_maybe_sent_without_idempotency_makes_an_answer_ambiguous(
            i in 0usize..Verdict::ALL.len(),
            status in proptest::option::of(any::<u16>()),
        ) {
            let v = Verdict::ALL[i];
            let [honoured, not_honoured] = both(&answered(v, status));
            prop_assert_ne!(honoured, OutcomeClass::Ambiguous);
            prop_assert_eq!(not_honoured == OutcomeClass::Ambiguous, v == Verdict::MaybeSent);
        }

        #[test]
        fn only_a_5xx_without_idempotency_makes_a_response_ambiguous(s in any::<u16>()) {
            let [honoured, not_honoured] = both(&status(s));
            prop_assert_ne!(honoured, OutcomeClass::Ambiguous);
            if (500..=599).contains(&s) {
                prop_assert_eq!(not_honoured, OutcomeClass::Ambiguous);
            } else {
                prop_assert_eq!(honoured, not_honoured);
            }
        }
    }
}
