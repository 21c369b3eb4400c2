//! Rate buckets: one row per provider account + channel, shared by every worker replica.
//! Each admission locks the row, lets `nudge_domain::admission` decide, and writes the state
//! back in the same transaction, so replicas together never admit more than the bucket allows.

use chrono::{DateTime, Utc};
use nudge_domain::{
    Admission, AdmissionSettings, BucketConfig, BucketState, Channel, Lane, ProviderAccount,
    admission,
};

use crate::{Ledger, LedgerError};

/// A bucket as operators see it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RateBucket {
    pub account: ProviderAccount,
    pub channel: Channel,
    pub rate_per_second: f64,
    pub burst: u32,
    pub effective_rate: f64,
    pub paused_until: Option<DateTime<Utc>>,
    pub reserve_new: f64,
    pub reserve_recovery: f64,
    pub changed_by: String,
    pub changed_at: DateTime<Utc>,
    pub change_reason: Option<String>,
}

/// The answer to an admission request, with the bucket's rates for logs and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketAdmission {
    pub admission: Admission,
    pub rate_per_second: f64,
    pub effective_rate: f64,
}

/// What a send whose slot has come should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketCheck {
    Open,
    ClosedUntil(DateTime<Utc>),
    /// A 429 slowed the bucket after this slot was reserved: reserve again.
    Slowed,
}

/// What a provider's answer says about the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feedback {
    /// A 429; `retry_at` when it carried a valid Retry-After; `reserved_at` when the send's
    /// slot was reserved (a 429 for a slot reserved before the last decrease does not lower
    /// the rate again).
    Throttled {
        retry_at: Option<DateTime<Utc>>,
        reserved_at: Option<DateTime<Utc>>,
    },
    Success,
}

#[derive(sqlx::FromRow)]
struct GateRow {
    rate_per_second: f64,
    effective_rate: f64,
    paused_until: Option<DateTime<Utc>>,
    last_decrease_at: Option<DateTime<Utc>>,
}

#[derive(sqlx::FromRow)]
struct BucketRow {
    provider_account: String,
    channel: String,
    rate_per_second: f64,
    burst: i32,
    effective_rate: f64,
    paused_until: Option<DateTime<Utc>>,
    reserve_new: f64,
    reserve_recovery: f64,
    tat: Option<DateTime<Utc>>,
    tat_new: Option<DateTime<Utc>>,
    tat_recovery: Option<DateTime<Utc>>,
    new_demand_at: Option<DateTime<Utc>>,
    recovery_demand_at: Option<DateTime<Utc>>,
    last_decrease_at: Option<DateTime<Utc>>,
    last_increase_at: Option<DateTime<Utc>>,
    throttled_rate: Option<f64>,
    changed_by: String,
    changed_at: DateTime<Utc>,
    change_reason: Option<String>,
}

const COLUMNS: &str = "provider_account, channel, rate_per_second, burst, effective_rate, \
     paused_until, reserve_new, reserve_recovery, tat, tat_new, tat_recovery, new_demand_at, \
     recovery_demand_at, last_decrease_at, last_increase_at, throttled_rate, changed_by, changed_at, \
     change_reason";

impl BucketRow {
    fn config(&self) -> Result<BucketConfig, LedgerError> {
        BucketConfig::new(
            self.rate_per_second,
            u32::try_from(self.burst).map_err(|e| LedgerError::corrupt("rate_buckets", e))?,
            self.reserve_new,
            self.reserve_recovery,
        )
        .map_err(|e| LedgerError::corrupt("rate_buckets", e))
    }

    fn state(&self) -> BucketState {
        BucketState {
            effective_rate: self.effective_rate,
            paused_until: self.paused_until,
            tat: self.tat,
            tat_new: self.tat_new,
            tat_recovery: self.tat_recovery,
            new_demand_at: self.new_demand_at,
            recovery_demand_at: self.recovery_demand_at,
            last_decrease_at: self.last_decrease_at,
            last_increase_at: self.last_increase_at,
            throttled_rate: self.throttled_rate,
        }
    }

    fn bucket(self) -> Result<RateBucket, LedgerError> {
        Ok(RateBucket {
            account: ProviderAccount::parse(&self.provider_account)
                .map_err(|e| LedgerError::corrupt("rate_buckets", e))?,
            channel: self
                .channel
                .parse()
                .map_err(|e| LedgerError::corrupt("rate_buckets", e))?,
            rate_per_second: self.rate_per_second,
            burst: u32::try_from(self.burst)
                .map_err(|e| LedgerError::corrupt("rate_buckets", e))?,
            effective_rate: self.effective_rate,
            paused_until: self.paused_until,
            reserve_new: self.reserve_new,
            reserve_recovery: self.reserve_recovery,
            changed_by: self.changed_by,
            changed_at: self.changed_at,
            change_reason: self.change_reason,
        })
    }
}

async fn lock(
    conn: &mut sqlx::PgConnection,
    account: &ProviderAccount,
    channel: Channel,
) -> Result<Option<BucketRow>, LedgerError> {
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM rate_buckets WHERE provider_account = $1 AND channel = $2 FOR UPDATE"
    )))
    .bind(account.as_str())
    .bind(channel.as_str())
    .fetch_optional(&mut *conn)
    .await?)
}

async fn store(
    conn: &mut sqlx::PgConnection,
    account: &ProviderAccount,
    channel: Channel,
    state: &BucketState,
) -> Result<(), LedgerError> {
    sqlx::query(
        "UPDATE rate_buckets
         SET effective_rate = $3, paused_until = $4, tat = $5, tat_new = $6, tat_recovery = $7,
             new_demand_at = $8, recovery_demand_at = $9, last_decrease_at = $10,
             last_increase_at = $11, throttled_rate = $12
         WHERE provider_account = $1 AND channel = $2",
    )
    .bind(account.as_str())
    .bind(channel.as_str())
    .bind(state.effective_rate)
    .bind(state.paused_until)
    .bind(state.tat)
    .bind(state.tat_new)
    .bind(state.tat_recovery)
    .bind(state.new_demand_at)
    .bind(state.recovery_demand_at)
    .bind(state.last_decrease_at)
    .bind(state.last_increase_at)
    .bind(state.throttled_rate)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

impl Ledger {
    /// Creates the bucket with the configured starting rate if it does not exist yet. An
    /// existing bucket keeps what operators set at run time.
    pub async fn ensure_bucket(
        &self,
        account: &ProviderAccount,
        channel: Channel,
        rate_per_second: f64,
        burst: u32,
        now: DateTime<Utc>,
    ) -> Result<(), LedgerError> {
        BucketConfig::new(rate_per_second, burst, 0.2, 0.1)
            .map_err(|_| LedgerError::InvalidInput("invalid starting rate or burst"))?;
        sqlx::query(
            "INSERT INTO rate_buckets (provider_account, channel, rate_per_second, burst,
                 effective_rate, changed_by, changed_at, change_reason)
             VALUES ($1, $2, $3, $4, $3, 'configuration', $5, 'starting rate from configuration')
             ON CONFLICT (provider_account, channel) DO NOTHING",
        )
        .bind(account.as_str())
        .bind(channel.as_str())
        .bind(rate_per_second)
        .bind(i32::try_from(burst).unwrap_or(i32::MAX))
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Sets a bucket's configured rate (0 stops sending on it) and burst (None keeps the
    /// current one, or `max(1, ceil(rate))` for a new bucket), creating it if absent. The
    /// effective rate becomes the new rate; a provider's pause (Retry-After) is kept. Audited
    /// (`rate_set`, with the rate and burst it replaced) in the same transaction; the bucket
    /// also remembers who changed it and why.
    pub async fn set_rate(
        &self,
        account: &ProviderAccount,
        channel: Channel,
        rate_per_second: f64,
        burst: Option<u32>,
        by: &crate::Operator,
    ) -> Result<RateBucket, LedgerError> {
        let now = by.at();
        if !rate_per_second.is_finite() || rate_per_second < 0.0 {
            return Err(LedgerError::InvalidInput(
                "the rate must be a finite number >= 0",
            ));
        }
        let mut tx = self.pool.begin().await?;
        let existing = lock(&mut tx, account, channel).await?;
        let burst = burst
            .or_else(|| existing.as_ref().and_then(|r| u32::try_from(r.burst).ok()))
            .unwrap_or_else(|| {
                // Saturating float-to-int: rates are far below u32::MAX.
                (rate_per_second.ceil() as u32).max(1)
            });
        let (reserve_new, reserve_recovery) = existing
            .as_ref()
            .map_or((0.2, 0.1), |r| (r.reserve_new, r.reserve_recovery));
        let config = BucketConfig::new(rate_per_second, burst, reserve_new, reserve_recovery)
            .map_err(|_| {
                LedgerError::InvalidInput("burst must be at least 1 unless the rate is 0")
            })?;
        let mut state = existing
            .as_ref()
            .map_or_else(|| BucketState::fresh(&config), BucketRow::state);
        admission::reconfigured(&config, &mut state, now);
        sqlx::query(
            "INSERT INTO rate_buckets (provider_account, channel, rate_per_second, burst,
                 effective_rate, changed_by, changed_at, change_reason)
             VALUES ($1, $2, $3, $4, $3, $5, $6, $7)
             ON CONFLICT (provider_account, channel) DO UPDATE
             SET rate_per_second = EXCLUDED.rate_per_second, burst = EXCLUDED.burst,
                 effective_rate = EXCLUDED.effective_rate,
                 changed_by = EXCLUDED.changed_by, changed_at = EXCLUDED.changed_at,
                 change_reason = EXCLUDED.change_reason",
        )
        .bind(account.as_str())
        .bind(channel.as_str())
        .bind(rate_per_second)
        .bind(i32::try_from(burst).unwrap_or(i32::MAX))
        .bind(by.actor())
        .bind(now)
        .bind(by.reason())
        .execute(&mut *tx)
        .await?;
        store(&mut tx, account, channel, &state).await?;
        let bucket = lock(&mut tx, account, channel)
            .await?
            .ok_or_else(|| LedgerError::corrupt("rate_buckets", "bucket vanished"))?
            .bucket()?;
        crate::audit::insert(
            &mut tx,
            &by.entry(
                "rate_set",
                format!("bucket:{account}/{channel}"),
                serde_json::json!({
                    "account": account.as_str(),
                    "channel": channel,
                    "rate_per_second": bucket.rate_per_second,
                    "burst": bucket.burst,
                    "previous": existing.as_ref().map(|p| serde_json::json!({
                        "rate_per_second": p.rate_per_second,
                        "burst": p.burst,
                        "effective_rate": p.effective_rate,
                    })),
                }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(bucket)
    }

    /// What a send that reserved its slot at `reserved_at` should do now that its slot has
    /// come: go, wait until the bucket reopens (a provider's pause, or `closed_recheck` after
    /// `now` when an operator set the rate to 0), or reserve again because a 429 slowed the
    /// bucket after the reservation (slots handed out at the old pace would overshoot).
    pub async fn bucket_check(
        &self,
        account: &ProviderAccount,
        channel: Channel,
        now: DateTime<Utc>,
        reserved_at: DateTime<Utc>,
        closed_recheck: std::time::Duration,
    ) -> Result<BucketCheck, LedgerError> {
        let row: Option<GateRow> = sqlx::query_as(
            "SELECT rate_per_second, effective_rate, paused_until, last_decrease_at FROM rate_buckets
             WHERE provider_account = $1 AND channel = $2",
        )
        .bind(account.as_str())
        .bind(channel.as_str())
        .fetch_optional(&self.pool)
        .await?;
        Ok(
            match row.map(|r| {
                (
                    r.rate_per_second,
                    r.effective_rate,
                    r.paused_until,
                    r.last_decrease_at,
                )
            }) {
                None => BucketCheck::Open,
                Some((rate, effective, _, _)) if rate <= 0.0 || effective <= 0.0 => {
                    BucketCheck::ClosedUntil(
                        now + chrono::Duration::from_std(closed_recheck)
                            .unwrap_or(chrono::Duration::seconds(10)),
                    )
                }
                Some((_, _, Some(paused), _)) if paused > now => BucketCheck::ClosedUntil(paused),
                Some((_, _, _, Some(decreased))) if decreased >= reserved_at => BucketCheck::Slowed,
                Some(_) => BucketCheck::Open,
            },
        )
    }

    /// What a channel's buckets admit together right now: the sum of their effective rates,
    /// less the paused ones. None when the channel has no bucket (not limited).
    pub async fn channel_rate(
        &self,
        channel: Channel,
        now: DateTime<Utc>,
    ) -> Result<Option<f64>, LedgerError> {
        let (buckets, rate): (i64, Option<f64>) = sqlx::query_as(
            "SELECT count(*), sum(effective_rate) FILTER (WHERE paused_until IS NULL OR paused_until <= $2)
             FROM rate_buckets WHERE channel = $1",
        )
        .bind(channel.as_str())
        .bind(now)
        .fetch_one(&self.pool)
        .await?;
        Ok((buckets > 0).then(|| rate.unwrap_or(0.0)))
    }

    /// Every bucket, by channel then account.
    pub async fn rate_buckets(&self) -> Result<Vec<RateBucket>, LedgerError> {
        let rows: Vec<BucketRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM rate_buckets ORDER BY channel, provider_account"
        )))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(BucketRow::bucket).collect()
    }

    /// Asks the bucket of `account` + `channel` for a send slot for `lane`. A provider account
    /// without a bucket is not limited (admitted now).
    ///
    /// `clock` is read once the bucket's row is locked: replicas queue on that lock, and a
    /// slot computed from a time read before the wait would place an immediate send earlier
    /// than it really happens, letting the provider see sends bunched closer than the bucket
    /// allows.
    pub async fn admit(
        &self,
        account: &ProviderAccount,
        channel: Channel,
        lane: Lane,
        clock: &(dyn Fn() -> DateTime<Utc> + Send + Sync),
        settings: &AdmissionSettings,
    ) -> Result<BucketAdmission, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let Some(row) = lock(&mut tx, account, channel).await? else {
            return Ok(BucketAdmission {
                admission: Admission::Admitted { send_at: clock() },
                rate_per_second: f64::INFINITY,
                effective_rate: f64::INFINITY,
            });
        };
        let now = clock();
        let config = row.config()?;
        let mut state = row.state();
        let admission = admission::admit(&config, &mut state, lane, now, settings);
        if state != row.state() {
            store(&mut tx, account, channel, &state).await?;
        }
        tx.commit().await?;
        Ok(BucketAdmission {
            admission,
            rate_per_second: config.rate_per_second(),
            effective_rate: state.effective_rate,
        })
    }

    /// Applies a provider's answer to the bucket: a 429 with Retry-After pauses it for every
    /// replica, one without lowers the effective rate, success raises it back. Returns the new
    /// effective rate and pause when they changed.
    pub async fn bucket_feedback(
        &self,
        account: &ProviderAccount,
        channel: Channel,
        feedback: Feedback,
        now: DateTime<Utc>,
    ) -> Result<Option<(f64, Option<DateTime<Utc>>)>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let Some(row) = lock(&mut tx, account, channel).await? else {
            return Ok(None);
        };
        let config = row.config()?;
        let mut state = row.state();
        let changed = match feedback {
            Feedback::Throttled {
                retry_at,
                reserved_at,
            } => admission::on_throttled_after(&config, &mut state, retry_at, reserved_at, now),
            Feedback::Success => admission::on_success(&config, &mut state, now),
        };
        if !changed {
            return Ok(None);
        }
        store(&mut tx, account, channel, &state).await?;
        tx.commit().await?;
        Ok(Some((state.effective_rate, state.paused_until)))
    }
}
