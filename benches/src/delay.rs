//! The delaying relay behind `delay-proxy` (and benchmarks that run it
//! in-process): every byte waits half the round trip in each direction.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Chunks in flight per direction (64 KiB each at most): room for a
/// 10 Gbit/s stream at a 10 ms round trip.
const IN_FLIGHT: usize = 4096;

/// Relays every connection `listener` accepts to `upstream`, `one_way`
/// late in each direction; runs until the task is dropped.
pub async fn serve(listener: TcpListener, upstream: SocketAddr, one_way: Duration) -> Result<()> {
    loop {
        let (client, _) = listener.accept().await?;
        tokio::spawn(async move {
            if let Err(e) = relay(client, upstream, one_way).await {
                eprintln!("connection ended: {e:#}");
            }
        });
    }
}

async fn relay(client: TcpStream, upstream: SocketAddr, one_way: Duration) -> Result<()> {
    // The connection's own handshake pays the round trip too.
    tokio::time::sleep(one_way * 2).await;
    let server = TcpStream::connect(upstream).await.context("upstream")?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = tokio::spawn(pipe(cr, sw, one_way));
    let down = tokio::spawn(pipe(sr, cw, one_way));
    let _ = tokio::join!(up, down);
    Ok(())
}

async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Bytes)>(IN_FLIGHT);
    let reader = tokio::spawn(async move {
        loop {
            let mut buf = BytesMut::with_capacity(64 << 10);
            match from.read_buf(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if tx
                        .send((Instant::now() + delay, buf.freeze()))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
    });
    while let Some((due, chunk)) = rx.recv().await {
        tokio::time::sleep_until(due).await;
        if to.write_all(&chunk).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
    reader.abort();
}
