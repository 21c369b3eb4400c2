#[tokio::main]
async fn main() -> std::process::ExitCode {
    nudge_producer::main().await
}
