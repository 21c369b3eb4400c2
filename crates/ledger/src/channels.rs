//! Operator controls per channel: drain mode and ownership (`channel_controls`, one row per
//! channel), and the producers' acknowledgement of operator flags (`producer_acks`).
//!
//! Drain: while a channel drains, [`insert_deliveries`](crate::reminders) creates no delivery
//! for it (reminders are recorded and their deliveries withheld), the redrive feeder waits,
//! and attempts carry the drain's incident. Turning it off commits the flag, then, in a second
//! transaction, materialises every withheld delivery whose time has come or whose window
//! already ran (running `off` again finishes a release that failed). The delivery inserts take
//! the channel rows `FOR SHARE` and a drain change takes its row `FOR UPDATE`, so once
//! `drain on` has committed no transaction still in flight creates work for the channel.
//!
//! Ownership: every delivery has an owner; a relay and a worker claim and lease only their
//! sender's (`Ledger::for_sender`). Handing a channel over moves its owed, unleased work and
//! the channel's default for new work to the new owner; a lease in flight finishes with the
//! worker that holds it.

use chrono::{DateTime, Utc};
use nudge_domain::Channel;

use crate::{Ledger, LedgerError, LedgerTime, Operator, audit, is_owner_name};

/// One channel's operator controls.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ChannelControl {
    pub channel: Channel,
    pub draining: bool,
    pub drain_incident: Option<String>,
    pub drain_started_at: Option<DateTime<Utc>>,
    pub owner: String,
    pub previous_owner: Option<String>,
    pub changed_by: String,
    pub changed_at: DateTime<Utc>,
    pub change_reason: Option<String>,
}

#[derive(sqlx::FromRow)]
struct ControlRow {
    channel: String,
    draining: bool,
    drain_incident: Option<String>,
    drain_started_at: Option<DateTime<Utc>>,
    owner: String,
    previous_owner: Option<String>,
    changed_by: String,
    changed_at: DateTime<Utc>,
    change_reason: Option<String>,
}

impl TryFrom<ControlRow> for ChannelControl {
    type Error = LedgerError;
    fn try_from(row: ControlRow) -> Result<Self, Self::Error> {
        Ok(Self {
            channel: row
                .channel
                .parse()
                .map_err(|e| LedgerError::corrupt("channel_controls", e))?,
            draining: row.draining,
            drain_incident: row.drain_incident,
            drain_started_at: row.drain_started_at,
            owner: row.owner,
            previous_owner: row.previous_owner,
            changed_by: row.changed_by,
            changed_at: row.changed_at,
            change_reason: row.change_reason,
        })
    }
}

const CONTROL_COLUMNS: &str = "channel, draining, drain_incident, drain_started_at, owner, \
     previous_owner, changed_by, changed_at, change_reason";

/// What `drain on|off` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainChange {
    /// False when the channel already was in the asked state (the flag was not changed).
    pub changed: bool,
    /// On `off`: withheld deliveries created now (their time had come or their window had run).
    pub released: u64,
}

/// What an ownership change did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerChange {
    pub previous: String,
    /// Owed deliveries (scheduled, queued, waiting to retry) moved to the new owner.
    pub moved: u64,
    /// Deliveries being sent under the old owner when it changed: they finish (or their lease
    /// expires) first, and are moved by the next change.
    pub in_flight: u64,
}

impl Ledger {
    /// Every channel's controls, in channel order.
    pub async fn channel_controls(&self) -> Result<Vec<ChannelControl>, LedgerError> {
        let rows: Vec<ControlRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {CONTROL_COLUMNS} FROM channel_controls ORDER BY channel"
        )))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(ChannelControl::try_from).collect()
    }

    /// Turns a channel's drain on or off, audited (`drain_on` / `drain_off`) with the
    /// operator's incident.
    ///
    /// Off is two transactions: the flag (and its audit row), then the release of the withheld
    /// work. Releasing inserts deliveries, which waits for any window holding its tenant's
    /// row; doing that while holding the channel's row would deadlock with a window waiting
    /// for that row. The release is idempotent, so `off` on a channel that is not draining
    /// still releases anything withheld (a release that failed after its flag committed is
    /// finished by running `off` again).
    ///
    /// Which withheld reminders are due is decided by the database's clock (`at` in tests).
    pub async fn set_draining(
        &self,
        channel: Channel,
        draining: bool,
        by: &Operator,
        at: LedgerTime,
    ) -> Result<DrainChange, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let row: ControlRow = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {CONTROL_COLUMNS} FROM channel_controls WHERE channel = $1 FOR UPDATE"
        )))
        .bind(channel.as_str())
        .fetch_one(&mut *tx)
        .await?;
        let changed = row.draining != draining;
        let now = by.at();
        if changed {
            if draining {
                sqlx::query(
                    "UPDATE channel_controls SET draining = true, drain_incident = $2,
                         drain_started_at = $3, changed_by = $4, changed_at = $3,
                         change_reason = $5
                     WHERE channel = $1",
                )
                .bind(channel.as_str())
                .bind(by.incident())
                .bind(now)
                .bind(by.actor())
                .bind(by.reason())
                .execute(&mut *tx)
                .await?;
            } else {
                sqlx::query(
                    "UPDATE channel_controls SET draining = false, drain_incident = NULL,
                         drain_started_at = NULL, changed_by = $3, changed_at = $2,
                         change_reason = $4
                     WHERE channel = $1",
                )
                .bind(channel.as_str())
                .bind(now)
                .bind(by.actor())
                .bind(by.reason())
                .execute(&mut *tx)
                .await?;
            }
            audit::insert(
                &mut tx,
                &by.entry(
                    if draining { "drain_on" } else { "drain_off" },
                    format!("channel:{channel}"),
                    serde_json::json!({
                        "drain_started_at": row.drain_started_at,
                        "drain_incident": row.drain_incident,
                    }),
                ),
            )
            .await?;
        }
        tx.commit().await?;
        let mut released = 0;
        if !draining {
            let mut tx = self.pool.begin().await?;
            let db_now: DateTime<Utc> = sqlx::query_scalar("SELECT COALESCE($1, now())")
                .bind(at.bind())
                .fetch_one(&mut *tx)
                .await?;
            released = crate::reminders::materialise_withheld(&mut tx, channel, db_now).await?;
            if released > 0 {
                audit::insert(
                    &mut tx,
                    &by.entry(
                        "drain_release",
                        format!("channel:{channel}"),
                        serde_json::json!({"released": released}),
                    ),
                )
                .await?;
            }
            tx.commit().await?;
        }
        Ok(DrainChange { changed, released })
    }

    /// Hands a channel's owed, unleased work and its new work to `to`, audited (`owner_set`
    /// with the change, `owner_moved` with the counts once the work has moved). The owner it replaces is kept as `previous_owner` (where a rollback
    /// returns the work); setting the owner it already has only sweeps owed work still
    /// under another owner (leases that finished since the last change).
    ///
    /// The channel's row changes first, in its own transaction (new work follows the new
    /// owner from then on); the owed work then moves in batches of 1,000 in id order, the
    /// order leases lock in, skipping rows a lease holds this instant. So no intake or window
    /// waits on the channel's row for the whole move, and a large move does not take every
    /// row lock at once.
    pub async fn set_channel_owner(
        &self,
        channel: Channel,
        to: &str,
        by: &Operator,
    ) -> Result<OwnerChange, LedgerError> {
        if !is_owner_name(to) {
            return Err(LedgerError::InvalidInput(
                "an owner is 1 to 64 of [a-z0-9_-], starting with a letter or digit",
            ));
        }
        let mut tx = self.pool.begin().await?;
        let previous: String =
            sqlx::query_scalar("SELECT owner FROM channel_controls WHERE channel = $1 FOR UPDATE")
                .bind(channel.as_str())
                .fetch_one(&mut *tx)
                .await?;
        if previous != to {
            sqlx::query(
                "UPDATE channel_controls SET owner = $2, previous_owner = owner, changed_by = $3,
                     changed_at = $4, change_reason = $5
                 WHERE channel = $1",
            )
            .bind(channel.as_str())
            .bind(to)
            .bind(by.actor())
            .bind(by.at())
            .bind(by.reason())
            .execute(&mut *tx)
            .await?;
        }
        audit::insert(
            &mut tx,
            &by.entry(
                "owner_set",
                format!("channel:{channel}"),
                serde_json::json!({"previous": previous, "owner": to}),
            ),
        )
        .await?;
        tx.commit().await?;
        let mut moved = 0;
        loop {
            let batch = sqlx::query(
                "UPDATE deliveries SET owner = $2, updated_at = $3
                 WHERE id IN (
                     SELECT id FROM deliveries
                     WHERE channel = $1 AND owner <> $2
                       AND state IN ('scheduled', 'queued', 'retry_wait')
                     ORDER BY id LIMIT 1000
                     FOR UPDATE SKIP LOCKED)",
            )
            .bind(channel.as_str())
            .bind(to)
            .bind(by.at())
            .execute(&self.pool)
            .await?
            .rows_affected();
            moved += batch;
            if batch < 1000 {
                break;
            }
        }
        let in_flight: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM deliveries
             WHERE channel = $1 AND owner <> $2 AND state = 'sending'",
        )
        .bind(channel.as_str())
        .bind(to)
        .fetch_one(&self.pool)
        .await?;
        let in_flight = u64::try_from(in_flight).unwrap_or(0);
        let mut conn = self.pool.acquire().await?;
        audit::insert(
            &mut conn,
            &by.entry(
                "owner_moved",
                format!("channel:{channel}"),
                serde_json::json!({
                    "previous": previous,
                    "owner": to,
                    "moved": moved,
                    "in_flight": in_flight,
                }),
            ),
        )
        .await?;
        Ok(OwnerChange {
            previous,
            moved,
            in_flight,
        })
    }

    /// Deliveries of `channel` being sent right now (leased), whoever owns them.
    pub async fn sending(&self, channel: Channel) -> Result<u64, LedgerError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM deliveries WHERE channel = $1 AND state = 'sending'",
        )
        .bind(channel.as_str())
        .fetch_one(&self.pool)
        .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// A producer instance's acknowledgement: its schedule pass that started at `started_at`
    /// (the database's clock) has honoured every flag committed before then.
    pub async fn ack_producer_pass(
        &self,
        instance: &str,
        started_at: DateTime<Utc>,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO producer_acks (instance, pass_started_at, updated_at)
             VALUES ($1, $2, $2)
             ON CONFLICT (instance) DO UPDATE
             SET pass_started_at = GREATEST(producer_acks.pass_started_at, EXCLUDED.pass_started_at),
                 updated_at = EXCLUDED.updated_at",
        )
        .bind(instance)
        .bind(started_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The producers that acknowledged a pass since `alive_since`, and when their latest pass
    /// started: a flag committed at `t` is seen by all of them once every one is past `t`.
    pub async fn producer_acks(
        &self,
        alive_since: DateTime<Utc>,
    ) -> Result<Vec<ProducerAck>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT instance, pass_started_at FROM producer_acks
             WHERE updated_at >= $1 ORDER BY instance",
        )
        .bind(alive_since)
        .fetch_all(&self.pool)
        .await?)
    }
}

/// A producer instance's latest acknowledged schedule pass (`producer_acks`).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ProducerAck {
    /// The producer process's name for itself (its host name and process id).
    pub instance: String,
    /// When its latest pass started, by the database's clock: every flag committed before
    /// then is honoured.
    pub pass_started_at: DateTime<Utc>,
}
