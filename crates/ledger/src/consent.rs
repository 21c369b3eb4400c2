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

/// One entry of a consent history: a destination's (no category) or a preference's (its
/// category). Holds no destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsentEntry {
    pub state: ConsentState,
    pub source: ConsentSource,
    /// The category of a preference's entry; none for a destination's.
    pub category: Option<String>,
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
        if keyword.state == ConsentState::OptedIn {
            // A provider's flag on a contact holding this destination is an opt-out too (the
            // lease reads both): the patient's START clears it with the destination's.
            sqlx::query(
                "UPDATE contacts c SET opted_out_at = NULL
                 FROM unnest($1::uuid[], $2::bytea[]) AS x(tenant_id, digest)
                 WHERE c.tenant_id = x.tenant_id AND c.channel = $3
                   AND c.destination_digest = x.digest AND c.opted_out_at IS NOT NULL",
            )
            .bind(&tenants)
            .bind(&digests)
            .bind(keyword.channel.as_str())
            .execute(&mut *tx)
            .await?;
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
                    category: None,
                    actor: r.actor,
                    keyword: r.keyword,
                    correlation_id: r.correlation_id,
                    recorded_at: r.at,
                })
            })
            .collect()
    }
}

/// A subscriber's consent: that of each destination they hold now, and the history of those
/// destinations (one page of it, oldest first). No destination in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberConsent {
    /// Per channel the subscriber has a destination on whose consent ever changed.
    pub current: Vec<(Channel, DestinationConsent)>,
    /// History entries after the page's start, at most the page's size, by id.
    pub entries: Vec<(i64, Channel, ConsentEntry)>,
    /// The id to ask the next page after, when there are more entries.
    pub next_after: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct HistoryRow {
    id: i64,
    channel: String,
    category: Option<String>,
    #[sqlx(flatten)]
    row: ConsentRow,
}

/// The consent of each destination `stored_ref` holds in `tenant`, per channel, where it ever
/// changed.
pub(crate) async fn destinations_of(
    conn: &mut sqlx::PgConnection,
    tenant: TenantId,
    stored_ref: &str,
) -> Result<Vec<(Channel, DestinationConsent)>, LedgerError> {
    let rows: Vec<(String, ConsentRow)> = sqlx::query_as::<_, HistoryRow>(
        "SELECT 0::bigint AS id, k.channel, NULL::text AS category, k.state, k.source, k.actor,
                k.keyword, k.correlation_id, k.changed_at AS at
         FROM contacts c
         JOIN destination_consent k ON k.tenant_id = c.tenant_id AND k.channel = c.channel
                                   AND k.destination_digest = c.destination_digest
         WHERE c.tenant_id = $1 AND c.subscriber_ref = $2
         ORDER BY k.channel",
    )
    .bind(tenant.as_uuid())
    .bind(stored_ref)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|r| (r.channel, r.row))
    .collect();
    rows.into_iter()
        .map(|(c, row)| {
            let (state, source) = row.parse()?;
            Ok((
                c.parse::<Channel>()
                    .map_err(|e| LedgerError::corrupt("destination_consent", e))?,
                DestinationConsent {
                    state,
                    source,
                    actor: row.actor,
                    changed_at: row.at,
                },
            ))
        })
        .collect()
}

/// The most entries one page of a subscriber's consent history holds.
pub const CONSENT_PAGE_MAX: u32 = 500;

impl Ledger {
    /// The consent of the destinations `subscriber_ref` holds now in `tenant`, with one page
    /// of their history after `after` (an entry id; none: from the start) of at most `limit`
    /// entries ([`CONSENT_PAGE_MAX`] at most). The history is the destinations', so it holds
    /// what was recorded for a number before this subscriber was posted with it. `None` when
    /// the subscriber holds no destination (never posted, or erased).
    pub async fn subscriber_consent(
        &self,
        cipher: &DestinationCipher,
        tenant: TenantId,
        subscriber_ref: &nudge_domain::SubscriberRef,
        after: Option<i64>,
        limit: u32,
    ) -> Result<Option<SubscriberConsent>, LedgerError> {
        let stored_ref = cipher.stored_ref(tenant, subscriber_ref)?;
        let limit = limit.clamp(1, CONSENT_PAGE_MAX);
        let mut tx = self.pool.begin().await?;
        let held: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM contacts WHERE tenant_id = $1 AND subscriber_ref = $2)
                 OR EXISTS (SELECT 1 FROM subscriber_preferences
                            WHERE tenant_id = $1 AND subscriber_ref = $2)",
        )
        .bind(tenant.as_uuid())
        .bind(&stored_ref)
        .fetch_one(&mut *tx)
        .await?;
        if !held {
            return Ok(None);
        }
        let current = destinations_of(&mut tx, tenant, &stored_ref).await?;
        // The history of the destinations the subscriber holds, and of their preferences (by
        // the subjects of their preferences' rows).
        let rows: Vec<HistoryRow> = sqlx::query_as(
            "SELECT h.id, h.channel, h.category, h.state, h.source, h.actor, h.keyword,
                    h.correlation_id, h.recorded_at AS at
             FROM (SELECT h.* FROM contacts c
                   JOIN consent_history h ON h.tenant_id = c.tenant_id AND h.channel = c.channel
                                         AND h.destination_digest = c.destination_digest
                   WHERE c.tenant_id = $1 AND c.subscriber_ref = $2 AND h.id > $3
                   UNION ALL
                   SELECT h.* FROM subscriber_preferences p
                   JOIN consent_history h ON h.subject = p.subject
                   WHERE p.tenant_id = $1 AND p.subscriber_ref = $2 AND h.id > $3) h
             ORDER BY h.id
             LIMIT $4",
        )
        .bind(tenant.as_uuid())
        .bind(&stored_ref)
        .bind(after.unwrap_or(0))
        .bind(i64::from(limit) + 1)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let channel = |text: &str| {
            text.parse::<Channel>()
                .map_err(|e| LedgerError::corrupt("consent_history", e))
        };
        let more = rows.len() > limit as usize;
        let mut entries = Vec::with_capacity(rows.len().min(limit as usize));
        for r in rows.into_iter().take(limit as usize) {
            let (state, source) = r.row.parse()?;
            entries.push((
                r.id,
                channel(&r.channel)?,
                ConsentEntry {
                    state,
                    source,
                    category: r.category,
                    actor: r.row.actor,
                    keyword: r.row.keyword,
                    correlation_id: r.row.correlation_id,
                    recorded_at: r.row.at,
                },
            ));
        }
        let next_after = if more {
            entries.last().map(|(id, _, _)| *id)
        } else {
            None
        };
        Ok(Some(SubscriberConsent {
            current,
            entries,
            next_after,
        }))
    }
}

/// One entry of a tenant's consent history as exported: a destination only as its keyed
/// digest (hex), which groups a destination's entries and names nothing without the key; a
/// preference by its subject, which names no one once the subscriber is erased.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ExportedConsent {
    pub id: i64,
    pub channel: Channel,
    /// A destination's entry: its keyed digest (hex).
    pub destination_digest: Option<String>,
    /// A preference's entry: its subject (the same for every change of one preference) and
    /// category.
    pub subject: Option<uuid::Uuid>,
    pub category: Option<String>,
    pub state: ConsentState,
    pub source: ConsentSource,
    pub actor: String,
    pub keyword: Option<String>,
    pub correlation_id: Option<String>,
    pub recorded_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct ExportRow {
    id: i64,
    channel: String,
    destination_digest: Option<Vec<u8>>,
    subject: Option<uuid::Uuid>,
    category: Option<String>,
    #[sqlx(flatten)]
    row: ConsentRow,
}

impl Ledger {
    /// A page of `tenant`'s whole consent history after entry `after`, at most `limit`
    /// entries ([`CONSENT_PAGE_MAX`] at most), by id.
    pub async fn consent_history_page(
        &self,
        tenant: TenantId,
        after: i64,
        limit: u32,
    ) -> Result<Vec<ExportedConsent>, LedgerError> {
        let rows: Vec<ExportRow> = sqlx::query_as(
            "SELECT id, channel, destination_digest, subject, category, state, source, actor,
                    keyword, correlation_id, recorded_at AS at
             FROM consent_history
             WHERE tenant_id = $1 AND id > $2
             ORDER BY id
             LIMIT $3",
        )
        .bind(tenant.as_uuid())
        .bind(after)
        .bind(i64::from(limit.clamp(1, CONSENT_PAGE_MAX)))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|r| {
                let (state, source) = r.row.parse()?;
                Ok(ExportedConsent {
                    id: r.id,
                    channel: r
                        .channel
                        .parse()
                        .map_err(|e| LedgerError::corrupt("consent_history", e))?,
                    destination_digest: r
                        .destination_digest
                        .map(|d| d.iter().map(|b| format!("{b:02x}")).collect()),
                    subject: r.subject,
                    category: r.category,
                    state,
                    source,
                    actor: r.row.actor,
                    keyword: r.row.keyword,
                    correlation_id: r.row.correlation_id,
                    recorded_at: r.row.at,
                })
            })
            .collect()
    }
}
