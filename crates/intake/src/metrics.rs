//! The intake's Prometheus metrics. Labels are route templates, status codes, reasons and
//! outcomes from fixed sets: never a tenant's request data, a subscriber or a destination.

use std::sync::Arc;

use nudge_telemetry::MetricRegistry;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    status: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// - `nudge_intake_requests_total{route, status}`: answered requests by route template.
/// - `nudge_intake_request_duration_seconds{route, status}`: how long they took.
/// - `nudge_intake_refusals_total{reason}`: 401s by reason (`unknown_tenant` included here,
///   though the client is told `bad_signature`).
/// - `nudge_intake_reminders_total{outcome}`: reminders `accepted`, `duplicate`, `conflict`,
///   `invalid`.
#[derive(Debug)]
pub struct IntakeMetrics {
    registry: Arc<MetricRegistry>,
    requests: Family<RequestLabels, Counter>,
    durations: Family<RequestLabels, Histogram>,
    refusals: Family<ReasonLabels, Counter>,
    reminders: Family<OutcomeLabels, Counter>,
}

impl Default for IntakeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl IntakeMetrics {
    pub fn new() -> Self {
        let mut registry = MetricRegistry::new();
        let requests = Family::<RequestLabels, Counter>::default();
        let durations = Family::<RequestLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 14))
        });
        let refusals = Family::<ReasonLabels, Counter>::default();
        let reminders = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "nudge_intake_requests",
            "Answered HTTP requests",
            requests.clone(),
        );
        registry.register(
            "nudge_intake_request_duration_seconds",
            "Time to answer an HTTP request",
            durations.clone(),
        );
        registry.register(
            "nudge_intake_refusals",
            "Requests refused as not authenticated",
            refusals.clone(),
        );
        registry.register(
            "nudge_intake_reminders",
            "Reminders posted, by what became of them",
            reminders.clone(),
        );
        Self {
            registry: Arc::new(registry),
            requests,
            durations,
            refusals,
            reminders,
        }
    }

    pub fn registry(&self) -> Arc<MetricRegistry> {
        self.registry.clone()
    }

    pub fn request(&self, route: &str, status: u16, seconds: f64) {
        let labels = RequestLabels {
            route: route.to_owned(),
            status,
        };
        self.requests.get_or_create(&labels).inc();
        self.durations.get_or_create(&labels).observe(seconds);
    }

    pub fn refusal(&self, reason: &'static str) {
        self.refusals.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub fn reminder(&self, outcome: &'static str) {
        self.reminders
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// The registry in the OpenMetrics text format.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        self.registry.encode()
    }
}
