//! Delivery receipts from providers: Twilio status callbacks and SendGrid event webhooks,
//! verified as each provider signs them, recorded against their delivery in the ledger
//! (`Ledger::record_receipts`: replays change nothing, an ambiguous delivery is settled by what
//! the receipt shows, bounces and opt-outs flag the contact).
//!
//! This module owns the `[receipts]` section, the verifiers built from it ([`Receipts`]) and
//! what a provider's status means; the routes are in [`crate::handlers::receipts`]. They are
//! outside `/v1`: signed by the provider, not by a tenant, so the tenant scheme
//! (`Nudge-Signature`) does not apply. A request for an account not configured here is refused
//! exactly as a bad signature is (403), a request without its signature header is 401, and a
//! refused request writes nothing. Receipts carry PHI (Twilio's `To`, SendGrid's `email`):
//! only statuses, codes, ids and the delivery key are read; nothing else is kept or logged.
//! This module must never import the intake's state or handlers (they import it).
//!
//! # Keys (`[receipts]`)
//!
//! | key | default | rule |
//! |-----|---------|------|
//! | `receipts.public_base_url` | unset | `http(s)://host[:port]` the providers call the intake at (Twilio signs the full URL it called); required when `receipts.twilio` has an entry |
//! | `receipts.twilio` | `[]` | accounts whose callbacks are taken at `POST /receipts/twilio/{account}`: `{ account, auth_token (secret) }` |
//! | `receipts.sendgrid` | `[]` | accounts whose event batches are taken at `POST /receipts/sendgrid/{account}`: `{ account, verification_key }`, the key as SendGrid shows it (base64 DER SubjectPublicKeyInfo, P-256) |
//! | `receipts.generic` | `[]` | generic accounts whose patients' replies are taken at `POST /inbound/generic/{account}`: `{ account, secret (secret) }`, the Standard Webhooks secret the provider signs with (`whsec_` and base64) |

use std::collections::HashMap;

use base64::Engine as _;
use nudge_config::{ConfigError, Secret};
use nudge_domain::{ContactFlag, ProviderAccount};
use nudge_ledger::ReceiptOutcome;
use serde::{Deserialize, Serialize};

/// The `[receipts]` section.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReceiptsSection {
    pub public_base_url: Option<String>,
    pub twilio: Vec<TwilioReceipts>,
    pub sendgrid: Vec<SendgridReceipts>,
    pub generic: Vec<GenericReceipts>,
}

/// A generic account whose patients' replies are taken, signed by Standard Webhooks.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenericReceipts {
    pub account: String,
    pub secret: Secret,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TwilioReceipts {
    pub account: String,
    pub auth_token: Secret,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendgridReceipts {
    pub account: String,
    pub verification_key: String,
}

/// The verifiers built from `[receipts]`.
#[derive(Default)]
pub struct Receipts {
    public_base: Option<url::Url>,
    twilio: HashMap<String, Secret>,
    sendgrid: HashMap<String, p256::ecdsa::VerifyingKey>,
    generic: HashMap<String, standardwebhooks::Webhook>,
}

impl std::fmt::Debug for Receipts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receipts")
            .field("twilio", &self.twilio.keys().collect::<Vec<_>>())
            .field("sendgrid", &self.sendgrid.keys().collect::<Vec<_>>())
            .field("generic", &self.generic.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Receipts {
    /// Where the providers call the intake (`receipts.public_base_url`).
    pub(crate) fn public_base(&self) -> Option<&url::Url> {
        self.public_base.as_ref()
    }

    /// The auth token of the Twilio account `account`, if it takes receipts.
    pub(crate) fn twilio_token(&self, account: &str) -> Option<&Secret> {
        self.twilio.get(account)
    }

    /// The verification key of the SendGrid account `account`, if it takes receipts.
    pub(crate) fn sendgrid_key(&self, account: &str) -> Option<&p256::ecdsa::VerifyingKey> {
        self.sendgrid.get(account)
    }

    /// The Standard Webhooks verifier of the generic account `account`, if it takes replies.
    pub(crate) fn generic_verifier(&self, account: &str) -> Option<&standardwebhooks::Webhook> {
        self.generic.get(account)
    }
}

impl ReceiptsSection {
    /// Checks every rule and builds the verifiers; errors name the key, never a value.
    pub fn build(&self) -> Result<Receipts, ConfigError> {
        let public_base = self
            .public_base_url
            .as_deref()
            .map(|raw| {
                let url = url::Url::parse(raw).map_err(|e| {
                    ConfigError::invalid("receipts.public_base_url", format!("not a URL ({e})"))
                })?;
                if !matches!(url.scheme(), "http" | "https")
                    || url.host().is_none()
                    || url.query().is_some()
                    || url.fragment().is_some()
                {
                    return Err(ConfigError::invalid(
                        "receipts.public_base_url",
                        "expected http(s)://host[:port][/path] without query or fragment",
                    ));
                }
                Ok(url)
            })
            .transpose()?;
        if !self.twilio.is_empty() && public_base.is_none() {
            return Err(ConfigError::invalid(
                "receipts.public_base_url",
                "required to verify Twilio callbacks (Twilio signs the URL it called)",
            ));
        }
        let mut twilio = HashMap::new();
        for (i, t) in self.twilio.iter().enumerate() {
            ProviderAccount::parse(&t.account).map_err(|e| {
                ConfigError::invalid(format!("receipts.twilio.{i}.account"), e.to_string())
            })?;
            if t.auth_token.expose().is_empty() {
                return Err(ConfigError::invalid(
                    format!("receipts.twilio.{i}.auth_token"),
                    "must not be empty",
                ));
            }
            twilio.insert(t.account.clone(), t.auth_token.clone());
        }
        let mut sendgrid = HashMap::new();
        for (i, s) in self.sendgrid.iter().enumerate() {
            ProviderAccount::parse(&s.account).map_err(|e| {
                ConfigError::invalid(format!("receipts.sendgrid.{i}.account"), e.to_string())
            })?;
            let key = verifying_key(&s.verification_key).ok_or_else(|| {
                ConfigError::invalid(
                    format!("receipts.sendgrid.{i}.verification_key"),
                    "must be a base64 DER P-256 public key (SubjectPublicKeyInfo)",
                )
            })?;
            sendgrid.insert(s.account.clone(), key);
        }
        let mut generic = HashMap::new();
        for (i, g) in self.generic.iter().enumerate() {
            ProviderAccount::parse(&g.account).map_err(|e| {
                ConfigError::invalid(format!("receipts.generic.{i}.account"), e.to_string())
            })?;
            let secret = g.secret.expose();
            let key = secret.strip_prefix("whsec_").unwrap_or(secret);
            let long_enough = base64::engine::general_purpose::STANDARD
                .decode(key)
                .is_ok_and(|k| k.len() >= 24);
            let verifier = standardwebhooks::Webhook::new(secret)
                .ok()
                .filter(|_| long_enough)
                .ok_or_else(|| {
                    ConfigError::invalid(
                        format!("receipts.generic.{i}.secret"),
                        "must be a Standard Webhooks secret: whsec_ and the base64 of at least 24 random bytes",
                    )
                })?;
            generic.insert(g.account.clone(), verifier);
        }
        Ok(Receipts {
            public_base,
            twilio,
            sendgrid,
            generic,
        })
    }
}

fn verifying_key(b64: &str) -> Option<p256::ecdsa::VerifyingKey> {
    use p256::pkcs8::DecodePublicKey as _;
    let der = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    p256::ecdsa::VerifyingKey::from_public_key_der(&der).ok()
}

/// A plain word: 1 to `max` characters of ASCII letters, digits, `_`, `-`, `.`.
pub(crate) fn plain(value: &str, max: usize) -> bool {
    !value.is_empty()
        && value.len() <= max
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// What Twilio's `MessageStatus` and `ErrorCode` mean.
pub(crate) fn twilio_meaning(
    status: &str,
    code: Option<&str>,
) -> (ReceiptOutcome, Option<ContactFlag>) {
    let outcome = match status {
        "delivered" | "read" => ReceiptOutcome::Delivered,
        "failed" | "undelivered" | "canceled" => ReceiptOutcome::Failed,
        _ => ReceiptOutcome::Progress,
    };
    let flag = match code {
        // The recipient replied STOP.
        Some("21610") => Some(ContactFlag::OptedOut),
        // Invalid number, not a mobile, unknown destination, landline.
        Some("21211" | "21614" | "30005" | "30006") => Some(ContactFlag::Invalid),
        _ => None,
    };
    (outcome, flag.filter(|_| outcome == ReceiptOutcome::Failed))
}

/// The fields of a SendGrid event that nudge reads; the rest (the address among them) is
/// skipped without being kept.
#[derive(Deserialize)]
pub(crate) struct SendgridEvent {
    pub(crate) event: Option<String>,
    pub(crate) sg_event_id: Option<String>,
    pub(crate) sg_message_id: Option<String>,
    pub(crate) nudge_key: Option<String>,
    #[serde(rename = "type")]
    pub(crate) kind: Option<String>,
    pub(crate) reason: Option<String>,
}

/// The most events taken from one batch (SendGrid batches by size; a larger one is refused).
pub(crate) const MAX_EVENTS: usize = 1000;

/// What a SendGrid event means.
pub(crate) fn sendgrid_meaning(e: &SendgridEvent) -> (ReceiptOutcome, Option<ContactFlag>) {
    match e.event.as_deref().unwrap_or_default() {
        "delivered" => (ReceiptOutcome::Delivered, None),
        // It arrived; the recipient does not want more.
        "spamreport" | "unsubscribe" | "group_unsubscribe" => {
            (ReceiptOutcome::Delivered, Some(ContactFlag::OptedOut))
        }
        "bounce" if e.kind.as_deref() == Some("blocked") => (ReceiptOutcome::Failed, None),
        "bounce" => (ReceiptOutcome::Failed, Some(ContactFlag::Invalid)),
        "dropped" => {
            let reason = e.reason.as_deref().unwrap_or_default().to_ascii_lowercase();
            let flag = if reason.contains("unsubscribe") || reason.contains("spam") {
                Some(ContactFlag::OptedOut)
            } else if reason.contains("bounce") || reason.contains("invalid") {
                Some(ContactFlag::Invalid)
            } else {
                None
            };
            (ReceiptOutcome::Failed, flag)
        }
        _ => (ReceiptOutcome::Progress, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generic_accounts_secret_must_be_a_standard_webhooks_secret() {
        let section = |secret: &str| ReceiptsSection {
            generic: vec![GenericReceipts {
                account: "sms-generic".into(),
                secret: Secret::new(secret),
            }],
            ..ReceiptsSection::default()
        };
        assert!(
            section("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
                .build()
                .is_ok_and(|r| r.generic_verifier("sms-generic").is_some())
        );
        for bad in ["", "whsec_", "whsec_not base64!", "whsec_c2hvcnQ="] {
            let err = section(bad).build().unwrap_err().to_string();
            assert!(err.contains("receipts.generic.0.secret"), "{bad:?}: {err}");
            // Never the secret itself.
            if let Some(value) = bad.strip_prefix("whsec_").filter(|v| !v.is_empty()) {
                assert!(!err.contains(value), "{err}");
            }
        }
    }

    #[test]
    fn twilio_statuses_and_codes_map_to_outcomes_and_flags() {
        assert_eq!(
            twilio_meaning("delivered", None),
            (ReceiptOutcome::Delivered, None)
        );
        assert_eq!(
            twilio_meaning("sent", None),
            (ReceiptOutcome::Progress, None)
        );
        assert_eq!(
            twilio_meaning("undelivered", Some("30005")),
            (ReceiptOutcome::Failed, Some(ContactFlag::Invalid))
        );
        assert_eq!(
            twilio_meaning("failed", Some("21610")),
            (ReceiptOutcome::Failed, Some(ContactFlag::OptedOut))
        );
        assert_eq!(
            twilio_meaning("undelivered", Some("30003")),
            (ReceiptOutcome::Failed, None)
        );
    }

    fn event(name: &str, kind: Option<&str>, reason: Option<&str>) -> SendgridEvent {
        SendgridEvent {
            event: Some(name.into()),
            sg_event_id: None,
            sg_message_id: None,
            nudge_key: None,
            kind: kind.map(str::to_owned),
            reason: reason.map(str::to_owned),
        }
    }

    #[test]
    fn sendgrid_events_map_to_outcomes_and_flags() {
        use ReceiptOutcome::*;
        assert_eq!(
            sendgrid_meaning(&event("delivered", None, None)),
            (Delivered, None)
        );
        assert_eq!(
            sendgrid_meaning(&event("processed", None, None)),
            (Progress, None)
        );
        assert_eq!(
            sendgrid_meaning(&event("bounce", Some("bounce"), None)),
            (Failed, Some(ContactFlag::Invalid))
        );
        assert_eq!(
            sendgrid_meaning(&event("bounce", Some("blocked"), None)),
            (Failed, None)
        );
        assert_eq!(
            sendgrid_meaning(&event("unsubscribe", None, None)),
            (Delivered, Some(ContactFlag::OptedOut))
        );
        assert_eq!(
            sendgrid_meaning(&event("dropped", None, Some("Unsubscribed Address"))),
            (Failed, Some(ContactFlag::OptedOut))
        );
        assert_eq!(
            sendgrid_meaning(&event("dropped", None, Some("Bounced Address"))),
            (Failed, Some(ContactFlag::Invalid))
        );
    }
}
