//! The fewest fetches any cache of a given size could make for a known
//! access sequence (Belady's MIN: on a miss with the cache full, drop the
//! item whose next use is furthest, the one just fetched included). The
//! plan bench prints it beside what the workers fetched from S3, so a
//! reader can tell how much of the fetch volume is the eviction policy's
//! doing and how much the fetch granularity's.

use std::collections::{BTreeSet, HashMap};

/// Misses of an optimal cache holding `capacity` items over `seq`, counted
/// per chunk of `chunk` accesses (one per epoch).
pub fn min_misses(seq: &[u64], capacity: usize, chunk: usize) -> Vec<usize> {
    let mut per_chunk = vec![0; seq.len().div_ceil(chunk.max(1))];
    // next[i]: where seq[i] is used next (usize::MAX: never).
    let mut next = vec![usize::MAX; seq.len()];
    let mut last: HashMap<u64, usize> = HashMap::new();
    for (i, item) in seq.iter().enumerate().rev() {
        next[i] = last.insert(*item, i).unwrap_or(usize::MAX);
    }
    let mut cached: HashMap<u64, usize> = HashMap::new();
    let mut by_next: BTreeSet<(usize, u64)> = BTreeSet::new();
    for (i, &item) in seq.iter().enumerate() {
        if let Some(at) = cached.remove(&item) {
            by_next.remove(&(at, item));
        } else {
            per_chunk[i / chunk.max(1)] += 1;
            if cached.len() >= capacity {
                match by_next.last().copied() {
                    // The item itself is used last: it is not kept.
                    Some((furthest, _)) if next[i] >= furthest => continue,
                    Some((furthest, victim)) => {
                        by_next.remove(&(furthest, victim));
                        cached.remove(&victim);
                    }
                    None => continue,
                }
            }
        }
        cached.insert(item, next[i]);
        by_next.insert((next[i], item));
    }
    per_chunk
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way of choosing what to drop, tried: the true minimum.
    fn brute_force(seq: &[u64], capacity: usize, held: &mut Vec<u64>, at: usize) -> usize {
        let Some(&item) = seq.get(at) else { return 0 };
        if held.contains(&item) {
            return brute_force(seq, capacity, held, at + 1);
        }
        // Not keeping it is always allowed.
        let mut best = 1 + brute_force(seq, capacity, held, at + 1);
        if held.len() < capacity {
            held.push(item);
            best = best.min(1 + brute_force(seq, capacity, held, at + 1));
            held.pop();
        } else {
            for i in 0..held.len() {
                let out = std::mem::replace(&mut held[i], item);
                best = best.min(1 + brute_force(seq, capacity, held, at + 1));
                held[i] = out;
            }
        }
        best
    }

    #[test]
    fn the_textbook_sequence_misses_eight_times_with_three_frames() {
        let seq = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1];
        // Textbooks give 9 for a cache that must keep what it fetched;
        // not keeping the 4 (used never again) saves one.
        assert_eq!(min_misses(&seq, 3, seq.len()), vec![8]);
        assert_eq!(brute_force(&seq, 3, &mut Vec::new(), 0), 8);
        // Counted per chunk, and nothing held: every access misses.
        let halves = min_misses(&seq, 3, 10);
        assert_eq!(halves.iter().sum::<usize>(), 8);
        assert_eq!(halves.len(), 2);
        assert_eq!(min_misses(&seq, 0, 10), vec![10, 10]);
    }

    #[test]
    fn it_matches_an_exhaustive_search_on_small_sequences() {
        let mut state = 7u64;
        for _ in 0..200 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 4 + (state >> 60) as usize;
            let items = 2 + (state >> 40) % 4;
            let seq: Vec<u64> = (0..len)
                .map(|i| (state >> (i % 48)).wrapping_mul(i as u64 + 3) % items)
                .collect();
            for capacity in 1..4 {
                assert_eq!(
                    min_misses(&seq, capacity, seq.len())[0],
                    brute_force(&seq, capacity, &mut Vec::new(), 0),
                    "{seq:?} with {capacity}"
                );
            }
        }
    }
}
