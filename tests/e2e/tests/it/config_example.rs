//! `config/nudge.example.toml` lists every key of every binary with its default, and cannot
//! drift: each binary's config struct is serialised with its defaults and every key it has must
//! be in the example with that value (a key without a default, commented out), and the example
//! must load as each binary's configuration (which refuses unknown keys).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Format, Toml};
use nudge_config::{Validate, load};
use nudge_console::ConsoleConfig;
use nudge_domain::Channel;
use nudge_events::EventsConfig;
use nudge_intake::IntakeConfig;
use nudge_janitor::JanitorConfig;
use nudge_producer::ProducerConfig;
use nudge_provider::{ApnsKeys, FcmKeys, HttpProviderConfig, ProviderKind};
use nudge_worker::WorkerConfig;
use nudgectl::CtlConfig;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

fn example_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/nudge.example.toml")
}

struct Example {
    text: String,
    values: Value,
}

fn example() -> Example {
    let path = example_path();
    Example {
        text: std::fs::read_to_string(&path).unwrap(),
        values: Figment::from(Toml::file_exact(&path)).extract().unwrap(),
    }
}

impl Example {
    /// The lines of `[section]` (or of the first `[[section]]`), up to the next table header.
    fn section_text(&self, section: &str) -> &str {
        let (start, header) = [format!("\n[{section}]\n"), format!("\n[[{section}]]\n")]
            .into_iter()
            .find_map(|header| self.text.find(&header).map(|start| (start, header)))
            .unwrap_or_else(|| panic!("no [{section}] in the example"));
        let body = &self.text[start + header.len()..];
        let end = body.find("\n[").map_or(body.len(), |i| i + 1);
        &body[..end]
    }

    /// Checks every key the defaults have: present with the same value, or, for a key without a
    /// default, shown commented out in its section. `differs` lists keys whose default in this
    /// binary is not the example's, with the value the binary has (the example says so).
    fn check_section(
        &self,
        binary: &str,
        section: &str,
        defaults: &serde_json::Map<String, Value>,
        example: &Value,
        differs: &[(&str, Value)],
    ) -> usize {
        let mut checked = 0;
        for (key, default) in defaults {
            let name = format!("{section}.{key}");
            if let Some((_, value)) = differs.iter().find(|(k, _)| *k == name) {
                assert_eq!(default, value, "{binary}: {name}'s own default changed");
                assert!(example.get(key).is_some(), "{binary}: {name} missing");
            } else if default.is_null() {
                let commented = format!("\n# {key} = ");
                assert!(
                    self.section_text(section).contains(&commented) && example.get(key).is_none(),
                    "{binary}: {name} has no default: show it commented out in [{section}]"
                );
            } else {
                assert_eq!(
                    example.get(key),
                    Some(default),
                    "{binary}: {name} in the example is not its default"
                );
            }
            checked += 1;
        }
        checked
    }
}

/// Every key of `T`'s defaults in every section but `providers` (a list, checked on its own),
/// then `T` loaded from the example, as the binary loads it.
fn check_binary<T>(binary: &str, sections: &[&str], differs: &[(&str, Value)]) -> usize
where
    T: Serialize + DeserializeOwned + Default + Validate,
{
    let example = example();
    let defaults = serde_json::to_value(T::default()).unwrap();
    let defaults = defaults.as_object().unwrap();
    let mut checked = 0;
    for (section, keys) in defaults {
        assert!(sections.contains(&section.as_str()), "{binary}: {section}");
        if section == "providers" {
            continue;
        }
        let keys = keys.as_object().unwrap();
        let in_example = example
            .values
            .get(section)
            .unwrap_or_else(|| panic!("{binary}: no [{section}] in the example"));
        checked += example.check_section(binary, section, keys, in_example, differs);
    }
    load::<T>(Some(&example_path()), sections)
        .unwrap_or_else(|e| panic!("{binary} refuses the example: {e}"));
    checked
}

#[test]
fn the_example_has_every_key_of_the_producer_with_its_default() {
    let checked = check_binary::<ProducerConfig>("nudge-producer", ProducerConfig::SECTIONS, &[]);
    assert_eq!(
        checked,
        6 + 6 + 4 + 9,
        "database, amqp, telemetry, producer"
    );
}

#[test]
fn the_example_has_every_key_of_the_workers_with_its_default() {
    let checked = check_binary::<WorkerConfig>("nudge-worker", WorkerConfig::SECTIONS, &[]);
    assert_eq!(
        checked,
        6 + 6 + 4 + 3 + 6 + 4 + 4,
        "database, amqp, telemetry, crypto, worker, retry, admission"
    );
}

#[test]
fn the_example_has_every_key_of_the_janitor_with_its_default() {
    let checked = check_binary::<JanitorConfig>("nudge-janitor", JanitorConfig::SECTIONS, &[]);
    assert_eq!(
        checked,
        6 + 6 + 4 + 5 + 4 + 4 + 14,
        "database, amqp, telemetry, janitor, retry, redrive, retention"
    );
}

#[test]
fn the_example_has_every_key_of_the_intake_with_its_default() {
    let checked = check_binary::<IntakeConfig>("nudge-intake", IntakeConfig::SECTIONS, &[]);
    assert_eq!(
        checked,
        6 + 4 + 3 + 10 + 4,
        "database, telemetry, crypto, intake, receipts"
    );
}

#[test]
fn the_example_has_every_key_of_nudge_events_with_its_default() {
    let checked = check_binary::<EventsConfig>("nudge-events", EventsConfig::SECTIONS, &[]);
    assert_eq!(
        checked,
        6 + 4 + 3 + 14,
        "database, telemetry, crypto, events"
    );
}

#[test]
fn the_example_has_every_key_of_nudge_console_with_its_default() {
    let checked = check_binary::<ConsoleConfig>("nudge-console", ConsoleConfig::SECTIONS, &[]);
    assert_eq!(checked, 6 + 4 + 8, "database, telemetry, console");
}

#[test]
fn the_example_has_every_key_of_nudgectl_with_its_default() {
    let checked = check_binary::<CtlConfig>(
        "nudgectl",
        CtlConfig::SECTIONS,
        &[("telemetry.log_filter", Value::from("warn"))],
    );
    assert_eq!(
        checked,
        6 + 4 + 3 + 14 + 1,
        "database, telemetry, crypto, retention, nudgectl"
    );
}

#[test]
fn the_example_provider_accounts_show_every_key_with_its_default() {
    let example = example();
    let entries = example.values["providers"].as_array().unwrap();
    assert_eq!(
        entries.len(),
        5,
        "a generic account, then one of each real kind"
    );
    let entry = &entries[0];
    let parsed: HttpProviderConfig = serde_json::from_value(entry.clone()).unwrap();
    parsed.validate("providers.0").unwrap();
    assert_eq!(parsed.channel, Channel::Sms);

    // The required keys as the example has them, every other key at its default.
    let defaults = serde_json::to_value(HttpProviderConfig::new(
        parsed.account.clone(),
        parsed.channel,
        parsed.base_url.clone(),
    ))
    .unwrap();
    let checked = example.check_section(
        "nudge-worker",
        "providers",
        defaults.as_object().unwrap(),
        entry,
        &[],
    );
    assert_eq!(checked, 11);
}

#[test]
fn the_example_shows_one_account_of_each_real_kind_with_every_key_at_its_default() {
    let example = example();
    let entries = example.values["providers"].as_array().unwrap();
    let mut kinds = Vec::new();
    let mut table_keys = 0;
    for (i, entry) in entries.iter().enumerate().skip(1) {
        let parsed: HttpProviderConfig = serde_json::from_value(entry.clone()).unwrap();
        parsed.validate(&format!("providers.{i}")).unwrap();
        assert!(!parsed.honours_idempotency);
        kinds.push(parsed.kind);
        // The required keys, the kind and its table as the example has them; every other key
        // at its default.
        let defaults = serde_json::to_value(HttpProviderConfig {
            kind: parsed.kind,
            twilio: parsed.twilio.clone(),
            sendgrid: parsed.sendgrid.clone(),
            ..HttpProviderConfig::new(
                parsed.account.clone(),
                parsed.channel,
                parsed.base_url.clone(),
            )
        })
        .unwrap();
        // The push kinds' tables are checked key by key: their required keys as the example
        // has them, every other key at its default.
        let kind = parsed.kind.as_str();
        let table = match parsed.kind {
            ProviderKind::Fcm => parsed.fcm.as_ref().map(|k| {
                serde_json::to_value(FcmKeys::new(
                    k.project_id.clone(),
                    k.client_email.clone(),
                    k.private_key.clone(),
                ))
            }),
            ProviderKind::Apns => parsed.apns.as_ref().map(|k| {
                serde_json::to_value(ApnsKeys::new(
                    k.team_id.clone(),
                    k.key_id.clone(),
                    k.private_key.clone(),
                    k.topic.clone(),
                ))
            }),
            _ => None,
        };
        let mut top = entry.clone();
        if let Some(table) = table {
            top.as_object_mut().unwrap().remove(kind);
            table_keys += example.check_section(
                "nudge-worker",
                &format!("providers.{kind}"),
                table.unwrap().as_object().unwrap(),
                &entry[kind],
                &[],
            );
        }
        let checked = example.check_section(
            "nudge-worker",
            "providers",
            defaults.as_object().unwrap(),
            &top,
            &[],
        );
        let with_table = usize::from(parsed.twilio.is_some() || parsed.sendgrid.is_some());
        assert_eq!(checked, 11 + with_table, "{}", parsed.kind);
    }
    assert_eq!(
        kinds,
        [
            ProviderKind::Twilio,
            ProviderKind::Sendgrid,
            ProviderKind::Fcm,
            ProviderKind::Apns
        ]
    );
    assert_eq!(
        table_keys,
        (6 + 3) + (8 + 3),
        "every key of the fcm and apns tables"
    );
}
