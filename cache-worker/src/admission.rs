//! When a random reader's miss fills a whole check block and when it
//! fetches only what it asked for. A block is fetched whole (and kept)
//! once the exact reads of it have cost as many S3 bytes as the block
//! itself: S3 bytes per byte read then stay under 2 for any access
//! pattern (the ski-rental bound), and blocks read often end up cached.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;

use crate::pages::PageKey;

/// Blocks tracked at most; beyond it the tally starts over (costing at
/// most one more exact read per block).
const MAX_TRACKED: usize = 1 << 16;

#[derive(Default)]
pub struct RandomAdmission {
    /// Bytes read exactly so far, per (page, block).
    rented: Mutex<HashMap<(PageKey, u64), u64>>,
}

impl RandomAdmission {
    /// Whether a miss of `sub` (page-relative; the page is `page_len`
    /// long, in blocks of `block`) should fetch the blocks it touches
    /// whole: only once every one of them has been paid for by exact
    /// reads. If not, the read is counted against each block.
    pub fn admit(&self, page: PageKey, sub: &Range<u64>, block: u64, page_len: u64) -> bool {
        let mut rented = self.rented.lock().unwrap_or_else(|e| e.into_inner());
        let first = sub.start / block;
        let last = sub.end.div_ceil(block);
        let overlap = |i: u64| sub.end.min((i + 1) * block) - sub.start.max(i * block);
        let paid_for = (first..last).all(|i| {
            let block_len = page_len.min((i + 1) * block) - i * block;
            rented.get(&(page, i)).copied().unwrap_or(0) + overlap(i) >= block_len
        });
        if paid_for {
            for i in first..last {
                rented.remove(&(page, i));
            }
            return true;
        }
        if rented.len() >= MAX_TRACKED {
            rented.clear();
        }
        for i in first..last {
            *rented.entry((page, i)).or_default() += overlap(i);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_bought_once_reads_of_it_cost_as_much() {
        let a = RandomAdmission::default();
        let page = PageKey::new("s3://b/k", "e", 0);
        let mut fetched = 0;
        let mut asked = 0;
        let mut bought = false;
        while !bought {
            asked += 4096;
            let at = 3 * 256 * 1024 + (asked % 8192);
            bought = a.admit(page, &(at..at + 4096), 256 * 1024, 4 << 20);
            fetched += if bought { 256 * 1024 } else { 4096 };
        }
        assert_eq!(asked, 256 * 1024);
        assert!(fetched <= 2 * asked, "{fetched} > 2 x {asked}");
        // Another block starts from nothing.
        assert!(!a.admit(page, &(4 << 18..(4 << 18) + 4096), 256 * 1024, 4 << 20));
        // A short last block is paid for sooner.
        assert!(a.admit(page, &(0..1000), 256 * 1024, 1000));
    }
}
