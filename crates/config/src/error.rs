use std::path::PathBuf;

use figment::error::Kind;

/// Why a configuration could not be loaded or was rejected.
///
/// Every variant names what is wrong (a dotted key such as `database.url`, or a file path) in its
/// `Display`; the underlying cause stays reachable through `source()`, so report it with the
/// whole chain. No variant ever carries a configured value, so printing one cannot leak a secret.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value was read and has the right type, but breaks a rule (checked by [`crate::Validate`]).
    #[error("invalid configuration: {key}: {message}")]
    Invalid {
        /// Dotted key path, e.g. `database.url`.
        key: String,
        /// What is expected; never contains the configured value.
        message: String,
    },

    /// figment could not build the struct: wrong type, unknown key, missing field, bad TOML.
    ///
    /// `Display` names the dotted key figment reports (none for a TOML syntax error, where the
    /// source gives the line); the source (figment's own message) says what was wrong and which
    /// provider (file or environment) supplied it. Boxed because
    /// `figment::Error` is large and this is the cold path.
    #[error("invalid configuration{}", figment_key(.0).map(|k| format!(": {k}")).unwrap_or_default())]
    Figment(#[source] Box<figment::Error>),

    /// A `NUDGE_` environment variable that is no configuration key and not one of the listed
    /// variables read elsewhere ([`crate::NOT_CONFIG_VARIABLES`]), most likely a misspelt key.
    #[error(
        "unknown environment variable {name}: a key is NUDGE_<SECTION>__<KEY>, with two \
         underscores between levels (e.g. NUDGE_DATABASE__URL), for a section of \
         nudge's configuration; unset it or fix its name"
    )]
    UnknownVariable {
        /// The variable's name; its value is never kept.
        name: String,
    },

    /// The configuration file named by `--config` or `NUDGE_CONFIG` could not be read.
    #[error("cannot read configuration file {}", path.display())]
    File {
        /// The path as it was given.
        path: PathBuf,
        /// Why it could not be read (missing, permissions, a directory, ...).
        #[source]
        source: std::io::Error,
    },
}

impl ConfigError {
    /// Shorthand for [`ConfigError::Invalid`], for binaries validating their own keys.
    pub fn invalid(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            key: key.into(),
            message: message.into(),
        }
    }

    /// The dotted key this error is about, when there is one.
    pub fn key(&self) -> Option<String> {
        match self {
            Self::Invalid { key, .. } => Some(key.clone()),
            Self::Figment(e) => figment_key(e),
            Self::File { .. } | Self::UnknownVariable { .. } => None,
        }
    }
}

impl From<figment::Error> for ConfigError {
    fn from(error: figment::Error) -> Self {
        Self::Figment(Box::new(error))
    }
}

/// The dotted key a figment error is about.
///
/// figment's path usually ends at the offending key, but for a missing field it can stop at the
/// enclosing map, with the field name only in the kind; append it then to name the exact key.
fn figment_key(error: &figment::Error) -> Option<String> {
    let mut path = error.path.clone();
    let field = match &error.kind {
        Kind::UnknownField(field, _) => Some(field.as_str()),
        Kind::MissingField(field) => Some(field.as_ref()),
        Kind::DuplicateField(field) => Some(*field),
        _ => None,
    };
    if let Some(field) = field
        && path.last().map(String::as_str) != Some(field)
    {
        path.push(field.to_owned());
    }
    (!path.is_empty()).then(|| path.join("."))
}
