use std::ffi::OsString;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::ConfigError;

/// Prefix of every environment variable that sets a configuration key.
pub const ENV_PREFIX: &str = "NUDGE_";

/// Environment variable naming the TOML file when `--config` is not given.
pub const CONFIG_FILE_ENV: &str = "NUDGE_CONFIG";

/// Separator for nesting in environment variable names: `NUDGE_DATABASE__URL` is `database.url`.
pub const ENV_NESTING: &str = "__";

/// Checks a loaded configuration, naming the offending key in the error.
///
/// A binary implements it for its struct by calling each section's `validate_at("<key>")` (or
/// `validate()` when the section sits under its conventional name), then its own checks.
pub trait Validate {
    /// `Ok` when every rule holds; otherwise the first broken one, naming its key.
    fn validate(&self) -> Result<(), ConfigError>;
}

/// Loads and validates a binary's configuration.
///
/// Layers, later ones winning: `T::default()`; the TOML file `config_file`, or when that is `None`
/// the file named by `NUDGE_CONFIG` (if set and non-empty); then `NUDGE_` environment variables
/// with `__` for nesting. Then [`Validate::validate`].
///
/// `sections` lists the top-level keys of `T` (e.g. `&["database", "telemetry"]`). Only
/// environment variables under those keys are read: every nudge binary shares one `NUDGE_`
/// namespace (a compose file or pod spec often sets `NUDGE_AMQP__URL` for all of them), and `T`
/// denies unknown fields, so a variable for a section this binary lacks would otherwise fail
/// start-up. A misspelt key *inside* a listed section (`NUDGE_DATABASE__URLL`) is still an error.
/// `NUDGE_CONFIG` is never a key, so `config` cannot be a section name.
///
/// Every other `NUDGE_` variable must be `NUDGE_<SECTION>__<KEY>` for a section in
/// [`KNOWN_SECTIONS`], or be listed in [`NOT_CONFIG_VARIABLES`] (or start with one of
/// [`NOT_CONFIG_PREFIXES`]): anything else stops the load naming the variable, so that a
/// misspelt name (`NUDGE_DATABASE_URL`, one underscore) cannot leave a default in force.
///
/// The file may hold sections of other nudge binaries ([`KNOWN_SECTIONS`]): they are ignored.
///
/// A file that was asked for but cannot be read is an error naming the path; when neither
/// `config_file` nor `NUDGE_CONFIG` is given, no file is read.
pub fn load<T>(config_file: Option<&Path>, sections: &[&str]) -> Result<T, ConfigError>
where
    T: DeserializeOwned + Serialize + Default + Validate,
{
    if sections.iter().any(|s| s.eq_ignore_ascii_case("config")) {
        return Err(ConfigError::invalid(
            "config",
            "reserved for the NUDGE_CONFIG file path; choose another section name",
        ));
    }

    check_environment(std::env::vars_os().map(|(name, _)| name))?;

    let mut figment = Figment::from(Serialized::defaults(T::default()));
    if let Some(path) = config_file
        .map(Path::to_path_buf)
        .or_else(config_file_from_env)
    {
        // figment treats a missing file as empty; a file someone named must exist.
        std::fs::read(&path).map_err(|source| ConfigError::File {
            path: path.clone(),
            source,
        })?;
        figment = figment.merge(SectionsOf {
            file: Toml::file_exact(&path),
            sections: sections.iter().map(|s| (*s).to_owned()).collect(),
        });
    }
    figment = figment.merge(env_provider(sections));

    let config: T = figment.extract()?;
    config.validate()?;
    Ok(config)
}

/// Every top-level section any nudge binary reads. One configuration file may serve several
/// binaries (a compose file or config map usually has one), so a binary ignores the sections of
/// the others; a top-level name outside this list is still refused, naming it, so a misspelt
/// section (`[databse]`) cannot silently fall back to defaults.
pub const KNOWN_SECTIONS: &[&str] = &[
    "database",
    "amqp",
    "telemetry",
    "crypto",
    "worker",
    "retry",
    "providers",
    "producer",
    "janitor",
    "redrive",
    "admission",
    "intake",
    "retention",
];

/// `NUDGE_` variables that are not configuration keys, read by name elsewhere: the file path
/// (`NUDGE_CONFIG`), `nudgectl`'s `--actor` (`NUDGE_ACTOR`), and the variables of the compose
/// file, the container build and the test harness (`deploy/README.md`, `scripts/`, `tests/`).
pub const NOT_CONFIG_VARIABLES: &[&str] = &[
    CONFIG_FILE_ENV,
    "NUDGE_ACTOR",
    "NUDGE_BIN_DIR",
    "NUDGE_DOCKERFILE",
    "NUDGE_IMAGE",
    "NUDGE_POSTGRES_PORT",
    "NUDGE_RABBITMQ_PORT",
    "NUDGE_RABBITMQ_UI_PORT",
    "NUDGE_STUB_PORT",
    "NUDGE_INTAKE_PORT",
    "NUDGE_PROMETHEUS_PORT",
];

/// Prefixes of `NUDGE_` variables that are not configuration keys: the benchmarks' and the
/// tests' own settings (`NUDGE_BENCH_*`, `NUDGE_TEST_*`, e.g. `NUDGE_TEST_AMQP_URL`).
pub const NOT_CONFIG_PREFIXES: &[&str] = &["NUDGE_BENCH_", "NUDGE_TEST_"];

/// Refuses a `NUDGE_` variable that is neither a key of a known section nor a listed
/// non-configuration variable (see [`load`]). Names the variable, never its value.
fn check_environment(names: impl Iterator<Item = OsString>) -> Result<(), ConfigError> {
    let mut unknown: Vec<String> = names
        .filter_map(|name| {
            let name = name.to_string_lossy().into_owned();
            let rest = name.strip_prefix(ENV_PREFIX)?;
            if NOT_CONFIG_VARIABLES.contains(&name.as_str())
                || NOT_CONFIG_PREFIXES.iter().any(|p| name.starts_with(p))
            {
                return None;
            }
            let known = rest.split_once(ENV_NESTING).is_some_and(|(top, key)| {
                !key.is_empty() && KNOWN_SECTIONS.iter().any(|s| s.eq_ignore_ascii_case(top))
            });
            (!known).then_some(name)
        })
        .collect();
    unknown.sort();
    match unknown.first() {
        None => Ok(()),
        Some(name) => Err(ConfigError::UnknownVariable { name: name.clone() }),
    }
}

/// The TOML file, less the known sections this binary does not have.
struct SectionsOf {
    file: figment::providers::Data<Toml>,
    sections: Vec<String>,
}

impl figment::Provider for SectionsOf {
    fn metadata(&self) -> figment::Metadata {
        self.file.metadata()
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        let mut data = self.file.data()?;
        for dict in data.values_mut() {
            dict.retain(|key, _| {
                self.sections.iter().any(|s| s == key) || !KNOWN_SECTIONS.contains(&key.as_str())
            });
        }
        Ok(data)
    }
}

fn config_file_from_env() -> Option<PathBuf> {
    std::env::var_os(CONFIG_FILE_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// `NUDGE_<SECTION>__<KEY>` variables for the listed sections only (see [`load`]).
fn env_provider(sections: &[&str]) -> Env {
    let sections: Vec<String> = sections.iter().map(|s| (*s).to_owned()).collect();
    Env::prefixed(ENV_PREFIX)
        .filter(move |name| {
            // `name` has the prefix stripped but is not split yet: `DATABASE__URL`.
            let name = name.as_str();
            let top = name.split_once(ENV_NESTING).map_or(name, |(top, _)| top);
            sections.iter().any(|s| s.eq_ignore_ascii_case(top))
        })
        .split(ENV_NESTING)
}
