//! Write-back through a real worker and the embedded S3 endpoint: the
//! acknowledgement comes before S3 has the object, reads, stats and
//! listings see it meanwhile, S3 receives objects in acknowledgement
//! order, and nothing acknowledged is lost across a restart or an outage.

use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::{ClientError, ErrorCode, WorkerClient};
use lakecache_s3_endpoint::{Fault, S3Op};
use lakecache_worker::store::StoreError;

use crate::harness::*;

async fn put_back(client: &WorkerClient, key: &str, body: &[u8]) -> lakecache_protocol::ObjectStat {
    let chunks: Vec<Bytes> = body.chunks(300_000).map(Bytes::copy_from_slice).collect();
    client
        .put_back(
            &uri(key),
            futures::stream::iter(chunks),
            &Default::default(),
        )
        .await
        .unwrap()
}

/// Waits until the worker's backlog is empty; panics after `limit`.
async fn drained(client: &WorkerClient, limit: Duration) {
    let start = std::time::Instant::now();
    loop {
        let status = client.writeback_status(None).await.unwrap();
        if status.pending_objects == 0 {
            return;
        }
        assert!(
            start.elapsed() < crate::harness::scaled(limit),
            "backlog not drained after {limit:?}: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn s3_sha(h: &Harness, key: &str) -> Option<String> {
    let meta = match h.direct.head(&uri(key)).await {
        Ok(m) => m,
        Err(StoreError::NotFound) => return None,
        Err(e) => panic!("HEAD {key}: {e}"),
    };
    let body = h
        .direct
        .get_range(&uri(key), 0..meta.size, &meta.etag)
        .await
        .unwrap();
    Some(sha(&body))
}

#[tokio::test]
async fn acknowledged_before_s3_visible_meanwhile_and_uploaded_in_order() {
    let mut h = Harness::start().await;
    // S3 cannot complete multipart uploads: the first (large) object
    // cannot reach S3, and the small one acknowledged after it must wait.
    h.faults()
        .inject(S3Op::CompleteMultipartUpload, Fault::InternalError, 100_000);
    let big = data((12 * MIB) as usize + 77, 1);
    let small = b"step-000100".to_vec();
    let big_stat = put_back(&h.client, "ckpt/step100/model.bin", &big).await;
    let small_stat = put_back(&h.client, "ckpt/latest", &small).await;
    assert!(big_stat.etag.starts_with("lc-"), "{big_stat:?}");
    assert_eq!(big_stat.size, big.len() as u64);

    // Read-your-writes: stat, ranged reads and listings see both.
    let stat = h.client.stat(&uri("ckpt/latest")).await.unwrap();
    assert_eq!(
        (stat.size, stat.etag.clone()),
        (small.len() as u64, small_stat.etag.clone())
    );
    let (mid, _) = h
        .client
        .read_checked(
            &uri("ckpt/step100/model.bin"),
            Some(5 * MIB..7 * MIB + 3),
            Some(&big_stat.etag),
        )
        .await
        .unwrap();
    assert_eq!(&mid[..], &big[5 * MIB as usize..7 * MIB as usize + 3]);
    let listing = h
        .client
        .list(BUCKET, "ckpt/", Some("/"), None, None)
        .await
        .unwrap();
    assert_eq!(listing.common_prefixes, vec!["ckpt/step100/".to_string()]);
    assert_eq!(listing.objects.len(), 1);
    assert_eq!(listing.objects[0].key, "ckpt/latest");

    // Order: the small object is not in S3 while the big one is stuck
    // (once its upload has failed, the uploader retries it, not the next).
    let start = std::time::Instant::now();
    while h
        .client
        .writeback_status(None)
        .await
        .unwrap()
        .last_error
        .is_none()
    {
        assert!(
            start.elapsed() < crate::harness::scaled(Duration::from_secs(60)),
            "the upload never failed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        s3_sha(&h, "ckpt/latest").await,
        None,
        "latest reached S3 before the checkpoint"
    );
    let status = h
        .client
        .writeback_status(Some("s3://data/ckpt/"))
        .await
        .unwrap();
    assert_eq!(status.pending_objects, 2);
    assert_eq!(status.pending_bytes, (big.len() + small.len()) as u64);
    assert!(status.last_error.is_some(), "{status:?}");

    // A restart (the journal replays) keeps both pending and visible.
    h.restart_worker().await;
    let stat = h.client.stat(&uri("ckpt/step100/model.bin")).await.unwrap();
    assert_eq!(stat.etag, big_stat.etag);

    h.faults().clear();
    drained(&h.client, Duration::from_secs(60)).await;
    assert_eq!(s3_sha(&h, "ckpt/step100/model.bin").await, Some(sha(&big)));
    assert_eq!(s3_sha(&h, "ckpt/latest").await, Some(sha(&small)));

    // The version a reader held still reads (same bytes, now S3's), and
    // the pages were kept: no GET reaches S3.
    let gets = h.gets();
    let (all, served) = h
        .client
        .read_checked(&uri("ckpt/step100/model.bin"), None, Some(&big_stat.etag))
        .await
        .unwrap();
    assert_eq!(sha(&all), sha(&big));
    assert_eq!(served.as_deref(), Some(big_stat.etag.as_str()));
    assert_eq!(h.gets(), gets, "uploaded pages were refetched");
    let stat = h.client.stat(&uri("ckpt/step100/model.bin")).await.unwrap();
    assert!(!stat.etag.starts_with("lc-"), "{stat:?}");
}

/// An upload that finishes while S3 is answering a LIST is in neither that
/// listing (S3 listed before the upload) nor the pending set afterwards.
/// The worker must still list it: a trainer's rank 0 signed a checkpoint
/// manifest without a file another rank had just written, and the resume
/// then refused the checkpoint.
#[tokio::test]
async fn an_upload_finishing_while_s3_lists_stays_in_that_listing() {
    let h = Harness::start().await;
    h.faults()
        .inject(S3Op::PutObject, Fault::InternalError, 100_000);
    let stat = put_back(&h.client, "race/rng_rank1.pt", b"rank 1 state").await;
    eventually(
        Duration::from_secs(60),
        "the first upload attempt",
        || async {
            h.client
                .writeback_status(None)
                .await
                .unwrap()
                .last_error
                .is_some()
        },
    )
    .await;

    // S3 lists now (without the object) and answers late; meanwhile the
    // upload goes through.
    let hold = crate::harness::scaled(Duration::from_secs(10));
    let lists = h.faults().count(S3Op::ListObjects);
    h.faults().inject(
        S3Op::ListObjects,
        Fault::DelayResponse {
            ms: hold.as_millis() as u64,
        },
        1,
    );
    let client = h.client.clone();
    let listing =
        tokio::spawn(async move { client.list(BUCKET, "race/", Some("/"), None, None).await });
    eventually(Duration::from_secs(30), "S3 serving the LIST", || async {
        h.faults().count(S3Op::ListObjects) > lists
    })
    .await;
    h.faults().clear(); // the LIST's rule is spent; uploads may succeed
    drained(&h.client, Duration::from_secs(60)).await;
    assert!(
        !listing.is_finished(),
        "the LIST came back before the upload finished, so this run shows nothing; \
         the held answer ({hold:?}) must outlast the upload's retry"
    );
    assert!(s3_sha(&h, "race/rng_rank1.pt").await.is_some());

    let listing = listing.await.unwrap().unwrap();
    let keys: Vec<_> = listing.objects.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(keys, vec!["race/rng_rank1.pt"], "{listing:?}");
    assert_eq!(listing.objects[0].size, stat.size);
}

#[tokio::test]
async fn deletes_and_renames_of_pending_objects_end_as_the_user_saw() {
    let h = Harness::start().await;
    h.faults()
        .inject(S3Op::PutObject, Fault::InternalError, 100_000);
    let a = data(300_000, 2);
    put_back(&h.client, "tmp/gone", b"deleted before upload").await;
    let src = put_back(&h.client, "tmp/latest.tmp", &a).await;
    // Rename as the mount does it: copy of the version, then delete.
    let copied = h
        .client
        .copy(
            &uri("tmp/latest.tmp"),
            Some(&src.etag),
            &uri("tmp/latest"),
            None,
        )
        .await
        .unwrap();
    assert_eq!(copied.size, a.len() as u64);
    h.client.delete(&uri("tmp/latest.tmp")).await.unwrap();
    h.client.delete(&uri("tmp/gone")).await.unwrap();
    for key in ["tmp/gone", "tmp/latest.tmp"] {
        let err = h.client.stat(&uri(key)).await.unwrap_err();
        assert!(
            matches!(
                err,
                ClientError::Api {
                    code: ErrorCode::NotFound,
                    ..
                }
            ),
            "{key}: {err}"
        );
    }
    let listing = h
        .client
        .list(BUCKET, "tmp/", None, None, None)
        .await
        .unwrap();
    let keys: Vec<_> = listing.objects.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(keys, ["tmp/latest"]);

    h.faults().clear();
    drained(&h.client, Duration::from_secs(60)).await;
    assert_eq!(s3_sha(&h, "tmp/latest").await, Some(sha(&a)));
    assert_eq!(s3_sha(&h, "tmp/latest.tmp").await, None);
    assert_eq!(s3_sha(&h, "tmp/gone").await, None);
}

#[tokio::test]
async fn a_body_not_matching_the_client_checksum_is_refused_and_not_kept() {
    let h = Harness::start().await;
    let request =
        b"PUT /v1/objects/data/bad HTTP/1.1\r\nhost: x\r\nx-lakecache-write-mode: back\r\n\
trailer: x-lakecache-crc32c\r\ntransfer-encoding: chunked\r\n\r\n\
5\r\nhello\r\n0\r\nx-lakecache-crc32c: 1234\r\n\r\n";
    let (status, body) = raw_request(h.addr(), request).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("checksum_mismatch"), "{body}");
    let err = h.client.stat(&uri("bad")).await.unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Api {
                code: ErrorCode::NotFound,
                ..
            }
        ),
        "{err}"
    );
    let status = h.client.writeback_status(None).await.unwrap();
    assert_eq!(status.pending_objects, 0);
    let dirty = h.options.cache_dir.join("writeback/pages");
    let files = std::fs::read_dir(&dirty).map_or(0, |d| d.flatten().count());
    assert_eq!(files, 0, "a refused body left dirty pages");
}

/// Page files under the worker's dirty page store (one directory level).
fn dirty_page_files(h: &Harness) -> usize {
    let pages = h.options.cache_dir.join("writeback/pages");
    let Ok(dirs) = std::fs::read_dir(&pages) else {
        return 0;
    };
    dirs.flatten()
        .map(|d| std::fs::read_dir(d.path()).map_or(0, |f| f.flatten().count()))
        .sum()
}

/// A write-back body that streams while the test feeds it, and its
/// answer once the feed is dropped.
type Streaming = (
    futures::channel::mpsc::Sender<Bytes>,
    tokio::task::JoinHandle<Result<lakecache_protocol::ObjectStat, ClientError>>,
);

fn stream_back(h: &Harness, key: &str) -> Streaming {
    let (feed, body) = futures::channel::mpsc::channel::<Bytes>(1);
    let (client, uri) = (h.client.clone(), uri(key));
    let streaming =
        tokio::spawn(async move { client.put_back(&uri, body, &Default::default()).await });
    (feed, streaming)
}

/// Feeds five whole pages (1 MiB) with a pause after each, as a
/// checkpoint writer pauses between tensors, until two of them are in
/// place while the body is still open; returns what was fed.
async fn feed_until_two_placed(
    h: &Harness,
    feed: &mut futures::channel::mpsc::Sender<Bytes>,
) -> Vec<u8> {
    use futures::SinkExt;
    let mut sent = Vec::new();
    for i in 0..5u64 {
        let page = data(MIB as usize, i);
        sent.extend_from_slice(&page);
        feed.send(Bytes::from(page))
            .await
            .expect("the body takes pages");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eventually(
        Duration::from_secs(30),
        "two whole pages in place before the body ends",
        || async { dirty_page_files(h) >= 2 },
    )
    .await;
    sent
}

/// Whole pages are labelled, synced and moved into place while the body
/// still streams in (the commit at its end then has little left); the
/// object reads back whole once acknowledged.
#[tokio::test]
async fn whole_pages_go_into_place_while_the_body_streams_in() {
    use futures::SinkExt;
    let h = Harness::start().await;
    let (mut feed, streaming) = stream_back(&h, "ckpt/placed.bin");
    let mut sent = feed_until_two_placed(&h, &mut feed).await;
    let tail = data(300_000, 9);
    sent.extend_from_slice(&tail);
    feed.send(Bytes::from(tail))
        .await
        .expect("the body takes the tail");
    drop(feed);
    let stat = streaming.await.unwrap().unwrap();
    assert_eq!(stat.size, sent.len() as u64);
    let got = h.client.read(&uri("ckpt/placed.bin"), None).await.unwrap();
    assert_eq!(sha(&got), sha(&sent), "the object read back differs");
}

/// A body whose client goes away part way leaves none of its pages,
/// those already moved into place included.
#[tokio::test]
async fn a_body_cut_off_leaves_none_of_the_pages_it_placed() {
    let h = Harness::start().await;
    let (mut feed, streaming) = stream_back(&h, "ckpt/cut.bin");
    feed_until_two_placed(&h, &mut feed).await;
    // The client gives up: its connection closes with the body unfinished.
    streaming.abort();
    drop(feed);
    eventually(
        Duration::from_secs(30),
        "no page left of the body cut off",
        || async { dirty_page_files(&h) == 0 },
    )
    .await;
    let status = h.client.writeback_status(None).await.unwrap();
    assert_eq!(status.pending_objects, 0);
    assert!(h.client.stat(&uri("ckpt/cut.bin")).await.is_err());
}

#[tokio::test]
async fn full_staging_blocks_then_fails_after_the_stall_timeout_and_keeps_what_was_acknowledged() {
    let h = Harness::with(|o| {
        o.cache.writeback.staging_limit = 2 * MIB;
        o.cache.writeback.stall_timeout = Duration::from_secs(1);
    })
    .await;
    h.faults()
        .inject(S3Op::PutObject, Fault::InternalError, 100_000);
    let first = data((2 * MIB) as usize, 3);
    put_back(&h.client, "full/first", &first).await;
    let started = std::time::Instant::now();
    let err = h
        .client
        .put_back(
            &uri("full/second"),
            futures::stream::iter(vec![Bytes::from(data(MIB as usize, 4))]),
            &Default::default(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Api {
                code: ErrorCode::StagingFull,
                ..
            }
        ),
        "{err}"
    );
    assert!(started.elapsed() >= Duration::from_secs(1));
    let status = h.client.writeback_status(None).await.unwrap();
    assert_eq!(status.pending_objects, 1);
    // S3 returns: the backlog drains and writes are taken again.
    h.faults().clear();
    drained(&h.client, Duration::from_secs(60)).await;
    assert_eq!(s3_sha(&h, "full/first").await, Some(sha(&first)));
    put_back(&h.client, "full/second", &data(MIB as usize, 4)).await;
    drained(&h.client, Duration::from_secs(60)).await;
}

/// A user restarts the worker with another `--page-size` while writes
/// are pending: the clean cache is discarded (its format changed), the
/// dirty pages are not, and the pending objects read and upload right.
#[tokio::test]
async fn a_restart_with_another_page_size_keeps_pending_writes() {
    let mut h = Harness::start().await;
    h.faults()
        .inject(S3Op::PutObject, Fault::InternalError, 100_000);
    h.faults()
        .inject(S3Op::CompleteMultipartUpload, Fault::InternalError, 100_000);
    let big = data(6 * MIB as usize + 123, 5);
    let small = data(700_001, 6);
    let big_stat = put_back(&h.client, "ps/big", &big).await;
    put_back(&h.client, "ps/small", &small).await;

    h.options.cache.page_size = 2 * MIB;
    h.restart_worker().await;
    let status = h.client.writeback_status(None).await.unwrap();
    assert_eq!(status.pending_objects, 2, "{status:?}");
    // Reads across the old 1 MiB page boundaries, with the new size set.
    let (piece, _) = h
        .client
        .read_checked(
            &uri("ps/big"),
            Some(MIB - 7..3 * MIB + 11),
            Some(&big_stat.etag),
        )
        .await
        .unwrap();
    assert_eq!(&piece[..], &big[MIB as usize - 7..3 * MIB as usize + 11]);

    h.faults().clear();
    drained(&h.client, Duration::from_secs(60)).await;
    assert_eq!(s3_sha(&h, "ps/big").await, Some(sha(&big)));
    assert_eq!(s3_sha(&h, "ps/small").await, Some(sha(&small)));
    let (all, _) = h
        .client
        .read_checked(&uri("ps/big"), None, None)
        .await
        .unwrap();
    assert_eq!(sha(&all), sha(&big));
}

/// A write-back's journal record is synced under the journal's lock.
/// Health checks, status and peer requests read the journal too; they
/// used to wait for that lock on the runtime's own threads, so on a
/// 2-thread runtime two of them stopped every request until the disk
/// finished (under a disk hog, workers "did not answer within 2s").
/// Here the journal's syncs take 10 s: a stat sent while health and
/// status requests wait for the journal is answered before that sync
/// ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_journal_sync_does_not_stop_other_requests() {
    use lakecache_worker::crashsim::slow_disk;
    let h = Harness::start().await;
    h.put_direct("plain/x", b"in S3 already").await;
    h.client.stat(&uri("plain/x")).await.unwrap();

    slow_disk::slow_syncs(
        &h.options.cache_dir,
        "writeback.journal",
        scaled(Duration::from_secs(10)),
    );
    let writer = {
        let client = h.client.clone();
        tokio::spawn(async move { put_back(&client, "ckpt/slow", b"weights").await })
    };
    eventually(
        Duration::from_secs(30),
        "the journal sync starts",
        || async { slow_disk::under_way() > 0 },
    )
    .await;
    // More journal readers than the runtime has threads.
    let waiting: Vec<_> = (0..4)
        .map(|i| {
            let client = h.client.clone();
            tokio::spawn(async move {
                if i % 2 == 0 {
                    client.health().await.map(|_| ())
                } else {
                    client.writeback_status(None).await.map(|_| ())
                }
            })
        })
        .collect();
    // A pause for ordering, not readiness: requests that have not reached
    // the lock yet would let the stat pass without proving anything (with
    // this pause the test failed before the fix, and passes after).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stat = h.client.stat(&uri("plain/x")).await.unwrap();
    let still_syncing = slow_disk::under_way() > 0;
    slow_disk::fast_syncs();
    assert_eq!(stat.size, 13);
    assert!(
        still_syncing,
        "the stat was answered only after the journal's sync ended"
    );
    for w in waiting {
        w.await.unwrap().unwrap();
    }
    assert!(writer.await.unwrap().etag.starts_with("lc-"));
}

/// While S3 is down, the outage breaker makes metadata calls fail fast.
/// The uploader closes it when an upload succeeds; it also closed it when
/// it merely skipped an entry a later write superseded, which needs no
/// S3, and the next stat then waited out the SDK's retries (a mount's
/// lookup "did not answer within 2s" in the write-back crash test).
#[tokio::test]
async fn a_skipped_superseded_upload_does_not_end_the_outage_fast_path() {
    let h = Harness::start().await;
    let forever = 1_000_000;
    for op in [S3Op::HeadObject, S3Op::PutObject] {
        h.faults().inject(op, Fault::InternalError, forever);
    }
    // Two stats that reach S3 and fail (each after the SDK's retries)
    // open the breaker.
    for key in ["probe/a", "probe/b"] {
        h.client.stat(&uri(key)).await.unwrap_err();
    }
    // The first write is superseded by the second before S3 takes either.
    put_back(&h.client, "ckpt/latest", b"step 1").await;
    put_back(&h.client, "ckpt/latest", b"step 2").await;
    eventually(
        Duration::from_secs(30),
        "the superseded entry is skipped",
        || async {
            h.client
                .writeback_status(None)
                .await
                .unwrap()
                .pending_objects
                == 1
        },
    )
    .await;
    let err = h.client.stat(&uri("probe/c")).await.unwrap_err();
    assert!(
        err.to_string().contains("failing fast"),
        "the stat went to S3 instead of failing fast: {err}"
    );
}

/// Two clients (two mounts) write the same object at once, each body
/// streaming while the other's upload is in flight, in both modes: both
/// are acknowledged, and what S3 and readers get is one of the two
/// bodies whole (the write acknowledged last), never a mix of parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_mounts_writing_one_object_at_once_leave_one_whole_body() {
    let h = Harness::start().await;
    let other = WorkerClient::new(&h.addr().to_string(), Duration::from_secs(60)).unwrap();
    for (round, mode) in [
        lakecache_protocol::WriteMode::Through,
        lakecache_protocol::WriteMode::Back,
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("shared/{round}.ckpt");
        let (a, b) = (
            data(12 * MIB as usize, 80 + round as u64),
            data(12 * MIB as usize + 3, 90 + round as u64),
        );
        let watch = Duration::from_secs(30);
        let (ra, rb) = tokio::join!(
            put_watched(&h.client, &key, &a, mode, watch),
            put_watched(&other, &key, &b, mode, watch)
        );
        let (sa, sb) = (ra.unwrap(), rb.unwrap());
        assert_eq!((sa.size, sb.size), (a.len() as u64, b.len() as u64));
        if mode == lakecache_protocol::WriteMode::Back {
            drained(&h.client, Duration::from_secs(60)).await;
        }
        let read = h.client.read(&uri(&key), None).await.unwrap();
        assert!(
            read[..] == a[..] || read[..] == b[..],
            "{mode:?}: a read returned a mix of the two writes ({} bytes)",
            read.len()
        );
        let in_s3 = s3_sha(&h, &key).await.unwrap();
        assert_eq!(in_s3, sha(&read), "{mode:?}: S3 and readers disagree");
    }
}

/// Uploads give way to a body being taken (a checkpoint burst): an
/// object acknowledged while another body streams in stays out of S3
/// until that body pauses, then lands; the wait is counted.
#[tokio::test]
async fn uploads_give_way_while_a_body_streams_in_and_go_once_it_pauses() {
    // Far longer than the body's pauses between pages (100 ms), so a
    // loaded machine does not make the body look paused.
    let quiet = scaled(Duration::from_secs(5));
    let h = Harness::with(|o| {
        o.cache.writeback.upload_give_way = Duration::from_secs(60);
        o.cache.writeback.upload_quiet = quiet;
    })
    .await;
    // A body fed a page (1 MiB) every 100 ms until the feeder stops.
    let (mut feed, body) = futures::channel::mpsc::channel::<Bytes>(1);
    let streaming = {
        let client = h.client.clone();
        tokio::spawn(async move {
            client
                .put_back(&uri("ckpt/step1/model.bin"), body, &Default::default())
                .await
        })
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let feeder = {
        let stop = stop.clone();
        tokio::spawn(async move {
            use futures::SinkExt;
            let mut pages = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let page = Bytes::from(data(MIB as usize, pages));
                feed.send(page).await.expect("the body takes pages");
                pages += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            pages
        })
    };
    eventually(
        Duration::from_secs(30),
        "the body's pages staged",
        || async {
            let m = h.client.metrics().await.unwrap();
            metric_value(&m, "lakecache_writeback_staging_used_bytes") >= (2 * MIB) as f64
        },
    )
    .await;
    put_back(&h.client, "ckpt/latest", b"step-1").await;
    // While pages keep arriving, the small object waits (it would take
    // milliseconds to upload).
    let held = std::time::Instant::now();
    while held.elapsed() < Duration::from_secs(1) {
        assert_eq!(
            h.s3_bytes("ckpt/latest").await,
            None,
            "an upload went while a body streamed in"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let pages = feeder.await.unwrap();
    let stat = streaming.await.unwrap().unwrap();
    assert_eq!(stat.size, pages * MIB);
    eventually(quiet + Duration::from_secs(30), "latest in S3", || async {
        h.s3_bytes("ckpt/latest").await.as_deref() == Some(&b"step-1"[..])
    })
    .await;
    drained(&h.client, Duration::from_secs(60)).await;
    let m = h.client.metrics().await.unwrap();
    assert!(
        metric_value(&m, "lakecache_writeback_upload_gave_way_milliseconds_total") >= 1000.0,
        "the wait is counted:\n{m}"
    );
}

/// Bytes of spare page files the worker reports (a missing metric fails).
async fn spare_bytes(h: &Harness) -> f64 {
    let metrics = h.client.metrics().await.unwrap();
    metric_value(&metrics, "lakecache_writeback_spare")
}

/// Inode numbers of the files in `dir`, and in the directories below it.
fn inodes_under(dir: &std::path::Path) -> std::collections::HashSet<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut found = std::collections::HashSet::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let Ok(meta) = entry.metadata() else { continue };
        if meta.is_dir() {
            found.extend(inodes_under(&entry.path()));
        } else {
            found.insert(meta.ino());
        }
    }
    found
}

/// A write-back burst leaves as many spare page files behind it as it
/// had pages, written once the bodies are quiet; the next burst's pages
/// are written over them (the page files are the spares' inodes), both
/// objects read back whole, and a restart keeps the spares.
#[tokio::test]
async fn spare_page_files_follow_a_burst_and_the_next_is_written_over_them() {
    let mut h = Harness::start().await;
    let spare = (MIB + 4096) as f64;
    assert_eq!(spare_bytes(&h).await, 0.0, "no write-back yet, no spare");
    let first = data((4 * MIB + 100) as usize, 31);
    put_back(&h.client, "ckpt/first.bin", &first).await;
    eventually(
        Duration::from_secs(30),
        "five spares (the first burst's pages) once it is quiet",
        || async { spare_bytes(&h).await == 5.0 * spare },
    )
    .await;
    let spare_dir = h.options.cache_dir.join("writeback/spare");
    let spares = inodes_under(&spare_dir);
    assert_eq!(spares.len(), 5, "{spares:?}");

    let second = data((3 * MIB) as usize, 32);
    put_back(&h.client, "ckpt/second.bin", &second).await;
    // Dirty pages, or clean ones if the upload already moved them.
    let mut pages = inodes_under(&h.options.cache_dir.join("writeback/pages"));
    pages.extend(inodes_under(&h.options.cache_dir.join("pages")));
    let reused = spares.intersection(&pages).count();
    assert_eq!(
        reused, 3,
        "the second body's 3 pages were not written over spares"
    );
    for (key, body) in [("ckpt/first.bin", &first), ("ckpt/second.bin", &second)] {
        let got = h.client.read(&uri(key), None).await.unwrap();
        assert_eq!(sha(&got), sha(body), "{key} reads back other bytes");
    }
    eventually(
        Duration::from_secs(30),
        "the spares refilled after the second burst",
        || async { spare_bytes(&h).await == 5.0 * spare },
    )
    .await;
    drained(&h.client, Duration::from_secs(60)).await;
    h.restart_worker().await;
    assert_eq!(
        spare_bytes(&h).await,
        5.0 * spare,
        "spares kept over a restart"
    );
    let got = h.client.read(&uri("ckpt/second.bin"), None).await.unwrap();
    assert_eq!(sha(&got), sha(&second));
    // Restarted with spares turned off: the ones kept are removed.
    h.options.cache.writeback.spare_most = 0;
    h.restart_worker().await;
    assert_eq!(spare_bytes(&h).await, 0.0);
    assert!(!spare_dir.exists(), "spares left on disk with spares off");
}
