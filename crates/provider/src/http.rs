//! The HTTP adapter: `POST {base_url}/v1/messages`.

use nudge_domain::{IdempotencySupport, ProviderAccount, SendOutcome};
use nudge_telemetry::error_chain;
use reqwest::header::{self, HeaderMap, HeaderName, HeaderValue};
use serde::Serialize;
use url::Url;

use crate::reason;
use crate::transport::{self, failed_before_send};
use crate::{HttpProviderConfig, Provider, ProviderError, SendRequest};

/// What a `Retry-After` header that is not valid UTF-8 is reported as; it parses as malformed.
pub const NON_UTF8_RETRY_AFTER: &str = "<non-utf8>";

/// How much of a 2xx body is read looking for the message id; a provider's answer is tiny.
const MAX_BODY_BYTES: usize = 64 * 1024;
/// A longer "id" is not stored: it is not what we asked for, and it goes into the ledger.
const MAX_MESSAGE_ID_LEN: usize = 256;

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const CORRELATION_ID: HeaderName = HeaderName::from_static("x-correlation-id");
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// A provider account reached over HTTP with one pooled client.
///
/// The client goes direct (system proxies are ignored: a proxy would answer for the provider and
/// hide whether our request ever left) and never follows redirects.
pub struct HttpProvider {
    account: ProviderAccount,
    idempotency: IdempotencySupport,
    endpoint: Url,
    auth: Option<HeaderValue>,
    client: reqwest::Client,
    /// The longest one request runs (`timeout_ms`).
    timeout: std::time::Duration,
}

impl std::fmt::Debug for HttpProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpProvider")
            .field("account", &self.account)
            .field("idempotency", &self.idempotency)
            .field("endpoint", &self.endpoint.as_str())
            .field("auth", &self.auth.as_ref().map(|_| "[redacted]"))
            .finish_non_exhaustive()
    }
}

#[derive(Serialize)]
struct MessageBody<'a> {
    channel: nudge_domain::Channel,
    to: &'a str,
    content: Option<&'a serde_json::Value>,
}

impl HttpProvider {
    /// Validates `cfg` (errors name keys relative to the provider section) and builds the client.
    pub fn new(cfg: &HttpProviderConfig) -> Result<Self, ProviderError> {
        cfg.validate("")?;
        let account = cfg
            .parsed_account()
            .map_err(|e| nudge_config::ConfigError::invalid("account", e.to_string()))?;
        let endpoint = cfg
            .endpoint()
            .map_err(|m| nudge_config::ConfigError::invalid("base_url", m))?;
        let client = transport::client(cfg, &account)?;
        Ok(Self {
            account,
            idempotency: cfg.idempotency(),
            endpoint,
            auth: cfg.auth_header(),
            client,
            timeout: std::time::Duration::from_millis(cfg.timeout_ms),
        })
    }

    /// Where messages are posted: `{base_url}/v1/messages`.
    pub fn endpoint(&self) -> &Url {
        &self.endpoint
    }

    fn headers(&self, req: &SendRequest<'_>) -> Result<HeaderMap, &'static str> {
        let mut headers = HeaderMap::new();
        // Always sent, whether or not the provider honours it: it costs nothing, and a provider
        // that starts honouring it silently becomes safe to retry against.
        let key = HeaderValue::from_str(req.idempotency_key.as_str())
            .map_err(|_| reason::REQUEST_BUILD_ERROR)?;
        headers.insert(IDEMPOTENCY_KEY, key);
        if let Some(auth) = &self.auth {
            headers.insert(header::AUTHORIZATION, auth.clone());
        }
        match HeaderValue::from_str(req.correlation_id) {
            Ok(v) => {
                headers.insert(CORRELATION_ID, v);
            }
            // Losing a trace link is better than not sending a reminder.
            Err(_) => tracing::debug!(
                provider_account = %self.account,
                "correlation id is not a valid header value; sending without it"
            ),
        }
        if let Some(v) = req.traceparent.and_then(|t| HeaderValue::from_str(t).ok()) {
            headers.insert(TRACEPARENT, v);
        }
        headers.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        Ok(headers)
    }

    async fn send_once(&self, req: SendRequest<'_>) -> SendOutcome {
        let headers = match self.headers(&req) {
            Ok(h) => h,
            Err(reason) => return failed_before_send(reason),
        };
        let body = MessageBody {
            channel: req.channel,
            to: req.destination,
            content: req.content,
        };
        if let Err(outcome) = req.open(self.timeout) {
            return outcome;
        }
        let response = self
            .client
            .post(self.endpoint.clone())
            .headers(headers)
            .json(&body)
            .send()
            .await;
        let response = match response {
            Ok(r) => r,
            Err(e) => return self.outcome_of_error(e),
        };

        let status = response.status();
        if let Some(outcome) = transport::out_of_range(status.as_u16()) {
            return outcome;
        }
        let retry_after = response.headers().get(header::RETRY_AFTER).map(|v| {
            match std::str::from_utf8(v.as_bytes()) {
                Ok(s) => s.to_owned(),
                Err(_) => NON_UTF8_RETRY_AFTER.to_owned(),
            }
        });
        let provider_message_id = if status.is_success() {
            self.message_id(response).await
        } else {
            // The body of a refusal is not needed; dropping the response closes or frees the
            // connection without waiting for it.
            None
        };
        SendOutcome::Response {
            status: status.as_u16(),
            retry_after,
            provider_message_id,
        }
    }

    /// The `"id"` of a 2xx JSON body. The status already says the provider took the message, so
    /// a body that cannot be read or parsed loses only the id, not the outcome.
    async fn message_id(&self, mut response: reqwest::Response) -> Option<String> {
        let mut body = Vec::new();
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    if body.len() + chunk.len() > MAX_BODY_BYTES {
                        tracing::warn!(
                            provider_account = %self.account,
                            max_body_bytes = MAX_BODY_BYTES,
                            "provider answered 2xx with an oversized body; message id not recorded"
                        );
                        return None;
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(
                        provider_account = %self.account,
                        reason = reason::BODY_ERROR,
                        error.cause_chain = %error_chain(&e.without_url()),
                        "provider answered 2xx but its body could not be read; message id not recorded"
                    );
                    return None;
                }
            }
        }
        let value: serde_json::Value = serde_json::from_slice(&body).ok()?;
        match value.get("id")? {
            serde_json::Value::String(s) if !s.is_empty() && s.len() <= MAX_MESSAGE_ID_LEN => {
                Some(s.clone())
            }
            serde_json::Value::Number(n) => Some(n.to_string()),
            _ => {
                tracing::warn!(
                    provider_account = %self.account,
                    "provider answered 2xx with an unusable id; message id not recorded"
                );
                None
            }
        }
    }

    fn outcome_of_error(&self, e: reqwest::Error) -> SendOutcome {
        transport::logged_outcome_of_error(&self.account, e)
    }
}

impl Provider for HttpProvider {
    fn account(&self) -> &ProviderAccount {
        &self.account
    }

    fn idempotency(&self) -> IdempotencySupport {
        self.idempotency
    }

    fn endpoint(&self) -> &Url {
        &self.endpoint
    }

    fn send<'a>(
        &'a self,
        req: SendRequest<'a>,
    ) -> impl std::future::Future<Output = SendOutcome> + Send + 'a {
        self.send_once(req)
    }
}
