//! The HTTP surface: the provider API per account, admin, stats and the webhook receiver.

use std::future::Future;
use std::io;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use nudge_domain::{Channel, ProviderAccount};
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::script::Script;
use crate::state::{Incoming, Reply, StubState};

/// The longest a `hang` step holds a connection.
pub const MAX_HANG: Duration = Duration::from_secs(120);

/// Longest `Idempotency-Key` taken; real providers cap it similarly.
const MAX_KEY_LEN: usize = 255;

#[derive(Clone)]
pub(crate) struct App {
    pub(crate) stub: StubState,
    /// Cancelled when shutdown starts, so held (hung or delayed) requests end and graceful
    /// shutdown does not wait out [`MAX_HANG`].
    pub(crate) shutdown: CancellationToken,
    /// Sends the shapes' delivery receipts.
    pub(crate) receipts: reqwest::Client,
}

/// Serves the stub on `listener` until `shutdown` completes, then finishes open requests (held
/// ones are released at once) and returns.
pub async fn serve(
    listener: TcpListener,
    state: StubState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let token = CancellationToken::new();
    let app = router(app(state, &token)?);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            token.cancel();
        })
        .await
}

/// [`serve`] over TLS with HTTP/2 only (the APNs shape), with `tls` from [`crate::tls::generate`].
pub async fn serve_tls(
    listener: TcpListener,
    state: StubState,
    tls: std::sync::Arc<tokio_rustls::rustls::ServerConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let token = CancellationToken::new();
    let app = router(app(state, &token)?);
    crate::tls::serve(listener, app, tls, async move {
        shutdown.await;
        token.cancel();
    })
    .await
}

fn app(state: StubState, shutdown: &CancellationToken) -> io::Result<App> {
    let receipts = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .no_proxy()
        .build()
        .map_err(io::Error::other)?;
    Ok(App {
        stub: state,
        shutdown: shutdown.clone(),
        receipts,
    })
}

fn router(app: App) -> Router {
    crate::shape::provider_routes(app.stub.shape().shape)
        .route("/admin/accounts/{account}", put(put_script).get(get_script))
        .route("/admin/reset", post(reset))
        .route("/admin/inbound", post(crate::twilio::send_inbound))
        .route("/stats", get(stats))
        .route("/stats/keys", get(keys))
        .route("/healthz", get(healthz))
        .merge(crate::webhooks::routes())
        .with_state(app)
}

/// The request body a provider expects. Only checked, never kept: `to` and `content` are PHI.
#[derive(Deserialize)]
struct MessageBody {
    #[allow(dead_code)] // Deserialized to check it is a channel name.
    channel: Channel,
    to: String,
    #[serde(default)]
    #[allow(dead_code)] // Any JSON, or null; its presence is all a provider checks here.
    content: Option<serde::de::IgnoredAny>,
}

fn check_body(body: &[u8]) -> Option<&'static str> {
    match serde_json::from_slice::<MessageBody>(body) {
        Ok(b) if b.to.is_empty() => Some("`to` must not be empty"),
        Ok(_) => None,
        Err(_) => Some(
            "body must be JSON {\"channel\": push|email|sms, \"to\": string, \"content\": any}",
        ),
    }
}

pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

/// A 400 with `{"error": message}`.
pub(crate) struct BadRequest(String);

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        error(StatusCode::BAD_REQUEST, self.0)
    }
}

pub(crate) fn parse_account(raw: &str) -> Result<ProviderAccount, BadRequest> {
    ProviderAccount::parse(raw).map_err(|e| BadRequest(e.to_string()))
}

pub(crate) async fn send_message(
    State(app): State<App>,
    Path(account): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let account = match parse_account(&account) {
        Ok(a) => a,
        Err(r) => return r.into_response(),
    };
    let (key, key_invalid) = match headers.get("idempotency-key").map(HeaderValue::to_str) {
        None => (None, None),
        Some(Ok(k)) if !k.is_empty() && k.len() <= MAX_KEY_LEN => (Some(k), None),
        Some(_) => (
            None,
            Some("Idempotency-Key must be 1 to 255 visible ASCII characters"),
        ),
    };
    let invalid = key_invalid.or_else(|| check_body(&body));
    drop(body);
    let traceparent = headers.get("traceparent").and_then(|v| v.to_str().ok());
    let reply = app.stub.handle(
        &account,
        Incoming {
            key,
            invalid,
            traceparent,
            dedupe: true,
        },
    );
    tracing::debug!(
        provider_account = %account,
        status = reply.status,
        delay_ms = reply.delay.map(|d| d.as_millis() as u64),
        hang = reply.hang,
        "provider request"
    );
    carry_out(&app, reply, into_response).await
}

/// Carries out a decided reply: holds it (a hang, a delay), then renders it in the shape's form.
pub(crate) async fn carry_out(
    app: &App,
    reply: Reply,
    render: impl FnOnce(Reply) -> Response,
) -> Response {
    if reply.hang {
        return hang(&app.shutdown).await;
    }
    if let Some(delay) = reply.delay {
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = app.shutdown.cancelled() => {}
        }
    }
    render(reply)
}

/// Holds the request open. Hyper drops this future when the client goes away; otherwise it ends
/// at shutdown or after [`MAX_HANG`], answering 504 to whoever is still waiting.
async fn hang(shutdown: &CancellationToken) -> Response {
    tokio::select! {
        () = tokio::time::sleep(MAX_HANG) => {}
        () = shutdown.cancelled() => {}
    }
    error(StatusCode::GATEWAY_TIMEOUT, "hang ended")
}

fn into_response(reply: Reply) -> Response {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, Json(reply.body)).into_response();
    if let Some(ra) = reply.retry_after
        && let Ok(value) = HeaderValue::from_str(&ra)
    {
        response.headers_mut().insert(header::RETRY_AFTER, value);
    }
    response
}

async fn put_script(
    State(app): State<App>,
    Path(account): Path<String>,
    script: Result<Json<Script>, JsonRejection>,
) -> Response {
    let account = match parse_account(&account) {
        Ok(a) => a,
        Err(r) => return r.into_response(),
    };
    match script {
        Ok(Json(script)) => {
            tracing::info!(provider_account = %account, "script set");
            app.stub.set_script(account, script);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(rejection) => error(StatusCode::BAD_REQUEST, rejection.body_text()),
    }
}

async fn get_script(State(app): State<App>, Path(account): Path<String>) -> Response {
    match parse_account(&account) {
        Ok(a) => Json(app.stub.script(&a)).into_response(),
        Err(r) => r.into_response(),
    }
}

async fn reset(State(app): State<App>) -> StatusCode {
    app.stub.reset();
    tracing::info!("state reset");
    StatusCode::NO_CONTENT
}

async fn stats(State(app): State<App>) -> Response {
    Json(app.stub.stats()).into_response()
}

async fn keys(State(app): State<App>) -> Response {
    Json(app.stub.keys()).into_response()
}

async fn healthz() -> &'static str {
    "ok"
}
