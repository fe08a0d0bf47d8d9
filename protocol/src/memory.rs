//! A memory budget shared by every request of a process (the mount's
//! read-ahead and upload queues, the worker's uploads and cold fetches):
//! work that would exceed it backs off or waits, so memory stays bounded
//! under any load instead of growing with it.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Accounting granularity; keeps permit counts small for large budgets.
const UNIT: u64 = 64 * 1024;

#[derive(Debug)]
pub struct MemoryBudget {
    permits: Arc<Semaphore>,
    units: u64,
}

/// Bytes held against the budget until dropped.
#[derive(Debug)]
pub struct Reservation {
    _permit: Option<OwnedSemaphorePermit>,
}

impl Reservation {
    /// Bytes that are not accounted (reads a caller is waiting for).
    pub fn none() -> Self {
        Self { _permit: None }
    }
}

fn units_of(bytes: u64) -> u64 {
    bytes.div_ceil(UNIT).max(1)
}

impl MemoryBudget {
    pub fn new(bytes: u64) -> Arc<Self> {
        let units = units_of(bytes).min(Semaphore::MAX_PERMITS as u64);
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(units as usize)),
            units,
        })
    }

    pub fn limit(&self) -> u64 {
        self.units * UNIT
    }

    pub fn available(&self) -> u64 {
        self.permits.available_permits() as u64 * UNIT
    }

    /// Takes `bytes` if the budget has them now.
    pub fn try_reserve(&self, bytes: u64) -> Option<Reservation> {
        let n = u32::try_from(units_of(bytes).min(self.units)).ok()?;
        self.permits
            .clone()
            .try_acquire_many_owned(n)
            .ok()
            .map(|p| Reservation { _permit: Some(p) })
    }

    /// Waits until `bytes` are free (a request larger than the whole
    /// budget waits for all of it).
    pub async fn reserve(&self, bytes: u64) -> Reservation {
        let n = u32::try_from(units_of(bytes).min(self.units)).unwrap_or(u32::MAX);
        match self.permits.clone().acquire_many_owned(n).await {
            Ok(p) => Reservation { _permit: Some(p) },
            // The semaphore is never closed; account nothing if it were.
            Err(_) => Reservation::none(),
        }
    }
}

/// Makes large buffers (upload parts, pages, read-ahead chunks: 1 MiB
/// and up) come from `mmap` and go back to the OS when freed. glibc
/// otherwise raises its mmap threshold after the first such free and
/// serves later ones from heap arenas, where fragmentation keeps the
/// process near its peak RSS long after the buffers are gone. Call once,
/// early in `main`.
pub fn return_large_buffers_to_the_os() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; 1 MiB is a valid
    // M_MMAP_THRESHOLD (at most HEAP_MAX/2).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// Physical memory of this machine (8 GiB when it cannot be read).
pub fn physical_memory() -> u64 {
    // SAFETY: sysconf reads system constants and touches no memory.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages > 0 && page > 0 {
        pages as u64 * page as u64
    } else {
        8 << 30
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reservations_are_bounded_and_released_on_drop() {
        let budget = MemoryBudget::new(1 << 20);
        let a = budget.try_reserve(768 << 10).expect("fits");
        assert!(budget.try_reserve(512 << 10).is_none(), "over budget");
        let b = budget.try_reserve(256 << 10).expect("the rest fits");
        assert_eq!(budget.available(), 0);
        drop(a);
        assert_eq!(budget.available(), 768 << 10);
        // A waiting reservation proceeds once memory is released.
        let waiter = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(1 << 20).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        drop(b);
        let all = waiter.await.unwrap();
        assert_eq!(budget.available(), 0);
        drop(all);
        assert_eq!(budget.available(), 1 << 20);
    }
}
