//! A GET's body with its CRC32C as a trailer, for a client that asks with
//! `TE: trailers`: the bytes are checked once more where they land (the
//! mount), so damage between the worker's page check and the reader is
//! caught and the range read again, never returned.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use lakecache_protocol::{BODY_CRC32C_TRAILER, LENGTH_HEADER};

use super::response::{BoxError, Response};

/// Turns `resp` (a full-length body) into one sent chunked with the CRC32C
/// trailer declared. Its length moves to [`LENGTH_HEADER`]: HTTP/1.1 sends
/// trailers only in chunked bodies, which carry no Content-Length.
pub(super) fn with_crc_trailer(resp: Response, len: u64) -> Response {
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::TRAILER,
        HeaderValue::from_static(BODY_CRC32C_TRAILER),
    );
    parts.headers.insert(LENGTH_HEADER, HeaderValue::from(len));
    let body = CrcTrailerBody {
        inner: body,
        crc: 0,
        sent_trailer: false,
    };
    Response::from_parts(parts, http_body_util::BodyExt::boxed_unsync(body))
}

struct CrcTrailerBody<B> {
    inner: B,
    crc: u32,
    sent_trailer: bool,
}

impl<B> Body for CrcTrailerBody<B>
where
    B: Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.sent_trailer {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.crc = crc32c::crc32c_append(self.crc, data);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                self.sent_trailer = true;
                let mut trailers = HeaderMap::new();
                trailers.insert(BODY_CRC32C_TRAILER, HeaderValue::from(self.crc));
                Poll::Ready(Some(Ok(Frame::trailers(trailers))))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.sent_trailer
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
