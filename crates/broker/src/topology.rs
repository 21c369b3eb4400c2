//! Names and arguments of nudge's exchanges and queues, and their idempotent declaration.
//!
//! ```text
//! {ns}nudge.work (direct) --<channel>--> {ns}work.<channel> (quorum, delivery limit, DLX)
//!                                              | rejected / over the delivery limit
//! {ns}nudge.dead (direct) <--------------------+
//!        +--<channel>--> {ns}dead.<channel> (quorum)
//! ```
//!
//! `dead.<channel>` is declared without a delivery limit or a dead-letter target: RabbitMQ
//! 3.x sets none, RabbitMQ 4.x applies 20 by default and then drops. The janitor therefore
//! never requeues a dead letter it failed to record (it holds it), and on 4.x a policy lifts
//! the limit; changing the queue's arguments instead would fail the redeclaration of every
//! existing queue (docs/decisions/0201-dead-letters-are-held-not-requeued.md).

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel as AmqpChannel, ExchangeKind};
use nudge_domain::Channel;

use crate::BrokerError;

const MAX_NAMESPACE_LEN: usize = 40;

/// Where nudge's messages live on one broker. The namespace prefixes every name, so that tests
/// (or several environments) can share one broker without seeing each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    namespace: String,
    delivery_limit: u32,
}

impl Topology {
    /// `namespace` is `""` (production) or 1 to 40 of `[a-z0-9-]` followed by a dot (`"t-3f2a."`).
    /// `delivery_limit` is how many times a message may be returned to `work.<channel>`
    /// (rejected with requeue, or left unacked by a consumer that died) before RabbitMQ
    /// dead-letters it instead; it is at least 1. A message is therefore delivered at most
    /// `delivery_limit + 1` times (RabbitMQ 3.10: `x-delivery-count` 0, 1, .. limit, then the next
    /// return dead-letters it with the `x-death` reason `delivery_limit`).
    pub fn new(namespace: &str, delivery_limit: u32) -> Result<Topology, BrokerError> {
        if !namespace_is_valid(namespace) {
            return Err(BrokerError::InvalidNamespace);
        }
        if delivery_limit == 0 {
            return Err(BrokerError::InvalidDeliveryLimit);
        }
        Ok(Topology {
            namespace: namespace.to_owned(),
            delivery_limit,
        })
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn delivery_limit(&self) -> u32 {
        self.delivery_limit
    }

    /// The direct exchange relays publish to, routed by channel name.
    pub fn work_exchange(&self) -> String {
        format!("{}nudge.work", self.namespace)
    }

    /// The direct exchange `work.<channel>` queues dead-letter to, routed by channel name.
    pub fn dead_exchange(&self) -> String {
        format!("{}nudge.dead", self.namespace)
    }

    pub fn work_queue(&self, channel: Channel) -> String {
        format!("{}work.{}", self.namespace, channel.as_str())
    }

    pub fn dead_queue(&self, channel: Channel) -> String {
        format!("{}dead.{}", self.namespace, channel.as_str())
    }

    /// The routing key for a channel on both exchanges.
    pub fn routing_key(channel: Channel) -> &'static str {
        channel.as_str()
    }

    /// The `x-` arguments of `work.<channel>`, as declared.
    ///
    /// At-least-once dead-lettering (RabbitMQ >= 3.10, quorum queues only) keeps a dead-lettered
    /// message in the source queue until the dead queue confirmed it, so a poison message is
    /// never lost between the two; RabbitMQ requires `x-overflow=reject-publish` for it, and
    /// without a length limit that overflow setting never rejects anything.
    fn work_queue_arguments(&self, channel: Channel) -> FieldTable {
        let mut args = quorum_arguments();
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
        );
        args.insert(
            "x-dead-letter-exchange".into(),
            long_string(&self.dead_exchange()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            long_string(Self::routing_key(channel)),
        );
        args.insert(
            "x-dead-letter-strategy".into(),
            long_string("at-least-once"),
        );
        args.insert("x-overflow".into(), long_string("reject-publish"));
        args
    }
}

fn namespace_is_valid(namespace: &str) -> bool {
    if namespace.is_empty() {
        return true;
    }
    let Some(body) = namespace.strip_suffix('.') else {
        return false;
    };
    (1..=MAX_NAMESPACE_LEN).contains(&body.len())
        && body
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn quorum_arguments() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), long_string("quorum"));
    args
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Names built from a validated namespace are at most ~60 bytes, far below the 255 of a
/// short string, so the conversion cannot fail.
fn short(s: String) -> ShortString {
    ShortString::from(s)
}

/// Declares both exchanges and, for every channel, `dead.<channel>` then `work.<channel>` with
/// their bindings. Idempotent while the arguments are unchanged; a queue that already exists
/// with other arguments (e.g. another delivery limit) fails with `PRECONDITION_FAILED`, which
/// also closes `channel`.
pub async fn declare(channel: &AmqpChannel, topology: &Topology) -> Result<(), BrokerError> {
    let durable_exchange = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let durable_queue = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    for exchange in [topology.work_exchange(), topology.dead_exchange()] {
        channel
            .exchange_declare(
                short(exchange.clone()),
                ExchangeKind::Direct,
                durable_exchange,
                FieldTable::default(),
            )
            .await
            .map_err(|source| BrokerError::Declare {
                object: format!("exchange {exchange}"),
                source,
            })?;
    }
    for ch in Channel::ALL {
        // The dead queue first, so that the work queue's dead-letter target is already routable.
        let queues = [
            (
                topology.dead_queue(ch),
                topology.dead_exchange(),
                quorum_arguments(),
            ),
            (
                topology.work_queue(ch),
                topology.work_exchange(),
                topology.work_queue_arguments(ch),
            ),
        ];
        for (queue, exchange, arguments) in queues {
            channel
                .queue_declare(short(queue.clone()), durable_queue, arguments)
                .await
                .map_err(|source| BrokerError::Declare {
                    object: format!("queue {queue}"),
                    source,
                })?;
            channel
                .queue_bind(
                    short(queue.clone()),
                    short(exchange.clone()),
                    Topology::routing_key(ch).into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|source| BrokerError::Declare {
                    object: format!("binding {exchange} -> {queue}"),
                    source,
                })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_namespace_and_the_channel() {
        let t = Topology::new("t-3f2a.", 5).unwrap();
        assert_eq!(t.work_exchange(), "t-3f2a.nudge.work");
        assert_eq!(t.dead_exchange(), "t-3f2a.nudge.dead");
        assert_eq!(t.work_queue(Channel::Sms), "t-3f2a.work.sms");
        assert_eq!(t.dead_queue(Channel::Push), "t-3f2a.dead.push");
        assert_eq!(Topology::routing_key(Channel::Email), "email");
        assert_eq!(t.delivery_limit(), 5);
        assert_eq!(t.namespace(), "t-3f2a.");
    }

    #[test]
    fn the_production_namespace_is_empty() {
        let t = Topology::new("", 1).unwrap();
        assert_eq!(t.work_exchange(), "nudge.work");
        assert_eq!(t.work_queue(Channel::Email), "work.email");
    }

    #[test]
    fn a_namespace_is_lowercase_letters_digits_and_dashes_ending_in_a_dot() {
        let forty = format!("{}.", "a".repeat(40));
        for ok in ["a.", "0-z.", forty.as_str()] {
            assert!(Topology::new(ok, 1).is_ok(), "{ok:?} refused");
        }
        let forty_one = format!("{}.", "a".repeat(41));
        for bad in [
            ".",
            "a",
            "A.",
            "a.b.",
            "a_b.",
            "a .",
            "é.",
            forty_one.as_str(),
        ] {
            assert!(
                matches!(Topology::new(bad, 1), Err(BrokerError::InvalidNamespace)),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn a_delivery_limit_of_zero_is_refused() {
        assert!(matches!(
            Topology::new("", 0),
            Err(BrokerError::InvalidDeliveryLimit)
        ));
    }

    #[test]
    fn a_work_queue_is_a_quorum_queue_dead_lettering_at_least_once_to_its_channel() {
        let t = Topology::new("n.", 7).unwrap();
        let args = t.work_queue_arguments(Channel::Sms);
        let get = |k: &str| args.inner().get(k).cloned();
        assert_eq!(get("x-queue-type"), Some(long_string("quorum")));
        assert_eq!(get("x-delivery-limit"), Some(AMQPValue::LongLongInt(7)));
        assert_eq!(
            get("x-dead-letter-exchange"),
            Some(long_string("n.nudge.dead"))
        );
        assert_eq!(get("x-dead-letter-routing-key"), Some(long_string("sms")));
        assert_eq!(
            get("x-dead-letter-strategy"),
            Some(long_string("at-least-once"))
        );
        assert_eq!(get("x-overflow"), Some(long_string("reject-publish")));
        assert_eq!(args.inner().len(), 6);
    }
}
