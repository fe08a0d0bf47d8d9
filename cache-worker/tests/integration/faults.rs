use lakecache_s3_endpoint::{Fault, S3Op};

use crate::harness::metric_value;
use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slowdown_503_is_retried_and_bytes_are_correct() {
    let h = Harness::start().await;
    let body = data((MIB + 99) as usize, 70);
    h.put_direct("throttled.bin", &body).await;
    h.faults().reset_counts();
    h.faults().inject(S3Op::GetObject, Fault::SlowDown, 2);
    let got = h
        .client
        .read(&uri("throttled.bin"), Some(0..MIB))
        .await
        .unwrap();
    assert_eq!(&got[..], &body[..MIB as usize]);
    assert_eq!(h.gets(), 3, "two throttled attempts, then success");
    let metrics = h.client.metrics().await.unwrap();
    assert!(
        metric_value(&metrics, "lakecache_s3_retries_total") >= 2.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_truncated_body_is_resumed_with_the_remaining_range() {
    let h = Harness::start().await;
    let body = data((2 * MIB) as usize, 71);
    h.put_direct("cut.bin", &body).await;
    h.faults().reset_counts();
    h.faults()
        .inject(S3Op::GetObject, Fault::TruncateBody { after: 300_000 }, 2);
    let got = h.client.read(&uri("cut.bin"), None).await.unwrap();
    assert_eq!(sha(&got), sha(&body));
    // Two pages; the first two GETs are cut and each resumed.
    assert!(h.gets() >= 4, "expected resumed GETs, saw {}", h.gets());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn persistent_s3_failure_is_a_clear_error_and_the_worker_recovers() {
    let h = Harness::start().await;
    let body = data(1000, 72);
    h.put_direct("down.bin", &body).await;
    h.client.stat(&uri("down.bin")).await.unwrap();
    h.faults()
        .inject(S3Op::GetObject, Fault::InternalError, 100);
    let err = h.client.read(&uri("down.bin"), None).await.unwrap_err();
    match err {
        lakecache_protocol::ClientError::Api { status, code, .. } => {
            assert_eq!(status, 502);
            assert_eq!(code, lakecache_protocol::ErrorCode::UpstreamUnavailable);
        }
        other => panic!("unexpected error {other}"),
    }
    h.faults().clear();
    assert_eq!(h.client.read(&uri("down.bin"), None).await.unwrap(), body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn persistent_throttling_maps_to_503_with_retry_after() {
    let h = Harness::start().await;
    h.put_direct("busy.bin", b"abc").await;
    h.client.stat(&uri("busy.bin")).await.unwrap();
    h.faults().inject(S3Op::GetObject, Fault::SlowDown, 100);
    let (status, text) = raw_request(
        h.addr(),
        b"GET /v1/objects/data/busy.bin HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 503, "{text}");
    assert!(
        text.to_ascii_lowercase().contains("retry-after: 1"),
        "{text}"
    );
    assert!(text.contains("upstream_throttled"), "{text}");
}

/// An upload part whose bytes stop moving (the store stops reading them)
/// is given up on and sent again on a new connection, well before the
/// attempt timeout; the object lands whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_upload_part_is_sent_again_on_a_new_connection() {
    let h = Harness::start().await;
    let body = data((24 * MIB) as usize, 72);
    h.faults().reset_counts();
    // The store sits on the first part's request for ten minutes without
    // reading its body: the sender's socket fills and nothing moves.
    h.faults()
        .inject(S3Op::UploadPart, Fault::Delay { ms: 600_000 }, 1);
    let started = std::time::Instant::now();
    let stat = h
        .client
        .put_bytes(&uri("stalled-part.bin"), bytes::Bytes::from(body.clone()))
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(stat.size, body.len() as u64);
    assert!(
        took < std::time::Duration::from_secs(45),
        "a stalled part held the upload for {took:?}"
    );
    let parts = h.faults().count(S3Op::UploadPart);
    assert!(
        parts > 3,
        "the stalled part was not sent again ({parts} part requests)"
    );
    let etag = h.direct.head(&uri("stalled-part.bin")).await.unwrap().etag;
    let in_s3 = h
        .direct
        .get_range(&uri("stalled-part.bin"), 0..body.len() as u64, &etag)
        .await
        .unwrap();
    assert!(in_s3[..] == body[..], "the object in S3 differs");
}
