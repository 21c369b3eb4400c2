//! The HTTP API: handlers, the shapes they read and answer (documented for OpenAPI by
//! `utoipa` from these very types), and authentication.
//!
//! Every `/v1` request is authenticated first ([`authenticate`]: signature header, timestamp,
//! then the tenant's secrets), after the content type and body size are checked and before its
//! body is parsed; a refused request writes nothing. A single reminder's post may take the
//! secrets from the intake's cache of tenants ([`Secrets::Cached`]) because its committer
//! verifies it again against the tenant read just before the import; every other request
//! reads its tenant from the ledger. A reminder is answered only after its
//! transaction committed (202 new, 200 the same event again, 409 the event id with another
//! body). No handler logs or answers with a destination, subscriber reference or content.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use axum::Json;
use axum::body::Bytes;
use axum::extract::OriginalUri;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use nudge_domain::{Channel, EventId, SubscriberRef};
use nudge_ledger::input::{self, InputError, ReminderInput, TenantField};
use nudge_ledger::{
    DestinationCipher, ImportOutcome, ImportReminder, IntakeTenant, Ledger, LedgerTime, Operator,
    ReminderStatus,
};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::commit::{Check, CommitError, Committer};
use crate::error::{ApiError, ErrorBody, InvalidRequest, Problem, Unauthorized};
use crate::metrics::IntakeMetrics;
use crate::signature::{HEADER, Refusal, SignatureHeader, Signed};

/// The correlation id header, read from requests and set on reminder answers.
pub const CORRELATION_HEADER: &str = "x-correlation-id";

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
    /// The providers' receipt verifiers (`[receipts]`); none until [`AppState::with_receipts`].
    receipts: Arc<crate::receipts::Receipts>,
}

struct Inner {
    ledger: Ledger,
    committer: Committer,
    /// Tenants as last read, by name: a single post whose signature matches here skips the
    /// read before its body is parsed (its committer reads and verifies again).
    tenants: Mutex<HashMap<String, IntakeTenant>>,
    cipher: DestinationCipher,
    metrics: Arc<IntakeMetrics>,
    limits: Limits,
    clock: Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

/// The request limits the handlers apply (from `[intake]`).
#[derive(Debug, Clone)]
pub struct Limits {
    pub batch_max: usize,
    pub timestamp_tolerance_s: u64,
    pub max_schedule_ahead: chrono::Duration,
}

impl AppState {
    /// `cipher` needs the subscriber key. `clock` is the intake's clock (signature freshness
    /// and the schedule-ahead limit); tests move it. Starts the committers of single
    /// reminders ([`Committer`]) on the current tokio runtime; they stop when the last clone
    /// of this state is dropped.
    pub fn new(
        ledger: Ledger,
        cipher: DestinationCipher,
        metrics: Arc<IntakeMetrics>,
        limits: Limits,
        clock: Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>,
    ) -> Self {
        let committer = Committer::start(ledger.clone(), cipher.clone(), clock.clone());
        Self {
            inner: Arc::new(Inner {
                ledger,
                committer,
                tenants: Mutex::new(HashMap::new()),
                cipher,
                metrics,
                limits,
                clock,
            }),
            receipts: Arc::default(),
        }
    }

    /// This state, taking the providers' receipts `receipts` verifies.
    pub fn with_receipts(mut self, receipts: crate::receipts::Receipts) -> Self {
        self.receipts = Arc::new(receipts);
        self
    }

    pub(crate) fn receipts(&self) -> &crate::receipts::Receipts {
        &self.receipts
    }

    pub(crate) fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    pub fn metrics(&self) -> &IntakeMetrics {
        &self.inner.metrics
    }

    pub fn ledger(&self) -> &Ledger {
        &self.inner.ledger
    }

    pub(crate) fn now(&self) -> DateTime<Utc> {
        (self.inner.clock)()
    }

    fn cached_tenant(&self, name: &str) -> Option<IntakeTenant> {
        self.inner
            .tenants
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    /// Keeps `found` as the tenant named `name` (or forgets the name when it has no tenant
    /// with a secret). At most [`TENANTS_CACHED`]: past that the cache starts again empty.
    fn remember_tenant(&self, name: &str, found: Option<&IntakeTenant>) {
        let mut tenants = self
            .inner
            .tenants
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match found {
            Some(tenant) if !tenant.secrets.is_empty() => {
                if tenants.len() >= TENANTS_CACHED && !tenants.contains_key(name) {
                    tenants.clear();
                }
                tenants.insert(name.to_owned(), tenant.clone());
            }
            _ => {
                tenants.remove(name);
            }
        }
    }
}

/// The most tenants the intake keeps between requests.
const TENANTS_CACHED: usize = 1024;

// ---- shapes -------------------------------------------------------------------------------

/// A channel name.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChannelName {
    Push,
    Email,
    Sms,
}

/// Destinations per channel: a phone number, an email address or a push token (each 1 to
/// 1024 bytes, not blank). Stored encrypted; never echoed.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Destinations {
    #[schema(min_length = 1, max_length = 1024)]
    pub push: Option<String>,
    #[schema(min_length = 1, max_length = 1024)]
    pub email: Option<String>,
    #[schema(min_length = 1, max_length = 1024)]
    pub sms: Option<String>,
}

/// One reminder: the fields of a `nudgectl reminders load` line without `tenant` (the path
/// names it). Every channel listed needs a destination, and no other channel may have one.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReminderBody {
    /// The client's id for this event, unique per tenant: posting it again is safe.
    #[schema(min_length = 1, max_length = 200, pattern = "^[!-~]+$")]
    pub event_id: String,
    /// The client's opaque identifier of the patient (stored only as a keyed hash).
    #[schema(min_length = 1, max_length = 128, pattern = "^[!-~]+$")]
    pub subscriber_ref: String,
    #[schema(min_items = 1, max_items = 3)]
    pub channels: Vec<ChannelName>,
    /// When to send (RFC 3339 with an offset); at most `intake.max_schedule_ahead_days` ahead.
    pub scheduled_at: DateTime<Utc>,
    /// After this, never send (after `scheduled_at`).
    pub expires_at: DateTime<Utc>,
    pub destinations: Destinations,
    /// Template parameters: a JSON object of at most 16 KiB as JSON text. Stored encrypted.
    #[schema(value_type = Option<Object>)]
    pub content: Option<Value>,
}

/// Several reminders in one request, each answered on its own.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReminderBatch {
    /// 1 to `intake.batch_max` (default 500) reminders.
    #[schema(min_items = 1)]
    pub reminders: Vec<ReminderBody>,
}

/// The body of `POST /v1/tenants/{tenant}/reminders`: one reminder, or a batch.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum PostReminders {
    One(ReminderBody),
    Many(ReminderBatch),
}

/// Why a reminder is recorded but not scheduled yet: it is held until the tenant is resumed
/// or the channel's drain ends, then scheduled at once if its time has come.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Held {
    pub tenant_paused: bool,
    /// Those of the reminder's channels that are draining.
    pub draining_channels: Vec<ChannelName>,
}

/// A reminder recorded (202, first time) or recognised (200, the same event and body again).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Accepted {
    pub reminder_id: uuid::Uuid,
    pub event_id: String,
    /// `accepted` (recorded now) or `duplicate` (recorded before, nothing changed).
    pub status: &'static str,
    /// Deliveries created at once (the reminder is due, or its window has run).
    pub deliveries_created: u64,
    pub correlation_id: String,
    /// Present when the reminder is recorded but held.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<Held>,
}

/// One reminder of a batch, answered on its own.
#[derive(Debug, Serialize, ToSchema)]
pub struct BatchItem {
    /// Its position in `reminders`.
    pub index: usize,
    /// 202 accepted, 200 duplicate, 409 event id used for another reminder, 400 invalid.
    pub status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reminder: Option<Accepted>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// Present with 400 (paths relative to this reminder) and 409.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<Problem>,
}

/// The answer to a batch: one item per reminder, in order. Everything accepted in it is
/// committed together, before this answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct BatchAnswer {
    pub results: Vec<BatchItem>,
}

/// The 200 answer of `POST .../reminders`: a duplicate single reminder, or a batch.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum PostAnswer {
    One(Accepted),
    Many(BatchAnswer),
}

/// One channel of a reminder. `state` is a delivery state (`scheduled`, `queued`, `sending`,
/// `retry_wait`, `delivered`, `dead_lettered`, `expired`, `cancelled`, `ambiguous`) or
/// `pending` while no delivery exists yet (not due yet, or held).
#[derive(Debug, Serialize, ToSchema)]
pub struct ChannelState {
    pub channel: ChannelName,
    pub state: String,
    pub attempts: i32,
    pub settled_at: Option<DateTime<Utc>>,
}

/// A reminder's state per channel. No destination, subscriber or content.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReminderState {
    pub reminder_id: uuid::Uuid,
    pub event_id: String,
    pub scheduled_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub cancelled_at: Option<DateTime<Utc>>,
    pub correlation_id: Option<String>,
    pub channels: Vec<ChannelState>,
}

/// What a cancellation did: `cancelled` lists the channels settled now; `reminder` shows
/// every channel after it (one already sent stays `delivered`; one being sent finishes and
/// is never retried).
#[derive(Debug, Serialize, ToSchema)]
pub struct CancelAnswer {
    pub cancelled: Vec<ChannelName>,
    pub reminder: ReminderState,
}

/// The body of `PUT .../contacts`: destinations for one or more channels; channels not given
/// keep theirs.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ContactsBody {
    pub destinations: Destinations,
}

/// The channels whose destination was stored.
#[derive(Debug, Serialize, ToSchema)]
pub struct ContactsAnswer {
    pub channels: Vec<ChannelName>,
}

/// What an erasure did (counts only).
#[derive(Debug, Serialize, ToSchema)]
pub struct ErasureAnswer {
    pub contacts_deleted: u64,
    pub reminders_erased: u64,
    pub deliveries_cancelled: u64,
}

fn channel_name(c: Channel) -> ChannelName {
    match c {
        Channel::Push => ChannelName::Push,
        Channel::Email => ChannelName::Email,
        Channel::Sms => ChannelName::Sms,
    }
}

// ---- request checks -----------------------------------------------------------------------

/// 415 unless the body is declared JSON.
fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if json {
        Ok(())
    } else {
        Err(ApiError::UnsupportedMediaType)
    }
}

/// The body, or 413 when it is over the limit (408 when it did not arrive in time).
fn body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge
        } else {
            ApiError::Timeout
        }
    })
}

fn path<T>(path: Result<Path<T>, PathRejection>) -> Result<T, ApiError> {
    path.map(|Path(p)| p)
        .map_err(|_| ApiError::invalid("path", "a path parameter is not valid UTF-8 text"))
}

/// The request as signed: its method, its target (path and query as sent) and its body.
#[derive(Debug, Clone, Copy)]
pub struct SignedRequest<'a> {
    pub method: &'a Method,
    pub uri: &'a Uri,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
}

impl SignedRequest<'_> {
    fn signed(&self) -> Signed<'_> {
        Signed {
            method: self.method.as_str(),
            target: self
                .uri
                .path_and_query()
                .map_or_else(|| self.uri.path(), |p| p.as_str()),
            body: self.body,
        }
    }
}

/// Where [`authenticate`] may take a tenant's secrets from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Secrets {
    /// Read from the ledger: what every request that acts at once needs (a secret retired a
    /// moment ago no longer passes; the pause and drain flags are current).
    Ledger,
    /// The intake's cache of tenants, read from the ledger again when the signature does not
    /// match there. Only for a single reminder's post: its committer reads the tenant again and
    /// verifies the signature once more before anything is written (see `commit`).
    Cached,
}

/// An authenticated request: its tenant (as read; see [`Secrets`]) and its signature.
#[derive(Debug, Clone)]
pub struct Authenticated {
    pub tenant: IntakeTenant,
    pub signature: SignatureHeader,
}

/// The tenant, if the request carries a fresh signature of its method, target and body under
/// one of the tenant's secrets. A tenant that does not exist costs the same work as a wrong
/// signature (a look in the cache and a verification, the same query, as many HMACs under a
/// placeholder), and its answer is a wrong signature's.
pub async fn authenticate(
    state: &AppState,
    tenant: &str,
    request: SignedRequest<'_>,
    from: Secrets,
) -> Result<Authenticated, ApiError> {
    let refuse = |refusal: Refusal| {
        state.metrics().refusal(refusal.internal());
        ApiError::Unauthorized(refusal)
    };
    let signature = request
        .headers
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .ok_or(Refusal::MissingSignature)
        .and_then(SignatureHeader::parse)
        .map_err(refuse)?;
    if !signature.is_fresh(
        state.now().timestamp(),
        state.inner.limits.timestamp_tolerance_s,
    ) {
        return Err(refuse(Refusal::StaleTimestamp));
    }
    let valid_name = !tenant.is_empty() && tenant.len() <= 200;
    let signed = request.signed();
    if from == Secrets::Cached {
        let cached = if valid_name {
            state.cached_tenant(tenant)
        } else {
            None
        };
        // Verified whether or not there is an entry: the same HMACs either way.
        if verify(&signature, cached.as_ref(), &signed)
            && let Some(tenant) = cached
        {
            return Ok(Authenticated { tenant, signature });
        }
    }
    let found = if valid_name {
        state
            .inner
            .ledger
            .intake_tenant(tenant, &state.inner.cipher)
            .await
            .map_err(ApiError::internal)?
    } else {
        None
    };
    state.remember_tenant(tenant, found.as_ref());
    let matched = verify(&signature, found.as_ref(), &signed);
    match found {
        Some(tenant) if matched => Ok(Authenticated { tenant, signature }),
        Some(t) if !t.secrets.is_empty() => Err(refuse(Refusal::BadSignature)),
        _ => Err(refuse(Refusal::UnknownTenant)),
    }
}

/// Whether `signature` matches `signed` under one of the tenant's secrets; the same number of
/// HMACs whether the tenant has one secret, two or none (see `SignatureHeader::matches`).
pub fn verify(
    signature: &SignatureHeader,
    tenant: Option<&IntakeTenant>,
    signed: &Signed<'_>,
) -> bool {
    let secrets: Vec<&[u8]> = tenant
        .iter()
        .flat_map(|t| t.secrets.iter().map(|s| s.expose().as_bytes()))
        .collect();
    signature.matches(&secrets, signed) && tenant.is_some()
}

/// The request's correlation id when it is 1 to 128 printable ASCII characters, else a new one.
fn correlation_id(headers: &HeaderMap) -> String {
    headers
        .get(CORRELATION_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= nudge_ledger::MAX_CORRELATION_ID_BYTES
                && v.bytes().all(|b| b.is_ascii_graphic())
        })
        .map_or_else(|| uuid::Uuid::new_v4().simple().to_string(), str::to_owned)
}

fn json_problem(e: &serde_json::Error) -> Problem {
    // serde_json's syntax messages never quote the input; the position is kept.
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let problem = text.strip_suffix(&suffix).unwrap_or(&text);
    Problem::new(
        "",
        format!(
            "invalid JSON at line {} column {}: {problem}",
            e.line(),
            e.column()
        ),
    )
}

// An unknown key is the client's text, and could be patient data typed as a key: never
// repeated, here as in the reminder's own fields (`InputError::UnknownField`).
const UNKNOWN_BATCH_FIELD: &str =
    "has a field other than `reminders`; its name is not repeated, as it could be patient data";
const UNKNOWN_CONTACTS_FIELD: &str = "has a field other than `destinations`; its name is not \
                                      repeated, as it could be patient data";

fn input_problem(prefix: &str, e: &InputError) -> Problem {
    Problem::new(format!("{prefix}{}", e.path()), e.to_string())
}

// ---- handlers -----------------------------------------------------------------------------

/// Liveness: the process answers.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "the process is up", body = String, content_type = "text/plain")))]
pub async fn healthz() -> &'static str {
    "ok"
}

/// Readiness: the ledger answers.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "the ledger answers", body = String, content_type = "text/plain"),
        (status = 503, description = "the ledger does not answer", body = String, content_type = "text/plain")))]
pub async fn readyz(State(state): State<AppState>) -> Response {
    let ping = sqlx_ping(&state.inner.ledger);
    match tokio::time::timeout(std::time::Duration::from_secs(2), ping).await {
        Ok(Ok(())) => (StatusCode::OK, "ready").into_response(),
        Ok(Err(e)) => {
            tracing::warn!(error.cause_chain = %format!("{e:#}"), "ledger not reachable");
            (StatusCode::SERVICE_UNAVAILABLE, "ledger not reachable").into_response()
        }
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "ledger not reachable").into_response(),
    }
}

async fn sqlx_ping(ledger: &Ledger) -> anyhow::Result<()> {
    ledger.ping().await?;
    Ok(())
}

/// This API's OpenAPI 3.1 description.
#[utoipa::path(get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "the OpenAPI document", body = Object)))]
pub async fn openapi() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        crate::openapi_json(),
    )
        .into_response()
}

/// Post one reminder, or `{"reminders": [...]}`.
///
/// Answered after commit. One reminder: 202 when recorded, 200 with the original reminder id
/// when the same event with the same body was recorded before, 409 when the event id is used
/// for another reminder. A batch: 200 with an answer per reminder, in order. A reminder of a
/// paused tenant or for a draining channel is recorded and held (`held` says so).
#[utoipa::path(post, path = "/v1/tenants/{tenant}/reminders", tag = "reminders",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex HMAC-SHA256 of \"<t>\\n<METHOD>\\n<path>\\n<body>\">"),
        ("X-Correlation-Id" = Option<String>, Header, description = "1 to 128 printable ASCII characters; generated when absent or invalid"),
    ),
    request_body(content = PostReminders, content_type = "application/json"),
    responses(
        (status = 202, description = "recorded", body = Accepted),
        (status = 200, description = "the same event again, or a batch's answers", body = PostAnswer),
        (status = 400, description = "invalid; nothing written", body = InvalidRequest),
        (status = 401, description = "not authenticated; nothing written", body = Unauthorized),
        (status = 408, description = "the body did not arrive in time", body = ErrorBody),
        (status = 409, description = "the event id is used for another reminder", body = ErrorBody),
        (status = 413, description = "the body is over the limit", body = ErrorBody),
        (status = 415, description = "the body is not JSON", body = ErrorBody),
        (status = 500, description = "unexpected; may be retried", body = ErrorBody),
    ),
    security(("signature" = [])))]
pub async fn post_reminders(
    State(state): State<AppState>,
    tenant: Result<Path<String>, PathRejection>,
    method: Method,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let tenant_name = path(tenant)?;
    require_json(&headers)?;
    let raw = body(raw)?;
    let request = SignedRequest {
        method: &method,
        uri: &uri,
        headers: &headers,
        body: &raw,
    };
    let authenticated = authenticate(&state, &tenant_name, request, Secrets::Cached).await?;
    let correlation = correlation_id(&headers);
    let value: Value = serde_json::from_slice(&raw).map_err(|e| {
        state.metrics().reminder("invalid");
        ApiError::Invalid(vec![json_problem(&e)])
    })?;
    let batch = matches!(&value, Value::Object(map) if map.contains_key("reminders"));
    let mut response = if batch {
        // A batch is imported here, at once: its tenant as the ledger has it now.
        let tenant = authenticate(&state, &tenant_name, request, Secrets::Ledger)
            .await?
            .tenant;
        post_batch(&state, &tenant, value, &correlation).await?
    } else {
        let signed = request.signed();
        let check = Check {
            tenant: tenant_name.clone(),
            signature: authenticated.signature,
            method: signed.method.to_owned(),
            target: signed.target.to_owned(),
            body: raw.clone(),
        };
        post_one(
            &state,
            &authenticated.tenant,
            value,
            &raw,
            check,
            &correlation,
        )
        .await?
    };
    if let Ok(v) = HeaderValue::from_str(&correlation) {
        response.headers_mut().insert(CORRELATION_HEADER, v);
    }
    Ok(response)
}

/// A reminder checked and ready to import, or its problems. `raw` is its text when it is the
/// whole body: read from it, an unknown field's problem says where the field ends.
fn prepare(
    state: &AppState,
    tenant: &IntakeTenant,
    value: Value,
    raw: Option<&[u8]>,
    correlation: &str,
    prefix: &str,
) -> Result<ImportReminder, Vec<Problem>> {
    let canonical = serde_json::to_vec(&value).map_err(|_| {
        vec![Problem::new(
            prefix,
            "the reminder cannot be read back as JSON",
        )]
    })?;
    let input = match raw {
        Some(raw) => ReminderInput::parse(raw, TenantField::Absent),
        None => ReminderInput::from_value(value, TenantField::Absent),
    }
    .map_err(|e| vec![input_problem(prefix, &e)])?;
    let ahead = state.now() + state.inner.limits.max_schedule_ahead;
    if input.scheduled_at > ahead {
        return Err(vec![Problem::new(
            format!("{prefix}/scheduled_at"),
            format!(
                "is more than {} days ahead (intake.max_schedule_ahead_days)",
                state.inner.limits.max_schedule_ahead.num_days()
            ),
        )]);
    }
    let mut item = input
        .into_import(tenant.id)
        .map_err(|e| vec![input_problem(prefix, &e)])?;
    let digest = state
        .inner
        .cipher
        .request_digest(tenant.id, &canonical)
        .map_err(|_| vec![Problem::new(prefix, "the reminder cannot be accepted")])?;
    item.reminder = item
        .reminder
        .with_correlation_id(correlation)
        .map_err(|_| {
            vec![Problem::new(
                "X-Correlation-Id",
                "is not a valid correlation id",
            )]
        })?
        .with_request_digest(digest);
    Ok(item)
}

fn held(tenant: &IntakeTenant, channels: &[Channel]) -> Option<Held> {
    let draining: Vec<ChannelName> = channels
        .iter()
        .filter(|c| tenant.draining.contains(c))
        .map(|c| channel_name(*c))
        .collect();
    (tenant.intake_paused || !draining.is_empty()).then_some(Held {
        tenant_paused: tenant.intake_paused,
        draining_channels: draining,
    })
}

/// What one imported reminder's outcome answers: status and body, or a problem.
fn answer(
    state: &AppState,
    tenant: &IntakeTenant,
    item: &ImportReminder,
    outcome: ImportOutcome,
    correlation: &str,
) -> Result<(StatusCode, Accepted), ApiError> {
    let event_id = item.reminder.event_id().as_str().to_owned();
    let accepted = |id: nudge_domain::ReminderId, status, deliveries_created| Accepted {
        reminder_id: id.as_uuid(),
        event_id: event_id.clone(),
        status,
        deliveries_created,
        correlation_id: correlation.to_owned(),
        held: held(tenant, item.reminder.channels()),
    };
    match outcome {
        ImportOutcome::Created {
            id,
            deliveries_created,
        } => {
            state.metrics().reminder("accepted");
            Ok((
                StatusCode::ACCEPTED,
                accepted(id, "accepted", deliveries_created),
            ))
        }
        ImportOutcome::AlreadyPresent { id } => {
            state.metrics().reminder("duplicate");
            Ok((StatusCode::OK, accepted(id, "duplicate", 0)))
        }
        ImportOutcome::EventConflict => {
            state.metrics().reminder("conflict");
            Err(ApiError::EventConflict(event_id))
        }
        ImportOutcome::UnknownTenant => Err(ApiError::internal(anyhow::anyhow!(
            "the tenant disappeared while its reminder was imported"
        ))),
    }
}

async fn post_one(
    state: &AppState,
    tenant: &IntakeTenant,
    value: Value,
    raw: &[u8],
    check: Check,
    correlation: &str,
) -> Result<Response, ApiError> {
    let item = prepare(state, tenant, value, Some(raw), correlation, "").map_err(|problems| {
        state.metrics().reminder("invalid");
        ApiError::Invalid(problems)
    })?;
    // Committed together with whatever other single posts are waiting, after the committer
    // read the tenant and verified the signature again (see `commit`).
    let committed = match state.inner.committer.import(item.clone(), check).await {
        Ok(committed) => committed,
        Err(CommitError::Refused(refusal)) => {
            state.metrics().refusal(refusal.internal());
            return Err(ApiError::Unauthorized(refusal));
        }
        Err(e) => return Err(ApiError::internal(e)),
    };
    let (status, accepted) = answer(
        state,
        &committed.tenant,
        &item,
        committed.outcome,
        correlation,
    )?;
    Ok((status, Json(accepted)).into_response())
}

async fn post_batch(
    state: &AppState,
    tenant: &IntakeTenant,
    value: Value,
    correlation: &str,
) -> Result<Response, ApiError> {
    let Value::Object(mut map) = value else {
        return Err(ApiError::invalid("", "expected a JSON object"));
    };
    if map.keys().any(|k| k != "reminders") {
        return Err(ApiError::invalid("", UNKNOWN_BATCH_FIELD));
    }
    let Some(Value::Array(items)) = map.remove("reminders") else {
        return Err(ApiError::invalid(
            "/reminders",
            "must be an array of reminders",
        ));
    };
    let max = state.inner.limits.batch_max;
    if items.is_empty() || items.len() > max {
        return Err(ApiError::invalid(
            "/reminders",
            format!("must hold 1 to {max} reminders (intake.batch_max)"),
        ));
    }
    let mut prepared: Vec<Result<ImportReminder, Vec<Problem>>> = Vec::with_capacity(items.len());
    for (index, item) in items.into_iter().enumerate() {
        prepared.push(prepare(
            state,
            tenant,
            item,
            None,
            correlation,
            &format!("/reminders/{index}"),
        ));
    }
    let valid: Vec<ImportReminder> = prepared
        .iter()
        .filter_map(|p| p.as_ref().ok())
        .cloned()
        .collect();
    let mut outcomes = state
        .inner
        .ledger
        .import_reminders(&valid, &state.inner.cipher, state.now())
        .await
        .map_err(ApiError::internal)?
        .into_iter();
    let mut results = Vec::with_capacity(prepared.len());
    for (index, p) in prepared.into_iter().enumerate() {
        let item = match p {
            Err(errors) => {
                state.metrics().reminder("invalid");
                results.push(BatchItem {
                    index,
                    status: 400,
                    reminder: None,
                    event_id: None,
                    errors,
                });
                continue;
            }
            Ok(item) => item,
        };
        let outcome = outcomes
            .next()
            .ok_or_else(|| ApiError::internal(anyhow::anyhow!("the import answered too few")))?;
        let event_id = item.reminder.event_id().as_str().to_owned();
        results.push(match answer(state, tenant, &item, outcome, correlation) {
            Ok((status, accepted)) => BatchItem {
                index,
                status: status.as_u16(),
                reminder: Some(accepted),
                event_id: Some(event_id),
                errors: Vec::new(),
            },
            Err(ApiError::EventConflict(event_id)) => BatchItem {
                index,
                status: 409,
                reminder: None,
                errors: vec![Problem::new(
                    format!("/reminders/{index}/event_id"),
                    "is already used for a different reminder",
                )],
                event_id: Some(event_id),
            },
            Err(other) => return Err(other),
        });
    }
    Ok((StatusCode::OK, Json(BatchAnswer { results })).into_response())
}

fn reminder_state(event_id: &EventId, status: ReminderStatus) -> ReminderState {
    ReminderState {
        reminder_id: status.id.as_uuid(),
        event_id: event_id.as_str().to_owned(),
        scheduled_at: status.scheduled_at,
        expires_at: status.expires_at,
        cancelled_at: status.cancelled_at,
        correlation_id: status.correlation_id,
        channels: status
            .channels
            .into_iter()
            .map(|c| ChannelState {
                channel: channel_name(c.channel),
                state: c
                    .state
                    .map_or_else(|| "pending".to_owned(), |s| s.as_str().to_owned()),
                attempts: c.attempts,
                settled_at: c.settled_at,
            })
            .collect(),
    }
}

fn event_id(text: &str) -> Result<EventId, ApiError> {
    EventId::parse(text).map_err(|e| ApiError::invalid("event_id", e.to_string()))
}

fn subscriber_ref(text: &str) -> Result<SubscriberRef, ApiError> {
    // The message names the field and a position, never the text.
    SubscriberRef::parse(text).map_err(|e| ApiError::invalid("subscriber_ref", e.to_string()))
}

/// A reminder's state per channel (no PHI).
#[utoipa::path(get, path = "/v1/tenants/{tenant}/reminders/{event_id}", tag = "reminders",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("event_id" = String, Path, description = "the client's event id", min_length = 1, max_length = 200, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the (empty) body"),
    ),
    responses(
        (status = 200, description = "the reminder", body = ReminderState),
        (status = 400, description = "invalid event id", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 404, description = "no such event", body = ErrorBody),
        (status = 500, description = "unexpected", body = ErrorBody),
    ),
    security(("signature" = [])))]
pub async fn get_reminder(
    State(state): State<AppState>,
    params: Result<Path<(String, String)>, PathRejection>,
    method: Method,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (tenant_name, event) = path(params)?;
    let raw = body(raw)?;
    let tenant = authenticate(
        &state,
        &tenant_name,
        SignedRequest {
            method: &method,
            uri: &uri,
            headers: &headers,
            body: &raw,
        },
        Secrets::Ledger,
    )
    .await?
    .tenant;
    let event_id = event_id(&event)?;
    let status = state
        .inner
        .ledger
        .reminder_status(tenant.id, &event_id)
        .await
        .map_err(ApiError::internal)?
        .ok_or(ApiError::NotFound)?;
    Ok(Json(reminder_state(&event_id, status)).into_response())
}

/// Cancel a reminder: every owed delivery is settled `cancelled`; one being sent finishes but
/// is never retried. Cancelling again answers the same.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/reminders/{event_id}/cancel", tag = "reminders",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("event_id" = String, Path, description = "the client's event id", min_length = 1, max_length = 200, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the body (usually empty)"),
    ),
    responses(
        (status = 200, description = "cancelled", body = CancelAnswer),
        (status = 400, description = "invalid event id", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 404, description = "no such event", body = ErrorBody),
        (status = 408, description = "the body did not arrive in time", body = ErrorBody),
        (status = 413, description = "the body is over the limit", body = ErrorBody),
        (status = 500, description = "unexpected", body = ErrorBody),
    ),
    security(("signature" = [])))]
pub async fn cancel_reminder(
    State(state): State<AppState>,
    params: Result<Path<(String, String)>, PathRejection>,
    method: Method,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (tenant_name, event) = path(params)?;
    let raw = body(raw)?;
    let tenant = authenticate(
        &state,
        &tenant_name,
        SignedRequest {
            method: &method,
            uri: &uri,
            headers: &headers,
            body: &raw,
        },
        Secrets::Ledger,
    )
    .await?
    .tenant;
    let event_id = event_id(&event)?;
    let cancellation = state
        .inner
        .ledger
        .cancel_reminder_by_channel(tenant.id, &event_id, LedgerTime::Database)
        .await
        .map_err(ApiError::internal)?
        .ok_or(ApiError::NotFound)?;
    Ok(Json(CancelAnswer {
        cancelled: cancellation
            .cancelled
            .iter()
            .map(|c| channel_name(*c))
            .collect(),
        reminder: reminder_state(&event_id, cancellation.status),
    })
    .into_response())
}

/// Store a subscriber's destinations for the channels given.
#[utoipa::path(put, path = "/v1/tenants/{tenant}/subscribers/{subscriber_ref}/contacts", tag = "subscribers",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("subscriber_ref" = String, Path, description = "the client's reference of the subscriber", min_length = 1, max_length = 128, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the body"),
    ),
    request_body(content = ContactsBody, content_type = "application/json"),
    responses(
        (status = 200, description = "stored", body = ContactsAnswer),
        (status = 400, description = "invalid; nothing written", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 408, description = "the body did not arrive in time", body = ErrorBody),
        (status = 413, description = "the body is over the limit", body = ErrorBody),
        (status = 415, description = "the body is not JSON", body = ErrorBody),
        (status = 500, description = "unexpected", body = ErrorBody),
    ),
    security(("signature" = [])))]
pub async fn put_contacts(
    State(state): State<AppState>,
    params: Result<Path<(String, String)>, PathRejection>,
    method: Method,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (tenant_name, subscriber) = path(params)?;
    require_json(&headers)?;
    let raw = body(raw)?;
    let tenant = authenticate(
        &state,
        &tenant_name,
        SignedRequest {
            method: &method,
            uri: &uri,
            headers: &headers,
            body: &raw,
        },
        Secrets::Ledger,
    )
    .await?
    .tenant;
    let subscriber = subscriber_ref(&subscriber)?;
    let value: Value =
        serde_json::from_slice(&raw).map_err(|e| ApiError::Invalid(vec![json_problem(&e)]))?;
    let Value::Object(mut map) = value else {
        return Err(ApiError::invalid("", "expected a JSON object"));
    };
    if map.keys().any(|k| k != "destinations") {
        return Err(ApiError::invalid("", UNKNOWN_CONTACTS_FIELD));
    }
    let destinations = map
        .remove("destinations")
        .ok_or_else(|| ApiError::invalid("/destinations", "missing field"))?;
    let Some(given) = destinations.as_object() else {
        return Err(ApiError::invalid(
            "/destinations",
            "must be an object of channel name to destination",
        ));
    };
    let mut channels = Vec::with_capacity(given.len());
    for key in given.keys() {
        // Not quoted: it could be a destination typed in the wrong place.
        let channel: Channel = key.parse().map_err(|_| {
            ApiError::invalid(
                "/destinations",
                "has a key that is not one of push, email, sms",
            )
        })?;
        channels.push(channel);
    }
    if channels.is_empty() {
        return Err(ApiError::invalid(
            "/destinations",
            "must give at least one channel",
        ));
    }
    let parsed = input::destinations(&destinations, &channels)
        .map_err(|e| ApiError::Invalid(vec![input_problem("", &e)]))?;
    state
        .inner
        .ledger
        .set_contacts(
            tenant.id,
            &subscriber,
            &parsed,
            &state.inner.cipher,
            state.now(),
        )
        .await
        .map_err(ApiError::internal)?;
    channels.sort();
    Ok(Json(ContactsAnswer {
        channels: channels.into_iter().map(channel_name).collect(),
    })
    .into_response())
}

/// Erase a subscriber: their destinations are deleted, their owed deliveries cancelled, and
/// their reminders keep only ids, states, times and classes. Erasing again answers zeros.
#[utoipa::path(delete, path = "/v1/tenants/{tenant}/subscribers/{subscriber_ref}", tag = "subscribers",
    params(
        ("tenant" = String, Path, description = "the tenant's name"),
        ("subscriber_ref" = String, Path, description = "the client's reference of the subscriber", min_length = 1, max_length = 128, pattern = "^[!-~]+$"),
        ("Nudge-Signature" = String, Header, description = "t=<unix seconds>,v2=<hex>: signs the method, the path and the (empty) body"),
    ),
    responses(
        (status = 200, description = "erased", body = ErasureAnswer),
        (status = 400, description = "invalid reference", body = InvalidRequest),
        (status = 401, description = "not authenticated", body = Unauthorized),
        (status = 500, description = "unexpected", body = ErrorBody),
    ),
    security(("signature" = [])))]
pub async fn erase_subscriber(
    State(state): State<AppState>,
    params: Result<Path<(String, String)>, PathRejection>,
    method: Method,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (tenant_name, subscriber) = path(params)?;
    let raw = body(raw)?;
    let tenant = authenticate(
        &state,
        &tenant_name,
        SignedRequest {
            method: &method,
            uri: &uri,
            headers: &headers,
            body: &raw,
        },
        Secrets::Ledger,
    )
    .await?
    .tenant;
    let subscriber = subscriber_ref(&subscriber)?;
    let by = Operator::new(
        &format!("nudge-intake:{tenant_name}"),
        Some("erasure requested by the tenant over the API"),
        state.now(),
    )
    .map_err(ApiError::internal)?;
    let erasure = state
        .inner
        .ledger
        .erase_subscriber(
            tenant.id,
            &subscriber,
            &state.inner.cipher,
            &by,
            LedgerTime::Database,
        )
        .await
        .map_err(ApiError::internal)?;
    Ok(Json(ErasureAnswer {
        contacts_deleted: erasure.contacts_deleted,
        reminders_erased: erasure.reminders_erased,
        deliveries_cancelled: erasure.deliveries_cancelled,
    })
    .into_response())
}
