//! The ledger across a failover, against real errors of a real server: what counts as the
//! ledger being away (a read-only transaction's write, a session ended by the server, not a
//! refused row), and a pool that keeps only connections to a server that takes writes (a
//! database made read-only for new sessions, a session turned read-only under the pool).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use nudge_ledger::test_support::*;
use nudge_ledger::{Ledger, LedgerError};
use sqlx::PgPool;

/// The SQLSTATE a statement failed with.
fn sqlstate(e: &LedgerError) -> Option<String> {
    match e {
        LedgerError::Database(sqlx::Error::Database(db)) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

async fn backend_pid(ledger: &Ledger) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_write_in_a_read_only_transaction_is_the_ledger_being_away(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION READ ONLY")
        .execute(&mut *tx)
        .await
        .unwrap();
    let refused = sqlx::query("INSERT INTO tenants (id, name, created_at, updated_at) VALUES (gen_random_uuid(), 'ro', now(), now())")
        .execute(&mut *tx)
        .await
        .unwrap_err();
    let e = LedgerError::from(refused);
    assert_eq!(sqlstate(&e).as_deref(), Some("25006"), "{e:?}");
    assert!(e.is_unavailable());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_session_ended_by_the_server_is_the_ledger_being_away(pool: PgPool) {
    let mut victim = pool.acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *victim)
        .await
        .unwrap();
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ended);
    let cut = sqlx::query("SELECT 1")
        .execute(&mut *victim)
        .await
        .unwrap_err();
    let e = LedgerError::from(cut);
    // The server says why before it closes the socket (57P01, admin shutdown); a client that
    // writes after the close sees the socket's error instead: away either way.
    assert!(
        sqlstate(&e).as_deref() == Some("57P01")
            || matches!(e, LedgerError::Database(sqlx::Error::Io(_))),
        "{e:?}"
    );
    assert!(e.is_unavailable(), "{e:?}");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_constraint_violation_is_not_the_ledger_being_away(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    ledger.create_tenant("clinic-a", &ops(t0())).await.unwrap();
    let twice = sqlx::query(
        "INSERT INTO tenants (id, name, created_at, updated_at) \
         VALUES (gen_random_uuid(), 'clinic-a', now(), now())",
    )
    .execute(ledger.pool())
    .await
    .unwrap_err();
    let e = LedgerError::from(twice);
    assert_eq!(sqlstate(&e).as_deref(), Some("23505"), "{e:?}");
    assert!(!e.is_unavailable());
    assert!(e.is_data_refused());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_pool_refuses_a_read_only_server_and_takes_it_once_it_is_writable_again(pool: PgPool) {
    set_read_only(&pool, true).await;
    let refused = configured(&pool, 2, 500).await.unwrap_err();
    assert!(refused.is_unavailable(), "{refused:?}");

    set_read_only(&pool, false).await;
    let ledger = configured(&pool, 2, 2_000).await.unwrap();
    ledger.check_writable().await.unwrap();
    ledger.create_tenant("clinic-a", &ops(t0())).await.unwrap();
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_pool_whose_server_turns_read_only_answers_away_and_serves_again_once_it_is_back(
    pool: PgPool,
) {
    let ledger = configured(&pool, 2, 500).await.unwrap();
    ledger.create_tenant("clinic-a", &ops(t0())).await.unwrap();

    set_read_only(&pool, true).await;
    // Every session of the pool was ended; the new ones would be read-only: refused.
    let away = ledger
        .create_tenant("clinic-b", &ops(t0()))
        .await
        .unwrap_err();
    assert!(away.is_unavailable(), "{away:?}");
    let unready = ledger.check_writable().await.unwrap_err();
    assert!(unready.is_unavailable(), "{unready:?}");

    set_read_only(&pool, false).await;
    ledger.create_tenant("clinic-b", &ops(t0())).await.unwrap();
    ledger.check_writable().await.unwrap();
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_pooled_connection_whose_server_turned_read_only_is_discarded_once_a_write_found_it(
    pool: PgPool,
) {
    // One connection, made read-only under the pool as a demoted primary's sessions are.
    let ledger = configured(&pool, 1, 2_000).await.unwrap();
    let demoted = {
        let mut conn = ledger.pool().acquire().await.unwrap();
        sqlx::query("SET default_transaction_read_only = on")
            .execute(&mut *conn)
            .await
            .unwrap();
        sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
            .fetch_one(&mut *conn)
            .await
            .unwrap()
    };
    // The first write may land on it and fail as the ledger away (unless another test of this
    // process has just made every pool check its connections); the next one is on a new
    // connection that takes writes.
    if let Err(e) = ledger.create_tenant("clinic-a", &ops(t0())).await {
        assert_eq!(sqlstate(&e).as_deref(), Some("25006"), "{e:?}");
        assert!(e.is_unavailable());
        ledger.create_tenant("clinic-a", &ops(t0())).await.unwrap();
    }
    assert_ne!(backend_pid(&ledger).await, demoted);
    ledger.check_writable().await.unwrap();
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn readiness_finds_a_read_only_session_and_the_pool_then_replaces_it(pool: PgPool) {
    let ledger = configured(&pool, 1, 2_000).await.unwrap();
    {
        let mut conn = ledger.pool().acquire().await.unwrap();
        sqlx::query("SET default_transaction_read_only = on")
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    // The check may itself be handed a fresh connection if another test of this process has
    // just made every pool check its connections; then it passes at once.
    if let Err(e) = ledger.check_writable().await {
        assert!(matches!(e, LedgerError::ReadOnly), "{e:?}");
        assert!(e.is_unavailable());
    }
    ledger.check_writable().await.unwrap();
    ledger.create_tenant("clinic-a", &ops(t0())).await.unwrap();
}
