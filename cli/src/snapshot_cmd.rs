//! `lakecache snapshot create s3://bucket/prefix s3://bucket/manifest.json`:
//! records every object under the prefix (key, size, ETag) in a checked
//! manifest, stored as an object; `lakecache mount --snapshot` pins a
//! mount to it. `snapshot show` prints one after checking it.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use lakecache_protocol::snapshot::{Snapshot, SnapshotEntry, MAX_SNAPSHOT_OBJECTS};
use lakecache_protocol::ObjectUri;
use lakecache_registry::ClusterClient;

use crate::cluster_args::ClusterArgs;
use crate::units::ByteSize;

#[derive(Args)]
pub struct SnapshotCmd {
    #[command(subcommand)]
    action: SnapshotAction,
}

#[derive(Subcommand)]
enum SnapshotAction {
    /// List s3://bucket/prefix and store its manifest at s3://bucket/key
    Create {
        /// The dataset: s3://bucket/prefix
        source: String,
        /// Where the manifest is stored: s3://bucket/key.json
        manifest: String,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// Check a stored manifest and summarise it
    Show {
        manifest: String,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
}

impl SnapshotCmd {
    pub async fn run(self) -> Result<()> {
        match self.action {
            SnapshotAction::Create {
                source,
                manifest,
                cluster,
            } => create(&source, &manifest, &cluster).await,
            SnapshotAction::Show { manifest, cluster } => {
                let client = cluster.connect().await?;
                let snap = load(&client, &manifest).await?;
                let bytes: u64 = snap.objects.iter().map(|o| o.size).sum();
                println!(
                    "snapshot of s3://{}/{}: {} objects, {}, checksum {}",
                    snap.bucket,
                    snap.prefix,
                    snap.objects.len(),
                    ByteSize(bytes).human(),
                    snap.checksum
                );
                Ok(())
            }
        }
    }
}

fn object_uri(s: &str, what: &str) -> Result<ObjectUri> {
    s.parse::<ObjectUri>()
        .map_err(|e| anyhow::anyhow!("{what} {s:?}: {e} (expected s3://bucket/key)"))
}

async fn create(source: &str, manifest: &str, cluster: &ClusterArgs) -> Result<()> {
    let (bucket, prefix) = crate::mount_cmd::parse_source(source)?;
    let target = object_uri(manifest, "manifest")?;
    if target.bucket() == bucket && target.key().starts_with(&prefix) {
        bail!(
            "the manifest {manifest} would be inside the dataset it describes; store it elsewhere"
        );
    }
    let client = cluster.connect().await?;
    let mut objects = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let page = client
            .list(&bucket, &prefix, None, token.as_deref(), Some(1000))
            .await
            .with_context(|| format!("listing {source}"))?;
        for e in page.objects {
            let mut entry = SnapshotEntry {
                key: e.key,
                size: e.size,
                etag: e.etag,
                last_modified_ms: e.last_modified_ms,
                version_id: None,
            };
            // Some S3-compatible stores list without ETags: ask.
            if entry.etag.is_empty() {
                let uri = ObjectUri::new(&bucket, &entry.key)?;
                let stat = client
                    .stat(&uri)
                    .await
                    .with_context(|| format!("HEAD {uri}"))?;
                entry.etag = stat.etag;
                entry.size = stat.size;
            }
            objects.push(entry);
        }
        if objects.len() > MAX_SNAPSHOT_OBJECTS {
            bail!(
                "{source} has more than {MAX_SNAPSHOT_OBJECTS} objects; snapshot a narrower prefix"
            );
        }
        match page.next_token {
            Some(t) => token = Some(t),
            None => break,
        }
    }
    let versioned = record_versions(&client, &bucket, &mut objects).await?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let snap = Snapshot::new(&bucket, &prefix, now_ms, objects);
    let bytes: u64 = snap.objects.iter().map(|o| o.size).sum();
    client
        .put(&target, snap.to_json().into())
        .await
        .with_context(|| format!("storing the manifest at {manifest}"))?;
    println!(
        "snapshot of {source}: {} objects, {}{}, checksum {} -> {manifest}",
        snap.objects.len(),
        ByteSize(bytes).human(),
        if versioned {
            ", with S3 version ids"
        } else {
            ""
        },
        snap.checksum
    );
    Ok(())
}

/// In a versioned bucket, records each object's VersionId (a HEAD each, 32
/// at a time), so a snapshot mount can still read a version after it is
/// overwritten. Size and ETag come from the same HEAD as the version id.
/// Returns whether the bucket is versioned (its first object has one).
async fn record_versions(
    client: &std::sync::Arc<lakecache_registry::ClusterClient>,
    bucket: &str,
    objects: &mut [SnapshotEntry],
) -> Result<bool> {
    use futures::{StreamExt, TryStreamExt};
    let Some(first) = objects.first() else {
        return Ok(false);
    };
    let probe = ObjectUri::new(bucket, &first.key)?;
    match client.current_version(&probe).await {
        Ok(v) if v.version_id.is_some() => {}
        Ok(_) => return Ok(false),
        Err(e) => {
            tracing::warn!(error = %lakecache_protocol::Chain(&e), "cannot ask for version ids; the snapshot pins ETags only");
            return Ok(false);
        }
    }
    let heads: Vec<_> = futures::stream::iter(objects.iter().map(|o| o.key.clone()))
        .map(|key| async move {
            let uri = ObjectUri::new(bucket, &key)?;
            client
                .current_version(&uri)
                .await
                .with_context(|| format!("HEAD {uri} for its version id"))
        })
        .buffered(32)
        .try_collect()
        .await?;
    for (entry, v) in objects.iter_mut().zip(heads) {
        entry.etag = v.etag;
        entry.size = v.size;
        entry.last_modified_ms = v.last_modified_ms;
        entry.version_id = v.version_id;
    }
    Ok(true)
}

/// Reads and checks the manifest stored at `manifest`.
pub async fn load(client: &Arc<ClusterClient>, manifest: &str) -> Result<Snapshot> {
    let uri = object_uri(manifest, "snapshot")?;
    lakecache_fuse::data_plane::load_manifest(client.as_ref(), &uri)
        .await
        .with_context(|| format!("snapshot manifest {manifest}"))
}
