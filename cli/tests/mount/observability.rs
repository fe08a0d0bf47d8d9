//! Metrics and traces end to end: a real Prometheus (Debian's package)
//! scrapes a worker and a mount, the hit ratio is queried, every panel of
//! deploy/grafana/lakecache.json returns data, the alert rules load; and
//! a stuck read is named by the mount's in-flight list.

use super::*;

const PROMETHEUS: &str = "/usr/bin/prometheus";

/// Percent-encodes a PromQL query for a URL.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The JSON body of a GET on Prometheus's API.
fn prom_get(port: u16, path: &str) -> serde_json::Value {
    let raw = reqwest_like_get(port, path);
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{path}: {e}: {raw}"))
}

fn instant_query(port: u16, q: &str) -> Vec<serde_json::Value> {
    let v = prom_get(port, &format!("/api/v1/query?query={}", encode(q)));
    assert_eq!(v["status"], "success", "{q}: {v}");
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

fn value_of(sample: &serde_json::Value) -> f64 {
    sample["value"][1]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(f64::NAN)
}

fn wait_until(what: &str, secs: u64, ok: impl FnMut() -> bool) {
    common::wait_until(
        what,
        Duration::from_secs(secs),
        Duration::from_millis(250),
        ok,
    );
}

/// The port the mount's metrics listener reported.
fn mount_metrics_port(env: &mut Env) -> u16 {
    env.mount
        .as_mut()
        .expect("mounted")
        .wait_for_port("mount metrics at http://", Duration::from_secs(30))
}

#[test]
fn prometheus_scrapes_worker_and_mount_and_every_dashboard_query_returns_data() {
    assert!(
        Path::new(PROMETHEUS).exists(),
        "Debian's prometheus package is missing (scripts/deps.sh installs it)"
    );
    // A tenant with a quota, so the per-tenant panels have data.
    let keys_dir = tempfile::tempdir().unwrap();
    let token = token_file(
        keys_dir.path(),
        "team.token",
        &[
            "--tenant",
            "team-a",
            "--allow-write",
            &format!("s3://{BUCKET}/"),
        ],
    );
    let keys = keys_dir.path().join("keys");
    let mut env = Env::start_full(
        1,
        &[],
        &[
            "--auth-keys",
            keys.to_str().unwrap(),
            "--tenant-quota",
            "team-a=1GiB",
        ],
    );
    env.put("data/a.bin", Bytes::from(pattern(6 << 20, 1)));
    env.mount_with(&[
        "--metrics-listen",
        "127.0.0.1:0",
        "--token-file",
        token.to_str().unwrap(),
    ]);
    let metrics_port = mount_metrics_port(&mut env);
    let worker_port = env.workers[0].0;

    let prom_dir = env.dir.path().join("prometheus");
    fs::create_dir_all(&prom_dir).unwrap();
    let rules =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus/lakecache-alerts.yml");
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: lakecache-worker\n    static_configs:\n      - targets: ['127.0.0.1:{worker_port}']\n  - job_name: lakecache-mount\n    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n",
        rules.canonicalize().unwrap().display()
    );
    fs::write(prom_dir.join("prometheus.yml"), config).unwrap();
    let mut prom = Proc::spawn(
        "prometheus",
        Command::new(PROMETHEUS)
            .arg(format!(
                "--config.file={}",
                prom_dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                prom_dir.join("data").display()
            ))
            .arg("--web.listen-address=127.0.0.1:0")
            .stdin(Stdio::null()),
    );
    let prom_port = prom.wait_for_port("msg=\"Listening on\"", Duration::from_secs(60));
    // The port opens before the TSDB is loaded; queries answer 503 until then.
    wait_until("prometheus ready", 60, || {
        let raw = reqwest_like_get(prom_port, "/-/ready");
        raw.lines().next().is_some_and(|l| l.contains(" 200 "))
    });
    wait_until("both targets up", 30, || {
        let up = instant_query(prom_port, "up == 1");
        up.len() == 2
    });

    // Traffic after the first scrapes, so rates see it: a cold read
    // (misses), the same bytes again from the worker's pages (hits), a
    // write, and a lookup that fails.
    let mnt = env.mountpoint();
    let (n, _) = sha_file(&mnt.join("data/a.bin")).unwrap();
    assert_eq!(n, 6 << 20);
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    sha_file(&mnt.join("data/a.bin")).unwrap();
    fs::write(mnt.join("data/out.bin"), pattern(1 << 20, 2)).unwrap();
    assert_eq!(
        errno_of(fs::metadata(mnt.join("data/missing"))),
        libc::ENOENT
    );

    // The hit ratio since start, and over the last minute.
    let ratio = "sum(lakecache_cache_hit_bytes_total) / (sum(lakecache_cache_hit_bytes_total) + sum(lakecache_cache_miss_bytes_total))";
    let mut seen = 0.0;
    wait_until("a hit ratio from Prometheus", 30, || {
        seen = instant_query(prom_port, ratio)
            .first()
            .map_or(0.0, value_of);
        seen > 0.0
    });
    eprintln!("prometheus query: {ratio}\n  => {seen:.3}");
    // The warm read is all hits; the cold one misses at least its first
    // page (the worker's own read-ahead turns the rest into hits).
    assert!(
        (0.5..1.0).contains(&seen),
        "one cold and one warm read: {seen}"
    );

    // Every dashboard panel's queries return series.
    let dash: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/lakecache.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels.len() >= 10);
    let mut empty = Vec::new();
    let mut checked = 0;
    for panel in panels {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "1m");
            checked += 1;
            let mut result = Vec::new();
            // Rates need two scrapes after the traffic.
            let deadline = common::deadline_in(Duration::from_secs(15));
            while result.is_empty() && Instant::now() < deadline {
                result = instant_query(prom_port, &expr);
                if result.is_empty() {
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
            if result.is_empty() {
                empty.push(format!("{}: {expr}", panel["title"]));
            }
        }
    }
    assert!(
        empty.is_empty(),
        "panels without data:\n{}",
        empty.join("\n")
    );
    eprintln!(
        "{checked} dashboard queries over {} panels returned data",
        panels.len()
    );

    // The mount's own series: ops by type with latency, bytes, errors by errno.
    let text = reqwest_like_get(metrics_port, "/metrics");
    for series in [
        "lakecache_fuse_op_duration_seconds_bucket{op=\"read\"",
        "lakecache_fuse_read_bytes_total",
        "lakecache_fuse_upload_bytes_total",
        "lakecache_fuse_errors_total{errno=\"ENOENT\",op=\"lookup\"}",
        "lakecache_fuse_inflight_ops",
    ] {
        assert!(
            text.contains(series),
            "mount metrics lack {series}:\n{text}"
        );
    }
    // The alert rules loaded and evaluate.
    let rules = prom_get(prom_port, "/api/v1/rules");
    let groups = rules["data"]["groups"].as_array().unwrap();
    let loaded: Vec<&serde_json::Value> = groups
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect();
    assert_eq!(loaded.len(), 6, "{rules}");
    wait_until("every alert rule evaluated", 15, || {
        let r = prom_get(prom_port, "/api/v1/rules");
        r["data"]["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap().clone())
            .all(|rule| rule["health"] == "ok")
    });
}

#[test]
fn a_stuck_read_is_named_in_the_mounts_inflight_list() {
    let mut env = Env::start(1);
    env.put("shards/stuck.bin", Bytes::from(pattern(4 << 20, 3)));
    env.mount_with(&["--metrics-listen", "127.0.0.1:0"]);
    let metrics_port = mount_metrics_port(&mut env);
    let worker_port = env.workers[0].0;
    let pid = env.workers[0].1.id().to_string();
    let path = env.mountpoint().join("shards/stuck.bin");
    // Open (and stat) while the worker answers; then it hangs.
    let mut f = File::open(&path).unwrap();
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        f.read(&mut buf).map(|n| n as u64)
    });
    let mut listing = serde_json::Value::Null;
    wait_until("the stuck read in /v1/inflight", 20, || {
        let raw = reqwest_like_get(metrics_port, "/v1/inflight");
        let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        listing = serde_json::from_str(body).unwrap_or_default();
        listing["operations"].as_array().is_some_and(|ops| {
            ops.iter()
                .any(|o| o["op"] == "read" && o["age_ms"].as_u64() > Some(500))
        })
    });
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    eprintln!("GET /v1/inflight while the worker is stopped:\n{listing:#}");
    let read = listing["operations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["op"] == "read")
        .unwrap()
        .clone();
    assert_eq!(read["path"], "shards/stuck.bin");
    assert_eq!(read["offset"], 0);
    assert_eq!(read["worker"], format!("127.0.0.1:{worker_port}"));
    assert!(reader.join().unwrap().unwrap() > 0);
    wait_until("an empty in-flight list", 20, || {
        let raw = reqwest_like_get(metrics_port, "/v1/inflight");
        raw.contains("\"operations\":[]")
    });
}
