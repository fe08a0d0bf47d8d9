//! Consistent hashing of (object URI, segment) onto workers.

use std::hash::{Hash, Hasher};

use hashring::HashRing;

use crate::membership::Member;
use crate::stable_hash::{StableKey, Xxh3Builder};

/// Virtual nodes per worker: with 8 equal workers the busiest owns at
/// most 1.1x the mean share of keys (see `balance_with_eight_workers`).
pub const DEFAULT_VNODES: u32 = 512;
/// Big shards are placed 64 MiB at a time so one file spreads out.
pub const DEFAULT_SEGMENT_SIZE: u64 = 64 << 20;

#[derive(Debug, Clone)]
pub struct RingOptions {
    pub vnodes: u32,
    /// Give workers virtual nodes in proportion to their capacity.
    pub weight_by_capacity: bool,
    pub segment_size: u64,
}

impl Default for RingOptions {
    fn default() -> Self {
        Self {
            vnodes: DEFAULT_VNODES,
            weight_by_capacity: false,
            segment_size: DEFAULT_SEGMENT_SIZE,
        }
    }
}

/// One point on the ring: the `replica`-th virtual node of a worker.
#[derive(Debug, Clone, PartialEq)]
struct VirtualNode {
    member: usize,
    id: std::sync::Arc<str>,
    replica: u32,
}

impl StableKey for VirtualNode {
    fn stable_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.id.len() + 5);
        b.extend_from_slice(self.id.as_bytes());
        b.push(b'#');
        b.extend_from_slice(&self.replica.to_be_bytes());
        b
    }
}

impl Hash for VirtualNode {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(&self.stable_bytes());
    }
}

/// The placement key: `uri`, a zero byte, the segment index big-endian.
#[derive(Debug, Clone, Copy)]
pub struct SegmentKey<'a> {
    pub uri: &'a str,
    pub segment: u64,
}

impl StableKey for SegmentKey<'_> {
    fn stable_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.uri.len() + 9);
        b.extend_from_slice(self.uri.as_bytes());
        b.push(0);
        b.extend_from_slice(&self.segment.to_be_bytes());
        b
    }
}

impl Hash for SegmentKey<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(&self.stable_bytes());
    }
}

/// An immutable ring over one membership view; rebuilt on every change.
pub struct Ring {
    ring: HashRing<VirtualNode, Xxh3Builder>,
    members: Vec<Member>,
    options: RingOptions,
}

impl Ring {
    pub fn new(members: &[Member], options: RingOptions) -> Self {
        let mut members: Vec<Member> = members.to_vec();
        members.sort_by(|a, b| a.id.cmp(&b.id));
        members.dedup_by(|a, b| a.id == b.id);
        let mean_capacity = if members.is_empty() {
            0.0
        } else {
            members.iter().map(|m| m.capacity as f64).sum::<f64>() / members.len() as f64
        };
        let mut nodes = Vec::new();
        for (idx, m) in members.iter().enumerate() {
            let count = if options.weight_by_capacity && mean_capacity > 0.0 {
                ((options.vnodes as f64 * m.capacity as f64 / mean_capacity).round() as u32).max(1)
            } else {
                options.vnodes.max(1)
            };
            let id: std::sync::Arc<str> = m.id.as_str().into();
            for replica in 0..count {
                nodes.push(VirtualNode {
                    member: idx,
                    id: id.clone(),
                    replica,
                });
            }
        }
        let mut ring = HashRing::with_hasher(Xxh3Builder);
        ring.batch_add(nodes);
        Self {
            ring,
            members,
            options,
        }
    }

    pub fn members(&self) -> &[Member] {
        &self.members
    }

    pub fn segment_size(&self) -> u64 {
        self.options.segment_size
    }

    /// The segment holding byte `offset` of an object.
    pub fn segment_of(&self, offset: u64) -> u64 {
        offset / self.options.segment_size
    }

    pub fn owner(&self, uri: &str, segment: u64) -> Option<&Member> {
        self.ring
            .get(&SegmentKey { uri, segment })
            .map(|v| &self.members[v.member])
    }

    /// Up to `n` distinct workers for a segment: the owner, then the next
    /// workers clockwise. This walks a copy of the ring (hashring has no
    /// cursor API), so callers use it on the failure path only.
    pub fn replicas(&self, uri: &str, segment: u64, n: usize) -> Vec<&Member> {
        let Some(nodes) = self
            .ring
            .get_with_replicas(&SegmentKey { uri, segment }, self.ring.len())
        else {
            return Vec::new();
        };
        let mut out: Vec<&Member> = Vec::with_capacity(n.min(self.members.len()));
        let mut seen = vec![false; self.members.len()];
        for v in nodes {
            if !seen[v.member] {
                seen[v.member] = true;
                out.push(&self.members[v.member]);
                if out.len() == n {
                    break;
                }
            }
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn members(n: usize) -> Vec<Member> {
        (0..n)
            .map(|i| Member {
                id: format!("worker-{i}"),
                address: format!("10.0.0.{i}:9500"),
                capacity: 100 << 30,
            })
            .collect()
    }

    fn shares(ring: &Ring, keys: usize) -> Vec<usize> {
        let mut counts = vec![0usize; ring.members().len()];
        for k in 0..keys {
            let uri = format!("s3://lake/shards/{k:06}.bin");
            let owner = ring.owner(&uri, 0).unwrap();
            let idx = ring
                .members()
                .iter()
                .position(|m| m.id == owner.id)
                .unwrap();
            counts[idx] += 1;
        }
        counts
    }

    #[test]
    fn balance_with_eight_workers() {
        let ring = Ring::new(&members(8), RingOptions::default());
        let keys = 100_000;
        let counts = shares(&ring, keys);
        let mean = keys as f64 / 8.0;
        let max = *counts.iter().max().unwrap() as f64;
        println!(
            "8 workers, {} vnodes: max/mean = {:.3} ({counts:?})",
            DEFAULT_VNODES,
            max / mean
        );
        assert!(
            max / mean <= 1.1,
            "busiest worker owns {:.3}x the mean",
            max / mean
        );
    }

    #[test]
    fn replicas_are_distinct_and_start_with_the_owner() {
        let ring = Ring::new(&members(5), RingOptions::default());
        for seg in 0..200 {
            let reps = ring.replicas("s3://b/k", seg, 3);
            assert_eq!(reps.len(), 3);
            assert_eq!(reps[0].id, ring.owner("s3://b/k", seg).unwrap().id);
            assert_ne!(reps[0].id, reps[1].id);
            assert_ne!(reps[1].id, reps[2].id);
            assert_ne!(reps[0].id, reps[2].id);
        }
        assert_eq!(ring.replicas("s3://b/k", 0, 10).len(), 5);
    }

    #[test]
    fn weights_follow_capacity() {
        let mut ms = members(2);
        ms[1].capacity = 3 * ms[0].capacity;
        let ring = Ring::new(
            &ms,
            RingOptions {
                weight_by_capacity: true,
                ..Default::default()
            },
        );
        let counts = shares(&ring, 40_000);
        let ratio = counts[1] as f64 / counts[0] as f64;
        assert!((2.5..3.5).contains(&ratio), "share ratio {ratio}");
    }

    #[test]
    fn placement_is_pinned() {
        // Owners must never change between builds: pinned expectations.
        let ring = Ring::new(&members(4), RingOptions::default());
        let owners: Vec<&str> = (0..8)
            .map(|s| ring.owner("s3://lake/pin.bin", s).unwrap().id.as_str())
            .collect();
        let pinned: Vec<&str> = include_str!("../testdata/pinned_owners.txt")
            .split_whitespace()
            .collect();
        assert_eq!(owners, pinned);
    }

    #[test]
    fn key_movement_is_near_one_over_n() {
        let keys = 20_000;
        for n in 3..=16 {
            let before = Ring::new(&members(n), RingOptions::default());
            let after = Ring::new(&members(n + 1), RingOptions::default());
            let moved = (0..keys)
                .filter(|k| {
                    let uri = format!("s3://lake/{k}");
                    before.owner(&uri, 0).unwrap().id != after.owner(&uri, 0).unwrap().id
                })
                .count();
            let frac = moved as f64 / keys as f64;
            let ideal = 1.0 / (n + 1) as f64;
            assert!(
                frac <= ideal * 1.25,
                "n={n}: moved {frac:.4}, ideal {ideal:.4}"
            );
        }
    }
}
