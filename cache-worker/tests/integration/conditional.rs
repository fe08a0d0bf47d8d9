//! Conditional writes (`If-Match`, `If-None-Match: *`) from the store
//! client through the embedded endpoint, and what they are for: a
//! write-back upload that S3 answers late never lands over a newer
//! version that reached S3 meanwhile.

use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::{written_stamp, UserMeta, WRITTEN_STAMP_META};
use lakecache_s3_endpoint::{Fault, S3Op};
use lakecache_worker::store::{StoreError, WriteIf};

use crate::harness::*;

#[tokio::test]
async fn the_endpoint_lands_a_write_only_while_its_condition_holds() {
    let h = Harness::start().await;
    let s3 = &h.direct;
    let key = uri("cond/obj");
    let none = UserMeta::default();
    let body = |n: u8| Bytes::from(vec![n; 1000]);

    // Nothing there: If-Match names no object, If-None-Match: * lands.
    let err = s3
        .put_if(&key, body(1), &none, &WriteIf::Matches("abc".into()))
        .await
        .unwrap_err();
    assert_eq!(err, StoreError::NotFound);
    let first = s3
        .put_if(&key, body(1), &none, &WriteIf::Absent)
        .await
        .unwrap();
    let err = s3
        .put_if(&key, body(2), &none, &WriteIf::Absent)
        .await
        .unwrap_err();
    assert_eq!(err, StoreError::PreconditionFailed);
    let err = s3
        .put_if(&key, body(2), &none, &WriteIf::Matches("0123".into()))
        .await
        .unwrap_err();
    assert_eq!(err, StoreError::PreconditionFailed);
    assert_eq!(h.s3_bytes("cond/obj").await.unwrap(), body(1).to_vec());
    let second = s3
        .put_if(&key, body(2), &none, &WriteIf::Matches(first.clone()))
        .await
        .unwrap();
    assert_eq!(h.s3_bytes("cond/obj").await.unwrap(), body(2).to_vec());

    // A multipart upload whose condition fails stays open: it completes
    // once the condition is right, and its object is what it sent.
    let big = data((6 * MIB) as usize, 3);
    let id = s3.create_multipart(&key, &none).await.unwrap();
    let p1 = s3
        .upload_part(
            &key,
            &id,
            1,
            Bytes::copy_from_slice(&big[..(5 * MIB) as usize]),
        )
        .await
        .unwrap();
    let p2 = s3
        .upload_part(
            &key,
            &id,
            2,
            Bytes::copy_from_slice(&big[(5 * MIB) as usize..]),
        )
        .await
        .unwrap();
    let parts = vec![(1, p1), (2, p2)];
    for stale in [WriteIf::Absent, WriteIf::Matches(first)] {
        let err = s3
            .complete_multipart_if(&key, &id, parts.clone(), &stale)
            .await
            .unwrap_err();
        assert_eq!(err, StoreError::PreconditionFailed, "{stale:?}");
    }
    assert_eq!(h.s3_bytes("cond/obj").await.unwrap(), body(2).to_vec());
    s3.complete_multipart_if(&key, &id, parts, &WriteIf::Matches(second))
        .await
        .unwrap();
    assert_eq!(h.s3_bytes("cond/obj").await.unwrap(), big);
}

/// S3 holds a version of `key` that a write acknowledged `ahead_ms` after
/// now put there, as another worker's upload would leave it.
async fn newer_version_lands(h: &Harness, key: &str, body: &[u8]) {
    let mut meta = UserMeta::default();
    meta.insert(
        WRITTEN_STAMP_META.to_string(),
        written_stamp(now_ms() + 1_000, "another-workers-journal"),
    );
    h.direct
        .put(&uri(key), Bytes::copy_from_slice(body), &meta)
        .await
        .unwrap();
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The upload's write (PutObject, or the completion of a multipart one)
/// reaches S3 and is held there; a newer version lands meanwhile; then
/// S3 serves the held write. It must not replace the newer version.
async fn a_late_upload_never_buries_a_newer_version(size: usize, op: S3Op) {
    let h = Harness::start().await;
    let key = format!("late/{size}");
    let hold = scaled(Duration::from_secs(6));
    h.faults().inject(
        op,
        Fault::Delay {
            ms: hold.as_millis() as u64,
        },
        1,
    );
    let before = h.faults().count(op);
    let older = data(size, 1);
    let chunks: Vec<Bytes> = older.chunks(300_000).map(Bytes::copy_from_slice).collect();
    h.client
        .put_back(
            &uri(&key),
            futures::stream::iter(chunks),
            &Default::default(),
        )
        .await
        .unwrap();
    // The worker has read S3's stamp (nothing there) and sent its write.
    eventually(
        Duration::from_secs(30),
        "the upload's write reaching S3",
        || async { h.faults().count(op) > before },
    )
    .await;
    let newer = data(size, 2);
    newer_version_lands(&h, &key, &newer).await;
    let start = std::time::Instant::now();
    loop {
        let status = h.client.writeback_status(None).await.unwrap();
        if status.pending_objects == 0 {
            break;
        }
        assert!(
            start.elapsed() < scaled(Duration::from_secs(60)),
            "backlog not drained: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        sha(&h.s3_bytes(&key).await.unwrap()),
        sha(&newer),
        "the older write-back version landed over the newer one"
    );
    // S3 refused the held write: the newer version was there first (else
    // this run showed nothing; the hold must outlast the direct PUT).
    let name = match op {
        S3Op::PutObject => "put_object",
        _ => "complete_multipart_upload",
    };
    let metrics = h.client.metrics().await.unwrap();
    let refused = metric_value(
        &metrics,
        &format!("lakecache_s3_requests_total{{op=\"{name}\",outcome=\"precondition_failed\""),
    );
    assert_eq!(refused, 1.0, "{metrics}");
}

#[tokio::test]
async fn a_late_put_never_buries_a_newer_version() {
    a_late_upload_never_buries_a_newer_version(300_000, S3Op::PutObject).await;
}

#[tokio::test]
async fn a_late_multipart_completion_never_buries_a_newer_version() {
    a_late_upload_never_buries_a_newer_version(
        (12 * MIB) as usize + 5,
        S3Op::CompleteMultipartUpload,
    )
    .await;
}

#[tokio::test]
async fn a_store_without_conditional_writes_still_gets_every_upload() {
    let h = Harness::start().await;
    for op in [S3Op::PutObject, S3Op::CompleteMultipartUpload] {
        h.faults()
            .inject(op, Fault::RefuseConditionalWrites, 100_000);
    }
    let objects = [
        ("old-store/small", data(300_000, 4)),
        ("old-store/big", data((11 * MIB) as usize, 5)),
    ];
    for (key, body) in &objects {
        let chunks: Vec<Bytes> = body.chunks(300_000).map(Bytes::copy_from_slice).collect();
        h.client
            .put_back(
                &uri(key),
                futures::stream::iter(chunks),
                &Default::default(),
            )
            .await
            .unwrap();
    }
    eventually(Duration::from_secs(60), "the backlog drained", || async {
        h.client
            .writeback_status(None)
            .await
            .unwrap()
            .pending_objects
            == 0
    })
    .await;
    for (key, body) in &objects {
        assert_eq!(sha(&h.s3_bytes(key).await.unwrap()), sha(body), "{key}");
    }
    // Refused once, then never asked again: the worker went on without
    // conditions (and this test saw a refusal, not a store that took them).
    let metrics = h.client.metrics().await.unwrap();
    let refused = metric_value(
        &metrics,
        "lakecache_s3_requests_total{op=\"put_object\",outcome=\"unsupported\"",
    );
    assert_eq!(refused, 1.0, "{metrics}");
}
