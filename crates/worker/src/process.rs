//! A batch of messages, start to finish. The loop in `lib.rs` owns consuming, batching,
//! concurrency and shutdown; [`Worker::process_batch`] is what tests call, through the same
//! two steps the loop runs: [`Worker::lease_step`] for the batch, then [`Worker::finish_step`]
//! for each message.
//!
//! The lease step decodes the envelopes (poison is dead-lettered) and leases the batch in one
//! transaction that also returns routing and send material and takes the send slots; a message
//! it does not lease ends there (stale, expired, cancelled, no slot in time, its tenant's own
//! account held by another worker or by none). A leased delivery then meets the send phases,
//! in this order, each a method that hands it on or ends its message:
//! 1. [`Worker::provider_for`]: the provider of the account the lease was routed to.
//! 2. [`Worker::open_material`]: the destination and content opened; a flagged contact, no
//!    destination or unreadable material settles it without a send.
//! 3. [`Worker::wait_and_fence`]: the wait for a slot reserved ahead, then the fence (the last
//!    statement before the request: the lease still held, not expired, not cancelled, the
//!    bucket still open); a slowed bucket reserves again.
//! 4. [`Worker::call_provider`]: the request, bounded by the send window.
//! 5. [`Worker::settle`]: decide, tell the bucket, raise an alert, record the outcome.
//!
//! A check that stops a send before its slot (quiet hours, consent) stands between the open
//! material and the fence, and the fence checks it again with the database's clock.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{
    AdmissionSettings, AttemptContext, AttemptFacts, BucketSignal, Channel, Decision,
    DeliveryState, OutcomeClass, ProviderAccount, RandJitter, RetryPolicy, SendOutcome,
    ThrottledSend, decide,
};
use nudge_ledger::{
    AttemptRecord, Destination, DestinationCipher, Feedback, FenceRefused, LeaseBatch,
    LeaseOutcome, LeasedDelivery, Ledger, LedgerError, LedgerTime, Material, MessagePointer,
    Recorded, SendSlot, Slotted, WorkerRoutes,
};
use nudge_proto::Envelope;
use nudge_provider::{BoxSendFuture, DynProvider, SEND_DEADLINE_PASSED, SendRequest, SendWindow};
use nudge_telemetry::error_chain;
use tracing::{Instrument, debug, error, info, warn};

use crate::clock::LedgerClock;
use crate::heartbeat::{HeldLease, LeaseBook};
use crate::metrics::{AttemptLabelsIn, WorkerMetrics};
use crate::recorder::{NotRecorded, Recorder};

/// First and longest pause between two tries of a statement while the ledger is away.
const LEDGER_AWAY_FIRST_PAUSE: Duration = Duration::from_millis(100);
const LEDGER_AWAY_MAX_PAUSE: Duration = Duration::from_secs(1);

/// How a message ends, and so how it is settled with the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed {
    /// The attempt was made and its outcome recorded.
    Attempted(DeliveryState),
    /// The delivery's time had run out: settled `expired`, nothing sent.
    Expired,
    /// Its reminder was cancelled: settled `cancelled`, nothing sent.
    Cancelled,
    /// Its destination opted out while it waited for its slot: settled `suppressed`, nothing
    /// sent.
    Suppressed,
    /// A duplicate or old message: the ledger says the delivery moved on.
    Stale,
    /// The lease was lost before the outcome could be applied (reaped while the worker was
    /// cut off): the outcome is not applied; the reaper's decision stands.
    LeaseLost,
    /// The message is dropped without a lease or an outcome: the ledger could not be reached,
    /// or no account here can send it. The ledger still owes the delivery and republishes it
    /// (or, for a lease, reaps it).
    Dropped(&'static str),
    /// The message itself is unusable: it goes to the dead-letter queue with this reason.
    Poison(&'static str),
    /// The lease was given back before its send, due again later (no slot in time, the bucket
    /// closed, shutdown, no live worker has the tenant's own account), on its own lane, without
    /// spending an attempt.
    Released(&'static str),
}

impl Processed {
    /// Every outcome but poison is acknowledged: the ledger, not the queue, holds the work.
    pub fn dead_letter(&self) -> bool {
        matches!(self, Processed::Poison(_))
    }
}

/// The provider accounts of one channel, of whatever kind (`nudge_provider::build`).
pub struct Providers {
    by_account: HashMap<ProviderAccount, Arc<dyn DynProvider>>,
    routes: WorkerRoutes,
}

impl std::fmt::Debug for Providers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Providers")
            .field("accounts", &self.by_account.keys().collect::<Vec<_>>())
            .field("default", &self.routes.default)
            .finish()
    }
}

impl Providers {
    pub fn new(providers: Vec<Arc<dyn DynProvider>>, default: ProviderAccount) -> Self {
        let routes = WorkerRoutes {
            default,
            accounts: providers
                .iter()
                .map(|p| (p.account().clone(), p.idempotency()))
                .collect(),
        };
        let by_account = providers
            .into_iter()
            .map(|p| (p.account().clone(), p))
            .collect();
        Self { by_account, routes }
    }

    /// Every account of the channel this worker can send through.
    pub fn accounts(&self) -> Vec<ProviderAccount> {
        self.routes
            .accounts
            .iter()
            .map(|(a, _)| a.clone())
            .collect()
    }

    fn get(&self, account: &ProviderAccount) -> Option<&dyn DynProvider> {
        self.by_account.get(account).map(|p| &**p)
    }
}

/// Everything one worker process needs to process messages.
pub struct Worker {
    pub channel: Channel,
    pub ledger: Ledger,
    pub cipher: DestinationCipher,
    pub providers: Providers,
    pub policy: RetryPolicy,
    /// How long a lease outlives the last heartbeat (`worker.lease_seconds`).
    pub lease_for: Duration,
    /// How long a delivery routed to an account no live worker has waits before its next look
    /// (`worker.account_recheck_ms`).
    pub account_recheck: Duration,
    /// The leases this worker holds, renewed by its heartbeat (see [`crate::heartbeat`]).
    pub leases: Arc<LeaseBook>,
    pub worker_id: String,
    /// The database's clock as this worker knows it.
    pub clock: Arc<LedgerClock>,
    pub admission: AdmissionSettings,
    /// Writes outcomes in groups (one commit for many sends).
    pub recorder: Recorder,
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

/// One message as the lease step takes it: its payload and the W3C context it carried.
#[derive(Debug, Clone, Copy)]
pub struct Inbound<'a> {
    pub payload: &'a [u8],
    /// The `traceparent` header: the worker's process span joins the trace it names.
    pub traceparent: Option<&'a str>,
}

/// What the lease step decided for one message.
#[derive(Debug)]
pub enum Step {
    /// Nothing to send: settle the message so.
    Done(Processed),
    /// A leased delivery to send.
    Send(Box<ToSend>),
}

/// A leased delivery with what its send needs.
#[derive(Debug)]
pub struct ToSend {
    lease: LeasedDelivery,
    /// Renewed by the heartbeat until the message is done.
    held: HeldLease,
    material: Result<Material, LedgerError>,
    slot: SendSlot,
    /// When the slot was reserved and the slot itself (the database's clock), for a 429's
    /// feedback: one for a slot reserved before the bucket's last decrease does not lower it
    /// again, one for a send on the burst's credit shrinks the burst.
    times: ThrottledSend,
    /// The bucket admitted below its configured rate: a success may raise it back.
    below_full_rate: bool,
    correlation_id: String,
    span: tracing::Span,
}

/// What a send phase hands on: `Continue` with what the next phase needs, or `Break` with how
/// the delivery's message ended in this phase (given back, settled without a send, lost).
type Phase<T> = ControlFlow<Processed, T>;

/// What the request carries, opened just before it (never logged).
struct Payload {
    destination: Destination,
    /// The reminder's content, when it has one that parses as JSON.
    content: Option<serde_json::Value>,
}

/// A provider's answer, with when the request started and the answer came (the database's
/// clock as this worker knows it).
struct Answered {
    outcome: SendOutcome,
    started_at: DateTime<Utc>,
    finished_at: DateTime<Utc>,
}

impl Worker {
    /// Processes a batch of message payloads: the lease step, then every send at once.
    /// Returns each message's end, in order.
    pub async fn process_batch(&self, payloads: &[&[u8]]) -> Vec<Processed> {
        let messages: Vec<Inbound<'_>> = payloads
            .iter()
            .map(|payload| Inbound {
                payload,
                traceparent: None,
            })
            .collect();
        let steps = self.lease_step(&messages).await;
        futures_util::future::join_all(steps.into_iter().map(|step| self.finish_step(step))).await
    }

    /// Finishes what the lease step decided for one message: sends a leased delivery, or
    /// returns the end it already had.
    pub async fn finish_step(&self, step: Step) -> Processed {
        match step {
            Step::Done(processed) => processed,
            Step::Send(send) => {
                let span = send.span.clone();
                self.send_leased(*send).instrument(span).await
            }
        }
    }

    /// Processes one message payload (a batch of one).
    pub async fn process_one(&self, payload: &[u8]) -> Processed {
        self.process_batch(&[payload])
            .await
            .pop()
            .unwrap_or(Processed::Dropped("empty_batch"))
    }

    fn lease_batch(&self) -> LeaseBatch<'_> {
        LeaseBatch {
            channel: self.channel,
            lease_holder: &self.worker_id,
            lease_for: self.lease_for,
            routes: &self.providers.routes,
            account_recheck: self.account_recheck,
            admission: &self.admission,
            cipher: &self.cipher,
            at: LedgerTime::Database,
        }
    }

    /// Decodes a batch and leases what it points at in one transaction.
    pub async fn lease_step(&self, inbound: &[Inbound<'_>]) -> Vec<Step> {
        let mut steps: Vec<Option<Step>> = Vec::with_capacity(inbound.len());
        let mut envelopes: Vec<(usize, Envelope)> = Vec::with_capacity(inbound.len());
        for (i, message) in inbound.iter().enumerate() {
            match Envelope::decode(message.payload) {
                Ok(envelope) if envelope.channel == self.channel => {
                    envelopes.push((i, envelope));
                    steps.push(None);
                }
                Ok(envelope) => {
                    warn!(channel = %self.channel, envelope_channel = %envelope.channel,
                          delivery_id = %envelope.delivery_id,
                          "message for another channel: dead-lettering");
                    steps.push(Some(Step::Done(Processed::Poison("wrong_channel"))));
                }
                Err(e) => {
                    warn!(channel = %self.channel, reason = e.reason_code(),
                          error.cause_chain = %error_chain(&e),
                          "poison message: dead-lettering");
                    steps.push(Some(Step::Done(Processed::Poison(e.reason_code()))));
                }
            }
        }
        if !envelopes.is_empty() {
            let messages: Vec<MessagePointer> = envelopes
                .iter()
                .map(|(_, e)| MessagePointer {
                    delivery_id: e.delivery_id,
                    generation: e.generation,
                })
                .collect();
            let (result, sent) = self.lease_while_away(&messages).await;
            let received = self.clock.local();
            match result {
                Ok(result) => {
                    self.clock.observe(result.leased_at, sent, received);
                    for reading in &result.buckets {
                        self.metrics.bucket(
                            &reading.account,
                            self.channel,
                            reading.rate_per_second,
                            reading.effective_rate,
                        );
                    }
                    let below_full_rate: Vec<&ProviderAccount> = result
                        .buckets
                        .iter()
                        .filter(|b| b.effective_rate < b.rate_per_second)
                        .map(|b| &b.account)
                        .collect();
                    for ((i, envelope), outcome) in envelopes.into_iter().zip(result.outcomes) {
                        steps[i] = Some(self.after_lease(
                            envelope,
                            inbound[i].traceparent,
                            outcome,
                            result.leased_at,
                            &below_full_rate,
                        ));
                    }
                }
                Err(e) => {
                    // Nothing was leased (the transaction rolled back), and the ledger is not
                    // merely away (or the worker is stopping): the deliveries stay `queued`
                    // and the relay republishes them.
                    error!(error.cause_chain = %error_chain(&e), messages = messages.len(),
                           "failed to lease");
                    for (i, _) in envelopes {
                        steps[i] = Some(Step::Done(Processed::Dropped("ledger_unavailable")));
                    }
                }
            }
        }
        steps
            .into_iter()
            .map(|s| s.unwrap_or(Step::Done(Processed::Dropped("unprocessed"))))
            .collect()
    }

    /// Leases `messages`, trying again for as long as the ledger is away (and the worker is
    /// not stopping): the messages stay unacknowledged here meanwhile, bounded by the
    /// prefetch, so none is dropped to wait for a republish, and none is handed back to the
    /// broker to spend its delivery limit. Returns the last result, and when (this worker's
    /// clock) its statement was sent.
    async fn lease_while_away(
        &self,
        messages: &[MessagePointer],
    ) -> (
        Result<nudge_ledger::LeaseResult, LedgerError>,
        DateTime<Utc>,
    ) {
        let batch = self.lease_batch();
        let mut sent = self.clock.local();
        let (result, tries) = self
            .while_away("lease", || {
                sent = self.clock.local();
                self.ledger.lease_batch(&batch, messages)
            })
            .await;
        if tries > 0 && result.is_ok() {
            info!(
                tries,
                messages = messages.len(),
                "leased after the ledger came back"
            );
        }
        (result, sent)
    }

    /// Runs `statement` again while it finds the ledger away and the worker is not stopping,
    /// pausing 100 ms, doubling to 1 s; the first time the ledger is found away is logged.
    /// Returns the last result and how many tries found the ledger away.
    async fn while_away<T, Fut>(
        &self,
        what: &'static str,
        mut statement: impl FnMut() -> Fut,
    ) -> (Result<T, LedgerError>, u32)
    where
        Fut: std::future::Future<Output = Result<T, LedgerError>>,
    {
        let mut pause = LEDGER_AWAY_FIRST_PAUSE;
        let mut tries = 0u32;
        loop {
            match statement().await {
                Err(e) if e.is_unavailable() && !self.shutdown.is_cancelled() => {
                    tries += 1;
                    if tries == 1 {
                        warn!(error.cause_chain = %error_chain(&e), statement = what,
                              "the ledger is away; holding on and trying again when it is back");
                    }
                }
                result => return (result, tries),
            }
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = self.shutdown.cancelled() => {}
            }
            pause = (pause * 2).min(LEDGER_AWAY_MAX_PAUSE);
        }
    }

    fn after_lease(
        &self,
        envelope: Envelope,
        traceparent: Option<&str>,
        outcome: LeaseOutcome,
        leased_at: DateTime<Utc>,
        below_full_rate: &[&ProviderAccount],
    ) -> Step {
        // The messaging "process" span (OpenTelemetry conventions), joined to the trace the
        // message's `traceparent` names (the relay's publish), else to the delivery's own.
        let span = tracing::info_span!("delivery",
            otel.name = %format_args!("process work.{}", self.channel),
            otel.kind = "consumer",
            messaging.system = "rabbitmq",
            messaging.operation.type = "process",
            messaging.operation.name = "process",
            messaging.destination.name = %format_args!("work.{}", self.channel),
            delivery_id = %envelope.delivery_id,
            channel = %self.channel,
            generation = envelope.generation,
            lane = %envelope.lane,
            correlation_id = %envelope.correlation_id);
        match traceparent {
            Some(traceparent) => nudge_telemetry::set_parent_from_traceparent(&span, traceparent),
            None => nudge_telemetry::set_delivery_parent(
                &span,
                *envelope.delivery_id.as_uuid().as_bytes(),
            ),
        }
        let _entered = span.enter();
        let done = match outcome {
            LeaseOutcome::Leased {
                lease,
                material,
                slot,
            } => {
                drop(_entered);
                let times = slot_times(slot, leased_at);
                let below_full_rate = below_full_rate.contains(&&lease.provider_account);
                let held = self.leases.hold(&lease);
                return Step::Send(Box::new(ToSend {
                    held,
                    lease,
                    material,
                    slot,
                    times,
                    below_full_rate,
                    correlation_id: envelope.correlation_id,
                    span,
                }));
            }
            LeaseOutcome::Released {
                until,
                reason,
                account,
            } => {
                let reason = deferral_label(reason);
                self.metrics.deferral(&account, self.channel, reason);
                debug!(provider_account = %account, reason, %until, "given back unsent: no slot in time, or inside quiet hours");
                Processed::Released(reason)
            }
            LeaseOutcome::Expired => {
                info!("expired before it could be sent: settled as expired");
                Processed::Expired
            }
            LeaseOutcome::QuietHoursExpired => {
                self.metrics.quiet_hours_expired(self.channel);
                info!("due inside its quiet hours, which outlast it: settled as expired");
                Processed::Expired
            }
            LeaseOutcome::Cancelled => {
                info!("reminder cancelled before the send: settled as cancelled");
                Processed::Cancelled
            }
            LeaseOutcome::Stale { state, generation } => {
                debug!(%state, current_generation = generation, "stale message dropped");
                Processed::Stale
            }
            LeaseOutcome::NotFound => {
                warn!("message for an unknown delivery dropped");
                Processed::Stale
            }
            LeaseOutcome::OwnedBy(owner) => {
                info!(%owner, "delivery handed to another sender: message dropped");
                Processed::Dropped("owned_by_another_sender")
            }
            LeaseOutcome::UnknownAccount(account) => {
                info!(provider_account = %account,
                      "tenant routed to a provider account this worker lacks and another live \
                       worker has; left queued for that one");
                Processed::Dropped("unknown_provider_account")
            }
            LeaseOutcome::AccountUnavailable { until, account } => {
                self.metrics
                    .deferral(&account, self.channel, "account_unavailable");
                warn!(provider_account = %account, %until,
                      "tenant routed to a provider account no live worker has; the delivery \
                       waits for it (account_unavailable), never sent through another account");
                Processed::Released("account_unavailable")
            }
        };
        Step::Done(done)
    }

    /// Takes one leased delivery through the send phases, in the order the module's `//!`
    /// lists them. Each phase hands the delivery on or ends its message there.
    async fn send_leased(&self, send: ToSend) -> Processed {
        let ToSend {
            mut lease,
            held,
            material,
            slot,
            times,
            below_full_rate,
            correlation_id,
            span: _,
        } = send;
        let phases = async {
            let provider = self.provider_for(&lease).await?;
            let payload = self
                .open_material(&lease, material, &correlation_id)
                .await?;
            // A check that stops a send before its slot is waited for (quiet hours, consent)
            // stands here: after the material is open, before the fence, which checks it
            // again with the database's clock.
            let times = self.wait_and_fence(&mut lease, &held, slot, times).await?;
            let answered = self
                .call_provider(provider, &lease, &held, payload, &correlation_id)
                .await;
            ControlFlow::Continue(
                self.settle(lease, answered, times, below_full_rate, &correlation_id)
                    .await,
            )
        };
        let end = match phases.await {
            ControlFlow::Continue(end) | ControlFlow::Break(end) => end,
        };
        // Held until here: the outcome is recorded (or the lease given back) by now.
        drop(held);
        end
    }

    /// The provider of the account the lease was routed to. The lease only takes accounts
    /// this worker has; a lease that says otherwise is given back rather than sent through
    /// the wrong account.
    async fn provider_for(&self, lease: &LeasedDelivery) -> Phase<&dyn DynProvider> {
        match self.providers.get(&lease.provider_account) {
            Some(provider) => ControlFlow::Continue(provider),
            None => ControlFlow::Break(
                self.give_back(lease, None, "unknown_provider_account")
                    .await,
            ),
        }
    }

    /// Opens what the request will carry: the destination, and the content (as JSON, when it
    /// parses). A delivery with nothing to send to is settled here without a send: a
    /// destination that opted out (suppressed), a contact its provider flagged invalid
    /// (dead-lettered), no destination on
    /// file for the channel, or material that did not open (dead-lettered).
    async fn open_material(
        &self,
        lease: &LeasedDelivery,
        material: Result<Material, LedgerError>,
        correlation_id: &str,
    ) -> Phase<Payload> {
        match material {
            Ok(Material {
                contact_flag: Some(flag),
                ..
            }) => {
                // A provider said this destination cannot (or must not) receive: no send.
                let (state, reason) = match flag {
                    nudge_domain::ContactFlag::OptedOut => {
                        (DeliveryState::Suppressed, nudge_ledger::CONTACT_OPTED_OUT)
                    }
                    nudge_domain::ContactFlag::Invalid => {
                        (DeliveryState::DeadLettered, "contact_invalid")
                    }
                };
                if state == DeliveryState::Suppressed {
                    self.metrics.suppressed(self.channel);
                }
                info!(
                    contact_flag = flag.as_str(),
                    "contact flagged by its provider: settled without a send"
                );
                ControlFlow::Break(
                    self.record_unsendable(lease, state, reason, correlation_id)
                        .await,
                )
            }
            Ok(Material {
                destination: Some(destination),
                content,
                ..
            }) => ControlFlow::Continue(Payload {
                destination,
                content: content.and_then(|c| serde_json::from_slice::<serde_json::Value>(&c).ok()),
            }),
            Ok(Material {
                destination: None, ..
            }) => {
                warn!("no destination on file for this channel: dead-lettering the delivery");
                ControlFlow::Break(
                    self.record_unsendable(
                        lease,
                        DeliveryState::DeadLettered,
                        "no_destination",
                        correlation_id,
                    )
                    .await,
                )
            }
            Err(e) => {
                error!(error.cause_chain = %error_chain(&e),
                       "the destination or content did not open: dead-lettering the delivery");
                ControlFlow::Break(
                    self.record_unsendable(
                        lease,
                        DeliveryState::DeadLettered,
                        "material_unreadable",
                        correlation_id,
                    )
                    .await,
                )
            }
        }
    }

    /// Waits for the reserved slot, then fences (a slot that had come at the lease was fenced
    /// with it: nothing to wait for). The fence renews `lease`; a bucket slowed since the
    /// reservation reserves again (a few times), which renews it too. Returns when the slot the
    /// send goes out in was reserved and the slot (the database's clock), for the bucket's
    /// feedback. Ends
    /// the message when the send may not go: shut down while waiting, the lease lost, the
    /// delivery expired or cancelled, the bucket closed, no new slot in time.
    async fn wait_and_fence(
        &self,
        lease: &mut LeasedDelivery,
        held: &HeldLease,
        mut slot: SendSlot,
        mut times: ThrottledSend,
    ) -> Phase<ThrottledSend> {
        let mut rounds = 0;
        while let SendSlot::At {
            send_at,
            reserved_at: reserved,
        } = slot
        {
            rounds += 1;
            times = slot_times(slot, reserved);
            if let Ok(wait) = (send_at - reserved).to_std() {
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    // Shutting down: nothing was sent, so the lease goes back due now and
                    // another worker takes it, rather than this one sending while it stops.
                    () = self.shutdown.cancelled() => {
                        return ControlFlow::Break(self.give_back(lease, None, "shutdown").await);
                    }
                }
            }
            let fenced = self.fence_while_away(lease, reserved).await;
            slot = match fenced {
                Ok(Ok(lease_until)) => {
                    lease.lease_expires_at = lease_until;
                    held.end().renewed(lease_until);
                    SendSlot::Now
                }
                Ok(Err(FenceRefused::LeaseLost)) => {
                    warn!("lease lost while waiting for the send slot: not sent");
                    return ControlFlow::Break(Processed::LeaseLost);
                }
                Ok(Err(FenceRefused::Expired)) => {
                    info!("expired while waiting for its slot: settled as expired, not sent");
                    return ControlFlow::Break(Processed::Expired);
                }
                Ok(Err(FenceRefused::Cancelled)) => {
                    info!("cancelled while waiting for its slot: settled as cancelled, not sent");
                    return ControlFlow::Break(Processed::Cancelled);
                }
                Ok(Err(FenceRefused::OptedOut)) => {
                    self.metrics.suppressed(self.channel);
                    info!(
                        "its destination opted out while it waited for its slot: settled as \
                         suppressed, not sent"
                    );
                    return ControlFlow::Break(Processed::Suppressed);
                }
                Ok(Err(FenceRefused::BucketClosedUntil(until))) => {
                    return ControlFlow::Break(
                        self.give_back(lease, Some(until), "bucket_closed_while_waiting")
                            .await,
                    );
                }
                Ok(Err(FenceRefused::Slowed)) if rounds < 3 => {
                    let slot = self.reserve_again(lease).await?;
                    held.end().renewed(lease.lease_expires_at);
                    // A slot at once: reserved, and sent, now.
                    times = slot_times(slot, self.clock.now());
                    slot
                }
                Ok(Err(FenceRefused::Slowed)) => {
                    return ControlFlow::Break(self.give_back(lease, None, "bucket_slowed").await);
                }
                Ok(Err(FenceRefused::QuietHours { until: Some(until) })) => {
                    self.metrics
                        .deferral(&lease.provider_account, self.channel, "quiet_hours");
                    info!(%until, "its quiet hours began while it waited for its slot: \
                                   given back until they end, not sent");
                    return ControlFlow::Break(Processed::Released("quiet_hours"));
                }
                Ok(Err(FenceRefused::QuietHours { until: None })) => {
                    self.metrics.quiet_hours_expired(self.channel);
                    info!(
                        "its quiet hours began while it waited for its slot and outlast it: \
                           settled as expired, not sent"
                    );
                    return ControlFlow::Break(Processed::Expired);
                }
                Err(e) => {
                    // No fence, no send: the lease goes back unsent (or, if the ledger is
                    // unreachable for that too, the reaper sees it was never sent).
                    error!(error.cause_chain = %error_chain(&e), "failed to fence the send");
                    return ControlFlow::Break(
                        self.give_back(lease, None, "ledger_unavailable").await,
                    );
                }
            };
        }
        ControlFlow::Continue(times)
    }

    /// The fence, tried again while the ledger is away (and the worker is not stopping): the
    /// heartbeat keeps the lease meanwhile, and the fence itself tells whether it is still
    /// held once the ledger is back.
    async fn fence_while_away(
        &self,
        lease: &LeasedDelivery,
        reserved: DateTime<Utc>,
    ) -> Result<Result<DateTime<Utc>, FenceRefused>, LedgerError> {
        self.while_away("fence", || {
            self.ledger.fence(
                lease,
                reserved,
                self.lease_for,
                self.admission.closed_recheck,
                LedgerTime::Database,
            )
        })
        .await
        .0
    }

    /// A new slot for a lease whose bucket slowed while it waited (part of
    /// [`Worker::wait_and_fence`]): fenced at once when it has come (which renews `lease`), or
    /// ahead to wait for; the lease is given back when there is none in time.
    async fn reserve_again(&self, lease: &mut LeasedDelivery) -> Phase<SendSlot> {
        match self
            .ledger
            .readmit(&self.lease_batch(), lease.clone())
            .await
        {
            Ok(Slotted::Slot(slot, renewed)) => {
                *lease = renewed;
                ControlFlow::Continue(slot)
            }
            Ok(Slotted::Released { until, reason }) => {
                let reason = deferral_label(reason);
                self.metrics
                    .deferral(&lease.provider_account, self.channel, reason);
                debug!(%until, reason, "no send slot in time after a slow-down: released");
                ControlFlow::Break(Processed::Released(reason))
            }
            Ok(Slotted::Unfenced) => {
                ControlFlow::Break(self.give_back(lease, None, "fence_refused").await)
            }
            Err(e) => {
                error!(error.cause_chain = %error_chain(&e), "failed to reserve a new send slot");
                ControlFlow::Break(self.give_back(lease, None, "ledger_unavailable").await)
            }
        }
    }

    /// The provider request, bounded by its [`SendWindow`] (a request starts only if it can be
    /// answered `admission.send_margin_ms` before the lease ends and the delivery expires; an
    /// adapter that has not started it by then is stopped: [`bounded_send`]), in an HTTP client
    /// span (OpenTelemetry conventions) whose context goes to the provider as `traceparent`.
    /// The destination is dropped as soon as the answer is in, and the request is timed.
    async fn call_provider(
        &self,
        provider: &dyn DynProvider,
        lease: &LeasedDelivery,
        held: &HeldLease,
        payload: Payload,
        correlation_id: &str,
    ) -> Answered {
        let Payload {
            destination,
            content,
        } = payload;
        let request_span = tracing::info_span!("provider request",
            otel.name = "POST",
            otel.kind = "client",
            http.request.method = "POST",
            server.address = provider.endpoint().host_str().unwrap_or_default(),
            url.scheme = provider.endpoint().scheme(),
            http.response.status_code = tracing::field::Empty,
            error.type = tracing::field::Empty,
            provider_account = %lease.provider_account,
            attempt = lease.attempt_number);
        let traceparent = nudge_telemetry::traceparent_of(&request_span);
        let started_at = self.clock.now();
        let window = SendWindow::renewed(
            started_at,
            lease.expires_at,
            held.end(),
            self.admission.send_margin,
        );
        let outcome = bounded_send(
            provider.send_boxed(SendRequest {
                idempotency_key: &lease.idempotency_key,
                channel: self.channel,
                destination: destination.expose(),
                content: content.as_ref(),
                correlation_id,
                traceparent: traceparent.as_deref(),
                window: Some(&window),
            }),
            &window,
        )
        .instrument(request_span.clone())
        .await;
        match &outcome {
            nudge_domain::SendOutcome::Response { status, .. }
            | nudge_domain::SendOutcome::Answered(nudge_domain::ProviderAnswer {
                http_status: Some(status),
                ..
            }) => {
                request_span.record("http.response.status_code", status);
                if *status >= 400 {
                    request_span.record("error.type", status.to_string());
                }
            }
            other => {
                request_span.record("error.type", nudge_domain::response_class(other));
            }
        }
        drop(request_span);
        drop(destination);
        let finished_at = self.clock.now();
        self.metrics.provider_request(
            &lease.provider_account,
            self.channel,
            (finished_at - started_at).as_seconds_f64(),
        );
        Answered {
            outcome,
            started_at,
            finished_at,
        }
    }

    /// Settles an attempt: the domain decides what the answer means, the bucket hears about
    /// it ([`Worker::feedback`]), an answer that needs an operator raises its alert, and the
    /// outcome is recorded (in a group, [`Recorder`]).
    async fn settle(
        &self,
        lease: LeasedDelivery,
        answered: Answered,
        times: ThrottledSend,
        below_full_rate: bool,
        correlation_id: &str,
    ) -> Processed {
        let Answered {
            outcome,
            started_at,
            finished_at,
        } = answered;
        let response_class = nudge_domain::response_class(&outcome);
        let decision = self.decide_attempt(&lease, &outcome, finished_at);
        self.feedback(&lease.provider_account, &decision, times, below_full_rate)
            .await;
        self.raise_alert(&lease.provider_account, &decision);
        info!(
            attempt = lease.attempt_number,
            provider_account = %lease.provider_account,
            outcome_class = %decision.facts.outcome_class,
            http_status = decision.facts.http_status,
            next_state = %decision.next_state,
            delay_ms = decision.facts.delay_chosen.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            send_ms = (finished_at - started_at).num_milliseconds(),
            "attempt finished"
        );
        self.record(
            lease,
            decision,
            (started_at, finished_at),
            correlation_id,
            response_class,
        )
        .await
    }

    /// The domain's decision on an answer (the retry policy's limit counted from the last
    /// redrive), and the `Retry-After` it carried counted by validity.
    fn decide_attempt(
        &self,
        lease: &LeasedDelivery,
        outcome: &SendOutcome,
        finished_at: DateTime<Utc>,
    ) -> Decision {
        let ctx = AttemptContext {
            attempt_number: lease
                .attempt_number
                .saturating_sub(lease.attempt_base)
                .max(1),
            expires_at: lease.expires_at,
            idempotency: lease.idempotency,
        };
        let mut jitter = RandJitter::from_entropy();
        let decision = decide(&ctx, outcome, finished_at, &self.policy, &mut jitter);
        if decision.facts.retry_after_seen.is_some() {
            let validity = if !decision.facts.retry_after_valid {
                "invalid"
            } else if decision
                .facts
                .delay_chosen
                .is_some_and(|d| d > self.policy.max_retry_after())
            {
                "over_ceiling"
            } else {
                "valid"
            };
            self.metrics
                .retry_after(&lease.provider_account, self.channel, validity);
        }
        decision
    }

    /// An answer that needs an operator (credentials refused, say): counted and logged as an
    /// error, once per attempt.
    fn raise_alert(&self, account: &ProviderAccount, decision: &Decision) {
        if let Some(alert) = decision.effects.alert {
            self.metrics
                .provider_alert(account, self.channel, alert.as_str());
            error!(
                provider_account = %account,
                channel = %self.channel,
                alert = alert.as_str(),
                reason = decision.facts.reason.as_deref(),
                "provider answer needs an operator"
            );
        }
    }

    /// Settles a delivery that is not attempted at all, through the same group write as an
    /// attempt's outcome.
    async fn record_unsendable(
        &self,
        lease: &LeasedDelivery,
        state: DeliveryState,
        reason: &str,
        correlation_id: &str,
    ) -> Processed {
        let now = self.clock.now();
        self.record(
            lease.clone(),
            without_send(state, reason),
            (now, now),
            correlation_id,
            "none",
        )
        .await
    }

    async fn record(
        &self,
        lease: LeasedDelivery,
        decision: Decision,
        (started_at, finished_at): (DateTime<Utc>, DateTime<Utc>),
        correlation_id: &str,
        response_class: &'static str,
    ) -> Processed {
        let account = lease.provider_account.clone();
        let scheduled_at = lease.scheduled_at;
        let attempt = AttemptRecord {
            started_at,
            finished_at: finished_at.max(started_at),
            worker: self.worker_id.clone(),
            correlation_id: Some(correlation_id.to_owned()),
        };
        let (class, next_state) = (decision.facts.outcome_class, decision.next_state);
        match self.recorder.record(lease, decision, attempt).await {
            Ok(Recorded::Applied) => {
                self.metrics.attempt(AttemptLabelsIn {
                    account: &account,
                    channel: self.channel,
                    response_class,
                    outcome_class: class,
                    next_state,
                });
                if next_state == DeliveryState::Delivered {
                    self.metrics
                        .delivered(self.channel, (finished_at - scheduled_at).as_seconds_f64());
                }
                Processed::Attempted(next_state)
            }
            Ok(Recorded::LeaseLost) => {
                warn!(outcome_class = %class, "lease lost before the outcome was recorded: the reaper's decision stands");
                Processed::LeaseLost
            }
            Err(NotRecorded::Stopped) => Processed::Dropped("recorder_stopped"),
            Err(NotRecorded::Refused) => Processed::Dropped("record_refused"),
        }
    }

    async fn give_back(
        &self,
        lease: &LeasedDelivery,
        until: Option<DateTime<Utc>>,
        reason: &'static str,
    ) -> Processed {
        match self
            .ledger
            .release(lease, until, LedgerTime::Database)
            .await
        {
            Ok(()) => {
                self.metrics
                    .deferral(&lease.provider_account, self.channel, reason);
                debug!(provider_account = %lease.provider_account, reason, "lease given back unsent");
                Processed::Released(reason)
            }
            Err(e) => {
                // Never sent and never fenced: when the lease runs out, the reaper gives it
                // back the same way.
                error!(error.cause_chain = %error_chain(&e),
                       "failed to give the lease back; the reaper returns it unsent");
                Processed::Dropped("release_failed")
            }
        }
    }

    /// Tells the bucket what the provider said: an account throttle (a generic 429, or an
    /// adapter's `throttled_account`) pauses (valid Retry-After, at most `admission.max_pause`)
    /// or slows it, a success raises a lowered rate back. A suspension (credentials refused)
    /// is written with the outcome, not here.
    async fn feedback(
        &self,
        account: &ProviderAccount,
        decision: &Decision,
        times: ThrottledSend,
        below_full_rate: bool,
    ) {
        let feedback = match (decision.effects.bucket, decision.facts.outcome_class) {
            (Some(BucketSignal::Throttled { retry_at }), _) => Feedback::Throttled {
                retry_at,
                send: Some(times),
            },
            (None, OutcomeClass::Delivered) if below_full_rate => Feedback::Success,
            _ => return,
        };
        let asked_for_pause = matches!(
            feedback,
            Feedback::Throttled {
                retry_at: Some(_),
                ..
            }
        );
        match self
            .ledger
            .bucket_feedback(
                account,
                self.channel,
                feedback,
                self.admission.max_pause,
                LedgerTime::Database,
            )
            .await
        {
            Ok(Some(applied)) => {
                let paused = asked_for_pause && applied.paused_until.is_some();
                self.metrics
                    .feedback(account, self.channel, applied.effective_rate, paused);
                info!(
                    provider_account = %account,
                    channel = %self.channel,
                    effective_rate = applied.effective_rate,
                    paused_until = applied.paused_until.map(|p| p.to_rfc3339()),
                    pause_capped = applied.pause_capped,
                    burst_limit = applied.burst_limit,
                    burst_from = applied.burst_from.map(|b| b.to_rfc3339()),
                    reserved_at = %times.reserved_at.to_rfc3339(),
                    slot_at = %times.slot_at.to_rfc3339(),
                    "rate bucket adjusted"
                );
            }
            Ok(None) => {}
            Err(e) => {
                warn!(error.cause_chain = %error_chain(&e),
                      "failed to apply provider feedback to the bucket")
            }
        }
    }
}

/// A send bounded by its window, whatever the adapter does inside: an adapter that has not
/// started its request by the window's deadline (still waiting for a token, say) is stopped
/// there, and the attempt failed before send (nothing left, so it is retried by the retry
/// policy and never held as maybe sent). A request that started runs to its own timeout
/// while the heartbeat renews its lease.
async fn bounded_send(mut send: BoxSendFuture<'_>, window: &SendWindow) -> SendOutcome {
    loop {
        let deadline = window.deadline();
        tokio::select! {
            biased;
            outcome = &mut send => return outcome,
            () = tokio::time::sleep_until(deadline) => {
                if window.started() {
                    return send.await;
                }
                // The heartbeat renewed the lease meanwhile: the window is still open.
                if window.deadline() > deadline {
                    continue;
                }
                drop(send);
                info!("the send's window closed before its request started: not sent");
                return SendOutcome::FailedBeforeSend {
                    reason: SEND_DEADLINE_PASSED.to_owned(),
                };
            }
        }
    }
}

/// The `reason` label of a lease given back for want of a slot (metrics and logs).
fn deferral_label(reason: nudge_domain::DeferReason) -> &'static str {
    match reason {
        nudge_domain::DeferReason::Closed => "bucket_closed",
        nudge_domain::DeferReason::Throttled => "bucket_throttled",
        nudge_domain::DeferReason::Paused => "bucket_paused",
        nudge_domain::DeferReason::Capped => "tenant_capped",
        nudge_domain::DeferReason::QuietHours => "quiet_hours",
    }
}

/// A delivery that is not attempted at all (no destination, a flagged contact): settled in
/// `state` (dead-lettered or cancelled) with a reason.
fn without_send(state: DeliveryState, reason: &str) -> Decision {
    Decision {
        next_state: state,
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
        effects: nudge_domain::Effects::default(),
    }
}

/// A slot's times for the bucket's feedback: when it was reserved and when it comes. A slot
/// that had come at its reservation (`Now`) went out at `at`, on the bucket's credit.
fn slot_times(slot: SendSlot, at: DateTime<Utc>) -> ThrottledSend {
    match slot {
        SendSlot::At {
            send_at,
            reserved_at,
        } => ThrottledSend {
            reserved_at,
            slot_at: send_at,
        },
        SendSlot::Now => ThrottledSend {
            reserved_at: at,
            slot_at: at,
        },
    }
}
