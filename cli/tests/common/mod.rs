//! Process helpers shared by the CLI's integration tests.
//!
//! Every child a test starts writes stdout and stderr to its own log file,
//! which is printed when the test fails ([`Proc`]'s drop during a panic).
//! Children report the port they bound in their log, and the test reads
//! it there. Servers a test restarts on their old address get a port
//! from [`unused_port`] (outside the kernel's ephemeral range).
//! Deadlines go through [`scaled`]: `LAKECACHE_TEST_TIME_SCALE` (a
//! positive number, default 1) multiplies every one of them on a slow or
//! loaded machine.
#![allow(dead_code)] // each test binary uses a different subset

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[path = "../../../testing/ports.rs"]
mod ports;
pub use ports::unused_port;

pub const BIN: &str = env!("CARGO_BIN_EXE_lakecache");

/// The factor every test deadline is multiplied by.
pub fn time_scale() -> f64 {
    match std::env::var("LAKECACHE_TEST_TIME_SCALE") {
        Err(_) => 1.0,
        Ok(s) => match s.trim().parse::<f64>() {
            Ok(f) if f.is_finite() && f > 0.0 => f,
            _ => panic!("LAKECACHE_TEST_TIME_SCALE={s:?} is not a positive number (e.g. 2 or 0.5)"),
        },
    }
}

/// `d` multiplied by [`time_scale`].
pub fn scaled(d: Duration) -> Duration {
    d.mul_f64(time_scale())
}

/// A deadline `d` (scaled) from now.
pub fn deadline_in(d: Duration) -> Instant {
    Instant::now() + scaled(d)
}

/// Where children's logs go: one directory per test process.
fn log_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lakecache-test-logs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating the test log directory");
    dir
}

/// A new log file's path for a child called `name`.
pub fn log_file(name: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let safe: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    log_dir().join(format!("{n:04}-{safe}.log"))
}

/// A child process with its output in a log file. Killed when dropped,
/// and its log printed if the test is failing at that moment.
pub struct Proc {
    pub child: Child,
    name: String,
    log: PathBuf,
    /// Where this process's output starts in a log kept across restarts.
    log_start: usize,
}

impl Proc {
    /// Spawns `cmd` with stdout and stderr going to a new log file.
    pub fn spawn(name: &str, cmd: &mut Command) -> Proc {
        Self::spawn_logged(name, cmd, &log_file(name))
    }

    /// Spawns `cmd` appending its output to `log` (kept across restarts).
    pub fn spawn_logged(name: &str, cmd: &mut Command, log: &Path) -> Proc {
        let open = || {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .unwrap_or_else(|e| panic!("opening {}: {e}", log.display()))
        };
        let log_start = std::fs::metadata(log).map_or(0, |m| m.len() as usize);
        let child = cmd
            .stdout(open())
            .stderr(open())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name} ({:?}): {e}", cmd.get_program()));
        Proc {
            child,
            name: name.to_string(),
            log: log.to_path_buf(),
            log_start,
        }
    }

    /// Wraps a child whose output the test reads itself (no log file).
    pub fn unlogged(name: &str, child: Child) -> Proc {
        Proc {
            child,
            name: name.to_string(),
            log: PathBuf::new(),
            log_start: 0,
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Everything the child has written so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The child's log, labelled, for a failure message.
    pub fn describe(&self) -> String {
        format!(
            "--- {} (pid {}, log {}):\n{}",
            self.name,
            self.child.id(),
            self.log.display(),
            tail(&self.log_text(), 200)
        )
    }

    /// What this process wrote (not earlier runs sharing its log).
    fn own_output(&self) -> String {
        let bytes = std::fs::read(&self.log).unwrap_or_default();
        String::from_utf8_lossy(bytes.get(self.log_start..).unwrap_or_default()).into_owned()
    }

    /// Waits (deadline `within`, scaled) for a line of this process's
    /// output containing `needle` and returns it; fails with the log if the
    /// child exits.
    pub fn wait_for_line(&mut self, needle: &str, within: Duration) -> String {
        let deadline = deadline_in(within);
        loop {
            let output = self.own_output();
            if let Some(line) = complete_lines(&output).find(|l| l.contains(needle)) {
                return line.to_string();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{} exited ({status}) before printing {needle:?}\n{}",
                    self.name,
                    self.describe()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{} did not print {needle:?} within {:?}\n{}",
                self.name,
                scaled(within),
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The port in the first log line containing `needle`: the digits after
    /// the last ':' that is followed by digits (`... on 127.0.0.1:40123 ...`).
    pub fn wait_for_port(&mut self, needle: &str, within: Duration) -> u16 {
        let line = self.wait_for_line(needle, within);
        port_in(&line).unwrap_or_else(|| panic!("no port in {line:?} from {}", self.name))
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then the exit status.
    pub fn term(&mut self) -> Option<std::process::ExitStatus> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        self.child.wait().ok()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() && !self.log.as_os_str().is_empty() {
            eprintln!("{}", self.describe());
        }
    }
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The lines of `text` that end in a newline. A log read while its child
/// is writing can end mid-line ("listening on https://127.0.0." was read
/// as a line without a port under load), so the last piece waits.
pub fn complete_lines(text: &str) -> std::str::Lines<'_> {
    let end = text.rfind('\n').map_or(0, |i| i + 1);
    text[..end].lines()
}

/// The port of the last `HOST:PORT` in `line`.
pub fn port_in(line: &str) -> Option<u16> {
    let bytes = line.as_bytes();
    let mut found = None;
    for (i, b) in bytes.iter().enumerate() {
        if *b != b':' {
            continue;
        }
        let digits: String = line[i + 1..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        if let Ok(p) = digits.parse::<u16>() {
            if p != 0 {
                found = Some(p);
            }
        }
    }
    found
}

/// How long a command a test runs to completion may take (scaled) before
/// it is killed and the test fails with its output. Generous: it exists so
/// that a command which wrongly keeps running (a refused worker or mount
/// that starts anyway, a CLI call stuck on a hung peer) fails the test
/// instead of hanging the suite until CI's limit.
pub const OUTPUT_BOUND: Duration = Duration::from_secs(300);

/// [`Command::output`] with a deadline: see [`OUTPUT_BOUND`].
pub trait OutputBounded {
    fn output_bounded(&mut self) -> std::io::Result<std::process::Output>;
}

impl OutputBounded for Command {
    fn output_bounded(&mut self) -> std::io::Result<std::process::Output> {
        output_within(self, OUTPUT_BOUND)
    }
}

/// Runs `cmd` to completion like [`Command::output`]; if it is still
/// running after `within` (scaled) it is killed and the test fails with
/// what it printed.
pub fn output_within(cmd: &mut Command, within: Duration) -> std::io::Result<std::process::Output> {
    let name = format!(
        "{} {}",
        Path::new(cmd.get_program()).display(),
        cmd.get_args()
            .next()
            .map(|a| a.to_string_lossy().into_owned())
            .unwrap_or_default()
    );
    let out_path = log_file(&format!("{name}-stdout"));
    let err_path = log_file(&format!("{name}-stderr"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(File::create(&out_path)?)
        .stderr(File::create(&err_path)?)
        .spawn()?;
    let read = |p: &Path| std::fs::read(p).unwrap_or_default();
    let deadline = deadline_in(within);
    let status = loop {
        match child.try_wait()? {
            Some(status) => break status,
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "`{name}` was still running after {:?} and was killed\n--- stdout:\n{}\n--- stderr:\n{}",
                    scaled(within),
                    tail(&String::from_utf8_lossy(&read(&out_path)), 100),
                    tail(&String::from_utf8_lossy(&read(&err_path)), 100),
                );
            }
        }
    };
    let output = std::process::Output {
        status,
        stdout: read(&out_path),
        stderr: read(&err_path),
    };
    // The caller holds the bytes now. Kept, a `lakecache cat` of a large
    // object left hundreds of MiB per test run in the log directory (23 GiB
    // of /tmp after a 20-iteration loop).
    let _ = std::fs::remove_file(&out_path);
    let _ = std::fs::remove_file(&err_path);
    Ok(output)
}

/// Waits (deadline scaled) until `port` on loopback accepts connections.
/// Only for ports a child already reported, e.g. after a restart.
pub fn wait_for_port(port: u16, what: &str) {
    let deadline = deadline_in(Duration::from_secs(30));
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not open port {port} within {:?}",
            scaled(Duration::from_secs(30))
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls `done` every `every` until it holds, failing with `what` (and
/// whatever `why` says at that moment) after `within` (scaled).
pub fn wait_until(
    what: &str,
    within: Duration,
    every: Duration,
    mut done: impl FnMut() -> bool,
) -> Duration {
    let started = Instant::now();
    let deadline = deadline_in(within);
    loop {
        if done() {
            return started.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {:?}",
            scaled(within)
        );
        std::thread::sleep(every);
    }
}

/// `lakecache s3-server` on a port of its own choosing, with one bucket.
pub fn start_s3(root: &Path, access: &str, secret: &str, bucket: &str) -> (Proc, u16) {
    start_s3_with(root, access, secret, bucket, &[])
}

/// [`start_s3`] with extra flags (quirk modes).
pub fn start_s3_with(
    root: &Path,
    access: &str,
    secret: &str,
    bucket: &str,
    extra: &[&str],
) -> (Proc, u16) {
    start_s3_on(root, access, secret, bucket, extra, 0)
}

/// [`start_s3_with`] on a given port (0: one from [`unused_port`]; a
/// restart passes the port the first start reported).
pub fn start_s3_on(
    root: &Path,
    access: &str,
    secret: &str,
    bucket: &str,
    extra: &[&str],
    port: u16,
) -> (Proc, u16) {
    // A restart may need this port again: see `unused_port`.
    let port = if port == 0 { unused_port() } else { port };
    let mut proc = Proc::spawn(
        "s3-server",
        Command::new(BIN)
            .args(["s3-server", "--root"])
            .arg(root)
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--access-key",
                access,
                "--secret-key",
                secret,
                "--bucket",
                bucket,
            ])
            .args(extra)
            .stdin(Stdio::null()),
    );
    let port = proc.wait_for_port("embedded S3 endpoint on", Duration::from_secs(30));
    (proc, port)
}

/// The port a `lakecache worker` printed it listens on.
pub fn worker_port(proc: &mut Proc) -> u16 {
    proc.wait_for_port("lakecache worker listening on", Duration::from_secs(60))
}

pub fn s3_env(access: &str, secret: &str, s3_port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ACCESS_KEY_ID", access.to_string()),
        ("AWS_SECRET_ACCESS_KEY", secret.to_string()),
        ("AWS_REGION", "us-east-1".to_string()),
        (
            "LAKECACHE_S3_ENDPOINT",
            format!("http://127.0.0.1:{s3_port}"),
        ),
        ("LAKECACHE_S3_PATH_STYLE", "true".to_string()),
    ]
}

/// A metric's value in a Prometheus text scrape: the first sample of
/// `name` whose label set contains every `labels` pair. A missing metric
/// is an error, never 0, so a renamed metric fails the check.
pub fn metric(scrape: &str, name: &str, labels: &[(&str, &str)]) -> Result<f64, String> {
    let want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    for line in scrape.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (label_part, value) = match rest.chars().next() {
            Some('{') => match rest.find("} ") {
                Some(end) => (&rest[..=end], &rest[end + 2..]),
                None => continue,
            },
            Some(' ') => ("", &rest[1..]),
            _ => continue, // a longer name with this one as prefix
        };
        if want.iter().all(|w| label_part.contains(w.as_str())) {
            let value = value.split_whitespace().next().unwrap_or("");
            return value
                .parse::<f64>()
                .map_err(|e| format!("{name}: value {value:?} is not a number: {e}"));
        }
    }
    Err(format!(
        "metric {name}{{{}}} is not in the scrape ({} lines)",
        want.join(","),
        scrape.lines().count()
    ))
}

/// Opens (creating) a file for appending, for logs kept across restarts.
pub fn append_file(path: &Path) -> File {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_in_reads_the_last_address() {
        assert_eq!(
            port_in("lakecache worker listening on http://127.0.0.1:40123"),
            Some(40123)
        );
        assert_eq!(
            port_in("2026 04:24:05 N | serving on 127.0.0.1:39721, this"),
            Some(39721)
        );
        assert_eq!(port_in("no address here"), None);
    }

    #[test]
    fn drawn_ports_lie_outside_the_ephemeral_range_and_never_repeat() {
        let (lo, hi) = ports::ephemeral_range();
        assert!(lo <= hi, "{lo}-{hi}");
        let drawn: Vec<u16> = (0..50).map(|_| unused_port()).collect();
        for &p in &drawn {
            assert!(!(lo..=hi).contains(&p), "{p} is in {lo}-{hi}");
            assert!(p >= 10_000, "{p}");
        }
        let distinct: std::collections::BTreeSet<_> = drawn.iter().collect();
        assert_eq!(
            distinct.len(),
            drawn.len(),
            "a port handed out twice: {drawn:?}"
        );
    }

    #[test]
    fn a_line_still_being_written_is_not_read() {
        let partial = "starting\nlakecache worker listening on https://127.0.0.";
        assert_eq!(complete_lines(partial).collect::<Vec<_>>(), ["starting"]);
        let whole = format!("{partial}1:40123\n");
        let line = complete_lines(&whole).find(|l| l.contains("listening on"));
        assert_eq!(line.and_then(port_in), Some(40123));
        assert_eq!(complete_lines("no newline yet").count(), 0);
    }

    #[test]
    fn a_missing_metric_is_an_error_not_zero() {
        let scrape = "# TYPE a counter\nlakecache_reads_total{op=\"read\"} 7\nlakecache_reads_total_x 3\nplain 2\n";
        assert_eq!(
            metric(scrape, "lakecache_reads_total", &[("op", "read")]),
            Ok(7.0)
        );
        assert_eq!(metric(scrape, "plain", &[]), Ok(2.0));
        assert!(metric(scrape, "lakecache_reads_total", &[("op", "stat")]).is_err());
        assert!(metric(scrape, "lakecache_reads", &[]).is_err());
    }
}
