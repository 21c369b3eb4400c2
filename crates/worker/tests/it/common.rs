//! What the worker's tests share beyond the ledger's fixtures (`nudge_ledger::test_support`).

use chrono::Utc;
use nudge_ledger::DueDelivery;
use nudge_proto::Envelope;

/// The queue message the relay publishes for `d`.
pub fn envelope(d: &DueDelivery) -> Vec<u8> {
    Envelope {
        delivery_id: d.id,
        reminder_id: d.reminder_id,
        tenant_id: d.tenant_id,
        channel: d.channel,
        generation: d.generation,
        lane: d.lane,
        correlation_id: "corr".into(),
        enqueued_at: Utc::now(),
    }
    .encode()
}
