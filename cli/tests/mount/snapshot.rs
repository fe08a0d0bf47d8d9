//! A mount pinned to a dataset snapshot: exactly the objects recorded,
//! each at its recorded ETag; an object changed in S3 since fails with
//! both ETags named (never the new bytes); a tampered manifest is refused.

use super::*;

fn cli(env: &Env, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .args(["--registry", &env.registry()])
        .envs(common::s3_env(ACCESS, SECRET, env.s3_port))
        .output_bounded()
        .unwrap()
}

#[test]
fn a_snapshot_mount_reads_the_recorded_versions_and_names_a_changed_object() {
    let mut env = Env::start(1);
    env.put("ds/a.bin", Bytes::from(pattern(3 << 20, 1)));
    env.put("ds/sub/b.bin", Bytes::from(pattern(1 << 20, 2)));
    env.put("ds/c.bin", Bytes::from(pattern(1 << 20, 3)));
    let out = cli(
        &env,
        &[
            "snapshot",
            "create",
            "s3://data/ds",
            "s3://data/snapshots/ds-1.json",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("$ lakecache snapshot create ...\n{stdout}");
    assert!(stdout.contains("3 objects"), "{stdout}");
    let manifest = env.s3_get("snapshots/ds-1.json").unwrap();
    let snap = lakecache_protocol::snapshot::Snapshot::from_json(&manifest).unwrap();
    let old_c = snap.get("ds/c.bin").unwrap().etag.clone();

    // After the snapshot: one object changes, one is added.
    env.put("ds/c.bin", Bytes::from(pattern(1 << 20, 33)));
    env.put("ds/new.bin", Bytes::from_static(b"not in the snapshot"));

    env.mount_with(&["--snapshot", "s3://data/snapshots/ds-1.json"]);
    let ds = env.mountpoint().join("ds");
    let mut names: Vec<String> = fs::read_dir(&ds)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["a.bin", "c.bin", "sub"]);
    assert_eq!(fs::read(ds.join("a.bin")).unwrap(), pattern(3 << 20, 1));
    assert_eq!(fs::read(ds.join("sub/b.bin")).unwrap(), pattern(1 << 20, 2));
    assert_eq!(errno_of(fs::metadata(ds.join("new.bin"))), libc::ENOENT);
    // The changed object: an error, never the new bytes.
    assert_eq!(errno_of(fs::read(ds.join("c.bin"))), libc::EIO);
    let new_c = env
        .rt
        .block_on(env.s3.head(&ObjectUri::new(BUCKET, "ds/c.bin").unwrap()))
        .unwrap()
        .etag;
    let log = env.log();
    let line = log
        .lines()
        .find(|l| l.contains("changed since the snapshot"))
        .unwrap_or_else(|| panic!("no snapshot error in the mount log:\n{log}"));
    eprintln!("mount log: {line}");
    assert!(line.contains("s3://data/ds/c.bin"), "{line}");
    assert!(line.contains(&old_c) && line.contains(&new_c), "{line}");
    // Read-only.
    assert_eq!(errno_of(fs::write(ds.join("x.bin"), b"x")), libc::EROFS);
    assert_eq!(errno_of(fs::remove_file(ds.join("a.bin"))), libc::EROFS);
    if let Some(mut m) = env.mount.take() {
        m.term();
    }
    wait_mounted(&env.mountpoint(), false);

    // A tampered manifest is refused before mounting. (A new key: the
    // worker may still serve the old manifest within its metadata TTL.)
    let text = String::from_utf8(manifest).unwrap().replace(&old_c, &new_c);
    env.put("snapshots/ds-tampered.json", Bytes::from(text));
    let mut cmd = env.mount_command();
    cmd.args(["--snapshot", "s3://data/snapshots/ds-tampered.json"]);
    let (ok, err) = run_bounded(cmd, Duration::from_secs(60));
    assert!(!ok, "a tampered manifest was mounted");
    assert!(err.contains("checksum mismatch"), "{err}");
    // A manifest inside the dataset it describes is refused.
    let out = cli(
        &env,
        &[
            "snapshot",
            "create",
            "s3://data/ds",
            "s3://data/ds/manifest.json",
        ],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("inside the dataset"));
}

/// Runs `cmd` to its end, killing it after `limit` (a mount that
/// wrongly starts would otherwise hold the test forever).
fn run_bounded(mut cmd: Command, limit: Duration) -> (bool, String) {
    let err_path = tempfile::NamedTempFile::new().unwrap();
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(err_path.reopen().unwrap())
        .spawn()
        .unwrap();
    let deadline = common::deadline_in(limit);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let err = fs::read_to_string(err_path.path()).unwrap_or_default();
    (status.is_some_and(|s| s.success()), err)
}
