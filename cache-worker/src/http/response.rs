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
    error(cache_error_code(e), e.to_string())
}

pub fn cache_error_code(e: &CacheError) -> ErrorCode {
    match e {
        CacheError::Store(StoreError::NotFound) => ErrorCode::NotFound,
        CacheError::Store(StoreError::PreconditionFailed) => ErrorCode::PreconditionFailed,
        CacheError::Store(StoreError::AccessDenied(_)) => ErrorCode::AccessDenied,
        CacheError::Store(StoreError::Throttled(_)) => ErrorCode::UpstreamThrottled,
        CacheError::Store(StoreError::Unavailable(_)) => ErrorCode::UpstreamUnavailable,
        CacheError::Store(
            StoreError::InvalidResponse(_) | StoreError::Unsupported(_) | StoreError::Other(_),
        ) => ErrorCode::UpstreamError,
        CacheError::Local(_) => ErrorCode::Internal,
        CacheError::Body(_) | CacheError::Invalid(_) | CacheError::FollowedFileChanged(_) => {
            ErrorCode::BadRequest
        }
        CacheError::BodyTooLarge(_) => ErrorCode::BodyTooLarge,
        CacheError::BodyIdle(_) => ErrorCode::BodyTimeout,
        CacheError::CopyTooLarge(_) => ErrorCode::CopyTooLarge,
        CacheError::ChecksumMismatch(_) => ErrorCode::ChecksumMismatch,
        CacheError::Fenced(_) => ErrorCode::WriteFenced,
        CacheError::StagingFull(_) => ErrorCode::StagingFull,
        CacheError::ReplicasUnavailable(_) => ErrorCode::ReplicasUnavailable,
        CacheError::ShuttingDown => ErrorCode::UpstreamUnavailable,
    }
}

/// How often a slow JSON answer sends a byte while it is being built.
const KEEPALIVE: std::time::Duration = std::time::Duration::from_millis(500);

/// A JSON answer that takes a while to build (a listing whose metadata the
/// worker is fetching from S3): a space goes out every [`KEEPALIVE`] until
/// `value` is ready, so a client's between-bytes deadline measures
/// progress rather than the total work. JSON allows leading whitespace.
/// A client that goes away cancels the work.
pub fn json_when_ready<T>(value: tokio::task::JoinHandle<T>) -> Response
where
    T: serde::Serialize + Send + 'static,
{
    use http_body::Frame;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(2);
    tokio::spawn(async move {
        let mut value = value;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
        loop {
            tokio::select! {
                done = &mut value => {
                    let frame = match done {
                        Ok(v) => serde_json::to_vec(&v)
                            .map(|b| Frame::data(Bytes::from(b)))
                            .map_err(|e| -> BoxError { Box::new(e) }),
                        Err(e) => Err(Box::new(e) as BoxError),
                    };
                    let _ = tx.send(frame).await;
                    return;
                }
                _ = tick.tick() => {
                    if tx.send(Ok(Frame::data(Bytes::from_static(b" ")))).await.is_err() {
                        value.abort();
                        return;
                    }
                }
            }
        }
    });
    let frames = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    });
    let mut resp = http::Response::new(http_body_util::StreamBody::new(frames).boxed_unsync());
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_slow_json_answer_sends_spaces_until_it_is_ready_and_then_parses() {
        let work = tokio::spawn(async {
            tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
            vec!["a".to_string(), "b".to_string()]
        });
        let mut body = json_when_ready(work).into_body();
        let mut frames = Vec::new();
        while let Some(frame) = body.frame().await {
            frames.push(frame.expect("no error frame").into_data().expect("data"));
        }
        // At least the keepalive due at 500 ms, then the value.
        let (value, keepalives) = frames.split_last().expect("frames");
        assert!(!keepalives.is_empty(), "{frames:?}");
        assert!(keepalives.iter().all(|f| f.as_ref() == b" "));
        assert_ne!(value.as_ref(), b" ");
        let all: Vec<u8> = frames.concat();
        let parsed: Vec<String> = serde_json::from_slice(&all).expect("valid JSON");
        assert_eq!(parsed, ["a", "b"]);
    }
}
