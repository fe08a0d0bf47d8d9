//! End to end through the real binary: `lakecache up`, then the client
//! commands against it, then a clean SIGTERM shutdown and a restart.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::BIN;

struct Up {
    child: Child,
    worker: String,
    mountpoint: String,
    /// The read/write token `up` minted for its bucket.
    token_file: String,
    /// Where `up`'s stderr goes; printed if the test fails.
    stderr_log: std::path::PathBuf,
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.stderr_log).unwrap_or_default();
            eprintln!(
                "--- lakecache up's stderr ({}):\n{}",
                self.stderr_log.display(),
                common::tail(&log, 200)
            );
        }
    }
}

/// Reads `up`'s stdout until its "try:" line, failing with its stderr if
/// it exits first.
fn up_banner(
    lines: &mut std::io::Lines<BufReader<std::process::ChildStdout>>,
    stderr_log: &std::path::Path,
    mut each: impl FnMut(&str),
) {
    for line in lines.by_ref() {
        let line = line.unwrap();
        each(&line);
        if line.starts_with("try:") {
            return;
        }
    }
    panic!(
        "lakecache up ended its output before \"try:\"; its stderr:\n{}",
        std::fs::read_to_string(stderr_log).unwrap_or_default()
    );
}

fn start_up(dir: &std::path::Path) -> Up {
    let stderr_log = common::log_file("up");
    let mut child = Command::new(BIN)
        .args([
            "up",
            "--s3-listen",
            "127.0.0.1:0",
            "--listen",
            "127.0.0.1:0",
            "--cache-size",
            "1GiB",
            "--dir",
        ])
        .arg(dir)
        .arg("--mount")
        .arg(dir.join("mnt"))
        .stdout(Stdio::piped())
        .stderr(common::append_file(&stderr_log))
        .spawn()
        .expect("spawn lakecache up");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut worker = None;
    let mut token_file = None;
    up_banner(&mut lines, &stderr_log, |line| {
        if let Some(rest) = line.trim().strip_prefix("token file") {
            token_file = rest.split_whitespace().next().map(str::to_string);
        }
        if let Some(rest) = line.trim().strip_prefix("worker") {
            let url = rest.split_whitespace().next().unwrap();
            worker = Some(url.trim_start_matches("http://").to_string());
        }
    });
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Up {
        stderr_log,
        child,
        worker: worker.expect("up printed the worker address"),
        token_file: token_file.expect("up printed its token file"),
        mountpoint: dir
            .join("mnt")
            .canonicalize()
            .unwrap()
            .display()
            .to_string(),
    }
}

fn run(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(data) = stdin {
        input.write_all(data).unwrap();
    }
    drop(input);
    child.wait_with_output().unwrap()
}

/// A client command with `up`'s token.
fn client(up: &Up, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut args = args.to_vec();
    args.extend(["--token-file", &up.token_file]);
    run(&args, stdin)
}

fn stop(mut up: Up) {
    let pid = up.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = common::deadline_in(Duration::from_secs(20));
    loop {
        if let Some(status) = up.child.try_wait().unwrap() {
            assert!(status.success(), "up exited with {status}");
            let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
            assert!(!mounts.contains(&up.mountpoint), "up left its mount behind");
            return;
        }
        assert!(Instant::now() < deadline, "up did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn up_serves_put_cat_stat_ls_and_shuts_down_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let up = start_up(dir.path());
    let w = up.worker.clone();
    let body: Vec<u8> = (0..5_000_000u32).map(|i| (i * 7 % 256) as u8).collect();

    let put = client(
        &up,
        &["put", "s3://lakecache/data/blob.bin", "--worker", &w],
        Some(&body),
    );
    assert!(
        put.status.success(),
        "put: {}",
        String::from_utf8_lossy(&put.stderr)
    );
    // A command that worked says nothing on stderr (no library chatter).
    assert!(
        put.stderr.is_empty(),
        "put wrote to stderr: {}",
        String::from_utf8_lossy(&put.stderr)
    );

    let cat = client(
        &up,
        &["cat", "s3://lakecache/data/blob.bin", "--worker", &w],
        None,
    );
    assert!(
        cat.status.success(),
        "cat: {}",
        String::from_utf8_lossy(&cat.stderr)
    );
    assert!(cat.stdout == body, "cat returned different bytes");

    let part = client(
        &up,
        &[
            "cat",
            "s3://lakecache/data/blob.bin",
            "--range",
            "10-19",
            "--worker",
            &w,
        ],
        None,
    );
    assert_eq!(part.stdout, &body[10..20]);

    let stat = client(
        &up,
        &[
            "stat",
            "s3://lakecache/data/blob.bin",
            "--json",
            "--worker",
            &w,
        ],
        None,
    );
    let json: serde_json::Value = serde_json::from_slice(&stat.stdout).unwrap();
    assert_eq!(json["size"], 5_000_000);

    let ls = client(&up, &["ls", "s3://lakecache/", "--worker", &w], None);
    let listing = String::from_utf8_lossy(&ls.stdout);
    assert!(listing.contains("PRE  data/"), "{listing}");

    // The bucket is mounted: the object is a file, and a file written
    // there is an object.
    let mnt = dir.path().join("mnt");
    assert!(std::fs::read(mnt.join("data/blob.bin")).unwrap() == body);
    std::fs::write(mnt.join("data/note.txt"), b"from the mount\n").unwrap();
    let note = client(
        &up,
        &["cat", "s3://lakecache/data/note.txt", "--worker", &w],
        None,
    );
    assert_eq!(note.stdout, b"from the mount\n");

    // Errors are clear and exit non-zero.
    let missing = client(&up, &["cat", "s3://lakecache/nope", "--worker", &w], None);
    assert_eq!(missing.status.code(), Some(1));
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(
        err.contains("404") && err.contains("s3://lakecache/nope"),
        "{err}"
    );
    let bad = client(&up, &["cat", "lakecache/nope", "--worker", &w], None);
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("s3://bucket/key"));

    // Without the token the worker refuses, and says what is missing.
    let anonymous = run(
        &[
            "cat",
            "s3://lakecache/data/blob.bin",
            "--worker",
            &w,
            "--no-s3-fallback",
        ],
        None,
    );
    assert_eq!(anonymous.status.code(), Some(1));
    let err = String::from_utf8_lossy(&anonymous.stderr);
    assert!(err.contains("401") && err.contains("token"), "{err}");
    // Nor do `up`'s banner and logs carry the S3 secret: it is in a
    // private file.
    let creds = std::fs::read_to_string(dir.path().join("s3-credentials")).unwrap();
    assert!(creds.contains("AWS_SECRET_ACCESS_KEY="));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.path().join("s3-credentials"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "credentials file is private");

    stop(up);

    // Objects and cache survive a restart over the same directory.
    let up = start_up(dir.path());
    let cat = client(
        &up,
        &[
            "cat",
            "s3://lakecache/data/blob.bin",
            "--worker",
            &up.worker,
        ],
        None,
    );
    assert!(cat.status.success() && cat.stdout == body);
    stop(up);
}

#[test]
fn invalid_worker_settings_fail_fast_with_the_flag_named() {
    let out = run(
        &[
            "worker",
            "--page-size",
            "128MiB",
            "--cache-dir",
            "/tmp/unused-lakecache",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--page-size"));
    let out = run(&["worker", "--cache-size", "lots"], None);
    assert_eq!(out.status.code(), Some(2), "clap usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid size"));

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("worker.toml");
    std::fs::write(&cfg, "cache_size = \"1GiB\"\nunknown_key = 3\n").unwrap();
    let out = run(&["worker", "--config", cfg.to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown_key"));

    // Secure by default: no plain HTTP and no anonymous access unless
    // asked for by name.
    let out = run(&["worker", "--cache-dir", "/tmp/unused-lakecache"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--auth-keys"));
    let out = run(
        &[
            "worker",
            "--no-auth",
            "--cache-dir",
            "/tmp/unused-lakecache",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--insecure-http"));
    let out = run(
        &[
            "up",
            "--listen",
            "0.0.0.0:0",
            "--no-mount",
            "--dir",
            "/tmp/unused-lakecache",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback"));
}

/// The secrets a running `up` holds: its token (whole and its signature),
/// the signing keys and the S3 secret key.
fn secrets_of(dir: &std::path::Path) -> Vec<String> {
    let token = std::fs::read_to_string(dir.join("token")).unwrap();
    let token = token.trim().to_string();
    let mut secrets = vec![token.rsplit('.').next().unwrap().to_string(), token];
    for line in std::fs::read_to_string(dir.join("keys")).unwrap().lines() {
        if let Some(secret) = line.strip_prefix("lakecache-key-v1 ") {
            secrets.push(secret.split_whitespace().nth(1).unwrap().to_string());
        }
    }
    let creds = std::fs::read_to_string(dir.join("s3-credentials")).unwrap();
    for line in creds.lines() {
        if let Some(secret) = line.strip_prefix("AWS_SECRET_ACCESS_KEY=") {
            secrets.push(secret.to_string());
        }
    }
    assert!(secrets.len() >= 4 && secrets.iter().all(|s| s.len() >= 20));
    secrets
}

#[test]
fn no_secret_reaches_logs_errors_status_or_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("up.log");
    let mut child = Command::new(BIN)
        .args([
            "up",
            "--s3-listen",
            "127.0.0.1:0",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--cache-size", "1GiB", "--log", "debug", "--dir"])
        .arg(dir.path())
        .arg("--mount")
        .arg(dir.path().join("mnt"))
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let mut seen = String::new();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut worker = String::new();
    up_banner(&mut lines, &log_path, |line| {
        if let Some(rest) = line.trim().strip_prefix("worker") {
            worker = rest
                .split_whitespace()
                .next()
                .unwrap()
                .trim_start_matches("http://")
                .into();
        }
        seen.push_str(line);
        seen.push('\n');
    });
    std::thread::spawn(move || for _ in lines {});
    let up = Up {
        stderr_log: log_path.clone(),
        child,
        worker: worker.clone(),
        mountpoint: dir
            .path()
            .join("mnt")
            .canonicalize()
            .unwrap()
            .display()
            .to_string(),
        token_file: dir.path().join("token").display().to_string(),
    };
    let secrets = secrets_of(dir.path());
    let mut record = |out: Output| {
        seen.push_str(&String::from_utf8_lossy(&out.stdout));
        seen.push_str(&String::from_utf8_lossy(&out.stderr));
    };
    let debug = ["--log", "debug"];
    // Everyday use, with debug logs, and every kind of refusal.
    let put = client(
        &up,
        &[
            "put",
            "s3://lakecache/s/x",
            "--worker",
            &worker,
            "--log",
            "debug",
        ],
        Some(b"data"),
    );
    assert!(put.status.success());
    record(put);
    for args in [
        vec!["cat", "s3://lakecache/s/x", "--worker", &worker],
        vec!["stat", "s3://lakecache/s/x", "--json", "--worker", &worker],
        vec!["ls", "s3://lakecache/", "--worker", &worker],
        vec!["status", "--json", "--worker", &worker],
        vec!["cat", "s3://lakecache/missing", "--worker", &worker],
        vec![
            "cat",
            "s3://other-bucket/x",
            "--worker",
            &worker,
            "--no-s3-fallback",
        ],
    ] {
        let mut args = args;
        args.extend(debug);
        record(client(&up, &args, None));
    }
    // A forged token (signature changed) and a malformed one.
    let forged = dir.path().join("forged");
    let mut token = std::fs::read_to_string(dir.path().join("token")).unwrap();
    let last = token.pop().unwrap();
    token.push(if last == 'A' { 'B' } else { 'A' });
    std::fs::write(&forged, &token).unwrap();
    let forged_s = forged.display().to_string();
    record(run(
        &[
            "cat",
            "s3://lakecache/s/x",
            "--worker",
            &worker,
            "--token-file",
            &forged_s,
            "--no-s3-fallback",
            "--log",
            "debug",
        ],
        None,
    ));
    // Metrics as a scraper sees them.
    use std::io::Read;
    let mut conn = std::net::TcpStream::connect(&worker).unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut metrics = String::new();
    conn.read_to_string(&mut metrics).unwrap();
    assert!(metrics.contains("lakecache_"), "{metrics}");
    seen.push_str(&metrics);
    stop(up);
    seen.push_str(&std::fs::read_to_string(&log_path).unwrap());
    assert!(seen.contains("DEBUG"), "debug logging was on");
    for secret in &secrets {
        assert!(
            !seen.contains(secret.as_str()),
            "a secret ({} chars) appeared in logs, errors, status or metrics",
            secret.len()
        );
    }
}
