//! nudgectl against a ledger that is read-only (a failover under way): it says so, first and
//! in words, and exits non-zero; once the ledger takes writes again the same command works.
#![allow(clippy::unwrap_used)]

use std::process::Command as Process;

use nudge_ledger::test_support::set_read_only;
use sqlx::PgPool;

fn status(pool: &PgPool) -> std::process::Output {
    Process::new(env!("CARGO_BIN_EXE_nudgectl"))
        .arg("status")
        .env(
            "NUDGE_DATABASE__URL",
            sqlx::ConnectOptions::to_url_lossy(&*pool.connect_options()).to_string(),
        )
        .env("NUDGE_DATABASE__ACQUIRE_TIMEOUT_MS", "500")
        .env_remove("NUDGE_CONFIG")
        .output()
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_command_against_a_read_only_ledger_says_the_ledger_is_away_or_read_only(pool: PgPool) {
    set_read_only(&pool, true).await;
    let out = status(&pool);
    set_read_only(&pool, false).await;
    let stderr = format!("\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{stderr}");
    // sqlx's own log of each refused connection may come before (at error, on stderr).
    let said = stderr
        .find("\nthe ledger is away or read-only")
        .unwrap_or_else(|| panic!("{stderr}"));
    let chain = stderr
        .find("\nerror: failed to connect to the database")
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(said < chain, "the reason comes before the chain: {stderr}");

    let out = status(&pool);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
