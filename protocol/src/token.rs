//! Signed, expiring access tokens that name a tenant and what it may do.
//!
//! A token is `lct1.<claims>.<mac>`: the claims are base64url JSON, the
//! MAC is HMAC-SHA256 over `lct1.<claims>` with a cluster signing key.
//! Workers hold a [`KeyRing`] (the current key and the previous one, so
//! keys rotate without invalidating every token at once) and check the
//! MAC in constant time, then expiry, then scope.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::uri::ObjectUri;

const PREFIX: &str = "lct1.";
/// Tokens longer than this are refused before any decoding.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;
const KEY_FILE_MAGIC: &str = "lakecache-key-v1";

type HmacSha256 = Hmac<Sha256>;

/// What a token allows. Scopes are `s3://bucket/prefix` strings; an
/// object is in scope when its URI starts with one of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    pub tenant: String,
    /// Key id of the signing key.
    pub kid: String,
    /// Expiry, seconds since the Unix epoch.
    pub exp: u64,
    #[serde(default)]
    pub read: Vec<String>,
    #[serde(default)]
    pub write: Vec<String>,
    /// Worker-to-worker calls (page hand-offs) need this.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub peer: bool,
    /// The cluster's operator: sees the whole write-back backlog, and
    /// health and metrics where they are protected. Grants no data scope.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub operator: bool,
    /// Public key (Ed25519, base64url) that verifies the cluster's signed
    /// worker registrations; set by [`SigningKey::mint`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub members_key: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("not a lakecache token")]
    Malformed,
    #[error("token signed with unknown key {0:?}")]
    UnknownKey(String),
    #[error("token signature does not verify")]
    BadSignature,
    #[error("token expired")]
    Expired,
    #[error("invalid scope {0:?}: expected s3://bucket/ or s3://bucket/prefix")]
    InvalidScope(String),
    #[error("invalid key file: {0}")]
    KeyFile(String),
}

/// One HMAC key with its id. The secret never appears in `Debug`.
#[derive(Clone)]
pub struct SigningKey {
    id: String,
    secret: Vec<u8>,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("id", &self.id)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl SigningKey {
    /// A fresh random 32-byte key.
    pub fn generate(id: &str) -> Self {
        Self {
            id: id.to_string(),
            secret: rand::random::<[u8; 32]>().to_vec(),
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub(crate) fn hmac(&self) -> HmacSha256 {
        self.mac()
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC takes keys of any length; this cannot fail.
        HmacSha256::new_from_slice(&self.secret).unwrap_or_else(|_| unreachable!())
    }

    /// The key as one line of a key file.
    pub fn to_line(&self) -> String {
        format!(
            "{KEY_FILE_MAGIC} {} {}",
            self.id,
            URL_SAFE_NO_PAD.encode(&self.secret)
        )
    }

    fn from_line(line: &str) -> Result<Self, TokenError> {
        let bad = |why: &str| TokenError::KeyFile(why.to_string());
        let mut parts = line.split_whitespace();
        if parts.next() != Some(KEY_FILE_MAGIC) {
            return Err(bad("a key line starts with lakecache-key-v1"));
        }
        let id = parts.next().ok_or_else(|| bad("missing key id"))?;
        let secret = parts
            .next()
            .and_then(|s| URL_SAFE_NO_PAD.decode(s).ok())
            .ok_or_else(|| bad("missing or invalid key"))?;
        if secret.len() < 32 {
            return Err(bad("keys are at least 32 bytes"));
        }
        if parts.next().is_some() {
            return Err(bad("trailing text after the key"));
        }
        Ok(Self {
            id: id.to_string(),
            secret,
        })
    }

    /// Signs `claims` (their `kid` is set to this key's id).
    pub fn mint(&self, claims: &Claims) -> String {
        let mut claims = claims.clone();
        claims.kid = self.id.clone();
        claims.members_key = crate::member_sig::member_public_key(self);
        // Serializing plain strings and numbers cannot fail.
        let json = serde_json::to_vec(&claims).unwrap_or_default();
        let signed = format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(json));
        let mut mac = self.mac();
        mac.update(signed.as_bytes());
        let tag = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
        format!("{signed}.{tag}")
    }
}

/// The keys a worker accepts: the current one signs, both verify.
#[derive(Debug, Clone)]
pub struct KeyRing {
    keys: Vec<SigningKey>,
}

impl KeyRing {
    pub fn new(current: SigningKey, previous: Option<SigningKey>) -> Self {
        Self {
            keys: std::iter::once(current).chain(previous).collect(),
        }
    }

    /// A key file: one `lakecache-key-v1 ID KEY` line per key, the
    /// current key first, then at most one previous key; `#` comments.
    pub fn parse(text: &str) -> Result<Self, TokenError> {
        let keys: Vec<SigningKey> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(SigningKey::from_line)
            .collect::<Result<_, _>>()?;
        match keys.len() {
            0 => Err(TokenError::KeyFile("no key in the file".into())),
            1 | 2 => Ok(Self { keys }),
            _ => Err(TokenError::KeyFile(
                "at most two keys: the current one and the previous one".into(),
            )),
        }
    }

    pub fn to_file(&self) -> String {
        let mut out = String::from("# lakecache signing keys: current first, then previous\n");
        for key in &self.keys {
            out.push_str(&key.to_line());
            out.push('\n');
        }
        out
    }

    pub fn keys(&self) -> &[SigningKey] {
        &self.keys
    }

    pub fn current(&self) -> &SigningKey {
        &self.keys[0]
    }

    /// Checks the token's signature and expiry (`now`: Unix seconds) and
    /// returns its claims.
    pub fn verify(&self, token: &str, now: u64) -> Result<Claims, TokenError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(TokenError::Malformed);
        }
        let rest = token.strip_prefix(PREFIX).ok_or(TokenError::Malformed)?;
        let (payload, tag) = rest.split_once('.').ok_or(TokenError::Malformed)?;
        let json = URL_SAFE_NO_PAD
            .decode(payload)
            .map_err(|_| TokenError::Malformed)?;
        let tag = URL_SAFE_NO_PAD
            .decode(tag)
            .map_err(|_| TokenError::Malformed)?;
        let claims: Claims = serde_json::from_slice(&json).map_err(|_| TokenError::Malformed)?;
        let key = self
            .keys
            .iter()
            .find(|k| k.id == claims.kid)
            .ok_or_else(|| TokenError::UnknownKey(claims.kid.clone()))?;
        let mut mac = key.mac();
        mac.update(&token.as_bytes()[..PREFIX.len() + payload.len()]);
        mac.verify_slice(&tag)
            .map_err(|_| TokenError::BadSignature)?;
        if claims.exp <= now {
            return Err(TokenError::Expired);
        }
        Ok(claims)
    }
}

/// The claims of a token, read without verifying it: a client uses
/// them to refuse what its own token would not allow before asking.
pub fn peek_claims(token: &str) -> Option<Claims> {
    let rest = token.trim().strip_prefix(PREFIX)?;
    let (payload, _) = rest.split_once('.')?;
    serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).ok()?).ok()
}

/// Checks a scope string: `s3://bucket/` or `s3://bucket/prefix`.
pub fn validate_scope(scope: &str) -> Result<(), TokenError> {
    let bad = || TokenError::InvalidScope(scope.to_string());
    let rest = scope.strip_prefix("s3://").ok_or_else(bad)?;
    let (bucket, _) = rest.split_once('/').ok_or_else(bad)?;
    crate::uri::validate_bucket(bucket).map_err(|_| bad())?;
    Ok(())
}

/// Whether `target` (`s3://bucket/key`) lies inside one of `scopes`.
pub fn scope_covers(scopes: &[String], target: &str) -> bool {
    scopes.iter().any(|s| target.starts_with(s.as_str()))
}

/// Whether `target` lies inside one of `scopes` or leads to one (a
/// listing of `s3://bucket/` may show the way to `s3://bucket/team-a/`).
pub fn scope_reaches(scopes: &[String], target: &str) -> bool {
    scopes
        .iter()
        .any(|s| target.starts_with(s.as_str()) || s.starts_with(target))
}

fn in_scope(scopes: &[String], target: &str) -> bool {
    scope_covers(scopes, target)
}

impl Claims {
    pub fn may_read(&self, uri: &ObjectUri) -> bool {
        let target = uri.to_string();
        in_scope(&self.read, &target) || in_scope(&self.write, &target)
    }

    pub fn may_write(&self, uri: &ObjectUri) -> bool {
        in_scope(&self.write, &uri.to_string())
    }

    /// Whether everything under `s3://bucket/prefix` lies in a writable
    /// scope (evicting a prefix from the cache needs this).
    pub fn may_write_prefix(&self, bucket: &str, prefix: &str) -> bool {
        in_scope(&self.write, &format!("s3://{bucket}/{prefix}"))
    }

    /// A listing of `bucket` under `prefix` may be served when the
    /// prefix lies inside a readable scope, or leads to one (the listing
    /// is then filtered with [`Claims::may_list_key`]).
    pub fn may_list(&self, bucket: &str, prefix: &str) -> bool {
        let target = format!("s3://{bucket}/{prefix}");
        scope_reaches(&self.read, &target) || scope_reaches(&self.write, &target)
    }

    /// Whether a listed object may be shown: only objects in scope.
    pub fn may_show_object(&self, bucket: &str, key: &str) -> bool {
        let target = format!("s3://{bucket}/{key}");
        in_scope(&self.read, &target) || in_scope(&self.write, &target)
    }

    /// Whether a listed common prefix (ending in `/`) may be shown: it is
    /// inside a scope or leads to one.
    pub fn may_show_prefix(&self, bucket: &str, prefix: &str) -> bool {
        self.may_list(bucket, prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> Claims {
        Claims {
            tenant: "team-a".into(),
            kid: String::new(),
            exp: 2_000,
            read: vec!["s3://datasets/llm/".into()],
            write: vec!["s3://ckpt/team-a/".into()],
            peer: false,
            operator: false,
            members_key: None,
        }
    }

    #[test]
    fn tokens_verify_and_expire() {
        let key = SigningKey::generate("k1");
        let ring = KeyRing::new(key.clone(), None);
        let token = key.mint(&claims());
        let got = ring.verify(&token, 1_000).unwrap();
        assert_eq!(got.tenant, "team-a");
        assert_eq!(got.kid, "k1");
        assert_eq!(ring.verify(&token, 2_000), Err(TokenError::Expired));
    }

    #[test]
    fn tampered_or_foreign_tokens_are_refused() {
        let key = SigningKey::generate("k1");
        let ring = KeyRing::new(key.clone(), None);
        let token = key.mint(&claims());
        // Widen the scope in the payload, keep the MAC.
        let (head, tag) = token.rsplit_once('.').unwrap();
        let mut wider = claims();
        wider.kid = "k1".into();
        wider.read.push("s3://".into());
        let forged = format!(
            "{PREFIX}{}.{tag}",
            URL_SAFE_NO_PAD.encode(serde_json::to_vec(&wider).unwrap())
        );
        assert_ne!(forged.rsplit_once('.').unwrap().0, head);
        assert_eq!(ring.verify(&forged, 1_000), Err(TokenError::BadSignature));
        let other = SigningKey::generate("k1").mint(&claims());
        assert_eq!(ring.verify(&other, 1_000), Err(TokenError::BadSignature));
        let unknown = SigningKey::generate("k9").mint(&claims());
        assert_eq!(
            ring.verify(&unknown, 1_000),
            Err(TokenError::UnknownKey("k9".into()))
        );
        for junk in ["", "lct1.", "lct1..", "Bearer x", "lct1.e30.AAAA"] {
            assert!(ring.verify(junk, 1_000).is_err(), "{junk:?}");
        }
    }

    #[test]
    fn rotation_accepts_the_previous_key() {
        let old = SigningKey::generate("k1");
        let new = SigningKey::generate("k2");
        let token = old.mint(&claims());
        let ring = KeyRing::parse(&KeyRing::new(new, Some(old)).to_file()).unwrap();
        assert_eq!(ring.current().id(), "k2");
        assert!(ring.verify(&token, 1_000).is_ok());
    }

    #[test]
    fn scopes_bound_reads_writes_and_listings() {
        let c = claims();
        let uri = |s: &str| s.parse::<ObjectUri>().unwrap();
        assert!(c.may_read(&uri("s3://datasets/llm/shard-1.bin")));
        assert!(!c.may_read(&uri("s3://datasets/llm-other/x")));
        assert!(!c.may_write(&uri("s3://datasets/llm/shard-1.bin")));
        assert!(c.may_write(&uri("s3://ckpt/team-a/step-1.pt")));
        assert!(c.may_read(&uri("s3://ckpt/team-a/step-1.pt")));
        assert!(!c.may_write(&uri("s3://ckpt/team-b/step-1.pt")));
        assert!(c.may_list("datasets", ""));
        assert!(c.may_list("datasets", "llm/"));
        assert!(c.may_list("datasets", "llm/sub/"));
        assert!(!c.may_list("datasets", "other/"));
        assert!(!c.may_list("private", ""));
        assert!(c.may_show_prefix("datasets", "llm/"));
        assert!(!c.may_show_prefix("datasets", "l/"));
        assert!(!c.may_show_object("datasets", "l"));
        assert!(c.may_show_object("datasets", "llm/a"));
    }

    #[test]
    fn key_files_are_checked() {
        assert!(KeyRing::parse("").is_err());
        assert!(KeyRing::parse("lakecache-key-v1 k1 c2hvcnQ").is_err());
        assert!(KeyRing::parse("other k1 AAAA").is_err());
        let line = SigningKey::generate("k1").to_line();
        assert!(KeyRing::parse(&format!("{line}\n{line}\n{line}")).is_err());
        assert!(!format!("{:?}", KeyRing::parse(&line).unwrap()).contains(&line[20..]));
    }
}
