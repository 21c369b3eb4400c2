//! Whether the ledger's server has a synchronous standby, for `status` when
//! `nudgectl.require_synchronous_standby` is set.
//!
//! Without one, an outcome the primary committed just before it was lost may be missing from
//! the replica promoted in its place: the delivery is owed again there and may be sent a second
//! time through a provider that honours no key (docs/OPERATIONS.md, "PostgreSQL failover
//! drill"). Read-only: it asks the server and never changes a setting.

use sqlx::PgPool;

/// What the server says about its synchronous standbys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynchronousStandby {
    /// `synchronous_standby_names`; empty: no standby is waited for.
    pub names: String,
    /// `synchronous_commit` of this session; `off` and `local` do not wait for a standby.
    pub commit: String,
    /// Standbys in `pg_stat_replication` whose `sync_state` is `sync` or `quorum`.
    pub synchronous: i64,
    /// Whether this role may read `sync_state` (superuser, or `pg_read_all_stats`, which
    /// `pg_monitor` grants): without it every row's `sync_state` reads NULL.
    pub sees_sync_state: bool,
    /// The role connected, named in the warning when it cannot tell.
    pub role: String,
}

impl SynchronousStandby {
    /// Asks the server.
    pub async fn read(pool: &PgPool) -> Result<Self, sqlx::Error> {
        let (names, commit, synchronous, sees_sync_state, role): (
            String,
            String,
            i64,
            bool,
            String,
        ) = sqlx::query_as(
            "SELECT current_setting('synchronous_standby_names'), \
                        current_setting('synchronous_commit'), \
                        (SELECT count(*) FROM pg_stat_replication \
                          WHERE sync_state IN ('sync', 'quorum')), \
                        pg_has_role(current_user, 'pg_read_all_stats', 'USAGE'), \
                        current_user::text",
        )
        .fetch_one(pool)
        .await?;
        Ok(Self {
            names,
            commit,
            synchronous,
            sees_sync_state,
            role,
        })
    }

    /// The warning `status` prints, or None when a synchronous standby confirms each commit.
    pub fn warning(&self) -> Option<String> {
        const RISK: &str = "an outcome committed just before this server is lost may be \
                            missing from a promoted replica, and its delivery sent again";
        if self.names.trim().is_empty() {
            return Some(format!(
                "warning: no synchronous standby: synchronous_standby_names is empty, so no \
                 commit waits for a replica; {RISK} (nudgectl.require_synchronous_standby is set)"
            ));
        }
        if matches!(self.commit.as_str(), "off" | "local") {
            return Some(format!(
                "warning: synchronous_commit is {}: commits do not wait for the synchronous \
                 standby ({}); {RISK}",
                self.commit, self.names
            ));
        }
        if self.synchronous > 0 {
            return None;
        }
        if !self.sees_sync_state {
            return Some(format!(
                "warning: cannot tell whether a synchronous standby is connected: role {} may \
                 not read pg_stat_replication.sync_state (grant it pg_monitor); \
                 synchronous_standby_names is '{}'",
                self.role, self.names
            ));
        }
        Some(format!(
            "warning: no synchronous standby connected: synchronous_standby_names is '{}' but \
             pg_stat_replication shows none sync or quorum, so commits wait until one connects",
            self.names
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(names: &str, commit: &str, synchronous: i64, sees: bool) -> SynchronousStandby {
        SynchronousStandby {
            names: names.to_owned(),
            commit: commit.to_owned(),
            synchronous,
            sees_sync_state: sees,
            role: "ops".to_owned(),
        }
    }

    #[test]
    fn a_connected_synchronous_standby_raises_no_warning() {
        assert_eq!(server("\"standby1\"", "on", 1, true).warning(), None);
        assert_eq!(
            server("ANY 1 (a, b)", "remote_apply", 2, true).warning(),
            None
        );
    }

    #[test]
    fn a_single_server_is_warned_about_by_its_empty_standby_names() {
        let warning = server("", "on", 0, true).warning().unwrap_or_default();
        assert!(
            warning.contains("synchronous_standby_names is empty"),
            "{warning}"
        );
    }

    #[test]
    fn commits_that_do_not_wait_are_warned_about_even_with_a_standby() {
        let warning = server("s1", "local", 1, true).warning().unwrap_or_default();
        assert!(warning.contains("synchronous_commit is local"), "{warning}");
    }

    #[test]
    fn a_role_that_cannot_read_sync_state_is_told_so_rather_than_told_none_is_connected() {
        let warning = server("s1", "on", 0, false).warning().unwrap_or_default();
        assert!(warning.contains("cannot tell"), "{warning}");
        assert!(warning.contains("pg_monitor"), "{warning}");
        let warning = server("s1", "on", 0, true).warning().unwrap_or_default();
        assert!(
            warning.contains("no synchronous standby connected"),
            "{warning}"
        );
    }
}
