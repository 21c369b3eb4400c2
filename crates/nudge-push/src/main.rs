#[tokio::main]
async fn main() -> std::process::ExitCode {
    nudge_worker::main_for(nudge_domain::Channel::Push).await
}
