//! A PUT's body as the cache consumes it: its size bounded, its CRC32C
//! checked against the client's trailer before the stream ends (a
//! mismatch fails the write before anything is acknowledged or completed
//! in S3), and its end signalled to the handler.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use futures::Stream;
use http_body_util::BodyStream;
use hyper::body::Incoming;
use lakecache_protocol::BODY_CRC32C_TRAILER;
use tokio::sync::oneshot;

use super::limits::{BodyIdle, IdleTimeoutBody};
use super::response::BoxError;
use crate::cache::CacheError;

pub struct CheckedBody {
    inner: Pin<Box<BodyStream<IdleTimeoutBody<Incoming>>>>,
    received: u64,
    limit: u64,
    crc: u32,
    /// The client declared the CRC32C trailer: a missing one is an error.
    required: bool,
    /// The trailer's value, for the write-back stage to keep.
    client_crc: Arc<OnceLock<u32>>,
    done: bool,
    /// Fired once the whole body arrived and checked out.
    arrived: Option<oneshot::Sender<()>>,
}

impl CheckedBody {
    pub fn new(
        body: IdleTimeoutBody<Incoming>,
        limit: u64,
        required: bool,
        client_crc: Arc<OnceLock<u32>>,
    ) -> (Self, oneshot::Receiver<()>) {
        let (arrived, rx) = oneshot::channel();
        let body = Self {
            inner: Box::pin(BodyStream::new(body)),
            received: 0,
            limit,
            crc: 0,
            required,
            client_crc,
            done: false,
            arrived: Some(arrived),
        };
        (body, rx)
    }

    fn fail(&mut self, e: CacheError) -> Poll<Option<Result<Bytes, CacheError>>> {
        self.done = true;
        Poll::Ready(Some(Err(e)))
    }

    fn trailer(&mut self, trailers: &http::HeaderMap) -> Result<(), CacheError> {
        let Some(v) = trailers.get(BODY_CRC32C_TRAILER) else {
            return Ok(());
        };
        let sent = v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .ok_or_else(|| {
                CacheError::Invalid(format!(
                    "trailer {BODY_CRC32C_TRAILER} must be a decimal CRC32C"
                ))
            })?;
        let _ = self.client_crc.set(sent);
        if sent != self.crc {
            return Err(CacheError::ChecksumMismatch(format!(
                "the body's CRC32C is {:08x}, the client sent {sent:08x}: bytes changed on the way",
                self.crc
            )));
        }
        Ok(())
    }
}

/// A body read failure, as the cache reports it (an idle client apart).
pub(super) fn body_error(e: BoxError) -> CacheError {
    match e.downcast_ref::<BodyIdle>() {
        Some(idle) => CacheError::BodyIdle(idle.to_string()),
        None => CacheError::Body(e.to_string()),
    }
}

impl Stream for CheckedBody {
    type Item = Result<Bytes, CacheError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            let frame = match ready!(this.inner.as_mut().poll_next(cx)) {
                Some(Ok(frame)) => frame,
                Some(Err(e)) => return this.fail(body_error(e)),
                None => {
                    this.done = true;
                    if this.required && this.client_crc.get().is_none() {
                        return this.fail(CacheError::ChecksumMismatch(format!(
                            "the client declared the {BODY_CRC32C_TRAILER} trailer but sent none"
                        )));
                    }
                    if let Some(arrived) = this.arrived.take() {
                        let _ = arrived.send(());
                    }
                    return Poll::Ready(None);
                }
            };
            match frame.into_data() {
                Ok(data) => {
                    this.received += data.len() as u64;
                    if this.received > this.limit {
                        return this.fail(CacheError::BodyTooLarge(this.limit));
                    }
                    this.crc = crc32c::crc32c_append(this.crc, &data);
                    return Poll::Ready(Some(Ok(data)));
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        if let Err(e) = this.trailer(&trailers) {
                            return this.fail(e);
                        }
                    }
                }
            }
        }
    }
}
