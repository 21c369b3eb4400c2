//! Quiet hours as an operator sets them: per tenant and channel, a daily window of the
//! subscriber's wall-clock time in which nothing is sent (`tenant_quiet_hours`), and whether the
//! tenant's reminders may ignore them. The lease and the fence apply them
//! (`deliveries::lease`); the rule is `nudge_domain::quiet`.

use chrono::NaiveTime;
use nudge_domain::{Channel, QuietHours, TenantId};

use crate::audit::{self, Operator};
use crate::{Ledger, LedgerError};

impl Ledger {
    /// Sets (or, with None, removes) a tenant's quiet hours on `channel`, under the tenant's
    /// row lock, audited (`tenant_quiet_hours`, with the window it replaced) in the same
    /// transaction. A window needs the tenant's default zone (the zone of a subscriber who
    /// has none): refused without one. Returns the window it replaced (`Some(None)`: none),
    /// or None when there is no such tenant.
    pub async fn set_tenant_quiet_hours(
        &self,
        id: TenantId,
        channel: Channel,
        hours: Option<QuietHours>,
        by: &Operator,
    ) -> Result<Option<Option<QuietHours>>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let zone: Option<Option<String>> =
            sqlx::query_scalar("SELECT time_zone FROM tenants WHERE id = $1 FOR UPDATE")
                .bind(id.as_uuid())
                .fetch_optional(&mut *tx)
                .await?;
        let Some(zone) = zone else {
            return Ok(None);
        };
        if hours.is_some() && zone.is_none() {
            return Err(LedgerError::InvalidInput(
                "quiet hours need the tenant's default time zone (nudgectl tenant set \
                 --time-zone), the zone of every subscriber who has none",
            ));
        }
        let previous: Option<(NaiveTime, NaiveTime)> = sqlx::query_as(
            "SELECT quiet_from, quiet_to FROM tenant_quiet_hours
             WHERE tenant_id = $1 AND channel = $2",
        )
        .bind(id.as_uuid())
        .bind(channel.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let previous = previous.map(|(from, to)| stored(from, to)).transpose()?;
        match hours {
            Some(hours) => {
                sqlx::query(
                    "INSERT INTO tenant_quiet_hours (tenant_id, channel, quiet_from, quiet_to,
                                                     updated_at)
                     VALUES ($1, $2, $3, $4, $5)
                     ON CONFLICT (tenant_id, channel) DO UPDATE
                     SET quiet_from = EXCLUDED.quiet_from, quiet_to = EXCLUDED.quiet_to,
                         updated_at = EXCLUDED.updated_at",
                )
                .bind(id.as_uuid())
                .bind(channel.as_str())
                .bind(hours.from())
                .bind(hours.to())
                .bind(by.at())
                .execute(&mut *tx)
                .await?;
            }
            None => {
                sqlx::query("DELETE FROM tenant_quiet_hours WHERE tenant_id = $1 AND channel = $2")
                    .bind(id.as_uuid())
                    .bind(channel.as_str())
                    .execute(&mut *tx)
                    .await?;
            }
        }
        let shown = |h: Option<QuietHours>| h.map(|h| h.to_string());
        audit::insert(
            &mut tx,
            &by.entry(
                "tenant_quiet_hours",
                format!("tenant:{id}"),
                serde_json::json!({
                    "channel": channel,
                    "quiet_hours": shown(hours),
                    "previous": shown(previous),
                }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(Some(previous))
    }

    /// A tenant's quiet hours, per channel that has them.
    pub async fn tenant_quiet_hours(
        &self,
        id: TenantId,
    ) -> Result<Vec<(Channel, QuietHours)>, LedgerError> {
        let rows: Vec<(String, NaiveTime, NaiveTime)> = sqlx::query_as(
            "SELECT channel, quiet_from, quiet_to FROM tenant_quiet_hours
             WHERE tenant_id = $1 ORDER BY channel",
        )
        .bind(id.as_uuid())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(channel, from, to)| {
                Ok((
                    channel
                        .parse()
                        .map_err(|e| LedgerError::corrupt("tenant_quiet_hours", e))?,
                    stored(from, to)?,
                ))
            })
            .collect()
    }
}

/// A subscriber's own quiet hours, as `PUT .../contacts` sets them on all their contacts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubscriberQuietHours {
    /// The tenant's window for each channel (the default).
    Tenant,
    /// Their own window, on every channel.
    Own(QuietHours),
    /// None at all, whatever the tenant's.
    Off,
}

/// Records a subscriber's quiet hours, stamped `now`, on their contacts. The subscriber's
/// setting is the latest stamped among all their contacts (the lease reads it so): a contact
/// added later follows it, and a contact another transaction holds (a concurrent post for the
/// same subscriber, storing another channel) is skipped rather than waited for (waiting for it
/// while it waits for ours would deadlock) and keeps its older stamp, which the latest
/// outranks. The contacts this transaction stored are its own, so they are always written.
pub(crate) async fn set_subscriber_quiet_hours(
    conn: &mut sqlx::PgConnection,
    tenant_id: TenantId,
    stored_ref: &str,
    quiet: SubscriberQuietHours,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<(), LedgerError> {
    let (from, to, off) = match quiet {
        SubscriberQuietHours::Tenant => (None, None, false),
        SubscriberQuietHours::Own(hours) => (Some(hours.from()), Some(hours.to()), false),
        SubscriberQuietHours::Off => (None, None, true),
    };
    sqlx::query(
        "WITH free AS (
             SELECT c.channel FROM contacts c
             WHERE c.tenant_id = $1 AND c.subscriber_ref = $2
             FOR UPDATE OF c SKIP LOCKED)
         UPDATE contacts c
         SET quiet_from = $3, quiet_to = $4, quiet_off = $5, quiet_set_at = $6
         FROM free f
         WHERE c.tenant_id = $1 AND c.subscriber_ref = $2 AND c.channel = f.channel",
    )
    .bind(tenant_id.as_uuid())
    .bind(stored_ref)
    .bind(from)
    .bind(to)
    .bind(off)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// A stored window, parsed (the table's CHECK keeps it valid).
pub(crate) fn stored(from: NaiveTime, to: NaiveTime) -> Result<QuietHours, LedgerError> {
    QuietHours::new(from, to).map_err(|e| LedgerError::corrupt("quiet hours", e))
}
