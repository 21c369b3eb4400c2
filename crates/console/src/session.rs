//! Who a request is: a session cookie signed with `console.session_key`, made at login from a
//! console token, or the user an authenticating proxy names in `console.trusted_header`.
//!
//! The cookie holds the token's id, the actor, the role, the session's CSRF token and its
//! expiry; it is checked against the token at every request, so revoking or expiring the
//! token ends the session at once. A session made through the proxy's header has a CSRF token
//! derived from the session key and the user's name.

use axum::http::HeaderMap;
use axum_extra::extract::SignedCookieJar;
use axum_extra::extract::cookie::{Cookie, SameSite};
use base64::Engine as _;
use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use nudge_ledger::{ConsoleRole, ConsoleToken, LedgerError, Operator};
use rand::RngExt as _;
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// The session cookie's name.
pub const COOKIE: &str = "nudge_console";

/// The longest a name from the proxy's header may be.
const HEADER_USER_MAX: usize = 100;

/// A signed-in user, as every page and action sees it.
#[derive(Debug, Clone, Serialize)]
pub struct Session {
    /// The audit log's actor: `console:<token name>` or `console:<proxy user>`.
    pub actor: String,
    pub role: ConsoleRole,
    /// The token every form of this session carries.
    pub csrf: String,
    /// The token the session was made with (None through the proxy's header).
    pub token_id: Option<i64>,
    pub expires_at: DateTime<Utc>,
    /// When the session was made (a logout ends the token's sessions made before it).
    #[serde(skip)]
    pub issued_at: DateTime<Utc>,
    /// HMAC of the token's stored digest under the session key: the cookie names a token the
    /// signer knew, not only its id.
    #[serde(skip)]
    pub proof: String,
    /// The proxy user's CSRF token of the day before, still accepted.
    #[serde(skip)]
    pub csrf_previous: Option<String>,
    /// The database's clock when this request began: what its reads and its action use.
    #[serde(skip)]
    pub now: DateTime<Utc>,
}

/// What the cookie holds (signed, not encrypted: nothing in it is secret but the CSRF token,
/// which only needs to be unknown to another site).
#[derive(Debug, Serialize, Deserialize)]
struct Stored {
    token: i64,
    actor: String,
    role: String,
    csrf: String,
    expires: i64,
    issued: i64,
    proof: String,
}

/// The most characters of a reason an action takes (the tables' CHECKs allow 500, and a
/// redrive's pause reason is prefixed).
pub const REASON_MAX_CHARS: usize = 400;

pub(crate) fn mac(key: &[u8], parts: &[&[u8]]) -> String {
    // HMAC takes a key of any length.
    let mut mac = match Hmac::<Sha256>::new_from_slice(key) {
        Ok(mac) => mac,
        Err(_) => return String::new(),
    };
    for part in parts {
        mac.update(part);
        mac.update(b"\0");
    }
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
}

/// The proof a session cookie carries of its token: the token's stored digest under the key.
pub fn token_proof(key: &[u8], digest: &[u8]) -> String {
    mac(key, &[b"nudge-console session", digest])
}

/// Compares in constant time.
pub(crate) fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Session {
    pub fn may_act(&self) -> bool {
        self.role == ConsoleRole::Operator
    }

    /// Whether `given` is this session's CSRF token (compared in constant time).
    pub fn csrf_matches(&self, given: &str) -> bool {
        same(&self.csrf, given)
            || self
                .csrf_previous
                .as_deref()
                .is_some_and(|p| same(p, given))
    }

    /// The operator an action of this session is audited as, at the database's time of the
    /// request: a reason of 1 to [`REASON_MAX_CHARS`] characters, and an incident if given.
    pub fn operator(&self, reason: &str, incident: Option<&str>) -> Result<Operator, LedgerError> {
        let reason = reason.trim();
        if reason.is_empty() {
            return Err(LedgerError::InvalidInput("an action needs a reason"));
        }
        if reason.chars().count() > REASON_MAX_CHARS {
            return Err(LedgerError::InvalidInput(
                "a reason is at most 400 characters",
            ));
        }
        Operator::new(&self.actor, Some(reason), self.now)?.with_incident(incident)
    }

    /// Whether the cookie's proof is that of `digest` (the token's stored digest) under `key`.
    pub fn proves(&self, key: &[u8], digest: &[u8]) -> bool {
        same(&self.proof, &token_proof(key, digest))
    }

    /// A session made at login with `token`, lasting `ttl` but never past the token. Its
    /// actor is `console:<name>#<token id>`: two tokens of one name stay apart in the audit
    /// log, and apart from a proxy's user (`console:proxy:<user>`).
    pub fn for_token(
        token: &ConsoleToken,
        ttl: chrono::Duration,
        now: DateTime<Utc>,
        key: &[u8],
    ) -> Self {
        let bytes: [u8; 32] = rand::rng().random();
        Self {
            actor: format!("console:{}#{}", token.name, token.id),
            role: token.role,
            csrf: base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes),
            token_id: Some(token.id),
            expires_at: (now + ttl).min(token.expires_at),
            issued_at: now,
            proof: token_proof(key, &token.digest),
            csrf_previous: None,
            now,
        }
    }

    /// The session of a user the proxy named in its header: None when the header is absent
    /// or not a usable name (1 to 100 visible characters).
    pub fn from_header(
        headers: &HeaderMap,
        header: &str,
        role: ConsoleRole,
        key: &[u8],
        now: DateTime<Utc>,
    ) -> Option<Self> {
        // One value only: a proxy that appends to what the client sent would let the client's
        // own value through otherwise.
        let mut values = headers.get_all(header).iter();
        let user = values.next()?.to_str().ok()?.trim();
        if values.next().is_some() {
            return None;
        }
        let usable = !user.is_empty()
            && user.chars().count() <= HEADER_USER_MAX
            && user.chars().all(|c| c.is_ascii_graphic());
        if !usable {
            return None;
        }
        let actor = format!("console:proxy:{user}");
        // A CSRF token of the user and the day: one that leaks is good for two days at most.
        let day = now.timestamp().div_euclid(86_400);
        let csrf_of = |day: i64| {
            mac(
                key,
                &[
                    b"nudge-console csrf",
                    actor.as_bytes(),
                    day.to_string().as_bytes(),
                ],
            )
        };
        Some(Self {
            csrf: csrf_of(day),
            csrf_previous: Some(csrf_of(day - 1)),
            actor,
            role,
            token_id: None,
            expires_at: now + chrono::Duration::hours(1),
            issued_at: now,
            proof: String::new(),
            now,
        })
    }

    /// The session in `jar`'s signed cookie, if any and not expired (the token is checked by
    /// the caller).
    pub fn from_cookie(jar: &SignedCookieJar, now: DateTime<Utc>) -> Option<Self> {
        let stored: Stored = serde_json::from_str(jar.get(COOKIE)?.value()).ok()?;
        let expires_at = DateTime::from_timestamp(stored.expires, 0)?;
        if expires_at <= now {
            return None;
        }
        Some(Self {
            actor: stored.actor,
            role: stored.role.parse().ok()?,
            csrf: stored.csrf,
            token_id: Some(stored.token),
            expires_at,
            issued_at: DateTime::from_timestamp_millis(stored.issued)?,
            proof: stored.proof,
            csrf_previous: None,
            now,
        })
    }

    /// The cookie that carries this session.
    pub fn cookie(&self, secure: bool) -> Option<Cookie<'static>> {
        let stored = Stored {
            token: self.token_id?,
            actor: self.actor.clone(),
            role: self.role.as_str().to_owned(),
            csrf: self.csrf.clone(),
            expires: self.expires_at.timestamp(),
            issued: self.issued_at.timestamp_millis(),
            proof: self.proof.clone(),
        };
        let value = serde_json::to_string(&stored).ok()?;
        // No Max-Age: the browser drops it when it closes; the expiry inside is what counts.
        Some(
            Cookie::build((COOKIE, value))
                .path("/")
                .http_only(true)
                .secure(secure)
                .same_site(SameSite::Strict)
                .build(),
        )
    }
}

/// The cookie that ends a session.
pub fn removal() -> Cookie<'static> {
    Cookie::build((COOKIE, "")).path("/").build()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(role: ConsoleRole, expires_in: i64) -> ConsoleToken {
        let now = Utc::now();
        ConsoleToken {
            id: 7,
            name: "alice".to_owned(),
            role,
            created_at: now,
            created_by: "ops".to_owned(),
            expires_at: now + chrono::Duration::seconds(expires_in),
            revoked_at: None,
            revoked_by: None,
            sessions_valid_after: None,
            digest: vec![3; 32],
        }
    }

    #[test]
    fn a_session_never_outlives_its_token() {
        let short = token(ConsoleRole::Viewer, 60);
        let s = Session::for_token(&short, chrono::Duration::hours(8), Utc::now(), &[1; 32]);
        assert_eq!(s.expires_at, short.expires_at);
        assert_eq!(s.actor, "console:alice#7");
        assert!(s.proves(&[1; 32], &short.digest));
        assert!(!s.proves(&[2; 32], &short.digest), "another key");
        assert!(!s.proves(&[1; 32], &[4; 32]), "another token");
        assert!(!s.may_act());
    }

    #[test]
    fn the_csrf_token_must_match_exactly() {
        let s = Session::for_token(
            &token(ConsoleRole::Operator, 600),
            chrono::Duration::hours(1),
            Utc::now(),
            &[1; 32],
        );
        assert!(s.csrf_matches(&s.csrf.clone()));
        assert!(!s.csrf_matches(""));
        assert!(!s.csrf_matches(&s.csrf[1..]));
        let mut other = s.csrf.clone();
        other.replace_range(0..1, if other.starts_with('A') { "B" } else { "A" });
        assert!(!s.csrf_matches(&other));
        assert!(s.may_act());
    }

    #[test]
    fn a_proxy_user_gets_a_stable_csrf_token_of_their_own() {
        let mut headers = HeaderMap::new();
        headers.insert("x-forwarded-user", "bob".parse().unwrap());
        let key = [9u8; 32];
        let now = Utc::now();
        let a = Session::from_header(&headers, "x-forwarded-user", ConsoleRole::Viewer, &key, now)
            .unwrap();
        let b = Session::from_header(&headers, "x-forwarded-user", ConsoleRole::Viewer, &key, now)
            .unwrap();
        assert_eq!(a.csrf, b.csrf);
        assert_eq!(a.actor, "console:proxy:bob");
        let tomorrow = Session::from_header(
            &headers,
            "x-forwarded-user",
            ConsoleRole::Viewer,
            &key,
            now + chrono::Duration::days(1),
        )
        .unwrap();
        assert!(
            tomorrow.csrf_matches(&a.csrf),
            "yesterday's token is still taken"
        );
        let later = Session::from_header(
            &headers,
            "x-forwarded-user",
            ConsoleRole::Viewer,
            &key,
            now + chrono::Duration::days(2),
        )
        .unwrap();
        assert!(!later.csrf_matches(&a.csrf), "not the day before that");
        headers.append("x-forwarded-user", "mallory".parse().unwrap());
        assert!(
            Session::from_header(&headers, "x-forwarded-user", ConsoleRole::Viewer, &key, now)
                .is_none(),
            "two values of the header: no session"
        );
        headers.remove("x-forwarded-user");
        headers.insert("x-forwarded-user", "bob".parse().unwrap());
        headers.insert("x-forwarded-user", "carol".parse().unwrap());
        let c = Session::from_header(&headers, "x-forwarded-user", ConsoleRole::Viewer, &key, now)
            .unwrap();
        assert_ne!(a.csrf, c.csrf);
        headers.insert("x-forwarded-user", "   ".parse().unwrap());
        assert!(
            Session::from_header(&headers, "x-forwarded-user", ConsoleRole::Viewer, &key, now)
                .is_none()
        );
        assert!(
            Session::from_header(
                &HeaderMap::new(),
                "x-forwarded-user",
                ConsoleRole::Viewer,
                &key,
                now
            )
            .is_none()
        );
    }
}
