//! A watcher process that removes the mount when its client dies.
//!
//! fusermount3's auto_unmount alone is racy: it wakes when its socket to
//! the client closes, which the kernel may do before the client's last
//! /dev/fuse descriptor is released. It then finds the connection still
//! up (the open it probes with fails with ECONNABORTED, not ENOTCONN) and
//! leaves a dead mount behind. The guard is started before mounting, so
//! it holds no /dev/fuse descriptor, and reads a pipe from the client:
//! when the pipe closes it waits until the connection is gone and
//! detaches the mount. It unmounts nothing that is still served.

use std::io::Read;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crate::mount::{force_unmount, is_dead_mount, is_mounted};

/// The subcommand the guard program is run with: `<program> mount-guard <path>`.
pub const GUARD_SUBCOMMAND: &str = "mount-guard";

/// How long a guard waits, after its client died, for the mount to be
/// either gone or dead before it gives up.
const SETTLE_LIMIT: Duration = Duration::from_secs(10);

/// The client's side: the guard dies with nothing to do once this is
/// dropped after a clean unmount; when the client is killed the kernel
/// closes the pipe for it.
pub struct UnmountGuard {
    _pipe: ChildStdin,
    _child: Child,
}

/// Starts `program mount-guard <mountpoint>` in a session of its own, so
/// signals sent to the client's process group do not reach it.
pub fn spawn(program: &Path, mountpoint: &Path) -> std::io::Result<UnmountGuard> {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(program);
    command
        .arg(GUARD_SUBCOMMAND)
        .arg(mountpoint)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = command.spawn()?;
    let pipe = child
        .stdin
        .take()
        .ok_or_else(|| std::io::Error::other("the guard's stdin was not piped"))?;
    Ok(UnmountGuard {
        _pipe: pipe,
        _child: child,
    })
}

/// The guard's body: waits for its stdin to close, then detaches the
/// mount at `mountpoint` if its server is gone. Returns the exit code.
pub fn run(mountpoint: &Path) -> i32 {
    let mut stdin = std::io::stdin();
    let mut buf = [0u8; 64];
    loop {
        match stdin.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let deadline = Instant::now() + SETTLE_LIMIT;
    loop {
        if !is_mounted(mountpoint) {
            return 0;
        }
        // A connection whose server just died answers ECONNABORTED until
        // the kernel has finished tearing it down, then ENOTCONN.
        if is_dead_mount(mountpoint) {
            return match force_unmount(mountpoint) {
                Ok(()) => 0,
                Err(_) => 1,
            };
        }
        if Instant::now() >= deadline {
            return 1;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
