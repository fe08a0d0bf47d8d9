//! A mount pinned to a dataset snapshot: listings and stats come from the
//! manifest, every read asks for the manifest's version, and an object
//! that changed in S3 since the snapshot fails with both ETags named,
//! never with the new bytes. Writes are refused.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use lakecache_protocol::snapshot::{Snapshot, SnapshotError};
use lakecache_protocol::{ListResponse, ObjectStat, ObjectUri, UserMeta, WriteMode};

use super::{read_exact, ByteStream, DataError, DataPlane};

/// Why a snapshot manifest could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("reading the snapshot manifest: {0}")]
    Read(#[from] DataError),
    #[error(transparent)]
    Invalid(#[from] SnapshotError),
}

/// Reads the manifest stored at `uri` (at its current ETag) and checks it.
pub async fn load_manifest(
    data: &dyn DataPlane,
    uri: &ObjectUri,
) -> Result<Snapshot, ManifestError> {
    let stat = data.stat(uri).await?;
    let bytes = read_exact(data, uri, 0..stat.size, &stat.etag).await?;
    Ok(Snapshot::from_json(&bytes)?)
}

pub struct SnapshotDataPlane {
    inner: Arc<dyn DataPlane>,
    snapshot: Snapshot,
}

impl SnapshotDataPlane {
    pub fn new(inner: Arc<dyn DataPlane>, snapshot: Snapshot) -> Self {
        Self { inner, snapshot }
    }

    fn entry(
        &self,
        uri: &ObjectUri,
    ) -> Result<&lakecache_protocol::snapshot::SnapshotEntry, DataError> {
        if uri.bucket() != self.snapshot.bucket {
            return Err(DataError::NotFound);
        }
        self.snapshot.get(uri.key()).ok_or(DataError::NotFound)
    }

    /// The error for an object no longer readable at its pinned ETag,
    /// naming what S3 has now.
    async fn mismatch(&self, uri: &ObjectUri, pinned: String) -> DataError {
        let current = match self.inner.stat(uri).await {
            Ok(s) => s.etag,
            Err(DataError::NotFound) => "(deleted)".to_string(),
            Err(e) => format!("(unknown: {e})"),
        };
        DataError::SnapshotMismatch {
            key: uri.to_string(),
            pinned,
            current,
        }
    }

    fn read_only() -> DataError {
        DataError::Denied("the mount is pinned to a snapshot and is read-only".to_string())
    }
}

#[async_trait::async_trait]
impl DataPlane for SnapshotDataPlane {
    async fn stat(&self, uri: &ObjectUri) -> Result<ObjectStat, DataError> {
        let e = self.entry(uri)?;
        Ok(ObjectStat {
            uri: uri.to_string(),
            size: e.size,
            etag: e.etag.clone(),
            last_modified_ms: e.last_modified_ms,
            written_as: None,
            meta: UserMeta::new(),
            held_by: None,
        })
    }

    async fn read(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        _etag: &str,
    ) -> Result<Bytes, DataError> {
        let entry = self.entry(uri)?;
        let pinned = entry.etag.clone();
        let version = entry.version_id.clone();
        match self.inner.read(uri, range.clone(), &pinned).await {
            // A versioned bucket still has the recorded version: read it.
            Err(DataError::Changed { .. } | DataError::NotFound) if version.is_some() => {
                let v = version.as_deref().unwrap_or_default();
                match self.inner.read_version(uri, range, v, &pinned).await {
                    Ok(bytes) => Ok(bytes),
                    Err(e) => {
                        tracing::warn!(%uri, version = v, error = %e, "pinned version not readable");
                        Err(self.mismatch(uri, pinned).await)
                    }
                }
            }
            Err(DataError::Changed { .. }) => Err(self.mismatch(uri, pinned).await),
            other => other,
        }
    }

    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, DataError> {
        if bucket != self.snapshot.bucket {
            return Ok(ListResponse::default());
        }
        let max = max_keys.unwrap_or(1000) as usize;
        Ok(self.snapshot.list(prefix, delimiter, token, max))
    }

    async fn put(&self, _: &ObjectUri, _: Bytes, _: &UserMeta) -> Result<ObjectStat, DataError> {
        Err(Self::read_only())
    }

    async fn upload(
        &self,
        _: &ObjectUri,
        _: ByteStream,
        _: super::UploadLimits,
        _: WriteMode,
        _: &UserMeta,
        _: &[String],
    ) -> Result<ObjectStat, DataError> {
        Err(Self::read_only())
    }

    async fn delete(&self, _: &ObjectUri) -> Result<(), DataError> {
        Err(Self::read_only())
    }

    async fn copy(
        &self,
        _: &ObjectUri,
        _: Option<&str>,
        _: &ObjectUri,
        _: Option<&UserMeta>,
    ) -> Result<ObjectStat, DataError> {
        Err(Self::read_only())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data_plane::MemoryDataPlane;
    use lakecache_protocol::snapshot::SnapshotEntry;

    #[tokio::test]
    async fn reads_are_pinned_and_a_changed_object_names_both_versions() {
        let memory = Arc::new(MemoryDataPlane::new());
        let a = ObjectUri::new("data", "ds/a.bin").unwrap();
        let b = ObjectUri::new("data", "ds/b.bin").unwrap();
        let sa = memory
            .put(&a, Bytes::from_static(b"aaaa"), &UserMeta::new())
            .await
            .unwrap();
        let sb = memory
            .put(&b, Bytes::from_static(b"bbbb"), &UserMeta::new())
            .await
            .unwrap();
        let entry = |s: &ObjectStat, key: &str| SnapshotEntry {
            key: key.into(),
            size: s.size,
            etag: s.etag.clone(),
            last_modified_ms: s.last_modified_ms,
            version_id: None,
        };
        let snap = Snapshot::new(
            "data",
            "ds/",
            0,
            vec![entry(&sa, "ds/a.bin"), entry(&sb, "ds/b.bin")],
        );
        let plane = SnapshotDataPlane::new(memory.clone(), snap);
        // Changed behind the snapshot, and a new object added.
        let sb2 = memory
            .put(&b, Bytes::from_static(b"BBBB"), &UserMeta::new())
            .await
            .unwrap();
        let c = ObjectUri::new("data", "ds/c.bin").unwrap();
        memory
            .put(&c, Bytes::from_static(b"c"), &UserMeta::new())
            .await
            .unwrap();

        assert_eq!(&plane.read(&a, 0..4, "ignored").await.unwrap()[..], b"aaaa");
        match plane.read(&b, 0..4, &sb2.etag).await {
            Err(DataError::SnapshotMismatch {
                key,
                pinned,
                current,
            }) => {
                assert_eq!(key, "s3://data/ds/b.bin");
                assert_eq!(pinned, sb.etag);
                assert_eq!(current, sb2.etag);
            }
            other => panic!("expected a snapshot mismatch, got {other:?}"),
        }
        assert!(matches!(plane.stat(&c).await, Err(DataError::NotFound)));
        let listing = plane
            .list("data", "ds/", Some("/"), None, None)
            .await
            .unwrap();
        assert_eq!(listing.objects.len(), 2);
        assert!(matches!(
            plane.put(&c, Bytes::new(), &UserMeta::new()).await,
            Err(DataError::Denied(_))
        ));
    }
}
