//! The janitor's Prometheus metrics, served on `telemetry.metrics_addr`: what its recovery
//! paths did (counters), and the ledger's picture (gauges) read every
//! `janitor.metrics_interval_ms` by [`refresh_gauges`], the one place the ledger is read for
//! metrics, so dashboards and alerts all see the same numbers.
//!
//! Labels are tenant ids (opaque), provider accounts, channels, states and fixed reasons:
//! never a subscriber, destination or message content.

use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use nudge_domain::Channel;
use nudge_ledger::{Ledger, LedgerGauges, LedgerTime};
use nudge_telemetry::MetricRegistry;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ChannelLabels {
    channel: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ChannelStateLabels {
    channel: &'static str,
    state: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TenantChannelLabels {
    tenant_id: String,
    channel: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TenantChannelStateLabels {
    tenant_id: String,
    channel: &'static str,
    state: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TenantLabels {
    tenant_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BucketLabels {
    provider_account: String,
    channel: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DeadLetterLabels {
    channel: &'static str,
    death_reason: &'static str,
}

type F64Gauge = Gauge<f64, AtomicU64>;

/// The states `nudge_ledger_deliveries` reports: live work by where it waits, then work
/// awaiting an operator (ambiguous and dead-lettered).
pub const GAUGE_STATES: [&str; 6] = [
    "due",
    "queued",
    "leased",
    "backoff",
    "ambiguous",
    "dead_lettered",
];

/// The janitor's families.
///
/// From the ledger, every `janitor.metrics_interval_ms`:
/// - `nudge_ledger_deliveries{channel, state}`: `due` (time come, not yet claimed), `queued`
///   (published, waiting for a worker), `leased` (being sent), `backoff` (waiting for a retry),
///   `ambiguous` (held for review), `dead_lettered`.
/// - `nudge_ledger_oldest_eligible_age_seconds{channel}`: how long the oldest due or queued
///   delivery has waited (0 when none).
/// - `nudge_ledger_tenant_deliveries{tenant_id, channel, state}` (the four live states) and
///   `nudge_ledger_tenant_oldest_eligible_age_seconds{tenant_id, channel}`: the same per
///   tenant, for tenants with live work.
/// - `nudge_ledger_tenant_awaiting_account_deliveries{tenant_id, channel}`: of the tenant's
///   `backoff`, the deliveries waiting for its own provider account, which no live worker had
///   at their last look (`account_unavailable`, 0411).
/// - `nudge_ledger_tenant_quiet_hours_deliveries{tenant_id, channel}`: of the tenant's
///   `backoff`, the deliveries deferred to the end of their subscriber's quiet hours (0502).
/// - `nudge_tenant_paused{tenant_id}`: 1 for each tenant whose intake is paused.
/// - `nudge_channel_draining{channel}`: 1 while the channel drains.
/// - `nudge_bucket_paused{provider_account, channel}`: 1 while a provider's answer pauses it.
/// - `nudge_ledger_gauges_refreshed_timestamp_seconds`, `nudge_ledger_gauges_duration_seconds`,
///   `nudge_ledger_gauges_errors_total`: when the picture was last read, how long it took, and
///   failed reads.
///
/// Counted by the recovery paths:
/// - `nudge_lease_expiries_total{outcome}`: expired leases, `returned_unsent` (the send never
///   started) or `reaped` (decided as a timeout after send).
/// - `nudge_deliveries_expired_total`: owed deliveries the expiry sweep settled as expired.
/// - `nudge_dead_letters_total{channel, death_reason}`: messages recorded from `dead.<channel>`
///   (DLQ ingress); `death_reason` is RabbitMQ's (`rejected`, `delivery_limit`, `expired`,
///   `maxlen`) or `other`.
/// - `nudge_orphaned_reminders_total`: reminders the watchdog found without a delivery.
#[derive(Debug)]
pub struct JanitorMetrics {
    registry: Arc<MetricRegistry>,
    deliveries: Family<ChannelStateLabels, Gauge>,
    oldest: Family<ChannelLabels, F64Gauge>,
    tenant_deliveries: Family<TenantChannelStateLabels, Gauge>,
    tenant_oldest: Family<TenantChannelLabels, F64Gauge>,
    tenant_awaiting_account: Family<TenantChannelLabels, Gauge>,
    tenant_quiet_hours: Family<TenantChannelLabels, Gauge>,
    tenant_paused: Family<TenantLabels, Gauge>,
    draining: Family<ChannelLabels, Gauge>,
    bucket_paused: Family<BucketLabels, Gauge>,
    refreshed: F64Gauge,
    refresh_duration: F64Gauge,
    refresh_errors: Counter,
    lease_expiries: Family<OutcomeLabels, Counter>,
    expired: Counter,
    dead_letters: Family<DeadLetterLabels, Counter>,
    orphaned: Counter,
    events_sequenced: Counter,
    /// The tenant series set by the last refresh, so the next one removes only those that
    /// are gone (a scrape never sees the tenant series missing while they are replaced).
    tenant_series: Arc<Mutex<TenantSeries>>,
}

#[derive(Debug, Default)]
struct TenantSeries {
    deliveries: HashSet<TenantChannelStateLabels>,
    oldest: HashSet<TenantChannelLabels>,
    awaiting_account: HashSet<TenantChannelLabels>,
    quiet_hours: HashSet<TenantChannelLabels>,
    paused: HashSet<TenantLabels>,
}

/// Sets `now`'s series in `family` with `value`, then removes those of `before` not in `now`.
fn replace<L, M>(family: &Family<L, M>, before: &mut HashSet<L>, now: Vec<(L, impl FnOnce(&M))>)
where
    L: Clone + Eq + std::hash::Hash,
    M: Default,
{
    let mut current = HashSet::with_capacity(now.len());
    for (labels, set) in now {
        set(&family.get_or_create(&labels));
        current.insert(labels);
    }
    for stale in before.difference(&current) {
        family.remove(stale);
    }
    *before = current;
}

impl Default for JanitorMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl JanitorMetrics {
    pub fn new() -> Self {
        let mut registry = MetricRegistry::new();
        let metrics = Self {
            registry: Arc::new(MetricRegistry::new()),
            deliveries: Family::default(),
            oldest: Family::default(),
            tenant_deliveries: Family::default(),
            tenant_oldest: Family::default(),
            tenant_awaiting_account: Family::default(),
            tenant_quiet_hours: Family::default(),
            tenant_paused: Family::default(),
            draining: Family::default(),
            bucket_paused: Family::default(),
            refreshed: F64Gauge::default(),
            refresh_duration: F64Gauge::default(),
            refresh_errors: Counter::default(),
            lease_expiries: Family::default(),
            expired: Counter::default(),
            dead_letters: Family::default(),
            orphaned: Counter::default(),
            events_sequenced: Counter::default(),
            tenant_series: Arc::default(),
        };
        registry.register(
            "nudge_ledger_deliveries",
            "Deliveries in the ledger by channel and where they wait",
            metrics.deliveries.clone(),
        );
        registry.register(
            "nudge_ledger_oldest_eligible_age_seconds",
            "How long the channel's oldest due or queued delivery has waited",
            metrics.oldest.clone(),
        );
        registry.register(
            "nudge_ledger_tenant_deliveries",
            "Live deliveries in the ledger by tenant, channel and where they wait",
            metrics.tenant_deliveries.clone(),
        );
        registry.register(
            "nudge_ledger_tenant_oldest_eligible_age_seconds",
            "How long the tenant's oldest due or queued delivery on the channel has waited",
            metrics.tenant_oldest.clone(),
        );
        registry.register(
            "nudge_ledger_tenant_awaiting_account_deliveries",
            "Deliveries of the tenant on the channel waiting for its own provider account, \
             which no live worker had",
            metrics.tenant_awaiting_account.clone(),
        );
        registry.register(
            "nudge_ledger_tenant_quiet_hours_deliveries",
            "Deliveries of the tenant on the channel deferred to the end of their subscriber's \
             quiet hours",
            metrics.tenant_quiet_hours.clone(),
        );
        registry.register(
            "nudge_tenant_paused",
            "1 while the tenant's intake is paused",
            metrics.tenant_paused.clone(),
        );
        registry.register(
            "nudge_channel_draining",
            "1 while the channel drains",
            metrics.draining.clone(),
        );
        registry.register(
            "nudge_bucket_paused",
            "1 while the rate bucket is paused by a provider's answer",
            metrics.bucket_paused.clone(),
        );
        registry.register(
            "nudge_ledger_gauges_refreshed_timestamp_seconds",
            "When the ledger gauges were last read (Unix time)",
            metrics.refreshed.clone(),
        );
        registry.register(
            "nudge_ledger_gauges_duration_seconds",
            "How long the last read of the ledger gauges took",
            metrics.refresh_duration.clone(),
        );
        // Counters are registered without `_total`: the encoder appends it.
        registry.register(
            "nudge_ledger_gauges_errors",
            "Failed reads of the ledger gauges",
            metrics.refresh_errors.clone(),
        );
        registry.register(
            "nudge_lease_expiries",
            "Leases that expired without an outcome, by what the reaper did",
            metrics.lease_expiries.clone(),
        );
        registry.register(
            "nudge_deliveries_expired",
            "Owed deliveries settled as expired by the expiry sweep",
            metrics.expired.clone(),
        );
        registry.register(
            "nudge_dead_letters",
            "Messages recorded from the dead-letter queues",
            metrics.dead_letters.clone(),
        );
        registry.register(
            "nudge_orphaned_reminders",
            "Reminders found without a delivery after their time and materialised",
            metrics.orphaned.clone(),
        );
        registry.register(
            "nudge_delivery_events_sequenced",
            "Delivery events numbered for their readers (the events API and process)",
            metrics.events_sequenced.clone(),
        );
        Self {
            registry: Arc::new(registry),
            ..metrics
        }
    }

    pub fn registry(&self) -> Arc<MetricRegistry> {
        self.registry.clone()
    }

    /// The registry in the OpenMetrics text format, as `/metrics` serves it.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        self.registry.encode()
    }

    /// Sets every ledger gauge from `gauges`. A tenant whose work is done (or who is
    /// resumed) drops out: its series are removed once the new ones are set.
    pub fn set_gauges(&self, gauges: &LedgerGauges) {
        for channel in Channel::ALL {
            let work = gauges.work.iter().filter(|w| w.channel == channel);
            let (mut due, mut queued, mut leased, mut backoff) = (0u64, 0u64, 0u64, 0u64);
            let mut oldest = 0f64;
            for w in work {
                due += w.due;
                queued += w.queued;
                leased += w.leased;
                backoff += w.backoff;
                oldest = oldest.max(w.oldest_eligible_age_s.unwrap_or(0.0));
            }
            let (ambiguous, dead_lettered) = gauges
                .awaiting_operator
                .iter()
                .find(|a| a.channel == channel)
                .map_or((0, 0), |a| (a.ambiguous, a.dead_lettered));
            for (state, n) in GAUGE_STATES.into_iter().zip([
                due,
                queued,
                leased,
                backoff,
                ambiguous,
                dead_lettered,
            ]) {
                self.deliveries
                    .get_or_create(&ChannelStateLabels {
                        channel: channel.as_str(),
                        state,
                    })
                    .set(as_i64(n));
            }
            self.oldest
                .get_or_create(&ChannelLabels {
                    channel: channel.as_str(),
                })
                .set(oldest);
            let draining = gauges
                .draining
                .iter()
                .any(|f| f.channel == channel && f.draining);
            self.draining
                .get_or_create(&ChannelLabels {
                    channel: channel.as_str(),
                })
                .set(i64::from(draining));
        }
        let mut series = self
            .tenant_series
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut deliveries = Vec::new();
        let mut oldest = Vec::new();
        let mut awaiting_account = Vec::new();
        let mut quiet_hours = Vec::new();
        for w in &gauges.work {
            let tenant_id = w.tenant_id.to_string();
            for (state, n) in [
                ("due", w.due),
                ("queued", w.queued),
                ("leased", w.leased),
                ("backoff", w.backoff),
            ] {
                deliveries.push((
                    TenantChannelStateLabels {
                        tenant_id: tenant_id.clone(),
                        channel: w.channel.as_str(),
                        state,
                    },
                    move |g: &Gauge| {
                        g.set(as_i64(n));
                    },
                ));
            }
            let age = w.oldest_eligible_age_s.unwrap_or(0.0);
            if w.awaiting_account > 0 {
                let n = as_i64(w.awaiting_account);
                awaiting_account.push((
                    TenantChannelLabels {
                        tenant_id: tenant_id.clone(),
                        channel: w.channel.as_str(),
                    },
                    move |g: &Gauge| {
                        g.set(n);
                    },
                ));
            }
            if w.quiet_hours > 0 {
                let n = as_i64(w.quiet_hours);
                quiet_hours.push((
                    TenantChannelLabels {
                        tenant_id: tenant_id.clone(),
                        channel: w.channel.as_str(),
                    },
                    move |g: &Gauge| {
                        g.set(n);
                    },
                ));
            }
            oldest.push((
                TenantChannelLabels {
                    tenant_id,
                    channel: w.channel.as_str(),
                },
                move |g: &F64Gauge| {
                    g.set(age);
                },
            ));
        }
        replace(&self.tenant_deliveries, &mut series.deliveries, deliveries);
        replace(&self.tenant_oldest, &mut series.oldest, oldest);
        replace(
            &self.tenant_awaiting_account,
            &mut series.awaiting_account,
            awaiting_account,
        );
        replace(
            &self.tenant_quiet_hours,
            &mut series.quiet_hours,
            quiet_hours,
        );
        let paused = gauges
            .paused_tenants
            .iter()
            .map(|tenant| {
                (
                    TenantLabels {
                        tenant_id: tenant.to_string(),
                    },
                    |g: &Gauge| {
                        g.set(1);
                    },
                )
            })
            .collect();
        replace(&self.tenant_paused, &mut series.paused, paused);
        drop(series);
        for bucket in &gauges.buckets {
            self.bucket_paused
                .get_or_create(&BucketLabels {
                    provider_account: bucket.account.as_str().to_owned(),
                    channel: bucket.channel.as_str(),
                })
                .set(i64::from(bucket.paused));
        }
    }

    pub fn lease_expiries(&self, returned_unsent: usize, reaped: usize) {
        for (outcome, n) in [("returned_unsent", returned_unsent), ("reaped", reaped)] {
            if n > 0 {
                self.lease_expiries
                    .get_or_create(&OutcomeLabels { outcome })
                    .inc_by(as_u64(n));
            }
        }
    }

    pub fn expired(&self, n: u64) {
        self.expired.inc_by(n);
    }

    pub fn orphaned(&self, n: u64) {
        self.orphaned.inc_by(n);
    }

    pub fn events_sequenced(&self, n: u32) {
        self.events_sequenced.inc_by(u64::from(n));
    }

    /// Counts a message recorded from `dead.<channel>`; RabbitMQ's reason, or `other`.
    pub fn dead_letter(&self, channel: Channel, death_reason: &str) {
        let death_reason = match death_reason {
            "rejected" => "rejected",
            "delivery_limit" => "delivery_limit",
            "expired" => "expired",
            "maxlen" => "maxlen",
            _ => "other",
        };
        self.dead_letters
            .get_or_create(&DeadLetterLabels {
                channel: channel.as_str(),
                death_reason,
            })
            .inc();
    }
}

fn as_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn as_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Reads the ledger's gauges once at `at` and sets them; a failed read is counted, logged
/// by the caller, and leaves the previous values (the refresh timestamp says how old).
pub async fn refresh_gauges(
    ledger: &Ledger,
    metrics: &JanitorMetrics,
    at: LedgerTime,
) -> Result<(), nudge_ledger::LedgerError> {
    let started = Instant::now();
    match ledger.gauges(at).await {
        Ok(gauges) => {
            metrics.set_gauges(&gauges);
            metrics
                .refresh_duration
                .set(started.elapsed().as_secs_f64());
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            metrics.refreshed.set(now);
            Ok(())
        }
        Err(e) => {
            metrics.refresh_errors.inc();
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use nudge_domain::{ProviderAccount, TenantId};
    use nudge_ledger::{AwaitingOperator, BucketGauge, DrainFlag, TenantChannelWork};

    use super::*;

    #[test]
    fn gauges_sum_tenants_per_channel_and_a_tenant_without_work_drops_out() {
        let metrics = JanitorMetrics::new();
        let (a, b) = (TenantId::new(), TenantId::new());
        let work = |tenant, due, oldest| TenantChannelWork {
            tenant_id: tenant,
            channel: Channel::Sms,
            due,
            queued: 1,
            leased: 0,
            backoff: 2,
            awaiting_account: due - 1,
            quiet_hours: 0,
            oldest_eligible_age_s: Some(oldest),
        };
        metrics.set_gauges(&LedgerGauges {
            work: vec![work(a, 3, 40.0), work(b, 1, 90.0)],
            awaiting_operator: vec![AwaitingOperator {
                channel: Channel::Sms,
                ambiguous: 1,
                dead_lettered: 4,
            }],
            paused_tenants: vec![b],
            draining: vec![DrainFlag {
                channel: Channel::Email,
                draining: true,
            }],
            buckets: vec![BucketGauge {
                account: ProviderAccount::parse("sms-main").expect("valid"),
                channel: Channel::Sms,
                rate_per_second: 10.0,
                effective_rate: 5.0,
                paused: true,
            }],
        });
        let text = metrics.encode().expect("encodes");
        for line in [
            "nudge_ledger_deliveries{channel=\"sms\",state=\"due\"} 4\n".to_owned(),
            "nudge_ledger_deliveries{channel=\"sms\",state=\"queued\"} 2\n".to_owned(),
            "nudge_ledger_deliveries{channel=\"sms\",state=\"backoff\"} 4\n".to_owned(),
            "nudge_ledger_deliveries{channel=\"sms\",state=\"ambiguous\"} 1\n".to_owned(),
            "nudge_ledger_deliveries{channel=\"sms\",state=\"dead_lettered\"} 4\n".to_owned(),
            "nudge_ledger_deliveries{channel=\"push\",state=\"due\"} 0\n".to_owned(),
            "nudge_ledger_oldest_eligible_age_seconds{channel=\"sms\"} 90.0\n".to_owned(),
            "nudge_channel_draining{channel=\"email\"} 1\n".to_owned(),
            "nudge_bucket_paused{provider_account=\"sms-main\",channel=\"sms\"} 1\n".to_owned(),
            format!("nudge_tenant_paused{{tenant_id=\"{b}\"}} 1\n"),
            format!(
                "nudge_ledger_tenant_oldest_eligible_age_seconds{{tenant_id=\"{a}\",channel=\"sms\"}} 40.0\n"
            ),
            format!(
                "nudge_ledger_tenant_awaiting_account_deliveries{{tenant_id=\"{a}\",channel=\"sms\"}} 2\n"
            ),
        ] {
            assert!(text.contains(&line), "{line} missing from {text}");
        }

        metrics.set_gauges(&LedgerGauges {
            work: vec![work(b, 1, 95.0)],
            ..LedgerGauges::default()
        });
        let text = metrics.encode().expect("encodes");
        assert!(!text.contains(&a.to_string()), "{text}");
        assert!(
            !text.contains("nudge_ledger_tenant_awaiting_account_deliveries{"),
            "only tenants with deliveries waiting for an account have the series: {text}"
        );
        assert!(!text.contains("nudge_tenant_paused{"), "{text}");
    }
}
