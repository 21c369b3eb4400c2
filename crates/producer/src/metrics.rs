//! The producer's Prometheus metrics, served on `telemetry.metrics_addr`.
//!
//! Labels are channels and fixed outcome names only: never a tenant's reminder data.

use std::sync::Arc;

use nudge_domain::Channel;
use nudge_telemetry::MetricRegistry;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ChannelLabels {
    channel: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct WindowLabels {
    outcome: &'static str,
}

/// - `nudge_relay_published_total{channel}`: first publishes of claimed work, confirmed.
/// - `nudge_relay_republished_total{channel}`: `queued` work whose message was missing from
///   the queue, published again and confirmed.
/// - `nudge_relay_unpublished_total{channel}`: publishes not confirmed (failed or timed out),
///   handed back to the ledger for the next pass.
/// - `nudge_windows_total{outcome}`: schedule windows run, `materialised`, `empty`, `paused`
///   (tenant paused: withheld) or `bad_schedule`.
/// - `nudge_window_deliveries_total`: deliveries the windows created.
/// - `nudge_series_occurrences_total`: occurrences of series the windows created as reminders.
/// - `nudge_series_unexpandable_total`: a window's series that could not be expanded (a stored
///   zone or rule that no longer parses); each is also an error log line.
#[derive(Debug)]
pub struct ProducerMetrics {
    registry: Arc<MetricRegistry>,
    published: Family<ChannelLabels, Counter>,
    republished: Family<ChannelLabels, Counter>,
    unpublished: Family<ChannelLabels, Counter>,
    windows: Family<WindowLabels, Counter>,
    window_deliveries: Counter,
    series_occurrences: Counter,
    series_unexpandable: Counter,
}

impl Default for ProducerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ProducerMetrics {
    pub fn new() -> Self {
        let mut registry = MetricRegistry::new();
        let published = Family::<ChannelLabels, Counter>::default();
        let republished = Family::<ChannelLabels, Counter>::default();
        let unpublished = Family::<ChannelLabels, Counter>::default();
        let windows = Family::<WindowLabels, Counter>::default();
        let window_deliveries = Counter::default();
        let series_occurrences = Counter::default();
        let series_unexpandable = Counter::default();
        registry.register(
            "nudge_relay_published",
            "Claimed deliveries published to the work queue with the broker's confirm",
            published.clone(),
        );
        registry.register(
            "nudge_relay_republished",
            "Queued deliveries whose message was missing, published again with a confirm",
            republished.clone(),
        );
        registry.register(
            "nudge_relay_unpublished",
            "Publishes not confirmed in time or refused, handed back to the ledger",
            unpublished.clone(),
        );
        registry.register(
            "nudge_windows",
            "Schedule windows run, by outcome",
            windows.clone(),
        );
        registry.register(
            "nudge_window_deliveries",
            "Deliveries created by schedule windows",
            window_deliveries.clone(),
        );
        registry.register(
            "nudge_series_occurrences",
            "Occurrences of recurring series created as reminders by schedule windows",
            series_occurrences.clone(),
        );
        registry.register(
            "nudge_series_unexpandable",
            "Series a window could not expand (a stored zone or rule no longer parses)",
            series_unexpandable.clone(),
        );
        Self {
            registry: Arc::new(registry),
            published,
            republished,
            unpublished,
            windows,
            window_deliveries,
            series_occurrences,
            series_unexpandable,
        }
    }

    pub fn registry(&self) -> Arc<MetricRegistry> {
        self.registry.clone()
    }

    /// The registry in the OpenMetrics text format, as `/metrics` serves it.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        self.registry.encode()
    }

    /// Counts one publish pass of `channel`: `republish` for lost messages sent again.
    pub fn published(&self, channel: Channel, republish: bool, ok: usize, failed: usize) {
        let labels = ChannelLabels {
            channel: channel.as_str(),
        };
        let family = if republish {
            &self.republished
        } else {
            &self.published
        };
        if ok > 0 {
            family.get_or_create(&labels).inc_by(as_u64(ok));
        }
        if failed > 0 {
            self.unpublished
                .get_or_create(&labels)
                .inc_by(as_u64(failed));
        }
    }

    /// Counts one window run, the deliveries it created and the series' occurrences it made
    /// reminders of.
    pub fn window(&self, outcome: &'static str, deliveries_created: u64, occurrences: u64) {
        self.windows.get_or_create(&WindowLabels { outcome }).inc();
        self.window_deliveries.inc_by(deliveries_created);
        self.series_occurrences.inc_by(occurrences);
    }

    /// Counts series a window could not expand.
    pub fn series_unexpandable(&self, series: u64) {
        self.series_unexpandable.inc_by(series);
    }
}

fn as_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use super::*;

    #[test]
    fn publishes_republishes_hand_backs_and_windows_are_counted() {
        let metrics = ProducerMetrics::new();
        metrics.published(Channel::Sms, false, 3, 1);
        metrics.published(Channel::Sms, true, 2, 0);
        metrics.window("materialised", 5, 2);
        metrics.window("empty", 0, 1);
        metrics.series_unexpandable(2);
        let text = metrics.encode().expect("encodes");
        for line in [
            "nudge_relay_published_total{channel=\"sms\"} 3\n",
            "nudge_relay_republished_total{channel=\"sms\"} 2\n",
            "nudge_relay_unpublished_total{channel=\"sms\"} 1\n",
            "nudge_windows_total{outcome=\"materialised\"} 1\n",
            "nudge_windows_total{outcome=\"empty\"} 1\n",
            "nudge_window_deliveries_total 5\n",
            "nudge_series_occurrences_total 3\n",
            "nudge_series_unexpandable_total 2\n",
        ] {
            assert!(text.contains(line), "{line} missing from {text}");
        }
    }
}
