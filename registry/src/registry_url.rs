//! `--registry` values: `static:ADDR,ADDR`, `file:/path`, or
//! `etcd://HOST:PORT[,HOST:PORT][/prefix]`.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use crate::etcd_access::EtcdAccess;
use crate::membership::{EtcdMembership, Membership, MembershipError, StaticMembership};
use crate::ring_settings::{advertised_ring_settings, claim_ring_settings, RingSettings};

pub const DEFAULT_PREFIX: &str = "/lakecache";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistryUrl {
    Static(Vec<String>),
    File(PathBuf),
    Etcd {
        endpoints: Vec<String>,
        prefix: String,
        /// Credentials, TLS and member trust; set from flags after parsing.
        access: EtcdAccess,
    },
}

fn valid_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

impl FromStr for RegistryUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(list) = s.strip_prefix("static:") {
            let addrs: Vec<String> = list
                .split(',')
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .map(str::to_string)
                .collect();
            if addrs.is_empty() {
                return Err("static: registry needs at least one HOST:PORT".into());
            }
            if let Some(bad) = addrs.iter().find(|a| !valid_host_port(a)) {
                return Err(format!(
                    "invalid worker address {bad:?} in --registry: expected HOST:PORT"
                ));
            }
            return Ok(RegistryUrl::Static(addrs));
        }
        if let Some(path) = s.strip_prefix("file:") {
            if path.is_empty() {
                return Err("file: registry needs a path".into());
            }
            return Ok(RegistryUrl::File(PathBuf::from(path)));
        }
        if let Some(rest) = s.strip_prefix("etcd://") {
            let (hosts, prefix) = match rest.find('/') {
                Some(i) => (&rest[..i], rest[i..].trim_end_matches('/').to_string()),
                None => (rest, DEFAULT_PREFIX.to_string()),
            };
            let endpoints: Vec<String> = hosts
                .split(',')
                .map(str::trim)
                .filter(|h| !h.is_empty())
                .map(str::to_string)
                .collect();
            if endpoints.is_empty() {
                return Err("etcd:// registry needs HOST:PORT".into());
            }
            if let Some(bad) = endpoints.iter().find(|a| !valid_host_port(a)) {
                return Err(format!("invalid etcd endpoint {bad:?}: expected HOST:PORT"));
            }
            let prefix = if prefix.is_empty() {
                DEFAULT_PREFIX.to_string()
            } else {
                prefix
            };
            return Ok(RegistryUrl::Etcd {
                endpoints,
                prefix,
                access: EtcdAccess::default(),
            });
        }
        Err(format!(
            "unsupported registry {s:?}: use static:HOST:PORT[,HOST:PORT], file:/path or etcd://HOST:PORT[/prefix]"
        ))
    }
}

impl RegistryUrl {
    /// Opens the membership source (for etcd: connects and lists).
    pub async fn open(&self, timeout: Duration) -> Result<Arc<dyn Membership>, MembershipError> {
        Ok(match self {
            RegistryUrl::Static(addrs) => Arc::new(StaticMembership::new(addrs)),
            RegistryUrl::File(path) => Arc::new(StaticMembership::from_file(
                path.clone(),
                Duration::from_secs(2),
            )?),
            RegistryUrl::Etcd {
                endpoints,
                prefix,
                access,
            } => Arc::new(
                EtcdMembership::connect(
                    access.urls(endpoints),
                    prefix.clone(),
                    access.clone(),
                    timeout,
                )
                .await?,
            ),
        })
    }

    /// etcd registries: records `wanted` as the cluster's ring settings
    /// unless some are recorded, and returns the recorded ones. Static
    /// and file registries record nothing (`None`).
    pub async fn claim_ring(
        &self,
        wanted: RingSettings,
        timeout: Duration,
    ) -> Result<Option<RingSettings>, MembershipError> {
        match self {
            RegistryUrl::Etcd {
                endpoints,
                prefix,
                access,
            } => claim_ring_settings(&access.urls(endpoints), access, prefix, wanted, timeout)
                .await
                .map(Some),
            _ => Ok(None),
        }
    }

    /// etcd registries: the ring settings a worker recorded, if any.
    pub async fn advertised_ring(
        &self,
        timeout: Duration,
    ) -> Result<Option<RingSettings>, MembershipError> {
        match self {
            RegistryUrl::Etcd {
                endpoints,
                prefix,
                access,
            } => advertised_ring_settings(&access.urls(endpoints), access, prefix, timeout).await,
            _ => Ok(None),
        }
    }
}

impl RegistryUrl {
    /// The same registry with etcd credentials, TLS and member trust
    /// (static and file registries have none).
    pub fn with_etcd_access(mut self, new: EtcdAccess) -> Self {
        if let RegistryUrl::Etcd { access, .. } = &mut self {
            *access = new;
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!(
            "static:127.0.0.1:9500,h:1".parse(),
            Ok(RegistryUrl::Static(vec![
                "127.0.0.1:9500".into(),
                "h:1".into()
            ]))
        );
        assert_eq!(
            "etcd://e1:2379,e2:2379/prod/cache".parse(),
            Ok(RegistryUrl::Etcd {
                endpoints: vec!["e1:2379".into(), "e2:2379".into()],
                prefix: "/prod/cache".into(),
                access: EtcdAccess::default(),
            })
        );
        assert_eq!(
            "etcd://e1:2379".parse(),
            Ok(RegistryUrl::Etcd {
                endpoints: vec!["e1:2379".into()],
                prefix: DEFAULT_PREFIX.into(),
                access: EtcdAccess::default(),
            })
        );
        assert_eq!(
            "file:/etc/members".parse(),
            Ok(RegistryUrl::File("/etc/members".into()))
        );
        for bad in [
            "static:",
            "static:nohost",
            "etcd://",
            "etcd://h:notaport",
            "zk://x:1",
            "file:",
        ] {
            assert!(bad.parse::<RegistryUrl>().is_err(), "{bad} accepted");
        }
    }
}
