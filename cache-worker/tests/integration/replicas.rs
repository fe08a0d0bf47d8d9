//! Write-back copies on a second worker: a write is acknowledged only
//! once another worker holds it durably; that worker serves it while the
//! primary is away, drops it once S3 has it, and uploads it itself when
//! the primary comes back without its disk.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::{ClientError, ErrorCode, ObjectUri, WorkerClient, WriteBackStatus};
use lakecache_s3_endpoint::{Fault, S3Op};
use lakecache_worker::{Placement, RunningWorker, WorkerOptions};

use crate::harness::*;

/// A ring fixed by the test: every write's copies go to `others`, in order.
struct FixedRing {
    me: String,
    others: Vec<String>,
}

impl Placement for FixedRing {
    fn remote_owner(&self, _: &ObjectUri, _: u64) -> Option<String> {
        None
    }
    fn replica_candidates(&self, _: &ObjectUri) -> Vec<String> {
        self.others.clone()
    }
    fn me(&self) -> Option<String> {
        Some(self.me.clone())
    }
}

fn place(worker: &RunningWorker, others: &[String]) {
    worker.cache().set_placement(Arc::new(FixedRing {
        me: worker.addr().to_string(),
        others: others.to_vec(),
    }));
}

fn client(worker: &RunningWorker) -> WorkerClient {
    WorkerClient::new(&worker.addr().to_string(), Duration::from_secs(60)).unwrap()
}

async fn put_back(
    client: &WorkerClient,
    key: &str,
    body: &[u8],
) -> Result<lakecache_protocol::ObjectStat, ClientError> {
    let chunks: Vec<Bytes> = body.chunks(300_000).map(Bytes::copy_from_slice).collect();
    client
        .put_back(
            &uri(key),
            futures::stream::iter(chunks),
            &Default::default(),
        )
        .await
}

/// Another worker C, with the harness's worker taking `first` as its
/// first copy candidate and C as the next; S3 completes no multipart
/// upload, so write-backs stay pending. Returns C and a client for it.
async fn pending_with_candidates(
    h: &Harness,
    dir: &std::path::Path,
    first: &str,
) -> (RunningWorker, WorkerClient) {
    let c = h.start_another(dir, None).await;
    place(
        h.worker.as_ref().unwrap(),
        &[first.to_string(), c.addr().to_string()],
    );
    place(&c, &[h.addr().to_string()]);
    h.faults().inject(
        S3Op::CompleteMultipartUpload,
        Fault::InternalError,
        1_000_000,
    );
    let c_client = client(&c);
    (c, c_client)
}

async fn status(client: &WorkerClient) -> WriteBackStatus {
    client.writeback_status(None).await.unwrap()
}

#[tokio::test]
async fn a_copy_on_the_next_worker_serves_reads_and_is_uploaded_when_the_primary_loses_its_disk() {
    let mut h = Harness::with(|o| o.cache.writeback.replicas = Some(2)).await;
    // An older version in S3 of a file that is then rewritten and deleted.
    h.client
        .put_bytes(&uri("ckpt/r/old"), Bytes::from_static(b"older version"))
        .await
        .unwrap();
    // S3 takes nothing: the writes stay pending.
    h.faults()
        .inject(S3Op::PutObject, Fault::InternalError, 1_000_000);
    h.faults().inject(
        S3Op::CompleteMultipartUpload,
        Fault::InternalError,
        1_000_000,
    );
    let b_dir = tempfile::tempdir().unwrap();
    let b = h.start_another(b_dir.path(), None).await;
    let (a_addr, b_addr) = (h.addr().to_string(), b.addr().to_string());
    place(h.worker.as_ref().unwrap(), std::slice::from_ref(&b_addr));
    place(&b, std::slice::from_ref(&a_addr));
    let b_client = client(&b);

    let big = data(7 * MIB as usize + 5, 3);
    let small = b"step-7".to_vec();
    let big_stat = put_back(&h.client, "ckpt/r/model.bin", &big).await.unwrap();
    let small_stat = put_back(&h.client, "ckpt/r/latest", &small).await.unwrap();
    put_back(&h.client, "ckpt/r/old", b"newer version")
        .await
        .unwrap();
    h.client.delete(&uri("ckpt/r/old")).await.unwrap();

    // Acknowledged means: pending on the primary and a copy on B (the
    // delete too).
    assert_eq!(status(&h.client).await.pending_objects, 4);
    let held = status(&b_client).await;
    assert_eq!((held.replica_objects, held.pending_objects), (4, 0));
    assert_eq!(
        held.replica_bytes,
        (big.len() + small.len() + b"newer version".len()) as u64
    );
    let metrics = b_client.metrics().await.unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("lakecache_writeback_replica_objects") && l.ends_with(" 4")),
        "{metrics}"
    );

    // A reader that fails over to B sees the same version and bytes.
    let stat = b_client.stat(&uri("ckpt/r/model.bin")).await.unwrap();
    assert_eq!(stat.etag, big_stat.etag);
    let (bytes, _) = b_client
        .read_checked(&uri("ckpt/r/model.bin"), None, Some(&big_stat.etag))
        .await
        .unwrap();
    assert_eq!(sha(&bytes), sha(&big));

    // The primary's disk is lost: it comes back empty at its address.
    h.worker.take().unwrap().shutdown().await;
    std::fs::remove_dir_all(&h.options.cache_dir).unwrap();
    let a2 = h.start_another(&h.options.cache_dir, Some(&a_addr)).await;
    place(&a2, std::slice::from_ref(&b_addr));
    assert_eq!(status(&client(&a2)).await.pending_objects, 0);

    // B notices the new journal and uploads its copies once S3 is back.
    h.faults().clear();
    eventually(Duration::from_secs(60), "B uploads the copies", || async {
        h.s3_bytes("ckpt/r/model.bin").await.as_deref() == Some(&big[..])
            && h.s3_bytes("ckpt/r/latest").await.as_deref() == Some(&small[..])
    })
    .await;
    eventually(Duration::from_secs(30), "B's backlog drains", || async {
        let s = status(&b_client).await;
        s.pending_objects == 0 && s.replica_objects == 0
    })
    .await;
    assert_eq!(
        h.s3_bytes("ckpt/r/old").await,
        None,
        "the delete acknowledged before the disk loss was not replayed"
    );
    assert!(small_stat.etag.starts_with("lc-"));
    a2.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn copies_are_dropped_once_the_primary_uploads_and_a_dead_candidate_is_skipped() {
    let h = Harness::with(|o| {
        o.cache.writeback.replicas = Some(2);
        // The dead worker holds up the first upload this long.
        o.cache.writeback.peer_order_wait = Duration::from_secs(1);
    })
    .await;
    let c_dir = tempfile::tempdir().unwrap();
    // The first candidate is a port nobody listens on: the copy goes to
    // the next one, fed from the primary's synced pages.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let (c, c_client) = pending_with_candidates(&h, c_dir.path(), &dead).await;
    let body = data(11 * MIB as usize, 9);
    put_back(&h.client, "ckpt/d/shard", &body).await.unwrap();
    assert_eq!(status(&c_client).await.replica_objects, 1);

    // Once S3 has it, the copy is dropped.
    h.faults().clear();
    eventually(Duration::from_secs(60), "the upload", || async {
        h.s3_bytes("ckpt/d/shard").await.as_deref() == Some(&body[..])
    })
    .await;
    eventually(Duration::from_secs(30), "C drops its copy", || async {
        status(&c_client).await.replica_objects == 0
    })
    .await;

    // With no live candidate left, a write is refused, not acknowledged.
    place(&c, &[]);
    c.shutdown().await;
    let err = put_back(&h.client, "ckpt/d/refused", b"not acknowledged")
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Api {
                code: ErrorCode::ReplicasUnavailable,
                status: 503,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(status(&h.client).await.pending_objects, 0);
    assert!(h.s3_bytes("ckpt/d/refused").await.is_none());
}

/// A peer that is up but hung (a stopped process: its socket takes
/// connections and then nothing): accepts connections, counts them and
/// never answers. It reads nothing, or (`swallowing`) reads every byte
/// sent, as a worker stopped after it took a body would have.
struct HungPeer {
    addr: String,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
}

impl HungPeer {
    fn start() -> Self {
        Self::listen(false)
    }

    fn swallowing() -> Self {
        Self::listen(true)
    }

    fn listen(reads: bool) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for mut conn in listener.incoming().flatten() {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if reads {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut conn, &mut std::io::sink());
                    });
                } else {
                    held.push(conn);
                }
            }
        });
        Self { addr, accepted }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The first candidate for copies hangs: the first write-back gives its
/// copy up after the replica deadline and the next candidate takes it.
/// The next write-back does not wait on that peer again: it is tried
/// last while it stays silent, so the copy goes to the live candidate
/// from the start and the hung peer is not even connected to.
#[tokio::test]
async fn a_hung_candidate_is_waited_on_once_not_once_per_write() {
    let h = Harness::with(|o| {
        o.cache.writeback.replicas = Some(2);
        o.cache.writeback.replica_progress = Duration::from_secs(1);
    })
    .await;
    let c_dir = tempfile::tempdir().unwrap();
    let hung = HungPeer::start();
    let (_c, c_client) = pending_with_candidates(&h, c_dir.path(), &hung.addr).await;
    // More than the hung peer's socket buffers take.
    let body = data(48 * MIB as usize, 21);
    put_back(&h.client, "ckpt/h/first", &body).await.unwrap();
    assert_eq!(status(&c_client).await.replica_objects, 1);
    let after_first = hung.accepted();
    assert!(
        after_first >= 1,
        "the first copy never went to the hung peer"
    );

    put_back(&h.client, "ckpt/h/second", &body).await.unwrap();
    assert_eq!(status(&c_client).await.replica_objects, 2);
    assert_eq!(
        hung.accepted(),
        after_first,
        "the second write-back went to the hung peer again"
    );
}

/// A write whose first copy candidate is `silent` (never answers), with
/// a live candidate to spare and a replica progress deadline far longer
/// than the test: the silent one is probed after 2 s and the live one
/// takes the copy. Before, the copy waited out the whole deadline.
async fn a_silent_candidate_is_probed_not_waited_out(silent: HungPeer, body: Vec<u8>) {
    let h = Harness::with(|o| {
        o.cache.writeback.replicas = Some(2);
        o.cache.writeback.replica_progress = Duration::from_secs(600);
    })
    .await;
    let c_dir = tempfile::tempdir().unwrap();
    let (_c, c_client) = pending_with_candidates(&h, c_dir.path(), &silent.addr).await;
    let write = put_back(&h.client, "ckpt/p/first", &body);
    // Within the test client's own 60 s timeout.
    let stat = tokio::time::timeout(Duration::from_secs(50), write)
        .await
        .expect("the write waited out the replica progress deadline")
        .unwrap();
    assert_eq!(stat.size, body.len() as u64);
    assert!(
        silent.accepted() >= 1,
        "the copy never went to the silent peer"
    );
    assert_eq!(status(&c_client).await.replica_objects, 1);
}

/// The first candidate hangs: the copy stalls once its socket buffers
/// are full (the body is larger than they take).
#[tokio::test]
async fn a_hung_candidate_with_a_spare_is_probed_not_waited_out() {
    a_silent_candidate_is_probed_not_waited_out(HungPeer::start(), data(48 * MIB as usize, 22))
        .await;
}

/// The first candidate takes the whole copy and never answers (stopped
/// after it read the body).
#[tokio::test]
async fn a_candidate_that_takes_the_copy_and_never_answers_is_probed_not_waited_out() {
    a_silent_candidate_is_probed_not_waited_out(HungPeer::swallowing(), data(8 * MIB as usize, 23))
        .await;
}

/// One copy per write, staging for one 2 MiB write, a 30 s stall timeout
/// and S3 order kept for a silent peer far longer than the test.
async fn room_for_one_write() -> Harness {
    Harness::with(|o| {
        o.cache.writeback.replicas = Some(1);
        o.cache.writeback.staging_limit = 2 * MIB;
        o.cache.writeback.stall_timeout = Duration::from_secs(30);
        o.cache.writeback.peer_order_wait = Duration::from_secs(600);
    })
    .await
}

/// Staging is full of a write whose upload waits, for S3 order, on a
/// peer that does not answer: the next write waits for room, and the
/// upload stops waiting for the silent peer so the room comes. Before,
/// the upload waited out `peer_order_wait` and the write failed as
/// staging full after its stall timeout.
#[tokio::test]
async fn a_write_waiting_for_staging_room_ends_the_wait_for_a_silent_peers_order() {
    let h = room_for_one_write().await;
    let hung = HungPeer::start();
    place(h.worker.as_ref().unwrap(), std::slice::from_ref(&hung.addr));
    let first = data(2 * MIB as usize, 31);
    put_back(&h.client, "room/first", &first).await.unwrap();
    // The uploader is asking the silent peer about the order by now.
    eventually(
        Duration::from_secs(30),
        "an order check on the peer",
        || async { hung.accepted() >= 1 },
    )
    .await;
    assert!(h.s3_bytes("room/first").await.is_none());
    let second = data(MIB as usize, 32);
    put_back(&h.client, "room/second", &second)
        .await
        .unwrap_or_else(|e| panic!("the write waiting for room failed: {e}"));
    assert_eq!(h.s3_bytes("room/first").await.as_deref(), Some(&first[..]));
    // With room to spare, the order is kept again: the second write's
    // upload waits for the silent peer, acknowledged and pending.
    let pending = status(&h.client).await;
    assert_eq!(pending.pending_objects, 1, "{pending:?}");
    assert!(h.s3_bytes("room/second").await.is_none());
}

/// A chain: this worker's staging is full of a write whose upload waits,
/// for S3 order, on worker B's earlier write, and B's upload waits on a
/// peer that does not answer. B says so in its status, and this worker,
/// its next write waiting for room, stops waiting for B's write. Before,
/// it waited out `peer_order_wait` and the write failed as staging full.
#[tokio::test]
async fn a_write_waiting_for_room_ends_the_wait_for_a_peer_held_by_a_silent_one() {
    let h = room_for_one_write().await;
    let hung = HungPeer::start();
    let b_dir = tempfile::tempdir().unwrap();
    let b = h.start_another(b_dir.path(), None).await;
    place(&b, std::slice::from_ref(&hung.addr));
    place(h.worker.as_ref().unwrap(), &[b.addr().to_string()]);
    let b_client = client(&b);
    let earlier = data(MIB as usize, 41);
    put_back(&b_client, "chain/earlier", &earlier)
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "B waiting on the silent peer",
        || async { status(&b_client).await.next_upload_waits_on_silent_peer },
    )
    .await;
    let first = data(2 * MIB as usize, 42);
    put_back(&h.client, "chain/first", &first).await.unwrap();
    let second = data(MIB as usize, 43);
    put_back(&h.client, "chain/second", &second)
        .await
        .unwrap_or_else(|e| panic!("the write waiting for room failed: {e}"));
    assert_eq!(h.s3_bytes("chain/first").await.as_deref(), Some(&first[..]));
    // B still keeps its write for the silent peer's order.
    assert!(h.s3_bytes("chain/earlier").await.is_none());
}

#[tokio::test]
async fn a_worker_alone_refuses_two_copies_and_a_malformed_copy_header_is_refused() {
    let h = Harness::with(|o| o.cache.writeback.replicas = Some(2)).await;
    let err = put_back(&h.client, "x/one", b"only one worker")
        .await
        .unwrap_err();
    assert_api_error(&err, ErrorCode::ReplicasUnavailable);
    // A malformed replica header is a 400, before any byte is staged.
    let err = h
        .client
        .put_replica(
            &uri("x/two"),
            "lc-not/a/version",
            "journal 127.0.0.1:1",
            futures::stream::iter([Ok(Bytes::from_static(b"x"))]),
            &Default::default(),
            None,
        )
        .await
        .unwrap_err();
    assert_api_error(&err, ErrorCode::BadRequest);
    assert_eq!(status(&h.client).await.replica_objects, 0);
}

#[tokio::test]
async fn a_later_write_on_another_worker_reaches_s3_after_an_earlier_one() {
    let h = Harness::with(|o| o.cache.writeback.replicas = Some(1)).await;
    let b_dir = tempfile::tempdir().unwrap();
    let b = h.start_another(b_dir.path(), None).await;
    let (a_addr, b_addr) = (h.addr().to_string(), b.addr().to_string());
    place(h.worker.as_ref().unwrap(), std::slice::from_ref(&b_addr));
    place(&b, std::slice::from_ref(&a_addr));
    let b_client = client(&b);
    // The checkpoint (on A) cannot complete its multipart upload; the
    // `latest` written after it (on B) must wait for it.
    h.faults().inject(
        S3Op::CompleteMultipartUpload,
        Fault::InternalError,
        1_000_000,
    );
    let big = data(12 * MIB as usize, 4);
    put_back(&h.client, "ord/step9/model.bin", &big)
        .await
        .unwrap();
    put_back(&b_client, "ord/latest", b"step9").await.unwrap();
    eventually(Duration::from_secs(30), "A's upload fails", || async {
        status(&h.client).await.last_error.is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        h.s3_bytes("ord/latest").await,
        None,
        "latest reached S3 before the checkpoint it names"
    );
    assert_eq!(status(&b_client).await.pending_objects, 1);

    h.faults().clear();
    eventually(Duration::from_secs(60), "both reach S3", || async {
        h.s3_bytes("ord/step9/model.bin").await.as_deref() == Some(&big[..])
            && h.s3_bytes("ord/latest").await.as_deref() == Some(&b"step9"[..])
    })
    .await;
    b.shutdown().await;
}

/// The harness's worker A and a second worker B, each placing the
/// other as its only peer.
struct TwoWorkers {
    b: RunningWorker,
    b_client: WorkerClient,
    a_addr: String,
    b_addr: String,
    _b_dir: tempfile::TempDir,
}

async fn two_workers(h: &Harness) -> TwoWorkers {
    let b_dir = tempfile::tempdir().unwrap();
    let b = h.start_another(b_dir.path(), None).await;
    let (a_addr, b_addr) = (h.addr().to_string(), b.addr().to_string());
    place(h.worker.as_ref().unwrap(), std::slice::from_ref(&b_addr));
    place(&b, std::slice::from_ref(&a_addr));
    TwoWorkers {
        b_client: client(&b),
        b,
        a_addr,
        b_addr,
        _b_dir: b_dir,
    }
}

/// One copy per write, and a peer that does not answer holds uploads up
/// for 1 s.
fn ordered_versions(o: &mut WorkerOptions) {
    o.cache.writeback.replicas = Some(1);
    o.cache.writeback.peer_order_wait = Duration::from_secs(1);
}

/// Two versions of one object on two workers (the mount sent the newer
/// one to B while A, the owner, was away). A's upload of the older one
/// is under way, its completion slow, when B acknowledges the newer one:
/// B waits for it past the bounded order wait, so the newer one lands
/// last. Before, B gave up after `peer_order_wait` and A's older version
/// landed over it (seen in the six-writer stall test through the mount).
#[tokio::test]
async fn a_newer_version_waits_for_an_older_one_being_uploaded_elsewhere() {
    let h = Harness::with(ordered_versions).await;
    let TwoWorkers {
        b,
        b_client,
        _b_dir,
        ..
    } = two_workers(&h).await;
    h.faults()
        .inject(S3Op::CompleteMultipartUpload, Fault::Delay { ms: 5_000 }, 1);
    let older = data(12 * MIB as usize, 5);
    let newer = data(MIB as usize, 6);
    put_back(&h.client, "ver/model.bin", &older).await.unwrap();
    eventually(Duration::from_secs(30), "A's upload completing", || async {
        h.faults().count(S3Op::CompleteMultipartUpload) >= 1
    })
    .await;
    put_back(&b_client, "ver/model.bin", &newer).await.unwrap();
    eventually(Duration::from_secs(60), "both backlogs drain", || async {
        status(&h.client).await.pending_objects == 0 && status(&b_client).await.pending_objects == 0
    })
    .await;
    let landed = h.s3_bytes("ver/model.bin").await;
    assert!(
        landed.as_deref() == Some(&newer[..]),
        "S3 ends with {:?} bytes, not the newer version's {}",
        landed.map(|b| b.len()),
        newer.len()
    );
    b.shutdown().await;
}

/// A's older version cannot reach S3 (its multipart completion fails)
/// when B acknowledges a newer one: A, retrying, finds the newer version
/// on B and drops its own, and the newer one lands; S3 never takes A's.
#[tokio::test]
async fn an_older_version_pending_elsewhere_is_skipped_for_a_newer_one() {
    let h = Harness::with(ordered_versions).await;
    let TwoWorkers {
        b,
        b_client,
        _b_dir,
        ..
    } = two_workers(&h).await;
    h.faults().inject(
        S3Op::CompleteMultipartUpload,
        Fault::InternalError,
        1_000_000,
    );
    let older = data(12 * MIB as usize, 5);
    let newer = data(MIB as usize, 6);
    put_back(&h.client, "ver/model.bin", &older).await.unwrap();
    eventually(Duration::from_secs(30), "A's upload fails", || async {
        status(&h.client).await.last_error.is_some()
    })
    .await;
    put_back(&b_client, "ver/model.bin", &newer).await.unwrap();
    eventually(Duration::from_secs(60), "both backlogs drain", || async {
        status(&h.client).await.pending_objects == 0 && status(&b_client).await.pending_objects == 0
    })
    .await;
    assert!(h.s3_bytes("ver/model.bin").await.as_deref() == Some(&newer[..]));
    b.shutdown().await;
}

/// A's upload of an older version of `key` fails, A stops (its journal
/// kept), and B takes and uploads a newer version past the silent A.
/// Returns the harness, the two workers and the newer bytes.
async fn newer_landed_while_a_was_away(key: &str) -> (Harness, TwoWorkers, Vec<u8>) {
    let h = Harness::with(ordered_versions).await;
    let two = two_workers(&h).await;
    h.faults()
        .inject(S3Op::PutObject, Fault::InternalError, 1_000_000);
    let older = data(MIB as usize, 7);
    let newer = data(MIB as usize / 2, 8);
    put_back(&h.client, key, &older).await.unwrap();
    eventually(Duration::from_secs(30), "A's upload fails", || async {
        status(&h.client).await.last_error.is_some()
    })
    .await;
    let mut h = h;
    h.worker.take().unwrap().shutdown().await;
    h.faults().clear();
    put_back(&two.b_client, key, &newer).await.unwrap();
    eventually(
        Duration::from_secs(60),
        "B uploads past the silent A",
        || async { h.s3_bytes(key).await.as_deref() == Some(&newer[..]) },
    )
    .await;
    (h, two, newer)
}

/// A back at its address, with `peer` as its ring: its backlog drains
/// and S3 still holds `newer` at `key`.
async fn a_returns_and_s3_keeps_the_newer(
    h: &mut Harness,
    a_addr: &str,
    peer: &str,
    key: &str,
    newer: &[u8],
) {
    // As `lakecache worker` does with a registry: no upload before the
    // ring is known.
    h.options.cache.writeback.await_ring = true;
    let a2 = h.start_another(&h.options.cache_dir, Some(a_addr)).await;
    place(&a2, &[peer.to_string()]);
    let a_client = client(&a2);
    eventually(Duration::from_secs(60), "A's backlog drains", || async {
        status(&a_client).await.pending_objects == 0
    })
    .await;
    assert!(
        h.s3_bytes(key).await.as_deref() == Some(newer),
        "A's older version landed over the newer one"
    );
    a2.shutdown().await;
}

/// The same, with A stopped (its journal kept) until after B's order
/// wait: B uploads the newer version, and A, back at its address,
/// learns from B that a newer version landed and skips its own.
#[tokio::test]
async fn a_worker_back_from_an_outage_skips_a_version_older_than_one_in_s3() {
    let (mut h, two, newer) = newer_landed_while_a_was_away("ver/latest").await;
    a_returns_and_s3_keeps_the_newer(&mut h, &two.a_addr, &two.b_addr, "ver/latest", &newer).await;
    two.b.shutdown().await;
}

/// The same, with B restarted over its directory (forgetting what it
/// uploaded) before A comes back: B has nothing left to tell A, but S3
/// keeps the newer version's write stamp, which A reads before uploading
/// and so skips its older version. Before the stamp, A's older version
/// landed over the newer one here.
#[tokio::test]
async fn an_older_version_is_skipped_after_the_newer_ones_worker_restarted() {
    let (mut h, two, newer) = newer_landed_while_a_was_away("ver/restart").await;
    two.b.shutdown().await;
    let b2 = h.start_another(two._b_dir.path(), Some(&two.b_addr)).await;
    place(&b2, std::slice::from_ref(&two.a_addr));
    let object = uri("ver/restart");
    let remembered = client(&b2)
        .writeback_status_of(&format!("s3://{}/", object.bucket()), &object.to_string())
        .await
        .unwrap()
        .writes_of_uri;
    assert!(
        remembered.is_empty(),
        "B still knows its upload: {remembered:?}"
    );
    a_returns_and_s3_keeps_the_newer(&mut h, &two.a_addr, &two.b_addr, "ver/restart", &newer).await;
    b2.shutdown().await;
}

/// A rename through the mount is a copy sent to the owner of the new
/// name, which need not hold the source: here `latest.tmp` is pending
/// on A (its copy on B) and the copy goes to C. C finds the pending
/// version on A and copies from there. Before, C asked S3, which did not
/// have it yet, and the rename failed with ENOENT (DeepSpeed's `latest`
/// rename on a three-worker write-back mount, seen in the write bench).
#[tokio::test]
async fn a_copy_sent_to_a_worker_without_the_pending_source_finds_it_on_its_primary() {
    let h = Harness::with(|o| o.cache.writeback.replicas = Some(2)).await;
    // S3 takes nothing: every write stays pending.
    h.faults()
        .inject(S3Op::PutObject, Fault::InternalError, 1_000_000);
    let (b_dir, c_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let b = h.start_another(b_dir.path(), None).await;
    let c = h.start_another(c_dir.path(), None).await;
    let (a_addr, b_addr, c_addr) = (
        h.addr().to_string(),
        b.addr().to_string(),
        c.addr().to_string(),
    );
    place(
        h.worker.as_ref().unwrap(),
        &[b_addr.clone(), c_addr.clone()],
    );
    place(&b, &[a_addr.clone(), c_addr.clone()]);
    // C's ring order for the source starts at its primary, A.
    place(&c, &[a_addr.clone(), b_addr.clone()]);
    let c_client = client(&c);

    let body = b"global_step100".to_vec();
    let written = put_back(&h.client, "ckpt/latest.tmp", &body).await.unwrap();
    assert!(written.etag.starts_with("lc-"), "{written:?}");
    assert_eq!(
        status(&c_client).await.replica_objects,
        0,
        "C holds no copy"
    );

    let copied = c_client
        .copy(&uri("ckpt/latest.tmp"), None, &uri("ckpt/latest"), None)
        .await
        .unwrap();
    assert_eq!(copied.size, body.len() as u64);
    let (bytes, _) = c_client
        .read_checked(&uri("ckpt/latest"), None, None)
        .await
        .unwrap();
    assert_eq!(bytes.as_ref(), &body[..]);
    // The copy is itself an acknowledged write-back on C (with its copy
    // on A), not a read of S3.
    assert_eq!(status(&c_client).await.pending_objects, 1);

    // A source no worker holds and S3 lacks is still "no such object".
    let err = c_client
        .copy(&uri("ckpt/missing.tmp"), None, &uri("ckpt/other"), None)
        .await
        .unwrap_err();
    assert_api_error(&err, ErrorCode::NotFound);
    b.shutdown().await;
    c.shutdown().await;
}

/// A copy answered by a worker other than the one it was sent to (a
/// stale ring, a copied config: the worker at B's address believes it is
/// at C) does not count: the copy goes to the next worker, and the write
/// is acknowledged with the copy that worker holds.
#[tokio::test]
async fn a_copy_answered_by_another_workers_identity_does_not_count() {
    let h = Harness::with(|o| o.cache.writeback.replicas = Some(2)).await;
    let (b_dir, c_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let b = h.start_another(b_dir.path(), None).await;
    let c = h.start_another(c_dir.path(), None).await;
    let (a_addr, b_addr, c_addr) = (
        h.addr().to_string(),
        b.addr().to_string(),
        c.addr().to_string(),
    );
    place(
        h.worker.as_ref().unwrap(),
        &[b_addr.clone(), c_addr.clone()],
    );
    // B takes itself for C.
    b.cache().set_placement(Arc::new(FixedRing {
        me: c_addr.clone(),
        others: vec![a_addr.clone()],
    }));
    place(&c, std::slice::from_ref(&a_addr));

    let body = data(3 * MIB as usize + 17, 9);
    let stat = put_back(&h.client, "ckpt/id/model.bin", &body)
        .await
        .unwrap();
    assert_eq!(stat.size, body.len() as u64);
    // C is asked only once B's copy is refused (one copy is wanted
    // besides the primary's).
    assert_eq!(
        status(&client(&c)).await.replica_objects,
        1,
        "the copy answered under another identity was counted"
    );
}

/// A primary sends a copy, then loses its power before its own journal
/// holds the write: the client was never told the write succeeded. The
/// replica must not upload that copy when it takes over from the
/// primary's lost disk; it would land in S3 over the client's retry.
/// A copy the primary confirmed (acknowledged) is uploaded. Found by the
/// widened power-loss sweep (`power_sweep.rs`).
#[tokio::test]
async fn a_copy_its_lost_primary_never_confirmed_is_dropped_not_uploaded() {
    let h = Harness::with(|o| o.cache.writeback.replicas = Some(2)).await;
    let b_dir = tempfile::tempdir().unwrap();
    let b = h.start_another(b_dir.path(), None).await;
    let a_addr = h.addr().to_string();
    place(&b, std::slice::from_ref(&a_addr));
    let b_client = client(&b);
    // Copies from "the primary at A's address" under a journal A does not
    // have: the journal that was lost with A's disk.
    let lost = format!("lost-journal {a_addr}");
    let copy = |key: &'static str, version: &'static str, body: &'static [u8]| {
        let (b_client, lost) = (b_client.clone(), lost.clone());
        async move {
            b_client
                .put_replica(
                    &uri(key),
                    version,
                    &lost,
                    futures::stream::iter([Ok(Bytes::from_static(body))]),
                    &Default::default(),
                    None,
                )
                .await
                .unwrap()
        }
    };
    copy(
        "conf/acked",
        "lc-00000000000000000000000000000001",
        b"acked",
    )
    .await;
    copy(
        "conf/never",
        "lc-00000000000000000000000000000002",
        b"never acked",
    )
    .await;
    b_client
        .confirm_replica(&uri("conf/acked"), "lc-00000000000000000000000000000001")
        .await
        .unwrap();
    // Confirming a copy this worker does not hold is refused, by name.
    let err = b_client
        .confirm_replica(&uri("conf/absent"), "lc-00000000000000000000000000000003")
        .await
        .unwrap_err();
    assert_api_error(&err, ErrorCode::NotFound);
    assert_eq!(status(&b_client).await.replica_objects, 2);

    eventually(
        Duration::from_secs(60),
        "B takes over and settles both copies",
        || async {
            let s = status(&b_client).await;
            s.replica_objects == 0 && s.pending_objects == 0
        },
    )
    .await;
    assert_eq!(
        h.s3_bytes("conf/acked").await.as_deref(),
        Some(&b"acked"[..])
    );
    assert_eq!(
        h.s3_bytes("conf/never").await,
        None,
        "a copy of a write never acknowledged was uploaded"
    );
    b.shutdown().await;
}
