use std::fmt;

use secrecy::{ExposeSecret, SecretString};
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// A configured secret (a URL with a password, a key): `Debug` and `Display` print `[redacted]`.
///
/// Deserializes from a plain string. Non-string input is rejected *without* echoing it, because
/// serde's usual "invalid type: found 12345" would put the secret into an error message.
///
/// It also serializes to the real value. That exists only so a config struct's `Default` can seed
/// figment through `Serialized::defaults`, which goes through `Serialize`; the defaults are
/// development values, and nothing in nudge serializes a loaded config anywhere else. Do not
/// serialize a config holding real secrets into logs, responses or files.
#[derive(Clone)]
pub struct Secret(SecretString);

impl Secret {
    /// Wraps a value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(SecretString::from(value.into()))
    }

    /// The secret itself, for the one place that needs it (a connection string, a cipher key).
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self::new(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self::new(value)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.expose())
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_string(SecretVisitor)
    }
}

struct SecretVisitor;

const NOT_A_STRING: &str =
    "expected a string for a secret (the value is not shown; quote it if it looks like a number)";

impl Visitor<'_> for SecretVisitor {
    type Value = Secret;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Secret, E> {
        Ok(Secret::new(v))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Secret, E> {
        Ok(Secret::new(v))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_i128<E: de::Error>(self, _: i128) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_u128<E: de::Error>(self, _: u128) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_char<E: de::Error>(self, _: char) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_display_are_redacted() {
        let secret = Secret::new("hunter2");
        assert_eq!(format!("{secret:?}"), "[redacted]");
        assert_eq!(format!("{secret}"), "[redacted]");
        assert_eq!(secret.expose(), "hunter2");
    }
}
