//! The sections a binary's config struct is composed from.
//!
//! Each section checks its own rules in `validate_at(prefix)`, where `prefix` is the key the
//! section sits under in the binary's struct, so errors name the full key. The [`Validate`] impls
//! use the conventional top-level names (`database`, `amqp`, `telemetry`, `crypto`).

use std::net::SocketAddr;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use secrecy::zeroize::Zeroize as _;
use serde::{Deserialize, Serialize};
use url::Url;

use crate::{ConfigError, Secret, Validate};

fn key(prefix: &str, field: &str) -> String {
    if prefix.is_empty() {
        field.to_owned()
    } else {
        format!("{prefix}.{field}")
    }
}

/// Parses `raw` as a URL whose scheme is one of `schemes`.
///
/// The message never includes `raw`: these URLs may carry a password. `url::ParseError` and the
/// scheme do not.
fn check_url(raw: &str, schemes: &[&str], expected: &str) -> Result<(), String> {
    match Url::parse(raw) {
        Ok(url) if schemes.contains(&url.scheme()) => Ok(()),
        Ok(url) => Err(format!("{expected}, found scheme `{}`", url.scheme())),
        Err(e) => Err(format!("{expected} ({e})")),
    }
}

/// PostgreSQL connection settings (the ledger).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// `postgres://` or `postgresql://` connection URL; may hold a password.
    pub url: Secret,
    /// Pool size, 1..=1000.
    pub max_connections: u32,
    /// How long to wait for a pooled connection before failing, > 0.
    pub acquire_timeout_ms: u64,
    /// PostgreSQL's `statement_timeout` for every connection: no statement runs longer.
    pub statement_timeout_ms: u64,
    /// PostgreSQL's `lock_timeout`: no statement waits longer for a row lock (a rate bucket
    /// held by a stalled replica), so one stuck peer cannot stall every worker.
    pub lock_timeout_ms: u64,
    /// PostgreSQL's `idle_in_transaction_session_timeout`: a session that leaves a transaction
    /// open and idle this long is ended, releasing its locks.
    pub idle_in_transaction_timeout_ms: u64,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: Secret::new("postgres://postgres@127.0.0.1:5432/nudge"),
            max_connections: 10,
            acquire_timeout_ms: 5000,
            statement_timeout_ms: 30_000,
            lock_timeout_ms: 2_000,
            idle_in_transaction_timeout_ms: 30_000,
        }
    }
}

impl DatabaseConfig {
    /// Checks the section as it sits under `prefix` (usually `"database"`).
    pub fn validate_at(&self, prefix: &str) -> Result<(), ConfigError> {
        check_url(
            self.url.expose(),
            &["postgres", "postgresql"],
            "expected a postgres:// or postgresql:// URL",
        )
        .map_err(|m| ConfigError::invalid(key(prefix, "url"), m))?;
        if !(1..=1000).contains(&self.max_connections) {
            return Err(ConfigError::invalid(
                key(prefix, "max_connections"),
                format!("must be between 1 and 1000, got {}", self.max_connections),
            ));
        }
        if self.acquire_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                key(prefix, "acquire_timeout_ms"),
                "must be greater than 0",
            ));
        }
        for (field, value) in [
            ("statement_timeout_ms", self.statement_timeout_ms),
            ("lock_timeout_ms", self.lock_timeout_ms),
            (
                "idle_in_transaction_timeout_ms",
                self.idle_in_transaction_timeout_ms,
            ),
        ] {
            if !(100..=3_600_000).contains(&value) {
                return Err(ConfigError::invalid(
                    key(prefix, field),
                    format!("must be between 100 and 3600000, got {value}"),
                ));
            }
        }
        if self.lock_timeout_ms > self.statement_timeout_ms {
            return Err(ConfigError::invalid(
                key(prefix, "lock_timeout_ms"),
                "must not exceed database.statement_timeout_ms",
            ));
        }
        Ok(())
    }
}

impl Validate for DatabaseConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_at("database")
    }
}

/// RabbitMQ connection settings (the transport).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AmqpConfig {
    /// `amqp://` or `amqps://` URL; may hold a password. Used when `urls` is empty.
    pub url: Secret,
    /// The nodes of a RabbitMQ cluster, each an `amqp://` or `amqps://` URL; when not empty it
    /// replaces `url`. A process connects to the first that answers and, when its connection
    /// drops, tries the next ones in turn.
    pub urls: Vec<Secret>,
    /// Unacknowledged deliveries per consumer, >= 1; bounds a worker's concurrency.
    pub prefetch: u16,
    /// How long to wait for the broker connection, > 0.
    pub connect_timeout_ms: u64,
    /// Prefix of every exchange and queue name: empty, or `[a-z0-9-]{1,40}` followed by a
    /// dot (e.g. `"staging."`), so several deployments or test runs can share one broker.
    pub namespace: String,
    /// How many times the broker redelivers a message before dead-lettering it, >= 1.
    pub delivery_limit: u32,
}

impl Default for AmqpConfig {
    fn default() -> Self {
        Self {
            url: Secret::new("amqp://guest:guest@127.0.0.1:5672/%2f"),
            urls: Vec::new(),
            prefetch: 96,
            connect_timeout_ms: 10_000,
            namespace: String::new(),
            delivery_limit: 5,
        }
    }
}

impl AmqpConfig {
    /// The broker addresses to try, in order: `urls`, or `url` alone when `urls` is empty.
    pub fn addresses(&self) -> Vec<&str> {
        if self.urls.is_empty() {
            vec![self.url.expose()]
        } else {
            self.urls.iter().map(Secret::expose).collect()
        }
    }

    /// Checks the section as it sits under `prefix` (usually `"amqp"`).
    pub fn validate_at(&self, prefix: &str) -> Result<(), ConfigError> {
        let amqp_url = |raw: &str| {
            check_url(
                raw,
                &["amqp", "amqps"],
                "expected an amqp:// or amqps:// URL",
            )
        };
        amqp_url(self.url.expose()).map_err(|m| ConfigError::invalid(key(prefix, "url"), m))?;
        for (i, url) in self.urls.iter().enumerate() {
            amqp_url(url.expose())
                .map_err(|m| ConfigError::invalid(key(prefix, &format!("urls.{i}")), m))?;
        }
        if self.urls.len() > MAX_AMQP_URLS {
            return Err(ConfigError::invalid(
                key(prefix, "urls"),
                format!("at most {MAX_AMQP_URLS} addresses, got {}", self.urls.len()),
            ));
        }
        if self.prefetch == 0 {
            return Err(ConfigError::invalid(
                key(prefix, "prefetch"),
                "must be at least 1",
            ));
        }
        if self.connect_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                key(prefix, "connect_timeout_ms"),
                "must be greater than 0",
            ));
        }
        if !valid_namespace(&self.namespace) {
            return Err(ConfigError::invalid(
                key(prefix, "namespace"),
                "must be empty or 1 to 40 of [a-z0-9-] followed by a dot, e.g. \"staging.\"",
            ));
        }
        if self.delivery_limit == 0 {
            return Err(ConfigError::invalid(
                key(prefix, "delivery_limit"),
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

/// A bound on `amqp.urls`, so a reconnect round (one connect timeout per address) stays short.
const MAX_AMQP_URLS: usize = 16;

fn valid_namespace(ns: &str) -> bool {
    if ns.is_empty() {
        return true;
    }
    let Some(body) = ns.strip_suffix('.') else {
        return false;
    };
    (1..=40).contains(&body.len())
        && body
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

impl Validate for AmqpConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_at("amqp")
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One JSON object per line, for log collectors.
    Json,
    /// Human-readable lines, for a terminal.
    #[default]
    Pretty,
}

/// Logs, traces and metrics settings, consumed by `nudge-telemetry`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// `json` or `pretty`.
    pub log_format: LogFormat,
    /// A tracing `EnvFilter` directive string; `RUST_LOG`, when set, wins over it.
    ///
    /// Only checked for emptiness here: the directive grammar belongs to `nudge-telemetry`,
    /// which rejects a bad one at start-up naming this key.
    pub log_filter: String,
    /// OTLP collector endpoint (`http://` or `https://`); no export when unset.
    pub otlp_endpoint: Option<String>,
    /// Address for the Prometheus metrics listener; none when unset.
    pub metrics_addr: Option<SocketAddr>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            log_format: LogFormat::default(),
            log_filter: "info".to_owned(),
            otlp_endpoint: None,
            metrics_addr: None,
        }
    }
}

impl TelemetryConfig {
    /// Checks the section as it sits under `prefix` (usually `"telemetry"`).
    pub fn validate_at(&self, prefix: &str) -> Result<(), ConfigError> {
        if self.log_filter.trim().is_empty() {
            return Err(ConfigError::invalid(
                key(prefix, "log_filter"),
                "must not be empty (use e.g. \"info\")",
            ));
        }
        if let Some(endpoint) = &self.otlp_endpoint {
            check_url(
                endpoint,
                &["http", "https"],
                "expected an http:// or https:// URL",
            )
            .map_err(|m| ConfigError::invalid(key(prefix, "otlp_endpoint"), m))?;
        }
        Ok(())
    }
}

impl Validate for TelemetryConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_at("telemetry")
    }
}

/// Keys for data at rest.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CryptoConfig {
    /// Standard base64 of exactly 32 bytes: the key that encrypts destinations in the ledger.
    pub destination_key: Option<Secret>,
    /// Standard base64 of exactly 32 bytes: the key of the keyed hash (HMAC-SHA256) that
    /// subscriber references are stored as. Needed only by writers (`nudgectl reminders load`,
    /// `nudgectl migrate` to convert rows written before); never by a worker.
    pub subscriber_key: Option<Secret>,
    /// Standard base64 of exactly 32 bytes: the key that seals tenants' signing secrets.
    /// Held by the intake, `nudge-events` and `nudgectl` only, never by a worker (which holds the destination
    /// key). Unset: secrets are sealed with the destination key, as before this key existed.
    pub tenant_secret_key: Option<Secret>,
}

impl CryptoConfig {
    /// Checks the section as it sits under `prefix` (usually `"crypto"`).
    pub fn validate_at(&self, prefix: &str) -> Result<(), ConfigError> {
        self.decode_destination_key(prefix)?;
        decode_key(self.subscriber_key.as_ref(), &key(prefix, "subscriber_key"))?;
        decode_key(
            self.tenant_secret_key.as_ref(),
            &key(prefix, "tenant_secret_key"),
        )
        .map(|_| ())
    }

    /// The decoded tenant secret key, `None` when not configured. Errors name
    /// `crypto.tenant_secret_key`, never the value.
    pub fn tenant_secret_key_bytes(&self) -> Result<Option<[u8; 32]>, ConfigError> {
        decode_key(self.tenant_secret_key.as_ref(), "crypto.tenant_secret_key")
    }

    /// The decoded subscriber key, `None` when not configured. Errors name
    /// `crypto.subscriber_key`, never the value.
    pub fn subscriber_key_bytes(&self) -> Result<Option<[u8; 32]>, ConfigError> {
        decode_key(self.subscriber_key.as_ref(), "crypto.subscriber_key")
    }

    /// The decoded destination key, `None` when not configured.
    ///
    /// Errors name `crypto.destination_key`; neither the value nor its decoded bytes are ever
    /// part of an error.
    pub fn destination_key_bytes(&self) -> Result<Option<[u8; 32]>, ConfigError> {
        self.decode_destination_key("crypto")
    }

    fn decode_destination_key(&self, prefix: &str) -> Result<Option<[u8; 32]>, ConfigError> {
        decode_key(
            self.destination_key.as_ref(),
            &key(prefix, "destination_key"),
        )
    }
}

/// A 32-byte key given as standard base64; errors name `name`, never the value.
fn decode_key(encoded: Option<&Secret>, name: &str) -> Result<Option<[u8; 32]>, ConfigError> {
    let Some(encoded) = encoded else {
        return Ok(None);
    };
    let invalid = |message: &str| ConfigError::invalid(name, message);
    // The decode error is dropped: base64's messages quote offending bytes of the secret.
    let mut decoded = STANDARD
        .decode(encoded.expose().trim())
        .map_err(|_| invalid("expected standard base64 (the value is not shown)"))?;
    let bytes = <[u8; 32]>::try_from(decoded.as_slice()).map_err(|_| {
        invalid(&format!(
            "expected base64 of exactly 32 bytes, got {} bytes",
            decoded.len()
        ))
    });
    decoded.zeroize();
    bytes.map(Some)
}

impl Validate for CryptoConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_at("crypto")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_section_default_is_valid() {
        assert!(DatabaseConfig::default().validate().is_ok());
        assert!(AmqpConfig::default().validate().is_ok());
        assert!(TelemetryConfig::default().validate().is_ok());
        assert!(CryptoConfig::default().validate().is_ok());
    }

    #[test]
    fn a_postgresql_scheme_is_accepted_and_a_mysql_one_is_not() {
        let mut db = DatabaseConfig {
            url: Secret::new("postgresql://u:p@db/nudge"),
            ..DatabaseConfig::default()
        };
        assert!(db.validate().is_ok());
        db.url = Secret::new("mysql://u:s3cr3t@db/nudge");
        let message = db.validate().map_err(|e| e.to_string()).err();
        let message = message.unwrap_or_default();
        assert!(message.starts_with("invalid configuration: database.url: expected a postgres://"));
        assert!(!message.contains("s3cr3t"), "{message}");
    }

    #[test]
    fn errors_name_the_key_under_the_given_prefix() {
        let db = DatabaseConfig {
            max_connections: 0,
            ..DatabaseConfig::default()
        };
        let err = db.validate_at("ledger_db").err().and_then(|e| e.key());
        assert_eq!(err.as_deref(), Some("ledger_db.max_connections"));
    }

    #[test]
    fn a_zero_prefetch_is_rejected() {
        let amqp = AmqpConfig {
            prefetch: 0,
            ..AmqpConfig::default()
        };
        let key = amqp.validate().err().and_then(|e| e.key());
        assert_eq!(key.as_deref(), Some("amqp.prefetch"));
    }

    #[test]
    fn an_amqp_url_must_be_amqp_or_amqps() {
        let amqp = AmqpConfig {
            url: Secret::new("http://guest:guest@localhost/"),
            ..AmqpConfig::default()
        };
        assert_eq!(
            amqp.validate().err().and_then(|e| e.key()).as_deref(),
            Some("amqp.url")
        );
        let amqps = AmqpConfig {
            url: Secret::new("amqps://guest:guest@localhost/%2f"),
            ..AmqpConfig::default()
        };
        assert!(amqps.validate().is_ok());
    }

    #[test]
    fn the_cluster_addresses_replace_the_single_url_and_a_bad_one_is_named_by_position() {
        let single = AmqpConfig::default();
        assert_eq!(single.addresses(), vec![single.url.expose()]);

        let cluster = AmqpConfig {
            urls: vec![
                Secret::new("amqp://guest:guest@127.0.0.1:5701/%2f"),
                Secret::new("amqp://guest:guest@127.0.0.1:5702/%2f"),
            ],
            ..AmqpConfig::default()
        };
        assert!(cluster.validate().is_ok());
        assert_eq!(
            cluster.addresses(),
            vec![
                "amqp://guest:guest@127.0.0.1:5701/%2f",
                "amqp://guest:guest@127.0.0.1:5702/%2f"
            ]
        );

        let bad = AmqpConfig {
            urls: vec![
                Secret::new("amqp://guest:guest@127.0.0.1:5701/%2f"),
                Secret::new("http://guest:s3cret@127.0.0.1:5702/"),
            ],
            ..AmqpConfig::default()
        };
        let error = bad.validate().unwrap_err();
        assert_eq!(error.key().as_deref(), Some("amqp.urls.1"));
        assert!(!error.to_string().contains("s3cret"), "{error}");

        let too_many = AmqpConfig {
            urls: vec![Secret::new("amqp://127.0.0.1/%2f"); MAX_AMQP_URLS + 1],
            ..AmqpConfig::default()
        };
        assert_eq!(
            too_many.validate().err().and_then(|e| e.key()).as_deref(),
            Some("amqp.urls")
        );
    }

    #[test]
    fn telemetry_needs_a_filter_and_an_http_otlp_endpoint() {
        let empty = TelemetryConfig {
            log_filter: "  ".to_owned(),
            ..TelemetryConfig::default()
        };
        assert_eq!(
            empty.validate().err().and_then(|e| e.key()).as_deref(),
            Some("telemetry.log_filter")
        );
        let grpc = TelemetryConfig {
            otlp_endpoint: Some("grpc://collector:4317".to_owned()),
            ..TelemetryConfig::default()
        };
        assert_eq!(
            grpc.validate().err().and_then(|e| e.key()).as_deref(),
            Some("telemetry.otlp_endpoint")
        );
        let http = TelemetryConfig {
            otlp_endpoint: Some("http://collector:4318".to_owned()),
            ..TelemetryConfig::default()
        };
        assert!(http.validate().is_ok());
    }

    #[test]
    fn a_32_byte_base64_destination_key_decodes() {
        let crypto = CryptoConfig {
            destination_key: Some(Secret::new(STANDARD.encode([7u8; 32]))),
            ..CryptoConfig::default()
        };
        assert!(crypto.validate().is_ok());
        assert_eq!(
            crypto.destination_key_bytes().ok().flatten(),
            Some([7u8; 32])
        );
        assert_eq!(
            CryptoConfig::default().destination_key_bytes().ok(),
            Some(None)
        );
    }

    #[test]
    fn a_malformed_tenant_secret_key_names_its_key_but_not_the_value() {
        let crypto = CryptoConfig {
            tenant_secret_key: Some(Secret::new("c2hvcnQ=")),
            ..CryptoConfig::default()
        };
        let message = crypto.validate().map_err(|e| e.to_string()).err();
        let message = message.unwrap_or_default();
        assert!(
            message.starts_with("invalid configuration: crypto.tenant_secret_key: "),
            "{message}"
        );
        assert!(!message.contains("c2hvcnQ="), "{message}");
        let valid = CryptoConfig {
            tenant_secret_key: Some(Secret::new(STANDARD.encode([3u8; 32]))),
            ..CryptoConfig::default()
        };
        assert_eq!(
            valid.tenant_secret_key_bytes().ok().flatten(),
            Some([3u8; 32])
        );
    }

    #[test]
    fn a_short_or_malformed_destination_key_names_the_key_but_not_the_value() {
        for value in [STANDARD.encode([7u8; 16]), "not base64 !!".to_owned()] {
            let crypto = CryptoConfig {
                destination_key: Some(Secret::new(value.clone())),
                ..CryptoConfig::default()
            };
            let message = crypto
                .validate()
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                message.starts_with("invalid configuration: crypto.destination_key: "),
                "{message}"
            );
            assert!(!message.contains(&value), "{message}");
            assert!(crypto.destination_key_bytes().is_err());
        }
    }

    #[test]
    fn debug_of_a_section_does_not_print_the_password() {
        let db = DatabaseConfig {
            url: Secret::new("postgres://nudge:s3cr3t-pw@db:5432/nudge"),
            ..DatabaseConfig::default()
        };
        let amqp = AmqpConfig {
            url: Secret::new("amqp://nudge:s3cr3t-pw@mq:5672/%2f"),
            ..AmqpConfig::default()
        };
        let printed = format!("{db:?} {amqp:?}");
        assert!(!printed.contains("s3cr3t-pw"), "{printed}");
        assert!(printed.contains("[redacted]"));
    }
}

/// The retry policy (`nudge_domain::RetryPolicy`): workers decide attempts with it and the
/// janitor's lease reaper decides expired leases with it, so both read this one section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Backoff base, in milliseconds (>= 1).
    pub base_delay_ms: u64,
    /// Backoff cap, in milliseconds (>= base).
    pub max_delay_ms: u64,
    /// Attempts before a retryable failure dead-letters (>= 1).
    pub max_attempts: u32,
    /// Longest Retry-After honoured, in seconds (> 0); a longer one dead-letters.
    pub max_retry_after_s: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            base_delay_ms: 1_000,
            max_delay_ms: 300_000,
            max_attempts: 8,
            max_retry_after_s: 3_600,
        }
    }
}

impl RetryConfig {
    /// The policy, or an error naming the `retry` section and the broken rule.
    pub fn policy(&self) -> Result<nudge_domain::RetryPolicy, ConfigError> {
        nudge_domain::RetryPolicy::new(
            std::time::Duration::from_millis(self.base_delay_ms),
            std::time::Duration::from_millis(self.max_delay_ms),
            self.max_attempts,
            std::time::Duration::from_secs(self.max_retry_after_s),
        )
        .map_err(|e| ConfigError::invalid("retry", e.to_string()))
    }
}
