//! The real `provider-stub` binary, spawned as a separate process.

#![allow(clippy::unwrap_used, clippy::expect_used)] // A failed unwrap is a failed test, with its location.

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_provider-stub"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn wait_with_deadline(child: &mut Child, deadline: Duration) -> std::process::ExitStatus {
    let until = Instant::now() + deadline;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("provider-stub did not exit within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn the_binary_prints_its_port_serves_and_exits_zero_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("provider-stub-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script_file = dir.join("scripts.json");
    std::fs::write(
        &script_file,
        r#"{"sms-main": {"sequence": [{"status": 429, "retry_after": "7"}]}}"#,
    )
    .unwrap();

    let mut child = spawn(&[
        "--listen",
        "127.0.0.1:0",
        "--script-file",
        script_file.to_str().unwrap(),
    ]);
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .trim_end()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    assert!(base.starts_with("http://127.0.0.1:"), "{base}");

    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let health = client.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let r = client
        .post(format!("{base}/accounts/sms-main/v1/messages"))
        .header("Idempotency-Key", "k")
        .json(&serde_json::json!({"channel": "sms", "to": "+15550100", "content": null}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429, "the script file was applied");
    assert_eq!(r.headers()["retry-after"], "7");

    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = wait_with_deadline(&mut child, Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{status:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_binary_refuses_a_non_loopback_address_unless_allowed() {
    let mut child = spawn(&["--listen", "0.0.0.0:0"]);
    let status = wait_with_deadline(&mut child, Duration::from_secs(10));
    assert_eq!(status.code(), Some(1));
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    assert!(out.is_empty(), "nothing announced: {out:?}");
}
