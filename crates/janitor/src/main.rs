#[tokio::main]
async fn main() -> std::process::ExitCode {
    nudge_janitor::main().await
}
