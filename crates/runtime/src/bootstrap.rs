//! The one start-up of the long-running binaries, in the shape of zero-to-production's
//! `Application::build`: configuration, telemetry, the shutdown token, the ledger, the broker
//! (topology declared, connection named after the service) and the admin listener
//! (`/metrics`, `/healthz`, `/readyz` on `telemetry.metrics_addr`). A binary's `run_binary` is
//! [`load_config`], [`Application::build`], then its own loop.
//!
//! It must never decide anything about the work itself: it hands out connected resources
//! and the token; what a binary does with them, and how it stops, stays in the binary.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use nudge_broker::{Broker, Topology};
use nudge_config::{AmqpConfig, DatabaseConfig, TelemetryConfig, Validate};
use nudge_ledger::Ledger;
use nudge_telemetry::{MetricRegistry, ReadyCheck, TelemetryGuard};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::info;

/// What the bootstrap needs to know of a binary's configuration struct.
pub trait ServiceConfig: DeserializeOwned + serde::Serialize + Default + Validate {
    /// The top-level sections the binary reads (passed to `nudge_config::load`).
    const SECTIONS: &'static [&'static str];

    fn database(&self) -> &DatabaseConfig;

    fn telemetry(&self) -> &TelemetryConfig;

    /// The broker section, for binaries that use RabbitMQ (the intake does not).
    fn amqp(&self) -> Option<&AmqpConfig> {
        None
    }

    /// The sender whose deliveries this process claims or leases (`Ledger::for_sender`), for
    /// binaries that claim or lease.
    fn sender(&self) -> Option<&str> {
        None
    }
}

/// Loads a binary's configuration: defaults, the TOML file, `NUDGE_` variables, validation.
pub fn load_config<C: ServiceConfig>(config_file: Option<&Path>) -> anyhow::Result<C> {
    nudge_config::load(config_file, C::SECTIONS).context("failed to load configuration")
}

/// A started process: its configuration and the resources every long-running binary shares.
/// Hold it until `main` returns (it keeps telemetry alive), and call [`Application::stop`]
/// when the binary's loops have returned.
#[derive(Debug)]
pub struct Application<C> {
    pub service: &'static str,
    pub config: C,
    pub ledger: Ledger,
    /// Connected with the topology declared; `None` when the configuration has no broker.
    pub broker: Option<Broker>,
    /// Cancelled by SIGTERM or Ctrl-C.
    pub shutdown: CancellationToken,
    /// Where `/metrics`, `/healthz` and `/readyz` are served, when `telemetry.metrics_addr`
    /// is set.
    pub metrics_addr: Option<SocketAddr>,
    _telemetry: TelemetryGuard,
}

impl<C: ServiceConfig> Application<C> {
    /// Initialises telemetry as `service`, installs the shutdown token, connects the ledger
    /// (for the configured sender) and the broker (named `service` in RabbitMQ's connection
    /// list), and serves `metrics` on `telemetry.metrics_addr` when that is set, with
    /// `/healthz` (the process answers) and `/readyz` (the ledger answers and takes writes and,
    /// for a binary with a broker, its connection is open).
    ///
    /// Must be called inside a tokio runtime, once per process (telemetry is global).
    pub async fn build(
        service: &'static str,
        config: C,
        metrics: Arc<MetricRegistry>,
    ) -> anyhow::Result<Self> {
        let telemetry = nudge_telemetry::init(service, config.telemetry())
            .context("failed to initialise logging")?;
        let shutdown = crate::shutdown_on_signal();
        let mut ledger = Ledger::connect(config.database())
            .await
            .context("failed to connect to PostgreSQL (database.url)")?;
        if let Some(sender) = config.sender() {
            ledger = ledger
                .for_sender(sender)
                .with_context(|| format!("invalid sender name for {service}"))?;
        }
        let broker = match config.amqp() {
            Some(amqp) => Some(connect_broker(service, amqp).await?),
            None => None,
        };
        let metrics_addr = match config.telemetry().metrics_addr {
            Some(addr) => Some(
                nudge_telemetry::serve_admin(
                    addr,
                    metrics,
                    readiness(ledger.clone(), broker.clone()),
                    shutdown.clone().cancelled_owned(),
                )
                .await
                .with_context(|| {
                    format!("failed to listen for metrics on {addr} (telemetry.metrics_addr)")
                })?,
            ),
            None => None,
        };
        info!(service, "started");
        Ok(Self {
            service,
            config,
            ledger,
            broker,
            shutdown,
            metrics_addr,
            _telemetry: telemetry,
        })
    }

    /// The broker, for binaries whose configuration always has one.
    pub fn broker(&self) -> anyhow::Result<Broker> {
        self.broker
            .clone()
            .with_context(|| format!("{} was built without a broker", self.service))
    }

    /// Closes the broker connection (if any) and reports a clean stop. Call after the
    /// binary's loops have returned.
    pub async fn stop(self) {
        if let Some(broker) = &self.broker {
            broker.close().await;
        }
        info!(service = self.service, "stopped cleanly");
    }
}

/// Ready when the ledger answers and takes writes (not a standby, not read-only: a failover
/// under way) and the broker connection (if any) is open.
fn readiness(ledger: Ledger, broker: Option<Broker>) -> ReadyCheck {
    Arc::new(move || {
        let (ledger, broker) = (ledger.clone(), broker.clone());
        Box::pin(async move {
            match ledger.check_writable().await {
                Ok(()) => {}
                Err(nudge_ledger::LedgerError::ReadOnly) => return Err("ledger read-only"),
                Err(_) => return Err("ledger not reachable"),
            }
            match broker {
                Some(broker) if !broker.is_connected().await => Err("broker not connected"),
                _ => Ok(()),
            }
        })
    })
}

async fn connect_broker(service: &str, amqp: &AmqpConfig) -> anyhow::Result<Broker> {
    let topology = Topology::new(&amqp.namespace, amqp.delivery_limit)
        .context("invalid amqp.namespace or amqp.delivery_limit")?;
    Broker::connect_named(
        &amqp.addresses(),
        Duration::from_millis(amqp.connect_timeout_ms),
        topology,
        service,
    )
    .await
    .context("failed to connect to RabbitMQ (amqp.url or amqp.urls)")
}
