//! TLS settings shared by workers (server side) and their clients.
//!
//! Certificates and keys are PEM files. Clients trust only the CA they are
//! given (`--tls-ca`), never the system store: a cluster's workers carry
//! certificates from the operator's own CA.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::server::WebPkiClientVerifier;
pub use rustls::ServerConfig;
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: rustls_pki_types::pem::Error,
    },
    #[error("{what} {path} holds no PEM certificate")]
    NoCertificate { what: &'static str, path: PathBuf },
    #[error("{what} {path}: {source}")]
    Rejected {
        what: &'static str,
        path: PathBuf,
        source: rustls::Error,
    },
    #[error("client CA {path}: {message}")]
    ClientCa { path: PathBuf, message: String },
}

/// aws-lc-rs with AES-128-GCM preferred: as safe for a cluster's links
/// and about a third cheaper per byte than AES-256-GCM, which matters at
/// cache speeds.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::aws_lc_rs::{cipher_suite, default_provider};
    let mut provider = default_provider();
    let preferred = [
        cipher_suite::TLS13_AES_128_GCM_SHA256,
        cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        cipher_suite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
    ];
    provider
        .cipher_suites
        .sort_by_key(|s| !preferred.iter().any(|p| p.suite() == s.suite()));
    Arc::new(provider)
}

fn certificates(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let read = |source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(read)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| TlsError::Read {
        what: "TLS key",
        path: path.to_path_buf(),
        source,
    })
}

fn roots(what: &'static str, path: &Path) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certificates(what, path)? {
        store.add(cert).map_err(|source| TlsError::Rejected {
            what,
            path: path.to_path_buf(),
            source,
        })?;
    }
    Ok(store)
}

/// A certificate chain and its key (a worker's, or a client's for mTLS).
#[derive(Debug, Clone)]
pub struct Identity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Identity {
    fn load(&self) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
        Ok((
            certificates("TLS certificate", &self.cert)?,
            private_key(&self.key)?,
        ))
    }
}

/// The client side: which CA signs workers' certificates, and the
/// client's own certificate for workers that demand one.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientTls")
    }
}

impl ClientTls {
    pub fn load(ca: &Path, identity: Option<&Identity>) -> Result<Self, TlsError> {
        let roots = roots("--tls-ca", ca)?;
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Rejected {
                what: "--tls-ca",
                path: ca.to_path_buf(),
                source,
            })?
            .with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some(id) => {
                let (chain, key) = id.load()?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|source| TlsError::Rejected {
                        what: "client certificate",
                        path: id.cert.clone(),
                        source,
                    })?
            }
        };
        Ok(Self {
            config: Arc::new(config),
        })
    }

    /// A config that trusts nothing, for connectors that only speak http.
    pub(crate) fn no_roots() -> ClientConfig {
        ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("the default provider supports the default versions")
            .with_root_certificates(RootCertStore::empty())
            .with_no_client_auth()
    }

    pub fn config(&self) -> Arc<ClientConfig> {
        self.config.clone()
    }
}

/// The worker side: its certificate, and the CA whose client
/// certificates it requires (mutual TLS) when one is given.
pub fn server_config(
    identity: &Identity,
    client_ca: Option<&Path>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let (chain, key) = identity.load()?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rejected {
            what: "TLS certificate",
            path: identity.cert.clone(),
            source,
        })?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots("--tls-client-ca", path)?),
                provider(),
            )
            .build()
            .map_err(|e| TlsError::ClientCa {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|source| TlsError::Rejected {
            what: "TLS certificate/key pair",
            path: identity.cert.clone(),
            source,
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
