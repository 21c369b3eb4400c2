use nudge_domain::{DeliveryState, IllegalTransition};

/// What can go wrong in the ledger. Callers match on the domain variants; `Database` and
/// `Migrate` are infrastructure failures to report with their chain.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("database error")]
    Database(#[from] sqlx::Error),

    #[error("failed to apply migrations")]
    Migrate(#[from] sqlx::migrate::MigrateError),

    #[error(transparent)]
    IllegalTransition(#[from] IllegalTransition),

    /// The same client event id was posted before with different content.
    #[error("event id already used for a different reminder (tenant {tenant_id})")]
    EventConflict { tenant_id: uuid::Uuid },

    #[error("invalid input: {0}")]
    InvalidInput(&'static str),

    #[error("unknown tenant {0}")]
    UnknownTenant(uuid::Uuid),

    /// A channel has at most one redrive running or paused at a time.
    #[error("redrive {id} is already active on {channel}: resume, wait for or cancel it first")]
    RedriveActive {
        channel: nudge_domain::Channel,
        id: nudge_domain::RedriveId,
    },

    #[error("no redrive with id {0}")]
    UnknownRedrive(nudge_domain::RedriveId),

    /// The change does not apply to a redrive in this state.
    #[error("redrive {id} is {}: not possible from that state", state.as_str())]
    RedriveState {
        id: nudge_domain::RedriveId,
        state: crate::RedriveState,
    },

    /// The lease was taken away (expired and reaped, or the delivery moved on) before the
    /// outcome was recorded: the outcome is not applied.
    #[error("lease on delivery {delivery_id} was lost (now {state})")]
    LeaseLost {
        delivery_id: uuid::Uuid,
        state: DeliveryState,
    },

    /// A row that the schema's constraints should have made impossible.
    #[error("corrupt row in {table}: {reason}")]
    Corrupt { table: &'static str, reason: String },

    #[error("destination encryption failed")]
    Crypto,

    /// A reminder or contact was to be written without `crypto.subscriber_key`: subscriber
    /// references are stored only as a keyed hash.
    /// A retention batch would have deleted more rows of a table than its run counted: the
    /// batch was rolled back (the database's message names the table and counts).
    #[error("retention run overran its counts: {0}")]
    RetentionOverrun(String),

    /// Another retention run holds the lock (one run at a time across replicas).
    #[error("another retention run is in progress")]
    RetentionRunning,

    /// The audit export of a retention batch could not be written: the batch was rolled back.
    #[error("failed to write the retention export")]
    Export(#[source] std::io::Error),

    #[error("writing a subscriber reference needs the subscriber key (crypto.subscriber_key)")]
    SubscriberKeyMissing,

    /// A signing secret sealed with the tenant secret key was to be opened without it.
    #[error(
        "opening a tenant's signing secret needs the tenant secret key (crypto.tenant_secret_key)"
    )]
    TenantSecretKeyMissing,
}

impl LedgerError {
    pub(crate) fn corrupt(table: &'static str, reason: impl std::fmt::Display) -> Self {
        Self::Corrupt {
            table,
            reason: reason.to_string(),
        }
    }

    /// The database refused the statement's data: a constraint (SQLSTATE class 23) or a
    /// value out of its type's range (class 22). Trying the same rows again fails the same
    /// way; trying them apart finds the one at fault.
    pub fn is_data_refused(&self) -> bool {
        match self {
            LedgerError::Database(sqlx::Error::Database(db)) => db
                .code()
                .is_some_and(|code| code.starts_with("23") || code.starts_with("22")),
            _ => false,
        }
    }
}
