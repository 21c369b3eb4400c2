//! PHI at rest. Destinations and message content: XChaCha20-Poly1305 with a key that lives
//! outside the database. The associated data binds each ciphertext to its row's identity,
//! so a ciphertext copied onto another subscriber's row fails to open.
//!
//! Subscriber references: stored as a keyed hash, HMAC-SHA256 under `crypto.subscriber_key`
//! over the tenant and the reference, written as 64 lowercase hex digits (the column
//! `subscriber_ref_keyed` says which rows hold one). The same reference of the same tenant
//! always gives the same stored value, so reminders still join their contacts on equality,
//! and a destination's associated data is computed from the *stored* value: whoever opens a
//! destination (the worker) needs no subscriber key. Only writers hold that key, so a
//! process that only sends cannot test guesses of references against the database.
//!
//! Tenants' signing secrets: XChaCha20-Poly1305 under `crypto.tenant_secret_key`, a key only
//! the intake and `nudgectl` hold (a worker holds the destination key, and with it it could
//! sign as every tenant). Rows sealed before that key existed are sealed with the destination
//! key and say so (`tenant_secrets.sealed_with`); they still open, and `nudgectl migrate`
//! seals them again under the new key.

use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac};
use nudge_domain::{Channel, SubscriberRef, TenantId};
use sha2::Sha256;

use crate::LedgerError;

/// What a reminder's sealed content is bound to: its tenant and its id, so a sealed body copied
/// onto another reminder does not open.
pub(crate) fn content_aad(tenant_id: TenantId, reminder_id: nudge_domain::ReminderId) -> Vec<u8> {
    format!("content:{tenant_id}:{reminder_id}").into_bytes()
}

const NONCE_LEN: usize = 24;

/// The key that turns a subscriber reference into its stored form. `Debug` never shows it.
#[derive(Clone)]
pub struct SubscriberKey {
    mac: Hmac<Sha256>,
}

impl std::fmt::Debug for SubscriberKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SubscriberKey(<redacted>)")
    }
}

impl SubscriberKey {
    pub fn new(key: &[u8; 32]) -> Self {
        Self {
            mac: <Hmac<Sha256> as Mac>::new_from_slice(key)
                .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length")),
        }
    }

    /// The stored form of `subscriber_ref` for `tenant_id`: 64 lowercase hex digits.
    pub(crate) fn stored_ref(&self, tenant_id: TenantId, subscriber_ref: &str) -> String {
        let mut mac = self.mac.clone();
        mac.update(b"nudge subscriber_ref v1\0");
        mac.update(tenant_id.as_uuid().as_bytes());
        mac.update(subscriber_ref.as_bytes());
        let digest = mac.finalize().into_bytes();
        let mut hex = String::with_capacity(64);
        for byte in digest {
            hex.push(char::from(HEX[usize::from(byte >> 4)]));
            hex.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
        hex
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Seals and opens destinations and content; with a [`SubscriberKey`], also writes
/// subscriber references in their stored form (only writers need one). `Debug` never shows
/// a key.
#[derive(Clone)]
pub struct DestinationCipher {
    aead: XChaCha20Poly1305,
    subscriber: Option<SubscriberKey>,
    tenant_secrets: Option<XChaCha20Poly1305>,
}

/// Which key sealed a tenant's signing secret (`tenant_secrets.sealed_with`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealedWith {
    /// Written before `crypto.tenant_secret_key` existed, or by a deployment without it.
    DestinationKey,
    TenantSecretKey,
}

impl SealedWith {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DestinationKey => "destination_key",
            Self::TenantSecretKey => "tenant_secret_key",
        }
    }

    pub(crate) fn parse(stored: &str) -> Result<Self, LedgerError> {
        match stored {
            "destination_key" => Ok(Self::DestinationKey),
            "tenant_secret_key" => Ok(Self::TenantSecretKey),
            _ => Err(LedgerError::corrupt(
                "tenant_secrets",
                "unknown sealed_with value",
            )),
        }
    }
}

/// Associated data of a secret sealed with the tenant secret key: it names the key, so a
/// ciphertext of one kind cannot be passed off as the other.
fn tenant_secret_aad(aad: &[u8]) -> Vec<u8> {
    let mut out = b"tenant_secret_key\0".to_vec();
    out.extend_from_slice(aad);
    out
}

impl std::fmt::Debug for DestinationCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DestinationCipher(<key redacted>)")
    }
}

impl DestinationCipher {
    pub fn new(key: &[u8; 32]) -> Self {
        Self {
            aead: XChaCha20Poly1305::new(key.into()),
            subscriber: None,
            tenant_secrets: None,
        }
    }

    /// Adds the key that seals tenants' signing secrets (`crypto.tenant_secret_key`): with
    /// it, new secrets are sealed under it and secrets sealed with the destination key can be
    /// sealed again ([`Ledger::reseal_tenant_secrets`]).
    ///
    /// [`Ledger::reseal_tenant_secrets`]: crate::Ledger::reseal_tenant_secrets
    pub fn with_tenant_secret_key(mut self, key: &[u8; 32]) -> Self {
        self.tenant_secrets = Some(XChaCha20Poly1305::new(key.into()));
        self
    }

    pub fn has_tenant_secret_key(&self) -> bool {
        self.tenant_secrets.is_some()
    }

    /// Seals a tenant's signing secret with the tenant secret key when there is one, else (a
    /// deployment that has not configured it yet) with the destination key as before.
    pub(crate) fn seal_tenant_secret(
        &self,
        plaintext: &[u8],
        aad: &[u8],
    ) -> Result<(Vec<u8>, SealedWith), LedgerError> {
        match &self.tenant_secrets {
            Some(aead) => Ok((
                seal_with(aead, plaintext, &tenant_secret_aad(aad))?,
                SealedWith::TenantSecretKey,
            )),
            None => Ok((self.seal(plaintext, aad)?, SealedWith::DestinationKey)),
        }
    }

    /// Opens a tenant's signing secret with the key that sealed it. One sealed with the
    /// tenant secret key needs that key ([`LedgerError::TenantSecretKeyMissing`] without it).
    pub(crate) fn open_tenant_secret(
        &self,
        sealed: &[u8],
        with: SealedWith,
        aad: &[u8],
    ) -> Result<Vec<u8>, LedgerError> {
        match with {
            SealedWith::DestinationKey => self.open(sealed, aad),
            SealedWith::TenantSecretKey => {
                let aead = self
                    .tenant_secrets
                    .as_ref()
                    .ok_or(LedgerError::TenantSecretKeyMissing)?;
                open_with(aead, sealed, &tenant_secret_aad(aad))
            }
        }
    }

    /// Opens a tenant's sealed secrets as the ledger reads them (parallel arrays, newest
    /// first), each with the associated data `aad(generation)`. `Err` names the table and the
    /// generation that does not open (a key this process lacks, another kind of ciphertext,
    /// or text that is not UTF-8).
    pub(crate) fn open_tenant_secrets(
        &self,
        table: &'static str,
        generations: &[i32],
        sealed: &[Vec<u8>],
        sealed_with: &[String],
        aad: impl Fn(i32) -> Vec<u8>,
    ) -> Result<Vec<String>, LedgerError> {
        generations
            .iter()
            .zip(sealed)
            .zip(sealed_with)
            .map(|((generation, sealed), with)| {
                let opened =
                    self.open_tenant_secret(sealed, SealedWith::parse(with)?, &aad(*generation))?;
                String::from_utf8(opened).map_err(|_| {
                    LedgerError::corrupt(
                        table,
                        format!("secret generation {generation} is not UTF-8"),
                    )
                })
            })
            .collect()
    }

    /// Adds the key for subscriber references, which every write of a reminder or contact
    /// needs ([`LedgerError::SubscriberKeyMissing`] without it).
    pub fn with_subscriber_key(mut self, key: SubscriberKey) -> Self {
        self.subscriber = Some(key);
        self
    }

    pub fn has_subscriber_key(&self) -> bool {
        self.subscriber.is_some()
    }

    /// The stored form of a subscriber reference (see the module documentation).
    pub(crate) fn stored_ref(
        &self,
        tenant_id: TenantId,
        subscriber_ref: &SubscriberRef,
    ) -> Result<String, LedgerError> {
        self.subscriber_key()
            .map(|key| key.stored_ref(tenant_id, subscriber_ref.as_str()))
    }

    pub(crate) fn subscriber_key(&self) -> Result<&SubscriberKey, LedgerError> {
        self.subscriber
            .as_ref()
            .ok_or(LedgerError::SubscriberKeyMissing)
    }

    /// A keyed digest (HMAC-SHA256 under the subscriber key) of a request as posted, so that
    /// a repeated post can be compared with the first without keeping its body: the body holds
    /// PHI, and a plain hash of it could be tested against guesses.
    pub fn request_digest(
        &self,
        tenant_id: TenantId,
        canonical: &[u8],
    ) -> Result<Vec<u8>, LedgerError> {
        let key = self.subscriber_key()?;
        let mut mac = key.mac.clone();
        mac.update(b"nudge request v1\0");
        mac.update(tenant_id.as_uuid().as_bytes());
        mac.update(canonical);
        Ok(mac.finalize().into_bytes().to_vec())
    }

    /// The keyed digest of a destination (HMAC-SHA256 under the subscriber key over the
    /// tenant, the channel and the destination's normal form, see [`Destination::normal_form`]):
    /// stored beside its ciphertext, it tells whether a post brings the destination a contact
    /// already holds without opening it, and names the destination a send used. Keyed, so a
    /// digest cannot be tested against guessed numbers without the key.
    pub fn destination_digest(
        &self,
        tenant_id: TenantId,
        channel: Channel,
        destination: &Destination,
    ) -> Result<DestinationDigest, LedgerError> {
        let key = self.subscriber_key()?;
        let mut mac = key.mac.clone();
        mac.update(b"nudge destination v1\0");
        mac.update(tenant_id.as_uuid().as_bytes());
        mac.update(channel.as_str().as_bytes());
        mac.update(b"\0");
        mac.update(destination.normal_form(channel).as_bytes());
        Ok(DestinationDigest(mac.finalize().into_bytes().to_vec()))
    }

    /// Returns `nonce || ciphertext`.
    pub(crate) fn seal(&self, plaintext: &[u8], aad: &[u8]) -> Result<Vec<u8>, LedgerError> {
        seal_with(&self.aead, plaintext, aad)
    }

    pub(crate) fn open(&self, sealed: &[u8], aad: &[u8]) -> Result<Vec<u8>, LedgerError> {
        open_with(&self.aead, sealed, aad)
    }
}

fn seal_with(
    aead: &XChaCha20Poly1305,
    plaintext: &[u8],
    aad: &[u8],
) -> Result<Vec<u8>, LedgerError> {
    let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
    let sealed = aead
        .encrypt(
            &nonce,
            Payload {
                msg: plaintext,
                aad,
            },
        )
        .map_err(|_| LedgerError::Crypto)?;
    let mut out = Vec::with_capacity(NONCE_LEN + sealed.len());
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&sealed);
    Ok(out)
}

fn open_with(aead: &XChaCha20Poly1305, sealed: &[u8], aad: &[u8]) -> Result<Vec<u8>, LedgerError> {
    if sealed.len() <= NONCE_LEN {
        return Err(LedgerError::Crypto);
    }
    let (nonce, ciphertext) = sealed.split_at(NONCE_LEN);
    aead.decrypt(
        XNonce::from_slice(nonce),
        Payload {
            msg: ciphertext,
            aad,
        },
    )
    .map_err(|_| LedgerError::Crypto)
}

/// A decrypted destination (phone number, email address or push token). Sensitive:
/// `Debug` is redacted and there is no `Display`; the only way to read it is [`expose`].
///
/// [`expose`]: Destination::expose
#[derive(Clone, PartialEq, Eq)]
pub struct Destination(String);

impl Destination {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl Destination {
    /// The form two spellings of one destination share: for SMS the number's `+` and digits
    /// (spaces, dashes, dots and brackets dropped), for email the address trimmed and
    /// lower-cased, for push the token trimmed.
    pub fn normal_form(&self, channel: Channel) -> String {
        let value = self.0.trim();
        match channel {
            Channel::Sms => value
                .chars()
                .filter(|c| c.is_ascii_digit() || *c == '+')
                .collect(),
            Channel::Email => value.to_lowercase(),
            Channel::Push => value.to_owned(),
        }
    }
}

/// The keyed digest of a destination ([`DestinationCipher::destination_digest`]): 32 bytes,
/// stored in `contacts.destination_digest` and stamped on a delivery by its fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DestinationDigest(Vec<u8>);

impl DestinationDigest {
    /// Its length in bytes.
    pub(crate) const LEN: usize = 32;

    /// A digest as the ledger stored it; `None` for anything but [`Self::LEN`] bytes.
    pub(crate) fn from_stored(bytes: Vec<u8>) -> Option<Self> {
        (bytes.len() == Self::LEN).then_some(Self(bytes))
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Destination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Destination(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cipher() -> DestinationCipher {
        DestinationCipher::new(&[7u8; 32])
    }

    #[test]
    fn two_spellings_of_one_destination_share_a_digest_and_two_destinations_do_not() {
        let writer = cipher().with_subscriber_key(SubscriberKey::new(&[9u8; 32]));
        let tenant = TenantId::from_uuid(uuid::Uuid::from_u128(1));
        let digest = |channel, value: &str| {
            writer
                .destination_digest(tenant, channel, &Destination::new(value))
                .unwrap()
        };
        assert_eq!(
            digest(Channel::Sms, "+1 (555) 010-0100"),
            digest(Channel::Sms, "+15550100100")
        );
        assert_eq!(
            digest(Channel::Email, " Pat@Example.org"),
            digest(Channel::Email, "pat@example.org")
        );
        assert_ne!(
            digest(Channel::Sms, "+15550100100"),
            digest(Channel::Sms, "+15550100101")
        );
        // The same text on another channel, or of another tenant, is another destination.
        assert_ne!(
            digest(Channel::Email, "pat@example.org"),
            digest(Channel::Push, "pat@example.org")
        );
        let other = TenantId::from_uuid(uuid::Uuid::from_u128(2));
        assert_ne!(
            digest(Channel::Sms, "+15550100100"),
            writer
                .destination_digest(other, Channel::Sms, &Destination::new("+15550100100"))
                .unwrap()
        );
        assert_eq!(digest(Channel::Sms, "+15550100100").as_bytes().len(), 32);
    }

    #[test]
    fn a_destination_digest_needs_the_subscriber_key() {
        let tenant = TenantId::from_uuid(uuid::Uuid::from_u128(1));
        assert!(matches!(
            cipher().destination_digest(tenant, Channel::Sms, &Destination::new("+15550100100")),
            Err(LedgerError::SubscriberKeyMissing)
        ));
    }

    #[test]
    fn a_sealed_destination_opens_with_the_same_row_identity() {
        let sealed = cipher().seal(b"+15550100", b"row-a").unwrap();
        assert_eq!(cipher().open(&sealed, b"row-a").unwrap(), b"+15550100");
    }

    #[test]
    fn a_ciphertext_moved_to_another_row_does_not_open() {
        let sealed = cipher().seal(b"+15550100", b"row-a").unwrap();
        assert!(cipher().open(&sealed, b"row-b").is_err());
    }

    #[test]
    fn the_plaintext_does_not_appear_in_the_ciphertext_and_nonces_differ() {
        let a = cipher().seal(b"alice@example.org", b"r").unwrap();
        let b = cipher().seal(b"alice@example.org", b"r").unwrap();
        assert_ne!(a, b);
        assert!(!a.windows(5).any(|w| w == b"alice"));
    }

    #[test]
    fn another_key_cannot_open_it() {
        let sealed = cipher().seal(b"token", b"r").unwrap();
        assert!(
            DestinationCipher::new(&[8u8; 32])
                .open(&sealed, b"r")
                .is_err()
        );
    }

    #[test]
    fn a_stored_subscriber_ref_is_a_keyed_hash_stable_per_tenant() {
        let key = SubscriberKey::new(&[9u8; 32]);
        let (a, b) = (TenantId::new(), TenantId::new());
        let stored = key.stored_ref(a, "patient-42");
        assert_eq!(stored.len(), 64);
        assert!(
            stored
                .bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert!(!stored.contains("patient"));
        assert_eq!(stored, key.stored_ref(a, "patient-42"));
        assert_ne!(stored, key.stored_ref(b, "patient-42"));
        assert_ne!(stored, key.stored_ref(a, "patient-43"));
        assert_ne!(
            stored,
            SubscriberKey::new(&[8u8; 32]).stored_ref(a, "patient-42")
        );
    }

    #[test]
    fn writing_a_subscriber_ref_needs_the_subscriber_key() {
        let subscriber = SubscriberRef::parse("patient-42").unwrap();
        assert!(matches!(
            cipher().stored_ref(TenantId::new(), &subscriber),
            Err(LedgerError::SubscriberKeyMissing)
        ));
        let keyed = cipher().with_subscriber_key(SubscriberKey::new(&[9u8; 32]));
        assert!(keyed.stored_ref(TenantId::new(), &subscriber).is_ok());
        assert!(!format!("{keyed:?}").contains('9'));
    }

    #[test]
    fn a_tenant_secret_sealed_with_the_tenant_secret_key_does_not_open_with_the_destination_key() {
        let intake = cipher().with_tenant_secret_key(&[5u8; 32]);
        let (sealed, with) = intake.seal_tenant_secret(b"nsk_secret", b"t:1").unwrap();
        assert_eq!(with, SealedWith::TenantSecretKey);
        assert_eq!(
            intake.open_tenant_secret(&sealed, with, b"t:1").unwrap(),
            b"nsk_secret"
        );
        // What a worker holds: the destination key alone.
        assert!(cipher().open(&sealed, b"t:1").is_err());
        assert!(matches!(
            cipher().open_tenant_secret(&sealed, with, b"t:1"),
            Err(LedgerError::TenantSecretKeyMissing)
        ));
        // Relabelled as sealed with the destination key, it does not open either.
        assert!(
            intake
                .open_tenant_secret(&sealed, SealedWith::DestinationKey, b"t:1")
                .is_err()
        );
    }

    #[test]
    fn a_tenant_secret_sealed_before_the_tenant_secret_key_still_opens() {
        let (sealed, with) = cipher().seal_tenant_secret(b"nsk_old", b"t:1").unwrap();
        assert_eq!(with, SealedWith::DestinationKey);
        let intake = cipher().with_tenant_secret_key(&[5u8; 32]);
        assert_eq!(
            intake.open_tenant_secret(&sealed, with, b"t:1").unwrap(),
            b"nsk_old"
        );
    }

    #[test]
    fn debug_output_never_shows_a_destination_or_the_key() {
        let shown = format!("{:?} {:?}", Destination::new("+15550100"), cipher());
        assert!(!shown.contains("5550100"));
        assert!(shown.contains("redacted"));
    }
}
