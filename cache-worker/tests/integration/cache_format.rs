//! The on-disk cache describes itself: pages written under one page size
//! or format are never served under another, corrupt or mislabelled pages
//! are refetched and counted, and a second worker cannot open a live
//! worker's directory.

use std::time::Duration;

use crate::harness::{metric_value, uri, Harness, MIB};

/// Every MiB of the object is a different byte value.
fn striped(mibs: u64) -> Vec<u8> {
    (0..mibs)
        .flat_map(|i| std::iter::repeat_n(i as u8 + 1, MIB as usize))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn page_size_change_on_restart_never_serves_old_pages() {
    let mut h = Harness::with(|o| o.cache.page_size = 4 * MIB).await;
    let body = striped(16);
    h.put_direct("striped.bin", &body).await;
    let whole = h.client.read(&uri("striped.bin"), None).await.unwrap();
    assert_eq!(whole.len(), body.len());
    assert_eq!(
        h.settled_page_files().await.len(),
        4,
        "four 4 MiB pages cached"
    );

    h.options.cache.page_size = 8 * MIB;
    h.restart_worker().await;
    let got = h
        .client
        .read(&uri("striped.bin"), Some(8 * MIB..8 * MIB + 8))
        .await
        .unwrap();
    assert_eq!(&got[..], &body[8 * MIB as usize..8 * MIB as usize + 8]);
    assert_eq!(got[0], 9, "byte 8 MiB belongs to the ninth MiB");
    let metrics = h.client.metrics().await.unwrap();
    assert!(
        metric_value(&metrics, "lakecache_discarded_pages_total") >= 4.0,
        "old pages must be discarded and counted:\n{metrics}"
    );
    // The whole object is right under the new page size, twice (cold, warm).
    for _ in 0..2 {
        let again = h.client.read(&uri("striped.bin"), None).await.unwrap();
        assert!(again == body, "wrong bytes after the page-size change");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_page_file_under_another_name_is_rejected() {
    // Swap two page files on disk: each still passes its own CRCs, but the
    // header names another page, so both are refetched.
    let h = Harness::start().await;
    let body = striped(2);
    h.put_direct("swap.bin", &body).await;
    h.client.read(&uri("swap.bin"), None).await.unwrap();
    let files = h.settled_page_files().await;
    assert_eq!(files.len(), 2);
    let (a, b) = (
        std::fs::read(&files[0]).unwrap(),
        std::fs::read(&files[1]).unwrap(),
    );
    std::fs::write(&files[0], b).unwrap();
    std::fs::write(&files[1], a).unwrap();
    h.faults().reset_counts();
    let got = h.client.read(&uri("swap.bin"), None).await.unwrap();
    assert!(got == body, "a swapped page was served");
    assert_eq!(h.gets(), 2, "both pages refetched");
    let metrics = h.client.metrics().await.unwrap();
    assert!(metric_value(&metrics, "lakecache_corrupt_pages_total") >= 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_truncated_page_file_is_refetched() {
    let h = Harness::start().await;
    let body = striped(1);
    h.put_direct("short.bin", &body).await;
    h.client.read(&uri("short.bin"), None).await.unwrap();
    let files = h.settled_page_files().await;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&files[0])
        .unwrap();
    f.set_len(100).unwrap();
    h.faults().reset_counts();
    let got = h.client.read(&uri("short.bin"), None).await.unwrap();
    assert!(got == body);
    assert_eq!(h.gets(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_worker_on_a_live_cache_dir_fails_before_touching_it() {
    let h = Harness::start().await;
    // Something in tmp/ that the running worker owns.
    let marker = h.options.cache_dir.join("tmp").join("in-flight-upload");
    std::fs::write(&marker, b"staged").unwrap();
    let store = lakecache_worker::s3_store(
        &h.s3_config,
        std::sync::Arc::new(lakecache_worker::Metrics::new().unwrap()),
    )
    .await;
    let started = std::time::Instant::now();
    let second = lakecache_worker::start_worker(
        h.options.clone(),
        store,
        std::sync::Arc::new(lakecache_worker::Metrics::new().unwrap()),
    )
    .await;
    let err = match second {
        Ok(_) => panic!("a second worker opened a live cache directory"),
        Err(e) => format!("{e:#}"),
    };
    let took = started.elapsed();
    eprintln!("a second worker on a live cache directory was refused after {took:?}");
    // Refused at once, not after a lock timeout (measured: 0.7 ms).
    assert!(
        took < crate::harness::scaled(Duration::from_secs(2)),
        "{took:?}"
    );
    assert!(err.contains("in use"), "unclear error: {err}");
    assert!(marker.exists(), "the live worker's staging was touched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_reads_fetch_what_they_ask_until_their_block_is_worth_keeping() {
    // 4 MiB pages; a 4 KiB read in the middle of an object is random.
    let h = Harness::with(|o| o.cache.page_size = 4 * MIB).await;
    let body = crate::harness::data((8 * MIB) as usize, 77);
    h.put_direct("random.bin", &body).await;
    let s3_bytes = |m: &str| metric_value(m, "lakecache_s3_transferred_bytes_total");
    let block = 256 * 1024;
    let base = 5 * MIB + block;
    let mut asked = 0.0;
    let mut fetched = 0.0;
    // Reads scattered over one check block: each costs what it asks,
    // until they have cost as much as the block, which is then kept.
    for i in 0..64u64 {
        let at = base + (i * 37 % 64) * 4096;
        h.faults().reset_counts();
        let got = h
            .client
            .read(&uri("random.bin"), Some(at..at + 4096))
            .await
            .unwrap();
        assert_eq!(&got[..], &body[at as usize..at as usize + 4096]);
        asked += 4096.0;
        assert_eq!(h.gets(), 1, "read {i}: one S3 request per random miss");
        fetched = s3_bytes(&h.client.metrics().await.unwrap());
        assert!(
            fetched <= 2.0 * asked,
            "read {i}: {fetched} S3 bytes for {asked} asked"
        );
    }
    assert_eq!(
        fetched,
        63.0 * 4096.0 + block as f64,
        "the block was bought once"
    );
    // The kept block now serves any read in it without S3.
    h.faults().reset_counts();
    let got = h
        .client
        .read(&uri("random.bin"), Some(base + 100..base + 9000))
        .await
        .unwrap();
    assert_eq!(
        &got[..],
        &body[(base + 100) as usize..(base + 9000) as usize]
    );
    assert_eq!(h.gets(), 0, "the kept block is served from disk");
    let all = h.client.read(&uri("random.bin"), None).await.unwrap();
    assert!(all == body, "a partly filled page served wrong bytes");
}

/// Pages handed over by another worker are kept only for the object's
/// current ETag, at page-aligned offsets, and then served without S3.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn handed_over_pages_are_checked_then_served_locally() {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use lakecache_protocol::ClientError;

    let h = Harness::with(|o| o.cache.page_size = MIB).await;
    let body = striped(3);
    let etag = h.put_direct("handed.bin", &body).await;
    let u = uri("handed.bin");
    let put = |etag: String, offset: u64, data: Vec<u8>| {
        // A fresh connection each time: a refusal sent before the body
        // was read closes the connection it came on.
        let client = lakecache_protocol::WorkerClient::new(
            &h.addr().to_string(),
            std::time::Duration::from_secs(60),
        )
        .unwrap();
        let u = u.clone();
        async move {
            let len = data.len() as u64;
            let b = Full::new(Bytes::from(data)).map_err(|e| match e {}).boxed();
            client
                .put_pages(&u, &etag, offset, len, "another-worker", b)
                .await
        }
    };
    let status = |r: Result<(), ClientError>| match r {
        Err(ClientError::Api { status, .. }) => status,
        // Refused before the body was read: the connection is cut.
        Err(ClientError::Transport { .. }) => 0,
        Err(e) => panic!("unexpected error {e}"),
        Ok(()) => 200,
    };
    let mib = MIB as usize;
    // Refusals may come before the body is read (then the connection is
    // cut under the sender): 412 / 400 or a cut, never 200.
    let wrong_etag = status(put("nope".into(), 0, body[..mib].to_vec()).await);
    assert!(wrong_etag == 412 || wrong_etag == 0, "got {wrong_etag}");
    let misaligned = status(put(etag.clone(), 4096, body[..mib].to_vec()).await);
    assert!(misaligned == 400 || misaligned == 0, "got {misaligned}");
    let too_long = status(put(etag.clone(), 0, vec![0; 4 * mib]).await);
    assert!(too_long == 400 || too_long == 0, "got {too_long}");
    assert!(h.page_files().is_empty(), "a refused hand-off left pages");
    // Bytes 1..3 MiB: two whole pages are kept.
    let gets = h.gets();
    assert_eq!(
        status(put(etag.clone(), MIB, body[mib..].to_vec()).await),
        200
    );
    assert_eq!(h.page_files().len(), 2);
    let got = h.client.read(&u, Some(MIB..3 * MIB)).await.unwrap();
    assert!(
        got[..] == body[mib..],
        "handed-over pages served wrong bytes"
    );
    assert_eq!(
        h.gets(),
        gets,
        "handed-over pages were fetched from S3 again"
    );
}
