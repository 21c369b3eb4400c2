//! Consuming with manual settlement.

use std::fmt;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use nudge_domain::Channel;
use nudge_telemetry::error_chain;

use crate::BrokerError;
use crate::Topology;
use crate::publish::TRACEPARENT;

const TRACESTATE: &str = "tracestate";

/// Which queue to consume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QueueKind {
    /// `work.<channel>`: what a channel worker processes.
    Work(Channel),
    /// `dead.<channel>`: what the dead-letter recorder moves into the ledger.
    Dead(Channel),
}

impl QueueKind {
    pub fn queue_name(&self, topology: &Topology) -> String {
        match *self {
            QueueKind::Work(channel) => topology.work_queue(channel),
            QueueKind::Dead(channel) => topology.dead_queue(channel),
        }
    }
}

/// Deliveries from one queue, on a channel of their own.
///
/// Dropping the consumer closes its channel once every [`Incoming`] taken from it is settled or
/// dropped; the broker then requeues whatever was not settled.
pub struct Consumer {
    inner: lapin::Consumer,
    channel: lapin::Channel,
    queue: String,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("queue", &self.queue)
            .field("tag", &self.inner.tag())
            .finish_non_exhaustive()
    }
}

impl Consumer {
    pub(crate) fn new(inner: lapin::Consumer, channel: lapin::Channel, queue: String) -> Consumer {
        Consumer {
            inner,
            channel,
            queue,
        }
    }

    /// The next delivery. `None` (consumer cancelled, e.g. the queue was deleted) or an error
    /// (channel or connection closed) end this consumer: call [`crate::Broker::consume`] again,
    /// which reconnects if needed. Cancel-safe: use it in a `select!` with shutdown.
    pub async fn next(&mut self) -> Option<Result<Incoming, BrokerError>> {
        match self.inner.next().await? {
            Ok(delivery) => Some(Ok(Incoming {
                delivery,
                _channel: Some(self.channel.clone()),
            })),
            Err(error) => Some(Err(BrokerError::Delivery(error))),
        }
    }

    /// The full (namespaced) queue name.
    pub fn queue(&self) -> &str {
        &self.queue
    }
}

/// One delivery, to be settled exactly once with [`ack`](Incoming::ack),
/// [`dead_letter`](Incoming::dead_letter) or [`requeue`](Incoming::requeue). Dropped unsettled,
/// it stays unacked until its channel closes, then the broker redelivers it.
pub struct Incoming {
    delivery: Delivery,
    /// Keeps the channel open until this delivery is settled, even if the consumer is dropped.
    _channel: Option<lapin::Channel>,
}

impl fmt::Debug for Incoming {
    /// Without the payload: payloads are never logged.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Incoming")
            .field("delivery_tag", &self.delivery.delivery_tag)
            .field("payload_len", &self.delivery.data.len())
            .field("correlation_id", &self.correlation_id())
            .field("redelivered", &self.redelivered())
            .field("delivery_count", &self.delivery_count())
            .finish_non_exhaustive()
    }
}

impl Incoming {
    pub fn payload(&self) -> &[u8] {
        &self.delivery.data
    }

    pub fn message_id(&self) -> Option<&str> {
        self.delivery
            .properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str)
    }

    pub fn correlation_id(&self) -> Option<&str> {
        self.delivery
            .properties
            .correlation_id()
            .as_ref()
            .map(ShortString::as_str)
    }

    /// The W3C `traceparent` header, if present and text.
    pub fn traceparent(&self) -> Option<&str> {
        self.header_str(TRACEPARENT)
    }

    /// The W3C `tracestate` header, if present and text.
    pub fn tracestate(&self) -> Option<&str> {
        self.header_str(TRACESTATE)
    }

    /// The AMQP `redelivered` flag: this message may have been seen (and even processed) before.
    pub fn redelivered(&self) -> bool {
        self.delivery.redelivered
    }

    /// How many times a quorum queue handed this message out before and got it back
    /// (`x-delivery-count`); 0 on the first delivery, when RabbitMQ sends no header.
    pub fn delivery_count(&self) -> u64 {
        self.headers()
            .and_then(|h| h.inner().get("x-delivery-count"))
            .and_then(as_u64)
            .unwrap_or(0)
    }

    /// For a dead-lettered message: why the last dead-lettering happened, from the first (most
    /// recent) `x-death` entry: `rejected`, `delivery_limit`, `expired` or `maxlen`.
    pub fn death_reason(&self) -> Option<String> {
        self.first_death_field("reason")
    }

    /// For a dead-lettered message: the queue it was dead-lettered from.
    pub fn death_queue(&self) -> Option<String> {
        self.first_death_field("queue")
    }

    /// Done with it: the broker forgets the message.
    pub async fn ack(self) -> Result<(), BrokerError> {
        let settled = self.delivery.acker.ack(BasicAckOptions::default()).await;
        settle_result("ack", settled)
    }

    /// Rejects without requeue, so the queue's dead-letter exchange moves it to `dead.<channel>`
    /// (for a poison message: undecodable, wrong schema, crash loop).
    pub async fn dead_letter(self) -> Result<(), BrokerError> {
        let settled = self
            .delivery
            .acker
            .reject(BasicRejectOptions { requeue: false })
            .await;
        settle_result("reject", settled)
    }

    /// Hands it back for redelivery; a quorum queue counts this against its delivery limit and
    /// dead-letters the message once past it.
    pub async fn requeue(self) -> Result<(), BrokerError> {
        let settled = self
            .delivery
            .acker
            .nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            })
            .await;
        settle_result("requeue", settled)
    }

    fn headers(&self) -> Option<&FieldTable> {
        self.delivery.properties.headers().as_ref()
    }

    fn header_str(&self, key: &str) -> Option<&str> {
        match self.headers()?.inner().get(key)? {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
            AMQPValue::ShortString(s) => Some(s.as_str()),
            _ => None,
        }
    }

    fn first_death_field(&self, key: &str) -> Option<String> {
        let AMQPValue::FieldArray(deaths) = self.headers()?.inner().get("x-death")? else {
            return None;
        };
        let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else {
            return None;
        };
        match first.inner().get(key)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            _ => None,
        }
    }
}

/// lapin answers `Ok(false)` when the acker was already used or its channel is gone: the
/// settlement did not reach the broker, which will redeliver the message.
fn settle_result(operation: &'static str, settled: lapin::Result<bool>) -> Result<(), BrokerError> {
    match settled {
        Ok(true) => Ok(()),
        Ok(false) => Err(BrokerError::ChannelClosed { operation }),
        Err(source) => Err(BrokerError::Settle { operation, source }),
    }
}

fn as_u64(value: &AMQPValue) -> Option<u64> {
    match *value {
        AMQPValue::ShortShortUInt(v) => Some(u64::from(v)),
        AMQPValue::ShortUInt(v) => Some(u64::from(v)),
        AMQPValue::LongUInt(v) => Some(u64::from(v)),
        AMQPValue::Timestamp(v) => Some(v),
        AMQPValue::ShortShortInt(v) => u64::try_from(v).ok(),
        AMQPValue::ShortInt(v) => u64::try_from(v).ok(),
        AMQPValue::LongInt(v) => u64::try_from(v).ok(),
        AMQPValue::LongLongInt(v) => u64::try_from(v).ok(),
        _ => None,
    }
}

/// Backoff between attempts to consume again after a consumer failed or ended.
const RECONSUME_FIRST: std::time::Duration = std::time::Duration::from_millis(100);
const RECONSUME_MAX: std::time::Duration = std::time::Duration::from_secs(5);

impl crate::Broker {
    /// Consumes `queue` until `shutdown`, awaiting `handle` for each message (which must
    /// settle it). When the consumer fails or ends (a dropped connection, a closed channel),
    /// it consumes again, which reconnects and redeclares through the supervisor, backing off
    /// from 100 ms to 5 s while that fails. Returns once `shutdown` is cancelled; a handler
    /// already running is awaited first.
    pub async fn consume_until<F, Fut>(
        &self,
        queue: QueueKind,
        prefetch: u16,
        consumer_tag: &str,
        shutdown: &tokio_util::sync::CancellationToken,
        mut handle: F,
    ) where
        F: FnMut(Incoming) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let name = queue.queue_name(self.topology());
        let mut delay = RECONSUME_FIRST;
        while !shutdown.is_cancelled() {
            let consumer = tokio::select! {
                () = shutdown.cancelled() => return,
                c = self.consume(queue, prefetch, consumer_tag) => c,
            };
            let mut consumer = match consumer {
                Ok(consumer) => {
                    delay = RECONSUME_FIRST;
                    consumer
                }
                Err(e) => {
                    tracing::warn!(queue = %name, error.cause_chain = %error_chain(&e),
                        delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                        "cannot consume; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(RECONSUME_MAX);
                    continue;
                }
            };
            loop {
                let next = tokio::select! {
                    () = shutdown.cancelled() => return,
                    next = consumer.next() => next,
                };
                match next {
                    Some(Ok(incoming)) => handle(incoming).await,
                    Some(Err(e)) => {
                        tracing::warn!(queue = %name, error.cause_chain = %error_chain(&e), "consumer failed; consuming again");
                        break;
                    }
                    None => {
                        tracing::warn!(queue = %name, "consumer ended; consuming again");
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::BasicProperties;
    use lapin::types::{FieldArray, LongString};

    fn incoming(headers: Option<FieldTable>) -> Incoming {
        let mut delivery = Delivery::mock(1, "".into(), "sms".into(), false, vec![9]);
        if let Some(h) = headers {
            delivery.properties = BasicProperties::default().with_headers(h);
        }
        Incoming {
            delivery,
            _channel: None,
        }
    }

    #[test]
    fn the_delivery_count_is_zero_without_the_header_and_read_from_any_integer_type() {
        assert_eq!(incoming(None).delivery_count(), 0);
        for value in [
            AMQPValue::LongLongInt(3),
            AMQPValue::LongInt(3),
            AMQPValue::ShortShortUInt(3),
        ] {
            let mut h = FieldTable::default();
            h.insert("x-delivery-count".into(), value);
            assert_eq!(incoming(Some(h)).delivery_count(), 3);
        }
        let mut h = FieldTable::default();
        h.insert("x-delivery-count".into(), AMQPValue::LongLongInt(-1));
        assert_eq!(incoming(Some(h)).delivery_count(), 0);
    }

    #[test]
    fn the_death_reason_and_queue_come_from_the_first_x_death_entry() {
        let entry = |reason: &str, queue: &str| {
            let mut t = FieldTable::default();
            t.insert(
                "reason".into(),
                AMQPValue::LongString(LongString::from(reason)),
            );
            t.insert(
                "queue".into(),
                AMQPValue::LongString(LongString::from(queue)),
            );
            AMQPValue::FieldTable(t)
        };
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![
                entry("delivery_limit", "work.sms"),
                entry("rejected", "work.other"),
            ])),
        );
        let message = incoming(Some(h));
        assert_eq!(message.death_reason().as_deref(), Some("delivery_limit"));
        assert_eq!(message.death_queue().as_deref(), Some("work.sms"));
        assert_eq!(incoming(None).death_reason(), None);
    }

    #[test]
    fn trace_headers_are_read_as_text() {
        let mut h = FieldTable::default();
        h.insert(
            "traceparent".into(),
            AMQPValue::LongString(LongString::from("00-abc-def-01")),
        );
        h.insert("tracestate".into(), AMQPValue::LongLongInt(1));
        let message = incoming(Some(h));
        assert_eq!(message.traceparent(), Some("00-abc-def-01"));
        assert_eq!(message.tracestate(), None);
    }

    #[test]
    fn the_debug_of_a_delivery_leaves_out_the_payload() {
        let text = format!("{:?}", incoming(None));
        assert!(text.contains("payload_len: 1"), "{text}");
    }
}
