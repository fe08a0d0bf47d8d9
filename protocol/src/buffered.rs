//! A TCP connector whose streams read through a large buffer.
//!
//! rustls pulls TLS records off the socket at most 4 KiB per read, so a
//! client receiving hundreds of MiB/s over HTTPS would make a system call
//! per 4 KiB. Reading the socket through a 256 KiB buffer turns that into
//! one call per many records. Plain HTTP loses nothing: hyper's own large
//! reads bypass the buffer.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::io::BufReader;
use tokio::net::TcpStream;

const READ_BUFFER: usize = 256 * 1024;

#[derive(Clone)]
pub(crate) struct BufferedConnector(pub HttpConnector);

type ConnectFuture = Pin<Box<dyn Future<Output = Result<BufferedTcp, BoxError>> + Send + 'static>>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<http::Uri> for BufferedConnector {
    type Response = BufferedTcp;
    type Error = BoxError;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower_service::Service::<http::Uri>::poll_ready(&mut self.0, cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connecting = tower_service::Service::<http::Uri>::call(&mut self.0, uri);
        Box::pin(async move {
            let tcp = connecting.await?.into_inner();
            Ok(BufferedTcp(TokioIo::new(BufReader::with_capacity(
                READ_BUFFER,
                tcp,
            ))))
        })
    }
}

pub(crate) struct BufferedTcp(TokioIo<BufReader<TcpStream>>);

impl Connection for BufferedTcp {
    fn connected(&self) -> Connected {
        self.0.inner().get_ref().connected()
    }
}

impl hyper::rt::Read for BufferedTcp {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for BufferedTcp {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }
}
