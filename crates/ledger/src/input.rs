//! The reminder as a client writes it (JSON): one format for `nudgectl reminders load` lines
//! and the intake's HTTP bodies, parsed into checked values with errors that name the field
//! ([`InputError::path`]) and never quote a destination, subscriber reference or content.
//!
//! Every field is first taken as raw JSON, so a value of the wrong type is reported by field
//! name here rather than by serde, whose messages quote the value.

use std::fmt;

pub mod series;

use chrono::{DateTime, Utc};
use nudge_domain::{
    Channel, EventId, ExpiresAfter, Expiry, IdError, InvalidExpiresAfter, InvalidLocalTime,
    LocalTime, ReminderTimes, ResolvedTimes, Revision, SendTime, SubscriberRef, TenantId,
    TimeError, UnknownZone, Zone,
};
use serde::Deserialize;
use serde_json::Value;
use serde_json::error::Category;

use crate::LedgerError;
use crate::crypto::Destination;
use crate::reminders::{ImportReminder, MAX_CONTENT_BYTES, MAX_DESTINATION_BYTES, NewReminder};

/// Where in a reminder's text something is, as serde_json counts: lines from 1, columns from 1
/// within the line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextPosition {
    pub line: usize,
    pub column: usize,
}

/// Why a reminder was refused. Names the field ([`InputError::path`]); never carries a
/// destination, subscriber reference or content.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error("destinations.{0} is longer than {MAX_DESTINATION_BYTES} bytes")]
    DestinationTooLong(Channel),
    #[error("content is longer than {MAX_CONTENT_BYTES} bytes (as JSON text)")]
    ContentTooLong,
    #[error("invalid JSON at column {column}: {problem}")]
    Syntax { column: usize, problem: String },
    #[error("expected a JSON object")]
    NotAnObject,
    /// A missing or repeated field, as serde words it (it names one of the format's fields).
    #[error("{0}")]
    Fields(String),
    /// A field that is not one of the format's. Its name is never repeated: it is the
    /// client's text, and could be patient data typed as a key. `at` is where it ends
    /// when the text was parsed here.
    #[error("{}", unknown_field(*.at))]
    UnknownField { at: Option<TextPosition> },
    #[error("{field} must be {expected}")]
    WrongType {
        field: String,
        expected: &'static str,
    },
    #[error("{field}: {source}")]
    Invalid {
        field: &'static str,
        source: IdError,
    },
    #[error("tenant must be 1 to 200 bytes")]
    TenantName,
    #[error("tenant is given by the path, not the body")]
    TenantInBody,
    #[error("channels must list at least one of push, email, sms")]
    NoChannels,
    #[error("channels[{index}] is not one of push, email, sms")]
    UnknownChannel { index: usize },
    #[error("channels lists {0} twice")]
    DuplicateChannel(Channel),
    #[error("{field} is not an RFC 3339 timestamp with an offset, e.g. 2026-11-30T09:00:00Z")]
    Timestamp { field: &'static str },
    /// A field that needs another missing, or two that exclude each other.
    #[error("{0}")]
    Times(#[from] TimeError),
    #[error("give {field} or {other}, not both")]
    Both {
        field: &'static str,
        other: &'static str,
    },
    #[error("missing field `{field}` (or give {other})")]
    Neither {
        field: &'static str,
        other: &'static str,
    },
    #[error("time_zone {0}")]
    UnknownZone(UnknownZone),
    #[error("scheduled_local {0}")]
    LocalTime(InvalidLocalTime),
    #[error("expires_after_s {0}")]
    ExpiresAfter(InvalidExpiresAfter),
    #[error("destinations.{0} is missing")]
    MissingDestination(Channel),
    #[error("destinations.{0} is empty")]
    EmptyDestination(Channel),
    #[error("destinations.{0} is given but {0} is not in channels")]
    UnlistedDestination(Channel),
    #[error("destinations has a key that is not one of push, email, sms")]
    UnknownDestinationChannel,
    #[error("quiet_hours must be \"respect\" (the default) or \"ignore\"")]
    QuietHours,
    #[error("category: {0}")]
    BadCategory(nudge_domain::CategoryError),
    #[error("revision must be an integer from 0 to 9223372036854775807")]
    Revision,
    #[error("refused by the ledger: {0}")]
    Refused(&'static str),
}

impl InputError {
    fn wrong_type(field: impl Into<String>, expected: &'static str) -> Self {
        Self::WrongType {
            field: field.into(),
            expected,
        }
    }

    fn from_json(error: &serde_json::Error) -> Self {
        // serde_json appends the position; the rest of a syntax message never quotes input.
        let text = error.to_string();
        let suffix = format!(" at line {} column {}", error.line(), error.column());
        let problem = text.strip_suffix(&suffix).unwrap_or(&text);
        match error.classify() {
            // serde quotes an unknown key back as written: never pass that on.
            Category::Data if problem.starts_with("unknown field `") => Self::UnknownField {
                at: (error.line() > 0).then(|| TextPosition {
                    line: error.line(),
                    column: error.column(),
                }),
            },
            Category::Data => {
                // A missing or repeated field is one of ours; keep a stray control character
                // from breaking the one-line-per-rejection output all the same.
                let mut fields = String::with_capacity(problem.len());
                for c in problem.chars() {
                    if c.is_control() {
                        fields.extend(c.escape_debug());
                    } else {
                        fields.push(c);
                    }
                }
                Self::Fields(fields)
            }
            Category::Syntax | Category::Eof | Category::Io => Self::Syntax {
                column: error.column(),
                problem: problem.to_owned(),
            },
        }
    }
}

/// The fields of a reminder, as an unknown field's message lists them.
const FIELDS: &str = "event_id, subscriber_ref, channels, scheduled_at, scheduled_local, \
                      time_zone, expires_at, expires_after_s, destinations, content, revision, \
                      quiet_hours \
                      (and tenant in a `reminders load` line)";

fn unknown_field(at: Option<TextPosition>) -> String {
    let place = at.map_or_else(String::new, |TextPosition { line, column }| {
        format!(" (it ends at line {line} column {column})")
    });
    format!(
        "has a field that is not one of {FIELDS}{place}; its name is not repeated, as it \
         could be patient data"
    )
}

/// One reminder as written: every field is taken as raw JSON so that a value of the wrong type
/// is reported by field name here, not by serde, whose messages quote the value.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLine {
    #[serde(default)]
    tenant: Option<Value>,
    event_id: Value,
    subscriber_ref: Value,
    channels: Value,
    #[serde(default)]
    scheduled_at: Option<Value>,
    #[serde(default)]
    scheduled_local: Option<Value>,
    #[serde(default)]
    time_zone: Option<Value>,
    #[serde(default)]
    expires_at: Option<Value>,
    #[serde(default)]
    expires_after_s: Option<Value>,
    destinations: Value,
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    revision: Option<Value>,
    #[serde(default)]
    quiet_hours: Option<Value>,
    #[serde(default)]
    category: Option<Value>,
}

/// One reminder, checked: every listed channel has a non-empty destination and no other channel
/// has one; exactly one of `scheduled_at` and `scheduled_local`, one of `expires_at` and
/// `expires_after_s`, a known `time_zone` when given; `content` is a JSON object, kept as its
/// JSON bytes. Its times become instants with [`ReminderInput::resolve`], which may need the
/// subscriber's or the tenant's zone ([`ReminderInput::needs_zone`]).
pub struct ReminderInput {
    /// The tenant's name, when the format carries it ([`TenantField::Required`]).
    pub tenant: Option<String>,
    pub event_id: EventId,
    pub subscriber_ref: SubscriberRef,
    pub channels: Vec<Channel>,
    /// The send time, expiry and zone as given (`time_zone` is also the subscriber's zone
    /// from then on).
    pub times: ReminderTimes,
    pub destinations: Vec<(Channel, Destination)>,
    pub content: Option<Vec<u8>>,
    /// The client's revision of this reminder, when given (a post without one is revision 0;
    /// a replacement must give one).
    pub revision: Option<Revision>,
    /// `"quiet_hours": "ignore"` (urgent: sent inside quiet hours, where the tenant allows
    /// it); absent or `"respect"`: not.
    pub ignore_quiet_hours: bool,
    /// What it is about (`general` when absent); that its tenant has it is the ledger's check.
    pub category: nudge_domain::Category,
}

/// Whether the reminder names its tenant: a `reminders load` line does, an HTTP body does
/// not (the tenant is in the path) and may not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantField {
    Required,
    Absent,
}

impl fmt::Debug for ReminderInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReminderInput")
            .field("tenant", &self.tenant)
            .field("event_id", &self.event_id)
            .field("subscriber_ref", &self.subscriber_ref)
            .field("channels", &self.channels)
            .field("times", &self.times)
            .field("destinations", &self.destinations)
            .field("content", &self.content.as_ref().map(|_| "<redacted>"))
            .field("revision", &self.revision)
            .field("ignore_quiet_hours", &self.ignore_quiet_hours)
            .field("category", &self.category)
            .finish()
    }
}

impl ReminderInput {
    /// Parses one reminder from its JSON text (a `reminders load` line, an HTTP body).
    pub fn parse(bytes: &[u8], tenant: TenantField) -> Result<Self, InputError> {
        // Checked first so that serde's type error for a bare value (which quotes it) never
        // happens: inside an object every field is a `Value`, which takes any JSON.
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(InputError::NotAnObject);
        }
        let raw: RawLine = serde_json::from_slice(bytes).map_err(|e| InputError::from_json(&e))?;
        Self::from_raw(raw, tenant)
    }

    /// Parses one reminder already read as JSON (an item of a batch).
    pub fn from_value(value: Value, tenant: TenantField) -> Result<Self, InputError> {
        if !value.is_object() {
            return Err(InputError::NotAnObject);
        }
        let raw: RawLine = serde_json::from_value(value).map_err(|e| InputError::from_json(&e))?;
        Self::from_raw(raw, tenant)
    }

    fn from_raw(raw: RawLine, tenant_field: TenantField) -> Result<Self, InputError> {
        let tenant = match (tenant_field, &raw.tenant) {
            (TenantField::Required, Some(value)) => {
                let tenant = string(value, "tenant")?;
                if tenant.is_empty() || tenant.len() > 200 {
                    return Err(InputError::TenantName);
                }
                Some(tenant.to_owned())
            }
            (TenantField::Required, None) => {
                return Err(InputError::Fields("missing field `tenant`".to_owned()));
            }
            (TenantField::Absent, None) => None,
            (TenantField::Absent, Some(_)) => return Err(InputError::TenantInBody),
        };
        let event_id = EventId::parse(string(&raw.event_id, "event_id")?).map_err(|source| {
            InputError::Invalid {
                field: "event_id",
                source,
            }
        })?;
        let subscriber_ref = SubscriberRef::parse(string(&raw.subscriber_ref, "subscriber_ref")?)
            .map_err(|source| InputError::Invalid {
            field: "subscriber_ref",
            source,
        })?;
        let channels = channels(&raw.channels)?;
        let times = times(
            raw.scheduled_at,
            raw.scheduled_local,
            raw.time_zone,
            raw.expires_at,
            raw.expires_after_s,
        )?;
        let destinations = destinations(&raw.destinations, &channels)?;
        let content = match raw.content {
            None | Some(Value::Null) => None,
            Some(content @ Value::Object(_)) => {
                let content = content.to_string().into_bytes();
                if content.len() > MAX_CONTENT_BYTES {
                    return Err(InputError::ContentTooLong);
                }
                Some(content)
            }
            Some(_) => return Err(InputError::wrong_type("content", "a JSON object")),
        };
        let revision = match raw.revision {
            None | Some(Value::Null) => None,
            Some(value) => Some(
                value
                    .as_i64()
                    .and_then(|v| Revision::new(v).ok())
                    .ok_or(InputError::Revision)?,
            ),
        };
        let ignore_quiet_hours = match raw.quiet_hours {
            None | Some(Value::Null) => false,
            Some(Value::String(text)) if text == "respect" => false,
            Some(Value::String(text)) if text == "ignore" => true,
            Some(_) => return Err(InputError::QuietHours),
        };
        let category = category(raw.category.as_ref())?;
        Ok(Self {
            tenant,
            event_id,
            subscriber_ref,
            channels,
            times,
            destinations,
            content,
            revision,
            ignore_quiet_hours,
            category,
        })
    }

    /// Whether its times need a zone it does not give: a local time without `time_zone`
    /// is read in the subscriber's zone, else the tenant's.
    pub fn needs_zone(&self) -> bool {
        self.times.needs_zone()
    }

    /// Its times as instants: a local time read in its own zone, else `subscriber`'s, else
    /// `tenant`'s (none at all is refused, naming `time_zone`).
    pub fn resolve(
        &self,
        subscriber: Option<Zone>,
        tenant: Option<Zone>,
    ) -> Result<ResolvedTimes, InputError> {
        Ok(self.times.resolve(subscriber, tenant)?)
    }
}

/// A reminder's or a series' `category`: absent or null is `general`.
pub(crate) fn category(value: Option<&Value>) -> Result<nudge_domain::Category, InputError> {
    match value {
        None | Some(Value::Null) => Ok(nudge_domain::Category::general()),
        Some(Value::String(name)) => {
            nudge_domain::Category::parse(name).map_err(InputError::BadCategory)
        }
        Some(_) => Err(InputError::wrong_type("category", "a string")),
    }
}

/// The send time, the expiry and the zone, each given one way only.
fn times(
    scheduled_at: Option<Value>,
    scheduled_local: Option<Value>,
    time_zone: Option<Value>,
    expires_at: Option<Value>,
    expires_after_s: Option<Value>,
) -> Result<ReminderTimes, InputError> {
    let present = |v: Option<Value>| v.filter(|v| !v.is_null());
    let send = match (present(scheduled_at), present(scheduled_local)) {
        (Some(at), None) => SendTime::At(timestamp(&at, "scheduled_at")?),
        (None, Some(local)) => SendTime::Local(
            LocalTime::parse(string(&local, "scheduled_local")?).map_err(InputError::LocalTime)?,
        ),
        (Some(_), Some(_)) => {
            return Err(InputError::Both {
                field: "scheduled_local",
                other: "scheduled_at",
            });
        }
        (None, None) => {
            return Err(InputError::Neither {
                field: "scheduled_at",
                other: "scheduled_local",
            });
        }
    };
    let zone = match present(time_zone) {
        None => None,
        Some(zone) => {
            Some(Zone::parse(string(&zone, "time_zone")?).map_err(InputError::UnknownZone)?)
        }
    };
    let expiry = match (present(expires_at), present(expires_after_s)) {
        (Some(at), None) => Expiry::At(timestamp(&at, "expires_at")?),
        (None, Some(after)) => Expiry::After(
            after
                .as_u64()
                .ok_or(InvalidExpiresAfter)
                .and_then(ExpiresAfter::from_secs)
                .map_err(InputError::ExpiresAfter)?,
        ),
        (Some(_), Some(_)) => {
            return Err(InputError::Both {
                field: "expires_after_s",
                other: "expires_at",
            });
        }
        (None, None) => {
            return Err(InputError::Neither {
                field: "expires_at",
                other: "expires_after_s",
            });
        }
    };
    Ok(ReminderTimes { send, expiry, zone })
}

fn string<'v>(value: &'v Value, field: &'static str) -> Result<&'v str, InputError> {
    value
        .as_str()
        .ok_or_else(|| InputError::wrong_type(field, "a string"))
}

/// A `channels` array: at least one of push, email, sms, none twice.
pub fn channels(value: &Value) -> Result<Vec<Channel>, InputError> {
    let items = value
        .as_array()
        .ok_or_else(|| InputError::wrong_type("channels", "an array of channel names"))?;
    if items.is_empty() {
        return Err(InputError::NoChannels);
    }
    let mut channels = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let channel: Channel = item
            .as_str()
            .and_then(|s| s.parse().ok())
            .ok_or(InputError::UnknownChannel { index })?;
        if channels.contains(&channel) {
            return Err(InputError::DuplicateChannel(channel));
        }
        channels.push(channel);
    }
    Ok(channels)
}

fn timestamp(value: &Value, field: &'static str) -> Result<DateTime<Utc>, InputError> {
    let text = string(value, field)?;
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| InputError::Timestamp { field })
}

pub fn destinations(
    value: &Value,
    channels: &[Channel],
) -> Result<Vec<(Channel, Destination)>, InputError> {
    let given = value.as_object().ok_or_else(|| {
        InputError::wrong_type("destinations", "an object of channel name to destination")
    })?;
    let mut destinations = Vec::with_capacity(channels.len());
    for &channel in channels {
        let value = given
            .get(channel.as_str())
            .ok_or(InputError::MissingDestination(channel))?;
        let text = value
            .as_str()
            .ok_or_else(|| InputError::wrong_type(format!("destinations.{channel}"), "a string"))?;
        if text.trim().is_empty() {
            return Err(InputError::EmptyDestination(channel));
        }
        if text.len() > MAX_DESTINATION_BYTES {
            return Err(InputError::DestinationTooLong(channel));
        }
        destinations.push((channel, Destination::new(text)));
    }
    // Any other key is a mistake: a destination for a channel the reminder does not use,
    // or not a channel at all (not quoted: it could be a destination typed in the wrong place).
    for key in given.keys() {
        let channel: Channel = key
            .parse()
            .map_err(|_| InputError::UnknownDestinationChannel)?;
        if !channels.contains(&channel) {
            return Err(InputError::UnlistedDestination(channel));
        }
    }
    Ok(destinations)
}

impl InputError {
    /// Where in the reminder the problem is, as a JSON pointer (`/destinations/sms`,
    /// `/channels/1`; empty for the whole document).
    pub fn path(&self) -> String {
        match self {
            Self::DestinationTooLong(c)
            | Self::MissingDestination(c)
            | Self::EmptyDestination(c)
            | Self::UnlistedDestination(c) => format!("/destinations/{c}"),
            Self::ContentTooLong => "/content".to_owned(),
            Self::Revision => "/revision".to_owned(),
            Self::QuietHours => "/quiet_hours".to_owned(),
            Self::BadCategory(_) => "/category".to_owned(),
            Self::Syntax { .. }
            | Self::NotAnObject
            | Self::Refused(_)
            | Self::UnknownField { .. } => String::new(),
            Self::Fields(message) => field_of(message)
                .map(|field| format!("/{}", field.replace('~', "~0").replace('/', "~1")))
                .unwrap_or_default(),
            Self::WrongType { field, .. } => format!("/{}", field.replace('.', "/")),
            Self::Invalid { field, .. } | Self::Timestamp { field } => format!("/{field}"),
            Self::TenantName | Self::TenantInBody => "/tenant".to_owned(),
            Self::NoChannels | Self::DuplicateChannel(_) => "/channels".to_owned(),
            Self::UnknownChannel { index } => format!("/channels/{index}"),
            Self::Times(e) => format!("/{}", e.field()),
            Self::Both { field, .. } | Self::Neither { field, .. } => format!("/{field}"),
            Self::UnknownZone(_) => "/time_zone".to_owned(),
            Self::LocalTime(_) => "/scheduled_local".to_owned(),
            Self::ExpiresAfter(_) => "/expires_after_s".to_owned(),
            Self::UnknownDestinationChannel => "/destinations".to_owned(),
        }
    }

    /// The ledger's refusal of a value this module already checks (kept as a rejection, in
    /// case the ledger's rules are ever stricter).
    pub fn refused(error: LedgerError) -> Self {
        match error {
            LedgerError::InvalidInput(reason) => Self::Refused(reason),
            _ => Self::Refused("not accepted by the ledger"),
        }
    }
}

/// The field a serde message about a missing or repeated field names.
fn field_of(message: &str) -> Option<&str> {
    ["missing field `", "duplicate field `"]
        .iter()
        .find_map(|prefix| message.strip_prefix(prefix))
        .and_then(|rest| rest.split('`').next())
}

impl ReminderInput {
    /// The reminder for `tenant_id` at the instants its times resolved to
    /// ([`ReminderInput::resolve`]), with its destinations and its zone (the subscriber's
    /// from then on), checked by the ledger's rules.
    pub fn into_import(
        self,
        tenant_id: TenantId,
        times: &ResolvedTimes,
    ) -> Result<ImportReminder, InputError> {
        let mut reminder = NewReminder::new(
            tenant_id,
            self.event_id,
            self.subscriber_ref,
            &self.channels,
            times.scheduled_at,
            times.expires_at,
        )
        .map_err(InputError::refused)?
        .with_time_zone(self.times.zone);
        if let Some(content) = self.content {
            reminder = reminder
                .with_content(content)
                .map_err(InputError::refused)?;
        }
        if let Some(revision) = self.revision {
            reminder = reminder.with_revision(revision);
        }
        reminder = reminder
            .ignoring_quiet_hours(self.ignore_quiet_hours)
            .with_category(self.category);
        Ok(ImportReminder {
            reminder,
            contacts: self.destinations,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"tenant": "clinic-a", "event_id": "appt-123", "subscriber_ref": "patient-42", "channels": ["sms", "email"], "scheduled_at": "2026-11-30T09:00:00Z", "expires_at": "2026-11-30T10:30:00+01:00", "destinations": {"sms": "+15550100", "email": "a@example.org"}, "content": {"template": "appointment"}}"#;

    fn with(field: &str, value: Value) -> Vec<u8> {
        let mut line: serde_json::Map<String, Value> = serde_json::from_str(GOOD).unwrap();
        if value.is_null() {
            line.remove(field);
        } else {
            line.insert(field.to_owned(), value);
        }
        serde_json::to_vec(&line).unwrap()
    }

    /// Why `bytes` is refused: by the parse, or else by resolving its times without a
    /// subscriber's or tenant's zone.
    fn reason(bytes: &[u8]) -> String {
        let err = match ReminderInput::parse(bytes, TenantField::Required) {
            Err(e) => e,
            Ok(input) => input.resolve(None, None).unwrap_err(),
        }
        .to_string();
        for secret in ["+15550100", "a@example.org", "patient-42", "appointment"] {
            assert!(!err.contains(secret), "{err} shows {secret}");
        }
        err
    }

    #[test]
    fn a_good_line_parses_with_its_channels_destinations_and_content() {
        let line = ReminderInput::parse(GOOD.as_bytes(), TenantField::Required).unwrap();
        assert_eq!(line.tenant.as_deref(), Some("clinic-a"));
        assert_eq!(line.event_id.as_str(), "appt-123");
        assert_eq!(line.subscriber_ref.as_str(), "patient-42");
        assert_eq!(line.channels, [Channel::Sms, Channel::Email]);
        let times = line.resolve(None, None).unwrap();
        assert_eq!(times.expires_at.to_rfc3339(), "2026-11-30T09:30:00+00:00");
        assert_eq!(line.times.zone, None);
        let dests: Vec<_> = line
            .destinations
            .iter()
            .map(|(c, d)| (*c, d.expose()))
            .collect();
        assert_eq!(
            dests,
            [
                (Channel::Sms, "+15550100"),
                (Channel::Email, "a@example.org")
            ]
        );
        assert_eq!(
            line.content.as_deref(),
            Some(br#"{"template":"appointment"}"#.as_slice())
        );
        assert!(!format!("{line:?}").contains("appointment"));
    }

    #[test]
    fn content_is_optional() {
        let line =
            ReminderInput::parse(&with("content", Value::Null), TenantField::Required).unwrap();
        assert!(line.content.is_none());
        assert_eq!(
            reason(&with("content", serde_json::json!("appointment"))),
            "content must be a JSON object"
        );
    }

    #[test]
    fn broken_json_is_reported_by_column() {
        assert_eq!(
            reason(br#"{"tenant" "clinic-a"}"#),
            "invalid JSON at column 11: expected `:`"
        );
        assert!(reason(br#"{"tenant": "#).starts_with("invalid JSON at column 11: EOF"));
        assert_eq!(reason(b"[1, 2]"), "expected a JSON object");
        assert_eq!(reason(br#""+15550100""#), "expected a JSON object");
    }

    #[test]
    fn an_unknown_field_is_placed_without_its_name_and_a_missing_one_is_named() {
        let line = with("patient-42", serde_json::json!("x"));
        let unknown = reason(&line);
        assert!(
            unknown.starts_with("has a field that is not one of event_id, "),
            "{unknown}"
        );
        // Where it ends: right after the key, whose quotes close at this column.
        let key_end = String::from_utf8_lossy(&line)
            .find("\"patient-42\"")
            .unwrap()
            + 12;
        let err = ReminderInput::parse(&line, TenantField::Required).unwrap_err();
        assert_eq!(
            err,
            InputError::UnknownField {
                at: Some(TextPosition {
                    line: 1,
                    column: key_end
                })
            }
        );
        assert!(
            err.to_string()
                .contains(&format!("line 1 column {key_end}")),
            "{err}"
        );
        assert_eq!(err.path(), "");
        assert_eq!(
            reason(&with("expires_at", Value::Null)),
            "missing field `expires_at` (or give expires_after_s)"
        );
    }

    #[test]
    fn a_value_of_the_wrong_type_names_the_field_without_quoting_the_value() {
        assert_eq!(
            reason(&with("subscriber_ref", serde_json::json!(15550100))),
            "subscriber_ref must be a string"
        );
        assert_eq!(
            reason(&with(
                "destinations",
                serde_json::json!({"sms": 15550100, "email": "a@example.org"})
            )),
            "destinations.sms must be a string"
        );
        assert_eq!(
            reason(&with("subscriber_ref", serde_json::json!("patient 42"))),
            "subscriber_ref: subscriber reference has a character not allowed at byte 7: \
             printable ASCII without whitespace"
        );
    }

    #[test]
    fn every_listed_channel_needs_a_destination_and_no_other_may_have_one() {
        assert_eq!(
            reason(&with(
                "destinations",
                serde_json::json!({"email": "a@example.org"})
            )),
            "destinations.sms is missing"
        );
        assert_eq!(
            reason(&with(
                "destinations",
                serde_json::json!({"sms": " ", "email": "a@example.org"})
            )),
            "destinations.sms is empty"
        );
        assert_eq!(
            reason(&with(
                "destinations",
                serde_json::json!({"sms": "+15550100", "email": "a@example.org", "push": "tok"})
            )),
            "destinations.push is given but push is not in channels"
        );
        assert_eq!(
            reason(&with(
                "destinations",
                serde_json::json!({"sms": "+15550100", "email": "a@example.org", "+15550100": "sms"})
            )),
            "destinations has a key that is not one of push, email, sms"
        );
    }

    #[test]
    fn channels_must_be_known_and_listed_once() {
        assert_eq!(
            reason(&with("channels", serde_json::json!([]))),
            "channels must list at least one of push, email, sms"
        );
        assert_eq!(
            reason(&with("channels", serde_json::json!(["sms", "fax"]))),
            "channels[1] is not one of push, email, sms"
        );
        assert_eq!(
            reason(&with("channels", serde_json::json!(["sms", "sms"]))),
            "channels lists sms twice"
        );
    }

    #[test]
    fn timestamps_need_an_offset_and_expiry_after_the_schedule() {
        assert_eq!(
            reason(&with(
                "scheduled_at",
                serde_json::json!("2026-11-30T09:00:00")
            )),
            "scheduled_at is not an RFC 3339 timestamp with an offset, e.g. 2026-11-30T09:00:00Z"
        );
        assert_eq!(
            reason(&with(
                "expires_at",
                serde_json::json!("2026-11-30T08:59:59Z")
            )),
            "expires_at must be after scheduled_at"
        );
    }

    #[test]
    fn an_unknown_key_is_never_repeated_whatever_it_holds() {
        for key in ["a\nb", "+15550100", "pat@example.org", "x`y"] {
            let r = reason(&with(key, serde_json::json!(1)));
            assert!(!r.contains('\n'), "{r}");
            assert!(!r.contains(key), "{r}");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod http_form {
    use super::*;

    const BODY: &str = r#"{"event_id": "appt-1", "subscriber_ref": "patient-42", "channels": ["sms"], "scheduled_at": "2026-11-30T09:00:00Z", "expires_at": "2026-11-30T10:00:00Z", "destinations": {"sms": "+15550100"}}"#;

    #[test]
    fn a_body_without_a_tenant_parses_and_one_with_a_tenant_is_refused_at_its_path() {
        let input = ReminderInput::parse(BODY.as_bytes(), TenantField::Absent).unwrap();
        assert_eq!(input.tenant, None);
        let mut value: Value = serde_json::from_str(BODY).unwrap();
        value["tenant"] = Value::from("clinic-a");
        let err = ReminderInput::from_value(value, TenantField::Absent).unwrap_err();
        assert_eq!(err, InputError::TenantInBody);
        assert_eq!(err.path(), "/tenant");
    }

    #[test]
    fn every_refusal_has_a_json_pointer_path_and_quotes_no_value() {
        let cases = [
            (
                serde_json::json!({"destinations": {"sms": 5}}),
                "/destinations/sms",
            ),
            (
                serde_json::json!({"channels": ["sms", "fax"]}),
                "/channels/1",
            ),
            (serde_json::json!({"subscriber": "x"}), ""),
            (
                serde_json::json!({"scheduled_at": "tomorrow"}),
                "/scheduled_at",
            ),
            (
                serde_json::json!({"expires_at": "2026-11-30T08:00:00Z"}),
                "/expires_at",
            ),
            (
                serde_json::json!({"subscriber_ref": "a b"}),
                "/subscriber_ref",
            ),
        ];
        for (patch, path) in cases {
            let mut value: Value = serde_json::from_str(BODY).unwrap();
            for (k, v) in patch.as_object().unwrap() {
                value[k] = v.clone();
            }
            let err = ReminderInput::from_value(value, TenantField::Absent)
                .and_then(|input| input.resolve(None, None))
                .unwrap_err();
            assert_eq!(err.path(), path, "{err}");
            assert!(!err.to_string().contains("+15550100"));
            assert!(!err.to_string().contains("patient-42"));
        }
        let mut missing: Value = serde_json::from_str(BODY).unwrap();
        missing.as_object_mut().unwrap().remove("channels");
        let err = ReminderInput::from_value(missing, TenantField::Absent).unwrap_err();
        assert_eq!(err.path(), "/channels");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod local_times {
    use super::*;

    const BODY: &str = r#"{"event_id": "appt-1", "subscriber_ref": "patient-42", "channels": ["sms"], "scheduled_local": "2027-03-14T02:30:00", "time_zone": "America/New_York", "expires_after_s": 3600, "destinations": {"sms": "+15550100"}}"#;

    fn patched(patch: Value) -> Result<ReminderInput, InputError> {
        let mut value: Value = serde_json::from_str(BODY).unwrap();
        for (k, v) in patch.as_object().unwrap() {
            if v.is_null() {
                value.as_object_mut().unwrap().remove(k);
            } else {
                value[k] = v.clone();
            }
        }
        ReminderInput::from_value(value, TenantField::Absent)
    }

    #[test]
    fn a_local_time_in_its_own_zone_resolves_forward_over_the_gap() {
        let input = patched(serde_json::json!({})).unwrap();
        assert!(!input.needs_zone());
        let times = input.resolve(None, None).unwrap();
        assert_eq!(times.scheduled_at.to_rfc3339(), "2027-03-14T07:30:00+00:00");
        assert_eq!(times.expires_at.to_rfc3339(), "2027-03-14T08:30:00+00:00");
        let item = input
            .into_import(TenantId::from_uuid(uuid::Uuid::nil()), &times)
            .unwrap();
        assert_eq!(
            item.reminder.time_zone().map(|z| z.name()),
            Some("America/New_York")
        );
    }

    #[test]
    fn a_local_time_without_a_zone_takes_the_subscribers_then_the_tenants_and_none_is_refused() {
        let input = patched(serde_json::json!({"time_zone": null})).unwrap();
        assert!(input.needs_zone());
        let london = Zone::parse("Europe/London").ok();
        let berlin = Zone::parse("Europe/Berlin").ok();
        assert_eq!(
            input
                .resolve(london, berlin)
                .unwrap()
                .scheduled_at
                .to_rfc3339(),
            "2027-03-14T02:30:00+00:00"
        );
        assert_eq!(
            input
                .resolve(None, berlin)
                .unwrap()
                .scheduled_at
                .to_rfc3339(),
            "2027-03-14T01:30:00+00:00"
        );
        let err = input.resolve(None, None).unwrap_err();
        assert_eq!(err.path(), "/time_zone");
        assert!(err.to_string().contains("time_zone is required"), "{err}");
    }

    #[test]
    fn every_bad_combination_is_refused_at_the_field_it_names() {
        let cases = [
            (
                serde_json::json!({"time_zone": "Mars/Olympus_Mons"}),
                "/time_zone",
            ),
            (serde_json::json!({"time_zone": "utc"}), "/time_zone"),
            (serde_json::json!({"time_zone": 5}), "/time_zone"),
            (
                serde_json::json!({"scheduled_at": "2027-03-14T07:30:00Z"}),
                "/scheduled_local",
            ),
            (
                serde_json::json!({"scheduled_local": null}),
                "/scheduled_at",
            ),
            (
                serde_json::json!({"scheduled_local": "2027-03-14T02:30:00-05:00"}),
                "/scheduled_local",
            ),
            (
                serde_json::json!({"scheduled_local": "2027-02-29T02:30:00"}),
                "/scheduled_local",
            ),
            (
                serde_json::json!({"expires_at": "2027-03-15T00:00:00Z"}),
                "/expires_after_s",
            ),
            (serde_json::json!({"expires_after_s": null}), "/expires_at"),
            (
                serde_json::json!({"expires_after_s": 0}),
                "/expires_after_s",
            ),
            (
                serde_json::json!({"expires_after_s": -5}),
                "/expires_after_s",
            ),
            (
                serde_json::json!({"expires_after_s": 1.5}),
                "/expires_after_s",
            ),
            (
                serde_json::json!({"expires_after_s": 31_622_401}),
                "/expires_after_s",
            ),
            (
                serde_json::json!({"expires_after_s": "3600"}),
                "/expires_after_s",
            ),
        ];
        for (patch, path) in cases {
            let err = patched(patch.clone()).unwrap_err();
            assert_eq!(err.path(), path, "{patch}: {err}");
            let text = err.to_string();
            assert!(!text.contains("Mars"), "{text}");
            assert!(!text.contains("+15550100"), "{text}");
        }
    }

    #[test]
    fn an_instant_with_a_zone_keeps_the_instant_and_gives_the_subscriber_the_zone() {
        let input = patched(serde_json::json!({
            "scheduled_local": null,
            "scheduled_at": "2027-03-14T12:00:00+01:00",
            "time_zone": "Europe/Berlin",
        }))
        .unwrap();
        assert!(!input.needs_zone());
        let times = input.resolve(None, None).unwrap();
        assert_eq!(times.scheduled_at.to_rfc3339(), "2027-03-14T11:00:00+00:00");
        assert_eq!(times.local, None);
        assert_eq!(input.times.zone.map(|z| z.name()), Some("Europe/Berlin"));
    }
}
