//! Destinations and message content at rest: XChaCha20-Poly1305 with a key that lives
//! outside the database. The associated data binds each ciphertext to its row's identity,
//! so a ciphertext copied onto another subscriber's row fails to open.

use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

use crate::LedgerError;

const NONCE_LEN: usize = 24;

/// Seals and opens destinations. `Debug` never shows the key.
#[derive(Clone)]
pub struct DestinationCipher {
    aead: XChaCha20Poly1305,
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
        }
    }

    /// Returns `nonce || ciphertext`.
    pub(crate) fn seal(&self, plaintext: &[u8], aad: &[u8]) -> Result<Vec<u8>, LedgerError> {
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let sealed = self
            .aead
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

    pub(crate) fn open(&self, sealed: &[u8], aad: &[u8]) -> Result<Vec<u8>, LedgerError> {
        if sealed.len() <= NONCE_LEN {
            return Err(LedgerError::Crypto);
        }
        let (nonce, ciphertext) = sealed.split_at(NONCE_LEN);
        self.aead
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: ciphertext,
                    aad,
                },
            )
            .map_err(|_| LedgerError::Crypto)
    }
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
    fn debug_output_never_shows_a_destination_or_the_key() {
        let shown = format!("{:?} {:?}", Destination::new("+15550100"), cipher());
        assert!(!shown.contains("5550100"));
        assert!(shown.contains("redacted"));
    }
}
