//! RocksDB-backed index: page entries, LRU access order and object
//! metadata, so a restarted worker serves warm pages without S3.

use std::path::Path;

use rocksdb::{ColumnFamilyDescriptor, IteratorMode, Options, WriteBatch, WriteOptions, DB};
use serde::{Deserialize, Serialize};

use crate::pages::PageKey;

const CF_PAGES: &str = "pages";
const CF_LRU: &str = "lru";
const CF_OBJECTS: &str = "objects";

#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("rocksdb: {0}")]
    Rocks(#[from] rocksdb::Error),
    #[error("undecodable index record: {0}")]
    Decode(String),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PageEntry {
    pub uri: String,
    pub etag: String,
    pub index: u64,
    pub len: u64,
    /// When the page was stored (ms since the epoch; 0 in indexes from
    /// before TTL policies, read as "now"). Set by `Cache::index_page`.
    #[serde(default)]
    pub fetched_ms: i64,
    /// The tenant whose request fetched it (its quota counts it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// Cached HEAD result; `validated_ms` drives the metadata TTL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRecord {
    pub size: u64,
    pub etag: String,
    pub last_modified_ms: i64,
    pub validated_ms: i64,
    /// User metadata (`x-amz-meta-*`); `None` when only a listing (which
    /// leaves it out) or an older worker recorded the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<lakecache_protocol::UserMeta>,
}

pub struct Index {
    db: DB,
}

impl Index {
    pub fn open(path: &Path) -> Result<Self, IndexError> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        let cfs = [CF_PAGES, CF_LRU, CF_OBJECTS]
            .into_iter()
            .map(|n| ColumnFamilyDescriptor::new(n, Options::default()));
        Ok(Self {
            db: DB::open_cf_descriptors(&opts, path, cfs)?,
        })
    }

    fn cf(&self, name: &str) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(name)
            .expect("column family created at open")
    }

    pub fn put_page(&self, key: &PageKey, entry: &PageEntry, seq: u64) -> Result<(), IndexError> {
        let encoded = serde_json::to_vec(entry).map_err(|e| IndexError::Decode(e.to_string()))?;
        let mut batch = WriteBatch::default();
        batch.put_cf(self.cf(CF_PAGES), key.0, encoded);
        batch.put_cf(self.cf(CF_LRU), key.0, seq.to_be_bytes());
        self.db.write(batch)?;
        Ok(())
    }

    /// Access order is a hint: written without the WAL, losing the last
    /// few touches in a crash only makes eviction slightly less exact.
    pub fn touch(&self, key: &PageKey, seq: u64) -> Result<(), IndexError> {
        let mut w = WriteOptions::default();
        w.disable_wal(true);
        self.db
            .put_cf_opt(self.cf(CF_LRU), key.0, seq.to_be_bytes(), &w)?;
        Ok(())
    }

    pub fn remove_pages(&self, keys: &[PageKey]) -> Result<(), IndexError> {
        let mut batch = WriteBatch::default();
        for key in keys {
            batch.delete_cf(self.cf(CF_PAGES), key.0);
            batch.delete_cf(self.cf(CF_LRU), key.0);
        }
        self.db.write(batch)?;
        Ok(())
    }

    /// Every page with its last access sequence and length.
    /// Every indexed page: key, access sequence and entry.
    pub fn load_pages(&self) -> Result<Vec<(PageKey, u64, PageEntry)>, IndexError> {
        let mut out = Vec::new();
        for item in self.db.iterator_cf(self.cf(CF_PAGES), IteratorMode::Start) {
            let (k, v) = item?;
            let Ok(key) = <[u8; 32]>::try_from(&k[..]) else {
                continue;
            };
            let key = PageKey(key);
            let entry: PageEntry = match serde_json::from_slice(&v) {
                Ok(e) => e,
                Err(_) => continue,
            };
            let seq = self
                .db
                .get_pinned_cf(self.cf(CF_LRU), key.0)?
                .and_then(|raw| <[u8; 8]>::try_from(&raw[..]).ok())
                .map(u64::from_be_bytes)
                .unwrap_or(0);
            out.push((key, seq, entry));
        }
        Ok(out)
    }

    /// Keys of the pages of objects whose URI starts with `uri_prefix`.
    pub fn pages_under(&self, uri_prefix: &str) -> Result<Vec<PageKey>, IndexError> {
        let mut out = Vec::new();
        for item in self.db.iterator_cf(self.cf(CF_PAGES), IteratorMode::Start) {
            let (k, v) = item?;
            let (Ok(key), Ok(entry)) = (
                <[u8; 32]>::try_from(&k[..]),
                serde_json::from_slice::<PageEntry>(&v),
            ) else {
                continue;
            };
            if entry.uri.starts_with(uri_prefix) {
                out.push(PageKey(key));
            }
        }
        Ok(out)
    }

    pub fn get_object(&self, uri: &str) -> Result<Option<ObjectRecord>, IndexError> {
        match self.db.get_pinned_cf(self.cf(CF_OBJECTS), uri)? {
            None => Ok(None),
            Some(raw) => serde_json::from_slice(&raw)
                .map(Some)
                .map_err(|e| IndexError::Decode(e.to_string())),
        }
    }

    pub fn put_object(&self, uri: &str, record: &ObjectRecord) -> Result<(), IndexError> {
        let encoded = serde_json::to_vec(record).map_err(|e| IndexError::Decode(e.to_string()))?;
        self.db.put_cf(self.cf(CF_OBJECTS), uri, encoded)?;
        Ok(())
    }

    pub fn delete_object(&self, uri: &str) -> Result<(), IndexError> {
        self.db.delete_cf(self.cf(CF_OBJECTS), uri)?;
        Ok(())
    }
}
