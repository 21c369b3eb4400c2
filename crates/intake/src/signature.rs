//! The signed webhook's signature, Stripe-style with the request's method and target signed
//! too: a header `Nudge-Signature: t=<unix seconds>,v2=<hex>[,v2=<hex>...]` where each `v2`
//! is HMAC-SHA256 of `"<t>\n<METHOD>\n<target>\n<raw body>"` ([`Signed`]) under one of the
//! tenant's signing secrets (a client rotating its secret sends one per secret). `target` is
//! the request's path, and `?query` when there is one, exactly as sent. A request is
//! authentic when any `v2` matches any active secret, compared in constant time, and `t` is
//! within the tolerance of our clock.
//!
//! Why not `v1` (`"<t>.<raw body>"`, the first scheme): it did not cover the method or path,
//! so a captured body-less request (a cancel, an erasure) could be replayed against another
//! event or subscriber of the same tenant within the tolerance. `v1` entries are now ignored
//! like any other scheme. Why newlines and not dots between the parts: a path may hold a dot
//! (`/subscribers/patient.42`), so `"<path>.<body>"` would read the same as another path with
//! another body (`/subscribers/patient` with body `42.`); a request target never holds a
//! line break, so each part ends where the first line break after it is.
//!
//! Must never: compare a signature with `==`; tell apart, in what it answers or in the work it
//! does, a tenant that does not exist from a signature that does not match (both are
//! [`Refusal::BadSignature`] to the client, and [`SignatureHeader::matches`] computes the same
//! number of HMACs for any number of secrets, none included; the caller keeps
//! [`Refusal::UnknownTenant`] for its own log and metric).

use hmac::{Hmac, Mac};
use nudge_ledger::IntakeTenant;
use sha2::Sha256;

/// The header's name.
pub const HEADER: &str = "nudge-signature";

/// The scheme the intake verifies.
pub const SCHEME: &str = "v2";

/// The most `v2` entries read from one header (a client rotating sends two).
const MAX_SIGNATURES: usize = 8;

/// The most secrets a tenant has at once; verification always tries this many (padded with a
/// placeholder), so its time does not say how many a tenant has, or whether it exists.
pub const SECRETS_TRIED: usize = 2;

/// The key tried in place of a secret a tenant does not have, so that the same work is done;
/// what it matches is discarded (it is public: a signature under it proves nothing).
const PLACEHOLDER_SECRET: &[u8] =
    b"nsk_0000000000000000000000000000000000000000000000000000000000000000";

/// Why a request was refused (401). [`Refusal::code`] is what the client sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No header, one that does not parse, or one without a `v2` entry.
    MissingSignature,
    /// No `v2` matches an active secret.
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

/// What a signature covers besides its timestamp.
#[derive(Debug, Clone, Copy)]
pub struct Signed<'a> {
    /// The request method as sent (`POST`).
    pub method: &'a str,
    /// The request target: the path, and `?query` when there is one, exactly as sent
    /// (percent-encoding kept).
    pub target: &'a str,
    /// The raw body (empty for a request without one).
    pub body: &'a [u8],
}

/// A parsed `Nudge-Signature` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignatureHeader {
    timestamp: i64,
    signatures: Vec<[u8; 32]>,
}

impl SignatureHeader {
    /// Parses `t=<digits>,v2=<64 hex>[,v2=...]`; entries of other schemes (`v1=`, `v0=`, a
    /// future `v3=`) are ignored, as Stripe's clients expect. Exactly one `t`, at least one
    /// `v2`: a header with only entries of other schemes is a missing signature.
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
                SCHEME => {
                    if signatures.len() == MAX_SIGNATURES {
                        return Err(Refusal::MissingSignature);
                    }
                    // A v2 that is not 64 hex digits can match nothing.
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

    /// Whether any signature matches `signed` under any of `secrets`. Every signature is
    /// compared (in constant time each) with at least [`SECRETS_TRIED`] keys, the missing ones
    /// taken by a placeholder whose matches are discarded: the work is the same for a tenant
    /// with one secret, two, or none at all, and does not say which one matched.
    pub fn matches(&self, secrets: &[&[u8]], signed: &Signed<'_>) -> bool {
        let mut matched = false;
        for slot in 0..SECRETS_TRIED.max(secrets.len()) {
            let (key, real) = match secrets.get(slot) {
                Some(key) => (*key, true),
                None => (PLACEHOLDER_SECRET, false),
            };
            let keyed = keyed(key);
            for signature in &self.signatures {
                // `verify_slice` compares in constant time.
                let ok = message(keyed.clone(), self.timestamp, signed)
                    .verify_slice(signature)
                    .is_ok();
                matched |= std::hint::black_box(ok) & real;
            }
        }
        matched
    }
}

fn keyed(secret: &[u8]) -> Hmac<Sha256> {
    <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"))
}

fn message(mut mac: Hmac<Sha256>, timestamp: i64, signed: &Signed<'_>) -> Hmac<Sha256> {
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b"\n");
    mac.update(signed.method.as_bytes());
    mac.update(b"\n");
    mac.update(signed.target.as_bytes());
    mac.update(b"\n");
    mac.update(signed.body);
    mac
}

/// The `v2` value for `signed` at `timestamp` under `secret`: what a client computes (tests,
/// the Schemathesis hook and the demo do the same).
pub fn sign(secret: &[u8], timestamp: i64, signed: &Signed<'_>) -> String {
    let digest = message(keyed(secret), timestamp, signed)
        .finalize()
        .into_bytes();
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `signature` matches `signed` under one of `tenant`'s secrets; the same number of
/// HMACs whether the tenant has one secret, two or none, or does not exist (see
/// [`SignatureHeader::matches`]). Both the authentication of a request and the committer's
/// check before its import verify with this.
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

/// A whole header value for `signed` at `timestamp`, one `v2` per secret.
pub fn header_value(secrets: &[&[u8]], timestamp: i64, signed: &Signed<'_>) -> String {
    let mut value = format!("t={timestamp}");
    for secret in secrets {
        value.push_str(",v2=");
        value.push_str(&sign(secret, timestamp, signed));
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

    fn post(body: &[u8]) -> Signed<'_> {
        Signed {
            method: "POST",
            target: "/v1/tenants/clinic/reminders",
            body,
        }
    }

    fn parse(secrets: &[&[u8]], t: i64, signed: &Signed<'_>) -> SignatureHeader {
        SignatureHeader::parse(&header_value(secrets, t, signed)).unwrap()
    }

    #[test]
    fn a_signature_under_the_tenants_secret_matches_and_any_other_does_not() {
        let header = parse(&[NEW], NOW, &post(BODY));
        assert!(header.matches(&[NEW], &post(BODY)));
        assert!(!header.matches(&[OLD], &post(BODY)));
        assert!(!header.matches(&[NEW], &post(b"{}")), "another body");
        let other_time =
            SignatureHeader::parse(&format!("t={},v2={}", NOW + 1, sign(NEW, NOW, &post(BODY))))
                .unwrap();
        assert!(
            !other_time.matches(&[NEW], &post(BODY)),
            "the timestamp is signed"
        );
    }

    #[test]
    fn the_method_and_the_target_are_signed() {
        let cancel = Signed {
            method: "POST",
            target: "/v1/tenants/clinic/reminders/appt-1/cancel",
            body: b"",
        };
        let header = parse(&[NEW], NOW, &cancel);
        assert!(header.matches(&[NEW], &cancel));
        let other_event = Signed {
            target: "/v1/tenants/clinic/reminders/appt-2/cancel",
            ..cancel
        };
        assert!(!header.matches(&[NEW], &other_event), "another path");
        let read = Signed {
            method: "GET",
            target: "/v1/tenants/clinic/reminders/appt-1",
            ..cancel
        };
        assert!(!parse(&[NEW], NOW, &read).matches(&[NEW], &cancel));
        let delete = Signed {
            method: "DELETE",
            ..cancel
        };
        assert!(!header.matches(&[NEW], &delete), "another method");
        let query = Signed {
            target: "/v1/tenants/clinic/reminders/appt-1/cancel?x=1",
            ..cancel
        };
        assert!(!header.matches(&[NEW], &query), "the query is signed");
    }

    #[test]
    fn a_dot_in_the_path_cannot_move_bytes_between_the_path_and_the_body() {
        // With dots between the parts these two would sign the same text.
        let erase = Signed {
            method: "DELETE",
            target: "/v1/tenants/clinic/subscribers/patient.42",
            body: b"",
        };
        let shifted = Signed {
            method: "DELETE",
            target: "/v1/tenants/clinic/subscribers/patient",
            body: b"42.",
        };
        let header = parse(&[NEW], NOW, &erase);
        assert!(header.matches(&[NEW], &erase));
        assert!(!header.matches(&[NEW], &shifted));
    }

    #[test]
    fn a_v1_signature_of_the_first_scheme_is_not_accepted() {
        // "<t>.<body>": valid under the first scheme, ignored now.
        let v1 = {
            let mut mac = keyed(NEW);
            mac.update(format!("{NOW}.").as_bytes());
            mac.update(BODY);
            let digest = mac.finalize().into_bytes();
            digest
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };
        assert_eq!(
            SignatureHeader::parse(&format!("t={NOW},v1={v1}")),
            Err(Refusal::MissingSignature)
        );
    }

    #[test]
    fn during_a_rotation_either_secret_and_either_signature_is_accepted() {
        // The client still signs with the old secret only.
        let old_only = parse(&[OLD], NOW, &post(BODY));
        assert!(old_only.matches(&[NEW, OLD], &post(BODY)));
        // The client signs with both; the intake has retired the old one.
        let both = parse(&[OLD, NEW], NOW, &post(BODY));
        assert!(both.matches(&[NEW], &post(BODY)));
        // After retirement, the old secret alone no longer passes.
        assert!(!old_only.matches(&[NEW], &post(BODY)));
    }

    #[test]
    fn several_v2_entries_are_read_and_other_schemes_ignored() {
        let value = format!(
            "t={NOW},v0=abc,v1=def,v2={},v2={}",
            sign(b"x", NOW, &post(BODY)),
            sign(NEW, NOW, &post(BODY))
        );
        let header = SignatureHeader::parse(&value).unwrap();
        assert!(header.matches(&[NEW], &post(BODY)));
    }

    #[test]
    fn no_secret_at_all_matches_nothing_not_even_a_signature_under_the_placeholder() {
        let header = parse(&[PLACEHOLDER_SECRET], NOW, &post(BODY));
        assert!(!header.matches(&[], &post(BODY)));
        assert!(!header.matches(&[NEW], &post(BODY)));
        assert!(header.matches(&[PLACEHOLDER_SECRET], &post(BODY)), "sanity");
    }

    #[test]
    fn stale_and_future_timestamps_are_outside_the_tolerance() {
        let header = |t: i64| parse(&[NEW], t, &post(BODY));
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
            "v2=00",
            "t=abc,v2=00",
            "t=1,t=2,v2=0000000000000000000000000000000000000000000000000000000000000000",
            "garbage",
            "t=-5,v2=0000000000000000000000000000000000000000000000000000000000000000",
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
            SignatureHeader::parse(&format!("t={NOW},v2=zz")),
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
            let header = parse(&[NEW], NOW, &post(&body));
            prop_assert!(header.matches(&[NEW], &post(&body)));
            if !body.is_empty() {
                let mut changed = body.clone();
                let i = flip % changed.len();
                changed[i] ^= 0x01;
                prop_assert!(!header.matches(&[NEW], &post(&changed)));
            }
        }

        #[test]
        fn any_other_target_breaks_the_signature(a in "/[!-~]{0,40}", b in "/[!-~]{0,40}") {
            prop_assume!(a != b);
            let signed = |target| Signed { method: "DELETE", target, body: b"" };
            let header = parse(&[NEW], NOW, &signed(&a));
            prop_assert!(!header.matches(&[NEW], &signed(&b)));
        }

        #[test]
        fn parsing_never_panics(value in ".{0,300}") {
            let _ = SignatureHeader::parse(&value);
        }
    }
}
