//! One message, start to finish: decode, lease, send, record. The loop in `lib.rs` owns
//! waiting, concurrency and shutdown; this is what tests call.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{
    Admission, AdmissionSettings, AttemptContext, AttemptFacts, Channel, Decision, DeferReason,
    DeliveryState, OutcomeClass, ProviderAccount, RandJitter, RetryAfter, RetryPolicy, decide,
};
use nudge_ledger::{
    AttemptRecord, BucketCheck, DestinationCipher, Feedback, LeaseOutcome, LeasedDelivery, Ledger,
};
use nudge_proto::Envelope;
use nudge_provider::{HttpProvider, Provider, SendRequest};
use tracing::{Instrument, debug, error, info, warn};

use crate::metrics::WorkerMetrics;

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
    /// The bucket had no slot within the admission wait: the lease went back to the ledger,
    /// due at the bucket's next opening, without spending an attempt.
    Released(&'static str),
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
    pub admission: AdmissionSettings,
    /// Bucket rates, attempts and deferrals, served on `telemetry.metrics_addr`.
    pub metrics: Arc<WorkerMetrics>,
    /// Cancelled at SIGTERM: a send still waiting for its slot then hands its lease back.
    pub shutdown: tokio_util::sync::CancellationToken,
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
        // The destination and content are loaded first, so that once the slot is reserved
        // only the wait for it stands between the bucket's decision and the wire.
        let (destination, content) = match self.ledger.send_material(lease, &self.cipher).await {
            Ok((Some(destination), content)) => (
                destination,
                content.and_then(|c| serde_json::from_slice::<serde_json::Value>(&c).ok()),
            ),
            Ok((None, _)) => {
                warn!("no destination on file for this channel: dead-lettering the delivery");
                let now = (self.clock)();
                return self
                    .record(
                        lease,
                        without_send("no_destination"),
                        (now, now),
                        account,
                        correlation_id,
                    )
                    .await;
            }
            Err(e) => {
                // The lease stays; the reaper settles it if this worker cannot.
                error!(error.cause_chain = ?e, "failed to load the destination and content");
                return Processed::Deferred("ledger_unavailable");
            }
        };
        let slot = match self.reserve(lease, account).await {
            Ok(slot) => slot,
            Err(processed) => return processed,
        };
        let slot = match self.wait_for(slot, lease, account).await {
            Ok(slot) => slot,
            Err(processed) => return processed,
        };
        let started_at = (self.clock)();

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
        self.feedback(account, &decision, &slot, finished_at).await;
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
            Ok(()) => {
                self.metrics.attempt(
                    self.channel,
                    decision.facts.outcome_class,
                    decision.next_state,
                );
                Processed::Attempted(decision.next_state)
            }
            Err(e) => {
                error!(error.cause_chain = ?e, "failed to record the outcome; the lease reaper settles it");
                Processed::Deferred("record_failed")
            }
        }
    }
}

impl Worker {
    /// Reserves a send slot from the bucket of `account` for this delivery's lane. A slot
    /// within the admission wait is returned (the caller prepares the send, then waits for
    /// it); a slot further away sends the lease back to the ledger, due at the bucket's next
    /// opening, so a throttled account never holds this worker's capacity.
    async fn reserve(
        &self,
        lease: &LeasedDelivery,
        account: &ProviderAccount,
    ) -> Result<Slot, Processed> {
        let reserved_at = (self.clock)();
        let admitted = match self
            .ledger
            .admit(
                account,
                self.channel,
                lease.lane,
                &*self.clock,
                &self.admission,
            )
            .await
        {
            Ok(admitted) => admitted,
            Err(e) => {
                error!(error.cause_chain = ?e, "failed to take a slot from the rate bucket");
                return Err(Processed::Deferred("ledger_unavailable"));
            }
        };
        self.metrics.bucket(
            account,
            self.channel,
            admitted.rate_per_second,
            admitted.effective_rate,
        );
        match admitted.admission {
            Admission::Admitted { send_at } => Ok(Slot {
                send_at,
                reserved_at,
                below_full_rate: admitted.effective_rate < admitted.rate_per_second,
            }),
            Admission::Deferred { until, reason } => {
                let reason = match reason {
                    DeferReason::Closed => "bucket_closed",
                    DeferReason::Throttled => "bucket_throttled",
                    DeferReason::Paused => "bucket_paused",
                };
                Err(self.give_back(lease, account, until, reason).await)
            }
        }
    }

    /// Waits for a reserved slot, then checks the bucket: while this send waited, a 429
    /// elsewhere may have paused it or slowed it (the slot was handed out at the old pace:
    /// reserve again, at most a few times), or an operator may have closed it (rate 0, the
    /// rollback switch).
    async fn wait_for(
        &self,
        mut slot: Slot,
        lease: &LeasedDelivery,
        account: &ProviderAccount,
    ) -> Result<Slot, Processed> {
        for _ in 0..3 {
            match (slot.send_at - (self.clock)()).to_std() {
                Ok(wait) if !wait.is_zero() => {
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        // Shutting down: nothing was sent, so the lease goes back due now and
                        // another worker takes it, rather than this one sending while it stops.
                        () = self.shutdown.cancelled() => {
                            let now = (self.clock)();
                            return Err(self.give_back(lease, account, now, "shutdown").await);
                        }
                    }
                }
                // Sent at once: nothing could have changed the bucket since it admitted this.
                _ => return Ok(slot),
            }
            let check = self
                .ledger
                .bucket_check(
                    account,
                    self.channel,
                    (self.clock)(),
                    slot.reserved_at,
                    self.admission.closed_recheck,
                )
                .await;
            match check {
                Ok(BucketCheck::Open) => return Ok(slot),
                Ok(BucketCheck::ClosedUntil(until)) => {
                    return Err(self
                        .give_back(lease, account, until, "bucket_closed_while_waiting")
                        .await);
                }
                Ok(BucketCheck::Slowed) => slot = self.reserve(lease, account).await?,
                Err(e) => {
                    error!(error.cause_chain = ?e, "failed to re-check the rate bucket");
                    return Err(Processed::Deferred("ledger_unavailable"));
                }
            }
        }
        Ok(slot)
    }

    async fn give_back(
        &self,
        lease: &LeasedDelivery,
        account: &ProviderAccount,
        until: DateTime<Utc>,
        reason: &'static str,
    ) -> Processed {
        match self.ledger.release(lease, until, (self.clock)()).await {
            Ok(()) => {
                self.metrics.deferral(account, self.channel, reason);
                debug!(provider_account = %account, reason, %until, "no send slot in time: released");
                Processed::Released(reason)
            }
            Err(e) => {
                error!(error.cause_chain = ?e, "failed to release the lease; the reaper settles it");
                Processed::Deferred("release_failed")
            }
        }
    }

    /// Tells the bucket what the provider said: a 429 pauses (valid Retry-After) or slows it,
    /// a success raises a lowered rate back.
    async fn feedback(
        &self,
        account: &ProviderAccount,
        decision: &Decision,
        slot: &Slot,
        at: DateTime<Utc>,
    ) {
        let feedback = match (decision.facts.http_status, decision.facts.outcome_class) {
            (Some(429), _) => {
                let retry_at = decision
                    .facts
                    .retry_after_seen
                    .as_deref()
                    .filter(|_| decision.facts.retry_after_valid)
                    .and_then(|seen| RetryAfter::parse(seen).ok())
                    .map(|r| r.resolve(at));
                Feedback::Throttled {
                    retry_at,
                    reserved_at: Some(slot.reserved_at),
                }
            }
            (_, OutcomeClass::Delivered) if slot.below_full_rate => Feedback::Success,
            _ => return,
        };
        match self
            .ledger
            .bucket_feedback(account, self.channel, feedback, at)
            .await
        {
            Ok(Some((effective_rate, paused_until))) => {
                self.metrics
                    .effective_rate(account, self.channel, effective_rate);
                info!(
                    provider_account = %account,
                    channel = %self.channel,
                    effective_rate,
                    paused_until = paused_until.map(|p| p.to_rfc3339()),
                    "rate bucket adjusted"
                );
            }
            Ok(None) => {}
            Err(e) => {
                warn!(error.cause_chain = ?e, "failed to apply provider feedback to the bucket")
            }
        }
    }
}

/// A reserved send slot.
struct Slot {
    send_at: DateTime<Utc>,
    reserved_at: DateTime<Utc>,
    below_full_rate: bool,
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
