//! A recurring reminder (series) as a client writes it: one format for the intake's
//! `POST .../series` body and a `nudgectl reminders load` line with `series_id`. Every problem
//! found is reported, each by its field (a JSON pointer), never quoting a value: a refused
//! rule is named by its kind.

use chrono::{DateTime, Utc};
use nudge_domain::series::{Series, SeriesLimits};
use nudge_domain::{Channel, ExpiresAfter, LocalTime, SubscriberRef, TenantId, Zone};
use serde_json::{Map, Value};

use super::{TenantField, channels, destinations};
use crate::crypto::Destination;
use crate::reminders::MAX_CONTENT_BYTES;
use crate::series::{NewSeries, check_series_id};

/// The fields of a series (and `tenant` in a `reminders load` line).
pub const FIELDS: &[&str] = &[
    "series_id",
    "subscriber_ref",
    "channels",
    "time_zone",
    "start_local",
    "rrule",
    "expires_after_s",
    "destinations",
    "content",
    "quiet_hours",
    "category",
];

/// A series' destinations, one per channel.
pub type Contacts = Vec<(Channel, Destination)>;

/// The most occurrences a series may have on one day.
pub const MAX_PER_DAY: usize = 24;

/// One problem with a series: where (a JSON pointer) and what, never the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeriesProblem {
    pub path: String,
    pub problem: String,
}

impl SeriesProblem {
    fn new(path: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            problem: problem.into(),
        }
    }
}

impl std::fmt::Display for SeriesProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.problem)
        } else {
            write!(f, "{}: {}", &self.path[1..], self.problem)
        }
    }
}

/// A series, each field checked on its own; the rule is parsed with [`SeriesInput::into_new`],
/// against the limits of whoever records it.
pub struct SeriesInput {
    /// The tenant's name, in a `reminders load` line.
    pub tenant: Option<String>,
    pub series_id: String,
    pub subscriber_ref: SubscriberRef,
    pub channels: Vec<Channel>,
    pub zone: Zone,
    pub start: LocalTime,
    pub rule: String,
    pub expires_after: ExpiresAfter,
    pub destinations: Vec<(Channel, Destination)>,
    pub content: Option<Vec<u8>>,
    pub ignore_quiet_hours: bool,
    /// Its occurrences' category (`general` when absent); the ledger checks the tenant has it.
    pub category: nudge_domain::Category,
}

impl std::fmt::Debug for SeriesInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeriesInput")
            .field("tenant", &self.tenant)
            .field("series_id", &self.series_id)
            .field("channels", &self.channels)
            .field("zone", &self.zone)
            .field("start", &self.start)
            .finish_non_exhaustive()
    }
}

/// Whether a JSON object is a series (it has `series_id`) rather than a reminder.
pub fn is_series(value: &Value) -> bool {
    value
        .as_object()
        .is_some_and(|m| m.contains_key("series_id"))
}

impl SeriesInput {
    /// Reads a series from JSON; every problem found, each by its field.
    pub fn from_value(value: Value, tenant_field: TenantField) -> Result<Self, Vec<SeriesProblem>> {
        let Value::Object(map) = value else {
            return Err(vec![SeriesProblem::new("", "expected a JSON object")]);
        };
        let mut problems = Vec::new();
        let tenant = read_tenant(&map, tenant_field, &mut problems);
        let allowed = |k: &str| {
            FIELDS.contains(&k) || (k == "tenant" && tenant_field == TenantField::Required)
        };
        if map.keys().any(|k| !allowed(k)) {
            problems.push(SeriesProblem::new(
                "",
                format!(
                    "has a field that is not one of {}{}; its name is not repeated, as it could \
                     be patient data",
                    FIELDS.join(", "),
                    if tenant_field == TenantField::Required {
                        " (and tenant)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        let series_id = text(&map, "series_id", &mut problems).and_then(|id| {
            check_series_id(&id)
                .map(|()| id)
                .map_err(|_| {
                    problems.push(SeriesProblem::new(
                        "/series_id",
                        "must be 1 to 180 visible ASCII characters",
                    ));
                })
                .ok()
        });
        let subscriber_ref = text(&map, "subscriber_ref", &mut problems).and_then(|s| {
            SubscriberRef::parse(&s)
                .map_err(|e| problems.push(SeriesProblem::new("/subscriber_ref", e.to_string())))
                .ok()
        });
        let channels = match map.get("channels") {
            Some(value) => channels(value)
                .map_err(|e| problems.push(SeriesProblem::new(e.path(), e.to_string())))
                .ok(),
            None => {
                problems.push(SeriesProblem::new("/channels", "is required"));
                None
            }
        };
        let destinations = match (map.get("destinations"), &channels) {
            (Some(value), Some(channels)) => destinations(value, channels)
                .map_err(|e| problems.push(SeriesProblem::new(e.path(), e.to_string())))
                .ok(),
            (None, _) => {
                problems.push(SeriesProblem::new("/destinations", "is required"));
                None
            }
            (Some(_), None) => None,
        };
        let zone = text(&map, "time_zone", &mut problems).and_then(|z| {
            Zone::parse(&z)
                .map_err(|_| {
                    problems.push(SeriesProblem::new(
                        "/time_zone",
                        "is not a zone of the built-in tz database (an IANA name such as \
                         Europe/Berlin)",
                    ));
                })
                .ok()
        });
        let start = text(&map, "start_local", &mut problems).and_then(|s| {
            LocalTime::parse(&s)
                .map_err(|_| {
                    problems.push(SeriesProblem::new(
                        "/start_local",
                        "must be a local date and time, YYYY-MM-DDTHH:MM[:SS], without an offset",
                    ));
                })
                .ok()
        });
        let rule = text(&map, "rrule", &mut problems);
        let expires_after = match map.get("expires_after_s") {
            Some(value) => value
                .as_u64()
                .and_then(|s| ExpiresAfter::from_secs(s).ok())
                .or_else(|| {
                    problems.push(SeriesProblem::new(
                        "/expires_after_s",
                        "must be an integer from 1 to 31622400",
                    ));
                    None
                }),
            None => {
                problems.push(SeriesProblem::new("/expires_after_s", "is required"));
                None
            }
        };
        let content = match map.get("content") {
            None | Some(Value::Null) => None,
            Some(content @ Value::Object(_)) => {
                let bytes = content.to_string().into_bytes();
                if bytes.len() > MAX_CONTENT_BYTES {
                    problems.push(SeriesProblem::new(
                        "/content",
                        "is longer than 16384 bytes (as JSON text)",
                    ));
                    None
                } else {
                    Some(bytes)
                }
            }
            Some(_) => {
                problems.push(SeriesProblem::new("/content", "must be a JSON object"));
                None
            }
        };
        let ignore_quiet_hours = match map.get("quiet_hours") {
            None | Some(Value::Null) => false,
            Some(Value::String(m)) if m == "respect" => false,
            Some(Value::String(m)) if m == "ignore" => true,
            Some(_) => {
                problems.push(SeriesProblem::new(
                    "/quiet_hours",
                    "must be \"respect\" or \"ignore\"",
                ));
                false
            }
        };
        let category = match crate::input::category(map.get("category")) {
            Ok(category) => category,
            Err(e) => {
                let message = e.to_string();
                problems.push(SeriesProblem::new(
                    "/category",
                    message.strip_prefix("category: ").unwrap_or(&message),
                ));
                nudge_domain::Category::general()
            }
        };
        match (
            series_id,
            subscriber_ref,
            channels,
            destinations,
            zone,
            start,
            rule,
            expires_after,
        ) {
            (
                Some(series_id),
                Some(subscriber_ref),
                Some(channels),
                Some(destinations),
                Some(zone),
                Some(start),
                Some(rule),
                Some(expires_after),
            ) if problems.is_empty() => Ok(Self {
                tenant,
                series_id,
                subscriber_ref,
                channels,
                zone,
                start,
                rule,
                expires_after,
                destinations,
                content,
                ignore_quiet_hours,
                category,
            }),
            _ => Err(problems),
        }
    }

    /// The series for `tenant_id`: its rule parsed against `limits` (a series ends within
    /// `limits.max_ahead` of its start), its start at most `latest_start`.
    pub fn into_new(
        self,
        tenant_id: TenantId,
        limits: &SeriesLimits,
        latest_start: DateTime<Utc>,
    ) -> Result<(NewSeries, Contacts), Vec<SeriesProblem>> {
        if self.zone.resolve(self.start).instant > latest_start {
            return Err(vec![SeriesProblem::new(
                "/start_local",
                format!(
                    "is more than {} days ahead (intake.max_schedule_ahead_days)",
                    limits.max_ahead.num_days()
                ),
            )]);
        }
        let series = Series::parse(&self.rule, self.start, self.zone, limits)
            .map_err(|e| vec![SeriesProblem::new("/rrule", e.to_string())])?;
        let refused = |e: crate::LedgerError| vec![SeriesProblem::new("", e.to_string())];
        let new = NewSeries::new(
            tenant_id,
            &self.series_id,
            self.subscriber_ref,
            &self.channels,
            series,
            &self.rule,
            self.expires_after,
        )
        .and_then(|s| s.with_content(self.content))
        .map_err(refused)?
        .ignoring_quiet_hours(self.ignore_quiet_hours)
        .with_category(self.category);
        Ok((new, self.destinations))
    }
}

fn read_tenant(
    map: &Map<String, Value>,
    tenant_field: TenantField,
    problems: &mut Vec<SeriesProblem>,
) -> Option<String> {
    match (tenant_field, map.get("tenant")) {
        (TenantField::Required, Some(Value::String(t))) if !t.is_empty() && t.len() <= 200 => {
            Some(t.clone())
        }
        (TenantField::Required, Some(_)) => {
            problems.push(SeriesProblem::new("/tenant", "must be 1 to 200 bytes"));
            None
        }
        (TenantField::Required, None) => {
            problems.push(SeriesProblem::new("/tenant", "is required"));
            None
        }
        (TenantField::Absent, Some(_)) => {
            problems.push(SeriesProblem::new(
                "/tenant",
                "tenant is given by the path, not the body",
            ));
            None
        }
        (TenantField::Absent, None) => None,
    }
}

fn text(
    map: &Map<String, Value>,
    field: &'static str,
    problems: &mut Vec<SeriesProblem>,
) -> Option<String> {
    match map.get(field) {
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            problems.push(SeriesProblem::new(format!("/{field}"), "must be a string"));
            None
        }
        None => {
            problems.push(SeriesProblem::new(format!("/{field}"), "is required"));
            None
        }
    }
}
