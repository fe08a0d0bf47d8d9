//! Directory listings: streamed page by page as `readdir` asks for more,
//! so the first entries of a huge prefix come back after one LIST; kept
//! for the metadata TTL once complete, so a second `ls` costs no LIST; and
//! dropped when this mount changes the directory.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::data_plane::DataPlane;
use crate::error::FsError;
use crate::inode::{Kind, Meta};

/// One name in a directory as S3 lists it (no inode yet).
#[derive(Debug, Clone)]
pub struct Listed {
    pub name: String,
    pub kind: Kind,
    pub key: String,
    pub meta: Meta,
}

/// A directory being read: the names so far and where the listing goes on.
pub struct DirStream {
    /// Names served before the S3 listing (`.`, `..`, files being written).
    pub head: Vec<Listed>,
    pub listed: Vec<Listed>,
    /// When the listing started: attributes from it are this old.
    pub listed_at: Instant,
    /// The listing cache's generation when the listing started.
    pub generation: u64,
    seen: HashSet<String>,
    token: Option<String>,
    done: bool,
    /// Whether the complete listing went to the listing cache.
    pub cached: bool,
    bucket: String,
    dir_key: String,
    /// Ask for each object's user metadata with the listing.
    with_meta: bool,
}

/// Entries fetched per LIST; S3's maximum.
const PAGE: u32 = 1000;

impl DirStream {
    pub fn new(bucket: &str, dir_key: &str, head: Vec<Listed>, generation: u64) -> Self {
        let seen = head.iter().map(|l| l.name.clone()).collect();
        Self {
            head,
            listed: Vec::new(),
            listed_at: Instant::now(),
            generation,
            seen,
            token: None,
            done: false,
            cached: false,
            bucket: bucket.to_string(),
            dir_key: dir_key.to_string(),
            with_meta: false,
        }
    }

    /// Lists with each object's user metadata (POSIX attributes).
    pub fn with_meta(mut self, on: bool) -> Self {
        self.with_meta = on;
        self
    }

    /// A stream over a complete listing from the cache.
    pub fn from_cache(mut self, cached: &CachedListing) -> Self {
        self.listed_at = cached.at;
        self.listed = cached
            .entries
            .iter()
            .filter(|l| !self.seen.contains(&l.name))
            .cloned()
            .collect();
        self.done = true;
        self.cached = true;
        self
    }

    pub fn len(&self) -> usize {
        self.head.len() + self.listed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    pub fn get(&self, i: usize) -> Option<&Listed> {
        if i < self.head.len() {
            self.head.get(i)
        } else {
            self.listed.get(i - self.head.len())
        }
    }

    pub fn get_mut(&mut self, i: usize) -> Option<&mut Listed> {
        if i < self.head.len() {
            self.head.get_mut(i)
        } else {
            let at = i - self.head.len();
            self.listed.get_mut(at)
        }
    }

    /// Lists pages until `want` entries are known or the listing ends.
    pub async fn fill_to(&mut self, data: &dyn DataPlane, want: usize) -> Result<(), FsError> {
        while !self.done && self.len() < want {
            let (bucket, dir, token) = (&self.bucket, &self.dir_key, self.token.as_deref());
            let page = if self.with_meta {
                data.list_with_meta(bucket, dir, Some("/"), token, Some(PAGE))
                    .await?
            } else {
                data.list(bucket, dir, Some("/"), token, Some(PAGE)).await?
            };
            // Prefixes first: a prefix shadows an object of the same name,
            // as `lookup` resolves it.
            for prefix in &page.common_prefixes {
                let Some(name) = prefix
                    .strip_prefix(&self.dir_key)
                    .and_then(|n| n.strip_suffix('/'))
                else {
                    continue;
                };
                if name.is_empty() || name == "." || name == ".." || name.contains('/') {
                    continue;
                }
                self.push(name, Kind::Dir, prefix.clone(), Meta::default());
            }
            for obj in &page.objects {
                let Some(name) = obj.key.strip_prefix(&self.dir_key) else {
                    continue;
                };
                // The directory's own marker, and names a path cannot hold.
                if name.is_empty() || name == "." || name == ".." || name.contains('/') {
                    continue;
                }
                // Some S3-compatible stores list without ETags: open then
                // asks for one instead of trusting an empty string.
                let meta = Meta {
                    size: obj.size,
                    etag: Some(obj.etag.clone()).filter(|e| !e.is_empty()),
                    mtime_ms: obj.last_modified_ms,
                    user: obj.meta.clone(),
                };
                self.push(name, Kind::File, obj.key.clone(), meta);
            }
            match page.next_token {
                Some(t) => self.token = Some(t),
                None => {
                    self.done = true;
                    self.seen = HashSet::new();
                }
            }
        }
        Ok(())
    }

    /// A name listed twice keeps its first entry, so entries already
    /// returned never change (a prefix wins within one page).
    fn push(&mut self, name: &str, kind: Kind, key: String, meta: Meta) {
        if self.seen.insert(name.to_string()) {
            self.listed.push(Listed {
                name: name.to_string(),
                kind,
                key,
                meta,
            });
        }
    }
}

#[derive(Clone)]
pub struct CachedListing {
    pub at: Instant,
    pub entries: Arc<Vec<Listed>>,
    /// Position of each name in `entries`, for lookups.
    index: Arc<HashMap<String, usize>>,
}

impl CachedListing {
    pub fn find(&self, name: &str) -> Option<&Listed> {
        self.index.get(name).and_then(|&i| self.entries.get(i))
    }

    /// Where `name` is in listing order.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }
}

/// Complete listings by directory key, for the metadata TTL, bounded in
/// total entries (oldest dropped first).
pub struct ListingCache {
    ttl: Duration,
    max_entries: usize,
    inner: Mutex<HashMap<String, CachedListing>>,
    /// Bumped by every invalidation: a listing that started before one
    /// may miss this mount's change and is not kept.
    generation: AtomicU64,
}

impl ListingCache {
    pub fn new(ttl: Duration, max_entries: usize) -> Self {
        Self {
            ttl,
            max_entries,
            inner: Mutex::default(),
            generation: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, CachedListing>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, dir_key: &str) -> Option<CachedListing> {
        let map = self.lock();
        let hit = map.get(dir_key)?;
        (hit.at.elapsed() < self.ttl).then(|| CachedListing {
            at: hit.at,
            entries: hit.entries.clone(),
            index: hit.index.clone(),
        })
    }

    /// The generation to pass to [`Self::put`] for a listing starting now.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Keeps a complete listing unless this mount changed a directory
    /// since `generation` was read.
    pub fn put(&self, dir_key: &str, generation: u64, at: Instant, entries: Vec<Listed>) {
        if self.ttl.is_zero() || entries.len() > self.max_entries {
            return;
        }
        let index = entries
            .iter()
            .enumerate()
            .map(|(i, l)| (l.name.clone(), i))
            .collect();
        let mut map = self.lock();
        if self.generation() != generation {
            return;
        }
        map.retain(|_, c| c.at.elapsed() < self.ttl);
        let mut total: usize = map.values().map(|c| c.entries.len()).sum();
        while total + entries.len() > self.max_entries {
            let Some(oldest) = map.iter().min_by_key(|(_, c)| c.at).map(|(k, _)| k.clone()) else {
                break;
            };
            if let Some(gone) = map.remove(&oldest) {
                total -= gone.entries.len();
            }
        }
        map.insert(
            dir_key.to_string(),
            CachedListing {
                at,
                entries: Arc::new(entries),
                index: Arc::new(index),
            },
        );
    }

    /// This mount changed the directory: its next listing goes to S3.
    pub fn invalidate(&self, dir_key: &str) {
        let mut map = self.lock();
        self.generation.fetch_add(1, Ordering::SeqCst);
        map.remove(dir_key);
    }

    /// A directory moved: its listing and those below it are stale.
    pub fn invalidate_under(&self, prefix: &str) {
        let mut map = self.lock();
        self.generation.fetch_add(1, Ordering::SeqCst);
        map.retain(|k, _| !k.starts_with(prefix));
    }

    /// Drops expired listings; returns how many entries were freed.
    pub fn purge_expired(&self) -> usize {
        let mut map = self.lock();
        let before: usize = map.values().map(|c| c.entries.len()).sum();
        map.retain(|_, c| c.at.elapsed() < self.ttl);
        before - map.values().map(|c| c.entries.len()).sum::<usize>()
    }
}
