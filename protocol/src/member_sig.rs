//! Signed worker registrations. A worker signs its membership record
//! with Ed25519 keys derived from the cluster's signing keys; clients
//! verify with the public key their token carries, so a record written
//! by anyone without the cluster key (a rogue registration in etcd)
//! never enters their ring.

use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::Mac;
use serde::{Deserialize, Serialize};

use crate::token::{KeyRing, SigningKey};

const SEED_LABEL: &[u8] = b"lakecache member signing v1";

/// One signature over a record, by the key with id `kid`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberSignature {
    pub kid: String,
    pub sig: String,
}

/// The Ed25519 seed of a signing key: its HMAC over a fixed label, so
/// the HMAC secret itself never signs anything public.
fn seed(key: &SigningKey) -> [u8; 32] {
    let mut mac = key.hmac();
    mac.update(SEED_LABEL);
    mac.finalize().into_bytes().into()
}

fn key_pair(key: &SigningKey) -> Option<Ed25519KeyPair> {
    Ed25519KeyPair::from_seed_unchecked(&seed(key)).ok()
}

/// The public key that verifies `key`'s member signatures, base64url.
pub fn member_public_key(key: &SigningKey) -> Option<String> {
    key_pair(key).map(|p| URL_SAFE_NO_PAD.encode(p.public_key().as_ref()))
}

/// Signs records with every key of a ring (current and previous), so
/// clients holding tokens from either key accept them.
#[derive(Debug, Clone)]
pub struct MemberSigner {
    keys: Vec<SigningKey>,
}

impl MemberSigner {
    pub fn new(ring: &KeyRing) -> Self {
        Self {
            keys: ring.keys().to_vec(),
        }
    }

    pub fn sign(&self, record: &[u8]) -> Vec<MemberSignature> {
        self.keys
            .iter()
            .filter_map(|k| {
                key_pair(k).map(|p| MemberSignature {
                    kid: k.id().to_string(),
                    sig: URL_SAFE_NO_PAD.encode(p.sign(record).as_ref()),
                })
            })
            .collect()
    }
}

/// Which member records a client believes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum MemberTrust {
    /// Every record (clusters run with --no-auth).
    #[default]
    AnyRecord,
    /// Records signed by one of these Ed25519 public keys.
    SignedBy(Vec<Vec<u8>>),
}

impl MemberTrust {
    /// From a worker's own keys.
    pub fn from_ring(ring: &KeyRing) -> Self {
        Self::SignedBy(
            ring.keys()
                .iter()
                .filter_map(|k| key_pair(k).map(|p| p.public_key().as_ref().to_vec()))
                .collect(),
        )
    }

    /// From the members key a client's token carries (`None` when the
    /// token carries none, or is not a lakecache token).
    pub fn from_token(token: &str) -> Option<Self> {
        let claims = crate::token::peek_claims(token)?;
        let key = URL_SAFE_NO_PAD.decode(claims.members_key?).ok()?;
        Some(Self::SignedBy(vec![key]))
    }

    pub fn accepts(&self, record: &[u8], signatures: &[MemberSignature]) -> bool {
        match self {
            MemberTrust::AnyRecord => true,
            MemberTrust::SignedBy(keys) => signatures.iter().any(|s| {
                let Ok(sig) = URL_SAFE_NO_PAD.decode(&s.sig) else {
                    return false;
                };
                keys.iter().any(|k| {
                    UnparsedPublicKey::new(&ED25519, k)
                        .verify(record, &sig)
                        .is_ok()
                })
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_verify_only_under_the_cluster_key_and_unchanged() {
        let ring = KeyRing::new(SigningKey::generate("k1"), None);
        let signer = MemberSigner::new(&ring);
        let record = b"w1 10.0.0.1:9500";
        let sigs = signer.sign(record);
        let trust = MemberTrust::from_ring(&ring);
        assert!(trust.accepts(record, &sigs));
        assert!(!trust.accepts(b"w1 10.6.6.6:9500", &sigs), "changed record");
        assert!(!trust.accepts(record, &[]), "unsigned record");
        let rogue = MemberSigner::new(&KeyRing::new(SigningKey::generate("k1"), None));
        assert!(
            !trust.accepts(record, &rogue.sign(record)),
            "other cluster's key"
        );
        assert!(MemberTrust::AnyRecord.accepts(record, &[]));
    }

    #[test]
    fn a_rotated_ring_signs_for_tokens_of_either_key() {
        let old = SigningKey::generate("k1");
        let token_of_old = old.mint(&crate::token::Claims {
            tenant: "t".into(),
            kid: String::new(),
            exp: u64::MAX,
            read: vec!["s3://b/".into()],
            write: vec![],
            peer: false,
            operator: false,
            members_key: None,
        });
        let ring = KeyRing::new(SigningKey::generate("k2"), Some(old));
        let sigs = MemberSigner::new(&ring).sign(b"rec");
        let trust = MemberTrust::from_token(&token_of_old).unwrap();
        assert!(trust.accepts(b"rec", &sigs));
    }
}
