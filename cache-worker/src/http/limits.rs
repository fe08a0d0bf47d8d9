//! Limits against one client or tenant taking the whole worker: a
//! concurrency limiter per tenant, and an idle timeout on request bodies.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use lakecache_protocol::ErrorCode;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::response::{error, BoxError, Response, ResponseBody};

/// Requests in flight per tenant (anonymous callers share one slot set).
/// The operations issue's request-rate quotas hang off the same map.
pub struct TenantLimiter {
    per_tenant: usize,
    wait: Duration,
    tenants: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl TenantLimiter {
    pub fn new(per_tenant: usize, wait: Duration) -> Self {
        Self {
            per_tenant: per_tenant.max(1),
            wait,
            tenants: Mutex::default(),
        }
    }

    fn slots(&self, tenant: &str) -> Arc<Semaphore> {
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        tenants
            .entry(tenant.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(self.per_tenant)))
            .clone()
    }

    /// A slot for one request, waiting up to the configured time (a burst
    /// queues briefly instead of failing); then 429.
    pub async fn admit(&self, tenant: &str) -> Result<OwnedSemaphorePermit, Box<Response>> {
        let slots = self.slots(tenant);
        match tokio::time::timeout(self.wait, slots.acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(Box::new(error(
                ErrorCode::TooManyRequests,
                format!(
                    "tenant {tenant} has {} requests in flight, the most this worker allows; retry later",
                    self.per_tenant
                ),
            ))),
        }
    }
}

/// A response body that holds its tenant slot until it is sent (or the
/// client goes away), so streaming reads count while they stream.
pub struct Admitted {
    body: ResponseBody,
    _slot: OwnedSemaphorePermit,
}

impl Admitted {
    pub fn wrap(resp: Response, slot: OwnedSemaphorePermit) -> Response {
        resp.map(|body| http_body_util::BodyExt::boxed_unsync(Admitted { body, _slot: slot }))
    }
}

impl Body for Admitted {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body that fails once the client has sent nothing for
/// `idle` while the worker was waiting for it. Time the worker spends not
/// reading (back-pressure from its memory budget) does not count.
pub struct IdleTimeoutBody<B> {
    inner: B,
    idle: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<B> IdleTimeoutBody<B> {
    pub fn new(inner: B, idle: Duration) -> Self {
        Self {
            inner,
            idle,
            timer: None,
        }
    }
}

/// The error an idle body ends with.
#[derive(Debug, thiserror::Error)]
#[error("the client sent no body data for {0:?}")]
pub struct BodyIdle(pub Duration);

impl<B> Body for IdleTimeoutBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.timer = None;
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => {
                let idle = this.idle;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyIdle(idle))))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

use std::future::Future as _;
