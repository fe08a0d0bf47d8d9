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
