//! The FCM HTTP v1 shape: Google's OAuth 2 token endpoint and FCM's send endpoint, per account,
//! answering with FCM's real bodies.
//!
//! | route | what |
//! |---|---|
//! | `POST /accounts/{account}/token` | the token URI: a form with `grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer` and an RS256 `assertion`, checked against the configured public key (`iss` set, `scope` FCM's, `aud` this URL, at most an hour long, not expired); answers `{"access_token", "expires_in", "token_type": "Bearer"}`, or 400 `{"error": "invalid_grant"}` |
//! | `POST /accounts/{account}/v1/projects/{project}/messages:send` | FCM's send: a live access token of the account (else 401 `UNAUTHENTICATED`), a body `{"message": {"token", ...}}` (else 400 `INVALID_ARGUMENT`), then the account's script like the generic API (keyed by the `Idempotency-Key` header the adapter sends, never deduplicated); a 2xx answers 200 `{"name": "projects/{project}/messages/{id}"}`, anything else FCM's error body for the status, with the step's `code` as FCM's `errorCode` when set ([`error_body`]) |
//! | `GET /stats/fcm` | [`FcmStats`]: tokens issued and refused, sends refused as unauthenticated |
//!
//! Like the generic API, bodies are checked and dropped: no device token or content is kept.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Json, Router};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use nudge_domain::ProviderAccount;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::push_common::key_of;
use crate::server::{App, carry_out};
use crate::state::{Incoming, Reply};

/// The grant type of a service-account assertion.
pub const JWT_BEARER_GRANT: &str = "urn:ietf:params:oauth:grant-type:jwt-bearer";
const FCM_SCOPE: &str = "https://www.googleapis.com/auth/firebase.messaging";

/// How the FCM shape checks and issues tokens, and the tokens it issued.
#[derive(Clone)]
pub struct FcmShape {
    /// The service account's public key (PEM): assertions must verify with it.
    pub public_key: Arc<DecodingKey>,
    /// The `expires_in` of issued access tokens; they stop working after it.
    pub token_lifetime: Duration,
    tokens: Arc<Mutex<Tokens>>,
}

impl std::fmt::Debug for FcmShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FcmShape")
            .field("token_lifetime", &self.token_lifetime)
            .finish_non_exhaustive()
    }
}

impl FcmShape {
    /// From an RSA public key in PEM (`PUBLIC KEY` or `RSA PUBLIC KEY`).
    pub fn from_pem(pem: &[u8], token_lifetime: Duration) -> anyhow::Result<Self> {
        Ok(Self {
            public_key: Arc::new(DecodingKey::from_rsa_pem(pem)?),
            token_lifetime,
            tokens: Arc::default(),
        })
    }
}

/// `GET /stats/fcm`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FcmStats {
    pub accounts: BTreeMap<String, FcmAccountStats>,
}

/// The token traffic of one account.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FcmAccountStats {
    /// Access tokens issued.
    pub tokens_issued: u64,
    /// Assertions refused (`invalid_grant`).
    pub assertions_refused: u64,
    /// Sends answered 401 because their access token was missing, unknown or expired.
    pub unauthenticated: u64,
}

#[derive(Default)]
struct Tokens {
    /// Access token -> (account, when it stops working).
    live: HashMap<String, (String, Instant)>,
    stats: FcmStats,
    issued: u64,
}

impl FcmShape {
    fn tokens(&self) -> std::sync::MutexGuard<'_, Tokens> {
        self.tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The FCM shape's routes.
pub(crate) fn routes() -> Router<App> {
    Router::new()
        .route("/accounts/{account}/token", post(token))
        .route(
            "/accounts/{account}/v1/projects/{project}/messages:send",
            post(send),
        )
        .route("/stats/fcm", get(stats))
}

/// The answer when the stub runs this shape without its settings (cannot happen from the CLI,
/// which requires them).
fn unconfigured() -> Response {
    crate::server::error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the fcm shape needs a public key",
    )
}

#[derive(Deserialize)]
struct TokenRequest {
    grant_type: String,
    assertion: String,
}

#[derive(Deserialize)]
struct AssertionClaims {
    iss: String,
    scope: String,
    aud: String,
    iat: i64,
    exp: i64,
}

fn oauth_error(error: &str, description: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(serde_json::json!({"error": error, "error_description": description})),
    )
        .into_response()
}

async fn token(
    State(app): State<App>,
    Path(account): Path<String>,
    form: Result<Form<TokenRequest>, axum::extract::rejection::FormRejection>,
) -> Response {
    let Ok(Form(form)) = form else {
        return oauth_error("invalid_request", "grant_type and assertion are required");
    };
    if form.grant_type != JWT_BEARER_GRANT {
        return oauth_error("unsupported_grant_type", "Invalid grant_type");
    }
    let Some(fcm) = app.stub.shape().fcm.as_ref() else {
        return unconfigured();
    };
    let mut validation = Validation::new(Algorithm::RS256);
    validation.set_required_spec_claims(&["exp", "iss", "aud"]);
    validation.validate_aud = false;
    validation.leeway = 0;
    let claims =
        jsonwebtoken::decode::<AssertionClaims>(&form.assertion, &fcm.public_key, &validation)
            .ok()
            .map(|t| t.claims)
            .filter(|c| {
                !c.iss.is_empty()
                    && c.scope.split(' ').any(|s| s == FCM_SCOPE)
                    && c.aud
                        .trim_end_matches('/')
                        .ends_with(&format!("/accounts/{account}/token"))
                    && c.exp > c.iat
                    && c.exp - c.iat <= 3600
            });
    let mut tokens = fcm.tokens();
    let stats = tokens.stats.accounts.entry(account.clone()).or_default();
    if claims.is_none() {
        stats.assertions_refused += 1;
        drop(tokens);
        tracing::info!(provider_account = %account, "assertion refused");
        return oauth_error("invalid_grant", "Invalid JWT Signature.");
    }
    stats.tokens_issued += 1;
    tokens.issued += 1;
    let access_token = format!("ya29.stub-{}-{}", tokens.issued, account);
    let until = Instant::now() + fcm.token_lifetime;
    tokens
        .live
        .insert(access_token.clone(), (account.clone(), until));
    drop(tokens);
    Json(serde_json::json!({
        "access_token": access_token,
        "expires_in": fcm.token_lifetime.as_secs(),
        "token_type": "Bearer",
    }))
    .into_response()
}

/// FCM's error body for `status`: the canonical status and, where FCM has one, its error code
/// (`reason` overrides the code chosen for the status).
pub fn error_body(status: u16, reason: Option<&str>) -> serde_json::Value {
    let (canonical, default_code, message) = match status {
        400 => (
            "INVALID_ARGUMENT",
            Some("INVALID_ARGUMENT"),
            "Request contains an invalid argument.",
        ),
        401 => (
            "UNAUTHENTICATED",
            Some("THIRD_PARTY_AUTH_ERROR"),
            "Auth error from APNS or Web Push Service",
        ),
        403 => (
            "PERMISSION_DENIED",
            Some("SENDER_ID_MISMATCH"),
            "SenderId mismatch",
        ),
        404 => (
            "NOT_FOUND",
            Some("UNREGISTERED"),
            "Requested entity was not found.",
        ),
        429 => (
            "RESOURCE_EXHAUSTED",
            Some("QUOTA_EXCEEDED"),
            "Quota exceeded for quota metric 'Send requests'.",
        ),
        500 => ("INTERNAL", Some("INTERNAL"), "Internal error encountered."),
        503 => (
            "UNAVAILABLE",
            Some("UNAVAILABLE"),
            "The service is currently unavailable.",
        ),
        _ => ("UNKNOWN", None, "Unknown error."),
    };
    let code = reason.or(default_code);
    let details: Vec<serde_json::Value> = code
        .map(|c| {
            vec![serde_json::json!({
                "@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError",
                "errorCode": c,
            })]
        })
        .unwrap_or_default();
    serde_json::json!({
        "error": {"code": status, "message": message, "status": canonical, "details": details}
    })
}

fn unauthenticated() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        Json(serde_json::json!({"error": {
            "code": 401,
            "message": "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid authentication credential.",
            "status": "UNAUTHENTICATED"
        }})),
    )
        .into_response()
}

#[derive(Deserialize)]
struct SendBody {
    message: SendMessage,
}

#[derive(Deserialize)]
struct SendMessage {
    token: String,
}

async fn send(
    State(app): State<App>,
    Path((account, project)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(fcm) = app.stub.shape().fcm.as_ref() else {
        return unconfigured();
    };
    let Ok(parsed) = ProviderAccount::parse(&account) else {
        return (
            StatusCode::NOT_FOUND,
            Json(error_body(404, Some("UNSPECIFIED_ERROR"))),
        )
            .into_response();
    };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    {
        let mut tokens = fcm.tokens();
        let live = bearer
            .and_then(|b| tokens.live.get(b))
            .is_some_and(|(acct, until)| acct == &account && Instant::now() < *until);
        if !live {
            tokens
                .stats
                .accounts
                .entry(account.clone())
                .or_default()
                .unauthenticated += 1;
            return unauthenticated();
        }
    }
    let invalid = match serde_json::from_slice::<SendBody>(&body) {
        Ok(b) if !b.message.token.is_empty() => None,
        _ => Some("body must be {\"message\": {\"token\": string, ...}}"),
    };
    drop(body);
    let (key, key_invalid) = key_of(&headers, "idempotency-key");
    let reply = app.stub.handle(
        &parsed,
        Incoming {
            key,
            invalid: key_invalid.or(invalid),
            traceparent: headers.get("traceparent").and_then(|v| v.to_str().ok()),
            // FCM does not deduplicate: a second send is a second notification.
            dedupe: false,
        },
    );
    carry_out(&app, reply, |reply| render(reply, &project)).await
}

/// A decided reply in FCM's form.
fn render(reply: Reply, project: &str) -> Response {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = if status.is_success() {
        let id = reply.message_id.as_deref().unwrap_or("0");
        (
            StatusCode::OK,
            Json(serde_json::json!({"name": format!("projects/{project}/messages/{id}")})),
        )
            .into_response()
    } else {
        (
            status,
            Json(error_body(reply.status, reply.code.as_deref())),
        )
            .into_response()
    };
    if let Some(ra) = reply.retry_after
        && let Ok(value) = HeaderValue::from_str(&ra)
    {
        response.headers_mut().insert(header::RETRY_AFTER, value);
    }
    response
}

async fn stats(State(app): State<App>) -> Response {
    match app.stub.shape().fcm.as_ref() {
        Some(fcm) => Json(fcm.tokens().stats.clone()).into_response(),
        None => unconfigured(),
    }
}
