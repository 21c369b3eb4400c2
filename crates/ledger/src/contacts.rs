//! Contacts: a subscriber's destination per channel, encrypted, keyed by the *stored*
//! subscriber reference (see `crypto`), with the subscriber's time zone, and the conversion
//! of rows written before subscriber references were stored as a keyed hash.
//!
//! A subscriber's zone is one value kept on every one of their contacts (so that erasure and
//! retention take it with them, and a send reads it with the destination): a zone given for
//! a subscriber is written to all their contacts, and a contact stored without one keeps the
//! zone it had. [`Ledger::subscriber_zone`] reads it. What a send needs is read and opened with its lease
//! (`deliveries::lease`), with the associated data defined here.

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, SubscriberRef, TenantId, Zone};

use crate::crypto::{Destination, DestinationCipher, DestinationDigest};
use crate::{Ledger, LedgerError};

/// A destination's associated data: its row's identity, with the subscriber reference in
/// the form the row stores, so that a reader opens it without the subscriber key.
pub(crate) fn destination_aad(tenant_id: TenantId, stored_ref: &str, channel: Channel) -> Vec<u8> {
    format!("destination:{tenant_id}:{channel}:{stored_ref}").into_bytes()
}

/// A destination ready to store: its row's key, its ciphertext (sealed under
/// [`destination_aad`] of that key) and its keyed digest.
pub(crate) struct SealedContact {
    pub tenant_id: uuid::Uuid,
    pub stored_ref: String,
    pub channel: Channel,
    pub ciphertext: Vec<u8>,
    pub digest: DestinationDigest,
    /// The subscriber's zone, when this write gives one; none keeps the stored one.
    pub time_zone: Option<Zone>,
}

impl SealedContact {
    pub(crate) fn with_time_zone(mut self, zone: Option<Zone>) -> Self {
        self.time_zone = zone;
        self
    }
}

/// A subscriber's zone, to be written to all their contacts.
pub(crate) struct SubscriberZone {
    pub tenant_id: uuid::Uuid,
    pub stored_ref: String,
    pub zone: Zone,
}

/// Writes each subscriber's zone to every one of their contacts (those of channels the
/// write did not name too), in one statement; nothing when none is given. Contacts another
/// transaction holds (a concurrent post for the same subscriber, upserting another channel) are
/// skipped rather than waited for: this transaction already holds the rows it upserted, and
/// waiting for the other's while it waits for ours is a deadlock. The other write brings its
/// own zone, or the skipped contact keeps the one it had until the subscriber's next write.
pub(crate) async fn set_subscriber_zones(
    conn: &mut sqlx::PgConnection,
    zones: &[SubscriberZone],
) -> Result<(), LedgerError> {
    if zones.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "WITH z AS (
             SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[])
                 AS z(tenant_id, subscriber_ref, time_zone)),
         free AS (
             SELECT c.tenant_id, c.subscriber_ref, c.channel, z.time_zone
             FROM contacts c JOIN z
               ON c.tenant_id = z.tenant_id AND c.subscriber_ref = z.subscriber_ref
             WHERE c.time_zone IS DISTINCT FROM z.time_zone
             FOR UPDATE OF c SKIP LOCKED)
         UPDATE contacts c SET time_zone = f.time_zone
         FROM free f
         WHERE c.tenant_id = f.tenant_id AND c.subscriber_ref = f.subscriber_ref
           AND c.channel = f.channel",
    )
    .bind(zones.iter().map(|z| z.tenant_id).collect::<Vec<_>>())
    .bind(
        zones
            .iter()
            .map(|z| z.stored_ref.as_str())
            .collect::<Vec<_>>(),
    )
    .bind(zones.iter().map(|z| z.zone.name()).collect::<Vec<_>>())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// What [`upsert_contacts`] does for the contacts it is given. A contact that already holds
/// the same destination keeps its ciphertext and flags; another destination resets them.
const UPSERT_CONTACTS: &str =
    "INSERT INTO contacts (tenant_id, subscriber_ref, subscriber_ref_keyed, channel,
                               destination_ciphertext, destination_digest, updated_at)
         SELECT c.tenant_id, c.subscriber_ref, true, c.channel, c.ciphertext, c.digest, $6
         FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::bytea[])
              AS c(tenant_id, subscriber_ref, channel, ciphertext, digest)
         ON CONFLICT (tenant_id, subscriber_ref, channel)
         DO UPDATE SET
             destination_ciphertext = CASE
                 WHEN contacts.destination_digest IS NOT DISTINCT FROM EXCLUDED.destination_digest
                 THEN contacts.destination_ciphertext
                 ELSE EXCLUDED.destination_ciphertext END,
             destination_digest = EXCLUDED.destination_digest,
             updated_at = EXCLUDED.updated_at,
             invalid_at = CASE
                 WHEN contacts.destination_digest IS DISTINCT FROM EXCLUDED.destination_digest
                  AND contacts.destination_digest IS NOT NULL
                 THEN NULL ELSE contacts.invalid_at END,
             opted_out_at = CASE
                 WHEN contacts.destination_digest IS DISTINCT FROM EXCLUDED.destination_digest
                  AND contacts.destination_digest IS NOT NULL
                 THEN NULL ELSE contacts.opted_out_at END";

/// [`UPSERT_CONTACTS`], and each contact given a zone (`$7`) takes it.
const UPSERT_CONTACTS_WITH_ZONE: &str =
    "INSERT INTO contacts (tenant_id, subscriber_ref, subscriber_ref_keyed, channel,
                               destination_ciphertext, destination_digest, updated_at, time_zone)
         SELECT c.tenant_id, c.subscriber_ref, true, c.channel, c.ciphertext, c.digest, $6,
                c.time_zone
         FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::bytea[], $7::text[])
              AS c(tenant_id, subscriber_ref, channel, ciphertext, digest, time_zone)
         ON CONFLICT (tenant_id, subscriber_ref, channel)
         DO UPDATE SET
             time_zone = COALESCE(EXCLUDED.time_zone, contacts.time_zone),
             destination_ciphertext = CASE
                 WHEN contacts.destination_digest IS NOT DISTINCT FROM EXCLUDED.destination_digest
                 THEN contacts.destination_ciphertext
                 ELSE EXCLUDED.destination_ciphertext END,
             destination_digest = EXCLUDED.destination_digest,
             updated_at = EXCLUDED.updated_at,
             invalid_at = CASE
                 WHEN contacts.destination_digest IS DISTINCT FROM EXCLUDED.destination_digest
                  AND contacts.destination_digest IS NOT NULL
                 THEN NULL ELSE contacts.invalid_at END,
             opted_out_at = CASE
                 WHEN contacts.destination_digest IS DISTINCT FROM EXCLUDED.destination_digest
                  AND contacts.destination_digest IS NOT NULL
                 THEN NULL ELSE contacts.opted_out_at END";

/// Stores sealed destinations in one statement. A contact that already holds the same
/// destination (the same digest) keeps its ciphertext and its provider flags: only its
/// `updated_at` moves, which keeps it from retention while it is posted. A contact given
/// another destination takes it and loses its flags (invalid, opted out): they describe the
/// destination they were learnt from. A contact stored before digests were (no digest) takes
/// the new destination and its digest but keeps its flags: whether the destination changed is
/// unknown, and an opt-out is never cleared on a guess. A contact given a zone takes it; one
/// given none keeps its own. The caller gives each key once.
pub(crate) async fn upsert_contacts(
    conn: &mut sqlx::PgConnection,
    sealed: &[SealedContact],
    now: DateTime<Utc>,
) -> Result<(), LedgerError> {
    if sealed.is_empty() {
        return Ok(());
    }
    // Without a zone (the common post) the statement is the one it always was: a zone costs
    // only the writes that give one.
    let zoned = sealed.iter().any(|c| c.time_zone.is_some());
    let statement = if zoned {
        UPSERT_CONTACTS_WITH_ZONE
    } else {
        UPSERT_CONTACTS
    };
    let query = sqlx::query(statement)
        .bind(sealed.iter().map(|c| c.tenant_id).collect::<Vec<_>>())
        .bind(
            sealed
                .iter()
                .map(|c| c.stored_ref.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(
            sealed
                .iter()
                .map(|c| c.channel.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(
            sealed
                .iter()
                .map(|c| c.ciphertext.as_slice())
                .collect::<Vec<_>>(),
        )
        .bind(
            sealed
                .iter()
                .map(|c| c.digest.as_bytes())
                .collect::<Vec<_>>(),
        )
        .bind(now);
    let query = if zoned {
        query.bind(
            sealed
                .iter()
                .map(|c| c.time_zone.map(|z| z.name()))
                .collect::<Vec<_>>(),
        )
    } else {
        query
    };
    query.execute(&mut *conn).await.map_err(|e| match &e {
        sqlx::Error::Database(db) if db.is_foreign_key_violation() => {
            LedgerError::InvalidInput("a contact names an unknown tenant")
        }
        _ => LedgerError::Database(e),
    })?;
    Ok(())
}

/// Seals one destination for its row: ciphertext and digest.
pub(crate) fn seal_contact(
    cipher: &DestinationCipher,
    tenant_id: TenantId,
    stored_ref: String,
    channel: Channel,
    destination: &Destination,
) -> Result<SealedContact, LedgerError> {
    let ciphertext = cipher.seal(
        destination.expose().as_bytes(),
        &destination_aad(tenant_id, &stored_ref, channel),
    )?;
    Ok(SealedContact {
        tenant_id: tenant_id.as_uuid(),
        digest: cipher.destination_digest(tenant_id, channel, destination)?,
        stored_ref,
        channel,
        ciphertext,
        time_zone: None,
    })
}

impl Ledger {
    /// Stores (or replaces) a subscriber's destination for one channel, encrypted (see
    /// `upsert_contacts` for what happens to its flags). Needs the cipher's subscriber key.
    pub async fn upsert_contact(
        &self,
        tenant_id: TenantId,
        subscriber_ref: &SubscriberRef,
        channel: Channel,
        destination: &Destination,
        cipher: &DestinationCipher,
        now: DateTime<Utc>,
    ) -> Result<(), LedgerError> {
        let stored_ref = cipher.stored_ref(tenant_id, subscriber_ref)?;
        let sealed = seal_contact(cipher, tenant_id, stored_ref, channel, destination)?;
        let mut conn = self.pool.acquire().await?;
        upsert_contacts(&mut conn, &[sealed], now)
            .await
            .map_err(|e| match e {
                LedgerError::InvalidInput(_) => LedgerError::UnknownTenant(tenant_id.as_uuid()),
                other => other,
            })
    }
}

/// The zones a local time falls back on when its reminder gives none: the subscriber's,
/// else the tenant's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FallbackZones {
    pub subscriber: Option<Zone>,
    pub tenant: Option<Zone>,
}

impl Ledger {
    /// The subscriber's zone as their contacts keep it (`None` when they have none, or no
    /// contacts) and the tenant's default zone, as the ledger has them now, in one
    /// statement. Needs the cipher's subscriber key.
    pub async fn fallback_zones(
        &self,
        tenant_id: TenantId,
        subscriber_ref: &SubscriberRef,
        cipher: &DestinationCipher,
    ) -> Result<FallbackZones, LedgerError> {
        let stored_ref = cipher.stored_ref(tenant_id, subscriber_ref)?;
        let (subscriber, tenant): (Option<String>, Option<String>) = sqlx::query_as(
            "SELECT (SELECT time_zone FROM contacts
                     WHERE tenant_id = $1 AND subscriber_ref = $2 AND time_zone IS NOT NULL
                     ORDER BY updated_at DESC, channel LIMIT 1),
                    (SELECT time_zone FROM tenants WHERE id = $1)",
        )
        .bind(tenant_id.as_uuid())
        .bind(&stored_ref)
        .fetch_one(&self.pool)
        .await?;
        Ok(FallbackZones {
            subscriber: subscriber
                .map(|name| stored_zone("contacts", &name))
                .transpose()?,
            tenant: tenant
                .map(|name| stored_zone("tenants", &name))
                .transpose()?,
        })
    }

    /// The subscriber's zone, as their contacts keep it ([`Ledger::fallback_zones`]).
    pub async fn subscriber_zone(
        &self,
        tenant_id: TenantId,
        subscriber_ref: &SubscriberRef,
        cipher: &DestinationCipher,
    ) -> Result<Option<Zone>, LedgerError> {
        Ok(self
            .fallback_zones(tenant_id, subscriber_ref, cipher)
            .await?
            .subscriber)
    }
}

/// A zone as a table stores it, read against the compiled-in database.
pub(crate) fn stored_zone(table: &'static str, name: &str) -> Result<Zone, LedgerError> {
    Zone::parse(name).map_err(|_| {
        LedgerError::corrupt(
            table,
            format_args!(
                "time_zone is not a zone of tz database {}",
                nudge_domain::TZDB_VERSION
            ),
        )
    })
}

/// What one pass of [`Ledger::convert_plaintext_subscribers`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SubscriberConversion {
    /// Subscribers (tenant + reference) converted; 0 when none is left.
    pub subscribers: u64,
    pub contacts: u64,
    pub reminders: u64,
}

#[derive(sqlx::FromRow)]
struct PlaintextContact {
    tenant_id: uuid::Uuid,
    subscriber_ref: String,
    channel: String,
    destination_ciphertext: Vec<u8>,
    updated_at: DateTime<Utc>,
}

/// Serialises conversions: two `nudgectl migrate` at once take turns, batch by batch.
const CONVERSION_LOCK: i64 = 0x6e75_6467_6501;

impl Ledger {
    /// Converts up to `batch` subscribers still stored in plaintext (rows written before
    /// the keyed hash) to their stored form, in one transaction: each one's contacts are
    /// opened under the old associated data and sealed again under the new one, and its
    /// reminders are rewritten with them, so a send's join of reminder and contact sees both
    /// sides converted or neither. Where a contact was written again since (in the new form),
    /// the more recently updated destination is kept. Call until it converts none.
    pub async fn convert_plaintext_subscribers(
        &self,
        cipher: &DestinationCipher,
        batch: u32,
    ) -> Result<SubscriberConversion, LedgerError> {
        let key = cipher.subscriber_key()?;
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(CONVERSION_LOCK)
            .execute(&mut *tx)
            .await?;
        let subscribers: Vec<(uuid::Uuid, String)> = sqlx::query_as(
            "SELECT tenant_id, subscriber_ref FROM (
                 SELECT tenant_id, subscriber_ref FROM contacts WHERE NOT subscriber_ref_keyed
                 UNION
                 SELECT tenant_id, subscriber_ref FROM reminders WHERE NOT subscriber_ref_keyed
             ) s LIMIT $1",
        )
        .bind(i64::from(batch.max(1)))
        .fetch_all(&mut *tx)
        .await?;
        if subscribers.is_empty() {
            return Ok(SubscriberConversion::default());
        }
        let tenants: Vec<uuid::Uuid> = subscribers.iter().map(|s| s.0).collect();
        let plain: Vec<&str> = subscribers.iter().map(|s| s.1.as_str()).collect();
        let stored: Vec<String> = subscribers
            .iter()
            .map(|(tenant, r)| key.stored_ref(TenantId::from_uuid(*tenant), r))
            .collect();
        let stored_of: std::collections::HashMap<(uuid::Uuid, &str), &str> = subscribers
            .iter()
            .zip(&stored)
            .map(|((tenant, r), s)| ((*tenant, r.as_str()), s.as_str()))
            .collect();

        let old: Vec<PlaintextContact> = sqlx::query_as(
            "DELETE FROM contacts c USING UNNEST($1::uuid[], $2::text[]) AS k(tenant_id, subscriber_ref)
             WHERE c.tenant_id = k.tenant_id AND c.subscriber_ref = k.subscriber_ref
               AND NOT c.subscriber_ref_keyed
             RETURNING c.tenant_id, c.subscriber_ref, c.channel, c.destination_ciphertext,
                       c.updated_at",
        )
        .bind(&tenants)
        .bind(&plain)
        .fetch_all(&mut *tx)
        .await?;
        let mut sealed = Vec::with_capacity(old.len());
        for contact in &old {
            let tenant_id = TenantId::from_uuid(contact.tenant_id);
            let channel: Channel = contact
                .channel
                .parse()
                .map_err(|e| LedgerError::corrupt("contacts", e))?;
            let destination = cipher.open(
                &contact.destination_ciphertext,
                &destination_aad(tenant_id, &contact.subscriber_ref, channel),
            )?;
            let stored_ref = stored_of
                .get(&(contact.tenant_id, contact.subscriber_ref.as_str()))
                .copied()
                .ok_or_else(|| LedgerError::corrupt("contacts", "subscriber not in the batch"))?;
            let resealed = cipher.seal(
                &destination,
                &destination_aad(tenant_id, stored_ref, channel),
            )?;
            sealed.push((
                contact.tenant_id,
                stored_ref,
                channel,
                resealed,
                contact.updated_at,
            ));
        }
        if !sealed.is_empty() {
            sqlx::query(
                "INSERT INTO contacts (tenant_id, subscriber_ref, subscriber_ref_keyed, channel,
                                       destination_ciphertext, updated_at)
                 SELECT c.tenant_id, c.subscriber_ref, true, c.channel, c.ciphertext, c.updated_at
                 FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::timestamptz[])
                      AS c(tenant_id, subscriber_ref, channel, ciphertext, updated_at)
                 ON CONFLICT (tenant_id, subscriber_ref, channel)
                 DO UPDATE SET destination_ciphertext = EXCLUDED.destination_ciphertext,
                               updated_at = EXCLUDED.updated_at
                 WHERE contacts.updated_at < EXCLUDED.updated_at",
            )
            .bind(sealed.iter().map(|c| c.0).collect::<Vec<_>>())
            .bind(sealed.iter().map(|c| c.1).collect::<Vec<_>>())
            .bind(sealed.iter().map(|c| c.2.as_str()).collect::<Vec<_>>())
            .bind(sealed.iter().map(|c| c.3.as_slice()).collect::<Vec<_>>())
            .bind(sealed.iter().map(|c| c.4).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
        }
        let reminders = sqlx::query(
            "UPDATE reminders r SET subscriber_ref = k.stored, subscriber_ref_keyed = true
             FROM UNNEST($1::uuid[], $2::text[], $3::text[]) AS k(tenant_id, plain, stored)
             WHERE r.tenant_id = k.tenant_id AND r.subscriber_ref = k.plain
               AND NOT r.subscriber_ref_keyed",
        )
        .bind(&tenants)
        .bind(&plain)
        .bind(&stored)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(SubscriberConversion {
            subscribers: subscribers.len() as u64,
            contacts: old.len() as u64,
            reminders,
        })
    }

    /// Subscribers (tenant + reference) still stored in plaintext.
    pub async fn plaintext_subscribers(&self) -> Result<u64, LedgerError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (
                 SELECT tenant_id, subscriber_ref FROM contacts WHERE NOT subscriber_ref_keyed
                 UNION
                 SELECT tenant_id, subscriber_ref FROM reminders WHERE NOT subscriber_ref_keyed
             ) s",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
