//! A TCP proxy that delays every byte by half the given round trip in
//! each direction, to put a local S3 endpoint "across a WAN" (this kernel
//! has no netem). Bytes are stamped on arrival and forwarded once their
//! delay has passed, so the delay adds latency without capping
//! throughput (a pipe, not a stop-and-wait relay).
//!
//! Usage: delay-proxy --listen 127.0.0.1:9100 --upstream 127.0.0.1:9000 --rtt-ms 10

mod delay;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use tokio::net::TcpListener;

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
    delay::serve(listener, args.upstream, one_way).await
}
