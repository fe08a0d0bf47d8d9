//! The replica side: copies of other workers' writes held until their
//! primary has them in S3.
//!
//! A primary tells its replicas to drop a copy once the copy's object is
//! settled; a replica also asks on its own, so a lost message costs
//! nothing. What the primary answers decides:
//! - another journal identity than the copy recorded: the primary's
//!   disk is gone, and this worker uploads the copies it holds of that
//!   journal, in the order they arrived;
//! - `settled` (uploaded, replaced, or never acknowledged): drop the copy;
//! - `pending`, or no answer: keep it. A primary that never comes back is
//!   replaced by starting a worker with an empty directory at its address;
//!   its new journal identity hands the copies to their replicas.

use std::collections::HashSet;
use std::sync::{Arc, Weak};

use lakecache_protocol::EntryState;

use super::{now_ms, WriteBack};
use crate::cache::{join_failed, Cache, CacheError};
use crate::journal::PendingObject;

/// Questions per round, so a large backlog does not flood a primary.
const MAX_ASKS: usize = 256;

/// Runs until the cache is dropped or closes.
pub(crate) async fn replica_watcher(cache: Weak<Cache>, wb: Arc<WriteBack>) {
    loop {
        tokio::time::sleep(wb.config.replica_check).await;
        let Some(cache) = cache.upgrade() else { return };
        if *cache.closing.borrow() {
            return;
        }
        // Off the runtime's threads: the journal lock is held across fsyncs.
        let wb2 = wb.clone();
        let held = tokio::task::spawn_blocking(move || wb2.replica_entries())
            .await
            .unwrap_or_default();
        if held.is_empty() {
            continue;
        }
        cache.check_copies(&wb, held).await;
    }
}

impl Cache {
    async fn check_copies(self: &Arc<Self>, wb: &Arc<WriteBack>, held: Vec<PendingObject>) {
        let now = now_ms();
        let min_age_ms = wb.config.replica_check.as_millis() as i64;
        let mut unreachable = HashSet::new();
        let mut asked = 0;
        for copy in held {
            let Some(primary) = copy.replica_of.clone() else {
                continue;
            };
            if now - copy.acked_ms < min_age_ms
                || unreachable.contains(&primary.addr)
                || asked >= MAX_ASKS
            {
                continue;
            }
            asked += 1;
            let Ok(uri) = super::visible::parse_uri(&copy.uri) else {
                continue;
            };
            let answer = match self.peers.client(&primary.addr) {
                Ok(c) => c.pending_entry(&uri, &copy.version).await.map_err(|e| {
                    self.peers.health().note_failure(&primary.addr, &e);
                    e.to_string()
                }),
                Err(e) => Err(e.to_string()),
            };
            if answer.is_ok() {
                self.peers.health().note_answered(&primary.addr);
            }
            match answer {
                Err(e) => {
                    tracing::debug!(primary = %primary.addr, error = %e, "a primary did not answer about a held copy; keeping it");
                    unreachable.insert(primary.addr);
                }
                Ok(entry) if entry.journal_id != primary.journal_id => wb.take_over(&primary),
                Ok(entry) if entry.state == EntryState::Settled => {
                    if let Err(e) = self.drop_replica(wb, &copy.uri, &copy.version).await {
                        tracing::warn!(uri = %copy.uri, error = %e, "dropping a settled copy failed");
                    }
                }
                Ok(_) => {}
            }
        }
    }

    /// Drops this worker's copy of `version` of `uri`, if it holds one
    /// that was not taken over. Returns whether it did.
    pub async fn drop_replica(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        uri: &str,
        version: &str,
    ) -> Result<bool, CacheError> {
        let Some(copy) = wb.replica_entry(uri, version) else {
            return Ok(false);
        };
        if wb.is_taken_over(&copy) {
            // Taken over: this worker uploads it now.
            return Ok(false);
        }
        let wb2 = wb.clone();
        tokio::task::spawn_blocking(move || {
            wb2.finished(&copy, "", false)?;
            let pages = copy.size.div_ceil(copy.page_size.max(1));
            for index in 0..pages {
                wb2.pages
                    .remove(&WriteBack::page_key(&copy.uri, &copy.version, index));
            }
            wb2.release(copy.size);
            Ok::<_, crate::journal::JournalError>(())
        })
        .await
        .map_err(join_failed)?
        .map_err(|e| CacheError::Local(e.to_string()))?;
        Ok(true)
    }
}
