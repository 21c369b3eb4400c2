//! Identifiers and the small values that name things, each parsed once at the edge.
//!
//! Errors never echo the rejected text: some of these values (a [`SubscriberRef`]) are sensitive,
//! and an error message is exactly the kind of thing that ends up in a log line.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Why an identifier or enumerated name was rejected. Says which field and why, never the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The text is not a UUID.
    #[error("{field} is not a valid UUID")]
    InvalidUuid {
        field: &'static str,
        #[source]
        source: uuid::Error,
    },
    /// The text is empty.
    #[error("{field} must not be empty")]
    Empty { field: &'static str },
    /// The text is longer than the field allows.
    #[error("{field} is {len} bytes long, at most {max} are allowed")]
    TooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
    /// A byte at `position` is outside the field's alphabet.
    #[error("{field} has a character not allowed at byte {position}: {allowed}")]
    InvalidCharacter {
        field: &'static str,
        position: usize,
        allowed: &'static str,
    },
    /// The text does not have the shape the field requires.
    #[error("{field} does not have the expected shape: {expected}")]
    InvalidFormat {
        field: &'static str,
        expected: &'static str,
    },
    /// Not one of the channel names `push`, `email`, `sms`.
    #[error("unknown channel: expected one of push, email, sms")]
    UnknownChannel,
    /// Not one of the delivery state names.
    #[error("unknown delivery state")]
    UnknownState,
    /// Not one of the outcome class names.
    #[error("unknown outcome class: expected one of delivered, retryable, terminal, ambiguous")]
    UnknownOutcomeClass,
}

macro_rules! uuid_id {
    ($(#[$meta:meta])* $name:ident, $field:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(Uuid);

        // A freshly generated id is not a "default" value; `Default` would hide that it is random.
        #[allow(clippy::new_without_default)]
        impl $name {
            /// A new time-ordered (v7) id, so that ids sort roughly by creation time in indexes.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }

            /// Wraps a UUID that is already known to name this kind of thing (e.g. a ledger row).
            pub const fn from_uuid(uuid: Uuid) -> Self {
                Self(uuid)
            }

            pub const fn as_uuid(&self) -> Uuid {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0.hyphenated(), f)
            }
        }

        impl FromStr for $name {
            type Err = IdError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s)
                    .map(Self)
                    .map_err(|source| IdError::InvalidUuid { field: $field, source })
            }
        }

        impl From<$name> for Uuid {
            fn from(id: $name) -> Uuid {
                id.0
            }
        }
    };
}

uuid_id!(
    /// A clinic (customer) of nudge.
    TenantId,
    "tenant id"
);
uuid_id!(
    /// One reminder as received from a tenant; it fans out to one delivery per channel.
    ReminderId,
    "reminder id"
);
uuid_id!(
    /// One `(reminder, channel)` delivery, the unit the ledger tracks.
    DeliveryId,
    "delivery id"
);

/// One redrive, as the ledger numbers it (`redrives.id`): a whole number from 1.
///
/// Parsed once where it enters (an operator's argument, a row read back), so a function that
/// takes a `RedriveId` never meets zero, a negative number or text. It serializes as the bare
/// number, as the operator's `--json` output always showed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "i64", into = "i64")]
pub struct RedriveId(i64);

impl RedriveId {
    const FIELD: &str = "redrive id";
    const EXPECTED: &str = "a whole number from 1";

    /// Decimal digits only (no sign, no spaces), at least 1 and at most `i64::MAX`.
    pub fn parse(s: &str) -> Result<Self, IdError> {
        if s.is_empty() {
            return Err(IdError::Empty { field: Self::FIELD });
        }
        let malformed = IdError::InvalidFormat {
            field: Self::FIELD,
            expected: Self::EXPECTED,
        };
        if !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(malformed);
        }
        let n: i64 = s.parse().map_err(|_| malformed)?;
        Self::try_from(n)
    }

    /// The number as the ledger stores it, for binding in a statement.
    pub const fn get(self) -> i64 {
        self.0
    }
}

impl TryFrom<i64> for RedriveId {
    type Error = IdError;

    fn try_from(n: i64) -> Result<Self, Self::Error> {
        if n >= 1 {
            Ok(Self(n))
        } else {
            Err(IdError::InvalidFormat {
                field: Self::FIELD,
                expected: Self::EXPECTED,
            })
        }
    }
}

impl From<RedriveId> for i64 {
    fn from(id: RedriveId) -> i64 {
        id.0
    }
}

impl fmt::Display for RedriveId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// The way a reminder reaches a person.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Channel {
    Push,
    Email,
    Sms,
}

impl Channel {
    pub const ALL: [Channel; 3] = [Channel::Push, Channel::Email, Channel::Sms];

    /// The stable lowercase name used in queue names, database rows and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Channel::Push => "push",
            Channel::Email => "email",
            Channel::Sms => "sms",
        }
    }
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Channel {
    type Err = IdError;

    /// Case-sensitive on purpose: the names are identifiers we write ourselves, so `SMS` is a bug
    /// upstream rather than something to be forgiving about.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Channel::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or(IdError::UnknownChannel)
    }
}

const VISIBLE_ASCII: &str = "printable ASCII without whitespace";

/// Checks the length and that every byte is printable ASCII other than space (0x21..=0x7E).
fn check_visible_ascii(field: &'static str, s: &str, max: usize) -> Result<(), IdError> {
    if s.is_empty() {
        return Err(IdError::Empty { field });
    }
    if s.len() > max {
        return Err(IdError::TooLong {
            field,
            len: s.len(),
            max,
        });
    }
    match s.bytes().position(|b| !b.is_ascii_graphic()) {
        Some(position) => Err(IdError::InvalidCharacter {
            field,
            position,
            allowed: VISIBLE_ASCII,
        }),
        None => Ok(()),
    }
}

/// Implements `FromStr`, `TryFrom<&str>` and `TryFrom<String>` in terms of `parse`.
macro_rules! parse_impls {
    ($name:ident) => {
        impl FromStr for $name {
            type Err = IdError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::parse(s)
            }
        }

        impl TryFrom<&str> for $name {
            type Error = IdError;

            fn try_from(s: &str) -> Result<Self, Self::Error> {
                Self::parse(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;

            fn try_from(s: String) -> Result<Self, Self::Error> {
                Self::parse(&s)
            }
        }
    };
}

/// The tenant's opaque identifier for the person a reminder is for.
///
/// It may identify a patient, so it is treated like PHI: `Debug` is redacted, there is no
/// `Display` and no `Serialize`, so it cannot slip into a log line, a metric label or a queue
/// message by accident. [`SubscriberRef::as_str`] exists for storage only.
#[derive(Clone, PartialEq, Eq, Hash, Deserialize)]
#[serde(try_from = "String")]
pub struct SubscriberRef(String);

impl SubscriberRef {
    pub const MAX_LEN: usize = 128;

    pub fn parse(s: &str) -> Result<Self, IdError> {
        check_visible_ascii("subscriber reference", s, Self::MAX_LEN)?;
        Ok(Self(s.to_owned()))
    }

    /// For writing to the ledger only; never log or label with it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SubscriberRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SubscriberRef(<redacted>)")
    }
}

parse_impls!(SubscriberRef);

/// One account at an external provider; rate buckets are keyed by account and channel.
///
/// The alphabet is narrow because the name appears in metric labels and bucket keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ProviderAccount(String);

impl ProviderAccount {
    pub const MAX_LEN: usize = 64;

    pub fn parse(s: &str) -> Result<Self, IdError> {
        const FIELD: &str = "provider account";
        if s.is_empty() {
            return Err(IdError::Empty { field: FIELD });
        }
        if s.len() > Self::MAX_LEN {
            return Err(IdError::TooLong {
                field: FIELD,
                len: s.len(),
                max: Self::MAX_LEN,
            });
        }
        for (position, b) in s.bytes().enumerate() {
            let ok = if position == 0 {
                b.is_ascii_lowercase() || b.is_ascii_digit()
            } else {
                b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'
            };
            if !ok {
                return Err(IdError::InvalidCharacter {
                    field: FIELD,
                    position,
                    allowed: if position == 0 {
                        "a lowercase letter or digit first"
                    } else {
                        "lowercase letters, digits, '_' and '-'"
                    },
                });
            }
        }
        Ok(Self(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ProviderAccount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<ProviderAccount> for String {
    fn from(v: ProviderAccount) -> String {
        v.0
    }
}

parse_impls!(ProviderAccount);

/// The tenant's id for the event that asked for a reminder; unique per tenant, it is what makes
/// a repeated webhook a no-op.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct EventId(String);

impl EventId {
    pub const MAX_LEN: usize = 200;

    pub fn parse(s: &str) -> Result<Self, IdError> {
        check_visible_ascii("event id", s, Self::MAX_LEN)?;
        Ok(Self(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<EventId> for String {
    fn from(v: EventId) -> String {
        v.0
    }
}

parse_impls!(EventId);
parse_impls!(RedriveId);

/// The `Idempotency-Key` sent to a provider on every attempt and redrive of one delivery.
///
/// It is a function of `(reminder, channel)` alone: never of the destination (which may change,
/// and is PHI) nor of the attempt, so that a provider that dedups by key sees one send however
/// many times we retry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct IdempotencyKey {
    text: String,
    reminder_id: ReminderId,
    channel: Channel,
}

impl IdempotencyKey {
    const PREFIX: &str = "nudge-";
    const EXPECTED: &str = "nudge-<reminder uuid, hyphenated lowercase>-<push|email|sms>";
    const UUID_LEN: usize = 36;

    pub fn for_delivery(reminder_id: ReminderId, channel: Channel) -> Self {
        Self {
            text: format!(
                "{}{}-{}",
                Self::PREFIX,
                reminder_id.as_uuid().hyphenated(),
                channel
            ),
            reminder_id,
            channel,
        }
    }

    /// Accepts exactly what [`IdempotencyKey::for_delivery`] produces, so that a key read back
    /// from storage is byte-for-byte the one sent before.
    pub fn parse(s: &str) -> Result<Self, IdError> {
        let malformed = IdError::InvalidFormat {
            field: "idempotency key",
            expected: Self::EXPECTED,
        };
        let rest = s.strip_prefix(Self::PREFIX).ok_or(malformed.clone())?;
        let (uuid_text, channel_text) =
            match (rest.get(..Self::UUID_LEN), rest.get(Self::UUID_LEN..)) {
                (Some(u), Some(c)) => (u, c),
                _ => return Err(malformed),
            };
        let channel_text = channel_text.strip_prefix('-').ok_or(malformed.clone())?;
        let uuid = Uuid::try_parse(uuid_text).map_err(|_| malformed.clone())?;
        let channel: Channel = channel_text.parse().map_err(|_| malformed.clone())?;
        let key = Self::for_delivery(ReminderId::from_uuid(uuid), channel);
        // Uuid parsing forgives uppercase; the key must not, or two spellings would name one send.
        if key.text != s {
            return Err(malformed);
        }
        Ok(key)
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn reminder_id(&self) -> ReminderId {
        self.reminder_id
    }

    pub fn channel(&self) -> Channel {
        self.channel
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl From<IdempotencyKey> for String {
    fn from(v: IdempotencyKey) -> String {
        v.text
    }
}

parse_impls!(IdempotencyKey);

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ids_display_as_hyphenated_lowercase_and_parse_back() {
        let id = ReminderId::new();
        let text = id.to_string();
        assert_eq!(text, id.as_uuid().hyphenated().to_string());
        assert_eq!(text.parse::<ReminderId>(), Ok(id));
        let tenant = TenantId::from_uuid(id.as_uuid());
        assert_eq!(tenant.as_uuid(), id.as_uuid());
    }

    #[test]
    fn a_non_uuid_is_rejected_naming_the_field() {
        let err = "not-a-uuid".parse::<DeliveryId>().unwrap_err();
        assert!(matches!(
            err,
            IdError::InvalidUuid {
                field: "delivery id",
                ..
            }
        ));
        assert!(err.to_string().contains("delivery id"));
    }

    #[test]
    fn new_ids_are_version_7_and_distinct() {
        let a = TenantId::new();
        let b = TenantId::new();
        assert_ne!(a, b);
        assert_eq!(a.as_uuid().get_version_num(), 7);
    }

    #[test]
    fn ids_serialize_as_a_bare_uuid_string() {
        let id = DeliveryId::from_uuid(Uuid::nil());
        let text = serde_json::to_string(&id).unwrap();
        assert_eq!(text, "\"00000000-0000-0000-0000-000000000000\"");
        assert_eq!(serde_json::from_str::<DeliveryId>(&text).unwrap(), id);
    }

    #[test]
    fn a_redrive_id_is_a_whole_number_from_1_and_shows_as_one() {
        let id = RedriveId::parse("7").unwrap();
        assert_eq!(id.get(), 7);
        assert_eq!(id.to_string(), "7");
        assert_eq!(serde_json::to_string(&id).unwrap(), "7");
        assert_eq!(serde_json::from_str::<RedriveId>("7").unwrap(), id);
        assert_eq!(RedriveId::try_from(7_i64), Ok(id));
        assert_eq!(i64::from(id), 7);
        assert_eq!(
            RedriveId::parse(&i64::MAX.to_string()).unwrap().get(),
            i64::MAX
        );
        assert!(matches!(
            RedriveId::parse(""),
            Err(IdError::Empty {
                field: "redrive id"
            })
        ));
        for bad in [
            "0",
            "-1",
            "+1",
            " 1",
            "1 ",
            "1.0",
            "x",
            "9223372036854775808",
        ] {
            let err = RedriveId::parse(bad).unwrap_err();
            assert!(
                matches!(
                    err,
                    IdError::InvalidFormat {
                        field: "redrive id",
                        ..
                    }
                ),
                "{bad:?}: {err:?}"
            );
        }
        assert!(RedriveId::try_from(0_i64).is_err());
        assert!(RedriveId::try_from(-5_i64).is_err());
        assert!(serde_json::from_str::<RedriveId>("0").is_err());
    }

    #[test]
    fn channels_round_trip_through_their_lowercase_names_only() {
        for c in Channel::ALL {
            assert_eq!(c.as_str().parse::<Channel>(), Ok(c));
            assert_eq!(c.to_string(), c.as_str());
            assert_eq!(
                serde_json::to_string(&c).unwrap(),
                format!("\"{}\"", c.as_str())
            );
        }
        assert_eq!("SMS".parse::<Channel>(), Err(IdError::UnknownChannel));
        assert_eq!("Push".parse::<Channel>(), Err(IdError::UnknownChannel));
        assert_eq!("".parse::<Channel>(), Err(IdError::UnknownChannel));
    }

    #[test]
    fn a_subscriber_ref_never_shows_its_value_in_debug_or_errors() {
        let r = SubscriberRef::parse("patient-12345").unwrap();
        assert_eq!(format!("{r:?}"), "SubscriberRef(<redacted>)");
        assert_eq!(r.as_str(), "patient-12345");

        let err = SubscriberRef::parse("patient 12345").unwrap_err();
        assert!(!err.to_string().contains("patient"));
        assert_eq!(
            err,
            IdError::InvalidCharacter {
                field: "subscriber reference",
                position: 7,
                allowed: VISIBLE_ASCII
            }
        );
    }

    #[test]
    fn a_subscriber_ref_is_one_to_128_visible_ascii_bytes() {
        assert!(SubscriberRef::parse(&"a".repeat(128)).is_ok());
        assert!(matches!(
            SubscriberRef::parse(&"a".repeat(129)),
            Err(IdError::TooLong { max: 128, .. })
        ));
        assert!(matches!(
            SubscriberRef::parse(""),
            Err(IdError::Empty { .. })
        ));
        assert!(SubscriberRef::parse("tab\there").is_err());
        assert!(SubscriberRef::parse("é").is_err());
        assert!(SubscriberRef::parse("a\u{7f}").is_err());
        assert!(SubscriberRef::parse("!~").is_ok());
    }

    #[test]
    fn a_provider_account_starts_with_a_letter_or_digit_and_stays_lowercase() {
        for ok in ["twilio-main", "0", "a_b-c", &"x".repeat(64)] {
            assert_eq!(ProviderAccount::parse(ok).unwrap().as_str(), ok);
        }
        for bad in [
            "",
            "-lead",
            "_lead",
            "Upper",
            "has space",
            "dot.ted",
            &"x".repeat(65),
        ] {
            assert!(ProviderAccount::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(ProviderAccount::parse("acct").unwrap().to_string(), "acct");
    }

    #[test]
    fn an_event_id_is_one_to_200_visible_ascii_bytes() {
        assert!(EventId::parse(&"e".repeat(200)).is_ok());
        assert!(EventId::parse(&"e".repeat(201)).is_err());
        assert!(EventId::parse("").is_err());
        assert!(EventId::parse("evt 1").is_err());
        assert_eq!(EventId::parse("evt_01:x").unwrap().to_string(), "evt_01:x");
    }

    #[test]
    fn the_idempotency_key_is_deterministic_and_differs_per_channel() {
        let reminder = ReminderId::new();
        let a = IdempotencyKey::for_delivery(reminder, Channel::Sms);
        let b = IdempotencyKey::for_delivery(reminder, Channel::Sms);
        assert_eq!(a, b);
        let keys: std::collections::HashSet<_> = Channel::ALL
            .into_iter()
            .map(|c| IdempotencyKey::for_delivery(reminder, c).to_string())
            .collect();
        assert_eq!(keys.len(), 3);
    }

    #[test]
    fn the_idempotency_key_has_the_documented_shape() {
        let uuid = Uuid::parse_str("0190f3e4-7b1c-7a00-8000-00000000abcd").unwrap();
        let key = IdempotencyKey::for_delivery(ReminderId::from_uuid(uuid), Channel::Email);
        assert_eq!(
            key.as_str(),
            "nudge-0190f3e4-7b1c-7a00-8000-00000000abcd-email"
        );
        assert_eq!(key.reminder_id().as_uuid(), uuid);
        assert_eq!(key.channel(), Channel::Email);
    }

    #[test]
    fn the_idempotency_key_parses_only_its_own_shape() {
        let key = IdempotencyKey::for_delivery(ReminderId::new(), Channel::Push);
        assert_eq!(IdempotencyKey::parse(key.as_str()), Ok(key.clone()));
        let upper = key.as_str().replace("nudge-", "").to_uppercase();
        for bad in [
            String::new(),
            "nudge-".to_owned(),
            format!("nudge-{upper}"),
            format!("{}x", key.as_str()),
            key.as_str().replace("-push", "-fax"),
            key.as_str().replace("-push", "push"),
            key.as_str().replace("nudge-", "nudge_"),
            "nudge-0190f3e47b1c7a00800000000000abcd-sms".to_owned(),
            "nudge-é".to_owned(),
        ] {
            assert!(IdempotencyKey::parse(&bad).is_err(), "{bad:?} accepted");
        }
    }

    proptest! {
        #[test]
        fn any_uuid_makes_an_idempotency_key_that_parses_back(bytes in any::<[u8; 16]>(), c in 0usize..3) {
            let key = IdempotencyKey::for_delivery(ReminderId::from_uuid(Uuid::from_bytes(bytes)), Channel::ALL[c]);
            prop_assert_eq!(IdempotencyKey::parse(key.as_str()), Ok(key));
        }

        #[test]
        fn parsing_arbitrary_text_never_panics(s in ".*") {
            let _ = SubscriberRef::parse(&s);
            let _ = ProviderAccount::parse(&s);
            let _ = EventId::parse(&s);
            let _ = IdempotencyKey::parse(&s);
            let _ = s.parse::<Channel>();
            let _ = s.parse::<TenantId>();
            let _ = RedriveId::parse(&s);
        }

        #[test]
        fn any_positive_number_is_a_redrive_id_that_prints_and_parses_back(n in 1..=i64::MAX) {
            let id = RedriveId::try_from(n).unwrap();
            prop_assert_eq!(RedriveId::parse(&id.to_string()), Ok(id));
            prop_assert_eq!(id.get(), n);
        }

        #[test]
        fn any_visible_ascii_event_id_round_trips(s in "[!-~]{1,200}") {
            let id = EventId::parse(&s).unwrap();
            prop_assert_eq!(id.as_str(), s.as_str());
        }
    }
}
