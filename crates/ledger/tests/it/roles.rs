//! The binaries' database roles, read from PostgreSQL's catalogs: each role's rights are the
//! table in `docs/database-roles.md`, and a few rights that matter are pinned by behaviour
//! (a worker cannot read the signing secrets, the janitor cannot switch retention's
//! protections off, a definer function never resolves a name through `public`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use nudge_ledger::test_support::as_role;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const ROLES: [&str; 7] = [
    "nudge_worker",
    "nudge_producer",
    "nudge_intake",
    "nudge_janitor",
    "nudge_events",
    "nudge_console",
    "public",
];

const RIGHTS_DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/database-roles.md");

/// Every right of every role, one line each (`role | object | rights`), from the catalogs:
/// role attributes, table and sequence privileges, column privileges beyond the table's,
/// EXECUTE on SECURITY DEFINER functions (an invoker function runs with the caller's rights
/// and grants nothing), and the schema's and database's privileges.
const RIGHTS_SQL: &str = "
WITH roles AS (SELECT r AS rolname FROM unnest($1::text[]) AS r),
rels AS (
    SELECT c.oid, c.relname, c.relkind FROM pg_class c
    JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')),
lines AS (
    SELECT r.rolname, 'attributes' AS object,
           concat_ws(' ',
               CASE WHEN a.rolcanlogin THEN 'LOGIN' ELSE 'NOLOGIN' END,
               CASE WHEN a.rolinherit THEN 'INHERIT' ELSE 'NOINHERIT' END,
               CASE WHEN a.rolsuper THEN 'SUPERUSER' END,
               CASE WHEN a.rolcreaterole THEN 'CREATEROLE' END,
               CASE WHEN a.rolcreatedb THEN 'CREATEDB' END,
               CASE WHEN a.rolbypassrls THEN 'BYPASSRLS' END,
               CASE WHEN a.rolreplication THEN 'REPLICATION' END) AS rights
    FROM roles r JOIN pg_roles a ON a.rolname = r.rolname
  UNION ALL
    SELECT r.rolname, 'table ' || c.relname,
           array_to_string(ARRAY(
               SELECT p FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE',
                                          'REFERENCES', 'TRIGGER']) WITH ORDINALITY AS x(p, i)
               WHERE has_table_privilege(r.rolname, c.oid, p) ORDER BY i), ', ')
    FROM roles r CROSS JOIN rels c WHERE c.relkind <> 'S'
  UNION ALL
    SELECT r.rolname, 'sequence ' || c.relname,
           array_to_string(ARRAY(
               SELECT p FROM unnest(ARRAY['USAGE', 'SELECT', 'UPDATE']) WITH ORDINALITY AS x(p, i)
               WHERE has_sequence_privilege(r.rolname, c.oid, p) ORDER BY i), ', ')
    FROM roles r CROSS JOIN rels c WHERE c.relkind = 'S'
  UNION ALL
    SELECT r.rolname, 'column ' || c.relname || '.' || a.attname,
           array_to_string(ARRAY(
               SELECT p FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'REFERENCES'])
                   WITH ORDINALITY AS x(p, i)
               WHERE has_column_privilege(r.rolname, c.oid, a.attnum, p)
                 AND NOT has_table_privilege(r.rolname, c.oid, p) ORDER BY i), ', ')
    FROM roles r CROSS JOIN rels c
    JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
    WHERE c.relkind <> 'S'
  UNION ALL
    SELECT r.rolname, 'function ' || p.oid::regprocedure::text, 'EXECUTE'
    FROM roles r CROSS JOIN pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE n.nspname = 'public' AND p.prosecdef AND has_function_privilege(r.rolname, p.oid, 'EXECUTE')
  UNION ALL
    SELECT r.rolname, 'schema public',
           array_to_string(ARRAY(
               SELECT p FROM unnest(ARRAY['USAGE', 'CREATE']) WITH ORDINALITY AS x(p, i)
               WHERE has_schema_privilege(r.rolname, 'public', p) ORDER BY i), ', ')
    FROM roles r
  UNION ALL
    SELECT r.rolname, 'database',
           array_to_string(ARRAY(
               SELECT p FROM unnest(ARRAY['CONNECT', 'CREATE', 'TEMPORARY']) WITH ORDINALITY AS x(p, i)
               WHERE has_database_privilege(r.rolname, current_database(), p) ORDER BY i), ', ')
    FROM roles r)
SELECT rolname || ' | ' || object || ' | ' || rights FROM lines
WHERE rights <> ''
ORDER BY 1";

async fn rights(pool: &PgPool) -> BTreeSet<String> {
    let roles: Vec<String> = ROLES.iter().map(|r| (*r).to_owned()).collect();
    sqlx::query_scalar::<_, String>(RIGHTS_SQL)
        .bind(&roles)
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// The lines of the doc's rights block (between its markers).
fn documented() -> BTreeSet<String> {
    let text = std::fs::read_to_string(RIGHTS_DOC).unwrap();
    let begin = text
        .find("<!-- rights:begin -->")
        .expect("the rights block's start");
    let end = text
        .find("<!-- rights:end -->")
        .expect("the rights block's end");
    text[begin..end]
        .lines()
        .skip(1)
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("```"))
        .map(str::to_owned)
        .collect()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn every_roles_rights_are_the_ones_docs_database_roles_lists(pool: PgPool) {
    let actual = rights(&pool).await;
    let documented = documented();
    let missing: Vec<_> = documented.difference(&actual).collect();
    let extra: Vec<_> = actual.difference(&documented).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "the roles' rights differ from docs/database-roles.md\n\
         documented but not held: {missing:#?}\nheld but not documented: {extra:#?}\n\
         the whole block as the catalogs have it:\n```\n{}\n```",
        actual.iter().cloned().collect::<Vec<_>>().join("\n")
    );
}

const DENIED: Option<&str> = Some("42501");

fn denied(got: Option<String>) -> Option<&'static str> {
    match got.as_deref() {
        Some("42501") => DENIED,
        None => None,
        Some(_) => Some("another error"),
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_worker_role_cannot_read_tenant_secrets_and_the_intake_role_can(pool: PgPool) {
    let read = "SELECT secret_ciphertext FROM tenant_secrets";
    assert_eq!(denied(as_role(&pool, "nudge_worker", read).await), DENIED);
    assert_eq!(denied(as_role(&pool, "nudge_producer", read).await), DENIED);
    assert_eq!(denied(as_role(&pool, "nudge_janitor", read).await), DENIED);
    assert_eq!(as_role(&pool, "nudge_intake", read).await, None);
    // Nor may a worker write the audit log, delete, or create anything.
    for sql in [
        "INSERT INTO audit_log (at, actor, action) VALUES (now(), 'w', 'forged')",
        "DELETE FROM deliveries",
        "CREATE TABLE shadow (x int)",
        "CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql AS 'SELECT NULL::timestamptz'",
    ] {
        assert_eq!(
            denied(as_role(&pool, "nudge_worker", sql).await),
            DENIED,
            "{sql}"
        );
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_janitor_role_cannot_switch_retentions_protections_off(pool: PgPool) {
    for sql in [
        // A redrive cancelled by hand would leave its dead letters deletable.
        "UPDATE redrives SET state = 'cancelled'",
        "UPDATE redrive_items SET skipped_reason = 'moved_on'",
        // A delivery's or a channel's owner is the ownership rule.
        "UPDATE channel_controls SET owner = 'nudge'",
        "UPDATE channel_controls SET previous_owner = 'nudge'",
        "UPDATE deliveries SET owner = 'nudge'",
        "UPDATE deliveries SET expires_at = now()",
        "INSERT INTO audit_log (at, actor, action) VALUES (now(), 'ops', 'forged')",
        "UPDATE retention_runs SET delivered_s = 604800",
        "DELETE FROM dead_letters",
    ] {
        assert_eq!(
            denied(as_role(&pool, "nudge_janitor", sql).await),
            DENIED,
            "{sql}"
        );
    }
    // What its sweeps write, it still may.
    assert_eq!(
        as_role(
            &pool,
            "nudge_janitor",
            "UPDATE deliveries SET state = state, lease_owner = NULL WHERE false"
        )
        .await,
        None
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn no_definer_function_resolves_names_through_the_public_schema(pool: PgPool) {
    let definers: Vec<(String, Option<Vec<String>>)> = sqlx::query_as(
        "SELECT p.oid::regprocedure::text, p.proconfig FROM pg_proc p
         JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'public' AND p.prosecdef ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        definers
            .iter()
            .any(|(f, _)| f.starts_with("nudge_retention_delete_deliveries")),
        "{definers:?}"
    );
    for (function, config) in &definers {
        let path = config
            .iter()
            .flatten()
            .find_map(|c| c.strip_prefix("search_path="))
            .unwrap_or_else(|| panic!("{function} sets no search_path"));
        assert_eq!(path, "pg_catalog, pg_temp", "{function}");
    }
}

/// A database created by PostgreSQL 14 or older lets every role CREATE in `public`; the
/// migrations take that away.
#[sqlx::test(migrations = false)]
async fn after_the_migrations_public_may_not_create_in_the_public_schema(pool: PgPool) {
    sqlx::query("GRANT CREATE ON SCHEMA public TO PUBLIC")
        .execute(&pool)
        .await
        .unwrap();
    nudge_ledger::MIGRATOR.run(&pool).await.unwrap();
    let can: bool = sqlx::query_scalar("SELECT has_schema_privilege('public', 'public', 'CREATE')")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(!can, "PUBLIC may still create in schema public");
}

/// Each role logs in (trust on the test server's loopback) and answers as itself.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn each_binary_role_can_log_in(pool: PgPool) {
    for role in [
        "nudge_worker",
        "nudge_producer",
        "nudge_intake",
        "nudge_janitor",
        "nudge_events",
        "nudge_console",
    ] {
        let options = (*pool.connect_options()).clone().username(role);
        let conn = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap();
        let me: String = sqlx::query_scalar("SELECT current_user::text")
            .fetch_one(&conn)
            .await
            .unwrap();
        assert_eq!(me, role);
        conn.close().await;
    }
}
