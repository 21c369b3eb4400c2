//! The checks of a request's path and content type, as extractors whose rejection is the
//! API's own error ([`ApiError`]), so a handler states them in its arguments instead of
//! repeating them. Axum runs a handler's extractors in the order of its arguments, which is
//! the order of the checks: the path, then the content type, then the body and its signature
//! ([`crate::auth::SignedTenant`], always last).
//!
//! Must never read the body (only [`crate::auth::SignedTenant`] does, within the body limit
//! and deadline) or quote a value from the request in a rejection.

use axum::extract::{FromRequestParts, Path};
use axum::http::header;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// The route's path parameters, or 400 when one is not valid UTF-8 text once decoded.
#[derive(Debug, Clone)]
pub struct ApiPath<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(p)| Self(p))
            .map_err(|_| ApiError::invalid("path", "a path parameter is not valid UTF-8 text"))
    }
}

/// A request whose body is declared JSON (`Content-Type: application/json`, any parameters),
/// or 415.
#[derive(Debug, Clone, Copy)]
pub struct JsonContent;

impl<S> FromRequestParts<S> for JsonContent
where
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let json = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
        if json {
            Ok(Self)
        } else {
            Err(ApiError::UnsupportedMediaType)
        }
    }
}
