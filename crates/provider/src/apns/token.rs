//! The APNs provider token: a JWT signed ES256 with the team's key (header `alg`, `kid` the key
//! id; claims `iss` the team id, `iat` the time it was made).
//!
//! Apple refuses a token older than an hour and answers `TooManyProviderTokenUpdates` to a
//! provider that changes it too often: a token is made at most once per [`MIN_REFRESH`] (20
//! minutes) and reused for every send until `refresh_after` has passed. A token APNs called
//! invalid or expired is replaced at the next send, but still no sooner than [`MIN_REFRESH`]
//! after it was made: refreshing faster would only add the updates error to the auth failure.
//! Making a token is synchronous and short, so one lock makes sure only one is made at a time.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::header::HeaderValue;
use serde::Serialize;
use tokio::time::Instant;

use nudge_domain::SendOutcome;

use crate::transport::failed_before_send;

/// The shortest time between two provider tokens.
pub const MIN_REFRESH: Duration = Duration::from_secs(20 * 60);
/// The longest Apple accepts a token for.
pub const MAX_AGE: Duration = Duration::from_secs(60 * 60);

#[derive(Serialize)]
struct Claims<'a> {
    iss: &'a str,
    iat: i64,
}

struct Issued {
    header: HeaderValue,
    at: Instant,
    refused: bool,
}

/// The provider tokens of one APNs account.
pub(crate) struct ProviderTokens {
    team_id: String,
    key_id: String,
    key: EncodingKey,
    refresh_after: Duration,
    current: Mutex<Option<Issued>>,
    made: AtomicU64,
}

impl std::fmt::Debug for ProviderTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderTokens")
            .field("key_id", &self.key_id)
            .field("refresh_after", &self.refresh_after)
            .field("made", &self.made.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl ProviderTokens {
    /// `refresh_after` is clamped to [`MIN_REFRESH`]..[`MAX_AGE`].
    pub(crate) fn new(
        team_id: String,
        key_id: String,
        key: EncodingKey,
        refresh_after: Duration,
    ) -> Self {
        Self {
            team_id,
            key_id,
            key,
            refresh_after: refresh_after.clamp(MIN_REFRESH, MAX_AGE),
            current: Mutex::new(None),
            made: AtomicU64::new(0),
        }
    }

    /// How many tokens were made so far.
    pub(crate) fn made(&self) -> u64 {
        self.made.load(Ordering::Relaxed)
    }

    /// The `authorization` value to send with: the current token, or a new one when it is due.
    pub(crate) fn authorization(&self) -> Result<HeaderValue, SendOutcome> {
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        if let Some(issued) = current.as_ref() {
            let age = now.saturating_duration_since(issued.at);
            let due = age >= self.refresh_after || issued.refused;
            if !due || age < MIN_REFRESH {
                return Ok(issued.header.clone());
            }
        }
        let header = self.sign()?;
        *current = Some(Issued {
            header: header.clone(),
            at: now,
            refused: false,
        });
        self.made.fetch_add(1, Ordering::Relaxed);
        Ok(header)
    }

    /// APNs refused `used` as invalid or expired: replace it at the next send allowed to.
    pub(crate) fn refused(&self, used: &HeaderValue) {
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(issued) = current.as_mut()
            && issued.header == *used
        {
            issued.refused = true;
        }
    }

    fn sign(&self) -> Result<HeaderValue, SendOutcome> {
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some(self.key_id.clone());
        let claims = Claims {
            iss: &self.team_id,
            iat: chrono::Utc::now().timestamp(),
        };
        let unsigned = || failed_before_send("provider_token_unsigned");
        let token = jsonwebtoken::encode(&header, &claims, &self.key).map_err(|_| unsigned())?;
        let mut value =
            HeaderValue::from_str(&format!("bearer {token}")).map_err(|_| unsigned())?;
        value.set_sensitive(true);
        Ok(value)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;

    fn tokens(refresh_after: Duration) -> ProviderTokens {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        ProviderTokens::new(
            "TEAM123456".into(),
            "KEY1234567".into(),
            EncodingKey::from_ec_pem(key.serialize_pem().as_bytes()).unwrap(),
            refresh_after,
        )
    }

    const MIN: Duration = Duration::from_secs(60);

    #[tokio::test(start_paused = true)]
    async fn a_token_is_reused_until_refresh_after_and_then_replaced_once() {
        let t = tokens(Duration::from_secs(50 * 60));
        let first = t.authorization().unwrap();
        for _ in 0..100 {
            assert_eq!(t.authorization().unwrap(), first);
        }
        tokio::time::advance(49 * MIN).await;
        assert_eq!(t.authorization().unwrap(), first);
        tokio::time::advance(MIN).await;
        let second = t.authorization().unwrap();
        assert_ne!(second, first);
        assert_eq!(t.authorization().unwrap(), second);
        assert_eq!(t.made(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_token_is_replaced_but_never_sooner_than_20_minutes_after_it_was_made() {
        let t = tokens(Duration::from_secs(50 * 60));
        let first = t.authorization().unwrap();
        t.refused(&first);
        tokio::time::advance(19 * MIN).await;
        assert_eq!(t.authorization().unwrap(), first, "19 minutes after");
        tokio::time::advance(MIN).await;
        assert_ne!(t.authorization().unwrap(), first, "20 minutes after");
        assert_eq!(t.made(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_configured_refresh_below_20_minutes_is_raised_to_20() {
        let t = tokens(Duration::from_secs(60));
        let first = t.authorization().unwrap();
        tokio::time::advance(19 * MIN).await;
        assert_eq!(t.authorization().unwrap(), first);
        tokio::time::advance(MIN).await;
        assert_ne!(t.authorization().unwrap(), first);
    }

    #[test]
    fn the_token_is_es256_with_the_key_id_and_the_team_as_issuer() {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let t = ProviderTokens::new(
            "TEAM123456".into(),
            "KEY1234567".into(),
            EncodingKey::from_ec_pem(key.serialize_pem().as_bytes()).unwrap(),
            Duration::from_secs(3000),
        );
        let value = t.authorization().unwrap();
        let jwt = value.to_str().unwrap().strip_prefix("bearer ").unwrap();
        let mut validation = jsonwebtoken::Validation::new(Algorithm::ES256);
        validation.required_spec_claims.clear();
        validation.validate_exp = false;
        let decoded = jsonwebtoken::decode::<serde_json::Value>(
            jwt,
            &jsonwebtoken::DecodingKey::from_ec_pem(key.public_key_pem().as_bytes()).unwrap(),
            &validation,
        )
        .unwrap();
        assert_eq!(decoded.header.kid.as_deref(), Some("KEY1234567"));
        assert_eq!(decoded.claims["iss"], "TEAM123456");
        let iat = decoded.claims["iat"].as_i64().unwrap();
        assert!(
            (iat - chrono::Utc::now().timestamp()).abs() <= 5,
            "iat within 5 s of now"
        );
    }
}
