//! What a tier directory must be before a mount uses it: creatable,
//! writable, ours (or empty), of our format, on a filesystem big enough,
//! and not in use by another mount. Each refusal names the path and the
//! fix; nothing in a directory we did not make is ever deleted.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::{io, TierError, FORMAT};

/// Makes `dir` (its parent must exist: a missing parent is more often a
/// disk that is not mounted than a wish for new directories) and checks
/// that it holds a tier of our format or nothing at all.
pub(super) fn prepare(dir: &Path) -> Result<(), TierError> {
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(TierError::NoParent(dir.to_path_buf()))
        }
        Err(e) => return Err(not_writable(dir, e)),
    }
    if !dir.is_dir() {
        return Err(TierError::NotADirectory(dir.to_path_buf()));
    }
    let format = dir.join("FORMAT");
    match std::fs::read_to_string(&format) {
        Ok(text) if text.trim() == FORMAT => {}
        Ok(text) => {
            return Err(TierError::Format {
                path: dir.to_path_buf(),
                found: text.trim().chars().take(64).collect(),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let empty = std::fs::read_dir(dir).map_err(io(dir))?.next().is_none();
            if !empty {
                return Err(TierError::Foreign(dir.to_path_buf()));
            }
            std::fs::write(&format, format!("{FORMAT}\n")).map_err(|e| not_writable(dir, e))?;
        }
        Err(e) => return Err(io(&format)(e)),
    }
    // A tier left by a mount on a filesystem since made read-only.
    let probe = dir.join(".write-probe");
    File::create(&probe).map_err(|e| not_writable(dir, e))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

fn not_writable(dir: &Path, source: std::io::Error) -> TierError {
    TierError::NotWritable {
        path: dir.to_path_buf(),
        source,
    }
}

/// Refuses a capacity larger than the filesystem that holds `dir`.
pub(super) fn check_capacity(dir: &Path, capacity: u64) -> Result<(), TierError> {
    let Some(disk) = filesystem_bytes(dir) else {
        return Ok(());
    };
    if capacity > disk {
        return Err(TierError::LargerThanDisk {
            path: dir.to_path_buf(),
            capacity,
            disk,
        });
    }
    Ok(())
}

fn filesystem_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statvfs we own.
    (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0)
        .then(|| st.f_blocks as u64 * st.f_frsize as u64)
}

/// An exclusive lock on the tier, held while the mount lives: two mounts
/// filling and evicting one directory would delete each other's files.
pub(super) struct TierLock {
    _file: File,
}

pub(super) fn lock(dir: &Path) -> Result<TierLock, TierError> {
    let path: PathBuf = dir.join("LOCK");
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| not_writable(dir, e))?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        return Err(TierError::InUse {
            path: dir.to_path_buf(),
            holder: holder.trim().to_string(),
        });
    }
    // Who holds it, for the next mount's message.
    let _ = file.set_len(0);
    let _ = writeln!(file, "pid {}", std::process::id());
    Ok(TierLock { _file: file })
}
