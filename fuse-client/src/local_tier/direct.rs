//! Fills write their aligned middle with `O_DIRECT`: the bytes already sit
//! in the kernel's page cache once, under the mounted file; a second
//! cached copy of the tier file would cost the node memory and the CPU
//! time of allocating it while a cold read is running.

use std::alloc::{alloc, dealloc, Layout};
use std::cell::RefCell;
use std::fs::File;
use std::os::unix::fs::FileExt;

/// Offsets and lengths of direct writes are multiples of this.
pub const ALIGN: u64 = 4096;
const BUFFER: usize = 1 << 20;

struct AlignedBuffer {
    ptr: *mut u8,
    layout: Layout,
}

impl AlignedBuffer {
    fn new() -> Option<Self> {
        let layout = Layout::from_size_align(BUFFER, ALIGN as usize).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc(layout) };
        (!ptr.is_null()).then_some(Self { ptr, layout })
    }

    fn fill(&mut self, from: &[u8]) -> &[u8] {
        let n = from.len().min(BUFFER);
        // SAFETY: `ptr` is valid for BUFFER bytes and `n` <= BUFFER; after
        // the copy the first `n` bytes are initialized.
        unsafe {
            std::ptr::copy_nonoverlapping(from.as_ptr(), self.ptr, n);
            std::slice::from_raw_parts(self.ptr, n)
        }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

thread_local! {
    static BUFFER_OF_THIS_THREAD: RefCell<Option<AlignedBuffer>> = const { RefCell::new(None) };
}

/// Writes `data` (a multiple of [`ALIGN`] long) at `offset` (aligned)
/// through `direct`, an `O_DIRECT` handle.
pub fn write_aligned(direct: &File, data: &[u8], offset: u64) -> std::io::Result<()> {
    BUFFER_OF_THIS_THREAD.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = AlignedBuffer::new();
        }
        let buffer = slot
            .as_mut()
            .ok_or_else(|| std::io::Error::other("no memory for an aligned buffer"))?;
        let mut done = 0;
        while done < data.len() {
            let piece = buffer.fill(&data[done..]);
            direct.write_all_at(piece, offset + done as u64)?;
            done += piece.len();
        }
        Ok(())
    })
}
