//! POSIX through the kernel: the project's conformance suite on the
//! mount against a local directory, everyday copy tools round-tripping
//! modes, owners, times and symlinks, and the metadata as a plain S3
//! client sees it, after a remount and with an empty worker cache.

use std::collections::BTreeMap;

use super::*;

/// Mount cases allowed to fail, each only with the error the README
/// documents for it (here EPERM: hard links cannot be stored in S3).
const UNSUPPORTED: &[(&str, &str, &str)] = &[(
    "link",
    "a hard link shares the inode and raises nlink",
    "[Errno 1] Operation not permitted",
)];

fn conformance_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/posix/conformance.py")
}

/// Runs the suite in `dir`; returns its per-syscall results.
fn run_conformance(dir: &Path, out: &Path) -> serde_json::Value {
    let status = Command::new("python3")
        .arg(conformance_script())
        .arg("--dir")
        .arg(dir)
        .arg("--json")
        .arg(out)
        .status()
        .unwrap();
    let results: serde_json::Value =
        serde_json::from_slice(&fs::read(out).expect("the suite wrote no results")).unwrap();
    eprintln!("conformance in {}: exit {status}", dir.display());
    results
}

/// (passed, total) per syscall.
type Counts = BTreeMap<String, (u64, u64)>;

/// Per-syscall counts, and the failed cases as (syscall, case).
fn summarize(results: &serde_json::Value) -> (Counts, Vec<(String, String)>) {
    let mut counts = BTreeMap::new();
    let mut failed = Vec::new();
    for (syscall, entry) in results.as_object().unwrap() {
        let passed = entry["passed"].as_u64().unwrap();
        let fails = entry["failed"].as_array().unwrap();
        counts.insert(syscall.clone(), (passed, passed + fails.len() as u64));
        for f in fails {
            failed.push((syscall.clone(), f.as_str().unwrap().to_string()));
        }
    }
    (counts, failed)
}

/// Mounts for POSIX tests: other users reach it (`--allow-other`, and a
/// searchable path), the kernel checks modes, times are kept to the ns.
fn mount_for_posix(env: &mut Env) {
    fs::set_permissions(env.dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    fs::create_dir_all(env.mountpoint()).unwrap();
    env.mount_with(&["--allow-other"]);
}

#[test]
fn conformance_suite_passes_on_the_mount_as_on_local_disk() {
    let mut env = Env::start(1);
    mount_for_posix(&mut env);
    let local = env.dir.path().join("local");
    fs::create_dir_all(&local).unwrap();
    fs::set_permissions(&local, fs::Permissions::from_mode(0o755)).unwrap();
    let (local_counts, local_failed) =
        summarize(&run_conformance(&local, &env.dir.path().join("local.json")));
    assert!(
        local_failed.is_empty(),
        "the suite itself is wrong: it fails on local disk: {local_failed:#?}"
    );
    let mount_json = env.dir.path().join("mount.json");
    let (mount_counts, mount_failed) = summarize(&run_conformance(&env.mountpoint(), &mount_json));
    let mut report = String::from("syscall    local  mount\n");
    for (syscall, (passed, total)) in &mount_counts {
        let (lp, lt) = local_counts[syscall];
        report += &format!("{syscall:10} {lp:3}/{lt:<3} {passed:3}/{total}\n");
    }
    eprintln!("{report}");
    if let Ok(path) = std::env::var("LAKECACHE_POSIX_RESULTS") {
        fs::copy(&mount_json, path).unwrap();
    }
    let unexpected: Vec<_> = mount_failed
        .iter()
        .filter(|(syscall, case)| {
            !UNSUPPORTED.iter().any(|(s, name, error)| {
                s == syscall && case.starts_with(name) && case.contains(error)
            })
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "cases local disk passes fail on the mount:\n{unexpected:#?}\n{}",
        env.log()
    );
    assert_eq!(local_counts, {
        let mut all = mount_counts.clone();
        for (syscall, _) in &mount_failed {
            all.get_mut(syscall).unwrap().0 += 1;
        }
        all
    });
}

/// `find -printf` of what the copy tools must keep: mode, owner, group,
/// mtime (ns), type, link target, size and path, sorted.
fn tree_listing(root: &Path, owners: bool) -> Vec<String> {
    let format = if owners {
        "%m %U %G %T@ %y %l %s %P\n"
    } else {
        "%m %T@ %y %l %s %P\n"
    };
    let out = Command::new("find")
        .arg(root)
        .args(["-mindepth", "1", "-printf", format])
        .output_bounded()
        .unwrap();
    assert!(out.status.success(), "find {}", root.display());
    let mut lines: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        // A directory's size is the file system's business.
        .map(|l| {
            let mut f: Vec<&str> = l.split(' ').collect();
            let size_at = f.len() - 2;
            if f[size_at - 2] == "d" {
                f[size_at] = "-";
            }
            f.join(" ")
        })
        .collect();
    lines.sort();
    lines
}

/// sha256 of every regular file under `root`, by relative path.
fn tree_contents(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_file() {
                let rel = entry
                    .path()
                    .strip_prefix(root)
                    .unwrap()
                    .display()
                    .to_string();
                out.insert(
                    rel,
                    Sha256::digest(fs::read(entry.path()).unwrap()).to_vec(),
                );
            }
        }
    }
    out
}

fn run(cmd: &mut Command) {
    let out = cmd.output_bounded().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A model directory as tools leave it: modes, owners, nanosecond times,
/// a relative symlink, an empty file, nesting. Times are set last.
fn make_source_tree(src: &Path) {
    fs::create_dir_all(src.join("model/shards")).unwrap();
    fs::write(src.join("model/config.json"), b"{\"layers\": 4}\n").unwrap();
    fs::write(src.join("model/shards/00.bin"), pattern(300_000, 1)).unwrap();
    fs::write(src.join("model/shards/01.bin"), pattern(2_500_000, 2)).unwrap();
    fs::write(src.join("model/empty"), b"").unwrap();
    fs::write(src.join("run.sh"), b"#!/bin/sh\necho hi\n").unwrap();
    std::os::unix::fs::symlink("shards/01.bin", src.join("model/latest.bin")).unwrap();
    let modes = [
        ("model", 0o750),
        ("model/shards", 0o700),
        ("model/config.json", 0o640),
        ("model/shards/00.bin", 0o600),
        ("model/shards/01.bin", 0o444),
        ("model/empty", 0o604),
        ("run.sh", 0o755),
    ];
    for (path, mode) in modes {
        fs::set_permissions(src.join(path), fs::Permissions::from_mode(mode)).unwrap();
    }
    run(Command::new("chown")
        .args(["1234:5678"])
        .arg(src.join("model/config.json")));
    run(Command::new("chown")
        .args(["-h", "4321:8765"])
        .arg(src.join("model/latest.bin")));
    // Deepest first, so setting a file's time does not move its directory's.
    for (i, path) in [
        "model/shards/00.bin",
        "model/shards/01.bin",
        "model/config.json",
        "model/empty",
        "model/latest.bin",
        "run.sh",
        "model/shards",
        "model",
    ]
    .iter()
    .enumerate()
    {
        run(Command::new("touch")
            .args(["-h", "-d"])
            .arg(format!("2024-0{}-1{i} 10:2{i}:3{i}.12345678{i}", 1 + i % 9))
            .arg(src.join(path)));
    }
}

#[test]
fn copy_tools_round_trip_modes_owners_times_and_symlinks() {
    let mut env = Env::start(1);
    mount_for_posix(&mut env);
    let src = env.dir.path().join("src");
    make_source_tree(&src);
    let want = tree_listing(&src, true);
    let want_contents = tree_contents(&src);
    let mnt = env.mountpoint();

    let started = Instant::now();
    run(Command::new("cp").arg("-a").arg(&src).arg(mnt.join("cp")));
    eprintln!("cp -a: {:?}", started.elapsed());
    assert_eq!(tree_listing(&mnt.join("cp"), true), want, "cp -a");
    assert_eq!(tree_contents(&mnt.join("cp")), want_contents);

    run(Command::new("rsync")
        .arg("-a")
        .arg(format!("{}/", src.display()))
        .arg(mnt.join("rsync")));
    assert_eq!(tree_listing(&mnt.join("rsync"), true), want, "rsync -a");
    assert_eq!(tree_contents(&mnt.join("rsync")), want_contents);

    let tarball = env.dir.path().join("tree.tar");
    // pax keeps nanosecond times (the default GNU format whole seconds).
    run(Command::new("tar")
        .args(["--format=posix", "-C"])
        .arg(&src)
        .arg("-cf")
        .arg(&tarball)
        .arg("."));
    fs::create_dir(mnt.join("tar")).unwrap();
    run(Command::new("tar")
        .arg("-C")
        .arg(mnt.join("tar"))
        .arg("-xpf")
        .arg(&tarball));
    assert_eq!(tree_listing(&mnt.join("tar"), true), want, "tar x");
    assert_eq!(tree_contents(&mnt.join("tar")), want_contents);

    // copytree keeps modes and times (copy2), not owners.
    run(Command::new("python3").args([
        "-c",
        "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2], symlinks=True)",
        &src.display().to_string(),
        &mnt.join("py").display().to_string(),
    ]));
    assert_eq!(
        tree_listing(&mnt.join("py"), false),
        tree_listing(&src, false),
        "shutil.copytree"
    );
    assert_eq!(tree_contents(&mnt.join("py")), want_contents);

    // A plain S3 client sees the same bytes, with the attributes as
    // x-amz-meta-* headers.
    let uri = ObjectUri::new(BUCKET, "cp/model/config.json").unwrap();
    let head = env.rt.block_on(env.s3.head(&uri)).unwrap();
    assert_eq!(head.user.get("mode").map(String::as_str), Some("33184")); // S_IFREG|0640
    assert_eq!(head.user.get("uid").map(String::as_str), Some("1234"));
    assert_eq!(head.user.get("gid").map(String::as_str), Some("5678"));
    assert!(head.user.contains_key("mtime"), "{:?}", head.user);
    assert_eq!(
        env.s3_get("cp/model/config.json").unwrap(),
        b"{\"layers\": 4}\n"
    );
    let link = ObjectUri::new(BUCKET, "cp/model/latest.bin").unwrap();
    let link_head = env.rt.block_on(env.s3.head(&link)).unwrap();
    assert_eq!(
        link_head.user.get("mode").map(String::as_str),
        Some("41471")
    ); // S_IFLNK|0777
    assert_eq!(env.s3_get("cp/model/latest.bin").unwrap(), b"shards/01.bin");

    // After a remount over a worker whose cache is gone, all of it is
    // still there: it lives in S3.
    env.mount.take().unwrap().term();
    wait_mounted(&mnt, false);
    let port = env.workers[0].0;
    env.workers[0].1.kill9();
    fs::remove_dir_all(env.dir.path().join("cache-0")).unwrap();
    env.workers[0].1 = env.spawn_worker(0, port, &[]);
    env.mount_with(&["--allow-other"]);
    for copy in ["cp", "rsync", "tar"] {
        assert_eq!(
            tree_listing(&mnt.join(copy), true),
            want,
            "{copy} after remount"
        );
        assert_eq!(tree_contents(&mnt.join(copy)), want_contents);
    }
}

#[test]
fn metadata_changes_show_at_once_and_reach_s3_coalesced() {
    let mut env = Env::start(1);
    mount_for_posix(&mut env);
    let mnt = env.mountpoint();
    let f = mnt.join("f.bin");
    fs::write(&f, b"payload").unwrap();
    let copies_before = s3_requests(env.workers[0].0, "copy_object");
    // rsync's and tar's order, by path, after close.
    run(Command::new("chown").arg("1:2").arg(&f));
    fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).unwrap();
    run(Command::new("touch")
        .args(["-d", "2020-01-02 03:04:05.5"])
        .arg(&f));
    let st = fs::metadata(&f).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((st.mode() & 0o7777, st.uid(), st.gid()), (0o600, 1, 2));
    assert_eq!(st.mtime(), 1577934245);
    // Stored by one copy once the window has passed (or fsync).
    let uri = ObjectUri::new(BUCKET, "f.bin").unwrap();
    let deadline = common::deadline_in(Duration::from_secs(10));
    loop {
        let head = env.rt.block_on(env.s3.head(&uri)).unwrap();
        if head.user.get("mode").map(String::as_str) == Some("33152") {
            assert_eq!(head.user.get("uid").map(String::as_str), Some("1"));
            assert!(
                head.user["mtime"].starts_with("1577934245.5"),
                "{:?}",
                head.user
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "metadata never reached S3: {:?}",
            head.user
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let copies = s3_requests(env.workers[0].0, "copy_object") - copies_before;
    // At most two copies for three changes in a row (measured: 1 idle; 0
    // once under a CPU and disk hog, the changes reaching S3 another way).
    // The request counts are read for real: the write above was a PUT.
    assert!(copies <= 2, "{copies} copies for three changes in a row");
    assert!(
        s3_requests(env.workers[0].0, "put_object") >= 1,
        "the worker's S3 request counts are missing"
    );
    assert_eq!(env.s3_get("f.bin").unwrap(), b"payload");
}

/// S3 requests of one operation a worker made, from its metrics; 0 when
/// it made none yet (so only for differences whose later reading is
/// shown to be non-zero).
fn s3_requests(port: u16, op: &str) -> u64 {
    let body = reqwest_like_get(port, "/metrics");
    let op = format!("op=\"{op}\"");
    body.lines()
        .filter(|l| l.starts_with("lakecache_s3_requests_total{") && l.contains(&op))
        .map(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("unreadable metric line {l:?}"))
        })
        .sum::<f64>() as u64
}

/// `st_blksize` is the buffer stdio and Python size themselves by: large
/// while a file is being written (each write is a FUSE request), small
/// otherwise, so a program reading in pieces smaller than the buffer
/// (NumPy's NPZ reader asks for 256 KiB) is not copied twice.
#[test]
fn io_size_hint_is_large_while_writing_and_small_for_reads() {
    use std::os::unix::fs::MetadataExt;
    const WRITING: u64 = 1 << 20;
    const READING: u64 = 4 << 10;
    let mut env = Env::start(1);
    env.put("stored.bin", Bytes::from(vec![7u8; 300_000]));
    mount_for_posix(&mut env);
    let mnt = env.mountpoint();
    let stored = mnt.join("stored.bin");
    assert_eq!(fs::metadata(&stored).unwrap().blksize(), READING);
    let reader = fs::File::open(&stored).unwrap();
    assert_eq!(reader.metadata().unwrap().blksize(), READING);
    drop(reader);
    // Replacing it: the truncating open makes the kernel ask again.
    let writer = fs::File::create(&stored).unwrap();
    assert_eq!(writer.metadata().unwrap().blksize(), WRITING);
    drop(writer);
    let created = fs::File::create(mnt.join("new.bin")).unwrap();
    assert_eq!(created.metadata().unwrap().blksize(), WRITING);
}
