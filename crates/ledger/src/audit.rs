use chrono::{DateTime, Utc};

use crate::{Ledger, LedgerError};

/// One operator action. Destructive commands must carry a reason.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditEntry {
    pub at: DateTime<Utc>,
    pub actor: String,
    pub action: String,
    pub target: Option<String>,
    pub reason: Option<String>,
    pub details: serde_json::Value,
}

#[derive(sqlx::FromRow)]
struct AuditRow {
    at: DateTime<Utc>,
    actor: String,
    action: String,
    target: Option<String>,
    reason: Option<String>,
    details: serde_json::Value,
}

impl From<AuditRow> for AuditEntry {
    fn from(row: AuditRow) -> Self {
        Self {
            at: row.at,
            actor: row.actor,
            action: row.action,
            target: row.target,
            reason: row.reason,
            details: row.details,
        }
    }
}

/// Appends `entry` inside the caller's transaction, so a change and its audit row commit
/// together or not at all.
pub(crate) async fn insert(
    conn: &mut sqlx::PgConnection,
    entry: &AuditEntry,
) -> Result<(), LedgerError> {
    if entry.actor.is_empty() || entry.action.is_empty() {
        return Err(LedgerError::InvalidInput(
            "an audit entry needs an actor and an action",
        ));
    }
    sqlx::query(
        "INSERT INTO audit_log (at, actor, action, target, reason, details)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(entry.at)
    .bind(&entry.actor)
    .bind(&entry.action)
    .bind(entry.target.as_deref())
    .bind(entry.reason.as_deref())
    .bind(&entry.details)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

impl Ledger {
    /// Appends to the audit log. The table refuses updates and deletes.
    pub async fn record_audit(&self, entry: &AuditEntry) -> Result<(), LedgerError> {
        if entry.actor.is_empty() || entry.action.is_empty() {
            return Err(LedgerError::InvalidInput(
                "an audit entry needs an actor and an action",
            ));
        }
        sqlx::query(
            "INSERT INTO audit_log (at, actor, action, target, reason, details)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(entry.at)
        .bind(&entry.actor)
        .bind(&entry.action)
        .bind(entry.target.as_deref())
        .bind(entry.reason.as_deref())
        .bind(&entry.details)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The most recent audit entries, newest first.
    pub async fn recent_audit(&self, limit: u32) -> Result<Vec<AuditEntry>, LedgerError> {
        let rows: Vec<AuditRow> = sqlx::query_as(
            "SELECT at, actor, action, target, reason, details FROM audit_log
             ORDER BY id DESC LIMIT $1",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(AuditEntry::from).collect())
    }
}
