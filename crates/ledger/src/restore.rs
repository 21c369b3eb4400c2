//! A ledger restored from a backup: detected from the database's own identity, refused to the
//! binaries that send until an operator reconciles it (docs/decisions/0017-restored-ledger.md).
//!
//! Detection is `nudge_ledger_observe()` (migration 20261210000101): the server's system
//! identifier, timeline and database OID against the recorded ones, and the recorded heartbeat's
//! age when they differ. Every observation that finds the recorded identity stamps the
//! heartbeat; a restored ledger stays restored, whoever observes it, until
//! [`Ledger::reconcile_restore`] holds what could have been sent after the backup and records
//! the identity found.
//!
//! It must never: clear a restore from a binary's role (only the owner reconciles); hold a
//! delivery the lost history could not have sent (work not yet due, settled or new since the
//! restore); settle a held delivery on anything but a provider's own record of the send.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use nudge_domain::restore::{HOLD_ALWAYS, HOLD_ONCE_DUE};
use nudge_domain::{Channel, IdempotencyKey, RESTORED_REASON, ReminderId};
use serde::Serialize;
use sqlx::{PgConnection, Row};

use crate::audit::{self, Operator};
use crate::{Ledger, LedgerError};

/// What one observation of the server's identity decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IdentityVerdict {
    /// Nothing was recorded: the identity seen is the ledger's from now on.
    FirstStart,
    /// The recorded identity.
    Same,
    /// A new timeline or cluster whose heartbeat was fresh: a promoted replica, adopted.
    Failover,
    /// Restored from a backup and not reconciled: nothing may be sent.
    Restored,
    /// The server is a standby in recovery: nothing was decided.
    InRecovery,
}

impl IdentityVerdict {
    fn parse(s: &str) -> Result<Self, LedgerError> {
        Ok(match s {
            "first_start" => Self::FirstStart,
            "same" => Self::Same,
            "failover" => Self::Failover,
            "restored" => Self::Restored,
            "in_recovery" => Self::InRecovery,
            other => return Err(LedgerError::corrupt("ledger_identity", other)),
        })
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::FirstStart => "first_start",
            Self::Same => "same",
            Self::Failover => "failover",
            Self::Restored => "restored",
            Self::InRecovery => "in_recovery",
        }
    }
}

/// One observation: the verdict, why, the heartbeat it left (the restored copy's when
/// restored) and when the restore was found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IdentityObservation {
    pub verdict: IdentityVerdict,
    pub reason: String,
    pub heartbeat_at: Option<DateTime<Utc>>,
    pub restored_at: Option<DateTime<Utc>>,
}

/// Why a binary that sends or publishes may not start on this ledger.
#[derive(Debug, thiserror::Error)]
pub enum SendingRefused {
    #[error(
        "the ledger was restored from a backup and is not reconciled ({reason}): whatever was \
         sent after the backup would be sent again. See `nudgectl restore status`, then \
         `nudgectl restore reconcile --since T --reason ...` (docs/OPERATIONS.md, \"Restoring \
         the ledger from a backup\")"
    )]
    Restored { reason: String },
    #[error("the database is a standby in recovery: database.url must reach the primary")]
    InRecovery,
    #[error("failed to check whether the ledger was restored")]
    Ledger(#[source] LedgerError),
}

/// An identity as PostgreSQL reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ServerIdentity {
    pub system_identifier: i64,
    pub timeline_id: i64,
    pub database_oid: u32,
}

/// The recorded identity and what is known of a restore.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RestoreStatus {
    /// What observing now decided (it records a first start or an adopted failover).
    pub observed: IdentityObservation,
    /// The identity recorded (before a reconciliation: the backup's).
    pub recorded: Option<RecordedIdentity>,
    /// What the server reports now; `None` on a standby.
    pub server: Option<ServerIdentity>,
    /// The latest identity events, newest first.
    pub events: Vec<IdentityEvent>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecordedIdentity {
    pub identity: ServerIdentity,
    pub recorded_at: DateTime<Utc>,
    pub heartbeat_at: DateTime<Utc>,
    pub failover_max_gap_s: f64,
    pub restored_at: Option<DateTime<Utc>>,
    pub restored_reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IdentityEvent {
    pub at: DateTime<Utc>,
    pub event: String,
    pub heartbeat_age_ms: Option<i64>,
    pub detail: String,
}

/// A send the provider's own records show (an export of its message log): the delivery's
/// idempotency key, and the provider's message id when the export has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfirmedSend {
    pub idempotency_key: IdempotencyKey,
    pub provider_message_id: Option<String>,
}

/// Deliveries counted by channel, tenant and state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RestoreCount {
    pub channel: Channel,
    pub tenant: String,
    pub state: String,
    pub count: i64,
}

/// What a reconciliation did (or, as a dry run, would do: the same statements, rolled back).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RestoreReconciliation {
    pub executed: bool,
    pub now: DateTime<Utc>,
    pub since: DateTime<Utc>,
    /// Whether the ledger was marked restored when the reconciliation began.
    pub was_restored: bool,
    pub restored_reason: Option<String>,
    /// Deliveries missing at the backup for reminders that were due: created held.
    pub materialised_held: i64,
    /// Held `ambiguous` by their state at the backup (`state` is that state).
    pub held: Vec<RestoreCount>,
    /// Held deliveries settled by a receipt recorded since the restore.
    pub settled_by_receipt: i64,
    /// Held deliveries settled `delivered` by the provider's records given.
    pub settled_by_provider_records: i64,
    /// Lines of the provider's records that named no held delivery.
    pub provider_records_unmatched: i64,
    /// Redrives that could have fed more dead letters: paused.
    pub redrives_paused: Vec<i64>,
    /// Still held for review after this, by channel and tenant (`state` is `ambiguous`).
    pub for_review: Vec<RestoreCount>,
    /// Reminders created after `since` that existed before the restore was found: left alone
    /// (new posts), unless `since` is earlier than the backup's point.
    pub reminders_after_since: i64,
    /// The identity recorded by the reconciliation.
    pub identity: ServerIdentity,
}

impl RestoreReconciliation {
    pub fn held_total(&self) -> i64 {
        self.held.iter().map(|c| c.count).sum::<i64>()
    }

    pub fn review_total(&self) -> i64 {
        self.for_review.iter().map(|c| c.count).sum()
    }
}

impl Ledger {
    /// Observes the server's identity (`nudge_ledger_observe()`): decides, records what it
    /// decided, and stamps the heartbeat unless the ledger is restored.
    pub async fn observe_identity(&self) -> Result<IdentityObservation, LedgerError> {
        let mut conn = self.pool.acquire().await?;
        observe(&mut conn).await
    }

    /// The start-up check of a binary that sends or publishes owed work: refused while the
    /// ledger is restored and not reconciled, or when the server is a standby.
    pub async fn ensure_not_restored(&self) -> Result<IdentityObservation, SendingRefused> {
        let observed = self
            .observe_identity()
            .await
            .map_err(SendingRefused::Ledger)?;
        match observed.verdict {
            IdentityVerdict::Restored => Err(SendingRefused::Restored {
                reason: observed.reason,
            }),
            IdentityVerdict::InRecovery => Err(SendingRefused::InRecovery),
            _ => Ok(observed),
        }
    }

    /// Whether the ledger is restored, why, and the identities recorded and seen.
    pub async fn restore_status(&self) -> Result<RestoreStatus, LedgerError> {
        let mut conn = self.pool.acquire().await?;
        let observed = observe(&mut conn).await?;
        let server = if observed.verdict == IdentityVerdict::InRecovery {
            None
        } else {
            Some(server_identity(&mut conn).await?)
        };
        let recorded = recorded_identity(&mut conn, false).await?;
        let events = sqlx::query(
            "SELECT at, event, heartbeat_age_ms, detail FROM ledger_identity_events
             ORDER BY id DESC LIMIT 10",
        )
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|row| {
            Ok(IdentityEvent {
                at: row.try_get("at")?,
                event: row.try_get("event")?,
                heartbeat_age_ms: row.try_get("heartbeat_age_ms")?,
                detail: row.try_get("detail")?,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
        Ok(RestoreStatus {
            observed,
            recorded,
            server,
            events,
        })
    }

    /// Reconciles a restored ledger with what may have happened after the backup's point
    /// `since` (the database's clock), in one transaction with its audit row:
    ///
    /// 1. every reminder created by `since` that was due before now and has no delivery on
    ///    one of its channels gets that delivery, held (the lost history may have
    ///    materialised and sent it; the orphan watchdog would send it again);
    /// 2. every delivery of a reminder created by `since` that the lost history could have
    ///    sent (`nudge_domain::after_restore`: leased, queued, or waiting for a time that has
    ///    come) is held `ambiguous` with reason `restored`;
    /// 3. held deliveries a receipt recorded since the restore speaks for are settled by it,
    ///    and those `confirmed` names (the provider's records) are settled `delivered`;
    /// 4. redrives that could feed more are paused;
    /// 5. the server's identity is recorded and the restore cleared: the workers may start.
    ///
    /// `execute = false` runs the same statements and rolls back: the dry run's counts are
    /// the execute's at that instant. Refused when `since` is before the restored copy's own
    /// heartbeat (the backup was taken after it: what was written between would be missed).
    pub async fn reconcile_restore(
        &self,
        since: DateTime<Utc>,
        confirmed: &[ConfirmedSend],
        operator: &Operator,
        execute: bool,
    ) -> Result<RestoreReconciliation, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let observed = observe(&mut tx).await?;
        if observed.verdict == IdentityVerdict::InRecovery {
            return Err(LedgerError::InvalidInput(
                "the server is a standby in recovery: reconcile on the primary",
            ));
        }
        let recorded = recorded_identity(&mut tx, true)
            .await?
            .ok_or(LedgerError::InvalidInput("no ledger identity is recorded"))?;
        let was_restored = recorded.restored_at.is_some();
        if was_restored && since < recorded.heartbeat_at {
            return Err(LedgerError::InvalidInput(
                "--since is before the restored copy's last heartbeat: the backup was taken \
                 after it (see `nudgectl restore status`); give a time at or after it",
            ));
        }
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&mut *tx)
            .await?;
        if since > now {
            return Err(LedgerError::InvalidInput("--since is in the future"));
        }
        let reason = format!(
            "{RESTORED_REASON}: could have been sent after {} (the backup's point)",
            since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        );

        let materialised_held = hold_missing(&mut tx, since, now, &reason).await?;
        let held = hold_owed(&mut tx, since, now, &reason).await?;
        let settled_by_receipt = settle_by_receipts(&mut tx, now).await?;
        let (settled_by_provider_records, provider_records_unmatched) =
            settle_confirmed(&mut tx, confirmed, now).await?;
        let redrives_paused: Vec<i64> = sqlx::query_scalar(
            "UPDATE redrives SET state = 'paused', pause_reason = $1, updated_at = $2
             WHERE state = 'running' OR (state = 'paused' AND pause_reason LIKE 'new_work_waiting%')
             RETURNING id",
        )
        .bind(format!(
            "{RESTORED_REASON}: the ledger was restored; resume once its dead letters are reviewed"
        ))
        .bind(now)
        .fetch_all(&mut *tx)
        .await?;
        let for_review = counts(
            &mut tx,
            "SELECT d.channel, t.name AS tenant, d.state, count(*) AS count
             FROM deliveries d JOIN tenants t ON t.id = d.tenant_id
             WHERE d.state = 'ambiguous' AND d.last_error_reason LIKE $1
             GROUP BY d.channel, t.name, d.state ORDER BY d.channel, t.name",
            &format!("{RESTORED_REASON}:%"),
        )
        .await?;
        let reminders_after_since: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM reminders WHERE created_at > $1 AND created_at <= $2",
        )
        .bind(since)
        .bind(recorded.restored_at.unwrap_or(now))
        .fetch_one(&mut *tx)
        .await?;

        let identity = server_identity(&mut tx).await?;
        sqlx::query(
            "UPDATE ledger_identity
             SET system_identifier = $1, timeline_id = $2, database_oid = $3, recorded_at = $4,
                 heartbeat_at = $4, restored_at = NULL, restored_reason = NULL,
                 found_system_identifier = NULL, found_timeline_id = NULL,
                 found_database_oid = NULL",
        )
        .bind(identity.system_identifier)
        .bind(identity.timeline_id)
        .bind(sqlx::postgres::types::Oid(identity.database_oid))
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let mut report = RestoreReconciliation {
            executed: execute,
            now,
            since,
            was_restored,
            restored_reason: recorded.restored_reason.clone(),
            materialised_held,
            held,
            settled_by_receipt,
            settled_by_provider_records,
            provider_records_unmatched,
            redrives_paused,
            for_review,
            reminders_after_since,
            identity,
        };
        sqlx::query(
            "INSERT INTO ledger_identity_events (at, event, system_identifier, timeline_id,
                 database_oid, previous_system_identifier, previous_timeline_id,
                 previous_database_oid, detail)
             VALUES ($1, 'reconciled', $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(now)
        .bind(identity.system_identifier)
        .bind(identity.timeline_id)
        .bind(sqlx::postgres::types::Oid(identity.database_oid))
        .bind(recorded.identity.system_identifier)
        .bind(recorded.identity.timeline_id)
        .bind(sqlx::postgres::types::Oid(recorded.identity.database_oid))
        .bind(format!(
            "reconciled by {} since {}: {} held, {} settled, {} for review",
            operator.actor(),
            since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            report.held_total() + report.materialised_held,
            report.settled_by_receipt + report.settled_by_provider_records,
            report.review_total()
        ))
        .execute(&mut *tx)
        .await?;
        let details = serde_json::to_value(&report)
            .map_err(|e| LedgerError::corrupt("audit_log", e.to_string()))?;
        let entry = operator.entry("restore_reconcile", "ledger".to_owned(), details);
        audit::insert(&mut tx, &entry).await?;
        if execute {
            tx.commit().await?;
        } else {
            tx.rollback().await?;
            report.executed = false;
        }
        Ok(report)
    }
}

async fn observe(conn: &mut PgConnection) -> Result<IdentityObservation, LedgerError> {
    let row = sqlx::query(
        "SELECT verdict, reason, heartbeat_at, restored_at FROM nudge_ledger_observe()",
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(IdentityObservation {
        verdict: IdentityVerdict::parse(row.try_get::<&str, _>("verdict")?)?,
        reason: row.try_get("reason")?,
        heartbeat_at: row.try_get("heartbeat_at")?,
        restored_at: row.try_get("restored_at")?,
    })
}

async fn server_identity(conn: &mut PgConnection) -> Result<ServerIdentity, LedgerError> {
    let row = sqlx::query(
        "SELECT (SELECT system_identifier FROM pg_control_system()) AS sysid,
                ('x' || lpad(substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8), 16, '0'))
                    ::bit(64)::bigint AS tli,
                (SELECT oid FROM pg_database WHERE datname = current_database()) AS db",
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(ServerIdentity {
        system_identifier: row.try_get("sysid")?,
        timeline_id: row.try_get("tli")?,
        database_oid: row.try_get::<sqlx::postgres::types::Oid, _>("db")?.0,
    })
}

async fn recorded_identity(
    conn: &mut PgConnection,
    lock: bool,
) -> Result<Option<RecordedIdentity>, LedgerError> {
    let sql = if lock {
        "SELECT system_identifier, timeline_id, database_oid, recorded_at, heartbeat_at,
                EXTRACT(EPOCH FROM failover_max_gap)::float8 AS gap, restored_at,
                restored_reason
         FROM ledger_identity FOR UPDATE"
    } else {
        "SELECT system_identifier, timeline_id, database_oid, recorded_at, heartbeat_at,
                EXTRACT(EPOCH FROM failover_max_gap)::float8 AS gap, restored_at,
                restored_reason
         FROM ledger_identity"
    };
    let Some(row) = sqlx::query(sql).fetch_optional(&mut *conn).await? else {
        return Ok(None);
    };
    Ok(Some(RecordedIdentity {
        identity: ServerIdentity {
            system_identifier: row.try_get("system_identifier")?,
            timeline_id: row.try_get("timeline_id")?,
            database_oid: row
                .try_get::<sqlx::postgres::types::Oid, _>("database_oid")?
                .0,
        },
        recorded_at: row.try_get("recorded_at")?,
        heartbeat_at: row.try_get("heartbeat_at")?,
        failover_max_gap_s: row.try_get("gap")?,
        restored_at: row.try_get("restored_at")?,
        restored_reason: row.try_get("restored_reason")?,
    }))
}

fn state_names<const N: usize>(states: [nudge_domain::DeliveryState; N]) -> Vec<&'static str> {
    states.iter().map(|s| s.as_str()).collect()
}

/// Step 1: the deliveries the lost history may have materialised and sent, created held.
async fn hold_missing(
    conn: &mut PgConnection,
    since: DateTime<Utc>,
    now: DateTime<Utc>,
    reason: &str,
) -> Result<i64, LedgerError> {
    let missing = sqlx::query(
        "SELECT r.id, r.tenant_id, c.channel, r.scheduled_at, r.expires_at
         FROM reminders r CROSS JOIN LATERAL unnest(r.channels) AS c(channel)
         WHERE r.created_at <= $1 AND r.cancelled_at IS NULL AND r.scheduled_at <= $2
           AND NOT EXISTS (SELECT 1 FROM deliveries d
                           WHERE d.reminder_id = r.id AND d.channel = c.channel)",
    )
    .bind(since)
    .bind(now)
    .fetch_all(&mut *conn)
    .await?;
    if missing.is_empty() {
        return Ok(0);
    }
    let (mut ids, mut reminders, mut tenants, mut channels, mut keys, mut scheduled, mut expires) =
        (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
    for row in &missing {
        let reminder: uuid::Uuid = row.try_get("id")?;
        let channel: String = row.try_get("channel")?;
        let parsed: Channel = channel
            .parse()
            .map_err(|e| LedgerError::corrupt("reminders", e))?;
        ids.push(uuid::Uuid::new_v4());
        keys.push(
            IdempotencyKey::for_delivery(ReminderId::from_uuid(reminder), parsed)
                .as_str()
                .to_owned(),
        );
        reminders.push(reminder);
        tenants.push(row.try_get::<uuid::Uuid, _>("tenant_id")?);
        channels.push(channel);
        scheduled.push(row.try_get::<DateTime<Utc>, _>("scheduled_at")?);
        expires.push(row.try_get::<DateTime<Utc>, _>("expires_at")?);
    }
    let created = sqlx::query(
        "INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
                                 scheduled_at, expires_at, next_attempt_at, created_at,
                                 updated_at, settled_at, owner, last_error_class,
                                 last_error_reason)
         SELECT d.id, d.reminder_id, d.tenant_id, d.channel, 'ambiguous', d.key,
                d.scheduled_at, d.expires_at, d.scheduled_at, $8, $8, $8, cc.owner,
                'ambiguous', $9 || ' (no delivery at the backup)'
         FROM UNNEST($1::uuid[], $2::uuid[], $3::uuid[], $4::text[], $5::text[],
                     $6::timestamptz[], $7::timestamptz[])
              AS d(id, reminder_id, tenant_id, channel, key, scheduled_at, expires_at)
         JOIN channel_controls cc ON cc.channel = d.channel
         ON CONFLICT (reminder_id, channel) DO NOTHING",
    )
    .bind(&ids)
    .bind(&reminders)
    .bind(&tenants)
    .bind(&channels)
    .bind(&keys)
    .bind(&scheduled)
    .bind(&expires)
    .bind(now)
    .bind(reason)
    .execute(&mut *conn)
    .await?;
    Ok(i64::try_from(created.rows_affected()).unwrap_or(i64::MAX))
}

/// Step 2: what the lost history could have sent, held `ambiguous`, counted by the state it
/// had.
async fn hold_owed(
    conn: &mut PgConnection,
    since: DateTime<Utc>,
    now: DateTime<Utc>,
    reason: &str,
) -> Result<Vec<RestoreCount>, LedgerError> {
    let rows = sqlx::query(
        "WITH candidates AS (
             SELECT d.id, d.state AS was FROM deliveries d JOIN reminders r ON r.id = d.reminder_id
             WHERE r.created_at <= $1
               AND (d.state = ANY($3::text[])
                    OR (d.state = ANY($4::text[]) AND d.next_attempt_at <= $2))
             FOR UPDATE OF d),
         held AS (
             UPDATE deliveries d
             SET state = 'ambiguous', settled_at = $2, updated_at = $2, lease_owner = NULL,
                 lease_expires_at = NULL, send_started_at = NULL, last_error_class = 'ambiguous',
                 last_error_reason = $5 || ' (was ' || c.was || ')'
             FROM candidates c WHERE d.id = c.id
             RETURNING d.channel, d.tenant_id, c.was)
         SELECT h.channel, t.name AS tenant, h.was AS state, count(*) AS count
         FROM held h JOIN tenants t ON t.id = h.tenant_id
         GROUP BY h.channel, t.name, h.was ORDER BY h.channel, t.name, h.was",
    )
    .bind(since)
    .bind(now)
    .bind(state_names(HOLD_ALWAYS))
    .bind(state_names(HOLD_ONCE_DUE))
    .bind(reason)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(count_row).collect()
}

/// Step 3a: receipts recorded since the restore (the intake kept taking them) that name a
/// held delivery settle it as a receipt settles any ambiguous delivery.
async fn settle_by_receipts(
    conn: &mut PgConnection,
    now: DateTime<Utc>,
) -> Result<i64, LedgerError> {
    let settled = sqlx::query(
        "WITH receipt AS (
             SELECT DISTINCT ON (e.delivery_id) e.id, e.delivery_id, e.outcome, e.status, e.code,
                    e.provider_message_id
             FROM provider_events e JOIN deliveries d ON d.id = e.delivery_id
             WHERE d.state = 'ambiguous' AND d.last_error_reason LIKE $2
               AND e.outcome IN ('delivered', 'failed')
             ORDER BY e.delivery_id, e.outcome = 'delivered' DESC, e.id),
         marked AS (
             UPDATE provider_events e SET settled = true FROM receipt r WHERE e.id = r.id)
         UPDATE deliveries d
         SET state = CASE WHEN r.outcome = 'delivered' THEN 'delivered' ELSE 'dead_lettered' END,
             last_error_class = CASE WHEN r.outcome = 'delivered' THEN NULL ELSE 'terminal' END,
             last_error_reason = 'receipt: ' || r.status || COALESCE(': ' || r.code, ''),
             provider_message_id = COALESCE(d.provider_message_id, r.provider_message_id),
             settled_at = $1, updated_at = $1
         FROM receipt r WHERE d.id = r.delivery_id",
    )
    .bind(now)
    .bind(format!("{RESTORED_REASON}:%"))
    .execute(&mut *conn)
    .await?;
    Ok(i64::try_from(settled.rows_affected()).unwrap_or(i64::MAX))
}

/// Step 3b: the provider's records of its sends settle the held deliveries they name.
async fn settle_confirmed(
    conn: &mut PgConnection,
    confirmed: &[ConfirmedSend],
    now: DateTime<Utc>,
) -> Result<(i64, i64), LedgerError> {
    if confirmed.is_empty() {
        return Ok((0, 0));
    }
    let mut by_key: BTreeMap<&str, Option<&str>> = BTreeMap::new();
    for c in confirmed {
        let id = c.provider_message_id.as_deref();
        let slot = by_key.entry(c.idempotency_key.as_str()).or_insert(id);
        if slot.is_none() {
            *slot = id;
        }
    }
    let keys: Vec<&str> = by_key.keys().copied().collect();
    let ids: Vec<Option<&str>> = by_key.values().copied().collect();
    let settled = sqlx::query(
        "UPDATE deliveries d
         SET state = 'delivered', last_error_class = NULL,
             last_error_reason = 'restored: sent, by the provider''s records',
             provider_message_id = COALESCE(c.message_id, d.provider_message_id),
             settled_at = $3, updated_at = $3
         FROM UNNEST($1::text[], $2::text[]) AS c(key, message_id)
         WHERE d.idempotency_key = c.key AND d.state = 'ambiguous'
           AND d.last_error_reason LIKE $4",
    )
    .bind(&keys)
    .bind(&ids)
    .bind(now)
    .bind(format!("{RESTORED_REASON}:%"))
    .execute(&mut *conn)
    .await?;
    let settled = i64::try_from(settled.rows_affected()).unwrap_or(i64::MAX);
    let distinct = i64::try_from(keys.len()).unwrap_or(i64::MAX);
    Ok((settled, distinct - settled))
}

async fn counts(
    conn: &mut PgConnection,
    sql: &'static str,
    bind: &str,
) -> Result<Vec<RestoreCount>, LedgerError> {
    let rows = sqlx::query(sql).bind(bind).fetch_all(&mut *conn).await?;
    rows.iter().map(count_row).collect()
}

fn count_row(row: &sqlx::postgres::PgRow) -> Result<RestoreCount, LedgerError> {
    Ok(RestoreCount {
        channel: row
            .try_get::<&str, _>("channel")?
            .parse()
            .map_err(|e| LedgerError::corrupt("deliveries", e))?,
        tenant: row.try_get("tenant")?,
        state: row.try_get("state")?,
        count: row.try_get("count")?,
    })
}
