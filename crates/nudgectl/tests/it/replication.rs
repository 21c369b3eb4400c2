//! `status` and the synchronous standby: the shared test server is a single server, so with
//! `nudgectl.require_synchronous_standby` set it is warned about, and without it not.
#![allow(clippy::unwrap_used)]

use std::process::Command as Process;

use sqlx::PgPool;

fn status(pool: &PgPool, require: Option<&str>, args: &[&str]) -> std::process::Output {
    let mut command = Process::new(env!("CARGO_BIN_EXE_nudgectl"));
    command
        .arg("status")
        .args(args)
        .env(
            "NUDGE_DATABASE__URL",
            sqlx::ConnectOptions::to_url_lossy(&*pool.connect_options()).to_string(),
        )
        .env_remove("NUDGE_CONFIG")
        .env_remove("NUDGE_NUDGECTL__REQUIRE_SYNCHRONOUS_STANDBY");
    if let Some(value) = require {
        command.env("NUDGE_NUDGECTL__REQUIRE_SYNCHRONOUS_STANDBY", value);
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn status_warns_about_a_server_without_a_synchronous_standby_when_one_is_required(
    pool: PgPool,
) {
    let out = status(&pool, Some("true"), &[]);

    let printed = String::from_utf8(out.stdout).unwrap();
    assert!(
        printed.contains("warning: no synchronous standby"),
        "{printed}"
    );
    assert!(
        printed.contains("synchronous_standby_names is empty"),
        "{printed}"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn status_as_json_keeps_the_warning_out_of_its_json(pool: PgPool) {
    let out = status(&pool, Some("true"), &["--json"]);

    let parsed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(parsed.is_array());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("warning: no synchronous standby"), "{err}");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn status_says_nothing_of_standbys_when_none_is_required(pool: PgPool) {
    for require in [None, Some("false")] {
        let out = status(&pool, require, &[]);

        let printed = String::from_utf8(out.stdout).unwrap();
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(!printed.contains("standby"), "{printed}");
        assert!(!err.contains("standby"), "{err}");
    }
}
