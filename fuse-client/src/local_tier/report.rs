//! What the node-local tier holds, object by object: served by the
//! mount's listener at `/v1/local-tier` and printed by
//! `lakecache status --mount`.

use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;

use serde::{Deserialize, Serialize};

use super::LocalTier;
use crate::complete::Completer;

/// Objects listed at most; the rest are counted in `objects_not_listed`.
pub const LISTED_AT_MOST: usize = 1000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TierReport {
    pub dir: PathBuf,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub whole: u64,
    pub partial: u64,
    /// Bytes the partial objects still miss.
    pub missing_bytes: u64,
    /// Bytes not written because the fill thread was behind (left as
    /// holes, for completion or later reads).
    pub fill_dropped_bytes: u64,
    /// Bytes of fills for objects wanted whole that waited for the fill
    /// thread (back-pressure on their readers) instead of being dropped.
    #[serde(default)]
    pub fill_waited_bytes: u64,
    pub completion: CompletionReport,
    /// Partial objects first (most missing first), then whole ones.
    pub objects: Vec<ObjectReport>,
    pub objects_not_listed: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionReport {
    /// Objects queued or being completed now.
    pub pending: u64,
    pub asked: u64,
    pub fetched_bytes: u64,
    pub completed: u64,
    pub failures: u64,
    pub abandoned: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObjectReport {
    pub uri: String,
    pub etag: String,
    pub size: u64,
    pub missing_bytes: u64,
    /// "whole" or "partial".
    pub state: String,
    /// A reader showed it wants the object whole: completion fetches
    /// what is missing.
    pub wanted_whole: bool,
}

impl LocalTier {
    /// The tier object by object, with completion's counters.
    pub fn report(&self, completer: Option<&Completer>) -> TierReport {
        let mut objects: Vec<ObjectReport> = self
            .objects()
            .into_iter()
            .map(|o| {
                let (uri, etag) = o.uri_and_etag();
                let missing_bytes = o.missing_bytes();
                ObjectReport {
                    uri,
                    etag,
                    size: o.size(),
                    missing_bytes,
                    state: if missing_bytes == 0 {
                        "whole"
                    } else {
                        "partial"
                    }
                    .into(),
                    wanted_whole: o.wanted_whole(),
                }
            })
            .collect();
        let whole = objects.iter().filter(|o| o.missing_bytes == 0).count() as u64;
        let partial = objects.len() as u64 - whole;
        let missing_bytes = objects.iter().map(|o| o.missing_bytes).sum();
        objects.sort_by(|a, b| {
            b.missing_bytes
                .cmp(&a.missing_bytes)
                .then_with(|| a.uri.cmp(&b.uri))
        });
        let objects_not_listed = objects.len().saturating_sub(LISTED_AT_MOST) as u64;
        objects.truncate(LISTED_AT_MOST);
        let completion = completer
            .map(|c| {
                let s = c.stats();
                CompletionReport {
                    pending: c.pending() as u64,
                    asked: s.asked.load(Relaxed),
                    fetched_bytes: s.fetched_bytes.load(Relaxed),
                    completed: s.completed.load(Relaxed),
                    failures: s.failures.load(Relaxed),
                    abandoned: s.abandoned.load(Relaxed),
                }
            })
            .unwrap_or_default();
        TierReport {
            dir: self.dir().to_path_buf(),
            capacity_bytes: self.capacity(),
            used_bytes: self.used(),
            whole,
            partial,
            missing_bytes,
            fill_dropped_bytes: self.fill_stats().dropped_bytes.load(Relaxed),
            fill_waited_bytes: self.fill_stats().kept_waited_bytes.load(Relaxed),
            completion,
            objects,
            objects_not_listed,
        }
    }
}
