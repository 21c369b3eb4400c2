use chrono::{DateTime, Utc};
use nudge_domain::{Channel, SubscriberRef, TenantId};

use crate::crypto::{Destination, DestinationCipher};
use crate::deliveries::LeasedDelivery;
use crate::reminders::content_aad;
use crate::{Ledger, LedgerError};

pub(crate) fn destination_aad(
    tenant_id: TenantId,
    subscriber_ref: &str,
    channel: Channel,
) -> Vec<u8> {
    format!("destination:{tenant_id}:{channel}:{subscriber_ref}").into_bytes()
}

pub(crate) async fn upsert_contact(
    conn: &mut sqlx::PgConnection,
    tenant_id: TenantId,
    subscriber_ref: &SubscriberRef,
    channel: Channel,
    destination: &Destination,
    cipher: &DestinationCipher,
    now: DateTime<Utc>,
) -> Result<(), LedgerError> {
    let sealed = cipher.seal(
        destination.expose().as_bytes(),
        &destination_aad(tenant_id, subscriber_ref.as_str(), channel),
    )?;
    sqlx::query(
        "INSERT INTO contacts (tenant_id, subscriber_ref, channel, destination_ciphertext, updated_at)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (tenant_id, subscriber_ref, channel)
         DO UPDATE SET destination_ciphertext = EXCLUDED.destination_ciphertext,
                       updated_at = EXCLUDED.updated_at",
    )
    .bind(tenant_id.as_uuid())
    .bind(subscriber_ref.as_str())
    .bind(channel.as_str())
    .bind(sealed)
    .bind(now)
    .execute(&mut *conn)
    .await
    .map_err(|e| match &e {
        sqlx::Error::Database(db) if db.is_foreign_key_violation() => {
            LedgerError::UnknownTenant(tenant_id.as_uuid())
        }
        _ => LedgerError::Database(e),
    })?;
    Ok(())
}

#[derive(sqlx::FromRow)]
struct MaterialRow {
    subscriber_ref: String,
    destination_ciphertext: Option<Vec<u8>>,
    content_ciphertext: Option<Vec<u8>>,
}

impl Ledger {
    /// Stores (or replaces) a subscriber's destination for one channel, encrypted.
    pub async fn upsert_contact(
        &self,
        tenant_id: TenantId,
        subscriber_ref: &SubscriberRef,
        channel: Channel,
        destination: &Destination,
        cipher: &DestinationCipher,
        now: DateTime<Utc>,
    ) -> Result<(), LedgerError> {
        let mut conn = self.pool.acquire().await?;
        upsert_contact(
            &mut conn,
            tenant_id,
            subscriber_ref,
            channel,
            destination,
            cipher,
            now,
        )
        .await
    }

    /// What a send needs, in one round trip, just before it: the decrypted destination (None
    /// when the subscriber has none on this channel) and the message content, if any.
    pub async fn send_material(
        &self,
        lease: &LeasedDelivery,
        cipher: &DestinationCipher,
    ) -> Result<(Option<Destination>, Option<Vec<u8>>), LedgerError> {
        let row: Option<MaterialRow> = sqlx::query_as(
            "SELECT r.subscriber_ref, c.destination_ciphertext, r.content_ciphertext
             FROM reminders r
             LEFT JOIN contacts c ON c.tenant_id = r.tenant_id
                                 AND c.subscriber_ref = r.subscriber_ref AND c.channel = $2
             WHERE r.id = $1",
        )
        .bind(lease.reminder_id.as_uuid())
        .bind(lease.channel.as_str())
        .fetch_optional(&self.pool)
        .await?;
        let Some(MaterialRow {
            subscriber_ref,
            destination_ciphertext: destination,
            content_ciphertext: content,
        }) = row
        else {
            return Ok((None, None));
        };
        let destination = destination
            .map(|sealed| {
                let plain = cipher.open(
                    &sealed,
                    &destination_aad(lease.tenant_id, &subscriber_ref, lease.channel),
                )?;
                String::from_utf8(plain)
                    .map(Destination::new)
                    .map_err(|_| LedgerError::Crypto)
            })
            .transpose()?;
        let content = content
            .map(|sealed| cipher.open(&sealed, &content_aad(lease.tenant_id, lease.reminder_id)))
            .transpose()?;
        Ok((destination, content))
    }
}
