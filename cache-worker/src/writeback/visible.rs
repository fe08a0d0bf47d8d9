//! Read-your-writes: what stat, read, list, delete and copy see of
//! objects acknowledged but not yet in S3.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use lakecache_protocol::{ListEntry, ListResponse, ObjectUri, ReadKind};

use super::upload::read_dirty_range;
use super::{now_ms, Pending};
use crate::cache::{join_failed, Cache, CacheError};
use crate::journal::PendingObject;
use crate::store::{ObjectMeta, StoreError};

/// Largest piece of a dirty object read at once.
const DIRTY_PIECE: u64 = 1 << 20;

impl Cache {
    /// The acknowledged state of `uri` when S3 is behind it: `Some(meta)`
    /// for a pending write, `Err(NotFound)` for a pending delete.
    pub(crate) fn pending_meta(&self, uri: &ObjectUri) -> Result<Option<ObjectMeta>, CacheError> {
        let Some(wb) = &self.writeback else {
            return Ok(None);
        };
        match wb.pending(&uri.to_string()) {
            None => Ok(None),
            Some(Pending::Deleted { .. }) => Err(StoreError::NotFound.into()),
            Some(Pending::Written {
                version,
                size,
                acked_ms,
                user,
                ..
            }) => Ok(Some(ObjectMeta {
                size,
                etag: version,
                last_modified_ms: acked_ms,
                user,
            })),
        }
    }

    /// The S3 ETag a cache version became once uploaded.
    pub fn uploaded_as(&self, uri: &ObjectUri, version: &str) -> Option<String> {
        self.writeback.as_ref()?.alias(&uri.to_string(), version)
    }

    /// `pos..end` (within one dirty page) of a pending version. If the
    /// version was uploaded meanwhile, its pages moved: the bytes come
    /// from the clean pages (or S3) under its ETag.
    pub(crate) async fn dirty_piece(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        pos: u64,
        end: u64,
    ) -> Result<Bytes, CacheError> {
        let object = match (&self.writeback, self.pending_meta(uri)) {
            (Some(wb), Ok(Some(now))) if now.etag == meta.etag => {
                let Some(Pending::Written { seq, page_size, .. }) = wb.pending(&uri.to_string())
                else {
                    return Err(StoreError::PreconditionFailed.into());
                };
                Some(dirty_record(uri, meta, seq, page_size))
            }
            _ => None,
        };
        let Some(object) = object else {
            return self.uploaded_piece(uri, meta, pos, end).await;
        };
        let ps = object.page_size.max(1);
        let end = end.min((pos / ps + 1) * ps).min(pos + DIRTY_PIECE);
        let wb = self.write_back_state()?.clone();
        let read = tokio::task::spawn_blocking(move || read_dirty_range(&wb, &object, pos..end))
            .await
            .map_err(join_failed)?;
        match read {
            Ok(bytes) => Ok(bytes),
            // Uploaded while we looked: the pages moved under the ETag.
            Err(_) if self.uploaded_as(uri, &meta.etag).is_some() => {
                self.uploaded_piece(uri, meta, pos, end).await
            }
            Err(e) => Err(e),
        }
    }

    /// The bytes of a cache version that reached S3, under its ETag.
    async fn uploaded_piece(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        pos: u64,
        end: u64,
    ) -> Result<Bytes, CacheError> {
        let Some(etag) = self.uploaded_as(uri, &meta.etag) else {
            return Err(StoreError::PreconditionFailed.into());
        };
        let clean = ObjectMeta {
            etag,
            ..meta.clone()
        };
        self.clean_piece_of(uri, &clean, pos, end, true, None).await
    }

    /// Pending writes and deletes under `prefix` of `bucket`, by URI.
    pub(crate) fn pending_under(&self, bucket: &str, prefix: &str) -> Vec<(String, Pending)> {
        match &self.writeback {
            Some(wb) => wb.pending_under(&format!("s3://{bucket}/{prefix}")),
            None => Vec::new(),
        }
    }

    /// Adds pending writes to a listing page and takes pending deletes
    /// out. A pending object lands in the page whose key range holds it.
    /// `pending_before` is the pending set read before the store listed:
    /// an entry that has since reached S3 (and left the set) may be missing
    /// from the store's listing, so it counts too, unless the set now says
    /// otherwise.
    pub(crate) fn merge_pending(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        after: Option<&str>,
        pending_before: Vec<(String, Pending)>,
        listing: &mut ListResponse,
    ) {
        // This page covers keys after the last key of the page before (or
        // the start) up to its own last key (or the end, when it is the
        // last page).
        let last_obj = listing.objects.last().map(|o| o.key.clone());
        let last_pre = listing.common_prefixes.last().cloned();
        let page_last = last_obj.max(last_pre);
        if let Some(next) = listing.next_token.take() {
            listing.next_token = Some(match &page_last {
                Some(last) => wrap_list_token(last, &next),
                None => next,
            });
        }
        let base = format!("s3://{bucket}/");
        let mut pending: std::collections::BTreeMap<String, Pending> =
            pending_before.into_iter().collect();
        pending.extend(self.pending_under(bucket, prefix));
        if pending.is_empty() {
            return;
        }
        let after = after.unwrap_or("");
        let upto = listing.next_token.as_ref().and(page_last);
        let in_page = |key: &str| key > after && upto.as_deref().is_none_or(|u| key <= u);
        for (uri, state) in pending {
            let key = &uri[base.len()..];
            let grouped = delimiter.and_then(|d| {
                key[prefix.len()..]
                    .find(d)
                    .map(|at| key[..prefix.len() + at + d.len()].to_string())
            });
            listing.objects.retain(|o| o.key != key);
            match (state, grouped) {
                (Pending::Deleted { .. }, _) => {}
                (Pending::Written { .. }, Some(dir)) => {
                    if in_page(&dir) && !listing.common_prefixes.contains(&dir) {
                        listing.common_prefixes.push(dir);
                    }
                }
                (
                    Pending::Written {
                        size,
                        version,
                        acked_ms,
                        user,
                        ..
                    },
                    None,
                ) => {
                    if in_page(key) {
                        listing.objects.push(ListEntry {
                            key: key.to_string(),
                            size,
                            etag: version,
                            last_modified_ms: acked_ms,
                            meta: Some(user),
                        });
                    }
                }
            }
        }
        listing.objects.sort_by(|a, b| a.key.cmp(&b.key));
        listing.common_prefixes.sort();
    }

    /// A delete of an object with pending writes is journaled behind them
    /// (S3 gets it after their uploads, or they are skipped); others go
    /// to S3 at once. Returns whether it was journaled.
    pub(crate) async fn delete_in_order(
        self: &Arc<Self>,
        uri: &ObjectUri,
    ) -> Result<bool, CacheError> {
        let Some(wb) = self.writeback.clone() else {
            return Ok(false);
        };
        let key = uri.to_string();
        match wb.pending(&key) {
            None => return Ok(false),
            Some(Pending::Deleted { .. }) => return Err(StoreError::NotFound.into()),
            Some(Pending::Written { .. }) => {}
        }
        let mut record = delete_record(
            &key,
            format!("{}{}", super::VERSION_PREFIX, uuid::Uuid::new_v4().simple()),
            self.config.page_size,
        );
        // The workers holding a copy of the pending write get the delete
        // too, before it is acknowledged: a replica that uploads the write
        // for a lost primary must also delete it.
        record.replicas = wb.replicas_of_pending(&key);
        self.copy_delete(&wb, uri, &record).await?;
        let journaled = record.clone();
        let recorded = tokio::task::spawn_blocking(move || wb.record(journaled))
            .await
            .map_err(join_failed)?
            .map_err(|e| CacheError::Local(e.to_string()));
        if let Err(e) = recorded {
            self.forget_copies(&record, &record.replicas);
            return Err(e);
        }
        self.confirm_copies(&record).await?;
        Ok(true)
    }

    /// Records a copy of a delete another worker journaled (see
    /// `delete_in_order`).
    pub async fn record_replica_delete(
        self: &Arc<Self>,
        uri: &ObjectUri,
        version: String,
        of: crate::journal::ReplicaOf,
        confirm: bool,
    ) -> Result<(), CacheError> {
        let wb = self.write_back_state()?.clone();
        let mut record = delete_record(&uri.to_string(), version, self.config.page_size);
        record.replica_of = Some(of);
        record.unconfirmed = confirm;
        tokio::task::spawn_blocking(move || wb.record(record))
            .await
            .map_err(join_failed)?
            .map_err(|e| CacheError::Local(e.to_string()))?;
        Ok(())
    }

    /// A copy S3 cannot do in order: the source is not in S3 yet, or the
    /// destination has pending writes a server-side copy would overtake.
    /// The source's bytes are written back again under the destination.
    pub(crate) async fn copy_through_cache(
        self: &Arc<Self>,
        from: &ObjectUri,
        source: &ObjectMeta,
        to: &ObjectUri,
        user: Option<&lakecache_protocol::UserMeta>,
    ) -> Result<ObjectMeta, CacheError> {
        let (body, _) = self
            .read(from, source, 0..source.size, ReadKind::Demand)
            .await?;
        self.write_back(
            to,
            Box::pin(body),
            Arc::new(OnceLock::new()),
            super::WriteRole::Primary,
            user.unwrap_or(&source.user).clone(),
        )
        .await
    }
}

fn delete_record(uri: &str, version: String, page_size: u64) -> PendingObject {
    PendingObject {
        seq: 0,
        uri: uri.to_string(),
        version,
        size: 0,
        part_size: 0,
        part_crcs: Vec::new(),
        acked_ms: now_ms(),
        page_size,
        delete: true,
        replica_of: None,
        unconfirmed: false,
        replicas: Vec::new(),
        meta: Default::default(),
        tenant: None,
    }
}

fn dirty_record(uri: &ObjectUri, meta: &ObjectMeta, seq: u64, page_size: u64) -> PendingObject {
    PendingObject {
        seq,
        uri: uri.to_string(),
        version: meta.etag.clone(),
        size: meta.size,
        part_size: 0,
        part_crcs: Vec::new(),
        acked_ms: meta.last_modified_ms,
        page_size,
        delete: false,
        replica_of: None,
        unconfirmed: false,
        replicas: Vec::new(),
        meta: meta.user.clone(),
        tenant: None,
    }
}

const TOKEN_TAG: &str = "lc1.";

/// A continuation token that also names the page's last key.
fn wrap_list_token(last_key: &str, store_token: &str) -> String {
    format!("{TOKEN_TAG}{}.{store_token}", hex::encode(last_key))
}

/// (last key of the page before, the store's own token) from a token of
/// ours; a token we did not make goes to the store as it is.
pub(crate) fn split_list_token(token: Option<&str>) -> (Option<String>, Option<&str>) {
    let Some(t) = token else { return (None, None) };
    let parsed = t.strip_prefix(TOKEN_TAG).and_then(|rest| {
        let (key, store) = rest.split_once('.')?;
        let key = String::from_utf8(hex::decode(key).ok()?).ok()?;
        Some((key, store))
    });
    match parsed {
        Some((key, store)) => (Some(key), Some(store)),
        None => (None, Some(t)),
    }
}

/// Parses the `s3://bucket/key` form the journal keeps.
pub(crate) fn parse_uri(s: &str) -> Result<ObjectUri, CacheError> {
    s.strip_prefix("s3://")
        .and_then(|rest| rest.split_once('/'))
        .ok_or_else(|| CacheError::Local(format!("journal names a bad URI {s:?}")))
        .and_then(|(b, k)| {
            ObjectUri::new(b, k).map_err(|e| CacheError::Local(format!("journal URI {s:?}: {e}")))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_tokens_carry_the_last_key_and_pass_foreign_tokens_through() {
        let ours = wrap_list_token("dir/é.bin", "opaque.token/with.dots");
        assert_eq!(
            split_list_token(Some(&ours)),
            (
                Some("dir/é.bin".to_string()),
                Some("opaque.token/with.dots")
            )
        );
        assert_eq!(split_list_token(Some("abc")), (None, Some("abc")));
        assert_eq!(split_list_token(Some("lc1.zz.x")), (None, Some("lc1.zz.x")));
        assert_eq!(split_list_token(None), (None, None));
    }

    #[test]
    fn journal_uris_parse_back() {
        let uri = parse_uri("s3://bucket/a/b c").unwrap();
        assert_eq!((uri.bucket(), uri.key()), ("bucket", "a/b c"));
        assert!(parse_uri("bucket/key").is_err());
    }
}
