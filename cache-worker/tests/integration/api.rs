use lakecache_protocol::{ClientError, ErrorCode};

use crate::harness::*;

async fn get_status(h: &Harness, path: &str, extra_headers: &str) -> (u16, String) {
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{extra_headers}Connection: close\r\n\r\n");
    raw_request(h.addr(), req.as_bytes()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unsatisfiable_ranges_get_416_and_malformed_ones_400() {
    let h = Harness::start().await;
    h.put_direct("r.bin", &data(1000, 80)).await;
    h.put_direct("empty.bin", b"").await;
    for range in ["bytes=1000-", "bytes=5000-6000", "bytes=-0"] {
        let (status, text) =
            get_status(&h, "/v1/objects/data/r.bin", &format!("Range: {range}\r\n")).await;
        assert_eq!(status, 416, "{range}: {text}");
        assert!(text.contains("content-range: bytes */1000"), "{text}");
        assert!(text.contains("\"range_not_satisfiable\""), "{text}");
    }
    let (status, _) = get_status(&h, "/v1/objects/data/empty.bin", "Range: bytes=0-\r\n").await;
    assert_eq!(status, 416);
    for range in ["bytes=5-1", "bytes=0-1,5-6", "lines=1-2", "bytes=x-"] {
        let (status, text) =
            get_status(&h, "/v1/objects/data/r.bin", &format!("Range: {range}\r\n")).await;
        assert_eq!(status, 400, "{range}: {text}");
        assert!(text.contains("\"invalid_range\""), "{text}");
    }
    let (status, text) =
        get_status(&h, "/v1/objects/data/r.bin", "Range: bytes=990-2000\r\n").await;
    assert_eq!(status, 206, "{text}");
    assert!(text.contains("content-range: bytes 990-999/1000"), "{text}");
    let (status, text) = get_status(&h, "/v1/objects/data/empty.bin", "").await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("content-length: 0"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_ahead_header_takes_1_and_nothing_else() {
    let h = Harness::start().await;
    h.put_direct("r.bin", &data(1000, 81)).await;
    let (status, text) = get_status(
        &h,
        "/v1/objects/data/r.bin",
        "x-lakecache-read-ahead: 1\r\n",
    )
    .await;
    assert_eq!(status, 200, "{text}");
    for value in ["yes", "0", "2"] {
        let (status, text) = get_status(
            &h,
            "/v1/objects/data/r.bin",
            &format!("x-lakecache-read-ahead: {value}\r\n"),
        )
        .await;
        assert_eq!(status, 400, "{value}: {text}");
        assert!(text.contains("\"bad_request\""), "{text}");
        assert!(text.contains("send 1 for a read-ahead"), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn traversal_and_invalid_paths_get_400() {
    let h = Harness::start().await;
    for path in [
        "/v1/objects/data/a/../b",
        "/v1/objects/data/%2e%2e/etc/passwd",
        "/v1/objects/data/a/%2E%2E/b",
        "/v1/objects/data/a%00b",
        "/v1/objects/data/a//b",
        "/v1/objects/data/./a",
        "/v1/objects/data/",
        "/v1/objects/Bad_Bucket/a",
        "/v1/objects/data/%ff%fe",
        "/v1/stat/data/../x",
        "/v1/list/..?prefix=a",
    ] {
        let (status, text) = get_status(&h, path, "").await;
        assert_eq!(status, 400, "{path}: {text}");
        assert!(text.contains("\"invalid_path\""), "{path}: {text}");
    }
    let (status, text) = get_status(&h, "/v1/list/data?prefix=a/../b", "").await;
    assert_eq!(status, 400, "{text}");
    let (status, _) = get_status(&h, "/v1/nothing", "").await;
    assert_eq!(status, 404);
    let (status, text) = raw_request(h.addr(), b"POST /v1/objects/data/a HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").await;
    assert_eq!(status, 405, "{text}");
    h.client.health().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_over_the_limits_get_4xx_and_the_worker_keeps_serving() {
    let h = Harness::with(|o| o.limits.max_body_bytes = MIB).await;
    h.put_direct("ok.bin", b"fine").await;

    let long = format!("/v1/objects/data/{}", "a".repeat(9000));
    let (status, text) = get_status(&h, &long, "").await;
    assert_eq!(status, 414, "{text}");

    let big_header = format!("X-Filler: {}\r\n", "b".repeat(70 * 1024));
    let (status, text) = get_status(&h, "/v1/objects/data/ok.bin", &big_header).await;
    assert_eq!(status, 431, "{}", &text[..text.len().min(200)]);

    let req = format!(
        "PUT /v1/objects/data/big.bin HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        2 * MIB
    );
    let (status, text) = raw_request(h.addr(), req.as_bytes()).await;
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("\"body_too_large\""), "{text}");

    // Chunked bodies are counted as they stream.
    let mut chunked = b"PUT /v1/objects/data/big2.bin HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
    let chunk = vec![b'z'; 256 * 1024];
    for _ in 0..6 {
        chunked.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        chunked.extend_from_slice(&chunk);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let (status, text) = raw_request(h.addr(), &chunked).await;
    assert_eq!(status, 413, "{}", &text[..text.len().min(300)]);
    // Nothing was stored for the rejected uploads.
    assert!(matches!(
        h.direct.head(&uri("big2.bin")).await,
        Err(lakecache_worker::store::StoreError::NotFound)
    ));

    h.client.health().await.unwrap();
    assert_eq!(
        &h.client.read(&uri("ok.bin"), None).await.unwrap()[..],
        b"fine"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn missing_objects_get_404_with_a_stable_code() {
    let h = Harness::start().await;
    match h.client.stat(&uri("nope")).await {
        Err(ClientError::Api {
            status: 404,
            code: ErrorCode::NotFound,
            ..
        }) => {}
        other => panic!("unexpected {other:?}"),
    }
    match h.client.read(&uri("nope"), None).await {
        Err(ClientError::Api {
            status: 404,
            code: ErrorCode::NotFound,
            ..
        }) => {}
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn listing_with_prefix_delimiter_and_pages() {
    let h = Harness::start().await;
    for key in ["ds/a/1", "ds/a/2", "ds/b/1", "ds/c", "ds/d", "other/x"] {
        h.put_direct(key, key.as_bytes()).await;
    }
    let page = h
        .client
        .list(BUCKET, "ds/", Some("/"), None, None)
        .await
        .unwrap();
    assert_eq!(page.common_prefixes, vec!["ds/a/", "ds/b/"]);
    let keys: Vec<_> = page.objects.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(keys, vec!["ds/c", "ds/d"]);
    assert!(page
        .objects
        .iter()
        .all(|o| !o.etag.is_empty() && o.size > 0));

    let mut seen = Vec::new();
    let mut token = None;
    loop {
        let page = h
            .client
            .list(BUCKET, "ds/", None, token.as_deref(), Some(2))
            .await
            .unwrap();
        seen.extend(page.objects.into_iter().map(|o| o.key));
        match page.next_token {
            Some(t) => token = Some(t),
            None => break,
        }
    }
    assert_eq!(seen, vec!["ds/a/1", "ds/a/2", "ds/b/1", "ds/c", "ds/d"]);
    let (status, _) = get_status(&h, "/v1/list/data?max-keys=0", "").await;
    assert_eq!(status, 400);
    let (status, _) = get_status(&h, "/v1/list/data?bogus=1", "").await;
    assert_eq!(status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_expose_the_documented_series() {
    let h = Harness::start().await;
    h.put_direct("m.bin", &data(5000, 90)).await;
    h.client.read(&uri("m.bin"), None).await.unwrap();
    h.client.read(&uri("m.bin"), None).await.unwrap();
    let text = h.client.metrics().await.unwrap();
    for name in [
        "lakecache_requests_total",
        "lakecache_request_duration_seconds_bucket",
        "lakecache_served_bytes_total",
        "lakecache_cache_hit_bytes_total",
        "lakecache_cache_miss_bytes_total",
        "lakecache_s3_requests_total",
        "lakecache_s3_transferred_bytes_total",
        "lakecache_s3_request_duration_seconds_bucket",
        "lakecache_cache_used_bytes",
        "lakecache_cache_capacity_bytes",
    ] {
        assert!(text.contains(name), "missing {name} in:\n{text}");
    }
}
