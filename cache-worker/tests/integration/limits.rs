//! Limits against abuse: a tenant's requests in flight are capped (other
//! tenants unaffected), an upload whose client goes silent is aborted,
//! and a client that never finishes its request head is cut off.

use std::time::{Duration, Instant};

use bytes::Bytes;
use lakecache_protocol::token::{Claims, KeyRing, SigningKey};
use lakecache_protocol::{ClientError, ErrorCode};
use lakecache_worker::AccessPolicy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::{uri, Harness};

fn token(key: &SigningKey, tenant: &str) -> String {
    key.mint(&Claims {
        tenant: tenant.into(),
        kid: String::new(),
        exp: 4_000_000_000,
        read: vec!["s3://data/".into()],
        write: vec!["s3://data/".into()],
        peer: false,
        operator: false,
        members_key: None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_over_its_request_cap_gets_429_and_others_go_on() {
    let key = SigningKey::generate("k1");
    let keys = KeyRing::new(key.clone(), None);
    let h = Harness::with(|o| {
        o.access = AccessPolicy {
            keys: Some(keys),
            ..Default::default()
        };
        o.limits.max_requests_per_tenant = 2;
        o.limits.tenant_wait = Duration::from_millis(300);
    })
    .await;
    let a = h
        .client
        .clone()
        .with_token(Some(&token(&key, "team-a")))
        .unwrap();
    let b = h
        .client
        .clone()
        .with_token(Some(&token(&key, "team-b")))
        .unwrap();
    a.put_bytes(&uri("big.bin"), Bytes::from(vec![3u8; 8 << 20]))
        .await
        .unwrap();

    // Two streaming reads whose bodies nobody reads hold both of team-a's
    // slots (each on its own connection).
    let fresh = |t: &str| {
        lakecache_protocol::WorkerClient::new(&h.addr().to_string(), Duration::from_secs(10))
            .unwrap()
            .with_token(Some(&token(&key, t)))
            .unwrap()
    };
    let held = [
        fresh("team-a")
            .read_stream(&uri("big.bin"), None)
            .await
            .unwrap(),
        fresh("team-a")
            .read_stream(&uri("big.bin"), None)
            .await
            .unwrap(),
    ];
    let started = Instant::now();
    let third = fresh("team-a").stat(&uri("big.bin")).await;
    match third {
        Err(ClientError::Api {
            status: 429,
            code,
            message,
        }) => {
            assert_eq!(code, ErrorCode::TooManyRequests);
            assert!(message.contains("team-a"), "{message}");
        }
        other => panic!("expected 429, got {other:?}"),
    }
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "it waited first"
    );
    // Another tenant is not affected.
    b.stat(&uri("big.bin")).await.unwrap();
    // Slots come back when the streams end.
    drop(held);
    let deadline = Instant::now() + crate::harness::scaled(Duration::from_secs(5));
    while a.stat(&uri("big.bin")).await.is_err() {
        assert!(Instant::now() < deadline, "slots never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upload_whose_client_goes_silent_is_aborted_and_stores_nothing() {
    let h = Harness::with(|o| o.limits.body_idle_timeout = Duration::from_millis(500)).await;
    let mut conn = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    conn.write_all(
        b"PUT /v1/objects/data/silent.bin HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n0123456789",
    )
    .await
    .unwrap();
    let started = Instant::now();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.contains("BodyTimeout") || text.contains("body_timeout"),
        "{text}"
    );
    let took = started.elapsed();
    eprintln!("a silent body was answered 408 after {took:?}");
    // The body timeout, not the test's 10 s (measured: 502 ms).
    assert!(
        took < crate::harness::scaled(Duration::from_secs(5)),
        "{took:?}"
    );
    assert!(
        h.direct.head(&uri("silent.bin")).await.is_err(),
        "nothing reached S3"
    );
    // The worker serves on.
    h.client.health().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_never_finishes_its_request_head_is_cut_off() {
    let h = Harness::with(|o| o.limits.header_read_timeout = Duration::from_millis(500)).await;
    let mut conn = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    conn.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\nx-slow: ")
        .await
        .unwrap();
    let started = Instant::now();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the connection was never closed");
    let took = started.elapsed();
    eprintln!("an unfinished request head was cut off after {took:?}");
    // The 500 ms header timeout, not the test's 10 s (measured: 502 ms).
    assert!(
        took < crate::harness::scaled(Duration::from_secs(5)),
        "{took:?}"
    );
    h.client.health().await.unwrap();
}
