//! Mounting: stale-mount cleanup, kernel options, a multi-threaded
//! session, and a clean unmount that never leaves a dead mount behind.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fuser::{Config, MountOption, Session, SessionACL};

use crate::adapter::KernelAdapter;
use crate::fs::Fs;

#[derive(Debug, Clone)]
pub struct MountOptions {
    pub mountpoint: PathBuf,
    /// Let other users in (needs `user_allow_other` in /etc/fuse.conf
    /// unless mounting as root).
    pub allow_other: bool,
    pub read_only: bool,
    /// Threads reading requests from /dev/fuse.
    pub threads: usize,
    /// A program that runs [`crate::unmount_guard::run`] as its
    /// `mount-guard` subcommand, started to remove the mount if this
    /// process dies; none leaves that to fusermount3's auto_unmount.
    pub unmount_guard: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("{path}: {message}")]
    Mountpoint { path: PathBuf, message: String },
    #[error("mounting {path} failed: {source}")]
    Mount {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub struct Mounted {
    mountpoint: PathBuf,
    unmounter: fuser::SessionUnmounter,
    _guard: Option<crate::unmount_guard::UnmountGuard>,
    session: Option<std::thread::JoinHandle<std::io::Result<()>>>,
    /// Becomes true when the session thread returns; awaited any number
    /// of times (a oneshot would panic when polled after completion).
    ended: tokio::sync::watch::Receiver<bool>,
    /// The tier socket, served while the mount is (dropped after it).
    _tier_clients: Option<crate::tier_clients::TierClients>,
}

/// True when `path` is a mount whose server is gone ("Transport endpoint
/// is not connected").
pub fn is_dead_mount(path: &Path) -> bool {
    // statfs always reaches the server; stat may be answered from cached
    // attributes of a connection that is already gone.
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let mut buf = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: c_path is NUL-terminated and buf is large enough for statfs.
    let rc = unsafe { libc::statfs(c_path.as_ptr(), buf.as_mut_ptr()) };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOTCONN)
}

/// Whether `path` is a mount point, from /proc/self/mountinfo.
pub fn is_mounted(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| unescape_mountinfo(mp) == want)
}

/// What `abort_connection` did.
#[derive(Debug)]
pub struct Aborted {
    /// The FUSE connection's number (`/sys/fs/fuse/connections/N`).
    pub connection: u32,
    /// Whether the mount point was detached afterwards.
    pub detached: bool,
}

/// Ends a FUSE mount whose server is stuck: aborts the kernel's FUSE
/// connection (every request waiting on the server fails at once, and
/// processes blocked in them can be killed again), then detaches the
/// mount point. Never touches the mount itself, which would block: the
/// connection is found in `/proc/self/mountinfo` by the mount point's
/// path, taken as given (made absolute, not resolved).
pub fn abort_connection(path: &Path) -> std::io::Result<Aborted> {
    use std::io::{Error, ErrorKind};
    let path = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    };
    let want = path.to_string_lossy().trim_end_matches('/').to_string();
    let entry = mount_entry(&path)?;
    let fstype = entry
        .split_once(" - ")
        .and_then(|(_, rest)| rest.split(' ').next())
        .unwrap_or("");
    if fstype != "fuse" && !fstype.starts_with("fuse.") {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("{want} is a {fstype} mount, not a FUSE one"),
        ));
    }
    let connection = device_of(&entry).map(|(_, minor)| minor).ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidData,
            format!("unreadable mountinfo entry {entry:?}"),
        )
    })?;
    let connections = Path::new("/sys/fs/fuse/connections");
    let abort = connections.join(connection.to_string()).join("abort");
    if !abort.exists() {
        mount_fusectl(connections)?;
    }
    std::fs::write(&abort, b"1")
        .map_err(|e| Error::new(e.kind(), format!("writing {}: {e}", abort.display())))?;
    Ok(Aborted {
        connection,
        detached: force_unmount(&path).is_ok(),
    })
}

/// The top mountinfo entry for the absolute `path`.
fn mount_entry(path: &Path) -> std::io::Result<String> {
    let want = path.to_string_lossy().trim_end_matches('/').to_string();
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    // The last entry for the path is the one on top.
    info.lines()
        .rfind(|l| l.split(' ').nth(4).map(unescape_mountinfo).as_deref() == Some(&want))
        .map(str::to_string)
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{want} is not a mount point"),
            )
        })
}

/// The device (major, minor) a mountinfo entry names.
fn device_of(entry: &str) -> Option<(u32, u32)> {
    let (major, minor) = entry.split(' ').nth(2)?.split_once(':')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// Lets the kernel send reads of up to `bytes` at once. A FUSE mount's
/// read-ahead starts at the kernel's default (128 KiB), whatever the
/// server asks at init, and buffered reads reach the server in pieces of
/// that size: a loader's 1 MiB read of a sample came as nine 128 KiB
/// reads (eight, and one ahead), which look like a stream starting and
/// set the mount's own read-ahead going; it fetched about 7 times the
/// sample. Raising it needs root; without, reads work as before.
fn raise_read_ahead(path: &Path, bytes: u32) {
    let knob = mount_entry(path).and_then(|entry| {
        let (major, minor) = device_of(&entry).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, "no device in mountinfo")
        })?;
        Ok(PathBuf::from(format!(
            "/sys/class/bdi/{major}:{minor}/read_ahead_kb"
        )))
    });
    let kib = bytes / 1024;
    let raised = knob.and_then(|knob| {
        let now: u32 = std::fs::read_to_string(&knob)?.trim().parse().unwrap_or(0);
        if now < kib {
            std::fs::write(&knob, format!("{kib}\n"))?;
        }
        Ok(knob)
    });
    match raised {
        Ok(knob) => tracing::debug!(knob = %knob.display(), kib, "kernel read size raised"),
        Err(e) => tracing::info!(
            error = %e,
            "could not raise the kernel's read-ahead for this mount (needs root); reads reach the mount in 128 KiB pieces"
        ),
    }
}

/// The kernel's FUSE control filesystem, where systemd has not mounted it.
fn mount_fusectl(at: &Path) -> std::io::Result<()> {
    let target = std::ffi::CString::new(at.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: every pointer is a NUL-terminated string that outlives the call.
    let rc = unsafe {
        libc::mount(
            c"fusectl".as_ptr(),
            target.as_ptr(),
            c"fusectl".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EBUSY) {
        Ok(())
    } else {
        let e = std::io::Error::last_os_error();
        Err(std::io::Error::new(
            e.kind(),
            format!("mounting fusectl at {}: {e}", at.display()),
        ))
    }
}

fn unescape_mountinfo(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// `fusermount3 -u [-z] path`; true when it succeeded.
fn fusermount_unmount(path: &Path, lazy: bool) -> bool {
    let mut cmd = std::process::Command::new("fusermount3");
    cmd.arg("-u");
    if lazy {
        cmd.arg("-z");
    }
    cmd.arg(path)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Detaches whatever is mounted at `path` (lazy, so a busy mount goes too).
pub fn force_unmount(path: &Path) -> std::io::Result<()> {
    if fusermount_unmount(path, true) {
        return Ok(());
    }
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: c_path is a valid NUL-terminated string for the call.
    let rc = unsafe { libc::umount2(c_path.as_ptr(), libc::MNT_DETACH) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn user_allow_other() -> bool {
    std::fs::read_to_string("/etc/fuse.conf")
        .map(|c| c.lines().any(|l| l.trim() == "user_allow_other"))
        .unwrap_or(false)
}

fn prepare_mountpoint(path: &Path) -> Result<PathBuf, MountError> {
    let err = |message: String| MountError::Mountpoint {
        path: path.to_path_buf(),
        message,
    };
    if is_dead_mount(path) {
        tracing::warn!(path = %path.display(), "removing a dead mount left by a crashed client");
        force_unmount(path).map_err(|e| err(format!("cannot remove the dead mount: {e}")))?;
    }
    std::fs::create_dir_all(path).map_err(|e| err(format!("cannot create: {e}")))?;
    let path = path
        .canonicalize()
        .map_err(|e| err(format!("cannot resolve: {e}")))?;
    let meta = std::fs::metadata(&path).map_err(|e| err(e.to_string()))?;
    if !meta.is_dir() {
        return Err(err("not a directory".into()));
    }
    if is_mounted(&path) {
        return Err(err(
            "something is already mounted here; unmount it first".into()
        ));
    }
    Ok(path)
}

/// Mounts `fs` and serves it from background threads until [`Mounted::unmount`]
/// or an external `umount`.
pub fn mount(
    fs: Arc<Fs>,
    runtime: tokio::runtime::Handle,
    options: &MountOptions,
) -> Result<Mounted, MountError> {
    let path = prepare_mountpoint(&options.mountpoint)?;
    let fs_config = fs.config().clone();
    let mut mount_options = vec![
        MountOption::FSName(format!(
            "lakecache:{}/{}",
            fs_config.bucket, fs_config.prefix
        )),
        MountOption::Subtype("lakecache".into()),
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoAtime,
        MountOption::DefaultPermissions,
        if options.read_only {
            MountOption::RO
        } else {
            MountOption::RW
        },
    ];
    // SAFETY: geteuid cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let acl = if options.allow_other {
        SessionACL::All
    } else if root || user_allow_other() {
        SessionACL::RootAndOwner
    } else {
        SessionACL::Owner
    };
    // auto_unmount (fusermount3 stays behind and unmounts when this
    // process dies) needs an ACL other than owner-only. The guard covers
    // its race, and the owner-only case.
    if acl != SessionACL::Owner {
        mount_options.push(MountOption::AutoUnmount);
    } else if options.unmount_guard.is_none() {
        tracing::warn!("auto_unmount unavailable (not root, no user_allow_other): a crashed client leaves a dead mount that the next mount cleans up");
    }
    let mut config = Config::default();
    config.mount_options = mount_options;
    config.acl = acl;
    config.n_threads = Some(options.threads.max(1));
    config.clone_fd = true;

    // Started before the session exists so it inherits no /dev/fuse fd.
    let guard =
        match &options.unmount_guard {
            Some(program) => Some(crate::unmount_guard::spawn(program, &path).map_err(|e| {
                MountError::Mount {
                    path: path.clone(),
                    source: std::io::Error::new(
                        e.kind(),
                        format!("starting the unmount guard: {e}"),
                    ),
                }
            })?),
            None => None,
        };
    if !options.read_only && fs_config.writes_back_any() {
        // The local worker writes its spare page files before the first
        // checkpoint burst, not after it.
        let data = fs.data_plane().clone();
        runtime.spawn(async move { data.prepare_write_back().await });
    }
    let kernel_cache = fs.kernel_cache().clone();
    // Other readers on the node share the tier through the mount.
    let tier_clients = {
        let _in_runtime = runtime.enter();
        crate::tier_clients::serve(fs.clone())
    };
    let adapter = KernelAdapter::new(fs, runtime, options.threads.max(1));
    let mut session = Session::new(adapter, &path, &config).map_err(|e| MountError::Mount {
        path: path.clone(),
        source: e,
    })?;
    kernel_cache.connect(Box::new(session.notifier()));
    raise_read_ahead(&path, crate::adapter::MAX_IO_BYTES);
    let unmounter = session.unmount_callable();
    let (done_tx, ended) = tokio::sync::watch::channel(false);
    let thread = std::thread::Builder::new()
        .name("fuse-session".into())
        .spawn(move || {
            let r = session.run();
            let _ = done_tx.send(true);
            r
        })
        .map_err(|e| MountError::Mount {
            path: path.clone(),
            source: e,
        })?;
    tracing::info!(path = %path.display(), bucket = %fs_config.bucket, prefix = %fs_config.prefix, "mounted");
    Ok(Mounted {
        mountpoint: path,
        unmounter,
        _guard: guard,
        session: Some(thread),
        ended,
        _tier_clients: tier_clients,
    })
}

impl Mounted {
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Resolves when the session ends on its own (external `umount`).
    pub async fn ended(&mut self) {
        // An error means the sender is gone, i.e. the thread ended too.
        let _ = self.ended.wait_for(|ended| *ended).await;
    }

    /// Unmounts and waits for the session threads. A busy mount is
    /// detached lazily rather than left behind.
    pub async fn unmount(mut self) -> std::io::Result<()> {
        if is_mounted(&self.mountpoint) {
            // fusermount3 itself: fuser's unmounter only closes the
            // auto_unmount socket, which can leave the mount in place.
            if !fusermount_unmount(&self.mountpoint, false) {
                if let Err(e) = self.unmounter.unmount() {
                    tracing::debug!(error = %e, "fuser unmount failed");
                }
            }
            if is_mounted(&self.mountpoint) {
                tracing::warn!(path = %self.mountpoint.display(), "mount busy; detaching lazily");
                force_unmount(&self.mountpoint)?;
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(30), self.ended()).await;
        if let Some(thread) = self.session.take() {
            if thread.is_finished() {
                match thread.join() {
                    Ok(Err(e)) => tracing::debug!(error = %e, "fuse session ended with an error"),
                    Err(_) => tracing::error!("fuse session thread panicked"),
                    Ok(Ok(())) => {}
                }
            }
        }
        tracing::info!(path = %self.mountpoint.display(), "unmounted");
        Ok(())
    }
}
