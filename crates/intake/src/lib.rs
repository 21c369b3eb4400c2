//! `nudge-intake`: the signed webhook through which a clinic's application hands nudge its
//! reminders, cancels them, keeps its subscribers' destinations and erases a subscriber, over
//! the same ledger as every other binary, and through which providers' delivery receipts
//! arrive ([`receipts`]). The routes are in [`handlers`] (by resource), the state they share
//! in [`state`], authentication in [`auth`] (over [`signature`]), the request and answer
//! shapes in [`shapes`], and the contract, generated from this code, in [`openapi`]
//! (committed as `docs/openapi.json`).
//!
//! It must never: answer 2xx before the ledger committed; write anything for a request it
//! refused; echo, log or put in a metric a destination, subscriber reference or content; tell
//! a client whether a tenant exists.

pub mod auth;
pub mod commit;
mod config;
pub mod error;
pub mod extract;
pub mod handlers;
pub mod metrics;
pub mod openapi;
pub mod receipts;
pub mod shapes;
pub mod signature;
pub mod state;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use hyper_util::rt::{TokioIo, TokioTimer};
use nudge_ledger::{DestinationCipher, SubscriberKey};
use nudge_telemetry::error_chain;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;
use tracing::{info, warn};

use crate::handlers::{
    events, inbound, operations, receipts as receipt_routes, reminders, series, subscribers,
};

pub use config::{IntakeConfig, IntakeSection};
pub use metrics::IntakeMetrics;
pub use openapi::{ApiDoc, openapi_json};
pub use state::{AppState, Limits};

/// Every route, with the body limit and the request timeout.
pub fn router(state: AppState, body_limit: usize, request_timeout: Duration) -> Router {
    Router::new()
        .route(
            "/v1/tenants/{tenant}/reminders",
            post(reminders::post_reminders),
        )
        .route(
            "/v1/tenants/{tenant}/reminders/{event_id}",
            get(reminders::get_reminder).put(reminders::put_reminder),
        )
        .route(
            "/v1/tenants/{tenant}/reminders/{event_id}/cancel",
            post(reminders::cancel_reminder),
        )
        .route("/v1/tenants/{tenant}/series", post(series::post_series))
        .route(
            "/v1/tenants/{tenant}/series/{series_id}",
            get(series::get_series),
        )
        .route(
            "/v1/tenants/{tenant}/series/{series_id}/cancel",
            post(series::cancel_series),
        )
        .route(
            "/v1/tenants/{tenant}/subscribers/{subscriber_ref}/contacts",
            put(subscribers::put_contacts),
        )
        .route(
            "/v1/tenants/{tenant}/subscribers/{subscriber_ref}",
            delete(subscribers::erase_subscriber),
        )
        .route(
            "/v1/tenants/{tenant}/subscribers/{subscriber_ref}/consent-history",
            get(subscribers::get_consent_history),
        )
        .route(
            "/v1/tenants/{tenant}/subscribers/{subscriber_ref}/preferences",
            get(subscribers::get_preferences).put(subscribers::put_preferences),
        )
        .route("/v1/tenants/{tenant}/events", get(events::get_events))
        .route("/receipts/twilio/{account}", post(receipt_routes::twilio))
        .route("/inbound/twilio/{account}", post(inbound::twilio))
        .route("/inbound/generic/{account}", post(inbound::generic))
        .route(
            "/receipts/sendgrid/{account}",
            post(receipt_routes::sendgrid),
        )
        .route("/healthz", get(operations::healthz))
        .route("/readyz", get(operations::readyz))
        .route("/openapi.json", get(openapi::openapi))
        .layer(axum::middleware::from_fn_with_state(
            (state.clone(), request_timeout),
            observe,
        ))
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// Bounds each request's time (408 past it) and counts it by route template and status.
async fn observe(
    State((state, timeout)): State<(AppState, Duration)>,
    request: Request,
    next: Next,
) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_owned();
    let started = Instant::now();
    let response = match tokio::time::timeout(timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => error::ApiError::Timeout.into_response(),
    };
    // A ledger outage is logged when it begins and when it ends, not per request.
    if let Some(error::LedgerAway(e)) = response.extensions().get::<error::LedgerAway>() {
        state.outage().away(e.as_ref().as_ref());
    } else if response.status().is_success() {
        state.outage().back();
    }
    state.metrics().request(
        &route,
        response.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    response
}

/// What [`read_whole_body`] needs: one deadline for the whole body, its limit, and the room
/// for bodies being read at once.
struct BodyReading {
    timeout: Duration,
    limit: usize,
    permits: Arc<Semaphore>,
}

/// Reads a request's body whole before the router sees it, under one deadline from its
/// headers' arrival (a timeout per frame would let a client that sends a byte now and then
/// hold its buffer for ever) and within the number of bodies read at once: every body is
/// read before its signature can be checked, so these two bound what unauthenticated
/// clients can make the intake hold (`max_body_reads` x `body_limit` bytes).
async fn read_whole_body(
    State(reading): State<Arc<BodyReading>>,
    request: Request,
    next: Next,
) -> Response {
    use http_body_util::BodyExt;
    let deadline = tokio::time::Instant::now() + reading.timeout;
    let (parts, body) = request.into_parts();
    if axum::body::HttpBody::size_hint(&body).exact() == Some(0) {
        return next.run(Request::from_parts(parts, body)).await;
    }
    let declared = parts
        .headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > reading.limit as u64) {
        return error::ApiError::TooLarge.into_response();
    }
    let Ok(Ok(permit)) =
        tokio::time::timeout_at(deadline, reading.permits.clone().acquire_owned()).await
    else {
        return error::ApiError::Timeout.into_response();
    };
    let limited = http_body_util::Limited::new(body, reading.limit);
    let bytes = match tokio::time::timeout_at(deadline, limited.collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return error::ApiError::TooLarge.into_response();
        }
        // Past the deadline, or the client went away mid-body.
        Ok(Err(_)) | Err(_) => return error::ApiError::Timeout.into_response(),
    };
    drop(permit);
    next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
        .await
}

/// How [`serve`] treats connections.
#[derive(Debug, Clone, Copy)]
pub struct ServeSettings {
    /// A client that has not sent its headers within this long is disconnected.
    pub header_read_timeout: Duration,
    /// A body that has not arrived whole within this long of its headers is answered 408,
    /// however it is cut into frames.
    pub body_read_timeout: Duration,
    /// The largest body read (`intake.body_limit_bytes`): a longer one is answered 413.
    pub body_limit: usize,
    /// Bodies read at once (none is authenticated before it is whole); a request that finds
    /// no room within its body's time is answered 408 without a byte of it being held.
    pub max_body_reads: usize,
    pub max_connections: usize,
    /// How long requests in flight may finish after shutdown.
    pub grace: Duration,
}

/// Serves `router` on `listener` (HTTP/1.1) until `shutdown`, then lets requests in flight
/// finish within the grace period. Connections beyond `max_connections` wait to be accepted.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    settings: ServeSettings,
    shutdown: CancellationToken,
) {
    let reading = Arc::new(BodyReading {
        timeout: settings.body_read_timeout,
        limit: settings.body_limit,
        permits: Arc::new(Semaphore::new(settings.max_body_reads.max(1))),
    });
    let router = router.layer(axum::middleware::from_fn_with_state(
        reading,
        read_whole_body,
    ));
    let permits = Arc::new(Semaphore::new(settings.max_connections.max(1)));
    let connections = TaskTracker::new();
    let close = CancellationToken::new();
    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let (stream, _peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors and the like: wait a little rather than spin.
                    warn!(error.cause_chain = %error_chain(&e), "failed to accept a connection");
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(Duration::from_millis(50)) => continue,
                    }
                }
            },
        };
        let router = router.clone();
        let close = close.clone();
        let header_read_timeout = settings.header_read_timeout;
        connections.spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(
                move |request: hyper::Request<hyper::body::Incoming>| {
                    router.clone().oneshot(request.map(axum::body::Body::new))
                },
            );
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(Some(header_read_timeout));
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(e) = result {
                        tracing::debug!(error.cause_chain = %error_chain(&e), "connection ended with an error");
                    }
                }
                () = close.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    if let Err(e) = connection.await {
                        tracing::debug!(error.cause_chain = %error_chain(&e), "connection ended with an error");
                    }
                }
            }
        });
    }
    close.cancel();
    connections.close();
    if tokio::time::timeout(settings.grace, connections.wait())
        .await
        .is_err()
    {
        warn!(
            grace_ms = settings.grace.as_millis() as u64,
            "requests in flight did not finish in time"
        );
    }
}

#[derive(Debug, clap::Parser)]
#[command(
    version,
    about = "The signed webhook: reminders, cancellation, contacts and erasure over HTTP.",
    long_about = "The signed webhook: reminders, cancellation, contacts and erasure over HTTP, \
                  answered after commit.\n\nConfiguration: defaults, then the TOML file given \
                  by --config or NUDGE_CONFIG, then NUDGE_* environment variables. See \
                  config/nudge.example.toml. Prints `listening on http://ADDR` once it accepts \
                  connections. SIGTERM or Ctrl-C stops accepting, lets requests in flight \
                  finish and exits 0."
)]
pub struct Cli {
    /// TOML configuration file (overrides NUDGE_CONFIG).
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
}

pub async fn main() -> ExitCode {
    use clap::Parser;
    let cli = Cli::parse();
    nudge_runtime::exit_code("intake", run_binary(cli).await)
}

async fn run_binary(cli: Cli) -> anyhow::Result<()> {
    let config: IntakeConfig = nudge_runtime::load_config(cli.config.as_deref())?;
    config.validate_to_run().context("invalid configuration")?;
    let metrics = Arc::new(IntakeMetrics::new());
    let app = nudge_runtime::Application::build("nudge-intake", config, metrics.registry()).await?;
    let crypto = &app.config.crypto;
    let key = crypto
        .destination_key_bytes()?
        .context("crypto.destination_key is required")?;
    let subscriber = crypto
        .subscriber_key_bytes()?
        .context("crypto.subscriber_key is required")?;
    let mut cipher =
        DestinationCipher::new(&key).with_subscriber_key(SubscriberKey::new(&subscriber));
    match crypto.tenant_secret_key_bytes()? {
        Some(secrets) => cipher = cipher.with_tenant_secret_key(&secrets),
        None => tracing::warn!(
            "crypto.tenant_secret_key is not set: tenants' signing secrets sealed with the \
             destination key, which every worker holds, are all this intake can open"
        ),
    }
    let section = &app.config.intake;
    let state = AppState::new(
        app.ledger.clone(),
        cipher,
        metrics,
        Limits {
            batch_max: section.batch_max,
            timestamp_tolerance_s: section.timestamp_tolerance_s,
            max_schedule_ahead: chrono::Duration::days(i64::from(section.max_schedule_ahead_days)),
        },
        Arc::new(chrono::Utc::now),
    )
    .with_receipts(app.config.receipts.build()?);
    let listener = TcpListener::bind(section.listen_addr)
        .await
        .with_context(|| {
            format!(
                "failed to listen on {} (intake.listen_addr)",
                section.listen_addr
            )
        })?;
    let bound: SocketAddr = listener
        .local_addr()
        .context("failed to read the bound address")?;
    info!(listen_addr = %bound, "intake listening");
    announce(bound);
    let router = router(
        state,
        section.body_limit_bytes,
        Duration::from_millis(section.request_timeout_ms),
    );
    serve(
        listener,
        router,
        ServeSettings {
            header_read_timeout: Duration::from_millis(section.header_read_timeout_ms),
            body_read_timeout: Duration::from_millis(section.body_read_timeout_ms),
            body_limit: section.body_limit_bytes,
            max_body_reads: section.max_body_reads,
            max_connections: section.max_connections,
            grace: Duration::from_secs(10),
        },
        app.shutdown.clone(),
    )
    .await;
    app.stop().await;
    Ok(())
}

/// The one line on stdout: where the intake listens (port 0 is resolved), for scripts and the
/// test harness.
#[allow(clippy::print_stdout)]
fn announce(bound: SocketAddr) {
    use std::io::Write;
    println!("listening on http://{bound}");
    let _ = std::io::stdout().flush();
}
