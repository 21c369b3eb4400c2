//! `load` end to end: defaults, file, environment and the errors an operator sees.
//!
//! `figment::Jail` serialises these tests, runs each in a fresh temporary directory and restores
//! the environment afterwards; `clear_env` keeps an ambient `NUDGE_*` from leaking in.

#![allow(
    clippy::result_large_err,
    reason = "figment::Jail fixes its closures' error type to figment::Error"
)]

use std::error::Error as _;
use std::path::Path;

use figment::Jail;
use nudge_config::{ConfigError, DatabaseConfig, LogFormat, TelemetryConfig, Validate, load};
use serde::{Deserialize, Serialize};

const SECTIONS: &[&str] = &["database", "telemetry"];

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct TestConfig {
    database: DatabaseConfig,
    telemetry: TelemetryConfig,
}

impl Validate for TestConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.database.validate()?;
        self.telemetry.validate()
    }
}

/// Display plus every source, as a binary would report it.
fn chain(e: &ConfigError) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

fn load_test(file: Option<&Path>) -> Result<TestConfig, ConfigError> {
    load(file, SECTIONS)
}

#[test]
fn defaults_load_when_there_is_no_file_and_no_environment() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        let config = load_test(None).map_err(|e| chain(&e))?;
        assert_eq!(
            config.database.url.expose(),
            "postgres://postgres@127.0.0.1:5432/nudge"
        );
        assert_eq!(config.database.max_connections, 10);
        assert_eq!(config.database.acquire_timeout_ms, 5000);
        assert_eq!(config.telemetry.log_format, LogFormat::Pretty);
        assert_eq!(config.telemetry.log_filter, "info");
        assert_eq!(config.telemetry.otlp_endpoint, None);
        assert_eq!(config.telemetry.metrics_addr, None);
        Ok(())
    });
}

#[test]
fn the_toml_file_overrides_defaults_and_keeps_the_rest() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file(
            "nudge.toml",
            r#"
                [database]
                max_connections = 50

                [telemetry]
                log_format = "json"
                metrics_addr = "0.0.0.0:9464"
            "#,
        )?;
        let config = load_test(Some(Path::new("nudge.toml"))).map_err(|e| chain(&e))?;
        assert_eq!(config.database.max_connections, 50);
        assert_eq!(config.database.acquire_timeout_ms, 5000);
        assert_eq!(config.telemetry.log_format, LogFormat::Json);
        assert_eq!(
            config.telemetry.metrics_addr,
            Some(([0, 0, 0, 0], 9464).into())
        );
        Ok(())
    });
}

#[test]
fn the_environment_overrides_the_toml_file() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file(
            "nudge.toml",
            r#"
                [database]
                url = "postgres://file@db/nudge"
                max_connections = 50
            "#,
        )?;
        jail.set_env("NUDGE_DATABASE__URL", "postgresql://env:pw@db:5432/nudge");
        jail.set_env("NUDGE_TELEMETRY__LOG_FORMAT", "json");
        let config = load_test(Some(Path::new("nudge.toml"))).map_err(|e| chain(&e))?;
        assert_eq!(
            config.database.url.expose(),
            "postgresql://env:pw@db:5432/nudge"
        );
        assert_eq!(config.database.max_connections, 50);
        assert_eq!(config.telemetry.log_format, LogFormat::Json);
        Ok(())
    });
}

#[test]
fn nudge_config_selects_the_file_and_is_not_read_as_a_key() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("from-env.toml", "[database]\nmax_connections = 7\n")?;
        jail.set_env("NUDGE_CONFIG", "from-env.toml");
        let config = load_test(None).map_err(|e| chain(&e))?;
        assert_eq!(config.database.max_connections, 7);
        Ok(())
    });
}

#[test]
fn an_explicit_file_wins_over_nudge_config() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("from-env.toml", "[database]\nmax_connections = 7\n")?;
        jail.create_file("explicit.toml", "[database]\nmax_connections = 8\n")?;
        jail.set_env("NUDGE_CONFIG", "from-env.toml");
        let config = load_test(Some(Path::new("explicit.toml"))).map_err(|e| chain(&e))?;
        assert_eq!(config.database.max_connections, 8);
        Ok(())
    });
}

#[test]
fn a_bad_database_url_names_database_url_without_printing_it() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.set_env("NUDGE_DATABASE__URL", "mysql://root:s3cr3t@db/nudge");
        let err = load_test(None).err().ok_or("expected an error")?;
        let message = chain(&err);
        assert!(
            message.starts_with(
                "invalid configuration: database.url: expected a postgres:// or postgresql:// URL"
            ),
            "{message}"
        );
        assert!(!message.contains("s3cr3t"), "{message}");
        Ok(())
    });
}

#[test]
fn an_unknown_key_in_the_file_is_named() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("nudge.toml", "[database]\nmax_conections = 5\n")?;
        let err = load_test(Some(Path::new("nudge.toml")))
            .err()
            .ok_or("expected an error")?;
        assert_eq!(err.key().as_deref(), Some("database.max_conections"));
        let message = chain(&err);
        assert!(
            message.starts_with("invalid configuration: database.max_conections"),
            "{message}"
        );
        assert!(message.contains("nudge.toml"), "{message}");
        Ok(())
    });
}

#[test]
fn an_unknown_top_level_section_in_the_file_is_named() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("nudge.toml", "[databse]\nurl = \"postgres://x@db/n\"\n")?;
        let err = load_test(Some(Path::new("nudge.toml")))
            .err()
            .ok_or("expected an error")?;
        assert_eq!(err.key().as_deref(), Some("databse"));
        Ok(())
    });
}

#[test]
fn a_toml_syntax_error_names_the_file() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("nudge.toml", "[database\n")?;
        let err = load_test(Some(Path::new("nudge.toml")))
            .err()
            .ok_or("expected an error")?;
        let message = chain(&err);
        assert!(message.starts_with("invalid configuration: "), "{message}");
        assert!(message.contains("nudge.toml"), "{message}");
        Ok(())
    });
}

#[test]
fn a_wrong_type_names_the_key() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("nudge.toml", "[database]\nmax_connections = \"x\"\n")?;
        let err = load_test(Some(Path::new("nudge.toml")))
            .err()
            .ok_or("expected an error")?;
        let message = chain(&err);
        assert!(
            message.starts_with("invalid configuration: database.max_connections: "),
            "{message}"
        );
        assert!(message.contains("invalid type"), "{message}");
        Ok(())
    });
}

#[test]
fn a_wrong_type_from_the_environment_names_the_key() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.set_env("NUDGE_DATABASE__MAX_CONNECTIONS", "lots");
        let err = load_test(None).err().ok_or("expected an error")?;
        assert_eq!(err.key().as_deref(), Some("database.max_connections"));
        assert!(chain(&err).contains("NUDGE_"), "{}", chain(&err));
        Ok(())
    });
}

#[test]
fn a_secret_of_the_wrong_type_is_not_echoed() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("nudge.toml", "[database]\nurl = 987654321\n")?;
        let err = load_test(Some(Path::new("nudge.toml")))
            .err()
            .ok_or("expected an error")?;
        let message = chain(&err);
        assert_eq!(err.key().as_deref(), Some("database.url"));
        assert!(!message.contains("987654321"), "{message}");
        Ok(())
    });
}

#[test]
fn an_explicitly_given_missing_file_is_an_error_naming_the_path() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        let err = load_test(Some(Path::new("absent.toml")))
            .err()
            .ok_or("expected an error")?;
        assert!(matches!(err, ConfigError::File { .. }), "{err:?}");
        assert!(err.to_string().contains("absent.toml"), "{err}");
        Ok(())
    });
}

#[test]
fn a_missing_file_named_by_nudge_config_is_an_error_naming_the_path() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.set_env("NUDGE_CONFIG", "gone.toml");
        let err = load_test(None).err().ok_or("expected an error")?;
        assert!(err.to_string().contains("gone.toml"), "{err}");
        Ok(())
    });
}

#[test]
fn environment_for_sections_this_binary_lacks_is_ignored() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.set_env("NUDGE_AMQP__URL", "amqp://guest:guest@mq:5672/%2f");
        jail.set_env("NUDGE_WORKER__LEASE_SECONDS", "30");
        let config = load_test(None).map_err(|e| chain(&e))?;
        assert_eq!(config.database.max_connections, 10);
        Ok(())
    });
}

#[test]
fn a_variable_with_one_underscore_between_levels_stops_the_load_naming_it() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.set_env(
            "NUDGE_DATABASE_URL",
            "postgres://nudge:s3cr3t@prod-db/nudge",
        );
        let err = load_test(None)
            .err()
            .ok_or("a misspelt variable was ignored")?;
        assert!(
            matches!(&err, ConfigError::UnknownVariable { name } if name == "NUDGE_DATABASE_URL"),
            "{err:?}"
        );
        let message = chain(&err);
        assert!(
            message.starts_with("unknown environment variable NUDGE_DATABASE_URL: "),
            "{message}"
        );
        assert!(message.contains("NUDGE_DATABASE__URL"), "{message}");
        assert!(!message.contains("s3cr3t"), "{message}");
        Ok(())
    });
}

#[test]
fn a_variable_for_no_section_of_any_binary_is_refused() {
    for name in [
        "NUDGE_DATABSE__URL",
        "NUDGE_UNRELATED",
        "NUDGE_DATABASE",
        "NUDGE_AMQP__",
    ] {
        Jail::expect_with(|jail| {
            jail.clear_env();
            jail.set_env(name, "1");
            let err = load_test(None).err().ok_or(format!("{name} was ignored"))?;
            assert!(chain(&err).contains(name), "{}", chain(&err));
            Ok(())
        });
    }
}

#[test]
fn variables_read_elsewhere_are_not_taken_for_keys() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("nudge.toml", "[database]\nmax_connections = 3\n")?;
        jail.set_env("NUDGE_CONFIG", "nudge.toml");
        for name in nudge_config::NOT_CONFIG_VARIABLES {
            if *name != "NUDGE_CONFIG" {
                jail.set_env(name, "x");
            }
        }
        jail.set_env(
            "NUDGE_TEST_AMQP_URL",
            "amqp://guest:guest@127.0.0.1:5672/%2f",
        );
        jail.set_env("NUDGE_BENCH_REMINDERS", "20000");
        let config = load_test(None).map_err(|e| chain(&e))?;
        assert_eq!(config.database.max_connections, 3);
        assert!(nudge_config::NOT_CONFIG_VARIABLES.contains(&"NUDGE_ACTOR"));
        Ok(())
    });
}

#[test]
fn a_misspelt_key_inside_a_known_section_from_the_environment_is_an_error() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.set_env("NUDGE_DATABASE__URLL", "postgres://x@db/nudge");
        let err = load_test(None).err().ok_or("expected an error")?;
        assert_eq!(err.key().as_deref(), Some("database.urll"));
        Ok(())
    });
}

#[test]
fn config_is_not_allowed_as_a_section_name() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        let err = load::<TestConfig>(None, &["database", "config"])
            .err()
            .ok_or("expected an error")?;
        assert_eq!(err.key().as_deref(), Some("config"));
        Ok(())
    });
}

#[test]
fn debug_of_a_loaded_config_does_not_contain_the_password() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.set_env(
            "NUDGE_DATABASE__URL",
            "postgres://nudge:pa55w0rd-xyz@db:5432/nudge",
        );
        let config = load_test(None).map_err(|e| chain(&e))?;
        let printed = format!("{config:?}");
        assert!(!printed.contains("pa55w0rd-xyz"), "{printed}");
        assert!(printed.contains("[redacted]"), "{printed}");
        Ok(())
    });
}

/// A binary's section with a required field, as a binary might write one.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WithRequired {
    #[serde(rename = "required")]
    _required: Required,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Required {
    #[serde(rename = "token")]
    _token: String,
}

#[test]
fn a_missing_required_field_names_the_full_key() {
    use figment::providers::{Format, Toml};

    let err = figment::Figment::from(Toml::string("[required]\n"))
        .extract::<WithRequired>()
        .err()
        .map(ConfigError::from);
    assert_eq!(
        err.as_ref().and_then(ConfigError::key).as_deref(),
        Some("required.token")
    );
    let message = err.as_ref().map(chain).unwrap_or_default();
    assert!(
        message.starts_with("invalid configuration: required.token: missing field"),
        "{message}"
    );
}

#[test]
fn a_file_shared_with_other_binaries_loads_ignoring_their_sections() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file(
            "shared.toml",
            r#"
                [database]
                max_connections = 7

                [amqp]
                prefetch = 4

                [[providers]]
                account = "sms-main"
            "#,
        )?;
        let config = load_test(Some(Path::new("shared.toml"))).map_err(|e| chain(&e))?;
        assert_eq!(config.database.max_connections, 7);
        Ok(())
    });
}

#[test]
fn a_misspelt_section_in_the_file_is_refused_by_name() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("typo.toml", "[databse]\nurl = \"postgres://x@y/z\"\n")?;
        let err = load_test(Some(Path::new("typo.toml"))).unwrap_err();
        assert!(chain(&err).contains("databse"), "{}", chain(&err));
        Ok(())
    });
}

/// A binary with a list of tables, as the workers' `[[providers]]`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct ListConfig {
    database: DatabaseConfig,
    providers: Vec<Entry>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Entry {
    account: String,
    auth_token: Option<nudge_config::Secret>,
    timeout_ms: u64,
}

impl Validate for ListConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.database.validate()
    }
}

const TWO_ENTRIES: &str = r#"
    [[providers]]
    account = "sms-main"
    timeout_ms = 1000

    [[providers]]
    account = "sms-backup"
    timeout_ms = 2000
"#;

fn load_list(file: &str) -> Result<ListConfig, ConfigError> {
    load(Some(Path::new(file)), &["database", "providers"])
}

#[test]
fn an_indexed_variable_sets_a_key_of_that_entry_and_leaves_the_rest_of_the_list() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("list.toml", TWO_ENTRIES)?;
        jail.set_env("NUDGE_PROVIDERS__1__AUTH_TOKEN", "tok-backup");
        jail.set_env("NUDGE_PROVIDERS__0__TIMEOUT_MS", "1500");
        jail.set_env("NUDGE_DATABASE__MAX_CONNECTIONS", "4");
        let config = load_list("list.toml").map_err(|e| chain(&e))?;
        assert_eq!(config.providers.len(), 2);
        assert_eq!(config.providers[0].account, "sms-main");
        assert_eq!(config.providers[0].timeout_ms, 1500);
        assert!(config.providers[0].auth_token.is_none());
        assert_eq!(config.providers[1].account, "sms-backup");
        assert_eq!(config.providers[1].timeout_ms, 2000);
        assert_eq!(
            config.providers[1].auth_token.as_ref().map(|t| t.expose()),
            Some("tok-backup")
        );
        assert_eq!(config.database.max_connections, 4);
        Ok(())
    });
}

#[test]
fn an_index_past_the_entries_is_refused_naming_the_key_without_the_value() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("list.toml", TWO_ENTRIES)?;
        jail.set_env("NUDGE_PROVIDERS__2__AUTH_TOKEN", "tok-s3cr3t");
        let err = load_list("list.toml").unwrap_err();
        assert_eq!(err.key().as_deref(), Some("providers.2.auth_token"));
        let message = chain(&err);
        assert!(message.contains("has 2 entries"), "{message}");
        assert!(!message.contains("s3cr3t"), "{message}");
        Ok(())
    });
}

#[test]
fn an_unknown_key_of_an_entry_from_the_environment_is_named() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("list.toml", TWO_ENTRIES)?;
        jail.set_env("NUDGE_PROVIDERS__0__AUTH_TOKN", "x");
        let err = load_list("list.toml").unwrap_err();
        assert!(chain(&err).contains("auth_tokn"), "{}", chain(&err));
        Ok(())
    });
}

#[test]
fn an_index_into_a_section_that_is_no_list_is_refused() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file("list.toml", TWO_ENTRIES)?;
        jail.set_env("NUDGE_DATABASE__0__URL", "postgres://x@y/z");
        let err = load_list("list.toml").unwrap_err();
        assert_eq!(err.key().as_deref(), Some("database.0.url"));
        assert!(
            chain(&err).contains("database is not a list"),
            "{}",
            chain(&err)
        );
        Ok(())
    });
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct BrokerConfig {
    amqp: nudge_config::AmqpConfig,
}

impl Validate for BrokerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.amqp.validate()
    }
}

#[test]
fn the_cluster_addresses_come_from_a_file_list_or_one_environment_variable() {
    Jail::expect_with(|jail| {
        jail.clear_env();
        jail.create_file(
            "nudge.toml",
            r#"
                [amqp]
                urls = ["amqp://file@rabbit-1:5672/%2f", "amqp://file@rabbit-2:5672/%2f"]
            "#,
        )?;
        let from_file: BrokerConfig =
            load(Some(Path::new("nudge.toml")), &["amqp"]).map_err(|e| chain(&e))?;
        assert_eq!(
            from_file.amqp.addresses(),
            vec![
                "amqp://file@rabbit-1:5672/%2f",
                "amqp://file@rabbit-2:5672/%2f"
            ]
        );

        jail.set_env(
            "NUDGE_AMQP__URLS",
            r#"["amqp://env@rabbit-1:5672/%2f","amqp://env@rabbit-2:5672/%2f","amqp://env@rabbit-3:5672/%2f"]"#,
        );
        let from_env: BrokerConfig =
            load(Some(Path::new("nudge.toml")), &["amqp"]).map_err(|e| chain(&e))?;
        assert_eq!(from_env.amqp.addresses().len(), 3);
        assert_eq!(from_env.amqp.addresses()[2], "amqp://env@rabbit-3:5672/%2f");
        Ok(())
    });
}
