//! The admin listener every long-running binary serves on `telemetry.metrics_addr`:
//! `GET /metrics` (the OpenMetrics text of one [`MetricRegistry`]), `GET /healthz` (the process
//! answers) and `GET /readyz` (the binary's own readiness check, bounded in time).
//!
//! The registry is passed in, never global: each binary registers its own families and hands
//! the registry here. [`MetricRegistry`] remembers the name and type of every family it was
//! given, so the list of what a binary exports is read from the code that registers it (the
//! dashboards' and alert rules' test compares against it), not kept by hand.
//!
//! The listener serves nothing but these three paths, so it can sit on an admin port that is
//! not exposed with the service.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};

use crate::error_chain;

/// The content type of the OpenMetrics text exposition format.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long `/readyz` waits for the readiness check before answering 503.
pub const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// One registered metric family: its name as registered (a counter without `_total`) and its
/// OpenMetrics type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyName {
    pub name: String,
    pub kind: &'static str,
}

impl FamilyName {
    /// The names of the samples a scrape carries for this family, as PromQL sees them:
    /// `<name>_total` for a counter, `<name>_bucket`, `_sum` and `_count` for a histogram,
    /// the name itself otherwise.
    pub fn sample_names(&self) -> Vec<String> {
        match self.kind {
            "counter" => vec![format!("{}_total", self.name)],
            "histogram" => ["_bucket", "_sum", "_count"]
                .iter()
                .map(|suffix| format!("{}{suffix}", self.name))
                .collect(),
            _ => vec![self.name.clone()],
        }
    }
}

/// A Prometheus registry that also lists what was registered in it.
#[derive(Debug, Default)]
pub struct MetricRegistry {
    registry: Registry,
    families: Vec<FamilyName>,
}

impl MetricRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `metric` as `name` (a counter without `_total`: the encoder adds it).
    pub fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        let kind = match metric.metric_type() {
            MetricType::Counter => "counter",
            MetricType::Gauge => "gauge",
            MetricType::Histogram => "histogram",
            MetricType::Info => "info",
            MetricType::Unknown => "unknown",
        };
        self.families.push(FamilyName {
            name: name.to_owned(),
            kind,
        });
        self.registry.register(name, help, metric);
    }

    /// Every family registered, in registration order.
    pub fn families(&self) -> &[FamilyName] {
        &self.families
    }

    /// The registry in the OpenMetrics text format, as `/metrics` serves it. Families with no
    /// series yet are left out.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// Why a binary is not ready: a fixed phrase naming what does not answer, never a URL.
pub type NotReady = &'static str;

/// A binary's readiness check: resolves to `Ok(())` when it can do its work.
pub type ReadyCheck =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), NotReady>> + Send>> + Send + Sync>;

/// A readiness check that always passes (the process answering is all there is to check).
pub fn always_ready() -> ReadyCheck {
    Arc::new(|| Box::pin(async { Ok(()) }))
}

#[derive(Clone)]
struct Admin {
    registry: Arc<MetricRegistry>,
    ready: ReadyCheck,
}

/// Binds `addr`, serves `/metrics`, `/healthz` and `/readyz` in the background until
/// `shutdown` completes, and returns the bound address (the real port when `addr` asked for
/// port 0).
///
/// Binding happens before this returns, so a taken or invalid address is an error for the
/// caller to report at start-up; a failure of the running server later is logged here.
pub async fn serve_admin(
    addr: SocketAddr,
    registry: Arc<MetricRegistry>,
    ready: ReadyCheck,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Admin { registry, ready });
    tracing::info!(metrics_addr = %bound, "admin listener (metrics, health, readiness) listening");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error.cause_chain = %error_chain(&e), metrics_addr = %bound, "admin listener failed");
        }
    });
    Ok(bound)
}

async fn metrics(State(admin): State<Admin>) -> Response {
    match admin.registry.encode() {
        Ok(body) => ([(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)], body).into_response(),
        Err(e) => {
            tracing::error!(error.cause_chain = %error_chain(&e), "failed to encode metrics");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(admin): State<Admin>) -> Response {
    match tokio::time::timeout(READY_TIMEOUT, (admin.ready)()).await {
        Ok(Ok(())) => (StatusCode::OK, "ready").into_response(),
        Ok(Err(why)) => (StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
        Err(_elapsed) => {
            (StatusCode::SERVICE_UNAVAILABLE, "readiness check timed out").into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::Histogram;

    use super::*;

    #[test]
    fn the_registry_lists_each_family_with_the_sample_names_a_scrape_carries() {
        let mut registry = MetricRegistry::new();
        registry.register("nudge_a", "a counter", Counter::<u64>::default());
        registry.register("nudge_b", "a gauge", Gauge::<i64>::default());
        registry.register("nudge_c_seconds", "a histogram", Histogram::new([1.0, 2.0]));
        let samples: Vec<String> = registry
            .families()
            .iter()
            .flat_map(FamilyName::sample_names)
            .collect();
        assert_eq!(
            samples,
            [
                "nudge_a_total",
                "nudge_b",
                "nudge_c_seconds_bucket",
                "nudge_c_seconds_sum",
                "nudge_c_seconds_count"
            ]
        );
    }
}
