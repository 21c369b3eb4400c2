//! The audit log: one append-only row per operator action (the table refuses UPDATE, DELETE
//! and TRUNCATE).
//!
//! An operator change and its row commit together. Every change function of the ledger
//! (tenant create, pause and resume, route, schedule, rate) takes the [`Operator`] making it and
//! writes the row itself, inside the change's own transaction, from what it read and wrote
//! under its locks: a change never commits without its row, a row never claims a change that
//! did not happen, and the `previous` values it records are the ones really replaced.
//! [`Ledger::record_audit`] stays for actions that are many transactions of their own (a bulk
//! load audits its summary once it has run).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::{Ledger, LedgerError};

/// Most characters an actor may have (the table's CHECK).
const ACTOR_MAX_CHARS: usize = 200;

/// Who makes an operator change, when and why: what a change function needs to write its
/// audit row. Parsed once, so a change function never starts with an actor the audit log
/// would refuse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    actor: String,
    reason: Option<String>,
    incident: Option<String>,
    at: DateTime<Utc>,
}

/// Most characters an incident id may have (the tables' CHECK).
const INCIDENT_MAX_CHARS: usize = 100;

impl Operator {
    /// `actor`: 1 to 200 characters, not blank. `reason`, when given, must say something.
    pub fn new(actor: &str, reason: Option<&str>, at: DateTime<Utc>) -> Result<Self, LedgerError> {
        if actor.trim().is_empty() || actor.chars().count() > ACTOR_MAX_CHARS {
            return Err(LedgerError::InvalidInput(
                "an operator change needs an actor of 1 to 200 characters",
            ));
        }
        if reason.is_some_and(|r| r.trim().is_empty()) {
            return Err(LedgerError::InvalidInput(
                "a reason, when given, must not be blank",
            ));
        }
        Ok(Self {
            actor: actor.to_owned(),
            reason: reason.map(str::to_owned),
            incident: None,
            at,
        })
    }

    /// The incident this change is made under (1 to 100 characters of `[A-Za-z0-9._:/-]`):
    /// recorded on the audit row, and on the attempts a redrive or drain makes.
    pub fn with_incident(mut self, incident: Option<&str>) -> Result<Self, LedgerError> {
        if let Some(id) = incident {
            let valid = !id.is_empty()
                && id.chars().count() <= INCIDENT_MAX_CHARS
                && id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._:/-".contains(c));
            if !valid {
                return Err(LedgerError::InvalidInput(
                    "an incident id is 1 to 100 of [A-Za-z0-9._:/-]",
                ));
            }
        }
        self.incident = incident.map(str::to_owned);
        Ok(self)
    }

    pub fn incident(&self) -> Option<&str> {
        self.incident.as_deref()
    }

    pub fn actor(&self) -> &str {
        &self.actor
    }

    pub fn reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }

    /// When the change is made: its rows' timestamps and the audit row's `at`.
    pub fn at(&self) -> DateTime<Utc> {
        self.at
    }

    /// The audit row of one change made by this operator.
    pub(crate) fn entry(
        &self,
        action: &str,
        target: String,
        details: serde_json::Value,
    ) -> AuditEntry {
        AuditEntry {
            at: self.at,
            actor: self.actor.clone(),
            action: action.to_owned(),
            target: Some(target),
            reason: self.reason.clone(),
            incident: self.incident.clone(),
            details,
        }
    }
}

/// One operator action as the audit log holds it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AuditEntry {
    pub at: DateTime<Utc>,
    pub actor: String,
    pub action: String,
    pub target: Option<String>,
    pub reason: Option<String>,
    pub incident: Option<String>,
    pub details: serde_json::Value,
}

#[derive(sqlx::FromRow)]
pub(crate) struct AuditRow {
    at: DateTime<Utc>,
    actor: String,
    action: String,
    target: Option<String>,
    reason: Option<String>,
    incident: Option<String>,
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
            incident: row.incident,
            details: row.details,
        }
    }
}

impl Ledger {
    /// Appends to the audit log on its own, for an action that is not one change (a bulk load
    /// records its summary after its lines committed). A change audits itself instead.
    pub async fn record_audit(&self, entry: &AuditEntry) -> Result<(), LedgerError> {
        let mut conn = self.pool.acquire().await?;
        insert(&mut conn, entry).await
    }

    /// The most recent audit entries, newest first.
    pub async fn recent_audit(&self, limit: u32) -> Result<Vec<AuditEntry>, LedgerError> {
        let rows: Vec<AuditRow> = sqlx::query_as(
            "SELECT at, actor, action, target, reason, incident, details FROM audit_log
             ORDER BY id DESC LIMIT $1",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(AuditEntry::from).collect())
    }
}

/// Appends one row, on the caller's connection: inside a change's transaction, the row
/// commits or rolls back with the change.
pub(crate) async fn insert(conn: &mut PgConnection, entry: &AuditEntry) -> Result<(), LedgerError> {
    if entry.actor.is_empty() || entry.action.is_empty() {
        return Err(LedgerError::InvalidInput(
            "an audit entry needs an actor and an action",
        ));
    }
    sqlx::query(
        "INSERT INTO audit_log (at, actor, action, target, reason, incident, details)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(entry.at)
    .bind(&entry.actor)
    .bind(&entry.action)
    .bind(entry.target.as_deref())
    .bind(entry.reason.as_deref())
    .bind(entry.incident.as_deref())
    .bind(&entry.details)
    .execute(&mut *conn)
    .await?;
    Ok(())
}
