//! The push's Prometheus metrics, served on `telemetry.metrics_addr`.
//!
//! Labels are fixed classes and states, never a tenant's URL, a destination or content.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use nudge_ledger::WebhookCounts;
use nudge_telemetry::MetricRegistry;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use crate::send::FailureClass;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClassLabels {
    class: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

type F64Gauge = Gauge<f64, AtomicU64>;

/// The push's families:
/// - `nudge_events_pushed_total`: events an endpoint acknowledged (2xx).
/// - `nudge_events_batches_total`: batches acknowledged.
/// - `nudge_events_push_failures_total{class}`: failed batches by [`FailureClass`].
/// - `nudge_events_webhooks_disabled_total`: webhooks this process disabled after failing
///   for `events.disable_after_s`.
/// - `nudge_events_push_lag_seconds`: per event, from the change (its `occurred_at`, the
///   database's time) to its batch's acknowledgement.
/// - `nudge_events_webhooks{state}`: `enabled`, `failing` (enabled, a retry waiting),
///   `disabled` (by nudge-events, after failing; alerted) and `disabled_by_operator`; read
///   from the ledger every `events.metrics_interval_ms`.
/// - `nudge_events_webhooks_behind`: enabled webhooks with numbered events their endpoint has
///   not acknowledged; `nudge_events_oldest_unacknowledged_seconds`: how long ago the oldest
///   of those happened (0 when none is behind). Read with the states.
#[derive(Debug)]
pub struct EventsMetrics {
    registry: Arc<MetricRegistry>,
    pushed: Counter,
    batches: Counter,
    failures: Family<ClassLabels, Counter>,
    disabled: Counter,
    lag: Histogram,
    webhooks: Family<StateLabels, Gauge>,
    behind: Gauge,
    oldest_unacknowledged: F64Gauge,
    refreshed: F64Gauge,
}

impl Default for EventsMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl EventsMetrics {
    pub fn new() -> Self {
        let mut registry = MetricRegistry::new();
        let metrics = Self {
            registry: Arc::new(MetricRegistry::new()),
            pushed: Counter::default(),
            batches: Counter::default(),
            failures: Family::default(),
            disabled: Counter::default(),
            lag: Histogram::new(exponential_buckets(0.01, 2.0, 16)),
            webhooks: Family::default(),
            behind: Gauge::default(),
            oldest_unacknowledged: F64Gauge::default(),
            refreshed: F64Gauge::default(),
        };
        registry.register(
            "nudge_events_pushed",
            "Delivery events a tenant's endpoint acknowledged",
            metrics.pushed.clone(),
        );
        registry.register(
            "nudge_events_batches",
            "Batches of delivery events a tenant's endpoint acknowledged",
            metrics.batches.clone(),
        );
        registry.register(
            "nudge_events_push_failures",
            "Batches of delivery events that failed, by class",
            metrics.failures.clone(),
        );
        registry.register(
            "nudge_events_webhooks_disabled",
            "Webhooks disabled after failing for events.disable_after_s",
            metrics.disabled.clone(),
        );
        registry.register(
            "nudge_events_push_lag_seconds",
            "From a delivery's change to the acknowledgement of its event's batch",
            metrics.lag.clone(),
        );
        registry.register(
            "nudge_events_webhooks",
            "Tenants' webhooks by state (enabled, failing, disabled, disabled_by_operator)",
            metrics.webhooks.clone(),
        );
        registry.register(
            "nudge_events_webhooks_behind",
            "Enabled webhooks with numbered events their endpoint has not acknowledged",
            metrics.behind.clone(),
        );
        registry.register(
            "nudge_events_oldest_unacknowledged_seconds",
            "How long ago the oldest event an enabled webhook has not acknowledged happened",
            metrics.oldest_unacknowledged.clone(),
        );
        registry.register(
            "nudge_events_webhooks_refreshed_timestamp_seconds",
            "When the webhooks' states were last read from the ledger",
            metrics.refreshed.clone(),
        );
        for class in FailureClass::ALL {
            // Every class is exported from the start, at 0.
            drop(metrics.failures.get_or_create(&ClassLabels {
                class: class.as_str(),
            }));
        }
        Self {
            registry: Arc::new(registry),
            ..metrics
        }
    }

    pub fn registry(&self) -> Arc<MetricRegistry> {
        self.registry.clone()
    }

    pub(crate) fn acknowledged(&self, lags: impl Iterator<Item = f64>) {
        self.batches.inc();
        for lag in lags {
            self.pushed.inc();
            self.lag.observe(lag.max(0.0));
        }
    }

    pub(crate) fn failed(&self, class: FailureClass) {
        self.failures
            .get_or_create(&ClassLabels {
                class: class.as_str(),
            })
            .inc();
    }

    pub(crate) fn disabled(&self) {
        self.disabled.inc();
    }

    pub(crate) fn webhooks(&self, counts: WebhookCounts) {
        let set = |state, value: u64| {
            self.webhooks
                .get_or_create(&StateLabels { state })
                .set(i64::try_from(value).unwrap_or(i64::MAX));
        };
        set("enabled", counts.enabled);
        set("failing", counts.failing);
        set("disabled", counts.disabled);
        set("disabled_by_operator", counts.disabled_by_operator);
        self.behind
            .set(i64::try_from(counts.behind).unwrap_or(i64::MAX));
        self.oldest_unacknowledged
            .set(counts.oldest_unacknowledged_s);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.refreshed.set(now);
    }

    /// The registry in the OpenMetrics text format, as `/metrics` serves it.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        self.registry.encode()
    }
}
