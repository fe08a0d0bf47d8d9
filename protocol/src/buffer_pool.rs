//! Reused buffers for large response bodies. A multi-MiB body collected
//! into a fresh allocation is served by `mmap`, so every 4 KiB of it costs
//! a page fault and a page clear before the data is even copied in (7% of
//! the mount's CPU on a warm sequential read). Buffers of 1 MiB and up go
//! back to a small idle pool when the last `Bytes` pointing into them is
//! dropped, and the next body of a similar size reuses one.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use bytes::Bytes;

/// Smaller buffers come from the heap cheaply and are not pooled.
const MIN_POOLED: usize = 1 << 20;

/// Idle bytes kept at most; set lower by a process with a small memory
/// budget ([`set_idle_limit`]).
static IDLE_LIMIT: AtomicUsize = AtomicUsize::new(64 << 20);

static IDLE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

fn idle() -> std::sync::MutexGuard<'static, Vec<Vec<u8>>> {
    IDLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Caps the bytes idle buffers may hold (0: no pooling).
pub fn set_idle_limit(bytes: usize) {
    IDLE_LIMIT.store(bytes, Ordering::Relaxed);
    let mut pool = idle();
    while pool.iter().map(Vec::capacity).sum::<usize>() > bytes {
        pool.pop();
    }
}

/// Keeps idle buffers to a small share of a process's memory budget
/// (1/8, at most 64 MiB): they sit outside the budget.
pub fn limit_idle_to_share_of(budget: u64) {
    set_idle_limit(
        usize::try_from(budget / 8)
            .unwrap_or(usize::MAX)
            .min(64 << 20),
    );
}

/// Frees every idle buffer (a process going quiet hands memory back).
pub fn release_idle() {
    idle().clear();
}

/// Bytes held by idle buffers.
pub fn idle_bytes() -> usize {
    idle().iter().map(Vec::capacity).sum()
}

/// An empty buffer with room for `capacity` bytes: an idle one of about
/// that size when there is one.
pub fn take(capacity: usize) -> Vec<u8> {
    if capacity >= MIN_POOLED {
        let mut pool = idle();
        let fits = pool
            .iter()
            .position(|b| b.capacity() >= capacity && b.capacity() / 2 <= capacity);
        if let Some(i) = fits {
            let mut buf = pool.swap_remove(i);
            buf.clear();
            return buf;
        }
    }
    Vec::with_capacity(capacity)
}

/// Freezes a filled buffer; a pooled-size one returns to the pool when
/// its last `Bytes` is dropped.
pub fn freeze(buf: Vec<u8>) -> Bytes {
    if buf.capacity() >= MIN_POOLED {
        Bytes::from_owner(Pooled(buf))
    } else {
        Bytes::from(buf)
    }
}

struct Pooled(Vec<u8>);

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.0));
    }
}

/// Returns a buffer to the idle pool if it is pooled-size and fits.
fn give_back(buf: Vec<u8>) {
    if buf.capacity() < MIN_POOLED {
        return;
    }
    let limit = IDLE_LIMIT.load(Ordering::Relaxed);
    let mut pool = idle();
    if pool.iter().map(Vec::capacity).sum::<usize>() + buf.capacity() <= limit {
        pool.push(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the pool is process-wide.
    #[test]
    fn large_buffers_are_reused_within_the_idle_limit() {
        release_idle();
        let mut buf = take(4 << 20);
        buf.extend_from_slice(&[7u8; 4 << 20]);
        let first = buf.as_ptr();
        let bytes = freeze(buf);
        let slice = bytes.slice(10..20);
        drop(bytes);
        assert_eq!(idle_bytes(), 0, "a slice still holds the buffer");
        assert_eq!(&slice[..], &[7u8; 10]);
        drop(slice);
        assert!(idle_bytes() >= 4 << 20);
        // A body of about that size reuses it, emptied.
        let again = take(3 << 20);
        assert_eq!(again.as_ptr(), first);
        assert!(again.is_empty());
        drop(again);
        // Not a much smaller one, nor small ones at all.
        assert!(take(1 << 20).capacity() < 4 << 20);
        let small = freeze(vec![1u8; 100]);
        drop(small);
        // Idle bytes stay within the limit.
        set_idle_limit(6 << 20);
        let held: Vec<Bytes> = (0..3)
            .map(|_| {
                let mut b = take(4 << 20);
                b.resize(4 << 20, 0);
                freeze(b)
            })
            .collect();
        drop(held);
        assert!(idle_bytes() <= 6 << 20, "{}", idle_bytes());
        set_idle_limit(0);
        assert_eq!(idle_bytes(), 0);
        set_idle_limit(64 << 20);
    }
}
