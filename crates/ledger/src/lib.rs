//! The send ledger: PostgreSQL, through sqlx, as the one authority on every delivery.
//!
//! It owns the schema (`migrations/` at the workspace root, embedded as [`MIGRATOR`]) and
//! every statement that reads or changes it. A queue message is only a pointer: whether a
//! delivery is new, owed, in flight, done or dead is decided here, by conditional updates.
//!
//! It must never: hold a transaction open across network I/O (a claim commits before its
//! message is published, see [`Ledger::claim_due`]); evaluate a time condition with a
//! process's clock (statements use PostgreSQL's, see [`LedgerTime`]); decide a delivery's next state itself (that is
//! `nudge_domain::decide`, the ledger only records it); store a destination or message
//! content in plaintext; log a destination, subscriber reference or content.
//!
//! The delivery statements take a [`LedgerTime`]: PostgreSQL's clock in every process, a fixed
//! instant in tests that move time instead of sleeping. Functions that only record an
//! operator's or client's action still take `now` from the caller.

mod age;
mod audit;
mod buckets;
mod channels;
mod consent;
mod console;
mod contacts;
mod crypto;
mod dead_letters;
mod deliveries;
mod dlq;
mod error;
mod estimate;
mod events;
mod export;
mod failover;
mod gauges;
pub mod input;
mod intake;
mod preferences;
mod quiet;
mod receipts;
mod redrive;
mod reminders;
mod republish;
mod reschedule;
mod restore;
mod retention;
mod schedules;
mod series;
mod status;
mod tenants;
#[cfg(feature = "test-support")]
pub mod test_support;
mod trace;
mod webhooks;
mod worker_accounts;

pub use age::AgeBand;
pub use audit::{AuditEntry, Operator};
pub use buckets::{BucketReading, Feedback, FeedbackApplied, RateBucket};
pub use channels::{ChannelControl, DrainChange, OwnerChange, ProducerAck};
pub use consent::{
    CONSENT_PAGE_MAX, ConsentEntry, DestinationConsent, ExportedConsent, InboundKeyword,
    InboundRecorded, SubscriberConsent,
};
pub use console::{
    AuditFilter, AuditLine, CONSOLE_TOKEN_MAX_TTL, ConsoleRole, ConsoleSecret, ConsoleToken,
    CreatedConsoleToken, LedgerSample, console_token_digest,
};
pub use contacts::{FallbackZones, SubscriberConversion};
pub use crypto::{Destination, DestinationCipher, DestinationDigest, SealedWith, SubscriberKey};
pub use dead_letters::{DeadLetter, DeadLetterAction};
pub use deliveries::{
    Attempt, AttemptRecord, CONTACT_OPTED_OUT, DeliveryRecord, DueDelivery, FenceRefused,
    LeaseBatch, LeaseOutcome, LeaseResult, LeasedDelivery, LedgerTime, Material, MessagePointer,
    OutcomeToRecord, QuietRule, Reaped, Recorded, RenewedLease, SendSlot, Slotted, WorkerRoutes,
};
pub use dlq::{DeadLetterCount, DlqGroup, DlqReport};
pub use error::{LedgerError, is_unavailable};
pub use estimate::{Backlog, OwedDelivery};
pub use events::{
    DeliveryEvent, DeliveryEventKind, EVENTS_PAGE_MAX, EventsPage, SEQUENCE_BATCH_MAX,
    SequencedEvents,
};
pub use export::IncidentAttempt;
pub use gauges::{AwaitingOperator, BucketGauge, DrainFlag, LedgerGauges, TenantChannelWork};
pub use intake::{
    Cancellation, Erasure, IntakeTenant, MAX_ACTIVE_SECRETS, ReminderChannelState, ReminderStatus,
    SigningSecret,
};
pub use preferences::{
    CategoryCreated, CategoryInfo, MAX_PREFERENCE_CHANGES, Preference, PreferenceAuthor,
    PreferenceChange, Preferences,
};
pub use quiet::SubscriberQuietHours;
pub use receipts::{Receipt, ReceiptOutcome, ReceiptRecorded};
pub use redrive::{
    AutoPause, Exclusion, ReasonCount, RedriveFilter, RedrivePlan, RedriveState, RedriveStatus,
    RedriveTick, StartedRedrive,
};
pub use reminders::{
    CreatedReminder, ImportOutcome, ImportReminder, MAX_CONTENT_BYTES, MAX_CORRELATION_ID_BYTES,
    MAX_DESTINATION_BYTES, NewReminder, WINDOW_BATCH, WindowOutcome,
};
pub use reschedule::{ReplacedBy, Replacement, RescheduleOutcome, Rescheduled};
pub use restore::{
    ConfirmedSend, IdentityEvent, IdentityObservation, IdentityVerdict, RecordedIdentity,
    RestoreCount, RestoreReconciliation, RestoreStatus, SendingRefused, ServerIdentity,
};
pub use retention::{
    Blocker, DeletedDelivery, DeliveryCount, KeepReason, RetentionBatch, RetentionPlan,
    RetentionRun, RetentionTable, RunEnd, RunState, RunSummary, TableCount,
};
pub use schedules::Schedule;
pub use series::{
    MAX_SERIES_ID_LEN, NewSeries, RESERVED_EVENT_ID, SHOWN_OCCURRENCES, SeriesCancellation,
    SeriesOutcome, SeriesStatus, SeriesSummary, check_series_id, is_occurrence_event_id,
    occurrence_event_id,
};
pub use status::{ChannelStatus, TenantLateness, TenantLatenessReport};
pub use tenants::Tenant;
pub use trace::{
    AttemptTiming, CLOCK_TOLERANCE_MS, DeliveryTrace, EarlyStart, Findings, LeaseHeld, MatchedAs,
    RedriveMembership, ReminderSummary, RescheduleEntry, Timeline, Trace, TraceError, TraceId,
    TraceIdError, findings,
};
pub use webhooks::{
    ClaimedWebhook, FailureRecorded, Fence, TenantWebhook, WEBHOOK_URL_MAX, WebhookCounts,
    WebhookFailure, WebhookSecret, WebhookSet, WebhookTarget, check_webhook_url,
};
pub use worker_accounts::{ANNOUNCE_EVERY, AnnouncedAccount, AwaitingAccount, HOLD_FOR};

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// The schema, embedded at build time from the workspace's `migrations/`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

#[cfg(test)]
mod migration_checksums;

/// How long a pooled connection may sit idle and still be handed out without a ping.
pub(crate) const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// The sender a ledger handle works for unless told otherwise ([`Ledger::for_sender`]).
pub const DEFAULT_SENDER: &str = "nudge";

/// A handle on the ledger. Cheap to clone: a connection pool and the name of the sender
/// (`deliveries.owner`) whose work this process claims and leases.
#[derive(Debug, Clone)]
pub struct Ledger {
    pool: PgPool,
    sender: std::sync::Arc<str>,
}

impl Ledger {
    /// Connects a pool. Fails fast (within `database.acquire_timeout_ms`) when the database
    /// is down or does not take writes (a standby, a read-only server: see `failover`), so a
    /// binary started against the wrong URL says so instead of hanging. Every
    /// connection gets the section's statement, lock and idle-in-transaction timeouts, so a
    /// stalled peer holding a row lock cannot stall this process past them.
    pub async fn connect(config: &nudge_config::DatabaseConfig) -> Result<Self, LedgerError> {
        let options: PgConnectOptions =
            config.url.expose().parse().map_err(LedgerError::Database)?;
        // Statements are logged by sqlx at info level by default, and they carry values bound
        // to placeholders only as `$n`; still, keep them at debug so logs stay about outcomes.
        let options = options
            .log_statements(tracing::log::LevelFilter::Debug)
            .options([
                ("statement_timeout", config.statement_timeout_ms.to_string()),
                ("lock_timeout", config.lock_timeout_ms.to_string()),
                (
                    "idle_in_transaction_session_timeout",
                    config.idle_in_transaction_timeout_ms.to_string(),
                ),
            ]);
        let suspicion = failover::Suspicion::new(config.max_connections);
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(Duration::from_millis(config.acquire_timeout_ms))
            // Only a primary that takes writes is a ledger (see `failover`).
            .after_connect(|conn, _| Box::pin(failover::refuse_read_only(conn)))
            // sqlx pings every connection before handing it out: one round trip more per
            // transaction (two per intake post). A connection back from use within
            // `PING_AFTER_IDLE` is handed out as it is; one idle longer is checked first
            // (does its server still take writes?), so a connection the database dropped
            // while it sat is replaced, not failed on. After a statement of this process
            // found the ledger away, every connection is checked (see `failover`).
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                let suspicion = suspicion.clone();
                Box::pin(async move { suspicion.before_acquire(conn, meta.idle_for).await })
            })
            .connect_with(options)
            .await?;
        Ok(Self::from_pool(pool))
    }

    /// Wraps an existing pool (tests get one per fresh database from `#[sqlx::test]`).
    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            sender: DEFAULT_SENDER.into(),
        }
    }

    /// The same ledger, claiming and leasing only deliveries owned by `sender` (the relay's
    /// `producer.owner`, a worker's `worker.owner`): work handed to another sender with
    /// `nudgectl owner set` is left to it.
    pub fn for_sender(mut self, sender: &str) -> Result<Self, LedgerError> {
        if !is_owner_name(sender) {
            return Err(LedgerError::InvalidInput(
                "an owner is 1 to 64 of [a-z0-9_-], starting with a letter or digit",
            ));
        }
        self.sender = sender.into();
        Ok(self)
    }

    /// The sender this handle works for.
    pub fn sender(&self) -> &str {
        &self.sender
    }

    /// Applies every migration not yet applied. Safe to run concurrently and repeatedly.
    pub async fn migrate(&self) -> Result<(), LedgerError> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// One round trip to the database: whether it answers (readiness probes).
    pub async fn ping(&self) -> Result<(), LedgerError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// An owner name as `deliveries.owner` and `channel_controls.owner` accept it.
pub fn is_owner_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    (1..=64).contains(&bytes.len())
        && bytes[0].is_ascii_alphanumeric()
        && !bytes[0].is_ascii_uppercase()
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_' || *b == b'-')
}
