//! Provider adapters: one send to an external provider (push, email, SMS), reported as a
//! [`SendOutcome`].
//!
//! Owns: the [`Provider`] trait workers send through (and [`DynProvider`] for dynamic dispatch),
//! the account configuration with its `kind` ([`HttpProviderConfig`], [`ProviderKind`]), the one
//! place a kind becomes an adapter ([`build`]), the adapters: [`HttpProvider`] (kind `generic`:
//! POSTs to `{base_url}/v1/messages` with our `Idempotency-Key` on every request, reported as a
//! bare status), [`twilio`], [`sendgrid`], [`fcm`] (FCM HTTP v1 with the OAuth 2
//! service-account flow) and [`apns`] (APNs over HTTP/2 with an ES256 provider token), each
//! reading its provider's contract into a [`nudge_domain::Verdict`], and the transport shared by all ([`transport`]: the mapping of
//! transport failures onto "the request never left" ([`SendOutcome::FailedBeforeSend`]) versus
//! "it may have been sent" ([`SendOutcome::UnknownAfterSend`]), with short stable reason codes).
//!
//! Must never: decide what an outcome means for a delivery (that is `nudge_domain::classify` and
//! `decide`; an adapter only says what its provider's answer means), retry or sleep (one call is
//! one attempt; backoff belongs to the ledger), follow a redirect (it could send twice), or put a
//! destination, message content or credential into a log line, an error or a reason.

pub mod apns;
mod config;
mod dispatch;
pub mod fcm;
mod http;
mod push;
pub mod reason;
pub mod sendgrid;
pub mod transport;
pub mod twilio;
mod window;

use std::future::Future;
use std::pin::Pin;

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, IdempotencyKey, IdempotencySupport, ProviderAccount, SendOutcome};
use url::Url;

pub use config::{ApnsKeys, FcmKeys, HttpProviderConfig, ProviderKind};
pub use dispatch::build;
pub use http::{HttpProvider, NON_UTF8_RETRY_AFTER};
pub use window::{LeaseEnd, SEND_DEADLINE_PASSED, SendWindow};

/// When the message stops being worth sending, and the sender's view of the database's clock
/// as the request is built ([`SendWindow::open`]): adapters whose provider can drop a message
/// that waited too long (Twilio's `ValidityPeriod`, APNs' `apns-expiration`, FCM's `ttl`)
/// derive it from these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expiry {
    pub expires_at: DateTime<Utc>,
    pub now: DateTime<Utc>,
}

impl Expiry {
    /// Whole seconds left before `expires_at`, rounded down, at least 0.
    pub fn seconds_left(&self) -> u64 {
        u64::try_from((self.expires_at - self.now).num_seconds()).unwrap_or(0)
    }
}

/// One message to send, borrowed from the worker for the duration of the attempt.
///
/// `destination` and `content` are PHI: adapters send them and drop them, never log them.
#[derive(Clone, Copy)]
pub struct SendRequest<'a> {
    pub idempotency_key: &'a IdempotencyKey,
    pub channel: Channel,
    pub destination: &'a str,
    pub content: Option<&'a serde_json::Value>,
    /// Opaque id tying the attempt to our traces; sent as `X-Correlation-Id`.
    pub correlation_id: &'a str,
    /// W3C trace context of the attempt's provider span, sent as `traceparent` when set.
    pub traceparent: Option<&'a str>,
    /// When the request may still start, and the delivery's expiry (None: no bound, and the
    /// provider is not told an expiry). Adapters call [`SendRequest::open`] as the last step
    /// before the request leaves.
    pub window: Option<&'a SendWindow>,
}

impl SendRequest<'_> {
    /// The last step before a request that may run for `request_timeout` leaves: the expiry as
    /// of now (None without a window), or the outcome of an attempt whose window has closed
    /// (nothing may be sent).
    pub fn open(
        &self,
        request_timeout: std::time::Duration,
    ) -> Result<Option<Expiry>, SendOutcome> {
        self.window.map(|w| w.open(request_timeout)).transpose()
    }
}

impl std::fmt::Debug for SendRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendRequest")
            .field("idempotency_key", &self.idempotency_key.as_str())
            .field("channel", &self.channel)
            .field("destination", &"<redacted>")
            .field("content", &self.content.map(|_| "<redacted>"))
            .field("correlation_id", &self.correlation_id)
            .field("traceparent", &self.traceparent)
            .field("window", &self.window)
            .finish()
    }
}

/// A provider account a worker can send through. One `send` is exactly one attempt.
pub trait Provider: Send + Sync {
    /// The account, for rate buckets, metrics and the attempt record.
    fn account(&self) -> &ProviderAccount;

    /// Whether the provider dedups by `Idempotency-Key`, i.e. whether resending after an unknown
    /// outcome is safe.
    fn idempotency(&self) -> IdempotencySupport;

    /// Where messages go (for the request span's server address; never logged in full).
    fn endpoint(&self) -> &Url;

    /// Sends once and reports what happened. Never fails: every failure is an outcome.
    ///
    /// The request's window is opened ([`SendRequest::open`]) as the last step before the
    /// request leaves; a request whose window refuses is never started. The caller may stop
    /// polling the future at the window's deadline while the window has not been opened (the
    /// adapter was still waiting, e.g. for a token): nothing was sent.
    fn send<'a>(&'a self, req: SendRequest<'a>) -> impl Future<Output = SendOutcome> + Send + 'a;
}

/// The future [`DynProvider::send_boxed`] returns.
pub type BoxSendFuture<'a> = Pin<Box<dyn Future<Output = SendOutcome> + Send + 'a>>;

/// Object-safe form of [`Provider`], for holding several kinds of provider (or a test double)
/// as `Arc<dyn DynProvider>`. Every [`Provider`] is one; the cost is one allocation per send.
pub trait DynProvider: Send + Sync {
    fn account(&self) -> &ProviderAccount;
    fn idempotency(&self) -> IdempotencySupport;
    fn endpoint(&self) -> &Url;
    fn send_boxed<'a>(&'a self, req: SendRequest<'a>) -> BoxSendFuture<'a>;
}

impl<P: Provider> DynProvider for P {
    fn account(&self) -> &ProviderAccount {
        Provider::account(self)
    }

    fn idempotency(&self) -> IdempotencySupport {
        Provider::idempotency(self)
    }

    fn endpoint(&self) -> &Url {
        Provider::endpoint(self)
    }

    fn send_boxed<'a>(&'a self, req: SendRequest<'a>) -> BoxSendFuture<'a> {
        Box::pin(Provider::send(self, req))
    }
}

/// A configuration error for `key` (relative to the provider section), as an adapter's
/// constructor reports it.
pub(crate) fn invalid_key(key: &str, message: impl Into<String>) -> ProviderError {
    ProviderError::Config(nudge_config::ConfigError::invalid(key, message))
}

/// Why a provider account could not be built. Never carries a configured value.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// A key breaks its rule; the message names the key (relative to the provider section).
    #[error(transparent)]
    Config(#[from] nudge_config::ConfigError),
    /// The HTTP client could not be built (e.g. no TLS roots could be loaded).
    #[error("failed to build the HTTP client for provider account {account}")]
    Client {
        account: ProviderAccount,
        #[source]
        source: reqwest::Error,
    },
}
