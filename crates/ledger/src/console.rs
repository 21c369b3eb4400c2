//! The console's tokens (`console_tokens`, migration 20261223000001, decision 0701) and the
//! audit log as the console filters it.
//!
//! A token is `nct_` and the base64url of 32 random bytes, shown once when made; the ledger
//! keeps only its SHA-256. It names a role ([`ConsoleRole`]), expires, and can be revoked; a
//! session made with it ends at its next request once the token is revoked or expired
//! ([`Ledger::console_token`]).

use base64::Engine as _;
use chrono::{DateTime, Utc};
use rand::RngExt as _;
use sha2::{Digest, Sha256};

use crate::audit::{self, AuditEntry, AuditRow};
use crate::{Ledger, LedgerError, Operator};

/// What a console session may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ConsoleRole {
    /// Reads every page.
    Viewer,
    /// Reads, and takes the operator actions (each audited).
    Operator,
}

impl ConsoleRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Viewer => "viewer",
            Self::Operator => "operator",
        }
    }
}

impl std::str::FromStr for ConsoleRole {
    type Err = &'static str;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "viewer" => Ok(Self::Viewer),
            "operator" => Ok(Self::Operator),
            _ => Err("a console role is viewer or operator"),
        }
    }
}

impl std::fmt::Display for ConsoleRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A console token's secret: shown once, never stored.
#[derive(Clone, PartialEq, Eq)]
pub struct ConsoleSecret(String);

impl std::fmt::Debug for ConsoleSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConsoleSecret(<redacted>)")
    }
}

impl ConsoleSecret {
    fn generate() -> Self {
        let bytes: [u8; 32] = rand::rng().random();
        Self(format!(
            "nct_{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
        ))
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// The SHA-256 the ledger keeps of a token (of its whole text, as typed).
pub fn console_token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.trim().as_bytes()).into()
}

/// One console token as the ledger keeps it (never its secret).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ConsoleToken {
    pub id: i64,
    pub name: String,
    pub role: ConsoleRole,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
    pub expires_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
    pub revoked_by: Option<String>,
    /// Sessions made before this instant are over (a logout sets it).
    pub sessions_valid_after: Option<DateTime<Utc>>,
    /// The SHA-256 the ledger keeps of the secret: a session is bound to it.
    #[serde(skip)]
    pub digest: Vec<u8>,
}

impl ConsoleToken {
    /// Whether a session made with this token may still be used at `now`.
    pub fn is_live(&self, now: DateTime<Utc>) -> bool {
        self.revoked_at.is_none() && self.expires_at > now
    }

    /// Whether a session of this token made at `issued` is still valid at `now`.
    pub fn admits(&self, issued: DateTime<Utc>, now: DateTime<Utc>) -> bool {
        self.is_live(now)
            && self
                .sessions_valid_after
                .is_none_or(|after| issued >= after)
    }
}

#[derive(sqlx::FromRow)]
struct TokenRow {
    id: i64,
    name: String,
    role: String,
    created_at: DateTime<Utc>,
    created_by: String,
    expires_at: DateTime<Utc>,
    revoked_at: Option<DateTime<Utc>>,
    revoked_by: Option<String>,
    sessions_valid_after: Option<DateTime<Utc>>,
    token_sha256: Vec<u8>,
}

const TOKEN_COLUMNS: &str = "id, name, role, created_at, created_by, expires_at, revoked_at, \
     revoked_by, sessions_valid_after, token_sha256";

impl TryFrom<TokenRow> for ConsoleToken {
    type Error = LedgerError;

    fn try_from(r: TokenRow) -> Result<Self, LedgerError> {
        Ok(Self {
            id: r.id,
            name: r.name,
            role: r
                .role
                .parse()
                .map_err(|e| LedgerError::corrupt("console_tokens", e))?,
            created_at: r.created_at,
            created_by: r.created_by,
            expires_at: r.expires_at,
            revoked_at: r.revoked_at,
            revoked_by: r.revoked_by,
            sessions_valid_after: r.sessions_valid_after,
            digest: r.token_sha256,
        })
    }
}

/// A token just made: the row, and its secret (shown once).
#[derive(Debug)]
pub struct CreatedConsoleToken {
    pub token: ConsoleToken,
    pub secret: ConsoleSecret,
}

/// The longest a console token may live.
pub const CONSOLE_TOKEN_MAX_TTL: chrono::Duration = chrono::Duration::days(90);

/// The audit log's filters; each one given narrows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditFilter {
    pub actor: Option<String>,
    pub action: Option<String>,
    pub incident: Option<String>,
    /// Entries older than this id only (the next page).
    pub before_id: Option<i64>,
}

/// One audit entry with its id (the console pages by it).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AuditLine {
    pub id: i64,
    #[serde(flatten)]
    pub entry: AuditEntry,
}

impl Ledger {
    /// Makes a console token of `role`, named `name` (1 to 100 characters), expiring after
    /// `ttl` (a minute to [`CONSOLE_TOKEN_MAX_TTL`]); audited (`console_token_create`) in the
    /// same transaction. The secret is returned once.
    pub async fn create_console_token(
        &self,
        name: &str,
        role: ConsoleRole,
        ttl: chrono::Duration,
        by: &Operator,
    ) -> Result<CreatedConsoleToken, LedgerError> {
        let name = name.trim();
        if name.is_empty() || name.chars().count() > 100 {
            return Err(LedgerError::InvalidInput(
                "a console token's name is 1 to 100 characters",
            ));
        }
        if ttl < chrono::Duration::minutes(1) || ttl > CONSOLE_TOKEN_MAX_TTL {
            return Err(LedgerError::InvalidInput(
                "a console token lives from a minute to 90 days",
            ));
        }
        let secret = ConsoleSecret::generate();
        let mut tx = self.pool.begin().await?;
        let row: TokenRow = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "INSERT INTO console_tokens (name, role, token_sha256, created_at, created_by,
                 expires_at)
             VALUES ($1, $2, $3, $4, $5, $6)
             RETURNING {TOKEN_COLUMNS}"
        )))
        .bind(name)
        .bind(role.as_str())
        .bind(&console_token_digest(secret.expose())[..])
        .bind(by.at())
        .bind(by.actor())
        .bind(by.at() + ttl)
        .fetch_one(&mut *tx)
        .await?;
        let token = ConsoleToken::try_from(row)?;
        audit::insert(
            &mut tx,
            &by.entry(
                "console_token_create",
                format!("console_token:{}", token.id),
                serde_json::json!({
                    "name": token.name,
                    "role": token.role.as_str(),
                    "expires_at": token.expires_at,
                }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(CreatedConsoleToken { token, secret })
    }

    /// Revokes a token (its sessions end at their next request); audited
    /// (`console_token_revoke`). None when no such token; a token already revoked is left as
    /// it was and returned with `false` (nothing changed, nothing audited).
    pub async fn revoke_console_token(
        &self,
        id: i64,
        by: &Operator,
    ) -> Result<Option<(ConsoleToken, bool)>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let row: Option<TokenRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "UPDATE console_tokens SET revoked_at = $2, revoked_by = $3
             WHERE id = $1 AND revoked_at IS NULL
             RETURNING {TOKEN_COLUMNS}"
        )))
        .bind(id)
        .bind(by.at())
        .bind(by.actor())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            drop(tx);
            return Ok(self.console_token(id).await?.map(|t| (t, false)));
        };
        let token = ConsoleToken::try_from(row)?;
        audit::insert(
            &mut tx,
            &by.entry(
                "console_token_revoke",
                format!("console_token:{id}"),
                serde_json::json!({ "name": token.name, "role": token.role.as_str() }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(Some((token, true)))
    }

    /// Every console token, the newest first (never a secret).
    pub async fn console_tokens(&self) -> Result<Vec<ConsoleToken>, LedgerError> {
        let rows: Vec<TokenRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {TOKEN_COLUMNS} FROM console_tokens ORDER BY id DESC"
        )))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(ConsoleToken::try_from).collect()
    }

    pub async fn console_token(&self, id: i64) -> Result<Option<ConsoleToken>, LedgerError> {
        let row: Option<TokenRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {TOKEN_COLUMNS} FROM console_tokens WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(ConsoleToken::try_from).transpose()
    }

    /// Ends every session made with token `id` before `at` (a logout; the database's clock
    /// when `at` is [`crate::LedgerTime::Database`]). False when there is no such token.
    pub async fn end_console_sessions(
        &self,
        id: i64,
        at: crate::LedgerTime,
    ) -> Result<bool, LedgerError> {
        let done = sqlx::query(
            "UPDATE console_tokens SET sessions_valid_after = COALESCE($2, now()) WHERE id = $1",
        )
        .bind(id)
        .bind(at.bind())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// The token whose secret is `token`, live or not (the caller tells the user which).
    pub async fn console_token_by_secret(
        &self,
        token: &str,
    ) -> Result<Option<ConsoleToken>, LedgerError> {
        let row: Option<TokenRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {TOKEN_COLUMNS} FROM console_tokens WHERE token_sha256 = $1"
        )))
        .bind(&console_token_digest(token)[..])
        .fetch_optional(&self.pool)
        .await?;
        row.map(ConsoleToken::try_from).transpose()
    }

    /// The audit log, newest first, narrowed by `filter`; at most `limit` entries.
    pub async fn audit_lines(
        &self,
        filter: &AuditFilter,
        limit: u32,
    ) -> Result<Vec<AuditLine>, LedgerError> {
        #[derive(sqlx::FromRow)]
        struct Line {
            id: i64,
            #[sqlx(flatten)]
            row: AuditRow,
        }
        let rows: Vec<Line> = sqlx::query_as(
            "SELECT id, at, actor, action, target, reason, incident, details FROM audit_log
             WHERE ($1::text IS NULL OR actor = $1)
               AND ($2::text IS NULL OR action = $2)
               AND ($3::text IS NULL OR incident = $3)
               AND ($4::bigint IS NULL OR id < $4)
             ORDER BY id DESC LIMIT $5",
        )
        .bind(filter.actor.as_deref())
        .bind(filter.action.as_deref())
        .bind(filter.incident.as_deref())
        .bind(filter.before_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|l| AuditLine {
                id: l.id,
                entry: AuditEntry::from(l.row),
            })
            .collect())
    }
}

/// One minute of one channel, as the janitor sampled it (`ledger_samples`, migration
/// 20261223000002): the console's sparklines.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LedgerSample {
    /// The minute's start: the oldest eligible wait is as of then, the counts of the minute
    /// before.
    pub at: DateTime<Utc>,
    pub channel: nudge_domain::Channel,
    pub oldest_eligible_age_s: Option<f64>,
    pub delivered: u64,
    pub throttled: u64,
}

#[derive(sqlx::FromRow)]
struct SampleRow {
    at: DateTime<Utc>,
    channel: String,
    oldest_eligible_age_s: Option<f64>,
    delivered: i64,
    throttled: i64,
}

impl Ledger {
    /// Writes the sample of the minute that began at `at` (the database's clock in
    /// production), unless it is written already; trims samples older than a day. Returns the
    /// rows written (0 or one per channel).
    pub async fn record_ledger_sample(&self, at: crate::LedgerTime) -> Result<u32, LedgerError> {
        let written: i32 = sqlx::query_scalar("SELECT nudge_record_ledger_sample($1)")
            .bind(at.bind())
            .fetch_one(&self.pool)
            .await?;
        Ok(u32::try_from(written).unwrap_or(0))
    }

    /// The samples of the last `minutes` minutes (of the database's clock), oldest first.
    pub async fn ledger_samples(&self, minutes: u32) -> Result<Vec<LedgerSample>, LedgerError> {
        let rows: Vec<SampleRow> = sqlx::query_as(
            "SELECT at, channel, oldest_eligible_age_s, delivered, throttled FROM ledger_samples
             WHERE at > now() - make_interval(mins => $1)
             ORDER BY at, channel",
        )
        .bind(i32::try_from(minutes).unwrap_or(i32::MAX))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|r| {
                Ok(LedgerSample {
                    at: r.at,
                    channel: r
                        .channel
                        .parse()
                        .map_err(|e| LedgerError::corrupt("ledger_samples", e))?,
                    oldest_eligible_age_s: r.oldest_eligible_age_s,
                    delivered: u64::try_from(r.delivered).unwrap_or(0),
                    throttled: u64::try_from(r.throttled).unwrap_or(0),
                })
            })
            .collect()
    }
}
