//! Crash case 2b: the power goes out at a sync call. Everything the worker
//! had not synced is undone as a power loss would lose it (the worker's
//! simulated power loss, `crashsim`), the worker starts again over what is
//! left, and every write it acknowledged before the cut must be there,
//! readable, and reach S3. The cut is tried at every sync of the run, one
//! run per sync.

use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::WorkerClient;
use lakecache_s3_endpoint::{Fault, S3Op};
use lakecache_worker::crashsim;

use crate::harness::*;

/// Sizes that cover one byte, part of a page, a page, several pages and
/// several upload parts (pages are 1 MiB, parts 5 MiB).
const SIZES: [usize; 5] = [
    1,
    300_000,
    MIB as usize,
    2 * MIB as usize + 512,
    6 * MIB as usize + 3,
];

/// The simulation is one per process: these tests take turns.
pub(crate) static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Acked {
    key: String,
    version: String,
    sha: String,
}

/// One run: the power goes out at sync number `cut_at`. Returns whether
/// it did (false once `cut_at` is past the run's last sync) and how many
/// acknowledged writes were checked.
async fn run(cut_at: u64) -> (bool, usize) {
    // Tracked from the worker's first directory on; the cut comes during
    // the writes (cuts during start-up are the next test's).
    let mut h = Harness::with(|o| crashsim::arm(&o.cache_dir, u64::MAX)).await;
    crashsim::cut_after(cut_at);
    h.faults()
        .inject(S3Op::PutObject, Fault::InternalError, 1_000_000);
    h.faults().inject(
        S3Op::CompleteMultipartUpload,
        Fault::InternalError,
        1_000_000,
    );
    let mut acked = Vec::new();
    for (i, size) in SIZES.iter().enumerate() {
        let key = format!("pl/{cut_at}/obj{i}");
        let body = data(*size, cut_at * 10 + i as u64);
        let chunks: Vec<Bytes> = body.chunks(200_000).map(Bytes::copy_from_slice).collect();
        if let Ok(stat) = h
            .client
            .put_back(
                &uri(&key),
                futures::stream::iter(chunks),
                &Default::default(),
            )
            .await
        {
            acked.push(Acked {
                key,
                version: stat.etag,
                sha: sha(&body),
            });
        }
    }
    // The machine is off: stop the worker while its file operations still
    // fail, then start a new one over what the "disk" kept.
    h.worker.take().unwrap().shutdown().await;
    let cut = crashsim::disarm();
    h.restart_worker().await;
    for a in &acked {
        let stat = h.client.stat(&uri(&a.key)).await.unwrap_or_else(|e| {
            panic!(
                "cut at sync {cut_at}: {} was acknowledged and is gone: {e}",
                a.key
            )
        });
        assert_eq!(stat.etag, a.version, "cut at sync {cut_at}: {}", a.key);
        let (bytes, _) = h
            .client
            .read_checked(&uri(&a.key), None, Some(&a.version))
            .await
            .unwrap_or_else(|e| panic!("cut at sync {cut_at}: reading {}: {e}", a.key));
        assert_eq!(sha(&bytes), a.sha, "cut at sync {cut_at}: {}", a.key);
    }
    h.faults().clear();
    let start = std::time::Instant::now();
    while h
        .client
        .writeback_status(None)
        .await
        .unwrap()
        .pending_objects
        > 0
    {
        assert!(
            start.elapsed() < crate::harness::scaled(Duration::from_secs(60)),
            "cut at sync {cut_at}: backlog not drained"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for a in &acked {
        let meta = h.direct.head(&uri(&a.key)).await.unwrap();
        let body = h
            .direct
            .get_range(&uri(&a.key), 0..meta.size, &meta.etag)
            .await
            .unwrap();
        assert_eq!(sha(&body), a.sha, "cut at sync {cut_at}: {} in S3", a.key);
    }
    (cut, acked.len())
}

#[tokio::test]
async fn nothing_acknowledged_is_lost_when_the_power_goes_out_at_any_sync() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut checked = 0;
    let mut cuts = 0;
    for cut_at in 1.. {
        let (cut, acked) = run(cut_at).await;
        checked += acked;
        if !cut {
            // Past the last sync: every write was acknowledged.
            assert_eq!(acked, SIZES.len());
            break;
        }
        cuts += 1;
        assert!(cut_at < 500, "the run never stops syncing");
    }
    eprintln!("power cut at each of {cuts} syncs; {checked} acknowledged writes checked after the cuts, none lost");
    assert!(cuts > SIZES.len(), "too few sync points: {cuts}");
}

/// The power goes out while a worker starts (creating its directories,
/// identity and journal): the next start must succeed over what is left
/// and take writes.
#[tokio::test]
async fn a_worker_whose_power_went_out_while_starting_starts_again() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let h = Harness::start().await;
    let mut cuts = 0;
    for cut_at in 1.. {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let mut options = h.options.clone();
        options.cache_dir = cache.clone();
        let metrics = std::sync::Arc::new(lakecache_worker::Metrics::new().unwrap());
        crashsim::arm(&cache, cut_at);
        let store = lakecache_worker::s3_store(&h.s3_config, metrics.clone()).await;
        let first =
            lakecache_worker::start_worker(options.clone(), store.clone(), metrics.clone()).await;
        if let Ok(w) = first {
            w.shutdown().await;
        }
        let cut = crashsim::disarm();
        let again = lakecache_worker::start_worker(options, store, metrics)
            .await
            .unwrap_or_else(|e| {
                panic!("cut at start-up sync {cut_at}: the next start failed: {e}")
            });
        let client = WorkerClient::new(&again.addr().to_string(), Duration::from_secs(30)).unwrap();
        client
            .put_back(
                &uri(&format!("boot/{cut_at}")),
                futures::stream::iter([Bytes::from_static(b"up")]),
                &Default::default(),
            )
            .await
            .unwrap_or_else(|e| {
                panic!("cut at start-up sync {cut_at}: a write after the restart failed: {e}")
            });
        again.shutdown().await;
        if !cut {
            break;
        }
        cuts += 1;
        assert!(cut_at < 100, "start-up never stops syncing");
    }
    assert!(cuts >= 3, "too few start-up sync points: {cuts}");
}
