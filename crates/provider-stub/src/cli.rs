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

    /// FCM shape (required for it): the service account's RSA public key, a PEM file;
    /// assertions at the token endpoint must verify with it.
    #[arg(long)]
    pub fcm_public_key: Option<PathBuf>,

    /// FCM shape: the `expires_in` of the access tokens issued, in seconds.
    #[arg(long, default_value_t = 3600)]
    pub fcm_token_lifetime_s: u64,

    /// APNs shape (required for it): the signing key's EC P-256 public key, a PEM file; provider
    /// tokens must verify with it.
    #[arg(long)]
    pub apns_public_key: Option<PathBuf>,

    /// APNs shape: a provider token that replaces the account's previous one sooner than this
    /// is refused with 429 TooManyProviderTokenUpdates, in seconds (Apple: 20 minutes).
    #[arg(long, default_value_t = 1200)]
    pub apns_min_token_interval_s: u64,

    /// APNs shape (required for it): where the certificate authority made at start-up is
    /// written (PEM), for clients to trust.
    #[arg(long)]
    pub tls_ca_out: Option<PathBuf>,
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
        let read = |path: &Option<PathBuf>, flag: &str| -> anyhow::Result<Vec<u8>> {
            let path = path
                .as_ref()
                .with_context(|| format!("--{flag} is required for --shape {:?}", self.shape))?;
            std::fs::read(path).with_context(|| format!("failed to read {}", path.display()))
        };
        let fcm = match self.shape {
            crate::Shape::Fcm => Some(
                crate::fcm::FcmShape::from_pem(
                    &read(&self.fcm_public_key, "fcm-public-key")?,
                    std::time::Duration::from_secs(self.fcm_token_lifetime_s),
                )
                .context("--fcm-public-key is not an RSA public key in PEM")?,
            ),
            _ => None,
        };
        let apns = match self.shape {
            crate::Shape::Apns => Some(
                crate::apns::ApnsShape::from_pem(
                    &read(&self.apns_public_key, "apns-public-key")?,
                    std::time::Duration::from_secs(self.apns_min_token_interval_s),
                )
                .context("--apns-public-key is not an EC public key in PEM")?,
            ),
            _ => None,
        };
        Ok(crate::ShapeConfig {
            shape: self.shape,
            twilio_auth_token: self.twilio_auth_token.clone(),
            sendgrid_event_url: self.sendgrid_event_url.clone(),
            sendgrid_signing_key,
            fcm,
            apns,
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
