#[tokio::main]
async fn main() -> std::process::ExitCode {
    nudge_events::main().await
}
