//! Publishing to the work exchange with publisher confirms and `mandatory`.

use std::fmt;
use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Confirmation, PublisherConfirm};
use nudge_domain::Channel;
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::{Broker, BrokerError, PublishError, Topology};

/// How long [`Publisher::publish_batch`] waits for all of a batch's confirms before giving up on
/// the rest (they fail with [`BrokerError::ConfirmTimeout`]: outcome unknown, publish again).
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

const CONTENT_TYPE: &str = "application/x-protobuf";
const APP_ID: &str = "nudge";
const PERSISTENT: u8 = 2;
pub(crate) const TRACEPARENT: &str = "traceparent";

/// One message for `work.<channel>`. The payload is an encoded envelope (ids only).
#[derive(Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    pub channel: Channel,
    pub payload: Vec<u8>,
    /// AMQP `message_id`, at most 255 bytes.
    pub message_id: String,
    /// AMQP `correlation_id`, at most 255 bytes.
    pub correlation_id: String,
    /// W3C `traceparent`, carried as a string header of the same name.
    pub traceparent: Option<String>,
}

impl fmt::Debug for OutgoingMessage {
    /// Without the payload: it is opaque here, and payloads are never logged.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutgoingMessage")
            .field("channel", &self.channel)
            .field("payload_len", &self.payload.len())
            .field("message_id", &self.message_id)
            .field("correlation_id", &self.correlation_id)
            .field("traceparent", &self.traceparent)
            .finish()
    }
}

/// Publishes to the work exchange on one confirm-mode channel.
///
/// If the channel breaks (connection dropped, channel error, a confirm timed out), the failed
/// batch reports [`PublishError::Broker`] for the messages it could not confirm and the *next*
/// call transparently opens a new channel through the [`Broker`] supervisor, reconnecting if
/// needed. Callers keep one `Publisher` and simply publish again; there is no need to call
/// [`Broker::publisher`] a second time. Batches on one publisher run one at a time.
pub struct Publisher {
    broker: Broker,
    channel: Mutex<Option<lapin::Channel>>,
}

impl fmt::Debug for Publisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Publisher")
            .field("broker", &self.broker)
            .finish_non_exhaustive()
    }
}

enum Pending {
    Done(Result<(), PublishError>),
    Confirm(PublisherConfirm),
}

impl Publisher {
    pub(crate) fn new(broker: Broker, channel: lapin::Channel) -> Publisher {
        Publisher {
            broker,
            channel: Mutex::new(Some(channel)),
        }
    }

    /// Publishes every message (persistent, `mandatory`, routing key = channel), then awaits
    /// each confirm. Result `i` is for `messages[i]`; `Ok(())` means the broker confirmed the
    /// message *and* did not return it, i.e. it is stored in a queue. Anything else may be
    /// published again (duplicates are harmless: the ledger drops them).
    ///
    /// Cancel-safe in the same sense: dropping the future leaves every message of the batch
    /// unconfirmed, to be published again.
    pub async fn publish_batch(
        &self,
        messages: &[OutgoingMessage],
    ) -> Vec<Result<(), PublishError>> {
        let mut slot = self.channel.lock().await;
        let channel = match slot.as_ref().filter(|c| c.status().connected()) {
            Some(channel) => channel.clone(),
            None => {
                *slot = None;
                match self.broker.confirm_channel().await {
                    Ok(channel) => {
                        *slot = Some(channel.clone());
                        channel
                    }
                    Err(error) => {
                        return messages
                            .iter()
                            .map(|_| Err(PublishError::Broker(error.clone())))
                            .collect();
                    }
                }
            }
        };

        let exchange = ShortString::from(self.broker.topology().work_exchange());
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        // Every publish of the batch is handed to the connection before any is awaited: each
        // `basic_publish` resolves only once its frames are written, and awaiting them one by
        // one costs a round trip through the connection's I/O task per message. `join_all`
        // polls the futures in order, so frames (and delivery tags) keep the batch's order.
        let sends = messages.iter().map(|message| {
            let channel = &channel;
            let exchange = exchange.clone();
            async move {
                let properties = properties(message)?;
                channel
                    .basic_publish(
                        exchange,
                        Topology::routing_key(message.channel).into(),
                        options,
                        &message.payload,
                        properties,
                    )
                    .await
                    .map_err(|error| PublishError::Broker(BrokerError::Publish(error)))
            }
        });
        let mut channel_failed = false;
        let pending: Vec<Pending> = futures_util::future::join_all(sends)
            .await
            .into_iter()
            .map(|sent| match sent {
                Ok(confirm) => Pending::Confirm(confirm),
                Err(error) => {
                    if matches!(error, PublishError::Broker(_)) {
                        channel_failed = true;
                    }
                    Pending::Done(Err(error))
                }
            })
            .collect();

        let deadline = Instant::now() + CONFIRM_TIMEOUT;
        let mut results = Vec::with_capacity(pending.len());
        for item in pending {
            let confirm = match item {
                Pending::Done(result) => {
                    results.push(result);
                    continue;
                }
                Pending::Confirm(confirm) => confirm,
            };
            let result = match tokio::time::timeout_at(deadline, confirm).await {
                Ok(Ok(Confirmation::Ack(None))) => Ok(()),
                // RabbitMQ acks an unroutable message after returning it: not stored anywhere.
                Ok(Ok(Confirmation::Ack(Some(_returned)))) => Err(PublishError::Unroutable),
                Ok(Ok(Confirmation::Nack(_))) => Err(PublishError::Nacked),
                Ok(Ok(Confirmation::NotRequested)) => {
                    channel_failed = true;
                    Err(BrokerError::ConfirmsNotEnabled.into())
                }
                Ok(Err(error)) => {
                    channel_failed = true;
                    Err(BrokerError::Publish(error).into())
                }
                Err(_elapsed) => {
                    channel_failed = true;
                    Err(BrokerError::ConfirmTimeout {
                        timeout: CONFIRM_TIMEOUT,
                    }
                    .into())
                }
            };
            results.push(result);
        }
        if channel_failed || !channel.status().connected() {
            // Dropping the last handle closes the channel if it is still open.
            *slot = None;
        }
        results
    }
}

fn properties(message: &OutgoingMessage) -> Result<BasicProperties, PublishError> {
    // `ShortString::from` panics past 255 bytes; these come from callers, so check.
    let message_id =
        ShortString::try_new(message.message_id.as_str()).map_err(|_| PublishError::Invalid {
            reason: "message_id is longer than 255 bytes",
        })?;
    let correlation_id = ShortString::try_new(message.correlation_id.as_str()).map_err(|_| {
        PublishError::Invalid {
            reason: "correlation_id is longer than 255 bytes",
        }
    })?;
    let mut properties = BasicProperties::default()
        .with_delivery_mode(PERSISTENT)
        .with_content_type(CONTENT_TYPE.into())
        .with_message_id(message_id)
        .with_correlation_id(correlation_id)
        .with_app_id(APP_ID.into());
    if let Some(traceparent) = &message.traceparent {
        let mut headers = FieldTable::default();
        headers.insert(
            TRACEPARENT.into(),
            AMQPValue::LongString(LongString::from(traceparent.as_str())),
        );
        properties = properties.with_headers(headers);
    }
    Ok(properties)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message() -> OutgoingMessage {
        OutgoingMessage {
            channel: Channel::Sms,
            payload: vec![1, 2, 3],
            message_id: "m-1".to_owned(),
            correlation_id: "c-1".to_owned(),
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned()),
        }
    }

    #[test]
    fn a_message_is_persistent_protobuf_from_nudge_with_its_ids_and_traceparent() {
        let p = properties(&message()).unwrap();
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(
            p.content_type().as_ref().map(ShortString::as_str),
            Some("application/x-protobuf")
        );
        assert_eq!(p.app_id().as_ref().map(ShortString::as_str), Some("nudge"));
        assert_eq!(
            p.message_id().as_ref().map(ShortString::as_str),
            Some("m-1")
        );
        assert_eq!(
            p.correlation_id().as_ref().map(ShortString::as_str),
            Some("c-1")
        );
        let headers = p.headers().clone().unwrap();
        assert!(headers.contains_key("traceparent"));
    }

    #[test]
    fn a_message_without_traceparent_has_no_headers() {
        let mut m = message();
        m.traceparent = None;
        assert_eq!(*properties(&m).unwrap().headers(), None);
    }

    #[test]
    fn an_id_longer_than_a_short_string_is_refused_instead_of_panicking() {
        let mut m = message();
        m.correlation_id = "c".repeat(256);
        assert!(matches!(properties(&m), Err(PublishError::Invalid { .. })));
        let mut m = message();
        m.message_id = "m".repeat(256);
        assert!(matches!(properties(&m), Err(PublishError::Invalid { .. })));
    }

    #[test]
    fn the_debug_of_a_message_leaves_out_the_payload() {
        let text = format!("{:?}", message());
        assert!(text.contains("payload_len: 3"));
        assert!(!text.contains("[1, 2, 3]"));
    }
}
