//! Per-inode locks around the S3 calls that change an object's key or
//! existence. A delayed metadata store copies the object onto itself; if
//! that copy were in flight while a rename or unlink deleted the key, it
//! would land after the delete and bring the old name back (seen with
//! `rsync -a`, which chmods a temp file and then renames it, on a loaded
//! machine). The store, the rename and the unlink of one inode take turns.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

#[derive(Default)]
pub(super) struct ObjectLocks {
    map: Mutex<HashMap<u64, Arc<AsyncMutex<()>>>>,
}

/// Held while one inode's object is stored, renamed or deleted.
pub(super) struct ObjectGuard<'a> {
    locks: &'a ObjectLocks,
    ino: u64,
    guard: Option<OwnedMutexGuard<()>>,
}

impl ObjectLocks {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<AsyncMutex<()>>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub async fn lock(&self, ino: u64) -> ObjectGuard<'_> {
        let lock = self.map().entry(ino).or_default().clone();
        let guard = lock.lock_owned().await;
        ObjectGuard {
            locks: self,
            ino,
            guard: Some(guard),
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map().len()
    }
}

impl Drop for ObjectGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        // The last holder or waiter removes the entry: the map holds only
        // inodes being worked on.
        let mut map = self.locks.map();
        if map
            .get(&self.ino)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            map.remove(&self.ino);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn one_inode_at_a_time_and_nothing_left_behind() {
        let locks = Arc::new(ObjectLocks::default());
        let first = locks.lock(7).await;
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move {
                let _g = locks.lock(7).await;
            })
        };
        // Another inode is not held up.
        drop(locks.lock(8).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiter.is_finished(),
            "the second lock of inode 7 did not wait"
        );
        drop(first);
        waiter.await.unwrap();
        assert_eq!(locks.len(), 0);
    }
}
