use chrono::{DateTime, Utc};
use nudge_domain::{Channel, ProviderAccount, TenantId, Zone};

use crate::audit::{self, Operator};
use crate::crypto::{DestinationCipher, SealedWith};
use crate::intake::secret_aad;
use crate::{Ledger, LedgerError};

/// A tenant's scheduling settings that `nudgectl tenant set` changes: each a column of
/// `tenants` and an audit action.
#[derive(Debug, Clone, Copy)]
enum TenantSetting {
    Weight,
    MaxShare,
    TimeZone,
    QuietHoursIgnorable,
}

impl TenantSetting {
    /// The column, from this fixed list only (it is written into the statement).
    fn column(self) -> &'static str {
        match self {
            TenantSetting::Weight => "claim_weight",
            TenantSetting::MaxShare => "max_share",
            TenantSetting::TimeZone => "time_zone",
            TenantSetting::QuietHoursIgnorable => "quiet_hours_ignorable",
        }
    }

    fn action(self) -> &'static str {
        match self {
            TenantSetting::Weight => "tenant_weight",
            TenantSetting::MaxShare => "tenant_max_share",
            TenantSetting::TimeZone => "tenant_time_zone",
            TenantSetting::QuietHoursIgnorable => "tenant_quiet_hours_ignorable",
        }
    }
}

/// A condition under which a setting's change is refused, checked under the tenant's row lock:
/// `when` is a statement of the tenant's id (`$1`) answering whether to refuse, and `why` the
/// error's message.
struct Refusal {
    when: &'static str,
    why: &'static str,
}

/// Secrets sealed again per transaction by [`Ledger::reseal_tenant_secrets`].
const RESEAL_BATCH: i64 = 500;

/// Secrets sealed like the intake's signing secrets, each table's with its associated data
/// (what binds a sealed secret to its row).
struct SealedSecrets {
    /// Up to `$1` rows still sealed with the destination key, locked.
    select: &'static str,
    /// Seals row (`$1`, `$2`) again: `$3` the new ciphertext, `$4` what sealed it.
    update: &'static str,
    aad: fn(uuid::Uuid, i32) -> Vec<u8>,
}

const SEALED_SECRETS: [SealedSecrets; 2] = [
    SealedSecrets {
        select: "SELECT tenant_id, generation, secret_ciphertext FROM tenant_secrets
                 WHERE sealed_with = 'destination_key'
                 ORDER BY tenant_id, generation LIMIT $1
                 FOR UPDATE",
        update: "UPDATE tenant_secrets SET secret_ciphertext = $3, sealed_with = $4
                 WHERE tenant_id = $1 AND generation = $2",
        aad: secret_aad,
    },
    SealedSecrets {
        select: "SELECT tenant_id, generation, secret_ciphertext FROM tenant_webhook_secrets
                 WHERE sealed_with = 'destination_key'
                 ORDER BY tenant_id, generation LIMIT $1
                 FOR UPDATE",
        update: "UPDATE tenant_webhook_secrets SET secret_ciphertext = $3, sealed_with = $4
                 WHERE tenant_id = $1 AND generation = $2",
        aad: crate::webhooks::secret_aad,
    },
];

/// A tenant and its operator flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub id: TenantId,
    pub name: String,
    pub intake_paused: bool,
    pub draining: bool,
    /// The tenant's default zone (`nudgectl tenant set --time-zone`), if it has one.
    pub time_zone: Option<Zone>,
    /// Whether its reminders may say `"quiet_hours": "ignore"`.
    pub quiet_hours_ignorable: bool,
}

#[derive(sqlx::FromRow)]
struct TenantRow {
    id: uuid::Uuid,
    name: String,
    intake_paused: bool,
    draining: bool,
    time_zone: Option<String>,
    quiet_hours_ignorable: bool,
}

#[derive(sqlx::FromRow)]
struct CreatedTenantRow {
    #[sqlx(flatten)]
    tenant: TenantRow,
    created: bool,
}

impl TryFrom<TenantRow> for Tenant {
    type Error = LedgerError;

    fn try_from(row: TenantRow) -> Result<Self, LedgerError> {
        Ok(Self {
            id: TenantId::from_uuid(row.id),
            name: row.name,
            intake_paused: row.intake_paused,
            draining: row.draining,
            time_zone: row
                .time_zone
                .as_deref()
                .map(|name| crate::contacts::stored_zone("tenants", name))
                .transpose()?,
            quiet_hours_ignorable: row.quiet_hours_ignorable,
        })
    }
}

impl Ledger {
    /// Creates a tenant, or returns the existing one of that name; audited (`tenant_create`,
    /// with whether it was created) in the same transaction.
    pub async fn create_tenant(&self, name: &str, by: &Operator) -> Result<Tenant, LedgerError> {
        if name.is_empty() || name.len() > 200 {
            return Err(LedgerError::InvalidInput(
                "tenant name must be 1 to 200 bytes",
            ));
        }
        let mut tx = self.pool.begin().await?;
        // `xmax = 0` only on the row version this statement inserted.
        let row: CreatedTenantRow = sqlx::query_as(
            "INSERT INTO tenants (id, name, created_at, updated_at) VALUES ($1, $2, $3, $3)
             ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name
             RETURNING id, name, intake_paused, draining, time_zone, quiet_hours_ignorable,
                       (xmax = 0) AS created",
        )
        .bind(TenantId::new().as_uuid())
        .bind(name)
        .bind(by.at())
        .fetch_one(&mut *tx)
        .await?;
        let created = row.created;
        let tenant = Tenant::try_from(row.tenant)?;
        audit::insert(
            &mut tx,
            &by.entry(
                "tenant_create",
                format!("tenant:{}", tenant.id),
                serde_json::json!({ "name": tenant.name, "created": created }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(tenant)
    }

    pub async fn tenant(&self, id: TenantId) -> Result<Option<Tenant>, LedgerError> {
        let row: Option<TenantRow> = sqlx::query_as(
            "SELECT id, name, intake_paused, draining, time_zone, quiet_hours_ignorable
             FROM tenants WHERE id = $1",
        )
        .bind(id.as_uuid())
        .fetch_optional(&self.pool)
        .await?;
        row.map(Tenant::try_from).transpose()
    }

    /// Tenants whose name contains `filter` (any case; all when None), paused ones first, then
    /// by name; at most `limit` of them, and how many match in all.
    pub async fn tenants(
        &self,
        filter: Option<&str>,
        limit: u32,
    ) -> Result<(Vec<Tenant>, u64), LedgerError> {
        // `%`, `_` and `\` in the filter are matched as themselves.
        let pattern = filter.map(|f| {
            let escaped = f
                .replace('\\', "\\\\")
                .replace('%', "\\%")
                .replace('_', "\\_");
            format!("%{escaped}%")
        });
        let rows: Vec<TenantRow> = sqlx::query_as(
            "SELECT id, name, intake_paused, draining, time_zone, quiet_hours_ignorable
             FROM tenants WHERE $1::text IS NULL OR name ILIKE $1
             ORDER BY intake_paused DESC, name LIMIT $2",
        )
        .bind(pattern.as_deref())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let total: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM tenants WHERE $1::text IS NULL OR name ILIKE $1",
        )
        .bind(pattern.as_deref())
        .fetch_one(&self.pool)
        .await?;
        let tenants = rows
            .into_iter()
            .map(Tenant::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        Ok((tenants, u64::try_from(total).unwrap_or(0)))
    }

    pub async fn tenant_by_name(&self, name: &str) -> Result<Option<Tenant>, LedgerError> {
        let row: Option<TenantRow> = sqlx::query_as(
            "SELECT id, name, intake_paused, draining, time_zone, quiet_hours_ignorable
             FROM tenants WHERE name = $1",
        )
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        row.map(Tenant::try_from).transpose()
    }

    /// Sets the intake-pause flag, audited (`intake_pause` / `intake_resume`) in the same
    /// transaction; returns false (and changes and audits nothing) when the tenant does not
    /// exist. Resuming materialises, in the same transaction, the reminders created during the
    /// pause whose window already ran, so nothing created while paused is left behind.
    pub async fn set_intake_paused(
        &self,
        id: TenantId,
        paused: bool,
        by: &Operator,
    ) -> Result<bool, LedgerError> {
        let now = by.at();
        let mut tx = self.pool.begin().await?;
        let current: Option<(bool, Option<DateTime<Utc>>)> = sqlx::query_as(
            "SELECT intake_paused, intake_paused_at FROM tenants WHERE id = $1 FOR UPDATE",
        )
        .bind(id.as_uuid())
        .fetch_optional(&mut *tx)
        .await?;
        let Some((was_paused, paused_at)) = current else {
            return Ok(false);
        };
        sqlx::query(
            "UPDATE tenants SET intake_paused = $2, updated_at = $3,
                 intake_paused_at = CASE WHEN $2 THEN COALESCE(intake_paused_at, $3) ELSE NULL END
             WHERE id = $1",
        )
        .bind(id.as_uuid())
        .bind(paused)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let mut materialised = 0;
        if was_paused && !paused {
            // A tenant paused before this column existed resumes everything not yet materialised.
            let since = paused_at.unwrap_or(DateTime::<Utc>::MIN_UTC);
            materialised =
                crate::reminders::materialise_paused_backlog(&mut tx, id, since, now).await?;
        }
        let action = if paused {
            "intake_pause"
        } else {
            "intake_resume"
        };
        audit::insert(
            &mut tx,
            &by.entry(
                action,
                format!("tenant:{id}"),
                serde_json::json!({
                    "intake_paused": paused,
                    "previous": was_paused,
                    "deliveries_materialised": materialised,
                }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Sets a tenant's claim weight (1..=1000): its share of each claim beside the other
    /// tenants with due work on the same channel (invariant 14). Audited (`tenant_weight`, with
    /// the weight it replaced) in the same transaction; returns the previous weight, or None
    /// (nothing changed) when the tenant does not exist.
    pub async fn set_tenant_weight(
        &self,
        id: TenantId,
        weight: u32,
        by: &Operator,
    ) -> Result<Option<u32>, LedgerError> {
        if !(1..=1000).contains(&weight) {
            return Err(LedgerError::InvalidInput("a claim weight is 1 to 1000"));
        }
        let value = i32::try_from(weight).unwrap_or(1000);
        let previous = self
            .set_tenant_setting(id, TenantSetting::Weight, value, None, None, by)
            .await?;
        Ok(previous.map(|p| u32::try_from(p).unwrap_or(1)))
    }

    /// Sets (or with None clears) a tenant's cap on its share of every rate-limited provider
    /// account it sends through, audited (`tenant_max_share`, with the cap it replaced) in the
    /// same transaction. Returns the cap it replaced (`Some(None)`: there was none), or None
    /// when there is no such tenant. Workers apply it at their next admission.
    pub async fn set_tenant_max_share(
        &self,
        id: TenantId,
        share: Option<nudge_domain::MaxShare>,
        by: &Operator,
    ) -> Result<Option<Option<f64>>, LedgerError> {
        let value = share.map(nudge_domain::MaxShare::get);
        self.set_tenant_setting(id, TenantSetting::MaxShare, value, None, None, by)
            .await
    }

    /// Sets (or, with `None`, clears) a tenant's default zone: the zone of a local time whose
    /// reminder and subscriber give none. Audited (`tenant_time_zone`, with the zone it
    /// replaced and the tz database's version) in the same transaction; returns the previous
    /// zone (`Some(None)`: it had none), or None (nothing changed) when the tenant does not
    /// exist.
    pub async fn set_tenant_time_zone(
        &self,
        id: TenantId,
        zone: Option<Zone>,
        by: &Operator,
    ) -> Result<Option<Option<Zone>>, LedgerError> {
        let value = zone.map(|z| z.name().to_owned());
        let previous = self
            .set_tenant_setting(
                id,
                TenantSetting::TimeZone,
                value,
                Some(("tzdb", nudge_domain::TZDB_VERSION)),
                // The quiet hours are read in this zone for a subscriber without one; set
                // under the same lock (`set_tenant_quiet_hours`), so the two never part.
                zone.is_none().then_some(Refusal {
                    when: "SELECT EXISTS (SELECT 1 FROM tenant_quiet_hours WHERE tenant_id = $1)",
                    why: "the tenant has quiet hours, read in its zone for a subscriber without \
                          one: clear them first (nudgectl tenant quiet-hours clear)",
                }),
                by,
            )
            .await?;
        // A zone stored by a binary with a newer tz database is reported, not refused.
        Ok(previous.map(|p| p.and_then(|name| Zone::parse(&name).ok())))
    }

    /// Writes one of a tenant's scheduling settings under the tenant's row lock, with its audit
    /// row (the new value, the one it replaced, and `note` when given) in the same transaction.
    /// Returns the value it replaced, or None when there is no such tenant.
    async fn set_tenant_setting<T>(
        &self,
        id: TenantId,
        setting: TenantSetting,
        value: T,
        note: Option<(&str, &str)>,
        refuse: Option<Refusal>,
        by: &Operator,
    ) -> Result<Option<T>, LedgerError>
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres>
            + for<'q> sqlx::Encode<'q, sqlx::Postgres>
            + sqlx::Type<sqlx::Postgres>
            + serde::Serialize
            + Send
            + Unpin,
    {
        let column = setting.column();
        let mut tx = self.pool.begin().await?;
        let previous: Option<T> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT {column} FROM tenants WHERE id = $1 FOR UPDATE"
        )))
        .bind(id.as_uuid())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(previous) = previous else {
            return Ok(None);
        };
        if let Some(refusal) = refuse {
            let refused: bool = sqlx::query_scalar(refusal.when)
                .bind(id.as_uuid())
                .fetch_one(&mut *tx)
                .await?;
            if refused {
                return Err(LedgerError::InvalidInput(refusal.why));
            }
        }
        let mut details = serde_json::json!({ column: &value, "previous": &previous });
        if let (Some((key, text)), Some(map)) = (note, details.as_object_mut()) {
            map.insert(key.to_owned(), serde_json::Value::from(text));
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE tenants SET {column} = $2, updated_at = $3 WHERE id = $1"
        )))
        .bind(id.as_uuid())
        .bind(value)
        .bind(by.at())
        .execute(&mut *tx)
        .await?;
        audit::insert(
            &mut tx,
            &by.entry(setting.action(), format!("tenant:{id}"), details),
        )
        .await?;
        tx.commit().await?;
        Ok(Some(previous))
    }

    /// Sets whether the tenant's reminders may say `"quiet_hours": "ignore"` (urgent classes,
    /// such as a cancelled appointment), audited (`tenant_quiet_hours_ignorable`) in the same
    /// transaction. Returns what it replaced, or None when there is no such tenant.
    pub async fn set_tenant_quiet_hours_ignorable(
        &self,
        id: TenantId,
        ignorable: bool,
        by: &Operator,
    ) -> Result<Option<bool>, LedgerError> {
        self.set_tenant_setting(
            id,
            TenantSetting::QuietHoursIgnorable,
            ignorable,
            None,
            None,
            by,
        )
        .await
    }

    /// Routes a tenant's channel to a provider account (None = the channel's default account),
    /// audited (`tenant_route`, with the account it replaced) in the same transaction.
    pub async fn set_tenant_channel_account(
        &self,
        id: TenantId,
        channel: Channel,
        account: Option<&ProviderAccount>,
        by: &Operator,
    ) -> Result<(), LedgerError> {
        let mut tx = self.pool.begin().await?;
        let previous: Option<Option<String>> = sqlx::query_scalar(
            "SELECT provider_account FROM tenant_channels
             WHERE tenant_id = $1 AND channel = $2 FOR UPDATE",
        )
        .bind(id.as_uuid())
        .bind(channel.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO tenant_channels (tenant_id, channel, provider_account, updated_at)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (tenant_id, channel)
             DO UPDATE SET provider_account = EXCLUDED.provider_account, updated_at = EXCLUDED.updated_at",
        )
        .bind(id.as_uuid())
        .bind(channel.as_str())
        .bind(account.map(|a| a.as_str()))
        .bind(by.at())
        .execute(&mut *tx)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(db) if db.is_foreign_key_violation() => {
                LedgerError::UnknownTenant(id.as_uuid())
            }
            _ => LedgerError::Database(e),
        })?;
        audit::insert(
            &mut tx,
            &by.entry(
                "tenant_route",
                format!("tenant:{id}"),
                serde_json::json!({
                    "channel": channel,
                    "account": account.map(ProviderAccount::as_str),
                    "previous": previous.flatten(),
                }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The provider account configured for a tenant's channel, if any.
    pub async fn tenant_channel_account(
        &self,
        id: TenantId,
        channel: Channel,
    ) -> Result<Option<ProviderAccount>, LedgerError> {
        let account: Option<Option<String>> = sqlx::query_scalar(
            "SELECT provider_account FROM tenant_channels WHERE tenant_id = $1 AND channel = $2",
        )
        .bind(id.as_uuid())
        .bind(channel.as_str())
        .fetch_optional(&self.pool)
        .await?;
        account
            .flatten()
            .map(|a| {
                ProviderAccount::parse(&a).map_err(|e| LedgerError::corrupt("tenant_channels", e))
            })
            .transpose()
    }

    /// Seals again under the tenant secret key every secret still sealed with the destination
    /// key (written before `crypto.tenant_secret_key` existed): the intake's signing secrets
    /// (`tenant_secrets`) and the events' webhook secrets (`tenant_webhook_secrets`); `nudgectl
    /// migrate` runs it once both keys are configured. 500 rows per transaction, each row
    /// locked, opened, sealed and marked; running it again resumes. Returns how many it sealed
    /// again. Needs the tenant secret key ([`LedgerError::TenantSecretKeyMissing`]).
    pub async fn reseal_tenant_secrets(
        &self,
        cipher: &DestinationCipher,
    ) -> Result<u64, LedgerError> {
        if !cipher.has_tenant_secret_key() {
            return Err(LedgerError::TenantSecretKeyMissing);
        }
        let mut resealed = 0;
        for secrets in &SEALED_SECRETS {
            resealed += self.reseal_secrets_of(secrets, cipher).await?;
        }
        Ok(resealed)
    }

    async fn reseal_secrets_of(
        &self,
        secrets: &SealedSecrets,
        cipher: &DestinationCipher,
    ) -> Result<u64, LedgerError> {
        let mut resealed = 0;
        loop {
            let mut tx = self.pool.begin().await?;
            let rows: Vec<(uuid::Uuid, i32, Vec<u8>)> = sqlx::query_as(secrets.select)
                .bind(RESEAL_BATCH)
                .fetch_all(&mut *tx)
                .await?;
            if rows.is_empty() {
                return Ok(resealed);
            }
            for (tenant_id, generation, sealed) in &rows {
                let aad = (secrets.aad)(*tenant_id, *generation);
                let plain = cipher.open_tenant_secret(sealed, SealedWith::DestinationKey, &aad)?;
                let (again, with) = cipher.seal_tenant_secret(&plain, &aad)?;
                sqlx::query(secrets.update)
                    .bind(tenant_id)
                    .bind(generation)
                    .bind(again)
                    .bind(with.as_str())
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            resealed += rows.len() as u64;
        }
    }

    /// How many secrets (the intake's signing secrets and the webhooks') are still sealed with
    /// the destination key.
    pub async fn tenant_secrets_sealed_with_destination_key(&self) -> Result<u64, LedgerError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM tenant_secrets WHERE sealed_with = 'destination_key')
                    + (SELECT count(*) FROM tenant_webhook_secrets
                       WHERE sealed_with = 'destination_key')",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
