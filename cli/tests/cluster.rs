//! Cluster tests with real processes: Debian's etcd, the embedded S3
//! endpoint (`lakecache s3-server`) and `lakecache worker`s registered in
//! etcd; clients are the `lakecache` CLI and the registry library.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lakecache_protocol::member_sig::MemberTrust;
use lakecache_protocol::{ObjectUri, WorkerClient};
use lakecache_registry::{ClusterClient, ClusterOptions, EtcdMembership, Membership};
use sha2::{Digest, Sha256};

mod common;
use common::{start_s3, worker_port, OutputBounded, Proc, BIN};

const ACCESS: &str = "cluster-test";
const SECRET: &str = "cluster-test-secret";
const PREFIX: &str = "/lctest";
const TTL_SECS: u64 = 2;

/// Every cluster runs as production would: workers over TLS with signing
/// keys, signed registrations, and clients with a CA and a token.
struct Security {
    keys: std::path::PathBuf,
    token_file: std::path::PathBuf,
    pki: lakecache_protocol::testing::TestPki,
}

impl Security {
    fn create(dir: &Path) -> Security {
        let pki = lakecache_protocol::testing::TestPki::create(dir).unwrap();
        let keys = dir.join("keys");
        let ok = |out: std::process::Output| {
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            out.stdout
        };
        ok(Command::new(BIN)
            .args(["token", "keygen", "--out"])
            .arg(&keys)
            .output_bounded()
            .unwrap());
        let token = ok(Command::new(BIN)
            .args(["token", "create", "--keys"])
            .arg(&keys)
            .args(["--tenant", "tests", "--allow-write", "s3://data/"])
            .output_bounded()
            .unwrap());
        let token_file = dir.join("token");
        std::fs::write(&token_file, token).unwrap();
        Security {
            keys,
            token_file,
            pki,
        }
    }

    fn token(&self) -> String {
        std::fs::read_to_string(&self.token_file)
            .unwrap()
            .trim()
            .to_string()
    }

    fn client_tls(&self) -> lakecache_protocol::tls::ClientTls {
        lakecache_protocol::tls::ClientTls::load(&self.pki.ca, None).unwrap()
    }
}

/// Fields drop in order: processes stop before their directory goes.
struct Cluster {
    sec: Security,
    etcd: Proc,
    etcd_port: u16,
    s3_port: u16,
    _s3: Proc,
    workers: Vec<(String, u16, Proc)>,
    /// Each worker id's log, appended across restarts.
    worker_logs: std::collections::HashMap<String, std::path::PathBuf>,
    dir: tempfile::TempDir,
}

/// Debian's etcd on ports it picks itself, read back from its log. Its
/// fsyncs are off: it is a fixture here, not the durability under test,
/// and a loaded disk made it miss its start deadline.
fn start_etcd(dir: &Path) -> (Proc, u16) {
    start_etcd_with(dir, "lctest", "http", &[])
}

/// [`start_etcd`] with a name, the client URL scheme and extra flags.
fn start_etcd_with(
    dir: &Path,
    name: &str,
    scheme: &str,
    extra: &[std::ffi::OsString],
) -> (Proc, u16) {
    let mut proc = Proc::spawn(
        "etcd",
        Command::new("etcd")
            .args(["--name", name, "--data-dir"])
            .arg(dir.join(name))
            .arg(format!("--listen-client-urls={scheme}://127.0.0.1:0"))
            .arg(format!("--advertise-client-urls={scheme}://127.0.0.1:0"))
            .arg("--listen-peer-urls=http://127.0.0.1:0")
            .arg("--initial-advertise-peer-urls=http://127.0.0.1:0")
            .arg(format!("--initial-cluster={name}=http://127.0.0.1:0"))
            .arg("--unsafe-no-fsync")
            .args(extra)
            .stdin(Stdio::null()),
    );
    let port = proc.wait_for_port("client requests on", Duration::from_secs(60));
    (proc, port)
}

impl Cluster {
    fn start(workers: usize) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let (etcd, etcd_port) = start_etcd(dir.path());
        let (s3, s3_port) = start_s3(&dir.path().join("s3"), ACCESS, SECRET, "data");
        let sec_dir = dir.path().join("sec");
        std::fs::create_dir(&sec_dir).unwrap();
        let mut cluster = Cluster {
            sec: Security::create(&sec_dir),
            dir,
            etcd,
            etcd_port,
            s3_port,
            _s3: s3,
            workers: Vec::new(),
            worker_logs: Default::default(),
        };
        for i in 0..workers {
            cluster.add_worker(&format!("w{i}"), None);
        }
        cluster
    }

    /// The registry library's view of this cluster's etcd.
    async fn etcd_membership(&self) -> EtcdMembership {
        let endpoint = format!("http://127.0.0.1:{}", self.etcd_port);
        let access = lakecache_registry::EtcdAccess {
            trust: MemberTrust::from_token(&self.sec.token()).unwrap(),
            ..Default::default()
        };
        EtcdMembership::connect(
            vec![endpoint],
            PREFIX.into(),
            access,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
    }

    fn registry(&self) -> String {
        format!("etcd://127.0.0.1:{}{PREFIX}", self.etcd_port)
    }

    fn add_worker(&mut self, id: &str, port: Option<u16>) -> u16 {
        let extra = [
            "--cache-size".to_string(),
            "4GiB".into(),
            "--s3-endpoint".into(),
            format!("http://127.0.0.1:{}", self.s3_port),
            "--s3-path-style".into(),
            "--lease-ttl".into(),
            format!("{TTL_SECS}s"),
        ];
        // A restart passes the port back: see `unused_port`.
        self.spawn_worker(id, port.unwrap_or_else(common::unused_port), &extra)
    }

    /// Flags that make a worker production-like: keys, TLS, peer CA.
    fn worker_security(&self) -> Vec<std::ffi::OsString> {
        let p = &self.sec.pki;
        vec![
            "--auth-keys".into(),
            self.sec.keys.clone().into(),
            "--tls-cert".into(),
            p.cert.clone().into(),
            "--tls-key".into(),
            p.key.clone().into(),
            "--tls-ca".into(),
            p.ca.clone().into(),
        ]
    }

    /// S3 credentials plus the clients' CA and token (workers ignore the
    /// token variable).
    fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = s3_env(self.s3_port);
        env.push(("LAKECACHE_TLS_CA", self.sec.pki.ca.display().to_string()));
        env.push((
            "LAKECACHE_TOKEN_FILE",
            self.sec.token_file.display().to_string(),
        ));
        env
    }

    fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(BIN)
            .args(args)
            .envs(self.env())
            .output_bounded()
            .unwrap()
    }

    /// A direct client of one worker, with the cluster's CA and token.
    /// The request timeout is at least 60 s (scaled): these clients fail a
    /// test only when a worker hangs, and a loaded disk made a 10 s one
    /// expire on a healthy worker.
    fn worker_client(&self, port: u16, timeout: Duration) -> WorkerClient {
        let timeout = common::scaled(timeout.max(Duration::from_secs(60)));
        WorkerClient::connect(
            &format!("127.0.0.1:{port}"),
            lakecache_protocol::Deadlines::uniform(timeout),
            Some(&self.sec.client_tls()),
        )
        .unwrap()
        .with_token(Some(&self.sec.token()))
        .unwrap()
    }

    /// Cluster-client options with the cluster's CA and token.
    fn options(&self) -> ClusterOptions {
        ClusterOptions {
            tls: Some(self.sec.client_tls()),
            token: Some(self.sec.token()),
            ..Default::default()
        }
    }

    /// Starts worker `id` with the cluster's security flags plus `extra`
    /// (etcd credentials), registered under `id`.
    fn add_worker_with(&mut self, id: &str, extra: &[String]) {
        self.spawn_worker(id, 0, extra);
    }

    /// Starts worker `id` on `port` (0: its own pick) with the cluster's
    /// security flags and registry plus `extra`; returns the port it
    /// reports once it listens.
    fn spawn_worker(&mut self, id: &str, port: u16, extra: &[String]) -> u16 {
        let log = self
            .worker_logs
            .entry(id.to_string())
            .or_insert_with(|| common::log_file(&format!("worker-{id}")))
            .clone();
        let mut cmd = Command::new(BIN);
        cmd.args([
            "worker",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--cache-dir",
        ])
        .arg(self.dir.path().join(format!("cache-{id}")))
        .args(self.worker_security())
        .args(["--registry", &self.registry(), "--worker-id", id])
        .args(extra)
        .envs(self.env())
        .stdin(Stdio::null());
        let mut worker = Proc::spawn_logged(&format!("worker {id}"), &mut cmd, &log);
        let port = worker_port(&mut worker);
        self.workers.push((id.to_string(), port, worker));
        port
    }

    /// Waits until `status` run with `extra` lists `id`.
    fn wait_listed(&self, id: &str, extra: &[String]) {
        let registry = self.registry();
        let mut args = vec!["status", "--json", "--registry", &registry];
        args.extend(extra.iter().map(String::as_str));
        let deadline = common::deadline_in(Duration::from_secs(15));
        loop {
            let out = self.cli(&args);
            if out.status.success()
                && String::from_utf8_lossy(&out.stdout).contains(&format!("\"{id}\""))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{id} never listed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Every child's log, for a failure message that is not a panic
    /// unwinding through them.
    fn logs(&self) -> String {
        let mut out = self.etcd.describe();
        for (_, _, w) in &self.workers {
            out += "\n";
            out += &w.describe();
        }
        out
    }

    fn worker_mut(&mut self, id: &str) -> &mut Proc {
        &mut self.workers.iter_mut().find(|(w, _, _)| w == id).unwrap().2
    }

    /// Member ids registered in etcd, as `lakecache status` lists them
    /// (live or not: liveness is probed separately).
    fn members(&self) -> Vec<String> {
        let out = self.cli(&["status", "--json", "--registry", &self.registry()]);
        assert!(
            out.status.success(),
            "status failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut ids: Vec<String> = json["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect();
        ids.sort();
        ids
    }

    fn wait_members(&self, want: &[&str], within: Duration) -> Duration {
        let started = Instant::now();
        loop {
            let got = self.members();
            if got == want {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < common::scaled(within),
                "members {got:?}, wanted {want:?} within {:?}\n{}",
                common::scaled(within),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

fn s3_env(s3_port: u16) -> Vec<(&'static str, String)> {
    common::s3_env(ACCESS, SECRET, s3_port)
}

#[test]
fn members_join_and_leave_within_the_lease_ttl() {
    let mut c = Cluster::start(3);
    c.wait_members(&["w0", "w1", "w2"], Duration::from_secs(15));
    c.add_worker("w3", None);
    c.wait_members(&["w0", "w1", "w2", "w3"], Duration::from_secs(5));
    // A crashed worker stops heart-beating and leaves within the TTL.
    c.worker_mut("w3").kill9();
    // Measured: 2.4 s with a 2 s TTL.
    let took = c.wait_members(&["w0", "w1", "w2"], Duration::from_secs(TTL_SECS * 3 + 3));
    eprintln!("killed worker left the view after {took:?} (TTL {TTL_SECS}s)");
    // A stopped worker revokes its lease and leaves at once.
    let _ = c.worker_mut("w2").term();
    c.wait_members(&["w0", "w1"], Duration::from_secs(3));
}

/// Deterministic test data, streamed without holding 1 GiB in memory.
fn block(i: u64) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(1 << 20);
    while out.len() < 1 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Uploads `mib` MiB of [`block`]s through the cluster with `lakecache
/// put`; returns the SHA-256 of what was sent.
fn put_streamed(c: &Cluster, key: &str, mib: u64) -> String {
    let mut put = Command::new(BIN)
        .args([
            "put",
            &format!("s3://data/{key}"),
            "--registry",
            &c.registry(),
        ])
        .envs(c.env())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut expected = Sha256::new();
    {
        use std::io::Write;
        let mut stdin = put.stdin.take().unwrap();
        for i in 0..mib {
            let b = block(i);
            expected.update(&b);
            // A put that exits early says why below.
            if stdin.write_all(&b).is_err() {
                break;
            }
        }
    }
    let out = put.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "put failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    hex(&expected.finalize())
}

/// The id of the worker owning each 64 MiB segment of `uri`.
fn segment_owners(c: &Cluster, uri: &str, segments: u64) -> Vec<String> {
    segment_replicas(c, uri, segments, 1)
        .into_iter()
        .map(|mut holders| holders.remove(0))
        .collect()
}

/// The ids of the first `copies` workers on the ring for each segment.
fn segment_replicas(c: &Cluster, uri: &str, segments: u64, copies: usize) -> Vec<Vec<String>> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let m = c.etcd_membership().await;
        let client = ClusterClient::new(Arc::new(m), c.options(), None);
        let uri: ObjectUri = uri.parse().unwrap();
        (0..segments)
            .map(|s| {
                client
                    .replicas_of(&uri, s, copies)
                    .into_iter()
                    .map(|m| m.id)
                    .collect()
            })
            .collect()
    })
}

#[test]
fn a_hung_worker_costs_seconds_not_a_minute() {
    const MIB: u64 = 1 << 20;
    const SIZE_MIB: u64 = 512;
    let mut c = Cluster::start(3);
    c.wait_members(&["w0", "w1", "w2"], Duration::from_secs(15));
    let expected = put_streamed(&c, "hang.bin", SIZE_MIB);
    let owners = segment_owners(&c, "s3://data/hang.bin", SIZE_MIB / 64);
    // A worker owning segments in the second half of the object.
    let victim = owners[4..]
        .iter()
        .find(|o| **o != owners[0])
        .unwrap()
        .clone();

    // The default timeouts of `cat`: whole requests 60 s, progress 2 s.
    let started = Instant::now();
    let mut cat = Command::new(BIN)
        .args(["cat", "s3://data/hang.bin", "--registry", &c.registry()])
        .envs(c.env())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = cat.stdout.take().unwrap();
    let mut got = Sha256::new();
    let (mut total, mut stopped) = (0u64, false);
    let mut buf = vec![0u8; 1 << 20];
    let pid = c.worker_mut(&victim).id().to_string();
    loop {
        let n = stdout.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        got.update(&buf[..n]);
        total += n as u64;
        if !stopped && total >= 64 * MIB {
            // Hung, not dead: the socket stays open and says nothing.
            Command::new("kill").args(["-STOP", &pid]).status().unwrap();
            stopped = true;
        }
    }
    let took = started.elapsed();
    let status = cat.wait().unwrap();
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    let mut err = String::new();
    cat.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    eprintln!("512 MiB with {victim} stopped mid-read: {took:?}");
    assert!(stopped);
    assert!(status.success(), "cat failed with {victim} hung: {err}");
    assert_eq!(total, SIZE_MIB * MIB);
    assert_eq!(hex(&got.finalize()), expected, "bytes differ");
    assert!(
        // The 2 s progress deadline, once per hung request (measured: 7.9 s
        // with another test run loading the machine).
        took < common::scaled(Duration::from_secs(20)),
        "a hung worker stalled the read for {took:?}"
    );
}

/// Sum of the metric lines starting with `name` over all workers. Fails
/// when no worker exports it: a renamed metric must not read as 0.
fn workers_metric(c: &Cluster, name: &str) -> f64 {
    workers_metric_opt(c, name)
        .unwrap_or_else(|| panic!("no worker exports a metric named {name}*"))
}

/// [`workers_metric`] as a baseline taken before anything could record
/// it: 0 when no worker has it yet. Only for a value a later
/// [`workers_metric`] reading is compared with.
fn workers_metric_baseline(c: &Cluster, name: &str) -> f64 {
    workers_metric_opt(c, name).unwrap_or(0.0)
}

fn workers_metric_opt(c: &Cluster, name: &str) -> Option<f64> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut sum = None;
        for (_, port, _) in &c.workers {
            let client = c.worker_client(*port, Duration::from_secs(5));
            let text = client.metrics().await.unwrap();
            for line in text.lines().filter(|l| l.starts_with(name)) {
                let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
                let value = value.unwrap_or_else(|| panic!("unreadable metric line {line:?}"));
                *sum.get_or_insert(0.0) += value;
            }
        }
        sum
    })
}

#[test]
fn written_segments_are_handed_to_their_owners_and_read_without_s3() {
    const SIZE_MIB: u64 = 256;
    let c = Cluster::start(3);
    c.wait_members(&["w0", "w1", "w2"], Duration::from_secs(15));
    let expected = put_streamed(&c, "ckpt.bin", SIZE_MIB);
    let owners = segment_owners(&c, "s3://data/ckpt.bin", SIZE_MIB / 64);
    // 8 MiB pages (the default): 8 per segment the writer (segment 0's
    // owner) hands on.
    let foreign = owners.iter().filter(|o| **o != owners[0]).count() as f64;
    assert!(foreign > 0.0, "all segments on one worker: {owners:?}");
    let deadline = common::deadline_in(Duration::from_secs(30));
    let mut handed = 0.0;
    while Instant::now() < deadline {
        handed = workers_metric_baseline(&c, "lakecache_handed_off_pages");
        if handed >= foreign * 8.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(handed, foreign * 8.0, "owners {owners:?}");

    // One cold read first, so the miss counter exists and the check
    // below compares two real readings.
    put_direct(&c, "cold.bin", 1 << 20);
    let cold = c.cli(&["cat", "s3://data/cold.bin", "--registry", &c.registry()]);
    assert!(
        cold.status.success(),
        "{}",
        String::from_utf8_lossy(&cold.stderr)
    );
    let misses = workers_metric(&c, "lakecache_cache_miss");
    assert!(
        misses >= (1 << 20) as f64,
        "the cold read missed {misses} bytes"
    );
    let out = Command::new(BIN)
        .args(["cat", "s3://data/ckpt.bin", "--registry", &c.registry()])
        .envs(c.env())
        .output_bounded()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(hex(&Sha256::digest(&out.stdout)), expected);
    assert_eq!(
        workers_metric(&c, "lakecache_cache_miss"),
        misses,
        "reading a just-written object went to S3: its pages are not on the segment owners"
    );
}

#[test]
fn every_worker_lists_a_write_or_delete_made_through_another_at_once() {
    let c = Cluster::start(3);
    c.wait_members(&["w0", "w1", "w2"], Duration::from_secs(15));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let clients: Vec<WorkerClient> = c
            .workers
            .iter()
            .map(|(_, port, _)| c.worker_client(*port, Duration::from_secs(10)))
            .collect();
        let listed = |client: &WorkerClient| {
            let client = client.clone();
            async move {
                // A listing first, so a worker that cached it would serve
                // the stale one next.
                let list = client
                    .list("data", "ckpt/", None, None, None)
                    .await
                    .unwrap();
                list.objects.into_iter().map(|o| o.key).collect::<Vec<_>>()
            }
        };
        for (step, writer) in clients.iter().enumerate() {
            for reader in &clients {
                listed(reader).await;
            }
            let key = format!("ckpt/step-{step}.pt");
            let uri: ObjectUri = format!("s3://data/{key}").parse().unwrap();
            writer
                .put_bytes(&uri, bytes::Bytes::from(vec![step as u8; 1000]))
                .await
                .unwrap();
            for (i, reader) in clients.iter().enumerate() {
                let keys = listed(reader).await;
                assert!(
                    keys.contains(&key),
                    "worker {i} lists {keys:?} without {key}"
                );
            }
            writer.delete(&uri).await.unwrap();
            for (i, reader) in clients.iter().enumerate() {
                let keys = listed(reader).await;
                assert!(!keys.contains(&key), "worker {i} still lists deleted {key}");
            }
        }
    });
}

#[test]
fn a_worker_or_client_with_other_ring_settings_is_refused() {
    let c = Cluster::start(1);
    c.wait_members(&["w0"], Duration::from_secs(15));
    let out = Command::new(BIN)
        .args([
            "worker",
            "--insecure-http",
            "--no-auth",
            "--listen",
            "127.0.0.1:0",
            "--cache-dir",
        ])
        .arg(c.dir.path().join("cache-odd"))
        .args(["--segment-size", "32MiB", "--registry", &c.registry()])
        .args([
            "--s3-endpoint",
            &format!("http://127.0.0.1:{}", c.s3_port),
            "--s3-path-style",
        ])
        .envs(c.env())
        .output_bounded()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a worker with another segment size started"
    );
    assert!(
        err.contains("--segment-size 67108864 --vnodes 512"),
        "unclear refusal: {err}"
    );
    assert!(
        !c.dir.path().join("cache-odd").exists(),
        "the refused worker created its cache directory"
    );

    let out = Command::new(BIN)
        .args([
            "ls",
            "s3://data/",
            "--vnodes",
            "64",
            "--registry",
            &c.registry(),
        ])
        .envs(c.env())
        .output_bounded()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--vnodes 64 differs"),
        "unclear refusal: {err}"
    );
}

#[test]
fn a_worker_killed_mid_stream_costs_no_failed_read() {
    const MIB: u64 = 1 << 20;
    const SIZE_MIB: u64 = 1024;
    let mut c = Cluster::start(3);
    c.wait_members(&["w0", "w1", "w2"], Duration::from_secs(15));

    let expected = put_streamed(&c, "big.bin", SIZE_MIB);

    // Which worker owns which 64 MiB segment: kill one that owns later ones.
    let membership_owner = segment_owners(&c, "s3://data/big.bin", SIZE_MIB / 64);
    let victim = membership_owner[10].clone();
    let spread: std::collections::BTreeSet<_> = membership_owner.iter().collect();
    assert_eq!(
        spread.len(),
        3,
        "1 GiB must spread over all three workers: {membership_owner:?}"
    );

    let mut cat = Command::new(BIN)
        .args([
            "cat",
            "s3://data/big.bin",
            "--registry",
            &c.registry(),
            "--timeout",
            "10",
        ])
        .envs(c.env())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = cat.stdout.take().unwrap();
    let mut got = Sha256::new();
    let mut total = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    let mut killed = false;
    loop {
        let n = stdout.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        got.update(&buf[..n]);
        total += n as u64;
        if !killed && total >= 300 * MIB {
            c.worker_mut(&victim).kill9();
            killed = true;
        }
    }
    let status = cat.wait().unwrap();
    let mut err = String::new();
    cat.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(killed, "the stream ended before the kill");
    assert!(status.success(), "cat failed after killing {victim}: {err}");
    assert_eq!(total, SIZE_MIB * MIB);
    assert_eq!(hex(&got.finalize()), expected, "bytes differ");

    // The killed worker comes back and rejoins: on a new port, since on
    // a busy machine its old one may meanwhile be the local port of some
    // outgoing connection (seen in CI: "Address already in use").
    c.wait_members(
        &["w0", "w1", "w2"]
            .into_iter()
            .filter(|w| *w != victim)
            .collect::<Vec<_>>(),
        Duration::from_secs(TTL_SECS * 3 + 3),
    );
    c.workers.retain(|(w, _, _)| *w != victim);
    c.add_worker(&victim, None);
    c.wait_members(&["w0", "w1", "w2"], Duration::from_secs(10));
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn two_processes_compute_identical_owners() {
    let args = [
        "ring",
        "--members",
        "w-a,w-b,w-c,w-d,w-e,w-f,w-g,w-h",
        "--keys",
        "100000",
    ];
    let first = Command::new(BIN).args(args).output_bounded().unwrap();
    let second = Command::new(BIN).args(args).output_bounded().unwrap();
    assert!(first.status.success() && second.status.success());
    assert_eq!(
        first.stdout.iter().filter(|b| **b == b'\n').count(),
        100_000
    );
    assert!(
        first.stdout == second.stdout,
        "two processes disagree on placement"
    );
    // And the library in this (third) process agrees.
    let members: Vec<lakecache_registry::Member> = "w-a,w-b,w-c,w-d,w-e,w-f,w-g,w-h"
        .split(',')
        .map(|id| lakecache_registry::Member {
            id: id.into(),
            address: id.into(),
            capacity: 0,
        })
        .collect();
    let ring = lakecache_registry::Ring::new(&members, Default::default());
    let mine: String = (0..100_000)
        .map(|k| {
            format!(
                "{}\n",
                ring.owner(&format!("s3://lake/key-{k}"), 0).unwrap().id
            )
        })
        .collect();
    assert!(mine.as_bytes() == first.stdout.as_slice());
}

#[test]
fn etcd_unreachable_at_start_is_a_clear_error() {
    // Port 1 (tcpmux): nothing listens there, so connections are refused.
    let dead = "etcd://127.0.0.1:1".to_string();
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let out = Command::new(BIN)
        .args([
            "worker",
            "--insecure-http",
            "--no-auth",
            "--listen",
            "127.0.0.1:0",
            "--registry",
            &dead,
            "--cache-dir",
        ])
        .arg(dir.path())
        .output_bounded()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach etcd"), "{err}");
    let took = started.elapsed();
    eprintln!("a worker with etcd unreachable gave up after {took:?}");
    // A bounded connect, not a hang (measured: 29 ms).
    assert!(took < common::scaled(Duration::from_secs(20)), "{took:?}");
    let out = Command::new(BIN)
        .args(["cat", "s3://data/x", "--registry", &dead])
        .output_bounded()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach etcd"));
}

#[test]
fn clients_keep_the_last_ring_when_etcd_is_lost() {
    let mut c = Cluster::start(3);
    c.wait_members(&["w0", "w1", "w2"], Duration::from_secs(15));
    let body: Vec<u8> = (0..3 * 64).flat_map(block).collect::<Vec<u8>>();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let m = c.etcd_membership().await;
        let membership: Arc<dyn Membership> = Arc::new(m);
        let client = ClusterClient::new(
            membership.clone(),
            ClusterOptions {
                s3_fallback: false,
                ..c.options()
            },
            None,
        );
        let uri: ObjectUri = "s3://data/kept.bin".parse().unwrap();
        client
            .put(&uri, bytes::Bytes::from(body.clone()))
            .await
            .unwrap();
        c.etcd.kill9();
        // Not a synchronisation: the leases must have run out while etcd
        // is gone, to show the client keeps members it can no longer renew.
        tokio::time::sleep(Duration::from_secs(TTL_SECS + 2)).await;
        assert_eq!(
            membership.subscribe().borrow().len(),
            3,
            "last known members kept"
        );
        for _ in 0..3 {
            let got = client.read(&uri, 0..body.len() as u64, None).await.unwrap();
            assert!(got == body[..], "reads keep working without etcd");
        }
    });
}

/// Member ids in a view.
fn ids(view: &[lakecache_registry::Member]) -> Vec<String> {
    let mut ids: Vec<String> = view.iter().map(|m| m.id.clone()).collect();
    ids.sort();
    ids
}

#[test]
fn a_registration_not_signed_by_the_cluster_key_never_joins_the_ring() {
    let c = Cluster::start(2);
    c.wait_members(&["w0", "w1"], Duration::from_secs(15));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let endpoint = vec![format!("http://127.0.0.1:{}", c.etcd_port)];
        // What anyone with etcd write access can do: register a member.
        let register = |id: &str, signer: Option<&lakecache_protocol::member_sig::MemberSigner>| {
            let member = lakecache_registry::Member {
                id: format!("rogue-{id}"),
                address: "127.0.0.1:1".into(),
                capacity: 1 << 40,
            };
            let signer = signer.cloned();
            let endpoint = endpoint.clone();
            async move {
                lakecache_registry::EtcdRegistration::start(
                    endpoint,
                    PREFIX.into(),
                    Default::default(),
                    member,
                    signer.as_ref(),
                    Duration::from_secs(30),
                    Duration::from_secs(5),
                )
                .await
                .unwrap()
            }
        };
        // Anyone who can write to etcd: an unsigned record, and one
        // signed with another cluster's keys.
        let unsigned = register("unsigned", None).await;
        let other_keys = lakecache_protocol::token::KeyRing::new(
            lakecache_protocol::token::SigningKey::generate("k-other"),
            None,
        );
        let signer = lakecache_protocol::member_sig::MemberSigner::new(&other_keys);
        let foreign = register("foreign", Some(&signer)).await;

        // A client that trusts everything sees them: they are in etcd.
        let open = EtcdMembership::connect(
            endpoint.clone(),
            PREFIX.into(),
            Default::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(
            ids(&open.subscribe().borrow()),
            ["rogue-foreign", "rogue-unsigned", "w0", "w1"]
        );
        // Clients with a token believe only the cluster's own workers,
        // at start and as records arrive.
        let trusting = c.etcd_membership().await;
        assert_eq!(ids(&trusting.subscribe().borrow()), ["w0", "w1"]);
        let late = register("late", None).await;
        // Once the trust-everything view has the late record, the trusting
        // one has been sent it too and must have dropped it.
        let deadline = common::deadline_in(Duration::from_secs(15));
        while !ids(&open.subscribe().borrow()).contains(&"rogue-late".to_string()) {
            assert!(
                Instant::now() < deadline,
                "the late record never reached etcd's watchers"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(ids(&trusting.subscribe().borrow()), ["w0", "w1"]);
        for r in [unsigned, foreign, late] {
            r.stop().await;
        }
    });
    // So does the CLI, and reads and writes never go to the rogue address.
    assert_eq!(c.members(), ["w0", "w1"]);
    let put = Command::new(BIN)
        .args(["put", "s3://data/signed/x", "--registry", &c.registry()])
        .args(["--no-s3-fallback"])
        .envs(c.env())
        .stdin(Stdio::null())
        .output_bounded()
        .unwrap();
    assert!(
        put.status.success(),
        "{}",
        String::from_utf8_lossy(&put.stderr)
    );

    // A client that trusts another CA is told so, and reads nothing.
    let wrong_ca = Command::new(BIN)
        .args(["cat", "s3://data/signed/x", "--registry", &c.registry()])
        .args(["--no-s3-fallback"])
        .envs(c.env())
        .env("LAKECACHE_TLS_CA", &c.sec.pki.other_ca)
        .output_bounded()
        .unwrap();
    assert_eq!(wrong_ca.status.code(), Some(1));
    let err = String::from_utf8_lossy(&wrong_ca.stderr);
    assert!(
        err.contains("TLS with worker")
            && err.contains("UnknownIssuer")
            && err.contains("--tls-ca"),
        "{err}"
    );
    assert!(wrong_ca.stdout.is_empty());
}

/// An etcd with auth on: root, and a `lakecache` user whose role reaches
/// only the cluster's prefix.
async fn enable_etcd_auth(port: u16, password: &str) {
    use etcd_client::{Client, Permission};
    let mut etcd = Client::connect([format!("http://127.0.0.1:{port}")], None)
        .await
        .unwrap();
    etcd.user_add("root", "root-pass-for-tests", None)
        .await
        .unwrap();
    etcd.user_grant_role("root", "root").await.unwrap();
    etcd.role_add("lakecache").await.unwrap();
    etcd.role_grant_permission(
        "lakecache",
        Permission::read_write(format!("{PREFIX}/")).with_prefix(),
    )
    .await
    .unwrap();
    etcd.user_add("lakecache", password, None).await.unwrap();
    etcd.user_grant_role("lakecache", "lakecache")
        .await
        .unwrap();
    etcd.auth_enable().await.unwrap();
}

#[test]
fn etcd_with_auth_works_with_credentials_and_fails_clearly_without() {
    let mut c = Cluster::start(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(enable_etcd_auth(c.etcd_port, "lc-pass-for-tests"));
    let password_file = c.dir.path().join("etcd-password");
    std::fs::write(&password_file, "lc-pass-for-tests\n").unwrap();
    let creds = [
        "--etcd-user".to_string(),
        "lakecache".into(),
        "--etcd-password-file".into(),
        password_file.display().to_string(),
    ];

    // A worker without credentials is refused by etcd and says so.
    let refused = Command::new(BIN)
        .args(["worker", "--listen", "127.0.0.1:0", "--cache-dir"])
        .arg(c.dir.path().join("cache-refused"))
        .args(c.worker_security())
        .args(["--registry", &c.registry()])
        .envs(c.env())
        .output_bounded()
        .unwrap();
    assert_eq!(refused.status.code(), Some(1));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("etcd")
            && (err.contains("user name is empty") || err.contains("permission denied")),
        "{err}"
    );

    // With them it registers; clients with them see it, without them fail.
    c.add_worker_with("w0", &creds);
    c.wait_listed("w0", &creds);
    let anonymous = c.cli(&["status", "--registry", &c.registry()]);
    assert_eq!(anonymous.status.code(), Some(1));
    let err = String::from_utf8_lossy(&anonymous.stderr);
    assert!(err.contains("etcd"), "{err}");

    let mut put = vec!["put", "s3://data/auth/x", "--registry"];
    let registry = c.registry();
    put.push(&registry);
    put.extend(creds.iter().map(String::as_str));
    let out = Command::new(BIN)
        .args(&put)
        .envs(c.env())
        .stdin(Stdio::null())
        .output_bounded()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The password is in no output.
    assert!(!String::from_utf8_lossy(&out.stderr).contains("lc-pass-for-tests"));
}

#[test]
fn etcd_over_tls_with_client_certificates() {
    let mut c = Cluster::start(0);
    // A second etcd that speaks only TLS and wants client certificates.
    c.etcd.kill9();
    let pki = &c.sec.pki;
    let tls_flags: Vec<std::ffi::OsString> = vec![
        "--cert-file".into(),
        pki.cert.clone().into(),
        "--key-file".into(),
        pki.key.clone().into(),
        "--trusted-ca-file".into(),
        pki.ca.clone().into(),
        "--client-cert-auth".into(),
    ];
    let (etcd, port) = start_etcd_with(c.dir.path(), "lctls", "https", &tls_flags);
    c.etcd = etcd;
    c.etcd_port = port;
    let tls: Vec<String> = vec![
        "--etcd-ca".into(),
        pki.ca.display().to_string(),
        "--etcd-cert".into(),
        pki.cert.display().to_string(),
        "--etcd-key".into(),
        pki.key.display().to_string(),
    ];
    c.add_worker_with("w0", &tls);
    c.wait_listed("w0", &tls);
    let registry = c.registry();
    // Without the client certificate (and CA), etcd is unreachable, clearly.
    let plain = c.cli(&["status", "--registry", &registry]);
    assert_eq!(plain.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&plain.stderr).contains("etcd"));
    let no_cert = c.cli(&["status", "--registry", &registry, "--etcd-ca", &tls[1]]);
    assert_eq!(no_cert.status.code(), Some(1));
}

/// Puts `len` bytes of [`block`]s straight into S3 (nothing cached).
fn put_direct(c: &Cluster, key: &str, len: u64) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let config = lakecache_worker::S3Config {
            endpoint: Some(format!("http://127.0.0.1:{}", c.s3_port)),
            path_style: true,
            static_credentials: Some((ACCESS.into(), SECRET.into())),
            ..Default::default()
        };
        let store = lakecache_worker::s3_store(
            &config,
            Arc::new(lakecache_worker::Metrics::new().unwrap()),
        )
        .await;
        let mut body = Vec::with_capacity(len as usize);
        let mut i = 0;
        while (body.len() as u64) < len {
            body.extend_from_slice(&block(i));
            i += 1;
        }
        body.truncate(len as usize);
        store
            .put(
                &format!("s3://data/{key}").parse().unwrap(),
                body.into(),
                &Default::default(),
            )
            .await
            .unwrap();
    });
}

#[test]
fn load_spreads_over_the_ring_resumes_and_leaves_reads_to_the_cache() {
    const MIB: u64 = 1 << 20;
    let c = Cluster::start(3);
    c.wait_members(&["w0", "w1", "w2"], Duration::from_secs(15));
    put_direct(&c, "shards/a.bin", 150 * MIB);
    put_direct(&c, "shards/b.bin", 5 * MIB + 123);
    put_direct(&c, "shards/notes.txt", MIB);
    put_direct(&c, "elsewhere/c.bin", MIB);
    let wanted = 155 * MIB + 123;
    let run = |args: &[&str]| {
        let mut all = vec!["load"];
        all.extend_from_slice(args);
        let reg = c.registry();
        all.extend_from_slice(&["--registry", &reg]);
        c.cli(&all)
    };

    let misses_before = workers_metric_baseline(&c, "lakecache_cache_miss");
    let out = run(&["s3://data/shards/", "--include", "*.bin", "--id", "first"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    eprintln!("--- load\n{stderr}{stdout}");
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("loaded 2 objects"), "{stdout}");
    // Every wanted byte came from S3 once: no worker loaded another's share.
    let fetched = workers_metric(&c, "lakecache_cache_miss") - misses_before;
    assert_eq!(fetched as u64, wanted, "bytes fetched from S3 by the load");

    // Each worker owned exactly the segments the ring gives it.
    let owners_a = segment_owners(&c, "s3://data/shards/a.bin", 3);
    let owner_b = segment_owners(&c, "s3://data/shards/b.bin", 1)[0].clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (id, port, _) in &c.workers {
        let p = rt
            .block_on(
                c.worker_client(*port, Duration::from_secs(5))
                    .load_status("first"),
            )
            .unwrap();
        let mut expect = 0;
        for (s, o) in owners_a.iter().enumerate() {
            if o == id {
                expect += (150 * MIB - s as u64 * 64 * MIB).min(64 * MIB);
            }
        }
        if owner_b == *id {
            expect += 5 * MIB + 123;
        }
        assert_eq!(p.bytes_owned, expect, "worker {id}: {p:?}");
        assert_eq!(p.objects_listed, 2, "worker {id}: {p:?}");
        assert_eq!(p.state, lakecache_protocol::LoadState::Done);
    }

    // Reads after a load cost S3 nothing.
    let misses = workers_metric(&c, "lakecache_cache_miss");
    let out = c.cli(&["cat", "s3://data/shards/a.bin", "--registry", &c.registry()]);
    assert!(out.status.success());
    assert_eq!(out.stdout.len() as u64, 150 * MIB);
    assert_eq!(workers_metric(&c, "lakecache_cache_miss"), misses);

    // A re-run skips what is cached.
    let out = run(&["s3://data/shards/", "--include", "*.bin"]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("0B fetched from S3") && stdout.contains("155.0MiB already cached"),
        "{stdout}"
    );

    // In the background: an id, then status and cancel by it.
    let out = run(&["s3://data/elsewhere/", "--background"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let out = run(&["status", &id, "--wait"]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && stdout.contains("loaded 1 objects"),
        "{stdout}"
    );

    // Clear errors: an unknown job, a bad pattern, a bad URI.
    let out = run(&["cancel", "no-such-job"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no worker knows load job no-such-job"));
    let out = run(&["s3://data/shards/", "--include", "[", "--id", "badglob"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("include pattern"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["data/shards"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("must start with s3://"));
    let out = run(&["s3://data/shards/", "--replicas", "9"]);
    assert!(!out.status.success());

    // free evicts the prefix on every worker; a load with --replicas 2
    // then keeps every segment on its owner and the next worker.
    let reg = c.registry();
    let out = c.cli(&["free", "s3://data/shards/", "--registry", &reg]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    eprintln!("--- free\n{stdout}");
    assert!(
        out.status.success() && stdout.contains("on 3 of 3 workers"),
        "{stdout}"
    );
    let misses_before = workers_metric_baseline(&c, "lakecache_cache_miss");
    let out = run(&[
        "s3://data/shards/",
        "--include",
        "*.bin",
        "--replicas",
        "2",
        "--id",
        "twice",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fetched = workers_metric(&c, "lakecache_cache_miss") - misses_before;
    assert_eq!(fetched as u64, 2 * wanted, "two copies of every byte");
    let replicas_a = segment_replicas(&c, "s3://data/shards/a.bin", 3, 2);
    for (id, port, _) in &c.workers {
        let p = rt
            .block_on(
                c.worker_client(*port, Duration::from_secs(5))
                    .load_status("twice"),
            )
            .unwrap();
        let mut expect = 0;
        for (s, holders) in replicas_a.iter().enumerate() {
            if holders.contains(id) {
                expect += (150 * MIB - s as u64 * 64 * MIB).min(64 * MIB);
            }
        }
        let b_holders = &segment_replicas(&c, "s3://data/shards/b.bin", 1, 2)[0];
        if b_holders.contains(id) {
            expect += 5 * MIB + 123;
        }
        assert_eq!(p.bytes_owned, expect, "worker {id}: {p:?}");
    }
}

/// A write-back whose copy goes to a hung worker (SIGSTOP: socket open,
/// silent): the primary gives that copy up and the next worker on the
/// ring takes it, so the write is acknowledged with two durable copies
/// in seconds (with that spare candidate, the stalled copy's replica is
/// probed after 2 s), not after the copy's 20-minute request timeout.
#[test]
fn a_hung_replica_is_replaced_and_the_write_back_acknowledged() {
    let mut c = Cluster::start(3);
    c.wait_members(&["w0", "w1", "w2"], Duration::from_secs(15));
    let uri_text = "s3://data/replica-hang.bin";
    let ring = segment_replicas(&c, uri_text, 1, 3).remove(0);
    let (primary, replica) = (ring[0].clone(), ring[1].clone());
    let port = c
        .workers
        .iter()
        .find(|(id, _, _)| *id == primary)
        .map(|(_, port, _)| *port)
        .unwrap();
    let pid = c.worker_mut(&replica).id().to_string();
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    let data = block(5);
    let body: Vec<Result<bytes::Bytes, lakecache_protocol::BoxError>> = (0..64)
        .map(|_| Ok(bytes::Bytes::from(data.clone())))
        .collect();
    let started = Instant::now();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = c.worker_client(port, Duration::from_secs(120));
    let uri: ObjectUri = uri_text.parse().unwrap();
    let stored = rt.block_on(client.put_checked(
        &uri,
        futures::stream::iter(body),
        lakecache_protocol::WriteMode::Back,
        &[],
        &Default::default(),
        Some(Duration::from_secs(30)),
    ));
    let took = started.elapsed();
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    eprintln!("write-back with replica {replica} stopped: {took:?}");
    let stored = stored.unwrap_or_else(|e| panic!("the write failed: {e}\n{}", c.logs()));
    assert_eq!(stored.size, 64 * data.len() as u64);
    assert!(
        took < common::scaled(Duration::from_secs(60)),
        "the hung replica held the write for {took:?}"
    );
    // Acknowledged means two durable copies (the default with three
    // workers): the primary's and the next live worker's.
    assert!(
        {
            let logs = c.logs();
            logs.contains("giving it up for the next candidate")
                || logs.contains("giving its write-back copy to the next candidate")
        },
        "the copy was not given up:\n{}",
        c.logs()
    );
    // The deadlines that decided it are shown by `lakecache status`.
    let status = c.cli(&["status", "--registry", &c.registry()]);
    let shown = String::from_utf8_lossy(&status.stdout);
    assert!(
        shown.contains("write-path deadlines")
            && shown.contains(primary.as_str())
            && shown.contains("replica progress 10s"),
        "{shown}\n{}",
        String::from_utf8_lossy(&status.stderr)
    );
}
