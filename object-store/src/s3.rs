//! The aws-sdk-s3 implementation of [`ObjectStore`].

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_s3::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_s3::config::{
    BehaviorVersion, ConfigBag, Credentials, Intercept, Region, RequestChecksumCalculation,
    ResponseChecksumValidation, RuntimeComponents,
};
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{
    ChecksumAlgorithm, CompletedMultipartUpload, CompletedPart, MetadataDirective,
};
use aws_smithy_runtime_api::client::orchestrator::Metadata;
use aws_smithy_runtime_api::client::retries::RequestAttempts;
use bytes::Bytes;
use lakecache_protocol::{ListEntry, ListResponse, ObjectUri, UserMeta};

use crate::{
    crc32c_header, unquote_etag, CopyRange, ObjectMeta, ObjectStore, PartReceipt, StoreError,
    StoreMetrics, WriteIf,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RetryMode {
    Standard,
    Adaptive,
}

impl std::str::FromStr for RetryMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "standard" => Ok(Self::Standard),
            "adaptive" => Ok(Self::Adaptive),
            other => Err(format!(
                "retry mode must be standard or adaptive, got {other:?}"
            )),
        }
    }
}

/// How to reach S3. Credentials come from the standard AWS chain unless
/// `static_credentials` is set (the embedded endpoint).
#[derive(Clone)]
pub struct S3Config {
    pub endpoint: Option<String>,
    pub region: String,
    pub path_style: bool,
    pub retry_mode: RetryMode,
    pub max_attempts: u32,
    /// Re-requests of the remaining range after a body breaks mid-stream.
    pub max_resumes: u32,
    pub connect_timeout: Duration,
    pub attempt_timeout: Duration,
    /// An upload (a part, or a whole small object) that has not finished
    /// within this long plus a second per MiB is taken for stalled: its
    /// connection is dropped and it is sent again on a new one.
    pub stall_timeout: Duration,
    pub static_credentials: Option<(String, String)>,
    /// CRC32C on every upload for the store to check (S3 answers
    /// BadDigest when the bytes it got differ from what was sent).
    pub checksums: bool,
}

impl fmt::Debug for S3Config {
    // Hand-written so secrets never reach a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("path_style", &self.path_style)
            .field("retry_mode", &self.retry_mode)
            .field("max_attempts", &self.max_attempts)
            .field("max_resumes", &self.max_resumes)
            .field("stall_timeout", &self.stall_timeout)
            .field("checksums", &self.checksums)
            .field(
                "static_credentials",
                &self.static_credentials.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl Default for S3Config {
    fn default() -> Self {
        Self {
            endpoint: None,
            region: "us-east-1".into(),
            path_style: false,
            retry_mode: RetryMode::Standard,
            max_attempts: 5,
            max_resumes: 3,
            connect_timeout: Duration::from_secs(5),
            attempt_timeout: Duration::from_secs(60),
            stall_timeout: Duration::from_secs(10),
            static_credentials: None,
            checksums: true,
        }
    }
}

/// Adds the current span's `traceparent` to every S3 request (after
/// signing: it is not a signed header), so the store's side of a slow read
/// joins the trace.
#[derive(Debug)]
struct TraceParent;

impl Intercept for TraceParent {
    fn name(&self) -> &'static str {
        "lakecache-traceparent"
    }

    fn modify_before_transmit(
        &self,
        ctx: &mut aws_sdk_s3::config::interceptors::BeforeTransmitInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), aws_sdk_s3::error::BoxError> {
        if let Some(parent) = lakecache_protocol::trace_context::current() {
            ctx.request_mut()
                .headers_mut()
                .insert("traceparent", parent);
        }
        Ok(())
    }
}

/// Counts SDK-internal retries (attempts after the first) by operation.
#[derive(Debug)]
struct RetryCounter(Arc<dyn StoreMetrics>);

impl Intercept for RetryCounter {
    fn name(&self) -> &'static str {
        "lakecache-retry-counter"
    }

    fn read_before_attempt(
        &self,
        _ctx: &BeforeTransmitInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), aws_sdk_s3::error::BoxError> {
        let attempts = cfg
            .load::<RequestAttempts>()
            .map(|a| a.attempts())
            .unwrap_or(1);
        if attempts > 1 {
            let op = cfg
                .load::<Metadata>()
                .map(|m| m.name().to_string())
                .unwrap_or_default();
            self.0.s3_retry(&op);
        }
        Ok(())
    }
}

pub struct S3Store {
    client: aws_sdk_s3::Client,
    max_resumes: u32,
    stall_timeout: Duration,
    checksums: bool,
    metrics: Arc<dyn StoreMetrics>,
}

impl S3Store {
    pub async fn new(config: &S3Config, metrics: Arc<dyn StoreMetrics>) -> Self {
        let retry = match config.retry_mode {
            RetryMode::Standard => aws_sdk_s3::config::retry::RetryConfig::standard(),
            RetryMode::Adaptive => aws_sdk_s3::config::retry::RetryConfig::adaptive(),
        }
        .with_max_attempts(config.max_attempts.max(1));
        let timeouts = aws_sdk_s3::config::timeout::TimeoutConfig::builder()
            .connect_timeout(config.connect_timeout)
            .operation_attempt_timeout(config.attempt_timeout)
            .build();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .region(Region::new(config.region.clone()))
            .retry_config(retry)
            .timeout_config(timeouts);
        if let Some((access, secret)) = &config.static_credentials {
            loader = loader.credentials_provider(Credentials::new(
                access.clone(),
                secret.clone(),
                None,
                None,
                "lakecache-static",
            ));
        }
        let shared = loader.load().await;
        let mut builder = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(config.path_style)
            // Many S3-compatible stores reject aws-chunked checksum trailers.
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            .interceptor(RetryCounter(metrics.clone()))
            .interceptor(TraceParent);
        if let Some(endpoint) = &config.endpoint {
            builder = builder.endpoint_url(endpoint);
        }
        Self {
            client: aws_sdk_s3::Client::from_conf(builder.build()),
            max_resumes: config.max_resumes,
            stall_timeout: config.stall_timeout,
            checksums: config.checksums,
            metrics,
        }
    }

    /// Sends an upload of `len` bytes (`send` builds it anew each time),
    /// allowing it the stall timeout plus a second per MiB. One that takes
    /// longer (a store that stopped reading the body, a half-dead
    /// connection) is dropped with its connection and sent again on a new
    /// one, at most [`STALL_RETRIES`] more times.
    async fn unstalled<T, E, F, Fut>(
        &self,
        op: &'static str,
        uri: &ObjectUri,
        len: usize,
        send: F,
    ) -> Result<T, StoreError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, SdkError<E>>>,
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let allowed = self.stall_timeout + Duration::from_secs((len as u64).div_ceil(1 << 20));
        for attempt in 0..=STALL_RETRIES {
            match tokio::time::timeout(allowed, send()).await {
                Ok(result) => return result.map_err(map_sdk_error),
                Err(_) => {
                    tracing::warn!(%uri, op, len, attempt, ?allowed, "an upload to S3 made no progress in time; sending it again on a new connection");
                    self.metrics.s3_retry(op);
                }
            }
        }
        Err(StoreError::Unavailable(format!(
            "{op} of {len} bytes for {uri} did not finish within {allowed:?}, {} times",
            STALL_RETRIES + 1
        )))
    }
}

/// Sends of a stalled upload after the first.
const STALL_RETRIES: u32 = 2;

fn map_sdk_error<E>(err: SdkError<E>) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let status = err.raw_response().map(|r| r.status().as_u16());
    let code = err.code().unwrap_or("").to_string();
    let detail = format!("{}", aws_sdk_s3::error::DisplayErrorContext(&err));
    match (&err, status) {
        (_, Some(404)) => StoreError::NotFound,
        (_, Some(412)) => StoreError::PreconditionFailed,
        // A conditional write that raced another write to the same key:
        // S3 asks for it to be tried again, which means checking anew.
        (_, Some(409)) if code == "ConditionalRequestConflict" => StoreError::PreconditionFailed,
        (_, Some(501)) => StoreError::Unsupported(detail),
        (_, Some(403)) => StoreError::AccessDenied(code),
        (_, Some(503)) if code == "SlowDown" || code.is_empty() => StoreError::Throttled(detail),
        (_, Some(s)) if s >= 500 => StoreError::Unavailable(detail),
        (SdkError::TimeoutError(_), _) | (SdkError::DispatchFailure(_), _) => {
            StoreError::Unavailable(detail)
        }
        (SdkError::ResponseError(_), _) => StoreError::InvalidResponse(detail),
        _ => StoreError::Other(detail),
    }
}

/// `If-Match` and `If-None-Match` for a write under `condition`.
fn condition_headers(condition: &WriteIf) -> (Option<String>, Option<String>) {
    match condition {
        WriteIf::Always => (None, None),
        WriteIf::Absent => (None, Some("*".into())),
        WriteIf::Matches(etag) => (Some(quoted(etag)), None),
    }
}

fn millis(t: Option<&aws_sdk_s3::primitives::DateTime>) -> i64 {
    t.and_then(|t| t.to_millis().ok()).unwrap_or(0)
}

fn quoted(etag: &str) -> String {
    format!("\"{etag}\"")
}

#[async_trait::async_trait]
impl ObjectStore for S3Store {
    async fn head(&self, uri: &ObjectUri) -> Result<ObjectMeta, StoreError> {
        self.head_versioned(uri).await.map(|(meta, _)| meta)
    }

    async fn get_range(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
    ) -> Result<Bytes, StoreError> {
        self.get_range_of(uri, range, etag, None).await
    }

    async fn current_version(
        &self,
        uri: &ObjectUri,
    ) -> Result<(ObjectMeta, Option<String>), StoreError> {
        self.head_versioned(uri).await
    }

    async fn get_range_version(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        version_id: &str,
        etag: &str,
    ) -> Result<Bytes, StoreError> {
        self.get_range_of(uri, range, etag, Some(version_id)).await
    }

    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: u32,
    ) -> Result<ListResponse, StoreError> {
        let out = self
            .client
            .list_objects_v2()
            .bucket(bucket)
            .prefix(prefix)
            .set_delimiter(delimiter.map(str::to_string))
            .set_continuation_token(token.map(str::to_string))
            .max_keys(max_keys as i32)
            .send()
            .await
            .map_err(map_sdk_error)?;
        let objects = out
            .contents()
            .iter()
            .map(|o| ListEntry {
                key: o.key().unwrap_or_default().to_string(),
                size: o.size().unwrap_or(0).max(0) as u64,
                etag: o.e_tag().map(unquote_etag).unwrap_or_default(),
                last_modified_ms: millis(o.last_modified()),
                meta: None,
            })
            .collect();
        let common_prefixes = out
            .common_prefixes()
            .iter()
            .filter_map(|p| p.prefix().map(str::to_string))
            .collect();
        let next_token = if out.is_truncated().unwrap_or(false) {
            out.next_continuation_token().map(str::to_string)
        } else {
            None
        };
        Ok(ListResponse {
            objects,
            common_prefixes,
            next_token,
        })
    }

    async fn put_if(
        &self,
        uri: &ObjectUri,
        data: Bytes,
        meta: &UserMeta,
        condition: &WriteIf,
    ) -> Result<String, StoreError> {
        let len = data.len() as i64;
        let crc = self.checksums.then(|| crc32c_header(&data));
        let (if_match, if_none_match) = condition_headers(condition);
        let out = self
            .unstalled("PutObject", uri, data.len(), || {
                self.client
                    .put_object()
                    .bucket(uri.bucket())
                    .key(uri.key())
                    .set_metadata(sdk_meta(meta))
                    .content_length(len)
                    .set_checksum_crc32_c(crc.clone())
                    .set_if_match(if_match.clone())
                    .set_if_none_match(if_none_match.clone())
                    .body(ByteStream::from(data.clone()))
                    .send()
            })
            .await?;
        out.e_tag()
            .map(unquote_etag)
            .ok_or_else(|| StoreError::InvalidResponse("PUT without ETag".into()))
    }

    async fn create_multipart(
        &self,
        uri: &ObjectUri,
        meta: &UserMeta,
    ) -> Result<String, StoreError> {
        let out = self
            .client
            .create_multipart_upload()
            .bucket(uri.bucket())
            .key(uri.key())
            .set_metadata(sdk_meta(meta))
            .set_checksum_algorithm(self.checksums.then_some(ChecksumAlgorithm::Crc32C))
            .send()
            .await
            .map_err(map_sdk_error)?;
        out.upload_id()
            .map(str::to_string)
            .ok_or_else(|| StoreError::InvalidResponse("no upload id".into()))
    }

    async fn upload_part(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        part_number: i32,
        data: Bytes,
    ) -> Result<PartReceipt, StoreError> {
        let len = data.len() as i64;
        // The store checks the part against it: a byte flipped on the way
        // fails the part instead of landing in the object.
        let crc = self.checksums.then(|| crc32c_header(&data));
        let out = self
            .unstalled("UploadPart", uri, data.len(), || {
                self.client
                    .upload_part()
                    .bucket(uri.bucket())
                    .key(uri.key())
                    .upload_id(upload_id)
                    .part_number(part_number)
                    .content_length(len)
                    .set_checksum_crc32_c(crc.clone())
                    .body(ByteStream::from(data.clone()))
                    .send()
            })
            .await?;
        let etag = out
            .e_tag()
            .map(str::to_string)
            .ok_or_else(|| StoreError::InvalidResponse("part without ETag".into()))?;
        Ok(PartReceipt { etag, crc32c: crc })
    }

    async fn complete_multipart_if(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        parts: Vec<(i32, PartReceipt)>,
        condition: &WriteIf,
    ) -> Result<String, StoreError> {
        let parts = parts
            .into_iter()
            .map(|(n, part)| {
                CompletedPart::builder()
                    .part_number(n)
                    .e_tag(part.etag)
                    .set_checksum_crc32_c(part.crc32c)
                    .build()
            })
            .collect();
        let (if_match, if_none_match) = condition_headers(condition);
        let out = self
            .client
            .complete_multipart_upload()
            .bucket(uri.bucket())
            .key(uri.key())
            .upload_id(upload_id)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            )
            .set_if_match(if_match)
            .set_if_none_match(if_none_match)
            .send()
            .await
            .map_err(map_sdk_error)?;
        out.e_tag()
            .map(unquote_etag)
            .ok_or_else(|| StoreError::InvalidResponse("complete without ETag".into()))
    }

    async fn abort_multipart(&self, uri: &ObjectUri, upload_id: &str) -> Result<(), StoreError> {
        self.client
            .abort_multipart_upload()
            .bucket(uri.bucket())
            .key(uri.key())
            .upload_id(upload_id)
            .send()
            .await
            .map_err(map_sdk_error)?;
        Ok(())
    }

    async fn delete(&self, uri: &ObjectUri) -> Result<(), StoreError> {
        self.client
            .delete_object()
            .bucket(uri.bucket())
            .key(uri.key())
            .send()
            .await
            .map_err(map_sdk_error)?;
        Ok(())
    }

    async fn upload_part_copy(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        part_number: i32,
        source: &CopyRange<'_>,
    ) -> Result<PartReceipt, StoreError> {
        if source.range.is_empty() {
            return Err(StoreError::Other("empty copy range".into()));
        }
        let out = self
            .client
            .upload_part_copy()
            .bucket(uri.bucket())
            .key(uri.key())
            .upload_id(upload_id)
            .part_number(part_number)
            .copy_source(copy_source(source.from))
            .copy_source_if_match(quoted(source.etag))
            .copy_source_range(format!(
                "bytes={}-{}",
                source.range.start,
                source.range.end - 1
            ))
            .send()
            .await
            .map_err(map_sdk_error)?;
        let result = out
            .copy_part_result()
            .ok_or_else(|| StoreError::InvalidResponse("part copy without a result".into()))?;
        let etag = result
            .e_tag()
            .map(str::to_string)
            .ok_or_else(|| StoreError::InvalidResponse("copied part without ETag".into()))?;
        let crc32c = result.checksum_crc32_c().map(str::to_string);
        Ok(PartReceipt { etag, crc32c })
    }

    async fn copy(
        &self,
        from: &ObjectUri,
        etag: &str,
        to: &ObjectUri,
        meta: Option<&UserMeta>,
    ) -> Result<ObjectMeta, StoreError> {
        self.client
            .copy_object()
            .bucket(to.bucket())
            .key(to.key())
            .copy_source(copy_source(from))
            .copy_source_if_match(quoted(etag))
            .set_metadata_directive(meta.map(|_| MetadataDirective::Replace))
            .set_metadata(meta.and_then(sdk_meta))
            .send()
            .await
            .map_err(map_sdk_error)?;
        // CopyObject's ETag is in an XML body some stores leave out; ask.
        self.head(to).await
    }
}

/// `x-amz-copy-source` for `from`: bucket/key, the key escaped.
fn copy_source(from: &ObjectUri) -> String {
    format!(
        "{}/{}",
        from.bucket(),
        percent_encoding::utf8_percent_encode(from.key(), COPY_SOURCE_ESCAPE)
    )
}

/// User metadata as the SDK takes it; none when empty.
fn sdk_meta(meta: &UserMeta) -> Option<std::collections::HashMap<String, String>> {
    (!meta.is_empty()).then(|| meta.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

/// Everything but unreserved characters and `/` is escaped in
/// `x-amz-copy-source`.
const COPY_SOURCE_ESCAPE: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'/')
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

impl S3Store {
    /// HEAD: the metadata and, in a versioned bucket, the version id.
    async fn head_versioned(
        &self,
        uri: &ObjectUri,
    ) -> Result<(ObjectMeta, Option<String>), StoreError> {
        let out = self
            .client
            .head_object()
            .bucket(uri.bucket())
            .key(uri.key())
            .send()
            .await
            .map_err(map_sdk_error)?;
        let etag = out
            .e_tag()
            .map(unquote_etag)
            .ok_or_else(|| StoreError::InvalidResponse("HEAD without ETag".into()))?;
        let size = out
            .content_length()
            .filter(|n| *n >= 0)
            .ok_or_else(|| StoreError::InvalidResponse("HEAD without Content-Length".into()))?;
        // The SDK keeps the names as sent; S3 lowercases them.
        let user = out
            .metadata()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let version = out
            .version_id()
            .filter(|v| !v.is_empty() && *v != "null")
            .map(str::to_string);
        let meta = ObjectMeta {
            size: size as u64,
            etag,
            last_modified_ms: millis(out.last_modified()),
            user,
        };
        Ok((meta, version))
    }

    /// Exactly `range` of the object (of version `version`, when given),
    /// which must carry `etag`.
    async fn get_range_of(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
        version: Option<&str>,
    ) -> Result<Bytes, StoreError> {
        let want = (range.end - range.start) as usize;
        let mut buf = lakecache_protocol::buffer_pool::take(want);
        let mut resumes = 0u32;
        while buf.len() < want {
            let start = range.start + buf.len() as u64;
            let out = self
                .client
                .get_object()
                .bucket(uri.bucket())
                .key(uri.key())
                .range(format!("bytes={start}-{}", range.end - 1))
                .if_match(quoted(etag))
                .set_version_id(version.map(str::to_string))
                .send()
                .await
                .map_err(map_sdk_error)?;
            // Stores that ignore If-Match must not mix versions either.
            if let Some(got) = out.e_tag() {
                if unquote_etag(got) != etag {
                    return Err(StoreError::PreconditionFailed);
                }
            }
            let mut body = out.body;
            let broken = loop {
                match body.try_next().await {
                    Ok(Some(chunk)) => {
                        if buf.len() + chunk.len() > want {
                            return Err(StoreError::InvalidResponse(format!(
                                "asked for {want} bytes, got more"
                            )));
                        }
                        buf.extend_from_slice(&chunk);
                    }
                    Ok(None) => break None,
                    Err(e) => break Some(e.to_string()),
                }
            };
            if buf.len() < want {
                // The SDK does not retry a body that fails after the
                // headers: resume with the remaining range.
                resumes += 1;
                self.metrics.s3_retry("GetObject.resume");
                let why = broken.unwrap_or_else(|| "body ended early".into());
                tracing::warn!(%uri, got = buf.len(), want, resumes, error = %why, "s3 body broke, resuming");
                if resumes > self.max_resumes {
                    return Err(StoreError::Unavailable(format!(
                        "body broke {resumes} times: {why}"
                    )));
                }
            }
        }
        Ok(lakecache_protocol::buffer_pool::freeze(buf))
    }
}
