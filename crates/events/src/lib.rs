//! `nudge-events`: pushes each tenant's delivery events to the endpoint it configured
//! (`nudgectl tenant webhook set`), as batches signed by the Standard Webhooks scheme
//! (decision 0602).
//!
//! - Every `events.poll_interval_ms`, the process leases the webhooks that are due and have
//!   numbered events past what their endpoint acknowledged (`Ledger::claim_webhooks`), up to
//!   `events.concurrency` tenants at once; each leased tenant is pushed by its own task, one
//!   batch at a time, so a tenant's events arrive in position order and a slow or dead
//!   endpoint holds only its own task (each request is bounded by
//!   `events.request_timeout_ms`).
//! - A 2xx moves the tenant's acknowledged position and the next batch follows at once. Any
//!   other answer, a timeout or a refused address fails the batch: it is retried as it was
//!   (same events, same `webhook-id`) after a capped, jittered backoff, or after the
//!   endpoint's `Retry-After` on a 429 or 503 (at most `events.max_retry_after_s`). A webhook
//!   failing for `events.disable_after_s` is disabled: its events wait, the alert
//!   `NudgeEventsWebhookDisabled` fires, and `nudgectl tenant webhook enable` resumes after
//!   the last acknowledged position.
//! - Addresses are guarded ([`guard`]): private, loopback and link-local ranges are refused
//!   before any connection unless `events.allow_addresses` names them.
//!
//! Delivery is at least once: a batch acknowledged by the endpoint but not recorded (the
//! process died between) is sent again; each event's `id` tells a client it has seen it.
//! Several replicas may run: a tenant is leased to one at a time.
//!
//! It must never move a tenant's acknowledged position past a batch the endpoint did not
//! acknowledge, send a tenant's batches out of order, or connect to an address the guard
//! refused.

pub mod guard;
pub mod metrics;
pub mod send;

use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ipnet::IpNet;
use nudge_config::{ConfigError, CryptoConfig, DatabaseConfig, TelemetryConfig, Validate};
use nudge_domain::{RandJitter, RetryPolicy, TenantId};
use nudge_ledger::{
    ClaimedWebhook, DestinationCipher, FailureRecorded, Fence, Ledger, WebhookFailure,
};
use nudge_runtime::Outage;
use nudge_telemetry::error_chain;
use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

pub use metrics::EventsMetrics;
pub use send::{FailureClass, SendFailure, Sender, SenderSettings};

use crate::guard::AddressGuard;

/// Configuration of `nudge-events`.
///
/// Keys, beyond the shared `database.*` and `telemetry.*`:
/// - `crypto.destination_key` (required) and `crypto.tenant_secret_key` (set it where the
///   intake has it): the keys the webhooks' signing secrets are sealed with.
/// - `events.*`: see [`EventsSection`].
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsConfig {
    pub database: DatabaseConfig,
    pub telemetry: TelemetryConfig,
    pub crypto: CryptoConfig,
    pub events: EventsSection,
}

impl nudge_runtime::ServiceConfig for EventsConfig {
    const SECTIONS: &'static [&'static str] = Self::SECTIONS;

    fn database(&self) -> &DatabaseConfig {
        &self.database
    }

    fn telemetry(&self) -> &TelemetryConfig {
        &self.telemetry
    }
}

impl EventsConfig {
    pub const SECTIONS: &'static [&'static str] = &["database", "telemetry", "crypto", "events"];
}

/// `[events]`: the push.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsSection {
    /// How often due webhooks are looked for (10..=60000).
    pub poll_interval_ms: u64,
    /// Tenants this process pushes at once (1..=10000): one task each.
    pub concurrency: u32,
    /// Events per POST (1..=1000).
    pub batch_max: u32,
    /// How long a task holds a tenant (renewed just before each batch is sent): another
    /// replica takes the tenant over after it. At least `request_timeout_ms` +
    /// `database.statement_timeout_ms` (in seconds, 1..=3600).
    pub lease_s: u64,
    /// Connecting to an endpoint, TLS included (100..=60000).
    pub connect_timeout_ms: u64,
    /// A whole request, from connecting to the answer's end (100..=120000).
    pub request_timeout_ms: u64,
    /// Most bytes of an answer's body read before it is dropped (0..=1048576); never kept.
    pub response_body_max_bytes: usize,
    /// The retry's backoff: full jitter up to `retry_base_ms` x 2^(failures - 1), at most
    /// `retry_max_ms`.
    pub retry_base_ms: u64,
    pub retry_max_ms: u64,
    /// The longest an endpoint's `Retry-After` (429 or 503) holds its batch (1..=86400).
    pub max_retry_after_s: u64,
    /// A webhook failing this long (no 2xx since its first failure) is disabled
    /// (60..=2592000).
    pub disable_after_s: u64,
    /// Lets endpoints use plain http (for tests on loopback; never in production).
    pub allow_http: bool,
    /// Address ranges (CIDR) the guard lets through although special-purpose (private,
    /// loopback, link-local...): `["127.0.0.0/8"]` for a receiver on this host.
    pub allow_addresses: Vec<String>,
    /// How often the webhooks' states are read for the gauges (100..=3600000).
    pub metrics_interval_ms: u64,
}

impl Default for EventsSection {
    fn default() -> Self {
        Self {
            poll_interval_ms: 200,
            concurrency: 64,
            batch_max: 100,
            lease_s: 60,
            connect_timeout_ms: 5_000,
            request_timeout_ms: 10_000,
            response_body_max_bytes: 4_096,
            retry_base_ms: 1_000,
            retry_max_ms: 300_000,
            max_retry_after_s: 600,
            disable_after_s: 86_400,
            allow_http: false,
            allow_addresses: Vec::new(),
            metrics_interval_ms: 15_000,
        }
    }
}

fn range(key: &str, value: u64, low: u64, high: u64) -> Result<(), ConfigError> {
    if (low..=high).contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            key,
            format!("must be between {low} and {high}"),
        ))
    }
}

impl EventsSection {
    /// The ranges of `allow_addresses`.
    pub fn allowed_ranges(&self) -> Result<Vec<IpNet>, ConfigError> {
        self.allow_addresses
            .iter()
            .map(|text| {
                text.trim().parse::<IpNet>().map_err(|_| {
                    ConfigError::invalid(
                        "events.allow_addresses",
                        format!("{text:?} is not a CIDR range (such as 127.0.0.0/8)"),
                    )
                })
            })
            .collect()
    }

    /// The retry policy of failed batches.
    pub fn retry_policy(&self) -> Result<RetryPolicy, ConfigError> {
        RetryPolicy::new(
            Duration::from_millis(self.retry_base_ms),
            Duration::from_millis(self.retry_max_ms),
            u32::MAX,
            Duration::from_secs(self.max_retry_after_s),
        )
        .map_err(|e| ConfigError::invalid("events.retry_base_ms", e.to_string()))
    }
}

impl Validate for EventsSection {
    fn validate(&self) -> Result<(), ConfigError> {
        range("events.poll_interval_ms", self.poll_interval_ms, 10, 60_000)?;
        range("events.concurrency", u64::from(self.concurrency), 1, 10_000)?;
        range("events.batch_max", u64::from(self.batch_max), 1, 1_000)?;
        range("events.lease_s", self.lease_s, 1, 3_600)?;
        range(
            "events.connect_timeout_ms",
            self.connect_timeout_ms,
            100,
            60_000,
        )?;
        range(
            "events.request_timeout_ms",
            self.request_timeout_ms,
            100,
            120_000,
        )?;
        range(
            "events.response_body_max_bytes",
            self.response_body_max_bytes as u64,
            0,
            1_048_576,
        )?;
        range("events.retry_base_ms", self.retry_base_ms, 1, 3_600_000)?;
        range(
            "events.retry_max_ms",
            self.retry_max_ms,
            self.retry_base_ms,
            86_400_000,
        )?;
        range(
            "events.max_retry_after_s",
            self.max_retry_after_s,
            1,
            86_400,
        )?;
        range(
            "events.disable_after_s",
            self.disable_after_s,
            60,
            2_592_000,
        )?;
        range(
            "events.metrics_interval_ms",
            self.metrics_interval_ms,
            100,
            3_600_000,
        )?;
        self.allowed_ranges().map(|_| ())
    }
}

impl Validate for EventsConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.database.validate()?;
        self.telemetry.validate()?;
        self.crypto.validate()?;
        self.events.validate()?;
        // The lease is renewed just before a batch is sent; it must outlast the request and
        // the statement that records its answer.
        let needed = self
            .events
            .request_timeout_ms
            .saturating_add(self.database.statement_timeout_ms);
        if self.events.lease_s.saturating_mul(1_000) < needed {
            return Err(ConfigError::invalid(
                "events.lease_s",
                format!(
                    "must be at least events.request_timeout_ms + database.statement_timeout_ms \
                     ({needed} ms): a tenant's lease must outlast a request and the statement \
                     that records its answer"
                ),
            ));
        }
        Ok(())
    }
}

#[derive(Debug, clap::Parser)]
#[command(
    version,
    about = "Push each tenant's delivery events to its endpoint, signed as Standard Webhooks.",
    long_about = "Push each tenant's delivery events to the endpoint set by `nudgectl tenant \
                  webhook set`: batches in position order, signed as Standard Webhooks \
                  (webhook-id, webhook-timestamp, webhook-signature), at least once. A failed \
                  batch is retried as it was, after a jittered backoff or the endpoint's \
                  Retry-After; a webhook failing for events.disable_after_s is disabled and its \
                  events wait for `nudgectl tenant webhook enable`. Private, loopback and \
                  link-local addresses are refused before connecting unless \
                  events.allow_addresses names them.\n\n\
                  Configuration: defaults, then the TOML file given by --config or NUDGE_CONFIG, \
                  then NUDGE_* environment variables. Safe to run as several replicas (a tenant \
                  is leased to one at a time). SIGTERM or Ctrl-C lets each request in flight \
                  finish, gives the tenants back and exits 0. Connect as the nudge_events \
                  database role (database.url)."
)]
pub struct Cli {
    /// TOML configuration file (overrides NUDGE_CONFIG).
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
}

pub async fn main() -> ExitCode {
    use clap::Parser;
    let cli = Cli::parse();
    nudge_runtime::exit_code("events", run_binary(cli).await)
}

/// The keys the webhooks' secrets are sealed with.
pub fn cipher(crypto: &CryptoConfig) -> anyhow::Result<DestinationCipher> {
    let key = crypto
        .destination_key_bytes()?
        .context("crypto.destination_key is required")?;
    let mut cipher = DestinationCipher::new(&key);
    match crypto.tenant_secret_key_bytes()? {
        Some(secrets) => cipher = cipher.with_tenant_secret_key(&secrets),
        None => warn!(
            "crypto.tenant_secret_key is not set: only webhook secrets sealed with the \
             destination key can be opened"
        ),
    }
    Ok(cipher)
}

async fn run_binary(cli: Cli) -> anyhow::Result<()> {
    let config: EventsConfig = nudge_runtime::load_config(cli.config.as_deref())?;
    let metrics = Arc::new(EventsMetrics::new());
    let app = nudge_runtime::Application::build("nudge-events", config, metrics.registry()).await?;
    // Positions of a ledger restored from a backup start again below what endpoints saw.
    nudge_runtime::restore_guard::check_at_start(&app.ledger).await?;
    let identity_watch =
        nudge_runtime::restore_guard::watch(app.ledger.clone(), app.shutdown.clone());
    let cipher = cipher(&app.config.crypto)?;
    let section = app.config.events.clone();
    let pusher = Pusher::new(app.ledger.clone(), cipher, &section, metrics.clone())?;
    let gauges = tokio::spawn(gauges_loop(
        app.ledger.clone(),
        metrics,
        Duration::from_millis(section.metrics_interval_ms),
        app.shutdown.clone(),
    ));
    pusher.run(app.shutdown.clone()).await;
    if let Err(e) = gauges.await {
        warn!(error.cause_chain = %error_chain(&e), "gauges task failed");
    }
    app.stop().await;
    nudge_runtime::restore_guard::finish(identity_watch).await
}

async fn gauges_loop(
    ledger: Ledger,
    metrics: Arc<EventsMetrics>,
    every: Duration,
    shutdown: CancellationToken,
) {
    let outage = Outage::new("events gauges");
    loop {
        match ledger.webhook_counts().await {
            Ok(counts) => {
                outage.back();
                metrics.webhooks(counts);
            }
            Err(e) if outage.away(&e) => {}
            Err(e) => {
                warn!(error.cause_chain = %error_chain(&e), "failed to read the webhooks' states");
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// The most batches a task pushes for one tenant before it gives the tenant back, so that a
/// tenant with a long backlog or a steady stream takes turns with the others waiting.
pub const BATCHES_PER_TURN: u32 = 20;

/// The push: leases tenants' webhooks and pushes each in its own task.
#[derive(Debug, Clone)]
pub struct Pusher {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    ledger: Ledger,
    cipher: DestinationCipher,
    sender: Sender,
    metrics: Arc<EventsMetrics>,
    policy: RetryPolicy,
    poll: Duration,
    concurrency: u32,
    batch_max: u32,
    lease: Duration,
    disable_after: Duration,
}

impl Pusher {
    pub fn new(
        ledger: Ledger,
        cipher: DestinationCipher,
        section: &EventsSection,
        metrics: Arc<EventsMetrics>,
    ) -> anyhow::Result<Self> {
        let sender = Sender::new(
            AddressGuard::new(section.allowed_ranges()?),
            SenderSettings {
                connect_timeout: Duration::from_millis(section.connect_timeout_ms),
                request_timeout: Duration::from_millis(section.request_timeout_ms),
                response_body_max_bytes: section.response_body_max_bytes,
                allow_http: section.allow_http,
            },
        )
        .context("failed to build the HTTP client")?;
        Ok(Self {
            inner: Arc::new(Inner {
                ledger,
                cipher,
                sender,
                metrics,
                policy: section.retry_policy()?,
                poll: Duration::from_millis(section.poll_interval_ms),
                concurrency: section.concurrency,
                batch_max: section.batch_max,
                lease: Duration::from_secs(section.lease_s),
                disable_after: Duration::from_secs(section.disable_after_s),
            }),
        })
    }

    /// Runs until `shutdown`; then lets each request in flight finish (each is bounded by the
    /// request timeout) and gives its tenant back.
    pub async fn run(&self, shutdown: CancellationToken) {
        let inner = &self.inner;
        let outage = Outage::new("events");
        let mut tasks: JoinSet<TenantId> = JoinSet::new();
        let mut busy: HashSet<TenantId> = HashSet::new();
        info!(concurrency = inner.concurrency, "pushing delivery events");
        loop {
            let free = inner
                .concurrency
                .saturating_sub(u32::try_from(tasks.len()).unwrap_or(u32::MAX));
            let mut pause = inner.poll;
            if free > 0 {
                let held: Vec<TenantId> = busy.iter().copied().collect();
                match inner.ledger.claim_webhooks(inner.lease, free, &held).await {
                    Ok(claimed) => {
                        outage.back();
                        for webhook in claimed {
                            busy.insert(webhook.tenant_id);
                            let inner = inner.clone();
                            let shutdown = shutdown.clone();
                            tasks.spawn(async move {
                                let tenant = webhook.tenant_id;
                                push_tenant(&inner, webhook, &shutdown).await;
                                tenant
                            });
                        }
                    }
                    Err(e) if outage.away(&e) => pause = outage.pause(inner.poll),
                    Err(e) => {
                        warn!(error.cause_chain = %error_chain(&e), "failed to lease webhooks; retrying");
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(pause) => {}
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    finished(&mut busy, done);
                }
            }
            while let Some(done) = tasks.try_join_next() {
                finished(&mut busy, done);
            }
        }
        while let Some(done) = tasks.join_next().await {
            finished(&mut busy, done);
        }
    }
}

fn finished(busy: &mut HashSet<TenantId>, done: Result<TenantId, tokio::task::JoinError>) {
    match done {
        Ok(tenant) => {
            busy.remove(&tenant);
        }
        Err(e) => {
            // A task that panicked leaves its tenant marked busy in this process; its lease
            // lapses and another replica takes the tenant over.
            error!(error.cause_chain = %error_chain(&e), "a tenant's push task failed");
        }
    }
}

/// Pushes one leased tenant's events, batch after batch, until none is left, its turn is over
/// ([`BATCHES_PER_TURN`]), a batch fails, the lease is lost or the process stops; gives the
/// tenant back unless a failure released it.
async fn push_tenant(inner: &Inner, webhook: ClaimedWebhook, shutdown: &CancellationToken) {
    let tenant = webhook.tenant_id;
    let lease = webhook.lease;
    let mut after = webhook.acked_position;
    let mut pending = webhook.pending_through;
    let mut failures = webhook.failures;
    let outage = Outage::new("events push");
    let mut pushed = 0;
    while pushed < BATCHES_PER_TURN && !shutdown.is_cancelled() {
        let page = match inner
            .ledger
            .tenant_events(tenant, after, inner.batch_max)
            .await
        {
            Ok(page) => page,
            Err(e) => {
                if !outage.away(&e) {
                    warn!(tenant_id = %tenant, error.cause_chain = %error_chain(&e),
                          "failed to read the tenant's events");
                }
                break;
            }
        };
        let mut events = page.events;
        if let Some(through) = pending {
            events.retain(|e| e.position <= through);
            if events.is_empty() && page.more {
                // The failed batch's events are gone (deleted by retention): push what follows.
                pending = None;
                continue;
            }
        }
        let (Some(first), Some(last)) = (events.first(), events.last()) else {
            break;
        };
        let through = last.position;
        let target = match inner
            .ledger
            .webhook_fence(tenant, lease, inner.lease, &inner.cipher)
            .await
        {
            Ok(Fence::Held(target)) => target,
            Ok(Fence::Lost) => {
                info!(tenant_id = %tenant,
                      "the webhook was disabled or its lease taken over: this task stops");
                return;
            }
            Ok(Fence::Unopenable(why)) => {
                let failure = SendFailure {
                    class: FailureClass::Secret,
                    detail: why,
                    retry_after: None,
                };
                record_failure(inner, tenant, lease, failures, through, &failure).await;
                return;
            }
            Err(e) => {
                if !outage.away(&e) {
                    warn!(tenant_id = %tenant, error.cause_chain = %error_chain(&e),
                          "failed to renew the tenant's lease");
                }
                break;
            }
        };
        debug!(tenant_id = %tenant, after, first = first.position, through, count = events.len(),
               "pushing a batch");
        let occurred: Vec<chrono::DateTime<chrono::Utc>> =
            events.iter().map(|e| e.occurred_at).collect();
        let batch = send::batch(
            tenant.as_uuid(),
            after,
            through,
            last.occurred_at,
            events
                .iter()
                .map(nudge_ledger::DeliveryEvent::wire)
                .collect(),
        );
        let sent = match batch {
            Ok(batch) => {
                inner
                    .sender
                    .send(&target.url, &batch, &target.secrets)
                    .await
            }
            Err(why) => Err(SendFailure {
                class: FailureClass::Other,
                detail: why,
                retry_after: None,
            }),
        };
        match sent {
            Ok(_) => {
                let acked = chrono::Utc::now();
                match inner
                    .ledger
                    .webhook_acknowledged(tenant, lease, through)
                    .await
                {
                    Ok(true) => {
                        inner
                            .metrics
                            .acknowledged(occurred.iter().map(|at| (acked - *at).as_seconds_f64()));
                        after = through;
                        pending = None;
                        failures = 0;
                        pushed += 1;
                    }
                    Ok(false) => {
                        warn!(tenant_id = %tenant, through,
                              "lease lost before the acknowledgement was recorded: the batch \
                               will be sent again");
                        return;
                    }
                    Err(e) => {
                        if !outage.away(&e) {
                            warn!(tenant_id = %tenant, error.cause_chain = %error_chain(&e),
                                  "failed to record an acknowledged batch: it will be sent again");
                        }
                        break;
                    }
                }
            }
            Err(failure) => {
                record_failure(inner, tenant, lease, failures, through, &failure).await;
                return;
            }
        }
    }
    if let Err(e) = inner.ledger.release_webhook(tenant, lease).await {
        debug!(tenant_id = %tenant, error.cause_chain = %error_chain(&e),
               "failed to give the tenant back; its lease lapses by itself");
    }
}

async fn record_failure(
    inner: &Inner,
    tenant: TenantId,
    lease: uuid::Uuid,
    failures: u32,
    through: i64,
    failure: &SendFailure,
) {
    inner.metrics.failed(failure.class);
    let failures = failures.saturating_add(1);
    let retry_in = match failure.retry_after {
        // The endpoint's wish, within nudge's bounds: never sooner than the backoff's base
        // (a `Retry-After: 0` is no reason to hammer it), never later than the ceiling.
        Some(asked) => asked
            .max(inner.policy.base_delay())
            .min(inner.policy.max_retry_after()),
        None => inner
            .policy
            .backoff(failures, &mut RandJitter::from_entropy()),
    };
    // 410 Gone: the endpoint says it is not coming back (Standard Webhooks' advice: disable).
    let disable_after = if failure.class == FailureClass::Gone {
        Duration::ZERO
    } else {
        inner.disable_after
    };
    let recorded = inner
        .ledger
        .webhook_failed(
            tenant,
            lease,
            &WebhookFailure {
                pending_through: through,
                error: failure.to_string(),
                retry_in,
                disable_after,
            },
        )
        .await;
    match recorded {
        Ok(FailureRecorded::Retrying) => {
            warn!(tenant_id = %tenant, class = failure.class.as_str(), detail = %failure.detail,
                  failures, retry_in_ms = u64::try_from(retry_in.as_millis()).unwrap_or(u64::MAX),
                  "event batch failed; retrying");
        }
        Ok(FailureRecorded::Disabled) => {
            inner.metrics.disabled();
            error!(tenant_id = %tenant, class = failure.class.as_str(), detail = %failure.detail,
                   "webhook disabled (failing for events.disable_after_s, or 410 Gone); its \
                    events wait for `nudgectl tenant webhook enable`");
        }
        Ok(FailureRecorded::LeaseLost) => {
            info!(tenant_id = %tenant, class = failure.class.as_str(),
                  "a batch failed after the webhook was disabled or its lease taken over");
        }
        Err(e) => {
            warn!(tenant_id = %tenant, error.cause_chain = %error_chain(&e),
                  "failed to record a failed batch; its lease lapses and it is retried");
        }
    }
}
