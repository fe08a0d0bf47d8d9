//! Dataset snapshots: a manifest of every object under a prefix (key,
//! size, ETag) that a mount can be pinned to, so a run can be repeated on
//! exactly the same bytes months later. The manifest carries a SHA-256
//! over its own contents, checked whenever it is read.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The manifest format this build writes and reads.
pub const SNAPSHOT_FORMAT: &str = "lakecache-snapshot/1";

/// Refuses manifests that would not fit a mount's memory (about 200 bytes
/// per object).
pub const MAX_SNAPSHOT_OBJECTS: usize = 10_000_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotEntry {
    /// The full S3 key.
    pub key: String,
    pub size: u64,
    pub etag: String,
    pub last_modified_ms: i64,
    /// The S3 version, when the bucket is versioned and the lister gave it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    pub format: String,
    pub bucket: String,
    /// The prefix that was listed (may be empty: the whole bucket).
    pub prefix: String,
    pub created_ms: i64,
    /// Sorted by key, no duplicates.
    pub objects: Vec<SnapshotEntry>,
    /// Hex SHA-256 of the manifest with this field empty.
    #[serde(default)]
    pub checksum: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SnapshotError {
    #[error("not a lakecache snapshot manifest: {0}")]
    Parse(String),
    #[error("manifest format {found:?} is not {SNAPSHOT_FORMAT:?} (written by another lakecache version)")]
    Format { found: String },
    #[error("manifest checksum mismatch: it says {stated}, its contents hash to {actual} (edited or damaged)")]
    Checksum { stated: String, actual: String },
    #[error("manifest lists {0:?} twice or out of order")]
    Order(String),
    #[error("manifest key {key:?} is not under its prefix {prefix:?}")]
    OutsidePrefix { key: String, prefix: String },
    #[error("manifest has {0} objects; at most {MAX_SNAPSHOT_OBJECTS} are supported")]
    TooLarge(usize),
}

impl Snapshot {
    /// A sealed manifest of `objects` (sorted here).
    pub fn new(
        bucket: &str,
        prefix: &str,
        created_ms: i64,
        mut objects: Vec<SnapshotEntry>,
    ) -> Self {
        objects.sort_by(|a, b| a.key.cmp(&b.key));
        objects.dedup_by(|a, b| a.key == b.key);
        let mut s = Self {
            format: SNAPSHOT_FORMAT.into(),
            bucket: bucket.into(),
            prefix: prefix.into(),
            created_ms,
            objects,
            checksum: String::new(),
        };
        s.checksum = s.digest();
        s
    }

    fn digest(&self) -> String {
        let unsealed = Self {
            checksum: String::new(),
            ..self.clone()
        };
        // Field order is fixed by the struct, so the bytes are canonical.
        let bytes = serde_json::to_vec(&unsealed).unwrap_or_default();
        hex::encode(Sha256::digest(&bytes))
    }

    pub fn to_json(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec_pretty(self).unwrap_or_default();
        out.push(b'\n');
        out
    }

    /// Parses and checks a manifest: format, checksum, order, prefix.
    pub fn from_json(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let s: Self =
            serde_json::from_slice(bytes).map_err(|e| SnapshotError::Parse(e.to_string()))?;
        if s.format != SNAPSHOT_FORMAT {
            return Err(SnapshotError::Format { found: s.format });
        }
        if s.objects.len() > MAX_SNAPSHOT_OBJECTS {
            return Err(SnapshotError::TooLarge(s.objects.len()));
        }
        let actual = s.digest();
        if actual != s.checksum {
            return Err(SnapshotError::Checksum {
                stated: s.checksum,
                actual,
            });
        }
        for w in s.objects.windows(2) {
            if w[0].key >= w[1].key {
                return Err(SnapshotError::Order(w[1].key.clone()));
            }
        }
        if let Some(e) = s.objects.iter().find(|e| !e.key.starts_with(&s.prefix)) {
            return Err(SnapshotError::OutsidePrefix {
                key: e.key.clone(),
                prefix: s.prefix.clone(),
            });
        }
        Ok(s)
    }

    /// The entry for `key`, if the snapshot has it.
    pub fn get(&self, key: &str) -> Option<&SnapshotEntry> {
        self.objects
            .binary_search_by(|e| e.key.as_str().cmp(key))
            .ok()
            .map(|i| &self.objects[i])
    }

    /// One page of a listing of the snapshot, like ListObjectsV2: keys
    /// under `prefix` after `after`, folded at `delimiter`.
    pub fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        after: Option<&str>,
        max_keys: usize,
    ) -> crate::ListResponse {
        let start = self.objects.partition_point(|e| {
            e.key.as_str() < prefix || after.is_some_and(|a| e.key.as_str() <= a)
        });
        let mut out = crate::ListResponse::default();
        let mut last = None;
        for e in self.objects[start..]
            .iter()
            .take_while(|e| e.key.starts_with(prefix))
        {
            if out.objects.len() + out.common_prefixes.len() >= max_keys.max(1) {
                out.next_token = last;
                return out;
            }
            let rest = &e.key[prefix.len()..];
            match delimiter.and_then(|d| rest.find(d).map(|i| i + d.len())) {
                Some(end) => {
                    let common = format!("{prefix}{}", &rest[..end]);
                    if out.common_prefixes.last() != Some(&common) {
                        out.common_prefixes.push(common.clone());
                    }
                    // Continue after everything under this common prefix.
                    last = Some(format!("{common}\u{10FFFF}"));
                }
                None => {
                    out.objects.push(crate::ListEntry {
                        key: e.key.clone(),
                        size: e.size,
                        etag: e.etag.clone(),
                        last_modified_ms: e.last_modified_ms,
                        meta: None,
                    });
                    last = Some(e.key.clone());
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str) -> SnapshotEntry {
        SnapshotEntry {
            key: key.into(),
            size: key.len() as u64,
            etag: format!("etag-{key}"),
            last_modified_ms: 1,
            version_id: None,
        }
    }

    #[test]
    fn a_manifest_round_trips_and_any_edit_is_caught() {
        let s = Snapshot::new(
            "data",
            "ds/",
            7,
            vec![entry("ds/b"), entry("ds/a"), entry("ds/a")],
        );
        assert_eq!(s.objects.len(), 2);
        let json = s.to_json();
        assert_eq!(Snapshot::from_json(&json).unwrap(), s);
        let edited = String::from_utf8(json.clone())
            .unwrap()
            .replace("etag-ds/a", "etag-ds/x");
        assert!(matches!(
            Snapshot::from_json(edited.as_bytes()),
            Err(SnapshotError::Checksum { .. })
        ));
        let other = String::from_utf8(json)
            .unwrap()
            .replace(SNAPSHOT_FORMAT, "lakecache-snapshot/9");
        assert!(matches!(
            Snapshot::from_json(other.as_bytes()),
            Err(SnapshotError::Format { .. })
        ));
        assert!(matches!(
            Snapshot::from_json(b"{}"),
            Err(SnapshotError::Parse(_))
        ));
        assert_eq!(s.get("ds/b").unwrap().etag, "etag-ds/b");
        assert!(s.get("ds/c").is_none());
    }

    #[test]
    fn listings_fold_at_the_delimiter_and_page_like_s3() {
        let keys = [
            "ds/a.bin",
            "ds/sub/1",
            "ds/sub/2",
            "ds/sub2/x",
            "ds/z.bin",
            "other/q",
        ];
        let s = Snapshot::new("data", "", 0, keys.iter().map(|k| entry(k)).collect());
        let top = s.list("ds/", Some("/"), None, 1000);
        let names: Vec<&str> = top.objects.iter().map(|o| o.key.as_str()).collect();
        assert_eq!(names, ["ds/a.bin", "ds/z.bin"]);
        assert_eq!(top.common_prefixes, ["ds/sub/", "ds/sub2/"]);
        assert!(top.next_token.is_none());
        // Two at a time: every name once, in order.
        let mut seen = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let page = s.list("ds/", Some("/"), token.as_deref(), 2);
            seen.extend(page.objects.iter().map(|o| o.key.clone()));
            seen.extend(page.common_prefixes.iter().cloned());
            match page.next_token {
                Some(t) => token = Some(t),
                None => break,
            }
        }
        seen.sort();
        assert_eq!(seen, ["ds/a.bin", "ds/sub/", "ds/sub2/", "ds/z.bin"]);
        let flat = s.list("ds/sub/", None, None, 10);
        assert_eq!(flat.objects.len(), 2);
    }
}
