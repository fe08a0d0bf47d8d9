//! Per-tenant quotas and S3 request rates: one team's scan evicts only
//! its own pages; pending write-back data counts against its writer;
//! a rate-limited tenant waits while others do not.

use std::time::{Duration, Instant};

use bytes::Bytes;
use lakecache_protocol::token::{Claims, KeyRing, SigningKey};
use lakecache_protocol::WorkerClient;
use lakecache_worker::AccessPolicy;

use crate::harness::*;

fn token_client(h: &Harness, key: &SigningKey, tenant: &str) -> WorkerClient {
    let claims = Claims {
        tenant: tenant.into(),
        kid: String::new(),
        exp: 4_000_000_000,
        read: vec!["s3://data/".into()],
        write: vec![format!("s3://data/{tenant}/")],
        peer: false,
        operator: false,
        members_key: None,
    };
    h.client
        .clone()
        .with_token(Some(&key.mint(&claims)))
        .unwrap()
}

/// A worker that requires tokens, tuned by `tune`, and its signing key.
async fn with_tokens(
    tune: impl FnOnce(&mut lakecache_worker::WorkerOptions),
) -> (Harness, SigningKey) {
    let key = SigningKey::generate("k1");
    let keys = KeyRing::new(key.clone(), None);
    let h = Harness::with(|o| {
        o.access = AccessPolicy {
            keys: Some(keys),
            allow: Vec::new(),
            protect_metrics: false,
        };
        tune(o);
    })
    .await;
    (h, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_scanning_tenant_evicts_its_own_pages_not_another_teams_dataset() {
    let (mut h, key) = with_tokens(|o| {
        o.cache.capacity = 64 * MIB;
        o.cache.tenant_quotas = [("scanner".to_string(), 8 * MIB)].into();
    })
    .await;
    let team = token_client(&h, &key, "team-a");
    let scanner = token_client(&h, &key, "scanner");
    let dataset = data((6 * MIB) as usize, 1);
    h.put_direct("datasets/a/train.bin", &dataset).await;
    team.read(&uri("datasets/a/train.bin"), None).await.unwrap();
    // The scanner reads 5x its quota.
    for i in 0..10 {
        h.put_direct(
            &format!("datasets/big/{i}.bin"),
            &data((4 * MIB) as usize, 10 + i),
        )
        .await;
        scanner
            .read(&uri(&format!("datasets/big/{i}.bin")), None)
            .await
            .unwrap();
    }
    h.settled_page_files().await;
    let health = h.client.health().await.unwrap();
    let scan = &health.tenants["scanner"];
    assert!(scan.cache_bytes <= 8 * MIB, "{health:?}");
    assert_eq!(scan.quota_bytes, Some(8 * MIB));
    assert_eq!(health.tenants["team-a"].cache_bytes, 6 * MIB, "{health:?}");
    h.faults().reset_counts();
    let again = team.read(&uri("datasets/a/train.bin"), None).await.unwrap();
    assert_eq!(sha(&again), sha(&dataset));
    assert_eq!(h.gets(), 0, "the scan flushed another team's dataset");
    let text = h.client.metrics().await.unwrap();
    assert!(
        metric_value(
            &text,
            "lakecache_tenant_quota_evicted_bytes_total{tenant=\"scanner\"}"
        ) >= (32 * MIB) as f64,
        "{text}"
    );
    assert!(
        text.contains("lakecache_tenant_cache_used_bytes{tenant=\"team-a\"} 6291456"),
        "{text}"
    );

    // Attribution survives a restart (it is in the page index).
    h.restart_worker().await;
    let health = h.client.health().await.unwrap();
    assert_eq!(health.tenants["team-a"].cache_bytes, 6 * MIB, "{health:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pending_write_back_counts_against_its_tenant_and_is_never_evicted() {
    let (h, key) = with_tokens(|o| {
        o.cache.tenant_quotas = [("team-b".to_string(), 6 * MIB)].into();
    })
    .await;
    let team = token_client(&h, &key, "team-b");
    for i in 0..3 {
        h.put_direct(
            &format!("datasets/{i}.bin"),
            &data((2 * MIB) as usize, 20 + i),
        )
        .await;
    }
    // S3 refuses uploads for now: the write stays pending.
    use lakecache_s3_endpoint::{Fault, S3Op};
    h.faults()
        .inject(S3Op::PutObject, Fault::InternalError, u32::MAX);
    h.faults()
        .inject(S3Op::CreateMultipartUpload, Fault::InternalError, u32::MAX);
    let ckpt = data((4 * MIB) as usize, 3);
    team.put_back(
        &uri("team-b/ckpt.pt"),
        futures::stream::iter([Bytes::from(ckpt.clone())]),
        &Default::default(),
    )
    .await
    .unwrap();
    // 4 MiB pending leaves 2 MiB of the quota for pages.
    for i in 0..3 {
        team.read(&uri(&format!("datasets/{i}.bin")), None)
            .await
            .unwrap();
    }
    // Pages fetched by the reads are written and indexed (and the quota
    // enforced) off the request path: on a loaded machine the last one may
    // land just after the read returns, so the check polls, with a deadline.
    let deadline = std::time::Instant::now() + scaled(std::time::Duration::from_secs(20));
    loop {
        let health = h.client.health().await.unwrap();
        let usage = &health.tenants["team-b"];
        assert_eq!(usage.pending_bytes, 4 * MIB, "{health:?}");
        if usage.cache_bytes + usage.pending_bytes <= 6 * MIB {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "team-b stays over its 6 MiB quota: {health:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // The pending checkpoint still reads back whole.
    let got = team.read(&uri("team-b/ckpt.pt"), None).await.unwrap();
    assert_eq!(sha(&got), sha(&ckpt));
    h.faults().clear();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_over_its_s3_rate_waits_and_others_do_not() {
    let (h, key) = with_tokens(|o| {
        o.cache.tenant_s3_rps = [("slow".to_string(), 5)].into();
    })
    .await;
    for i in 0..15 {
        h.put_direct(&format!("datasets/s/{i}"), b"x").await;
        h.put_direct(&format!("datasets/f/{i}"), b"x").await;
    }
    let slow = token_client(&h, &key, "slow");
    let fast = token_client(&h, &key, "fast");
    let started = Instant::now();
    for i in 0..15 {
        fast.stat(&uri(&format!("datasets/f/{i}"))).await.unwrap();
    }
    let fast_took = started.elapsed();
    let started = Instant::now();
    for i in 0..15 {
        slow.stat(&uri(&format!("datasets/s/{i}"))).await.unwrap();
    }
    let slow_took = started.elapsed();
    // 15 HEADs at 5/s with a burst of 5: at least 2 s.
    assert!(slow_took >= Duration::from_millis(1800), "{slow_took:?}");
    assert!(fast_took < Duration::from_secs(1), "{fast_took:?}");
}
