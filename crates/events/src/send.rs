//! One signed POST of a batch of events to a tenant's endpoint (decision 0602).
//!
//! The request follows the Standard Webhooks specification, so a client verifies it with the
//! published libraries: `webhook-id` (the batch's id, the same on every retry of the batch),
//! `webhook-timestamp` (this attempt's time, seconds) and `webhook-signature` (`v1,<base64>`
//! per secret that signs now, space-separated: two during a rotation's overlap). The body is
//! `{"type": "delivery.events", "timestamp": ..., "data": {"events": [...], ...}}`.
//!
//! What the endpoint answers decides the batch: a 2xx acknowledges it; anything else fails it
//! ([`SendFailure`], with the endpoint's `Retry-After` on a 429 or 503). Redirects are not
//! followed (a 3xx fails, named); the response's body is never kept and at most
//! `events.response_body_max_bytes` of it is read.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use chrono::{DateTime, Utc};
use nudge_domain::retry_after::RetryAfter;
use nudge_ledger::WebhookSecret;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER, USER_AGENT};

use crate::guard::{AddressGuard, AddressRefused, GuardedResolver};

/// The `User-Agent` of every push.
const AGENT: &str = concat!("nudge-events/", env!("CARGO_PKG_VERSION"));

/// How the client is built.
#[derive(Debug, Clone)]
pub struct SenderSettings {
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    pub response_body_max_bytes: usize,
    pub allow_http: bool,
}

/// Why a batch failed: a class for metrics and logs, a short detail (never the response's
/// body) and the endpoint's `Retry-After`, when it sent one with a 429 or 503.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendFailure {
    pub class: FailureClass,
    pub detail: String,
    pub retry_after: Option<Duration>,
}

impl std::fmt::Display for SendFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.class.as_str(), self.detail)
    }
}

/// The kinds of failure, as labelled in `nudge_events_push_failures_total{class}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureClass {
    /// The endpoint's address is in a refused range (decided before connecting).
    AddressRefused,
    /// The URL is no longer one the process may call (plain http where not allowed).
    UrlRefused,
    /// The endpoint answered a redirect, which is not followed.
    RedirectRefused,
    /// No connection (refused, unreachable, DNS, TLS).
    Connect,
    /// No complete answer within `events.request_timeout_ms`.
    Timeout,
    /// 429.
    Throttled,
    /// Another 4xx.
    Rejected,
    /// 5xx.
    ServerError,
    /// 410 Gone: the endpoint says it is not coming back; the webhook is disabled at once.
    Gone,
    /// A signing secret cannot be opened (a key this process lacks, or a corrupt row).
    Secret,
    /// Any other answer or transport error.
    Other,
}

impl FailureClass {
    pub const ALL: [FailureClass; 11] = [
        Self::AddressRefused,
        Self::UrlRefused,
        Self::RedirectRefused,
        Self::Connect,
        Self::Timeout,
        Self::Throttled,
        Self::Rejected,
        Self::ServerError,
        Self::Gone,
        Self::Secret,
        Self::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::AddressRefused => "address_refused",
            Self::UrlRefused => "url_refused",
            Self::RedirectRefused => "redirect_refused",
            Self::Connect => "connect",
            Self::Timeout => "timeout",
            Self::Throttled => "throttled",
            Self::Rejected => "rejected",
            Self::ServerError => "server_error",
            Self::Gone => "gone",
            Self::Secret => "secret",
            Self::Other => "other",
        }
    }
}

fn failure(class: FailureClass, detail: impl Into<String>) -> SendFailure {
    SendFailure {
        class,
        detail: detail.into(),
        retry_after: None,
    }
}

/// One batch, as it is signed and sent.
#[derive(Debug, Clone)]
pub struct Batch {
    /// `webhook-id`: the same for every attempt at the same batch.
    pub id: String,
    /// The body, exactly as signed.
    pub body: Vec<u8>,
}

/// The batch of `events` (wire form, positions `after` < p <= `through`) of `tenant_id`: its id
/// and body. The body is the same for every attempt (its `timestamp` is the newest event's),
/// so a retry is byte for byte the batch that failed.
pub fn batch(
    tenant_id: uuid::Uuid,
    after: i64,
    through: i64,
    newest: DateTime<Utc>,
    events: Vec<serde_json::Value>,
) -> Result<Batch, String> {
    let body = serde_json::json!({
        "type": "delivery.events",
        "timestamp": newest,
        "data": {
            "tenant_id": tenant_id,
            "after": after,
            "through": through,
            "events": events,
        },
    });
    Ok(Batch {
        id: format!("nudge_{}_{after}_{through}", tenant_id.simple()),
        body: serde_json::to_vec(&body)
            .map_err(|e| format!("the batch does not serialise: {e}"))?,
    })
}

/// The `webhook-signature` value for `batch` at `timestamp` (seconds): one `v1,<base64>` per
/// secret, space-separated.
pub fn signature(
    batch: &Batch,
    timestamp: i64,
    secrets: &[WebhookSecret],
) -> Result<String, String> {
    let mut signatures = Vec::with_capacity(secrets.len());
    for secret in secrets {
        let webhook = standardwebhooks::Webhook::new(secret.expose())
            .map_err(|_| "a stored webhook secret is not a Standard Webhooks secret".to_owned())?;
        let signed = webhook
            .sign(&batch.id, timestamp, &batch.body)
            .map_err(|e| format!("signing failed: {e}"))?;
        signatures.push(signed);
    }
    if signatures.is_empty() {
        return Err("the webhook has no secret that signs now".to_owned());
    }
    Ok(signatures.join(" "))
}

/// The HTTP client of the push, behind the address guard.
#[derive(Debug, Clone)]
pub struct Sender {
    client: reqwest::Client,
    guard: Arc<AddressGuard>,
    settings: SenderSettings,
}

impl Sender {
    pub fn new(guard: AddressGuard, settings: SenderSettings) -> anyhow::Result<Self> {
        let guard = Arc::new(guard);
        let client = reqwest::Client::builder()
            .dns_resolver(Arc::new(GuardedResolver::new(guard.clone())))
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(settings.connect_timeout)
            .timeout(settings.request_timeout)
            .no_proxy()
            .build()?;
        Ok(Self {
            client,
            guard,
            settings,
        })
    }

    /// POSTs `batch` to `url`, signed with `secrets`. `Ok` on a 2xx.
    pub async fn send(
        &self,
        url: &str,
        batch: &Batch,
        secrets: &[WebhookSecret],
    ) -> Result<StatusCode, SendFailure> {
        let parsed = url::Url::parse(url)
            .map_err(|_| failure(FailureClass::UrlRefused, "the URL does not parse"))?;
        match parsed.scheme() {
            "https" => {}
            "http" if self.settings.allow_http => {}
            other => {
                return Err(failure(
                    FailureClass::UrlRefused,
                    format!("scheme {other} refused (https only unless events.allow_http)"),
                ));
            }
        }
        // A literal address is not resolved: the guard sees it here.
        let literal = match parsed.host() {
            Some(url::Host::Ipv4(a)) => Some(std::net::IpAddr::V4(a)),
            Some(url::Host::Ipv6(a)) => Some(std::net::IpAddr::V6(a)),
            Some(url::Host::Domain(_)) => None,
            None => return Err(failure(FailureClass::UrlRefused, "the URL names no host")),
        };
        if let Some(address) = literal {
            self.guard
                .check(address)
                .map_err(|e| failure(FailureClass::AddressRefused, e.to_string()))?;
        }
        let timestamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let signature =
            signature(batch, timestamp, secrets).map_err(|e| failure(FailureClass::Other, e))?;
        let response = self
            .client
            .post(parsed)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(USER_AGENT, HeaderValue::from_static(AGENT))
            .header(standardwebhooks::HEADER_WEBHOOK_ID, &batch.id)
            .header(
                standardwebhooks::HEADER_WEBHOOK_TIMESTAMP,
                timestamp.to_string(),
            )
            .header(standardwebhooks::HEADER_WEBHOOK_SIGNATURE, signature)
            .body(batch.body.clone())
            .send()
            .await
            .map_err(transport_failure)?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| RetryAfter::parse(v).ok())
            .map(|r| {
                let now = Utc::now();
                (r.resolve(now) - now).to_std().unwrap_or_default()
            });
        self.drain(response).await;
        if status.is_success() {
            return Ok(status);
        }
        let code = status.as_u16();
        Err(if status.is_redirection() {
            // The location is not repeated: it is the endpoint's to say, and may carry a token.
            failure(
                FailureClass::RedirectRefused,
                format!("answered {code}, a redirect (not followed)"),
            )
        } else if status == StatusCode::TOO_MANY_REQUESTS {
            SendFailure {
                class: FailureClass::Throttled,
                detail: format!("answered {code}"),
                retry_after,
            }
        } else if status.is_server_error() {
            SendFailure {
                class: FailureClass::ServerError,
                detail: format!("answered {code}"),
                retry_after: (status == StatusCode::SERVICE_UNAVAILABLE)
                    .then_some(retry_after)
                    .flatten(),
            }
        } else if status == StatusCode::GONE {
            failure(FailureClass::Gone, format!("answered {code}"))
        } else if status.is_client_error() {
            failure(FailureClass::Rejected, format!("answered {code}"))
        } else {
            failure(FailureClass::Other, format!("answered {code}"))
        })
    }

    /// Reads at most `response_body_max_bytes` of the body and drops it.
    async fn drain(&self, mut response: reqwest::Response) {
        let mut read = 0usize;
        while read < self.settings.response_body_max_bytes {
            match response.chunk().await {
                Ok(Some(chunk)) => read += chunk.len(),
                Ok(None) | Err(_) => break,
            }
        }
    }
}

/// The class of a transport error; a refusal by the guard (inside the resolver's error) is
/// named as such.
fn transport_failure(e: reqwest::Error) -> SendFailure {
    // Never the URL in what is kept or logged: its query may carry the endpoint's token.
    let e = e.without_url();
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(cause) = source {
        if let Some(refused) = cause.downcast_ref::<AddressRefused>() {
            return failure(FailureClass::AddressRefused, refused.to_string());
        }
        source = cause.source();
    }
    if e.is_timeout() {
        failure(FailureClass::Timeout, "no complete answer in time")
    } else if e.is_connect() {
        failure(
            FailureClass::Connect,
            format!("no connection: {}", nudge_telemetry::error_chain(&e)),
        )
    } else {
        failure(
            FailureClass::Other,
            format!("transport: {}", nudge_telemetry::error_chain(&e)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_the_same_bytes_and_id_every_time() {
        let tenant = uuid::Uuid::from_u128(7);
        let at = DateTime::<Utc>::from_timestamp(1_700_000_000, 0).unwrap_or_default();
        let events = vec![
            serde_json::json!({"position": 4}),
            serde_json::json!({"position": 9}),
        ];
        let one = batch(tenant, 3, 9, at, events.clone()).unwrap();
        let two = batch(tenant, 3, 9, at, events).unwrap();
        assert_eq!(one.id, two.id);
        assert_eq!(one.body, two.body);
        assert_eq!(one.id, format!("nudge_{}_3_9", tenant.simple()));
        let body: serde_json::Value = serde_json::from_slice(&one.body).unwrap_or_default();
        assert_eq!(body["type"], "delivery.events");
        assert_eq!(body["data"]["through"], 9);
        assert_eq!(body["data"]["events"][1]["position"], 9);
    }

    #[test]
    fn the_signature_verifies_with_each_secret_and_not_with_another() {
        let secrets = [WebhookSecret::generate(), WebhookSecret::generate()];
        let at = DateTime::<Utc>::from_timestamp(1_700_000_000, 0).unwrap_or_default();
        let one = batch(uuid::Uuid::from_u128(1), 0, 1, at, vec![]).unwrap();
        let now = Utc::now().timestamp();
        let header = signature(&one, now, &secrets).unwrap_or_default();
        assert_eq!(header.split(' ').count(), 2);
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(standardwebhooks::HEADER_WEBHOOK_ID, one.id.parse().unwrap());
        headers.insert(
            standardwebhooks::HEADER_WEBHOOK_TIMESTAMP,
            now.to_string().parse().unwrap(),
        );
        headers.insert(
            standardwebhooks::HEADER_WEBHOOK_SIGNATURE,
            header.parse().unwrap(),
        );
        for secret in &secrets {
            let webhook = standardwebhooks::Webhook::new(secret.expose()).unwrap();
            webhook.verify(&one.body, &headers).unwrap();
        }
        let other = standardwebhooks::Webhook::new(WebhookSecret::generate().expose()).unwrap();
        assert!(other.verify(&one.body, &headers).is_err());
        assert!(signature(&one, now, &[]).is_err());
    }
}

#[cfg(test)]
mod guard_tests {
    use super::*;

    /// Every spelling of a loopback or private address that `url` reads as an IP literal is
    /// refused before any connection (nothing listens on these ports in the test).
    #[tokio::test]
    async fn literal_addresses_in_any_spelling_are_refused_before_connecting() {
        let sender = Sender::new(
            AddressGuard::default(),
            SenderSettings {
                connect_timeout: Duration::from_millis(200),
                request_timeout: Duration::from_millis(500),
                response_body_max_bytes: 0,
                allow_http: true,
            },
        )
        .unwrap();
        let at = DateTime::<Utc>::from_timestamp(1_700_000_000, 0).unwrap_or_default();
        let one = batch(uuid::Uuid::from_u128(1), 0, 1, at, vec![]).unwrap();
        let secrets = [WebhookSecret::generate()];
        for url in [
            "http://2130706433:9/",
            "http://0x7f.1:9/",
            "http://127.1:9/",
            "http://0177.0.0.1:9/",
            "http://[::ffff:127.0.0.1]:9/",
            "http://[::1]:9/",
            "http://10.0.0.1:9/",
            "http://169.254.169.254/latest/meta-data",
            "http://[fd00::1]:9/",
        ] {
            let refused = sender.send(url, &one, &secrets).await.unwrap_err();
            assert_eq!(
                refused.class,
                FailureClass::AddressRefused,
                "{url}: {refused}"
            );
        }
        let plain = Sender::new(
            AddressGuard::default(),
            SenderSettings {
                connect_timeout: Duration::from_millis(200),
                request_timeout: Duration::from_millis(500),
                response_body_max_bytes: 0,
                allow_http: false,
            },
        )
        .unwrap();
        let refused = plain
            .send("http://example.com/", &one, &secrets)
            .await
            .unwrap_err();
        assert_eq!(refused.class, FailureClass::UrlRefused);
    }
}
