//! A worker that hangs (SIGSTOP: socket open, silent) while a file is
//! written through the mount: the writer gets EIO within the progress
//! deadline instead of sitting in a FUSE request nothing can end, in
//! both write modes. Once the worker resumes, the mount writes again and
//! nothing half-written shows up as the file.

use super::*;

const PROGRESS: &str = "2s";

/// The port the mount's metrics listener reported.
fn metrics_port(env: &mut Env) -> u16 {
    env.mount
        .as_mut()
        .expect("mounted")
        .wait_for_port("mount metrics at http://", Duration::from_secs(30))
}

/// Mounts with the test's progress deadline, a metrics listener and
/// `flags`; returns the metrics port.
fn mount_watched(env: &mut Env, flags: &[&str]) -> u16 {
    let mut args = vec![
        "--write-progress-timeout",
        PROGRESS,
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(flags);
    env.mount_with(&args);
    metrics_port(env)
}

fn resends(port: u16) -> f64 {
    let text = reqwest_like_get(port, "/metrics");
    common::metric(&text, "lakecache_fuse_write_resends_total", &[]).unwrap()
}

fn stalls(port: u16) -> f64 {
    let text = reqwest_like_get(port, "/metrics");
    common::metric(&text, "lakecache_fuse_write_stalls_total", &[]).unwrap()
}

/// Writes 8 MiB (enough to start the upload), stops the worker, and
/// goes on writing; returns how long the writer took to get its answer,
/// and the answer. A writer still blocked after a minute fails the test
/// (the worker is resumed first, so the writer and the test can end).
fn write_with_worker_stopped(env: &mut Env, name: &str) -> (Duration, std::io::Result<()>) {
    let path = env.mountpoint().join(name);
    let block = pattern(1 << 20, 7);
    let mut f = File::create(&path).unwrap();
    for _ in 0..8 {
        f.write_all(&block).unwrap();
    }
    let pid = env.workers[0].1.id().to_string();
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    let started = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    let writer = std::thread::spawn(move || {
        let result = (|| {
            for _ in 0..256 {
                f.write_all(&block)?;
            }
            f.sync_all()?;
            drop(f);
            Ok(())
        })();
        let _ = tx.send(started.elapsed());
        result
    });
    let answered = rx.recv_timeout(common::scaled(Duration::from_secs(60)));
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    let result = writer.join().unwrap();
    match answered {
        Ok(took) => (took, result),
        Err(_) => panic!(
            "the writer was still blocked a minute after the worker stopped (it ended with {result:?} once the worker resumed)"
        ),
    }
}

fn a_stopped_worker_fails_the_write_within_the_deadline(mode: &str) {
    let mut env = Env::start(1);
    let port = mount_watched(&mut env, &["--write-mode", mode]);
    assert_eq!(stalls(port), 0.0, "a stall before any write");
    // The deadline, as an operator sees it.
    let out = common::output_within(
        Command::new(BIN).args(["status", "--mount", &format!("127.0.0.1:{port}")]),
        common::scaled(Duration::from_secs(30)),
    )
    .unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{shown}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        shown.contains(&format!("{mode} mode; progress deadline 2s"))
            && shown.contains("no node-local tier"),
        "{shown}"
    );

    let (took, result) = write_with_worker_stopped(&mut env, "stalled.bin");
    eprintln!("{mode}: writer answered {took:?} after the worker stopped: {result:?}");
    let err = result.expect_err("a write to a stopped worker succeeded");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // 2 s without progress, plus the machine's slack; before the deadline
    // existed the writer waited for as long as the worker was stopped.
    assert!(
        took < common::scaled(Duration::from_secs(20)),
        "the writer waited {took:?} on a stopped worker"
    );
    assert!(stalls(port) >= 1.0, "the stall was not counted");
    assert!(
        env.log().contains("made no progress on the write"),
        "the mount's log does not say why the write failed:\n{}",
        common::tail(&env.log(), 30)
    );

    // The worker is back: the mount writes again, and what it wrote is
    // what S3 and the mount serve.
    let data = pattern(24 << 20, 11);
    let path = env.mountpoint().join("after.bin");
    fs::write(&path, &data).unwrap();
    if mode == "back" {
        env.sync_bucket(60);
    }
    common::wait_until(
        "the write after the stall in S3",
        common::scaled(Duration::from_secs(60)),
        Duration::from_millis(100),
        || env.s3_get("after.bin").as_deref() == Some(&data[..]),
    );
    assert_eq!(fs::read(&path).unwrap(), data);
    // The given-up file is not in S3 with part of its bytes.
    let stalled = env.s3_get("stalled.bin");
    assert!(
        stalled.as_ref().is_none_or(|b| b.len() == 264 << 20),
        "a partial stalled.bin of {:?} bytes reached S3",
        stalled.map(|b| b.len())
    );
}

#[test]
fn a_stopped_worker_fails_a_write_through_within_the_deadline() {
    a_stopped_worker_fails_the_write_within_the_deadline("through");
}

#[test]
fn a_stopped_worker_fails_a_write_back_within_the_deadline() {
    a_stopped_worker_fails_the_write_within_the_deadline("back");
}

/// The mount's own daemon stuck (SIGSTOP): a reader blocks in the mount
/// where even SIGKILL cannot end it. `lakecache umount --abort` aborts
/// the kernel's FUSE connection: the reader gets an error at once, and
/// the mount point is detached.
#[test]
fn umount_abort_ends_a_mount_whose_daemon_is_stuck() {
    let mut env = Env::start(1);
    env.put("a.bin", Bytes::from(pattern(1 << 20, 3)));
    env.mount();
    let mountpoint = env.mountpoint();
    let daemon = env.mount.as_ref().expect("mounted").id().to_string();
    Command::new("kill")
        .args(["-STOP", &daemon])
        .status()
        .unwrap();
    let mut reader = Command::new("cat")
        .arg(mountpoint.join("a.bin"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The reader is stuck waiting on the mount's answer.
    let wchan = format!("/proc/{}/wchan", reader.id());
    common::wait_until(
        "the reader blocked in a FUSE request",
        common::scaled(Duration::from_secs(10)),
        Duration::from_millis(20),
        || {
            fs::read_to_string(&wchan)
                .is_ok_and(|w| w.contains("fuse") || w.contains("request_wait_answer"))
        },
    );
    let stuck = reader.try_wait().unwrap().is_none();

    let out = common::output_within(
        Command::new(BIN)
            .args(["umount", "--abort"])
            .arg(&mountpoint),
        common::scaled(Duration::from_secs(30)),
    )
    .expect("lakecache umount --abort did not return");
    let mut reader_status = None;
    common::wait_until(
        "the stuck reader ending",
        common::scaled(Duration::from_secs(10)),
        Duration::from_millis(20),
        || {
            reader_status = reader.try_wait().unwrap();
            reader_status.is_some()
        },
    );
    let reader_status = reader_status.unwrap();
    Command::new("kill")
        .args(["-CONT", &daemon])
        .status()
        .unwrap();
    assert!(
        out.status.success(),
        "umount --abort failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stuck, "the reader was not blocked by the stopped daemon");
    assert!(
        !reader_status.success(),
        "the reader read through an aborted mount"
    );
    assert!(
        !lakecache_fuse::mount::is_mounted(&mountpoint),
        "the mount point is still mounted"
    );
    // Not a mount now: a clear error, not a hang.
    let again = common::output_within(
        Command::new(BIN)
            .args(["umount", "--abort"])
            .arg(&mountpoint),
        common::scaled(Duration::from_secs(30)),
    )
    .unwrap();
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("is not a mount point"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
}

static SIX_WRITERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The scene: three workers, six 128 MiB checkpoint files written
/// at once with `dd conv=fsync`, the owner of one of them stopped 1 s
/// in. Every writer succeeds (the stalled write is sent again, whole, to
/// the next worker), in about the time of a run without the hang, and
/// every file reads back byte-identical. A newer version written while
/// the stopped worker is still away is what S3 keeps after it resumes.
fn six_writers_with_one_worker_stopped(mode: &str) {
    // One at a time: each writes 2.3 GiB through three workers beside a
    // CPU and disk hog, and its bounds assume the machine is otherwise
    // its own (two at once on two cores also double the disk they fill).
    let _alone = SIX_WRITERS.lock().unwrap_or_else(|p| p.into_inner());
    const FILES: usize = 6;
    const MIB: usize = 128;
    let mut env = Env::start(3);
    let port = mount_watched(&mut env, &["--write-mode", mode]);
    let sources: Vec<PathBuf> = (0..FILES)
        .map(|i| {
            let p = env.dir.path().join(format!("src-{i}.bin"));
            fs::write(&p, pattern(MIB << 20, 100 + i as u64)).unwrap();
            p
        })
        .collect();
    // Returns each writer's time and, when `stop`, the index of the file
    // whose owner was stopped 1 s in.
    let run = |env: &Env,
               round: &str,
               stop: Option<Duration>|
     -> (Vec<Duration>, Option<(usize, String)>) {
        let started = Instant::now();
        let mut writers: Vec<_> = sources
            .iter()
            .enumerate()
            .map(|(i, src)| {
                Command::new("dd")
                    .arg(format!("if={}", src.display()))
                    .arg(format!(
                        "of={}",
                        env.mountpoint().join(format!("{round}-{i}.ckpt")).display()
                    ))
                    .args(["bs=1M", "conv=fsync", "status=none"])
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut victim = None;
        if let Some(stop_at) = stop {
            common::wait_until(
                "the stop time into the writes",
                Duration::from_secs(5),
                Duration::from_millis(10),
                || started.elapsed() >= stop_at,
            );
            // The owner of the file furthest from done (on a fast disk
            // some writers are done within the second, and one whose
            // bytes are all in may be acknowledged before the stop lands).
            let size = |i: usize| {
                fs::metadata(env.mountpoint().join(format!("{round}-{i}.ckpt")))
                    .map_or(0, |m| m.len())
            };
            let unfinished = (0..writers.len())
                .filter(|&i| matches!(writers[i].try_wait(), Ok(None)))
                .min_by_key(|&i| size(i))
                .unwrap_or(0);
            let owner = env.owner_index(&format!("{round}-{unfinished}.ckpt"), 0);
            let pid = env.workers[owner].1.id().to_string();
            Command::new("kill").args(["-STOP", &pid]).status().unwrap();
            victim = Some((unfinished, pid));
        }
        let times = writers
            .into_iter()
            .enumerate()
            .map(|(i, w)| {
                let out = w.wait_with_output().unwrap();
                assert!(
                    out.status.success(),
                    "{round}: writer {i} failed: {}\nmount log:\n{}\n{}",
                    String::from_utf8_lossy(&out.stderr),
                    common::tail(&env.log(), 30),
                    env.trouble()
                );
                started.elapsed()
            })
            .collect();
        (times, victim)
    };
    let (calm, _) = run(&env, "calm", None);
    let slowest_calm = calm.iter().max().copied().unwrap();
    // No false alarm: healthy workers, however loaded, are never given
    // up on; the same writes again beside a CPU and disk hog.
    let loaded = {
        let _hog = Hog::start(env.dir.path());
        run(&env, "loaded", None).0
    };
    eprintln!(
        "{mode}: slowest of {FILES} writers {slowest_calm:?}, {:?} beside the hog",
        loaded.iter().max().copied().unwrap()
    );
    assert_eq!(
        (stalls(port), resends(port)),
        (0.0, 0.0),
        "{mode}: a healthy worker was taken for hung (stalls, resends)\n{}",
        common::tail(&env.log(), 30)
    );
    // 1 s in, or halfway through where the calm round took under 2 s
    // (a fast disk): either way, with writes still in flight.
    let stop_at = (slowest_calm / 2).min(Duration::from_secs(1));
    let (hung, victim) = run(&env, "hung", Some(stop_at));
    let (victim_file, pid) = victim.unwrap();
    let victim_name = format!("hung-{victim_file}.ckpt");
    let victim = env.owner_index(&victim_name, 0);
    let slowest_hung = hung.iter().max().copied().unwrap();
    eprintln!(
        "{mode}: slowest of {FILES} writers {slowest_calm:?} without a hang, {slowest_hung:?} with worker {victim} (owner of {victim_name}) stopped {stop_at:?} in"
    );
    // A newer version of a file the stopped worker was taking.
    let newer = pattern(4 << 20, 999);
    fs::write(env.mountpoint().join(&victim_name), &newer).unwrap();
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    assert!(
        reqwest_like_get(port, "/metrics").contains("lakecache_fuse_write_resends_total"),
        "no resend metric"
    );
    let resends = resends(port);
    // The stalled upload was sent again; or, on a loaded machine, the
    // stop landed before the victim's upload began and a request that
    // timed out on the stopped worker had already marked it suspect, so
    // the upload went to the next worker from the start (writers prefer
    // workers not suspect) and nothing stalled.
    let victim_addr = format!("127.0.0.1:{}", env.workers[victim].0);
    let routed_around = env
        .log()
        .lines()
        .any(|l| l.contains("trying the next replica") && l.contains(&victim_addr))
        && env.worker_log_paths.iter().enumerate().any(|(i, path)| {
            i != victim
                && fs::read_to_string(path)
                    .unwrap_or_default()
                    .lines()
                    .any(|l| {
                        // The writer's own file, not the newer 4 MiB one.
                        l.contains("write-back recorded")
                            && l.contains(&format!("/{victim_name} "))
                            && l.contains(&format!("size={}", MIB << 20))
                    })
        });
    assert!(
        resends >= 1.0 || routed_around,
        "no write was sent again, and {victim_name} was not routed around {victim_addr}\n{}\n{}",
        common::tail(&env.log(), 30),
        env.worker_logs()
    );
    // The slowest writer within the deadline and a resend of the calm
    // time (generous: a loaded machine), not as long as the worker hung.
    assert!(
        slowest_hung < slowest_calm + common::scaled(Duration::from_secs(30)),
        "{slowest_hung:?} against {slowest_calm:?} without the hang"
    );
    if mode == "back" {
        env.sync_bucket(120);
    }
    for (i, src) in sources.iter().enumerate() {
        let want = fs::read(src).unwrap();
        for round in ["calm", "loaded", "hung"] {
            let name = format!("{round}-{i}.ckpt");
            if name == victim_name {
                continue;
            }
            let got = fs::read(env.mountpoint().join(&name)).unwrap();
            assert!(got == want, "{mode}: {name} reads back different bytes");
        }
    }
    // The resumed worker never lands its stale copy over the newer one.
    let deadline = Instant::now() + common::scaled(Duration::from_secs(60));
    loop {
        let got = env.s3_get(&victim_name);
        if got.as_deref() == Some(&newer[..]) {
            break;
        }
        if Instant::now() >= deadline {
            let old = fs::read(&sources[victim_file]).unwrap();
            let what = match &got {
                None => "nothing".to_string(),
                Some(b) if *b == old => {
                    format!("the version the hung writer wrote ({} bytes)", b.len())
                }
                Some(b) => format!("{} bytes matching neither version", b.len()),
            };
            let mut logs = String::new();
            for (i, path) in env.worker_log_paths.iter().enumerate() {
                let text = fs::read_to_string(path).unwrap_or_default();
                logs += &format!("--- worker {i}, lines naming {victim_name} or warning\n");
                for line in text.lines() {
                    if line.contains(&victim_name) || line.contains(" WARN ") {
                        logs += line;
                        logs.push('\n');
                    }
                }
            }
            panic!(
                "{mode}: S3 holds {what} as {victim_name}, not the newer version\n--- mount\n{}\n{logs}",
                common::tail(&env.log(), 60),
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let settle = Instant::now();
    common::wait_until(
        "the resumed worker answering",
        common::scaled(Duration::from_secs(30)),
        Duration::from_millis(100),
        || worker_requests_opt(env.workers[victim].0, "write").is_ok(),
    );
    assert_eq!(
        env.s3_get(&victim_name).as_deref(),
        Some(&newer[..]),
        "a stale copy replaced the newer {victim_name} {:?} after the worker resumed",
        settle.elapsed()
    );
}

/// Load for the no-false-failover round: two threads spinning and one
/// writing and syncing 8 MiB at a time (the 2-core CI machine's cores
/// and disk both busy), until dropped.
struct Hog {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Hog {
    fn start(dir: &std::path::Path) -> Self {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut threads = Vec::new();
        for _ in 0..2 {
            let stop = stop.clone();
            threads.push(std::thread::spawn(move || {
                let mut x = 1u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..100_000 {
                        x = std::hint::black_box(
                            x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1),
                        );
                    }
                }
            }));
        }
        let (stop_disk, path) = (stop.clone(), dir.join("hog.bin"));
        threads.push(std::thread::spawn(move || {
            let chunk = vec![7u8; 8 << 20];
            let mut f = File::create(&path).unwrap();
            let mut written = 0u64;
            while !stop_disk.load(Ordering::Relaxed) {
                if written >= 256 << 20 {
                    f = File::create(&path).unwrap();
                    written = 0;
                }
                f.write_all(&chunk).unwrap();
                f.sync_data().unwrap();
                written += chunk.len() as u64;
            }
            drop(f);
            let _ = fs::remove_file(&path);
        }));
        Self { stop, threads }
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[test]
fn six_writers_through_with_one_worker_stopped_all_succeed() {
    six_writers_with_one_worker_stopped("through");
}

#[test]
fn six_writers_back_with_one_worker_stopped_all_succeed() {
    six_writers_with_one_worker_stopped("back");
}

/// The stopped worker got the whole of a small write into its socket
/// before it stopped (so its copy is complete), the mount sent the write
/// again elsewhere, and the application then wrote a newer version. When
/// the worker resumes, its stale copy must not land over the newer one.
#[test]
fn a_resumed_worker_never_lands_its_stale_copy_over_a_newer_write_through() {
    a_resumed_worker_never_lands_its_stale_copy("through");
}

#[test]
fn a_resumed_worker_never_lands_its_stale_copy_over_a_newer_write_back() {
    a_resumed_worker_never_lands_its_stale_copy("back");
}

fn a_resumed_worker_never_lands_its_stale_copy(mode: &str) {
    let mut env = Env::start(3);
    env.mount_with(&["--write-progress-timeout", PROGRESS, "--write-mode", mode]);
    let victim = env.owner_index("small.ckpt", 0);
    let pid = env.workers[victim].1.id().to_string();
    let old = pattern(2 << 20, 1);
    let newer = pattern(3 << 20, 2);
    // Opened while the owner answers (so it is not suspect), written once
    // it is stopped: the owner takes the upload, its socket holds all of
    // it, the mount gives up on it and sends it to the next worker.
    let mut f = File::create(env.mountpoint().join("small.ckpt")).unwrap();
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    f.write_all(&old).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert!(
        env.log().contains("sending the write again"),
        "the write did not go to the stopped owner first:\n{}",
        common::tail(&env.log(), 20)
    );
    fs::write(env.mountpoint().join("small.ckpt"), &newer).unwrap();
    let sync = |env: &Env| {
        if mode == "back" {
            env.sync_bucket(60);
        }
    };
    if mode == "through" {
        assert_eq!(env.s3_get("small.ckpt").as_deref(), Some(&newer[..]));
    }
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    // The resumed worker reads the old write to its end and would store
    // it now: it must see it outlived the mount's patience and refuse it.
    let log = env.worker_log_paths[victim].clone();
    common::wait_until(
        "the resumed worker refusing the old write",
        common::scaled(Duration::from_secs(30)),
        Duration::from_millis(50),
        || {
            // Refused as outliving the mount's patience, or (had its body
            // not been whole in the socket) failed as cut off.
            fs::read_to_string(&log).is_ok_and(|t| {
                t.lines().any(|l| {
                    l.contains("small.ckpt")
                        && (l.contains("write fenced") || l.contains("nothing was acknowledged"))
                })
            })
        },
    );
    sync(&env);
    assert_eq!(
        env.s3_get("small.ckpt").map(|b| b.len()),
        Some(newer.len()),
        "{mode}: the resumed worker's stale copy replaced the newer write"
    );
    assert_eq!(
        fs::read(env.mountpoint().join("small.ckpt")).unwrap(),
        newer
    );
}

/// A write far larger than the mount's memory budget, its worker stopped
/// after 64 MiB: what the budget cannot keep was spooled to the node's
/// disk, so the write is sent again, whole, to the next worker, and the
/// file reads back byte-identical.
#[test]
fn a_write_larger_than_the_memory_budget_is_resent_from_the_spool() {
    let mut env = Env::start(3);
    let port = mount_watched(&mut env, &["--memory-limit", "32MiB"]);
    let name = "spooled.ckpt";
    let owner = env.owner_index(name, 0);
    let pid = env.workers[owner].1.id().to_string();
    let block = |i: usize| pattern(1 << 20, 1000 + i as u64);
    let mut f = File::create(env.mountpoint().join(name)).unwrap();
    for i in 0..64 {
        f.write_all(&block(i)).unwrap();
    }
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        for i in 64..128 {
            f.write_all(&block(i))?;
        }
        f.sync_all()?;
        drop(f);
        Ok(())
    });
    let result = writer.join().unwrap();
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    result.unwrap_or_else(|e| {
        panic!(
            "the write failed: {e}\nmount log:\n{}",
            common::tail(&env.log(), 30)
        )
    });
    let resends = resends(port);
    assert!(resends >= 1.0, "the write was not sent again");
    // The resend said how much it replayed from the spool.
    let log = env.log();
    let spooled = log
        .lines()
        .filter_map(|l| l.split("kept=(").nth(1))
        .filter_map(|rest| rest.split(')').next())
        .filter_map(|pair| pair.split(", ").nth(1)?.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    assert!(
        spooled >= 32 << 20,
        "expected most of the write replayed from the spool, got {spooled} bytes:\n{}",
        common::tail(&log, 20)
    );
    let got = fs::read(env.mountpoint().join(name)).unwrap();
    assert_eq!(got.len(), 128 << 20);
    for i in 0..128 {
        assert!(
            got[i << 20..(i + 1) << 20] == block(i)[..],
            "MiB {i} reads back different bytes"
        );
    }
}
