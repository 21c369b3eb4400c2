//! Applied migrations are immutable: every migration's version, file and SHA-384 (the checksum
//! sqlx stores in `_sqlx_migrations` and compares on every `migrate`) are committed in
//! `migrations/checksums.txt`, and this test holds the embedded [`MIGRATOR`] to that list. A
//! database migrated before an edit, a rename, a renumbering or a removal refuses `migrate`
//! (`VersionMismatch` or `VersionMissing`), so each of those fails here first; a change to the
//! schema comes as a new migration, whose line is appended to the list
//! (`docs/decisions/0017-migrations-are-immutable.md`).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::MIGRATOR;

/// The committed list, embedded so the test reads what was committed beside the migrations.
const COMMITTED: &str = include_str!("../../../migrations/checksums.txt");

/// One migration as the list records it.
#[derive(Debug, PartialEq, Eq)]
struct Entry {
    file: String,
    sha384: String,
}

/// The list's lines, by version, from the text of `migrations/checksums.txt`.
fn committed() -> BTreeMap<i64, Entry> {
    let mut entries = BTreeMap::new();
    for (number, line) in COMMITTED.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [version, file, sha384] = fields[..] else {
            panic!(
                "migrations/checksums.txt line {}: expected `version file sha384`, found {line:?}",
                number + 1
            );
        };
        let version: i64 = version.parse().unwrap_or_else(|_| {
            panic!(
                "migrations/checksums.txt line {}: {version:?} is not a version",
                number + 1
            )
        });
        let entry = Entry {
            file: file.to_owned(),
            sha384: sha384.to_owned(),
        };
        assert!(
            entries.insert(version, entry).is_none(),
            "migrations/checksums.txt lists version {version} twice"
        );
    }
    entries
}

/// The embedded migrations, by version, as the list would record them.
fn embedded() -> BTreeMap<i64, Entry> {
    MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .map(|m| {
            let file = format!("{}_{}.sql", m.version, m.description.replace(' ', "_"));
            let sha384 = m.checksum.iter().fold(String::new(), |mut hex, byte| {
                let _ = write!(hex, "{byte:02x}");
                hex
            });
            (m.version, Entry { file, sha384 })
        })
        .collect()
}

fn line(version: i64, entry: &Entry) -> String {
    format!("{version} {} {}", entry.file, entry.sha384)
}

#[test]
fn every_committed_migration_is_embedded_unchanged_and_every_new_one_is_listed_after_them() {
    let committed = committed();
    let embedded = embedded();
    let mut problems = Vec::new();

    for (version, listed) in &committed {
        match embedded.get(version) {
            None => problems.push(format!(
                "migration {version} ({}) is listed but no longer in migrations/: a database that \
                 applied it refuses `migrate` (VersionMissing). Put it back unchanged.",
                listed.file
            )),
            Some(now) if now != listed => problems.push(format!(
                "migration {version} changed since it was listed (listed: {}, now: {}): a \
                 database that applied it refuses `migrate` (VersionMismatch). Restore the file \
                 as listed and make the change as a new migration.",
                line(*version, listed),
                line(*version, now)
            )),
            Some(_) => {}
        }
    }

    let last_listed = committed.keys().next_back().copied().unwrap_or(i64::MIN);
    let mut to_append = Vec::new();
    for (version, entry) in &embedded {
        if committed.contains_key(version) {
            continue;
        }
        if *version <= last_listed {
            problems.push(format!(
                "migration {version} ({}) is numbered before the last listed one ({last_listed}): \
                 a new migration takes a version after every applied one (no renumbering).",
                entry.file
            ));
        } else {
            to_append.push(line(*version, entry));
        }
    }
    if !to_append.is_empty() {
        problems.push(format!(
            "new migrations are not listed yet; append to migrations/checksums.txt (or run \
             scripts/migration-checksums.sh >> migrations/checksums.txt):\n{}",
            to_append.join("\n")
        ));
    }

    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn sqlx_checksum_is_the_sha384_of_the_file_so_the_script_prints_the_same_list() {
    use sha2::{Digest, Sha384};

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations");
    for (version, entry) in embedded() {
        let bytes = std::fs::read(dir.join(&entry.file))
            .unwrap_or_else(|e| panic!("migration {version}: reading {}: {e}", entry.file));
        let digest = Sha384::digest(&bytes)
            .iter()
            .fold(String::new(), |mut hex, byte| {
                let _ = write!(hex, "{byte:02x}");
                hex
            });
        assert_eq!(digest, entry.sha384, "migration {version} ({})", entry.file);
    }
}
