//! The uploader: drains the journal to S3 in the order writes were
//! acknowledged, one object at a time (its parts in parallel), so a
//! `latest` pointer written after a checkpoint never reaches S3 first.
//! Every part is read back from the dirty pages and checked against the
//! CRC32C recorded at acknowledgement before it is sent; S3 checks it
//! again (`x-amz-checksum-crc32c`).

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use lakecache_protocol::{ObjectUri, UriWrite};

use super::landing::S3Holds;
use super::{now_ms, WriteBack};
use crate::cache::{join_failed, Cache, CacheError};
use crate::index::PageEntry;
use crate::journal::PendingObject;
use crate::pages::{PageId, PageKey};
use crate::store::{ObjectMeta, StoreError};

const FIRST_RETRY: Duration = Duration::from_millis(200);
/// How often a worker asks whether earlier writes elsewhere are in S3.
const ORDER_POLL: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(30);

/// The journal's lock is held across fsyncs: wait for it off the
/// runtime's threads.
async fn next_pending(wb: &Arc<WriteBack>) -> Option<PendingObject> {
    let wb = wb.clone();
    tokio::task::spawn_blocking(move || wb.next_pending())
        .await
        .ok()
        .flatten()
}

/// Clears `WriteBack::waits_on_silent_peer` when an order wait ends,
/// however it ends.
struct SilentWait<'a>(&'a WriteBack);

impl Drop for SilentWait<'_> {
    fn drop(&mut self) {
        self.0
            .waits_on_silent_peer
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

/// Runs until the cache is dropped or closes.
pub(crate) async fn uploader(cache: Weak<Cache>, wb: Arc<WriteBack>) {
    let mut retry = FIRST_RETRY;
    loop {
        let Some(next) = next_pending(&wb).await else {
            let woken = wb.wake.notified();
            if next_pending(&wb).await.is_none() {
                let _ = tokio::time::timeout(Duration::from_secs(1), woken).await;
            }
            if cache.strong_count() == 0 {
                return;
            }
            continue;
        };
        let Some(cache) = cache.upgrade() else { return };
        if *cache.closing.borrow() {
            return;
        }
        // A stopping worker drops an upload in flight; the entry stays
        // journaled and starts over at the next start.
        let mut closing = cache.closing.subscribe();
        let result = tokio::select! {
            r = async {
                cache.wait_for_ring(&wb).await;
                let newer = cache.wait_for_earlier_elsewhere(&wb, &next).await;
                cache.upload_one(&wb, &next, newer).await
            } => r,
            _ = closing.wait_for(|c| *c) => return,
        };
        match result {
            Ok(reached_s3) => {
                retry = FIRST_RETRY;
                // Only an answer from S3 says it is back: an entry skipped
                // as superseded closed the breaker during an outage, and
                // the next stat then waited out the SDK's retries.
                if reached_s3 {
                    let _ = cache.s3_down.observe(Ok(()));
                }
            }
            Err(e) => {
                if let CacheError::Store(s) = &e {
                    let _ = cache.s3_down.observe::<()>(Err(s.clone()));
                }
                let permanent = matches!(
                    e,
                    CacheError::Store(StoreError::AccessDenied(_) | StoreError::NotFound)
                );
                let kind = if permanent { "permanent" } else { "transient" };
                tracing::warn!(
                    uri = %next.uri, seq = next.seq, error = %e, kind,
                    retry_in = ?retry,
                    "write-back upload failed; the data stays staged and the upload is retried"
                );
                wb.set_error(Some(format!("{}: {e}", next.uri)));
                cache.metrics.writeback_failure();
                drop(cache);
                let woken = wb.wake.notified();
                let _ = tokio::time::timeout(retry, woken).await;
                retry = (retry * 2).min(LAST_RETRY);
            }
        }
    }
}

impl Cache {
    /// Until the worker knows its ring (when it is to join one).
    async fn wait_for_ring(&self, wb: &WriteBack) {
        let mut said = false;
        while wb.config.await_ring && self.peers.placement().is_none() {
            if !said {
                tracing::info!("write-back uploads wait until this worker knows its ring");
                said = true;
            }
            tokio::time::sleep(ORDER_POLL).await;
        }
    }

    /// Waits while another worker's next upload in the same bucket was
    /// acknowledged before `next`: S3 receives a bucket's objects in the
    /// order their writes were acknowledged across workers, not only
    /// within one. Entries are ordered by (acknowledgement time, journal
    /// identity), which every worker computes alike, so two workers never
    /// wait for each other. A worker that does not answer holds uploads
    /// up for `peer_order_wait` (30 s) once per outage.
    ///
    /// Versions of the one object `next` names are kept in that order
    /// however long the wait: an older version pending on a worker that
    /// answers is waited for (the mount sent the newer one elsewhere
    /// while its owner was away). Returns the worker that holds, or put
    /// in S3, a version acknowledged after `next`'s, as soon as one is
    /// seen: `next` is then skipped, so nothing needs ordering.
    async fn wait_for_earlier_elsewhere(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        next: &PendingObject,
    ) -> Option<String> {
        let placement = self.peers.placement()?;
        let uri = super::visible::parse_uri(&next.uri).ok()?;
        let bucket = format!("s3://{}/", uri.bucket());
        let mine = (next.acked_ms, wb.id.as_str());
        let other = |w: &&UriWrite| w.version != next.version;
        // Cleared however this returns (the upload may also be dropped).
        let _silent = SilentWait(wb);
        for addr in placement.replica_candidates(&uri) {
            let mut said = false;
            let waiting_since = Instant::now();
            loop {
                let status = match self.peers.client(&addr) {
                    Ok(c) => c
                        .writeback_status_of(&bucket, &next.uri)
                        .await
                        .map_err(|e| {
                            self.peers.health().note_failure(&addr, &e);
                            e.to_string()
                        }),
                    Err(e) => Err(e.to_string()),
                };
                let writes = status.as_ref().map_or(&[][..], |s| &s.writes_of_uri[..]);
                if writes.iter().filter(other).any(|w| w.stamp() > mine) {
                    // `next` is skipped, not uploaded: nothing to order.
                    return Some(addr);
                }
                let older_version_pending = writes
                    .iter()
                    .filter(other)
                    .any(|w| w.pending && w.stamp() < mine);
                // Silent since when: paid once per outage, not per upload.
                let silent_for = match &status {
                    Ok(_) => {
                        wb.silent_peers().remove(&addr);
                        self.peers.health().note_answered(&addr);
                        Duration::ZERO
                    }
                    Err(_) => wb
                        .silent_peers()
                        .entry(addr.clone())
                        .or_insert_with(Instant::now)
                        .elapsed(),
                };
                let wait = match &status {
                    Ok(s) => {
                        let earlier = s
                            .next_upload_acked_ms
                            .is_some_and(|t| (t, s.journal_id.as_str()) < mine);
                        // An earlier write there that itself waits on a
                        // silent worker gives way as a silent worker does.
                        let gives_way = earlier
                            && s.next_upload_waits_on_silent_peer
                            && wb.writers_wait_for_room();
                        if gives_way {
                            tracing::warn!(%addr, uri = %next.uri, "writes on this worker are waiting for staging room; uploading before an earlier write there that waits on a worker that does not answer");
                        }
                        earlier && !gives_way
                    }
                    // Writes here wait for staging room that this wait
                    // holds: a silent peer's order gives way to them.
                    Err(e) if wb.writers_wait_for_room() => {
                        tracing::warn!(%addr, error = %e, uri = %next.uri, "writes on this worker are waiting for staging room; uploading without waiting for a worker that does not answer");
                        false
                    }
                    Err(e) if silent_for < wb.config.peer_order_wait => {
                        tracing::debug!(%addr, error = %e, "waiting for a worker to answer before uploading in order");
                        true
                    }
                    Err(e) => {
                        if !said {
                            tracing::warn!(%addr, error = %e, uri = %next.uri, wait = ?wb.config.peer_order_wait, "a worker has stopped answering; uploading without waiting for its earlier writes");
                        }
                        false
                    }
                };
                wb.waits_on_silent_peer.store(
                    wait && status.is_err(),
                    std::sync::atomic::Ordering::Release,
                );
                if !wait && !older_version_pending {
                    break;
                }
                // Two workers that took over a lost worker's copies can
                // each hold the other's earlier write: bounded, not a
                // deadlock. Not so for an older version of this object:
                // its holder skips it once it sees this one, so it never
                // waits for this one.
                if !older_version_pending && waiting_since.elapsed() >= wb.config.peer_order_wait {
                    tracing::warn!(%addr, uri = %next.uri, "an earlier write on another worker has not reached S3 in time; uploading without waiting for it");
                    break;
                }
                if !said {
                    tracing::debug!(%addr, uri = %next.uri, "waiting for an earlier write on another worker to reach S3");
                    said = true;
                }
                tokio::time::sleep(ORDER_POLL).await;
            }
        }
        None
    }

    async fn upload_one(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        object: &PendingObject,
        newer_on: Option<String>,
    ) -> Result<bool, CacheError> {
        let uri = super::visible::parse_uri(&object.uri)?;
        // A copy its lost primary never confirmed was never acknowledged:
        // uploading it could land a write the client was told failed
        // over the one it retried.
        let never_acked = object.replica_of.is_some() && object.unconfirmed;
        if never_acked {
            tracing::warn!(uri = %object.uri, version = %object.version, "dropping a copy its lost primary never confirmed (the write was not acknowledged)");
        }
        if let Some(addr) = &newer_on {
            tracing::info!(uri = %object.uri, version = %object.version, worker = %addr, "a newer version of this object was acknowledged on another worker; skipping this older one");
        }
        let mut superseded = wb.superseded(object) || never_acked || newer_on.is_some();
        let etag = if superseded {
            // A later write or delete of the same object replaces this
            // one; S3 ends the same without it.
            String::new()
        } else if object.delete {
            superseded = matches!(self.s3_holds(wb, &uri, object).await, S3Holds::Newer);
            if !superseded {
                match self.store.delete(&uri).await {
                    Ok(()) | Err(StoreError::NotFound) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            String::new()
        } else {
            match self.land(wb, &uri, object).await? {
                Some(etag) => etag,
                None => {
                    superseded = true;
                    String::new()
                }
            }
        };
        let (wb2, record, tag) = (wb.clone(), object.clone(), etag.clone());
        tokio::task::spawn_blocking(move || wb2.finished(&record, &tag, !superseded))
            .await
            .map_err(join_failed)?
            .map_err(|e| CacheError::Local(e.to_string()))?;
        // The copies on other workers are no longer needed.
        self.forget_copies(object, &object.replicas);
        if !object.delete {
            self.adopt_pages(wb, &uri, object, &etag).await;
        }
        wb.release(if object.delete { 0 } else { object.size });
        self.metrics.writeback_uploaded(object.size);
        tracing::debug!(uri = %object.uri, seq = object.seq, %etag, superseded, "write-back entry done");
        Ok(!superseded)
    }

    /// Part `i` of a pending object from its dirty pages, checked against
    /// the CRC32C recorded when the write was acknowledged.
    pub(super) async fn read_part(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        object: &PendingObject,
        i: usize,
    ) -> Result<Bytes, CacheError> {
        let start = i as u64 * object.part_size;
        let end = (start + object.part_size).min(object.size);
        let waited = wb.give_way_to_writes(&self.closing).await;
        if !waited.is_zero() {
            self.metrics.upload_gave_way(waited);
        }
        let memory = self.memory.reserve(end - start).await;
        let (wb2, record) = (wb.clone(), object.clone());
        let data = tokio::task::spawn_blocking(move || read_dirty_range(&wb2, &record, start..end))
            .await
            .map_err(join_failed)??;
        drop(memory);
        let want = object.part_crcs.get(i).copied().unwrap_or(0);
        if crc32c::crc32c(&data) != want {
            return Err(CacheError::Local(format!(
                "dirty part {} of {} does not match the CRC32C recorded at acknowledgement",
                i + 1,
                object.uri
            )));
        }
        Ok(data)
    }

    /// After upload: dirty pages become clean pages keyed by the ETag (no
    /// refetch), unless a newer write replaced the object meanwhile.
    async fn adopt_pages(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        uri: &ObjectUri,
        object: &PendingObject,
        etag: &str,
    ) {
        let key = uri.to_string();
        let current = wb.pending(&key).is_none();
        let keep = current && !etag.is_empty() && object.page_size == self.config.page_size;
        if current && !etag.is_empty() {
            let meta = ObjectMeta {
                size: object.size,
                etag: etag.to_string(),
                last_modified_ms: now_ms(),
                user: object.meta.clone(),
            };
            if let Err(e) = self.replace_meta(&key, Some(&meta)).await {
                tracing::warn!(%uri, error = %e, "recording metadata after write-back failed");
            }
        }
        let (this, wb2, record, s3_etag) =
            (self.clone(), wb.clone(), object.clone(), etag.to_string());
        let moved = tokio::task::spawn_blocking(move || {
            let _site = crate::crashsim::site("settle: pages re-keyed to the ETag");
            let pages = record.size.div_ceil(record.page_size.max(1));
            for index in 0..pages {
                let from_key = WriteBack::page_key(&record.uri, &record.version, index);
                if !keep {
                    wb2.pages.remove(&from_key);
                    continue;
                }
                let from_id = WriteBack::page_id(&record, index);
                let to_key = PageKey::new(&record.uri, &s3_etag, index);
                let to_id = PageId::new(&record.uri, &s3_etag, index, record.page_size, record.size);
                match wb2.pages.move_to(&from_key, &from_id, &this.pages, &to_key, &to_id) {
                    Ok(()) => this.index_page(
                        to_key,
                        PageEntry {
                            uri: record.uri.clone(),
                            etag: s3_etag.clone(),
                            index,
                            len: to_id.len,
                            fetched_ms: 0,
                            tenant: None,
                        },
                    ),
                    Err(e) => {
                        tracing::warn!(uri = %record.uri, page = index, error = %e, "keeping an uploaded page failed; it will be read from S3");
                        wb2.pages.remove(&from_key);
                    }
                }
            }
        })
        .await;
        if let Err(e) = moved {
            tracing::warn!(%uri, error = %e, "adopting uploaded pages failed");
        }
        // Segment owners get their pages once they are clean pages here.
        if current && !etag.is_empty() {
            let meta = ObjectMeta {
                size: object.size,
                etag: etag.to_string(),
                last_modified_ms: now_ms(),
                user: object.meta.clone(),
            };
            self.hand_off_segments(uri, &meta);
        }
        self.evict.notify_one();
    }
}

/// `range` of a pending object, read from its dirty pages (blocking).
pub(crate) fn read_dirty_range(
    wb: &WriteBack,
    object: &PendingObject,
    range: std::ops::Range<u64>,
) -> Result<Bytes, CacheError> {
    let ps = object.page_size.max(1);
    let mut out = BytesMut::with_capacity((range.end - range.start) as usize);
    let mut pos = range.start;
    while pos < range.end {
        let index = pos / ps;
        let page_start = index * ps;
        let end = range.end.min(page_start + ps);
        let key = WriteBack::page_key(&object.uri, &object.version, index);
        let id = WriteBack::page_id(object, index);
        let bytes = wb
            .pages
            .read(&key, &id, pos - page_start..end - page_start)
            .map_err(|e| {
                CacheError::Local(format!(
                    "dirty page {index} of {} ({}): {e}",
                    object.uri, object.version
                ))
            })?;
        out.extend_from_slice(&bytes);
        pos = end;
    }
    Ok(out.freeze())
}
