//! The supervised connection: one AMQP connection per process, replaced (and the topology
//! redeclared) by the first caller that needs a channel after it dropped.
//!
//! A process may know several addresses (the nodes of a cluster). It connects to the first that
//! answers; after a drop it tries the next ones in turn, starting after the node it lost, so a
//! node that went down is tried last rather than first. Quorum queues live on every node, so
//! whichever node answers serves the same queues.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::options::{
    BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};
use nudge_domain::Channel;
use nudge_telemetry::error_chain;
use tokio::sync::{Mutex, MutexGuard};
use tokio_util::sync::CancellationToken;

use crate::consume::{Consumer, QueueKind};
use crate::publish::Publisher;
use crate::{BrokerError, Topology, declare};

const INITIAL_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How long [`Broker::close`] waits for the broker to acknowledge the close.
pub const CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// `connection.close` reply code for a normal shutdown.
const REPLY_SUCCESS: u16 = 200;

/// A handle on RabbitMQ, cheap to clone and share between tasks.
///
/// It holds at most one connection. When that connection is found closed or errored, the next
/// call that needs a channel ([`Broker::publisher`], [`Broker::consume`], or a [`Publisher`]
/// replacing its channel) reconnects with capped exponential backoff (100 ms doubling to 5 s,
/// each attempt bounded by the connect timeout) and redeclares the topology before handing out a
/// channel. Concurrent callers wait for that one reconnect instead of starting their own.
///
/// Reconnecting retries until it succeeds or [`Broker::close`] is called, logging each failed
/// attempt; the futures are cancel-safe, so a caller that must stop (shutdown) drops the call
/// from a `select!`. Declaring the topology is not retried when the broker *refuses* it (a queue
/// exists with other arguments): that error is returned, since waiting will not fix it.
#[derive(Clone)]
pub struct Broker {
    inner: Arc<Inner>,
}

struct Inner {
    /// The nodes to try, in order; at least one. Hold the password: never logged, never in
    /// `Debug` (only `host:port` is).
    uris: Vec<AMQPUri>,
    /// Index into `uris` of the node the current (or last) connection went to.
    current: AtomicUsize,
    connection_name: String,
    connect_timeout: Duration,
    topology: Topology,
    connection: Mutex<Option<Connection>>,
    closed: CancellationToken,
}

impl fmt::Debug for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Broker")
            .field("connection_name", &self.inner.connection_name)
            .field("topology", &self.inner.topology)
            .field("closed", &self.inner.closed.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl Broker {
    /// Connects once (failing after `connect_timeout` if the broker does not answer) and
    /// declares `topology`. There is no retry here: a process that cannot reach its broker at
    /// start-up should say so and exit. The connection is named `nudge` in the management UI;
    /// see [`Broker::connect_named`].
    pub async fn connect(
        url: &str,
        connect_timeout: Duration,
        topology: Topology,
    ) -> Result<Broker, BrokerError> {
        Broker::connect_named(&[url], connect_timeout, topology, "nudge").await
    }

    /// Connects to the first of `urls` (the nodes of one cluster) that answers within
    /// `connect_timeout` each, and declares `topology`; fails when none does, with the last
    /// node's error. `connection_name` is what `rabbitmqctl list_connections` and the management
    /// UI show (e.g. the service name).
    pub async fn connect_named(
        urls: &[&str],
        connect_timeout: Duration,
        topology: Topology,
        connection_name: &str,
    ) -> Result<Broker, BrokerError> {
        // Parsed here rather than by lapin, whose parse error quotes the whole URL.
        let uris = urls
            .iter()
            .map(|url| url.parse::<AMQPUri>().map_err(|_| BrokerError::InvalidUrl))
            .collect::<Result<Vec<_>, _>>()?;
        if uris.is_empty() {
            return Err(BrokerError::InvalidUrl);
        }
        let inner = Inner {
            uris,
            current: AtomicUsize::new(0),
            connection_name: connection_name.to_owned(),
            connect_timeout,
            topology,
            connection: Mutex::new(None),
            closed: CancellationToken::new(),
        };
        let connection = inner.connect_any(0).await?;
        *inner.connection.lock().await = Some(connection);
        Ok(Broker {
            inner: Arc::new(inner),
        })
    }

    pub fn topology(&self) -> &Topology {
        &self.inner.topology
    }

    /// Whether the current connection is open. `false` after a drop until a caller reconnects.
    pub async fn is_connected(&self) -> bool {
        self.inner
            .connection
            .lock()
            .await
            .as_ref()
            .is_some_and(|c| c.status().connected())
    }

    /// Closes the connection (the broker requeues unacked deliveries) and stops reconnecting:
    /// every later call on any clone of this handle fails with [`BrokerError::Closed`].
    pub async fn close(&self) {
        self.inner.closed.cancel();
        let connection = self.inner.connection.lock().await.take();
        if let Some(connection) = connection
            && connection.status().connected()
        {
            // Bounded: lapin's close can wait forever on a channel that is itself closing, and
            // a shutdown must finish. The broker cleans up a dropped connection either way.
            match tokio::time::timeout(
                CLOSE_TIMEOUT,
                connection.close(REPLY_SUCCESS, "shutdown".into()),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::debug!(
                        error.cause_chain = %error_chain(&error),
                        "closing the RabbitMQ connection failed"
                    );
                }
                Err(_) => {
                    tracing::warn!(
                        timeout_ms = CLOSE_TIMEOUT.as_millis() as u64,
                        "closing the RabbitMQ connection timed out; dropping it"
                    );
                }
            }
        }
    }

    /// A publisher on its own confirm-mode channel. See [`Publisher::publish_batch`].
    pub async fn publisher(&self) -> Result<Publisher, BrokerError> {
        let channel = self.confirm_channel().await?;
        Ok(Publisher::new(self.clone(), channel))
    }

    /// Starts consuming `queue` on a new channel with manual acknowledgement, at most
    /// `prefetch` (>= 1) unsettled deliveries at a time. When the consumer ends ([`Consumer::next`]
    /// gives `None` or an error) call this again: it reconnects if needed.
    pub async fn consume(
        &self,
        queue: QueueKind,
        prefetch: u16,
        consumer_tag: &str,
    ) -> Result<Consumer, BrokerError> {
        if prefetch == 0 {
            return Err(BrokerError::InvalidPrefetch);
        }
        let tag =
            ShortString::try_new(consumer_tag).map_err(|_| BrokerError::InvalidConsumerTag)?;
        let name = queue.queue_name(self.topology());
        let consume_error = |source| BrokerError::Consume {
            queue: name.clone(),
            source,
        };
        let channel = self.open_channel().await?;
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(consume_error)?;
        let consumer = channel
            .basic_consume(
                ShortString::from(name.clone()),
                tag,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(consume_error)?;
        Ok(Consumer::new(consumer, channel, name))
    }

    /// How many messages of `work.<channel>` are ready (waiting for a consumer), from a passive
    /// declare on a short-lived channel. Messages delivered to a consumer and not yet settled
    /// are not counted.
    pub async fn ready_messages(&self, channel: Channel) -> Result<u32, BrokerError> {
        let name = self.topology().work_queue(channel);
        let amqp = self.open_channel().await?;
        let declared = amqp
            .queue_declare(
                ShortString::from(name.clone()),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|source| BrokerError::Declare {
                object: name,
                source,
            })?;
        // Best effort: a failure leaves the channel to be closed with the connection.
        let _ = amqp.close(REPLY_SUCCESS, "inspected".into()).await;
        Ok(declared.message_count())
    }

    pub(crate) async fn confirm_channel(&self) -> Result<lapin::Channel, BrokerError> {
        let channel = self.open_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(BrokerError::Channel)?;
        Ok(channel)
    }

    /// A new channel on a live connection, reconnecting first if the connection is gone.
    pub(crate) async fn open_channel(&self) -> Result<lapin::Channel, BrokerError> {
        // The connection can die between the liveness check and `channel.open`; one more round
        // then reconnects instead of failing the caller.
        let mut last_error = None;
        for _ in 0..2 {
            let mut guard = self.live_connection().await?;
            let Some(connection) = guard.as_ref() else {
                return Err(BrokerError::Closed);
            };
            match connection.create_channel().await {
                Ok(channel) => return Ok(channel),
                Err(error) => {
                    if !connection.status().connected() {
                        *guard = None;
                    }
                    last_error = Some(error);
                }
            }
        }
        Err(match last_error {
            Some(error) => BrokerError::Channel(error),
            None => BrokerError::Closed,
        })
    }

    /// The connection slot, holding a connected connection on success.
    async fn live_connection(&self) -> Result<MutexGuard<'_, Option<Connection>>, BrokerError> {
        let inner = &self.inner;
        let mut guard = inner.connection.lock().await;
        if inner.closed.is_cancelled() {
            return Err(BrokerError::Closed);
        }
        if guard.as_ref().is_some_and(|c| c.status().connected()) {
            return Ok(guard);
        }
        // Dropping the dead connection's handle; channels still holding it fail on their own.
        *guard = None;
        let mut delay = INITIAL_BACKOFF;
        let mut attempt: u32 = 1;
        // The node just lost goes last: with one address this is that address again.
        let first = (inner.current.load(Ordering::Relaxed) + 1) % inner.uris.len();
        loop {
            let result = tokio::select! {
                () = inner.closed.cancelled() => return Err(BrokerError::Closed),
                result = inner.connect_any(first) => result,
            };
            match result {
                Ok(connection) => {
                    tracing::info!(
                        attempt,
                        node = %inner.node(inner.current.load(Ordering::Relaxed)),
                        "reconnected to RabbitMQ and redeclared the topology"
                    );
                    *guard = Some(connection);
                    return Ok(guard);
                }
                Err(error) if is_refusal(&error) => return Err(error),
                Err(error) => {
                    tracing::warn!(
                        attempt,
                        delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                        error.cause_chain = %error_chain(&error),
                        "reconnecting to RabbitMQ failed, retrying"
                    );
                    tokio::select! {
                        () = inner.closed.cancelled() => return Err(BrokerError::Closed),
                        () = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(MAX_BACKOFF);
                    attempt = attempt.saturating_add(1);
                }
            }
        }
    }
}

/// The broker answered and refused the topology with a channel-level error (e.g.
/// `PRECONDITION_FAILED`: a queue exists with other arguments): retrying with the same
/// arguments cannot help. A connection-level error (e.g. `CONNECTION_FORCED`) is retried.
fn is_refusal(error: &BrokerError) -> bool {
    matches!(error, BrokerError::Declare { source, .. } if source.is_amqp_soft_error())
}

impl Inner {
    /// `host:port` of node `index`, for logs (the URL holds the password).
    fn node(&self, index: usize) -> String {
        let authority = &self.uris[index].authority;
        format!("{}:{}", authority.host, authority.port)
    }

    /// Tries every node once, starting at `first`, and records which one answered. A refusal of
    /// the topology is returned at once (another node holds the same definitions); otherwise the
    /// last node's error is.
    async fn connect_any(&self, first: usize) -> Result<Connection, BrokerError> {
        let count = self.uris.len();
        let mut last_error = None;
        for index in (0..count).map(|i| (first + i) % count) {
            // Recorded before the attempt: a caller that gives up while a node hangs (its own
            // timeout, shutdown) leaves the next reconnect to start after that node, not on it.
            self.current.store(index, Ordering::Relaxed);
            match self.connect_and_declare(index).await {
                Ok(connection) => return Ok(connection),
                Err(error) if is_refusal(&error) => return Err(error),
                Err(error) => {
                    if count > 1 {
                        tracing::debug!(
                            node = %self.node(index),
                            error.cause_chain = %error_chain(&error),
                            "RabbitMQ node did not take the connection; trying the next"
                        );
                    }
                    last_error = Some(error);
                }
            }
        }
        Err(last_error.unwrap_or(BrokerError::InvalidUrl))
    }

    /// Connects to node `index` and declares the topology, all within the connect timeout: a
    /// node that takes the connection and then stalls is given up like one that never answers.
    async fn connect_and_declare(&self, index: usize) -> Result<Connection, BrokerError> {
        tokio::time::timeout(self.connect_timeout, self.connect_and_declare_once(index))
            .await
            .map_err(|_| BrokerError::ConnectTimeout {
                timeout: self.connect_timeout,
            })?
    }

    async fn connect_and_declare_once(&self, index: usize) -> Result<Connection, BrokerError> {
        let properties = ConnectionProperties::default()
            .with_connection_name(self.connection_name.as_str().into());
        let connection = Connection::connect_uri(self.uris[index].clone(), properties)
            .await
            .map_err(BrokerError::Connect)?;
        let channel = connection
            .create_channel()
            .await
            .map_err(BrokerError::Channel)?;
        let declared = declare(&channel, &self.topology).await;
        if declared.is_ok() {
            // Best effort: a failure here leaves the channel to be closed with the connection.
            let _ = channel.close(REPLY_SUCCESS, "declared".into()).await;
        } else if connection.status().connected() {
            let _ = connection
                .close(REPLY_SUCCESS, "topology refused".into())
                .await;
        }
        declared.map(|()| connection)
    }
}
