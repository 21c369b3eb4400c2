//! What the push adapters ([`crate::fcm`], [`crate::apns`]) share: the reminder's content as a
//! notification and its data, `Retry-After` read from an answer, their answers built as
//! [`ProviderAnswer`]s with a code that is one of the provider's documented ones, and the
//! window of recent answers that tells a misconfigured account from bad device tokens
//! ([`Misconfiguration`]).

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use nudge_config::ConfigError;
use nudge_domain::{ProviderAnswer, Verdict};

/// An answer with a status and the provider's code (`None`: the body named none).
pub(crate) fn answer(verdict: Verdict, status: u16, code: Option<&str>) -> ProviderAnswer {
    ProviderAnswer::new(verdict, Some(status)).with_code(code)
}

/// An answer to a request that was never sent (refused before it left): no status.
pub(crate) fn refused_before_send(code: &str) -> ProviderAnswer {
    ProviderAnswer::new(Verdict::Rejected, None).with_code(Some(code))
}

/// The `Retry-After` header as text (bounded); `None` when absent, not UTF-8 or too long.
pub(crate) fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<String> {
    crate::transport::header_text(headers, "retry-after", 128)
}

/// Whether `retry_after` is present and parses (delta-seconds or an HTTP date).
pub(crate) fn has_valid_retry_after(retry_after: Option<&str>) -> bool {
    retry_after.is_some_and(|v| nudge_domain::RetryAfter::parse(v).is_ok())
}

/// The default of `misconfigured_window`: how many of an account's recent answers are kept.
pub(crate) const fn default_misconfigured_window() -> usize {
    50
}

/// The default of `misconfigured_share`.
pub(crate) const fn default_misconfigured_share() -> f64 {
    0.5
}

/// The default of `misconfigured_min_answers`.
pub(crate) const fn default_misconfigured_min_answers() -> usize {
    5
}

/// Checks the three `misconfigured_*` keys of a push kind's table, naming the bad one.
pub(crate) fn validate_misconfigured(
    window: usize,
    share: f64,
    min_answers: usize,
    key: impl Fn(&str) -> String,
) -> Result<(), ConfigError> {
    if !(10..=10_000).contains(&window) {
        return Err(ConfigError::invalid(
            key("misconfigured_window"),
            "must be between 10 and 10000",
        ));
    }
    if !(share > 0.0 && share <= 1.0) {
        return Err(ConfigError::invalid(
            key("misconfigured_share"),
            "must be above 0 and at most 1",
        ));
    }
    if !(1..=window).contains(&min_answers) {
        return Err(ConfigError::invalid(
            key("misconfigured_min_answers"),
            "must be between 1 and misconfigured_window",
        ));
    }
    Ok(())
}

/// Tells an account whose configuration is wrong from contacts whose device tokens are.
///
/// Some answers flag a contact but are also what every send of a misconfigured account gets:
/// APNs's `400 BadDeviceToken` for a sandbox token sent to production (or the reverse), FCM's
/// `SENDER_ID_MISMATCH` for a credential of another project. One of them among many accepted
/// pushes is one bad token; most of an account's recent answers being them is the account. The
/// window keeps whether each of the account's last `window` answers was such an answer; once
/// they are at least `min_answers` and `share` of the window, each further one is read as the
/// account's fault ([`Verdict::AuthFailure`]: operators alerted, the account suspended as for
/// refused credentials, the contact left alone) instead of the contact's. Per worker process:
/// each replica judges from what it saw.
#[derive(Debug)]
pub(crate) struct Misconfiguration {
    window: usize,
    share: f64,
    min_answers: usize,
    recent: Mutex<Recent>,
}

#[derive(Debug, Default)]
struct Recent {
    answers: VecDeque<bool>,
    suspect: usize,
}

impl Misconfiguration {
    pub(crate) fn new(window: usize, share: f64, min_answers: usize) -> Self {
        Self {
            window: window.max(1),
            share,
            min_answers,
            recent: Mutex::default(),
        }
    }

    /// Records `answer` (`suspect`: one a misconfiguration also gets) and returns it, read as
    /// the account's fault when such answers now pass the share of the window.
    pub(crate) fn judge(&self, answer: ProviderAnswer, suspect: bool) -> ProviderAnswer {
        let mut recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        recent.answers.push_back(suspect);
        recent.suspect += usize::from(suspect);
        while recent.answers.len() > self.window {
            if recent.answers.pop_front() == Some(true) {
                recent.suspect -= 1;
            }
        }
        #[allow(clippy::cast_precision_loss)] // Counts up to 10,000: exact in an f64.
        let share = recent.suspect as f64 / recent.answers.len() as f64;
        let misconfigured = suspect && recent.suspect >= self.min_answers && share >= self.share;
        drop(recent);
        if !misconfigured {
            return answer;
        }
        tracing::error!(
            code = answer.code.as_ref().map(|c| c.as_str()),
            share_of_recent_answers = share,
            "most of the account's recent answers refuse its device tokens: \
             read as a misconfigured account, not as invalid contacts"
        );
        ProviderAnswer {
            verdict: Verdict::AuthFailure,
            ..answer
        }
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

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;

    fn invalid() -> ProviderAnswer {
        answer(Verdict::ContactInvalid, 400, Some("BadDeviceToken"))
    }

    fn accepted() -> ProviderAnswer {
        ProviderAnswer::new(Verdict::Accepted, Some(200))
    }

    #[test]
    fn suspect_answers_become_the_accounts_fault_once_they_pass_the_share_and_the_minimum() {
        let m = Misconfiguration::new(10, 0.5, 3);
        // The first two are contacts' (below the minimum), the third passes both.
        assert_eq!(m.judge(invalid(), true).verdict, Verdict::ContactInvalid);
        assert_eq!(m.judge(invalid(), true).verdict, Verdict::ContactInvalid);
        let third = m.judge(invalid(), true);
        assert_eq!(third.verdict, Verdict::AuthFailure);
        assert_eq!(
            third.code.as_ref().map(|c| c.as_str()),
            Some("BadDeviceToken")
        );
        assert_eq!(third.http_status, Some(400));
        // Other answers are never changed.
        assert_eq!(m.judge(accepted(), false).verdict, Verdict::Accepted);
    }

    #[test]
    fn a_bad_token_now_and_then_among_accepted_pushes_stays_the_contacts() {
        let m = Misconfiguration::new(20, 0.5, 3);
        for i in 0..200 {
            let suspect = i % 4 == 0;
            let got = m.judge(if suspect { invalid() } else { accepted() }, suspect);
            if suspect {
                assert_eq!(got.verdict, Verdict::ContactInvalid, "answer {i}");
            }
        }
    }

    #[test]
    fn the_window_forgets_old_answers_so_a_fixed_account_recovers() {
        let m = Misconfiguration::new(10, 0.5, 3);
        for _ in 0..10 {
            m.judge(invalid(), true);
        }
        assert_eq!(m.judge(invalid(), true).verdict, Verdict::AuthFailure);
        for _ in 0..10 {
            m.judge(accepted(), false);
        }
        assert_eq!(m.judge(invalid(), true).verdict, Verdict::ContactInvalid);
    }

    #[test]
    fn the_misconfigured_keys_are_checked_naming_the_key() {
        let key = |k: &str| format!("providers.3.fcm.{k}");
        assert!(validate_misconfigured(50, 0.5, 5, key).is_ok());
        let bad = |w, s, m| {
            validate_misconfigured(w, s, m, key)
                .unwrap_err()
                .key()
                .unwrap()
        };
        assert_eq!(bad(9, 0.5, 5), "providers.3.fcm.misconfigured_window");
        assert_eq!(bad(50, 0.0, 5), "providers.3.fcm.misconfigured_share");
        assert_eq!(bad(50, 1.5, 5), "providers.3.fcm.misconfigured_share");
        assert_eq!(bad(50, f64::NAN, 5), "providers.3.fcm.misconfigured_share");
        assert_eq!(bad(50, 0.5, 0), "providers.3.fcm.misconfigured_min_answers");
        assert_eq!(
            bad(50, 0.5, 51),
            "providers.3.fcm.misconfigured_min_answers"
        );
    }

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
    fn a_url_key_is_http_with_a_host_and_without_credentials_query_or_fragment() {
        for good in [
            "http://127.0.0.1:9/token",
            "https://oauth2.googleapis.com/token",
        ] {
            assert!(parse_base_url(good).is_ok(), "{good}");
        }
        for bad in [
            "ftp://h/",
            "http://u:p@h/",
            "http://h/?q",
            "http://h/#f",
            "nope",
        ] {
            assert!(parse_base_url(bad).is_err(), "{bad}");
        }
    }
}
