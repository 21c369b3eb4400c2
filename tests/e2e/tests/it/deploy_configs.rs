//! The configuration files that ship with the deployments (`deploy/compose/nudge.toml`, the
//! Kubernetes base's and every overlay's `nudge.toml`) load as every binary that reads them,
//! with the secrets the environment adds there (the Kubernetes files hold none: the Secret
//! sets them as `NUDGE_*` variables, checked by `scripts/validate-k8s.sh`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use nudge_config::{AmqpConfig, DatabaseConfig, Secret, Validate, load};
use nudge_console::ConsoleConfig;
use nudge_domain::Channel;
use nudge_events::EventsConfig;
use nudge_intake::IntakeConfig;
use nudge_janitor::JanitorConfig;
use nudge_producer::ProducerConfig;
use nudge_worker::WorkerConfig;
use nudgectl::CtlConfig;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Public test key (32 bytes), standing in for the Secret's.
const KEY: &str = "vRdeBeF1KMBq4P78kL4MbxId31ISqKCBf5M1IV5/9Ow=";

fn deploy_configs() -> Vec<PathBuf> {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    let mut files = vec![
        deploy.join("compose/nudge.toml"),
        deploy.join("k8s/base/nudge.toml"),
    ];
    let overlays = std::fs::read_dir(deploy.join("k8s/overlays")).unwrap();
    for overlay in overlays {
        let file = overlay.unwrap().path().join("nudge.toml");
        if file.exists() {
            files.push(file);
        }
    }
    files
}

fn load_as<T>(file: &Path, sections: &[&str]) -> T
where
    T: Serialize + DeserializeOwned + Default + Validate,
{
    load::<T>(Some(file), sections)
        .unwrap_or_else(|e| panic!("{} does not load: {e}", file.display()))
}

#[test]
fn every_deployment_configuration_loads_as_every_binary() {
    let files = deploy_configs();
    assert!(
        files.len() >= 3,
        "compose, the base and an overlay: {files:?}"
    );
    for file in &files {
        load_as::<ProducerConfig>(file, ProducerConfig::SECTIONS);
        load_as::<JanitorConfig>(file, JanitorConfig::SECTIONS);
        load_as::<IntakeConfig>(file, IntakeConfig::SECTIONS);
        load_as::<EventsConfig>(file, EventsConfig::SECTIONS);
        load_as::<ConsoleConfig>(file, ConsoleConfig::SECTIONS);
        load_as::<CtlConfig>(file, CtlConfig::SECTIONS);
        let mut worker = load_as::<WorkerConfig>(file, WorkerConfig::SECTIONS);
        if worker.crypto.destination_key.is_none() {
            worker.crypto.destination_key = Some(Secret::new(KEY));
        }
        for channel in [Channel::Push, Channel::Email, Channel::Sms] {
            worker
                .validate_for(channel)
                .unwrap_or_else(|e| panic!("{} as the {channel} worker: {e}", file.display()));
        }
    }
}

#[test]
fn the_kubernetes_configurations_hold_no_secret() {
    let kubernetes = deploy_configs()
        .into_iter()
        .filter(|f| f.components().any(|c| c.as_os_str() == "k8s"))
        .collect::<Vec<_>>();
    assert!(
        kubernetes.len() >= 2,
        "the base and an overlay: {kubernetes:?}"
    );
    for file in &kubernetes {
        let worker = load_as::<WorkerConfig>(file, WorkerConfig::SECTIONS);
        let intake = load_as::<IntakeConfig>(file, IntakeConfig::SECTIONS);
        let console = load_as::<ConsoleConfig>(file, ConsoleConfig::SECTIONS);
        let name = file.display();
        assert!(
            console.console.session_key.is_none(),
            "{name}: console.session_key"
        );
        assert!(
            worker.crypto.destination_key.is_none(),
            "{name}: destination_key"
        );
        assert!(
            intake.crypto.subscriber_key.is_none(),
            "{name}: subscriber_key"
        );
        assert!(
            worker.providers.iter().all(|p| p.auth_token.is_none()),
            "{name}: a provider's auth_token"
        );
        // The URLs carry passwords: left at their defaults here, set from the Secret.
        assert_eq!(
            worker.database.url.expose(),
            DatabaseConfig::default().url.expose(),
            "{name}: database.url"
        );
        assert_eq!(
            worker.amqp.url.expose(),
            AmqpConfig::default().url.expose(),
            "{name}: amqp.url"
        );
    }
}
