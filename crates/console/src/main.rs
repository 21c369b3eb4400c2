#[tokio::main]
async fn main() -> std::process::ExitCode {
    nudge_console::main().await
}
