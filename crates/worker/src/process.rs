//! One message, start to finish: decode, lease, send, record. The loop in `lib.rs` owns
//! waiting, concurrency and shutdown; this is what tests call.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{
    AttemptContext, AttemptFacts, Channel, Decision, DeliveryState, OutcomeClass, ProviderAccount,
    RandJitter, RetryPolicy, decide,
};
use nudge_ledger::{AttemptRecord, DestinationCipher, LeaseOutcome, LeasedDelivery, Ledger};
use nudge_proto::Envelope;
use nudge_provider::{HttpProvider, Provider, SendRequest};
use tracing::{Instrument, debug, error, info, warn};

/// How a message ends, and so how it is settled with the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed {
    /// The attempt was made and its outcome recorded.
    Attempted(DeliveryState),
    /// The delivery's time had run out: settled `expired`, nothing sent.
    Expired,
    /// A duplicate or old message: the ledger says the delivery moved on.
    Stale,
    /// The ledger could not be reached or refused the write. The message is dropped: the
    /// ledger still owes the delivery and republishes it (or reaps its lease).
    Deferred(&'static str),
    /// The message itself is unusable: it goes to the dead-letter queue with this reason.
    Poison(&'static str),
}

impl Processed {
    /// Every outcome but poison is acknowledged: the ledger, not the queue, holds the work.
    pub fn dead_letter(&self) -> bool {
        matches!(self, Processed::Poison(_))
    }
}

/// A clock, injected so tests can move time.
pub type Clock = Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>;

/// The provider accounts of one channel.
#[derive(Debug)]
pub struct Providers {
    by_account: HashMap<ProviderAccount, HttpProvider>,
    default: ProviderAccount,
}

impl Providers {
    pub fn new(providers: Vec<HttpProvider>, default: ProviderAccount) -> Self {
        let by_account = providers
            .into_iter()
            .map(|p| (p.account().clone(), p))
            .collect();
        Self {
            by_account,
            default,
        }
    }

    fn get(&self, account: &ProviderAccount) -> Option<&HttpProvider> {
        self.by_account.get(account)
    }
}

/// Everything one worker process needs to process a message.
pub struct Worker {
    pub channel: Channel,
    pub ledger: Ledger,
    pub cipher: DestinationCipher,
    pub providers: Providers,
    pub policy: RetryPolicy,
    pub lease_for: Duration,
    pub worker_id: String,
    pub clock: Clock,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("channel", &self.channel)
            .field("worker_id", &self.worker_id)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Processes one message payload.
    pub async fn process_one(&self, payload: &[u8]) -> Processed {
        let envelope = match Envelope::decode(payload) {
            Ok(envelope) => envelope,
            Err(e) => {
                warn!(channel = %self.channel, reason = e.reason_code(), error.cause_chain = ?e,
                      "poison message: dead-lettering");
                return Processed::Poison(e.reason_code());
            }
        };
        if envelope.channel != self.channel {
            warn!(channel = %self.channel, envelope_channel = %envelope.channel,
                  delivery_id = %envelope.delivery_id, "message for another channel: dead-lettering");
            return Processed::Poison("wrong_channel");
        }
        let span = tracing::info_span!("delivery",
            delivery_id = %envelope.delivery_id,
            channel = %self.channel,
            generation = envelope.generation,
            lane = %envelope.lane,
            correlation_id = %envelope.correlation_id);
        self.process_envelope(&envelope).instrument(span).await
    }

    async fn process_envelope(&self, envelope: &Envelope) -> Processed {
        let account = match self
            .ledger
            .tenant_channel_account(envelope.tenant_id, self.channel)
            .await
        {
            Ok(account) => account.unwrap_or_else(|| self.providers.default.clone()),
            Err(e) => {
                error!(error.cause_chain = ?e, "failed to read the tenant's provider routing");
                return Processed::Deferred("ledger_unavailable");
            }
        };
        let Some(provider) = self.providers.get(&account) else {
            error!(provider_account = %account,
                   "tenant routed to a provider account this worker has no configuration for; \
                    leaving the delivery queued");
            return Processed::Deferred("unknown_provider_account");
        };

        let now = (self.clock)();
        let lease = match self
            .ledger
            .lease_via(
                envelope.delivery_id,
                envelope.generation,
                &self.worker_id,
                self.lease_for,
                now,
                Some((&account, provider.idempotency())),
            )
            .await
        {
            Ok(LeaseOutcome::Leased(lease)) => lease,
            Ok(LeaseOutcome::Expired) => {
                info!("expired before it could be sent: settled as expired");
                return Processed::Expired;
            }
            Ok(LeaseOutcome::Stale { state, generation }) => {
                debug!(%state, current_generation = generation, "stale message dropped");
                return Processed::Stale;
            }
            Ok(LeaseOutcome::NotFound) => {
                warn!("message for an unknown delivery dropped");
                return Processed::Stale;
            }
            Err(e) => {
                error!(error.cause_chain = ?e, "failed to lease");
                return Processed::Deferred("ledger_unavailable");
            }
        };
        self.send_leased(&lease, provider, &account, &envelope.correlation_id)
            .await
    }

    async fn send_leased(
        &self,
        lease: &LeasedDelivery,
        provider: &HttpProvider,
        account: &ProviderAccount,
        correlation_id: &str,
    ) -> Processed {
        let started_at = (self.clock)();
        let destination = match self.ledger.destination_for(lease, &self.cipher).await {
            Ok(Some(destination)) => destination,
            Ok(None) => {
                warn!("no destination on file for this channel: dead-lettering the delivery");
                return self
                    .record(
                        lease,
                        without_send("no_destination"),
                        (started_at, (self.clock)()),
                        account,
                        correlation_id,
                    )
                    .await;
            }
            Err(e) => {
                // The lease stays; the reaper settles it if this worker cannot.
                error!(error.cause_chain = ?e, "failed to load the destination");
                return Processed::Deferred("ledger_unavailable");
            }
        };
        let content = match self.ledger.content_for(lease, &self.cipher).await {
            Ok(content) => content.and_then(|c| serde_json::from_slice(&c).ok()),
            Err(e) => {
                error!(error.cause_chain = ?e, "failed to load the message content");
                return Processed::Deferred("ledger_unavailable");
            }
        };

        let outcome = provider
            .send(SendRequest {
                idempotency_key: &lease.idempotency_key,
                channel: self.channel,
                destination: destination.expose(),
                content: content.as_ref(),
                correlation_id,
            })
            .await;
        drop(destination);
        let finished_at = (self.clock)();
        let ctx = AttemptContext {
            attempt_number: lease.attempt_number,
            expires_at: lease.expires_at,
            idempotency: provider.idempotency(),
        };
        let mut jitter = RandJitter::from_entropy();
        let decision = decide(&ctx, &outcome, finished_at, &self.policy, &mut jitter);
        info!(
            attempt = lease.attempt_number,
            provider_account = %account,
            outcome_class = %decision.facts.outcome_class,
            http_status = decision.facts.http_status,
            next_state = %decision.next_state,
            delay_ms = decision.facts.delay_chosen.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            send_ms = (finished_at - started_at).num_milliseconds(),
            "attempt finished"
        );
        // The attempt is recorded as finishing at the instant the decision was taken from, so
        // `next_attempt_at` is exactly `finished_at` plus the delay chosen.
        self.record(
            lease,
            decision,
            (started_at, finished_at),
            account,
            correlation_id,
        )
        .await
    }

    async fn record(
        &self,
        lease: &LeasedDelivery,
        decision: Decision,
        (started_at, finished_at): (DateTime<Utc>, DateTime<Utc>),
        account: &ProviderAccount,
        correlation_id: &str,
    ) -> Processed {
        let record = AttemptRecord {
            started_at,
            finished_at: finished_at.max(started_at),
            provider_account: Some(account.clone()),
            worker: self.worker_id.clone(),
            correlation_id: Some(correlation_id.to_owned()),
        };
        match self.ledger.record_outcome(lease, &decision, &record).await {
            Ok(()) => Processed::Attempted(decision.next_state),
            Err(e) => {
                error!(error.cause_chain = ?e, "failed to record the outcome; the lease reaper settles it");
                Processed::Deferred("record_failed")
            }
        }
    }
}

/// A delivery that cannot be attempted at all (no destination): dead-lettered with a reason.
fn without_send(reason: &str) -> Decision {
    Decision {
        next_state: DeliveryState::DeadLettered,
        next_attempt_at: None,
        facts: AttemptFacts {
            outcome_class: OutcomeClass::Terminal,
            http_status: None,
            retry_after_seen: None,
            retry_after_valid: false,
            delay_chosen: None,
            reason: Some(reason.to_owned()),
            provider_message_id: None,
        },
    }
}
