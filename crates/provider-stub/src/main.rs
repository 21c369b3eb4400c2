use std::io::Write as _;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;
use nudge_config::TelemetryConfig;

#[tokio::main]
async fn main() -> ExitCode {
    let args = provider_stub::Args::parse();
    let _telemetry = match nudge_telemetry::init("provider-stub", &TelemetryConfig::default()) {
        Ok(guard) => guard,
        Err(e) => {
            // No logger yet: stderr is the only place left to report it.
            #[allow(clippy::print_stderr)]
            {
                eprintln!("error: {}", nudge_telemetry::error_chain(&e));
            }
            return ExitCode::FAILURE;
        }
    };
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error.cause_chain = %format!("{e:#}"), "provider-stub failed");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: provider_stub::Args) -> anyhow::Result<()> {
    let state = provider_stub::StubState::with_shape(args.shape_config()?);
    if let Some(path) = &args.script_file {
        for (account, script) in provider_stub::load_scripts(path)? {
            state.set_script(account, script);
        }
    }
    let listener = provider_stub::bind(&args).await?;
    let shutdown = provider_stub::shutdown_signal().context("failed to install signal handlers")?;
    let addr = listener
        .local_addr()
        .context("failed to read the bound address")?;

    // The one line a harness reads to learn the port; flushed because stdout is a pipe there.
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on http://{addr}").context("failed to write to stdout")?;
    stdout.flush().context("failed to flush stdout")?;
    drop(stdout);
    tracing::info!(%addr, "provider stub listening");

    provider_stub::serve(listener, state, shutdown)
        .await
        .context("server failed")?;
    tracing::info!("provider stub stopped");
    Ok(())
}
