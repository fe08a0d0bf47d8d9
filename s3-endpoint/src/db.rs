//! Object storage of the embedded endpoint: a RocksDB index of keys over
//! immutable blob files.
//!
//! Keys never become file paths, so every key S3 allows (directory markers
//! ending in `/`, `a` beside `a/b`, `..`) can be stored without touching the
//! filesystem namespace.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use rocksdb::{ColumnFamilyDescriptor, Direction, IteratorMode, Options, WriteOptions, DB};
use serde::{Deserialize, Serialize};

const CF_BUCKETS: &str = "buckets";
const CF_OBJECTS: &str = "objects";
const CF_UPLOADS: &str = "uploads";

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("rocksdb: {0}")]
    Rocks(#[from] rocksdb::Error),
    #[error("i/o on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("corrupt record for {0}")]
    Corrupt(String),
    /// A conditional write found the key other than its condition says.
    #[error("the object under {key} is not what the write's condition names")]
    ConditionFailed { key: String, missing: bool },
}

/// What a write asks the key to hold for it to land (S3's If-Match and
/// If-None-Match on PutObject and CompleteMultipartUpload).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum WriteCondition {
    #[default]
    None,
    /// `If-None-Match: *`: no object under the key.
    Absent,
    /// `If-Match: "etag"`: the object tagged so.
    Matches(String),
}

impl WriteCondition {
    fn holds(&self, current: Option<&ObjectRecord>) -> bool {
        match (self, current) {
            (Self::None, _) => true,
            (Self::Absent, current) => current.is_none(),
            (Self::Matches(tag), Some(record)) => *tag == record.etag,
            (Self::Matches(_), None) => false,
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DbError + '_ {
    move |source| DbError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What the index knows about one stored object.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ObjectRecord {
    pub size: u64,
    /// Unquoted: hex MD5 for single PUTs, `md5-of-part-md5s-N` for multipart.
    pub etag: String,
    pub last_modified_ms: i64,
    pub blob: String,
    pub content_type: Option<String>,
    /// User metadata (`x-amz-meta-*`), names lowercase.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

impl ObjectRecord {
    pub fn last_modified(&self) -> SystemTime {
        UNIX_EPOCH + std::time::Duration::from_millis(self.last_modified_ms.max(0) as u64)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UploadRecord {
    pub bucket: String,
    pub key: String,
    pub content_type: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// What a stored object carries besides its bytes.
#[derive(Debug, Clone, Default)]
pub struct Attrs {
    pub content_type: Option<String>,
    pub metadata: BTreeMap<String, String>,
}

/// One page of a listing.
#[derive(Debug, Default)]
pub struct ListPage {
    pub objects: Vec<(String, ObjectRecord)>,
    pub common_prefixes: Vec<String>,
    /// Opaque cursor for the next page, when truncated.
    pub next: Option<String>,
}

pub struct ObjectDb {
    db: DB,
    root: PathBuf,
    /// Serialises read-modify-write of object records so an overwritten
    /// blob is always reclaimed exactly once.
    commit_lock: Mutex<()>,
}

fn object_key(bucket: &str, key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(bucket.len() + 1 + key.len());
    k.extend_from_slice(bucket.as_bytes());
    k.push(0);
    k.extend_from_slice(key.as_bytes());
    k
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl ObjectDb {
    pub fn open(root: &Path) -> Result<Self, DbError> {
        for dir in ["blobs", "tmp", "uploads"] {
            let p = root.join(dir);
            std::fs::create_dir_all(&p).map_err(io_err(&p))?;
        }
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        let cfs = [CF_BUCKETS, CF_OBJECTS, CF_UPLOADS]
            .into_iter()
            .map(|n| ColumnFamilyDescriptor::new(n, Options::default()));
        let db = DB::open_cf_descriptors(&opts, root.join("index"), cfs)?;
        Ok(Self {
            db,
            root: root.to_path_buf(),
            commit_lock: Mutex::new(()),
        })
    }

    fn cf(&self, name: &str) -> &rocksdb::ColumnFamily {
        // The three families are created in `open`; their absence is a bug.
        self.db
            .cf_handle(name)
            .expect("column family created at open")
    }

    fn synced() -> WriteOptions {
        let mut w = WriteOptions::default();
        w.set_sync(true);
        w
    }

    pub fn create_bucket(&self, name: &str) -> Result<bool, DbError> {
        if self.bucket_exists(name)? {
            return Ok(false);
        }
        self.db.put_cf_opt(
            self.cf(CF_BUCKETS),
            name,
            now_ms().to_be_bytes(),
            &Self::synced(),
        )?;
        Ok(true)
    }

    pub fn bucket_exists(&self, name: &str) -> Result<bool, DbError> {
        Ok(self.db.get_pinned_cf(self.cf(CF_BUCKETS), name)?.is_some())
    }

    pub fn list_buckets(&self) -> Result<Vec<(String, i64)>, DbError> {
        let mut out = Vec::new();
        for item in self
            .db
            .iterator_cf(self.cf(CF_BUCKETS), IteratorMode::Start)
        {
            let (k, v) = item?;
            let ts = v
                .as_ref()
                .try_into()
                .map(i64::from_be_bytes)
                .unwrap_or_default();
            out.push((String::from_utf8_lossy(&k).into_owned(), ts));
        }
        Ok(out)
    }

    /// Deletes an empty bucket; `Ok(false)` when it still holds objects.
    pub fn delete_bucket(&self, name: &str) -> Result<bool, DbError> {
        let page = self.list(name, "", None, None, 1)?;
        if !page.objects.is_empty() {
            return Ok(false);
        }
        self.db
            .delete_cf_opt(self.cf(CF_BUCKETS), name, &Self::synced())?;
        Ok(true)
    }

    pub fn get(&self, bucket: &str, key: &str) -> Result<Option<ObjectRecord>, DbError> {
        let Some(raw) = self
            .db
            .get_pinned_cf(self.cf(CF_OBJECTS), object_key(bucket, key))?
        else {
            return Ok(None);
        };
        serde_json::from_slice(&raw)
            .map(Some)
            .map_err(|_| DbError::Corrupt(format!("{bucket}/{key}")))
    }

    pub fn blob_path(&self, blob: &str) -> PathBuf {
        self.root.join("blobs").join(&blob[..2]).join(blob)
    }

    pub fn tmp_path(&self) -> PathBuf {
        self.root
            .join("tmp")
            .join(uuid::Uuid::new_v4().simple().to_string())
    }

    /// Makes a fully written, fsynced temp file the new content of `key`
    /// when `condition` holds at the moment of the commit (checked under
    /// the commit lock, so no other write comes between); otherwise the
    /// temp file is removed and nothing changes.
    #[allow(clippy::too_many_arguments)]
    pub fn commit(
        &self,
        bucket: &str,
        key: &str,
        tmp: &Path,
        size: u64,
        etag: String,
        attrs: Attrs,
        condition: &WriteCondition,
    ) -> Result<ObjectRecord, DbError> {
        let blob = uuid::Uuid::new_v4().simple().to_string();
        let dest = self.blob_path(&blob);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        std::fs::rename(tmp, &dest).map_err(io_err(&dest))?;
        let record = ObjectRecord {
            size,
            etag,
            last_modified_ms: now_ms(),
            blob,
            content_type: attrs.content_type,
            metadata: attrs.metadata,
        };
        let encoded = serde_json::to_vec(&record).map_err(|_| DbError::Corrupt(key.into()))?;
        let old = {
            let _guard = self.commit_lock.lock().unwrap_or_else(|p| p.into_inner());
            let old = self.get(bucket, key)?;
            if !condition.holds(old.as_ref()) {
                let _ = std::fs::remove_file(&dest);
                return Err(DbError::ConditionFailed {
                    key: key.to_string(),
                    missing: old.is_none(),
                });
            }
            self.db.put_cf_opt(
                self.cf(CF_OBJECTS),
                object_key(bucket, key),
                encoded,
                &Self::synced(),
            )?;
            old
        };
        if let Some(old) = old {
            // Open readers keep their descriptor; unlinking is safe.
            let _ = std::fs::remove_file(self.blob_path(&old.blob));
        }
        Ok(record)
    }

    /// Removes `key`; deleting a missing key is not an error (S3 semantics).
    pub fn delete(&self, bucket: &str, key: &str) -> Result<(), DbError> {
        let old = {
            let _guard = self.commit_lock.lock().unwrap_or_else(|p| p.into_inner());
            let old = self.get(bucket, key)?;
            self.db.delete_cf_opt(
                self.cf(CF_OBJECTS),
                object_key(bucket, key),
                &Self::synced(),
            )?;
            old
        };
        if let Some(old) = old {
            let _ = std::fs::remove_file(self.blob_path(&old.blob));
        }
        Ok(())
    }

    /// Lists keys under `prefix` in byte order, rolling keys that contain
    /// `delimiter` after the prefix into common prefixes.
    pub fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        cursor: Option<&str>,
        max_keys: usize,
    ) -> Result<ListPage, DbError> {
        let base = object_key(bucket, "");
        let mut seek = object_key(bucket, prefix);
        if let Some(c) = cursor {
            seek = cursor_seek(&base, c)
                .unwrap_or(seek)
                .max(object_key(bucket, prefix));
        }
        let mut page = ListPage::default();
        let mut last_emitted: Option<String> = None;
        let mut iter = self.db.iterator_cf(
            self.cf(CF_OBJECTS),
            IteratorMode::From(&seek, Direction::Forward),
        );
        while let Some(item) = iter.next() {
            let (k, v) = item?;
            if !k.starts_with(&base) {
                break;
            }
            let key = String::from_utf8_lossy(&k[base.len()..]).into_owned();
            if !key.starts_with(prefix) {
                break;
            }
            if page.objects.len() + page.common_prefixes.len() >= max_keys {
                page.next = last_emitted.map(|c| c.to_string());
                return Ok(page);
            }
            let rest = &key[prefix.len()..];
            if let Some(d) = delimiter.filter(|d| !d.is_empty()) {
                if let Some(pos) = rest.find(d) {
                    let cp = format!("{prefix}{}", &rest[..pos + d.len()]);
                    // Jump past every key under this common prefix.
                    let mut next = object_key(bucket, &cp);
                    next.push(0xff);
                    iter = self.db.iterator_cf(
                        self.cf(CF_OBJECTS),
                        IteratorMode::From(&next, Direction::Forward),
                    );
                    last_emitted = Some(format!("p{}", hex::encode(cp.as_bytes())));
                    page.common_prefixes.push(cp);
                    continue;
                }
            }
            let record: ObjectRecord =
                serde_json::from_slice(&v).map_err(|_| DbError::Corrupt(key.clone()))?;
            last_emitted = Some(format!("k{}", hex::encode(key.as_bytes())));
            page.objects.push((key, record));
        }
        Ok(page)
    }

    pub fn create_upload(&self, record: &UploadRecord) -> Result<String, DbError> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = self.upload_dir(&id);
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let encoded = serde_json::to_vec(record).map_err(|_| DbError::Corrupt(id.clone()))?;
        self.db
            .put_cf_opt(self.cf(CF_UPLOADS), &id, encoded, &Self::synced())?;
        Ok(id)
    }

    pub fn get_upload(&self, id: &str) -> Result<Option<UploadRecord>, DbError> {
        let Some(raw) = self.db.get_pinned_cf(self.cf(CF_UPLOADS), id)? else {
            return Ok(None);
        };
        serde_json::from_slice(&raw)
            .map(Some)
            .map_err(|_| DbError::Corrupt(id.into()))
    }

    pub fn upload_dir(&self, id: &str) -> PathBuf {
        self.root.join("uploads").join(id)
    }

    pub fn remove_upload(&self, id: &str) -> Result<(), DbError> {
        self.db
            .delete_cf_opt(self.cf(CF_UPLOADS), id, &Self::synced())?;
        // Moved aside first: a part still being received creates its file
        // by the upload's path, so after the move it fails instead of
        // landing in a directory that `remove_dir_all` already listed (the
        // directory would then outlive the abort).
        let dir = self.upload_dir(id);
        let aside = self
            .root
            .join("tmp")
            .join(format!("aborted-{id}-{}", uuid::Uuid::new_v4().simple()));
        let doomed = match std::fs::rename(&dir, &aside) {
            Ok(()) => aside,
            Err(_) => dir,
        };
        let _ = std::fs::remove_dir_all(doomed);
        Ok(())
    }
}

/// Decodes a listing cursor into the first index key strictly after it.
fn cursor_seek(base: &[u8], cursor: &str) -> Option<Vec<u8>> {
    let (kind, hexed) = cursor.split_at_checked(1)?;
    let raw = hex::decode(hexed).ok()?;
    let mut seek = base.to_vec();
    seek.extend_from_slice(&raw);
    match kind {
        "k" => seek.push(0),
        "p" => seek.push(0xff),
        _ => return None,
    }
    Some(seek)
}

/// Validates a client-supplied continuation token.
pub fn cursor_is_valid(cursor: &str) -> bool {
    cursor_seek(b"", cursor).is_some()
}
