//! What an emulated account answers: its script, parsed once when it is set.

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Timelike as _, Utc};
use serde::{Deserialize, Serialize};

/// How an account behaves. Every field is optional; the empty script accepts everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Script {
    /// A token bucket checked before anything else.
    pub rate_limit: Option<RateLimit>,
    /// Per idempotency key: the key's n-th answered request gets `sequence[n]`.
    pub sequence: Vec<Step>,
    /// What a key gets after its sequence; accept (202) when unset.
    pub default: Option<Step>,
    /// Answer 400 to a request without an `Idempotency-Key`.
    pub require_idempotency_key: bool,
}

/// A token bucket: `per_second` tokens a second, at most `burst` (default `per_second`) at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    pub per_second: NonZeroU32,
    #[serde(default)]
    pub burst: Option<NonZeroU32>,
    /// The form of the `Retry-After` sent with a bucket's 429.
    #[serde(default)]
    pub retry_after: RetryAfterForm,
}

impl RateLimit {
    pub fn burst(&self) -> NonZeroU32 {
        self.burst.unwrap_or(self.per_second)
    }
}

/// The `Retry-After` a bucket 429 carries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryAfterForm {
    /// Whole seconds until the next token, rounded up.
    #[default]
    Delta,
    /// The instant of the next token as an IMF-fixdate (rounded up to the second).
    HttpDate,
    /// No header.
    None,
    /// `soon`, which no parser accepts.
    Malformed,
}

impl RetryAfterForm {
    /// The header value for a bucket whose next token is `wait` after `now`.
    pub fn render(self, now: DateTime<Utc>, wait: Duration) -> Option<String> {
        match self {
            Self::Delta => Some(ceil_secs(wait).max(1).to_string()),
            Self::HttpDate => {
                let at = now + TimeDelta::from_std(wait).unwrap_or(TimeDelta::MAX);
                Some(imf_fixdate(ceil_to_second(at)))
            }
            Self::None => None,
            Self::Malformed => Some("soon".to_owned()),
        }
    }
}

fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The HTTP status of a step: 200..=999 (1xx is not a final answer). 600..=999 are not HTTP
/// statuses, but the `http` crate takes them and a broken gateway may send one: a step may
/// answer one so tests can see what an adapter makes of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "u16", into = "u16")]
pub struct StepStatus(u16);

impl StepStatus {
    pub const ACCEPTED: StepStatus = StepStatus(202);

    pub fn new(status: u16) -> Result<Self, ScriptError> {
        if (200..=999).contains(&status) {
            Ok(Self(status))
        } else {
            Err(ScriptError::Status(status))
        }
    }

    pub fn as_u16(self) -> u16 {
        self.0
    }

    pub fn is_success(self) -> bool {
        (200..=299).contains(&self.0)
    }
}

impl Default for StepStatus {
    fn default() -> Self {
        Self::ACCEPTED
    }
}

impl TryFrom<u16> for StepStatus {
    type Error = ScriptError;

    fn try_from(v: u16) -> Result<Self, Self::Error> {
        Self::new(v)
    }
}

impl From<StepStatus> for u16 {
    fn from(s: StepStatus) -> u16 {
        s.0
    }
}

/// One scripted answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// 202 when unset.
    #[serde(default)]
    pub status: StepStatus,
    /// The `Retry-After` to send, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<RetryAfterSpec>,
    /// Answer this long after the request arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
    /// Never answer: hold the connection until the client gives up, the server shuts down or
    /// [`crate::MAX_HANG`] passes. A 2xx hang still counts as accepted: the provider "sent" the
    /// message and only the answer was lost, which is what an unknown outcome looks like.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hang: bool,
    /// The provider's error code in the answer's body, for shapes that have one (Twilio's
    /// numeric codes such as `21211`; SendGrid's `invalid_to` names the recipient's field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// What the delivery receipt of a message taken by this step (a 2xx, or a hang: taken,
    /// answer lost) reports, for shapes that send receipts: Twilio's `MessageStatus`
    /// (`delivered` by default, `undelivered`, `failed`), SendGrid's `event` (`delivered` by
    /// default, `bounce`, `dropped`, `unsubscribe`); `none` sends no receipt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt: Option<String>,
    /// How long after the request the receipt is sent (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt_delay_ms: Option<u64>,
}

impl Step {
    pub fn status(status: u16) -> Result<Self, ScriptError> {
        Ok(Self {
            status: StepStatus::new(status)?,
            ..Self::default()
        })
    }

    pub fn with_retry_after(mut self, spec: RetryAfterSpec) -> Self {
        self.retry_after = Some(spec);
        self
    }

    pub fn delay(&self) -> Option<Duration> {
        self.delay_ms.map(Duration::from_millis)
    }
}

/// A scripted `Retry-After`: a raw value sent as is, or an HTTP date `secs` from the answer.
///
/// In JSON it is one string: `"@http_date+N"` (IMF-fixdate), `"@rfc850+N"`, `"@asctime+N"`, or
/// anything else as the raw header value (which must be a valid header value; that is how a
/// malformed one such as `"soon"` is sent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum RetryAfterSpec {
    Raw(String),
    ImfFixdate { secs: u32 },
    Rfc850 { secs: u32 },
    Asctime { secs: u32 },
}

impl RetryAfterSpec {
    /// The header value for an answer given at `now`. Dates are rounded up to the next whole
    /// second, so the date is never before `now + secs`.
    pub fn render(&self, now: DateTime<Utc>) -> String {
        let at = |secs: u32| ceil_to_second(now + TimeDelta::seconds(i64::from(secs)));
        match self {
            Self::Raw(raw) => raw.clone(),
            Self::ImfFixdate { secs } => imf_fixdate(at(*secs)),
            Self::Rfc850 { secs } => at(*secs).format("%A, %d-%b-%y %H:%M:%S GMT").to_string(),
            Self::Asctime { secs } => at(*secs).format("%a %b %e %H:%M:%S %Y").to_string(),
        }
    }
}

impl FromStr for RetryAfterSpec {
    type Err = ScriptError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(rest) = s.strip_prefix('@') {
            let (form, secs) = rest
                .split_once('+')
                .ok_or_else(|| ScriptError::RetryAfter(s.to_owned()))?;
            let secs: u32 = secs
                .parse()
                .map_err(|_| ScriptError::RetryAfter(s.to_owned()))?;
            return match form {
                "http_date" => Ok(Self::ImfFixdate { secs }),
                "rfc850" => Ok(Self::Rfc850 { secs }),
                "asctime" => Ok(Self::Asctime { secs }),
                _ => Err(ScriptError::RetryAfter(s.to_owned())),
            };
        }
        // Tab and visible ASCII, the bytes a header value can hold that every client accepts.
        if s.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b)) {
            Ok(Self::Raw(s.to_owned()))
        } else {
            Err(ScriptError::RetryAfter(s.to_owned()))
        }
    }
}

impl TryFrom<String> for RetryAfterSpec {
    type Error = ScriptError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl fmt::Display for RetryAfterSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Raw(raw) => f.write_str(raw),
            Self::ImfFixdate { secs } => write!(f, "@http_date+{secs}"),
            Self::Rfc850 { secs } => write!(f, "@rfc850+{secs}"),
            Self::Asctime { secs } => write!(f, "@asctime+{secs}"),
        }
    }
}

impl From<RetryAfterSpec> for String {
    fn from(s: RetryAfterSpec) -> String {
        s.to_string()
    }
}

/// Why a script was rejected. Scripts are test fixtures, so the bad value is shown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScriptError {
    #[error("status {0} is not a final status the http crate takes (200..=999)")]
    Status(u16),
    #[error(
        "retry_after {0:?} is neither a header value nor one of @http_date+N, @rfc850+N, @asctime+N"
    )]
    RetryAfter(String),
}

fn ceil_to_second(t: DateTime<Utc>) -> DateTime<Utc> {
    let whole = t.with_nanosecond(0).unwrap_or(t);
    if whole == t {
        t
    } else {
        whole + TimeDelta::seconds(1)
    }
}

/// The preferred HTTP-date form of RFC 9110, e.g. `Sun, 06 Nov 1994 08:49:37 GMT`.
fn imf_fixdate(t: DateTime<Utc>) -> String {
    t.format("%a, %d %b %Y %H:%M:%S GMT").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("1994-11-06T08:49:36.250Z")
            .unwrap()
            .with_timezone(&Utc)
    }

    #[test]
    fn each_http_date_form_is_rendered_as_rfc_9110_spells_it() {
        let spec = |s: &str| s.parse::<RetryAfterSpec>().unwrap().render(now());
        assert_eq!(spec("@http_date+0"), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(spec("@rfc850+0"), "Sunday, 06-Nov-94 08:49:37 GMT");
        assert_eq!(spec("@asctime+0"), "Sun Nov  6 08:49:37 1994");
        assert_eq!(spec("@http_date+60"), "Sun, 06 Nov 1994 08:50:37 GMT");
        assert_eq!(spec("120"), "120");
        assert_eq!(spec("soon"), "soon");
    }

    #[test]
    fn every_rendered_date_parses_as_an_http_date_no_earlier_than_asked() {
        let now = Utc::now();
        for form in ["@http_date+30", "@rfc850+30", "@asctime+30"] {
            let value = form.parse::<RetryAfterSpec>().unwrap().render(now);
            let parsed = httpdate::parse_http_date(&value).unwrap();
            let floor = SystemTime::from(now) + Duration::from_secs(30);
            assert!(parsed >= floor, "{form}: {value}");
            assert!(
                parsed < floor + Duration::from_secs(1) + Duration::from_millis(1),
                "{form}"
            );
        }
    }

    #[test]
    fn an_unknown_at_form_or_a_control_character_is_refused() {
        for bad in ["@http_date", "@http_date+x", "@fortnight+1", "a\nb", "é"] {
            assert!(bad.parse::<RetryAfterSpec>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_bucket_429_renders_each_configured_form() {
        let wait = Duration::from_millis(1_200);
        assert_eq!(
            RetryAfterForm::Delta.render(now(), wait).as_deref(),
            Some("2")
        );
        assert_eq!(
            RetryAfterForm::Delta
                .render(now(), Duration::from_millis(1))
                .as_deref(),
            Some("1")
        );
        assert_eq!(
            RetryAfterForm::HttpDate.render(now(), wait).as_deref(),
            Some("Sun, 06 Nov 1994 08:49:38 GMT")
        );
        assert_eq!(RetryAfterForm::None.render(now(), wait), None);
        assert_eq!(
            RetryAfterForm::Malformed.render(now(), wait).as_deref(),
            Some("soon")
        );
    }

    #[test]
    fn a_script_reads_from_json_with_every_field_optional() {
        let s: Script = serde_json::from_str("{}").unwrap();
        assert_eq!(s, Script::default());
        let s: Script = serde_json::from_value(serde_json::json!({
            "rate_limit": {"per_second": 5, "burst": 1, "retry_after": "http_date"},
            "sequence": [{"status": 429, "retry_after": "@rfc850+2"}, {"status": 500, "delay_ms": 10}, {"hang": true}],
            "default": {"status": 202},
            "require_idempotency_key": true
        }))
        .unwrap();
        assert_eq!(s.rate_limit.unwrap().burst().get(), 1);
        assert_eq!(
            s.sequence[0].retry_after,
            Some(RetryAfterSpec::Rfc850 { secs: 2 })
        );
        assert_eq!(s.sequence[2].status, StepStatus::ACCEPTED);
        assert!(s.sequence[2].hang);
        let back: Script = serde_json::from_value(serde_json::to_value(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn a_script_with_a_bad_value_is_refused() {
        for bad in [
            serde_json::json!({"sequence": [{"status": 100}]}),
            serde_json::json!({"sequence": [{"status": 1000}]}),
            serde_json::json!({"rate_limit": {"per_second": 0}}),
            serde_json::json!({"rate_limit": {"per_second": 1, "retry_after": "later"}}),
            serde_json::json!({"default": {"status": 202, "colour": "red"}}),
            serde_json::json!({"sequence": [{"retry_after": "@asctime+-1"}]}),
        ] {
            assert!(
                serde_json::from_value::<Script>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }
}
