//! The admin listener, spawned for real on port 0 and called over HTTP.

#![allow(clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use nudge_telemetry::{
    MetricRegistry, OPENMETRICS_CONTENT_TYPE, ReadyCheck, always_ready, serve_admin,
};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::oneshot;

#[tokio::test]
async fn get_metrics_answers_with_the_registered_gauge_in_openmetrics_text() {
    let mut registry = MetricRegistry::new();
    let gauge = Gauge::<f64, AtomicU64>::default();
    registry.register("nudge_test_level", "A gauge for the test", gauge.clone());
    gauge.set(2.5);
    let (stop, stopped) = oneshot::channel::<()>();

    let addr = serve_admin(
        "127.0.0.1:0".parse().expect("a valid address"),
        Arc::new(registry),
        always_ready(),
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
async fn healthz_answers_and_readyz_follows_the_readiness_check() {
    let ready: ReadyCheck = Arc::new(|| Box::pin(async { Err("ledger not reachable") }));
    let not_ready = serve_admin(
        "127.0.0.1:0".parse().expect("a valid address"),
        Arc::new(MetricRegistry::new()),
        ready,
        std::future::pending(),
    )
    .await
    .expect("binds port 0");
    let healthz = reqwest::get(format!("http://{not_ready}/healthz"))
        .await
        .expect("the listener answers");
    assert_eq!(healthz.status(), reqwest::StatusCode::OK);
    let readyz = reqwest::get(format!("http://{not_ready}/readyz"))
        .await
        .expect("the listener answers");
    assert_eq!(readyz.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        readyz.text().await.expect("a text body"),
        "ledger not reachable"
    );

    let ready = serve_admin(
        "127.0.0.1:0".parse().expect("a valid address"),
        Arc::new(MetricRegistry::new()),
        always_ready(),
        std::future::pending(),
    )
    .await
    .expect("binds port 0");
    let readyz = reqwest::get(format!("http://{ready}/readyz"))
        .await
        .expect("the listener answers");
    assert_eq!(readyz.status(), reqwest::StatusCode::OK);
}

#[tokio::test]
async fn other_paths_are_not_found() {
    let addr = serve_admin(
        "127.0.0.1:0".parse().expect("a valid address"),
        Arc::new(MetricRegistry::new()),
        always_ready(),
        std::future::pending(),
    )
    .await
    .expect("binds port 0");
    let response = reqwest::get(format!("http://{addr}/"))
        .await
        .expect("the listener answers");
    assert_eq!(response.status(), reqwest::StatusCode::NOT_FOUND);
}
