//! The `/metrics` listener, spawned for real on port 0 and scraped over HTTP.

#![allow(clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use nudge_telemetry::{OPENMETRICS_CONTENT_TYPE, serve_metrics};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;

#[tokio::test]
async fn get_metrics_answers_with_the_registered_gauge_in_openmetrics_text() {
    let mut registry = Registry::default();
    let gauge = Gauge::<f64, AtomicU64>::default();
    registry.register("nudge_test_level", "A gauge for the test", gauge.clone());
    gauge.set(2.5);
    let (stop, stopped) = oneshot::channel::<()>();

    let addr = serve_metrics(
        "127.0.0.1:0".parse().expect("a valid address"),
        Arc::new(registry),
        async {
            let _ = stopped.await;
        },
    )
    .await
    .expect("binds port 0");
    assert_ne!(addr.port(), 0, "the bound port is returned");

    let response = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .expect("the listener answers");
    assert_eq!(response.status(), reqwest::StatusCode::OK);
    assert_eq!(
        response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
        Some(OPENMETRICS_CONTENT_TYPE)
    );
    let body = response.text().await.expect("a text body");
    assert!(
        body.lines().any(|line| line == "nudge_test_level 2.5"),
        "{body}"
    );
    assert!(body.ends_with("# EOF\n"), "{body}");

    let _ = stop.send(());
}

#[tokio::test]
async fn other_paths_are_not_found() {
    let addr = serve_metrics(
        "127.0.0.1:0".parse().expect("a valid address"),
        Arc::new(Registry::default()),
        std::future::pending(),
    )
    .await
    .expect("binds port 0");
    let response = reqwest::get(format!("http://{addr}/"))
        .await
        .expect("the listener answers");
    assert_eq!(response.status(), reqwest::StatusCode::NOT_FOUND);
}
