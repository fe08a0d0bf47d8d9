use std::sync::Arc;
use std::time::Duration;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cold_read_returns_the_object_and_warm_read_makes_no_s3_get() {
    let h = Harness::start().await;
    let body = data((10 * MIB + 12345) as usize, 1);
    h.put_direct("shards/a.bin", &body).await;

    let cold = h.client.read(&uri("shards/a.bin"), None).await.unwrap();
    assert_eq!(sha(&cold), sha(&body));
    let cold_gets = h.gets();
    assert_eq!(cold_gets, 11, "one GET per 1 MiB page");

    h.faults().reset_counts();
    let warm = h.client.read(&uri("shards/a.bin"), None).await.unwrap();
    assert_eq!(sha(&warm), sha(&body));
    // Ranged reads across page boundaries, all warm.
    for (start, end) in [
        (0u64, 1u64),
        (MIB - 3, MIB + 3),
        (5 * MIB + 7, 9 * MIB),
        (10 * MIB, 10 * MIB + 12345),
    ] {
        let got = h
            .client
            .read(&uri("shards/a.bin"), Some(start..end))
            .await
            .unwrap();
        assert_eq!(
            &got[..],
            &body[start as usize..end as usize],
            "range {start}..{end}"
        );
    }
    assert_eq!(h.gets(), 0, "warm reads must not GET from S3");
    assert_eq!(h.heads(), 0, "metadata is fresh within the TTL");
    let metrics = h.client.metrics().await.unwrap();
    assert!(
        metrics.contains("lakecache_cache_hit_bytes_total"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restarted_worker_serves_warm_pages_without_s3() {
    let mut h = Harness::start().await;
    let body = data((3 * MIB + 5) as usize, 2);
    h.put_direct("warm.bin", &body).await;
    assert_eq!(
        sha(&h.client.read(&uri("warm.bin"), None).await.unwrap()),
        sha(&body)
    );

    h.restart_worker().await;
    h.faults().reset_counts();
    let again = h.client.read(&uri("warm.bin"), None).await.unwrap();
    assert_eq!(sha(&again), sha(&body));
    assert_eq!(h.gets(), 0);
    assert_eq!(h.heads(), 0);
    assert!(h.worker.as_ref().unwrap().cache().used_bytes() >= body.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eviction_under_a_small_capacity_keeps_reads_correct() {
    let h = Harness::with(|o| o.cache.capacity = 6 * MIB).await;
    let objects: Vec<Vec<u8>> = (0..5)
        .map(|i| data((3 * MIB + 100) as usize, 10 + i))
        .collect();
    for (i, body) in objects.iter().enumerate() {
        h.put_direct(&format!("evict/{i}"), body).await;
    }
    for _round in 0..2 {
        for (i, body) in objects.iter().enumerate() {
            let got = h
                .client
                .read(&uri(&format!("evict/{i}")), None)
                .await
                .unwrap();
            assert_eq!(sha(&got), sha(body), "object {i}");
        }
    }
    // Eviction runs in the background.
    let cache = h.worker.as_ref().unwrap().cache().clone();
    eventually(Duration::from_secs(10), "eviction down to capacity", || {
        let used = cache.used_bytes();
        async move { used <= 6 * MIB }
    })
    .await;
    let metrics = h.client.metrics().await.unwrap();
    let evicted = metric_value(&metrics, "lakecache_evicted_pages_total");
    assert!(evicted > 0.0, "no evictions recorded:\n{metrics}");
    // Page files on disk match the accounting.
    let on_disk: u64 = h
        .settled_page_files()
        .await
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum();
    assert!(on_disk <= 6 * MIB, "{on_disk} bytes of page files on disk");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn changed_etag_is_detected_and_new_bytes_served() {
    // TTL 0: every read revalidates, so a new version is seen at once.
    let h = Harness::with(|o| o.cache.metadata_ttl = Duration::ZERO).await;
    let v1 = data((2 * MIB) as usize, 20);
    let v2 = data((2 * MIB + 777) as usize, 21);
    h.put_direct("model.bin", &v1).await;
    assert_eq!(
        sha(&h.client.read(&uri("model.bin"), None).await.unwrap()),
        sha(&v1)
    );
    let used_v1 = h.worker.as_ref().unwrap().cache().used_bytes();
    h.put_direct("model.bin", &v2).await;
    assert_eq!(
        sha(&h.client.read(&uri("model.bin"), None).await.unwrap()),
        sha(&v2)
    );
    let stat = h.client.stat(&uri("model.bin")).await.unwrap();
    assert_eq!(stat.size, v2.len() as u64);
    // The old version's pages are reclaimed.
    let cache = h.worker.as_ref().unwrap().cache().clone();
    let v2_len = v2.len() as u64;
    eventually(
        Duration::from_secs(10),
        "the old version's pages reclaimed",
        || {
            let used = cache.used_bytes();
            async move { used < used_v1 + v2_len }
        },
    )
    .await;
    assert!(
        cache.used_bytes() <= v2.len() as u64 + MIB,
        "old pages kept: {}",
        cache.used_bytes()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_version_change_mid_read_is_never_mixed() {
    // TTL 60 s: the worker still believes in v1 when v2 lands in S3.
    let h = Harness::start().await;
    let v1 = data((3 * MIB) as usize, 30);
    let v2 = data((3 * MIB) as usize, 31);
    h.put_direct("ckpt.bin", &v1).await;
    // Cache only page 0 of v1.
    let head = h.client.read(&uri("ckpt.bin"), Some(0..MIB)).await.unwrap();
    assert_eq!(&head[..], &v1[..MIB as usize]);
    h.put_direct("ckpt.bin", &v2).await;
    // Page 0 is a v1 hit, page 1 must come from S3 with If-Match v1 and
    // fails: the read breaks instead of splicing v2 onto v1.
    match h.client.read(&uri("ckpt.bin"), None).await {
        Ok(bytes) => assert!(bytes[..] == v2[..], "mixed or stale bytes served"),
        Err(e) => assert!(e.is_retryable(), "unexpected error {e}"),
    }
    // The next read sees v2 entirely.
    let again = h.client.read(&uri("ckpt.bin"), None).await.unwrap();
    assert_eq!(sha(&again), sha(&v2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_readers_of_a_cold_page_cause_one_get() {
    let h = Harness::start().await;
    let body = data(MIB as usize, 40);
    h.put_direct("hot.bin", &body).await;
    h.faults().reset_counts();
    let client = Arc::new(h.client.clone());
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            client.read(&uri("hot.bin"), None).await
        }));
    }
    for t in tasks {
        assert_eq!(sha(&t.await.unwrap().unwrap()), sha(&body));
    }
    assert_eq!(
        h.gets(),
        1,
        "single-flight must collapse 32 cold reads into one GET"
    );
    assert_eq!(h.heads(), 1, "and 32 cold stats into one HEAD");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_page_just_fetched_whole_serves_its_readers_next_request_from_memory() {
    let h = Harness::start().await;
    let body = data(MIB as usize, 51);
    h.put_direct("stream.bin", &body).await;
    let half = MIB / 2;
    // The first half, read from offset 0, fetches the whole page.
    let first = h
        .client
        .read(&uri("stream.bin"), Some(0..half))
        .await
        .unwrap();
    assert_eq!(&first[..], &body[..half as usize]);
    assert_eq!(h.gets(), 1);
    // Whatever is on disk now, the next request is answered from memory.
    let files = h.settled_page_files().await;
    assert_eq!(files.len(), 1);
    let mut raw = std::fs::read(&files[0]).unwrap();
    raw[4096 + half as usize + 10] ^= 0x55;
    std::fs::write(&files[0], raw).unwrap();
    let second = h
        .client
        .read(&uri("stream.bin"), Some(half..MIB))
        .await
        .unwrap();
    assert_eq!(sha(&second), sha(&body[half as usize..]));
    assert_eq!(h.gets(), 1, "no second fetch");
    let metrics = h.client.metrics().await.unwrap();
    assert_eq!(
        metric_value(&metrics, "lakecache_fresh_served_bytes_total"),
        half as f64
    );
    // Served whole, the page left memory: the damaged file is caught.
    let again = h
        .client
        .read(&uri("stream.bin"), Some(half..MIB))
        .await
        .unwrap();
    assert_eq!(sha(&again), sha(&body[half as usize..]));
    let metrics = h.client.metrics().await.unwrap();
    assert_eq!(metric_value(&metrics, "lakecache_corrupt_pages_total"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupted_page_file_is_detected_and_refetched() {
    let h = Harness::start().await;
    let body = data((MIB / 2) as usize, 50);
    h.put_direct("fragile.bin", &body).await;
    h.client.read(&uri("fragile.bin"), None).await.unwrap();
    let files = h.settled_page_files().await;
    assert_eq!(files.len(), 1);
    let mut raw = std::fs::read(&files[0]).unwrap();
    // Past the 4 KiB header: a data byte.
    raw[4096 + 1000] ^= 0x55;
    std::fs::write(&files[0], raw).unwrap();

    h.faults().reset_counts();
    let got = h.client.read(&uri("fragile.bin"), None).await.unwrap();
    assert_eq!(sha(&got), sha(&body), "corrupt bytes must never be served");
    assert_eq!(h.gets(), 1, "the page is refetched");
    let metrics = h.client.metrics().await.unwrap();
    assert!(metric_value(&metrics, "lakecache_corrupt_pages_total") >= 1.0);
    // And the refetched page is good again.
    h.faults().reset_counts();
    assert_eq!(
        sha(&h.client.read(&uri("fragile.bin"), None).await.unwrap()),
        sha(&body)
    );
    assert_eq!(h.gets(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sequential_reads_trigger_read_ahead() {
    let h = Harness::with(|o| o.cache.readahead_pages = 3).await;
    let body = data((8 * MIB) as usize, 60);
    h.put_direct("seq.bin", &body).await;
    let first = h
        .client
        .read(&uri("seq.bin"), Some(0..256 * 1024))
        .await
        .unwrap();
    assert_eq!(&first[..], &body[..256 * 1024]);
    // Pages 1..=3 arrive in the background: fetched, then stored.
    eventually(
        Duration::from_secs(10),
        "read-ahead fetching the next pages",
        || {
            let gets = h.gets();
            async move { gets >= 4 }
        },
    )
    .await;
    let cache = h.worker.as_ref().unwrap().cache().clone();
    eventually(Duration::from_secs(10), "read-ahead pages stored", || {
        let used = cache.used_bytes();
        async move { used >= 4 * MIB }
    })
    .await;
    let before = h.gets();
    let next = h
        .client
        .read(&uri("seq.bin"), Some(MIB..2 * MIB))
        .await
        .unwrap();
    assert_eq!(&next[..], &body[MIB as usize..2 * MIB as usize]);
    assert_eq!(h.gets(), before, "page 1 was already read ahead");

    // A random read does not trigger read-ahead.
    let h2 = Harness::with(|o| o.cache.readahead_pages = 3).await;
    h2.put_direct("rand.bin", &body).await;
    h2.faults().reset_counts();
    h2.client
        .read(&uri("rand.bin"), Some(5 * MIB + 10..5 * MIB + 4106))
        .await
        .unwrap();
    // Nothing must follow: a quiet period, not a synchronisation.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h2.gets(), 1, "random reads must not be amplified");
}
