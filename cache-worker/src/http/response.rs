//! Building responses: JSON errors with stable codes, JSON bodies.

use bytes::Bytes;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use lakecache_protocol::{ErrorBody, ErrorCode};

use crate::cache::CacheError;
use crate::store::StoreError;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Unsync: read streams hold S3 futures that are `Send` but not `Sync`.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;
pub type Response = http::Response<ResponseBody>;

pub fn full(data: impl Into<Bytes>) -> ResponseBody {
    Full::new(data.into())
        .map_err(|e| match e {})
        .boxed_unsync()
}

pub fn json<T: serde::Serialize>(status: http::StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => {
            let mut resp = http::Response::new(full(body));
            *resp.status_mut() = status;
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            resp
        }
        Err(e) => error(ErrorCode::Internal, format!("encoding response: {e}")),
    }
}

/// An error response; the status follows from the code.
pub fn error(code: ErrorCode, message: impl Into<String>) -> Response {
    let status = http::StatusCode::from_u16(code.http_status())
        .unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = json(status, &ErrorBody::new(code, message));
    *resp.status_mut() = status;
    if code == ErrorCode::UpstreamThrottled {
        resp.headers_mut().insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
    }
    resp
}

pub fn cache_error(e: &CacheError) -> Response {
    let code = match e {
        CacheError::Store(StoreError::NotFound) => ErrorCode::NotFound,
        CacheError::Store(StoreError::PreconditionFailed) => ErrorCode::PreconditionFailed,
        CacheError::Store(StoreError::AccessDenied(_)) => ErrorCode::AccessDenied,
        CacheError::Store(StoreError::Throttled(_)) => ErrorCode::UpstreamThrottled,
        CacheError::Store(StoreError::Unavailable(_)) => ErrorCode::UpstreamUnavailable,
        CacheError::Store(StoreError::InvalidResponse(_) | StoreError::Other(_)) => {
            ErrorCode::UpstreamError
        }
        CacheError::Local(_) => ErrorCode::Internal,
        CacheError::Body(_) | CacheError::Invalid(_) => ErrorCode::BadRequest,
        CacheError::BodyTooLarge(_) => ErrorCode::BodyTooLarge,
        CacheError::BodyIdle(_) => ErrorCode::BodyTimeout,
        CacheError::CopyTooLarge(_) => ErrorCode::CopyTooLarge,
        CacheError::ChecksumMismatch(_) => ErrorCode::ChecksumMismatch,
        CacheError::StagingFull(_) => ErrorCode::StagingFull,
        CacheError::ReplicasUnavailable(_) => ErrorCode::ReplicasUnavailable,
        CacheError::ShuttingDown => ErrorCode::UpstreamUnavailable,
    };
    error(code, e.to_string())
}
