//! The one function that turns an attempt's outcome into the delivery's next state.
//!
//! Workers call [`decide`] right after a send and write its [`Decision`] to the ledger in the same
//! transaction as the attempt record. Keeping the whole rule here, with time and randomness as
//! parameters, is what lets the property tests below pin the invariants of the design: no retry at
//! or after expiry, never earlier than a valid `Retry-After`, and nothing dropped silently.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::answer::{Alert, BucketSignal, ContactFlag, Effects, ProviderAnswer, Verdict};
use crate::classify::{IdempotencySupport, OutcomeClass, SendOutcome, classify};
use crate::policy::{Jitter, RetryPolicy};
use crate::retry_after::{RetryAfter, add_saturating, trim_ows};
use crate::state::DeliveryState;

/// The longest `Retry-After` value recorded in [`AttemptFacts::retry_after_seen`]; a provider's
/// header is untrusted input and must not bloat the attempt history.
pub const RETRY_AFTER_SEEN_MAX_CHARS: usize = 64;

/// What the decision needs to know about the delivery besides the outcome itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptContext {
    /// 1-based number of the attempt that just finished.
    pub attempt_number: u32,
    pub expires_at: DateTime<Utc>,
    pub idempotency: IdempotencySupport,
}

/// What is recorded about the attempt, whatever the decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptFacts {
    pub outcome_class: OutcomeClass,
    pub http_status: Option<u16>,
    /// The raw header, trimmed, truncated to [`RETRY_AFTER_SEEN_MAX_CHARS`] characters.
    pub retry_after_seen: Option<String>,
    pub retry_after_valid: bool,
    /// The delay computed for the next attempt: set for `RetryWait`, and also when a computed
    /// delay is why the delivery expired or was dead-lettered, so the history explains itself.
    pub delay_chosen: Option<Duration>,
    /// A stable, PHI-free code (`http_400`, `attempts_exhausted: http_503`, ...), never the
    /// adapter's free-text error.
    pub reason: Option<String>,
    pub provider_message_id: Option<String>,
}

/// The next state of the delivery and what to record.
///
/// `next_attempt_at` is `Some` exactly when `next_state` is [`DeliveryState::RetryWait`], and
/// `next_state` is always a legal transition from [`DeliveryState::Sending`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub next_state: DeliveryState,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub facts: AttemptFacts,
    /// What the answer does besides moving the delivery, whatever its next state (a throttle
    /// on the last allowed attempt still slows the bucket).
    pub effects: Effects,
}

const UNKNOWN_OUTCOME_AFTER_SEND: &str = "unknown_outcome_after_send";
const FAILED_BEFORE_SEND: &str = "failed_before_send";
const WOULD_RETRY_AFTER_EXPIRY: &str = "would_retry_after_expiry";
const RETRY_AFTER_OVER_CEILING: &str = "retry_after_over_ceiling";

/// Decides what happens to a delivery after one attempt. `now` is when the attempt finished.
///
/// A valid `Retry-After` is obeyed exactly: we never come back earlier than the provider asked,
/// and if it asks for longer than `policy.max_retry_after` the delivery is dead-lettered (with a
/// reason an operator can redrive on) rather than held or sent early. Without one, capped
/// exponential backoff with full jitter spreads the retries.
pub fn decide(
    ctx: &AttemptContext,
    outcome: &SendOutcome,
    now: DateTime<Utc>,
    policy: &RetryPolicy,
    jitter: &mut impl Jitter,
) -> Decision {
    let outcome_class = classify(outcome, ctx.idempotency);
    let answered = match outcome {
        SendOutcome::Answered(answer) => Some(answer),
        _ => None,
    };
    let (http_status, raw_retry_after, provider_message_id, cause) = match outcome {
        SendOutcome::Response {
            status,
            retry_after,
            provider_message_id,
        } => (
            Some(*status),
            retry_after.as_deref().map(trim_ows),
            provider_message_id.clone(),
            format!("http_{status}"),
        ),
        SendOutcome::Answered(answer) => (
            answer.http_status,
            answer.retry_after.as_deref().map(trim_ows),
            answer.provider_message_id.clone(),
            answer_cause(answer),
        ),
        SendOutcome::FailedBeforeSend { .. } => (None, None, None, FAILED_BEFORE_SEND.to_owned()),
        SendOutcome::UnknownAfterSend { .. } => {
            (None, None, None, UNKNOWN_OUTCOME_AFTER_SEND.to_owned())
        }
    };
    let retry_after = raw_retry_after.and_then(|raw| RetryAfter::parse(raw).ok());
    let mut facts = AttemptFacts {
        outcome_class,
        http_status,
        retry_after_seen: raw_retry_after
            .map(|raw| truncate_chars(raw, RETRY_AFTER_SEEN_MAX_CHARS)),
        retry_after_valid: retry_after.is_some(),
        delay_chosen: None,
        reason: None,
        provider_message_id,
    };
    let effects = effects(outcome, retry_after.map(|ra| ra.resolve(now)));

    let next_state = match outcome_class {
        OutcomeClass::Delivered => DeliveryState::Delivered,
        OutcomeClass::Terminal => {
            facts.reason = Some(cause);
            DeliveryState::DeadLettered
        }
        OutcomeClass::Ambiguous => {
            facts.reason = Some(match (answered, http_status) {
                // The adapter said so; its cause starts with `maybe_sent`.
                (Some(_), _) => cause,
                // A 5xx from a provider without idempotency: it may have sent.
                (None, Some(_)) => format!("maybe_sent: {cause}"),
                (None, None) => UNKNOWN_OUTCOME_AFTER_SEND.to_owned(),
            });
            DeliveryState::Ambiguous
        }
        OutcomeClass::Retryable => {
            if ctx.attempt_number >= policy.max_attempts() && !is_account_fault(outcome) {
                facts.reason = Some(format!("attempts_exhausted: {cause}"));
                DeliveryState::DeadLettered
            } else {
                let (next, delay) = match retry_after {
                    Some(ra) => {
                        let next = ra.resolve(now);
                        // `resolve` never returns an instant before `now`.
                        (next, (next - now).to_std().unwrap_or(Duration::ZERO))
                    }
                    None => {
                        let delay = policy.backoff(ctx.attempt_number, jitter);
                        (add_saturating(now, delay), delay)
                    }
                };
                facts.delay_chosen = Some(delay);
                if next >= ctx.expires_at {
                    facts.reason = Some(WOULD_RETRY_AFTER_EXPIRY.to_owned());
                    DeliveryState::Expired
                } else if retry_after.is_some() && delay > policy.max_retry_after() {
                    facts.reason = Some(RETRY_AFTER_OVER_CEILING.to_owned());
                    DeliveryState::DeadLettered
                } else {
                    facts.reason = Some(cause);
                    return Decision {
                        next_state: DeliveryState::RetryWait,
                        next_attempt_at: Some(next),
                        facts,
                        effects,
                    };
                }
            }
        }
    };
    Decision {
        next_state,
        next_attempt_at: None,
        facts,
        effects,
    }
}

/// Whether the outcome is a refusal of the account itself (its credentials, or an answer read
/// as its misconfiguration): it says nothing about this delivery, so it never spends the
/// delivery's attempt budget. It cannot exhaust the budget here, and the ledger does not count
/// it toward the next attempts' budget either (`attempt_base` moves with it); the account's
/// suspension, not the attempt limit, is what stops such sends. Expiry still ends the delivery.
pub fn is_account_fault(outcome: &SendOutcome) -> bool {
    matches!(outcome, SendOutcome::Answered(answer) if answer.verdict == Verdict::AuthFailure)
}

/// An answer's cause in the attempt's reason: its verdict, then the provider's code when it
/// gave one (`contact_invalid: 21211`); never anything free-text from the provider.
fn answer_cause(answer: &ProviderAnswer) -> String {
    match (&answer.code, answer.http_status) {
        (Some(code), _) => format!("{}: {code}", answer.verdict),
        (None, Some(status)) => format!("{}: http_{status}", answer.verdict),
        (None, None) => answer.verdict.as_str().to_owned(),
    }
}

/// What an outcome does besides moving the delivery. A generic 429 throttles the bucket, as
/// it always has; an adapter's verdict says the rest. `retry_at` is the answer's valid
/// `Retry-After`, resolved.
fn effects(outcome: &SendOutcome, retry_at: Option<DateTime<Utc>>) -> Effects {
    let verdict = match outcome {
        SendOutcome::Response { status: 429, .. } => Verdict::ThrottledAccount,
        SendOutcome::Answered(answer) => answer.verdict,
        _ => return Effects::default(),
    };
    match verdict {
        Verdict::ThrottledAccount => Effects {
            bucket: Some(BucketSignal::Throttled { retry_at }),
            ..Effects::default()
        },
        Verdict::AuthFailure => Effects {
            bucket: Some(BucketSignal::Suspend),
            alert: Some(Alert::AuthFailure),
            ..Effects::default()
        },
        Verdict::OwnFault => Effects {
            alert: Some(Alert::OwnFault),
            ..Effects::default()
        },
        Verdict::ContactInvalid => Effects {
            contact: Some(ContactFlag::Invalid),
            ..Effects::default()
        },
        Verdict::ContactOptedOut => Effects {
            contact: Some(ContactFlag::OptedOut),
            ..Effects::default()
        },
        Verdict::Accepted
        | Verdict::ThrottledRecipient
        | Verdict::RetryLater
        | Verdict::Rejected
        | Verdict::MaybeSent => Effects::default(),
    }
}

fn truncate_chars(s: &str, max_chars: usize) -> String {
    s.chars().take(max_chars).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;
    use crate::policy::{FixedJitter, MaxJitter};
    use chrono::{TimeDelta, TimeZone};
    use proptest::prelude::*;
    use std::time::UNIX_EPOCH;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap()
    }

    fn ctx(attempt_number: u32) -> AttemptContext {
        AttemptContext {
            attempt_number,
            expires_at: now() + TimeDelta::days(1),
            idempotency: IdempotencySupport::Honoured,
        }
    }

    fn response(status: u16, retry_after: Option<&str>) -> SendOutcome {
        SendOutcome::Response {
            status,
            retry_after: retry_after.map(str::to_owned),
            provider_message_id: None,
        }
    }

    fn run(ctx: &AttemptContext, outcome: &SendOutcome) -> Decision {
        decide(ctx, outcome, now(), &RetryPolicy::default(), &mut MaxJitter)
    }

    #[test]
    fn a_2xx_is_delivered_and_keeps_the_provider_message_id() {
        let outcome = SendOutcome::Response {
            status: 202,
            retry_after: None,
            provider_message_id: Some("SM123".into()),
        };
        let d = run(&ctx(1), &outcome);
        assert_eq!(d.next_state, DeliveryState::Delivered);
        assert_eq!(d.next_attempt_at, None);
        assert_eq!(d.facts.provider_message_id.as_deref(), Some("SM123"));
        assert_eq!(d.facts.http_status, Some(202));
        assert_eq!(d.facts.outcome_class, OutcomeClass::Delivered);
        assert_eq!(d.facts.reason, None);
    }

    #[test]
    fn an_auth_failure_on_the_last_allowed_attempt_retries_rather_than_spend_the_budget() {
        let refused = SendOutcome::Answered(
            ProviderAnswer::new(Verdict::AuthFailure, Some(401)).with_code(Some("20003")),
        );
        let d = run(&ctx(8), &refused);
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        assert_eq!(d.facts.reason.as_deref(), Some("auth_failure: 20003"));
        assert_eq!(d.effects.bucket, Some(BucketSignal::Suspend));
        // Any other retryable answer on that attempt still exhausts it.
        let d = run(&ctx(8), &response(503, None));
        assert_eq!(d.next_state, DeliveryState::DeadLettered);
        // And expiry still wins over an account's fault.
        let c = AttemptContext {
            expires_at: now() + TimeDelta::milliseconds(1),
            ..ctx(8)
        };
        assert_eq!(run(&c, &refused).next_state, DeliveryState::Expired);
    }

    #[test]
    fn a_2xx_on_the_last_allowed_attempt_is_still_delivered() {
        let d = run(&ctx(8), &response(200, None));
        assert_eq!(d.next_state, DeliveryState::Delivered);
    }

    #[test]
    fn a_400_is_dead_lettered_with_its_status_as_the_reason() {
        let d = run(&ctx(1), &response(400, Some("10")));
        assert_eq!(d.next_state, DeliveryState::DeadLettered);
        assert_eq!(d.next_attempt_at, None);
        assert_eq!(d.facts.reason.as_deref(), Some("http_400"));
        assert_eq!(d.facts.outcome_class, OutcomeClass::Terminal);
    }

    #[test]
    fn a_timeout_after_send_is_ambiguous_for_an_account_without_idempotency() {
        let c = AttemptContext {
            idempotency: IdempotencySupport::NotHonoured,
            ..ctx(1)
        };
        let d = run(
            &c,
            &SendOutcome::UnknownAfterSend {
                reason: "read timeout".into(),
            },
        );
        assert_eq!(d.next_state, DeliveryState::Ambiguous);
        assert_eq!(d.next_attempt_at, None);
        assert_eq!(
            d.facts.reason.as_deref(),
            Some("unknown_outcome_after_send")
        );
    }

    #[test]
    fn a_timeout_after_send_is_retried_for_an_account_that_honours_idempotency() {
        let d = run(
            &ctx(1),
            &SendOutcome::UnknownAfterSend {
                reason: "read timeout".into(),
            },
        );
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        assert_eq!(d.next_attempt_at, Some(now() + TimeDelta::seconds(1)));
        assert_eq!(
            d.facts.reason.as_deref(),
            Some("unknown_outcome_after_send")
        );
    }

    #[test]
    fn a_429_with_delta_seconds_waits_exactly_that_long() {
        let d = run(&ctx(1), &response(429, Some(" 120 ")));
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        assert_eq!(d.next_attempt_at, Some(now() + TimeDelta::seconds(120)));
        assert_eq!(d.facts.delay_chosen, Some(Duration::from_secs(120)));
        assert_eq!(d.facts.retry_after_seen.as_deref(), Some("120"));
        assert!(d.facts.retry_after_valid);
        assert_eq!(d.facts.reason.as_deref(), Some("http_429"));
    }

    #[test]
    fn a_429_with_an_http_date_defers_until_that_date() {
        let d = run(
            &ctx(1),
            &response(429, Some("Tue, 01 Jan 2030 00:05:00 GMT")),
        );
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        assert_eq!(
            d.next_attempt_at,
            Some(Utc.with_ymd_and_hms(2030, 1, 1, 0, 5, 0).unwrap())
        );
        assert_eq!(d.facts.delay_chosen, Some(Duration::from_secs(300)));
        assert!(d.facts.retry_after_valid);
    }

    #[test]
    fn a_429_with_an_http_date_in_the_past_retries_now() {
        let d = run(
            &ctx(1),
            &response(429, Some("Sun, 06 Nov 1994 08:49:37 GMT")),
        );
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        assert_eq!(d.next_attempt_at, Some(now()));
        assert_eq!(d.facts.delay_chosen, Some(Duration::ZERO));
    }

    #[test]
    fn a_429_with_a_malformed_header_falls_back_to_backoff() {
        let d = decide(
            &ctx(3),
            &response(429, Some("soon")),
            now(),
            &RetryPolicy::default(),
            &mut FixedJitter::new(2_500),
        );
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        assert_eq!(
            d.next_attempt_at,
            Some(now() + TimeDelta::milliseconds(2_500))
        );
        assert_eq!(d.facts.delay_chosen, Some(Duration::from_millis(2_500)));
        assert_eq!(d.facts.retry_after_seen.as_deref(), Some("soon"));
        assert!(!d.facts.retry_after_valid);
    }

    #[test]
    fn a_503_without_retry_after_uses_capped_exponential_backoff() {
        let d = run(&ctx(4), &response(503, None));
        assert_eq!(d.next_attempt_at, Some(now() + TimeDelta::seconds(8)));
        assert_eq!(d.facts.retry_after_seen, None);
        assert!(!d.facts.retry_after_valid);
    }

    #[test]
    fn retry_after_is_honoured_on_a_5xx_too() {
        let d = run(&ctx(1), &response(503, Some("30")));
        assert_eq!(d.next_attempt_at, Some(now() + TimeDelta::seconds(30)));
    }

    #[test]
    fn a_failure_before_send_is_retried_with_backoff() {
        let d = run(
            &ctx(2),
            &SendOutcome::FailedBeforeSend {
                reason: "dns".into(),
            },
        );
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        assert_eq!(d.next_attempt_at, Some(now() + TimeDelta::seconds(2)));
        assert_eq!(d.facts.http_status, None);
        assert_eq!(d.facts.reason.as_deref(), Some("failed_before_send"));
    }

    #[test]
    fn a_retryable_outcome_on_the_last_attempt_is_dead_lettered_naming_the_last_cause() {
        let cases = [
            (response(503, Some("5")), "attempts_exhausted: http_503"),
            (
                SendOutcome::FailedBeforeSend {
                    reason: "tls".into(),
                },
                "attempts_exhausted: failed_before_send",
            ),
            (
                SendOutcome::UnknownAfterSend {
                    reason: "reset".into(),
                },
                "attempts_exhausted: unknown_outcome_after_send",
            ),
        ];
        for (outcome, reason) in cases {
            for attempt in [8, 9, u32::MAX] {
                let d = run(&ctx(attempt), &outcome);
                assert_eq!(d.next_state, DeliveryState::DeadLettered);
                assert_eq!(d.next_attempt_at, None);
                assert_eq!(d.facts.reason.as_deref(), Some(reason));
            }
        }
    }

    #[test]
    fn a_retry_that_would_land_at_or_after_expiry_expires_instead() {
        let c = AttemptContext {
            expires_at: now() + TimeDelta::seconds(120),
            ..ctx(1)
        };
        for header in ["120", "121", "Tue, 01 Jan 2030 00:02:00 GMT"] {
            let d = run(&c, &response(429, Some(header)));
            assert_eq!(d.next_state, DeliveryState::Expired, "{header}");
            assert_eq!(d.next_attempt_at, None);
            assert_eq!(d.facts.reason.as_deref(), Some("would_retry_after_expiry"));
        }
        let d = run(&c, &response(429, Some("119")));
        assert_eq!(d.next_state, DeliveryState::RetryWait);
    }

    #[test]
    fn a_delivery_already_past_expiry_expires_even_with_retry_after_zero() {
        let c = AttemptContext {
            expires_at: now(),
            ..ctx(1)
        };
        let d = run(&c, &response(429, Some("0")));
        assert_eq!(d.next_state, DeliveryState::Expired);
    }

    #[test]
    fn a_retry_after_longer_than_the_ceiling_is_dead_lettered_not_sent_early() {
        let c = AttemptContext {
            expires_at: now() + TimeDelta::days(7),
            ..ctx(1)
        };
        let d = run(&c, &response(429, Some("3601")));
        assert_eq!(d.next_state, DeliveryState::DeadLettered);
        assert_eq!(d.next_attempt_at, None);
        assert_eq!(d.facts.reason.as_deref(), Some("retry_after_over_ceiling"));
        assert_eq!(d.facts.delay_chosen, Some(Duration::from_secs(3601)));

        let d = run(&c, &response(429, Some("3600")));
        assert_eq!(d.next_state, DeliveryState::RetryWait);
    }

    #[test]
    fn an_overflowing_retry_after_is_over_the_ceiling_not_a_reason_to_retry_soon() {
        // Beyond u32 but within the calendar: past the ceiling, so dead-lettered.
        let mut c = ctx(1);
        c.expires_at = now() + TimeDelta::days(365 * 1000);
        let d = run(&c, &response(429, Some("4294967296")));
        assert_eq!(d.next_state, DeliveryState::DeadLettered);
        assert_eq!(d.facts.reason.as_deref(), Some("retry_after_over_ceiling"));
        assert!(d.facts.retry_after_valid);
        // Beyond u64: a wait past any expiry, so the delivery expires; never a quick retry.
        let d = run(&ctx(1), &response(429, Some("99999999999999999999999")));
        assert_eq!(d.next_state, DeliveryState::Expired);
        assert_eq!(d.facts.reason.as_deref(), Some("would_retry_after_expiry"));
        assert_eq!(d.next_attempt_at, None);
    }

    #[test]
    fn a_5xx_without_idempotency_is_held_ambiguous_naming_the_status() {
        let mut c = ctx(1);
        c.idempotency = IdempotencySupport::NotHonoured;
        for status in [500, 502, 504] {
            let d = run(&c, &response(status, None));
            assert_eq!(d.next_state, DeliveryState::Ambiguous, "{status}");
            assert_eq!(
                d.facts.reason.as_deref(),
                Some(format!("maybe_sent: http_{status}").as_str())
            );
        }
        let d = run(&c, &response(503, Some("2")));
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        let d = run(&c, &response(429, Some("2")));
        assert_eq!(d.next_state, DeliveryState::RetryWait);
    }

    #[test]
    fn expiry_is_checked_before_the_ceiling() {
        let d = run(&ctx(1), &response(429, Some("999999")));
        assert_eq!(d.next_state, DeliveryState::Expired);
    }

    #[test]
    fn the_recorded_retry_after_is_trimmed_and_cut_to_64_characters() {
        let long = format!("\t{}  ", "é".repeat(100));
        let d = run(&ctx(1), &response(429, Some(&long)));
        let seen = d.facts.retry_after_seen.unwrap();
        assert_eq!(seen.chars().count(), 64);
        assert!(seen.chars().all(|c| c == 'é'));
        assert!(!d.facts.retry_after_valid);
    }

    fn answered(
        verdict: Verdict,
        status: u16,
        retry_after: Option<&str>,
        code: Option<&str>,
    ) -> SendOutcome {
        SendOutcome::Answered(
            ProviderAnswer::new(verdict, Some(status))
                .with_retry_after(retry_after.map(str::to_owned))
                .with_code(code),
        )
    }

    fn not_honoured(attempt: u32) -> AttemptContext {
        AttemptContext {
            idempotency: IdempotencySupport::NotHonoured,
            ..ctx(attempt)
        }
    }

    #[test]
    fn a_generic_429_throttles_the_bucket_with_its_retry_after_as_before() {
        let d = run(&ctx(1), &response(429, Some("30")));
        assert_eq!(
            d.effects,
            Effects {
                bucket: Some(BucketSignal::Throttled {
                    retry_at: Some(now() + TimeDelta::seconds(30))
                }),
                ..Effects::default()
            }
        );
        let d = run(&ctx(1), &response(429, Some("soon")));
        assert_eq!(
            d.effects.bucket,
            Some(BucketSignal::Throttled { retry_at: None })
        );
        for status in [200, 400, 408, 500, 503] {
            assert_eq!(
                run(&ctx(1), &response(status, Some("30"))).effects,
                Effects::default()
            );
        }
    }

    #[test]
    fn an_accepted_answer_is_delivered_with_its_message_id() {
        let outcome = SendOutcome::Answered(
            ProviderAnswer::new(Verdict::Accepted, Some(201)).with_message_id(Some("SM1".into())),
        );
        let d = run(&not_honoured(1), &outcome);
        assert_eq!(d.next_state, DeliveryState::Delivered);
        assert_eq!(d.facts.provider_message_id.as_deref(), Some("SM1"));
        assert_eq!(d.facts.http_status, Some(201));
        assert_eq!(d.effects, Effects::default());
    }

    #[test]
    fn an_account_throttle_feeds_the_bucket_and_retries_at_the_date_it_gave() {
        let d = run(
            &not_honoured(1),
            &answered(
                Verdict::ThrottledAccount,
                429,
                Some("Tue, 01 Jan 2030 00:01:00 GMT"),
                Some("20429"),
            ),
        );
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        let at = now() + TimeDelta::seconds(60);
        assert_eq!(d.next_attempt_at, Some(at));
        assert_eq!(
            d.effects.bucket,
            Some(BucketSignal::Throttled { retry_at: Some(at) })
        );
        assert_eq!(d.facts.reason.as_deref(), Some("throttled_account: 20429"));
    }

    #[test]
    fn a_recipient_throttle_retries_that_delivery_and_never_feeds_the_bucket() {
        let d = run(
            &not_honoured(1),
            &answered(
                Verdict::ThrottledRecipient,
                429,
                Some("5"),
                Some("TooManyRequests"),
            ),
        );
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        assert_eq!(d.next_attempt_at, Some(now() + TimeDelta::seconds(5)));
        assert_eq!(d.effects, Effects::default());
        assert_eq!(
            d.facts.reason.as_deref(),
            Some("throttled_recipient: TooManyRequests")
        );
    }

    #[test]
    fn retry_later_honours_its_retry_after_without_telling_the_bucket() {
        let d = run(
            &not_honoured(1),
            &answered(Verdict::RetryLater, 503, Some("20"), None),
        );
        assert_eq!(d.next_attempt_at, Some(now() + TimeDelta::seconds(20)));
        assert_eq!(d.effects, Effects::default());
        assert_eq!(d.facts.reason.as_deref(), Some("retry_later: http_503"));
    }

    #[test]
    fn an_invalid_contact_is_dead_lettered_and_flagged() {
        let d = run(
            &not_honoured(1),
            &answered(Verdict::ContactInvalid, 400, None, Some("21211")),
        );
        assert_eq!(d.next_state, DeliveryState::DeadLettered);
        assert_eq!(d.facts.reason.as_deref(), Some("contact_invalid: 21211"));
        assert_eq!(d.effects.contact, Some(ContactFlag::Invalid));
        assert_eq!(d.effects.bucket, None);
    }

    #[test]
    fn an_opted_out_contact_is_dead_lettered_and_flagged() {
        let d = run(
            &not_honoured(1),
            &answered(Verdict::ContactOptedOut, 400, None, Some("21610")),
        );
        assert_eq!(d.next_state, DeliveryState::DeadLettered);
        assert_eq!(d.facts.reason.as_deref(), Some("contact_opted_out: 21610"));
        assert_eq!(d.effects.contact, Some(ContactFlag::OptedOut));
    }

    #[test]
    fn a_rejection_is_dead_lettered_with_nothing_else() {
        let d = run(
            &not_honoured(1),
            &answered(Verdict::Rejected, 400, None, Some("INVALID_ARGUMENT")),
        );
        assert_eq!(d.next_state, DeliveryState::DeadLettered);
        assert_eq!(d.effects, Effects::default());
    }

    #[test]
    fn an_auth_failure_suspends_the_account_alerts_and_retries_the_delivery() {
        let d = run(
            &not_honoured(1),
            &answered(Verdict::AuthFailure, 401, None, Some("20003")),
        );
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        assert_eq!(
            d.effects,
            Effects {
                bucket: Some(BucketSignal::Suspend),
                alert: Some(Alert::AuthFailure),
                contact: None,
            }
        );
    }

    #[test]
    fn our_own_fault_alerts_retries_and_never_tells_the_bucket() {
        let d = run(
            &not_honoured(1),
            &answered(
                Verdict::OwnFault,
                429,
                Some("1"),
                Some("TooManyProviderTokenUpdates"),
            ),
        );
        assert_eq!(d.next_state, DeliveryState::RetryWait);
        assert_eq!(d.effects.bucket, None);
        assert_eq!(d.effects.alert, Some(Alert::OwnFault));
    }

    #[test]
    fn maybe_sent_is_held_ambiguous_without_idempotency_and_retried_with_it() {
        let outcome = answered(Verdict::MaybeSent, 502, None, None);
        let d = run(&not_honoured(1), &outcome);
        assert_eq!(d.next_state, DeliveryState::Ambiguous);
        assert_eq!(d.facts.reason.as_deref(), Some("maybe_sent: http_502"));
        assert_eq!(run(&ctx(1), &outcome).next_state, DeliveryState::RetryWait);
    }

    #[test]
    fn an_answer_on_the_last_attempt_still_has_its_effects() {
        let d = run(
            &not_honoured(8),
            &answered(Verdict::ThrottledAccount, 429, None, None),
        );
        assert_eq!(d.next_state, DeliveryState::DeadLettered);
        assert_eq!(
            d.effects.bucket,
            Some(BucketSignal::Throttled { retry_at: None })
        );
    }

    // ---- properties ----

    fn instant(secs: i64) -> DateTime<Utc> {
        DateTime::<Utc>::from_timestamp(secs, 0).unwrap()
    }

    fn http_date(t: DateTime<Utc>) -> String {
        let secs = u64::try_from(t.timestamp()).unwrap();
        httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(secs))
    }

    #[derive(Debug, Clone)]
    enum Header {
        Absent,
        Delta(u32),
        /// Seconds relative to `now`, formatted as an IMF-fixdate.
        Date(i64),
        Garbage(String),
    }

    fn header() -> impl Strategy<Value = Header> {
        prop_oneof![
            Just(Header::Absent),
            (0u32..20_000).prop_map(Header::Delta),
            any::<u32>().prop_map(Header::Delta),
            (-100_000i64..200_000).prop_map(Header::Date),
            ".{0,80}".prop_map(Header::Garbage),
        ]
    }

    fn status() -> impl Strategy<Value = u16> {
        prop_oneof![
            Just(429u16),
            Just(503u16),
            Just(408u16),
            500u16..600,
            200u16..300,
            any::<u16>(),
        ]
    }

    fn outcome(now: DateTime<Utc>) -> impl Strategy<Value = SendOutcome> {
        prop_oneof![
            4 => (status(), header(), proptest::option::of("[a-zA-Z0-9]{1,20}")).prop_map(
                move |(status, h, provider_message_id)| SendOutcome::Response {
                    status,
                    retry_after: match h {
                        Header::Absent => None,
                        Header::Delta(n) => Some(n.to_string()),
                        Header::Date(offset) => Some(http_date(now + TimeDelta::seconds(offset))),
                        Header::Garbage(s) => Some(s),
                    },
                    provider_message_id,
                }
            ),
            2 => (0usize..crate::answer::Verdict::ALL.len(), proptest::option::of(status()), header(),
                  proptest::option::of("[a-zA-Z0-9]{1,20}"), proptest::option::of(".{0,20}")).prop_map(
                move |(v, http_status, h, id, code)| SendOutcome::Answered(
                    ProviderAnswer::new(crate::answer::Verdict::ALL[v], http_status)
                        .with_retry_after(match h {
                            Header::Absent => None,
                            Header::Delta(n) => Some(n.to_string()),
                            Header::Date(offset) => Some(http_date(now + TimeDelta::seconds(offset))),
                            Header::Garbage(s) => Some(s),
                        })
                        .with_message_id(id)
                        .with_code(code.as_deref()),
                )
            ),
            1 => ".{0,10}".prop_map(|reason| SendOutcome::FailedBeforeSend { reason }),
            1 => ".{0,10}".prop_map(|reason| SendOutcome::UnknownAfterSend { reason }),
        ]
    }

    fn policy() -> impl Strategy<Value = RetryPolicy> {
        (1u64..=10_000, 0u64..=1_000_000, 1u32..=20, 1u64..=100_000).prop_map(
            |(base_ms, extra_ms, max_attempts, ceiling_s)| {
                RetryPolicy::new(
                    Duration::from_millis(base_ms),
                    Duration::from_millis(base_ms + extra_ms),
                    max_attempts,
                    Duration::from_secs(ceiling_s),
                )
                .unwrap()
            },
        )
    }

    /// Everything `decide` takes, drawn together so each property sees the same space.
    fn scenario()
    -> impl Strategy<Value = (AttemptContext, SendOutcome, DateTime<Utc>, RetryPolicy, u64)> {
        (1_000_000_000i64..4_000_000_000).prop_flat_map(|now_s| {
            let now = instant(now_s);
            (
                (0u32..=25, -100_000i64..2_000_000, any::<bool>()),
                outcome(now),
                Just(now),
                policy(),
                any::<u64>(),
            )
                .prop_map(
                    |((attempt_number, expires_in, idem), outcome, now, policy, j)| {
                        let ctx = AttemptContext {
                            attempt_number,
                            expires_at: now + TimeDelta::seconds(expires_in),
                            idempotency: idem.into(),
                        };
                        (ctx, outcome, now, policy, j)
                    },
                )
        })
    }

    fn valid_retry_after(outcome: &SendOutcome) -> Option<RetryAfter> {
        match outcome {
            SendOutcome::Response {
                retry_after: Some(raw),
                ..
            }
            | SendOutcome::Answered(ProviderAnswer {
                retry_after: Some(raw),
                ..
            }) => RetryAfter::parse(raw).ok(),
            _ => None,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        #[test]
        fn never_schedules_a_retry_at_or_after_expiry((ctx, outcome, now, policy, j) in scenario()) {
            let d = decide(&ctx, &outcome, now, &policy, &mut FixedJitter::new(j));
            if let Some(next) = d.next_attempt_at {
                prop_assert!(next < ctx.expires_at);
            }
        }

        #[test]
        fn never_schedules_earlier_than_a_valid_retry_after((ctx, outcome, now, policy, j) in scenario()) {
            let d = decide(&ctx, &outcome, now, &policy, &mut FixedJitter::new(j));
            if let (Some(ra), Some(next)) = (valid_retry_after(&outcome), d.next_attempt_at) {
                prop_assert!(next >= ra.resolve(now));
                prop_assert_eq!(next, ra.resolve(now));
                prop_assert!(d.facts.retry_after_valid);
            }
        }

        #[test]
        fn a_valid_retry_after_is_followed_exactly_or_not_retried_at_all(
            now_s in 1_000_000_000i64..4_000_000_000,
            offset in -100_000i64..200_000,
            as_date in any::<bool>(),
            status in prop_oneof![Just(429u16), Just(408u16), Just(503u16), 500u16..600],
            honoured in any::<bool>(),
            policy in policy(),
        ) {
            let now = instant(now_s);
            let header = if as_date {
                http_date(now + TimeDelta::seconds(offset))
            } else {
                offset.unsigned_abs().to_string()
            };
            let ra = RetryAfter::parse(&header).unwrap();
            let ctx = AttemptContext {
                attempt_number: 1,
                expires_at: now + TimeDelta::days(3),
                idempotency: IdempotencySupport::from(honoured),
            };
            let d = decide(&ctx, &response(status, Some(&header)), now, &policy, &mut MaxJitter);
            if !honoured && status >= 500 && status != 503 {
                // Maybe sent, and the key would not dedupe a resend.
                prop_assert_eq!(d.next_state, DeliveryState::Ambiguous);
            } else if policy.max_attempts() == 1 {
                prop_assert_eq!(d.next_state, DeliveryState::DeadLettered);
            } else if ra.resolve(now) - now > TimeDelta::from_std(policy.max_retry_after()).unwrap() {
                prop_assert_eq!(d.next_state, DeliveryState::DeadLettered);
                prop_assert_eq!(d.facts.reason.as_deref(), Some("retry_after_over_ceiling"));
            } else {
                prop_assert_eq!(d.next_state, DeliveryState::RetryWait);
                prop_assert_eq!(d.next_attempt_at, Some(ra.resolve(now)));
            }
        }

        #[test]
        fn exhausted_attempts_on_a_retryable_outcome_dead_letter((ctx, outcome, now, policy, j) in scenario()) {
            let ctx = AttemptContext { attempt_number: ctx.attempt_number.max(policy.max_attempts()), ..ctx };
            let d = decide(&ctx, &outcome, now, &policy, &mut FixedJitter::new(j));
            if classify(&outcome, ctx.idempotency) == OutcomeClass::Retryable && !is_account_fault(&outcome) {
                prop_assert_eq!(d.next_state, DeliveryState::DeadLettered);
                let reason = d.facts.reason.unwrap_or_default();
                prop_assert!(reason.starts_with("attempts_exhausted"), "{}", reason);
            }
        }

        #[test]
        fn next_attempt_at_is_set_exactly_when_waiting_to_retry((ctx, outcome, now, policy, j) in scenario()) {
            let d = decide(&ctx, &outcome, now, &policy, &mut FixedJitter::new(j));
            prop_assert_eq!(d.next_attempt_at.is_some(), d.next_state == DeliveryState::RetryWait);
            if let Some(next) = d.next_attempt_at {
                prop_assert!(next >= now);
                prop_assert!(d.facts.delay_chosen.is_some());
            }
        }

        #[test]
        fn the_next_state_is_always_a_legal_move_from_sending((ctx, outcome, now, policy, j) in scenario()) {
            let d = decide(&ctx, &outcome, now, &policy, &mut FixedJitter::new(j));
            prop_assert!(DeliveryState::Sending.can_transition_to(d.next_state));
            prop_assert_eq!(d.facts.outcome_class, classify(&outcome, ctx.idempotency));
            if d.next_state != DeliveryState::Delivered {
                prop_assert!(d.facts.reason.is_some());
            }
        }

        #[test]
        fn only_an_account_throttle_or_an_auth_failure_tells_the_bucket((ctx, outcome, now, policy, j) in scenario()) {
            let d = decide(&ctx, &outcome, now, &policy, &mut FixedJitter::new(j));
            let verdict = match &outcome {
                SendOutcome::Answered(a) => Some(a.verdict),
                SendOutcome::Response { status: 429, .. } => Some(Verdict::ThrottledAccount),
                _ => None,
            };
            match d.effects.bucket {
                Some(BucketSignal::Throttled { retry_at }) => {
                    prop_assert_eq!(verdict, Some(Verdict::ThrottledAccount));
                    prop_assert_eq!(retry_at, valid_retry_after(&outcome).map(|ra| ra.resolve(now)));
                }
                Some(BucketSignal::Suspend) => prop_assert_eq!(verdict, Some(Verdict::AuthFailure)),
                None => prop_assert!(!matches!(verdict, Some(Verdict::ThrottledAccount | Verdict::AuthFailure))),
            }
        }

        #[test]
        fn a_contact_is_flagged_exactly_when_the_answer_condemns_it((ctx, outcome, now, policy, j) in scenario()) {
            let d = decide(&ctx, &outcome, now, &policy, &mut FixedJitter::new(j));
            let want = match &outcome {
                SendOutcome::Answered(a) if a.verdict == Verdict::ContactInvalid => Some(ContactFlag::Invalid),
                SendOutcome::Answered(a) if a.verdict == Verdict::ContactOptedOut => Some(ContactFlag::OptedOut),
                _ => None,
            };
            prop_assert_eq!(d.effects.contact, want);
            if want.is_some() {
                prop_assert_eq!(d.next_state, DeliveryState::DeadLettered);
            }
        }

        #[test]
        fn an_answer_s_reason_never_holds_more_than_its_verdict_and_a_plain_code((ctx, outcome, now, policy, j) in scenario()) {
            let d = decide(&ctx, &outcome, now, &policy, &mut FixedJitter::new(j));
            if let (SendOutcome::Answered(a), Some(reason)) = (&outcome, &d.facts.reason) {
                prop_assert!(reason.len() <= 128, "{}", reason);
                prop_assert!(reason.bytes().all(|b| b.is_ascii_alphanumeric() || b" :_-.".contains(&b)), "{}", reason);
                if d.next_state == DeliveryState::DeadLettered || d.next_state == DeliveryState::Ambiguous {
                    prop_assert!(reason.contains(a.verdict.as_str()) || reason.starts_with("attempts_exhausted") || reason.starts_with("retry_after_over_ceiling"), "{}", reason);
                }
            }
        }

        #[test]
        fn a_backoff_retry_never_waits_longer_than_the_cap((ctx, outcome, now, policy, j) in scenario()) {
            let d = decide(&ctx, &outcome, now, &policy, &mut FixedJitter::new(j));
            if d.next_state == DeliveryState::RetryWait && !d.facts.retry_after_valid {
                let delay = d.facts.delay_chosen.unwrap();
                prop_assert!(delay <= policy.backoff_cap(ctx.attempt_number));
                prop_assert!(delay <= policy.max_delay());
            }
        }
    }

    #[test]
    fn http_date_helper_matches_the_rfc_example() {
        let t = Utc.with_ymd_and_hms(1994, 11, 6, 8, 49, 37).unwrap();
        assert_eq!(http_date(t), "Sun, 06 Nov 1994 08:49:37 GMT");
    }
}
