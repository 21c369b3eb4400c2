//! RabbitMQ for nudge: the topology, one supervised connection per process, publishing with
//! confirms and consuming with manual settlement.
//!
//! This crate owns how nudge talks to RabbitMQ: the names and arguments of the exchanges and
//! quorum queues ([`Topology`], [`declare`]), reconnecting and redeclaring after the connection
//! drops ([`Broker`]), counting a publish as done only when the broker confirmed it and did not
//! return it ([`Publisher`]), and reading and settling deliveries ([`Consumer`], [`Incoming`]).
//!
//! It must never decide anything about a delivery: a message is a pointer and the ledger is the
//! authority, so this crate neither decodes payloads nor drops, retries or dedups messages on its
//! own. It must never log the AMQP URL (it holds a password) or a payload.

mod broker;
mod consume;
mod error;
mod publish;
#[cfg(feature = "test-support")]
pub mod test_support;
mod topology;

pub use broker::Broker;
pub use consume::{Consumer, Incoming, QueueKind};
pub use error::{BrokerError, PublishError};
pub use publish::{CONFIRM_TIMEOUT, OutgoingMessage, Publisher};
pub use topology::{Topology, declare};

/// Re-exported so callers can name the channel type of [`declare`] without depending on lapin.
pub use lapin;
