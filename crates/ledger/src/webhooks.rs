//! Tenants' event endpoints (`tenant_webhooks`, decision 0602): where `nudge-events` pushes a
//! tenant's delivery events, the secrets it signs them with (Standard Webhooks), and how far
//! the endpoint has acknowledged.
//!
//! - `nudgectl tenant webhook set|rotate|enable|disable|show` ([`Ledger::set_tenant_webhook`],
//!   [`Ledger::rotate_webhook_secret`], [`Ledger::set_tenant_webhook_enabled`],
//!   [`Ledger::tenant_webhook`]), each audited in its transaction; a secret is returned once
//!   and stored sealed.
//! - `nudge-events` leases a tenant's webhook ([`Ledger::claim_webhooks`]): one process pushes
//!   a tenant's events at a time, so its batches go in position order. A 2xx moves
//!   `acked_position` ([`Ledger::webhook_acknowledged`]); a failure keeps the batch as it was
//!   for its retry and sets when ([`Ledger::webhook_failed`]), and one failing longer than the
//!   configured time disables the webhook: its events wait, nothing is skipped, and enabling it
//!   again resumes after `acked_position`.
//!
//! It must never move `acked_position` for a batch the endpoint did not acknowledge, nor let
//! a process whose lease lapsed (another took the tenant over) record anything for it.

use std::time::Duration;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use nudge_domain::TenantId;
use rand::RngExt as _;
use uuid::Uuid;

use crate::audit::{self, Operator};
use crate::crypto::DestinationCipher;
use crate::{Ledger, LedgerError};

/// The most characters a webhook's URL may have (the table's CHECK).
pub const WEBHOOK_URL_MAX: usize = 2_048;

/// The most characters of an error or a reason kept on a webhook (the table's CHECKs).
const TEXT_MAX: usize = 500;

/// A webhook's signing secret in the Standard Webhooks form: `whsec_` and the base64 of 32
/// random bytes (the HMAC-SHA256 key). Shown once, when made; stored sealed.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret(String);

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(<redacted>)")
    }
}

impl WebhookSecret {
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::rng().random();
        Self(format!(
            "whsec_{}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        ))
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

pub(crate) fn secret_aad(tenant_id: Uuid, generation: i32) -> Vec<u8> {
    format!("tenant-webhook-secret:{tenant_id}:{generation}").into_bytes()
}

/// Checks a webhook URL as `nudgectl tenant webhook set` takes it and returns it in its normal
/// form (what is stored): absolute `https` (`http` only when `allow_http`), a host, no user
/// name or password, no fragment, at most [`WEBHOOK_URL_MAX`] characters. Where the host
/// resolves to is decided by `nudge-events` at each request (an address can change after this
/// check).
pub fn check_webhook_url(url: &str, allow_http: bool) -> Result<String, &'static str> {
    if url.chars().count() > WEBHOOK_URL_MAX {
        return Err("the URL is longer than 2048 characters");
    }
    let parsed = url::Url::parse(url).map_err(|_| "not an absolute URL")?;
    match parsed.scheme() {
        "https" => {}
        "http" if allow_http => {}
        "http" => return Err("plain http is refused: use https"),
        _ => return Err("the scheme must be https"),
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err("the URL names no host");
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err("the URL must not carry a user name or password");
    }
    if parsed.fragment().is_some() {
        return Err("the URL must not carry a fragment (#...)");
    }
    let normal = parsed.as_str().to_owned();
    if normal.chars().count() > WEBHOOK_URL_MAX {
        return Err("the URL is longer than 2048 characters");
    }
    Ok(normal)
}

/// `url` without its query (which may carry a token), for the audit log.
fn without_query(url: &str) -> String {
    url.split_once('?')
        .map_or_else(|| url.to_owned(), |(head, _)| format!("{head}?..."))
}

/// A tenant's webhook as an operator sees it (no secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantWebhook {
    pub tenant_id: TenantId,
    pub url: String,
    pub enabled: bool,
    pub acked_position: i64,
    pub pending_through: Option<i64>,
    pub failures: i32,
    pub failing_since: Option<DateTime<Utc>>,
    pub next_attempt_at: DateTime<Utc>,
    pub last_error: Option<String>,
    pub disabled_at: Option<DateTime<Utc>>,
    /// `failing` (nudge-events, after `events.disable_after_s`) or `operator`.
    pub disabled_by: Option<String>,
    pub disabled_reason: Option<String>,
    pub lease_until: Option<DateTime<Utc>>,
    /// The tenant's newest numbered event: `acked_position` short of it is what waits.
    pub newest_position: i64,
    /// Each secret's generation, when it was made and when it stops signing (newest first).
    pub secrets: Vec<(i32, DateTime<Utc>, Option<DateTime<Utc>>)>,
}

/// What [`Ledger::set_tenant_webhook`] did.
#[derive(Debug)]
pub struct WebhookSet {
    /// The tenant had no webhook: this one is new, with its first secret.
    pub created: bool,
    /// The new webhook's secret (shown once); `None` when an existing webhook's URL changed.
    pub secret: Option<WebhookSecret>,
    /// Where the push resumes: after this position.
    pub acked_position: i64,
}

/// A webhook leased to one `nudge-events` task.
#[derive(Debug, Clone)]
pub struct ClaimedWebhook {
    pub tenant_id: TenantId,
    /// This claim's lease (a token made by the claim): every later step names it, so a task
    /// whose lease was taken over records and sends nothing more.
    pub lease: Uuid,
    pub acked_position: i64,
    pub pending_through: Option<i64>,
    pub failures: u32,
}

/// Where and how a batch is sent, as the webhook stands when its lease is renewed.
#[derive(Debug, Clone)]
pub struct WebhookTarget {
    pub url: String,
    /// The secrets that sign now, newest first (two during a rotation's overlap).
    pub secrets: Vec<WebhookSecret>,
}

/// What [`Ledger::webhook_fence`] found.
#[derive(Debug, Clone)]
pub enum Fence {
    /// The lease is held and renewed: send to this target.
    Held(WebhookTarget),
    /// The lease is no longer this task's, or the webhook was disabled: send nothing.
    Lost,
    /// The lease is held but a secret cannot be opened (a key this process lacks, or a
    /// corrupt row): the batch fails with this reason.
    Unopenable(String),
}

/// A failed push, as [`Ledger::webhook_failed`] records it.
#[derive(Debug, Clone)]
pub struct WebhookFailure {
    /// The failed batch's last position: its retry is the same batch.
    pub pending_through: i64,
    /// What went wrong, for `nudgectl tenant webhook show` (an error class and a short
    /// detail; never a response body).
    pub error: String,
    /// How long until the retry.
    pub retry_in: Duration,
    /// A webhook failing for longer than this is disabled.
    pub disable_after: Duration,
}

/// What [`Ledger::webhook_failed`] recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureRecorded {
    /// Recorded; the push is retried at its time.
    Retrying,
    /// Recorded, and the webhook has been failing long enough: disabled.
    Disabled,
    /// Not recorded: this process's lease had lapsed (another may hold the tenant).
    LeaseLost,
}

/// How many webhooks are in each state (the push's gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WebhookCounts {
    pub enabled: u64,
    /// Enabled and failing (a retry is waiting).
    pub failing: u64,
    /// Disabled by nudge-events after failing for `events.disable_after_s`.
    pub disabled: u64,
    /// Disabled by an operator.
    pub disabled_by_operator: u64,
    /// Enabled, with numbered events their endpoint has not acknowledged yet.
    pub behind: u64,
    /// How long ago the oldest of those events happened (its `occurred_at`), over the enabled
    /// webhooks; 0 when none is behind.
    pub oldest_unacknowledged_s: f64,
}

#[derive(sqlx::FromRow)]
struct WebhookRow {
    tenant_id: Uuid,
    url: String,
    enabled: bool,
    acked_position: i64,
    pending_through: Option<i64>,
    failures: i32,
    failing_since: Option<DateTime<Utc>>,
    next_attempt_at: DateTime<Utc>,
    last_error: Option<String>,
    disabled_at: Option<DateTime<Utc>>,
    disabled_by: Option<String>,
    disabled_reason: Option<String>,
    lease_until: Option<DateTime<Utc>>,
    newest_position: i64,
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    tenant_id: Uuid,
    lease_owner: Uuid,
    acked_position: i64,
    pending_through: Option<i64>,
    failures: i32,
}

#[derive(sqlx::FromRow)]
struct FenceRow {
    url: String,
    generations: Vec<i32>,
    ciphertexts: Vec<Vec<u8>>,
    sealed_with: Vec<String>,
}

fn clip(text: &str) -> String {
    text.chars().take(TEXT_MAX).collect()
}

fn interval(d: Duration) -> f64 {
    d.as_secs_f64()
}

async fn add_secret(
    tx: &mut sqlx::PgConnection,
    tenant_id: TenantId,
    generation: i32,
    cipher: &DestinationCipher,
) -> Result<WebhookSecret, LedgerError> {
    let secret = WebhookSecret::generate();
    let (sealed, with) = cipher.seal_tenant_secret(
        secret.expose().as_bytes(),
        &secret_aad(tenant_id.as_uuid(), generation),
    )?;
    sqlx::query(
        "INSERT INTO tenant_webhook_secrets (tenant_id, generation, secret_ciphertext, sealed_with,
                                             created_at)
         VALUES ($1, $2, $3, $4, now())",
    )
    .bind(tenant_id.as_uuid())
    .bind(generation)
    .bind(sealed)
    .bind(with.as_str())
    .execute(&mut *tx)
    .await?;
    Ok(secret)
}

impl Ledger {
    /// Sets the tenant's webhook URL (checked and normalised by [`check_webhook_url`] by the
    /// caller). A new webhook gets its first secret (returned, to be shown once) and starts
    /// after `start_after` (at most the tenant's newest numbered event), or after the newest
    /// when `None`: it is sent what happens from now on. An existing webhook keeps its secrets,
    /// state and where it was (a start position is refused for it); the next batch goes to the
    /// new URL. Audited (never with the secret, the URL without its query) in the same
    /// transaction.
    pub async fn set_tenant_webhook(
        &self,
        tenant_id: TenantId,
        url: &str,
        start_after: Option<i64>,
        cipher: &DestinationCipher,
        by: &Operator,
    ) -> Result<WebhookSet, LedgerError> {
        let mut tx = self.pool.begin().await?;
        crate::intake::lock_tenant(&mut tx, tenant_id).await?;
        let existing: Option<(String, i64)> = sqlx::query_as(
            "SELECT url, acked_position FROM tenant_webhooks WHERE tenant_id = $1 FOR UPDATE",
        )
        .bind(tenant_id.as_uuid())
        .fetch_optional(&mut *tx)
        .await?;
        let newest: i64 = sqlx::query_scalar::<_, Option<i64>>(
            "SELECT max(position) FROM delivery_events
             WHERE tenant_id = $1 AND position IS NOT NULL",
        )
        .bind(tenant_id.as_uuid())
        .fetch_one(&mut *tx)
        .await?
        .unwrap_or(0);
        let set = if let Some((old_url, acked)) = existing {
            if start_after.is_some() {
                return Err(LedgerError::InvalidInput(
                    "the tenant has a webhook already: a start position applies to a new one \
                     only (its push resumes after the last acknowledged batch)",
                ));
            }
            sqlx::query(
                "UPDATE tenant_webhooks SET url = $2, updated_at = now() WHERE tenant_id = $1",
            )
            .bind(tenant_id.as_uuid())
            .bind(url)
            .execute(&mut *tx)
            .await?;
            audit::insert(
                &mut tx,
                &by.entry(
                    "tenant_webhook_set",
                    format!("tenant:{tenant_id}"),
                    serde_json::json!({
                        "url": without_query(url),
                        "previous_url": without_query(&old_url),
                    }),
                ),
            )
            .await?;
            WebhookSet {
                created: false,
                secret: None,
                acked_position: acked,
            }
        } else {
            let start = start_after.unwrap_or(newest).max(0);
            if start > newest {
                return Err(LedgerError::InvalidInput(
                    "the start position is past the tenant's newest event: the events up to it \
                     would never be pushed",
                ));
            }
            sqlx::query(
                "INSERT INTO tenant_webhooks (tenant_id, url, acked_position) VALUES ($1, $2, $3)",
            )
            .bind(tenant_id.as_uuid())
            .bind(url)
            .bind(start)
            .execute(&mut *tx)
            .await?;
            let secret = add_secret(&mut tx, tenant_id, 1, cipher).await?;
            audit::insert(
                &mut tx,
                &by.entry(
                    "tenant_webhook_set",
                    format!("tenant:{tenant_id}"),
                    serde_json::json!({
                        "url": without_query(url),
                        "start_after": start,
                        "generation": 1,
                    }),
                ),
            )
            .await?;
            WebhookSet {
                created: true,
                secret: Some(secret),
                acked_position: start,
            }
        };
        tx.commit().await?;
        Ok(set)
    }

    /// Adds a new signing secret (returned, to be shown once) and lets the older ones sign for
    /// `overlap` more (each request carries a signature by each), so a client can switch
    /// without missing a batch. Secrets whose overlap ended are dropped; at most two sign at
    /// once, so a rotation during another's overlap ends the older one now. Audited.
    pub async fn rotate_webhook_secret(
        &self,
        tenant_id: TenantId,
        overlap: Duration,
        cipher: &DestinationCipher,
        by: &Operator,
    ) -> Result<WebhookSecret, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let newest: Option<Option<i32>> = sqlx::query_scalar(
            "SELECT (SELECT max(generation) FROM tenant_webhook_secrets s
                     WHERE s.tenant_id = w.tenant_id)
             FROM tenant_webhooks w WHERE w.tenant_id = $1 FOR UPDATE",
        )
        .bind(tenant_id.as_uuid())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(newest) = newest else {
            return Err(LedgerError::InvalidInput(
                "the tenant has no webhook: set one first (nudgectl tenant webhook set)",
            ));
        };
        let newest = newest.unwrap_or(0);
        // The newest keeps signing for the overlap; every older one stops now.
        sqlx::query(
            "DELETE FROM tenant_webhook_secrets
             WHERE tenant_id = $1 AND (generation < $2 OR retires_at <= now())",
        )
        .bind(tenant_id.as_uuid())
        .bind(newest)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE tenant_webhook_secrets
             SET retires_at = now() + make_interval(secs => $3)
             WHERE tenant_id = $1 AND generation = $2",
        )
        .bind(tenant_id.as_uuid())
        .bind(newest)
        .bind(interval(overlap))
        .execute(&mut *tx)
        .await?;
        let secret = add_secret(&mut tx, tenant_id, newest + 1, cipher).await?;
        audit::insert(
            &mut tx,
            &by.entry(
                "tenant_webhook_rotate",
                format!("tenant:{tenant_id}"),
                serde_json::json!({
                    "generation": newest + 1,
                    "previous_signs_for_s": overlap.as_secs(),
                }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(secret)
    }

    /// Enables or disables the tenant's webhook; `true` when it changed. Enabling clears the
    /// failures and pushes at once, resuming after `acked_position` (nothing was skipped while
    /// it was off); disabling stops the push before its next batch (a request in flight
    /// finishes), and the events wait. Audited.
    pub async fn set_tenant_webhook_enabled(
        &self,
        tenant_id: TenantId,
        enabled: bool,
        by: &Operator,
    ) -> Result<bool, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let was: Option<bool> = sqlx::query_scalar(
            "SELECT enabled FROM tenant_webhooks WHERE tenant_id = $1 FOR UPDATE",
        )
        .bind(tenant_id.as_uuid())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(was) = was else {
            return Err(LedgerError::InvalidInput(
                "the tenant has no webhook: set one first (nudgectl tenant webhook set)",
            ));
        };
        if was == enabled {
            tx.commit().await?;
            return Ok(false);
        }
        if enabled {
            sqlx::query(
                "UPDATE tenant_webhooks
                 SET enabled = true, disabled_at = NULL, disabled_by = NULL,
                     disabled_reason = NULL, failures = 0,
                     failing_since = NULL, next_attempt_at = now(), updated_at = now()
                 WHERE tenant_id = $1",
            )
            .bind(tenant_id.as_uuid())
            .execute(&mut *tx)
            .await?;
        } else {
            sqlx::query(
                "UPDATE tenant_webhooks
                 SET enabled = false, disabled_at = now(), disabled_by = 'operator',
                     disabled_reason = $2, updated_at = now()
                 WHERE tenant_id = $1",
            )
            .bind(tenant_id.as_uuid())
            .bind(clip(&format!("disabled by {}", by.actor())))
            .execute(&mut *tx)
            .await?;
        }
        audit::insert(
            &mut tx,
            &by.entry(
                if enabled {
                    "tenant_webhook_enable"
                } else {
                    "tenant_webhook_disable"
                },
                format!("tenant:{tenant_id}"),
                serde_json::json!({}),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The tenant's webhook, or `None` when it has none.
    pub async fn tenant_webhook(
        &self,
        tenant_id: TenantId,
    ) -> Result<Option<TenantWebhook>, LedgerError> {
        let row: Option<WebhookRow> = sqlx::query_as(
            "SELECT tenant_id, url, enabled, acked_position, pending_through, failures,
                    failing_since, next_attempt_at, last_error, disabled_at, disabled_by,
                    disabled_reason, lease_until,
                    COALESCE((SELECT max(position) FROM delivery_events e
                              WHERE e.tenant_id = w.tenant_id AND e.position IS NOT NULL), 0)
                        AS newest_position
             FROM tenant_webhooks w WHERE tenant_id = $1",
        )
        .bind(tenant_id.as_uuid())
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let secrets: Vec<(i32, DateTime<Utc>, Option<DateTime<Utc>>)> = sqlx::query_as(
            "SELECT generation, created_at, retires_at FROM tenant_webhook_secrets
             WHERE tenant_id = $1 AND (retires_at IS NULL OR retires_at > now())
             ORDER BY generation DESC",
        )
        .bind(tenant_id.as_uuid())
        .fetch_all(&self.pool)
        .await?;
        Ok(Some(TenantWebhook {
            tenant_id: TenantId::from_uuid(row.tenant_id),
            url: row.url,
            enabled: row.enabled,
            acked_position: row.acked_position,
            pending_through: row.pending_through,
            failures: row.failures,
            failing_since: row.failing_since,
            next_attempt_at: row.next_attempt_at,
            last_error: row.last_error,
            disabled_at: row.disabled_at,
            disabled_by: row.disabled_by,
            disabled_reason: row.disabled_reason,
            lease_until: row.lease_until,
            newest_position: row.newest_position,
            secrets,
        }))
    }

    /// Leases up to `limit` enabled webhooks that are due (their retry's time came), have
    /// numbered events past `acked_position` and are not in `busy` (the tenants this process
    /// pushes already), each for `lease` under a token of its own. Webhooks another task holds
    /// (an unexpired lease) are passed over; the least recently served go first.
    pub async fn claim_webhooks(
        &self,
        lease: Duration,
        limit: u32,
        busy: &[TenantId],
    ) -> Result<Vec<ClaimedWebhook>, LedgerError> {
        let busy: Vec<Uuid> = busy.iter().map(|t| t.as_uuid()).collect();
        let rows: Vec<ClaimRow> = sqlx::query_as(
            "WITH due AS (
                 SELECT w.tenant_id FROM tenant_webhooks w
                 WHERE w.enabled AND w.next_attempt_at <= now()
                   AND (w.lease_until IS NULL OR w.lease_until < now())
                   AND NOT (w.tenant_id = ANY($3))
                   AND EXISTS (SELECT 1 FROM delivery_events e
                               WHERE e.tenant_id = w.tenant_id
                                 AND e.position > w.acked_position)
                 ORDER BY w.next_attempt_at
                 LIMIT $2
                 FOR UPDATE SKIP LOCKED
             )
             UPDATE tenant_webhooks w
             SET lease_owner = gen_random_uuid(),
                 lease_until = now() + make_interval(secs => $1)
             FROM due WHERE w.tenant_id = due.tenant_id
             RETURNING w.tenant_id, w.lease_owner, w.acked_position, w.pending_through,
                       w.failures",
        )
        .bind(interval(lease))
        .bind(i64::from(limit.max(1)))
        .bind(&busy)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|row| ClaimedWebhook {
                tenant_id: TenantId::from_uuid(row.tenant_id),
                lease: row.lease_owner,
                acked_position: row.acked_position,
                pending_through: row.pending_through,
                failures: u32::try_from(row.failures).unwrap_or(0),
            })
            .collect())
    }

    /// Renews the lease `lease_token` for `lease` just before a batch is sent, and reads the
    /// webhook as it stands now: its URL and the secrets that sign now, opened. A task sends
    /// only after [`Fence::Held`]: a disabled webhook, a changed URL or a rotated secret takes
    /// effect at the next batch, and a task whose lease was taken over sends nothing more.
    pub async fn webhook_fence(
        &self,
        tenant_id: TenantId,
        lease_token: Uuid,
        lease: Duration,
        cipher: &DestinationCipher,
    ) -> Result<Fence, LedgerError> {
        let row: Option<FenceRow> = sqlx::query_as(
            "UPDATE tenant_webhooks w
             SET lease_until = now() + make_interval(secs => $3)
             WHERE tenant_id = $1 AND lease_owner = $2 AND lease_until >= now() AND enabled
             RETURNING w.url,
                 ARRAY(SELECT generation FROM tenant_webhook_secrets s
                       WHERE s.tenant_id = w.tenant_id
                         AND (s.retires_at IS NULL OR s.retires_at > now())
                       ORDER BY generation DESC) AS generations,
                 ARRAY(SELECT secret_ciphertext FROM tenant_webhook_secrets s
                       WHERE s.tenant_id = w.tenant_id
                         AND (s.retires_at IS NULL OR s.retires_at > now())
                       ORDER BY generation DESC) AS ciphertexts,
                 ARRAY(SELECT sealed_with FROM tenant_webhook_secrets s
                       WHERE s.tenant_id = w.tenant_id
                         AND (s.retires_at IS NULL OR s.retires_at > now())
                       ORDER BY generation DESC) AS sealed_with",
        )
        .bind(tenant_id.as_uuid())
        .bind(lease_token)
        .bind(interval(lease))
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(Fence::Lost);
        };
        let secrets = match cipher.open_tenant_secrets(
            "tenant_webhook_secrets",
            &row.generations,
            &row.ciphertexts,
            &row.sealed_with,
            |generation| secret_aad(tenant_id.as_uuid(), generation),
        ) {
            Ok(texts) => texts.into_iter().map(WebhookSecret).collect::<Vec<_>>(),
            Err(e) => {
                return Ok(Fence::Unopenable(format!(
                    "a signing secret cannot be opened: {e}"
                )));
            }
        };
        if secrets.is_empty() {
            return Ok(Fence::Unopenable(
                "the webhook has no secret that signs now".into(),
            ));
        }
        Ok(Fence::Held(WebhookTarget {
            url: row.url,
            secrets,
        }))
    }

    /// Records that the endpoint acknowledged (2xx) the batch through position `through`:
    /// the push resumes after it and the failures are cleared. `false` (nothing recorded)
    /// when the lease `lease_token` is no longer held.
    pub async fn webhook_acknowledged(
        &self,
        tenant_id: TenantId,
        lease_token: Uuid,
        through: i64,
    ) -> Result<bool, LedgerError> {
        let done = sqlx::query(
            "UPDATE tenant_webhooks
             SET acked_position = GREATEST(acked_position, $3), pending_through = NULL,
                 failures = 0, failing_since = NULL, last_error = NULL, updated_at = now()
             WHERE tenant_id = $1 AND lease_owner = $2 AND lease_until >= now()",
        )
        .bind(tenant_id.as_uuid())
        .bind(lease_token)
        .bind(through)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(done == 1)
    }

    /// Records a failed push and releases the lease: the batch through
    /// `failure.pending_through` is retried as it is after `failure.retry_in`; a webhook failing
    /// since longer ago than `failure.disable_after` is disabled instead (its events wait).
    pub async fn webhook_failed(
        &self,
        tenant_id: TenantId,
        lease_token: Uuid,
        failure: &WebhookFailure,
    ) -> Result<FailureRecorded, LedgerError> {
        let row: Option<bool> = sqlx::query_scalar(
            "WITH decided AS (
                 SELECT tenant_id,
                        COALESCE(failing_since, now()) AS since,
                        COALESCE(failing_since, now()) > now() - make_interval(secs => $6)
                            AS keep
                 FROM tenant_webhooks
                 WHERE tenant_id = $1 AND lease_owner = $2 AND lease_until >= now() AND enabled
                 FOR UPDATE
             )
             UPDATE tenant_webhooks w
             SET failures = w.failures + 1,
                 failing_since = d.since,
                 pending_through = $3,
                 last_error = $4,
                 next_attempt_at = now() + make_interval(secs => $5),
                 enabled = d.keep,
                 disabled_at = CASE WHEN d.keep THEN NULL ELSE now() END,
                 disabled_by = CASE WHEN d.keep THEN NULL ELSE 'failing' END,
                 disabled_reason = CASE WHEN d.keep THEN NULL
                     ELSE 'failing since '
                          || to_char(d.since AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')
                          || ': ' || left($4, 400) END,
                 lease_owner = NULL, lease_until = NULL, updated_at = now()
             FROM decided d WHERE w.tenant_id = d.tenant_id
             RETURNING w.enabled",
        )
        .bind(tenant_id.as_uuid())
        .bind(lease_token)
        .bind(failure.pending_through)
        .bind(clip(&failure.error))
        .bind(interval(failure.retry_in))
        .bind(interval(failure.disable_after))
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row {
            None => FailureRecorded::LeaseLost,
            Some(true) => FailureRecorded::Retrying,
            Some(false) => FailureRecorded::Disabled,
        })
    }

    /// Gives the lease back (nothing left to push for now, the task's turn is over, or the
    /// process stops); the webhook goes behind the others waiting to be claimed.
    pub async fn release_webhook(
        &self,
        tenant_id: TenantId,
        lease_token: Uuid,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "UPDATE tenant_webhooks
             SET lease_owner = NULL, lease_until = NULL,
                 next_attempt_at = GREATEST(next_attempt_at, now())
             WHERE tenant_id = $1 AND lease_owner = $2",
        )
        .bind(tenant_id.as_uuid())
        .bind(lease_token)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// How many webhooks are enabled, failing, and disabled (by failing, by an operator), and
    /// how far behind the enabled ones are: one probe of the `(tenant_id, position)` index per
    /// webhook, for its first event past what its endpoint acknowledged.
    pub async fn webhook_counts(&self) -> Result<WebhookCounts, LedgerError> {
        let (enabled, failing, disabled, by_operator, behind, oldest): (
            i64,
            i64,
            i64,
            i64,
            i64,
            f64,
        ) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE w.enabled),
                    count(*) FILTER (WHERE w.enabled AND w.failures > 0),
                    count(*) FILTER (WHERE w.disabled_by = 'failing'),
                    count(*) FILTER (WHERE w.disabled_by = 'operator'),
                    count(b.occurred_at) FILTER (WHERE w.enabled),
                    COALESCE(EXTRACT(EPOCH FROM now() - min(b.occurred_at)
                                                  FILTER (WHERE w.enabled)), 0)::float8
             FROM tenant_webhooks w
             LEFT JOIN LATERAL (
                 SELECT e.occurred_at FROM delivery_events e
                 WHERE e.tenant_id = w.tenant_id AND e.position > w.acked_position
                 ORDER BY e.position LIMIT 1) b ON true",
        )
        .fetch_one(&self.pool)
        .await?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(WebhookCounts {
            enabled: n(enabled),
            failing: n(failing),
            disabled: n(disabled),
            disabled_by_operator: n(by_operator),
            behind: n(behind),
            oldest_unacknowledged_s: oldest.max(0.0),
        })
    }
}
