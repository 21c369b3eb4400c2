//! The worker's Prometheus metrics, served on `telemetry.metrics_addr` by `run_binary`.
//!
//! Labels are opaque ids and classes only (provider account, channel, outcome class, state,
//! reason): never a destination, subscriber reference or anything from a message. Each family's
//! label values come from a small fixed set or from configuration, so cardinality stays bounded.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use nudge_domain::{Channel, DeliveryState, OutcomeClass, ProviderAccount};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BucketLabels {
    provider_account: String,
    channel: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct AttemptLabels {
    channel: &'static str,
    outcome_class: &'static str,
    next_state: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DeferralLabels {
    provider_account: String,
    channel: &'static str,
    reason: &'static str,
}

type RateGauge = Gauge<f64, AtomicU64>;

/// The worker's metric families and the registry that holds them.
///
/// - `nudge_bucket_effective_rate{provider_account, channel}`: the bucket's current rate (sends
///   per second) after 429 slow-downs, as last seen by this worker.
/// - `nudge_bucket_rate{provider_account, channel}`: the bucket's configured rate.
/// - `nudge_attempts_total{channel, outcome_class, next_state}`: attempts whose decision was
///   recorded in the ledger.
/// - `nudge_admission_deferrals_total{provider_account, channel, reason}`: leases given back to
///   the ledger because the bucket had no slot in time (reason `bucket_closed`,
///   `bucket_throttled`, `bucket_paused` or `bucket_closed_while_waiting`).
#[derive(Debug)]
pub struct WorkerMetrics {
    registry: Arc<Registry>,
    effective_rate: Family<BucketLabels, RateGauge>,
    rate: Family<BucketLabels, RateGauge>,
    attempts: Family<AttemptLabels, Counter>,
    deferrals: Family<DeferralLabels, Counter>,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl WorkerMetrics {
    /// A fresh registry holding the worker's families, all empty.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let effective_rate = Family::<BucketLabels, RateGauge>::default();
        let rate = Family::<BucketLabels, RateGauge>::default();
        let attempts = Family::<AttemptLabels, Counter>::default();
        let deferrals = Family::<DeferralLabels, Counter>::default();
        registry.register(
            "nudge_bucket_effective_rate",
            "Current send rate of the rate bucket in sends per second, after 429 slow-downs",
            effective_rate.clone(),
        );
        registry.register(
            "nudge_bucket_rate",
            "Configured send rate of the rate bucket in sends per second",
            rate.clone(),
        );
        // Counters are registered without `_total`: the encoder appends it.
        registry.register(
            "nudge_attempts",
            "Send attempts whose decision was recorded in the ledger",
            attempts.clone(),
        );
        registry.register(
            "nudge_admission_deferrals",
            "Leases given back to the ledger because the rate bucket had no slot in time",
            deferrals.clone(),
        );
        Self {
            registry: Arc::new(registry),
            effective_rate,
            rate,
            attempts,
            deferrals,
        }
    }

    /// The registry to serve on `/metrics`.
    pub fn registry(&self) -> Arc<Registry> {
        self.registry.clone()
    }

    /// The registry in the OpenMetrics text format, as `/metrics` serves it.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }

    /// Records a bucket's configured and effective rates, from an admission.
    pub fn bucket(
        &self,
        account: &ProviderAccount,
        channel: Channel,
        rate_per_second: f64,
        effective_rate: f64,
    ) {
        let labels = bucket_labels(account, channel);
        self.rate.get_or_create(&labels).set(rate_per_second);
        self.effective_rate
            .get_or_create(&labels)
            .set(effective_rate);
    }

    /// Records a bucket's effective rate, from provider feedback (which does not report the
    /// configured rate).
    pub fn effective_rate(&self, account: &ProviderAccount, channel: Channel, effective_rate: f64) {
        self.effective_rate
            .get_or_create(&bucket_labels(account, channel))
            .set(effective_rate);
    }

    /// Counts an attempt whose decision was recorded.
    pub fn attempt(
        &self,
        channel: Channel,
        outcome_class: OutcomeClass,
        next_state: DeliveryState,
    ) {
        self.attempts
            .get_or_create(&AttemptLabels {
                channel: channel.as_str(),
                outcome_class: outcome_class.as_str(),
                next_state: next_state.as_str(),
            })
            .inc();
    }

    /// Counts a lease given back to the ledger for want of a send slot.
    pub fn deferral(&self, account: &ProviderAccount, channel: Channel, reason: &'static str) {
        self.deferrals
            .get_or_create(&DeferralLabels {
                provider_account: account.as_str().to_owned(),
                channel: channel.as_str(),
                reason,
            })
            .inc();
    }
}

fn bucket_labels(account: &ProviderAccount, channel: Channel) -> BucketLabels {
    BucketLabels {
        provider_account: account.as_str().to_owned(),
        channel: channel.as_str(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use super::*;

    fn account() -> ProviderAccount {
        ProviderAccount::parse("sms-main").expect("a valid account")
    }

    #[test]
    fn a_bucket_admission_sets_both_rate_gauges() {
        let metrics = WorkerMetrics::new();
        metrics.bucket(&account(), Channel::Sms, 20.0, 15.0);
        let text = metrics.encode().expect("encodes");
        assert!(
            text.contains(
                "nudge_bucket_effective_rate{provider_account=\"sms-main\",channel=\"sms\"} 15.0\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "nudge_bucket_rate{provider_account=\"sms-main\",channel=\"sms\"} 20.0\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn feedback_moves_the_effective_rate_and_leaves_the_configured_rate() {
        let metrics = WorkerMetrics::new();
        metrics.bucket(&account(), Channel::Sms, 20.0, 20.0);
        metrics.effective_rate(&account(), Channel::Sms, 10.0);
        let text = metrics.encode().expect("encodes");
        assert!(
            text.contains(
                "nudge_bucket_effective_rate{provider_account=\"sms-main\",channel=\"sms\"} 10.0\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "nudge_bucket_rate{provider_account=\"sms-main\",channel=\"sms\"} 20.0\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn attempts_and_deferrals_are_counted_with_total_suffixes() {
        let metrics = WorkerMetrics::new();
        metrics.attempt(
            Channel::Push,
            OutcomeClass::Delivered,
            DeliveryState::Delivered,
        );
        metrics.attempt(
            Channel::Push,
            OutcomeClass::Delivered,
            DeliveryState::Delivered,
        );
        metrics.deferral(&account(), Channel::Push, "bucket_throttled");
        let text = metrics.encode().expect("encodes");
        assert!(
            text.contains(
                "nudge_attempts_total{channel=\"push\",outcome_class=\"delivered\",next_state=\"delivered\"} 2\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "nudge_admission_deferrals_total{provider_account=\"sms-main\",channel=\"push\",reason=\"bucket_throttled\"} 1\n"
            ),
            "{text}"
        );
    }
}
