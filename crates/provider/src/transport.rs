//! What every HTTP adapter shares: the client (direct, no redirects, the account's timeouts),
//! the mapping of transport failures onto "never left" and "may have been sent", reading a
//! bounded body.

use std::time::Duration;

use nudge_domain::{ProviderAccount, SendOutcome};
use nudge_telemetry::error_chain;

use crate::reason;
use crate::{HttpProviderConfig, ProviderError};

/// The most of an answer's body any adapter reads: a provider's answer is tiny.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// A client for one account: the account's timeouts, system proxies ignored (a proxy would
/// answer for the provider and hide whether our request ever left), redirects never followed
/// (one could send twice).
pub fn client(
    cfg: &HttpProviderConfig,
    account: &ProviderAccount,
) -> Result<reqwest::Client, ProviderError> {
    client_builder(cfg)
        .build()
        .map_err(|source| ProviderError::Client {
            account: account.clone(),
            source,
        })
}

/// The settings of [`client`], for an adapter that adds its own (APNs: HTTP/2 only, its trust
/// anchors).
pub fn client_builder(cfg: &HttpProviderConfig) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(cfg.timeout_ms))
        .connect_timeout(Duration::from_millis(cfg.connect_timeout_ms))
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
}

/// [`outcome_of_error`], with the detail behind the reason code logged at debug (the caller
/// records and logs the outcome once). `without_url` because reqwest's message names the URL.
pub fn logged_outcome_of_error(account: &ProviderAccount, e: reqwest::Error) -> SendOutcome {
    let outcome = outcome_of_error(&e);
    tracing::debug!(
        provider_account = %account,
        outcome = ?outcome,
        error.cause_chain = %error_chain(&e.without_url()),
        "provider request failed"
    );
    outcome
}

/// Reads at most `max` bytes of a body. `None` when it is longer or breaks off: the caller
/// keeps what the status said and loses only what the body would have added.
pub async fn read_body(mut response: reqwest::Response, max: usize) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > max {
                    return None;
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Some(body),
            Err(_) => return None,
        }
    }
}

/// A header's value as text, when it is valid UTF-8 and at most `max` bytes long.
pub fn header_text(headers: &reqwest::header::HeaderMap, name: &str, max: usize) -> Option<String> {
    let value = headers.get(name)?;
    let text = std::str::from_utf8(value.as_bytes()).ok()?;
    (text.len() <= max).then(|| text.trim().to_owned())
}

/// The reqwest error kinds, mapped onto whether the request can have left.
///
/// `is_connect` covers refused, DNS, TLS and connect timeouts: the request was never written.
/// A timeout that is not a connect timeout fired after the connection was up, so the request may
/// have been written and acted on; the same goes for a connection that broke before the answer.
pub fn outcome_of_error(e: &reqwest::Error) -> SendOutcome {
    if e.is_connect() {
        failed_before_send(if e.is_timeout() {
            reason::CONNECT_TIMEOUT
        } else {
            reason::CONNECT_ERROR
        })
    } else if e.is_builder() {
        failed_before_send(reason::REQUEST_BUILD_ERROR)
    } else if e.is_timeout() {
        unknown_after_send(reason::TIMEOUT_AFTER_SEND)
    } else if e.is_body() {
        unknown_after_send(reason::BODY_ERROR)
    } else {
        unknown_after_send(reason::RESET_AFTER_SEND)
    }
}

/// The outcome of an answer whose status is not an HTTP status (outside 100-599: the `http`
/// crate accepts up to 999, the attempt history does not): unknown after send, like a
/// malformed answer, so an account that dedupes by key retries it and one that does not holds
/// it ambiguous, as for a 5xx. `None` for a status in range.
pub fn out_of_range(status: u16) -> Option<SendOutcome> {
    (!(100..=599).contains(&status)).then(|| unknown_after_send(reason::STATUS_OUT_OF_RANGE))
}

pub fn failed_before_send(reason: &str) -> SendOutcome {
    SendOutcome::FailedBeforeSend {
        reason: reason.to_owned(),
    }
}

pub fn unknown_after_send(reason: &str) -> SendOutcome {
    SendOutcome::UnknownAfterSend {
        reason: reason.to_owned(),
    }
}
