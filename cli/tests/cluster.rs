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
use common::{free_port, start_s3, wait_for_port, Proc, BIN};

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
            .output()
            .unwrap());
        let token = ok(Command::new(BIN)
            .args(["token", "create", "--keys"])
            .arg(&keys)
            .args(["--tenant", "tests", "--allow-write", "s3://data/"])
            .output()
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

struct Cluster {
    dir: tempfile::TempDir,
    sec: Security,
    etcd: Proc,
    etcd_port: u16,
    s3_port: u16,
    _s3: Proc,
    workers: Vec<(String, u16, Proc)>,
}

fn start_etcd(dir: &Path) -> (Proc, u16) {
    let (client, peer) = (free_port(), free_port());
    let child = Command::new("etcd")
        .args(["--name", "lctest", "--data-dir"])
        .arg(dir.join("etcd"))
        .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
        .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
        .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
        .arg(format!(
            "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
        ))
        .arg(format!("--initial-cluster=lctest=http://127.0.0.1:{peer}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd from Debian's etcd-server must be installed (scripts/deps.sh)");
    wait_for_port(client, "etcd");
    (Proc(child), client)
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
        self.spawn_worker(id, port.unwrap_or_else(free_port), &extra)
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
            .output()
            .unwrap()
    }

    /// A direct client of one worker, with the cluster's CA and token.
    fn worker_client(&self, port: u16, timeout: Duration) -> WorkerClient {
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
        self.spawn_worker(id, free_port(), extra);
    }

    /// Starts worker `id` on `port` with the cluster's security flags and
    /// registry plus `extra`; returns the port once it listens.
    fn spawn_worker(&mut self, id: &str, port: u16, extra: &[String]) -> u16 {
        let worker = Command::new(BIN)
            .args([
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
            .stdout(Stdio::null())
            .stderr(worker_log())
            .spawn()
            .unwrap();
        wait_for_port(port, "worker");
        self.workers.push((id.to_string(), port, Proc(worker)));
        port
    }

    /// Waits until `status` run with `extra` lists `id`.
    fn wait_listed(&self, id: &str, extra: &[String]) {
        let registry = self.registry();
        let mut args = vec!["status", "--json", "--registry", &registry];
        args.extend(extra.iter().map(String::as_str));
        let deadline = Instant::now() + Duration::from_secs(15);
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
                started.elapsed() < within,
                "members {got:?}, wanted {want:?} within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Worker logs go to the test's stderr with LAKECACHE_TEST_LOGS=1.
fn worker_log() -> Stdio {
    if std::env::var_os("LAKECACHE_TEST_LOGS").is_some() {
        Stdio::inherit()
    } else {
        Stdio::null()
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
    let pid = c.worker_mut(&victim).0.id().to_string();
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
        took < Duration::from_secs(20),
        "a hung worker stalled the read for {took:?}"
    );
}

/// Sum of the metric lines starting with `name` over all workers.
fn workers_metric(c: &Cluster, name: &str) -> f64 {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut sum = 0.0;
        for (_, port, _) in &c.workers {
            let client = c.worker_client(*port, Duration::from_secs(5));
            let text = client.metrics().await.unwrap();
            sum += text
                .lines()
                .filter(|l| l.starts_with(name))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>();
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
    // 4 MiB pages: 16 per segment the writer (segment 0's owner) hands on.
    let foreign = owners.iter().filter(|o| **o != owners[0]).count() as f64;
    assert!(foreign > 0.0, "all segments on one worker: {owners:?}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut handed = 0.0;
    while Instant::now() < deadline {
        handed = workers_metric(&c, "lakecache_handed_off_pages");
        if handed >= foreign * 16.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(handed, foreign * 16.0, "owners {owners:?}");

    let misses = workers_metric(&c, "lakecache_cache_miss");
    let out = Command::new(BIN)
        .args(["cat", "s3://data/ckpt.bin", "--registry", &c.registry()])
        .envs(c.env())
        .output()
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
    let port = free_port();
    let out = Command::new(BIN)
        .args([
            "worker",
            "--insecure-http",
            "--no-auth",
            "--listen",
            &format!("127.0.0.1:{port}"),
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
        .output()
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
        .output()
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

    // The killed worker comes back and rejoins.
    let port = c.workers.iter().find(|(w, _, _)| *w == victim).unwrap().1;
    c.wait_members(
        &["w0", "w1", "w2"]
            .into_iter()
            .filter(|w| *w != victim)
            .collect::<Vec<_>>(),
        Duration::from_secs(TTL_SECS * 3 + 3),
    );
    c.workers.retain(|(w, _, _)| *w != victim);
    c.add_worker(&victim, Some(port));
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
    let first = Command::new(BIN).args(args).output().unwrap();
    let second = Command::new(BIN).args(args).output().unwrap();
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
    let dead = format!("etcd://127.0.0.1:{}", free_port());
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
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach etcd"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20));
    let out = Command::new(BIN)
        .args(["cat", "s3://data/x", "--registry", &dead])
        .output()
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
        tokio::time::sleep(Duration::from_millis(500)).await;
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
        .output()
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
        .output()
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
    let port = free_port();
    let refused = Command::new(BIN)
        .args([
            "worker",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--cache-dir",
        ])
        .arg(c.dir.path().join("cache-refused"))
        .args(c.worker_security())
        .args(["--registry", &c.registry()])
        .envs(c.env())
        .output()
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
        .output()
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
    let dir = c.dir.path().join("etcd-tls");
    let (client, peer) = (free_port(), free_port());
    let pki = &c.sec.pki;
    let child = Command::new("etcd")
        .args(["--name", "lctls", "--data-dir"])
        .arg(&dir)
        .arg(format!("--listen-client-urls=https://127.0.0.1:{client}"))
        .arg(format!(
            "--advertise-client-urls=https://127.0.0.1:{client}"
        ))
        .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
        .arg(format!(
            "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
        ))
        .arg(format!("--initial-cluster=lctls=http://127.0.0.1:{peer}"))
        .arg("--cert-file")
        .arg(&pki.cert)
        .arg("--key-file")
        .arg(&pki.key)
        .arg("--trusted-ca-file")
        .arg(&pki.ca)
        .arg("--client-cert-auth")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_port(client, "etcd (TLS)");
    c.etcd = Proc(child);
    c.etcd_port = client;
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

    let misses_before = workers_metric(&c, "lakecache_cache_miss");
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
    let misses_before = workers_metric(&c, "lakecache_cache_miss");
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
