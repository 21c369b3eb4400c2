//! Rate buckets: one row per provider account + channel, shared by every worker replica.
//! Each admission locks the row, lets `nudge_domain::admission` decide, and writes the state
//! back in the same transaction, so replicas together never admit more than the bucket allows.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use nudge_domain::drain::{self, BucketRates};
use nudge_domain::{
    Admission, AdmissionSettings, BucketConfig, BucketState, Channel, Lane, MaxShare,
    ProviderAccount, TenantCap, TenantId, ThrottledSend, admission,
};

use crate::{Ledger, LedgerError, LedgerTime};

/// A bucket as operators see it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RateBucket {
    pub account: ProviderAccount,
    pub channel: Channel,
    pub rate_per_second: f64,
    pub burst: u32,
    /// The burst the provider was found to take back to back, smaller than `burst`, which
    /// admission uses instead until an operator sets the bucket again; `None` while the
    /// configured burst stands.
    pub learned_burst: Option<u32>,
    pub effective_rate: f64,
    pub paused_until: Option<DateTime<Utc>>,
    /// Why it is paused: the answer that paused it, and whether the pause was cut short.
    pub pause_cause: Option<String>,
    /// When the provider last answered 429 (a lone one moves nothing: decision 0120).
    pub last_throttled_at: Option<DateTime<Utc>>,
    pub reserve_new: f64,
    pub reserve_recovery: f64,
    pub changed_by: String,
    pub changed_at: DateTime<Utc>,
    pub change_reason: Option<String>,
}

impl RateBucket {
    /// The rates that decide whether the bucket admits anything now (`nudge_domain::drain`).
    pub fn rates(&self) -> BucketRates {
        BucketRates {
            rate_per_second: self.rate_per_second,
            effective_rate: self.effective_rate,
            paused_until: self.paused_until,
        }
    }
}

/// What a provider's answer says about the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feedback {
    /// A 429; `retry_at` when it carried a valid Retry-After; `send` when the send's
    /// reservation and slot are known (a 429 for a slot reserved before the last decrease does
    /// not lower the rate again; one for a send that spent the burst shrinks the burst).
    Throttled {
        retry_at: Option<DateTime<Utc>>,
        send: Option<ThrottledSend>,
    },
    Success,
}

/// What a provider's answer did to a bucket, when it changed it.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedbackApplied {
    pub effective_rate: f64,
    pub paused_until: Option<DateTime<Utc>>,
    /// The provider asked for a longer pause than `admission.max_pause_s`: it was cut to that.
    pub pause_capped: bool,
    /// The burst the bucket admits with now, where a 429 found it smaller than configured.
    pub burst_limit: Option<u32>,
    /// When the burst the bucket last spent began (the admission that found it whole).
    pub burst_from: Option<DateTime<Utc>>,
}

/// A bucket's rates as one admission saw them, for logs and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketReading {
    pub account: ProviderAccount,
    pub rate_per_second: f64,
    pub effective_rate: f64,
}

/// One lease asking for a slot.
pub(crate) struct SlotRequest<'a> {
    pub account: &'a ProviderAccount,
    pub lane: Lane,
    pub tenant: TenantId,
    /// The tenant's cap on its share of any bucket, if it has one.
    pub max_share: Option<MaxShare>,
}

/// The slots of one admission round: the answers in request order, the database time they
/// were decided at, and the buckets they came from.
pub(crate) struct SlotAnswers {
    pub admissions: Vec<Admission>,
    pub decided_at: DateTime<Utc>,
    pub readings: Vec<BucketReading>,
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
    burst_limit: Option<i32>,
    burst_from: Option<DateTime<Utc>>,
    burst_cut_at: Option<DateTime<Utc>>,
    last_throttled_at: Option<DateTime<Utc>>,
    throttled_until: Option<DateTime<Utc>>,
    changed_by: String,
    changed_at: DateTime<Utc>,
    change_reason: Option<String>,
    pause_cause: Option<String>,
}

#[derive(sqlx::FromRow)]
struct ChannelRateRow {
    rate_per_second: f64,
    effective_rate: f64,
    paused_until: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
}

const COLUMNS: &str = "provider_account, channel, rate_per_second, burst, effective_rate, \
     paused_until, reserve_new, reserve_recovery, tat, tat_new, tat_recovery, new_demand_at, \
     recovery_demand_at, last_decrease_at, last_increase_at, throttled_rate, burst_limit, burst_from, \
     burst_cut_at, last_throttled_at, throttled_until, changed_by, changed_at, \
     change_reason, pause_cause";

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
            // A corrupt (non-positive) limit reads as none: the configured burst.
            burst_limit: self.burst_limit.and_then(|b| u32::try_from(b).ok()),
            burst_from: self.burst_from,
            burst_cut_at: self.burst_cut_at,
            last_throttled_at: self.last_throttled_at,
            throttled_until: self.throttled_until,
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
            learned_burst: self
                .burst_limit
                .and_then(|b| u32::try_from(b).ok())
                .filter(|b| i64::from(*b) < i64::from(self.burst)),
            effective_rate: self.effective_rate,
            paused_until: self.paused_until,
            pause_cause: self.pause_cause.filter(|_| self.paused_until.is_some()),
            last_throttled_at: self.last_throttled_at,
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

/// Locks the bucket row and reads the database's clock *after* the lock is held: replicas
/// queue on that lock, and a slot computed from a time read before the wait would place an
/// immediate send earlier than it really happens, letting the provider see sends bunched
/// closer than the bucket allows. The no-op UPDATE is what makes `RETURNING` run after the
/// lock (a `SELECT ... FOR UPDATE` evaluates its target list before waiting).
async fn lock_now(
    conn: &mut sqlx::PgConnection,
    account: &ProviderAccount,
    channel: Channel,
    at: LedgerTime,
) -> Result<Option<(BucketRow, DateTime<Utc>)>, LedgerError> {
    #[derive(sqlx::FromRow)]
    struct Locked {
        #[sqlx(flatten)]
        row: BucketRow,
        db_now: DateTime<Utc>,
    }
    let locked: Option<Locked> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE rate_buckets SET burst = burst WHERE provider_account = $1 AND channel = $2
         RETURNING {COLUMNS}, COALESCE($3, clock_timestamp()) AS db_now"
    )))
    .bind(account.as_str())
    .bind(channel.as_str())
    .bind(at.bind())
    .fetch_optional(&mut *conn)
    .await?;
    Ok(locked.map(|l| (l.row, l.db_now)))
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
             last_increase_at = $11, throttled_rate = $12, burst_limit = $13, burst_from = $14,
             burst_cut_at = $15, last_throttled_at = $16, throttled_until = $17,
             pause_cause = CASE WHEN $4::timestamptz IS NULL THEN NULL ELSE pause_cause END
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
    .bind(
        state
            .burst_limit
            .map(|b| i32::try_from(b).unwrap_or(i32::MAX)),
    )
    .bind(state.burst_from)
    .bind(state.burst_cut_at)
    .bind(state.last_throttled_at)
    .bind(state.throttled_until)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Suspends an account for `suspend_for` (the provider refused its credentials), inside the
/// caller's transaction: its bucket paused for every replica, its rate untouched, the cause
/// stored for `nudgectl status`. An account without a bucket (not rate-limited) is suspended
/// all the same, in `account_suspensions`, which admission reads for such accounts: either way
/// its other deliveries are given back unsent until the end. Returns the suspension's end when
/// it changed.
pub(crate) async fn suspend(
    conn: &mut sqlx::PgConnection,
    account: &ProviderAccount,
    channel: Channel,
    suspend_for: std::time::Duration,
    at: LedgerTime,
) -> Result<Option<DateTime<Utc>>, LedgerError> {
    let cause = format!(
        "provider refused the account's credentials: suspended for admission.max_pause_s ({} s)",
        suspend_for.as_secs()
    );
    let Some((row, now)) = lock_now(conn, account, channel, at).await? else {
        return suspend_without_bucket(conn, account, channel, suspend_for, &cause, at).await;
    };
    let mut state = row.state();
    let until = now + chrono::Duration::from_std(suspend_for).unwrap_or(chrono::Duration::MAX);
    if !admission::on_suspended(&mut state, until, now) {
        return Ok(None);
    }
    store(conn, account, channel, &state).await?;
    sqlx::query(
        "UPDATE rate_buckets SET pause_cause = $3 WHERE provider_account = $1 AND channel = $2",
    )
    .bind(account.as_str())
    .bind(channel.as_str())
    .bind(cause)
    .execute(&mut *conn)
    .await?;
    Ok(state.paused_until)
}

/// [`suspend`] for an account without a bucket: until `now + suspend_for`, a later suspension
/// already stored kept.
async fn suspend_without_bucket(
    conn: &mut sqlx::PgConnection,
    account: &ProviderAccount,
    channel: Channel,
    suspend_for: std::time::Duration,
    cause: &str,
    at: LedgerTime,
) -> Result<Option<DateTime<Utc>>, LedgerError> {
    let until: Option<DateTime<Utc>> = sqlx::query_scalar(
        "INSERT INTO account_suspensions AS s
             (provider_account, channel, suspended_until, cause, suspended_at)
         VALUES ($1, $2, COALESCE($4, clock_timestamp()) + make_interval(secs => $3), $5,
                 COALESCE($4, clock_timestamp()))
         ON CONFLICT (provider_account, channel) DO UPDATE
         SET suspended_until = EXCLUDED.suspended_until, cause = EXCLUDED.cause,
             suspended_at = EXCLUDED.suspended_at
         WHERE s.suspended_until < EXCLUDED.suspended_until
         RETURNING suspended_until",
    )
    .bind(account.as_str())
    .bind(channel.as_str())
    .bind(suspend_for.as_secs_f64())
    .bind(at.bind())
    .bind(cause)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(until)
}

/// When the suspension of an account without a bucket ends, if it has not yet.
async fn suspended_until(
    conn: &mut sqlx::PgConnection,
    account: &ProviderAccount,
    channel: Channel,
    at: LedgerTime,
) -> Result<Option<DateTime<Utc>>, LedgerError> {
    Ok(sqlx::query_scalar(
        "SELECT suspended_until FROM account_suspensions
         WHERE provider_account = $1 AND channel = $2
           AND suspended_until > COALESCE($3, clock_timestamp())",
    )
    .bind(account.as_str())
    .bind(channel.as_str())
    .bind(at.bind())
    .fetch_optional(&mut *conn)
    .await?)
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

    /// What a channel's buckets admit together at `at` (the database's clock unless pinned):
    /// `nudge_domain::drain::admitted_rate` over the channel's bucket rows, so the relay's
    /// window and `nudgectl estimate-drain` count the same buckets. None when the channel has
    /// no bucket (not limited). One query, as the aggregate it replaces: a channel has a bucket
    /// per provider account, a handful of rows, so the rule runs in Rust at no extra round trip.
    pub async fn channel_rate(
        &self,
        channel: Channel,
        at: LedgerTime,
    ) -> Result<Option<f64>, LedgerError> {
        let rows: Vec<ChannelRateRow> = sqlx::query_as(
            "SELECT rate_per_second, effective_rate, paused_until, COALESCE($2, now()) AS now
             FROM rate_buckets WHERE channel = $1",
        )
        .bind(channel.as_str())
        .bind(at.bind())
        .fetch_all(&self.pool)
        .await?;
        let Some(now) = rows.first().map(|r| r.now) else {
            return Ok(None);
        };
        Ok(drain::admitted_rate(
            rows.iter().map(|r| BucketRates {
                rate_per_second: r.rate_per_second,
                effective_rate: r.effective_rate,
                paused_until: r.paused_until,
            }),
            now,
        ))
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

    /// Applies a provider's answer to the bucket: a 429 confirmed by another within the
    /// confirmation window (`nudge_domain::on_throttled`) pauses it for every replica when it
    /// carries a Retry-After and lowers the effective rate; a lone 429 is only recorded (its
    /// delivery waits for its own retry); success raises the rate back. No answer pauses
    /// a bucket for longer than `max_pause` (`admission.max_pause_s`), whatever it asked for:
    /// after the pause the bucket sends at its lowered rate and climbs back only as sends
    /// succeed. Returns what changed of the rate, pause or burst, if anything. Time is the
    /// database's, read under the lock.
    pub async fn bucket_feedback(
        &self,
        account: &ProviderAccount,
        channel: Channel,
        feedback: Feedback,
        max_pause: std::time::Duration,
        at: LedgerTime,
    ) -> Result<Option<FeedbackApplied>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let Some((row, now)) = lock_now(&mut tx, account, channel, at).await? else {
            return Ok(None);
        };
        let config = row.config()?;
        let mut state = row.state();
        let (changed, cause) = match feedback {
            Feedback::Throttled { retry_at, send } => {
                let longest =
                    now + chrono::Duration::from_std(max_pause).unwrap_or(chrono::Duration::MAX);
                let capped = retry_at.filter(|r| *r > longest).map(|_| longest);
                let kept = capped.or(retry_at);
                let changed = admission::on_throttled_after(&config, &mut state, kept, send, now);
                let cause = kept
                    .filter(|_| state.paused_until != row.paused_until)
                    .map(|until| {
                        let asked = retry_at.map_or(0, |r| (r - now).num_seconds());
                        if capped.is_some() {
                            format!(
                                "429 Retry-After of {asked} s, cut to admission.max_pause_s ({} s)",
                                (until - now).num_seconds()
                            )
                        } else {
                            format!("429 Retry-After of {asked} s")
                        }
                    });
                (changed, cause.map(|c| (c, capped.is_some())))
            }
            Feedback::Success => (admission::on_success(&config, &mut state, now), None),
        };
        if !changed {
            return Ok(None);
        }
        store(&mut tx, account, channel, &state).await?;
        if let Some((cause, _)) = &cause {
            sqlx::query(
                "UPDATE rate_buckets SET pause_cause = $3 WHERE provider_account = $1 AND channel = $2",
            )
            .bind(account.as_str())
            .bind(channel.as_str())
            .bind(cause)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        // A lone 429 only records when it came (decision 0120): nothing an operator or a
        // metric needs to hear about.
        let before = row.state();
        if state.effective_rate == before.effective_rate
            && state.paused_until == before.paused_until
            && state.burst_limit == before.burst_limit
        {
            return Ok(None);
        }
        Ok(Some(FeedbackApplied {
            effective_rate: state.effective_rate,
            paused_until: state.paused_until,
            pause_capped: cause.is_some_and(|(_, capped)| capped),
            burst_limit: state.burst_limit,
            burst_from: state.burst_from,
        }))
    }

    /// Clears a bucket's pause (an operator overriding a provider's `Retry-After`), recording
    /// the change and its audit row in one transaction. Returns the bucket, or None when there
    /// is no such bucket. The rate is untouched.
    pub async fn resume_bucket(
        &self,
        account: &ProviderAccount,
        channel: Channel,
        by: &crate::Operator,
    ) -> Result<Option<RateBucket>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let Some(row) = lock(&mut tx, account, channel).await? else {
            return Ok(None);
        };
        sqlx::query(
            "UPDATE rate_buckets SET paused_until = NULL, pause_cause = NULL
             WHERE provider_account = $1 AND channel = $2",
        )
        .bind(account.as_str())
        .bind(channel.as_str())
        .execute(&mut *tx)
        .await?;
        let entry = by.entry(
            "rate_resume",
            format!("bucket:{account}/{channel}"),
            serde_json::json!({
                "account": account.as_str(),
                "channel": channel,
                "paused_until": row.paused_until.map(|p| p.to_rfc3339()),
                "pause_cause": row.pause_cause,
            }),
        );
        crate::audit::insert(&mut tx, &entry).await?;
        let row = lock(&mut tx, account, channel)
            .await?
            .ok_or_else(|| LedgerError::corrupt("rate_buckets", "bucket vanished"))?;
        tx.commit().await?;
        row.bucket().map(Some)
    }
}

/// A capped tenant's state on one bucket during a round of admission.
struct CapState {
    tat: Option<DateTime<Utc>>,
    read: Option<DateTime<Utc>>,
    deferred: u32,
}

/// The capped tenants' GCRA state on the bucket (locked by the caller's bucket row lock: only
/// admission writes it, and only under that lock). No statement when no request has a cap.
async fn load_caps(
    conn: &mut sqlx::PgConnection,
    account: &ProviderAccount,
    channel: Channel,
    requests: &[SlotRequest<'_>],
) -> Result<HashMap<TenantId, CapState>, LedgerError> {
    let mut caps: HashMap<TenantId, CapState> = requests
        .iter()
        .filter(|r| r.account == account && r.max_share.is_some())
        .map(|r| {
            (
                r.tenant,
                CapState {
                    tat: None,
                    read: None,
                    deferred: 0,
                },
            )
        })
        .collect();
    if caps.is_empty() {
        return Ok(caps);
    }
    let tenants: Vec<uuid::Uuid> = caps.keys().map(|t| t.as_uuid()).collect();
    let rows: Vec<(uuid::Uuid, DateTime<Utc>)> = sqlx::query_as(
        "SELECT tenant_id, tat FROM tenant_bucket_shares
         WHERE provider_account = $1 AND channel = $2 AND tenant_id = ANY($3)",
    )
    .bind(account.as_str())
    .bind(channel.as_str())
    .bind(&tenants)
    .fetch_all(&mut *conn)
    .await?;
    for (tenant, tat) in rows {
        if let Some(cap) = caps.get_mut(&TenantId::from_uuid(tenant)) {
            cap.tat = Some(tat);
            cap.read = Some(tat);
        }
    }
    Ok(caps)
}

/// Writes back the capped tenants' state that admission moved.
async fn store_caps(
    conn: &mut sqlx::PgConnection,
    account: &ProviderAccount,
    channel: Channel,
    caps: &HashMap<TenantId, CapState>,
) -> Result<(), LedgerError> {
    let (tenants, tats): (Vec<uuid::Uuid>, Vec<DateTime<Utc>>) = caps
        .iter()
        .filter_map(|(tenant, cap)| {
            cap.tat
                .filter(|_| cap.tat != cap.read)
                .map(|tat| (tenant.as_uuid(), tat))
        })
        .unzip();
    if tenants.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO tenant_bucket_shares (provider_account, channel, tenant_id, tat)
         SELECT $1, $2, u.tenant_id, u.tat FROM unnest($3::uuid[], $4::timestamptz[])
             AS u(tenant_id, tat)
         ON CONFLICT (provider_account, channel, tenant_id) DO UPDATE SET tat = EXCLUDED.tat",
    )
    .bind(account.as_str())
    .bind(channel.as_str())
    .bind(&tenants)
    .bind(&tats)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Takes a send slot for each request, in one round of the buckets' locks: each bucket is
/// locked once (in account order, so concurrent rounds cannot deadlock), the domain admits its
/// requests in order at the database time read under the lock, and the state is written back.
/// A request on an account without a bucket is admitted at once, unless the account is
/// suspended ([`suspend`]): then it is deferred to the suspension's end.
pub(crate) async fn admit_slots(
    conn: &mut sqlx::PgConnection,
    channel: Channel,
    requests: &[SlotRequest<'_>],
    settings: &AdmissionSettings,
    at: LedgerTime,
) -> Result<SlotAnswers, LedgerError> {
    let mut accounts: Vec<&ProviderAccount> = requests.iter().map(|r| r.account).collect();
    accounts.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    accounts.dedup();
    let mut admissions: Vec<Option<Admission>> = vec![None; requests.len()];
    let mut readings = Vec::with_capacity(accounts.len());
    let mut decided_at = None;
    for account in accounts {
        let Some((row, now)) = lock_now(conn, account, channel, at).await? else {
            if let Some(until) = suspended_until(conn, account, channel, at).await? {
                for (i, request) in requests.iter().enumerate() {
                    if request.account == account {
                        admissions[i] = Some(Admission::Deferred {
                            until,
                            reason: nudge_domain::DeferReason::Paused,
                        });
                    }
                }
            }
            continue;
        };
        decided_at = Some(decided_at.map_or(now, |d: DateTime<Utc>| d.max(now)));
        let config = row.config()?;
        let mut state = row.state();
        let mut caps = load_caps(conn, account, channel, requests).await?;
        for (i, request) in requests.iter().enumerate() {
            if request.account == account {
                let cap = request.max_share.and_then(|share| {
                    caps.get_mut(&request.tenant).map(|c| TenantCap {
                        share,
                        tat: &mut c.tat,
                        deferred: &mut c.deferred,
                    })
                });
                admissions[i] = Some(admission::admit_capped(
                    &config,
                    &mut state,
                    request.lane,
                    now,
                    settings,
                    cap,
                ));
            }
        }
        if state != row.state() {
            store(conn, account, channel, &state).await?;
        }
        store_caps(conn, account, channel, &caps).await?;
        readings.push(BucketReading {
            account: account.clone(),
            rate_per_second: config.rate_per_second(),
            effective_rate: state.effective_rate,
        });
    }
    let decided_at = match decided_at {
        Some(at) => at,
        None => {
            sqlx::query_scalar("SELECT COALESCE($1, clock_timestamp())")
                .bind(at.bind())
                .fetch_one(&mut *conn)
                .await?
        }
    };
    Ok(SlotAnswers {
        admissions: admissions
            .into_iter()
            .map(|a| {
                a.unwrap_or(Admission::Admitted {
                    send_at: decided_at,
                })
            })
            .collect(),
        decided_at,
        readings,
    })
}
