//! Errors of this crate. None of them carries the AMQP URL or a payload.

use std::time::Duration;

/// A broker operation failed. Connection-level failures are retried by the [`crate::Broker`]
/// supervisor on the next call that needs a channel; the caller only has to call again.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BrokerError {
    /// The topology namespace is neither empty nor `[a-z0-9-]{1,40}` followed by a dot.
    #[error("invalid topology namespace: expected \"\" or 1 to 40 of [a-z0-9-] followed by '.'")]
    InvalidNamespace,
    /// The delivery limit must let a message be delivered at least once.
    #[error("invalid delivery limit: must be at least 1")]
    InvalidDeliveryLimit,
    /// A consumer needs a prefetch of at least 1: 0 would mean unbounded in-flight work.
    #[error("invalid prefetch: must be at least 1")]
    InvalidPrefetch,
    /// A consumer tag is at most 255 bytes (an AMQP short string).
    #[error("invalid consumer tag: longer than 255 bytes")]
    InvalidConsumerTag,
    /// The AMQP URL could not be parsed. The URL itself is not shown: it may hold a password.
    #[error("the AMQP URL is not valid (not shown, it may hold a password)")]
    InvalidUrl,
    /// No connection was established within the connect timeout.
    #[error("could not connect to RabbitMQ within {} ms", timeout.as_millis())]
    ConnectTimeout { timeout: Duration },
    /// The connection attempt failed (refused, bad credentials, TLS, ...).
    #[error("could not connect to RabbitMQ")]
    Connect(#[source] lapin::Error),
    /// Declaring an exchange, queue or binding failed (e.g. a queue exists with other arguments).
    #[error("failed to declare {object}")]
    Declare {
        object: String,
        #[source]
        source: lapin::Error,
    },
    /// Opening or configuring a channel failed.
    #[error("failed to open an AMQP channel")]
    Channel(#[source] lapin::Error),
    /// `basic.consume` (or its `basic.qos`) was refused.
    #[error("failed to start consuming from {queue}")]
    Consume {
        queue: String,
        #[source]
        source: lapin::Error,
    },
    /// The consumer's channel or connection failed while waiting for a delivery.
    #[error("the consumer's channel failed")]
    Delivery(#[source] lapin::Error),
    /// Sending an ack, reject or nack failed.
    #[error("failed to {operation} a delivery")]
    Settle {
        operation: &'static str,
        #[source]
        source: lapin::Error,
    },
    /// The delivery's channel closed before it could be settled; the broker requeues it.
    #[error("could not {operation} a delivery: its channel is closed (the broker requeues it)")]
    ChannelClosed { operation: &'static str },
    /// `basic.publish` could not be sent, or its confirm never came.
    #[error("failed to publish")]
    Publish(#[source] lapin::Error),
    /// No confirm arrived in time; whether the broker has the message is unknown.
    #[error("no publisher confirm within {} ms", timeout.as_millis())]
    ConfirmTimeout { timeout: Duration },
    /// The channel was not in confirm mode, so the broker promised nothing.
    #[error("the channel is not in confirm mode")]
    ConfirmsNotEnabled,
    /// [`crate::Broker::close`] was called; this handle no longer connects.
    #[error("the broker handle is closed")]
    Closed,
}

/// Why one message of a batch does not count as published.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PublishError {
    /// The broker accepted the message but no queue was bound for its routing key, so it was
    /// returned (`mandatory`) and is not stored anywhere.
    #[error("the broker returned the message as unroutable")]
    Unroutable,
    /// The broker refused to take responsibility for the message (e.g. a queue rejecting
    /// publishes, or an internal error).
    #[error("the broker refused the message (nack)")]
    Nacked,
    /// The message cannot be sent as given; nothing was published.
    #[error("the message is invalid: {reason}")]
    Invalid { reason: &'static str },
    /// The channel or connection failed: the broker may or may not have the message.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}
