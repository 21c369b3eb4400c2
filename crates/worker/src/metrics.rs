//! The worker's Prometheus metrics, served on `telemetry.metrics_addr` by `run_binary`.
//!
//! Labels are opaque ids and classes only (provider account, channel, response and outcome
//! class, state, reason): never a destination, subscriber reference or anything from a
//! message. Each family's label values come from a small fixed set or from configuration, so
//! cardinality stays bounded.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use nudge_domain::{Channel, DeliveryState, OutcomeClass, ProviderAccount};
use nudge_telemetry::MetricRegistry;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BucketLabels {
    provider_account: String,
    channel: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct AttemptLabels {
    provider_account: String,
    channel: &'static str,
    response_class: &'static str,
    outcome_class: &'static str,
    next_state: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    provider_account: String,
    channel: &'static str,
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RetryAfterLabels {
    provider_account: String,
    channel: &'static str,
    validity: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ChannelLabels {
    channel: &'static str,
}

type RateGauge = Gauge<f64, AtomicU64>;

/// Buckets of the scheduled-to-delivered histogram, in seconds: one second to a day, with a
/// bound at 300 s (the delivered-within-five-minutes objective the alert rules use).
pub const SCHEDULED_TO_DELIVERED_BUCKETS: [f64; 12] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1_800.0, 3_600.0, 21_600.0, 86_400.0,
];

/// Buckets of the provider latency histogram, in seconds: 5 ms to about 41 s.
fn provider_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.005, 2.0, 14)
}

/// The worker's metric families and the registry that holds them.
///
/// - `nudge_bucket_effective_rate{provider_account, channel}`: the bucket's current rate (sends
///   per second) after 429 slow-downs, as last seen by this worker.
/// - `nudge_bucket_rate{provider_account, channel}`: the bucket's configured rate.
/// - `nudge_bucket_pauses_total{provider_account, channel}`: 429 answers that paused the bucket.
/// - `nudge_attempts_total{provider_account, channel, response_class, outcome_class,
///   next_state}`: attempts whose decision was recorded in the ledger; `response_class` is
///   `2xx`, `3xx`, `4xx`, `429`, `5xx`, `timeout`, `network` or `none` (nothing was sent: no
///   destination on file, unreadable material).
/// - `nudge_retry_after_total{provider_account, channel, validity}`: `Retry-After` headers seen,
///   `valid`, `invalid` (malformed: the backoff applied) or `over_ceiling` (valid, longer than
///   `retry.max_retry_after_s`).
/// - `nudge_admission_deferrals_total{provider_account, channel, reason}`: leases given back
///   to the ledger because the bucket had no slot in time (`bucket_closed`,
///   `bucket_throttled`, `bucket_paused`, `bucket_closed_while_waiting`, `bucket_slowed`).
/// - `nudge_lease_releases_total{provider_account, channel, reason}`: leases given back unsent
///   for any other reason (`shutdown`, `ledger_unavailable`, `fence_refused`,
///   `unknown_provider_account`, `account_unavailable`: routed to the tenant's own account,
///   which no live worker has, so given back until the next look, 0411; `tenant_capped`: the
///   tenant's `--max-share`; `quiet_hours`: inside the subscriber's quiet hours, 0502).
/// - `nudge_quiet_hours_expired_total{channel}`: deliveries settled `expired` with the reason
///   `quiet_hours`: their subscriber's quiet hours outlasted them (0502).
/// - `nudge_deliveries_suppressed_total{channel}`: deliveries settled `suppressed` without a
///   request because their destination opted out, at the lease or the fence (0505).
/// - `nudge_scheduled_to_delivered_seconds{channel}`: from the reminder's time to the 2xx.
/// - `nudge_provider_request_duration_seconds{provider_account, channel}`: provider calls.
/// - `nudge_provider_alerts_total{provider_account, channel, reason}`: provider answers an
///   operator must hear about: `auth_failure` (the account's credentials were refused; its
///   bucket is suspended) and `own_fault` (a fault of ours, such as provider tokens renewed
///   too often).
#[derive(Debug)]
pub struct WorkerMetrics {
    registry: Arc<MetricRegistry>,
    effective_rate: Family<BucketLabels, RateGauge>,
    rate: Family<BucketLabels, RateGauge>,
    pauses: Family<BucketLabels, Counter>,
    attempts: Family<AttemptLabels, Counter>,
    retry_after: Family<RetryAfterLabels, Counter>,
    deferrals: Family<ReasonLabels, Counter>,
    releases: Family<ReasonLabels, Counter>,
    scheduled_to_delivered: Family<ChannelLabels, Histogram>,
    provider_latency: Family<BucketLabels, Histogram>,
    alerts: Family<ReasonLabels, Counter>,
    quiet_hours_expired: Family<ChannelLabels, Counter>,
    suppressed: Family<ChannelLabels, Counter>,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// What one attempt contributes to the metrics.
#[derive(Debug, Clone, Copy)]
pub struct AttemptLabelsIn<'a> {
    pub account: &'a ProviderAccount,
    pub channel: Channel,
    /// [`nudge_domain::response_class`], or `none` when nothing was sent.
    pub response_class: &'static str,
    pub outcome_class: OutcomeClass,
    pub next_state: DeliveryState,
}

impl WorkerMetrics {
    /// A fresh registry holding the worker's families, all empty.
    pub fn new() -> Self {
        let mut registry = MetricRegistry::new();
        let effective_rate = Family::<BucketLabels, RateGauge>::default();
        let rate = Family::<BucketLabels, RateGauge>::default();
        let pauses = Family::<BucketLabels, Counter>::default();
        let attempts = Family::<AttemptLabels, Counter>::default();
        let retry_after = Family::<RetryAfterLabels, Counter>::default();
        let deferrals = Family::<ReasonLabels, Counter>::default();
        let releases = Family::<ReasonLabels, Counter>::default();
        let alerts = Family::<ReasonLabels, Counter>::default();
        let scheduled_to_delivered =
            Family::<ChannelLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(SCHEDULED_TO_DELIVERED_BUCKETS)
            });
        let provider_latency = Family::<BucketLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(provider_buckets())
        });
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
            "nudge_bucket_pauses",
            "Provider answers (429 with a valid Retry-After) that paused the rate bucket",
            pauses.clone(),
        );
        registry.register(
            "nudge_attempts",
            "Send attempts whose decision was recorded in the ledger",
            attempts.clone(),
        );
        registry.register(
            "nudge_retry_after",
            "Retry-After headers seen in provider answers, by validity",
            retry_after.clone(),
        );
        registry.register(
            "nudge_admission_deferrals",
            "Leases given back to the ledger because the rate bucket had no slot in time",
            deferrals.clone(),
        );
        registry.register(
            "nudge_lease_releases",
            "Leases given back to the ledger unsent for a reason other than the rate bucket",
            releases.clone(),
        );
        registry.register(
            "nudge_scheduled_to_delivered_seconds",
            "Time from a reminder's scheduled time to its provider's 2xx",
            scheduled_to_delivered.clone(),
        );
        registry.register(
            "nudge_provider_request_duration_seconds",
            "Duration of provider requests, from send to answer or failure",
            provider_latency.clone(),
        );
        let quiet_hours_expired = Family::<ChannelLabels, Counter>::default();
        registry.register(
            "nudge_quiet_hours_expired",
            "Deliveries settled expired because their subscriber's quiet hours outlasted them",
            quiet_hours_expired.clone(),
        );
        let suppressed = Family::<ChannelLabels, Counter>::default();
        registry.register(
            "nudge_deliveries_suppressed",
            "Deliveries settled suppressed without a request: their destination opted out",
            suppressed.clone(),
        );
        registry.register(
            "nudge_provider_alerts",
            "Provider answers an operator must act on (credentials refused, a fault of ours)",
            alerts.clone(),
        );
        Self {
            registry: Arc::new(registry),
            effective_rate,
            rate,
            pauses,
            attempts,
            retry_after,
            deferrals,
            releases,
            scheduled_to_delivered,
            provider_latency,
            alerts,
            quiet_hours_expired,
            suppressed,
        }
    }

    /// Counts a delivery settled `suppressed` (its destination opted out).
    pub fn suppressed(&self, channel: Channel) {
        self.suppressed
            .get_or_create(&ChannelLabels {
                channel: channel.as_str(),
            })
            .inc();
    }

    /// Counts a delivery settled `expired` because its quiet hours outlasted it.
    pub fn quiet_hours_expired(&self, channel: Channel) {
        self.quiet_hours_expired
            .get_or_create(&ChannelLabels {
                channel: channel.as_str(),
            })
            .inc();
    }

    /// The registry to serve on `/metrics`.
    pub fn registry(&self) -> Arc<MetricRegistry> {
        self.registry.clone()
    }

    /// The registry in the OpenMetrics text format, as `/metrics` serves it.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        self.registry.encode()
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
    /// configured rate), and counts the pause when the feedback paused it.
    pub fn feedback(
        &self,
        account: &ProviderAccount,
        channel: Channel,
        effective_rate: f64,
        paused: bool,
    ) {
        let labels = bucket_labels(account, channel);
        self.effective_rate
            .get_or_create(&labels)
            .set(effective_rate);
        if paused {
            self.pauses.get_or_create(&labels).inc();
        }
    }

    /// Counts an attempt whose decision was recorded.
    pub fn attempt(&self, attempt: AttemptLabelsIn<'_>) {
        self.attempts
            .get_or_create(&AttemptLabels {
                provider_account: attempt.account.as_str().to_owned(),
                channel: attempt.channel.as_str(),
                response_class: attempt.response_class,
                outcome_class: attempt.outcome_class.as_str(),
                next_state: attempt.next_state.as_str(),
            })
            .inc();
    }

    /// Counts a `Retry-After` header seen: `valid`, `invalid` or `over_ceiling`.
    pub fn retry_after(&self, account: &ProviderAccount, channel: Channel, validity: &'static str) {
        self.retry_after
            .get_or_create(&RetryAfterLabels {
                provider_account: account.as_str().to_owned(),
                channel: channel.as_str(),
                validity,
            })
            .inc();
    }

    /// Counts a lease given back unsent: a deferral when the rate bucket is why (`bucket_*`),
    /// a release otherwise.
    pub fn deferral(&self, account: &ProviderAccount, channel: Channel, reason: &'static str) {
        let labels = ReasonLabels {
            provider_account: account.as_str().to_owned(),
            channel: channel.as_str(),
            reason,
        };
        if reason.starts_with("bucket_") {
            self.deferrals.get_or_create(&labels).inc();
        } else {
            self.releases.get_or_create(&labels).inc();
        }
    }

    /// Counts a provider answer an operator must hear about (`nudge_domain::Alert`).
    pub fn provider_alert(
        &self,
        account: &ProviderAccount,
        channel: Channel,
        reason: &'static str,
    ) {
        self.alerts
            .get_or_create(&ReasonLabels {
                provider_account: account.as_str().to_owned(),
                channel: channel.as_str(),
                reason,
            })
            .inc();
    }

    /// Observes a delivery's time from its scheduled time to its 2xx.
    pub fn delivered(&self, channel: Channel, seconds: f64) {
        self.scheduled_to_delivered
            .get_or_create(&ChannelLabels {
                channel: channel.as_str(),
            })
            .observe(seconds.max(0.0));
    }

    /// Observes one provider request's duration.
    pub fn provider_request(&self, account: &ProviderAccount, channel: Channel, seconds: f64) {
        self.provider_latency
            .get_or_create(&bucket_labels(account, channel))
            .observe(seconds.max(0.0));
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
    fn feedback_moves_the_effective_rate_counts_pauses_and_leaves_the_configured_rate() {
        let metrics = WorkerMetrics::new();
        metrics.bucket(&account(), Channel::Sms, 20.0, 20.0);
        metrics.feedback(&account(), Channel::Sms, 10.0, true);
        metrics.feedback(&account(), Channel::Sms, 12.0, false);
        let text = metrics.encode().expect("encodes");
        assert!(
            text.contains(
                "nudge_bucket_effective_rate{provider_account=\"sms-main\",channel=\"sms\"} 12.0\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "nudge_bucket_rate{provider_account=\"sms-main\",channel=\"sms\"} 20.0\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "nudge_bucket_pauses_total{provider_account=\"sms-main\",channel=\"sms\"} 1\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn attempts_deferrals_and_releases_are_counted_with_total_suffixes() {
        let metrics = WorkerMetrics::new();
        for _ in 0..2 {
            metrics.attempt(AttemptLabelsIn {
                account: &account(),
                channel: Channel::Push,
                response_class: "2xx",
                outcome_class: OutcomeClass::Delivered,
                next_state: DeliveryState::Delivered,
            });
        }
        metrics.deferral(&account(), Channel::Push, "bucket_throttled");
        metrics.deferral(&account(), Channel::Push, "shutdown");
        metrics.retry_after(&account(), Channel::Push, "over_ceiling");
        let text = metrics.encode().expect("encodes");
        for line in [
            "nudge_attempts_total{provider_account=\"sms-main\",channel=\"push\",response_class=\"2xx\",outcome_class=\"delivered\",next_state=\"delivered\"} 2\n",
            "nudge_admission_deferrals_total{provider_account=\"sms-main\",channel=\"push\",reason=\"bucket_throttled\"} 1\n",
            "nudge_lease_releases_total{provider_account=\"sms-main\",channel=\"push\",reason=\"shutdown\"} 1\n",
            "nudge_retry_after_total{provider_account=\"sms-main\",channel=\"push\",validity=\"over_ceiling\"} 1\n",
        ] {
            assert!(text.contains(line), "{line} missing from {text}");
        }
    }

    #[test]
    fn latencies_land_in_their_histograms() {
        let metrics = WorkerMetrics::new();
        metrics.delivered(Channel::Email, 42.0);
        metrics.provider_request(&account(), Channel::Email, 0.02);
        let text = metrics.encode().expect("encodes");
        assert!(
            text.contains(
                "nudge_scheduled_to_delivered_seconds_bucket{le=\"60.0\",channel=\"email\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "nudge_scheduled_to_delivered_seconds_bucket{le=\"30.0\",channel=\"email\"} 0\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "nudge_provider_request_duration_seconds_count{provider_account=\"sms-main\",channel=\"email\"} 1\n"
            ),
            "{text}"
        );
    }
}
