//! Age bands for operator reports: how old a row is, counted from a time column the report
//! chooses (a reminder's `scheduled_at` for the dead-letter listing and the redrive plan,
//! `settled_at` for retention).
//!
//! The dead-letter listing and the redrive plan both group by these bands, so an operator
//! reading one can pass the other's `--max-age` with the same meaning. The bands are computed
//! in SQL ([`age_band_sql`]) so counting never fetches rows.

use std::fmt;

/// How long ago a reminder was scheduled.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum AgeBand {
    #[serde(rename = "<1h")]
    UnderHour,
    #[serde(rename = "1h-6h")]
    HoursOneToSix,
    #[serde(rename = "6h-24h")]
    HoursSixToDay,
    #[serde(rename = "1d-7d")]
    DaysOneToSeven,
    #[serde(rename = ">7d")]
    OverWeek,
}

impl AgeBand {
    pub const ALL: [AgeBand; 5] = [
        AgeBand::UnderHour,
        AgeBand::HoursOneToSix,
        AgeBand::HoursSixToDay,
        AgeBand::DaysOneToSeven,
        AgeBand::OverWeek,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AgeBand::UnderHour => "<1h",
            AgeBand::HoursOneToSix => "1h-6h",
            AgeBand::HoursSixToDay => "6h-24h",
            AgeBand::DaysOneToSeven => "1d-7d",
            AgeBand::OverWeek => ">7d",
        }
    }

    /// The band of an age in seconds (a reminder scheduled in the future is under an hour).
    pub fn of_seconds(age_s: i64) -> Self {
        match age_s {
            ..3_600 => AgeBand::UnderHour,
            3_600..21_600 => AgeBand::HoursOneToSix,
            21_600..86_400 => AgeBand::HoursSixToDay,
            86_400..604_800 => AgeBand::DaysOneToSeven,
            _ => AgeBand::OverWeek,
        }
    }

    pub(crate) fn parse(name: &str) -> Option<Self> {
        AgeBand::ALL.into_iter().find(|b| b.as_str() == name)
    }
}

impl fmt::Display for AgeBand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A SQL expression naming the band of the time `scheduled_column` (any timestamp expression:
/// `scheduled_at`, `settled_at`, ...) as of `now_expr`, matching [`AgeBand::of_seconds`].
pub(crate) fn age_band_sql(scheduled_column: &str, now_expr: &str) -> String {
    format!(
        "CASE WHEN {now_expr} - {scheduled_column} < interval '1 hour' THEN '<1h' \
              WHEN {now_expr} - {scheduled_column} < interval '6 hours' THEN '1h-6h' \
              WHEN {now_expr} - {scheduled_column} < interval '24 hours' THEN '6h-24h' \
              WHEN {now_expr} - {scheduled_column} < interval '7 days' THEN '1d-7d' \
              ELSE '>7d' END"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_split_at_their_bounds() {
        assert_eq!(AgeBand::of_seconds(-5), AgeBand::UnderHour);
        assert_eq!(AgeBand::of_seconds(3_599), AgeBand::UnderHour);
        assert_eq!(AgeBand::of_seconds(3_600), AgeBand::HoursOneToSix);
        assert_eq!(AgeBand::of_seconds(86_399), AgeBand::HoursSixToDay);
        assert_eq!(AgeBand::of_seconds(86_400), AgeBand::DaysOneToSeven);
        assert_eq!(AgeBand::of_seconds(604_800), AgeBand::OverWeek);
        for band in AgeBand::ALL {
            assert_eq!(AgeBand::parse(band.as_str()), Some(band));
        }
    }
}
