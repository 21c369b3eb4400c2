//! Every metric an alert rule or a dashboard panel reads is one a binary exports, and every
//! recording rule a panel reads is defined. What the binaries export is read from the code that
//! registers it (each binary's metrics struct lists its families), not from a copy kept by hand.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use nudge_console::ConsoleMetrics;
use nudge_events::EventsMetrics;
use nudge_intake::IntakeMetrics;
use nudge_janitor::JanitorMetrics;
use nudge_producer::ProducerMetrics;
use nudge_worker::WorkerMetrics;

fn observability() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/observability")
}

/// Every sample name a scrape of any binary can carry.
fn exported() -> BTreeSet<String> {
    let registries = [
        WorkerMetrics::new().registry(),
        ProducerMetrics::new().registry(),
        JanitorMetrics::new().registry(),
        IntakeMetrics::new().registry(),
        EventsMetrics::new().registry(),
        ConsoleMetrics::new().registry(),
    ];
    registries
        .iter()
        .flat_map(|r| r.families().iter().flat_map(|f| f.sample_names()))
        .collect()
}

/// The identifiers in `text` that start with `prefix` (`nudge_` for metrics, `nudge:` for
/// recording rules): a word made of lower-case letters, digits, `_` and `:`.
fn names(text: &str, prefix: &str) -> BTreeSet<String> {
    let word = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == ':';
    let mut found = BTreeSet::new();
    for (i, _) in text.match_indices(prefix) {
        if text[..i].chars().next_back().is_some_and(word) {
            continue;
        }
        let name: String = text[i..].chars().take_while(|&c| word(c)).collect();
        // "nudge: deliveries" (a title) names nothing.
        if name.len() > prefix.len() {
            found.insert(name);
        }
    }
    found
}

fn rules_text() -> String {
    let dir = observability().join("rules");
    let mut text = String::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        text.push_str(&std::fs::read_to_string(entry.unwrap().path()).unwrap());
    }
    text
}

fn dashboards_text() -> String {
    let dir = observability().join("grafana");
    let mut text = String::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let body = std::fs::read_to_string(&path).unwrap();
        let json: serde_json::Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
        assert!(json["panels"].is_array(), "{} has panels", path.display());
        text.push_str(&body);
    }
    text
}

#[test]
fn every_metric_the_alert_rules_read_is_exported_by_a_binary() {
    let exported = exported();
    let used = names(&rules_text(), "nudge_");
    assert!(used.len() > 10, "the rules read metrics: {used:?}");
    let missing: Vec<&String> = used.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "rules read metrics no binary exports: {missing:?}"
    );
}

#[test]
fn every_metric_and_recording_rule_a_dashboard_panel_reads_exists() {
    let exported = exported();
    let dashboards = dashboards_text();
    let used = names(&dashboards, "nudge_");
    assert!(used.len() > 10, "the panels read metrics: {used:?}");
    let missing: Vec<&String> = used.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "panels read metrics no binary exports: {missing:?}"
    );
    let recorded: BTreeSet<String> = rules_text()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record: "))
        .map(|name| name.trim().to_owned())
        .collect();
    let missing: Vec<String> = names(&dashboards, "nudge:")
        .into_iter()
        .filter(|name| !recorded.contains(name))
        .collect();
    assert!(
        missing.is_empty(),
        "panels read recording rules that are not defined: {missing:?}"
    );
}

#[test]
fn the_name_scanner_finds_whole_metric_names_only() {
    let text =
        r#"rate(nudge_attempts_total{x="y"}[5m]) / nudge:throttled:ratio_rate10m my_nudge_x"#;
    assert_eq!(
        names(text, "nudge_").into_iter().collect::<Vec<_>>(),
        ["nudge_attempts_total"]
    );
    assert_eq!(
        names(text, "nudge:").into_iter().collect::<Vec<_>>(),
        ["nudge:throttled:ratio_rate10m"]
    );
}
