use std::ffi::OsString;
use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Value};
use figment::{Figment, Metadata, Profile};
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
/// A list of tables (`[[providers]]`) cannot be written as variables, but a key of one of its
/// entries can: `NUDGE_PROVIDERS__0__AUTH_TOKEN` sets `auth_token` of the first entry the
/// defaults and the file give (so that a secret of an entry comes from the environment like
/// any other). An index past the entries is an error naming the key: the environment never
/// creates an entry.
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
    let entries = list_entries(&figment, sections, std::env::vars_os())?;
    if !entries.is_empty() {
        figment = figment.merge(ListEntries(entries));
    }

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
    "receipts",
    "retention",
    "events",
    "console",
    "nudgectl",
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
    "NUDGE_CONSOLE_PORT",
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

/// `NUDGE_<SECTION>__<KEY>` variables for the listed sections only (see [`load`]), less the
/// ones with a list index ([`list_entries`] applies those).
fn env_provider(sections: &[&str]) -> Env {
    let sections: Vec<String> = sections.iter().map(|s| (*s).to_owned()).collect();
    Env::prefixed(ENV_PREFIX)
        .filter(move |name| {
            // `name` has the prefix stripped but is not split yet: `DATABASE__URL`.
            let name = name.as_str();
            let top = name.split_once(ENV_NESTING).map_or(name, |(top, _)| top);
            sections.iter().any(|s| s.eq_ignore_ascii_case(top)) && !has_index(name)
        })
        .split(ENV_NESTING)
}

/// Whether a variable name (prefix stripped) has a list index among its levels: `PROVIDERS__0__AUTH_TOKEN`.
fn has_index(name: &str) -> bool {
    name.split(ENV_NESTING)
        .any(|level| !level.is_empty() && level.bytes().all(|b| b.is_ascii_digit()))
}

/// The lists of the listed sections that `NUDGE_<SECTION>__<INDEX>__<KEY>` variables change:
/// each list as the defaults and the file give it, with those keys set in its entries.
fn list_entries(
    figment: &Figment,
    sections: &[&str],
    vars: impl Iterator<Item = (OsString, OsString)>,
) -> Result<Dict, ConfigError> {
    let mut vars: Vec<(String, String)> = vars
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
        .filter(|(name, _)| name.strip_prefix(ENV_PREFIX).is_some_and(has_index))
        .collect();
    // One order whatever the environment's: a later variable cannot silently lose to an earlier one.
    vars.sort();
    let mut lists = Dict::new();
    for (name, value) in vars {
        let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        let path: Vec<String> = rest
            .split(ENV_NESTING)
            .map(str::to_ascii_lowercase)
            .collect();
        let Some((section, keys)) = path.split_first() else {
            continue;
        };
        if !sections.contains(&section.as_str()) {
            continue;
        }
        let key = path.join(".");
        if !lists.contains_key(section) {
            let list = figment.find_value(section).map_err(|_| {
                ConfigError::invalid(&key, format!("{name}: {section} is not a list"))
            })?;
            lists.insert(section.clone(), list);
        }
        let Some(list) = lists.get_mut(section) else {
            continue;
        };
        let Ok(value) = value.parse::<Value>();
        set_in_list(list, section, keys, value)
            .map_err(|message| ConfigError::invalid(&key, format!("{name}: {message}")))?;
    }
    Ok(lists)
}

/// Sets `keys` (an index, then keys and indexes) under `at`, a list, naming what is wrong
/// otherwise. `at_name` is the dotted path of `at`, for the message.
fn set_in_list(at: &mut Value, at_name: &str, keys: &[String], value: Value) -> Result<(), String> {
    let Some((first, rest)) = keys.split_first() else {
        return Err(format!("{at_name}: a key is needed after the index"));
    };
    let next_name = format!("{at_name}.{first}");
    let slot = match (at, first.parse::<usize>()) {
        (Value::Array(_, items), Ok(index)) => {
            let len = items.len();
            items.get_mut(index).ok_or_else(|| {
                format!(
                    "{at_name} has {len} entries (from the defaults and the file); the \
                     environment sets keys of an entry, it cannot add one"
                )
            })?
        }
        (Value::Array(..), Err(_)) => {
            return Err(format!(
                "{at_name} is a list: expected an index, got {first}"
            ));
        }
        (Value::Dict(_, dict), Err(_)) => {
            if rest.is_empty() {
                dict.insert(first.clone(), value);
                return Ok(());
            }
            dict.entry(first.clone())
                .or_insert_with(|| Value::from(Dict::new()))
        }
        (_, _) => return Err(format!("{at_name} is not a list")),
    };
    if rest.is_empty() {
        return Err(format!("{next_name}: a key is needed after the index"));
    }
    set_in_list(slot, &next_name, rest, value)
}

/// The lists [`list_entries`] changed, merged over the defaults, the file and the other variables.
struct ListEntries(Dict);

impl figment::Provider for ListEntries {
    fn metadata(&self) -> Metadata {
        Metadata::named("`NUDGE_` environment variable(s) of list entries")
    }

    fn data(&self) -> Result<figment::value::Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.0.clone()))
    }
}
