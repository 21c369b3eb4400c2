//! The provider shapes the stub speaks, and the one place a shape picks its routes.
//!
//! A stub speaks one shape (`--shape`), like a real provider speaks one protocol; every shape
//! shares the accounts' scripts (token bucket, sequences, delays, hangs) and counters, and
//! renders the scripted answer in its provider's form (status, error body, rate-limit headers).
//! The real providers' shapes never deduplicate by key (they do not) and send delivery receipts
//! for what they took: Twilio's status callbacks to each message's `StatusCallback`, signed with
//! `X-Twilio-Signature`; SendGrid's event webhook batches to `--sendgrid-event-url`, signed with
//! ECDSA P-256. The push shapes check their credentials as the providers do: `fcm` runs Google's
//! token endpoint and accepts only the access tokens it issued; `apns` is served over TLS and
//! HTTP/2 ([`crate::tls`]) and verifies each ES256 provider token. A shape is added with a variant
//! here, its module, and its routes below.

use axum::Router;
use axum::routing::post;
use nudge_telemetry::error_chain;

use crate::server::App;

/// Which provider's protocol the stub speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Shape {
    /// nudge's own JSON protocol: `POST /accounts/{account}/v1/messages`.
    #[default]
    Generic,
    /// Twilio Messages: `POST /accounts/{account}/2010-04-01/Accounts/{sid}/Messages.json`.
    Twilio,
    /// SendGrid v3 Mail Send: `POST /accounts/{account}/v3/mail/send`.
    Sendgrid,
    /// FCM HTTP v1: `POST /accounts/{account}/token` (OAuth 2) and
    /// `POST /accounts/{account}/v1/projects/{project}/messages:send`.
    Fcm,
    /// APNs, over TLS and HTTP/2: `POST /accounts/{account}/3/device/{device token}`.
    Apns,
}

/// A shape and what its receipts need.
#[derive(Clone, Default)]
pub struct ShapeConfig {
    pub shape: Shape,
    /// Twilio: the auth token status callbacks are signed with (unsigned without one).
    pub twilio_auth_token: Option<String>,
    /// SendGrid: where event webhook batches go (none are sent without it).
    pub sendgrid_event_url: Option<url::Url>,
    /// SendGrid: the key event batches are signed with (unsigned without one).
    pub sendgrid_signing_key: Option<p256::ecdsa::SigningKey>,
    /// FCM: the service account's public key and the tokens issued (required for `fcm`).
    pub fcm: Option<crate::fcm::FcmShape>,
    /// APNs: the signing key's public half and the tokens seen (required for `apns`).
    pub apns: Option<crate::apns::ApnsShape>,
}

impl std::fmt::Debug for ShapeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShapeConfig")
            .field("shape", &self.shape)
            .field(
                "twilio_auth_token",
                &self.twilio_auth_token.as_ref().map(|_| "[redacted]"),
            )
            .field(
                "sendgrid_event_url",
                &self.sendgrid_event_url.as_ref().map(url::Url::as_str),
            )
            .field(
                "sendgrid_signing_key",
                &self.sendgrid_signing_key.as_ref().map(|_| "[redacted]"),
            )
            .field("fcm", &self.fcm)
            .field("apns", &self.apns)
            .finish()
    }
}

impl ShapeConfig {
    pub fn new(shape: Shape) -> Self {
        Self {
            shape,
            ..Self::default()
        }
    }
}

/// The provider API of a shape.
pub(crate) fn provider_routes(shape: Shape) -> Router<App> {
    match shape {
        Shape::Generic => Router::new().route(
            "/accounts/{account}/v1/messages",
            post(crate::server::send_message),
        ),
        Shape::Twilio => Router::new().route(
            "/accounts/{account}/2010-04-01/Accounts/{sid}/Messages.json",
            post(crate::twilio::send_message),
        ),
        Shape::Sendgrid => Router::new().route(
            "/accounts/{account}/v3/mail/send",
            post(crate::sendgrid::send_message),
        ),
        Shape::Fcm => crate::fcm::routes(),
        Shape::Apns => crate::apns::routes(),
    }
}

/// Sends one receipt after `delay`, in the background; failures are logged, never retried
/// (a lost receipt leaves an ambiguous delivery for review, as at a real provider).
pub(crate) fn send_receipt(
    delay: std::time::Duration,
    request: reqwest::RequestBuilder,
    what: &'static str,
) {
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        match request.send().await {
            Ok(r) => tracing::debug!(receipt = what, status = r.status().as_u16(), "receipt sent"),
            Err(e) => {
                tracing::warn!(
                    receipt = what,
                    error.cause_chain = %error_chain(&e.without_url()),
                    "receipt not delivered"
                )
            }
        }
    });
}
