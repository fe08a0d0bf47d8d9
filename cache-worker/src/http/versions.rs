//! `/v1/version/{bucket}/{key}`: object versions, for clients pinned to a
//! snapshot of a versioned bucket.
//!
//! - `GET` without a query: the current version (`ObjectVersion`).
//! - `GET ?version_id=V&etag=E&start=S&end=N`: exactly those bytes of
//!   version V, which must carry ETag E. Read through from S3 and not
//!   cached: the page cache keeps an object under its current ETag only.

use http::StatusCode;
use lakecache_protocol::{ErrorCode, ObjectUri, ObjectVersion};

use super::response::{cache_error, error, full, json, Response};
use super::routes::{parse_uri, AppState};
use crate::cache::CacheError;

/// The most one request may ask for (the body is held in memory).
const MAX_VERSION_READ: u64 = 64 << 20;

pub(super) async fn route(
    state: &AppState,
    access: &super::auth::Access<'_>,
    rest: &str,
    query: &str,
) -> Response {
    let uri = match parse_uri(rest) {
        Ok(u) => u,
        Err(resp) => return *resp,
    };
    if let Err(denied) = access.read(&uri) {
        return *denied;
    }
    if query.is_empty() {
        return current(state, &uri).await;
    }
    let (mut version, mut etag, mut start, mut end) = (None, None, None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let Some((k, v)) = pair.split_once('=') else {
            return error(
                ErrorCode::BadRequest,
                format!("malformed query pair {pair:?}"),
            );
        };
        let v = match percent_encoding::percent_decode_str(v).decode_utf8() {
            Ok(v) => v.into_owned(),
            Err(_) => return error(ErrorCode::BadRequest, format!("{k} is not valid UTF-8")),
        };
        match k {
            "version_id" => version = Some(v),
            "etag" => etag = Some(v),
            "start" | "end" => {
                let Ok(n) = v.parse::<u64>() else {
                    return error(ErrorCode::BadRequest, format!("{k}={v:?} is not a number"));
                };
                if k == "start" {
                    start = Some(n);
                } else {
                    end = Some(n);
                }
            }
            _ => return error(ErrorCode::BadRequest, format!("unknown parameter {k:?}")),
        }
    }
    let (Some(version), Some(etag), Some(start), Some(end)) = (version, etag, start, end) else {
        return error(
            ErrorCode::BadRequest,
            "a version read needs version_id, etag, start and end",
        );
    };
    if end <= start || end - start > MAX_VERSION_READ {
        return error(
            ErrorCode::InvalidRange,
            format!("range {start}..{end} is empty or over {MAX_VERSION_READ} bytes"),
        );
    }
    match state
        .cache
        .store
        .get_range_version(&uri, start..end, &version, &etag)
        .await
    {
        Ok(bytes) => http::Response::builder()
            .status(StatusCode::OK)
            .header(http::header::CONTENT_TYPE, "application/octet-stream")
            .header(http::header::ETAG, format!("\"{etag}\""))
            .body(full(bytes))
            .unwrap_or_else(|e| error(ErrorCode::Internal, e.to_string())),
        Err(e) => cache_error(&CacheError::Store(e)),
    }
}

async fn current(state: &AppState, uri: &ObjectUri) -> Response {
    match state.cache.store.current_version(uri).await {
        Ok((meta, version_id)) => json(
            StatusCode::OK,
            &ObjectVersion {
                size: meta.size,
                etag: meta.etag,
                last_modified_ms: meta.last_modified_ms,
                version_id,
            },
        ),
        Err(e) => cache_error(&CacheError::Store(e)),
    }
}
