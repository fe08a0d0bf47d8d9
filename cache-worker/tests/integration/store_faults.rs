//! The worker over `FaultyStore`: failures of the store layer itself
//! (after the SDK's retries) must leave the cache clean and the worker
//! answering with specific errors.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::{ClientError, ErrorCode, WorkerClient};
use lakecache_worker::store::{FaultyStore, S3Store, StoreError, StoreFault};
use lakecache_worker::{Metrics, RunningWorker};

use crate::harness::*;

struct FaultyWorker {
    _dir: tempfile::TempDir,
    worker: RunningWorker,
    client: WorkerClient,
    faults: Arc<Mutex<VecDeque<StoreFault>>>,
}

impl FaultyWorker {
    async fn start(h: &Harness) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(Metrics::new().unwrap());
        let s3 = S3Store::new(&h.s3_config, metrics.clone()).await;
        let store = FaultyStore::new(s3);
        let faults = store.handle();
        let options = default_options(dir.path().join("cache"));
        let worker = lakecache_worker::start_worker(options, Arc::new(store), metrics)
            .await
            .unwrap();
        let client =
            WorkerClient::new(&worker.addr().to_string(), Duration::from_secs(30)).unwrap();
        Self {
            _dir: dir,
            worker,
            client,
            faults,
        }
    }

    fn inject(&self, fault: StoreFault) {
        self.faults.lock().unwrap().push_back(fault);
    }
}

fn code_of(e: &ClientError) -> Option<ErrorCode> {
    match e {
        ClientError::Api { code, .. } => Some(*code),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_page_fetch_is_reported_and_not_cached() {
    let h = Harness::start().await;
    let w = FaultyWorker::start(&h).await;
    let body = data((3 * MIB) as usize, 90);
    h.put_direct("flaky.bin", &body).await;
    w.inject(StoreFault::FailGet(StoreError::Throttled(
        "SlowDown".into(),
    )));
    let err = w
        .client
        .read(&uri("flaky.bin"), Some(0..MIB))
        .await
        .unwrap_err();
    assert_eq!(code_of(&err), Some(ErrorCode::UpstreamThrottled), "{err}");
    // The next read fetches again and gets the object's own bytes.
    let got = w.client.read(&uri("flaky.bin"), None).await.unwrap();
    assert_eq!(sha(&got), sha(&body));
    w.worker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_head_is_not_remembered_as_missing() {
    let h = Harness::start().await;
    let w = FaultyWorker::start(&h).await;
    h.put_direct("there.bin", b"hello").await;
    w.inject(StoreFault::FailHead(StoreError::Unavailable(
        "connection reset".into(),
    )));
    let err = w.client.stat(&uri("there.bin")).await.unwrap_err();
    assert_eq!(code_of(&err), Some(ErrorCode::UpstreamUnavailable), "{err}");
    let stat = w.client.stat(&uri("there.bin")).await.unwrap();
    assert_eq!(stat.size, 5);
    w.worker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_upload_keeps_the_old_object_and_serves_it() {
    let h = Harness::start().await;
    let w = FaultyWorker::start(&h).await;
    let old = data(100_000, 91);
    w.client
        .put_bytes(&uri("ckpt.bin"), Bytes::from(old.clone()))
        .await
        .unwrap();
    assert_eq!(
        sha(&w.client.read(&uri("ckpt.bin"), None).await.unwrap()),
        sha(&old)
    );
    w.inject(StoreFault::FailWrite(StoreError::AccessDenied(
        "bucket policy".into(),
    )));
    let err = w
        .client
        .put_bytes(&uri("ckpt.bin"), Bytes::from(data(100_000, 92)))
        .await
        .unwrap_err();
    assert_eq!(code_of(&err), Some(ErrorCode::AccessDenied), "{err}");
    let got = w.client.read(&uri("ckpt.bin"), None).await.unwrap();
    assert_eq!(sha(&got), sha(&old), "the failed write left no trace");
    w.worker.shutdown().await;
}
