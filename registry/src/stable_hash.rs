//! The placement hash: XXH3-64 (seed 0) over exactly the bytes a key type
//! writes. `std::hash::Hash` output of std types is not promised stable
//! across Rust versions, so ring key types write their bytes explicitly
//! through [`StableKey`].

use std::hash::{BuildHasher, Hasher};

/// Buffers written bytes and hashes them at `finish`.
#[derive(Default)]
pub struct Xxh3Hasher {
    bytes: Vec<u8>,
}

impl Hasher for Xxh3Hasher {
    fn write(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
    }

    fn finish(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&self.bytes)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Xxh3Builder;

impl BuildHasher for Xxh3Builder {
    type Hasher = Xxh3Hasher;

    fn build_hasher(&self) -> Xxh3Hasher {
        Xxh3Hasher::default()
    }
}

/// The bytes a value contributes to the placement hash.
pub trait StableKey {
    fn stable_bytes(&self) -> Vec<u8>;
}

/// Placement hash of a key, as the ring computes it.
pub fn placement_hash(key: &impl StableKey) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&key.stable_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh3_matches_the_published_test_vectors() {
        // XXH3-64 of the empty input and of "a" with seed 0 (reference values
        // from the xxHash specification test suite).
        assert_eq!(xxhash_rust::xxh3::xxh3_64(b""), 0x2D06_8005_38D3_94C2);
        let mut h = Xxh3Builder.build_hasher();
        h.write(b"");
        assert_eq!(h.finish(), 0x2D06_8005_38D3_94C2);
    }
}
