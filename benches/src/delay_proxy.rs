//! A TCP proxy that delays every byte by half the given round trip in
//! each direction, to put a local S3 endpoint "across a WAN" (this kernel
//! has no netem). Bytes are stamped on arrival and forwarded once their
//! delay has passed, so the delay adds latency without capping
//! throughput (a pipe, not a stop-and-wait relay).
//!
//! Usage: delay-proxy --listen 127.0.0.1:9100 --upstream 127.0.0.1:9000 --rtt-ms 10

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::{Bytes, BytesMut};
use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    listen: SocketAddr,
    #[arg(long)]
    upstream: SocketAddr,
    /// Round trip added, split evenly between the two directions
    #[arg(long, default_value_t = 10)]
    rtt_ms: u64,
}

/// Chunks in flight per direction (64 KiB each at most): room for a
/// 10 Gbit/s stream at a 10 ms round trip.
const IN_FLIGHT: usize = 4096;

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let one_way = Duration::from_micros(args.rtt_ms * 500);
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    eprintln!(
        "delay-proxy {} -> {} (+{} ms round trip)",
        args.listen, args.upstream, args.rtt_ms
    );
    loop {
        let (client, _) = listener.accept().await?;
        let upstream = args.upstream;
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
