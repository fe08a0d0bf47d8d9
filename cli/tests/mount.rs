//! FUSE tests through the real kernel: `lakecache s3-server`, `lakecache
//! worker`s and `lakecache mount` as processes; files are read and written
//! with ordinary syscalls, fio and Python; S3 is checked directly.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use lakecache_protocol::ObjectUri;
use lakecache_worker::store::{ObjectStore, StoreError};
use lakecache_worker::{Metrics, S3Config};
use sha2::{Digest, Sha256};

mod common;
use common::{start_s3_with, worker_port, OutputBounded, Proc, BIN};

const ACCESS: &str = "mount-test";
const SECRET: &str = "mount-test-secret";
const BUCKET: &str = "data";
const SEGMENT: &str = "16MiB";

/// Fields drop in order: processes stop before their directory goes.
struct Env {
    rt: tokio::runtime::Runtime,
    s3: Arc<dyn ObjectStore>,
    s3_port: u16,
    s3_proc: Proc,
    workers: Vec<(u16, Proc)>,
    /// The `--registry` every worker is started with when the environment
    /// has more than one: workers that know their ring, as deployed
    /// (write-back copies, hand-offs and the order of versions across
    /// workers all need it). None: standalone workers.
    worker_ring: Option<String>,
    mount: Option<Proc>,
    /// Worker `i`'s log, appended across restarts.
    worker_log_paths: Vec<PathBuf>,
    /// The mount's log (a new one per mount).
    mount_log: PathBuf,
    dir: tempfile::TempDir,
}

/// `--write-spare` of the tests' workers unless a test sets its own.
const TEST_WRITE_SPARE: &str = "64MiB";

impl Env {
    fn start(workers: usize) -> Env {
        Self::start_with(workers, &[])
    }

    /// With extra `s3-server` flags (quirk modes).
    fn start_with(workers: usize, s3_flags: &[&str]) -> Env {
        Self::start_full(workers, s3_flags, &[])
    }

    /// With extra `s3-server` and `worker` flags.
    fn start_full(workers: usize, s3_flags: &[&str], worker_flags: &[&str]) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let (s3_proc, s3_port) =
            start_s3_with(&dir.path().join("s3"), ACCESS, SECRET, BUCKET, s3_flags);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let s3 = rt.block_on(async {
            let config = S3Config {
                endpoint: Some(format!("http://127.0.0.1:{s3_port}")),
                path_style: true,
                static_credentials: Some((ACCESS.into(), SECRET.into())),
                ..S3Config::default()
            };
            lakecache_worker::s3_store(&config, Arc::new(Metrics::new().unwrap())).await
        });
        let mut env = Env {
            dir,
            rt,
            s3,
            s3_port,
            s3_proc,
            workers: Vec::new(),
            worker_ring: None,
            mount: None,
            worker_log_paths: Vec::new(),
            mount_log: PathBuf::new(),
        };
        if workers > 1 {
            // Workers that know their ring need every address before any
            // starts, so here the test picks the ports. A port taken in
            // between makes that worker exit, and the test fails with its
            // log.
            let mut ports: Vec<u16> = Vec::new();
            while ports.len() < workers {
                let port = common::unused_port();
                if !ports.contains(&port) {
                    ports.push(port);
                }
            }
            let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
            env.worker_ring = Some(format!("static:{}", addrs.join(",")));
            for (i, port) in ports.into_iter().enumerate() {
                let child = env.spawn_worker(i, port, worker_flags);
                env.workers.push((port, child));
            }
        } else {
            for i in 0..workers {
                // Tests restart workers on their port: see `unused_port`.
                let port = common::unused_port();
                let child = env.spawn_worker(i, port, worker_flags);
                env.workers.push((port, child));
            }
        }
        env
    }

    /// [`Env::start_worker`] where the port is known: a restart on the
    /// port the worker had (the static ring names it).
    fn spawn_worker(&mut self, i: usize, port: u16, worker_flags: &[&str]) -> Proc {
        let (got, child) = self.start_worker(i, port, worker_flags);
        assert_eq!(got, port);
        child
    }

    /// `lakecache worker` number `i` (its cache dir is `cache-{i}`) on
    /// `port` (0: its own pick); the port it reports and the process.
    fn start_worker(&mut self, i: usize, port: u16, worker_flags: &[&str]) -> (u16, Proc) {
        while self.worker_log_paths.len() <= i {
            let n = self.worker_log_paths.len();
            self.worker_log_paths
                .push(common::log_file(&format!("worker-{n}")));
        }
        let mut cmd = Command::new(BIN);
        cmd.args(["worker", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--insecure-http"])
            .args(if worker_flags.contains(&"--auth-keys") {
                &[][..]
            } else {
                &["--no-auth"][..]
            })
            .arg("--cache-dir")
            .arg(self.dir.path().join(format!("cache-{i}")))
            .args(if worker_flags.contains(&"--cache-size") {
                &[][..]
            } else {
                &["--cache-size", "4GiB"][..]
            })
            // A write-back mount beside a worker has it write this much
            // in spare page files; the default 2 GiB per test is disk
            // time taken from the tests running beside it.
            .args(if worker_flags.contains(&"--write-spare") {
                &[][..]
            } else {
                &["--write-spare", TEST_WRITE_SPARE][..]
            })
            .args(["--s3-path-style", "--s3-endpoint"])
            .arg(format!("http://127.0.0.1:{}", self.s3_port))
            .args(worker_flags)
            .args(match &self.worker_ring {
                Some(ring) if !worker_flags.contains(&"--registry") => {
                    vec!["--registry", ring.as_str(), "--segment-size", SEGMENT]
                }
                _ => Vec::new(),
            })
            .envs(common::s3_env(ACCESS, SECRET, self.s3_port))
            // Each write-back record and upload in the log a failure prints.
            .env(
                "LAKECACHE_LOG",
                std::env::var("LAKECACHE_LOG")
                    .unwrap_or_else(|_| "info,lakecache_worker::writeback=debug".into()),
            )
            .stdin(Stdio::null());
        let mut child =
            Proc::spawn_logged(&format!("worker {i}"), &mut cmd, &self.worker_log_paths[i]);
        let got = worker_port(&mut child);
        (got, child)
    }

    /// The last lines of every worker's log, for a failure message.
    fn worker_logs(&self) -> String {
        let mut out = String::new();
        for (i, path) in self.worker_log_paths.iter().enumerate() {
            let text = fs::read_to_string(path).unwrap_or_default();
            out += &format!("--- worker {i}\n{}\n", common::tail(&text, 40));
        }
        out
    }

    /// What a failure needs to be read: free space where the test keeps
    /// its files, and the error and warning lines of the S3 endpoint and
    /// of every worker (a 500 from the endpoint names its cause only in
    /// the endpoint's own log).
    fn trouble(&self) -> String {
        let df = Command::new("df")
            .args(["-h", "--output=avail,size,target"])
            .arg(self.dir.path())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| format!("df failed: {e}\n"));
        let warnings = |text: &str| {
            let lines: Vec<&str> = text
                .lines()
                .filter(|l| l.contains(" ERROR ") || l.contains(" WARN "))
                .collect();
            lines[lines.len().saturating_sub(20)..].join("\n")
        };
        let mut out = format!(
            "--- free space\n{df}--- s3-server, errors and warnings\n{}\n",
            warnings(&self.s3_proc.log_text())
        );
        for (i, path) in self.worker_log_paths.iter().enumerate() {
            let text = fs::read_to_string(path).unwrap_or_default();
            out += &format!("--- worker {i}, errors and warnings\n{}\n", warnings(&text));
        }
        out
    }

    fn registry(&self) -> String {
        let addrs: Vec<String> = self
            .workers
            .iter()
            .map(|(p, _)| format!("127.0.0.1:{p}"))
            .collect();
        format!("static:{}", addrs.join(","))
    }

    fn mountpoint(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }

    fn mount_command(&self) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(["mount", &format!("s3://{BUCKET}")])
            .arg(self.mountpoint())
            .args([
                "--registry",
                &self.registry(),
                "--segment-size",
                SEGMENT,
                "--s3-path-style",
            ])
            .envs(common::s3_env(ACCESS, SECRET, self.s3_port));
        cmd
    }

    fn mount(&mut self) {
        self.mount_with::<&str>(&[]);
    }

    /// Mounts with `extra` flags, logging to a new log file.
    fn mount_with<S: AsRef<std::ffi::OsStr>>(&mut self, extra: &[S]) {
        let mut cmd = self.mount_command();
        cmd.args(extra);
        self.spawn_mount(&mut cmd);
        self.wait_mount_serving();
    }

    /// Waits until the mount serves, failing at once if its process exits.
    fn wait_mount_serving(&mut self) {
        let mountpoint = self.mountpoint();
        let mount = self.mount.as_mut().expect("a mount was started");
        common::wait_until(
            "the mount serving",
            Duration::from_secs(30),
            Duration::from_millis(50),
            || {
                if let Ok(Some(status)) = mount.child.try_wait() {
                    panic!(
                        "the mount exited ({status}) before serving\n{}",
                        mount.describe()
                    );
                }
                mounted_and_serving(&mountpoint)
            },
        );
    }

    /// Starts `cmd` as this environment's mount, with a new log.
    fn spawn_mount(&mut self, cmd: &mut Command) {
        self.mount_log = common::log_file("mount");
        self.mount = Some(Proc::spawn_logged(
            "mount",
            cmd.stdin(Stdio::null()),
            &self.mount_log,
        ));
    }

    fn put(&self, key: &str, data: Bytes) {
        let uri = ObjectUri::new(BUCKET, key).unwrap();
        self.rt
            .block_on(self.s3.put(&uri, data, &Default::default()))
            .unwrap();
    }

    /// The object's bytes straight from S3, or None when it is absent.
    fn s3_get(&self, key: &str) -> Option<Vec<u8>> {
        let uri = ObjectUri::new(BUCKET, key).unwrap();
        self.rt.block_on(async {
            let meta = match self.s3.head(&uri).await {
                Ok(m) => m,
                Err(StoreError::NotFound) => return None,
                Err(e) => panic!("head {key}: {e}"),
            };
            Some(
                self.s3
                    .get_range(&uri, 0..meta.size, &meta.etag)
                    .await
                    .unwrap()
                    .to_vec(),
            )
        })
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.mount_log).unwrap_or_default()
    }

    /// The index in `workers` of the worker owning the segment of `key`
    /// that holds byte `offset`, as the mount's ring computes it.
    fn owner_index(&self, key: &str, offset: u64) -> usize {
        let owner = self.rt.block_on(async {
            let addrs: Vec<String> = self
                .workers
                .iter()
                .map(|(p, _)| format!("127.0.0.1:{p}"))
                .collect();
            let membership = Arc::new(lakecache_registry::StaticMembership::new(&addrs));
            let mut options = lakecache_registry::ClusterOptions::default();
            options.ring.segment_size = 16 << 20;
            let cluster = lakecache_registry::ClusterClient::new(membership, options, None);
            let uri = ObjectUri::new(BUCKET, key).unwrap();
            cluster.owner_of(&uri, offset).unwrap().address
        });
        self.workers
            .iter()
            .position(|(p, _)| owner.ends_with(&format!(":{p}")))
            .unwrap()
    }

    /// `lakecache sync` of the whole bucket: what is written back is in S3.
    fn sync_bucket(&self, timeout_secs: u32) {
        let timeout = timeout_secs.to_string();
        let bucket = format!("s3://{BUCKET}/");
        self.cli_ok(&["sync", &bucket, "--timeout", &timeout]);
    }

    /// `lakecache ARGS --registry <this cluster>`, which must succeed.
    fn cli_ok(&self, args: &[&str]) -> std::process::Output {
        let out = Command::new(BIN)
            .args(args)
            .args(["--registry", &self.registry()])
            .output_bounded()
            .unwrap();
        assert!(
            out.status.success(),
            "lakecache {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some(mut m) = self.mount.take() {
            m.term();
        }
        if lakecache_fuse::mount::is_mounted(&self.mountpoint()) {
            let _ = lakecache_fuse::mount::force_unmount(&self.mountpoint());
        }
    }
}

/// One statfs answers both questions at once: it reaches a live FUSE
/// server (a dead mount fails with ENOTCONN), and a bare directory reports
/// its own file system's type. Two separate checks (in the mount table,
/// then not dead) raced the next client's removal of a dead mount: both
/// passed in the moment between the removal and the new mount, and a read
/// of the bare directory failed with ENOENT (soak iteration 2, e5e0435).
fn mounted_and_serving(path: &Path) -> bool {
    const FUSE_SUPER_MAGIC: libc::c_long = 0x6573_5546;
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let mut buf = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: c_path is NUL-terminated and buf is large enough for statfs.
    let rc = unsafe { libc::statfs(c_path.as_ptr(), buf.as_mut_ptr()) };
    // SAFETY: statfs filled buf when it returned 0.
    rc == 0 && unsafe { buf.assume_init() }.f_type == FUSE_SUPER_MAGIC
}

/// Mounted means serving; unmounted means gone, not merely dead.
fn wait_mounted(path: &Path, want: bool) {
    let what = format!(
        "{} becoming {}",
        path.display(),
        if want { "mounted" } else { "unmounted" }
    );
    common::wait_until(
        &what,
        Duration::from_secs(30),
        Duration::from_millis(50),
        || {
            if want {
                mounted_and_serving(path)
            } else {
                let path = path.canonicalize().unwrap_or(path.to_path_buf());
                !lakecache_fuse::mount::is_mounted(&path)
            }
        },
    );
}

/// Deterministic pseudo-random bytes.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn sha_file(path: &Path) -> std::io::Result<(u64, Vec<u8>)> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
        h.update(&buf[..n]);
    }
    Ok((total, h.finalize().to_vec()))
}

fn errno_of<T>(r: std::io::Result<T>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.raw_os_error().unwrap_or(-1),
    }
}

/// Requests of kind `op` (`stat`, `read`, ...) the worker has answered.
/// Fails when the worker does not export the count: a renamed metric
/// must not read as 0.
fn worker_requests(port: u16, op: &str) -> u64 {
    worker_requests_opt(port, op).unwrap_or_else(|e| panic!("worker on port {port}: {e}"))
}

/// [`worker_requests`] as a baseline taken before the worker may have
/// answered any such request: 0 when it has none yet. Only for a value a
/// later [`worker_requests`] reading is compared with.
fn worker_requests_baseline(port: u16, op: &str) -> u64 {
    worker_requests_opt(port, op).unwrap_or(0)
}

fn worker_requests_opt(port: u16, op: &str) -> Result<u64, String> {
    let body = reqwest_like_get(port, "/metrics");
    common::metric(
        &body,
        "lakecache_request_duration_seconds_count",
        &[("op", op)],
    )
    .map(|v| v as u64)
}

/// A bare HTTP/1.0 GET (the metrics endpoint is plain text).
fn reqwest_like_get(port: u16, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn reads_objects_from_s3_and_lists_prefixes_like_a_filesystem() {
    let mut env = Env::start(1);
    let sizes: [usize; 6] = [0, 1, 4095, (1 << 20) + 1, (17 << 20) + 5, 1 << 30];
    for (i, size) in sizes.iter().enumerate() {
        env.put(
            &format!("sizes/obj-{size}"),
            Bytes::from(pattern(*size, i as u64)),
        );
    }
    for key in ["tree/a/b/c.txt", "tree/a/d.txt", "tree/x", "tree/x/y"] {
        env.put(key, Bytes::from(key.as_bytes().to_vec()));
    }
    env.put("tree/e/", Bytes::new());
    env.rt.block_on(async {
        use futures::StreamExt;
        let s3 = env.s3.clone();
        futures::stream::iter(0..10_000)
            .map(|i| {
                let s3 = s3.clone();
                async move {
                    let uri = ObjectUri::new(BUCKET, format!("many/f{i:05}")).unwrap();
                    s3.put(&uri, Bytes::from(vec![b'x'; 100]), &Default::default())
                        .await
                        .unwrap();
                }
            })
            .buffer_unordered(64)
            .collect::<Vec<_>>()
            .await;
    });
    env.mount();
    let mnt = env.mountpoint();

    for (i, size) in sizes.iter().enumerate() {
        let path = mnt.join(format!("sizes/obj-{size}"));
        assert_eq!(fs::metadata(&path).unwrap().len(), *size as u64);
        let (n, digest) = sha_file(&path).unwrap();
        assert_eq!(n, *size as u64);
        assert_eq!(
            digest,
            Sha256::digest(pattern(*size, i as u64)).to_vec(),
            "{size}"
        );
    }

    // Directories come from prefixes: `e` from a marker, `x` shadows the
    // object of the same name, as `find` shows.
    let out = Command::new("find")
        .arg(".")
        .current_dir(mnt.join("tree"))
        .output_bounded()
        .unwrap();
    let mut found: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    found.sort();
    assert_eq!(
        found,
        [
            ".",
            "./a",
            "./a/b",
            "./a/b/c.txt",
            "./a/d.txt",
            "./e",
            "./x",
            "./x/y"
        ]
    );
    assert!(fs::metadata(mnt.join("tree/a/b")).unwrap().is_dir());
    assert_eq!(fs::metadata(mnt.join("tree/a/b/c.txt")).unwrap().len(), 14);
    assert_eq!(fs::read(mnt.join("tree/x/y")).unwrap(), b"tree/x/y");
    assert_eq!(errno_of(fs::metadata(mnt.join("tree/nope"))), libc::ENOENT);
    assert_eq!(
        errno_of(fs::read_dir(mnt.join("tree/a/d.txt"))),
        libc::ENOTDIR
    );

    // `ls -l` of 10,000 entries: names and sizes from the listing, not
    // one HEAD per file.
    let port = env.workers[0].0;
    let stats_before = worker_requests_baseline(port, "stat");
    let mut count = 0;
    for entry in fs::read_dir(mnt.join("many")).unwrap() {
        let entry = entry.unwrap();
        assert_eq!(entry.metadata().unwrap().len(), 100);
        count += 1;
    }
    let out = Command::new("ls")
        .arg("-l")
        .arg(mnt.join("many"))
        .output_bounded()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 10_001); // + "total"
    assert_eq!(count, 10_000);
    // A stat of a name no listing has shown goes to the worker: the count
    // read below is live, not a missing metric.
    assert_eq!(
        errno_of(fs::metadata(mnt.join("many/not-listed"))),
        libc::ENOENT
    );
    let stats = worker_requests(port, "stat") - stats_before;
    eprintln!("ls -l of 10,000 entries and one unlisted name: {stats} worker stat requests");
    // Measured: 2 (the unlisted name's, and one more).
    assert!(
        (1..100).contains(&stats),
        "{stats} stat requests for listing 10,000 entries and one unlisted name"
    );
}

#[test]
fn writes_renames_and_deletes_land_in_s3_and_unsupported_ops_fail_cleanly() {
    let mut env = Env::start(1);
    env.put("existing.bin", Bytes::from(pattern(3 << 20, 7)));
    env.mount();
    let mnt = env.mountpoint();
    let healthy = |env: &Env| {
        let (n, _) = sha_file(&env.mountpoint().join("existing.bin")).unwrap();
        assert_eq!(n, 3 << 20, "mount unhealthy; log:\n{}", env.log());
    };

    // Write, close, read back; the bytes are in S3 when close returns.
    let data = pattern(9 << 20, 1);
    fs::write(mnt.join("ckpt.bin"), &data).unwrap();
    assert_eq!(env.s3_get("ckpt.bin").as_deref(), Some(&data[..]));
    assert_eq!(fs::read(mnt.join("ckpt.bin")).unwrap(), data);
    // Overwrite with O_TRUNC.
    fs::write(mnt.join("ckpt.bin"), b"short").unwrap();
    assert_eq!(fs::read(mnt.join("ckpt.bin")).unwrap(), b"short");
    assert_eq!(env.s3_get("ckpt.bin").unwrap(), b"short");

    // Write a temp file, rename it over the final name.
    fs::write(mnt.join("model.tmp"), &data).unwrap();
    fs::rename(mnt.join("model.tmp"), mnt.join("ckpt.bin")).unwrap();
    assert!(env.s3_get("model.tmp").is_none());
    assert_eq!(env.s3_get("ckpt.bin").as_deref(), Some(&data[..]));
    assert_eq!(fs::read(mnt.join("ckpt.bin")).unwrap(), data);

    // mkdir, nested write, rmdir refusing then succeeding, unlink.
    fs::create_dir(mnt.join("run1")).unwrap();
    assert_eq!(env.s3_get("run1/"), Some(Vec::new()));
    fs::write(mnt.join("run1/latest"), b"step10").unwrap();
    assert_eq!(errno_of(fs::remove_dir(mnt.join("run1"))), libc::ENOTEMPTY);
    // A directory with files moves object by object.
    fs::rename(mnt.join("run1"), mnt.join("run2")).unwrap();
    assert_eq!(env.s3_get("run2/latest").unwrap(), b"step10");
    assert!(env.s3_get("run1/latest").is_none() && env.s3_get("run1/").is_none());
    fs::rename(mnt.join("run2"), mnt.join("run1")).unwrap();
    assert_eq!(fs::read(mnt.join("run1/latest")).unwrap(), b"step10");
    fs::remove_file(mnt.join("run1/latest")).unwrap();
    assert!(env.s3_get("run1/latest").is_none());
    fs::create_dir(mnt.join("empty")).unwrap();
    fs::rename(mnt.join("empty"), mnt.join("moved")).unwrap();
    assert!(fs::metadata(mnt.join("moved")).unwrap().is_dir());
    assert_eq!(env.s3_get("moved/"), Some(Vec::new()));
    fs::remove_dir(mnt.join("moved")).unwrap();
    fs::remove_dir(mnt.join("run1")).unwrap();
    assert!(env.s3_get("run1/").is_none());
    assert_eq!(errno_of(fs::metadata(mnt.join("run1"))), libc::ENOENT);

    // Python: plain writes, torch.save-like streaming writes and a
    // safetensors-like header + buffers followed by os.replace.
    let script = r#"
import json, os, struct, sys
d = sys.argv[1]
with open(os.path.join(d, "plain.txt"), "w") as f:
    f.write("hello from python\n")
with open(os.path.join(d, "stream.pt"), "wb") as f:
    for i in range(2000):
        f.write(bytes([i % 251]) * 4093)
tensors = {"w": bytes(range(256)) * 8192, "b": b"\x01" * 12345}
header, offset = {}, 0
for name, buf in tensors.items():
    header[name] = {"dtype": "U8", "shape": [len(buf)], "data_offsets": [offset, offset + len(buf)]}
    offset += len(buf)
h = json.dumps(header).encode()
tmp = os.path.join(d, "model.safetensors.tmp")
with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(h)))
    f.write(h)
    for buf in tensors.values():
        f.write(buf)
    f.flush()
    os.fsync(f.fileno())
os.replace(tmp, os.path.join(d, "model.safetensors"))
# np.savez's pattern: zipfile streams an entry, then seeks back to patch
# its local header with the sizes and CRC (3 MiB: the upload is already
# streaming when the patch comes).
import zipfile
with zipfile.ZipFile(os.path.join(d, "arrays.npz"), "w") as z:
    with z.open("x.npy", "w", force_zip64=True) as f:
        for i in range(48):
            f.write(bytes([i]) * 65536)
"#;
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(&mnt)
        .output_bounded()
        .unwrap();
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(env.s3_get("plain.txt").unwrap(), b"hello from python\n");
    let stream: Vec<u8> = (0..2000u32)
        .flat_map(|i| vec![(i % 251) as u8; 4093])
        .collect();
    assert_eq!(env.s3_get("stream.pt").unwrap(), stream);
    let st = env.s3_get("model.safetensors").unwrap();
    let hlen = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    assert_eq!(st.len(), 8 + hlen + 256 * 8192 + 12345);
    assert!(env.s3_get("model.safetensors.tmp").is_none());
    // The archive in S3 is whole: its header patched, its entry intact.
    let npz = env.dir.path().join("arrays-from-s3.npz");
    fs::write(&npz, env.s3_get("arrays.npz").expect("arrays.npz in S3")).unwrap();
    let check = Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); assert z.testzip() is None; \
             assert z.read('x.npy') == b''.join(bytes([i]) * 65536 for i in range(48))",
        ])
        .arg(&npz)
        .output_bounded()
        .unwrap();
    assert!(
        check.status.success(),
        "the zip written through the mount is not whole in S3: {}",
        String::from_utf8_lossy(&check.stderr)
    );

    // In-place changes of an existing object (appends, writes at an
    // offset, truncate, chmod): it is copied to a local spool on the
    // first change and uploaded whole on close.
    env.put("edit.bin", Bytes::from(pattern(2 << 20, 3)));
    let edit = mnt.join("edit.bin");
    let mut want = pattern(2 << 20, 3);
    {
        let mut f = OpenOptions::new().append(true).open(&edit).unwrap();
        f.write_all(b"tail").unwrap();
    }
    want.extend_from_slice(b"tail");
    assert_eq!(env.s3_get("edit.bin").unwrap(), want);
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(&edit)
        .and_then(|f| f.write_at(b"XY", 1000))
        .unwrap();
    want[1000..1002].copy_from_slice(b"XY");
    assert_eq!(fs::read(&edit).unwrap(), want);
    assert_eq!(env.s3_get("edit.bin").unwrap(), want);
    OpenOptions::new()
        .write(true)
        .open(&edit)
        .unwrap()
        .set_len(5)
        .unwrap();
    assert_eq!(env.s3_get("edit.bin").unwrap(), &want[..5]);
    fs::set_permissions(&edit, fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        fs::metadata(&edit).unwrap().permissions().mode() & 0o7777,
        0o600
    );

    // Unsupported operations: a specific errno each, and the mount stays up.
    let existing = mnt.join("existing.bin");
    // A write past the end leaves a hole of zeros (the file moves off its
    // streamed upload to a spool file; so do writes behind the end).
    {
        let f = File::create(mnt.join("random.bin")).unwrap();
        f.write_at(b"abc", 0).unwrap();
        f.write_at(b"zzz", 1 << 20).unwrap();
    }
    let mut holed = vec![0u8; (1 << 20) + 3];
    holed[..3].copy_from_slice(b"abc");
    holed[1 << 20..].copy_from_slice(b"zzz");
    assert!(
        env.s3_get("random.bin").unwrap() == holed,
        "random.bin in S3"
    );
    let cases: Vec<(&str, i32, i32)> = vec![
        (
            "read while being written",
            {
                let _w = File::create(mnt.join("busy.bin")).unwrap();
                errno_of(File::open(mnt.join("busy.bin")))
            },
            libc::EBUSY,
        ),
        (
            "hard link",
            errno_of(fs::hard_link(&existing, mnt.join("hard"))),
            libc::EPERM,
        ),
        (
            "setxattr",
            {
                let c = std::ffi::CString::new(existing.as_os_str().as_encoded_bytes()).unwrap();
                // SAFETY: valid strings and buffer.
                let rc = unsafe {
                    libc::setxattr(c.as_ptr(), c"user.k".as_ptr(), b"v".as_ptr().cast(), 1, 0)
                };
                if rc == 0 {
                    0
                } else {
                    std::io::Error::last_os_error().raw_os_error().unwrap()
                }
            },
            libc::EOPNOTSUPP,
        ),
        (
            "fallocate",
            {
                let f = File::create(mnt.join("falloc.bin")).unwrap();
                // SAFETY: valid descriptor.
                let rc =
                    unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, 4096) };
                if rc == 0 {
                    0
                } else {
                    std::io::Error::last_os_error().raw_os_error().unwrap()
                }
            },
            libc::EOPNOTSUPP,
        ),
        (
            "rmdir of a file",
            errno_of(fs::remove_dir(&existing)),
            libc::ENOTDIR,
        ),
        (
            "unlink of a directory",
            {
                fs::create_dir(mnt.join("adir")).unwrap();
                errno_of(fs::remove_file(mnt.join("adir")))
            },
            libc::EISDIR,
        ),
        (
            "mkdir over an existing name",
            errno_of(fs::create_dir(mnt.join("adir"))),
            libc::EEXIST,
        ),
        (
            "non-UTF-8 name",
            errno_of(File::create(
                mnt.join(std::ffi::OsStr::from_bytes(b"bad\xff")),
            )),
            libc::EINVAL,
        ),
    ];
    let mut failures = Vec::new();
    for (what, got, want) in &cases {
        if got != want {
            failures.push(format!("{what}: errno {got}, want {want}"));
        }
        healthy(&env);
    }
    assert!(failures.is_empty(), "{failures:#?}\nlog:\n{}", env.log());
    // Refused writes left the object intact.
    assert_eq!(env.s3_get("existing.bin").unwrap(), pattern(3 << 20, 7));

    // fio writes a file and verifies it (crc32c) through the mount.
    let job = Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/fio/verify-write.fio");
    let scratch = tempfile::tempdir().unwrap();
    let out = Command::new("fio")
        .arg(&job)
        .current_dir(scratch.path())
        .env("LAKECACHE_FIO_DIR", &mnt)
        .env("LAKECACHE_FIO_SIZE", "64M")
        .output_bounded()
        .expect("fio (scripts/deps.sh installs it)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("err= 0"),
        "fio failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        env.s3_get("fio-verify.0.0").map(|b| b.len()),
        Some(64 << 20)
    );
}

#[test]
fn a_worker_killed_during_a_read_through_the_mount_costs_no_io_error() {
    read_through_a_worker_failure(false);
}

#[test]
fn a_worker_hung_during_a_read_through_the_mount_costs_seconds() {
    let took = read_through_a_worker_failure(true);
    eprintln!("384 MiB through the mount with a worker stopped: {took:?}");
    // Before progress deadlines, each request to the stopped worker waited
    // out the 60 s request timeout (measured: 5.9 s, machine loaded).
    assert!(
        took < common::scaled(Duration::from_secs(25)),
        "a hung worker stalled the mount for {took:?}"
    );
}

/// Reads 384 MiB through the mount while the owner of a later segment is
/// killed (or stopped: hung, socket open, silent); returns the read time.
fn read_through_a_worker_failure(hang: bool) -> Duration {
    let mut env = Env::start(3);
    let size = 384usize << 20;
    let data = pattern(size, 99);
    let want = Sha256::digest(&data).to_vec();
    env.put("big.bin", Bytes::from(data));
    env.mount();
    // The owner of a segment well ahead of where the kill happens.
    let victim = env.owner_index("big.bin", 20 << 24);

    let started = Instant::now();
    let mut f = File::open(env.mountpoint().join("big.bin")).unwrap();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0usize;
    let mut failed = false;
    let pid = env.workers[victim].1.id().to_string();
    loop {
        let n = f.read(&mut buf).expect("read through the mount");
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        total += n;
        if !failed && total >= 96 << 20 {
            if hang {
                Command::new("kill").args(["-STOP", &pid]).status().unwrap();
            } else {
                env.workers[victim].1.kill9();
            }
            failed = true;
        }
    }
    let took = started.elapsed();
    if hang {
        Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    }
    eprintln!(
        "384 MiB through the mount, owner {} mid-read: {took:?}",
        if hang { "stopped" } else { "killed" }
    );
    assert!(failed);
    assert_eq!(total, size);
    assert_eq!(h.finalize().to_vec(), want);
    took
}

/// No such process, or only a zombie left for its parent to reap.
fn process_gone(pid: &str) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // "PID (COMM) STATE ...": the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

fn mount_pids(mountpoint: &Path) -> Vec<String> {
    let out = Command::new("pgrep")
        .args([
            "-f",
            &format!("(fusermount3|mount-guard).*{}", mountpoint.display()),
        ])
        .output_bounded()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect()
}

#[test]
fn sigterm_unmounts_and_a_killed_client_leaves_no_dead_mount() {
    let mut env = Env::start(1);
    env.put("hello.txt", Bytes::from_static(b"hi\n"));
    let mnt = env.mountpoint();

    env.mount();
    assert_eq!(fs::read(mnt.join("hello.txt")).unwrap(), b"hi\n");
    let status = env.mount.take().unwrap().term().unwrap();
    assert!(status.success(), "mount exited with {status}");
    wait_mounted(&mnt, false);

    // Unmounted from outside, as a benchmark harness does: the client
    // exits cleanly, without a panic.
    env.mount();
    let out = Command::new("fusermount3")
        .arg("-u")
        .arg(&mnt)
        .output_bounded()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut client = env.mount.take().unwrap();
    let status = client.child.wait().unwrap();
    assert!(
        status.success(),
        "mount exited with {status}: {}",
        env.log()
    );
    assert!(!env.log().contains("panicked"), "{}", env.log());
    wait_mounted(&mnt, false);

    // SIGKILL: fusermount3's auto_unmount releases the mount.
    env.mount();
    env.mount.take().unwrap().kill9();
    wait_mounted(&mnt, false);
    assert!(!lakecache_fuse::mount::is_dead_mount(&mnt));

    // Killing the helpers too (fusermount3 and the guard) leaves a dead
    // mount; the next mount clears it.
    env.mount();
    let helpers = mount_pids(&mnt.canonicalize().unwrap());
    for pid in &helpers {
        let _ = Command::new("kill").args(["-KILL", pid]).status();
    }
    // The helpers must be gone before their client dies, or they still
    // unmount.
    common::wait_until(
        "the mount's helpers exiting",
        Duration::from_secs(20),
        Duration::from_millis(20),
        || helpers.iter().all(|pid| process_gone(pid)),
    );
    env.mount.take().unwrap().kill9();
    if !helpers.is_empty() {
        assert!(
            lakecache_fuse::mount::is_dead_mount(&mnt),
            "expected a dead mount after killing {helpers:?}: {:?}",
            fs::metadata(&mnt)
        );
    }
    env.mount();
    assert_eq!(fs::read(mnt.join("hello.txt")).unwrap(), b"hi\n");
    env.mount.take().unwrap().term();
    wait_mounted(&mnt, false);

    // --daemon returns once mounted; the detached process serves on.
    let out = env
        .mount_command()
        .arg("--daemon")
        .arg("--log-file")
        .arg(env.dir.path().join("daemon.log"))
        .output_bounded()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let pid = stdout
        .split("pid ")
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
        .expect("pid printed")
        .to_string();
    assert_eq!(fs::read(mnt.join("hello.txt")).unwrap(), b"hi\n");
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    wait_mounted(&mnt, false);

    // Bad input at the CLI: clear errors, nothing mounted.
    let out = Command::new(BIN)
        .args(["mount", "http://x", "/tmp/nowhere"])
        .output_bounded()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected s3://bucket"));
    let out = env
        .mount_command()
        .arg("--readahead-chunk")
        .arg("0")
        .output_bounded()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--readahead-chunk"));
}

#[test]
fn listings_without_etags_and_objects_changed_after_ls_read_right() {
    // A store whose listings carry no ETag, 2,000 small files, some of
    // them overwritten between `ls -l` and `open`: every read returns the
    // object's current bytes, on the first pass and the second.
    let mut env = Env::start_with(1, &["--list-without-etags"]);
    let body = |i: usize, version: usize| format!("v{version}-{i:05}").into_bytes();
    let mut version = vec![1usize; 2000];
    for (i, v) in version.iter().enumerate() {
        env.put(&format!("small/f{i:05}"), Bytes::from(body(i, *v)));
    }
    env.mount();
    let dir = env.mountpoint().join("small");
    for pass in 0..2 {
        let mut listed = 0;
        for entry in fs::read_dir(&dir).unwrap() {
            let meta = entry.unwrap().metadata().unwrap();
            assert!(meta.is_file());
            listed += 1;
        }
        assert_eq!(listed, 2000, "pass {pass}");
        // Overwritten between `ls` and `open` on the first pass; the second
        // pass (a listing from the mount's cache, still without ETags) must
        // read the same current versions, not fail with ESTALE.
        for i in (0..2000).step_by(if pass == 0 { 10 } else { usize::MAX }) {
            if pass > 0 {
                break;
            }
            version[i] += 1;
            env.put(&format!("small/f{i:05}"), Bytes::from(body(i, version[i])));
        }
        for (i, v) in version.iter().enumerate() {
            let got = fs::read(dir.join(format!("f{i:05}")))
                .unwrap_or_else(|e| panic!("pass {pass}: reading f{i:05}: {e}\n{}", env.log()));
            assert_eq!(got, body(i, *v), "pass {pass}: f{i:05}");
        }
    }
}

/// `lakecache token ...` in `dir`; returns the file written.
fn token_file(dir: &Path, name: &str, args: &[&str]) -> PathBuf {
    let keys = dir.join("keys");
    if !keys.exists() {
        let out = Command::new(BIN)
            .args(["token", "keygen", "--out"])
            .arg(&keys)
            .output_bounded()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = Command::new(BIN)
        .args(["token", "create", "--keys"])
        .arg(&keys)
        .args(args)
        .output_bounded()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = dir.join(name);
    fs::write(&path, &out.stdout).unwrap();
    path
}

#[test]
fn a_mount_can_do_what_its_token_allows_and_nothing_else() {
    let keys_dir = tempfile::tempdir().unwrap();
    let read_only = token_file(
        keys_dir.path(),
        "ro.token",
        &["--tenant", "readers", "--allow", &format!("s3://{BUCKET}/")],
    );
    let ckpt_writer = token_file(
        keys_dir.path(),
        "rw.token",
        &[
            "--tenant",
            "team-a",
            "--allow",
            &format!("s3://{BUCKET}/"),
            "--allow-write",
            &format!("s3://{BUCKET}/ckpt/"),
        ],
    );
    let keys = keys_dir.path().join("keys");
    let mut env = Env::start_full(1, &[], &["--auth-keys", keys.to_str().unwrap()]);
    env.put("ckpt/a.pt", Bytes::from_static(b"weights"));

    // No token: the mount refuses to start and says why.
    let out = env.mount_command().output_bounded().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("requires a token"), "{err}");

    // Read-only: reads work, every write is EACCES, S3 is untouched.
    let mut cmd = env.mount_command();
    cmd.arg("--token-file").arg(&read_only);
    env.spawn_mount(&mut cmd);
    env.wait_mount_serving();
    let mnt = env.mountpoint();
    assert_eq!(fs::read(mnt.join("ckpt/a.pt")).unwrap(), b"weights");
    assert_eq!(
        errno_of(fs::write(mnt.join("ckpt/a.pt"), b"evil")),
        libc::EACCES
    );
    assert_eq!(
        errno_of(fs::write(mnt.join("ckpt/new.pt"), b"x")),
        libc::EACCES
    );
    assert_eq!(
        errno_of(fs::remove_file(mnt.join("ckpt/a.pt"))),
        libc::EACCES
    );
    assert_eq!(env.s3_get("ckpt/a.pt").as_deref(), Some(&b"weights"[..]));
    assert_eq!(env.s3_get("ckpt/new.pt"), None);
    env.mount.take().unwrap().term();
    wait_mounted(&mnt, false);

    // Checkpoint writer: writes under ckpt/ only.
    let mut cmd = env.mount_command();
    cmd.arg("--token-file").arg(&ckpt_writer);
    env.spawn_mount(&mut cmd);
    env.wait_mount_serving();
    fs::write(mnt.join("ckpt/new.pt"), b"step 2").unwrap();
    assert_eq!(env.s3_get("ckpt/new.pt").as_deref(), Some(&b"step 2"[..]));
    assert_eq!(
        errno_of(fs::write(mnt.join("elsewhere.bin"), b"x")),
        libc::EACCES
    );
    assert_eq!(env.s3_get("elsewhere.bin"), None);
}

#[path = "mount/dir_prefetch.rs"]
mod dir_prefetch;
#[path = "mount/local_commit.rs"]
mod local_commit;
#[path = "mount/local_socket.rs"]
mod local_socket;
#[path = "mount/local_tier.rs"]
mod local_tier;
#[path = "mount/observability.rs"]
mod observability;
#[path = "mount/posix.rs"]
mod posix;
#[path = "mount/sample_reads.rs"]
mod sample_reads;
#[path = "mount/snapshot.rs"]
mod snapshot;
#[path = "mount/tier_clients.rs"]
mod tier_clients;
#[path = "mount/tier_completion.rs"]
mod tier_completion;
#[path = "mount/tier_damage.rs"]
mod tier_damage;
#[path = "mount/tier_refusals.rs"]
mod tier_refusals;
#[path = "mount/write_stall.rs"]
mod write_stall;
#[path = "mount/writeback.rs"]
mod writeback;
