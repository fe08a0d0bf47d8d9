//! Process helpers shared by the CLI's integration tests.
#![allow(dead_code)] // each test binary uses a different subset

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_lakecache");

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn wait_for_port(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not open port {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills the process when dropped, so a failing test leaves nothing behind.
pub struct Proc(pub Child);

impl Proc {
    pub fn kill9(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// SIGTERM, then the exit status.
    pub fn term(&mut self) -> Option<std::process::ExitStatus> {
        let pid = self.0.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        self.0.wait().ok()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// `lakecache s3-server` on a free port with one bucket.
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
    let port = free_port();
    let child = Command::new(BIN)
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
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_port(port, "s3-server");
    (Proc(child), port)
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
