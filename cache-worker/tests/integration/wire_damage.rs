//! One bit flipped on the wire between the worker and its client, in each
//! direction, by a TCP proxy between them: a damaged read is read again
//! (or fails), a damaged write is refused; wrong bytes are never returned
//! or stored.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lakecache_protocol::{ClientError, ErrorCode, WorkerClient, WriteMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::harness::*;

/// Flips the last byte of `pattern` wherever it passes, in one direction,
/// while flips are left.
#[derive(Clone)]
struct Flipper {
    pattern: Arc<Vec<u8>>,
    left: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
}

impl Flipper {
    fn new(pattern: &[u8]) -> Self {
        Self {
            pattern: Arc::new(pattern.to_vec()),
            left: Arc::new(AtomicU64::new(0)),
            done: Arc::new(AtomicU64::new(0)),
        }
    }

    fn arm(&self, times: u64) {
        self.left.store(times, Ordering::SeqCst);
    }

    fn flipped(&self) -> u64 {
        self.done.load(Ordering::SeqCst)
    }

    /// Copies `from` to `to`, flipping the pattern's last byte where it
    /// ends in what was just read (the tail of the last read is kept, so
    /// a pattern split across reads is seen too).
    async fn pump(
        self,
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
    ) {
        let keep = self.pattern.len() - 1;
        let mut tail: Vec<u8> = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut seen = tail.clone();
            seen.extend_from_slice(&buf[..n]);
            if let Some(at) = seen
                .windows(self.pattern.len())
                .position(|w| w == &self.pattern[..])
            {
                let last = at + keep - tail.len();
                let take = self
                    .left
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| l.checked_sub(1));
                if take.is_ok() {
                    buf[last] ^= 0x01;
                    self.done.fetch_add(1, Ordering::SeqCst);
                }
            }
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
            let start = seen.len().saturating_sub(keep);
            tail = seen[start..].to_vec();
        }
        let _ = to.shutdown().await;
    }
}

/// Listens on a port of the OS's choosing and forwards to `upstream`.
async fn proxy(upstream: std::net::SocketAddr, to_worker: Flipper, to_client: Flipper) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(worker) = TcpStream::connect(upstream).await else {
                continue;
            };
            let (cr, cw) = client.into_split();
            let (wr, ww) = worker.into_split();
            tokio::spawn(to_worker.clone().pump(cr, ww));
            tokio::spawn(to_client.clone().pump(wr, cw));
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_damaged_on_the_wire_is_read_again_and_never_returned() {
    let h = Harness::start().await;
    let body = data(3 * MIB as usize, 41);
    h.put_direct("wire/read.bin", &body).await;
    let pattern = &body[(MIB + 5000) as usize..(MIB + 5016) as usize];
    let to_client = Flipper::new(pattern);
    let addr = proxy(h.addr(), Flipper::new(b"unused-pattern"), to_client.clone()).await;
    let client = WorkerClient::new(&addr, Duration::from_secs(30)).unwrap();
    let u = uri("wire/read.bin");

    // Clean: the trailer checks out, nothing flipped.
    let (got, _) = client
        .read_checked(&u, Some(0..3 * MIB), None)
        .await
        .unwrap();
    assert!(got[..] == body[..]);

    // One damaged answer: read again from the worker, right bytes.
    to_client.arm(1);
    let (got, _) = client
        .read_checked(&u, Some(MIB..2 * MIB), None)
        .await
        .unwrap();
    assert_eq!(
        to_client.flipped(),
        1,
        "the proxy must have damaged one answer"
    );
    assert!(
        got[..] == body[MIB as usize..2 * MIB as usize],
        "damaged bytes returned"
    );

    // Every answer damaged: an error naming the damage, never the bytes.
    to_client.arm(u64::MAX);
    let err = client
        .read_checked(&u, Some(MIB..2 * MIB), None)
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Damaged { .. }), "{err:?}");
    assert!(
        err.is_retryable(),
        "a replica may serve what this wire damaged"
    );
    assert_eq!(to_client.flipped(), 3, "one damaged answer, then two");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_damaged_on_the_wire_is_refused_and_nothing_is_stored() {
    let h = Harness::start().await;
    let old = data(MIB as usize, 42);
    h.put_direct("wire/write.bin", &old).await;
    let new = data(2 * MIB as usize, 43);
    let to_worker = Flipper::new(&new[700_000..700_016]);
    let addr = proxy(h.addr(), to_worker.clone(), Flipper::new(b"unused-pattern")).await;
    let client = WorkerClient::new(&addr, Duration::from_secs(30)).unwrap();
    let u = uri("wire/write.bin");

    for mode in [WriteMode::Through, WriteMode::Back] {
        to_worker.arm(1);
        let before = to_worker.flipped();
        let err = put_watched(
            &client,
            "wire/write.bin",
            &new,
            mode,
            Duration::from_secs(10),
        )
        .await
        .unwrap_err();
        assert_eq!(
            to_worker.flipped(),
            before + 1,
            "{mode:?}: nothing was damaged"
        );
        let refused = matches!(
            &err,
            ClientError::Api {
                code: ErrorCode::ChecksumMismatch,
                ..
            }
        ) || err.to_string().contains("CRC32C");
        assert!(refused, "{mode:?}: {err:?}");
        // The old bytes stay, through the worker and in S3.
        let got = h.client.read(&u, None).await.unwrap();
        assert!(
            got[..] == old[..],
            "{mode:?}: a damaged write replaced the object"
        );
        let in_s3 = h
            .direct
            .get_range(
                &u,
                0..old.len() as u64,
                &h.direct.head(&u).await.unwrap().etag,
            )
            .await
            .unwrap();
        assert!(in_s3[..] == old[..], "{mode:?}: a damaged write reached S3");
    }
}
