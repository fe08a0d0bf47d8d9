//! The node-local tier damaged behind the mount's back: a truncated copy,
//! a full disk, a deleted directory. Reads stay right (the bytes come from
//! the workers), and each kind is counted in a metric and named in the
//! mount's log once.

use super::local_tier::tier_files;
use super::tier_completion::wait_until;
use super::*;

/// A small tmpfs, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: PathBuf, size: &str) -> Self {
        fs::create_dir_all(&at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&at)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mounting a tmpfs at {}", at.display());
        Self(at)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn damage(port: u16, kind: &str) -> f64 {
    let text = reqwest_like_get(port, "/metrics");
    common::metric(
        &text,
        "lakecache_fuse_local_tier_damage_total",
        &[("kind", kind)],
    )
    .unwrap_or_else(|e| panic!("mount metrics: {e}\n{text}"))
}

fn sha_of(data: &[u8]) -> Vec<u8> {
    Sha256::digest(data).to_vec()
}

#[test]
fn damage_behind_the_mounts_back_is_counted_named_once_and_reads_stay_right() {
    let mut env = Env::start(1);
    let objects: Vec<(String, Vec<u8>)> = (0..4)
        .map(|i| (format!("d{i}.bin"), pattern((6 << 20) + i, 90 + i as u64)))
        .collect();
    for (key, data) in &objects {
        env.put(key, Bytes::from(data.clone()));
    }
    // The tier on its own small filesystem, so it can be filled up.
    let disk = Tmpfs::mount(env.dir.path().join("small-disk"), "40m");
    let tier = disk.0.join("tier");
    let mut cmd = env.mount_command();
    cmd.arg("--local-cache")
        .arg(&tier)
        .args(["--local-cache-size", "32MiB"])
        .args(["--metrics-listen", "127.0.0.1:0"]);
    env.spawn_mount(&mut cmd);
    env.wait_mount_serving();
    let port = env
        .mount
        .as_mut()
        .unwrap()
        .wait_for_port("mount metrics at http://", Duration::from_secs(30));
    let mnt = env.mountpoint();
    let read = |key: &str| sha_file(&mnt.join(key)).map(|(_, sha)| sha);

    // Truncated: d0 whole in the tier, then cut short.
    let (key, data) = &objects[0];
    assert_eq!(read(key).unwrap(), sha_of(data));
    wait_until("d0 whole in the tier", 60, || {
        super::local_tier::tier_objects(&tier)
            .iter()
            .any(|o| o.whole)
    });
    let copy = tier_files(&tier, "data").remove(0);
    OpenOptions::new()
        .write(true)
        .open(&copy)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    assert_eq!(read(key).unwrap(), sha_of(data), "d0 after truncation");
    wait_until("truncated damage counted", 30, || {
        damage(port, "truncated") >= 1.0
    });

    // Full: the tier's filesystem filled by someone else.
    let filler = disk.0.join("someone-elses-file");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=1M", "status=none"])
        .arg(format!("of={}", filler.display()))
        .stderr(Stdio::null()) // "No space left on device" is the point
        .status();
    for (key, data) in &objects[1..3] {
        assert_eq!(read(key).unwrap(), sha_of(data), "{key} on a full disk");
    }
    // Fills are written off the read path: counted soon after.
    wait_until("no_space damage counted", 30, || {
        damage(port, "no_space") >= 1.0
    });

    // Deleted: the whole tier directory.
    fs::remove_dir_all(&tier).unwrap();
    let (key, data) = &objects[3];
    assert_eq!(read(key).unwrap(), sha_of(data), "d3 with the tier gone");
    wait_until("missing damage counted", 30, || {
        damage(port, "missing") >= 1.0
    });

    let log = env.log();
    for kind in ["truncated", "no_space", "missing"] {
        assert_eq!(
            log.matches(&format!("damage={kind}")).count(),
            1,
            "{kind} should be named once:\n{log}"
        );
    }
    // Reads of every object are still right after all of it.
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    for (key, data) in &objects {
        assert_eq!(read(key).unwrap(), sha_of(data), "{key} at the end");
    }
}
