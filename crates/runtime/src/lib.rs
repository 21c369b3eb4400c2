//! Process lifecycle shared by the long-running nudge binaries: a cancellation token that
//! SIGTERM or Ctrl-C cancels (shutdown is passed in, never a global), and one way to turn a
//! run's result into an exit code with the whole error chain reported once.
//!
//! [`Application::build`] is the one start-up of those binaries (configuration, telemetry,
//! ledger, broker, metrics listener, shutdown token); see [`bootstrap`].
//!
//! It must never decide what shutting down means for a binary's work: each binary's loop
//! watches the token and finishes or releases its own in-flight work.

pub mod bootstrap;
pub mod outage;
pub mod restore_guard;

pub use bootstrap::{Application, ServiceConfig, load_config};
pub use outage::Outage;

use std::process::ExitCode;

use nudge_telemetry::error_chain;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// A token cancelled on the first SIGTERM or Ctrl-C. Must be called inside a tokio runtime.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        #[cfg(unix)]
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(e) => {
                    warn!(error.cause_chain = %error_chain(&e), "cannot listen for SIGTERM");
                    std::future::pending::<()>().await;
                }
            }
        };
        #[cfg(not(unix))]
        let term = std::future::pending::<()>();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => info!("interrupt received: shutting down"),
            () = term => info!("SIGTERM received: shutting down"),
        }
        cancel.cancel();
    });
    token
}

/// The exit code of a run: success, or failure with the error chain logged once and printed
/// on stderr (the log may not be set up yet when configuration is what failed).
pub fn exit_code(service: &str, result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The chain on one line; `Debug` of an anyhow error would add its backtrace (when
            // one was captured) to a log line.
            error!(error.cause_chain = %error_chain(&*e), "{service} stopped");
            #[allow(clippy::print_stderr)]
            {
                eprintln!("error: {}", error_chain(&*e));
            }
            ExitCode::FAILURE
        }
    }
}
