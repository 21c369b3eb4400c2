//! The Prometheus scrape endpoint: `GET /metrics` on the admin address, answering with the
//! OpenMetrics text encoding of one [`Registry`].
//!
//! The registry is passed in, never global: each binary registers its own families and hands
//! the registry here. The listener serves nothing but metrics, so it can sit on an admin port
//! that is not exposed with the service.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;

/// The content type of the OpenMetrics text exposition format.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Binds `addr`, serves `GET /metrics` from `registry` in the background until `shutdown`
/// completes, and returns the bound address (the real port when `addr` asked for port 0).
///
/// Binding happens before this returns, so a taken or invalid address is an error for the
/// caller to report at start-up; a failure of the running server later is logged here.
pub async fn serve_metrics(
    addr: SocketAddr,
    registry: Arc<Registry>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .with_state(registry);
    tracing::info!(metrics_addr = %bound, "metrics listening");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error.cause_chain = ?e, metrics_addr = %bound, "metrics listener failed");
        }
    });
    Ok(bound)
}

async fn metrics(State(registry): State<Arc<Registry>>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)], body).into_response(),
        Err(e) => {
            tracing::error!(error.cause_chain = ?e, "failed to encode metrics");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}
