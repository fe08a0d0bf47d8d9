//! Write-back through the kernel, with crashes: a writer makes
//! checkpoint-like files (1 MiB blocks, fsync, close; some written to a
//! temp name and renamed into place) and records each file's sha256 once
//! close returned. Meanwhile the worker is SIGKILLed and restarted, the
//! S3 endpoint is stopped and restarted, and the mount is SIGKILLed
//! during a write. Then `lakecache sync`, and every recorded file is read
//! back through a fresh worker with an empty cache (so from S3).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::*;

/// sha256 of every file whose close returned 0, by key.
type Acked = Arc<Mutex<BTreeMap<String, Vec<u8>>>>;

/// Writes one file as a checkpoint writer does; returns its sha256.
fn write_checkpoint(
    dir: &Path,
    name: &str,
    len: usize,
    seed: u64,
    via_tmp: bool,
) -> std::io::Result<Vec<u8>> {
    let data = pattern(len, seed);
    let target = dir.join(name);
    let path = if via_tmp {
        dir.join(format!("{name}.tmp"))
    } else {
        target.clone()
    };
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)?;
    for block in data.chunks(1 << 20) {
        f.write_all(block)?;
    }
    f.sync_all()?;
    drop(f);
    if via_tmp {
        fs::rename(&path, &target)?;
    }
    Ok(Sha256::digest(&data).to_vec())
}

/// A writer thread: files of 1–6 MiB until `stop`; every third goes
/// through a temp name. Returns (attempted, failed).
fn writer(
    mnt: PathBuf,
    acked: Acked,
    stop: Arc<AtomicBool>,
    tag: &'static str,
) -> std::thread::JoinHandle<(u32, u32)> {
    std::thread::spawn(move || {
        let dir = mnt.join("checkpoints").join(tag);
        let (mut tried, mut failed) = (0, 0);
        let mut seed = 1u64;
        while !stop.load(Ordering::Relaxed) {
            if let Err(e) = fs::create_dir_all(&dir) {
                eprintln!("{tag}: mkdir failed: {e}");
                failed += 1;
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            seed += 1;
            tried += 1;
            let len = (1 << 20) + (seed as usize * 917_731) % (5 << 20);
            let name = format!("step{seed:04}.bin");
            match write_checkpoint(&dir, &name, len, seed, seed.is_multiple_of(3)) {
                Ok(sha) => {
                    acked
                        .lock()
                        .unwrap()
                        .insert(format!("checkpoints/{tag}/{name}"), sha);
                }
                Err(e) => {
                    eprintln!("{tag}: {name} failed: {e}");
                    failed += 1;
                }
            }
        }
        (tried, failed)
    })
}

/// Starts the S3 endpoint again over `root`, on the port it had (the
/// workers know it by that port).
fn restart_s3(env: &mut Env, root: &Path) {
    let (proc, port) = common::start_s3_on(root, ACCESS, SECRET, BUCKET, &[], env.s3_port);
    assert_eq!(port, env.s3_port);
    env.s3_proc = proc;
}

/// Waits until `acked` holds at least `n` files whose key contains `tag`:
/// writers run for a number of acknowledged writes, not a fixed time, so a
/// slow machine does not end a phase before it wrote anything.
fn wait_acked(acked: &Acked, tag: &str, n: usize) {
    common::wait_until(
        &format!("{n} acknowledged writes under {tag}"),
        Duration::from_secs(120),
        Duration::from_millis(50),
        || {
            acked
                .lock()
                .unwrap()
                .keys()
                .filter(|k| k.contains(tag))
                .count()
                >= n
        },
    );
}

fn sync(env: &Env, timeout: &str) -> std::process::Output {
    Command::new(BIN)
        .args([
            "sync",
            &format!("s3://{BUCKET}/checkpoints/"),
            "--timeout",
            timeout,
        ])
        .args(["--registry", &env.registry()])
        .output_bounded()
        .unwrap()
}

/// Reads every acknowledged file through a fresh worker (empty cache)
/// and returns how many verified.
fn verify_from_s3(env: &mut Env, acked: &BTreeMap<String, Vec<u8>>) -> usize {
    let (port, _fresh) = env.start_worker(99, 0, &[]);
    let client = lakecache_protocol::WorkerClient::new(
        &format!("127.0.0.1:{port}"),
        Duration::from_secs(60),
    )
    .unwrap();
    let mut verified = 0;
    for (key, want) in acked {
        let uri = ObjectUri::new(BUCKET, key).unwrap();
        let got = env.rt.block_on(client.read(&uri, None));
        match got {
            Ok(bytes) if Sha256::digest(&bytes).to_vec() == *want => verified += 1,
            Ok(bytes) => panic!("{key}: {} bytes with the wrong sha256", bytes.len()),
            Err(e) => panic!("{key}: acknowledged but not readable from S3: {e}"),
        }
    }
    verified
}

#[test]
fn acknowledged_checkpoints_survive_worker_kills_an_s3_outage_and_a_killed_mount() {
    let mut env = Env::start(1);
    env.mount_with(&["--write-mode", "back"]);
    let mnt = env.mountpoint();
    let acked: Acked = Arc::default();
    let mut report = Vec::new();

    // 1. SIGKILL the worker mid-run, restart it over the same directory.
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(mnt.clone(), acked.clone(), stop.clone(), "kill");
    wait_acked(&acked, "/kill/", 2);
    let port = env.workers[0].0;
    env.workers[0].1.kill9();
    // Down for a moment while the writer goes on (a time, not a sync).
    std::thread::sleep(Duration::from_millis(300));
    let before_restart = acked.lock().unwrap().len();
    env.workers[0].1 = env.spawn_worker(0, port, &[]);
    wait_acked(&acked, "/kill/", before_restart + 2);
    stop.store(true, Ordering::Relaxed);
    let (tried, failed) = w.join().unwrap();
    report.push(format!(
        "worker SIGKILL: {tried} writes tried, {failed} failed while it was down"
    ));

    // 4. S3 stopped for a while: writes keep being acknowledged.
    let s3_root = env.dir.path().join("s3");
    env.s3_proc.kill9();
    // The first S3 call after the outage began pays the SDK's retries;
    // after it the worker fails metadata calls fast (and answers from what
    // it knows), so this writer's lookups do not time out.
    let deadline = common::deadline_in(Duration::from_secs(60));
    loop {
        let asked = Instant::now();
        let out = Command::new(BIN)
            .args([
                "stat",
                &format!("s3://{BUCKET}/checkpoints/probe"),
                "--registry",
                &env.registry(),
            ])
            .args(["--progress-timeout", "60s", "--no-s3-fallback"])
            .output_bounded()
            .unwrap();
        assert!(!out.status.success());
        if asked.elapsed() < Duration::from_millis(500) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker never noticed S3 was down"
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(mnt.clone(), acked.clone(), stop.clone(), "outage");
    // 4 s in the test command; LAKECACHE_CRASH_OUTAGE_SECS=30 for the
    // issue's longer outage.
    let outage = std::env::var("LAKECACHE_CRASH_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    std::thread::sleep(Duration::from_secs(outage));
    stop.store(true, Ordering::Relaxed);
    let (tried, failed) = w.join().unwrap();
    if failed > 0 {
        eprintln!("{}", env.log());
    }
    assert_eq!(failed, 0, "a write failed while S3 was down");
    let during = acked
        .lock()
        .unwrap()
        .keys()
        .filter(|k| k.contains("/outage/"))
        .count();
    assert!(
        during > 0 && tried > 0,
        "nothing was written during the outage"
    );
    report.push(format!(
        "S3 outage of {outage} s: {tried} writes acknowledged, 0 failed"
    ));
    let out = sync(&env, "1");
    assert!(!out.status.success(), "sync said done while S3 was down");
    restart_s3(&mut env, &s3_root);

    // 3. SIGKILL the mount during a write: that file is absent or whole.
    let inflight = mnt.join("checkpoints/inflight.bin");
    let writer_proc = Command::new("dd")
        .args(["if=/dev/urandom", "bs=1M", "count=400"])
        .arg(format!("of={}", inflight.display()))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut writer_proc = Proc::unlogged("dd", writer_proc);
    // Kill the mount once dd is well into the file, not after a fixed time.
    common::wait_until(
        "dd writing the in-flight file",
        Duration::from_secs(60),
        Duration::from_millis(20),
        || fs::metadata(&inflight).is_ok_and(|m| m.len() >= 32 << 20),
    );
    env.mount.take().unwrap().kill9();
    writer_proc.kill9();
    if lakecache_fuse::mount::is_mounted(&mnt) {
        let _ = lakecache_fuse::mount::force_unmount(&mnt);
    }

    let out = sync(&env, "120");
    assert!(
        out.status.success(),
        "sync: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let acked = acked.lock().unwrap().clone();
    assert!(
        acked.len() >= 4,
        "too few files acknowledged: {}",
        acked.len()
    );
    let inflight_in_s3 = env.s3_get("checkpoints/inflight.bin");
    assert!(
        inflight_in_s3.is_none(),
        "a partial object of {} bytes appeared under the final name",
        inflight_in_s3.map_or(0, |b| b.len())
    );
    assert!(
        !acked.keys().any(|k| k.ends_with(".tmp")),
        "a temp name was recorded"
    );
    let verified = verify_from_s3(&mut env, &acked);
    // No temp file of a renamed checkpoint is left in S3.
    for key in acked.keys() {
        assert!(
            env.s3_get(&format!("{key}.tmp")).is_none(),
            "{key}.tmp left in S3"
        );
    }
    report.push("mount SIGKILL mid-write: in-flight file absent from S3".to_string());
    eprintln!(
        "write-back crash run: {} acknowledged, {verified} verified from S3, {} lost; {}",
        acked.len(),
        acked.len() - verified,
        report.join("; ")
    );
    assert_eq!(verified, acked.len());
}

#[test]
fn write_back_reads_its_own_writes_and_sync_waits_for_s3() {
    let mut env = Env::start(1);
    env.mount_with(&["--write-back-prefix", "checkpoints"]);
    let mnt = env.mountpoint();
    fs::create_dir_all(mnt.join("checkpoints")).unwrap();
    let sha =
        write_checkpoint(&mnt.join("checkpoints"), "model.pt", (9 << 20) + 5, 3, true).unwrap();
    // Visible at once, with its size, through the mount and the worker.
    let (len, got) = sha_file(&mnt.join("checkpoints/model.pt")).unwrap();
    assert_eq!((len, got), ((9 << 20) + 5, sha.clone()));
    let names: Vec<_> = fs::read_dir(mnt.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("model.pt")]);
    // Outside the prefix the mount writes through: in S3 at close.
    fs::write(mnt.join("notes.txt"), b"through").unwrap();
    assert_eq!(env.s3_get("notes.txt").as_deref(), Some(&b"through"[..]));
    let out = sync(&env, "60");
    assert!(
        out.status.success(),
        "sync: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let in_s3 = env
        .s3_get("checkpoints/model.pt")
        .expect("in S3 after sync");
    assert_eq!(Sha256::digest(&in_s3).to_vec(), sha);
    assert!(env.s3_get("checkpoints/model.pt.tmp").is_none());
    let status = Command::new(BIN)
        .args(["status", "--registry", &env.registry()])
        .output_bounded()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("PENDING"), "{text}");
}

/// Crash case 2: three workers that know their ring, two copies of every
/// write-back. One worker is SIGKILLed and its cache directory deleted
/// (its disk is lost), then replaced by a worker with an empty directory
/// at its address. Every file whose close returned still reaches S3: the
/// copies of the lost worker's writes are uploaded by the workers holding
/// them.
#[test]
fn with_two_copies_a_worker_that_loses_its_disk_loses_no_acknowledged_checkpoint() {
    let mut env = Env::start(0);
    // The one place a test picks ports for a child: workers that know
    // their ring need every address before any starts. A port taken in
    // between makes that worker exit, and the test fails with its log.
    let ports: Vec<u16> = (0..3).map(|_| common::unused_port()).collect();
    let registry = format!(
        "static:{}",
        ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    );
    let flags = [
        "--registry",
        registry.as_str(),
        "--segment-size",
        SEGMENT,
        "--write-replicas",
        "2",
    ];
    for (i, port) in ports.iter().enumerate() {
        let worker = env.spawn_worker(i, *port, &flags);
        env.workers.push((*port, worker));
    }
    env.mount_with(&["--write-mode", "back"]);
    let mnt = env.mountpoint();
    let acked: Acked = Arc::default();
    // With S3 up most writes would upload at once; stopping it first
    // keeps every write pending when the disk goes.
    let s3_root = env.dir.path().join("s3");
    env.s3_proc.kill9();

    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(mnt.clone(), acked.clone(), stop.clone(), "disk");
    // The first S3 calls of each worker pay the SDK's retries before it
    // fails fast: wait for a few acknowledgements, not a fixed time.
    wait_acked(&acked, "/disk/", 4);
    let before = acked.lock().unwrap().len();
    let lost = 1;
    env.workers[lost].1.kill9();
    fs::remove_dir_all(env.dir.path().join(format!("cache-{lost}"))).unwrap();
    // Gone for a while as writes go on (an outage length, not a sync:
    // writes owned by the lost worker may fail meanwhile).
    std::thread::sleep(Duration::from_secs(2));
    env.workers[lost].1 = env.spawn_worker(lost, ports[lost], &flags);
    wait_acked(&acked, "/disk/", before + 2);
    stop.store(true, Ordering::Relaxed);
    let (tried, failed) = w.join().unwrap();
    restart_s3(&mut env, &s3_root);

    let out = sync(&env, "180");
    assert!(
        out.status.success(),
        "sync: {}{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        env.worker_logs()
    );
    let acked = acked.lock().unwrap().clone();
    assert!(
        before >= 3,
        "too few files acknowledged before the loss: {before}"
    );
    let verified = verify_from_s3(&mut env, &acked);
    eprintln!(
        "write-back disk-loss run (3 workers, 2 copies): {} acknowledged ({before} before the disk was lost), \
         {verified} verified from S3, {} lost; {tried} writes tried, {failed} failed while the worker was down",
        acked.len(),
        acked.len() - verified
    );
    assert_eq!(verified, acked.len());
}

/// Workers started without a registry cannot order the write-back
/// versions of one file that reached different workers. A write-back
/// mount over two of them says so at start, naming each, and `lakecache
/// status` shows them with no ring. Over workers that know their ring
/// (the usual environment here), the mount says they all do.
#[test]
fn a_write_back_mount_names_workers_that_know_no_ring() {
    let mut standalone = Env::start(0);
    for i in 0..2 {
        let (port, child) = standalone.start_worker(i, 0, &[]);
        standalone.workers.push((port, child));
    }
    standalone.mount_with(&["--write-mode", "back"]);
    for (port, _) in &standalone.workers {
        let addr = format!("127.0.0.1:{port}");
        common::wait_until(
            "the mount's warning naming each worker",
            common::scaled(Duration::from_secs(30)),
            Duration::from_millis(50),
            || {
                standalone
                    .log()
                    .lines()
                    .any(|l| l.contains("knows no ring") && l.contains(&addr))
            },
        );
    }
    let status = |env: &Env| -> (serde_json::Value, String) {
        let out = env.cli_ok(&["status", "--json"]);
        (
            serde_json::from_slice(&out.stdout).unwrap(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (json, stderr) = status(&standalone);
    for m in json["members"].as_array().unwrap() {
        assert!(m["live"].as_bool().unwrap(), "{m}");
        assert!(m["ring_workers"].is_null(), "{m}");
    }
    assert_eq!(stderr.matches("knows no ring").count(), 2, "{stderr}");

    let mut ringed = Env::start(2);
    ringed.mount_with(&["--write-mode", "back"]);
    common::wait_until(
        "the mount's word that every worker knows its ring",
        common::scaled(Duration::from_secs(30)),
        Duration::from_millis(50),
        || ringed.log().contains("every worker knows the mount's ring"),
    );
    assert!(!ringed.log().contains("knows no ring"), "{}", ringed.log());
    let (json, stderr) = status(&ringed);
    for m in json["members"].as_array().unwrap() {
        assert_eq!(m["ring_workers"].as_u64(), Some(2), "{m}");
    }
    assert!(!stderr.contains("knows no ring"), "{stderr}");
}
