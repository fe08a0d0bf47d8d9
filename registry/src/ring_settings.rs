//! The placement settings one cluster shares, advertised in etcd.
//!
//! Every client and worker must hash with the same segment size and vnode
//! count, or they disagree about owners: reads miss, written pages land on
//! the wrong worker. The first worker to join an etcd registry records its
//! settings at `<prefix>/ring`; a worker with other settings refuses to
//! start, and clients take the recorded ones.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use serde::{Deserialize, Serialize};

use crate::etcd_access::EtcdAccess;
use crate::membership::{connect, MembershipError};
use crate::ring::RingOptions;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingSettings {
    pub segment_size: u64,
    pub vnodes: u32,
}

impl RingSettings {
    pub fn of(options: &RingOptions) -> Self {
        Self {
            segment_size: options.segment_size,
            vnodes: options.vnodes,
        }
    }
}

impl std::fmt::Display for RingSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "segment size {} bytes, {} vnodes",
            self.segment_size, self.vnodes
        )
    }
}

fn ring_key(prefix: &str) -> String {
    format!("{}/ring", prefix.trim_end_matches('/'))
}

fn etcd(e: impl std::fmt::Display) -> MembershipError {
    MembershipError::Etcd(e.to_string())
}

/// A failed request here means etcd is not answering: say where.
fn unreachable(endpoints: &[String]) -> impl Fn(MembershipError) -> MembershipError + '_ {
    move |e| match e {
        MembershipError::Etcd(message) => MembershipError::Unreachable {
            endpoints: endpoints.join(","),
            message,
        },
        other => other,
    }
}

fn decode(raw: &[u8], key: &str) -> Result<RingSettings, MembershipError> {
    serde_json::from_slice(raw).map_err(|e| {
        MembershipError::Etcd(format!(
            "{key} holds {:?}, not ring settings: {e}",
            String::from_utf8_lossy(raw)
        ))
    })
}

/// Records `wanted` unless settings are already recorded; returns the
/// recorded ones (compare them with `wanted`).
pub async fn claim_ring_settings(
    endpoints: &[String],
    access: &EtcdAccess,
    prefix: &str,
    wanted: RingSettings,
    timeout: Duration,
) -> Result<RingSettings, MembershipError> {
    let mut client = connect(endpoints, access, timeout).await?;
    let key = ring_key(prefix);
    let value = serde_json::to_vec(&wanted).map_err(etcd)?;
    let txn = Txn::new()
        .when([Compare::version(key.as_str(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key.as_str(), value, None)])
        .or_else([TxnOp::get(key.as_str(), None)]);
    let resp = tokio::time::timeout(timeout, client.txn(txn))
        .await
        .map_err(|_| MembershipError::Etcd(format!("recording {key} timed out")))
        .and_then(|r| r.map_err(etcd))
        .map_err(unreachable(endpoints))?;
    if resp.succeeded() {
        tracing::info!(%key, settings = %wanted, "recorded the cluster's ring settings");
        return Ok(wanted);
    }
    for op in resp.op_responses() {
        if let TxnOpResponse::Get(get) = op {
            if let Some(kv) = get.kvs().first() {
                return decode(kv.value(), &key);
            }
        }
    }
    Err(MembershipError::Etcd(format!(
        "{key} vanished while it was read"
    )))
}

/// The recorded settings, if a worker has recorded any.
pub async fn advertised_ring_settings(
    endpoints: &[String],
    access: &EtcdAccess,
    prefix: &str,
    timeout: Duration,
) -> Result<Option<RingSettings>, MembershipError> {
    let mut client = connect(endpoints, access, timeout).await?;
    let key = ring_key(prefix);
    let resp = tokio::time::timeout(timeout, client.get(key.as_str(), None))
        .await
        .map_err(|_| MembershipError::Etcd(format!("reading {key} timed out")))
        .and_then(|r| r.map_err(etcd))
        .map_err(unreachable(endpoints))?;
    resp.kvs()
        .first()
        .map(|kv| decode(kv.value(), &key))
        .transpose()
}
