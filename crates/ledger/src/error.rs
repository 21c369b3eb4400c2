use nudge_domain::{DeliveryState, IllegalTransition};

/// What can go wrong in the ledger. Callers match on the domain variants; `Database` and
/// `Migrate` are infrastructure failures to report with their chain.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("database error")]
    Database(#[source] sqlx::Error),

    /// The server answered but will not take writes: a standby in recovery, or a server with
    /// `default_transaction_read_only` on (a primary being demoted, a disk-full guard). Never
    /// a valid ledger; the same as being away for every caller.
    #[error("the database is in recovery or read-only: database.url must reach the primary")]
    ReadOnly,

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

    /// A reminder or a series names a category its tenant does not have.
    #[error("the tenant has no category {0:?}: create it first (nudgectl category create)")]
    UnknownCategory(String),

    /// A required category cannot be switched off through the preferences (a destination's
    /// opt-out still stops it).
    #[error("the category {0:?} is required: it cannot be switched off")]
    CategoryRequired(String),

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

    /// The ledger is away rather than wrong: the connection failed or was cut, no connection
    /// came free in time (a pool closed on purpose is not away: it never comes back), or the
    /// server is shutting down, in recovery or read-only (a standby
    /// not yet promoted, a primary demoted by a failover). The same statement may succeed once
    /// the ledger is back, so a caller holding work keeps it and tries again; any other error
    /// would fail the same way again.
    ///
    /// By SQLSTATE: class 08 (connection exception), 57P0x (admin or crash shutdown, cannot
    /// connect now) and 25006 (read-only SQL transaction). Serialization failures and
    /// deadlocks (40001, 40P01) are not "away": their statement's owner retries them.
    pub fn is_unavailable(&self) -> bool {
        match self {
            LedgerError::Database(e) => sqlx_unavailable(e),
            LedgerError::ReadOnly => true,
            _ => false,
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

/// Every statement's error becomes a [`LedgerError`] here: one that says the ledger is away
/// also tells the pools to check their connections before handing them out again
/// (the ledger's `failover` module), so that a connection to a server demoted under it is not reused.
impl From<sqlx::Error> for LedgerError {
    fn from(e: sqlx::Error) -> Self {
        if sqlx_unavailable(&e) {
            crate::failover::unavailable_seen();
        }
        LedgerError::Database(e)
    }
}

/// [`LedgerError::is_unavailable`] of a driver error.
fn sqlx_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08") || code.starts_with("57P") || code == "25006"
        }),
        _ => false,
    }
}

/// Whether an error, or any error in its chain of sources, is the ledger being away
/// ([`LedgerError::is_unavailable`], or the driver's own error of the same kind): for callers
/// that hold the ledger's error inside their own (an `anyhow` chain, a handler's error).
pub fn is_unavailable(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(ledger) = e.downcast_ref::<LedgerError>() {
            if ledger.is_unavailable() {
                return true;
            }
        } else if let Some(driver) = e.downcast_ref::<sqlx::Error>()
            && sqlx_unavailable(driver)
        {
            return true;
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_connection_or_an_exhausted_pool_is_the_ledger_being_away() {
        let cut = LedgerError::Database(sqlx::Error::Io(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        assert!(cut.is_unavailable());
        assert!(LedgerError::Database(sqlx::Error::PoolTimedOut).is_unavailable());
        assert!(LedgerError::ReadOnly.is_unavailable());
    }

    #[test]
    fn the_ledger_away_is_found_inside_a_callers_error_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("failed to claim")]
        struct Callers(#[source] LedgerError);
        assert!(is_unavailable(&Callers(LedgerError::ReadOnly)));
        assert!(is_unavailable(&Callers(LedgerError::Database(
            sqlx::Error::PoolTimedOut
        ))));
        assert!(!is_unavailable(&Callers(LedgerError::InvalidInput("x"))));
    }

    #[test]
    fn a_refused_row_or_a_missing_row_is_not_the_ledger_being_away() {
        assert!(!LedgerError::Database(sqlx::Error::RowNotFound).is_unavailable());
        assert!(!LedgerError::InvalidInput("x").is_unavailable());
        assert!(!LedgerError::corrupt("deliveries", "bad").is_unavailable());
    }
}
