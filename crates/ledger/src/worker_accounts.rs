//! The provider accounts the live workers can send through (`worker_accounts`, 0411).
//!
//! Each worker announces the accounts of its channel when it starts and then every
//! [`ANNOUNCE_EVERY`], each announcement holding the account for [`HOLD_FOR`] from the
//! database's clock. One row per sender, channel and account (not per worker), moved forward
//! by whichever worker announces it last: the table is as small as the configuration and needs
//! no cleanup. The lease reads it for a delivery routed to an account the leasing worker lacks
//! (another live worker has it: leave the delivery `queued` for that one; none has: give it
//! back until the next look), and `nudgectl status` for what waits on an account nobody has.
//!
//! It must never be read as the authority on where a delivery goes: the tenant's routing
//! (`tenant_channels`) is. A lapsed row only means that nobody announced the account lately.

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, ProviderAccount, TenantId};

use crate::{Ledger, LedgerError, LedgerTime};

/// How often a worker announces its accounts.
pub const ANNOUNCE_EVERY: Duration = Duration::from_secs(10);

/// How long one announcement holds an account: three announcements, so one or two late or
/// lost ones cost nothing, while a stopped worker's accounts lapse within half a minute.
pub const HOLD_FOR: Duration = Duration::from_secs(30);

/// One account some worker announced, as the ledger holds it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AnnouncedAccount {
    /// The sender whose workers have it (`worker.owner`).
    pub owner: String,
    pub channel: Channel,
    pub account: ProviderAccount,
    /// Until when the last announcement holds it (the database's clock).
    pub held_until: DateTime<Utc>,
    /// Whether a live worker has it: `held_until` is still ahead.
    pub live: bool,
}

/// Deliveries of one tenant and channel given back because no live worker had the account
/// the tenant is routed to (`retry_wait`, reason `account_unavailable`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AwaitingAccount {
    pub tenant_id: TenantId,
    pub tenant: String,
    pub channel: Channel,
    /// The account the tenant is routed to now; None when its routing was removed since (the
    /// deliveries then go through the workers' default at their next look).
    pub account: Option<ProviderAccount>,
    pub deliveries: u64,
    /// How long the oldest of them has been owed (since its scheduled time), in seconds.
    pub oldest_scheduled_age_s: i64,
    /// When the next of them is looked at again.
    pub next_look_at: DateTime<Utc>,
    /// Whether a live worker of the deliveries' sender has the account now: they go out at
    /// their next look.
    pub held_now: bool,
}

#[derive(sqlx::FromRow)]
struct AnnouncedRow {
    owner: String,
    channel: String,
    provider_account: String,
    held_until: DateTime<Utc>,
    live: bool,
}

#[derive(sqlx::FromRow)]
struct AwaitingRow {
    tenant_id: uuid::Uuid,
    tenant: String,
    channel: String,
    account: Option<String>,
    deliveries: i64,
    oldest_scheduled_at: DateTime<Utc>,
    next_look_at: DateTime<Utc>,
    held_now: bool,
}

fn channel(s: &str, table: &'static str) -> Result<Channel, LedgerError> {
    s.parse().map_err(|e| LedgerError::corrupt(table, e))
}

impl Ledger {
    /// Announces that a live worker of this handle's sender can send `channel` through
    /// `accounts`, for [`HOLD_FOR`] from the database's clock, in one statement. An earlier
    /// announcement that holds longer (another worker's) is kept.
    pub async fn announce_accounts(
        &self,
        channel: Channel,
        accounts: &[ProviderAccount],
        at: LedgerTime,
    ) -> Result<(), LedgerError> {
        // In one order for every worker: two announcing the same accounts at once never wait
        // on each other's rows in a cycle.
        let mut names: Vec<&str> = accounts.iter().map(ProviderAccount::as_str).collect();
        names.sort_unstable();
        names.dedup();
        sqlx::query(
            "INSERT INTO worker_accounts
                 (owner, channel, provider_account, held_until, announced_at)
             SELECT $1, $2, a, COALESCE($5, now()) + $4 * interval '1 millisecond',
                    COALESCE($5, now())
             FROM unnest($3::text[]) AS a
             ORDER BY a
             ON CONFLICT (owner, channel, provider_account) DO UPDATE
             SET held_until = GREATEST(worker_accounts.held_until, EXCLUDED.held_until),
                 announced_at = EXCLUDED.announced_at",
        )
        .bind(&*self.sender)
        .bind(channel.as_str())
        .bind(&names)
        .bind(crate::deliveries::millis(HOLD_FOR))
        .bind(at.bind())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Marks `account` as this sender's default for `channel` (`default_announced_at`): an
    /// inbound STOP to it then reaches every tenant without an account of its own on the
    /// channel (decision 0505). Never cleared: an account once a default keeps counting as
    /// one, the safe side for an opt-out.
    pub async fn announce_default_account(
        &self,
        channel: Channel,
        account: &ProviderAccount,
        at: LedgerTime,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO worker_accounts
                 (owner, channel, provider_account, held_until, announced_at,
                  default_announced_at)
             VALUES ($1, $2, $3, COALESCE($5, now()) + $4 * interval '1 millisecond',
                     COALESCE($5, now()), COALESCE($5, now()))
             ON CONFLICT (owner, channel, provider_account) DO UPDATE
             SET default_announced_at = EXCLUDED.default_announced_at",
        )
        .bind(&*self.sender)
        .bind(channel.as_str())
        .bind(account.as_str())
        .bind(crate::deliveries::millis(HOLD_FOR))
        .bind(at.bind())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Every account ever announced, live or lapsed, by sender, channel and account.
    pub async fn announced_accounts(
        &self,
        at: LedgerTime,
    ) -> Result<Vec<AnnouncedAccount>, LedgerError> {
        let rows: Vec<AnnouncedRow> = sqlx::query_as(
            "SELECT owner, channel, provider_account, held_until,
                    held_until > COALESCE($1, now()) AS live
             FROM worker_accounts ORDER BY owner, channel, provider_account",
        )
        .bind(at.bind())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|r| {
                Ok(AnnouncedAccount {
                    owner: r.owner,
                    channel: channel(&r.channel, "worker_accounts")?,
                    account: ProviderAccount::parse(&r.provider_account)
                        .map_err(|e| LedgerError::corrupt("worker_accounts", e))?,
                    held_until: r.held_until,
                    live: r.live,
                })
            })
            .collect()
    }

    /// The deliveries that wait because no live worker had their tenant's account, per tenant
    /// and channel, the most first. An operator's read: it passes over the `retry_wait` rows.
    pub async fn awaiting_accounts(
        &self,
        at: LedgerTime,
    ) -> Result<Vec<AwaitingAccount>, LedgerError> {
        let rows: Vec<AwaitingRow> = sqlx::query_as(
            "WITH c AS (SELECT COALESCE($1, now()) AS at),
             waiting AS (
                 SELECT d.tenant_id, d.channel, d.owner, count(*) AS deliveries,
                        min(d.scheduled_at) AS oldest_scheduled_at,
                        min(d.next_attempt_at) AS next_look_at
                 FROM deliveries d
                 WHERE d.state = 'retry_wait' AND d.last_error_reason = 'account_unavailable'
                 GROUP BY d.tenant_id, d.channel, d.owner)
             SELECT w.tenant_id, t.name AS tenant, w.channel, tc.provider_account AS account,
                    w.deliveries::bigint AS deliveries, w.oldest_scheduled_at, w.next_look_at,
                    EXISTS (SELECT 1 FROM worker_accounts a
                            WHERE a.owner = w.owner AND a.channel = w.channel
                              AND a.provider_account = tc.provider_account
                              AND a.held_until > c.at) AS held_now
             FROM waiting w CROSS JOIN c
             JOIN tenants t ON t.id = w.tenant_id
             LEFT JOIN tenant_channels tc
                    ON tc.tenant_id = w.tenant_id AND tc.channel = w.channel
             ORDER BY w.deliveries DESC, w.oldest_scheduled_at, t.name, w.channel",
        )
        .bind(at.bind())
        .fetch_all(&self.pool)
        .await?;
        let now = self.clock(at).await?;
        rows.into_iter()
            .map(|r| {
                Ok(AwaitingAccount {
                    tenant_id: TenantId::from_uuid(r.tenant_id),
                    tenant: r.tenant,
                    channel: channel(&r.channel, "deliveries")?,
                    account: r
                        .account
                        .as_deref()
                        .map(ProviderAccount::parse)
                        .transpose()
                        .map_err(|e| LedgerError::corrupt("tenant_channels", e))?,
                    deliveries: u64::try_from(r.deliveries).unwrap_or(0),
                    oldest_scheduled_age_s: (now - r.oldest_scheduled_at).num_seconds().max(0),
                    next_look_at: r.next_look_at,
                    held_now: r.held_now,
                })
            })
            .collect()
    }
}
