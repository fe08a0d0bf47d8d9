//! The S3 operations the embedded endpoint answers, on top of [`ObjectDb`].

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use md5::{Digest, Md5};
use s3s::dto::*;
use s3s::{s3_error, S3Error, S3ErrorCode, S3Request, S3Response, S3Result, S3};
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio_util::io::ReaderStream;

use crate::db::{
    cursor_is_valid, Attrs, DbError, ObjectDb, ObjectRecord, UploadRecord, WriteCondition,
};
use crate::faults::FaultInjector;
use crate::part_copy;

/// Large reads matter: 4 KiB reads cap a stream near 130 MB/s.
const READ_CHUNK: usize = 1 << 20;
/// S3's minimum size for every part but the last.
const MIN_PART_SIZE: u64 = 5 * 1024 * 1024;
const MAX_KEYS: i32 = 1000;

#[derive(Clone)]
pub struct EmbeddedS3 {
    db: Arc<ObjectDb>,
    list_without_etags: bool,
    /// Counters (checksums verified) shared with the HTTP layer.
    faults: Arc<FaultInjector>,
}

impl EmbeddedS3 {
    /// One page of a listing (v1 or v2) as S3 objects and common
    /// prefixes, with the cursor of the last entry when more follow.
    async fn list_page(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        cursor: Option<String>,
        max_keys: i32,
    ) -> S3Result<(Vec<Object>, Vec<CommonPrefix>, Option<String>)> {
        let (bucket, prefix) = (bucket.to_string(), prefix.to_string());
        let delimiter = delimiter.map(str::to_string);
        let page = self
            .blocking(move |db| {
                db.list(
                    &bucket,
                    &prefix,
                    delimiter.as_deref(),
                    cursor.as_deref(),
                    max_keys as usize,
                )
            })
            .await?;
        let contents = page
            .objects
            .into_iter()
            .map(|(key, r)| Object {
                key: Some(key),
                size: Some(r.size as i64),
                e_tag: (!self.list_without_etags).then(|| strong(&r.etag)),
                last_modified: Some(Timestamp::from(r.last_modified())),
                storage_class: Some(ObjectStorageClass::from_static(
                    ObjectStorageClass::STANDARD,
                )),
                ..Default::default()
            })
            .collect();
        let prefixes = page
            .common_prefixes
            .into_iter()
            .map(|p| CommonPrefix { prefix: Some(p) })
            .collect();
        Ok((contents, prefixes, page.next))
    }

    pub fn new(db: Arc<ObjectDb>, list_without_etags: bool, faults: Arc<FaultInjector>) -> Self {
        Self {
            db,
            list_without_etags,
            faults,
        }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&ObjectDb) -> Result<T, DbError> + Send + 'static,
    ) -> S3Result<T> {
        let db = self.db.clone();
        tokio::task::spawn_blocking(move || f(&db))
            .await
            .map_err(|e| s3_error!(e, InternalError))?
            .map_err(internal)
    }

    async fn require_bucket(&self, bucket: &str) -> S3Result<()> {
        let name = bucket.to_string();
        if self.blocking(move |db| db.bucket_exists(&name)).await? {
            Ok(())
        } else {
            Err(s3_error!(NoSuchBucket))
        }
    }

    async fn record(&self, bucket: &str, key: &str) -> S3Result<ObjectRecord> {
        self.require_bucket(bucket).await?;
        let (b, k) = (bucket.to_string(), key.to_string());
        self.blocking(move |db| db.get(&b, &k))
            .await?
            .ok_or_else(|| s3_error!(NoSuchKey))
    }
}

fn internal(e: DbError) -> S3Error {
    // Not storage errors: a conditional write's answer, as S3 gives it.
    if let DbError::ConditionFailed { missing, .. } = e {
        return if missing {
            s3_error!(NoSuchKey)
        } else {
            s3_error!(PreconditionFailed)
        };
    }
    tracing::error!(error = %e, "embedded s3 storage error");
    s3_error!(e, InternalError)
}

fn io_internal(e: std::io::Error) -> S3Error {
    tracing::error!(error = %e, "embedded s3 i/o error");
    s3_error!(e, InternalError)
}

/// The condition of a write (PutObject, CompleteMultipartUpload), as S3
/// takes it: `If-None-Match: *` or `If-Match` with an ETag, not both.
fn write_condition(
    if_match: Option<&IfMatch>,
    if_none_match: Option<&IfNoneMatch>,
) -> S3Result<WriteCondition> {
    match (if_match, if_none_match) {
        (None, None) => Ok(WriteCondition::None),
        (Some(ETagCondition::ETag(tag)), None) => {
            Ok(WriteCondition::Matches(tag.value().to_string()))
        }
        (None, Some(ETagCondition::Any)) => Ok(WriteCondition::Absent),
        (Some(_), Some(_)) => Err(s3_error!(
            InvalidRequest,
            "a write takes If-Match or If-None-Match, not both"
        )),
        (Some(ETagCondition::Any), None) => Err(s3_error!(
            NotImplemented,
            "a write's If-Match takes an ETag, not *"
        )),
        (None, Some(ETagCondition::ETag(_))) => Err(s3_error!(
            NotImplemented,
            "a write's If-None-Match takes only *"
        )),
    }
}

fn check_if_match(cond: Option<&IfMatch>, record: &ObjectRecord) -> S3Result<()> {
    match cond {
        Some(ETagCondition::ETag(tag)) if tag.value() != record.etag => {
            Err(s3_error!(PreconditionFailed))
        }
        _ => Ok(()),
    }
}

/// Streams `body` into a new temp file, returning (size, md5). The file is
/// fsynced: an acknowledged PUT survives a crash.
/// A received body: its length, MD5 (the ETag) and CRC32C (base64, as
/// `x-amz-checksum-crc32c` carries it).
struct Received {
    size: u64,
    md5: [u8; 16],
    crc32c: String,
}

/// Stores a request body in `path`, checked against the length and the
/// CRC32C the client sent, if any (S3 answers BadDigest on a mismatch).
/// A body refused leaves no file behind.
async fn receive_body(
    path: &Path,
    body: Option<StreamingBlob>,
    expected_len: Option<i64>,
    expected_crc32c: Option<&str>,
    faults: &FaultInjector,
) -> S3Result<Received> {
    let received = write_body(path, body, expected_len, expected_crc32c, faults).await;
    if received.is_err() {
        let _ = tokio::fs::remove_file(path).await;
    }
    received
}

/// CRC32C as the `x-amz-checksum-crc32c` header carries it.
fn crc32c_base64(crc: u32) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(crc.to_be_bytes())
}

async fn write_body(
    path: &Path,
    body: Option<StreamingBlob>,
    expected_len: Option<i64>,
    expected_crc32c: Option<&str>,
    faults: &FaultInjector,
) -> S3Result<Received> {
    let mut file = tokio::fs::File::create(path).await.map_err(io_internal)?;
    let mut hasher = Md5::new();
    let mut crc = 0u32;
    let mut size = 0u64;
    if let Some(mut body) = body {
        while let Some(chunk) = body.next().await {
            let chunk = chunk
                .map_err(|e| S3Error::with_message(S3ErrorCode::IncompleteBody, e.to_string()))?;
            hasher.update(&chunk);
            crc = crc32c::crc32c_append(crc, &chunk);
            size += chunk.len() as u64;
            file.write_all(&chunk).await.map_err(io_internal)?;
        }
    }
    if let Some(len) = expected_len {
        if len as u64 != size {
            return Err(s3_error!(IncompleteBody, "received {size} of {len} bytes"));
        }
    }
    let crc32c = crc32c_base64(crc);
    if let Some(want) = expected_crc32c {
        if want != crc32c {
            return Err(s3_error!(
                BadDigest,
                "The CRC32C you specified did not match the calculated checksum."
            ));
        }
        faults.checksum_verified();
    }
    file.sync_all().await.map_err(io_internal)?;
    Ok(Received {
        size,
        md5: hasher.finalize().into(),
        crc32c,
    })
}

fn strong(etag: &str) -> ETag {
    ETag::Strong(etag.to_string())
}

/// An upload a part may go to: it exists for this bucket and key, and
/// the part number is one S3 allows.
impl EmbeddedS3 {
    async fn check_part_target(
        &self,
        upload_id: &str,
        bucket: &str,
        key: &str,
        part_number: i32,
    ) -> S3Result<()> {
        let upload = upload_id.to_string();
        let found = self.blocking(move |db| db.get_upload(&upload)).await?;
        match found {
            Some(u) if u.bucket == bucket && u.key == key => {}
            _ => return Err(s3_error!(NoSuchUpload)),
        }
        if !(1..=10_000).contains(&part_number) {
            return Err(s3_error!(InvalidArgument, "part number must be 1..=10000"));
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl S3 for EmbeddedS3 {
    async fn create_bucket(
        &self,
        req: S3Request<CreateBucketInput>,
    ) -> S3Result<S3Response<CreateBucketOutput>> {
        let name = req.input.bucket.clone();
        if !self.blocking(move |db| db.create_bucket(&name)).await? {
            return Err(s3_error!(BucketAlreadyOwnedByYou));
        }
        Ok(S3Response::new(CreateBucketOutput::default()))
    }

    async fn head_bucket(
        &self,
        req: S3Request<HeadBucketInput>,
    ) -> S3Result<S3Response<HeadBucketOutput>> {
        self.require_bucket(&req.input.bucket).await?;
        Ok(S3Response::new(HeadBucketOutput::default()))
    }

    async fn delete_bucket(
        &self,
        req: S3Request<DeleteBucketInput>,
    ) -> S3Result<S3Response<DeleteBucketOutput>> {
        self.require_bucket(&req.input.bucket).await?;
        let name = req.input.bucket.clone();
        if !self.blocking(move |db| db.delete_bucket(&name)).await? {
            return Err(s3_error!(BucketNotEmpty));
        }
        Ok(S3Response::new(DeleteBucketOutput::default()))
    }

    async fn list_buckets(
        &self,
        _req: S3Request<ListBucketsInput>,
    ) -> S3Result<S3Response<ListBucketsOutput>> {
        let buckets = self.blocking(|db| db.list_buckets()).await?;
        let buckets = buckets
            .into_iter()
            .map(|(name, ms)| Bucket {
                name: Some(name),
                creation_date: Some(Timestamp::from(
                    std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64),
                )),
                ..Default::default()
            })
            .collect();
        Ok(S3Response::new(ListBucketsOutput {
            buckets: Some(buckets),
            ..Default::default()
        }))
    }

    async fn head_object(
        &self,
        req: S3Request<HeadObjectInput>,
    ) -> S3Result<S3Response<HeadObjectOutput>> {
        let input = req.input;
        let record = self.record(&input.bucket, &input.key).await?;
        check_if_match(input.if_match.as_ref(), &record)?;
        Ok(S3Response::new(HeadObjectOutput {
            content_length: Some(record.size as i64),
            e_tag: Some(strong(&record.etag)),
            last_modified: Some(Timestamp::from(record.last_modified())),
            content_type: record.content_type.clone(),
            metadata: user_metadata(&record),
            accept_ranges: Some("bytes".into()),
            ..Default::default()
        }))
    }

    async fn get_object(
        &self,
        req: S3Request<GetObjectInput>,
    ) -> S3Result<S3Response<GetObjectOutput>> {
        let input = req.input;
        let record = self.record(&input.bucket, &input.key).await?;
        check_if_match(input.if_match.as_ref(), &record)?;
        let range = match input.range {
            Some(r) => Some(r.check(record.size).map_err(|_| s3_error!(InvalidRange))?),
            None => None,
        };
        let (start, end) = range.clone().map_or((0, record.size), |r| (r.start, r.end));
        let len = end - start;
        let mut file = tokio::fs::File::open(self.db.blob_path(&record.blob))
            .await
            .map_err(io_internal)?;
        file.seek(std::io::SeekFrom::Start(start))
            .await
            .map_err(io_internal)?;
        let stream = ReaderStream::with_capacity(file.take(len), READ_CHUNK);
        Ok(S3Response::new(GetObjectOutput {
            body: Some(StreamingBlob::wrap(stream)),
            content_length: Some(len as i64),
            content_range: range
                .map(|_| format!("bytes {start}-{}/{}", end.saturating_sub(1), record.size)),
            e_tag: Some(strong(&record.etag)),
            last_modified: Some(Timestamp::from(record.last_modified())),
            content_type: record.content_type.clone(),
            metadata: user_metadata(&record),
            accept_ranges: Some("bytes".into()),
            ..Default::default()
        }))
    }

    async fn put_object(
        &self,
        req: S3Request<PutObjectInput>,
    ) -> S3Result<S3Response<PutObjectOutput>> {
        let input = req.input;
        self.require_bucket(&input.bucket).await?;
        let condition = write_condition(input.if_match.as_ref(), input.if_none_match.as_ref())?;
        let tmp = self.db.tmp_path();
        let received = receive_body(
            &tmp,
            input.body,
            input.content_length,
            input.checksum_crc32c.as_deref(),
            &self.faults,
        )
        .await;
        let Received { size, md5, crc32c } = received?;
        let etag = hex::encode(md5);
        let attrs = Attrs {
            content_type: input.content_type,
            metadata: lowercase_names(input.metadata),
        };
        let (bucket, key, tag) = (input.bucket, input.key, etag.clone());
        let commit = self
            .blocking(move |db| db.commit(&bucket, &key, &tmp, size, tag, attrs, &condition))
            .await;
        let record = commit?;
        Ok(S3Response::new(PutObjectOutput {
            e_tag: Some(strong(&record.etag)),
            checksum_crc32c: Some(crc32c),
            ..Default::default()
        }))
    }

    /// Copies by hard-linking the source blob: blobs are never modified
    /// in place, so both keys can share it.
    async fn copy_object(
        &self,
        req: S3Request<CopyObjectInput>,
    ) -> S3Result<S3Response<CopyObjectOutput>> {
        let input = req.input;
        let CopySource::Bucket {
            bucket: src_bucket,
            key: src_key,
            ..
        } = &input.copy_source
        else {
            return Err(s3_error!(NotImplemented, "access-point copy sources"));
        };
        self.require_bucket(&input.bucket).await?;
        let source = self.record(src_bucket, src_key).await?;
        check_if_match(input.copy_source_if_match.as_ref(), &source)?;
        let tmp = self.db.tmp_path();
        let blob = self.db.blob_path(&source.blob);
        let linked = tmp.clone();
        tokio::task::spawn_blocking(move || std::fs::hard_link(&blob, &linked))
            .await
            .map_err(|e| s3_error!(InternalError, "copy task failed: {e}"))?
            .map_err(io_internal)?;
        let (bucket, key) = (input.bucket, input.key);
        let replace = input
            .metadata_directive
            .as_ref()
            .is_some_and(|d| d.as_str().eq_ignore_ascii_case("REPLACE"));
        let attrs = if replace {
            Attrs {
                content_type: input.content_type.or(source.content_type),
                metadata: lowercase_names(input.metadata),
            }
        } else {
            Attrs {
                content_type: source.content_type,
                metadata: source.metadata,
            }
        };
        let (size, etag) = (source.size, source.etag.clone());
        let record = self
            .blocking(move |db| {
                db.commit(
                    &bucket,
                    &key,
                    &tmp,
                    size,
                    etag,
                    attrs,
                    &WriteCondition::None,
                )
            })
            .await?;
        Ok(S3Response::new(CopyObjectOutput {
            copy_object_result: Some(CopyObjectResult {
                e_tag: Some(strong(&record.etag)),
                last_modified: Some(Timestamp::from(record.last_modified())),
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn delete_object(
        &self,
        req: S3Request<DeleteObjectInput>,
    ) -> S3Result<S3Response<DeleteObjectOutput>> {
        self.require_bucket(&req.input.bucket).await?;
        let (b, k) = (req.input.bucket.clone(), req.input.key.clone());
        self.blocking(move |db| db.delete(&b, &k)).await?;
        Ok(S3Response::new(DeleteObjectOutput::default()))
    }

    async fn list_objects_v2(
        &self,
        req: S3Request<ListObjectsV2Input>,
    ) -> S3Result<S3Response<ListObjectsV2Output>> {
        let input = req.input;
        self.require_bucket(&input.bucket).await?;
        let max_keys = input.max_keys.unwrap_or(MAX_KEYS).clamp(0, MAX_KEYS);
        if let Some(token) = &input.continuation_token {
            if !cursor_is_valid(token) {
                return Err(s3_error!(InvalidArgument, "invalid continuation token"));
            }
        }
        // StartAfter is a key: turn it into the equivalent cursor.
        let cursor = input.continuation_token.clone().or_else(|| {
            input
                .start_after
                .as_ref()
                .map(|k| format!("k{}", hex::encode(k.as_bytes())))
        });
        let prefix = input.prefix.clone().unwrap_or_default();
        let (contents, prefixes, next) = self
            .list_page(
                &input.bucket,
                &prefix,
                input.delimiter.as_deref(),
                cursor,
                max_keys,
            )
            .await?;
        let key_count = (contents.len() + prefixes.len()) as i32;
        Ok(S3Response::new(ListObjectsV2Output {
            name: Some(input.bucket),
            prefix: input.prefix,
            delimiter: input.delimiter,
            max_keys: Some(max_keys),
            key_count: Some(key_count),
            continuation_token: input.continuation_token,
            start_after: input.start_after,
            is_truncated: Some(next.is_some()),
            next_continuation_token: next,
            contents: Some(contents),
            common_prefixes: Some(prefixes),
            ..Default::default()
        }))
    }

    /// ListObjects (v1), for clients that still use it (s3fs by default):
    /// the marker is a key; one inside a common prefix skips that prefix.
    async fn list_objects(
        &self,
        req: S3Request<ListObjectsInput>,
    ) -> S3Result<S3Response<ListObjectsOutput>> {
        let input = req.input;
        self.require_bucket(&input.bucket).await?;
        let max_keys = input.max_keys.unwrap_or(MAX_KEYS).clamp(0, MAX_KEYS);
        let prefix = input.prefix.clone().unwrap_or_default();
        let delimiter = input.delimiter.clone().filter(|d| !d.is_empty());
        let cursor = input.marker.as_ref().map(|marker| {
            let rest = marker.strip_prefix(prefix.as_str());
            match (rest, &delimiter) {
                (Some(rest), Some(d)) if rest.contains(d.as_str()) => {
                    let end = rest.find(d.as_str()).unwrap_or(0) + d.len();
                    format!("p{}", hex::encode(format!("{prefix}{}", &rest[..end])))
                }
                _ => format!("k{}", hex::encode(marker.as_bytes())),
            }
        });
        let (contents, prefixes, next) = self
            .list_page(
                &input.bucket,
                &prefix,
                delimiter.as_deref(),
                cursor,
                max_keys,
            )
            .await?;
        // The cursor names the last key or prefix returned: that is the
        // next marker.
        let next_marker = next.as_ref().and_then(|c| {
            let bytes = hex::decode(c.get(1..)?).ok()?;
            String::from_utf8(bytes).ok()
        });
        Ok(S3Response::new(ListObjectsOutput {
            name: Some(input.bucket),
            prefix: input.prefix,
            delimiter: input.delimiter,
            marker: input.marker,
            max_keys: Some(max_keys),
            is_truncated: Some(next_marker.is_some()),
            next_marker,
            contents: Some(contents),
            common_prefixes: Some(prefixes),
            ..Default::default()
        }))
    }

    async fn create_multipart_upload(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        let input = req.input;
        self.require_bucket(&input.bucket).await?;
        let record = UploadRecord {
            bucket: input.bucket.clone(),
            key: input.key.clone(),
            content_type: input.content_type.clone(),
            metadata: lowercase_names(input.metadata.clone()),
        };
        let id = self.blocking(move |db| db.create_upload(&record)).await?;
        Ok(S3Response::new(CreateMultipartUploadOutput {
            bucket: Some(input.bucket),
            key: Some(input.key),
            upload_id: Some(id),
            ..Default::default()
        }))
    }

    async fn upload_part(
        &self,
        req: S3Request<UploadPartInput>,
    ) -> S3Result<S3Response<UploadPartOutput>> {
        let input = req.input;
        self.check_part_target(
            &input.upload_id,
            &input.bucket,
            &input.key,
            input.part_number,
        )
        .await?;
        let dir = self.db.upload_dir(&input.upload_id);
        let tmp = dir.join(format!(
            "{}.{}",
            input.part_number,
            uuid::Uuid::new_v4().simple()
        ));
        let received = receive_body(
            &tmp,
            input.body,
            input.content_length,
            input.checksum_crc32c.as_deref(),
            &self.faults,
        )
        .await;
        let Received { md5, crc32c, .. } = received?;
        let etag = hex::encode(md5);
        let dest = dir.join(format!("{}-{}", input.part_number, etag));
        tokio::fs::rename(&tmp, &dest).await.map_err(io_internal)?;
        Ok(S3Response::new(UploadPartOutput {
            e_tag: Some(strong(&etag)),
            checksum_crc32c: Some(crc32c),
            ..Default::default()
        }))
    }

    async fn upload_part_copy(
        &self,
        req: S3Request<UploadPartCopyInput>,
    ) -> S3Result<S3Response<UploadPartCopyOutput>> {
        let input = req.input;
        self.check_part_target(
            &input.upload_id,
            &input.bucket,
            &input.key,
            input.part_number,
        )
        .await?;
        let CopySource::Bucket {
            bucket: src_bucket,
            key: src_key,
            ..
        } = &input.copy_source
        else {
            return Err(s3_error!(NotImplemented, "access-point copy sources"));
        };
        let source = self.record(src_bucket, src_key).await?;
        check_if_match(input.copy_source_if_match.as_ref(), &source)?;
        let range = part_copy::parse_copy_range(input.copy_source_range.as_deref(), source.size)
            .map_err(|m| S3Error::with_message(S3ErrorCode::InvalidArgument, m))?;
        if range.end - range.start > part_copy::MAX_PART_COPY {
            return Err(s3_error!(
                InvalidRequest,
                "a copied part may be at most 5 GiB"
            ));
        }
        let dir = self.db.upload_dir(&input.upload_id);
        let tmp = dir.join(format!(
            "{}.{}",
            input.part_number,
            uuid::Uuid::new_v4().simple()
        ));
        let blob = self.db.blob_path(&source.blob);
        let part = tmp.clone();
        let copied =
            tokio::task::spawn_blocking(move || part_copy::copy_range(&blob, &part, range))
                .await
                .map_err(|e| s3_error!(InternalError, "copy task failed: {e}"))?;
        let (md5, crc) = match copied {
            Ok(hashes) => hashes,
            Err(e) => {
                let _ = tokio::fs::remove_file(&tmp).await;
                return Err(io_internal(e));
            }
        };
        let etag = hex::encode(md5);
        let dest = dir.join(format!("{}-{}", input.part_number, etag));
        tokio::fs::rename(&tmp, &dest).await.map_err(io_internal)?;
        Ok(S3Response::new(UploadPartCopyOutput {
            copy_part_result: Some(CopyPartResult {
                e_tag: Some(strong(&etag)),
                checksum_crc32c: Some(crc32c_base64(crc)),
                last_modified: Some(Timestamp::from(source.last_modified())),
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn complete_multipart_upload(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        let input = req.input;
        let condition = write_condition(input.if_match.as_ref(), input.if_none_match.as_ref())?;
        let upload = input.upload_id.clone();
        let record = self.blocking(move |db| db.get_upload(&upload)).await?;
        let record = match record {
            Some(u) if u.bucket == input.bucket && u.key == input.key => u,
            _ => return Err(s3_error!(NoSuchUpload)),
        };
        let parts = input
            .multipart_upload
            .and_then(|m| m.parts)
            .unwrap_or_default();
        if parts.is_empty() {
            return Err(s3_error!(MalformedXML, "no parts listed"));
        }
        let dir = self.db.upload_dir(&input.upload_id);
        let mut files = Vec::with_capacity(parts.len());
        let mut last_number = 0;
        for part in &parts {
            let number = part.part_number.unwrap_or(0);
            let etag = part
                .e_tag
                .as_ref()
                .map(|e| e.value().to_string())
                .unwrap_or_default();
            if number <= last_number {
                return Err(s3_error!(InvalidPartOrder));
            }
            last_number = number;
            let path = dir.join(format!("{number}-{etag}"));
            let meta = tokio::fs::metadata(&path).await.map_err(|_| {
                s3_error!(InvalidPart, "part {number} with etag {etag} not uploaded")
            })?;
            files.push((path, meta.len(), etag));
        }
        for (i, (_, len, _)) in files.iter().enumerate() {
            if i + 1 < files.len() && *len < MIN_PART_SIZE {
                return Err(s3_error!(EntityTooSmall));
            }
        }
        let tmp = self.db.tmp_path();
        let (size, etag) = concat_parts(&tmp, &files).await.inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
        let attrs = Attrs {
            content_type: record.content_type,
            metadata: record.metadata,
        };
        let (bucket, key, tag) = (record.bucket, record.key, etag.clone());
        let id = input.upload_id.clone();
        // A failed condition leaves the upload to be completed or aborted
        // again, as S3 does.
        self.blocking(move |db| {
            db.commit(&bucket, &key, &tmp, size, tag, attrs, &condition)?;
            db.remove_upload(&id)
        })
        .await?;
        Ok(S3Response::new(CompleteMultipartUploadOutput {
            bucket: Some(input.bucket),
            key: Some(input.key),
            e_tag: Some(strong(&etag)),
            ..Default::default()
        }))
    }

    async fn abort_multipart_upload(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        let id = req.input.upload_id.clone();
        let probe = id.clone();
        if self
            .blocking(move |db| db.get_upload(&probe))
            .await?
            .is_none()
        {
            return Err(s3_error!(NoSuchUpload));
        }
        self.blocking(move |db| db.remove_upload(&id)).await?;
        Ok(S3Response::new(AbortMultipartUploadOutput::default()))
    }
}

/// User metadata names are case-insensitive; S3 keeps them lowercase.
fn lowercase_names(
    metadata: Option<std::collections::HashMap<String, String>>,
) -> std::collections::BTreeMap<String, String> {
    metadata
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect()
}

fn user_metadata(record: &ObjectRecord) -> Option<std::collections::HashMap<String, String>> {
    (!record.metadata.is_empty()).then(|| {
        record
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    })
}

/// Concatenates part files into `dest` (fsynced) and computes the multipart
/// ETag: MD5 over the parts' binary MD5s, suffixed with the part count.
async fn concat_parts(
    dest: &Path,
    files: &[(std::path::PathBuf, u64, String)],
) -> S3Result<(u64, String)> {
    let mut out = tokio::fs::File::create(dest).await.map_err(io_internal)?;
    let mut etag_hasher = Md5::new();
    let mut size = 0u64;
    let mut buf = vec![0u8; READ_CHUNK];
    for (path, _, etag) in files {
        let raw = hex::decode(etag).map_err(|_| s3_error!(InvalidPart))?;
        etag_hasher.update(&raw);
        let mut part = tokio::fs::File::open(path).await.map_err(io_internal)?;
        loop {
            let n = part.read(&mut buf).await.map_err(io_internal)?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n]).await.map_err(io_internal)?;
            size += n as u64;
        }
    }
    out.sync_all().await.map_err(io_internal)?;
    let etag = format!("{}-{}", hex::encode(etag_hasher.finalize()), files.len());
    Ok((size, etag))
}

/// Used by tests and the fault layer to build S3-shaped error bodies.
pub fn error_xml(code: &str, message: &str) -> Bytes {
    Bytes::from(format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(data: &'static [u8]) -> Option<StreamingBlob> {
        let chunks = vec![
            Ok::<_, std::io::Error>(Bytes::from_static(&data[..3])),
            Ok(Bytes::from_static(&data[3..])),
        ];
        Some(StreamingBlob::wrap(futures::stream::iter(chunks)))
    }

    fn request<T>(input: T) -> S3Request<T> {
        S3Request {
            input,
            method: http::Method::GET,
            uri: http::Uri::default(),
            headers: http::HeaderMap::new(),
            extensions: http::Extensions::new(),
            credentials: None,
            region: None,
            service: None,
            trailing_headers: None,
        }
    }

    /// Every page of a v1 listing: (keys and prefixes in order, markers).
    async fn list_v1(
        s3: &EmbeddedS3,
        delimiter: Option<&str>,
        marker: Option<&str>,
    ) -> Vec<String> {
        let mut out = Vec::new();
        let mut marker = marker.map(str::to_string);
        loop {
            let input = ListObjectsInput {
                bucket: "b".into(),
                delimiter: delimiter.map(str::to_string),
                marker: marker.clone(),
                max_keys: Some(2),
                ..Default::default()
            };
            let page = s3.list_objects(request(input)).await.unwrap().output;
            for o in page.contents.unwrap_or_default() {
                out.push(o.key.unwrap());
            }
            for p in page.common_prefixes.unwrap_or_default() {
                out.push(p.prefix.unwrap());
            }
            if page.is_truncated != Some(true) {
                return out;
            }
            marker = page.next_marker;
            assert!(marker.is_some(), "a truncated page names its next marker");
        }
    }

    #[tokio::test]
    async fn v1_listings_page_by_marker_and_skip_a_common_prefix_named_as_marker() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(ObjectDb::open(dir.path()).unwrap());
        db.create_bucket("b").unwrap();
        for key in ["a", "b", "dir/x", "dir/y", "e", "f"] {
            let tmp = db.tmp_path();
            std::fs::write(&tmp, key).unwrap();
            db.commit(
                "b",
                key,
                &tmp,
                key.len() as u64,
                key.into(),
                Attrs::default(),
                &WriteCondition::None,
            )
            .unwrap();
        }
        let s3 = EmbeddedS3::new(db, false, Arc::new(FaultInjector::default()));
        let mut with_delimiter = list_v1(&s3, Some("/"), None).await;
        with_delimiter.sort();
        assert_eq!(with_delimiter, ["a", "b", "dir/", "e", "f"]);
        assert_eq!(
            list_v1(&s3, None, None).await,
            ["a", "b", "dir/x", "dir/y", "e", "f"]
        );
        // A marker that is (or lies in) a common prefix skips all of it.
        assert_eq!(list_v1(&s3, Some("/"), Some("dir/")).await, ["e", "f"]);
        assert_eq!(list_v1(&s3, Some("/"), Some("dir/x")).await, ["e", "f"]);
        assert_eq!(list_v1(&s3, None, Some("dir/x")).await, ["dir/y", "e", "f"]);
    }

    #[tokio::test]
    async fn a_body_not_matching_its_crc32c_is_bad_digest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("body");
        let faults = FaultInjector::default();
        let data = b"checkpoint shard";
        let right = crc32c_base64(crc32c::crc32c(data));
        let got = receive_body(&path, blob(data), Some(16), Some(&right), &faults)
            .await
            .unwrap();
        assert_eq!((got.size, got.crc32c.as_str()), (16, right.as_str()));
        assert_eq!(faults.checksums_verified(), 1);
        // Without a checksum the body is still taken (most clients send none).
        receive_body(&path, blob(data), Some(16), None, &faults)
            .await
            .unwrap();
        // One flipped bit in what arrived, as the client's CRC describes
        // the bytes it sent.
        let err = receive_body(
            &path,
            blob(b"checkpoint shard"),
            Some(16),
            Some("AAAAAA=="),
            &faults,
        )
        .await
        .err()
        .unwrap();
        assert_eq!(*err.code(), S3ErrorCode::BadDigest);
        assert_eq!(faults.checksums_verified(), 1);
    }
}
