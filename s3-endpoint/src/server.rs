//! HTTP serving: TCP_NODELAY on every connection (Nagle plus delayed ACKs
//! turn a 1 ms ranged GET into 40 ms), faults and counting, graceful stop.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use s3s::service::S3Service;
use tokio::net::TcpListener;

use crate::faults::{Fault, FaultInjector, S3Op};
use crate::s3api::error_xml;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ResponseBody = BoxBody<Bytes, BoxError>;

fn error_response(
    status: http::StatusCode,
    code: &str,
    message: &str,
) -> http::Response<ResponseBody> {
    let body = Full::new(error_xml(code, message))
        .map_err(|e| match e {})
        .boxed();
    let mut resp = http::Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/xml"),
    );
    resp
}

/// A body that yields `remaining` bytes and then fails, so hyper drops the
/// connection mid-message the way a broken network does.
struct TruncatedBody {
    inner: s3s::Body,
    remaining: usize,
}

impl HttpBody for TruncatedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.remaining == 0 {
            return Poll::Ready(Some(Err("injected fault: body truncated".into())));
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(mut data) => {
                    if data.len() > self.remaining {
                        data.truncate(self.remaining);
                    }
                    self.remaining -= data.len();
                    Poll::Ready(Some(Ok(Frame::data(data))))
                }
                Err(frame) => Poll::Ready(Some(Ok(frame))),
            },
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A request body whose first data byte arrives flipped.
struct CorruptedBody {
    inner: Incoming,
    done: bool,
}

impl HttpBody for CorruptedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match polled {
            Poll::Ready(Some(Ok(frame))) if !self.done => match frame.into_data() {
                Ok(data) if !data.is_empty() => {
                    self.done = true;
                    let mut flipped = data.to_vec();
                    flipped[0] ^= 0x01;
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from(flipped)))))
                }
                Ok(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                Err(frame) => Poll::Ready(Some(Ok(frame))),
            },
            other => other,
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Counts the data bytes of a response body as they are sent.
struct CountedBody {
    inner: ResponseBody,
    faults: Arc<FaultInjector>,
}

impl HttpBody for CountedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                self.faults.add_sent(data.len());
            }
        }
        polled
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

async fn handle(
    service: S3Service,
    faults: Arc<FaultInjector>,
    req: http::Request<Incoming>,
) -> Result<http::Response<ResponseBody>, Infallible> {
    if req.method() == http::Method::GET && req.uri().path() == "/_lakecache/stats" {
        let body = Full::new(Bytes::from(faults.render()))
            .map_err(|e| match e {})
            .boxed();
        return Ok(http::Response::new(body));
    }
    let op = S3Op::classify(req.method(), req.uri());
    let fault = faults.on_request(op);
    match fault {
        Some(Fault::Delay { ms }) => {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
        Some(Fault::SlowDown) => {
            return Ok(error_response(
                http::StatusCode::SERVICE_UNAVAILABLE,
                "SlowDown",
                "Please reduce your request rate. (injected)",
            ))
        }
        Some(Fault::InternalError) => {
            return Ok(error_response(
                http::StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "We encountered an internal error. (injected)",
            ))
        }
        Some(Fault::RefuseConditionalWrites)
            if ["if-match", "if-none-match"]
                .iter()
                .any(|h| req.headers().contains_key(*h)) =>
        {
            return Ok(error_response(
                http::StatusCode::NOT_IMPLEMENTED,
                "NotImplemented",
                "A header you provided implies functionality that is not implemented. (injected)",
            ))
        }
        _ => {}
    }
    let req = match fault {
        Some(Fault::CorruptRequestBody) => {
            req.map(|inner| s3s::Body::http_body(CorruptedBody { inner, done: false }))
        }
        _ => req.map(s3s::Body::from),
    };
    // One span per S3 request, joined to the caller's trace when it sent
    // a traceparent (a worker reading for a traced FUSE read).
    let span = tracing::info_span!("s3_request", op = ?op, method = %req.method(), path = %req.uri().path());
    lakecache_telemetry::trace::adopt_remote_parent(&span, req.headers());
    let resp = match tracing::Instrument::instrument(service.call(req), span).await {
        Ok(resp) => resp,
        Err(err) => {
            tracing::error!(?err, "s3 service failed");
            return Ok(error_response(
                http::StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "internal error",
            ));
        }
    };
    if let Some(Fault::DelayResponse { ms }) = fault {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    let (parts, body) = resp.into_parts();
    let body = match fault {
        Some(Fault::TruncateBody { after }) => TruncatedBody {
            inner: body,
            remaining: after,
        }
        .boxed(),
        _ => body.map_err(|e| -> BoxError { e }).boxed(),
    };
    let body = CountedBody {
        inner: body,
        faults,
    }
    .boxed();
    Ok(http::Response::from_parts(parts, body))
}

/// Serves S3 on `listener` until `shutdown` resolves, then drains
/// connections in flight.
pub async fn serve(
    listener: TcpListener,
    service: S3Service,
    faults: Arc<FaultInjector>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let (service, faults) = (service.clone(), faults.clone());
        let svc = service_fn(move |req| handle(service.clone(), faults.clone(), req));
        let conn = builder.serve_connection(TokioIo::new(stream), svc);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "s3 connection ended with error");
            }
        });
    }
    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), graceful.shutdown()).await;
}
