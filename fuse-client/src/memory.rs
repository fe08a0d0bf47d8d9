//! The mount's memory: one [`MemoryBudget`] for read-ahead chunks and
//! queued upload data of every open file. Read-ahead backs off when it is
//! spent (the bytes a reader asked for are always fetched); writers wait
//! until their queued data has gone to the worker.

pub use lakecache_protocol::memory::{MemoryBudget, Reservation};

/// 1/8 of physical memory, at most 4 GiB (at least 64 MiB).
pub fn default_limit() -> u64 {
    (lakecache_protocol::memory::physical_memory() / 8).clamp(64 << 20, 4 << 30)
}

/// Hands freed heap memory back to the kernel (glibc keeps it otherwise,
/// and a mount that once listed millions of names would stay large).
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}
