//! The mount's metrics and its table of operations in flight, one set
//! per process (a process serves one mount), exported on
//! `--metrics-listen`.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use lakecache_telemetry::{counter, seconds_histogram, InFlight, MetricsRegistry};
use opentelemetry::metrics::{Counter, Histogram};
use opentelemetry::KeyValue;

pub struct MountMetrics {
    pub registry: Arc<MetricsRegistry>,
    pub inflight: Arc<InFlight>,
    op_seconds: Histogram<f64>,
    op_errors: Counter<u64>,
    read_bytes: Counter<u64>,
    tier_hit_bytes: Counter<u64>,
    cached_now_bytes: Counter<u64>,
    tier_socket_bytes: Counter<u64>,
    readahead_hit_bytes: Counter<u64>,
    readahead_wasted_bytes: Counter<u64>,
    dir_prefetch_files: Counter<u64>,
    plan_ranges: Counter<u64>,
    worker_whole_fetches: Counter<u64>,
    upload_bytes: Counter<u64>,
    upload_seconds: Histogram<f64>,
    write_stalls: Counter<u64>,
    write_resends: Counter<u64>,
    write_respooled: Counter<u64>,
    local_commits: Counter<u64>,
    local_commit_bytes: Counter<u64>,
    followed_commits: Counter<u64>,
}

/// The process's mount metrics.
pub fn global() -> &'static MountMetrics {
    static METRICS: OnceLock<MountMetrics> = OnceLock::new();
    METRICS.get_or_init(MountMetrics::new)
}

impl MountMetrics {
    fn new() -> Self {
        let registry = Arc::new(MetricsRegistry::new());
        let inflight = InFlight::new();
        let meter = registry.meter("lakecache-mount");
        let table = inflight.clone();
        meter
            .u64_observable_gauge("lakecache_fuse_inflight_ops")
            .with_description("FUSE operations being worked on now")
            .with_callback(move |o| o.observe(table.len() as u64, &[]))
            .build();
        Self {
            op_seconds: seconds_histogram(
                &meter,
                "lakecache_fuse_op_duration",
                "FUSE operation latency by op, from the kernel's request to the reply",
            ),
            op_errors: counter(
                &meter,
                "lakecache_fuse_errors",
                "",
                "FUSE operations answered with an error, by op and errno",
            ),
            read_bytes: counter(
                &meter,
                "lakecache_fuse_read",
                "By",
                "Bytes returned to read(2) through FUSE",
            ),
            tier_hit_bytes: counter(
                &meter,
                "lakecache_fuse_local_tier_hit",
                "By",
                "Bytes read from the node-local tier instead of a worker",
            ),
            cached_now_bytes: {
                let cached_now = counter(
                    &meter,
                    "lakecache_fuse_worker_cached_now",
                    "By",
                    "Bytes of random reads a worker on this host had cached, answered on the kernel-request thread",
                );
                // Exported from the start: none yet reads as 0, not absent.
                cached_now.add(0, &[]);
                cached_now
            },
            tier_socket_bytes: counter(
                &meter,
                "lakecache_fuse_tier_socket",
                "By",
                "Bytes other readers on the node got through the tier socket (how: file handed over, or inline)",
            ),
            readahead_hit_bytes: counter(
                &meter,
                "lakecache_fuse_readahead_hit",
                "By",
                "Bytes served from read-ahead fetched before they were asked for",
            ),
            readahead_wasted_bytes: counter(
                &meter,
                "lakecache_fuse_readahead_wasted",
                "By",
                "Read-ahead bytes dropped without being read",
            ),
            dir_prefetch_files: counter(
                &meter,
                "lakecache_fuse_dir_prefetch_files",
                "",
                "Files fetched ahead of a reader opening a directory in order, by outcome (used: opened; wasted: dropped unopened)",
            ),
            plan_ranges: {
                let ranges = counter(
                    &meter,
                    "lakecache_fuse_plan_ranges",
                    "",
                    "Planned sample ranges held in memory ahead of a reader, by outcome (fetched: asked of the workers; ready: in memory; served: a read answered from memory; dropped: let go unread, or a read came while it was fetched)",
                );
                // Exported from the start: none yet reads as 0, not absent.
                for outcome in ["fetched", "ready", "served", "dropped"] {
                    ranges.add(0, &[KeyValue::new("outcome", outcome)]);
                }
                ranges
            },
            worker_whole_fetches: counter(
                &meter,
                "lakecache_fuse_worker_whole_fetches",
                "",
                "Objects read randomly, without a node-local tier, that the workers were asked to fetch whole",
            ),
            write_stalls: {
                let stalls = counter(
                    &meter,
                    "lakecache_fuse_write_stalls",
                    "",
                    "Writes given up because their worker made no progress for --write-progress-timeout",
                );
                // Exported from the start: a healthy mount reads 0, not nothing.
                stalls.add(0, &[]);
                stalls
            },
            write_resends: {
                let resends = counter(
                    &meter,
                    "lakecache_fuse_write_resends",
                    "",
                    "Writes sent again, whole, to the next worker after the one taking them stalled",
                );
                resends.add(0, &[]);
                resends
            },
            write_respooled: {
                let respooled = counter(
                    &meter,
                    "lakecache_fuse_write_respooled",
                    "",
                    "Files written out of order (zip headers patched, HDF5), moved off their streamed upload to a spool file",
                );
                respooled.add(0, &[]);
                respooled
            },
            local_commits: {
                let commits = counter(
                    &meter,
                    "lakecache_fuse_local_commits",
                    "",
                    "Written-back files committed by the worker on this host from their staged file",
                );
                commits.add(0, &[]);
                commits
            },
            local_commit_bytes: counter(
                &meter,
                "lakecache_fuse_local_commit",
                "By",
                "Bytes of written-back files committed by the worker on this host",
            ),
            followed_commits: {
                let followed = counter(
                    &meter,
                    "lakecache_fuse_followed_commits",
                    "",
                    "Local commits the worker took while the file was written, sealed at close",
                );
                followed.add(0, &[]);
                followed
            },
            upload_bytes: counter(
                &meter,
                "lakecache_fuse_upload",
                "By",
                "Bytes of files stored on flush, fsync or close",
            ),
            upload_seconds: seconds_histogram(
                &meter,
                "lakecache_fuse_upload_commit_duration",
                "Time flush/fsync/close waited for an upload to be stored",
            ),
            registry,
            inflight,
        }
    }

    /// Exports the node-local tier's state and its completion: objects
    /// whole and partial, bytes missing, and what completion fetched.
    pub fn observe_local_tier(
        &self,
        tier: Arc<crate::local_tier::LocalTier>,
        completer: Arc<crate::complete::Completer>,
        kernel_cache: Arc<crate::kernel_cache::KernelCache>,
    ) {
        use std::sync::atomic::Ordering::Relaxed;
        let meter = self.registry.meter("lakecache-mount");
        let t = tier.clone();
        meter
            .u64_observable_gauge("lakecache_fuse_local_tier_objects")
            .with_description("Objects held by the node-local tier, by state (whole or partial)")
            .with_callback(move |o| {
                let s = t.summary();
                o.observe(s.whole, &[KeyValue::new("state", "whole")]);
                o.observe(s.partial, &[KeyValue::new("state", "partial")]);
            })
            .build();
        let t = tier.clone();
        meter
            .u64_observable_gauge("lakecache_fuse_local_tier_missing_bytes")
            .with_description("Bytes the node-local tier's partial objects still miss")
            .with_callback(move |o| o.observe(t.summary().missing_bytes, &[]))
            .build();
        let t = tier.clone();
        meter
            .u64_observable_counter("lakecache_fuse_local_tier_fill_dropped_bytes")
            .with_description(
                "Bytes not written to the tier because its fill thread was behind (left as holes)",
            )
            .with_callback(move |o| o.observe(t.fill_stats().dropped_bytes.load(Relaxed), &[]))
            .build();
        let t = tier;
        meter
            .u64_observable_counter("lakecache_fuse_local_tier_fill_waited_bytes")
            .with_description(
                "Bytes of fills for objects wanted whole that waited for the fill thread (their readers held back) instead of being dropped",
            )
            .with_callback(move |o| {
                o.observe(t.fill_stats().kept_waited_bytes.load(Relaxed), &[])
            })
            .build();
        meter
            .u64_observable_counter("lakecache_fuse_local_tier_damage")
            .with_description(
                "Damage found in the node-local tier (its bytes fetched again), by kind",
            )
            .with_callback(|o| {
                for kind in crate::local_tier::damage::ALL {
                    o.observe(kind.count(), &[KeyValue::new("kind", kind.name())]);
                }
            })
            .build();
        let c = completer.clone();
        meter
            .u64_observable_counter("lakecache_fuse_local_tier_completion_fetched_bytes")
            .with_description(
                "Bytes fetched from the workers to complete objects in the node-local tier",
            )
            .with_callback(move |o| o.observe(c.stats().fetched_bytes.load(Relaxed), &[]))
            .build();
        let c = completer.clone();
        meter
            .u64_observable_counter("lakecache_fuse_local_tier_completion_requests")
            .with_description(
                "Objects queued for completion in the node-local tier (by readers or a remount)",
            )
            .with_callback(move |o| o.observe(c.stats().asked.load(Relaxed), &[]))
            .build();
        let c = completer;
        meter
            .u64_observable_counter("lakecache_fuse_local_tier_completions")
            .with_description(
                "Objects whose completion ended, by outcome (whole, failed try, abandoned)",
            )
            .with_callback(move |o| {
                let s = c.stats();
                o.observe(
                    s.completed.load(Relaxed),
                    &[KeyValue::new("outcome", "whole")],
                );
                o.observe(
                    s.failures.load(Relaxed),
                    &[KeyValue::new("outcome", "failed")],
                );
                o.observe(
                    s.abandoned.load(Relaxed),
                    &[KeyValue::new("outcome", "abandoned")],
                );
            })
            .build();
        meter
            .u64_observable_counter("lakecache_fuse_page_cache_push")
            .with_unit("By")
            .with_description(
                "Bytes of objects fetched whole for random readers pushed into the kernel's page cache (pushed), or skipped because the pusher was behind (dropped)",
            )
            .with_callback(move |o| {
                let s = kernel_cache.stats();
                o.observe(
                    s.pushed_bytes.load(Relaxed),
                    &[KeyValue::new("outcome", "pushed")],
                );
                o.observe(
                    s.dropped_bytes.load(Relaxed),
                    &[KeyValue::new("outcome", "dropped")],
                );
            })
            .build();
    }

    pub fn op(&self, op: &'static str, elapsed: Duration, errno: Option<i32>) {
        let op_kv = KeyValue::new("op", op);
        self.op_seconds
            .record(elapsed.as_secs_f64(), std::slice::from_ref(&op_kv));
        if let Some(errno) = errno {
            self.op_errors
                .add(1, &[op_kv, KeyValue::new("errno", errno_name(errno))]);
        }
    }

    pub fn read(&self, bytes: u64) {
        self.read_bytes.add(bytes, &[]);
    }

    pub fn cached_now(&self, bytes: u64) {
        self.cached_now_bytes.add(bytes, &[]);
    }

    pub fn tier_hit(&self, bytes: u64) {
        self.tier_hit_bytes.add(bytes, &[]);
    }

    /// `how`: "file" (a tier file handed over whole) or "inline".
    pub fn tier_socket(&self, how: &'static str, bytes: u64) {
        self.tier_socket_bytes
            .add(bytes, &[opentelemetry::KeyValue::new("how", how)]);
    }

    pub fn readahead_hit(&self, bytes: u64) {
        self.readahead_hit_bytes.add(bytes, &[]);
    }

    pub fn readahead_wasted(&self, bytes: u64) {
        self.readahead_wasted_bytes.add(bytes, &[]);
    }

    pub fn dir_prefetch(&self, outcome: &'static str) {
        self.dir_prefetch_files
            .add(1, &[KeyValue::new("outcome", outcome)]);
    }

    pub fn plan_range(&self, outcome: &'static str) {
        self.plan_ranges
            .add(1, &[KeyValue::new("outcome", outcome)]);
    }

    pub fn worker_whole_fetch(&self) {
        self.worker_whole_fetches.add(1, &[]);
    }

    pub fn write_respooled(&self) {
        self.write_respooled.add(1, &[]);
    }

    pub fn write_resend(&self) {
        self.write_resends.add(1, &[]);
    }

    pub fn local_commit(&self, bytes: u64) {
        self.local_commits.add(1, &[]);
        self.local_commit_bytes.add(bytes, &[]);
    }

    pub fn followed_commit(&self) {
        self.followed_commits.add(1, &[]);
    }

    pub fn write_stall(&self) {
        self.write_stalls.add(1, &[]);
    }

    pub fn upload(&self, bytes: u64, elapsed: Duration) {
        self.upload_bytes.add(bytes, &[]);
        self.upload_seconds.record(elapsed.as_secs_f64(), &[]);
    }
}

/// The symbolic name of the errnos the mount answers with.
fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::ENOENT => "ENOENT",
        libc::EIO => "EIO",
        libc::EACCES => "EACCES",
        libc::EPERM => "EPERM",
        libc::EEXIST => "EEXIST",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::EBADF => "EBADF",
        libc::ENOSPC => "ENOSPC",
        libc::EROFS => "EROFS",
        libc::EXDEV => "EXDEV",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ESTALE => "ESTALE",
        libc::EAGAIN => "EAGAIN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::EFBIG => "EFBIG",
        libc::ENODATA => "ENODATA",
        libc::ENOSYS => "ENOSYS",
        other => return other.to_string(),
    };
    name.to_string()
}
