//! The APNs shape: `POST /accounts/{account}/3/device/{device token}` over TLS and HTTP/2 (see
//! [`crate::tls`]), answering with APNs's real headers and bodies.
//!
//! A request is checked as APNs checks it, in this order, each failure answered with APNs's
//! status and `{"reason": ...}`: the provider token (`authorization: bearer <JWT>`: ES256, verified
//! with the configured public key, `kid` and `iss` present, `iat` within the last hour; else 403
//! `MissingProviderToken`, `InvalidProviderToken` or `ExpiredProviderToken`), a token change
//! sooner than [`ApnsShape::min_token_interval`] after the last one (429
//! `TooManyProviderTokenUpdates`), `apns-topic` (400 `MissingTopic`), the device token (hex, else
//! 400 `BadDeviceToken`), `apns-push-type`, `apns-priority`, `apns-expiration` (400
//! `InvalidPushType`, `BadPriority`, `BadExpirationDate`), the payload (400 `PayloadEmpty`
//! without `aps`, 413 `PayloadTooLarge` over 4096 bytes). Then the account's script, like the
//! generic API, keyed by `apns-id` and never deduplicated: a 2xx answers 200 with `apns-id` and
//! no body, anything else the status with the step's `code` as the reason, or APNs's reason for
//! the status ([`reason_for`]); a 410 also carries `timestamp`.
//!
//! `GET /stats/apns` ([`ApnsStats`]) counts, per account, the distinct provider tokens seen (the
//! refreshes a test checks against Apple's 20-minute rule) and the refusals.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use nudge_domain::ProviderAccount;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::push_common::key_of;
use crate::server::{App, carry_out};
use crate::state::{Incoming, Reply};

const MAX_PAYLOAD_BYTES: usize = 4096;
/// Apple refuses a provider token older than this.
const MAX_TOKEN_AGE_S: i64 = 3600;

/// How the APNs shape checks provider tokens, and the tokens it saw.
#[derive(Clone)]
pub struct ApnsShape {
    /// The signing key's public half (PEM): provider tokens must verify with it.
    pub public_key: Arc<DecodingKey>,
    /// A new provider token sooner than this after the account's previous one is refused with
    /// 429 `TooManyProviderTokenUpdates` (Apple's rule is 20 minutes); zero allows any.
    pub min_token_interval: Duration,
    tokens: Arc<Mutex<TokenLog>>,
    made_up_ids: Arc<AtomicU64>,
}

impl std::fmt::Debug for ApnsShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApnsShape")
            .field("min_token_interval", &self.min_token_interval)
            .finish_non_exhaustive()
    }
}

impl ApnsShape {
    /// From an EC P-256 public key in PEM (`PUBLIC KEY`).
    pub fn from_pem(pem: &[u8], min_token_interval: Duration) -> anyhow::Result<Self> {
        Ok(Self {
            public_key: Arc::new(DecodingKey::from_ec_pem(pem)?),
            min_token_interval,
            tokens: Arc::default(),
            made_up_ids: Arc::default(),
        })
    }
}

/// `GET /stats/apns`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApnsStats {
    pub accounts: BTreeMap<String, ApnsAccountStats>,
}

/// The provider-token traffic of one account.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApnsAccountStats {
    /// Distinct valid provider tokens seen, in the order they first came.
    pub provider_tokens: u64,
    /// Requests refused with 429 `TooManyProviderTokenUpdates`.
    pub token_updates_refused: u64,
    /// Requests refused with 403 (missing, invalid or expired provider token).
    pub provider_token_refused: u64,
}

#[derive(Default)]
struct TokenLog {
    /// Account -> (its current token, when it was first seen).
    current: BTreeMap<String, (String, Instant)>,
    stats: ApnsStats,
}

impl ApnsShape {
    fn log(&self) -> std::sync::MutexGuard<'_, TokenLog> {
        self.tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An `apns-id` for a request that sent none, as APNs makes one up.
    fn made_up_id(&self) -> String {
        let n = self.made_up_ids.fetch_add(1, Ordering::Relaxed) + 1;
        format!("00000000-0000-4000-8000-{n:012x}")
    }
}

/// The APNs shape's routes.
pub(crate) fn routes() -> Router<App> {
    Router::new()
        .route("/accounts/{account}/3/device/{device}", post(send))
        .route("/stats/apns", get(stats))
}

/// The answer when the stub runs this shape without its settings (cannot happen from the CLI,
/// which requires them).
fn unconfigured() -> Response {
    crate::server::error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the apns shape needs a public key",
    )
}

/// APNs's reason for a scripted status.
pub fn reason_for(status: u16) -> &'static str {
    match status {
        400 => "BadDeviceToken",
        403 => "InvalidProviderToken",
        404 => "BadPath",
        405 => "MethodNotAllowed",
        410 => "Unregistered",
        413 => "PayloadTooLarge",
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        _ => "InternalServerError",
    }
}

fn refuse(status: StatusCode, reason: &str, apns_id: &str) -> Response {
    let mut body = serde_json::json!({ "reason": reason });
    if status == StatusCode::GONE {
        body["timestamp"] = serde_json::json!(chrono::Utc::now().timestamp_millis());
    }
    let mut response = (status, Json(body)).into_response();
    if let Ok(v) = HeaderValue::from_str(apns_id) {
        response.headers_mut().insert("apns-id", v);
    }
    response
}

#[derive(Deserialize)]
struct ProviderClaims {
    iss: String,
    iat: i64,
}

/// Checks the provider token; the refusal to answer when it fails.
fn check_token(
    apns: &ApnsShape,
    account: &str,
    headers: &HeaderMap,
) -> Result<(), (StatusCode, &'static str)> {
    let Some(jwt) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("bearer ")
                .or_else(|| v.strip_prefix("Bearer "))
        })
    else {
        return Err((StatusCode::FORBIDDEN, "MissingProviderToken"));
    };
    let mut validation = Validation::new(Algorithm::ES256);
    validation.required_spec_claims.clear();
    validation.validate_exp = false;
    let decoded = jsonwebtoken::decode::<ProviderClaims>(jwt, &apns.public_key, &validation)
        .map_err(|_| (StatusCode::FORBIDDEN, "InvalidProviderToken"))?;
    if decoded.header.kid.as_deref().is_none_or(str::is_empty) || decoded.claims.iss.is_empty() {
        return Err((StatusCode::FORBIDDEN, "InvalidProviderToken"));
    }
    let age = chrono::Utc::now().timestamp() - decoded.claims.iat;
    if age > MAX_TOKEN_AGE_S {
        return Err((StatusCode::FORBIDDEN, "ExpiredProviderToken"));
    }
    let mut log = apns.log();
    let now = Instant::now();
    let changed = match log.current.get(account) {
        Some((current, _)) if current == jwt => false,
        Some((_, since)) if now.duration_since(*since) < apns.min_token_interval => {
            log.stats
                .accounts
                .entry(account.to_owned())
                .or_default()
                .token_updates_refused += 1;
            return Err((StatusCode::TOO_MANY_REQUESTS, "TooManyProviderTokenUpdates"));
        }
        _ => true,
    };
    if changed {
        log.current
            .insert(account.to_owned(), (jwt.to_owned(), now));
        log.stats
            .accounts
            .entry(account.to_owned())
            .or_default()
            .provider_tokens += 1;
    }
    Ok(())
}

fn check_request(
    device: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(), (StatusCode, &'static str)> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if text("apns-topic").is_none_or(str::is_empty) {
        return Err((StatusCode::BAD_REQUEST, "MissingTopic"));
    }
    if device.is_empty() || !device.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err((StatusCode::BAD_REQUEST, "BadDeviceToken"));
    }
    if let Some(t) = text("apns-push-type")
        && !matches!(
            t,
            "alert"
                | "background"
                | "voip"
                | "complication"
                | "fileprovider"
                | "mdm"
                | "location"
                | "liveactivity"
                | "pushtotalk"
                | "widgets"
        )
    {
        return Err((StatusCode::BAD_REQUEST, "InvalidPushType"));
    }
    if let Some(p) = text("apns-priority")
        && !matches!(p, "1" | "5" | "10")
    {
        return Err((StatusCode::BAD_REQUEST, "BadPriority"));
    }
    if let Some(e) = text("apns-expiration")
        && e.parse::<u64>().is_err()
    {
        return Err((StatusCode::BAD_REQUEST, "BadExpirationDate"));
    }
    if body.len() > MAX_PAYLOAD_BYTES {
        return Err((StatusCode::PAYLOAD_TOO_LARGE, "PayloadTooLarge"));
    }
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(v) if v.get("aps").is_some_and(serde_json::Value::is_object) => Ok(()),
        _ => Err((StatusCode::BAD_REQUEST, "PayloadEmpty")),
    }
}

async fn send(
    State(app): State<App>,
    Path((account, device)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(apns) = app.stub.shape().apns.as_ref() else {
        return unconfigured();
    };
    let (key, key_invalid) = key_of(&headers, "apns-id");
    let apns_id = key.map_or_else(|| apns.made_up_id(), str::to_owned);
    let Ok(parsed) = ProviderAccount::parse(&account) else {
        return refuse(StatusCode::NOT_FOUND, "BadPath", &apns_id);
    };
    if let Err((status, reason)) = check_token(apns, &account, &headers) {
        if status == StatusCode::FORBIDDEN {
            apns.log()
                .stats
                .accounts
                .entry(account.clone())
                .or_default()
                .provider_token_refused += 1;
        }
        return refuse(status, reason, &apns_id);
    }
    if key_invalid.is_some() {
        return refuse(StatusCode::BAD_REQUEST, "BadMessageId", &apns_id);
    }
    if let Err((status, reason)) = check_request(&device, &headers, &body) {
        return refuse(status, reason, &apns_id);
    }
    drop(body);
    let reply = app.stub.handle(
        &parsed,
        Incoming {
            key,
            invalid: None,
            traceparent: headers.get("traceparent").and_then(|v| v.to_str().ok()),
            // APNs does not deduplicate: a second send is a second notification.
            dedupe: false,
        },
    );
    carry_out(&app, reply, |reply| render(reply, &apns_id)).await
}

/// A decided reply in APNs's form.
fn render(reply: Reply, apns_id: &str) -> Response {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = if status.is_success() {
        let mut r = StatusCode::OK.into_response();
        if let Ok(v) = HeaderValue::from_str(apns_id) {
            r.headers_mut().insert("apns-id", v);
        }
        r
    } else {
        let reason = reply
            .code
            .as_deref()
            .unwrap_or_else(|| reason_for(reply.status));
        refuse(status, reason, apns_id)
    };
    if let Some(ra) = reply.retry_after
        && let Ok(value) = HeaderValue::from_str(&ra)
    {
        response.headers_mut().insert(header::RETRY_AFTER, value);
    }
    response
}

async fn stats(State(app): State<App>) -> Response {
    match app.stub.shape().apns.as_ref() {
        Some(apns) => Json(apns.log().stats.clone()).into_response(),
        None => unconfigured(),
    }
}
