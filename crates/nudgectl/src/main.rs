use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = nudgectl::Cli::parse();
    match nudgectl::run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The operator reads this on a terminal: the whole chain, once.
            #[allow(clippy::print_stderr)]
            {
                eprintln!("{}", nudgectl::failure_message(&e));
            }
            ExitCode::FAILURE
        }
    }
}
