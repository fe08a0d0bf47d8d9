//! The embedded S3 endpoint behaves like S3 where clients notice.

use bytes::Bytes;
use lakecache_worker::store::StoreError;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn directory_markers_and_prefix_only_directories() {
    let h = Harness::start().await;
    // A marker object beside a real key under it, and a key named like
    // the marker's parent: all three can coexist in S3.
    h.put_direct("dir/", b"").await;
    h.put_direct("dir/file", b"x").await;
    h.put_direct("dir", b"plain").await;
    h.put_direct("only/prefix/obj", b"y").await;

    let page = h
        .direct
        .list(BUCKET, "", Some("/"), None, 1000)
        .await
        .unwrap();
    assert_eq!(page.common_prefixes, vec!["dir/", "only/"]);
    assert_eq!(
        page.objects
            .iter()
            .map(|o| o.key.as_str())
            .collect::<Vec<_>>(),
        vec!["dir"]
    );
    let inside = h
        .direct
        .list(BUCKET, "dir/", Some("/"), None, 1000)
        .await
        .unwrap();
    let keys: Vec<_> = inside.objects.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(keys, vec!["dir/", "dir/file"]);
    assert!(
        inside.objects.iter().all(|o| !o.etag.is_empty()),
        "listings carry ETags"
    );

    // HEAD on a prefix-only "directory" is a plain 404, not a server error.
    assert_eq!(
        h.direct.head(&uri("only/prefix/")).await,
        Err(StoreError::NotFound)
    );
    assert_eq!(h.direct.head(&uri("only")).await, Err(StoreError::NotFound));
    assert_eq!(h.direct.head(&uri("dir/")).await.unwrap().size, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etags_follow_s3_rules_and_if_match_is_enforced() {
    let h = Harness::start().await;
    let etag = h.put_direct("e.bin", b"hello").await;
    assert_eq!(
        etag, "5d41402abc4b2a76b9719d911017c592",
        "single PUT ETag is the MD5"
    );
    assert_eq!(
        h.direct
            .get_range(&uri("e.bin"), 0..5, "not-the-etag")
            .await,
        Err(StoreError::PreconditionFailed)
    );
    // Parts under 5 MiB (except the last) are rejected like S3 does.
    let u = uri("mp.bin");
    let id = h
        .direct
        .create_multipart(&u, &Default::default())
        .await
        .unwrap();
    let p1 = h
        .direct
        .upload_part(&u, &id, 1, Bytes::from(vec![1u8; 1000]))
        .await
        .unwrap();
    let p2 = h
        .direct
        .upload_part(&u, &id, 2, Bytes::from(vec![2u8; 1000]))
        .await
        .unwrap();
    let err = h
        .direct
        .complete_multipart(&u, &id, vec![(1, p1), (2, p2)])
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::Other(ref m) if m.contains("EntityTooSmall")),
        "{err:?}"
    );
    h.direct.abort_multipart(&u, &id).await.unwrap();
    assert_eq!(h.direct.head(&u).await, Err(StoreError::NotFound));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn listing_pages_through_many_keys_and_common_prefixes() {
    let h = Harness::start().await;
    let mut expected = Vec::new();
    for i in 0..25 {
        let key = format!("many/{i:03}");
        h.put_direct(&key, b"z").await;
        expected.push(key);
    }
    for d in 0..5 {
        h.put_direct(&format!("many/sub{d}/a"), b"z").await;
        h.put_direct(&format!("many/sub{d}/b"), b"z").await;
    }
    let mut keys = Vec::new();
    let mut prefixes = Vec::new();
    let mut token = None;
    loop {
        let page = h
            .direct
            .list(BUCKET, "many/", Some("/"), token.as_deref(), 7)
            .await
            .unwrap();
        assert!(page.objects.len() + page.common_prefixes.len() <= 7);
        keys.extend(page.objects.into_iter().map(|o| o.key));
        prefixes.extend(page.common_prefixes);
        match page.next_token {
            Some(t) => token = Some(t),
            None => break,
        }
    }
    assert_eq!(keys, expected);
    assert_eq!(
        prefixes,
        (0..5).map(|d| format!("many/sub{d}/")).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uploads_carry_crc32c_and_a_body_damaged_on_the_way_is_refused() {
    use lakecache_s3_endpoint::{Fault, S3Op};
    let h = Harness::start().await;
    let faults = h.s3.faults();
    // Every part and single PUT the worker's store sends is checked.
    let before = faults.checksums_verified();
    h.put_direct("small.bin", b"hello").await;
    let u = uri("big.bin");
    let body: Vec<u8> = (0..(11u32 << 20)).map(|i| (i % 251) as u8).collect();
    let id = h
        .direct
        .create_multipart(&u, &Default::default())
        .await
        .unwrap();
    let p1 = h
        .direct
        .upload_part(&u, &id, 1, Bytes::copy_from_slice(&body[..6 << 20]))
        .await
        .unwrap();
    assert!(p1.crc32c.is_some());
    let p2 = h
        .direct
        .upload_part(&u, &id, 2, Bytes::copy_from_slice(&body[6 << 20..]))
        .await
        .unwrap();
    h.direct
        .complete_multipart(&u, &id, vec![(1, p1), (2, p2)])
        .await
        .unwrap();
    assert_eq!(faults.checksums_verified() - before, 3);
    let etag = h.direct.head(&u).await.unwrap().etag;
    let got = h
        .direct
        .get_range(&u, 0..body.len() as u64, &etag)
        .await
        .unwrap();
    assert!(got[..] == body[..]);
    // A store told not to send checksums (for S3-compatible stores that
    // refuse the header) sends none.
    let plain = lakecache_worker::s3_store(
        &lakecache_worker::S3Config {
            checksums: false,
            ..h.s3_config.clone()
        },
        std::sync::Arc::new(lakecache_worker::Metrics::new().unwrap()),
    )
    .await;
    let verified = faults.checksums_verified();
    plain
        .put(
            &uri("plain.bin"),
            Bytes::from_static(b"x"),
            &Default::default(),
        )
        .await
        .unwrap();
    assert_eq!(faults.checksums_verified(), verified);

    // A flipped bit on the way in: the store refuses the body and keeps
    // nothing under the name. Over plain HTTP the SDK signs the payload's
    // SHA-256, so the signature check is what refuses it here; the CRC32C
    // path alone is shown by `the_crc32c_alone_refuses_a_damaged_unsigned_body`.
    let refused = |err: &StoreError| {
        let text = format!("{err:?}");
        text.contains("IncompleteBody") && text.contains("UploadStreamError: Sha256Mismatch")
    };
    faults.inject(S3Op::PutObject, Fault::CorruptRequestBody, 1);
    let err = h
        .direct
        .put(
            &uri("damaged.bin"),
            Bytes::from_static(b"precious bytes"),
            &Default::default(),
        )
        .await
        .unwrap_err();
    assert!(refused(&err), "{err:?}");
    assert_eq!(
        h.direct.head(&uri("damaged.bin")).await,
        Err(StoreError::NotFound)
    );
    faults.inject(S3Op::UploadPart, Fault::CorruptRequestBody, 1);
    let u = uri("damaged-mp.bin");
    let id = h
        .direct
        .create_multipart(&u, &Default::default())
        .await
        .unwrap();
    let err = h
        .direct
        .upload_part(&u, &id, 1, Bytes::from(vec![7u8; 1000]))
        .await
        .unwrap_err();
    assert!(refused(&err), "{err:?}");
}

/// With payload signing off (as over HTTPS), only the CRC32C the client
/// sends can catch a body damaged on the way: the store answers
/// `BadDigest` and keeps nothing under the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_crc32c_alone_refuses_a_damaged_unsigned_body() {
    use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
    use lakecache_s3_endpoint::{Fault, S3Op};
    let h = Harness::start().await;
    let (access, secret) = h.s3_config.static_credentials.clone().unwrap();
    let config = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .endpoint_url(h.s3.url())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new(access, secret, None, None, "test"))
        .force_path_style(true)
        .build();
    let sdk = aws_sdk_s3::Client::from_conf(config);
    let body = Bytes::from_static(b"precious bytes");
    let put = |key: &'static str| {
        sdk.put_object()
            .bucket(BUCKET)
            .key(key)
            .checksum_crc32_c(lakecache_worker::store::crc32c_header(&body))
            .body(body.clone().into())
            .customize()
            .disable_payload_signing()
            .send()
    };
    // Undamaged, the unsigned body with its CRC32C is accepted: the
    // refusal below is the checksum's doing, not the unsigned payload's.
    put("unsigned-ok.bin").await.unwrap();
    let faults = h.s3.faults();
    faults.inject(S3Op::PutObject, Fault::CorruptRequestBody, 1);
    let err = put("unsigned-damaged.bin").await.unwrap_err();
    let code = err.as_service_error().and_then(|e| e.meta().code());
    assert_eq!(code, Some("BadDigest"), "{err:?}");
    assert_eq!(
        h.direct.head(&uri("unsigned-damaged.bin")).await,
        Err(StoreError::NotFound)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn user_metadata_is_stored_returned_and_replaced_by_a_copy() {
    let h = Harness::start().await;
    let meta: lakecache_protocol::UserMeta = [
        ("mode".to_string(), "33188".to_string()),
        ("mtime".to_string(), "1700000000.5".to_string()),
    ]
    .into();
    let u = uri("meta/single");
    h.direct
        .put(&u, Bytes::from_static(b"body"), &meta)
        .await
        .unwrap();
    assert_eq!(h.direct.head(&u).await.unwrap().user, meta);

    // A multipart upload carries what it was started with.
    let mp = uri("meta/multi");
    let id = h.direct.create_multipart(&mp, &meta).await.unwrap();
    let part = h
        .direct
        .upload_part(&mp, &id, 1, Bytes::from_static(b"part"))
        .await
        .unwrap();
    h.direct
        .complete_multipart(&mp, &id, vec![(1, part)])
        .await
        .unwrap();
    assert_eq!(h.direct.head(&mp).await.unwrap().user, meta);

    // A copy keeps the source's metadata, or replaces it (in place too),
    // and the bytes and ETag of a single-part object stay.
    let kept = uri("meta/kept");
    let etag = h.direct.head(&u).await.unwrap().etag;
    h.direct.copy(&u, &etag, &kept, None).await.unwrap();
    assert_eq!(h.direct.head(&kept).await.unwrap().user, meta);
    let new: lakecache_protocol::UserMeta = [("mode".to_string(), "33261".to_string())].into();
    let replaced = h.direct.copy(&u, &etag, &u, Some(&new)).await.unwrap();
    assert_eq!(replaced.user, new);
    assert_eq!(replaced.etag, etag);
    let got = h.direct.get_range(&u, 0..4, &etag).await.unwrap();
    assert_eq!(&got[..], b"body");

    // Through the worker: headers in, stat out, replaced by a copy.
    let through = uri("meta/through");
    let body = http_body_util::BodyExt::boxed(http_body_util::BodyExt::map_err(
        http_body_util::Full::new(Bytes::from_static(b"via worker")),
        |e| match e {},
    ));
    let stat = h.client.put(&through, body, &meta).await.unwrap();
    assert_eq!(stat.meta, meta);
    assert_eq!(h.client.stat(&through).await.unwrap().meta, meta);
    assert_eq!(h.direct.head(&through).await.unwrap().user, meta);
    let stat = h
        .client
        .copy(&through, Some(&stat.etag), &through, Some(&new))
        .await
        .unwrap();
    assert_eq!(stat.meta, new);
    assert_eq!(h.client.stat(&through).await.unwrap().meta, new);
    assert_eq!(h.direct.head(&through).await.unwrap().user, new);
}

/// Only a write-back upload stamps its write in S3: a stamp a client
/// sends (copied from a stat, or forged to hold later writes back) is
/// not stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_cannot_set_the_write_stamp() {
    let h = Harness::start().await;
    let sent: lakecache_protocol::UserMeta = [
        ("mode".to_string(), "33188".to_string()),
        (
            lakecache_protocol::WRITTEN_STAMP_META.to_string(),
            lakecache_protocol::written_stamp(i64::MAX / 2, "forged"),
        ),
    ]
    .into();
    let through = uri("meta/stamped");
    let body = http_body_util::BodyExt::boxed(http_body_util::BodyExt::map_err(
        http_body_util::Full::new(Bytes::from_static(b"stamp")),
        |e| match e {},
    ));
    h.client.put(&through, body, &sent).await.unwrap();
    let stored = h.direct.head(&through).await.unwrap().user;
    let want: lakecache_protocol::UserMeta = [("mode".to_string(), "33188".to_string())].into();
    assert_eq!(stored, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn objects_above_the_copy_limit_are_copied_in_parts_with_their_metadata() {
    // The limit stands in for S3's 5 GiB: 12 MiB copies as 5 + 5 + 2 MiB.
    let h = Harness::with(|o| o.cache.copy_part_limit = 5 * MIB).await;
    let body = data(12 * MIB as usize, 7);
    let meta: lakecache_protocol::UserMeta = [("mode".to_string(), "33188".to_string())].into();
    let u = uri("big/model.bin");
    h.direct
        .put(&u, Bytes::from(body.clone()), &meta)
        .await
        .unwrap();
    let stat = h.client.stat(&u).await.unwrap();

    // chmod of a large object: a copy onto itself with new metadata.
    let new: lakecache_protocol::UserMeta = [("mode".to_string(), "33261".to_string())].into();
    let copied = h
        .client
        .copy(&u, Some(&stat.etag), &u, Some(&new))
        .await
        .unwrap();
    assert_eq!(copied.meta, new);
    assert!(copied.etag.ends_with("-3"), "three parts: {}", copied.etag);
    let head = h.direct.head(&u).await.unwrap();
    assert_eq!((head.user, head.size), (new.clone(), body.len() as u64));
    let got = h
        .direct
        .get_range(&u, 0..body.len() as u64, &head.etag)
        .await
        .unwrap();
    assert_eq!(sha(&got), sha(&body));

    // A copy to another name keeps the source's metadata.
    let other = uri("big/copy.bin");
    let kept = h.client.copy(&u, None, &other, None).await.unwrap();
    assert_eq!(kept.meta, new);
    assert_eq!(h.direct.head(&other).await.unwrap().user, new);

    // A stale ETag is refused and leaves no upload behind.
    let err = h
        .client
        .copy(&u, Some(&stat.etag), &other, None)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            lakecache_protocol::ClientError::Api {
                code: lakecache_protocol::ErrorCode::PreconditionFailed,
                ..
            }
        ),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_endpoint_refuses_copy_ranges_outside_the_source() {
    let h = Harness::start().await;
    let u = uri("range/src");
    let etag = h
        .direct
        .put(&u, Bytes::from(data(1000, 1)), &Default::default())
        .await
        .unwrap();
    let dst = uri("range/dst");
    let id = h
        .direct
        .create_multipart(&dst, &Default::default())
        .await
        .unwrap();
    let source = lakecache_worker::store::CopyRange {
        from: &u,
        etag: &etag,
        range: 500..1001,
    };
    let err = h
        .direct
        .upload_part_copy(&dst, &id, 1, &source)
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::Other(_) | StoreError::InvalidResponse(_)),
        "{err:?}"
    );
    let wrong = lakecache_worker::store::CopyRange {
        from: &u,
        etag: "0123",
        range: 0..10,
    };
    let err = h
        .direct
        .upload_part_copy(&dst, &id, 1, &wrong)
        .await
        .unwrap_err();
    assert_eq!(err, StoreError::PreconditionFailed);
}
