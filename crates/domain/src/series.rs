//! Recurring reminders (series): an RFC 5545 RRULE from a start in the subscriber's local time,
//! expanded into occurrences, each a local time resolved to its instant.
//!
//! The rule is expanded in *floating* wall-clock time: the `rrule` crate is given the start as
//! if it were UTC (which has no gaps or repeats), so it does pure calendar arithmetic on
//! wall-clock times, and each occurrence is resolved in the series' zone by [`Zone::resolve`],
//! the one disambiguation rule nudge has (0501): 08:00 stays 08:00 across both changes, a
//! 02:30 the clocks skip happens once at 03:30, a 01:30 they repeat happens once, the first
//! time. `rrule`'s own zone handling is not used: it refuses a start in a gap, drops
//! occurrences where a zone changes at midnight, and reads a time without a zone in the host's.
//!
//! Accepted: `[RRULE:]KEY=VALUE;...` with FREQ (DAILY, WEEKLY, MONTHLY), INTERVAL, BYDAY,
//! BYMONTHDAY, BYHOUR, BYMINUTE, COUNT, UNTIL and WKST; a series must end (COUNT or UNTIL, not
//! both) within a bound of its start, and may not happen more than a bound of times a day.
//! UNTIL is read by nudge: `YYYYMMDDTHHMMSSZ` is an instant; `YYYYMMDDTHHMMSS` or `YYYYMMDD` a
//! local time in the series' zone (a date: the end of that day). Errors never quote the rule.
//! Nothing here reads a clock.

use chrono::{DateTime, Duration, NaiveDate, NaiveDateTime, TimeZone as _, Utc};
use rrule::{Frequency, RRule, RRuleSet, Unvalidated};

use crate::zone::{LocalTime, Resolved, Zone};

/// What a series may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeriesLimits {
    /// Its last occurrence (or UNTIL) at most this long after its start.
    pub max_ahead: Duration,
    /// At most this many occurrences on one day (BYHOUR x BYMINUTE).
    pub max_per_day: usize,
}

/// Why a series was refused. Never carries the rule's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SeriesError {
    #[error(
        "is not an RRULE of FREQ=DAILY, WEEKLY or MONTHLY with INTERVAL, BYDAY, BYMONTHDAY, \
         BYHOUR, BYMINUTE, COUNT, UNTIL or WKST (COUNT and UNTIL not both), producing at least \
         one occurrence"
    )]
    Rule,
    #[error("must end: give COUNT or UNTIL")]
    NeverEnds,
    #[error("ends further ahead of its start than a series may (intake.max_schedule_ahead_days)")]
    TooFarAhead,
    #[error("happens more times a day than a series may (BYHOUR x BYMINUTE)")]
    TooManyPerDay,
}

/// A checked series: its zone, its start and the rule, ready to expand.
#[derive(Debug, Clone)]
pub struct Series {
    zone: Zone,
    start: LocalTime,
    set: RRuleSet,
    until: Option<DateTime<Utc>>,
}

/// One occurrence: the wall-clock time the rule gave (the event id's part) and its instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occurrence {
    pub local: LocalTime,
    pub resolved: Resolved,
}

impl Occurrence {
    pub fn instant(&self) -> DateTime<Utc> {
        self.resolved.instant
    }
}

fn floating(n: NaiveDateTime) -> DateTime<rrule::Tz> {
    rrule::Tz::UTC.from_utc_datetime(&n)
}

const KEYS: &[&str] = &[
    "FREQ",
    "INTERVAL",
    "BYDAY",
    "BYMONTHDAY",
    "BYHOUR",
    "BYMINUTE",
    "COUNT",
    "UNTIL",
    "WKST",
];

/// The rule without UNTIL (for `rrule`), and UNTIL as nudge reads it.
fn prepass(text: &str, zone: Zone) -> Result<(String, Option<DateTime<Utc>>), SeriesError> {
    if text.len() > 512 {
        return Err(SeriesError::Rule);
    }
    let body = text.strip_prefix("RRULE:").unwrap_or(text);
    if body.is_empty() || !body.is_ascii() {
        return Err(SeriesError::Rule);
    }
    let mut kept = Vec::new();
    let mut until = None;
    let mut seen = Vec::new();
    for part in body.split(';') {
        let (key, value) = part.split_once('=').ok_or(SeriesError::Rule)?;
        if !KEYS.contains(&key) || seen.contains(&key) || value.is_empty() {
            return Err(SeriesError::Rule);
        }
        seen.push(key);
        if key == "UNTIL" {
            until = Some(parse_until(value, zone)?);
        } else {
            kept.push(part);
        }
    }
    Ok((kept.join(";"), until))
}

fn parse_until(value: &str, zone: Zone) -> Result<DateTime<Utc>, SeriesError> {
    if let Some(utc) = value.strip_suffix('Z') {
        return NaiveDateTime::parse_from_str(utc, "%Y%m%dT%H%M%S")
            .map(|n| n.and_utc())
            .map_err(|_| SeriesError::Rule);
    }
    let local = if value.len() == 8 {
        NaiveDate::parse_from_str(value, "%Y%m%d")
            .map_err(|_| SeriesError::Rule)?
            .and_hms_opt(23, 59, 59)
            .ok_or(SeriesError::Rule)?
    } else {
        NaiveDateTime::parse_from_str(value, "%Y%m%dT%H%M%S").map_err(|_| SeriesError::Rule)?
    };
    let local = LocalTime::new(local).map_err(|_| SeriesError::Rule)?;
    Ok(zone.resolve(local).instant)
}

impl Series {
    /// Checks `rule` from `start` in `zone` against `limits`.
    pub fn parse(
        rule: &str,
        start: LocalTime,
        zone: Zone,
        limits: &SeriesLimits,
    ) -> Result<Self, SeriesError> {
        let (rule_text, until) = prepass(rule, zone)?;
        let parsed: RRule<Unvalidated> = rule_text.parse().map_err(|_| SeriesError::Rule)?;
        if !matches!(
            parsed.get_freq(),
            Frequency::Daily | Frequency::Weekly | Frequency::Monthly
        ) || parsed.get_interval() == 0
            || parsed.get_count() == Some(0)
        {
            return Err(SeriesError::Rule);
        }
        match (parsed.get_count(), until) {
            (Some(_), Some(_)) => return Err(SeriesError::Rule),
            (None, None) => return Err(SeriesError::NeverEnds),
            _ => {}
        }
        let validated = parsed
            .validate(floating(start.naive()))
            .map_err(|_| SeriesError::Rule)?;
        // After validation the lists hold the start's time where absent: their product is
        // the most a day can hold.
        let per_day = validated.get_by_hour().len()
            * validated.get_by_minute().len()
            * validated.get_by_second().len();
        if per_day > limits.max_per_day {
            return Err(SeriesError::TooManyPerDay);
        }
        let series = Self {
            zone,
            start,
            set: RRuleSet::new(floating(start.naive())).rrule(validated),
            until,
        };
        let first = series.zone.resolve(start).instant;
        let horizon = first + limits.max_ahead;
        let last = match until {
            Some(until) => Some(until),
            // A COUNT: its last occurrence, counted up to a day past the horizon.
            None => series
                .locals_until(series.zone.local_at(horizon).naive() + Duration::days(1))
                .last()
                .map(|local| series.zone.resolve(local).instant),
        };
        match last {
            Some(last) if last > horizon => Err(SeriesError::TooFarAhead),
            _ if series
                .between(first - Duration::days(2), horizon)
                .is_empty() =>
            {
                Err(SeriesError::Rule)
            }
            _ => Ok(series),
        }
    }

    pub fn zone(&self) -> Zone {
        self.zone
    }

    pub fn start(&self) -> LocalTime {
        self.start
    }

    /// The rule's wall-clock times up to `stop` (inclusive), in order.
    fn locals_until(&self, stop: NaiveDateTime) -> impl Iterator<Item = LocalTime> + '_ {
        (&self.set)
            .into_iter()
            .map(|at| at.naive_utc())
            .take_while(move |n| *n <= stop)
            .filter_map(|n| LocalTime::new(n).ok())
    }

    /// The first occurrence at or after `from`, if the series has one: where the expansion
    /// resumes. A local time the clocks skip resolves later than the next ones on its day, so
    /// the rule's times are looked at a day past the first that comes at or after `from`.
    pub fn next_from(&self, from: DateTime<Utc>) -> Option<Occurrence> {
        // Past UNTIL (two days of slack, as in `between`) nothing more can come.
        let stop = self.until.map_or(NaiveDateTime::MAX, |u| {
            self.zone.local_at(u).naive() + Duration::days(2)
        });
        let mut best: Option<Occurrence> = None;
        for local in self.locals_until(stop) {
            if best.is_some_and(|b| local.naive() > b.local.naive() + Duration::days(1)) {
                break;
            }
            let o = Occurrence {
                local,
                resolved: self.zone.resolve(local),
            };
            if self.until.is_some_and(|u| o.instant() > u) || o.instant() < from {
                continue;
            }
            if best.is_none_or(|b| (o.instant(), o.local) < (b.instant(), b.local)) {
                best = Some(o);
            }
        }
        best
    }

    /// Up to `n` occurrences at or after `from`, in order.
    pub fn upcoming(&self, from: DateTime<Utc>, n: usize) -> Vec<Occurrence> {
        let mut found = Vec::with_capacity(n);
        let mut from = from;
        while found.len() < n {
            let Some(o) = self.next_from(from) else {
                break;
            };
            from = o.instant() + Duration::microseconds(1);
            found.push(o);
        }
        found
    }

    /// The occurrences whose instants fall in `[from, to)`, in order of instant. Two local
    /// times that resolve to one instant (02:30 and 03:30 on a spring-forward day) are one
    /// occurrence, the earlier wall-clock time's.
    pub fn between(&self, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<Occurrence> {
        let last = self.until.map_or(to, |u| u.min(to));
        // Two days of slack: a gap moves a time forward by at most a day (Samoa, 2011).
        let stop = self.zone.local_at(last).naive() + Duration::days(2);
        let mut out: Vec<Occurrence> = self
            .locals_until(stop)
            .map(|local| Occurrence {
                local,
                resolved: self.zone.resolve(local),
            })
            .filter(|o| self.until.is_none_or(|u| o.instant() <= u))
            .filter(|o| from <= o.instant() && o.instant() < to)
            .collect();
        out.sort_by_key(|o| (o.instant(), o.local));
        out.dedup_by_key(|o| o.instant());
        out
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn limits() -> SeriesLimits {
        SeriesLimits {
            max_ahead: Duration::days(366),
            max_per_day: 24,
        }
    }

    fn local(text: &str) -> LocalTime {
        LocalTime::parse(text).unwrap()
    }

    fn utc(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .unwrap()
            .with_timezone(&Utc)
    }

    fn series(rule: &str, start: &str, zone: &str) -> Series {
        Series::parse(rule, local(start), Zone::parse(zone).unwrap(), &limits()).unwrap()
    }

    /// (local time the rule gave, instant) of every occurrence in [from, to).
    fn shown(s: &Series, from: &str, to: &str) -> Vec<(String, String)> {
        s.between(utc(from), utc(to))
            .into_iter()
            .map(|o| (o.local.to_string(), o.instant().to_rfc3339()))
            .collect()
    }

    #[test]
    fn a_daily_time_stays_on_the_wall_clock_across_both_changes() {
        for (zone, spring, fall) in [
            ("America/New_York", "2027-03-13", "2027-11-06"),
            ("Europe/London", "2027-03-27", "2027-10-30"),
            ("Australia/Lord_Howe", "2027-10-02", "2027-04-03"),
        ] {
            let z = Zone::parse(zone).unwrap();
            let s = series("FREQ=DAILY;COUNT=365", "2027-01-01T08:00:00", zone);
            for day in [spring, fall] {
                let d = NaiveDate::parse_from_str(day, "%Y-%m-%d").unwrap();
                for offset in 0..3 {
                    let at = (d + Duration::days(offset)).and_hms_opt(0, 0, 0).unwrap();
                    let from = z.resolve(LocalTime::new(at).unwrap()).instant;
                    let found = s.between(from, from + Duration::hours(23));
                    assert_eq!(found.len(), 1, "{zone} {at}");
                    assert_eq!(
                        z.local_at(found[0].instant()).naive().time(),
                        chrono::NaiveTime::from_hms_opt(8, 0, 0).unwrap(),
                        "{zone} {at}: 08:00 on the wall clock"
                    );
                }
            }
        }
    }

    #[test]
    fn a_time_the_clocks_skip_happens_once_after_the_gap_and_a_repeated_one_once_the_first_time() {
        let s = series(
            "FREQ=DAILY;COUNT=365",
            "2027-01-01T02:30:00",
            "America/New_York",
        );
        assert_eq!(
            shown(&s, "2027-03-13T00:00:00Z", "2027-03-16T00:00:00Z"),
            vec![
                (
                    "2027-03-13T02:30:00".into(),
                    "2027-03-13T07:30:00+00:00".into()
                ),
                // 02:30 does not exist: 03:30 EDT, once.
                (
                    "2027-03-14T02:30:00".into(),
                    "2027-03-14T07:30:00+00:00".into()
                ),
                (
                    "2027-03-15T02:30:00".into(),
                    "2027-03-15T06:30:00+00:00".into()
                ),
            ]
        );
        let s = series(
            "FREQ=DAILY;COUNT=365",
            "2027-01-01T01:30:00",
            "America/New_York",
        );
        assert_eq!(
            shown(&s, "2027-11-07T00:00:00Z", "2027-11-08T00:00:00Z"),
            // 01:30 happens at 05:30Z (EDT) and 06:30Z (EST): the first, once.
            vec![(
                "2027-11-07T01:30:00".into(),
                "2027-11-07T05:30:00+00:00".into()
            )]
        );
        // 02:30 and 03:30 meet on the spring-forward day: one reminder, the 02:30's.
        let s = series(
            "FREQ=DAILY;BYHOUR=2,3;BYMINUTE=30;COUNT=700",
            "2027-01-01T02:30:00",
            "America/New_York",
        );
        assert_eq!(
            shown(&s, "2027-03-14T05:00:00Z", "2027-03-14T12:00:00Z"),
            vec![(
                "2027-03-14T02:30:00".into(),
                "2027-03-14T07:30:00+00:00".into()
            )]
        );
    }

    /// Daily series at 08:00, 02:30 and 01:30 (New York's, London's and Lord Howe's changes
    /// happen between 01:00 and 03:00) on both change days of each zone: each day has exactly
    /// one occurrence, 08:00 stays 08:00, a skipped time comes after the gap, a repeated one the
    /// first time. Printed as the table it checks.
    #[test]
    fn the_series_dst_table() {
        // (zone, spring-forward day, fall-back day, the wall clock a skipped time comes at:
        // New York skips 02:00-03:00, London 01:00-02:00, Lord Howe 02:00-02:30).
        let zones = [
            ("America/New_York", "2027-03-14", "2027-11-07", "03:30:00"),
            ("Europe/London", "2027-03-28", "2027-10-31", "02:30:00"),
            ("Australia/Lord_Howe", "2027-10-03", "2027-04-04", "-"),
        ];
        println!(
            "{:<20} {:<6} {:<11} {:<20} {:<26} {}",
            "zone", "daily", "day", "occurrence (local)", "due (UTC)", "wall clock then"
        );
        for (zone, spring, fall, skipped_at) in zones {
            let z = Zone::parse(zone).unwrap();
            for time in ["08:00:00", "02:30:00", "01:30:00"] {
                let s = series("FREQ=DAILY;COUNT=365", &format!("2027-01-01T{time}"), zone);
                for (day, kind) in [(spring, "spring"), (fall, "fall")] {
                    let d = NaiveDate::parse_from_str(day, "%Y-%m-%d").unwrap();
                    let from = z.resolve(LocalTime::new(d.and_hms_opt(0, 0, 0).unwrap()).unwrap());
                    let to = z.resolve(
                        LocalTime::new((d + Duration::days(1)).and_hms_opt(0, 0, 0).unwrap())
                            .unwrap(),
                    );
                    let found = s.between(from.instant, to.instant);
                    assert_eq!(found.len(), 1, "{zone} {day} {time}: {found:?}");
                    let o = found[0];
                    let wall = z.local_at(o.instant()).naive().time().to_string();
                    println!(
                        "{zone:<20} {:<6} {day:<11} {:<20} {:<26} {wall} ({kind})",
                        &time[..5],
                        o.local.to_string(),
                        o.instant().to_rfc3339()
                    );
                    assert_eq!(o.local.to_string(), format!("{day}T{time}"));
                    let in_gap = kind == "spring"
                        && z.resolve(o.local).kind != crate::zone::Resolution::Exact;
                    if in_gap {
                        assert_eq!(wall, skipped_at, "{zone} {day} {time}");
                    } else {
                        assert_eq!(wall, time, "{zone} {day} {time}: on the wall clock");
                    }
                    if kind == "fall"
                        && let crate::zone::Resolution::Repeated { .. } = z.resolve(o.local).kind
                    {
                        // A repeated time: the first of its two instants (the later offset).
                        let second = o.instant()
                            + Duration::seconds(
                                i64::from(z.offset_at(o.instant()).local_minus_utc())
                                    - i64::from(
                                        z.offset_at(o.instant() + Duration::hours(3))
                                            .local_minus_utc(),
                                    ),
                            );
                        assert!(second > o.instant(), "{zone} {day} {time}");
                        assert_eq!(z.local_at(second).naive(), o.local.naive());
                    }
                }
            }
        }
    }

    #[test]
    fn the_next_occurrence_is_the_earliest_instant_even_past_a_gap() {
        // 02:30 and 03:30 daily: on the spring-forward day 02:30 resolves to 03:30 EDT, the
        // same instant as 03:30; the next after 03:00 EDT that day is that one instant, once.
        let s = series(
            "FREQ=DAILY;BYHOUR=2,3;BYMINUTE=30;UNTIL=20270320",
            "2027-01-01T02:30:00",
            "America/New_York",
        );
        let next = s.next_from(utc("2027-03-14T06:59:00Z")).unwrap();
        assert_eq!(next.local.to_string(), "2027-03-14T02:30:00");
        assert_eq!(next.instant(), utc("2027-03-14T07:30:00Z"));
        let after = s.next_from(next.instant() + Duration::seconds(1)).unwrap();
        assert_eq!(after.local.to_string(), "2027-03-15T02:30:00");
        // Nothing after the last.
        assert_eq!(s.next_from(utc("2027-03-21T12:00:00Z")), None);
        let counted = series("FREQ=DAILY;COUNT=2", "2027-01-01T08:00:00", "Europe/Berlin");
        assert_eq!(counted.next_from(utc("2027-01-02T08:00:00Z")), None);
        assert_eq!(
            counted
                .next_from(utc("2026-01-01T00:00:00Z"))
                .map(|o| o.local.to_string()),
            Some("2027-01-01T08:00:00".to_owned())
        );
    }

    #[test]
    fn weekly_and_monthly_rules_count_and_until() {
        let s = series(
            "RRULE:FREQ=WEEKLY;INTERVAL=2;BYDAY=MO,WE;COUNT=4",
            "2027-03-01T09:00:00",
            "Europe/Berlin",
        );
        let all: Vec<String> = s
            .between(utc("2027-01-01T00:00:00Z"), utc("2028-01-01T00:00:00Z"))
            .iter()
            .map(|o| o.local.to_string())
            .collect();
        assert_eq!(
            all,
            [
                "2027-03-01T09:00:00",
                "2027-03-03T09:00:00",
                "2027-03-15T09:00:00",
                "2027-03-17T09:00:00"
            ]
        );
        // UNTIL as a local date: the whole of that day, in the series' zone.
        let s = series(
            "FREQ=MONTHLY;BYMONTHDAY=31;UNTIL=20270731",
            "2027-01-31T18:00:00",
            "Europe/Berlin",
        );
        let months: Vec<String> = s
            .between(utc("2027-01-01T00:00:00Z"), utc("2028-01-01T00:00:00Z"))
            .iter()
            .map(|o| o.local.to_string())
            .collect();
        assert_eq!(
            months,
            [
                "2027-01-31T18:00:00",
                "2027-03-31T18:00:00",
                "2027-05-31T18:00:00",
                "2027-07-31T18:00:00"
            ]
        );
    }

    #[test]
    fn a_rule_that_never_ends_goes_too_far_or_too_often_is_refused_by_its_kind() {
        let z = Zone::parse("Europe/Berlin").unwrap();
        let start = local("2027-01-01T08:00:00");
        let refused = |rule: &str| Series::parse(rule, start, z, &limits()).unwrap_err();
        assert_eq!(refused("FREQ=DAILY"), SeriesError::NeverEnds);
        assert_eq!(refused("FREQ=DAILY;COUNT=400"), SeriesError::TooFarAhead);
        assert_eq!(
            refused("FREQ=DAILY;UNTIL=20300101T000000Z"),
            SeriesError::TooFarAhead
        );
        assert_eq!(
            refused("FREQ=DAILY;BYHOUR=0,1,2,3,4,5,6,7,8,9,10,11,12;BYMINUTE=0,30;COUNT=5"),
            SeriesError::TooManyPerDay
        );
        for rule in [
            "FREQ=HOURLY;COUNT=3",
            "FREQ=YEARLY;COUNT=3",
            "FREQ=DAILY;COUNT=3;UNTIL=20270301T000000Z",
            "FREQ=DAILY;COUNT=0",
            "FREQ=DAILY;INTERVAL=0;COUNT=3",
            "FREQ=DAILY;COUNT=3;BYSECOND=5",
            "FREQ=DAILY;COUNT=3;COUNT=4",
            "DTSTART:20270101T080000;FREQ=DAILY;COUNT=3",
            "FREQ=DAILY;UNTIL=20261201T000000Z",
            "FREQ=DAILY;UNTIL=2027-03-01",
            "FREQ=DAILY;BYHOUR=25;COUNT=3",
            "",
            "FREQ=DAILY;;COUNT=3",
        ] {
            assert_eq!(refused(rule), SeriesError::Rule, "{rule}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Windows cut anywhere give the occurrences one window over the whole range gives:
        /// a producer's windows create each occurrence once, whatever their size.
        #[test]
        fn windows_cut_anywhere_give_the_same_occurrences(
            zone in prop::sample::select(vec!["America/New_York", "Europe/London", "Australia/Lord_Howe", "America/Santiago"]),
            hour in 0u32..24,
            cuts in proptest::collection::vec(1i64..(40 * 24), 1..12),
        ) {
            let start = format!("2027-01-01T{hour:02}:30:00");
            let s = series("FREQ=DAILY;COUNT=365", &start, zone);
            let from = utc("2026-12-31T00:00:00Z");
            let to = utc("2028-01-02T00:00:00Z");
            let whole: Vec<_> = s.between(from, to).into_iter().map(|o| o.local).collect();
            prop_assert_eq!(whole.len(), 365);
            let mut edges: Vec<DateTime<Utc>> = cuts.iter().scan(from, |at, h| {
                *at += Duration::hours(*h * 10);
                Some(*at)
            }).filter(|at| *at < to).collect();
            edges.insert(0, from);
            edges.push(to);
            let pieces: Vec<_> = edges.windows(2)
                .flat_map(|w| s.between(w[0], w[1]))
                .map(|o| o.local)
                .collect();
            prop_assert_eq!(pieces, whole);
            // Where an expansion resumes: the first of what is left.
            for edge in &edges {
                prop_assert_eq!(
                    s.next_from(*edge).map(|o| o.local),
                    s.between(*edge, to).first().map(|o| o.local)
                );
            }
        }
    }
}
