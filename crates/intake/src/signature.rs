//! The signed webhook's signature, Stripe-style: a header
//! `Nudge-Signature: t=<unix seconds>,v1=<hex>[,v1=<hex>...]` where each `v1` is
//! HMAC-SHA256 of `"<t>.<raw body>"` under one of the tenant's signing secrets (a client
//! rotating its secret sends one per secret). A request is authentic when any `v1` matches any
//! active secret, compared in constant time, and `t` is within the tolerance of our clock.
//!
//! Must never: compare a signature with `==`; tell apart, in what it answers, a tenant that
//! does not exist from a signature that does not match (both are [`Refusal::BadSignature`] to
//! the client; the caller keeps [`Refusal::UnknownTenant`] for its own log and metric).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header's name.
pub const HEADER: &str = "nudge-signature";

/// The most `v1` entries read from one header (a client rotating sends two).
const MAX_SIGNATURES: usize = 8;

/// Why a request was refused (401). [`Refusal::code`] is what the client sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No header, or one that does not parse.
    MissingSignature,
    /// No `v1` matches an active secret.
    BadSignature,
    /// `t` is further from now than the tolerance, in the past or the future.
    StaleTimestamp,
    /// The tenant does not exist or has no active secret. Answered as `bad_signature`.
    UnknownTenant,
}

impl Refusal {
    /// The reason code in the 401 body. An unknown tenant is answered exactly as a bad
    /// signature, so the answer does not say which tenants exist.
    pub fn code(self) -> &'static str {
        match self {
            Self::MissingSignature => "missing_signature",
            Self::BadSignature | Self::UnknownTenant => "bad_signature",
            Self::StaleTimestamp => "stale_timestamp",
        }
    }

    /// The reason for logs and the refusal metric (operators may see which tenants exist).
    pub fn internal(self) -> &'static str {
        match self {
            Self::MissingSignature => "missing_signature",
            Self::BadSignature => "bad_signature",
            Self::StaleTimestamp => "stale_timestamp",
            Self::UnknownTenant => "unknown_tenant",
        }
    }
}

/// A parsed `Nudge-Signature` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignatureHeader {
    timestamp: i64,
    signatures: Vec<[u8; 32]>,
}

impl SignatureHeader {
    /// Parses `t=<digits>,v1=<64 hex>[,v1=...]`; entries of other schemes (`v0=`, a future
    /// `v2=`) are ignored, as Stripe's clients expect. Exactly one `t`, at least one `v1`.
    pub fn parse(header: &str) -> Result<Self, Refusal> {
        let mut timestamp = None;
        let mut signatures = Vec::new();
        for part in header.split(',') {
            let (key, value) = part
                .trim()
                .split_once('=')
                .ok_or(Refusal::MissingSignature)?;
            match key {
                "t" => {
                    if timestamp.is_some()
                        || value.is_empty()
                        || value.len() > 12
                        || !value.bytes().all(|b| b.is_ascii_digit())
                    {
                        return Err(Refusal::MissingSignature);
                    }
                    timestamp = Some(
                        value
                            .parse::<i64>()
                            .map_err(|_| Refusal::MissingSignature)?,
                    );
                }
                "v1" => {
                    if signatures.len() == MAX_SIGNATURES {
                        return Err(Refusal::MissingSignature);
                    }
                    // A v1 that is not 64 hex digits can match nothing.
                    if let Some(sig) = decode_hex32(value) {
                        signatures.push(sig);
                    } else {
                        return Err(Refusal::BadSignature);
                    }
                }
                _ => {}
            }
        }
        match (timestamp, signatures.is_empty()) {
            (Some(timestamp), false) => Ok(Self {
                timestamp,
                signatures,
            }),
            _ => Err(Refusal::MissingSignature),
        }
    }

    pub fn timestamp(&self) -> i64 {
        self.timestamp
    }

    /// Whether the timestamp is within `tolerance_s` of `now` (unix seconds), either way.
    pub fn is_fresh(&self, now: i64, tolerance_s: u64) -> bool {
        let tolerance = i64::try_from(tolerance_s).unwrap_or(i64::MAX);
        now.abs_diff(self.timestamp) <= tolerance.unsigned_abs()
    }

    /// Whether any signature matches `body` under any of `secrets`. Every pair is compared
    /// (in constant time each), so the time taken does not say which one matched.
    pub fn matches<'a>(&self, secrets: impl IntoIterator<Item = &'a [u8]>, body: &[u8]) -> bool {
        let mut matched = false;
        for secret in secrets {
            for signature in &self.signatures {
                // `verify_slice` compares in constant time.
                matched |= mac(secret, self.timestamp, body)
                    .verify_slice(signature)
                    .is_ok();
            }
        }
        matched
    }
}

fn mac(secret: &[u8], timestamp: i64, body: &[u8]) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The `v1` value for `body` at `timestamp` under `secret`: what a client computes (tests,
/// the Schemathesis hook and the demo do the same).
pub fn sign(secret: &[u8], timestamp: i64, body: &[u8]) -> String {
    let digest = mac(secret, timestamp, body).finalize().into_bytes();
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// A whole header value for `body` at `timestamp`, one `v1` per secret.
pub fn header_value(secrets: &[&[u8]], timestamp: i64, body: &[u8]) -> String {
    let mut value = format!("t={timestamp}");
    for secret in secrets {
        value.push_str(",v1=");
        value.push_str(&sign(secret, timestamp, body));
    }
    value
}

fn decode_hex32(text: &str) -> Option<[u8; 32]> {
    let bytes = text.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        let hi = hex_value(pair[0])?;
        let lo = hex_value(pair[1])?;
        out[i] = (hi << 4) | lo;
    }
    Some(out)
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const OLD: &[u8] = b"nsk_old";
    const NEW: &[u8] = b"nsk_new";
    const BODY: &[u8] = br#"{"event_id":"e-1"}"#;
    const NOW: i64 = 1_800_000_000;

    #[test]
    fn a_signature_under_the_tenants_secret_matches_and_any_other_does_not() {
        let header = SignatureHeader::parse(&header_value(&[NEW], NOW, BODY)).unwrap();
        assert!(header.matches([NEW], BODY));
        assert!(!header.matches([OLD], BODY));
        assert!(!header.matches([NEW], b"{}"), "another body");
        let other_time =
            SignatureHeader::parse(&format!("t={},v1={}", NOW + 1, sign(NEW, NOW, BODY))).unwrap();
        assert!(!other_time.matches([NEW], BODY), "the timestamp is signed");
    }

    #[test]
    fn during_a_rotation_either_secret_and_either_signature_is_accepted() {
        // The client still signs with the old secret only.
        let old_only = SignatureHeader::parse(&header_value(&[OLD], NOW, BODY)).unwrap();
        assert!(old_only.matches([NEW, OLD], BODY));
        // The client signs with both; the intake has retired the old one.
        let both = SignatureHeader::parse(&header_value(&[OLD, NEW], NOW, BODY)).unwrap();
        assert!(both.matches([NEW], BODY));
        // After retirement, the old secret alone no longer passes.
        assert!(!old_only.matches([NEW], BODY));
    }

    #[test]
    fn several_v1_entries_are_read_and_unknown_schemes_ignored() {
        let value = format!(
            "t={NOW},v0=abc,v1={},v1={}",
            sign(b"x", NOW, BODY),
            sign(NEW, NOW, BODY)
        );
        let header = SignatureHeader::parse(&value).unwrap();
        assert!(header.matches([NEW], BODY));
    }

    #[test]
    fn stale_and_future_timestamps_are_outside_the_tolerance() {
        let header = |t: i64| SignatureHeader::parse(&header_value(&[NEW], t, BODY)).unwrap();
        assert!(header(NOW - 300).is_fresh(NOW, 300));
        assert!(header(NOW + 300).is_fresh(NOW, 300));
        assert!(!header(NOW - 301).is_fresh(NOW, 300), "stale");
        assert!(!header(NOW + 301).is_fresh(NOW, 300), "from the future");
        assert!(!header(0).is_fresh(NOW, 300));
    }

    #[test]
    fn a_header_without_a_timestamp_or_a_signature_is_a_missing_signature() {
        for value in [
            "",
            "t=1",
            "v1=00",
            "t=abc,v1=00",
            "t=1,t=2,v1=0000000000000000000000000000000000000000000000000000000000000000",
            "garbage",
            "t=-5,v1=0000000000000000000000000000000000000000000000000000000000000000",
        ] {
            assert!(
                matches!(
                    SignatureHeader::parse(value),
                    Err(Refusal::MissingSignature | Refusal::BadSignature)
                ),
                "{value:?}"
            );
        }
        assert_eq!(SignatureHeader::parse(""), Err(Refusal::MissingSignature));
        assert_eq!(
            SignatureHeader::parse(&format!("t={NOW},v1=zz")),
            Err(Refusal::BadSignature)
        );
    }

    #[test]
    fn an_unknown_tenant_is_answered_as_a_bad_signature() {
        assert_eq!(Refusal::UnknownTenant.code(), Refusal::BadSignature.code());
        assert_eq!(Refusal::UnknownTenant.internal(), "unknown_tenant");
    }

    proptest! {
        #[test]
        fn any_change_to_the_body_breaks_the_signature(body in proptest::collection::vec(any::<u8>(), 0..256), flip in any::<usize>()) {
            let header = SignatureHeader::parse(&header_value(&[NEW], NOW, &body)).unwrap();
            prop_assert!(header.matches([NEW], &body));
            if !body.is_empty() {
                let mut changed = body.clone();
                let i = flip % changed.len();
                changed[i] ^= 0x01;
                prop_assert!(!header.matches([NEW], &changed));
            }
        }

        #[test]
        fn parsing_never_panics(value in ".{0,300}") {
            let _ = SignatureHeader::parse(&value);
        }
    }
}
