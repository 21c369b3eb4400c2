use std::io::Write as _;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;
use nudge_config::TelemetryConfig;
use nudge_telemetry::error_chain;

#[tokio::main]
async fn main() -> ExitCode {
    let args = provider_stub::Args::parse();
    let _telemetry = match nudge_telemetry::init("provider-stub", &TelemetryConfig::default()) {
        Ok(guard) => guard,
        Err(e) => {
            // No logger yet: stderr is the only place left to report it.
            #[allow(clippy::print_stderr)]
            {
                eprintln!("error: {}", error_chain(&e));
            }
            return ExitCode::FAILURE;
        }
    };
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error.cause_chain = %error_chain(&*e), "provider-stub failed");
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
    // APNs is only spoken over TLS: the authority is written before the address is announced.
    let tls = match args.shape {
        provider_stub::Shape::Apns => {
            let ca_out = args
                .tls_ca_out
                .as_deref()
                .context("--tls-ca-out is required for --shape apns")?;
            Some(provider_stub::tls::generate(ca_out)?)
        }
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };

    // The one line a harness reads to learn the port; flushed because stdout is a pipe there.
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on {scheme}://{addr}").context("failed to write to stdout")?;
    stdout.flush().context("failed to flush stdout")?;
    drop(stdout);
    tracing::info!(%addr, "provider stub listening");

    match tls {
        Some(tls) => provider_stub::serve_tls(listener, state, tls, shutdown).await,
        None => provider_stub::serve(listener, state, shutdown).await,
    }
    .context("server failed")?;
    tracing::info!("provider stub stopped");
    Ok(())
}
