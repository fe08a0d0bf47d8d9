//! The CRC32C of each page of a body, as the stage wrote it. A followed
//! body checks the pages it took early against these once the file is
//! sealed, instead of summing every early page a second time while it is
//! taken: the stage sums each page's blocks anyway, for the page's label.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crate::cache::CacheError;

/// How long a check waits for a page's CRC before it asks again whether
/// the body was dropped (a stage that failed writes no more).
const WAIT_STEP: Duration = Duration::from_millis(100);

#[derive(Debug, Default)]
pub struct PageCrcs {
    state: Mutex<Crcs>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Crcs {
    by_index: HashMap<u64, u32>,
    /// The stage ended (written or failed): no more CRCs come.
    closed: bool,
}

impl PageCrcs {
    /// Page `index` was written with this CRC32C.
    pub fn set(&self, index: u64, crc: u32) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.by_index.insert(index, crc);
        drop(state);
        self.changed.notify_all();
    }

    /// The stage will write no more pages.
    pub fn close(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
        self.changed.notify_all();
    }

    /// The CRC32C page `index` was written with, once it is (blocking).
    pub fn wait(&self, index: u64) -> Result<u32, CacheError> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(crc) = state.by_index.get(&index) {
                return Ok(*crc);
            }
            if state.closed {
                return Err(CacheError::Invalid(format!(
                    "page {index} of the followed file was never written; nothing was recorded"
                )));
            }
            state = self
                .changed
                .wait_timeout(state, WAIT_STEP)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Closes the CRCs when the stage that fills them ends, however it ends.
pub(super) struct CloseOnDrop(pub(super) std::sync::Arc<PageCrcs>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_wait_ends_with_the_crc_or_when_the_stage_ends() {
        let crcs = Arc::new(PageCrcs::default());
        let waiter = {
            let crcs = crcs.clone();
            std::thread::spawn(move || crcs.wait(3))
        };
        crcs.set(2, 7);
        crcs.set(3, 9);
        assert_eq!(waiter.join().unwrap().unwrap(), 9);
        let waiter = {
            let crcs = crcs.clone();
            std::thread::spawn(move || crcs.wait(5))
        };
        drop(CloseOnDrop(crcs.clone()));
        assert!(
            waiter.join().unwrap().is_err(),
            "a closed stage ends the wait"
        );
        assert_eq!(crcs.wait(2).unwrap(), 7, "CRCs set before the close stay");
    }
}
