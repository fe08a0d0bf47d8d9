//! What a mount serves and how it caches.

use std::time::Duration;

/// Long against a healthy worker's pauses (it answers a write's end with
/// a byte every 500 ms, and takes body bytes unless S3 stalls its part
/// uploads), short against a checkpoint's patience.
pub const DEFAULT_WRITE_PROGRESS: Duration = Duration::from_secs(10);

use lakecache_protocol::WriteMode;

#[derive(Debug, Clone)]
pub struct FsConfig {
    pub bucket: String,
    /// Key prefix shown as the mount's root: empty or ending in `/`.
    pub prefix: String,
    pub uid: u32,
    pub gid: u32,
    pub file_mode: u16,
    pub dir_mode: u16,
    /// How long the kernel and the client trust attributes and names.
    pub attr_ttl: Duration,
    pub entry_ttl: Duration,
    /// First read-ahead window of a sequential reader; doubles per read.
    pub readahead_initial: u64,
    /// Largest read-ahead window (bytes in flight per open file).
    pub readahead_max: u64,
    /// Size of one read-ahead request to a worker.
    pub readahead_chunk: u64,
    /// Upper bound on one upload: a writer that stalls longer fails.
    pub upload_timeout: Duration,
    /// A worker that takes no byte of a write for this long while bytes
    /// wait for it, or says nothing for this long once the body is sent,
    /// is given up on: the write fails with EIO instead of holding the
    /// application (and its FUSE request) for as long as the worker hangs.
    pub write_progress_timeout: Duration,
    /// One budget for read-ahead and queued upload data of all handles.
    pub memory_limit: u64,
    /// What the mount's token lets it write (`s3://bucket/prefix`
    /// scopes): opening anything else for writing fails with EACCES at
    /// once instead of at close. `None`: no token, or no limit known.
    pub write_scopes: Option<Vec<String>>,
    /// How files are written unless a prefix below says otherwise.
    pub write_mode: WriteMode,
    /// Keys (full S3 keys, e.g. `runs/checkpoints/`) written back.
    pub write_back_prefixes: Vec<String>,
    /// Keys (full S3 keys, e.g. `datasets/shards/`) whose objects the
    /// node-local tier completes as soon as they are opened, whatever
    /// the read pattern (a shuffling reader never reads 8 MiB in order).
    pub tier_whole_prefixes: Vec<String>,
    /// Bytes a published plan's next objects are fetched ahead into the
    /// node-local tier (all plans together); 0: off.
    pub tier_plan_prefetch: u64,
    /// Bytes of planned ranges (a plan's next samples) held in memory
    /// ahead of the reader, all plans together; 0: none.
    pub plan_memory: u64,
    /// Where the socket for other processes on the node (plans, reads)
    /// is made when the mount has no node-local tier; with a tier it is
    /// in the tier's directory.
    pub client_socket_dir: Option<std::path::PathBuf>,
    /// A random reader (3 jumps in one open) of an object at most this
    /// large gets it fetched whole into the node-local tier; 0: never.
    pub random_whole_max: u64,
    /// A random reader's whole-fetched object is also pushed into the
    /// kernel's page cache for its inode as it arrives (see
    /// `kernel_cache`), so its later reads never reach this process.
    pub push_page_cache: bool,
    /// Bytes fetched ahead of a reader that opens a directory's files in
    /// order (small files, fetched whole); 0: off.
    pub dir_prefetch_window: u64,
    /// Read each object's mode, owner, times and type from its S3 user
    /// metadata (a HEAD per object the first time it is listed); off,
    /// listings alone give the attributes and every object shows the
    /// defaults above (faster `ls -l` of huge datasets).
    pub posix_metadata: bool,
    /// Largest object `truncate` rewrites (to a size other than 0), and
    /// the largest changed in place (opened without `O_TRUNC`).
    pub truncate_rewrite_max: u64,
    /// Where files changed in place are spooled until they are uploaded.
    pub spool_dir: std::path::PathBuf,
    /// Written-back files the worker on this host owns are written into
    /// a staged file with FUSE passthrough (see `staged.rs`).
    pub staged_writes: bool,
    /// How long an operation on a file whose writer was just closed but
    /// still claims the inode (a staged file, or an empty file stored
    /// only on release) waits for that writer's release: the kernel sends
    /// it just after `close` returns, and `close(); open()`,
    /// `close(); rename()` or `close(); unlink()` must find the file
    /// closed, not still written.
    pub release_wait: Duration,
}

impl FsConfig {
    /// The bounds every upload of this mount runs under.
    pub fn upload_limits(&self) -> crate::data_plane::UploadLimits {
        crate::data_plane::UploadLimits {
            total: self.upload_timeout,
            progress: self.write_progress_timeout,
        }
    }

    pub fn new(bucket: impl Into<String>, prefix: impl Into<String>) -> Self {
        let mut prefix = prefix.into();
        if !prefix.is_empty() && !prefix.ends_with('/') {
            prefix.push('/');
        }
        // SAFETY: getuid/getgid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        Self {
            bucket: bucket.into(),
            prefix,
            uid,
            gid,
            file_mode: 0o644,
            dir_mode: 0o755,
            attr_ttl: Duration::from_secs(60),
            entry_ttl: Duration::from_secs(60),
            readahead_initial: 1 << 20,
            readahead_max: 64 << 20,
            readahead_chunk: 8 << 20,
            upload_timeout: Duration::from_secs(6 * 3600),
            write_progress_timeout: DEFAULT_WRITE_PROGRESS,
            memory_limit: crate::memory::default_limit(),
            write_scopes: None,
            write_mode: WriteMode::Through,
            write_back_prefixes: Vec::new(),
            tier_whole_prefixes: Vec::new(),
            tier_plan_prefetch: crate::tier_plans::DEFAULT_TIER_PLAN_PREFETCH,
            plan_memory: crate::plan_ranges::DEFAULT_PLAN_MEMORY,
            client_socket_dir: None,
            random_whole_max: 2 << 30,
            push_page_cache: true,
            dir_prefetch_window: 64 << 20,
            posix_metadata: true,
            truncate_rewrite_max: 1 << 30,
            spool_dir: std::env::temp_dir().join("lakecache-spool"),
            staged_writes: true,
            release_wait: Duration::from_secs(2),
        }
    }

    /// Whether the tier completes `key`'s object at its first open.
    pub fn tier_whole_for(&self, key: &str) -> bool {
        self.tier_whole_prefixes.iter().any(|p| key.starts_with(p))
    }

    /// Whether any object of this mount is written back.
    pub fn writes_back_any(&self) -> bool {
        self.write_mode == WriteMode::Back || !self.write_back_prefixes.is_empty()
    }

    /// The write mode of the object `key`.
    pub fn write_mode_for(&self, key: &str) -> WriteMode {
        if self.write_back_prefixes.iter().any(|p| key.starts_with(p)) {
            WriteMode::Back
        } else {
            self.write_mode
        }
    }
}
