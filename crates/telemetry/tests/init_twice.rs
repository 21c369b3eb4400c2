//! `init` installs a process-wide subscriber, so this runs in its own test binary.

use nudge_config::{LogFormat, TelemetryConfig};
use nudge_telemetry::{TelemetryError, init};

#[test]
fn a_second_init_is_an_error_not_a_panic() {
    let cfg = TelemetryConfig {
        log_format: LogFormat::Json,
        ..TelemetryConfig::default()
    };
    let first = init("nudge-test", &cfg);
    assert!(first.is_ok(), "{first:?}");
    let second = init("nudge-test", &cfg);
    assert!(
        matches!(second, Err(TelemetryError::AlreadyInitialised(_))),
        "{second:?}"
    );
}
