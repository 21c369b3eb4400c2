//! `nudge-console`: the on-call console, one web site over the ledger (decision 0701).
//!
//! Server-rendered HTML pages answer the questions of an incident: what is waiting and how
//! late (per channel and per tenant), what is leased, what will retry, what was rejected (the
//! dead letters and held work), what the redrives are doing, what happened to one reminder
//! (the trace) and who changed what (the audit log). Reading needs no JavaScript.
//!
//! - **Who.** A session starts with a console token (`nudgectl console token create --role
//!   viewer|operator`, stored hashed, expiring, revocable) or, when `console.trusted_header`
//!   is set, with the name an authenticating proxy puts in that header. Sessions are cookies
//!   signed with `console.session_key` (`HttpOnly`, `SameSite=Strict`, `Secure` unless
//!   `console.secure_cookies` is off); a revoked or expired token ends them at their next
//!   request.
//! - **Actions.** Only an `operator` session may act; each form carries the session's CSRF
//!   token and a reason, and each action is the ledger function `nudgectl` calls, writing its
//!   audit row (actor `console:<name>`) in the same transaction. A viewer's POST is refused
//!   with 403 and writes nothing.
//! - **No PHI.** Pages show ids, classes, counts and times; the console holds no key that
//!   opens a destination or content, and connects as the `nudge_console` role.
//!
//! It must never take an action for a session that is not an operator's, or one whose form
//! lacks the session's CSRF token.

pub mod metrics;
pub mod session;
mod templates;
pub mod web;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use nudge_config::{ConfigError, DatabaseConfig, Secret, TelemetryConfig, Validate};
use nudge_ledger::ConsoleRole;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tracing::{info, warn};

pub use metrics::ConsoleMetrics;
pub use web::{AppState, router, serve};

/// Configuration of `nudge-console`: the shared `database.*` and `telemetry.*`, and
/// `console.*` ([`ConsoleSection`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleConfig {
    pub database: DatabaseConfig,
    pub telemetry: TelemetryConfig,
    pub console: ConsoleSection,
}

impl nudge_runtime::ServiceConfig for ConsoleConfig {
    const SECTIONS: &'static [&'static str] = Self::SECTIONS;

    fn database(&self) -> &DatabaseConfig {
        &self.database
    }

    fn telemetry(&self) -> &TelemetryConfig {
        &self.telemetry
    }
}

impl ConsoleConfig {
    pub const SECTIONS: &'static [&'static str] = &["database", "telemetry", "console"];
}

/// `[console]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleSection {
    /// Where the pages are served.
    pub listen_addr: SocketAddr,
    /// Standard base64 of at least 32 random bytes: signs the session cookies (required).
    /// Changing it ends every session.
    pub session_key: Option<Secret>,
    /// How long a session lasts after its login (300..=86400); never past its token's expiry.
    pub session_ttl_s: u64,
    /// Marks the session cookie `Secure` (sent over https only). Turn it off only to serve
    /// plain http on loopback (tests, a port-forward).
    pub secure_cookies: bool,
    /// A request header naming the user an authenticating proxy let through (such as
    /// `X-Forwarded-User`); unset (the default) ignores every such header. Set it only where
    /// the proxy is the console's one way in and strips the header from what clients send.
    pub trusted_header: Option<String>,
    /// The role of a user named by `trusted_header`: `viewer` or `operator`.
    pub trusted_header_role: String,
    /// The addresses (CIDR ranges) the proxy connects from: `trusted_header` is read only on a
    /// connection from one of them and dropped from any other. Required with
    /// `trusted_header`.
    pub trusted_proxies: Vec<String>,
    /// Rows a table shows at most (10..=1000).
    pub page_rows: u32,
}

impl Default for ConsoleSection {
    fn default() -> Self {
        Self {
            listen_addr: SocketAddr::from(([0, 0, 0, 0], 8095)),
            session_key: None,
            session_ttl_s: 28_800,
            secure_cookies: true,
            trusted_header: None,
            trusted_header_role: "viewer".to_owned(),
            trusted_proxies: Vec::new(),
            page_rows: 200,
        }
    }
}

/// Headers a client or browser sets itself, never a proxy's user.
const RESERVED_HEADERS: &[&str] = &[
    "authorization",
    "cookie",
    "host",
    "origin",
    "referer",
    "user-agent",
    "content-type",
    "content-length",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "sec-fetch-site",
];

/// The least number of bytes of `console.session_key`.
pub const SESSION_KEY_MIN_BYTES: usize = 32;

impl ConsoleSection {
    /// The session key's bytes.
    pub fn session_key_bytes(&self) -> Result<Vec<u8>, ConfigError> {
        use base64::Engine as _;
        let key = self.session_key.as_ref().ok_or_else(|| {
            ConfigError::invalid(
                "console.session_key",
                "is required: standard base64 of at least 32 random bytes \
                 (openssl rand -base64 48)",
            )
        })?;
        // The decode error is dropped: its message could quote bytes of the key.
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(key.expose().trim())
            .map_err(|_| ConfigError::invalid("console.session_key", "is not standard base64"))?;
        if bytes.len() < SESSION_KEY_MIN_BYTES {
            return Err(ConfigError::invalid(
                "console.session_key",
                "must be at least 32 bytes (openssl rand -base64 48)",
            ));
        }
        Ok(bytes)
    }

    /// The ranges of `trusted_proxies`.
    pub fn trusted_proxy_ranges(&self) -> Result<Vec<ipnet::IpNet>, ConfigError> {
        self.trusted_proxies
            .iter()
            .map(|text| {
                text.trim().parse::<ipnet::IpNet>().map_err(|_| {
                    ConfigError::invalid(
                        "console.trusted_proxies",
                        format!("{text:?} is not a CIDR range (such as 10.0.0.0/8)"),
                    )
                })
            })
            .collect()
    }

    pub fn trusted_role(&self) -> Result<ConsoleRole, ConfigError> {
        self.trusted_header_role
            .parse()
            .map_err(|e: &str| ConfigError::invalid("console.trusted_header_role", e))
    }
}

impl Validate for ConsoleSection {
    fn validate(&self) -> Result<(), ConfigError> {
        // Required to serve (checked at start), not to load: the example leaves it unset.
        if self.session_key.is_some() {
            self.session_key_bytes()?;
        }
        if !(300..=86_400).contains(&self.session_ttl_s) {
            return Err(ConfigError::invalid(
                "console.session_ttl_s",
                "must be between 300 and 86400",
            ));
        }
        if !(10..=1_000).contains(&self.page_rows) {
            return Err(ConfigError::invalid(
                "console.page_rows",
                "must be between 10 and 1000",
            ));
        }
        if let Some(name) = &self.trusted_header {
            let header =
                axum::http::HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
                    ConfigError::invalid("console.trusted_header", "is not an HTTP header name")
                })?;
            if RESERVED_HEADERS.contains(&header.as_str()) {
                return Err(ConfigError::invalid(
                    "console.trusted_header",
                    "names a header every client sends or a browser sets (such as cookie, \
                     host, origin): use the proxy's own, such as X-Forwarded-User",
                ));
            }
            if self.trusted_proxies.is_empty() {
                return Err(ConfigError::invalid(
                    "console.trusted_proxies",
                    "must name the proxy's addresses when console.trusted_header is set: the \
                     header is taken from them only",
                ));
            }
        }
        self.trusted_proxy_ranges()?;
        self.trusted_role().map(|_| ())
    }
}

impl Validate for ConsoleConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.database.validate()?;
        self.telemetry.validate()?;
        self.console.validate()?;
        if self.telemetry.metrics_addr == Some(self.console.listen_addr) {
            return Err(ConfigError::invalid(
                "console.listen_addr",
                "is telemetry.metrics_addr: the pages and /metrics need a listener each",
            ));
        }
        Ok(())
    }
}

#[derive(Debug, clap::Parser)]
#[command(
    version,
    about = "Serve the on-call console: one web page over the ledger.",
    long_about = "Serve the on-call console on console.listen_addr: what is waiting, leased, \
                  retrying and rejected, per channel and per tenant; the dead letters, the \
                  redrives, a reminder's trace and the audit log. Log in with a token from \
                  `nudgectl console token create --role viewer|operator` (or through an \
                  authenticating proxy, console.trusted_header). An operator's session may \
                  pause and resume a tenant's intake, drain a channel, set or resume a rate \
                  and run redrives (dry run first), each with a reason and an audit row; a \
                  viewer's may only read. No destination or content is ever shown.\n\n\
                  Configuration: defaults, then the TOML file given by --config or \
                  NUDGE_CONFIG, then NUDGE_* environment variables; console.session_key is \
                  required. Safe to run as several replicas (sessions are signed cookies). \
                  SIGTERM or Ctrl-C stops it. Connect as the nudge_console database role \
                  (database.url)."
)]
pub struct Cli {
    /// TOML configuration file (overrides NUDGE_CONFIG).
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
}

pub async fn main() -> ExitCode {
    use clap::Parser;
    let cli = Cli::parse();
    nudge_runtime::exit_code("console", run_binary(cli).await)
}

async fn run_binary(cli: Cli) -> anyhow::Result<()> {
    let config: ConsoleConfig = nudge_runtime::load_config(cli.config.as_deref())?;
    let metrics = Arc::new(ConsoleMetrics::new());
    let app =
        nudge_runtime::Application::build("nudge-console", config, metrics.registry()).await?;
    let section = app.config.console.clone();
    let state = AppState::new(app.ledger.clone(), &section, metrics)?;
    let listener = TcpListener::bind(section.listen_addr)
        .await
        .with_context(|| {
            format!(
                "failed to listen on {} (console.listen_addr)",
                section.listen_addr
            )
        })?;
    info!(addr = %listener.local_addr()?, "console listening");
    if !section.secure_cookies && !section.listen_addr.ip().is_loopback() {
        warn!(
            addr = %section.listen_addr,
            "console.secure_cookies is off on a non-loopback address: serve it behind TLS and \
             turn it on, or a session cookie can travel in clear text"
        );
    }
    web::serve(listener, state, app.shutdown.clone())
        .await
        .context("the console's listener failed")?;
    app.stop().await;
    Ok(())
}
