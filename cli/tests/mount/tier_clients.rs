//! Another reader on the node (the Python client's Rust end) sharing the
//! mount's node-local tier through its socket, while the mount is killed
//! with -9, restarted with changed settings, and the object replaced in
//! S3 behind it; the store lists without ETags throughout.

use lakecache_protocol::tier_socket::{TierChannel, TierRead};

use super::local_tier::{mount_with_tier, tier_objects};
use super::*;

fn uri(key: &str) -> String {
    format!("s3://{BUCKET}/{key}")
}

/// The version of `key` as the workers report it (where a reader like
/// the Python client learns it), once they report what S3 holds.
fn etag(env: &Env, key: &str) -> String {
    let uri = ObjectUri::new(BUCKET, key).unwrap();
    let in_s3 = env.rt.block_on(env.s3.head(&uri)).unwrap().etag;
    let worker = lakecache_protocol::WorkerClient::new(
        &format!("127.0.0.1:{}", env.workers[0].0),
        Duration::from_secs(30),
    )
    .unwrap();
    common::wait_until(
        "the worker reporting the version in S3",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || env.rt.block_on(worker.stat(&uri)).unwrap().etag == in_s3,
    );
    in_s3
}

/// Reads all of `key` at `etag` through the channel.
fn read_all(channel: &TierChannel, key: &str, etag: &str, len: usize) -> (TierRead, Vec<u8>) {
    let mut out = vec![0u8; len];
    let got = channel
        .read_into(&uri(key), etag, 0, &mut out)
        .unwrap_or_else(|e| panic!("reading {key}: {e}"));
    (got, out)
}

fn stat(channel: &TierChannel, which: &str) -> u64 {
    let stats = channel.stats();
    let counter = match which {
        "file" => &stats.file_bytes,
        "inline" => &stats.inline_bytes,
        _ => &stats.unavailable,
    };
    counter.load(std::sync::atomic::Ordering::Relaxed)
}

#[test]
fn a_tier_socket_reader_reads_right_across_a_mount_killed_restarted_and_an_object_replaced() {
    // Versions the workers trust for 1 s, so the replacement below is
    // seen soon.
    let mut env = Env::start_full(1, &["--list-without-etags"], &["--metadata-ttl", "1"]);
    let keys = ["tc/a/x.bin", "tc/b/x.bin", "tc/c/x.bin"];
    let data: Vec<Vec<u8>> = [(6 << 20) + 123, (3 << 20) + 7, (2 << 20) + 1]
        .iter()
        .enumerate()
        .map(|(i, &len)| pattern(len, 90 + i as u64))
        .collect();
    for (key, bytes) in keys.iter().zip(&data) {
        env.put(key, Bytes::from(bytes.clone()));
    }
    let etags: Vec<String> = keys.iter().map(|k| etag(&env, k)).collect();
    let tier = mount_with_tier(&mut env, &[]);
    let channel = TierChannel::connect(&tier).unwrap();

    // First read: the mount reads it (and fills its tier) and sends it.
    let (got, bytes) = read_all(&channel, keys[0], &etags[0], data[0].len());
    assert_eq!(got, TierRead::Done, "{}", env.log());
    assert!(bytes == data[0], "a.bin through the mount");
    assert_eq!(stat(&channel, "inline"), data[0].len() as u64);
    common::wait_until(
        "a.bin whole in the tier",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || {
            tier_objects(&tier)
                .iter()
                .any(|o| o.uri.ends_with(keys[0]) && o.whole)
        },
    );
    // Whole now: the reader is handed the tier's file.
    let (got, bytes) = read_all(&channel, keys[0], &etags[0], data[0].len());
    assert!(
        got == TierRead::Done && bytes == data[0],
        "a.bin handed over"
    );
    assert_eq!(stat(&channel, "file"), data[0].len() as u64);

    // kill -9: the file it holds stays right; other reads go to the
    // workers (Unavailable), and within the back-off without asking.
    env.mount.take().unwrap().kill9();
    let _ = lakecache_fuse::mount::force_unmount(&env.mountpoint());
    wait_mounted(&env.mountpoint(), false);
    let (got, bytes) = read_all(&channel, keys[0], &etags[0], data[0].len());
    assert!(
        got == TierRead::Done && bytes == data[0],
        "held a.bin after kill -9"
    );
    let (got, _) = read_all(&channel, keys[1], &etags[1], data[1].len());
    assert!(
        matches!(&got, TierRead::Unavailable(why) if why.contains("node-local tier socket")),
        "{got:?}"
    );
    let (got, _) = read_all(&channel, keys[1], &etags[1], data[1].len());
    assert!(
        matches!(&got, TierRead::Unavailable(why) if why.contains("a moment ago")),
        "{got:?}"
    );

    // The remount (a changed plan budget) adopts the tier; after the
    // back-off the reader reaches it on its own.
    mount_with_tier(&mut env, &["--local-cache-plan-prefetch", "64MiB"]);
    let mut bytes = Vec::new();
    common::wait_until(
        "the reader reaching the remounted tier",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || {
            let got;
            (got, bytes) = read_all(&channel, keys[1], &etags[1], data[1].len());
            got == TierRead::Done
        },
    );
    assert!(bytes == data[1], "b.bin through the remount");
    let plan = vec![(ObjectUri::new(BUCKET, keys[2]).unwrap(), 0..1000)];
    assert_eq!(channel.publish_plan("job/0", 60, &plan).unwrap(), 1);

    // A restart between two reads costs nothing: the idle connection to
    // the old mount is replaced by a new one at once.
    env.mount.take().unwrap().term();
    wait_mounted(&env.mountpoint(), false);
    mount_with_tier(&mut env, &[]);
    let unavailable = stat(&channel, "unavailable");
    let (got, bytes) = read_all(&channel, keys[2], &etags[2], data[2].len());
    assert!(got == TierRead::Done && bytes == data[2], "c.bin: {got:?}");
    assert_eq!(stat(&channel, "unavailable"), unavailable);

    // Replaced in S3: the new version reads new bytes through the mount;
    // a read naming the old version still gets exactly that version's
    // bytes (the file held), never the new ones.
    let replaced = pattern(data[0].len() + 4096, 99);
    env.put(keys[0], Bytes::from(replaced.clone()));
    let new_etag = etag(&env, keys[0]);
    assert_ne!(new_etag, etags[0]);
    let (got, bytes) = read_all(&channel, keys[0], &new_etag, replaced.len());
    assert!(
        got == TierRead::Done && bytes == replaced,
        "new a.bin: {got:?}"
    );
    let (got, bytes) = read_all(&channel, keys[0], &etags[0], data[0].len());
    assert!(
        got == TierRead::Done && bytes == data[0],
        "old a.bin: {got:?}"
    );
    // And the mount itself reads the new version.
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    assert!(fs::read(env.mountpoint().join(keys[0])).unwrap() == replaced);
}
