//! An in-memory data plane with S3's semantics (flat keys, listings with
//! prefix, delimiter and pages, ETag-checked reads) and, on request, the
//! quirks of S3-compatible stores.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Mutex;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use lakecache_protocol::{ListEntry, ListResponse, ObjectStat, ObjectUri, UserMeta};

use super::{ByteStream, DataError, DataPlane};

/// How this store differs from S3.
#[derive(Debug, Clone, Default)]
pub struct Quirks {
    /// Listings carry empty ETags (some S3-compatible stores do this).
    pub list_without_etags: bool,
    /// Listings return at most this many entries a page, whatever was asked.
    pub list_page_limit: Option<u32>,
    /// Every call waits this long first (a distant or overloaded store).
    pub latency: Option<Duration>,
    /// Reads are also answered on the caller's thread
    /// ([`DataPlane::read_cached_now`]), as a worker on the same host
    /// answers for what it holds (never while `latency` is set).
    pub serves_now: bool,
}

#[derive(Debug, Clone)]
struct StoredObject {
    data: Bytes,
    etag: String,
    mtime_ms: i64,
    meta: UserMeta,
}

#[derive(Default)]
struct State {
    objects: BTreeMap<(String, String), StoredObject>,
    versions: u64,
}

#[derive(Default)]
pub struct MemoryDataPlane {
    state: Mutex<State>,
    quirks: Mutex<Quirks>,
}

const DEFAULT_MAX_KEYS: u32 = 1000;

impl MemoryDataPlane {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_quirks(quirks: Quirks) -> Self {
        Self {
            quirks: Mutex::new(quirks),
            ..Self::default()
        }
    }

    pub fn set_quirks(&self, quirks: Quirks) {
        *self.quirks.lock().unwrap_or_else(|p| p.into_inner()) = quirks;
    }

    fn quirks(&self) -> Quirks {
        self.quirks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn delay(&self) {
        if let Some(d) = self.quirks().latency {
            tokio::time::sleep(d).await;
        }
    }

    /// Writes an object behind the filesystem's back (another client, or
    /// an overwrite between a listing and an open); returns its ETag.
    pub fn insert(&self, bucket: &str, key: &str, data: impl Into<Bytes>) -> String {
        let mut state = self.state();
        state.versions += 1;
        let etag = format!("mem-{:08x}", state.versions);
        let object = StoredObject {
            data: data.into(),
            etag: etag.clone(),
            mtime_ms: 1_700_000_000_000 + state.versions as i64,
            meta: UserMeta::new(),
        };
        state
            .objects
            .insert((bucket.to_string(), key.to_string()), object);
        etag
    }

    /// Deletes behind the filesystem's back.
    pub fn remove(&self, bucket: &str, key: &str) -> bool {
        self.state()
            .objects
            .remove(&(bucket.to_string(), key.to_string()))
            .is_some()
    }

    /// The current content of an object.
    pub fn get(&self, bucket: &str, key: &str) -> Option<Bytes> {
        self.state()
            .objects
            .get(&(bucket.to_string(), key.to_string()))
            .map(|o| o.data.clone())
    }

    /// Every key of a bucket, in order.
    pub fn keys(&self, bucket: &str) -> Vec<String> {
        self.state()
            .objects
            .keys()
            .filter(|(b, _)| b == bucket)
            .map(|(_, k)| k.clone())
            .collect()
    }

    fn stat_of(uri: &ObjectUri, o: &StoredObject) -> ObjectStat {
        ObjectStat {
            uri: uri.to_string(),
            size: o.data.len() as u64,
            etag: o.etag.clone(),
            last_modified_ms: o.mtime_ms,
            written_as: None,
            meta: o.meta.clone(),
            held_by: None,
        }
    }

    fn store(&self, uri: &ObjectUri, data: Bytes, meta: &UserMeta) -> ObjectStat {
        let mut state = self.state();
        state.versions += 1;
        let object = StoredObject {
            data,
            etag: format!("mem-{:08x}", state.versions),
            mtime_ms: 1_700_000_000_000 + state.versions as i64,
            meta: meta.clone(),
        };
        let stat = Self::stat_of(uri, &object);
        state
            .objects
            .insert((uri.bucket().to_string(), uri.key().to_string()), object);
        stat
    }

    fn lookup(&self, uri: &ObjectUri) -> Result<StoredObject, DataError> {
        self.state()
            .objects
            .get(&(uri.bucket().to_string(), uri.key().to_string()))
            .cloned()
            .ok_or(DataError::NotFound)
    }
}

/// One row of a listing before paging: an object or a common prefix.
enum Row {
    Object(ListEntry),
    Prefix(String),
}

impl Row {
    fn sort_key(&self) -> &str {
        match self {
            Row::Object(e) => &e.key,
            Row::Prefix(p) => p,
        }
    }
}

#[async_trait::async_trait]
impl DataPlane for MemoryDataPlane {
    async fn stat(&self, uri: &ObjectUri) -> Result<ObjectStat, DataError> {
        self.delay().await;
        let o = self.lookup(uri)?;
        Ok(Self::stat_of(uri, &o))
    }

    async fn read(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
    ) -> Result<Bytes, DataError> {
        self.delay().await;
        let o = self.lookup(uri)?;
        if o.etag != etag {
            return Err(DataError::Changed {
                expected: Some(etag.to_string()),
                found: Some(o.etag),
            });
        }
        let size = o.data.len() as u64;
        if range.start > range.end || range.end > size {
            return Err(DataError::InvalidRange {
                start: range.start,
                end: range.end,
            });
        }
        Ok(o.data.slice(range.start as usize..range.end as usize))
    }

    fn read_cached_now(&self, uri: &ObjectUri, range: Range<u64>, etag: &str) -> Option<Bytes> {
        let quirks = self.quirks();
        if !quirks.serves_now || quirks.latency.is_some() || range.is_empty() {
            return None;
        }
        let o = self.lookup(uri).ok()?;
        (o.etag == etag && range.end <= o.data.len() as u64)
            .then(|| o.data.slice(range.start as usize..range.end as usize))
    }

    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, DataError> {
        self.delay().await;
        let quirks = self.quirks();
        let mut limit = max_keys.unwrap_or(DEFAULT_MAX_KEYS).max(1);
        if let Some(cap) = quirks.list_page_limit {
            limit = limit.min(cap.max(1));
        }
        let mut rows: Vec<Row> = Vec::new();
        {
            let state = self.state();
            let start = (bucket.to_string(), prefix.to_string());
            for ((b, key), o) in state.objects.range(start..) {
                if b != bucket || !key.starts_with(prefix) {
                    break;
                }
                let rest = &key[prefix.len()..];
                if let Some(d) = delimiter.filter(|d| !d.is_empty()) {
                    if let Some(i) = rest.find(d) {
                        let common = format!("{prefix}{}", &rest[..i + d.len()]);
                        if !matches!(rows.last(), Some(Row::Prefix(p)) if *p == common) {
                            rows.push(Row::Prefix(common));
                        }
                        continue;
                    }
                }
                rows.push(Row::Object(ListEntry {
                    key: key.clone(),
                    size: o.data.len() as u64,
                    etag: if quirks.list_without_etags {
                        String::new()
                    } else {
                        o.etag.clone()
                    },
                    last_modified_ms: o.mtime_ms,
                    meta: None,
                }));
            }
        }
        // The token is the last row of the previous page.
        let rows = rows
            .into_iter()
            .filter(|r| token.is_none_or(|t| r.sort_key() > t));
        let mut page = ListResponse::default();
        let mut last = None;
        let mut more = false;
        for (taken, row) in rows.enumerate() {
            if taken as u32 == limit {
                more = true;
                break;
            }
            last = Some(row.sort_key().to_string());
            match row {
                Row::Object(e) => page.objects.push(e),
                Row::Prefix(p) => page.common_prefixes.push(p),
            }
        }
        if more {
            page.next_token = last;
        }
        Ok(page)
    }

    async fn list_with_meta(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, DataError> {
        let mut page = self
            .list(bucket, prefix, delimiter, token, max_keys)
            .await?;
        let state = self.state();
        for entry in &mut page.objects {
            let key = (bucket.to_string(), entry.key.clone());
            entry.meta = state.objects.get(&key).map(|o| o.meta.clone());
        }
        Ok(page)
    }

    async fn put(
        &self,
        uri: &ObjectUri,
        data: Bytes,
        meta: &UserMeta,
    ) -> Result<ObjectStat, DataError> {
        self.delay().await;
        Ok(self.store(uri, data, meta))
    }

    async fn upload(
        &self,
        uri: &ObjectUri,
        mut body: ByteStream,
        _limits: super::UploadLimits,
        _mode: lakecache_protocol::WriteMode,
        meta: &UserMeta,
        _avoid: &[String],
    ) -> Result<ObjectStat, DataError> {
        self.delay().await;
        let mut buf = BytesMut::new();
        while let Some(chunk) = body.next().await {
            buf.extend_from_slice(&chunk?);
        }
        Ok(self.store(uri, buf.freeze(), meta))
    }

    async fn delete(&self, uri: &ObjectUri) -> Result<(), DataError> {
        self.delay().await;
        // S3 answers a delete of a missing key with success.
        self.remove(uri.bucket(), uri.key());
        Ok(())
    }

    async fn copy(
        &self,
        from: &ObjectUri,
        etag: Option<&str>,
        to: &ObjectUri,
        meta: Option<&UserMeta>,
    ) -> Result<ObjectStat, DataError> {
        self.delay().await;
        let o = self.lookup(from)?;
        if let Some(want) = etag.filter(|e| *e != o.etag) {
            return Err(DataError::Changed {
                expected: Some(want.to_string()),
                found: Some(o.etag),
            });
        }
        Ok(self.store(to, o.data, meta.unwrap_or(&o.meta)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uri(key: &str) -> ObjectUri {
        ObjectUri::new("bkt", key).unwrap()
    }

    #[tokio::test]
    async fn listing_groups_by_delimiter_and_pages() {
        let m = MemoryDataPlane::new();
        for k in ["d/a", "d/b/1", "d/b/2", "d/c", "d/e/x", "e"] {
            m.insert("bkt", k, Bytes::from_static(b"x"));
        }
        let page = m.list("bkt", "d/", Some("/"), None, Some(2)).await.unwrap();
        assert_eq!(page.objects.len(), 1);
        assert_eq!(page.common_prefixes, vec!["d/b/".to_string()]);
        let token = page.next_token.expect("more pages");
        let page = m
            .list("bkt", "d/", Some("/"), Some(&token), Some(2))
            .await
            .unwrap();
        assert_eq!(page.objects[0].key, "d/c");
        assert_eq!(page.common_prefixes, vec!["d/e/".to_string()]);
        assert!(page.next_token.is_none());
    }

    #[tokio::test]
    async fn reads_check_the_version() {
        let m = MemoryDataPlane::new();
        let etag = m.insert("bkt", "k", Bytes::from_static(b"hello"));
        assert_eq!(&m.read(&uri("k"), 1..3, &etag).await.unwrap()[..], b"el");
        m.insert("bkt", "k", Bytes::from_static(b"world"));
        assert!(matches!(
            m.read(&uri("k"), 0..1, &etag).await,
            Err(DataError::Changed { .. })
        ));
        assert!(matches!(
            m.read(&uri("nope"), 0..1, &etag).await,
            Err(DataError::NotFound)
        ));
    }

    #[tokio::test]
    async fn quirky_listings_drop_etags_and_cap_pages() {
        let m = MemoryDataPlane::with_quirks(Quirks {
            list_without_etags: true,
            list_page_limit: Some(1),
            latency: None,
            serves_now: false,
        });
        m.insert("bkt", "a", Bytes::from_static(b"1"));
        m.insert("bkt", "c", Bytes::from_static(b"2"));
        let page = m.list("bkt", "", None, None, None).await.unwrap();
        assert_eq!(page.objects.len(), 1);
        assert_eq!(page.objects[0].etag, "");
        assert!(page.next_token.is_some());
    }
}
