//! Short-circuit reads: a client on the worker's host reads cached pages
//! from the page files through the worker's Unix socket, and pages not on
//! disk yet as bytes sent inline on it. The bytes are the object's
//! (checked per block), HTTP carries none of them, damage and version
//! changes fall back to HTTP's handling, and tokens are checked as over
//! HTTP.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lakecache_protocol::local_read::LocalChannel;
use lakecache_protocol::token::{Claims, KeyRing, SigningKey};
use lakecache_protocol::{ClientError, ErrorCode};
use lakecache_worker::AccessPolicy;

use crate::harness::*;

fn socket_of(h: &Harness) -> PathBuf {
    h.options
        .local_socket
        .clone()
        .expect("the harness set a socket")
}

async fn with_socket(tune: impl FnOnce(&mut lakecache_worker::WorkerOptions)) -> Harness {
    Harness::with(|o| {
        o.local_socket = Some(o.cache_dir.with_file_name("worker.sock"));
        tune(o);
    })
    .await
}

/// Tokens signed by `key` required on every request.
fn tokens_of(key: &SigningKey) -> AccessPolicy {
    AccessPolicy {
        keys: Some(KeyRing::new(key.clone(), None)),
        allow: Vec::new(),
        protect_metrics: false,
    }
}

/// A tenant's token reading `scope`, and writing it when `write`.
fn token(key: &SigningKey, tenant: &str, scope: &str, write: bool) -> String {
    key.mint(&Claims {
        tenant: tenant.into(),
        kid: String::new(),
        exp: 4_000_000_000,
        read: vec![scope.into()],
        write: if write {
            vec![scope.into()]
        } else {
            Vec::new()
        },
        peer: false,
        operator: false,
        members_key: None,
    })
}

/// HTTP reads the worker answered so far (the series must exist).
fn http_reads(metrics: &str) -> f64 {
    let lines: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("lakecache_requests_total{") && l.contains("op=\"read\""))
        .collect();
    assert!(!lines.is_empty(), "no read requests counted in:\n{metrics}");
    lines
        .iter()
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reader_on_this_host_gets_cold_bytes_inline_then_page_files_and_http_carries_none() {
    let h = with_socket(|_| {}).await;
    let body = data((3 * MIB + 12_345) as usize, 71);
    let etag = h.put_direct("local/shard.bin", &body).await;
    // One read over HTTP, so that the count of HTTP reads exists.
    h.put_direct("local/other.bin", b"over http").await;
    h.client.read(&uri("local/other.bin"), None).await.unwrap();
    let metrics = h.client.metrics().await.unwrap();
    let http_before = http_reads(&metrics);
    let served_before = metric_value(&metrics, "lakecache_served_bytes_total");

    let channel = Arc::new(LocalChannel::new(&socket_of(&h), None));
    let local = h.client.clone().with_local(Some(channel.clone()));
    // Not cached yet: the worker fetches each page and sends its bytes
    // inline on the socket (from memory, not read back from the new
    // page files).
    let (cold, _) = local
        .read_checked(
            &uri("local/shard.bin"),
            Some(0..body.len() as u64),
            Some(&etag),
        )
        .await
        .unwrap();
    assert_eq!(sha(&cold), sha(&body));
    let metrics = h.client.metrics().await.unwrap();
    assert_eq!(
        metric_value(&metrics, "lakecache_local_inline_served_bytes_total"),
        body.len() as f64
    );
    let served_cold = metric_value(&metrics, "lakecache_served_bytes_total");
    assert_eq!(served_cold - served_before, body.len() as f64);
    assert_eq!(h.gets(), 4 + 1, "one GET per page (and the HTTP read)");
    // Fetched pages are written behind their readers; the reads below
    // are of page files.
    h.settled_page_files().await;

    let channel = Arc::new(LocalChannel::new(&socket_of(&h), None));
    assert!(channel.serves(&h.addr().to_string()));
    assert!(
        !channel.serves("127.0.0.1:1"),
        "another port is another worker"
    );
    let local = h.client.clone().with_local(Some(channel));
    // Across three pages, starting and ending inside blocks.
    let range = 1_000..(2 * MIB + 777_777);
    let (got, served_as) = local
        .read_checked(&uri("local/shard.bin"), Some(range.clone()), Some(&etag))
        .await
        .unwrap();
    assert_eq!(
        sha(&got),
        sha(&body[range.start as usize..range.end as usize])
    );
    assert_eq!(served_as.as_deref(), Some(etag.as_str()));
    // The last page, short, and read a second time from its file.
    for _ in 0..2 {
        let tail = 3 * MIB..body.len() as u64;
        let (got, _) = local
            .read_checked(&uri("local/shard.bin"), Some(tail.clone()), Some(&etag))
            .await
            .unwrap();
        assert_eq!(&got[..], &body[tail.start as usize..]);
    }
    let metrics = h.client.metrics().await.unwrap();
    let local_bytes = (range.end - range.start) + 2 * 12_345;
    assert_eq!(
        metric_value(&metrics, "lakecache_local_served_bytes_total"),
        local_bytes as f64
    );
    assert_eq!(
        metric_value(&metrics, "lakecache_served_bytes_total"),
        served_cold,
        "the worker sent no bytes of cached pages itself"
    );
    assert_eq!(http_reads(&metrics), http_before, "no read went over HTTP");
    assert_eq!(h.gets(), 4 + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_caller_that_takes_no_inline_bytes_is_sent_to_http_for_a_cold_page() {
    use lakecache_protocol::local_read::{recv_message, send_message, LocalAnswer};
    use std::os::fd::AsRawFd;
    let h = with_socket(|_| {}).await;
    let body = data(MIB as usize + 10, 73);
    let etag = h.put_direct("local/old-mount.bin", &body).await;
    // What a mount from before inline answers sends: no `inline` field.
    let request = format!(
        r#"{{"op":"page","uri":"{}","etag":"{etag}","offset":0,"len":100}}"#,
        uri("local/old-mount.bin")
    );
    let sock = std::os::unix::net::UnixStream::connect(socket_of(&h)).unwrap();
    let ask = |sock: &std::os::unix::net::UnixStream| {
        send_message(sock.as_raw_fd(), request.as_bytes(), None).unwrap();
        let (reply, fd) = recv_message(sock.as_raw_fd()).unwrap();
        (serde_json::from_slice::<LocalAnswer>(&reply).unwrap(), fd)
    };
    let (answer, fd) = tokio::task::block_in_place(|| ask(&sock));
    assert!(
        matches!(answer, LocalAnswer::Unavailable { .. }),
        "{answer:?}"
    );
    assert!(fd.is_none());
    assert_eq!(h.gets(), 0, "declining fetched nothing");
    // Once cached, the same request gets the page file. The read may
    // return while the page is still on its way to its file (served from
    // memory, which an old mount cannot take): asked until granted.
    h.client
        .read(&uri("local/old-mount.bin"), None)
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (answer, fd) = tokio::task::block_in_place(|| ask(&sock));
        if matches!(answer, LocalAnswer::Granted(_)) {
            assert!(fd.is_some());
            break;
        }
        assert!(
            matches!(answer, LocalAnswer::Unavailable { .. }),
            "{answer:?}"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "never granted: {answer:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A mount's read on its kernel-request thread: answered only from what
/// the worker holds, declined at once (and without a fetch) otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cached_only_read_is_declined_without_a_fetch_until_every_byte_is_held() {
    use lakecache_protocol::local_read::LocalError;
    let h = with_socket(|_| {}).await;
    let body = data((2 * MIB + 4_321) as usize, 74);
    let etag = h.put_direct("local/cached-only.bin", &body).await;
    let u = uri("local/cached-only.bin");
    let channel = LocalChannel::new(&socket_of(&h), None);
    let member = h.addr().to_string();
    // Across pages 1 and 2 (of 1 MiB).
    let range = MIB + 100..2 * MIB + 200;
    let ask =
        || tokio::task::block_in_place(|| channel.read_cached(&member, &u, &etag, range.clone()));
    let declined = ask();
    assert!(
        matches!(declined, Err(LocalError::Unavailable(_))),
        "{declined:?}"
    );
    assert_eq!(h.gets(), 0, "declining fetched nothing");
    assert!(channel.worth_asking(&member), "a decline is not a failure");
    // The last page held (read over HTTP), page 1 not: still declined.
    h.client
        .read(&u, Some(2 * MIB..body.len() as u64))
        .await
        .unwrap();
    assert_eq!(h.gets(), 1);
    let declined = ask();
    assert!(
        matches!(declined, Err(LocalError::Unavailable(_))),
        "{declined:?}"
    );
    assert_eq!(h.gets(), 1, "declining fetched nothing");
    // Both held: the bytes, from memory or the page files.
    h.client.read(&u, Some(MIB..2 * MIB)).await.unwrap();
    let got = ask().unwrap();
    assert_eq!(&got[..], &body[range.start as usize..range.end as usize]);
    assert_eq!(h.gets(), 2, "served without a fetch");
    // Once on disk too.
    h.settled_page_files().await;
    assert_eq!(
        &ask().unwrap()[..],
        &body[range.start as usize..range.end as usize]
    );
    assert_eq!(h.gets(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_damaged_page_file_or_another_version_falls_back_to_http() {
    let h = with_socket(|_| {}).await;
    let body = data(MIB as usize, 72);
    let etag = h.put_direct("local/damaged.bin", &body).await;
    let local = h
        .client
        .clone()
        .with_local(Some(Arc::new(LocalChannel::new(&socket_of(&h), None))));
    let (got, _) = local
        .read_checked(&uri("local/damaged.bin"), Some(0..MIB), Some(&etag))
        .await
        .unwrap();
    assert_eq!(sha(&got), sha(&body));
    // One byte flipped in the page file: the reader's block check fails,
    // the read goes over HTTP, which drops the page and fetches it again.
    let files = h.settled_page_files().await;
    assert_eq!(files.len(), 1);
    let mut raw = std::fs::read(&files[0]).unwrap();
    raw[4096 + 300_000] ^= 0x10;
    std::fs::write(&files[0], raw).unwrap();
    let (got, _) = local
        .read_checked(&uri("local/damaged.bin"), Some(0..MIB), Some(&etag))
        .await
        .unwrap();
    assert_eq!(sha(&got), sha(&body), "never the damaged bytes");
    let metrics = h.client.metrics().await.unwrap();
    assert_eq!(metric_value(&metrics, "lakecache_corrupt_pages_total"), 1.0);
    assert_eq!(h.gets(), 2);

    // A version the worker does not have: HTTP's answer, 412.
    let stale = local
        .read_checked(&uri("local/damaged.bin"), Some(0..10), Some("not-the-etag"))
        .await
        .unwrap_err();
    assert!(
        matches!(stale, ClientError::Api { status: 412, .. }),
        "{stale:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_socket_checks_tokens_and_scopes_as_http_does() {
    let key = SigningKey::generate("k1");
    let h = with_socket(|o| o.access = tokens_of(&key)).await;
    let body = data(100_000, 73);
    let etag = h.put_direct("team-a/shard.bin", &body).await;
    let mint = |tenant: &str, read: &str| token(&key, tenant, read, false);
    let read_with = |token: Option<String>| {
        let channel = Arc::new(LocalChannel::new(&socket_of(&h), token));
        // The HTTP client carries no token: only the socket may answer.
        h.client.clone().with_local(Some(channel))
    };
    let target = uri("team-a/shard.bin");
    for (token, want) in [
        (None, ErrorCode::Unauthenticated),
        (Some("garbage".to_string()), ErrorCode::Unauthenticated),
        (
            Some(mint("team-b", "s3://data/team-b/")),
            ErrorCode::OutOfScope,
        ),
    ] {
        let e = read_with(token)
            .read_checked(&target, Some(0..100), Some(&etag))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, ClientError::Api { code, .. } if *code == want),
            "{e:?}"
        );
    }
    assert_eq!(h.gets(), 0, "nothing refused touched S3");
    let team_a = mint("team-a", "s3://data/team-a/");
    // Cached first over HTTP (the socket serves pages already on disk).
    let http = h.client.clone().with_token(Some(&team_a)).unwrap();
    http.read(&target, None).await.unwrap();
    h.settled_page_files().await;
    let (got, _) = read_with(Some(team_a.clone()))
        .read_checked(&target, Some(0..100_000), Some(&etag))
        .await
        .unwrap();
    assert_eq!(&got[..], &body[..]);
    let metrics = h.client.metrics().await.unwrap();
    assert_eq!(
        metric_value(&metrics, "lakecache_local_served_bytes_total"),
        100_000.0
    );
    // A cold object comes over the socket too, under the same token:
    // inline, or as the page file when the worker's write of the page
    // it just fetched won the race (the HTTP client has no token, so
    // nothing else could have answered).
    let cold = data(70_000, 74);
    let cold_etag = h.put_direct("team-a/cold.bin", &cold).await;
    let (got, _) = read_with(Some(team_a))
        .read_checked(&uri("team-a/cold.bin"), Some(0..70_000), Some(&cold_etag))
        .await
        .unwrap();
    assert_eq!(&got[..], &cold[..]);
    let metrics = h.client.metrics().await.unwrap();
    let granted = metric_value(&metrics, "lakecache_local_served_bytes_total") - 100_000.0;
    // Absent until the first inline answer: here it may not have come.
    let inline = if metrics.contains("lakecache_local_inline_served_bytes_total") {
        metric_value(&metrics, "lakecache_local_inline_served_bytes_total")
    } else {
        0.0
    };
    assert_eq!(
        granted + inline,
        70_000.0,
        "the socket did not serve the cold read"
    );
}

/// The co-located write path: a file whose descriptor comes over the
/// socket is taken as a write-back of its first `size` bytes, with the
/// token and scope checks of an HTTP write, and a clear refusal for a
/// file shorter than the commit names.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_file_committed_over_the_socket_is_a_write_back_under_the_write_checks() {
    use lakecache_protocol::local_read::LocalError;
    use std::io::Write as _;

    let key = SigningKey::generate("k1");
    let h = with_socket(|o| o.access = tokens_of(&key)).await;
    let mint = |tenant: &str, scope: &str| token(&key, tenant, scope, true);
    let body = data((3 * MIB + 777) as usize, 75);
    let mut file = tempfile::tempfile().unwrap();
    file.write_all(&body).unwrap();
    // Bytes past the committed size are not part of the object.
    file.write_all(b"tail not committed").unwrap();
    let file = Arc::new(file);
    let member = h.addr().to_string();
    let commit = |token: Option<String>, key: &'static str, size: u64| {
        let (socket, file, member) = (socket_of(&h), file.clone(), member.clone());
        tokio::task::spawn_blocking(move || {
            LocalChannel::new(&socket, token).commit(
                &member,
                &uri(key),
                &file,
                size,
                &Default::default(),
                std::time::Duration::from_secs(30),
            )
        })
    };
    let size = body.len() as u64;
    for (token, want) in [
        (None, ErrorCode::Unauthenticated),
        (Some("garbage".to_string()), ErrorCode::Unauthenticated),
        (
            Some(mint("team-b", "s3://data/team-b/")),
            ErrorCode::OutOfScope,
        ),
    ] {
        match commit(token, "team-a/ckpt.bin", size).await.unwrap() {
            Err(LocalError::Refused { code, .. }) if code == want => {}
            other => panic!("expected {want:?}, got {other:?}"),
        }
    }
    let team_a = mint("team-a", "s3://data/team-a/");
    match commit(Some(team_a.clone()), "team-a/ckpt.bin", size + (1 << 20))
        .await
        .unwrap()
    {
        Err(LocalError::Refused {
            code: ErrorCode::BadRequest,
            message,
        }) => assert!(message.contains("holds"), "{message}"),
        other => panic!("a commit past the file's end: {other:?}"),
    }
    assert_eq!(h.gets(), 0, "nothing refused touched S3");

    let stat = commit(Some(team_a.clone()), "team-a/ckpt.bin", size)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stat.size, size);
    assert!(
        stat.etag.starts_with("lc-"),
        "a write-back version: {stat:?}"
    );
    let http = h.client.clone().with_token(Some(&team_a)).unwrap();
    let got = http.read(&uri("team-a/ckpt.bin"), None).await.unwrap();
    assert!(
        got[..] == body[..],
        "the committed object reads back other bytes"
    );
}

/// Bytes of write-back staging in use (pending objects and bodies being
/// taken), from the worker's metrics.
async fn staging_used(h: &Harness) -> f64 {
    let metrics = h.client.metrics().await.unwrap();
    metric_value(&metrics, "lakecache_writeback_staging_used")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followed_file_is_taken_as_it_grows_and_checked_at_the_seal() {
    use lakecache_protocol::local_read::{Following, LocalError};
    use std::os::unix::fs::FileExt as _;

    let h = with_socket(|_| {}).await;
    let member = h.addr().to_string();
    let follow =
        |key: &'static str, file: Arc<std::fs::File>, meta: lakecache_protocol::UserMeta| {
            let (socket, member) = (socket_of(&h), member.clone());
            async move {
                tokio::task::spawn_blocking(move || {
                    LocalChannel::new(&socket, None).follow(
                        &member,
                        &uri(key),
                        &file,
                        &meta,
                        std::time::Duration::from_secs(30),
                    )
                })
                .await
                .unwrap()
                .unwrap()
            }
        };
    let seal = |f: Following, size: u64, meta: lakecache_protocol::UserMeta| async move {
        tokio::task::spawn_blocking(move || f.seal(size, &meta))
            .await
            .unwrap()
    };
    let body = data((5 * MIB + 333) as usize, 76);
    let mut meta = lakecache_protocol::UserMeta::new();
    meta.insert("mode".into(), "100600".into());

    // Two pages written before the follow, the rest after the worker has
    // taken them (the staging in use shows it), then the seal.
    let file = Arc::new(tempfile::tempfile().unwrap());
    file.write_all_at(&body[..2 * MIB as usize], 0).unwrap();
    let following = follow("grown.bin", file.clone(), meta.clone()).await;
    eventually(
        Duration::from_secs(20),
        "the first pages taken before the seal",
        || async { staging_used(&h).await >= MIB as f64 },
    )
    .await;
    file.write_all_at(&body[2 * MIB as usize..], 2 * MIB)
        .unwrap();
    let mut sealed_meta = meta.clone();
    sealed_meta.insert("mtime".into(), "1700000000".into());
    let stat = seal(following, body.len() as u64, sealed_meta.clone())
        .await
        .unwrap();
    assert_eq!(stat.size, body.len() as u64);
    assert_eq!(stat.meta, sealed_meta, "recorded with the seal's metadata");
    let got = h.client.read(&uri("grown.bin"), None).await.unwrap();
    assert!(
        got[..] == body[..],
        "the followed object reads back other bytes"
    );
    // Once uploaded, the object holds no staging: from here on, what is
    // in use is the follows' own.
    eventually(
        Duration::from_secs(60),
        "the followed object uploaded",
        || async { staging_used(&h).await == 0.0 },
    )
    .await;
    let recorded = 0.0;

    // A page rewritten after the worker took it: the seal is refused,
    // nothing is recorded, and the staging taken is given back.
    let file = Arc::new(tempfile::tempfile().unwrap());
    file.write_all_at(&body[..3 * MIB as usize], 0).unwrap();
    let following = follow("patched.bin", file.clone(), meta.clone()).await;
    eventually(
        Duration::from_secs(20),
        "pages taken before the patch",
        || async { staging_used(&h).await >= recorded + 2.0 * MIB as f64 },
    )
    .await;
    file.write_all_at(b"patched header", 10).unwrap();
    match seal(following, 3 * MIB, meta.clone()).await {
        Err(LocalError::Refused { code, message }) => {
            assert_eq!(code, ErrorCode::BadRequest, "{message}");
            assert!(message.contains("changed"), "{message}");
        }
        other => panic!("a file changed after it was taken: {other:?}"),
    }
    assert_api_error(
        &h.client.read(&uri("patched.bin"), None).await.unwrap_err(),
        ErrorCode::NotFound,
    );

    // A seal below what was taken is refused too.
    let following = follow("shrunk.bin", file.clone(), meta.clone()).await;
    eventually(
        Duration::from_secs(20),
        "pages taken before the shrink",
        || async { staging_used(&h).await >= recorded + 2.0 * MIB as f64 },
    )
    .await;
    match seal(following, MIB / 2, meta.clone()).await {
        Err(LocalError::Refused { message, .. }) => {
            assert!(message.contains("sealed at"), "{message}")
        }
        other => panic!("a seal below the bytes taken: {other:?}"),
    }

    // A follow dropped without a seal (the application went away): the
    // worker drops what it took.
    let following = follow("dropped.bin", file.clone(), meta.clone()).await;
    eventually(
        Duration::from_secs(20),
        "pages taken before the drop",
        || async { staging_used(&h).await >= recorded + 2.0 * MIB as f64 },
    )
    .await;
    drop(following);
    eventually(
        Duration::from_secs(20),
        "the dropped follow's staging given back",
        || async { staging_used(&h).await == recorded },
    )
    .await;
    assert_api_error(
        &h.client.read(&uri("dropped.bin"), None).await.unwrap_err(),
        ErrorCode::NotFound,
    );
    assert_api_error(
        &h.client.read(&uri("shrunk.bin"), None).await.unwrap_err(),
        ErrorCode::NotFound,
    );
}

/// A mount on this host that writes back says so on the socket when it
/// starts: the worker writes its spare page files, up to the configured
/// cap, before any write-back comes, so the first burst is written over
/// them too. A token that may not write gets nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_back_mount_announced_on_the_socket_gets_its_spares_before_any_burst() {
    let key = SigningKey::generate("k1");
    let spare = MIB + 4096;
    // Three and a half spares: the cap is kept in whole spares.
    let cap = 3 * spare + spare / 2;
    let h = with_socket(|o| {
        o.access = tokens_of(&key);
        o.cache.writeback.spare_most = cap;
    })
    .await;
    let spare_bytes = || async {
        let metrics = h.client.metrics().await.unwrap();
        metric_value(&metrics, "lakecache_writeback_spare")
    };
    let prepare = |token: Option<String>| {
        let channel = LocalChannel::new(&socket_of(&h), token);
        tokio::task::spawn_blocking(move || channel.prepare_write_back())
    };
    let read_only = token(&key, "team-a", "s3://data/team-a/", false);
    for (token, want) in [
        (None, ErrorCode::Unauthenticated),
        (Some(read_only), ErrorCode::OutOfScope),
    ] {
        match prepare(token).await.unwrap() {
            Err(lakecache_protocol::local_read::LocalError::Refused { code, .. }) => {
                assert_eq!(code, want)
            }
            other => panic!("expected a {want:?} refusal, got {other:?}"),
        }
    }
    // Given time to act on a refusal, the worker must have written nothing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        spare_bytes().await,
        0.0,
        "spares written for a refused request"
    );

    let writer = token(&key, "team-a", "s3://data/team-a/", true);
    assert_eq!(prepare(Some(writer)).await.unwrap().unwrap(), cap);
    eventually(
        Duration::from_secs(30),
        "three spares written with no write-back taken",
        || async { spare_bytes().await == (3 * spare) as f64 },
    )
    .await;
    let spare_dir = h.options.cache_dir.join("writeback/spare");
    assert_eq!(std::fs::read_dir(&spare_dir).unwrap().count(), 3);
}
