//! The worker's heartbeat: one statement renews every lease a worker still holds.
//!
//! A lease is short (`worker.lease_seconds`, a few seconds) and lives as long as its holder:
//! the holder renews all of its leases at once every `worker.heartbeat_ms`, by the database's
//! clock, so a worker that dies loses its leases within one lease length while a slow send of a
//! live one is never reaped. A lease is renewed only while the same holder still has it at the
//! same generation: one the reaper settled, or a delivery that moved on, is left alone. A lease
//! that lapsed but was not reaped yet is renewed too: nobody else can have taken it (the reaper
//! clears the holder when it acts), and its holder is alive to finish it.
//!
//! Rows another transaction holds (an outcome being recorded, the reaper at work) are skipped
//! rather than waited for: the next beat renews them if they are still held, and the heartbeat
//! never deadlocks with the holder's own recorder.

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::DeliveryId;

use super::{LedgerTime, MessagePointer, millis, to_i64};
use crate::{Ledger, LedgerError};

/// One lease the heartbeat renewed, with its new end (the database's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenewedLease {
    pub delivery_id: DeliveryId,
    pub lease_expires_at: DateTime<Utc>,
}

impl Ledger {
    /// Renews, in one statement, each of `held` that `holder` still leases at that
    /// generation, to `lease_for` from the database's clock; returns those renewed. A lease not
    /// returned was lost (reaped, settled, moved on) or is locked by another statement this
    /// instant: the caller keeps it and lets the fence or the outcome's record tell which.
    pub async fn renew_leases(
        &self,
        holder: &str,
        held: &[MessagePointer],
        lease_for: Duration,
        at: LedgerTime,
    ) -> Result<Vec<RenewedLease>, LedgerError> {
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let mut pointers: Vec<(uuid::Uuid, i64)> = held
            .iter()
            .map(|p| (p.delivery_id.as_uuid(), to_i64(p.generation)))
            .collect();
        // Locks taken in one order by every heartbeat.
        pointers.sort_unstable();
        let (ids, generations): (Vec<uuid::Uuid>, Vec<i64>) = pointers.into_iter().unzip();
        let rows: Vec<(uuid::Uuid, DateTime<Utc>)> = sqlx::query_as(
            "WITH held AS (
                 SELECT d.id FROM deliveries d
                 JOIN unnest($2::uuid[], $3::bigint[]) AS h(id, generation)
                   ON d.id = h.id AND d.generation = h.generation
                 WHERE d.lease_owner = $1 AND d.lease_expires_at IS NOT NULL
                 ORDER BY d.id
                 FOR UPDATE OF d SKIP LOCKED)
             UPDATE deliveries d
             SET lease_expires_at = COALESCE($5, clock_timestamp()) + $4 * interval '1 millisecond'
             FROM held WHERE d.id = held.id
             RETURNING d.id, d.lease_expires_at",
        )
        .bind(holder)
        .bind(&ids)
        .bind(&generations)
        .bind(millis(lease_for))
        .bind(at.bind())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, lease_expires_at)| RenewedLease {
                delivery_id: DeliveryId::from_uuid(id),
                lease_expires_at,
            })
            .collect())
    }
}
