//! What the janitor's tests share beyond the ledger's fixtures (`nudge_ledger::test_support`).

use nudge_ledger::Ledger;
use nudge_ledger::test_support::connected_as;
use sqlx::PgPool;

/// The same database as `pool`, connected as the janitor's restricted role.
pub async fn as_janitor(pool: &PgPool) -> Ledger {
    connected_as(pool, "nudge_janitor").await
}
