//! Server-side copies of objects above CopyObject's 5 GiB: a multipart
//! upload whose parts are UploadPartCopy ranges of the source.

use futures::{StreamExt as _, TryStreamExt as _};
use lakecache_protocol::{ObjectUri, UserMeta};

use crate::{CopyRange, ObjectStore, StoreError, MAX_COPY_BYTES};

/// S3's smallest part (all but the last) and largest part count.
const MIN_PART: u64 = 5 << 20;
const MAX_PARTS: u64 = 10_000;
/// Parts copied at once; each is a long server-side operation.
const PARTS_IN_FLIGHT: usize = 4;

/// Copies version `etag` of `from` (`size` bytes) to `to` with `meta` as
/// its user metadata, in parts of at most `part_limit` bytes (raised as
/// far as 10,000 parts need); returns the new ETag. The upload is
/// aborted when a part or the completion fails, so nothing half-copied
/// is left to bill.
pub async fn multipart_copy<S: ObjectStore + ?Sized>(
    store: &S,
    from: &ObjectUri,
    etag: &str,
    size: u64,
    to: &ObjectUri,
    meta: &UserMeta,
    part_limit: u64,
) -> Result<String, StoreError> {
    let part = part_size(size, part_limit);
    let upload = store.create_multipart(to, meta).await?;
    let copied = async {
        let ranges: Vec<(i32, std::ops::Range<u64>)> = (0..size.div_ceil(part))
            .map(|i| ((i + 1) as i32, i * part..((i + 1) * part).min(size)))
            .collect();
        let upload = upload.as_str();
        let parts: Vec<_> = futures::stream::iter(ranges)
            .map(|(number, range)| async move {
                let source = CopyRange { from, etag, range };
                let receipt = store.upload_part_copy(to, upload, number, &source).await?;
                Ok::<_, StoreError>((number, receipt))
            })
            .buffered(PARTS_IN_FLIGHT)
            .try_collect()
            .await?;
        store.complete_multipart(to, upload, parts).await
    }
    .await;
    if copied.is_err() {
        if let Err(e) = store.abort_multipart(to, &upload).await {
            tracing::warn!(error = %e, to = %to, "aborting a failed multipart copy");
        }
    }
    copied
}

/// The part size for `size` bytes: `limit` (within S3's 5 MiB..5 GiB),
/// larger where 10,000 parts would not hold the object.
fn part_size(size: u64, limit: u64) -> u64 {
    limit
        .clamp(MIN_PART, MAX_COPY_BYTES)
        .max(size.div_ceil(MAX_PARTS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_stay_within_s3_limits() {
        assert_eq!(part_size(12 << 20, 5 << 20), 5 << 20);
        assert_eq!(part_size(12 << 20, 1), MIN_PART);
        assert_eq!(part_size(6 << 30, MAX_COPY_BYTES), MAX_COPY_BYTES);
        assert_eq!(part_size(6 << 30, 64 << 30), MAX_COPY_BYTES);
        // 5 TiB with 5 MiB parts would need 1M parts.
        let five_tib = 5u64 << 40;
        assert!(five_tib.div_ceil(part_size(five_tib, MIN_PART)) <= MAX_PARTS);
    }
}
