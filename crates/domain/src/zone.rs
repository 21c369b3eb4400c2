//! The patient's time: an IANA time zone ([`Zone`]), a wall-clock time without an offset
//! ([`LocalTime`]), how a local time becomes one instant in a zone ([`Zone::resolve`]), and a
//! reminder's times as the client gave them ([`ReminderTimes`]: an instant or a local time,
//! an expiry instant or a duration), resolved against the reminder's own zone, else the
//! subscriber's, else the tenant's.
//!
//! Zones come from the IANA database compiled into `chrono-tz` (its version:
//! [`TZDB_VERSION`]): the host's `/usr/share/zoneinfo` and `TZ` never decide a time, and an
//! unknown name is refused, never taken as UTC. A local time that does not exist (the clocks
//! jump forward over it) resolves forward by the gap; one that happens twice (the clocks go
//! back over it) resolves to the earlier instant: Temporal's `compatible` disambiguation.
//! Nothing here reads a clock.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Duration, FixedOffset, NaiveDateTime, Offset, TimeZone as _, Utc};
use chrono_tz::Tz;

/// The version of the IANA time-zone database compiled in (for example `2025b`).
pub const TZDB_VERSION: &str = chrono_tz::IANA_TZDB_VERSION;

/// The longest zone name accepted (the longest IANA name is 32 bytes).
const MAX_ZONE_NAME_BYTES: usize = 64;

/// An IANA time zone known to the compiled-in database (`Europe/Berlin`,
/// `America/New_York`, `UTC`). Names are matched exactly, case included.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Zone(Tz);

/// A zone name the compiled-in database does not know. Never carries the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("is not an IANA time zone name known to tz database {TZDB_VERSION} (e.g. Europe/Berlin)")]
pub struct UnknownZone;

impl Zone {
    /// The zone named `name` in the compiled-in database.
    pub fn parse(name: &str) -> Result<Self, UnknownZone> {
        if name.is_empty() || name.len() > MAX_ZONE_NAME_BYTES {
            return Err(UnknownZone);
        }
        Tz::from_str(name).map(Self).map_err(|_| UnknownZone)
    }

    /// The zone of the compiled-in database.
    pub(crate) fn tz(&self) -> Tz {
        self.0
    }

    /// The zone's IANA name, as the database spells it.
    pub fn name(&self) -> &'static str {
        self.0.name()
    }

    /// The zone's offset from UTC at `instant`.
    pub fn offset_at(&self, instant: DateTime<Utc>) -> FixedOffset {
        self.0.offset_from_utc_datetime(&instant.naive_utc()).fix()
    }

    /// The wall-clock time in this zone at `instant`.
    pub fn local_at(&self, instant: DateTime<Utc>) -> LocalTime {
        LocalTime(instant.with_timezone(&self.0).naive_local())
    }

    /// The instant `local` names in this zone, by the `compatible` rule: a local time in a
    /// gap (the clocks jumped over it) is read with the offset before the jump, which lands
    /// as far after the jump as it was after the gap's start; a local time that happens
    /// twice is the earlier one.
    pub fn resolve(&self, local: LocalTime) -> Resolved {
        use chrono::LocalResult;
        match self.0.from_local_datetime(&local.0) {
            LocalResult::Single(at) => Resolved {
                instant: at.with_timezone(&Utc),
                offset: at.offset().fix(),
                kind: Resolution::Exact,
            },
            LocalResult::Ambiguous(earlier, later) => Resolved {
                instant: earlier.with_timezone(&Utc),
                offset: earlier.offset().fix(),
                kind: Resolution::Repeated {
                    later_offset: later.offset().fix(),
                },
            },
            LocalResult::None => {
                // Temporal's GetPossibleInstantsFor / DisambiguatePossibleInstants: the
                // offsets a day either side of the wall time read as UTC bracket the jump.
                let as_utc = local.0.and_utc();
                let before = self.offset_at(as_utc - Duration::days(1));
                let after = self.offset_at(as_utc + Duration::days(1));
                let instant =
                    (local.0 - Duration::seconds(i64::from(before.local_minus_utc()))).and_utc();
                let skipped = Duration::seconds(i64::from(
                    after.local_minus_utc() - before.local_minus_utc(),
                ));
                Resolved {
                    instant,
                    offset: self.offset_at(instant),
                    kind: Resolution::Skipped { gap: skipped },
                }
            }
        }
    }
}

impl fmt::Display for Zone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Debug for Zone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Zone({})", self.name())
    }
}

impl FromStr for Zone {
    type Err = UnknownZone;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// A wall-clock date and time without an offset, `YYYY-MM-DDTHH:MM:SS` (seconds optional, no
/// fraction), in years 1970 to 9999.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LocalTime(NaiveDateTime);

/// A local time that is not `YYYY-MM-DDTHH:MM[:SS]` naming a real calendar date and time
/// in years 1970 to 9999, without an offset. Never carries the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "is not a local date and time YYYY-MM-DDTHH:MM:SS without an offset, in years 1970 to 9999 \
     (e.g. 2027-03-14T02:30:00)"
)]
pub struct InvalidLocalTime;

impl LocalTime {
    pub fn parse(text: &str) -> Result<Self, InvalidLocalTime> {
        // The shortest and longest accepted forms; anything else (an offset, a fraction) is
        // refused before chrono reads it.
        // Exactly the padded forms the API documents (`YYYY-MM-DDTHH:MM` or `...:SS`): chrono
        // alone would also take unpadded fields.
        let padded = |form: &str| {
            text.len() == form.len()
                && text.bytes().zip(form.bytes()).all(|(c, f)| {
                    if f == b'9' {
                        c.is_ascii_digit()
                    } else {
                        c == f
                    }
                })
        };
        if !padded("9999-99-99T99:99") && !padded("9999-99-99T99:99:99") {
            return Err(InvalidLocalTime);
        }
        let naive = NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M:%S")
            .or_else(|_| NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M"))
            .map_err(|_| InvalidLocalTime)?;
        Self::new(naive)
    }

    /// `naive` as a local time, when its year is 1970 to 9999.
    pub fn new(naive: NaiveDateTime) -> Result<Self, InvalidLocalTime> {
        use chrono::{Datelike, Timelike};
        // chrono's leap second (second 60) is no wall-clock time a zone can resolve.
        if !(1970..=9999).contains(&naive.year()) || naive.nanosecond() >= 1_000_000_000 {
            return Err(InvalidLocalTime);
        }
        Ok(Self(naive))
    }

    pub fn naive(&self) -> NaiveDateTime {
        self.0
    }
}

impl fmt::Display for LocalTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.format("%Y-%m-%dT%H:%M:%S"))
    }
}

impl fmt::Debug for LocalTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LocalTime({self})")
    }
}

/// How a local time met its zone's transitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// It happens once.
    Exact,
    /// It does not exist: the clocks jumped forward by `gap` over it, and it was moved forward
    /// by as much.
    Skipped { gap: Duration },
    /// It happens twice: the earlier instant was taken; the later one has `later_offset`.
    Repeated { later_offset: FixedOffset },
}

/// A local time resolved in a zone: the instant, and the zone's offset at that instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    pub instant: DateTime<Utc>,
    pub offset: FixedOffset,
    pub kind: Resolution,
}

/// The longest `expires_after_s`: 366 days.
pub const MAX_EXPIRES_AFTER_S: u32 = 366 * 24 * 3600;

/// How long after its scheduled instant a reminder expires: 1 second to
/// [`MAX_EXPIRES_AFTER_S`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ExpiresAfter(u32);

/// An `expires_after_s` outside 1 to [`MAX_EXPIRES_AFTER_S`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("must be an integer number of seconds from 1 to {MAX_EXPIRES_AFTER_S} (366 days)")]
pub struct InvalidExpiresAfter;

impl ExpiresAfter {
    pub fn from_secs(secs: u64) -> Result<Self, InvalidExpiresAfter> {
        u32::try_from(secs)
            .ok()
            .filter(|s| (1..=MAX_EXPIRES_AFTER_S).contains(s))
            .map(Self)
            .ok_or(InvalidExpiresAfter)
    }

    pub fn secs(&self) -> u32 {
        self.0
    }

    pub fn duration(&self) -> Duration {
        Duration::seconds(i64::from(self.0))
    }
}

/// When a reminder is to be sent, as given: an instant, or a local time in a zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendTime {
    At(DateTime<Utc>),
    Local(LocalTime),
}

/// When a reminder expires, as given: an instant, or a duration after its send time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    At(DateTime<Utc>),
    After(ExpiresAfter),
}

/// Whose zone a local time was read in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZoneSource {
    /// The reminder's own `time_zone`.
    Reminder,
    /// The subscriber's stored zone.
    Subscriber,
    /// The tenant's default zone.
    Tenant,
}

impl ZoneSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reminder => "reminder",
            Self::Subscriber => "subscriber",
            Self::Tenant => "tenant",
        }
    }
}

/// A reminder's send time, expiry and zone as the client gave them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReminderTimes {
    pub send: SendTime,
    pub expiry: Expiry,
    /// The reminder's own zone (also the subscriber's from then on).
    pub zone: Option<Zone>,
}

/// A reminder's times resolved to instants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedTimes {
    pub scheduled_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// How a local send time was read, and in whose zone; `None` for an instant.
    pub local: Option<(Zone, ZoneSource, Resolved)>,
}

/// Why a reminder's times cannot be resolved. Each names the field at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TimeError {
    /// A local send time, and no zone: not the reminder's, the subscriber's nor the tenant's.
    #[error(
        "time_zone is required with scheduled_local: neither the subscriber nor the tenant \
         has a time zone"
    )]
    NoZone,
    #[error("expires_at must be after scheduled_at")]
    ExpiresNotAfterScheduled,
    /// The expiry, a duration after the send time, is past what an instant can hold.
    #[error("expires_after_s puts the expiry out of range")]
    ExpiryOutOfRange,
}

impl TimeError {
    /// The field at fault.
    pub fn field(&self) -> &'static str {
        match self {
            Self::NoZone => "time_zone",
            Self::ExpiresNotAfterScheduled => "expires_at",
            Self::ExpiryOutOfRange => "expires_after_s",
        }
    }
}

impl ReminderTimes {
    /// Whether resolving needs a zone the reminder does not give (the subscriber's, else the
    /// tenant's): a local send time without `time_zone`.
    pub fn needs_zone(&self) -> bool {
        matches!(self.send, SendTime::Local(_)) && self.zone.is_none()
    }

    /// The instants these times name: a local send time is read in the reminder's zone, else
    /// `subscriber`'s, else `tenant`'s; an expiry duration counts from the send instant.
    pub fn resolve(
        &self,
        subscriber: Option<Zone>,
        tenant: Option<Zone>,
    ) -> Result<ResolvedTimes, TimeError> {
        let (scheduled_at, local) = match self.send {
            SendTime::At(at) => (at, None),
            SendTime::Local(local) => {
                let (zone, source) = self
                    .zone
                    .map(|z| (z, ZoneSource::Reminder))
                    .or(subscriber.map(|z| (z, ZoneSource::Subscriber)))
                    .or(tenant.map(|z| (z, ZoneSource::Tenant)))
                    .ok_or(TimeError::NoZone)?;
                let resolved = zone.resolve(local);
                (resolved.instant, Some((zone, source, resolved)))
            }
        };
        let expires_at = match self.expiry {
            Expiry::At(at) => at,
            Expiry::After(after) => scheduled_at
                .checked_add_signed(after.duration())
                .ok_or(TimeError::ExpiryOutOfRange)?,
        };
        if expires_at <= scheduled_at {
            return Err(TimeError::ExpiresNotAfterScheduled);
        }
        Ok(ResolvedTimes {
            scheduled_at,
            expires_at,
            local,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::print_stdout)]
mod tests {
    use super::*;

    fn zone(name: &str) -> Zone {
        Zone::parse(name).unwrap()
    }

    fn local(text: &str) -> LocalTime {
        LocalTime::parse(text).unwrap()
    }

    fn utc(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .unwrap()
            .with_timezone(&Utc)
    }

    #[test]
    fn a_leap_second_or_an_unpadded_field_is_not_a_local_time() {
        for bad in [
            "2027-06-30T23:59:60",
            "2027-3-14T02:30:00",
            "2027-03-14T2:30",
            "2027-03-14 02:30:00",
            "2027-03-14T02:30:00Z",
        ] {
            assert_eq!(LocalTime::parse(bad), Err(InvalidLocalTime), "{bad}");
        }
        assert!(LocalTime::parse("2027-03-14T02:30").is_ok());
        assert!(LocalTime::parse("2027-03-14T02:30:59").is_ok());
    }

    #[test]
    fn a_zone_is_an_exact_iana_name_and_nothing_else() {
        assert_eq!(zone("Europe/Berlin").name(), "Europe/Berlin");
        assert_eq!(zone("UTC").name(), "UTC");
        for bad in [
            "",
            "europe/berlin",
            "Europe/Atlantis",
            "CEST",
            "+01:00",
            "Local",
            " Europe/Berlin",
            "Europe/Berlin\n",
            &"A".repeat(65),
        ] {
            assert_eq!(Zone::parse(bad), Err(UnknownZone), "{bad:?}");
        }
        assert!(!UnknownZone.to_string().contains("Atlantis"));
    }

    #[test]
    fn the_compiled_in_database_names_its_version() {
        assert_eq!(TZDB_VERSION.len(), 5, "{TZDB_VERSION}");
        assert!(TZDB_VERSION.starts_with("20"), "{TZDB_VERSION}");
    }

    #[test]
    fn a_local_time_has_no_offset_and_names_a_real_date() {
        assert_eq!(
            local("2027-03-14T02:30:00").to_string(),
            "2027-03-14T02:30:00"
        );
        assert_eq!(local("2027-03-14T02:30").to_string(), "2027-03-14T02:30:00");
        for bad in [
            "2027-03-14T02:30:00Z",
            "2027-03-14T02:30:00+01:00",
            "2027-03-14T02:30:00.5",
            "2027-02-30T02:30:00",
            "2027-03-14T24:00:00",
            "2027-03-14 02:30:00",
            "1969-12-31T23:59:59",
            "2027-03-14",
            "",
        ] {
            assert_eq!(LocalTime::parse(bad), Err(InvalidLocalTime), "{bad:?}");
        }
    }

    #[test]
    fn expires_after_is_one_second_to_366_days() {
        assert!(ExpiresAfter::from_secs(0).is_err());
        assert_eq!(ExpiresAfter::from_secs(1).unwrap().secs(), 1);
        assert!(ExpiresAfter::from_secs(u64::from(MAX_EXPIRES_AFTER_S)).is_ok());
        assert!(ExpiresAfter::from_secs(u64::from(MAX_EXPIRES_AFTER_S) + 1).is_err());
        assert!(ExpiresAfter::from_secs(u64::MAX).is_err());
    }

    /// One row of the daylight-saving table: a local time in a zone and what it must resolve
    /// to.
    struct Row {
        zone: &'static str,
        local: &'static str,
        utc: &'static str,
        offset: &'static str,
        kind: &'static str,
    }

    const fn row(
        zone: &'static str,
        local: &'static str,
        utc: &'static str,
        offset: &'static str,
        kind: &'static str,
    ) -> Row {
        Row {
            zone,
            local,
            utc,
            offset,
            kind,
        }
    }

    /// Both change days of 2027 in three zones: New York and London move by an hour, Lord
    /// Howe by 30 minutes. Before, inside and after each gap and overlap.
    #[rustfmt::skip]
    const TABLE: &[Row] = &[
        // America/New_York: 2027-03-14 02:00 EST -> 03:00 EDT; 2027-11-07 02:00 EDT -> 01:00 EST.
        row("America/New_York", "2027-03-14T01:59:59", "2027-03-14T06:59:59Z", "-05:00", "exact"),
        row("America/New_York", "2027-03-14T02:00:00", "2027-03-14T07:00:00Z", "-04:00", "gap +60m"),
        row("America/New_York", "2027-03-14T02:30:00", "2027-03-14T07:30:00Z", "-04:00", "gap +60m"),
        row("America/New_York", "2027-03-14T03:00:00", "2027-03-14T07:00:00Z", "-04:00", "exact"),
        row("America/New_York", "2027-11-07T00:59:59", "2027-11-07T04:59:59Z", "-04:00", "exact"),
        row("America/New_York", "2027-11-07T01:00:00", "2027-11-07T05:00:00Z", "-04:00", "earlier of two"),
        row("America/New_York", "2027-11-07T01:30:00", "2027-11-07T05:30:00Z", "-04:00", "earlier of two"),
        row("America/New_York", "2027-11-07T02:00:00", "2027-11-07T07:00:00Z", "-05:00", "exact"),
        // Europe/London: 2027-03-28 01:00 GMT -> 02:00 BST; 2027-10-31 02:00 BST -> 01:00 GMT.
        row("Europe/London", "2027-03-28T00:59:59", "2027-03-28T00:59:59Z", "+00:00", "exact"),
        row("Europe/London", "2027-03-28T01:00:00", "2027-03-28T01:00:00Z", "+01:00", "gap +60m"),
        row("Europe/London", "2027-03-28T01:30:00", "2027-03-28T01:30:00Z", "+01:00", "gap +60m"),
        row("Europe/London", "2027-03-28T02:00:00", "2027-03-28T01:00:00Z", "+01:00", "exact"),
        row("Europe/London", "2027-10-31T00:59:59", "2027-10-30T23:59:59Z", "+01:00", "exact"),
        row("Europe/London", "2027-10-31T01:00:00", "2027-10-31T00:00:00Z", "+01:00", "earlier of two"),
        row("Europe/London", "2027-10-31T01:30:00", "2027-10-31T00:30:00Z", "+01:00", "earlier of two"),
        row("Europe/London", "2027-10-31T02:00:00", "2027-10-31T02:00:00Z", "+00:00", "exact"),
        // Australia/Lord_Howe: 2027-04-04 02:00 +11 -> 01:30 +10:30; 2027-10-03 02:00 +10:30
        // -> 02:30 +11.
        row("Australia/Lord_Howe", "2027-04-04T01:29:59", "2027-04-03T14:29:59Z", "+11:00", "exact"),
        row("Australia/Lord_Howe", "2027-04-04T01:30:00", "2027-04-03T14:30:00Z", "+11:00", "earlier of two"),
        row("Australia/Lord_Howe", "2027-04-04T01:45:00", "2027-04-03T14:45:00Z", "+11:00", "earlier of two"),
        row("Australia/Lord_Howe", "2027-04-04T02:00:00", "2027-04-03T15:30:00Z", "+10:30", "exact"),
        row("Australia/Lord_Howe", "2027-10-03T01:59:59", "2027-10-02T15:29:59Z", "+10:30", "exact"),
        row("Australia/Lord_Howe", "2027-10-03T02:00:00", "2027-10-02T15:30:00Z", "+11:00", "gap +30m"),
        row("Australia/Lord_Howe", "2027-10-03T02:15:00", "2027-10-02T15:45:00Z", "+11:00", "gap +30m"),
        row("Australia/Lord_Howe", "2027-10-03T02:30:00", "2027-10-02T15:30:00Z", "+11:00", "exact"),
    ];

    fn kind(resolved: &Resolved) -> String {
        match resolved.kind {
            Resolution::Exact => "exact".to_owned(),
            Resolution::Skipped { gap } => format!("gap +{}m", gap.num_minutes()),
            Resolution::Repeated { .. } => "earlier of two".to_owned(),
        }
    }

    #[test]
    fn local_times_on_both_change_days_resolve_by_the_compatible_rule() {
        println!(
            "{:<21} {:<22} {:<22} {:<7} {:<21} {}",
            "local time", "zone", "resolved (UTC)", "offset", "wall clock then", "how"
        );
        let mut wrong = Vec::new();
        for r in TABLE {
            let resolved = zone(r.zone).resolve(local(r.local));
            let at = resolved.instant.format("%Y-%m-%dT%H:%M:%SZ").to_string();
            let offset = resolved.offset.to_string();
            let how = kind(&resolved);
            let wall = zone(r.zone).local_at(resolved.instant);
            println!(
                "{:<21} {:<22} {:<22} {:<7} {:<21} {}",
                r.local,
                r.zone,
                at,
                offset,
                wall.to_string(),
                how
            );
            if at != r.utc || offset != r.offset || how != r.kind {
                wrong.push(format!(
                    "{} {}: got {at} {offset} {how}, want {} {} {}",
                    r.local, r.zone, r.utc, r.offset, r.kind
                ));
            }
        }
        assert!(wrong.is_empty(), "{wrong:#?}");
    }

    #[test]
    fn a_local_time_is_read_in_the_reminders_zone_then_the_subscribers_then_the_tenants() {
        let times = |zone| ReminderTimes {
            send: SendTime::Local(local("2027-03-14T02:30:00")),
            expiry: Expiry::After(ExpiresAfter::from_secs(3600).unwrap()),
            zone,
        };
        let ny = zone("America/New_York");
        let london = zone("Europe/London");
        let berlin = zone("Europe/Berlin");
        let own = times(Some(ny)).resolve(Some(london), Some(berlin)).unwrap();
        assert_eq!(own.scheduled_at, utc("2027-03-14T07:30:00Z"));
        assert_eq!(own.expires_at, utc("2027-03-14T08:30:00Z"));
        assert_eq!(own.local.unwrap().1, ZoneSource::Reminder);
        let subscriber = times(None).resolve(Some(london), Some(berlin)).unwrap();
        assert_eq!(subscriber.scheduled_at, utc("2027-03-14T02:30:00Z"));
        assert_eq!(subscriber.local.unwrap().1, ZoneSource::Subscriber);
        let tenant = times(None).resolve(None, Some(berlin)).unwrap();
        assert_eq!(tenant.scheduled_at, utc("2027-03-14T01:30:00Z"));
        assert_eq!(tenant.local.unwrap().0, berlin);
        assert_eq!(times(None).resolve(None, None), Err(TimeError::NoZone));
        assert_eq!(TimeError::NoZone.field(), "time_zone");
    }

    #[test]
    fn an_instant_needs_no_zone_and_an_expiry_must_follow_it() {
        let at = utc("2027-03-14T07:30:00Z");
        let times = ReminderTimes {
            send: SendTime::At(at),
            expiry: Expiry::At(at),
            zone: None,
        };
        assert!(!times.needs_zone());
        assert_eq!(
            times.resolve(None, None),
            Err(TimeError::ExpiresNotAfterScheduled)
        );
        let after = ReminderTimes {
            expiry: Expiry::After(ExpiresAfter::from_secs(90).unwrap()),
            ..times
        }
        .resolve(None, None)
        .unwrap();
        assert_eq!(after.expires_at, utc("2027-03-14T07:31:30Z"));
        assert_eq!(after.local, None);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn any_zone() -> impl Strategy<Value = Zone> {
            (0..chrono_tz::TZ_VARIANTS.len()).prop_map(|i| Zone(chrono_tz::TZ_VARIANTS[i]))
        }

        fn any_local() -> impl Strategy<Value = LocalTime> {
            // 1970 to 2100, to the second.
            (0i64..4_102_444_800).prop_map(|s| {
                LocalTime::new(DateTime::from_timestamp(s, 0).unwrap().naive_utc()).unwrap()
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Every local time resolves to one instant that reads back as that local time,
            /// or, in a gap, as that local time moved forward by the gap.
            #[test]
            fn a_resolved_instant_reads_back_as_its_local_time(zone in any_zone(), local in any_local()) {
                let resolved = zone.resolve(local);
                let back = zone.local_at(resolved.instant).naive();
                prop_assert_eq!(zone.offset_at(resolved.instant), resolved.offset);
                match resolved.kind {
                    Resolution::Exact | Resolution::Repeated { .. } => prop_assert_eq!(back, local.naive()),
                    Resolution::Skipped { gap } => {
                        prop_assert!(gap > Duration::zero() && gap <= Duration::hours(48));
                        prop_assert_eq!(back, local.naive() + gap);
                    }
                }
            }

            /// A repeated local time is the earlier of its instants: the later one reads back
            /// as the same local time, and is after it.
            #[test]
            fn a_repeated_local_time_is_the_earlier_instant(zone in any_zone(), local in any_local()) {
                let resolved = zone.resolve(local);
                if let Resolution::Repeated { later_offset } = resolved.kind {
                    let later = (local.naive() - Duration::seconds(i64::from(later_offset.local_minus_utc()))).and_utc();
                    prop_assert!(later > resolved.instant);
                    prop_assert_eq!(zone.local_at(later).naive(), local.naive());
                }
            }

            /// The zone's name parses back to the same zone.
            #[test]
            fn a_zone_name_parses_back(zone in any_zone()) {
                prop_assert_eq!(Zone::parse(zone.name()), Ok(zone));
            }
        }
    }
}
