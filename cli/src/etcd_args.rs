//! etcd credentials and TLS, shared by workers and clients.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use lakecache_protocol::member_sig::MemberTrust;
use lakecache_registry::EtcdAccess;
use serde::Deserialize;

#[derive(Debug, Clone, Default, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdArgs {
    /// etcd user (etcd auth enabled); its password comes from
    /// --etcd-password-file
    #[arg(long, env = "LAKECACHE_ETCD_USER", requires = "etcd_password_file")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password
    #[arg(long, env = "LAKECACHE_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    pub etcd_password_file: Option<PathBuf>,
    /// PEM CA of etcd's server certificate: etcd is then spoken to over TLS
    #[arg(long, env = "LAKECACHE_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate for etcd's --client-cert-auth
    #[arg(long, env = "LAKECACHE_ETCD_CERT", requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,
    /// Key of --etcd-cert
    #[arg(long, env = "LAKECACHE_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
}

impl EtcdArgs {
    /// `self` wins over `under` field by field.
    pub fn over(self, under: EtcdArgs) -> EtcdArgs {
        EtcdArgs {
            etcd_user: self.etcd_user.or(under.etcd_user),
            etcd_password_file: self.etcd_password_file.or(under.etcd_password_file),
            etcd_ca: self.etcd_ca.or(under.etcd_ca),
            etcd_cert: self.etcd_cert.or(under.etcd_cert),
            etcd_key: self.etcd_key.or(under.etcd_key),
        }
    }

    pub fn access(&self, trust: MemberTrust) -> Result<EtcdAccess> {
        let password = match &self.etcd_password_file {
            None => None,
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading --etcd-password-file {}", path.display()))?;
                Some(text.trim_end_matches(['\n', '\r']).to_string())
            }
        };
        anyhow::ensure!(
            self.etcd_user.is_some() == password.is_some(),
            "--etcd-user and --etcd-password-file go together"
        );
        anyhow::ensure!(
            self.etcd_cert.is_some() == self.etcd_key.is_some(),
            "--etcd-cert and --etcd-key go together"
        );
        anyhow::ensure!(
            self.etcd_cert.is_none() || self.etcd_ca.is_some(),
            "--etcd-cert needs --etcd-ca"
        );
        Ok(EtcdAccess {
            user: self.etcd_user.clone(),
            password,
            ca: self.etcd_ca.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
            trust,
        })
    }
}
