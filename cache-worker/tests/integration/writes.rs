use bytes::Bytes;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn multipart_write_lands_in_s3_and_reads_back_as_a_hit() {
    let h = Harness::start().await;
    let body = data((12 * MIB + 321) as usize, 100);
    let stat = h
        .client
        .put_bytes(&uri("ckpt/step-10.bin"), Bytes::from(body.clone()))
        .await
        .unwrap();
    assert_eq!(stat.size, body.len() as u64);
    assert!(
        stat.etag.ends_with("-3"),
        "5 MiB parts: expected a 3-part ETag, got {}",
        stat.etag
    );
    // S3 has the bytes.
    let meta = h.direct.head(&uri("ckpt/step-10.bin")).await.unwrap();
    assert_eq!(meta.etag, stat.etag);
    let in_s3 = h
        .direct
        .get_range(&uri("ckpt/step-10.bin"), 0..meta.size, &meta.etag)
        .await
        .unwrap();
    assert_eq!(sha(&in_s3), sha(&body));
    // The cache already holds it.
    h.faults().reset_counts();
    let back = h.client.read(&uri("ckpt/step-10.bin"), None).await.unwrap();
    assert_eq!(sha(&back), sha(&body));
    assert_eq!(h.gets(), 0, "written bytes must be cached");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn small_write_overwrite_and_delete() {
    let h = Harness::start().await;
    let u = uri("notes/a.txt");
    h.client
        .put_bytes(&u, Bytes::from_static(b"first"))
        .await
        .unwrap();
    assert_eq!(&h.client.read(&u, None).await.unwrap()[..], b"first");
    h.client
        .put_bytes(&u, Bytes::from_static(b"second version"))
        .await
        .unwrap();
    assert_eq!(
        &h.client.read(&u, None).await.unwrap()[..],
        b"second version"
    );
    let listed = h
        .client
        .list(BUCKET, "notes/", Some("/"), None, None)
        .await
        .unwrap();
    assert_eq!(listed.objects.len(), 1);
    assert_eq!(listed.objects[0].size, 14);
    h.client.delete(&u).await.unwrap();
    assert!(h.client.stat(&u).await.is_err());
    assert!(h
        .client
        .list(BUCKET, "notes/", Some("/"), None, None)
        .await
        .unwrap()
        .objects
        .is_empty());
    // Empty objects and directory markers are writable too.
    h.client
        .put_bytes(&uri("empty"), Bytes::new())
        .await
        .unwrap();
    assert_eq!(h.client.stat(&uri("empty")).await.unwrap().size, 0);
    h.client
        .put_bytes(&uri("dir/"), Bytes::new())
        .await
        .unwrap();
    assert_eq!(h.client.stat(&uri("dir/")).await.unwrap().size, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_upload_is_reported_and_nothing_is_stored() {
    use lakecache_s3_endpoint::{Fault, S3Op};
    let h = Harness::with(|o| o.cache.readahead_pages = 0).await;
    // Every part upload fails: the write must fail, not be acknowledged.
    h.faults()
        .inject(S3Op::UploadPart, Fault::InternalError, 1000);
    let body = Bytes::from(data((11 * MIB) as usize, 101));
    let err = h
        .client
        .put_bytes(&uri("lost.bin"), body)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("502"), "{err}");
    assert!(h.direct.head(&uri("lost.bin")).await.is_err());
    assert!(
        h.faults().count(S3Op::AbortMultipartUpload) >= 1,
        "the upload was aborted"
    );
}

/// Pending multipart uploads the endpoint holds.
fn pending_uploads(h: &Harness) -> usize {
    std::fs::read_dir(h.s3_root().join("uploads")).map_or(0, |d| d.count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_killed_mid_upload_leaves_no_multipart_and_no_staging() {
    use tokio::io::AsyncWriteExt;
    let h = Harness::start().await;
    let cache = h.worker.as_ref().unwrap().cache().clone();
    let mut conn = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    let head = format!(
        "PUT /v1/objects/{BUCKET}/cut.bin HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
        64 * MIB
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    let piece = data(MIB as usize, 7);
    for _ in 0..24 {
        conn.write_all(&piece).await.unwrap();
    }
    // Parts are in flight and pages staged when the client dies.
    let deadline =
        std::time::Instant::now() + crate::harness::scaled(std::time::Duration::from_secs(10));
    while pending_uploads(&h) == 0 || cache.staged_bytes() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the upload never started"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    drop(conn);
    let deadline =
        std::time::Instant::now() + crate::harness::scaled(std::time::Duration::from_secs(10));
    while pending_uploads(&h) > 0 || cache.staged_bytes() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "after the client died: {} pending uploads, {} staged bytes",
            pending_uploads(&h),
            cache.staged_bytes()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let tmp = std::fs::read_dir(h.options.cache_dir.join("tmp"))
        .unwrap()
        .count();
    assert_eq!(tmp, 0, "staged page files left behind");
    assert!(
        h.direct.head(&uri("cut.bin")).await.is_err(),
        "nothing was stored"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_shutting_down_aborts_its_uploads() {
    use tokio::io::AsyncWriteExt;
    let mut h = Harness::start().await;
    let mut conn = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    let head = format!(
        "PUT /v1/objects/{BUCKET}/half.bin HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
        64 * MIB
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    let piece = data(MIB as usize, 8);
    for _ in 0..12 {
        conn.write_all(&piece).await.unwrap();
    }
    let deadline =
        std::time::Instant::now() + crate::harness::scaled(std::time::Duration::from_secs(10));
    while pending_uploads(&h) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the upload never started"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let started = std::time::Instant::now();
    h.worker.take().unwrap().shutdown().await;
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(
        pending_uploads(&h),
        0,
        "the multipart upload was not aborted"
    );
    drop(conn);
}

/// A watched write (the mount's): the worker answers once the body is
/// in, keeps the answer alive while it stores the object, and checks the
/// body's CRC32C trailer, in both modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_watched_write_is_stored_and_answered_in_both_modes() {
    use lakecache_protocol::WriteMode;
    let h = Harness::start().await;
    for (mode, key) in [
        (WriteMode::Through, "watched/through.bin"),
        (WriteMode::Back, "watched/back.bin"),
    ] {
        let data = crate::harness::data(3 << 20, 5);
        let pieces: Vec<Result<Bytes, lakecache_protocol::BoxError>> = data
            .chunks(1 << 20)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let stat = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            h.client.put_checked(
                &uri(key),
                futures::stream::iter(pieces),
                mode,
                &[],
                &Default::default(),
                Some(std::time::Duration::from_secs(2)),
            ),
        )
        .await
        .expect("a watched write hung")
        .expect("a watched write failed");
        assert_eq!(stat.size, data.len() as u64, "{mode:?}");
        let back = h.client.read(&uri(key), None).await.unwrap();
        assert_eq!(&back[..], &data[..], "{mode:?}");
    }
}

/// A chunked PUT of `body` with the CRC32C trailer declared; `trailer`
/// is the value sent, or none.
fn chunked_put(key: &str, mode: &str, body: &[u8], trailer: Option<u32>) -> Vec<u8> {
    let mut req = format!(
        "PUT /v1/objects/data/{key} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Transfer-Encoding: chunked\r\nTrailer: x-lakecache-crc32c\r\n\
         x-lakecache-write-mode: {mode}\r\n\r\n{:x}\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    req.extend_from_slice(b"\r\n0\r\n");
    if let Some(crc) = trailer {
        req.extend_from_slice(format!("x-lakecache-crc32c: {crc}\r\n").as_bytes());
    }
    req.extend_from_slice(b"\r\n");
    req
}

/// The body's checksum is checked before anything is stored, in both
/// modes: a wrong trailer, or a declared one never sent, fails the write
/// and S3 never sees the object.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_whose_checksum_is_wrong_or_missing_is_refused_in_both_modes() {
    let h = Harness::start().await;
    let body = crate::harness::data(3 << 20, 9);
    let right = crc32c::crc32c(&body);
    for mode in ["through", "back"] {
        for (case, trailer) in [("wrong", Some(right ^ 1)), ("missing", None)] {
            let key = format!("crc/{mode}-{case}.bin");
            let (status, text) =
                raw_request(h.addr(), &chunked_put(&key, mode, &body, trailer)).await;
            assert_eq!(status, 400, "{mode} {case}: {text}");
            assert!(text.contains("checksum_mismatch"), "{mode} {case}: {text}");
            assert_eq!(
                h.direct.head(&uri(&key)).await.err(),
                Some(lakecache_worker::store::StoreError::NotFound),
                "{mode} {case}: the refused body reached S3"
            );
            let stat = h.client.stat(&uri(&key)).await;
            assert!(
                stat.is_err(),
                "{mode} {case}: the refused body is served: {stat:?}"
            );
        }
        // The same body with its right checksum is stored.
        let key = format!("crc/{mode}-right.bin");
        let (status, text) =
            raw_request(h.addr(), &chunked_put(&key, mode, &body, Some(right))).await;
        assert_eq!(status, 200, "{mode}: {text}");
        let back = h.client.read(&uri(&key), None).await.unwrap();
        assert_eq!(&back[..], &body[..], "{mode}");
    }
}
