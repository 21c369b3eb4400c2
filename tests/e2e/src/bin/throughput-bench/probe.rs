//! What the benchmark reads from outside the processes it measures: CPU time and peak memory
//! from `/proc`, commit counts from `pg_stat_database`, statement counts from
//! `pg_stat_statements` (when the server preloads it), the client backends serving a database.
//!
//! The bench's own queries on the measured database go through [`Observer`], which counts them
//! so that they can be subtracted: every figure is what the nudge processes did.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::{Connection, PgConnection};

/// Clock ticks per second of `/proc/<pid>/stat` times (`getconf CLK_TCK`, 100 when unknown).
fn clock_ticks() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .and_then(|text| text.trim().parse::<f64>().ok())
            .filter(|ticks| *ticks > 0.0)
            .unwrap_or(100.0)
    })
}

/// CPU seconds (user + system) a process has used so far; None when it is gone.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; the fields after its ')' are fixed.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks())
}

/// Peak resident set size (`VmHWM`) of a process in KiB; None when it is gone.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The machine's load average when a run starts: the benchmark shares the machine.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// A connection to the server's maintenance database: reads the statistics of the measured
/// database without adding to them.
#[derive(Debug)]
pub struct Admin {
    conn: PgConnection,
}

impl Admin {
    pub async fn connect() -> anyhow::Result<Self> {
        Ok(Self {
            conn: PgConnection::connect(&nudge_e2e::admin_url())
                .await
                .context("PostgreSQL must answer (DATABASE_URL)")?,
        })
    }

    /// Whether the server preloads `pg_stat_statements` (it cannot be loaded later).
    pub async fn statements_loaded(&mut self) -> anyhow::Result<bool> {
        let libraries: String =
            sqlx::query_scalar("SELECT current_setting('shared_preload_libraries')")
                .fetch_one(&mut self.conn)
                .await?;
        Ok(libraries
            .split(',')
            .any(|l| l.trim().trim_matches('"') == "pg_stat_statements"))
    }

    /// Process ids of the client backends connected to `db`.
    pub async fn backends(&mut self, db: &str) -> anyhow::Result<Vec<u32>> {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend'",
        )
        .bind(db)
        .fetch_all(&mut self.conn)
        .await?;
        Ok(pids
            .into_iter()
            .filter_map(|p| u32::try_from(p).ok())
            .collect())
    }

    /// `xact_commit` of `db` once nothing is connected to it any more and the counter has
    /// settled: a backend reports its counts when it is idle or exits, not at each commit.
    pub async fn settled_commits(&mut self, db: &str) -> anyhow::Result<i64> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.backends(db).await?.is_empty() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "clients of {db} still connected after 30 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut last = self.commits(db).await?;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let now = self.commits(db).await?;
            if now == last || Instant::now() >= deadline {
                return Ok(now);
            }
            last = now;
        }
    }

    async fn commits(&mut self, db: &str) -> anyhow::Result<i64> {
        Ok(
            sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
                .bind(db)
                .fetch_one(&mut self.conn)
                .await?,
        )
    }

    pub async fn close(self) {
        let _ = self.conn.close().await;
    }
}

/// The bench's one connection to the measured database, counting its own transactions
/// (each query is one, autocommitted) so that they are taken out of the figures.
#[derive(Debug)]
pub struct Observer {
    conn: PgConnection,
    queries: i64,
}

impl Observer {
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        Ok(Self {
            conn: PgConnection::connect(url).await?,
            queries: 0,
        })
    }

    pub fn conn(&mut self) -> &mut PgConnection {
        self.queries += 1;
        &mut self.conn
    }

    /// Queries (hence transactions and statements) this observer has run so far.
    pub fn queries(&self) -> i64 {
        self.queries
    }

    /// Makes `pg_stat_statements` readable in this database (the server preloads it; each
    /// database needs the extension's view).
    pub async fn enable_statements(&mut self) -> anyhow::Result<()> {
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(self.conn())
            .await?;
        Ok(())
    }

    /// Statements executed in this database so far, by every client (`pg_stat_statements`).
    pub async fn statements(&mut self) -> anyhow::Result<i64> {
        let total: i64 = sqlx::query_scalar(
            "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_statements
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(self.conn())
        .await?;
        Ok(total)
    }

    pub async fn close(self) {
        let _ = self.conn.close().await;
    }
}
