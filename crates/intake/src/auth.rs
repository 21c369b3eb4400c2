//! Authentication of the `/v1` API: a request is its tenant's when it carries a fresh
//! signature ([`crate::signature`]) of its method, target and body under one of the tenant's
//! secrets. Handlers take a [`SignedTenant`], an extractor that reads the tenant's name from
//! the path, the body whole (413 over the limit, 408 late) and the signature header together,
//! and hands them the verified tenant and the body; its rejection is the API's own error
//! (401 with the reason code, counted in `nudge_intake_refusals_total`).
//!
//! A single reminder's post may take the secrets from the intake's cache of tenants
//! ([`Secrets::Cached`], `SignedTenant<FromCache>`) because its committer verifies it again
//! against the tenant read just before the import; every other request reads its tenant from
//! the ledger.
//!
//! Must never: tell apart, in an answer or in the work done, a tenant that does not exist
//! from a signature that does not match (both are `bad_signature`; only the refusal metric
//! says `unknown_tenant`); parse a body before its signature is verified; write anything.

use std::marker::PhantomData;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, OriginalUri, Request};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use nudge_ledger::IntakeTenant;

use crate::error::ApiError;
use crate::extract::ApiPath;
use crate::signature::{self, HEADER, Refusal, SignatureHeader, Signed};
use crate::state::AppState;

/// The request as signed: its method, its target (path and query as sent) and its body.
#[derive(Debug, Clone, Copy)]
pub struct SignedRequest<'a> {
    pub method: &'a Method,
    pub uri: &'a Uri,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
}

impl SignedRequest<'_> {
    /// What the signature covers.
    pub fn signed(&self) -> Signed<'_> {
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
        state.limits().timestamp_tolerance_s,
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
        if signature::verify(&signature, cached.as_ref(), &signed)
            && let Some(tenant) = cached
        {
            return Ok(Authenticated { tenant, signature });
        }
    }
    let found = if valid_name {
        state
            .ledger()
            .intake_tenant(tenant, state.cipher())
            .await
            .map_err(ApiError::internal)?
    } else {
        None
    };
    state.remember_tenant(tenant, found.as_ref());
    let matched = signature::verify(&signature, found.as_ref(), &signed);
    match found {
        Some(tenant) if matched => Ok(Authenticated { tenant, signature }),
        Some(t) if !t.secrets.is_empty() => Err(refuse(Refusal::BadSignature)),
        _ => Err(refuse(Refusal::UnknownTenant)),
    }
}

/// Where a [`SignedTenant`] takes its tenant's secrets from: [`FromLedger`] or [`FromCache`].
pub trait SecretsFrom: Send + Sync + 'static {
    const SECRETS: Secrets;
}

/// [`Secrets::Ledger`]: the tenant as the ledger has it now.
#[derive(Debug, Clone, Copy)]
pub enum FromLedger {}

impl SecretsFrom for FromLedger {
    const SECRETS: Secrets = Secrets::Ledger;
}

/// [`Secrets::Cached`]: only for a post whose committer verifies it again.
#[derive(Debug, Clone, Copy)]
pub enum FromCache {}

impl SecretsFrom for FromCache {
    const SECRETS: Secrets = Secrets::Cached;
}

/// A request of the `/v1` API verified as its tenant's: the tenant (from the path parameter
/// `tenant`, its secrets from `S`), the signature and the raw body it covers.
///
/// Extracted in this order, each failure answered by the API's error: the path (400), the
/// body read whole (413 over `intake.body_limit_bytes`, 408 when it did not arrive in time),
/// then [`authenticate`] (401). It reads the body, so it is a handler's last argument.
#[derive(Debug, Clone)]
pub struct SignedTenant<S = FromLedger> {
    /// The tenant as read (see [`Secrets`]).
    pub tenant: IntakeTenant,
    pub signature: SignatureHeader,
    /// The tenant's name as the path gives it.
    pub name: String,
    /// The raw body, as signed.
    pub body: Bytes,
    pub headers: HeaderMap,
    method: Method,
    uri: Uri,
    from: PhantomData<fn() -> S>,
}

impl<S> SignedTenant<S> {
    /// The request as signed.
    pub fn request(&self) -> SignedRequest<'_> {
        SignedRequest {
            method: &self.method,
            uri: &self.uri,
            headers: &self.headers,
            body: &self.body,
        }
    }

    /// The tenant as the ledger has it now, the request authenticated again against it (for a
    /// request authenticated from the cache that turns out to act at once).
    pub async fn from_ledger(&self, state: &AppState) -> Result<IntakeTenant, ApiError> {
        Ok(
            authenticate(state, &self.name, self.request(), Secrets::Ledger)
                .await?
                .tenant,
        )
    }
}

impl<S: SecretsFrom> FromRequest<AppState> for SignedTenant<S> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let (mut parts, body) = request.into_parts();
        let ApiPath(params) =
            ApiPath::<Vec<(String, String)>>::from_request_parts(&mut parts, state).await?;
        let name = params
            .into_iter()
            .find_map(|(key, value)| (key == "tenant").then_some(value))
            .ok_or_else(|| {
                ApiError::internal(anyhow::anyhow!("the route has no tenant parameter"))
            })?;
        let Ok(OriginalUri(uri)) = OriginalUri::from_request_parts(&mut parts, state).await;
        let method = parts.method.clone();
        let headers = parts.headers.clone();
        let body = Bytes::from_request(Request::from_parts(parts, body), state)
            .await
            .map_err(|rejection| {
                if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::TooLarge
                } else {
                    ApiError::Timeout
                }
            })?;
        let request = SignedRequest {
            method: &method,
            uri: &uri,
            headers: &headers,
            body: &body,
        };
        let Authenticated { tenant, signature } =
            authenticate(state, &name, request, S::SECRETS).await?;
        Ok(Self {
            tenant,
            signature,
            name,
            body,
            headers,
            method,
            uri,
            from: PhantomData,
        })
    }
}
