//! The console's Prometheus metrics, served on `telemetry.metrics_addr`.
//!
//! Labels are the fixed names of pages and actions, never an id or a user.

use std::sync::Arc;

use nudge_telemetry::MetricRegistry;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PageLabels {
    page: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ActionLabels {
    action: &'static str,
    outcome: &'static str,
}

/// The console's families:
/// - `nudge_console_page_seconds{page}`: the server's time to answer a page (its queries and
///   rendering).
/// - `nudge_console_actions_total{action,outcome}`: operator actions, `done`, `refused`
///   (not an operator, or no valid CSRF token: nothing written) or `failed`.
/// - `nudge_console_logins_total{outcome}`: `ok` or `refused`.
#[derive(Debug)]
pub struct ConsoleMetrics {
    registry: Arc<MetricRegistry>,
    page: Family<PageLabels, Histogram>,
    actions: Family<ActionLabels, Counter>,
    logins: Family<OutcomeLabels, Counter>,
}

impl Default for ConsoleMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ConsoleMetrics {
    pub fn new() -> Self {
        let mut registry = MetricRegistry::new();
        let page = Family::<PageLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 14))
        });
        let actions = Family::<ActionLabels, Counter>::default();
        let logins = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "nudge_console_page_seconds",
            "Server time to answer a console page",
            page.clone(),
        );
        registry.register(
            "nudge_console_actions",
            "Operator actions taken through the console, by outcome",
            actions.clone(),
        );
        registry.register(
            "nudge_console_logins",
            "Console logins, by outcome",
            logins.clone(),
        );
        Self {
            registry: Arc::new(registry),
            page,
            actions,
            logins,
        }
    }

    pub fn registry(&self) -> Arc<MetricRegistry> {
        self.registry.clone()
    }

    pub fn page(&self, page: &'static str, seconds: f64) {
        self.page
            .get_or_create(&PageLabels { page })
            .observe(seconds);
    }

    pub fn action(&self, action: &'static str, outcome: &'static str) {
        self.actions
            .get_or_create(&ActionLabels { action, outcome })
            .inc();
    }

    pub fn login(&self, ok: bool) {
        let outcome = if ok { "ok" } else { "refused" };
        self.logins.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    /// The families as Prometheus text (for tests).
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        self.registry.encode()
    }
}
