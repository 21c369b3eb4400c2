//! The console's routes: the pages (GET, any session), the operator actions (POST, an
//! operator's session with its CSRF token and a reason), login and logout.
//!
//! Every answer carries a Content-Security-Policy that allows nothing but this site's own
//! stylesheet and forms (no script at all), and `Cache-Control: no-store`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{FromRef, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use axum_extra::extract::SignedCookieJar;
use axum_extra::extract::cookie::Key;
use chrono::Utc;
use minijinja::Environment;
use nudge_domain::{Channel, ProviderAccount, RedriveId, TenantId};
use nudge_ledger::{
    AuditFilter, ConsoleRole, Ledger, LedgerError, LedgerTime, RedriveFilter, TraceError, TraceId,
};
use nudge_telemetry::error_chain;
use serde::Deserialize;
use serde_json::{Value, json};
use tracing::{info, warn};

use crate::session::{self, Session};
use crate::{ConsoleMetrics, ConsoleSection, templates};

/// What every handler shares.
#[derive(Debug, Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    ledger: Ledger,
    env: Environment<'static>,
    key: Key,
    key_bytes: Vec<u8>,
    secure_cookies: bool,
    session_ttl: chrono::Duration,
    trusted: Option<Trusted>,
    rows: u32,
    metrics: Arc<ConsoleMetrics>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("secure_cookies", &self.secure_cookies)
            .field("session_ttl", &self.session_ttl)
            .field("trusted", &self.trusted)
            .field("rows", &self.rows)
            .finish_non_exhaustive()
    }
}

/// The authenticating proxy: its header, the role of its users, and the addresses it connects
/// from (the header is dropped from a request from anywhere else).
#[derive(Debug, Clone)]
struct Trusted {
    header: String,
    role: ConsoleRole,
    proxies: Vec<ipnet::IpNet>,
}

impl FromRef<AppState> for Key {
    fn from_ref(state: &AppState) -> Self {
        state.inner.key.clone()
    }
}

impl AppState {
    pub fn new(
        ledger: Ledger,
        section: &ConsoleSection,
        metrics: Arc<ConsoleMetrics>,
    ) -> anyhow::Result<Self> {
        let key_bytes = section.session_key_bytes()?;
        let trusted = match &section.trusted_header {
            Some(name) => Some(Trusted {
                header: name.trim().to_ascii_lowercase(),
                role: section.trusted_role()?,
                proxies: section.trusted_proxy_ranges()?,
            }),
            None => None,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                ledger,
                env: templates::environment(),
                key: Key::derive_from(&key_bytes),
                key_bytes,
                secure_cookies: section.secure_cookies,
                session_ttl: chrono::Duration::seconds(
                    i64::try_from(section.session_ttl_s).unwrap_or(28_800),
                ),
                trusted,
                rows: section.page_rows,
                metrics,
            }),
        })
    }
}

/// Every route of the console.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(overview))
        .route("/tenants", get(tenants))
        .route("/dead-letters", get(dead_letters))
        .route("/redrives", get(redrives))
        .route("/trace", get(trace))
        .route("/audit", get(audit))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route("/tenants/{tenant}/intake", post(tenant_intake))
        .route("/channels/{channel}/drain", post(drain))
        .route("/rates", post(rate_set))
        .route("/rates/resume", post(rate_resume))
        .route("/redrives/plan", post(redrive_plan))
        .route("/redrives/execute", post(redrive_execute))
        .route("/redrives/{id}/change", post(redrive_change))
        .route("/static/console.css", get(stylesheet))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .layer(axum::middleware::map_response(security_headers))
        .with_state(state)
}

/// Serves the console on `listener` until `shutdown` is cancelled, with each connection's peer
/// address known (the trusted header is taken only from `console.trusted_proxies`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        router(state).into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(async move { shutdown.cancelled().await })
    .await
}

/// Before any route: a POST must come from the console's own pages (a browser's
/// `Sec-Fetch-Site` same-origin, or an `Origin` naming this host, when it sends them), which
/// stops another site's form from logging a user in or acting; and the trusted header is
/// dropped unless the request comes from a trusted proxy.
async fn guard(
    State(state): State<AppState>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(trusted) = &state.inner.trusted {
        let peer = request
            .extensions()
            .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
            .map(|c| c.0.ip());
        let from_proxy = peer.is_some_and(|ip| trusted.proxies.iter().any(|n| n.contains(&ip)));
        if !from_proxy {
            request.headers_mut().remove(trusted.header.as_str());
        }
    }
    if request.method() == axum::http::Method::POST && !same_origin(request.headers()) {
        return (
            StatusCode::FORBIDDEN,
            "refused: this form was not sent from the console's own pages",
        )
            .into_response();
    }
    next.run(request).await
}

fn same_origin(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site") {
        return matches!(site.to_str(), Ok("same-origin" | "none"));
    }
    match (headers.get(header::ORIGIN), headers.get(header::HOST)) {
        (None, _) => true,
        (Some(origin), Some(host)) => match (origin.to_str(), host.to_str()) {
            (Ok(origin), Ok(host)) => origin
                .split_once("://")
                .is_some_and(|(_, authority)| authority == host),
            _ => false,
        },
        (Some(_), None) => false,
    }
}

async fn security_headers(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        templates::STYLESHEET,
    )
        .into_response()
}

// ---- rendering --------------------------------------------------------------------------

/// The parts of a page every template reads.
struct Page<'a> {
    template: &'static str,
    key: &'static str,
    title: &'a str,
    session: Option<&'a Session>,
    refresh: Option<u32>,
    notice: Option<&'a str>,
    /// This page's own address (a GET, without `refresh`, `notice` and `sig`): the footer's
    /// refresh links; None for a page an action rendered.
    here: Option<String>,
}

impl AppState {
    fn render(&self, page: Page<'_>, context: Value, status: StatusCode) -> Response {
        let mut ctx = match context {
            Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        ctx.insert("page".into(), json!(page.key));
        ctx.insert("title".into(), json!(page.title));
        ctx.insert("session".into(), json!(page.session));
        ctx.insert("refresh".into(), json!(page.refresh));
        ctx.insert("notice".into(), json!(page.notice));
        ctx.insert("here".into(), json!(page.here));
        if let Some(session) = page.session {
            ctx.entry("now").or_insert(json!(session.now));
        }
        ctx.entry("now").or_insert(json!(Utc::now()));
        let rendered = self
            .inner
            .env
            .get_template(page.template)
            .and_then(|t| t.render(minijinja::Value::from_serialize(&ctx)));
        match rendered {
            Ok(html) => (
                status,
                [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
                html,
            )
                .into_response(),
            Err(e) => {
                warn!(
                    error.cause_chain = %error_chain(&e),
                    template = page.template,
                    "failed to render a console page"
                );
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the page could not be rendered: see the console's log",
                )
                    .into_response()
            }
        }
    }

    fn error_page(
        &self,
        status: StatusCode,
        session: Option<&Session>,
        message: &str,
        back: &str,
    ) -> Response {
        self.render(
            Page {
                template: "error.html",
                key: "error",
                title: status.canonical_reason().unwrap_or("Error"),
                session,
                refresh: None,
                notice: None,
                here: None,
            },
            json!({ "message": message, "back": back }),
            status,
        )
    }

    /// A ledger error as the page a user sees: what they can fix is said; the rest is logged.
    fn ledger_error(&self, session: &Session, e: &LedgerError, back: &str) -> Response {
        let status = match e {
            LedgerError::InvalidInput(_) => StatusCode::BAD_REQUEST,
            LedgerError::UnknownTenant(_) | LedgerError::UnknownRedrive(_) => StatusCode::NOT_FOUND,
            LedgerError::RedriveActive { .. } | LedgerError::RedriveState { .. } => {
                StatusCode::CONFLICT
            }
            e if e.is_unavailable() => {
                warn!(error.cause_chain = %error_chain(e), "the console could not reach the ledger");
                return self.error_page(
                    StatusCode::SERVICE_UNAVAILABLE,
                    Some(session),
                    "The ledger did not answer (away, or read-only during a failover): nothing \
                     was changed; try again in a few seconds.",
                    back,
                );
            }
            e if e.is_data_refused() => {
                return self.error_page(
                    StatusCode::BAD_REQUEST,
                    Some(session),
                    "The ledger refused a value of this form (too long, or out of range): \
                     nothing was changed.",
                    back,
                );
            }
            _ => {
                warn!(error.cause_chain = %error_chain(e), "a console request failed in the ledger");
                return self.error_page(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    Some(session),
                    "The ledger did not answer as expected: see the console's log.",
                    back,
                );
            }
        };
        self.error_page(status, Some(session), &e.to_string(), back)
    }
}

// ---- who is asking ----------------------------------------------------------------------

/// The session of this request, or the answer that sends the user to log in.
async fn who(
    state: &AppState,
    headers: &HeaderMap,
    jar: &SignedCookieJar,
) -> Result<Session, Response> {
    let ledger = &state.inner.ledger;
    let now = match ledger.clock(LedgerTime::Database).await {
        Ok(now) => now,
        Err(e) => return Err(unavailable(&e)),
    };
    if let Some(trusted) = &state.inner.trusted
        && let Some(session) = Session::from_header(
            headers,
            &trusted.header,
            trusted.role,
            &state.inner.key_bytes,
            now,
        )
    {
        return Ok(session);
    }
    let to_login = || Redirect::to("/login").into_response();
    let Some(session) = Session::from_cookie(jar, now) else {
        return Err(to_login());
    };
    let Some(token_id) = session.token_id else {
        return Err(to_login());
    };
    match ledger.console_token(token_id).await {
        Ok(Some(token))
            if token.admits(session.issued_at, now)
                && token.role == session.role
                && session.proves(&state.inner.key_bytes, &token.digest) =>
        {
            Ok(session)
        }
        Ok(_) => Err(to_login()),
        Err(e) => Err(unavailable(&e)),
    }
}

/// The answer when the ledger cannot be read before a session is known.
fn unavailable(e: &LedgerError) -> Response {
    warn!(error.cause_chain = %error_chain(e), "the console could not reach the ledger");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, "5")],
        "the ledger did not answer: try again in a few seconds",
    )
        .into_response()
}

/// Lets an action through only for an operator's session whose form carried its CSRF token:
/// the refusal (403, counted) otherwise.
fn refusal(
    state: &AppState,
    session: &Session,
    csrf: &str,
    action: &'static str,
) -> Option<Response> {
    if !session.csrf_matches(csrf) {
        state.inner.metrics.action(action, "refused");
        return Some(state.error_page(
            StatusCode::FORBIDDEN,
            Some(session),
            "This form is not from this session (its CSRF token does not match): reload the \
             page and try again.",
            "/",
        ));
    }
    if !session.may_act() {
        state.inner.metrics.action(action, "refused");
        return Some(state.error_page(
            StatusCode::FORBIDDEN,
            Some(session),
            "A viewer may read but not act: log in with an operator's token.",
            "/",
        ));
    }
    None
}

// ---- login ------------------------------------------------------------------------------

async fn login_page(State(state): State<AppState>) -> Response {
    state.render(
        Page {
            template: "login.html",
            key: "login",
            title: "Log in",
            session: None,
            refresh: None,
            notice: None,
            here: None,
        },
        json!({}),
        StatusCode::OK,
    )
}

#[derive(Debug, Deserialize)]
struct LoginForm {
    #[serde(default)]
    token: String,
}

async fn login(
    State(state): State<AppState>,
    jar: SignedCookieJar,
    Form(form): Form<LoginForm>,
) -> Response {
    let now = match state.inner.ledger.clock(LedgerTime::Database).await {
        Ok(now) => now,
        Err(e) => return unavailable(&e),
    };
    let refused = |state: &AppState, message: &str| {
        state.inner.metrics.login(false);
        state.render(
            Page {
                template: "login.html",
                key: "login",
                title: "Log in",
                session: None,
                refresh: None,
                notice: Some(message),
                here: None,
            },
            json!({}),
            StatusCode::UNAUTHORIZED,
        )
    };
    let token = form.token.trim();
    if token.is_empty() || token.len() > 200 {
        return refused(&state, "Paste a console token.");
    }
    let found = match state.inner.ledger.console_token_by_secret(token).await {
        Ok(found) => found,
        Err(e) => return unavailable(&e),
    };
    let Some(token) = found.filter(|t| t.is_live(now)) else {
        info!("console login refused: unknown, expired or revoked token");
        return refused(&state, "That token is unknown, expired or revoked.");
    };
    let session = Session::for_token(&token, state.inner.session_ttl, now, &state.inner.key_bytes);
    let Some(cookie) = session.cookie(state.inner.secure_cookies) else {
        return refused(&state, "That token cannot make a session.");
    };
    state.inner.metrics.login(true);
    info!(token_id = token.id, role = %token.role, "console login");
    (jar.add(cookie), Redirect::to("/")).into_response()
}

#[derive(Debug, Deserialize)]
struct CsrfOnly {
    #[serde(default)]
    csrf: String,
}

async fn logout(
    State(state): State<AppState>,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Form(form): Form<CsrfOnly>,
) -> Response {
    match who(&state, &headers, &jar).await {
        Ok(session) if !session.csrf_matches(&form.csrf) => state.error_page(
            StatusCode::FORBIDDEN,
            Some(&session),
            "This form is not from this session: reload the page.",
            "/",
        ),
        Ok(session) => {
            // Every session of the token ends, not only this browser's cookie.
            if let Some(id) = session.token_id
                && let Err(e) = state
                    .inner
                    .ledger
                    .end_console_sessions(id, LedgerTime::Database)
                    .await
            {
                return unavailable(&e);
            }
            info!(actor = %session.actor, "console logout");
            (jar.remove(session::removal()), Redirect::to("/login")).into_response()
        }
        Err(_) => (jar.remove(session::removal()), Redirect::to("/login")).into_response(),
    }
}

// ---- the pages --------------------------------------------------------------------------

/// What every page's query may carry.
#[derive(Debug, Default, Deserialize)]
struct Common {
    /// Reload the page every so many seconds (5..=300).
    refresh: Option<u32>,
    /// A short message from the action that led here, shown only with its signature (`sig`):
    /// a link from elsewhere cannot put words in the console's mouth.
    notice: Option<String>,
    sig: Option<String>,
}

impl Common {
    fn refresh(&self) -> Option<u32> {
        self.refresh.map(|s| s.clamp(5, 300))
    }

    fn notice(&self, key: &[u8]) -> Option<&str> {
        let notice = self.notice.as_deref()?;
        let sig = self.sig.as_deref()?;
        session::same(sig, &notice_sig(key, notice)).then(|| {
            let end = notice
                .char_indices()
                .nth(300)
                .map_or(notice.len(), |(i, _)| i);
            &notice[..end]
        })
    }
}

/// Times a page and records it under `page`.
struct Timer {
    started: Instant,
    page: &'static str,
}

impl Timer {
    fn start(page: &'static str) -> Self {
        Self {
            started: Instant::now(),
            page,
        }
    }

    fn done(self, state: &AppState, response: Response) -> Response {
        state
            .inner
            .metrics
            .page(self.page, self.started.elapsed().as_secs_f64());
        response
    }
}

/// `uri` without `refresh`, `notice` and `sig`: where the footer's refresh links point.
fn here(uri: &axum::http::Uri) -> Option<String> {
    let kept: Vec<(String, String)> =
        url::form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
            .filter(|(k, _)| !matches!(k.as_ref(), "refresh" | "notice" | "sig"))
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
    if kept.is_empty() {
        return Some(uri.path().to_owned());
    }
    let query = url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(kept)
        .finish();
    Some(format!("{}?{query}", uri.path()))
}

fn channels() -> Vec<&'static str> {
    Channel::ALL.iter().map(|c| c.as_str()).collect()
}

async fn overview(
    State(state): State<AppState>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Query(common): Query<Common>,
) -> Response {
    let timer = Timer::start("overview");
    let session = match who(&state, &headers, &jar).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let ledger = &state.inner.ledger;
    let now = session.now;
    let read = async {
        let channels = ledger.status(now).await?;
        let buckets = ledger.rate_buckets().await?;
        let samples = ledger.ledger_samples(SPARK_MINUTES).await?;
        Ok::<_, LedgerError>((channels, buckets, samples))
    };
    let response = match read.await {
        Ok((channels, buckets, samples)) => state.render(
            Page {
                template: "overview.html",
                key: "overview",
                title: "Overview",
                session: Some(&session),
                refresh: common.refresh(),
                notice: common.notice(&state.inner.key_bytes),
                here: here(&uri),
            },
            json!({
                "channels": channels,
                "buckets": buckets,
                "trends": trends(&samples, now),
                "now": now,
            }),
            StatusCode::OK,
        ),
        Err(e) => state.ledger_error(&session, &e, "/"),
    };
    timer.done(&state, response)
}

/// The most redrives the redrives page lists.
const REDRIVES_SHOWN: u32 = 50;

/// How far back the overview's sparklines reach.
const SPARK_MINUTES: u32 = 60;
/// A sparkline's size in SVG units.
const SPARK_W: f64 = 120.0;
const SPARK_H: f64 = 24.0;

/// One channel's last hour, drawn: the oldest eligible wait, and the deliveries and the 429s
/// per minute.
#[derive(Debug, serde::Serialize)]
struct Trend {
    channel: &'static str,
    /// Polyline points (`x,y ...`) and the largest value drawn.
    age_points: String,
    age_max: f64,
    delivered_points: String,
    delivered_max: u64,
    throttled_points: String,
    throttled_max: u64,
    /// The last sampled minute: deliveries and 429s (None before the first sample).
    delivered_last: Option<u64>,
    throttled_last: Option<u64>,
    samples: usize,
}

fn polyline(values: &[(f64, f64)], max: f64) -> String {
    values
        .iter()
        .map(|(x, v)| {
            let y = if max > 0.0 {
                SPARK_H - (v / max) * (SPARK_H - 2.0) - 1.0
            } else {
                SPARK_H - 1.0
            };
            format!("{x:.1},{y:.1}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The sparklines of each channel from the samples of the last [`SPARK_MINUTES`] minutes:
/// x is the minute's place in the hour, so a missing minute leaves a longer segment.
fn trends(samples: &[nudge_ledger::LedgerSample], now: chrono::DateTime<Utc>) -> Vec<Trend> {
    let start = now - chrono::Duration::minutes(i64::from(SPARK_MINUTES));
    let x = |at: chrono::DateTime<Utc>| {
        let minutes = (at - start).num_seconds() as f64 / 60.0;
        (minutes / f64::from(SPARK_MINUTES) * SPARK_W).clamp(0.0, SPARK_W)
    };
    Channel::ALL
        .iter()
        .map(|&channel| {
            let mine: Vec<_> = samples.iter().filter(|s| s.channel == channel).collect();
            let ages: Vec<(f64, f64)> = mine
                .iter()
                .map(|s| (x(s.at), s.oldest_eligible_age_s.unwrap_or(0.0)))
                .collect();
            let delivered: Vec<(f64, f64)> =
                mine.iter().map(|s| (x(s.at), s.delivered as f64)).collect();
            let age_max = ages.iter().map(|(_, v)| *v).fold(0.0, f64::max);
            let delivered_max = mine.iter().map(|s| s.delivered).max().unwrap_or(0);
            let throttled: Vec<(f64, f64)> =
                mine.iter().map(|s| (x(s.at), s.throttled as f64)).collect();
            let throttled_max = mine.iter().map(|s| s.throttled).max().unwrap_or(0);
            Trend {
                channel: channel.as_str(),
                age_points: polyline(&ages, age_max),
                age_max,
                delivered_points: polyline(&delivered, delivered_max as f64),
                delivered_max,
                throttled_points: polyline(&throttled, throttled_max as f64),
                throttled_max,
                delivered_last: mine.last().map(|s| s.delivered),
                throttled_last: mine.last().map(|s| s.throttled),
                samples: mine.len(),
            }
        })
        .collect()
}

#[derive(Debug, serde::Serialize)]
struct TenantView {
    id: String,
    name: String,
    intake_paused: bool,
    time_zone: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct TenantsQuery {
    /// Part of a tenant's name.
    #[serde(default)]
    q: String,
    #[serde(flatten)]
    common: Common,
}

async fn tenants(
    State(state): State<AppState>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Query(query): Query<TenantsQuery>,
) -> Response {
    let common = &query.common;
    let timer = Timer::start("tenants");
    let session = match who(&state, &headers, &jar).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let ledger = &state.inner.ledger;
    let rows = state.inner.rows;
    let read = async {
        let lateness = ledger.tenant_lateness(rows, LedgerTime::Database).await?;
        let (tenants, total) = ledger.tenants(given(&query.q).as_deref(), rows).await?;
        Ok::<_, LedgerError>((lateness, tenants, total))
    };
    let response = match read.await {
        Ok((lateness, tenants, total)) => {
            let tenants: Vec<TenantView> = tenants
                .into_iter()
                .map(|t| TenantView {
                    id: t.id.to_string(),
                    name: t.name,
                    intake_paused: t.intake_paused,
                    time_zone: t.time_zone.map(|z| z.to_string()),
                })
                .collect();
            state.render(
                Page {
                    template: "tenants.html",
                    key: "tenants",
                    title: "Tenants",
                    session: Some(&session),
                    refresh: common.refresh(),
                    notice: common.notice(&state.inner.key_bytes),
                    here: here(&uri),
                },
                json!({
                    "lateness": lateness,
                    "tenants": tenants,
                    "total": total,
                    "q": query.q.trim(),
                }),
                StatusCode::OK,
            )
        }
        Err(e) => state.ledger_error(&session, &e, "/tenants"),
    };
    timer.done(&state, response)
}

#[derive(Debug, Default, Deserialize)]
struct DeadLetterQuery {
    #[serde(default)]
    channel: String,
    #[serde(flatten)]
    common: Common,
}

async fn dead_letters(
    State(state): State<AppState>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Query(query): Query<DeadLetterQuery>,
) -> Response {
    let timer = Timer::start("dead_letters");
    let session = match who(&state, &headers, &jar).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let channel = match query.channel.as_str() {
        "" => None,
        name => match name.parse::<Channel>() {
            Ok(c) => Some(c),
            Err(_) => {
                return state.error_page(
                    StatusCode::BAD_REQUEST,
                    Some(&session),
                    "No such channel: push, email or sms.",
                    "/dead-letters",
                );
            }
        },
    };
    let response = match state.inner.ledger.dlq_report(channel, session.now).await {
        Ok(report) => state.render(
            Page {
                template: "dead_letters.html",
                key: "dead_letters",
                title: "Dead letters and held work",
                session: Some(&session),
                refresh: query.common.refresh(),
                notice: query.common.notice(&state.inner.key_bytes),
                here: here(&uri),
            },
            json!({
                "report": report,
                "channel": channel.map(Channel::as_str),
                "channels": channels(),
                "now": report.now,
            }),
            StatusCode::OK,
        ),
        Err(e) => state.ledger_error(&session, &e, "/dead-letters"),
    };
    timer.done(&state, response)
}

async fn redrives(
    State(state): State<AppState>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Query(common): Query<Common>,
) -> Response {
    let timer = Timer::start("redrives");
    let session = match who(&state, &headers, &jar).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    // The most recent: each is read with its own counts (the ledger's `redrives`).
    let shown = state.inner.rows.min(REDRIVES_SHOWN);
    let response = match state.inner.ledger.redrives(shown).await {
        Ok(list) => state.render(
            Page {
                template: "redrives.html",
                key: "redrives",
                title: "Redrives",
                session: Some(&session),
                refresh: common.refresh(),
                notice: common.notice(&state.inner.key_bytes),
                here: here(&uri),
            },
            json!({ "redrives": list, "channels": channels() }),
            StatusCode::OK,
        ),
        Err(e) => state.ledger_error(&session, &e, "/redrives"),
    };
    timer.done(&state, response)
}

#[derive(Debug, Default, Deserialize)]
struct TraceQuery {
    #[serde(default)]
    id: String,
    #[serde(flatten)]
    common: Common,
}

async fn trace(
    State(state): State<AppState>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Query(query): Query<TraceQuery>,
) -> Response {
    let timer = Timer::start("trace");
    let session = match who(&state, &headers, &jar).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let text = query.id.trim();
    let refresh = query.common.refresh();
    let page = |notice| trace_page(&session, refresh, notice, here(&uri));
    let response = if text.is_empty() {
        state.render(
            page(query.common.notice(&state.inner.key_bytes)),
            json!({ "query": "", "trace": null }),
            StatusCode::OK,
        )
    } else {
        match TraceId::parse(text) {
            Err(e) => state.render(
                page(Some(&e.to_string())),
                json!({ "query": text, "trace": null }),
                StatusCode::BAD_REQUEST,
            ),
            Ok(id) => match state.inner.ledger.trace(&id, session.now).await {
                Ok(found) => state.render(
                    page(None),
                    json!({ "query": text, "trace": found }),
                    StatusCode::OK,
                ),
                Err(TraceError::Ledger(e)) => state.ledger_error(&session, &e, "/trace"),
                Err(not_found) => state.render(
                    page(Some(&not_found.to_string())),
                    json!({ "query": text, "trace": null }),
                    StatusCode::NOT_FOUND,
                ),
            },
        }
    };
    timer.done(&state, response)
}

fn trace_page<'a>(
    session: &'a Session,
    refresh: Option<u32>,
    notice: Option<&'a str>,
    here: Option<String>,
) -> Page<'a> {
    Page {
        template: "trace.html",
        key: "trace",
        title: "Trace",
        session: Some(session),
        refresh,
        notice,
        here,
    }
}

#[derive(Debug, Default, Deserialize)]
struct AuditQuery {
    #[serde(default)]
    actor: String,
    #[serde(default)]
    action: String,
    #[serde(default)]
    incident: String,
    before: Option<i64>,
    #[serde(flatten)]
    common: Common,
}

fn given(text: &str) -> Option<String> {
    let t = text.trim();
    (!t.is_empty()).then(|| t.to_owned())
}

async fn audit(
    State(state): State<AppState>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Query(query): Query<AuditQuery>,
) -> Response {
    let timer = Timer::start("audit");
    let session = match who(&state, &headers, &jar).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let filter = AuditFilter {
        actor: given(&query.actor),
        action: given(&query.action),
        incident: given(&query.incident),
        before_id: query.before,
    };
    let rows = state.inner.rows;
    let response = match state.inner.ledger.audit_lines(&filter, rows).await {
        Ok(lines) => {
            let next_before = (lines.len() == rows as usize)
                .then(|| lines.last().map(|l| l.id))
                .flatten();
            state.render(
                Page {
                    template: "audit.html",
                    key: "audit",
                    title: "Audit log",
                    session: Some(&session),
                    refresh: query.common.refresh(),
                    notice: query.common.notice(&state.inner.key_bytes),
                    here: here(&uri),
                },
                json!({
                    "lines": lines,
                    "next_before": next_before,
                    "filter": {
                        "actor": query.actor.trim(),
                        "action": query.action.trim(),
                        "incident": query.incident.trim(),
                    },
                }),
                StatusCode::OK,
            )
        }
        Err(e) => state.ledger_error(&session, &e, "/audit"),
    };
    timer.done(&state, response)
}

async fn not_found(
    State(state): State<AppState>,
    headers: HeaderMap,
    jar: SignedCookieJar,
) -> Response {
    let session = who(&state, &headers, &jar).await.ok();
    state.error_page(
        StatusCode::NOT_FOUND,
        session.as_ref(),
        "No such page.",
        "/",
    )
}

// ---- the actions ------------------------------------------------------------------------

fn notice_sig(key: &[u8], notice: &str) -> String {
    session::mac(key, &[b"nudge-console notice", notice.as_bytes()])
}

/// Where an action sends the user back, with what it did (signed: see [`Common::notice`]).
fn done(state: &AppState, path: &str, notice: &str) -> Response {
    let mut url = String::from(path);
    url.push_str("?notice=");
    url.extend(url::form_urlencoded::byte_serialize(notice.as_bytes()));
    url.push_str("&sig=");
    url.push_str(&notice_sig(&state.inner.key_bytes, notice));
    Redirect::to(&url).into_response()
}

#[derive(Debug, Deserialize)]
struct ReasonForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    incident: String,
    /// `true` or `false`: the state asked for (pause or drain).
    #[serde(default)]
    paused: String,
    #[serde(default)]
    draining: String,
}

fn flag(text: &str) -> Option<bool> {
    match text {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

/// One action's request, let through: an operator's session whose form carried its CSRF
/// token. Its answers count in `nudge_console_actions_total` and send the user back to `back`.
struct Act<'a> {
    state: &'a AppState,
    session: Session,
    action: &'static str,
    back: &'static str,
}

impl<'a> Act<'a> {
    async fn begin(
        state: &'a AppState,
        headers: &HeaderMap,
        jar: &SignedCookieJar,
        csrf: &str,
        action: &'static str,
        back: &'static str,
    ) -> Result<Act<'a>, Response> {
        let session = who(state, headers, jar).await?;
        if let Some(refused) = refusal(state, &session, csrf, action) {
            return Err(refused);
        }
        Ok(Act {
            state,
            session,
            action,
            back,
        })
    }

    /// A form this action cannot take: `status` and what to change.
    fn bad(&self, status: StatusCode, message: &str) -> Response {
        self.state
            .error_page(status, Some(&self.session), message, self.back)
    }

    /// A ledger error before the change was tried (a reason or an incident refused).
    fn refused(&self, e: &LedgerError) -> Response {
        self.state.ledger_error(&self.session, e, self.back)
    }

    /// The change's answer: back with `notice`, or its error.
    fn finish(&self, result: Result<String, LedgerError>) -> Response {
        match result {
            Ok(notice) => {
                self.state.inner.metrics.action(self.action, "done");
                done(self.state, self.back, &notice)
            }
            Err(e) => {
                self.state.inner.metrics.action(self.action, "failed");
                self.state.ledger_error(&self.session, &e, self.back)
            }
        }
    }
}

async fn tenant_intake(
    State(state): State<AppState>,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Path(tenant): Path<String>,
    Form(form): Form<ReasonForm>,
) -> Response {
    let act = match Act::begin(
        &state,
        &headers,
        &jar,
        &form.csrf,
        "tenant_intake",
        "/tenants",
    )
    .await
    {
        Ok(act) => act,
        Err(r) => return r,
    };
    let Ok(tenant) = uuid::Uuid::parse_str(&tenant).map(TenantId::from_uuid) else {
        return act.bad(StatusCode::NOT_FOUND, "No such tenant.");
    };
    let Some(paused) = flag(&form.paused) else {
        return act.bad(StatusCode::BAD_REQUEST, "paused must be true or false.");
    };
    let operator = match act
        .session
        .operator(&form.reason, given(&form.incident).as_deref())
    {
        Ok(o) => o,
        Err(e) => return act.refused(&e),
    };
    match state
        .inner
        .ledger
        .set_intake_paused(tenant, paused, &operator)
        .await
    {
        Ok(false) => act.bad(StatusCode::NOT_FOUND, "No such tenant."),
        changed => act.finish(changed.map(|_| {
            let verb = if paused { "paused" } else { "resumed" };
            format!("Intake of tenant {tenant} {verb}.")
        })),
    }
}

async fn drain(
    State(state): State<AppState>,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Path(channel): Path<String>,
    Form(form): Form<ReasonForm>,
) -> Response {
    let act = match Act::begin(&state, &headers, &jar, &form.csrf, "drain", "/").await {
        Ok(act) => act,
        Err(r) => return r,
    };
    let Ok(channel) = channel.parse::<Channel>() else {
        return act.bad(StatusCode::NOT_FOUND, "No such channel.");
    };
    let Some(draining) = flag(&form.draining) else {
        return act.bad(StatusCode::BAD_REQUEST, "draining must be true or false.");
    };
    let operator = match act
        .session
        .operator(&form.reason, given(&form.incident).as_deref())
    {
        Ok(o) => o,
        Err(e) => return act.refused(&e),
    };
    let changed = state
        .inner
        .ledger
        .set_draining(channel, draining, &operator, LedgerTime::Database)
        .await;
    act.finish(changed.map(|change| match (draining, change.changed) {
        (true, true) => format!("{channel} is draining."),
        (true, false) => format!("{channel} was already draining."),
        (false, _) => format!(
            "{channel} is no longer draining; {} withheld deliveries released.",
            change.released
        ),
    }))
}

#[derive(Debug, Deserialize)]
struct RateForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    account: String,
    #[serde(default)]
    channel: String,
    #[serde(default)]
    rate: String,
    #[serde(default)]
    reason: String,
}

impl RateForm {
    fn bucket(&self) -> Option<(ProviderAccount, Channel)> {
        Some((
            ProviderAccount::parse(self.account.trim()).ok()?,
            self.channel.parse().ok()?,
        ))
    }
}

async fn rate_set(
    State(state): State<AppState>,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Form(form): Form<RateForm>,
) -> Response {
    let act = match Act::begin(&state, &headers, &jar, &form.csrf, "rate_set", "/").await {
        Ok(act) => act,
        Err(r) => return r,
    };
    let Some((account, channel)) = form.bucket() else {
        return act.bad(StatusCode::BAD_REQUEST, "No such bucket.");
    };
    let Ok(rate) = form.rate.trim().parse::<f64>() else {
        return act.bad(
            StatusCode::BAD_REQUEST,
            "The rate is a number of sends per second (0 stops sending).",
        );
    };
    let operator = match act.session.operator(&form.reason, None) {
        Ok(o) => o,
        Err(e) => return act.refused(&e),
    };
    let set = state
        .inner
        .ledger
        .set_rate(&account, channel, rate, None, &operator)
        .await;
    act.finish(set.map(|bucket| {
        format!(
            "Rate of {account} on {channel} set to {} per second.",
            bucket.rate_per_second
        )
    }))
}

async fn rate_resume(
    State(state): State<AppState>,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Form(form): Form<RateForm>,
) -> Response {
    let act = match Act::begin(&state, &headers, &jar, &form.csrf, "rate_resume", "/").await {
        Ok(act) => act,
        Err(r) => return r,
    };
    let Some((account, channel)) = form.bucket() else {
        return act.bad(StatusCode::BAD_REQUEST, "No such bucket.");
    };
    let operator = match act.session.operator(&form.reason, None) {
        Ok(o) => o,
        Err(e) => return act.refused(&e),
    };
    match state
        .inner
        .ledger
        .resume_bucket(&account, channel, &operator)
        .await
    {
        Ok(None) => act.bad(StatusCode::NOT_FOUND, "No such bucket."),
        resumed => {
            act.finish(resumed.map(|_| format!("The bucket of {account} on {channel} resumed.")))
        }
    }
}

#[derive(Debug, Default, Deserialize, serde::Serialize)]
struct RedriveForm {
    #[serde(default, skip_serializing)]
    csrf: String,
    #[serde(default)]
    channel: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    max_age_h: String,
    #[serde(default)]
    limit: String,
    #[serde(default)]
    rate: String,
    #[serde(default)]
    canary: String,
    /// What the dry run counted (the execute form carries it): the execute takes at most as
    /// many, and nothing without a dry run that found some.
    #[serde(default, skip_serializing)]
    planned: String,
    #[serde(default, skip_serializing)]
    reason: String,
    #[serde(default, skip_serializing)]
    incident: String,
}

impl RedriveForm {
    fn filter(&self) -> Result<(RedriveFilter, f64), &'static str> {
        let channel = self
            .channel
            .parse::<Channel>()
            .map_err(|_| "No such channel: push, email or sms.")?;
        let tenant = match self.tenant.trim() {
            "" => None,
            t => Some(TenantId::from_uuid(
                uuid::Uuid::parse_str(t).map_err(|_| "The tenant is a tenant id (a uuid).")?,
            )),
        };
        let max_age = match self.max_age_h.trim() {
            "" => None,
            h => Some(Duration::from_secs(
                h.parse::<u64>()
                    .ok()
                    .filter(|h| (1..=24 * 366).contains(h))
                    .ok_or("The age is a whole number of hours, 1 to 8784.")?
                    * 3_600,
            )),
        };
        let limit = match self.limit.trim() {
            "" => None,
            l => Some(
                l.parse::<u32>()
                    .ok()
                    .filter(|l| *l >= 1)
                    .ok_or("The limit is a whole number, at least 1.")?,
            ),
        };
        let rate = self
            .rate
            .trim()
            .parse::<f64>()
            .map_err(|_| "The rate is a number of deliveries per second.")?;
        Ok((
            RedriveFilter {
                channel,
                tenant,
                max_age,
                limit,
            },
            rate,
        ))
    }

    fn canary(&self) -> Result<Option<u32>, &'static str> {
        match self.canary.trim() {
            "" => Ok(None),
            c => c
                .parse::<u32>()
                .ok()
                .filter(|c| *c >= 1)
                .map(Some)
                .ok_or("The canary is a whole number, at least 1."),
        }
    }
}

async fn redrive_plan(
    State(state): State<AppState>,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Form(form): Form<RedriveForm>,
) -> Response {
    let timer = Timer::start("redrive_plan");
    let act = match Act::begin(
        &state,
        &headers,
        &jar,
        &form.csrf,
        "redrive_plan",
        "/redrives",
    )
    .await
    {
        Ok(act) => act,
        Err(r) => return r,
    };
    let (filter, rate) = match form.filter() {
        Ok(f) => f,
        Err(m) => return act.bad(StatusCode::BAD_REQUEST, m),
    };
    let response = match state
        .inner
        .ledger
        .plan_redrive(&filter, rate, LedgerTime::Database)
        .await
    {
        Ok(plan) => {
            state.inner.metrics.action(act.action, "done");
            state.render(
                Page {
                    template: "redrive_plan.html",
                    key: "redrives",
                    title: "Redrive: dry run",
                    session: Some(&act.session),
                    refresh: None,
                    notice: None,
                    here: None,
                },
                json!({ "plan": plan, "form": form }),
                StatusCode::OK,
            )
        }
        Err(e) => state.ledger_error(&act.session, &e, act.back),
    };
    timer.done(&state, response)
}

async fn redrive_execute(
    State(state): State<AppState>,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Form(form): Form<RedriveForm>,
) -> Response {
    let act = match Act::begin(
        &state,
        &headers,
        &jar,
        &form.csrf,
        "redrive_execute",
        "/redrives",
    )
    .await
    {
        Ok(act) => act,
        Err(r) => return r,
    };
    let (filter, rate) = match form.filter() {
        Ok(f) => f,
        Err(m) => return act.bad(StatusCode::BAD_REQUEST, m),
    };
    let canary = match form.canary() {
        Ok(c) => c,
        Err(m) => return act.bad(StatusCode::BAD_REQUEST, m),
    };
    let Some(planned) = form.planned.trim().parse::<u32>().ok().filter(|p| *p >= 1) else {
        return act.bad(
            StatusCode::BAD_REQUEST,
            "A redrive starts from its dry run: run the dry run, check its counts, then execute.",
        );
    };
    // Never more than the dry run showed, though more may have been dead-lettered since.
    let filter = RedriveFilter {
        limit: Some(filter.limit.map_or(planned, |l| l.min(planned))),
        ..filter
    };
    let operator = match act
        .session
        .operator(&form.reason, given(&form.incident).as_deref())
    {
        Ok(o) => o,
        Err(e) => return act.refused(&e),
    };
    let started = state
        .inner
        .ledger
        .execute_redrive(&filter, rate, canary, &operator, LedgerTime::Database)
        .await;
    act.finish(started.map(|started| {
        format!(
            "Redrive {} started: {} deliveries at {} per second.",
            started.id, started.plan.eligible, started.plan.rate_per_second
        )
    }))
}

#[derive(Debug, Deserialize)]
struct RedriveChangeForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    change: String,
    #[serde(default)]
    reason: String,
}

async fn redrive_change(
    State(state): State<AppState>,
    headers: HeaderMap,
    jar: SignedCookieJar,
    Path(id): Path<String>,
    Form(form): Form<RedriveChangeForm>,
) -> Response {
    let act = match Act::begin(
        &state,
        &headers,
        &jar,
        &form.csrf,
        "redrive_change",
        "/redrives",
    )
    .await
    {
        Ok(act) => act,
        Err(r) => return r,
    };
    let Ok(id) = RedriveId::parse(&id) else {
        return act.bad(StatusCode::NOT_FOUND, "No such redrive.");
    };
    let operator = match act.session.operator(&form.reason, None) {
        Ok(o) => o,
        Err(e) => return act.refused(&e),
    };
    let ledger = &state.inner.ledger;
    let at = LedgerTime::Database;
    let (changed, verb) = match form.change.as_str() {
        "pause" => (ledger.pause_redrive(id, &operator, at).await, "paused"),
        "resume" => (ledger.resume_redrive(id, &operator, at).await, "resumed"),
        "cancel" => (ledger.cancel_redrive(id, &operator, at).await, "cancelled"),
        _ => {
            return act.bad(
                StatusCode::BAD_REQUEST,
                "A redrive is paused, resumed or cancelled.",
            );
        }
    };
    act.finish(changed.map(|()| format!("Redrive {id} {verb}.")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nudge_ledger::LedgerSample;

    fn sample(
        minutes_ago: i64,
        channel: Channel,
        age: Option<f64>,
        delivered: u64,
    ) -> LedgerSample {
        let now = chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        LedgerSample {
            at: now - chrono::Duration::minutes(minutes_ago),
            channel,
            oldest_eligible_age_s: age,
            delivered,
            throttled: delivered / 10,
        }
    }

    #[test]
    fn each_channel_is_drawn_from_its_own_samples_across_the_hour() {
        let now = chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let samples = [
            sample(60, Channel::Sms, Some(0.0), 0),
            sample(30, Channel::Sms, Some(90.0), 100),
            sample(0, Channel::Sms, None, 50),
            sample(30, Channel::Email, Some(5.0), 20),
        ];
        let drawn = trends(&samples, now);
        assert_eq!(drawn.len(), 3, "every channel, with or without samples");
        let sms = drawn.iter().find(|t| t.channel == "sms").unwrap();
        assert_eq!(sms.samples, 3);
        assert_eq!(sms.age_max, 90.0);
        assert_eq!((sms.delivered_max, sms.throttled_max), (100, 10));
        assert_eq!(
            (sms.delivered_last, sms.throttled_last),
            (Some(50), Some(5))
        );
        // x runs from 0 (an hour ago) to 120 (now); y from 23 (0) to 1 (the largest).
        assert_eq!(sms.age_points, "0.0,23.0 60.0,1.0 120.0,23.0");
        assert_eq!(sms.delivered_points, "0.0,23.0 60.0,1.0 120.0,12.0");
        let push = drawn.iter().find(|t| t.channel == "push").unwrap();
        assert_eq!((push.samples, push.age_points.as_str()), (0, ""));
        assert_eq!(push.delivered_last, None);
    }
}
