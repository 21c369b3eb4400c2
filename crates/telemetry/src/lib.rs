//! Telemetry set-up shared by every nudge binary.
//!
//! Owns: installing the process-wide tracing subscriber once, from `main`, via [`init`] (JSON or
//! human-readable logs on stderr, filtered by `RUST_LOG` or `telemetry.log_filter`), the
//! [`TelemetryGuard`] that flushes on exit, [`error_chain`] for reporting an error once with its
//! causes, [`MetricRegistry`] (a Prometheus registry that lists what it holds) and
//! [`serve_admin`], the admin listener (`/metrics`, `/healthz`, `/readyz`) a binary starts on
//! `telemetry.metrics_addr` with its own registry and readiness check. When
//! `telemetry.otlp_endpoint` is set, spans are exported over OTLP (HTTP/protobuf, batch
//! exporter), JSON log lines carry `trace_id` and `span_id`, and [`traceparent_of`] /
//! [`set_parent_from_traceparent`] carry W3C context across RabbitMQ and to providers.
//!
//! Must never: have [`init`] called from a library crate (libraries emit `tracing` events and
//! spans, and use the context helpers), log or put on a span a destination, subscriber
//! reference, message body or secret (it logs only the service name, the log format and the
//! metrics address), or panic when called twice.

mod json;
mod metrics;
mod otel;

use std::io::{IsTerminal as _, Write as _};

pub use metrics::{
    FamilyName, MetricRegistry, NotReady, OPENMETRICS_CONTENT_TYPE, READY_TIMEOUT, ReadyCheck,
    always_ready, serve_admin,
};
use nudge_config::{LogFormat, TelemetryConfig};
pub use otel::{
    TRACEPARENT, delivery_context, set_delivery_parent, set_parent_from_traceparent, traceparent_of,
};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::ParseError;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::{SubscriberInitExt as _, TryInitError};

/// Why telemetry could not be started.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The log filter is not valid `EnvFilter` syntax. `key` is `telemetry.log_filter`, or
    /// `RUST_LOG` when that variable was set and therefore used instead.
    #[error("invalid configuration: {key}: not a valid tracing filter")]
    InvalidFilter {
        /// Where the filter came from.
        key: &'static str,
        /// The parse failure, naming the bad directive.
        #[source]
        source: ParseError,
    },

    /// A global subscriber (or `log` logger) is already installed, e.g. `init` ran twice.
    #[error("telemetry is already initialised in this process")]
    AlreadyInitialised(#[source] TryInitError),

    /// The OTLP exporter could not be built from `telemetry.otlp_endpoint`.
    #[error("invalid configuration: telemetry.otlp_endpoint: {0}")]
    Otlp(String),
}

/// Keeps telemetry alive; hold it until `main` returns, then let it drop: dropping it exports
/// the spans still buffered (bounded by the exporter's timeout) and flushes stderr.
#[must_use = "dropping the guard flushes and stops telemetry; bind it (`let _telemetry = ...`) in main"]
#[derive(Debug)]
pub struct TelemetryGuard {
    traces: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.traces.take().map(|provider| provider.shutdown()) {
            tracing::warn!(error.cause_chain = %error_chain(&e), "failed to export the last spans");
        }
        // Nowhere left to report a failed flush of stderr; the process is exiting.
        let _ = std::io::stderr().flush();
    }
}

/// Installs the global tracing subscriber for `service_name` and returns the guard.
///
/// - Filter: `RUST_LOG` when set and non-empty, else `cfg.log_filter`; an invalid one is an error
///   naming its source.
/// - Format: [`LogFormat::Json`] writes one object per line with `service` (= `service_name`),
///   `timestamp`, `level`, `target`, `fields`, `span` and `spans`; [`LogFormat::Pretty`] writes
///   human-readable lines, coloured when stderr is a terminal.
/// - Bridges `log` records from dependencies into tracing.
///
/// Call once, first thing in `main` after loading config; a second call returns
/// [`TelemetryError::AlreadyInitialised`].
pub fn init(
    service_name: &'static str,
    cfg: &TelemetryConfig,
) -> Result<TelemetryGuard, TelemetryError> {
    let rust_log = std::env::var("RUST_LOG").ok();
    let filter = build_filter(rust_log.as_deref(), &cfg.log_filter)?;

    let traces = cfg
        .otlp_endpoint
        .as_deref()
        .map(|endpoint| otel::provider(service_name, endpoint))
        .transpose()?;
    let otel_layer = traces.as_ref().map(|provider| {
        tracing_opentelemetry::layer().with_tracer(otel::tracer(provider, service_name))
    });
    let trace_ids = traces.is_some();
    let (json, pretty) = match cfg.log_format {
        LogFormat::Json => (
            Some(json::json_layer(service_name, trace_ids, std::io::stderr)),
            None,
        ),
        LogFormat::Pretty => (
            None,
            Some(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(std::io::stderr().is_terminal()),
            ),
        ),
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(otel_layer)
        .with(json)
        .with(pretty)
        .try_init()
        .map_err(TelemetryError::AlreadyInitialised)?;

    // `metrics_addr` is served by each binary through [`serve_admin`], with its own registry.
    tracing::info!(service = service_name, log_format = ?cfg.log_format,
                   otlp_export = trace_ids, "telemetry initialised");

    Ok(TelemetryGuard { traces })
}

/// The filter from `RUST_LOG` when set and non-empty, else from the configured directives.
pub(crate) fn build_filter(
    rust_log: Option<&str>,
    configured: &str,
) -> Result<EnvFilter, TelemetryError> {
    let (key, directives) = match rust_log.filter(|v| !v.trim().is_empty()) {
        Some(v) => ("RUST_LOG", v),
        None => ("telemetry.log_filter", configured),
    };
    EnvFilter::try_new(directives).map_err(|source| TelemetryError::InvalidFilter { key, source })
}

/// `e` and each of its sources, joined with `": "`, for the one place an error is reported:
/// `error.cause_chain = %error_chain(&e)` (`%error_chain(&*e)` for an `anyhow::Error`), the
/// only way an error is logged (see docs/OBSERVABILITY.md, "Logging an error").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("failed to lease delivery")]
    struct Outer(#[source] Middle);

    #[derive(Debug, thiserror::Error)]
    #[error("query failed")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn error_chain_joins_every_source_with_a_colon() {
        let e = Outer(Middle(std::io::Error::other("connection reset")));
        assert_eq!(
            error_chain(&e),
            "failed to lease delivery: query failed: connection reset"
        );
    }

    #[test]
    fn error_chain_of_an_error_without_source_is_its_message() {
        let e = std::io::Error::other("boom");
        assert_eq!(error_chain(&e), "boom");
    }

    #[test]
    fn the_configured_filter_is_used_when_rust_log_is_unset_or_empty() {
        for rust_log in [None, Some(""), Some("  ")] {
            let filter = build_filter(rust_log, "warn,nudge=debug");
            assert_eq!(
                filter.map(|f| f.to_string()).ok().as_deref(),
                Some("nudge=debug,warn")
            );
        }
    }

    #[test]
    fn rust_log_wins_over_the_configured_filter() {
        let filter = build_filter(Some("trace"), "info");
        assert_eq!(filter.map(|f| f.to_string()).ok().as_deref(), Some("trace"));
    }

    #[test]
    fn an_invalid_configured_filter_names_telemetry_log_filter() {
        let err = build_filter(None, "nudge=loud").err();
        assert!(
            matches!(
                err,
                Some(TelemetryError::InvalidFilter {
                    key: "telemetry.log_filter",
                    ..
                })
            ),
            "{err:?}"
        );
        let message = err.map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(
            message,
            "invalid configuration: telemetry.log_filter: not a valid tracing filter"
        );
    }

    #[test]
    fn an_invalid_rust_log_names_rust_log() {
        let err = build_filter(Some("nudge=loud"), "info").err();
        assert!(
            matches!(
                err,
                Some(TelemetryError::InvalidFilter {
                    key: "RUST_LOG",
                    ..
                })
            ),
            "{err:?}"
        );
    }
}
