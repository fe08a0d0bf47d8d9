//! Per-prefix cache policies (pin, TTL, skip-cache, max-age), `free`, and
//! the per-bucket egress-saved counts, against a real worker and S3.

use std::time::Duration;

use lakecache_worker::policy::{Policies, PrefixPolicy};

use crate::harness::*;

fn policy(prefix: &str) -> PrefixPolicy {
    PrefixPolicy {
        prefix: format!("s3://{BUCKET}/{prefix}"),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pinned_pages_survive_a_scan_that_evicts_everything_else_and_restarts() {
    let mut h = Harness::with(|o| {
        o.cache.capacity = 8 * MIB;
        o.cache.high_watermark = 0.9;
        o.cache.low_watermark = 0.5;
        o.cache.policies = Policies::new(vec![PrefixPolicy {
            pin: true,
            ..policy("golden/")
        }])
        .unwrap();
    })
    .await;
    let golden = data((3 * MIB) as usize, 1);
    h.put_direct("golden/tokenizer.bin", &golden).await;
    h.client
        .read(&uri("golden/tokenizer.bin"), None)
        .await
        .unwrap();
    // A scan of 5x the cache through the same worker.
    for i in 0..10 {
        let body = data((4 * MIB) as usize, 100 + i);
        h.put_direct(&format!("scan/{i}.bin"), &body).await;
        h.client
            .read(&uri(&format!("scan/{i}.bin")), None)
            .await
            .unwrap();
    }
    // Page accounting settles in the background; the pinned bytes stay.
    eventually(
        Duration::from_secs(10),
        "3 MiB pinned after the scan",
        || {
            let client = h.client.clone();
            async move { client.health().await.unwrap().pinned_bytes == 3 * MIB }
        },
    )
    .await;
    let health = h.client.health().await.unwrap();
    assert_eq!(health.pinned_bytes, 3 * MIB, "{health:?}");
    h.faults().reset_counts();
    let again = h
        .client
        .read(&uri("golden/tokenizer.bin"), None)
        .await
        .unwrap();
    assert_eq!(sha(&again), sha(&golden));
    assert_eq!(h.gets(), 0, "the pinned object was evicted by the scan");

    // Pins are restored from the index after a restart.
    h.restart_worker().await;
    assert_eq!(h.client.health().await.unwrap().pinned_bytes, 3 * MIB);
    for i in 0..4 {
        h.client
            .read(&uri(&format!("scan/{i}.bin")), None)
            .await
            .unwrap();
    }
    h.faults().reset_counts();
    h.client
        .read(&uri("golden/tokenizer.bin"), None)
        .await
        .unwrap();
    assert_eq!(h.gets(), 0, "the pin was lost across the restart");

    // free evicts pinned pages too (an operator asked) and only under
    // the prefix.
    let freed = h.client.free(BUCKET, "golden/").await.unwrap();
    assert_eq!((freed.pages, freed.bytes), (3, 3 * MIB));
    assert_eq!(h.client.health().await.unwrap().pinned_bytes, 0);
    h.faults().reset_counts();
    h.client
        .read(&uri("golden/tokenizer.bin"), None)
        .await
        .unwrap();
    assert_eq!(h.gets(), 3, "freed pages must come from S3 again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ttl_pages_expire_skip_cache_stores_nothing_and_max_age_revalidates() {
    let h = Harness::with(|o| {
        o.cache.metadata_ttl = Duration::from_secs(3600);
        o.cache.policies = Policies::new(vec![
            PrefixPolicy {
                ttl: Some(Duration::from_secs(1)),
                ..policy("hourly/")
            },
            PrefixPolicy {
                skip_cache: true,
                ..policy("stream/")
            },
            PrefixPolicy {
                max_age: Some(Duration::from_millis(300)),
                ..policy("live/")
            },
        ])
        .unwrap();
    })
    .await;
    let body = data((2 * MIB) as usize, 7);
    for key in ["hourly/a.bin", "stream/a.bin", "live/a.bin", "plain/a.bin"] {
        h.put_direct(key, &body).await;
        h.client.read(&uri(key), None).await.unwrap();
    }
    // Warm right after: everything but the skip-cache object.
    h.faults().reset_counts();
    for key in ["hourly/a.bin", "plain/a.bin"] {
        h.client.read(&uri(key), None).await.unwrap();
    }
    assert_eq!(h.gets(), 0);
    let got = h.client.read(&uri("stream/a.bin"), None).await.unwrap();
    assert_eq!(sha(&got), sha(&body));
    assert_eq!(h.gets(), 2, "a skip-cache read goes to S3 every time");

    // After the TTL (and the evictor's next 1 s round) the TTL object's
    // pages are gone; the plain one stays.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    h.faults().reset_counts();
    h.client.read(&uri("plain/a.bin"), None).await.unwrap();
    assert_eq!(h.gets(), 0);
    h.client.read(&uri("hourly/a.bin"), None).await.unwrap();
    assert_eq!(h.gets(), 2, "TTL pages were not evicted");

    // max-age: the live/ object is re-HEADed after 300 ms, the plain one
    // is trusted for the worker-wide hour.
    h.faults().reset_counts();
    h.client.stat(&uri("plain/a.bin")).await.unwrap();
    h.client.stat(&uri("live/a.bin")).await.unwrap();
    assert_eq!(h.heads(), 1, "only the max-age object revalidates");
    let changed = data((2 * MIB) as usize, 8);
    h.put_direct("live/a.bin", &changed).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let got = h.client.read(&uri("live/a.bin"), None).await.unwrap();
    assert_eq!(sha(&got), sha(&changed), "max-age did not revalidate");

    // Egress saved is counted per bucket, in health and metrics.
    let health = h.client.health().await.unwrap();
    let ours = health.buckets.get(BUCKET).copied().unwrap_or_default();
    assert!(ours.hit_bytes >= 4 * MIB, "{health:?}");
    assert!(ours.miss_bytes >= 8 * MIB, "{health:?}");
    assert_eq!(ours.hit_bytes, health.hit_bytes);
    let text = h.client.metrics().await.unwrap();
    let dollars = metric_value(
        &text,
        "lakecache_egress_saved_dollars_total{bucket=\"data\"}",
    );
    let expect = ours.hit_bytes as f64 / 1e9 * 0.09;
    assert!(
        (dollars - expect).abs() < 1e-9,
        "{dollars} vs {expect}\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn free_refuses_bad_prefixes_and_methods_with_clear_errors() {
    let h = Harness::start().await;
    let err = h.client.free(BUCKET, "a/../b").await.unwrap_err();
    assert!(err.to_string().contains("'..'"), "{err}");
    let err = h.client.free("Bad_Bucket", "").await.unwrap_err();
    assert!(err.to_string().contains("bucket"), "{err}");
    let (status, text) = raw_request(
        h.addr(),
        b"GET /v1/free/data HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 405, "{text}");
    let (status, text) = raw_request(
        h.addr(),
        b"POST /v1/free/data HTTP/1.1\r\nhost: x\r\ncontent-length: 9\r\nconnection: close\r\n\r\n{\"x\": 1}\n",
    )
    .await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("unknown field"), "{text}");
}

/// A big preload runs in its own fetch slots: a reader's cold read on the
/// same worker finishes while the load is still going, instead of
/// queueing behind it. S3 is slowed (300 ms per GET) so the load lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_running_load_does_not_hold_up_other_reads() {
    use lakecache_protocol::{LoadSpec, LoadState};
    use lakecache_s3_endpoint::{Fault, S3Op};
    let h = Harness::start().await;
    for i in 0..24 {
        h.put_direct(
            &format!("bulk/{i:02}.bin"),
            &data((8 * MIB) as usize, 40 + i),
        )
        .await;
    }
    let hot = data((2 * MIB) as usize, 99);
    h.put_direct("hot/x.bin", &hot).await;
    h.faults()
        .inject(S3Op::GetObject, Fault::Delay { ms: 300 }, u32::MAX);
    let spec = LoadSpec {
        bucket: BUCKET.into(),
        prefix: "bulk/".into(),
        include: None,
        replicas: None,
    };
    h.client.load_start("bulk", &spec).await.unwrap();
    // Wait until the load is fetching.
    let started = std::time::Instant::now();
    loop {
        let p = h.client.load_status("bulk").await.unwrap();
        if p.bytes_fetched > 0 {
            break;
        }
        assert!(
            started.elapsed() < crate::harness::scaled(Duration::from_secs(30)),
            "{p:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let read_started = std::time::Instant::now();
    let got = h.client.read(&uri("hot/x.bin"), None).await.unwrap();
    let read_took = read_started.elapsed();
    assert_eq!(sha(&got), sha(&hot));
    let during = h.client.load_status("bulk").await.unwrap();
    eprintln!(
        "cold 2 MiB read took {read_took:?} while the load had {} of {} bytes",
        during.bytes_fetched, during.bytes_owned
    );
    assert_eq!(
        during.state,
        LoadState::Running,
        "the read waited for the whole load: {during:?}"
    );
    h.faults().clear();
    let started = std::time::Instant::now();
    loop {
        let p = h.client.load_status("bulk").await.unwrap();
        if p.state != LoadState::Running {
            assert_eq!(p.state, LoadState::Done, "{p:?}");
            assert_eq!(p.bytes_fetched + p.bytes_cached, 24 * 8 * MIB, "{p:?}");
            break;
        }
        assert!(
            started.elapsed() < crate::harness::scaled(Duration::from_secs(120)),
            "{p:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
