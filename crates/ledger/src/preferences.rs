//! Categories and a subscriber's preferences (decision 0506): what a tenant's reminders are
//! about, and per channel and category whether a subscriber wants them.
//!
//! A tenant's categories are `general` (every tenant's, never required, without a row) and
//! those an operator created ([`Ledger::create_category`], audited). A preference is kept per
//! tenant, subscriber (the stored reference), channel and category in
//! `subscriber_preferences`; no row is opted in. Its history goes to `consent_history` by a
//! trigger, under the row's `subject` (a random id), never under the reference: an erasure
//! deletes the rows and the history names no one. A `required` category is never switched off
//! here ([`LedgerError::CategoryRequired`]); a destination's opt-out (a STOP) still stops it,
//! at the lease and the fence, which read both.

use chrono::{DateTime, Utc};
use nudge_domain::{Category, Channel, ConsentSource, ConsentState, SubscriberRef, TenantId};

use crate::audit::{self, Operator};
use crate::crypto::DestinationCipher;
use crate::{Ledger, LedgerError, LedgerTime};

/// One of a tenant's categories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CategoryInfo {
    pub name: Category,
    pub required: bool,
    /// `None` for `general`, which no one created.
    pub created_at: Option<DateTime<Utc>>,
}

/// What creating a category did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CategoryCreated {
    Created,
    /// It existed already, as asked: nothing changed.
    AlreadyPresent,
}

/// One preference: a channel and a category, whether the subscriber wants it, and its last
/// change (none: never changed, opted in).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preference {
    pub channel: Channel,
    pub category: Category,
    pub required: bool,
    pub state: ConsentState,
    pub source: Option<ConsentSource>,
    pub actor: Option<String>,
    pub changed_at: Option<DateTime<Utc>>,
}

/// A subscriber's preferences: every channel with every category of the tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preferences {
    pub entries: Vec<Preference>,
    /// Per channel the subscriber has a destination on whose consent ever changed (a STOP
    /// outranks every category).
    pub destinations: Vec<(Channel, crate::DestinationConsent)>,
}

/// One change a client asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferenceChange {
    pub channel: Channel,
    pub category: Category,
    pub state: ConsentState,
}

/// Who changes preferences, and under which request.
#[derive(Debug, Clone)]
pub struct PreferenceAuthor<'a> {
    pub source: ConsentSource,
    pub actor: &'a str,
    pub correlation_id: Option<&'a str>,
}

/// The most changes one request may carry (3 channels by the categories of a tenant).
pub const MAX_PREFERENCE_CHANGES: usize = 300;

#[derive(sqlx::FromRow)]
struct PreferenceRow {
    channel: String,
    category: String,
    state: String,
    source: String,
    actor: String,
    changed_at: DateTime<Utc>,
}

impl Ledger {
    /// Creates a category of `tenant`, audited in the same transaction. Creating it again as
    /// it is changes nothing; with the other `required` it is refused (categories never
    /// change: a reminder names one for its whole life).
    pub async fn create_category(
        &self,
        tenant: TenantId,
        name: &Category,
        required: bool,
        by: &Operator,
    ) -> Result<CategoryCreated, LedgerError> {
        if name.is_general() {
            return Err(LedgerError::InvalidInput(
                "general is every tenant's category already (never required)",
            ));
        }
        // No lock on the tenant: a category is never changed or deleted, and the insert's
        // foreign key holds the tenant for as long as it needs (a share lock would wait for a
        // window holding the tenant for its whole run).
        let mut tx = self.pool.begin().await?;
        let exists: Option<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM tenants WHERE id = $1")
            .bind(tenant.as_uuid())
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            return Err(LedgerError::UnknownTenant(tenant.as_uuid()));
        }
        let inserted = sqlx::query(
            "INSERT INTO categories (tenant_id, name, required, created_at, created_by)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (tenant_id, name) DO NOTHING",
        )
        .bind(tenant.as_uuid())
        .bind(name.as_str())
        .bind(required)
        .bind(by.at())
        .bind(by.actor())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if inserted == 0 {
            let was: bool = sqlx::query_scalar(
                "SELECT required FROM categories WHERE tenant_id = $1 AND name = $2",
            )
            .bind(tenant.as_uuid())
            .bind(name.as_str())
            .fetch_one(&mut *tx)
            .await?;
            return if was == required {
                Ok(CategoryCreated::AlreadyPresent)
            } else {
                Err(LedgerError::InvalidInput(
                    "the category exists with the other `required`: a category never changes",
                ))
            };
        }
        audit::insert(
            &mut tx,
            &by.entry(
                "category_create",
                format!("tenant:{tenant}"),
                serde_json::json!({ "category": name.as_str(), "required": required }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(CategoryCreated::Created)
    }

    /// The categories of `tenant`: `general` first, then by name.
    pub async fn categories(&self, tenant: TenantId) -> Result<Vec<CategoryInfo>, LedgerError> {
        let mut conn = self.pool.acquire().await?;
        categories_in(&mut conn, tenant).await
    }

    /// Every channel with every category of `tenant` for `subscriber_ref`, and the consent of
    /// the destinations they hold. `None` when the subscriber holds no destination and has no
    /// preference (never posted, or erased).
    pub async fn subscriber_preferences(
        &self,
        cipher: &DestinationCipher,
        tenant: TenantId,
        subscriber_ref: &SubscriberRef,
    ) -> Result<Option<Preferences>, LedgerError> {
        let stored_ref = cipher.stored_ref(tenant, subscriber_ref)?;
        let mut tx = self.pool.begin().await?;
        let known: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM contacts WHERE tenant_id = $1 AND subscriber_ref = $2)
                 OR EXISTS (SELECT 1 FROM subscriber_preferences
                            WHERE tenant_id = $1 AND subscriber_ref = $2)",
        )
        .bind(tenant.as_uuid())
        .bind(&stored_ref)
        .fetch_one(&mut *tx)
        .await?;
        if !known {
            return Ok(None);
        }
        let categories = categories_in(&mut tx, tenant).await?;
        let rows: Vec<PreferenceRow> = sqlx::query_as(
            "SELECT channel, category, state, source, actor, changed_at
             FROM subscriber_preferences WHERE tenant_id = $1 AND subscriber_ref = $2",
        )
        .bind(tenant.as_uuid())
        .bind(&stored_ref)
        .fetch_all(&mut *tx)
        .await?;
        let destinations = crate::consent::destinations_of(&mut tx, tenant, &stored_ref).await?;
        tx.commit().await?;
        let mut entries = Vec::with_capacity(Channel::ALL.len() * categories.len());
        for channel in Channel::ALL {
            for category in &categories {
                let row = rows.iter().find(|r| {
                    r.channel == channel.as_str() && r.category == category.name.as_str()
                });
                let (state, source, actor, changed_at) = match row {
                    Some(r) => (
                        ConsentState::parse(&r.state).ok_or_else(|| {
                            LedgerError::corrupt("subscriber_preferences", "state")
                        })?,
                        Some(ConsentSource::parse(&r.source).ok_or_else(|| {
                            LedgerError::corrupt("subscriber_preferences", "source")
                        })?),
                        Some(r.actor.clone()),
                        Some(r.changed_at),
                    ),
                    None => (ConsentState::OptedIn, None, None, None),
                };
                entries.push(Preference {
                    channel,
                    category: category.name.clone(),
                    required: category.required,
                    state,
                    source,
                    actor,
                    changed_at,
                });
            }
        }
        Ok(Some(Preferences {
            entries,
            destinations,
        }))
    }

    /// Applies `changes` to the preferences of `subscriber_ref` in `tenant`, all or none, in
    /// one transaction: refused naming the category when one is unknown
    /// ([`LedgerError::UnknownCategory`]) or required and switched off
    /// ([`LedgerError::CategoryRequired`]). A change to the state a stored preference already
    /// has writes nothing; every other one (a first one too, an explicit opt-in included) is
    /// written with its history entry. Returns how many changed.
    /// Times are the database's ([`LedgerTime::Database`]) unless fixed.
    pub async fn set_preferences(
        &self,
        cipher: &DestinationCipher,
        tenant: TenantId,
        subscriber_ref: &SubscriberRef,
        changes: &[PreferenceChange],
        author: &PreferenceAuthor<'_>,
        at: LedgerTime,
    ) -> Result<u64, LedgerError> {
        if changes.len() > MAX_PREFERENCE_CHANGES {
            return Err(LedgerError::InvalidInput(
                "at most 300 preferences change in one request",
            ));
        }
        if author.actor.trim().is_empty() || author.actor.chars().count() > 200 {
            return Err(LedgerError::InvalidInput(
                "a preference's actor is 1 to 200 characters",
            ));
        }
        let stored_ref = cipher.stored_ref(tenant, subscriber_ref)?;
        // No lock on the tenant (see `create_category`): the insert's foreign key holds it.
        let mut tx = self.pool.begin().await?;
        let exists: Option<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM tenants WHERE id = $1")
            .bind(tenant.as_uuid())
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            return Err(LedgerError::UnknownTenant(tenant.as_uuid()));
        }
        let categories = categories_in(&mut tx, tenant).await?;
        for change in changes {
            if !categories.iter().any(|c| c.name == change.category) {
                return Err(LedgerError::UnknownCategory(change.category.to_string()));
            }
        }
        // The last change of a channel and category wins, as the request listed them; what a
        // required category ends as is what is checked.
        let mut last: Vec<&PreferenceChange> = Vec::with_capacity(changes.len());
        for change in changes {
            last.retain(|c| !(c.channel == change.channel && c.category == change.category));
            last.push(change);
        }
        for change in &last {
            let required = categories
                .iter()
                .any(|c| c.name == change.category && c.required);
            if required && change.state == ConsentState::OptedOut {
                return Err(LedgerError::CategoryRequired(change.category.to_string()));
            }
        }
        // In key order: two requests for one subscriber never wait on each other in a cycle.
        last.sort_by(|a, b| {
            (a.channel.as_str(), a.category.as_str())
                .cmp(&(b.channel.as_str(), b.category.as_str()))
        });
        let written = sqlx::query(
            "INSERT INTO subscriber_preferences
                 (tenant_id, subscriber_ref, channel, category, state, source, actor,
                  correlation_id, changed_at)
             SELECT $1, $2, x.channel, x.category, x.state, $6, $7, $8, COALESCE($9, now())
             FROM unnest($3::text[], $4::text[], $5::text[]) WITH ORDINALITY
                  AS x(channel, category, state, ord)
             ORDER BY x.ord
             ON CONFLICT (tenant_id, subscriber_ref, channel, category) DO UPDATE
             SET state = EXCLUDED.state, source = EXCLUDED.source, actor = EXCLUDED.actor,
                 correlation_id = EXCLUDED.correlation_id, changed_at = EXCLUDED.changed_at
             WHERE subscriber_preferences.state <> EXCLUDED.state",
        )
        .bind(tenant.as_uuid())
        .bind(&stored_ref)
        .bind(last.iter().map(|c| c.channel.as_str()).collect::<Vec<_>>())
        .bind(last.iter().map(|c| c.category.as_str()).collect::<Vec<_>>())
        .bind(last.iter().map(|c| c.state.as_str()).collect::<Vec<_>>())
        .bind(author.source.as_str())
        .bind(author.actor)
        .bind(author.correlation_id)
        .bind(at.bind())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(written)
    }
}

async fn categories_in(
    conn: &mut sqlx::PgConnection,
    tenant: TenantId,
) -> Result<Vec<CategoryInfo>, LedgerError> {
    let rows: Vec<(String, bool, DateTime<Utc>)> = sqlx::query_as(
        "SELECT name, required, created_at FROM categories WHERE tenant_id = $1 ORDER BY name",
    )
    .bind(tenant.as_uuid())
    .fetch_all(&mut *conn)
    .await?;
    let mut categories = Vec::with_capacity(rows.len() + 1);
    categories.push(CategoryInfo {
        name: Category::general(),
        required: false,
        created_at: None,
    });
    for (name, required, created_at) in rows {
        categories.push(CategoryInfo {
            name: Category::parse(&name).map_err(|e| LedgerError::corrupt("categories", e))?,
            required,
            created_at: Some(created_at),
        });
    }
    Ok(categories)
}
