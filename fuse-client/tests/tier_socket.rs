//! The mount's tier socket driven by the reader's end
//! (`lakecache_protocol::tier_socket`), over a real Unix socket, with the
//! data plane in memory: what the mount fetches, when it hands over the
//! tier's file, and how it answers bad requests.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lakecache_fuse::data_plane::{DataOp, FaultyDataPlane, MemoryDataPlane};
use lakecache_fuse::local_tier::LocalTier;
use lakecache_fuse::{tier_clients, Fs, FsConfig};
use lakecache_protocol::local_read::{recv_message, send_message};
use lakecache_protocol::tier_socket::{
    TierAnswer, TierChannel, TierClientError, TierErrorKind, TierRead, TIER_SOCKET_NAME,
};

const MIB: usize = 1 << 20;

fn body(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 13 % 253) as u8).collect()
}

/// Sends one raw request body and returns the answer.
fn ask(c: &UnixStream, body: &[u8]) -> TierAnswer {
    send_message(c.as_raw_fd(), body, None).unwrap();
    let (reply, _) = recv_message(c.as_raw_fd()).unwrap();
    serde_json::from_slice(&reply).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_on_the_node_fills_the_mounts_tier_once_then_reads_its_file() {
    let data = body(5 * MIB + 321);
    let plane = Arc::new(FaultyDataPlane::new(MemoryDataPlane::new()));
    let etag = plane.inner().insert("data", "train/x.bin", data.clone());
    plane
        .inner()
        .insert("data", "other/y.bin", b"elsewhere".to_vec());
    let dir = tempfile::tempdir().unwrap();
    let tier = Arc::new(LocalTier::open(dir.path(), 64 * MIB as u64).unwrap());
    let fs = Arc::new(
        Fs::new(plane.clone(), FsConfig::new("data", "train/")).with_local_tier(tier.clone()),
    );
    let serving = tier_clients::serve(fs.clone()).expect("a tier gets a socket");
    assert_eq!(serving.path(), dir.path().join(TIER_SOCKET_NAME));

    let tier_dir = dir.path().to_path_buf();
    let (data2, etag2) = (data.clone(), etag.clone());
    let channel = tokio::task::spawn_blocking(move || {
        let channel = TierChannel::connect(&tier_dir).unwrap();
        assert!(channel.serves("data", "train/x.bin") && !channel.serves("data", "other/y.bin"));
        let mut out = vec![0u8; data2.len()];
        let done = channel.read_into("s3://data/train/x.bin", &etag2, 0, &mut out);
        assert_eq!(done.unwrap(), TierRead::Done);
        assert!(out == data2, "inline bytes differ from the object");
        channel
    })
    .await
    .unwrap();
    let read_bytes: u64 = plane.read_ranges().iter().map(|r| r.end - r.start).sum();
    assert_eq!(
        read_bytes,
        data.len() as u64,
        "fetched {:?}",
        plane.read_ranges()
    );

    // The whole object lands in the tier; the next read gets its file.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !tier
        .get("s3://data/train/x.bin", &etag)
        .is_some_and(|o| o.is_complete())
    {
        assert!(Instant::now() < deadline, "the tier copy never completed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reads_before = plane.calls(DataOp::Read);
    let (data2, etag2) = (data.clone(), etag.clone());
    let channel = tokio::task::spawn_blocking(move || {
        let mut out = vec![0u8; 1000];
        let at = 4 * MIB;
        channel
            .read_into("s3://data/train/x.bin", &etag2, at as u64, &mut out)
            .unwrap();
        assert!(out == data2[at..at + 1000]);
        let file_bytes = channel
            .stats()
            .file_bytes
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(file_bytes, 1000);
        channel
    })
    .await
    .unwrap();
    assert_eq!(
        plane.calls(DataOp::Read),
        reads_before,
        "a tier hit went to the workers"
    );

    // Definite answers, and what the mount leaves to the workers.
    let etag2 = etag.clone();
    let dir2 = dir.path().to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut out = vec![0u8; 10];
        let changed = channel.read_into("s3://data/train/x.bin", "older", 0, &mut out);
        assert!(matches!(changed, Err(TierClientError::Refused { kind: TierErrorKind::Changed, .. })), "{changed:?}");
        let gone = channel.read_into("s3://data/train/gone.bin", &etag2, 0, &mut out);
        assert!(matches!(gone, Err(TierClientError::Refused { kind: TierErrorKind::NotFound, .. })), "{gone:?}");

        let c = UnixStream::connect(dir2.join(TIER_SOCKET_NAME)).unwrap();
        let answer = ask(&c, br#"{"op":"read","uri":"s3://data/other/y.bin","etag":"e","offset":0,"len":9}"#);
        assert!(matches!(&answer, TierAnswer::Unavailable { reason } if reason.contains("outside this mount")), "{answer:?}");
        let answer = ask(&c, br#"{"op":"read","uri":"s3://data/train/x.bin","etag":"e","offset":0,"len":0}"#);
        assert!(matches!(&answer, TierAnswer::Error { kind: TierErrorKind::BadRequest, message } if message.contains("1 to")), "{answer:?}");
        let answer = ask(&c, br#"{"op":"read","uri":"not a uri","etag":"e","offset":0,"len":1}"#);
        assert!(matches!(answer, TierAnswer::Error { kind: TierErrorKind::BadRequest, .. }), "{answer:?}");
        let answer = ask(&c, br#"{"op":"format_disk"}"#);
        assert!(matches!(&answer, TierAnswer::Error { kind: TierErrorKind::BadRequest, message } if message.contains("not a tier socket request")), "{answer:?}");
        let past = format!(r#"{{"op":"read","uri":"s3://data/train/x.bin","etag":"{etag2}","offset":{},"len":2}}"#, 5 * MIB + 320);
        let answer = ask(&c, past.as_bytes());
        assert!(matches!(answer, TierAnswer::Error { kind: TierErrorKind::InvalidRange, .. }), "{answer:?}");
        // A frame longer than any request ends the connection, and only it.
        let mut raw = &c;
        raw.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
        let mut rest = Vec::new();
        assert_eq!(raw.read_to_end(&mut rest).unwrap(), 0);
        let c = UnixStream::connect(dir2.join(TIER_SOCKET_NAME)).unwrap();
        assert!(matches!(ask(&c, br#"{"op":"hello"}"#), TierAnswer::Hello { .. }));
    })
    .await
    .unwrap();
    // Dropped with the mount: the socket goes.
    drop(serving);
    assert!(!dir.path().join(TIER_SOCKET_NAME).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_plan_has_the_tier_fetch_the_next_objects_before_they_are_read() {
    let plane = Arc::new(FaultyDataPlane::new(MemoryDataPlane::new()));
    let mut etags = Vec::new();
    for i in 0..6 {
        etags.push(
            plane
                .inner()
                .insert("data", &format!("train/{i}.bin"), body(3 * MIB + i)),
        );
    }
    plane
        .inner()
        .insert("data", "train/unplanned.bin", body(MIB));
    let dir = tempfile::tempdir().unwrap();
    let tier = Arc::new(LocalTier::open(dir.path(), 256 * MIB as u64).unwrap());
    let fs = Arc::new(
        Fs::new(plane.clone(), FsConfig::new("data", "train/")).with_local_tier(tier.clone()),
    );
    let _serving = tier_clients::serve(fs.clone()).unwrap();
    let tier_dir = dir.path().to_path_buf();
    let uri = |i: usize| format!("s3://data/train/{i}.bin");
    let entries: Vec<_> = [3usize, 0, 5, 1, 4, 2]
        .iter()
        .map(|&i| (uri(i).parse().unwrap(), 0..(3 * MIB + i) as u64))
        .collect();
    let channel = tokio::task::spawn_blocking(move || {
        let channel = TierChannel::connect(&tier_dir).unwrap();
        assert_eq!(channel.publish_plan("job/0", 60, &entries).unwrap(), 6);
        channel
    })
    .await
    .unwrap();
    // Before any read: the plan's first two objects are fetched whole.
    let whole = |i: usize| {
        tier.get(&uri(i), &etags[i])
            .is_some_and(|o| o.is_complete())
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(whole(3) && whole(0)) {
        assert!(
            Instant::now() < deadline,
            "the plan's first objects were not prefetched"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let plans = fs.tier_plans().unwrap();
    assert!(
        plans
            .stats
            .prefetched_objects
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2
    );
    // The reader then finds each planned object whole, read by itself.
    let reads_before = plane.calls(DataOp::Read);
    let etag3 = etags[3].clone();
    let channel = tokio::task::spawn_blocking(move || {
        let mut out = vec![0u8; 3 * MIB + 3];
        channel
            .read_into("s3://data/train/3.bin", &etag3, 0, &mut out)
            .unwrap();
        assert!(out == body(3 * MIB + 3));
        assert_eq!(
            channel
                .stats()
                .inline_bytes
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        channel
    })
    .await
    .unwrap();
    // The reader moved on: the next planned object is fetched too.
    while !whole(5) {
        assert!(
            Instant::now() < deadline,
            "the plan's third object was not prefetched"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(plane.calls(DataOp::Read) > reads_before);
    assert!(tier.get("s3://data/train/unplanned.bin", "any").is_none());
    // A malformed plan is refused with what is wrong, and the last one stays.
    let bad = vec![("s3://data/train/1.bin".parse().unwrap(), 9..9)];
    let refused = tokio::task::spawn_blocking(move || channel.publish_plan("job/0", 60, &bad))
        .await
        .unwrap();
    match refused {
        Err(TierClientError::Refused {
            kind: TierErrorKind::BadRequest,
            message,
        }) => {
            assert!(message.contains("empty or reversed"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(plans.held(), 1);
}

/// A mount with no node-local tier takes plans through a socket in
/// `client_socket_dir` and holds each plan's next samples in memory,
/// within `plan_memory`: a loader's reads (open, read, release, as a map
/// style data set does per sample) are answered from there, and every
/// sample is fetched from the workers once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_tier_a_plans_next_samples_are_held_in_memory_and_fetched_once() {
    const SAMPLE: u64 = MIB as u64;
    let plane = Arc::new(FaultyDataPlane::new(MemoryDataPlane::new()));
    let shard = body(4 * MIB);
    for s in 0..4 {
        plane
            .inner()
            .insert("data", &format!("train/s{s}.bin"), shard.clone());
    }
    let dir = tempfile::tempdir().unwrap();
    let mut config = FsConfig::new("data", "train/");
    config.client_socket_dir = Some(dir.path().to_path_buf());
    config.plan_memory = 3 * SAMPLE;
    let fs = Arc::new(Fs::new(plane.clone(), config).with_client_plans());
    assert!(fs.local_tier().is_none());
    let _serving = tier_clients::serve(fs.clone()).expect("a socket without a tier");
    let plans = fs.tier_plans().expect("plans without a tier").clone();
    let runner = tokio::spawn(plans.clone().run());
    let ranges = plans.ranges().expect("ranges in memory").clone();

    // Shuffled 1 MiB samples out of four 4 MiB shards: (shard, sample).
    let order = [
        (2u64, 1u64),
        (0, 3),
        (1, 0),
        (3, 2),
        (2, 0),
        (0, 0),
        (1, 3),
        (3, 1),
    ];
    let uri = |s: u64| format!("s3://data/train/s{s}.bin");
    let entries: Vec<(lakecache_protocol::ObjectUri, std::ops::Range<u64>)> = order
        .iter()
        .map(|&(s, k)| (uri(s).parse().unwrap(), k * SAMPLE..(k + 1) * SAMPLE))
        .collect();
    let socket_dir = dir.path().to_path_buf();
    let taken = tokio::task::spawn_blocking(move || {
        TierChannel::connect(&socket_dir)
            .unwrap()
            .publish_plan("job/0", 60, &entries)
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(taken, order.len());

    for (i, &(s, k)) in order.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ranges.is_ready(&uri(s), k * SAMPLE) {
            assert!(Instant::now() < deadline, "sample {i} was never held");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Never more than the bound ahead of the reader.
        assert!(ranges.held_bytes() <= 3 * SAMPLE);
        let served = || {
            ranges
                .stats
                .served
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        let served_before = served();
        let node = fs.lookup(1, &format!("s{s}.bin")).await.unwrap();
        let (fh, _) = fs.open(node.ino, libc::O_RDONLY, 0).await.unwrap();
        let got = fs.read(fh, k * SAMPLE, SAMPLE as u32).await.unwrap();
        fs.release(fh).await.unwrap();
        assert!(
            got[..] == shard[(k * SAMPLE) as usize..((k + 1) * SAMPLE) as usize],
            "sample {i} differs"
        );
        assert_eq!(
            served(),
            served_before + 1,
            "sample {i} was read from the workers, not from memory"
        );
    }
    // Each sample was fetched once: by the plan, none by a read.
    let mut fetched = plane.read_ranges();
    fetched.sort_by_key(|r| r.start);
    assert_eq!(fetched.len(), order.len(), "fetched {fetched:?}");
    assert!(fetched.iter().all(|r| r.end - r.start == SAMPLE));
    assert_eq!(ranges.held_bytes(), 0);
    runner.abort();
}
