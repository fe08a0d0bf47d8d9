//! The write path: stream a body to S3 (multipart when large) and keep the
//! written bytes as pages, so the next read is a hit.
//!
//! The upload is acknowledged only after S3 acknowledged it. Pages are
//! staged while the body streams and committed under the new ETag once S3
//! has answered; an asynchronous write-back mode can later reuse the
//! staging and replace the final "wait for S3" step with a durable journal.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use lakecache_protocol::{buffer_pool, ObjectUri, UserMeta};
use tokio::task::JoinHandle;

use crate::cache::{Cache, CacheError};
use crate::index::PageEntry;
use crate::pages::{PageId, PageKey, Staged};
use crate::store::{multipart_copy, ObjectMeta, PartReceipt, StoreError};
use lakecache_protocol::memory::Reservation;

/// Part uploads in flight per write: bounds memory at this many parts.
const PARTS_IN_FLIGHT: usize = 4;
const MIN_PART_BYTES: u64 = 5 << 20;
const MAX_PART_BYTES: u64 = 5 << 30;

struct StagedPage {
    index: u64,
    file: Staged,
}

struct Upload {
    id: String,
    next_part: i32,
    in_flight: VecDeque<JoinHandle<Result<(i32, PartReceipt), StoreError>>>,
    done: Vec<(i32, PartReceipt)>,
}

impl Cache {
    /// Uploads `body` as the new content of `uri`; returns the metadata of
    /// the stored object once S3 has it.
    pub async fn write<S>(
        self: &Arc<Self>,
        uri: &ObjectUri,
        body: S,
        user: &UserMeta,
    ) -> Result<ObjectMeta, CacheError>
    where
        S: Stream<Item = Result<Bytes, CacheError>> + Send + Unpin,
    {
        let mut staged = Vec::new();
        let mut upload: Option<Upload> = None;
        let result = self
            .write_inner(uri, body, user, &mut staged, &mut upload)
            .await;
        match result {
            Ok((etag, size)) => {
                let meta = self.finish_write(uri, etag, size, user, staged).await;
                self.hand_off_segments(uri, &meta);
                Ok(meta)
            }
            Err(e) => {
                self.discard_staged(staged);
                if let Some(up) = upload {
                    for task in up.in_flight {
                        task.abort();
                    }
                    if let Err(abort) = self.store.abort_multipart(uri, &up.id).await {
                        tracing::warn!(%uri, error = %abort, "aborting multipart upload failed");
                    }
                }
                tracing::warn!(%uri, error = %e, "write failed; nothing was acknowledged");
                Err(e)
            }
        }
    }

    async fn write_inner<S>(
        self: &Arc<Self>,
        uri: &ObjectUri,
        mut body: S,
        user: &UserMeta,
        staged: &mut Vec<StagedPage>,
        upload: &mut Option<Upload>,
    ) -> Result<(String, u64), CacheError>
    where
        S: Stream<Item = Result<Bytes, CacheError>> + Send + Unpin,
    {
        let ps = self.config.page_size as usize;
        // The next part's memory is reserved before its bytes are read:
        // over the worker's budget, the body waits (TCP back-pressure).
        // Buffers are allocated at their exact size (growing one by
        // doubling would hold twice what was reserved).
        let mut part_size = self.part_size(1);
        let mut part_memory = self.memory.reserve(part_size as u64).await;
        // Parts and pages in pooled, aligned buffers: mapped populated (no
        // fault per 4 KiB), reused, and a page goes to disk with O_DIRECT
        // straight from its buffer.
        let mut part = buffer_pool::take(part_size);
        // One page being staged per upload, outside the budget: holding it
        // while waiting for a part could starve every upload at once.
        let mut page = buffer_pool::take(ps);
        let mut total = 0u64;
        let mut pages_seen = 0u64;
        let mut staging = true;
        let mut closing = self.closing.subscribe();
        loop {
            let chunk = tokio::select! {
                chunk = body.next() => chunk,
                _ = closing.wait_for(|c| *c) => return Err(CacheError::ShuttingDown),
            };
            let Some(chunk) = chunk else { break };
            let chunk = chunk?;
            total += chunk.len() as u64;
            let mut rest = &chunk[..];
            while staging && !rest.is_empty() {
                if let Some(full) = fill_page(&mut page, ps, &mut rest) {
                    staging = self.stage(&full, pages_seen, staged).await;
                    pages_seen += 1;
                }
            }
            if !staging && page.capacity() > buffer_pool::ALIGN {
                page = buffer_pool::PoolBuf::with_capacity(0);
            }
            let mut rest = &chunk[..];
            while !rest.is_empty() {
                let take = (part_size - part.len()).min(rest.len());
                part.extend_from_slice(&rest[..take]);
                rest = &rest[take..];
                if part.len() == part_size {
                    let full = std::mem::replace(&mut part, buffer_pool::PoolBuf::with_capacity(0));
                    let data = buffer_pool::freeze(full);
                    self.send_part(uri, user, upload, data, part_memory).await?;
                    let next = upload.as_ref().map_or(1, |u| u.next_part);
                    part_size = self.part_size(next);
                    part_memory = self.memory.reserve(part_size as u64).await;
                    part = buffer_pool::take(part_size);
                }
            }
        }
        if staging && !page.is_empty() {
            let rest = buffer_pool::freeze(page);
            self.stage(&rest, pages_seen, staged).await;
        }
        // The commit: a write its client gave up on is not stored.
        crate::fence::check()?;
        let etag = match upload {
            None => self.store.put(uri, buffer_pool::freeze(part), user).await?,
            Some(_) => {
                if !part.is_empty() {
                    self.send_part(uri, user, upload, buffer_pool::freeze(part), part_memory)
                        .await?;
                }
                let Some(up) = upload.as_mut() else {
                    return Err(CacheError::Local("upload state lost".into()));
                };
                while let Some(task) = up.in_flight.pop_front() {
                    up.done.push(join_part(task).await?);
                }
                let parts = std::mem::take(&mut up.done);
                crate::fence::check()?;
                self.store.complete_multipart(uri, &up.id, parts).await?
            }
        };
        *upload = None;
        Ok((etag, total))
    }

    /// Size of part `number` (1-based): the configured size for the first
    /// thousand parts, doubling every thousand after, so that 10,000 parts
    /// hold S3's 5 TiB maximum; never above S3's 5 GiB or half the memory
    /// budget (one part must always fit).
    fn part_size(&self, number: i32) -> usize {
        let tier = (number.max(1) as u64 - 1) / 1000;
        let grown = self.config.part_size.saturating_mul(1 << tier.min(20));
        let cap = MAX_PART_BYTES.min((self.memory.limit() / 2).max(MIN_PART_BYTES));
        grown.clamp(MIN_PART_BYTES, cap) as usize
    }

    /// Stages one page (counted against the cache capacity); returns
    /// whether staging should go on.
    async fn stage(
        self: &Arc<Self>,
        data: &Bytes,
        index: u64,
        staged: &mut Vec<StagedPage>,
    ) -> bool {
        let len = data.len() as u64;
        if !self.lru.reserve_staging(len) {
            return false;
        }
        if self.lru.over_high_watermark() {
            self.evict.notify_one();
        }
        let (this, data) = (self.clone(), data.clone());
        match tokio::task::spawn_blocking(move || this.pages.stage(&data)).await {
            Ok(Ok(file)) => {
                staged.push(StagedPage { index, file });
                true
            }
            Ok(Err(e)) => {
                self.lru.release_staging(len);
                tracing::warn!(error = %e, "staging written page failed; it will be read from S3");
                false
            }
            Err(e) => {
                self.lru.release_staging(len);
                tracing::warn!(error = %e, "staging task failed");
                false
            }
        }
    }

    async fn send_part(
        self: &Arc<Self>,
        uri: &ObjectUri,
        user: &UserMeta,
        upload: &mut Option<Upload>,
        data: Bytes,
        memory: Reservation,
    ) -> Result<(), CacheError> {
        if upload.is_none() {
            let id = self.store.create_multipart(uri, user).await?;
            *upload = Some(Upload {
                id,
                next_part: 1,
                in_flight: VecDeque::new(),
                done: Vec::new(),
            });
        }
        let Some(up) = upload.as_mut() else {
            return Err(CacheError::Local("upload state lost".into()));
        };
        if up.in_flight.len() >= PARTS_IN_FLIGHT {
            if let Some(task) = up.in_flight.pop_front() {
                up.done.push(join_part(task).await?);
            }
        }
        let number = up.next_part;
        up.next_part += 1;
        let (store, uri, id) = (self.store.clone(), uri.clone(), up.id.clone());
        up.in_flight.push_back(crate::tenant::spawn(async move {
            let _memory = memory;
            store
                .upload_part(&uri, &id, number, data)
                .await
                .map(|part| (number, part))
        }));
        Ok(())
    }

    /// S3 has the object: record its metadata and commit staged pages
    /// under the new ETag.
    async fn finish_write(
        self: &Arc<Self>,
        uri: &ObjectUri,
        etag: String,
        size: u64,
        user: &UserMeta,
        staged: Vec<StagedPage>,
    ) -> ObjectMeta {
        let key = uri.to_string();
        // HEAD gives S3's own Last-Modified; if it shows another writer's
        // version, our pages must not be committed under it.
        let written = ObjectMeta {
            size,
            etag: etag.clone(),
            last_modified_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0),
            user: user.clone(),
        };
        let meta = match self.store.head(uri).await {
            Ok(meta) => meta,
            Err(e) => {
                tracing::debug!(%uri, error = %e, "HEAD after write failed; using upload result");
                written.clone()
            }
        };
        let ours = meta.etag == etag && meta.size == size;
        if !ours {
            // Another writer's upload of the same object completed after
            // ours: S3 now holds theirs. Ours still landed, and the answer
            // describes it, never the other writer's object.
            tracing::info!(%uri, ours = %etag, now = %meta.etag, "another write of this object completed right after this one; S3 keeps the later one");
        }
        if let Err(e) = self.replace_meta(&key, Some(&meta)).await {
            tracing::warn!(%uri, error = %e, "recording metadata after write failed");
        }
        let ps = self.config.page_size;
        let this = self.clone();
        let tenant = crate::tenant::current().map(|t| t.to_string());
        let committed = tokio::task::spawn_blocking(move || {
            for page in staged {
                this.lru.release_staging(page.file.len);
                if !ours {
                    this.pages.discard_staged(page.file);
                    continue;
                }
                let page_key = PageKey::new(&key, &etag, page.index);
                let id = PageId::new(&key, &etag, page.index, ps, size);
                let len = page.file.len;
                match this.pages.commit(page.file, &page_key, &id) {
                    Ok(()) => this.index_page(
                        page_key,
                        PageEntry {
                            uri: key.clone(),
                            etag: etag.clone(),
                            index: page.index,
                            len,
                            fetched_ms: 0,
                            tenant: tenant.clone(),
                        },
                    ),
                    Err(e) => {
                        tracing::warn!(uri = %key, page = page.index, error = %e, "committing written page failed")
                    }
                }
            }
        })
        .await;
        if let Err(e) = committed {
            tracing::warn!(%uri, error = %e, "committing written pages failed");
        }
        if ours {
            meta
        } else {
            written
        }
    }
}

impl Cache {
    /// Frees staged pages of a failed upload; the files go off the runtime.
    /// Each stays counted as staged until its file is gone: the disk holds
    /// it until then, and "nothing staged" must mean no file is left.
    fn discard_staged(self: &Arc<Self>, staged: Vec<StagedPage>) {
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            for page in staged {
                let len = page.file.len;
                this.pages.discard_staged(page.file);
                this.lru.release_staging(len);
            }
        });
    }

    /// Server-side copy of `from` (the version tagged `etag`, or the
    /// current one) to `to`; the copy's metadata is recorded at once.
    pub async fn copy(
        self: &Arc<Self>,
        from: &ObjectUri,
        etag: Option<&str>,
        to: &ObjectUri,
        user: Option<&UserMeta>,
    ) -> Result<ObjectMeta, CacheError> {
        // A copy sent here by the owner of `to` whose source is pending
        // on the worker that took it (a rename onto a key owned here).
        if etag.is_none() {
            if let Some(version) = self.pending_on_peer(from).await {
                if let Some(meta) = self.copy_from_peer(from, &version, to, user).await? {
                    return Ok(meta);
                }
            }
        }
        if let Some(version) = etag.filter(|e| crate::writeback::is_cache_version(e)) {
            let here = matches!(self.pending_meta(from), Ok(Some(m)) if m.etag == version)
                || self.uploaded_as(from, version).is_some();
            if !here {
                if let Some(meta) = self.copy_from_peer(from, version, to, user).await? {
                    return Ok(meta);
                }
            }
        }
        let source = self.revalidate(from).await?;
        let named_other = etag.is_some_and(|e| {
            e != source.etag && self.uploaded_as(from, e).as_deref() != Some(&source.etag)
        });
        if named_other {
            return Err(StoreError::PreconditionFailed.into());
        }
        if crate::writeback::is_cache_version(&source.etag)
            || !matches!(self.pending_meta(to), Ok(None))
        {
            return self.copy_through_cache(from, &source, to, user).await;
        }
        if source.size > self.config.copy_part_limit {
            return self.copy_in_parts(from, &source, to, user).await;
        }
        let meta = self.store.copy(from, &source.etag, to, user).await?;
        self.replace_meta(&to.to_string(), Some(&meta)).await?;
        Ok(meta)
    }

    /// A copy above CopyObject's limit: UploadPartCopy parts. A multipart
    /// upload takes the metadata at its start, so keeping the source's
    /// means asking S3 for it (the index may know only a listing).
    async fn copy_in_parts(
        self: &Arc<Self>,
        from: &ObjectUri,
        source: &ObjectMeta,
        to: &ObjectUri,
        user: Option<&UserMeta>,
    ) -> Result<ObjectMeta, CacheError> {
        let kept;
        let user = match user {
            Some(user) => user,
            None => {
                let head = self.store.head(from).await?;
                if head.etag != source.etag {
                    return Err(StoreError::PreconditionFailed.into());
                }
                kept = head.user;
                &kept
            }
        };
        tracing::info!(from = %from, to = %to, size = source.size, "copying in parts (UploadPartCopy)");
        multipart_copy(
            self.store.as_ref(),
            from,
            &source.etag,
            source.size,
            to,
            user,
            self.config.copy_part_limit,
        )
        .await?;
        let meta = self.store.head(to).await?;
        self.replace_meta(&to.to_string(), Some(&meta)).await?;
        Ok(meta)
    }
}

async fn join_part(
    task: JoinHandle<Result<(i32, PartReceipt), StoreError>>,
) -> Result<(i32, PartReceipt), CacheError> {
    match task.await {
        Ok(r) => r.map_err(CacheError::from),
        Err(e) => Err(CacheError::Local(format!("part upload task failed: {e}"))),
    }
}

/// Moves bytes from `rest` into `page` (a pooled, aligned buffer of `ps`
/// bytes); returns the page once it is full, a fresh one in its place.
pub(crate) fn fill_page(
    page: &mut buffer_pool::PoolBuf,
    ps: usize,
    rest: &mut &[u8],
) -> Option<Bytes> {
    let take = (ps - page.len()).min(rest.len());
    page.extend_from_slice(&rest[..take]);
    *rest = &rest[take..];
    (page.len() == ps).then(|| buffer_pool::freeze(std::mem::replace(page, buffer_pool::take(ps))))
}
