//! Consent of a destination (`destination_consent`, decision 0505): whether a number, an
//! address or a token may be reached on its channel, kept by the destination's keyed digest
//! so that it outlives the subscriber it was posted for.
//!
//! Written by: a patient's inbound keyword ([`Ledger::record_inbound_keyword`], every tenant
//! that sends through the account the patient replied to); a provider's word that the
//! recipient opted out, in the statement that records the attempt or the receipt that said so
//! (`deliveries::record`, `receipts`). Every write is appended to `consent_history` by a
//! trigger: no path here writes the history itself. Read by the lease and the fence before
//! every send (`deliveries::lease`): an opted-out destination is never sent to.

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, ConsentSource, ConsentState, ProviderAccount, TenantId};

use crate::crypto::{Destination, DestinationCipher};
use crate::{Ledger, LedgerError, LedgerTime};

/// A patient's reply that changes consent, verified by the intake. `destination` is the
/// number that replied; `provider_event` the provider's identity of the message (the replay
/// guard: one message changes a tenant's consent once).
#[derive(Debug)]
pub struct InboundKeyword<'a> {
    pub account: &'a ProviderAccount,
    pub channel: Channel,
    pub destination: &'a Destination,
    pub state: ConsentState,
    /// The keyword as received (trimmed, at most 64 characters).
    pub keyword: &'a str,
    pub provider_event: &'a str,
    pub correlation_id: Option<&'a str>,
}

/// What became of an inbound keyword.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboundRecorded {
    /// Recorded for this many tenants (those that send through the account on the channel;
    /// none when no tenant does).
    Recorded { tenants: usize },
    /// This message was recorded before: nothing changed.
    Replay,
}

/// A destination's consent as it stands: its last change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DestinationConsent {
    pub state: ConsentState,
    pub source: ConsentSource,
    pub actor: String,
    pub changed_at: DateTime<Utc>,
}

/// One entry of a destination's consent history. Holds no destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsentEntry {
    pub state: ConsentState,
    pub source: ConsentSource,
    pub actor: String,
    pub keyword: Option<String>,
    pub correlation_id: Option<String>,
    pub recorded_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct ConsentRow {
    state: String,
    source: String,
    actor: String,
    keyword: Option<String>,
    correlation_id: Option<String>,
    at: DateTime<Utc>,
}

impl ConsentRow {
    fn parse(&self) -> Result<(ConsentState, ConsentSource), LedgerError> {
        Ok((
            ConsentState::parse(&self.state)
                .ok_or_else(|| LedgerError::corrupt("destination_consent", "state"))?,
            ConsentSource::parse(&self.source)
                .ok_or_else(|| LedgerError::corrupt("destination_consent", "source"))?,
        ))
    }
}

/// The tenants that send through `account` on `channel`: those routed to it, and, when a
/// worker ever announced it as its default for the channel, every tenant without an account
/// of its own there.
const TENANTS_OF_ACCOUNT: &str = "SELECT t.id
    FROM tenants t
    LEFT JOIN tenant_channels tc ON tc.tenant_id = t.id AND tc.channel = $2
    WHERE tc.provider_account = $1
       OR (tc.provider_account IS NULL AND EXISTS (
               SELECT 1 FROM worker_accounts w
               WHERE w.channel = $2 AND w.provider_account = $1
                 AND w.default_announced_at IS NOT NULL))
    ORDER BY t.id";

/// Every write of an inbound keyword, one row per tenant. Written whether or not it changes
/// the state: the history keeps every keyword received, with its time.
const UPSERT_INBOUND: &str = "INSERT INTO destination_consent
        (tenant_id, channel, destination_digest, state, source, actor, keyword, correlation_id,
         provider_event, changed_at)
    SELECT x.tenant_id, $3, x.digest, $4, 'inbound_keyword', $5, $6, $7, $8, COALESCE($9, now())
    FROM unnest($1::uuid[], $2::bytea[]) AS x(tenant_id, digest)
    ORDER BY x.tenant_id
    ON CONFLICT (tenant_id, channel, destination_digest) DO UPDATE
    SET state = EXCLUDED.state, source = EXCLUDED.source, actor = EXCLUDED.actor,
        keyword = EXCLUDED.keyword, correlation_id = EXCLUDED.correlation_id,
        provider_event = EXCLUDED.provider_event, changed_at = EXCLUDED.changed_at";

impl Ledger {
    /// Records a patient's keyword for every tenant that sends through `account` on the
    /// channel, in one transaction: the destination's consent for each becomes `state`, with
    /// its history entry. A message recorded before (its `provider_event`) changes nothing.
    pub async fn record_inbound_keyword(
        &self,
        cipher: &DestinationCipher,
        keyword: &InboundKeyword<'_>,
        at: LedgerTime,
    ) -> Result<InboundRecorded, LedgerError> {
        if keyword.provider_event.is_empty() || keyword.provider_event.chars().count() > 200 {
            return Err(LedgerError::InvalidInput(
                "an inbound message's identity is 1 to 200 characters",
            ));
        }
        let mut tx = self.pool.begin().await?;
        let tenants: Vec<uuid::Uuid> = sqlx::query_scalar(TENANTS_OF_ACCOUNT)
            .bind(keyword.account.as_str())
            .bind(keyword.channel.as_str())
            .fetch_all(&mut *tx)
            .await?;
        if tenants.is_empty() {
            return Ok(InboundRecorded::Recorded { tenants: 0 });
        }
        let seen: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM consent_history
                            WHERE tenant_id = ANY($1) AND provider_event = $2)",
        )
        .bind(&tenants)
        .bind(keyword.provider_event)
        .fetch_one(&mut *tx)
        .await?;
        if seen {
            return Ok(InboundRecorded::Replay);
        }
        let digests = tenants
            .iter()
            .map(|t| {
                cipher
                    .destination_digest(
                        TenantId::from_uuid(*t),
                        keyword.channel,
                        keyword.destination,
                    )
                    .map(|d| d.as_bytes().to_vec())
            })
            .collect::<Result<Vec<_>, _>>()?;
        let written = sqlx::query(UPSERT_INBOUND)
            .bind(&tenants)
            .bind(&digests)
            .bind(keyword.channel.as_str())
            .bind(keyword.state.as_str())
            .bind(format!("inbound:{}", keyword.account))
            .bind(keyword.keyword)
            .bind(keyword.correlation_id)
            .bind(keyword.provider_event)
            .bind(at.bind())
            .execute(&mut *tx)
            .await;
        match written {
            Ok(_) => {}
            // The same message, recorded by a concurrent request since the look above.
            Err(sqlx::Error::Database(e))
                if e.constraint() == Some("consent_history_event_idx") =>
            {
                return Ok(InboundRecorded::Replay);
            }
            Err(e) => return Err(e.into()),
        }
        tx.commit().await?;
        Ok(InboundRecorded::Recorded {
            tenants: tenants.len(),
        })
    }

    /// The consent of `destination` on `channel` for `tenant`, if it ever changed.
    pub async fn destination_consent(
        &self,
        cipher: &DestinationCipher,
        tenant: TenantId,
        channel: Channel,
        destination: &Destination,
    ) -> Result<Option<DestinationConsent>, LedgerError> {
        let digest = cipher.destination_digest(tenant, channel, destination)?;
        let row: Option<ConsentRow> = sqlx::query_as(
            "SELECT state, source, actor, keyword, correlation_id, changed_at AS at
             FROM destination_consent
             WHERE tenant_id = $1 AND channel = $2 AND destination_digest = $3",
        )
        .bind(tenant.as_uuid())
        .bind(channel.as_str())
        .bind(digest.as_bytes())
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| {
            let (state, source) = r.parse()?;
            Ok(DestinationConsent {
                state,
                source,
                actor: r.actor,
                changed_at: r.at,
            })
        })
        .transpose()
    }

    /// Every change of the consent of `destination` on `channel` for `tenant`, oldest first.
    pub async fn destination_consent_history(
        &self,
        cipher: &DestinationCipher,
        tenant: TenantId,
        channel: Channel,
        destination: &Destination,
    ) -> Result<Vec<ConsentEntry>, LedgerError> {
        let digest = cipher.destination_digest(tenant, channel, destination)?;
        let rows: Vec<ConsentRow> = sqlx::query_as(
            "SELECT state, source, actor, keyword, correlation_id, recorded_at AS at
             FROM consent_history
             WHERE tenant_id = $1 AND channel = $2 AND destination_digest = $3
             ORDER BY id",
        )
        .bind(tenant.as_uuid())
        .bind(channel.as_str())
        .bind(digest.as_bytes())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|r| {
                let (state, source) = r.parse()?;
                Ok(ConsentEntry {
                    state,
                    source,
                    actor: r.actor,
                    keyword: r.keyword,
                    correlation_id: r.correlation_id,
                    recorded_at: r.at,
                })
            })
            .collect()
    }
}
