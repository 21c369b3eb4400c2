use nudge_domain::TenantId;

use crate::audit::{self, Operator};
use crate::{Ledger, LedgerError};

/// When the producer materialises a tenant's reminders: a cron expression (validated by the
/// producer, which owns the cron dialect) and how far ahead each tick looks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub tenant_id: TenantId,
    pub cron: String,
    pub window_seconds: u32,
}

#[derive(sqlx::FromRow)]
struct ScheduleRow {
    tenant_id: uuid::Uuid,
    cron: String,
    window_seconds: i32,
}

impl Ledger {
    /// Sets a tenant's schedule (one per tenant: replacing is the common operation), audited
    /// (`schedule_set`, with the schedule it replaced) in the same transaction.
    pub async fn set_schedule(
        &self,
        tenant_id: TenantId,
        cron: &str,
        window_seconds: u32,
        by: &Operator,
    ) -> Result<(), LedgerError> {
        if cron.trim().is_empty() || cron.len() > 200 {
            return Err(LedgerError::InvalidInput(
                "a cron expression must be 1 to 200 bytes",
            ));
        }
        let window = i32::try_from(window_seconds)
            .ok()
            .filter(|w| (1..=604_800).contains(w))
            .ok_or(LedgerError::InvalidInput(
                "a window must be 1 s to 7 days long",
            ))?;
        let cron = cron.trim();
        let mut tx = self.pool.begin().await?;
        let previous: Option<(String, i32)> = sqlx::query_as(
            "DELETE FROM schedules WHERE tenant_id = $1 RETURNING cron, window_seconds",
        )
        .bind(tenant_id.as_uuid())
        .fetch_optional(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO schedules (id, tenant_id, cron, window_seconds, enabled, created_at)
             VALUES ($1, $2, $3, $4, true, $5)",
        )
        .bind(uuid::Uuid::now_v7())
        .bind(tenant_id.as_uuid())
        .bind(cron)
        .bind(window)
        .bind(by.at())
        .execute(&mut *tx)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(db) if db.is_foreign_key_violation() => {
                LedgerError::UnknownTenant(tenant_id.as_uuid())
            }
            _ => LedgerError::Database(e),
        })?;
        audit::insert(
            &mut tx,
            &by.entry(
                "schedule_set",
                format!("tenant:{tenant_id}"),
                serde_json::json!({
                    "cron": cron,
                    "window_seconds": window_seconds,
                    "previous": previous.map(|(cron, window_seconds)| serde_json::json!({
                        "cron": cron,
                        "window_seconds": window_seconds,
                    })),
                }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Every enabled schedule, for the producer.
    pub async fn schedules(&self) -> Result<Vec<Schedule>, LedgerError> {
        let rows: Vec<ScheduleRow> = sqlx::query_as(
            "SELECT tenant_id, cron, window_seconds FROM schedules WHERE enabled ORDER BY tenant_id",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|r| {
                Ok(Schedule {
                    tenant_id: TenantId::from_uuid(r.tenant_id),
                    cron: r.cron,
                    window_seconds: u32::try_from(r.window_seconds)
                        .map_err(|e| LedgerError::corrupt("schedules", e))?,
                })
            })
            .collect()
    }
}
