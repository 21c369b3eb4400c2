//! Quiet hours: a daily stretch of the subscriber's wall-clock time (`21:00`-`08:00`) in which
//! nothing is sent on a channel. A delivery that falls due inside it waits for its end; one
//! whose expiry comes first expires with the reason `quiet_hours`. Nothing is dropped for it.
//!
//! A window is a pair of wall-clock times, `from` (inclusive) and `to` (exclusive); when `to`
//! is not after `from` it ends the next day. An instant is quiet when the subscriber's wall
//! clock then reads inside the window. On each local date the window is one span of instants,
//! from `from` on that date to `to` (that date or the next) in the subscriber's zone, with its
//! edges placed so that no quiet wall-clock time falls outside it: an edge the clocks jump over
//! (spring forward) is at the jump; a start that happens twice (fall back) is the earlier one,
//! an end that happens twice the later one, so the repeated hour is quiet both times. This is
//! not the `compatible` rule a reminder's local time follows ([`Zone::resolve`]): that rule
//! moves a time in a gap forward by the gap, which would leave the wall-clock times just after
//! a jump outside a window that covers them. A daylight-saving change inside a window makes it
//! an hour longer or shorter in instants, as it is on the wall clock. The host's zone never
//! enters into it.
//!
//! Nothing here reads a clock.

use std::fmt;

use chrono::{DateTime, Duration, NaiveTime, Timelike as _, Utc};

use chrono::TimeZone as _;

use crate::zone::Zone;

/// A daily quiet window in wall-clock time: from `from` (inclusive) to `to` (exclusive), ending
/// the next day when `to` is not after `from`. `from` and `to` differ.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuietHours {
    from: NaiveTime,
    to: NaiveTime,
}

/// Why a quiet window was refused. Never carries the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidQuietHours {
    #[error("is not a wall-clock time HH:MM or HH:MM:SS (e.g. 21:00)")]
    Time,
    #[error("starts and ends at the same time: give a window, or none")]
    Empty,
}

impl QuietHours {
    pub fn new(from: NaiveTime, to: NaiveTime) -> Result<Self, InvalidQuietHours> {
        let whole = |t: NaiveTime| t.nanosecond() == 0;
        if !whole(from) || !whole(to) {
            return Err(InvalidQuietHours::Time);
        }
        if from == to {
            return Err(InvalidQuietHours::Empty);
        }
        Ok(Self { from, to })
    }

    /// From two wall-clock times as text, `HH:MM` or `HH:MM:SS`.
    pub fn parse(from: &str, to: &str) -> Result<Self, InvalidQuietHours> {
        Self::new(parse_time(from)?, parse_time(to)?)
    }

    /// One wall-clock time as a window's edge takes it, `HH:MM` or `HH:MM:SS`.
    pub fn parse_time(text: &str) -> Result<NaiveTime, InvalidQuietHours> {
        parse_time(text)
    }

    pub fn from(&self) -> NaiveTime {
        self.from
    }

    pub fn to(&self) -> NaiveTime {
        self.to
    }

    /// The window that holds `instant` in `zone`, or else the next one to start after it, as
    /// instants: `start <= instant < end`, or `instant < start`.
    pub fn around(&self, zone: Zone, instant: DateTime<Utc>) -> QuietSpan {
        let date = zone.local_at(instant).naive().date();
        // The window that began the day before may still be running; windows never overlap
        // (each ends before the next day's starts), so the first that has not ended is it.
        let mut day = date - Duration::days(1);
        loop {
            // A window wholly inside a jump forward has no wall-clock time that day.
            if let Some(span) = self.on(zone, day).filter(|span| span.end > instant) {
                return span;
            }
            day += Duration::days(1);
        }
    }

    /// Whether `instant` is inside a window in `zone`; if so, when the quiet ends: the
    /// window's end, or the end of the next one when that starts right there (on the day the
    /// clocks jump over the free time between them, two windows touch).
    pub fn quiet_until(&self, zone: Zone, instant: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let span = self.around(zone, instant);
        span.contains(instant).then(|| self.joined_end(zone, span))
    }

    /// The end of `span`, or of the windows that start at its end, one after the other. A
    /// window lasts less than a day and the free time between two vanishes only inside a
    /// jump, so two steps reach free time; the bound only guards the loop.
    fn joined_end(&self, zone: Zone, span: QuietSpan) -> DateTime<Utc> {
        let mut end = span.end;
        for _ in 0..4 {
            let next = self.around(zone, end);
            if !next.contains(end) {
                break;
            }
            end = next.end;
        }
        end
    }

    /// The window that starts on local `date`.
    fn on(&self, zone: Zone, date: chrono::NaiveDate) -> Option<QuietSpan> {
        let end_date = if self.to > self.from {
            date
        } else {
            date + Duration::days(1)
        };
        let start = boundary(zone, date.and_time(self.from), Edge::Start);
        let end = boundary(zone, end_date.and_time(self.to), Edge::End);
        (end > start).then_some(QuietSpan { start, end })
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Edge {
    Start,
    End,
}

/// Where a window's edge at wall-clock `local` falls, so that every instant whose wall clock is
/// inside the window is inside the span: a start the clocks jump over begins at the jump (the
/// first instant whose wall clock is past it); an end they jump over ends there too; a start
/// that happens twice is the earlier, an end that happens twice the later (the repeated hour
/// is quiet both times it is lived).
fn boundary(zone: Zone, local: chrono::NaiveDateTime, edge: Edge) -> DateTime<Utc> {
    use chrono::LocalResult;
    match zone.tz().from_local_datetime(&local) {
        LocalResult::Single(at) => at.with_timezone(&Utc),
        LocalResult::Ambiguous(earlier, later) => match edge {
            Edge::Start => earlier.with_timezone(&Utc),
            Edge::End => later.with_timezone(&Utc),
        },
        LocalResult::None => {
            // In a gap: the jump lies between the wall time read with the offset after it (an
            // instant before the jump) and with the offset before it (one after). Find, to the
            // second, the first instant whose wall clock has passed `local`.
            let as_utc = local.and_utc();
            let before = zone.offset_at(as_utc - Duration::days(1)).local_minus_utc();
            let after = zone.offset_at(as_utc + Duration::days(1)).local_minus_utc();
            // Whole seconds: transitions fall on them, so the search ends on the jump itself.
            let mut lo = (local - Duration::seconds(i64::from(after)))
                .and_utc()
                .timestamp();
            let mut hi = (local - Duration::seconds(i64::from(before)))
                .and_utc()
                .timestamp();
            let wall =
                |secs: i64| DateTime::from_timestamp(secs, 0).map(|at| zone.local_at(at).naive());
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if wall(mid).is_some_and(|w| w >= local) {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            DateTime::from_timestamp(hi, 0).unwrap_or_else(|| local.and_utc())
        }
    }
}

impl fmt::Display for QuietHours {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", show(self.from), show(self.to))
    }
}

impl fmt::Debug for QuietHours {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "QuietHours({self})")
    }
}

/// `HH:MM`, or `HH:MM:SS` when the seconds are not zero.
fn show(t: NaiveTime) -> String {
    if t.second() == 0 {
        t.format("%H:%M").to_string()
    } else {
        t.format("%H:%M:%S").to_string()
    }
}

fn parse_time(text: &str) -> Result<NaiveTime, InvalidQuietHours> {
    let shaped = matches!(text.len(), 5 | 8)
        && text.bytes().enumerate().all(|(i, b)| {
            if i % 3 == 2 {
                b == b':'
            } else {
                b.is_ascii_digit()
            }
        });
    if !shaped {
        return Err(InvalidQuietHours::Time);
    }
    let format = if text.len() == 5 { "%H:%M" } else { "%H:%M:%S" };
    NaiveTime::parse_from_str(text, format).map_err(|_| InvalidQuietHours::Time)
}

/// One quiet window as instants: `start` inclusive, `end` exclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuietSpan {
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
}

impl QuietSpan {
    pub fn contains(&self, instant: DateTime<Utc>) -> bool {
        self.start <= instant && instant < self.end
    }
}

/// What quiet hours do to a delivery due at `now` that expires at `expires_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuietVerdict {
    /// Not inside a window: it may be sent, but not at or after `next_start` (the next
    /// window's start), which the fence checks with the database's clock.
    Send {
        next_start: DateTime<Utc>,
        next_end: DateTime<Utc>,
    },
    /// Inside a window that ends before its expiry: due again at `until`.
    Defer { until: DateTime<Utc> },
    /// Inside a window that outlasts its expiry: it expires, reason `quiet_hours`.
    Expire,
}

/// The rule for one delivery: deferred to the window's end, unless its expiry comes first.
pub fn quiet_verdict(
    hours: QuietHours,
    zone: Zone,
    now: DateTime<Utc>,
    expires_at: DateTime<Utc>,
) -> QuietVerdict {
    let span = hours.around(zone, now);
    if !span.contains(now) {
        return QuietVerdict::Send {
            next_start: span.start,
            next_end: hours.joined_end(zone, span),
        };
    }
    let end = hours.joined_end(zone, span);
    if expires_at <= end {
        QuietVerdict::Expire
    } else {
        QuietVerdict::Defer { until: end }
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone as _;
    use proptest::prelude::*;

    use super::*;

    fn zone(name: &str) -> Zone {
        Zone::parse(name).unwrap()
    }

    fn utc(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .unwrap()
            .with_timezone(&Utc)
    }

    fn hours(from: &str, to: &str) -> QuietHours {
        QuietHours::parse(from, to).unwrap()
    }

    #[test]
    fn a_window_is_two_wall_clock_times_that_differ() {
        assert_eq!(hours("21:00", "08:00").to_string(), "21:00-08:00");
        assert_eq!(hours("21:00:30", "08:00").to_string(), "21:00:30-08:00");
        for bad in [
            "9:00",
            "21:00:0",
            "24:00",
            "21:60",
            "21-00",
            "",
            "21:00Z",
            "２１:00",
        ] {
            assert_eq!(
                QuietHours::parse(bad, "08:00"),
                Err(InvalidQuietHours::Time),
                "{bad}"
            );
        }
        assert_eq!(
            QuietHours::parse("08:00", "08:00:00"),
            Err(InvalidQuietHours::Empty)
        );
    }

    /// Quiet hours 21:00-08:00 and 01:00-03:00 (inside the changes) on both change days in
    /// three zones, one with a 30-minute change. Each row: the zone, the window, an instant,
    /// and what it is: quiet until an instant, or free until the next window's start.
    #[test]
    fn the_dst_table() {
        struct Row {
            zone: &'static str,
            window: (&'static str, &'static str),
            at: &'static str,
            quiet_until: Option<&'static str>,
            next_start: Option<&'static str>,
        }
        let row = |zone, window, at, quiet_until, next_start| Row {
            zone,
            window,
            at,
            quiet_until,
            next_start,
        };
        let rows = [
            // New York: 2027-03-14 02:00 EST -> 03:00 EDT; 2027-11-07 02:00 EDT -> 01:00 EST.
            row(
                "America/New_York",
                ("21:00", "08:00"),
                "2027-03-14T06:59:59Z",
                Some("2027-03-14T12:00:00Z"),
                None,
            ),
            row(
                "America/New_York",
                ("21:00", "08:00"),
                "2027-03-14T12:00:00Z",
                None,
                Some("2027-03-15T01:00:00Z"),
            ),
            row(
                "America/New_York",
                ("01:00", "03:00"),
                "2027-03-14T06:30:00Z",
                Some("2027-03-14T07:00:00Z"),
                None,
            ),
            row(
                "America/New_York",
                ("02:30", "04:00"),
                "2027-03-14T06:59:00Z",
                None,
                Some("2027-03-14T07:00:00Z"),
            ),
            row(
                "America/New_York",
                ("02:30", "04:00"),
                "2027-03-14T07:00:00Z",
                Some("2027-03-14T08:00:00Z"),
                None,
            ),
            // A start in the gap that is not half-way into it: at the jump, to the second.
            row(
                "America/New_York",
                ("02:20", "04:00"),
                "2027-03-14T06:59:59Z",
                None,
                Some("2027-03-14T07:00:00Z"),
            ),
            row(
                "America/New_York",
                ("21:00", "08:00"),
                "2027-11-07T12:59:59Z",
                Some("2027-11-07T13:00:00Z"),
                None,
            ),
            row(
                "America/New_York",
                ("01:00", "03:00"),
                "2027-11-07T05:00:00Z",
                Some("2027-11-07T08:00:00Z"),
                None,
            ),
            row(
                "America/New_York",
                ("01:00", "03:00"),
                "2027-11-07T06:30:00Z",
                Some("2027-11-07T08:00:00Z"),
                None,
            ),
            row(
                "America/New_York",
                ("01:30", "02:00"),
                "2027-11-07T06:45:00Z",
                Some("2027-11-07T07:00:00Z"),
                None,
            ),
            // London: 2027-03-28 01:00 GMT -> 02:00 BST; 2027-10-31 02:00 BST -> 01:00 GMT.
            row(
                "Europe/London",
                ("21:00", "08:00"),
                "2027-03-28T06:59:59Z",
                Some("2027-03-28T07:00:00Z"),
                None,
            ),
            row(
                "Europe/London",
                ("00:30", "01:30"),
                "2027-03-28T00:45:00Z",
                Some("2027-03-28T01:00:00Z"),
                None,
            ),
            row(
                "Europe/London",
                ("21:00", "08:00"),
                "2027-10-31T07:59:59Z",
                Some("2027-10-31T08:00:00Z"),
                None,
            ),
            row(
                "Europe/London",
                ("21:00", "08:00"),
                "2027-10-30T19:59:59Z",
                None,
                Some("2027-10-30T20:00:00Z"),
            ),
            row(
                "Europe/London",
                ("01:00", "02:00"),
                "2027-10-31T01:30:00Z",
                Some("2027-10-31T02:00:00Z"),
                None,
            ),
            // Lord Howe: 2027-04-04 02:00 +11 -> 01:30 +10:30; 2027-10-03 02:00 +10:30 -> 02:30 +11.
            row(
                "Australia/Lord_Howe",
                ("21:00", "08:00"),
                "2027-04-03T21:29:59Z",
                Some("2027-04-03T21:30:00Z"),
                None,
            ),
            row(
                "Australia/Lord_Howe",
                ("01:30", "02:15"),
                "2027-04-03T14:40:00Z",
                Some("2027-04-03T15:45:00Z"),
                None,
            ),
            row(
                "Australia/Lord_Howe",
                ("02:00", "02:30"),
                "2027-10-02T15:20:00Z",
                None,
                Some("2027-10-03T15:00:00Z"),
            ),
            row(
                "Australia/Lord_Howe",
                ("02:00", "02:30"),
                "2027-10-02T15:30:00Z",
                None,
                Some("2027-10-03T15:00:00Z"),
            ),
            row(
                "Australia/Lord_Howe",
                ("21:00", "08:00"),
                "2027-10-02T20:59:59Z",
                Some("2027-10-02T21:00:00Z"),
                None,
            ),
        ];
        println!(
            "zone                 window        at (UTC)              local at              verdict"
        );
        for r in rows {
            let z = zone(r.zone);
            let h = hours(r.window.0, r.window.1);
            let at = utc(r.at);
            let span = h.around(z, at);
            let quiet = h.quiet_until(z, at);
            let verdict = match quiet {
                Some(until) => {
                    format!("quiet until {} ({})", until.to_rfc3339(), z.local_at(until))
                }
                None => format!(
                    "free until {} ({})",
                    span.start.to_rfc3339(),
                    z.local_at(span.start)
                ),
            };
            println!(
                "{:20} {:13} {:21} {:21} {verdict}",
                r.zone,
                h.to_string(),
                r.at,
                z.local_at(at).to_string()
            );
            assert_eq!(
                quiet,
                r.quiet_until.map(utc),
                "{} {} at {}",
                r.zone,
                h,
                r.at
            );
            if let Some(next) = r.next_start {
                assert_eq!(span.start, utc(next), "{} {} at {}", r.zone, h, r.at);
            }
        }
    }

    /// 02:11:50 to 02:00 in Berlin leaves 02:00 to 02:11:50 free, a time the clocks jump
    /// over on 28 March 2027: that day the night's window ends where the next begins, and a
    /// delivery deferred then waits for the end of the next one (found by the property below).
    #[test]
    fn windows_that_touch_on_a_jump_forward_defer_past_both() {
        let h = hours("02:11:50", "02:00");
        let z = zone("Europe/Berlin");
        // 02:11:50 CET on the 27th, the window's start.
        let due = Utc.timestamp_opt(1_806_109_910, 0).unwrap();
        // Expiring a second after the jump (03:00:01 CEST on the 28th): still quiet, so it
        // expires rather than waking at the jump, inside the next window.
        let expires = due + Duration::seconds(85_691);
        assert_eq!(quiet_verdict(h, z, due, expires), QuietVerdict::Expire);
        // Living longer, it waits for the end of both: 02:00 CEST on the 29th.
        let QuietVerdict::Defer { until } = quiet_verdict(h, z, due, due + Duration::days(3))
        else {
            panic!("deferred, not expired or sent");
        };
        assert_eq!(until, utc("2027-03-29T00:00:00Z"));
        assert_eq!(h.quiet_until(z, until), None, "{until} is free");
        assert_eq!(h.quiet_until(z, due), Some(until));
    }

    #[test]
    fn expiry_inside_the_window_expires_and_after_it_defers() {
        let (z, h) = (zone("Europe/Berlin"), hours("21:00", "08:00"));
        let now = utc("2027-06-01T20:00:00Z"); // 22:00 in Berlin
        let end = utc("2027-06-02T06:00:00Z");
        assert_eq!(quiet_verdict(h, z, now, end), QuietVerdict::Expire);
        assert_eq!(
            quiet_verdict(h, z, now, end + Duration::seconds(1)),
            QuietVerdict::Defer { until: end }
        );
        assert_eq!(
            quiet_verdict(h, z, utc("2027-06-01T18:59:59Z"), end),
            QuietVerdict::Send {
                next_start: utc("2027-06-01T19:00:00Z"),
                next_end: end
            }
        );
    }

    const ZONES: &[&str] = &[
        "America/New_York",
        "Europe/London",
        "Australia/Lord_Howe",
        "Europe/Berlin",
        "Asia/Kolkata",
        "America/Santiago",
        "Pacific/Chatham",
        "UTC",
    ];

    fn any_hours() -> impl Strategy<Value = QuietHours> {
        (0u32..86_400, 1u32..86_400).prop_map(|(from, len)| {
            let from_t = NaiveTime::from_num_seconds_from_midnight_opt(from, 0).unwrap();
            let to_t =
                NaiveTime::from_num_seconds_from_midnight_opt((from + len) % 86_400, 0).unwrap();
            QuietHours::new(from_t, to_t).unwrap()
        })
    }

    /// Instants in 2026-2028, half of them within a day of a transition of the zone.
    fn any_instant() -> impl Strategy<Value = i64> {
        prop_oneof![
            1_767_225_600i64..1_861_920_000,
            // Near the March and October/November and April changes of 2027.
            prop::sample::select(vec![
                1_805_000_000i64,
                1_805_500_000,
                1_806_400_000,
                1_806_900_000,
                1_822_400_000,
                1_822_900_000,
                1_825_400_000,
                1_825_900_000,
                1_817_600_000,
                1_817_900_000
            ])
            .prop_flat_map(|c| (c - 172_800)..(c + 172_800)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// For any zone, window, due time, retries and expiry: a delivery sent at the first
        /// instant the rule allows is never inside a window, and one the rule defers is due
        /// again at an instant that is not quiet, or it expires; nothing is dropped.
        #[test]
        fn no_send_falls_inside_a_window_and_no_deferred_delivery_is_lost(
            z in prop::sample::select(ZONES),
            h in any_hours(),
            due in any_instant(),
            retries in proptest::collection::vec(1i64..200_000, 0..4),
            lifetime in 1i64..(3 * 86_400),
        ) {
            let z = zone(z);
            let mut at = Utc.timestamp_opt(due, 0).unwrap();
            let expires = at + Duration::seconds(lifetime);
            let mut steps = 0;
            let mut retries = retries.into_iter();
            loop {
                steps += 1;
                prop_assert!(steps < 10, "a delivery went round {} times", steps);
                match quiet_verdict(h, z, at, expires) {
                    QuietVerdict::Send { next_start, next_end } => {
                        prop_assert!(next_start > at);
                        prop_assert!(next_end > next_start);
                        prop_assert!(h.quiet_until(z, at).is_none());
                        // Sampled instants between now and the next start are free.
                        for k in 1..8 {
                            let mid = at + (next_start - at) * k / 8;
                            prop_assert!(h.quiet_until(z, mid).is_none(), "{} quiet at {}", h, mid);
                        }
                        // A retry goes round again, later.
                        match retries.next() {
                            Some(after) if at + Duration::seconds(after) < expires => {
                                at += Duration::seconds(after);
                            }
                            _ => break,
                        }
                    }
                    QuietVerdict::Defer { until } => {
                        prop_assert!(until > at && until < expires);
                        prop_assert!(h.quiet_until(z, until).is_none(), "{} deferred into a window", h);
                        at = until;
                    }
                    QuietVerdict::Expire => {
                        let end = h.quiet_until(z, at).unwrap();
                        prop_assert!(expires <= end);
                        break;
                    }
                }
            }
        }

        /// Everywhere, transitions included: an instant whose wall clock reads inside the window
        /// is quiet, and a quiet instant's wall clock reads inside it, but for the repeated
        /// hour of a fall back, which may be quiet both times it is lived.
        #[test]
        fn every_wall_clock_time_inside_the_window_is_quiet(
            z in prop::sample::select(ZONES),
            h in any_hours(),
            at in any_instant(),
        ) {
            let z = zone(z);
            let at = Utc.timestamp_opt(at, 0).unwrap();
            let t = z.local_at(at).naive().time();
            let inside = if h.from() < h.to() {
                h.from() <= t && t < h.to()
            } else {
                t >= h.from() || t < h.to()
            };
            let quiet = h.quiet_until(z, at).is_some();
            if inside {
                prop_assert!(quiet, "{} at {} ({}) is not quiet", h, at, t);
            } else if quiet {
                // Only next to a change of offset (the repeated hour, at most 3 hours away).
                let repeated = [-3i64, 3]
                    .iter()
                    .any(|d| z.offset_at(at + Duration::hours(*d)) != z.offset_at(at));
                prop_assert!(repeated, "{} at {} ({}) is quiet outside the window", h, at, t);
            }
        }

        /// Away from a zone's transitions, "quiet" is exactly the wall clock inside the window.
        #[test]
        fn quiet_is_the_wall_clock_inside_the_window(
            z in prop::sample::select(ZONES),
            h in any_hours(),
            at in 1_767_225_600i64..1_861_920_000,
        ) {
            let z = zone(z);
            let at = Utc.timestamp_opt(at, 0).unwrap();
            let steady = [-2i64, -1, 1, 2].iter().all(|d| z.offset_at(at + Duration::days(*d)) == z.offset_at(at));
            prop_assume!(steady);
            let t = z.local_at(at).naive().time();
            let inside = if h.from() < h.to() {
                h.from() <= t && t < h.to()
            } else {
                t >= h.from() || t < h.to()
            };
            prop_assert_eq!(h.quiet_until(z, at).is_some(), inside);
        }
    }
}
