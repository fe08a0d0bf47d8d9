//! How lakecache talks to etcd and what it believes from it: TLS, a
//! username and password, and which member records count.

use std::path::PathBuf;
use std::time::Duration;

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};
use lakecache_protocol::member_sig::{MemberSignature, MemberSigner, MemberTrust};
use serde::{Deserialize, Serialize};

use crate::membership::{Member, MembershipError};

/// Credentials and TLS settings for etcd. The password never appears in
/// `Debug` output.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct EtcdAccess {
    pub user: Option<String>,
    pub password: Option<String>,
    /// CA of etcd's server certificate: etcd is then spoken to over TLS.
    pub ca: Option<PathBuf>,
    /// Client certificate and key, for etcd's --client-cert-auth.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Which member records enter the ring.
    pub trust: MemberTrust,
}

impl std::fmt::Debug for EtcdAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAccess")
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("ca", &self.ca)
            .field("cert", &self.cert)
            .field("trust", &self.trust)
            .finish()
    }
}

fn read(what: &str, path: &PathBuf) -> Result<Vec<u8>, MembershipError> {
    std::fs::read(path)
        .map_err(|e| MembershipError::Etcd(format!("reading {what} {}: {e}", path.display())))
}

impl EtcdAccess {
    /// `HOST:PORT` endpoints as URLs of the right scheme.
    pub fn urls(&self, endpoints: &[String]) -> Vec<String> {
        let scheme = if self.ca.is_some() { "https" } else { "http" };
        endpoints
            .iter()
            .map(|e| format!("{scheme}://{e}"))
            .collect()
    }

    pub(crate) fn connect_options(
        &self,
        timeout: Duration,
    ) -> Result<ConnectOptions, MembershipError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout)
            .with_keep_alive(Duration::from_secs(5), timeout);
        match (&self.user, &self.password) {
            (Some(user), Some(password)) => options = options.with_user(user, password),
            (None, None) => {}
            _ => {
                return Err(MembershipError::Etcd(
                    "etcd user and password go together".into(),
                ))
            }
        }
        if let Some(ca) = &self.ca {
            let mut tls =
                TlsOptions::new().ca_certificate(Certificate::from_pem(read("--etcd-ca", ca)?));
            match (&self.cert, &self.key) {
                (Some(cert), Some(key)) => {
                    tls = tls.identity(Identity::from_pem(
                        read("--etcd-cert", cert)?,
                        read("--etcd-key", key)?,
                    ));
                }
                (None, None) => {}
                _ => {
                    return Err(MembershipError::Etcd(
                        "--etcd-cert and --etcd-key go together".into(),
                    ))
                }
            }
            options = options.with_tls(tls);
        } else if self.cert.is_some() {
            return Err(MembershipError::Etcd("--etcd-cert needs --etcd-ca".into()));
        }
        Ok(options)
    }
}

/// A member record as stored in etcd: the member and its signatures.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredMember {
    #[serde(flatten)]
    member: Member,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    sigs: Vec<MemberSignature>,
}

/// What a signature covers: the record's etcd key (so it cannot be
/// replayed under another prefix or id) and every field.
fn signed_bytes(key: &str, m: &Member) -> Vec<u8> {
    format!(
        "lakecache-member-v1\n{key}\n{}\n{}\n{}",
        m.id, m.address, m.capacity
    )
    .into_bytes()
}

pub(crate) fn encode_member(
    key: &str,
    member: &Member,
    signer: Option<&MemberSigner>,
) -> Result<Vec<u8>, MembershipError> {
    let stored = StoredMember {
        member: member.clone(),
        sigs: signer.map_or_else(Vec::new, |s| s.sign(&signed_bytes(key, member))),
    };
    serde_json::to_vec(&stored).map_err(|e| MembershipError::Etcd(e.to_string()))
}

/// The member a record names, if it is well formed and trusted.
pub(crate) fn decode_member(key: &str, raw: &[u8], trust: &MemberTrust) -> Option<Member> {
    let stored = match serde_json::from_slice::<StoredMember>(raw) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%key, error = %e, "ignoring malformed member record");
            return None;
        }
    };
    if !trust.accepts(&signed_bytes(key, &stored.member), &stored.sigs) {
        tracing::warn!(
            %key,
            address = %stored.member.address,
            "ignoring a member record not signed by the cluster key"
        );
        return None;
    }
    Some(stored.member)
}
