#[tokio::main]
async fn main() -> std::process::ExitCode {
    nudge_intake::main().await
}
