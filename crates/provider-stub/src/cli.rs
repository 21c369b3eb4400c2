//! The binary's arguments, script file and shutdown signal, kept here so `main.rs` is wiring.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use nudge_domain::ProviderAccount;
use tokio::net::TcpListener;

use crate::script::Script;

/// A local HTTP provider for tests and the demo, emulating many provider accounts at once.
///
/// An account's base URL is `http://HOST:PORT/accounts/{account}`. After binding, exactly one
/// line `listening on http://ADDR` is printed to stdout; logs go to stderr.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "provider-stub", version)]
pub struct Args {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,

    /// JSON file mapping account name to script, applied at start.
    #[arg(long)]
    pub script_file: Option<PathBuf>,

    /// Allow listening on an address other than loopback (the stub has no authentication).
    #[arg(long)]
    pub allow_non_loopback: bool,

    /// The provider protocol to speak.
    #[arg(long, value_enum, default_value_t = crate::Shape::Generic)]
    pub shape: crate::Shape,

    /// Twilio shape: the auth token status callbacks are signed with.
    #[arg(long, env = "PROVIDER_STUB_TWILIO_AUTH_TOKEN", hide_env_values = true)]
    pub twilio_auth_token: Option<String>,

    /// SendGrid shape: where event webhook batches are posted.
    #[arg(long)]
    pub sendgrid_event_url: Option<url::Url>,

    /// SendGrid shape: the P-256 private key event batches are signed with, base64 PKCS#8 DER.
    #[arg(
        long,
        env = "PROVIDER_STUB_SENDGRID_SIGNING_KEY",
        hide_env_values = true
    )]
    pub sendgrid_signing_key: Option<String>,
}

impl Args {
    /// The shape and what its receipts need.
    pub fn shape_config(&self) -> anyhow::Result<crate::ShapeConfig> {
        let sendgrid_signing_key = self
            .sendgrid_signing_key
            .as_deref()
            .map(|b64| {
                use base64::Engine as _;
                use p256::pkcs8::DecodePrivateKey as _;
                let der = base64::engine::general_purpose::STANDARD
                    .decode(b64.trim())
                    .context("--sendgrid-signing-key is not base64")?;
                p256::ecdsa::SigningKey::from_pkcs8_der(&der).map_err(|_| {
                    anyhow::anyhow!("--sendgrid-signing-key is not a P-256 PKCS#8 key")
                })
            })
            .transpose()?;
        Ok(crate::ShapeConfig {
            shape: self.shape,
            twilio_auth_token: self.twilio_auth_token.clone(),
            sendgrid_event_url: self.sendgrid_event_url.clone(),
            sendgrid_signing_key,
        })
    }
}

/// Reads a script file: a JSON object from account name to [`Script`].
pub fn load_scripts(path: &Path) -> anyhow::Result<BTreeMap<ProviderAccount, Script>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("failed to read script file {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("failed to parse script file {}", path.display()))
}

/// Binds `args.listen`, refusing a non-loopback address unless allowed.
pub async fn bind(args: &Args) -> anyhow::Result<TcpListener> {
    if !args.listen.ip().is_loopback() && !args.allow_non_loopback {
        anyhow::bail!(
            "refusing to listen on non-loopback address {}: the stub has no authentication; pass --allow-non-loopback to do it anyway",
            args.listen
        );
    }
    TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("failed to listen on {}", args.listen))
}

/// Completes on the first SIGTERM or SIGINT. Handlers are installed now, so a signal that
/// arrives before the future is polled is not lost.
pub fn shutdown_signal() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!(signal = "SIGTERM", "shutting down"),
            _ = int.recv() => tracing::info!(signal = "SIGINT", "shutting down"),
        }
    })
}
