//! How one pending object lands in S3 without burying a newer write.
//!
//! Every write-back upload carries a stamp (when its write was
//! acknowledged, and by which journal). Before uploading, the worker
//! reads S3's stamp: a newer one means this version is skipped. Between
//! that HEAD and the upload another worker may land a newer version (this
//! one paused, or its upload slow): so the upload is conditional on S3
//! still holding what the HEAD saw (`If-Match`, or `If-None-Match: *`
//! where there was nothing), and a failed condition means reading the
//! stamp again.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures::StreamExt;
use lakecache_protocol::{parse_written_stamp, written_stamp, ObjectUri, WRITTEN_STAMP_META};

use super::{now_ms, WriteBack};
use crate::cache::{Cache, CacheError};
use crate::journal::PendingObject;
use crate::store::{StoreError, WriteIf};

/// How far ahead of this worker's clock an S3 write stamp may be and
/// still be believed (the workers' clocks differ a little).
const STAMP_CLOCK_SKEW_MS: i64 = 5 * 60 * 1000;
/// Conditional uploads of one object that may find S3 changed under them
/// in a row, before the uploader's own retry (with its back-off) takes
/// over: other writers landing this often is contention, not a race.
const CHANGED_UNDER_US: usize = 4;

/// What S3 holds under a pending object's key, as far as landing it goes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum S3Holds {
    /// A version acknowledged after this one: skip this one.
    Newer,
    /// Something this version may replace, as long as it is still there
    /// when the upload lands.
    Older(WriteIf),
}

impl Cache {
    /// Whether S3 holds a version of `object`'s object that a write
    /// acknowledged after it put there, by the stamp every write-back
    /// upload stores ([`WRITTEN_STAMP_META`]). S3 remembers it past any
    /// worker's restart, which the peers' answers do not. Uploads go on
    /// when S3 cannot say (no stamp, a failed HEAD: then unconditionally).
    pub(super) async fn s3_holds(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        uri: &ObjectUri,
        object: &PendingObject,
    ) -> S3Holds {
        let head = match self.store.head(uri).await {
            Ok(head) => head,
            Err(StoreError::NotFound) => return S3Holds::Older(WriteIf::Absent),
            Err(e) => {
                tracing::debug!(%uri, error = %e, "no HEAD before the upload: uploading without S3's stamp check");
                return S3Holds::Older(WriteIf::Always);
            }
        };
        // A store that answers HEAD without an ETag gives nothing to
        // match: the upload then goes unconditionally.
        let over = S3Holds::Older(if head.etag.is_empty() {
            WriteIf::Always
        } else {
            WriteIf::Matches(head.etag.clone())
        });
        let Some((acked_ms, journal_id)) = head
            .user
            .get(WRITTEN_STAMP_META)
            .and_then(|v| parse_written_stamp(v))
        else {
            return over;
        };
        // No write is acknowledged in the future: a stamp claiming one
        // (set by hand, or a clock far off) must not hold later writes
        // back, so it is not believed.
        if acked_ms > now_ms().saturating_add(STAMP_CLOCK_SKEW_MS) {
            tracing::warn!(%uri, s3_acked_ms = acked_ms, "S3's write stamp on this object lies in the future; ignoring it");
            return over;
        }
        let newer = (acked_ms, journal_id.as_str()) > (object.acked_ms, wb.id.as_str());
        if newer {
            tracing::info!(%uri, version = %object.version, s3_acked_ms = acked_ms, s3_journal = %journal_id, "S3 holds a version of this object acknowledged after this one; skipping this older one");
            return S3Holds::Newer;
        }
        over
    }

    /// Uploads `object` unless S3 holds a newer version, checked again
    /// whenever S3 changed between the check and the upload. Returns the
    /// new ETag, or None when skipped for a newer version.
    pub(super) async fn land(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        uri: &ObjectUri,
        object: &PendingObject,
    ) -> Result<Option<String>, CacheError> {
        let mut changed = 0;
        loop {
            let mut condition = match self.s3_holds(wb, uri, object).await {
                S3Holds::Newer => return Ok(None),
                S3Holds::Older(condition) => condition,
            };
            if wb.unconditional_only.load(Ordering::Relaxed) {
                condition = WriteIf::Always;
            }
            match self.upload_pending(wb, uri, object, &condition).await {
                Ok(etag) => return Ok(Some(etag)),
                // The store changed since the HEAD: look again. (NotFound:
                // `If-Match` on an object deleted meanwhile.)
                Err(CacheError::Store(StoreError::PreconditionFailed | StoreError::NotFound))
                    if condition != WriteIf::Always =>
                {
                    changed += 1;
                    tracing::info!(%uri, version = %object.version, ?condition, "S3 changed between the stamp check and the upload; checking again");
                    if changed >= CHANGED_UNDER_US {
                        return Err(CacheError::Store(StoreError::PreconditionFailed));
                    }
                }
                Err(CacheError::Store(StoreError::Unsupported(e)))
                    if condition != WriteIf::Always =>
                {
                    if !wb.unconditional_only.swap(true, Ordering::Relaxed) {
                        tracing::warn!(%uri, error = %e, "this S3 store does not take conditional writes; uploading without them (a worker paused between its stamp check and its upload could then land an older version over a newer one)");
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn upload_pending(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        uri: &ObjectUri,
        object: &PendingObject,
        condition: &WriteIf,
    ) -> Result<String, CacheError> {
        let mut meta = object.meta.clone();
        meta.insert(
            WRITTEN_STAMP_META.to_string(),
            written_stamp(object.acked_ms, &wb.id),
        );
        // The user's metadata comes first: where the stamp would take it
        // past S3's limit the object goes without one.
        if lakecache_protocol::validate_user_meta(&meta).is_err() {
            meta.remove(WRITTEN_STAMP_META);
        }
        let parts = object.part_crcs.len();
        if parts <= 1 {
            let data = self.read_part(wb, object, 0).await?;
            return Ok(self.store.put_if(uri, data, &meta, condition).await?);
        }
        let id = self.store.create_multipart(uri, &meta).await?;
        let this = self.clone();
        let sent = futures::stream::iter(0..parts)
            .map(|i| {
                let (this, wb, id) = (this.clone(), wb.clone(), id.clone());
                async move {
                    let data = this.read_part(&wb, object, i).await?;
                    let receipt = this.store.upload_part(uri, &id, i as i32 + 1, data).await?;
                    Ok::<_, CacheError>((i as i32 + 1, receipt))
                }
            })
            .buffered(wb.config.parts_in_flight.max(1))
            .collect::<Vec<_>>()
            .await;
        let receipts: Result<Vec<_>, CacheError> = sent.into_iter().collect();
        let completed = match receipts {
            Ok(receipts) => self
                .store
                .complete_multipart_if(uri, &id, receipts, condition)
                .await
                .map_err(CacheError::from),
            Err(e) => Err(e),
        };
        // A failed part, or a failed condition, leaves the upload open.
        if completed.is_err() {
            if let Err(abort) = self.store.abort_multipart(uri, &id).await {
                tracing::warn!(%uri, error = %abort, "aborting write-back multipart upload failed");
            }
        }
        completed
    }
}
