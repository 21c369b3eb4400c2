//! The envelope a relay publishes for one delivery, and the one place it is encoded and parsed.
//!
//! This crate owns the wire format of queue messages (`proto/nudge/v1/envelope.proto`) and turns
//! bytes from the broker into an [`Envelope`] of domain types, or an [`EnvelopeError`] whose
//! [`reason_code`](EnvelopeError::reason_code) a worker records when it dead-letters the message.
//!
//! It must never carry anything but ids: no destination, template or message text, and no
//! subscriber reference (docs/DESIGN.md, invariant 6). It does no I/O and never decides whether a
//! delivery is owed; the ledger does.

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, DeliveryId, Lane, ReminderId, TenantId};
use prost::Message as _;

/// The prost types generated from `proto/nudge/v1/envelope.proto`. Prefer [`Envelope`]: these
/// hold unchecked wire values.
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/nudge.v1.rs"));
}

/// The envelope layout this crate writes and the only one it reads.
pub const SCHEMA_VERSION: u32 = 1;

/// The longest correlation id accepted, in bytes (it is printable ASCII, so also in characters).
pub const CORRELATION_ID_MAX_LEN: usize = 128;

/// A parsed envelope: a pointer to one delivery attempt. The ledger stays the authority.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub delivery_id: DeliveryId,
    pub reminder_id: ReminderId,
    pub tenant_id: TenantId,
    pub channel: Channel,
    /// The attempt generation the ledger must still hold for this message to be acted on.
    pub generation: u64,
    pub lane: Lane,
    /// 1 to [`CORRELATION_ID_MAX_LEN`] printable ASCII characters (checked on decode).
    pub correlation_id: String,
    pub enqueued_at: DateTime<Utc>,
}

/// Why bytes from the broker are not an envelope this version can act on. Messages never echo
/// field values.
#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    /// Not a protobuf `DeliveryEnvelope` at all.
    #[error("the message is not a decodable delivery envelope")]
    Undecodable(#[source] prost::DecodeError),
    /// A layout this reader does not know; the writer is newer (or broken).
    #[error("unsupported envelope schema version {0} (this reader knows {SCHEMA_VERSION})")]
    UnsupportedSchemaVersion(u32),
    /// Decodable, but a field does not hold a valid value.
    #[error("envelope field {field} is invalid: {reason}")]
    InvalidField { field: &'static str, reason: String },
}

impl EnvelopeError {
    /// A stable, low-cardinality code for dead-letter records and metric labels.
    pub fn reason_code(&self) -> &'static str {
        match self {
            EnvelopeError::Undecodable(_) => "undecodable",
            EnvelopeError::UnsupportedSchemaVersion(_) => "unsupported_schema_version",
            EnvelopeError::InvalidField { .. } => "invalid_field",
        }
    }

    fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        EnvelopeError::InvalidField {
            field,
            reason: reason.into(),
        }
    }
}

impl Envelope {
    /// The protobuf bytes of this envelope, at [`SCHEMA_VERSION`].
    ///
    /// `enqueued_at` inside a leap second is written as the last nanosecond before it, because a
    /// protobuf `Timestamp` cannot express one.
    pub fn encode(&self) -> Vec<u8> {
        self.to_pb().encode_to_vec()
    }

    /// Parses broker bytes: the schema version is checked first, then every field.
    pub fn decode(bytes: &[u8]) -> Result<Envelope, EnvelopeError> {
        let raw = pb::DeliveryEnvelope::decode(bytes).map_err(EnvelopeError::Undecodable)?;
        Envelope::try_from(raw)
    }

    fn to_pb(&self) -> pb::DeliveryEnvelope {
        let nanos = self.enqueued_at.timestamp_subsec_nanos().min(999_999_999);
        pb::DeliveryEnvelope {
            schema_version: SCHEMA_VERSION,
            delivery_id: self.delivery_id.to_string(),
            reminder_id: self.reminder_id.to_string(),
            tenant_id: self.tenant_id.to_string(),
            channel: pb::Channel::from(self.channel).into(),
            generation: self.generation,
            lane: pb::Lane::from(self.lane).into(),
            correlation_id: self.correlation_id.clone(),
            enqueued_at: Some(prost_types::Timestamp {
                seconds: self.enqueued_at.timestamp(),
                // Below 1e9 after the clamp, so it fits.
                nanos: i32::try_from(nanos).unwrap_or(999_999_999),
            }),
        }
    }
}

impl TryFrom<pb::DeliveryEnvelope> for Envelope {
    type Error = EnvelopeError;

    fn try_from(raw: pb::DeliveryEnvelope) -> Result<Self, Self::Error> {
        if raw.schema_version != SCHEMA_VERSION {
            return Err(EnvelopeError::UnsupportedSchemaVersion(raw.schema_version));
        }
        let delivery_id = raw
            .delivery_id
            .parse()
            .map_err(|e: nudge_domain::IdError| {
                EnvelopeError::invalid("delivery_id", e.to_string())
            })?;
        let reminder_id = raw
            .reminder_id
            .parse()
            .map_err(|e: nudge_domain::IdError| {
                EnvelopeError::invalid("reminder_id", e.to_string())
            })?;
        let tenant_id = raw.tenant_id.parse().map_err(|e: nudge_domain::IdError| {
            EnvelopeError::invalid("tenant_id", e.to_string())
        })?;
        let channel = match pb::Channel::try_from(raw.channel) {
            Ok(pb::Channel::Push) => Channel::Push,
            Ok(pb::Channel::Email) => Channel::Email,
            Ok(pb::Channel::Sms) => Channel::Sms,
            Ok(pb::Channel::Unspecified) => {
                return Err(EnvelopeError::invalid("channel", "unspecified"));
            }
            Err(_) => return Err(EnvelopeError::invalid("channel", "unknown enum value")),
        };
        let lane = match pb::Lane::try_from(raw.lane) {
            Ok(pb::Lane::New) => Lane::New,
            Ok(pb::Lane::Retry) => Lane::Retry,
            Ok(pb::Lane::Redrive) => Lane::Redrive,
            Ok(pb::Lane::Unspecified) => return Err(EnvelopeError::invalid("lane", "unspecified")),
            Err(_) => return Err(EnvelopeError::invalid("lane", "unknown enum value")),
        };
        let correlation_id = parse_correlation_id(raw.correlation_id)?;
        let enqueued_at = parse_timestamp(raw.enqueued_at)?;
        Ok(Envelope {
            delivery_id,
            reminder_id,
            tenant_id,
            channel,
            generation: raw.generation,
            lane,
            correlation_id,
            enqueued_at,
        })
    }
}

/// Printable ASCII only: the id goes into log lines and AMQP `correlation_id`, where control
/// characters or multi-byte text would be an injection vector or overflow a short string.
fn parse_correlation_id(s: String) -> Result<String, EnvelopeError> {
    const FIELD: &str = "correlation_id";
    if s.is_empty() {
        return Err(EnvelopeError::invalid(FIELD, "empty"));
    }
    if s.len() > CORRELATION_ID_MAX_LEN {
        return Err(EnvelopeError::invalid(
            FIELD,
            format!("longer than {CORRELATION_ID_MAX_LEN} bytes"),
        ));
    }
    if let Some(position) = s.bytes().position(|b| !b.is_ascii_graphic()) {
        return Err(EnvelopeError::invalid(
            FIELD,
            format!("character at byte {position} is not printable ASCII"),
        ));
    }
    Ok(s)
}

fn parse_timestamp(ts: Option<prost_types::Timestamp>) -> Result<DateTime<Utc>, EnvelopeError> {
    const FIELD: &str = "enqueued_at";
    let ts = ts.ok_or_else(|| EnvelopeError::invalid(FIELD, "missing"))?;
    // Protobuf's Timestamp requires 0 <= nanos < 1e9; chrono would read 1e9.. as a leap second.
    let nanos = u32::try_from(ts.nanos)
        .ok()
        .filter(|n| *n < 1_000_000_000)
        .ok_or_else(|| EnvelopeError::invalid(FIELD, "nanos outside 0..1e9"))?;
    DateTime::from_timestamp(ts.seconds, nanos)
        .ok_or_else(|| EnvelopeError::invalid(FIELD, "seconds out of range"))
}

impl From<Channel> for pb::Channel {
    fn from(c: Channel) -> Self {
        match c {
            Channel::Push => pb::Channel::Push,
            Channel::Email => pb::Channel::Email,
            Channel::Sms => pb::Channel::Sms,
        }
    }
}

impl From<Lane> for pb::Lane {
    fn from(l: Lane) -> Self {
        match l {
            Lane::New => pb::Lane::New,
            Lane::Retry => pb::Lane::Retry,
            Lane::Redrive => pb::Lane::Redrive,
        }
    }
}

#[cfg(test)]
mod tests;
