//! Reused buffers for large response bodies. A multi-MiB body collected
//! into a fresh allocation is served by `mmap`, so every 4 KiB of it costs
//! a page fault and a page clear before the data is even copied in (7% of
//! the mount's CPU on a warm sequential read). Buffers of 1 MiB and up go
//! back to a small idle pool when the last `Bytes` pointing into them is
//! dropped, and the next body of a similar size reuses one.
//!
//! Every buffer starts on a 4 KiB boundary and its capacity is a multiple
//! of 4 KiB, so a page fetched from S3 can be written to disk with
//! `O_DIRECT` straight from it (see [`PoolBuf::padded_to`]).

use std::alloc::{alloc_zeroed, dealloc, realloc, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use bytes::Bytes;

/// Smaller buffers come from the heap cheaply and are not pooled.
const MIN_POOLED: usize = 1 << 20;

/// Start and capacity of every buffer are multiples of this: what
/// `O_DIRECT` asks of memory on any block device.
pub const ALIGN: usize = 4096;

/// Idle bytes kept at most; set lower by a process with a small memory
/// budget ([`set_idle_limit`]).
static IDLE_LIMIT: AtomicUsize = AtomicUsize::new(64 << 20);

static IDLE: Mutex<Vec<PoolBuf>> = Mutex::new(Vec::new());

/// Buffers this large are mapped from the kernel with every page
/// populated in one call: zeroed there once, with no page fault per 4 KiB
/// (a fault and a clear per page was 3-4% of a cold read's CPU) and no
/// second zeroing pass in user space.
const MAPPED: usize = 128 * 1024;

/// A byte buffer aligned to [`ALIGN`], whose whole capacity is always
/// initialized (zeroed when allocated), so it can be lengthened without
/// writing to it first.
pub struct PoolBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: PoolBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for PoolBuf {}
// SAFETY: shared access only reads through `&self`.
unsafe impl Sync for PoolBuf {}

impl PoolBuf {
    fn layout(capacity: usize) -> Layout {
        Layout::from_size_align(capacity, ALIGN).unwrap_or_else(|_| {
            // Only a capacity near usize::MAX gets here; no allocation of
            // that size can succeed either.
            std::alloc::handle_alloc_error(Layout::new::<[u8; ALIGN]>())
        })
    }

    /// An empty buffer with room for at least `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        let capacity = capacity.max(1).next_multiple_of(ALIGN);
        let ptr = if capacity >= MAPPED {
            map_zeroed(capacity)
        } else {
            let layout = Self::layout(capacity);
            // SAFETY: the layout has a non-zero size.
            let raw = unsafe { alloc_zeroed(layout) };
            NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
        };
        Self {
            ptr,
            len: 0,
            capacity,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    fn reserve_total(&mut self, total: usize) {
        if total <= self.capacity {
            return;
        }
        let new_capacity = total.max(self.capacity * 2).next_multiple_of(ALIGN);
        if self.capacity >= MAPPED || new_capacity >= MAPPED {
            // Moved into a new buffer (zeroed past what is copied).
            let mut grown = Self::with_capacity(new_capacity);
            grown.extend_from_slice(self);
            let len = self.len;
            *self = grown;
            self.len = len;
            return;
        }
        // SAFETY: `ptr` was allocated with `layout(capacity)`; the new size
        // is non-zero and keeps the alignment.
        let raw = unsafe { realloc(self.ptr.as_ptr(), Self::layout(self.capacity), new_capacity) };
        let ptr = NonNull::new(raw)
            .unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout(new_capacity)));
        // SAFETY: the grown tail is ours and uninitialized; zero it so the
        // whole capacity stays initialized.
        unsafe {
            std::ptr::write_bytes(
                ptr.as_ptr().add(self.capacity),
                0,
                new_capacity - self.capacity,
            )
        };
        self.ptr = ptr;
        self.capacity = new_capacity;
    }

    pub fn extend_from_slice(&mut self, data: &[u8]) {
        let end = self.len + data.len();
        self.reserve_total(end);
        // SAFETY: `end` <= capacity; source and destination do not overlap
        // (`data` cannot borrow our spare capacity).
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.ptr.as_ptr().add(self.len),
                data.len(),
            )
        };
        self.len = end;
    }

    /// Sets the length to `len`, growing if needed. Bytes past the old
    /// length hold whatever an earlier use of the buffer left there.
    pub fn set_len(&mut self, len: usize) {
        self.reserve_total(len);
        self.len = len;
    }

    /// The bytes followed by zeros up to the next multiple of `align`
    /// (which must divide [`ALIGN`]): an `O_DIRECT` write's source.
    pub fn padded_to(&mut self, align: usize) -> &[u8] {
        let end = self.len.next_multiple_of(align.clamp(1, ALIGN));
        // Within capacity: it is a multiple of ALIGN, and align divides it.
        let end = end.min(self.capacity);
        // SAFETY: the whole capacity is initialized and owned by us.
        let all = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), end) };
        all[self.len..].fill(0);
        all
    }
}

impl Deref for PoolBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the first `len` bytes are initialized (all of capacity is).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for deref, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        if self.capacity >= MAPPED {
            // SAFETY: mapped with this length by `map_zeroed`, and unused
            // from here on.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.capacity) };
        } else {
            // SAFETY: allocated with this layout in `with_capacity`/`reserve_total`.
            unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.capacity)) }
        }
    }
}

/// `len` bytes of private anonymous memory, zeroed and populated.
fn map_zeroed(len: usize) -> NonNull<u8> {
    // SAFETY: a fresh anonymous mapping aliases nothing; failure is
    // checked below.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        std::alloc::handle_alloc_error(PoolBuf::layout(len));
    }
    NonNull::new(raw.cast()).unwrap_or_else(|| std::alloc::handle_alloc_error(PoolBuf::layout(len)))
}

fn idle() -> std::sync::MutexGuard<'static, Vec<PoolBuf>> {
    IDLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Caps the bytes idle buffers may hold (0: no pooling).
pub fn set_idle_limit(bytes: usize) {
    IDLE_LIMIT.store(bytes, Ordering::Relaxed);
    let mut pool = idle();
    while pool.iter().map(PoolBuf::capacity).sum::<usize>() > bytes {
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
    idle().iter().map(PoolBuf::capacity).sum()
}

/// An empty buffer with room for `capacity` bytes: an idle one of about
/// that size when there is one.
pub fn take(capacity: usize) -> PoolBuf {
    if capacity >= MIN_POOLED {
        let mut pool = idle();
        let fits = pool
            .iter()
            .rposition(|b| b.capacity() >= capacity && b.capacity() / 2 <= capacity);
        if let Some(i) = fits {
            let mut buf = pool.remove(i);
            buf.clear();
            return buf;
        }
    }
    PoolBuf::with_capacity(capacity)
}

/// Freezes a filled buffer; a pooled-size one returns to the pool when
/// its last `Bytes` is dropped.
/// `n` bytes of `file` from offset `at`, read into a pooled buffer.
pub fn read_at(file: &std::fs::File, at: u64, n: usize) -> std::io::Result<Bytes> {
    use std::os::unix::fs::FileExt;
    let mut buf = take(n);
    buf.set_len(n);
    file.read_exact_at(&mut buf, at)?;
    Ok(freeze(buf))
}

pub fn freeze(buf: PoolBuf) -> Bytes {
    if buf.capacity() >= MIN_POOLED {
        Bytes::from_owner(Pooled(Some(buf)))
    } else {
        Bytes::from_owner(buf)
    }
}

struct Pooled(Option<PoolBuf>);

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        self.0.as_deref().unwrap_or_default()
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(buf) = self.0.take() {
            give_back(buf);
        }
    }
}

/// Returns a buffer to the idle pool if it is pooled-size, making room by
/// freeing the longest idle ones: the sizes in use change (4 MiB S3 pages
/// while a cache fills, 1 MiB reads once it is warm), and a pool full of
/// the old size would make every new buffer a fresh mapping.
fn give_back(buf: PoolBuf) {
    let limit = IDLE_LIMIT.load(Ordering::Relaxed);
    if buf.capacity() < MIN_POOLED || buf.capacity() > limit {
        return;
    }
    let mut pool = idle();
    let mut idle_bytes = pool.iter().map(PoolBuf::capacity).sum::<usize>();
    while idle_bytes + buf.capacity() > limit && !pool.is_empty() {
        idle_bytes -= pool.remove(0).capacity();
    }
    pool.push(buf);
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
        let mut small = take(100);
        small.extend_from_slice(&[1u8; 100]);
        let small = freeze(small);
        drop(small);
        // Idle bytes stay within the limit.
        set_idle_limit(6 << 20);
        let held: Vec<Bytes> = (0..3)
            .map(|_| {
                let mut b = take(4 << 20);
                b.set_len(4 << 20);
                freeze(b)
            })
            .collect();
        drop(held);
        assert!(idle_bytes() <= 6 << 20, "{}", idle_bytes());
        // A new size pushes the old ones out instead of being dropped.
        set_idle_limit(8 << 20);
        let big: Vec<Bytes> = (0..2)
            .map(|_| {
                let mut b = take(4 << 20);
                b.set_len(4 << 20);
                freeze(b)
            })
            .collect();
        drop(big);
        assert_eq!(idle_bytes(), 8 << 20);
        let mut small = take(1 << 20);
        small.set_len(1 << 20);
        assert!(
            small.capacity() < 2 << 20,
            "a 4 MiB buffer is too big for 1 MiB"
        );
        drop(freeze(small));
        let again = take(1 << 20);
        assert!(again.capacity() < 2 << 20);
        assert!(idle_bytes() <= 8 << 20);
        set_idle_limit(0);
        assert_eq!(idle_bytes(), 0);
        set_idle_limit(64 << 20);
    }

    #[test]
    fn buffers_are_aligned_initialized_and_keep_their_bytes_when_grown() {
        let mut buf = PoolBuf::with_capacity(10);
        assert_eq!(buf.as_ptr() as usize % ALIGN, 0);
        assert_eq!(buf.capacity(), ALIGN);
        buf.extend_from_slice(b"hello");
        // Past the capacity: grows, stays aligned, keeps the bytes.
        buf.extend_from_slice(&[9u8; 3 * ALIGN]);
        assert_eq!(buf.as_ptr() as usize % ALIGN, 0);
        assert_eq!(buf.capacity() % ALIGN, 0);
        assert_eq!(&buf[..5], b"hello");
        assert_eq!(buf.len(), 5 + 3 * ALIGN);
        // Into and within mapped sizes: still aligned, bytes kept.
        buf.extend_from_slice(&vec![3u8; MAPPED]);
        buf.extend_from_slice(&vec![4u8; 2 * MAPPED]);
        assert_eq!(buf.as_ptr() as usize % ALIGN, 0);
        assert_eq!(&buf[..5], b"hello");
        assert_eq!(buf.len(), 5 + 3 * ALIGN + 3 * MAPPED);
        assert!(buf[5 + 3 * ALIGN..][..MAPPED].iter().all(|b| *b == 3));
        assert!(buf[5 + 3 * ALIGN + MAPPED..].iter().all(|b| *b == 4));
        // Lengthening exposes zeroed (never uninitialized) bytes.
        let mut fresh = PoolBuf::with_capacity(2 * ALIGN);
        fresh.set_len(2 * ALIGN);
        assert!(fresh.iter().all(|b| *b == 0));
        // Padding for a direct write: zeros after the data, to the block.
        let mut tail = PoolBuf::with_capacity(ALIGN);
        tail.extend_from_slice(&[1u8; 700]);
        tail.set_len(1000);
        tail[700..].fill(5);
        tail.set_len(700);
        let padded = tail.padded_to(512);
        assert_eq!(padded.len(), 1024);
        assert!(padded[..700].iter().all(|b| *b == 1));
        assert!(padded[700..].iter().all(|b| *b == 0));
        assert_eq!(tail.len(), 700);
        // Frozen small buffers still read back.
        let frozen = freeze(tail);
        assert_eq!(frozen.len(), 700);
    }
}
