use chrono::{DateTime, Utc};
use nudge_domain::{Channel, SubscriberRef, TenantId};

use crate::crypto::{Destination, DestinationCipher};
use crate::deliveries::LeasedDelivery;
use crate::reminders::content_aad;
use crate::{Ledger, LedgerError};

fn destination_aad(tenant_id: TenantId, subscriber_ref: &str, channel: Channel) -> Vec<u8> {
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

    /// Loads and decrypts the destination of a leased delivery, just before the send.
    /// None when the subscriber has no destination on that channel.
    pub async fn destination_for(
        &self,
        lease: &LeasedDelivery,
        cipher: &DestinationCipher,
    ) -> Result<Option<Destination>, LedgerError> {
        let row: Option<(String, Vec<u8>)> = sqlx::query_as(
            "SELECT c.subscriber_ref, c.destination_ciphertext
             FROM reminders r
             JOIN contacts c ON c.tenant_id = r.tenant_id AND c.subscriber_ref = r.subscriber_ref
             WHERE r.id = $1 AND c.channel = $2",
        )
        .bind(lease.reminder_id.as_uuid())
        .bind(lease.channel.as_str())
        .fetch_optional(&self.pool)
        .await?;
        let Some((subscriber_ref, sealed)) = row else {
            return Ok(None);
        };
        let plain = cipher.open(
            &sealed,
            &destination_aad(lease.tenant_id, &subscriber_ref, lease.channel),
        )?;
        let text = String::from_utf8(plain).map_err(|_| LedgerError::Crypto)?;
        Ok(Some(Destination::new(text)))
    }

    /// Loads and decrypts a leased delivery's message content, if it has any.
    pub async fn content_for(
        &self,
        lease: &LeasedDelivery,
        cipher: &DestinationCipher,
    ) -> Result<Option<Vec<u8>>, LedgerError> {
        let sealed: Option<Option<Vec<u8>>> =
            sqlx::query_scalar("SELECT content_ciphertext FROM reminders WHERE id = $1")
                .bind(lease.reminder_id.as_uuid())
                .fetch_optional(&self.pool)
                .await?;
        sealed
            .flatten()
            .map(|s| cipher.open(&s, &content_aad(lease.tenant_id, lease.reminder_id)))
            .transpose()
    }
}
