//! The `Retry-After` response header (RFC 9110 §10.2.3): delta-seconds or an HTTP-date.

use std::time::{Duration, SystemTime};

use chrono::{DateTime, TimeDelta, Utc};

/// What a provider asked for: wait this long, or wait until then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryAfter {
    Delay(Duration),
    At(DateTime<Utc>),
}

/// Why a `Retry-After` value could not be used. The value itself is not carried: the caller has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed Retry-After: {reason}")]
pub struct MalformedRetryAfter {
    reason: MalformedReason,
}

impl MalformedRetryAfter {
    pub fn reason(&self) -> MalformedReason {
        self.reason
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MalformedReason {
    #[error("empty")]
    Empty,
    /// Neither `1*DIGIT` nor an IMF-fixdate, RFC 850 or asctime date. Signs, fractions and
    /// trailing junk land here.
    #[error("neither delta-seconds nor an HTTP-date")]
    Unrecognised,
}

impl RetryAfter {
    /// Parses a header value, tolerating the optional whitespace (SP / HTAB) around it.
    ///
    /// A delta-seconds value too large for a `u64` saturates (RFC 9110 lets recipients clamp an
    /// overflowing delta): it is a valid request to wait a very long time, so the retry
    /// policy's ceiling applies to it, as to any long one. Treating it as malformed would fall
    /// back to backoff and retry within seconds what the provider asked us to leave alone.
    pub fn parse(value: &str) -> Result<RetryAfter, MalformedRetryAfter> {
        let value = trim_ows(value);
        if value.is_empty() {
            return Err(MalformedReason::Empty.into());
        }
        if value.bytes().all(|b| b.is_ascii_digit()) {
            // `u32::from_str` alone would also accept a leading `+`, which delta-seconds does not.
            let secs = value.parse::<u64>().unwrap_or(u64::MAX);
            return Ok(RetryAfter::Delay(Duration::from_secs(secs)));
        }
        httpdate::parse_http_date(value)
            .map(|t: SystemTime| RetryAfter::At(DateTime::<Utc>::from(t)))
            .map_err(|_| MalformedReason::Unrecognised.into())
    }

    /// The instant the provider allows the next attempt, never before `now`: a date in the past
    /// means "now", and a delay too large to represent saturates instead of wrapping.
    pub fn resolve(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        match *self {
            RetryAfter::Delay(delay) => add_saturating(now, delay),
            RetryAfter::At(at) => at.max(now),
        }
    }
}

impl std::str::FromStr for RetryAfter {
    type Err = MalformedRetryAfter;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RetryAfter::parse(s)
    }
}

impl From<MalformedReason> for MalformedRetryAfter {
    fn from(reason: MalformedReason) -> Self {
        MalformedRetryAfter { reason }
    }
}

/// Strips RFC 9110 optional whitespace (SP and HTAB only) from both ends.
pub(crate) fn trim_ows(s: &str) -> &str {
    s.trim_matches([' ', '\t'])
}

pub(crate) fn add_saturating(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| t.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;
    use chrono::TimeZone;
    use proptest::prelude::*;
    use std::time::UNIX_EPOCH;

    fn at(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
    }

    fn rfc_example() -> DateTime<Utc> {
        at(1994, 11, 6, 8, 49, 37)
    }

    fn reason(s: &str) -> MalformedReason {
        RetryAfter::parse(s).unwrap_err().reason()
    }

    #[test]
    fn delta_seconds_are_a_delay() {
        assert_eq!(
            RetryAfter::parse("120"),
            Ok(RetryAfter::Delay(Duration::from_secs(120)))
        );
    }

    #[test]
    fn delta_seconds_with_surrounding_whitespace_are_a_delay() {
        assert_eq!(
            RetryAfter::parse("  120\t"),
            Ok(RetryAfter::Delay(Duration::from_secs(120)))
        );
    }

    #[test]
    fn zero_seconds_means_retry_now() {
        let now = at(2030, 1, 1, 0, 0, 0);
        let ra = RetryAfter::parse("0").unwrap();
        assert_eq!(ra, RetryAfter::Delay(Duration::ZERO));
        assert_eq!(ra.resolve(now), now);
    }

    #[test]
    fn the_largest_u32_is_still_a_delay() {
        assert_eq!(
            RetryAfter::parse("4294967295"),
            Ok(RetryAfter::Delay(Duration::from_secs(u64::from(u32::MAX))))
        );
    }

    #[test]
    fn an_imf_fixdate_is_that_instant() {
        for s in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "  Sun, 06 Nov 1994 08:49:37 GMT\t",
        ] {
            assert_eq!(
                RetryAfter::parse(s),
                Ok(RetryAfter::At(rfc_example())),
                "{s:?}"
            );
        }
    }

    #[test]
    fn an_obsolete_rfc_850_date_is_that_instant() {
        for s in [
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "\t Sunday, 06-Nov-94 08:49:37 GMT ",
        ] {
            assert_eq!(
                RetryAfter::parse(s),
                Ok(RetryAfter::At(rfc_example())),
                "{s:?}"
            );
        }
    }

    #[test]
    fn an_asctime_date_is_that_instant() {
        for s in ["Sun Nov  6 08:49:37 1994", " \tSun Nov  6 08:49:37 1994  "] {
            assert_eq!(
                RetryAfter::parse(s),
                Ok(RetryAfter::At(rfc_example())),
                "{s:?}"
            );
        }
    }

    #[test]
    fn a_date_in_the_past_resolves_to_now() {
        let now = at(2030, 1, 1, 0, 0, 0);
        let ra = RetryAfter::parse("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(ra.resolve(now), now);
    }

    #[test]
    fn a_date_in_the_future_resolves_to_exactly_that_instant() {
        let now = at(2030, 1, 1, 0, 0, 0);
        let ra = RetryAfter::parse("Tue, 01 Jan 2030 00:05:00 GMT").unwrap();
        assert_eq!(ra.resolve(now), at(2030, 1, 1, 0, 5, 0));
    }

    #[test]
    fn a_delay_resolves_to_now_plus_the_delay() {
        let now = at(2030, 1, 1, 0, 0, 0);
        let ra = RetryAfter::parse("120").unwrap();
        assert_eq!(ra.resolve(now), at(2030, 1, 1, 0, 2, 0));
    }

    #[test]
    fn a_delay_too_large_for_the_calendar_saturates_instead_of_panicking() {
        let ra = RetryAfter::Delay(Duration::MAX);
        assert_eq!(
            ra.resolve(at(2030, 1, 1, 0, 0, 0)),
            DateTime::<Utc>::MAX_UTC
        );
    }

    #[test]
    fn empty_and_whitespace_only_values_are_malformed() {
        assert_eq!(reason(""), MalformedReason::Empty);
        assert_eq!(reason("   "), MalformedReason::Empty);
        assert_eq!(reason(" \t "), MalformedReason::Empty);
    }

    #[test]
    fn signed_fractional_and_non_numeric_values_are_malformed() {
        for s in ["-1", "1.5", "+5", "abc", "12abc", "1 2", "١٢"] {
            assert_eq!(reason(s), MalformedReason::Unrecognised, "{s:?}");
        }
    }

    #[test]
    fn a_delta_that_overflows_is_a_valid_very_long_delay_not_malformed() {
        assert_eq!(
            RetryAfter::parse("4294967296"),
            Ok(RetryAfter::Delay(Duration::from_secs(4_294_967_296)))
        );
        assert_eq!(
            RetryAfter::parse("99999999999999999999999999"),
            Ok(RetryAfter::Delay(Duration::from_secs(u64::MAX)))
        );
        let now = DateTime::<Utc>::UNIX_EPOCH;
        assert_eq!(
            RetryAfter::parse("99999999999999999999999999")
                .unwrap()
                .resolve(now),
            DateTime::<Utc>::MAX_UTC
        );
    }

    #[test]
    fn a_truncated_date_is_malformed() {
        assert_eq!(reason("Sun, 06 Nov 1994"), MalformedReason::Unrecognised);
    }

    #[test]
    fn whitespace_other_than_space_and_tab_is_not_trimmed() {
        assert!(RetryAfter::parse("120\n").is_err());
    }

    proptest! {
        #[test]
        fn any_u32_round_trips_as_delta_seconds(n in any::<u32>()) {
            prop_assert_eq!(
                RetryAfter::parse(&n.to_string()),
                Ok(RetryAfter::Delay(Duration::from_secs(u64::from(n))))
            );
        }

        #[test]
        fn any_formatted_http_date_parses_back_to_the_same_second(
            // Up to 9999-12-31T23:59:59Z, the last instant an HTTP-date can express.
            secs in 0u64..253_402_300_800,
            nanos in 0u32..1_000_000_000,
        ) {
            let t = UNIX_EPOCH + Duration::new(secs, nanos);
            let text = httpdate::fmt_http_date(t);
            let expected = DateTime::<Utc>::from_timestamp(i64::try_from(secs).unwrap(), 0).unwrap();
            prop_assert_eq!(RetryAfter::parse(&text), Ok(RetryAfter::At(expected)));
        }

        #[test]
        fn arbitrary_strings_never_panic(s in ".*") {
            let _ = RetryAfter::parse(&s);
        }

        #[test]
        fn arbitrary_bytes_shaped_like_dates_never_panic(s in "[ \t]{0,2}[A-Za-z0-9 ,:-]{0,40}[ \t]{0,2}") {
            if let Ok(ra) = RetryAfter::parse(&s) {
                let now = DateTime::<Utc>::from_timestamp(1_900_000_000, 0).unwrap();
                prop_assert!(ra.resolve(now) >= now);
            }
        }
    }
}
