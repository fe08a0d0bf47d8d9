//! Worker membership: who is in the cluster right now.
//!
//! Every implementation publishes its latest view on a `watch` channel;
//! clients rebuild their ring from it. When the source goes away (etcd
//! down), the last known view stays published.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, PutOptions, WatchOptions};
use lakecache_protocol::member_sig::MemberSigner;

use crate::etcd_access::{decode_member, encode_member, EtcdAccess};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// One worker as the cluster knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub id: String,
    /// `HOST:PORT` of the worker's HTTP API.
    pub address: String,
    /// Cache capacity in bytes (for weighting and status).
    pub capacity: u64,
}

pub type View = Arc<Vec<Member>>;

#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    #[error("cannot reach etcd at {endpoints}: {message}")]
    Unreachable { endpoints: String, message: String },
    #[error("etcd error: {0}")]
    Etcd(String),
    #[error("cannot read members file {path}: {message}")]
    File { path: PathBuf, message: String },
}

pub trait Membership: Send + Sync + 'static {
    /// The latest view; the receiver sees every later change.
    fn subscribe(&self) -> watch::Receiver<View>;
    /// For logs and errors: where membership comes from.
    fn describe(&self) -> String;
}

/// A fixed list of addresses (ids are the addresses), or a members file
/// (one `HOST:PORT` per line) reloaded when it changes.
pub struct StaticMembership {
    tx: watch::Sender<View>,
    source: String,
    _reload: Option<tokio::task::JoinHandle<()>>,
}

fn members_from(addresses: &[String]) -> Vec<Member> {
    addresses
        .iter()
        .map(|a| a.trim())
        .filter(|a| !a.is_empty() && !a.starts_with('#'))
        .map(|a| Member {
            id: a.to_string(),
            address: a.to_string(),
            capacity: 0,
        })
        .collect()
}

impl StaticMembership {
    pub fn new(addresses: &[String]) -> Self {
        let (tx, _) = watch::channel(Arc::new(members_from(addresses)));
        Self {
            tx,
            source: format!("static:{}", addresses.join(",")),
            _reload: None,
        }
    }

    /// Reads `path` now and re-reads it every `every`.
    pub fn from_file(path: PathBuf, every: Duration) -> Result<Self, MembershipError> {
        let read = |path: &PathBuf| -> Result<Vec<Member>, MembershipError> {
            let text = std::fs::read_to_string(path).map_err(|e| MembershipError::File {
                path: path.clone(),
                message: e.to_string(),
            })?;
            Ok(members_from(
                &text.lines().map(str::to_string).collect::<Vec<_>>(),
            ))
        };
        let (tx, _) = watch::channel(Arc::new(read(&path)?));
        let sender = tx.clone();
        let file = path.clone();
        let reload = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match read(&file) {
                    Ok(members) => {
                        sender.send_if_modified(|current| {
                            let changed = **current != members;
                            if changed {
                                tracing::info!(members = members.len(), "members file changed");
                                *current = Arc::new(members.clone());
                            }
                            changed
                        });
                    }
                    Err(e) => tracing::warn!(error = %e, "keeping last members list"),
                }
            }
        });
        Ok(Self {
            tx,
            source: format!("file:{}", path.display()),
            _reload: Some(reload),
        })
    }
}

impl Membership for StaticMembership {
    fn subscribe(&self) -> watch::Receiver<View> {
        self.tx.subscribe()
    }

    fn describe(&self) -> String {
        self.source.clone()
    }
}

impl Drop for StaticMembership {
    fn drop(&mut self) {
        if let Some(task) = &self._reload {
            task.abort();
        }
    }
}

fn members_key(prefix: &str) -> String {
    format!("{}/members/", prefix.trim_end_matches('/'))
}

pub(crate) async fn connect(
    endpoints: &[String],
    access: &EtcdAccess,
    timeout: Duration,
) -> Result<Client, MembershipError> {
    let options = access.connect_options(timeout)?;
    let unreachable = |message: String| MembershipError::Unreachable {
        endpoints: endpoints.join(","),
        message,
    };
    let client = tokio::time::timeout(timeout, Client::connect(endpoints, Some(options)))
        .await
        .map_err(|_| unreachable(format!("no answer within {timeout:?}")))?
        .map_err(|e| unreachable(e.to_string()))?;
    Ok(client)
}

/// Members registered under `<prefix>/members/` in etcd: listed, then
/// watched. Lost connections are retried forever; meanwhile the last view
/// stays published.
pub struct EtcdMembership {
    tx: watch::Sender<View>,
    source: String,
    task: tokio::task::JoinHandle<()>,
}

impl EtcdMembership {
    /// Connects and lists once, so an unreachable etcd is an error here.
    pub async fn connect(
        endpoints: Vec<String>,
        prefix: String,
        access: EtcdAccess,
        timeout: Duration,
    ) -> Result<Self, MembershipError> {
        let mut client = connect(&endpoints, &access, timeout).await?;
        let key = members_key(&prefix);
        let (members, revision) = list(&mut client, &key, &access, timeout)
            .await
            .map_err(|e| MembershipError::Unreachable {
                endpoints: endpoints.join(","),
                message: e.to_string(),
            })?;
        let (tx, _) = watch::channel(Arc::new(members.values().cloned().collect::<Vec<_>>()));
        let sender = tx.clone();
        let source = format!("etcd://{}{}", endpoints.join(","), prefix);
        let task = tokio::spawn(watch_loop(
            endpoints, access, key, timeout, sender, client, members, revision,
        ));
        Ok(Self { tx, source, task })
    }
}

impl Membership for EtcdMembership {
    fn subscribe(&self) -> watch::Receiver<View> {
        self.tx.subscribe()
    }

    fn describe(&self) -> String {
        self.source.clone()
    }
}

impl Drop for EtcdMembership {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn list(
    client: &mut Client,
    key: &str,
    access: &EtcdAccess,
    timeout: Duration,
) -> Result<(BTreeMap<String, Member>, i64), MembershipError> {
    let resp = tokio::time::timeout(
        timeout,
        client.get(key, Some(GetOptions::new().with_prefix())),
    )
    .await
    .map_err(|_| MembershipError::Etcd(format!("listing {key} timed out")))?
    .map_err(|e| MembershipError::Etcd(e.to_string()))?;
    let mut members = BTreeMap::new();
    for kv in resp.kvs() {
        let k = String::from_utf8_lossy(kv.key()).into_owned();
        if let Some(m) = decode_member(&k, kv.value(), &access.trust) {
            members.insert(k, m);
        }
    }
    let revision = resp.header().map_or(0, |h| h.revision());
    Ok((members, revision))
}

fn publish(tx: &watch::Sender<View>, members: &BTreeMap<String, Member>) {
    let view: Vec<Member> = members.values().cloned().collect();
    tx.send_if_modified(|current| {
        let changed = **current != view;
        if changed {
            tracing::info!(members = view.len(), "membership changed");
            *current = Arc::new(view.clone());
        }
        changed
    });
}

#[allow(clippy::too_many_arguments)]
async fn watch_loop(
    endpoints: Vec<String>,
    access: EtcdAccess,
    key: String,
    timeout: Duration,
    tx: watch::Sender<View>,
    first_client: Client,
    mut members: BTreeMap<String, Member>,
    mut revision: i64,
) {
    let mut client = Some(first_client);
    let mut backoff = Duration::from_millis(500);
    loop {
        let result: Result<(), MembershipError> = async {
            let mut c = match client.take() {
                Some(c) => c,
                None => {
                    let mut c = connect(&endpoints, &access, timeout).await?;
                    // Relist: events may have been missed while away.
                    let (fresh, rev) = list(&mut c, &key, &access, timeout).await?;
                    members = fresh;
                    revision = rev;
                    publish(&tx, &members);
                    c
                }
            };
            let options = WatchOptions::new()
                .with_prefix()
                .with_start_revision(revision + 1);
            let mut stream = c
                .watch(key.as_str(), Some(options))
                .await
                .map_err(|e| MembershipError::Etcd(e.to_string()))?;
            backoff = Duration::from_millis(500);
            while let Some(resp) = stream
                .message()
                .await
                .map_err(|e| MembershipError::Etcd(e.to_string()))?
            {
                if resp.canceled() {
                    return Err(MembershipError::Etcd(format!(
                        "watch canceled: {}",
                        resp.cancel_reason()
                    )));
                }
                for event in resp.events() {
                    let Some(kv) = event.kv() else { continue };
                    let k = String::from_utf8_lossy(kv.key()).into_owned();
                    revision = revision.max(kv.mod_revision());
                    match event.event_type() {
                        EventType::Put => match decode_member(&k, kv.value(), &access.trust) {
                            Some(m) => {
                                members.insert(k, m);
                            }
                            // A replaced record that no longer verifies leaves.
                            None => {
                                members.remove(&k);
                            }
                        },
                        EventType::Delete => {
                            members.remove(&k);
                        }
                    }
                }
                publish(&tx, &members);
            }
            Err(MembershipError::Etcd("watch stream ended".into()))
        }
        .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, members = members.len(), "etcd watch lost; keeping the last known members and retrying");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// A worker's own registration: `{id, address, capacity}` under a lease
/// that is kept alive; re-registered whenever the lease is lost.
pub struct EtcdRegistration {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

struct Registered {
    client: Client,
    lease: i64,
}

async fn register(
    endpoints: &[String],
    access: &EtcdAccess,
    key: &str,
    value: &[u8],
    ttl: Duration,
    timeout: Duration,
) -> Result<Registered, MembershipError> {
    let mut client = connect(endpoints, access, timeout).await?;
    let etcd = |e: etcd_client::Error| MembershipError::Etcd(e.to_string());
    let lease = tokio::time::timeout(
        timeout,
        client.lease_grant(ttl.as_secs().max(1) as i64, None),
    )
    .await
    .map_err(|_| MembershipError::Etcd("lease grant timed out".into()))?
    .map_err(etcd)?
    .id();
    tokio::time::timeout(
        timeout,
        client.put(key, value, Some(PutOptions::new().with_lease(lease))),
    )
    .await
    .map_err(|_| MembershipError::Etcd("registration put timed out".into()))?
    .map_err(etcd)?;
    Ok(Registered { client, lease })
}

/// Keeps one lease alive until it is lost (error) or `stop` fires (Ok).
async fn keep_alive(
    reg: &mut Registered,
    ttl: Duration,
    stop: &mut tokio::sync::oneshot::Receiver<()>,
) -> Result<(), MembershipError> {
    let etcd = |e: etcd_client::Error| MembershipError::Etcd(e.to_string());
    let (mut keeper, mut stream) = reg.client.lease_keep_alive(reg.lease).await.map_err(etcd)?;
    let every = (ttl / 3).max(Duration::from_millis(300));
    loop {
        tokio::select! {
            _ = &mut *stop => return Ok(()),
            () = tokio::time::sleep(every) => {}
        }
        keeper.keep_alive().await.map_err(etcd)?;
        match tokio::time::timeout(ttl, stream.message()).await {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => {}
            Ok(Ok(_)) => return Err(MembershipError::Etcd("lease expired".into())),
            Ok(Err(e)) => return Err(etcd(e)),
            Err(_) => return Err(MembershipError::Etcd("keep-alive timed out".into())),
        }
    }
}

impl EtcdRegistration {
    /// Registers once (errors are returned), then keeps the registration
    /// alive in the background.
    /// With `signer`, the record carries signatures by the cluster's
    /// keys (clients with tokens ignore unsigned records).
    pub async fn start(
        endpoints: Vec<String>,
        prefix: String,
        access: EtcdAccess,
        member: Member,
        signer: Option<&MemberSigner>,
        ttl: Duration,
        timeout: Duration,
    ) -> Result<Self, MembershipError> {
        let key = format!("{}{}", members_key(&prefix), member.id);
        let value = encode_member(&key, &member, signer)?;
        let first = register(&endpoints, &access, &key, &value, ttl, timeout)
            .await
            .map_err(|e| match e {
                MembershipError::Etcd(message) => MembershipError::Unreachable {
                    endpoints: endpoints.join(","),
                    message,
                },
                other => other,
            })?;
        tracing::info!(%key, lease = first.lease, "registered in etcd");
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut current = Some(first);
            loop {
                let mut reg = match current.take() {
                    Some(r) => r,
                    None => match register(&endpoints, &access, &key, &value, ttl, timeout).await {
                        Ok(r) => {
                            tracing::info!(%key, lease = r.lease, "re-registered in etcd");
                            r
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "re-registering failed; retrying");
                            tokio::select! {
                                _ = &mut stop_rx => return,
                                () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                            }
                        }
                    },
                };
                match keep_alive(&mut reg, ttl, &mut stop_rx).await {
                    Ok(()) => {
                        // Leave at once instead of waiting for the TTL.
                        let _ =
                            tokio::time::timeout(timeout, reg.client.lease_revoke(reg.lease)).await;
                        return;
                    }
                    Err(e) => tracing::warn!(error = %e, "lost the etcd lease; re-registering"),
                }
            }
        });
        Ok(Self {
            stop: Some(stop_tx),
            task,
        })
    }

    /// Deregisters (revokes the lease) and stops.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.task).await;
    }
}

impl Drop for EtcdRegistration {
    fn drop(&mut self) {
        if self.stop.is_some() {
            self.task.abort();
        }
    }
}
