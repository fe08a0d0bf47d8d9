//! CRC32C of concatenated runs from the runs' CRCs, fast enough to run
//! per block. `crc32c::crc32c_combine` squares a 32x32 GF(2) matrix
//! about log2(len) times on every call: some 20 µs for a 256 KiB block,
//! so combining the block CRCs of a 562 MB checkpoint took 110 ms of the
//! commit its writer waits for. Shifting a CRC over `len` zero bytes is
//! linear, so for a length seen before it is four table lookups.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Lengths whose tables are kept: multiples of [`KEPT_GRAIN`] (block,
/// page and part sizes), up to this many. An object's last block, of any
/// length, is combined the slow way, once.
const KEPT_LENGTHS: usize = 16;
const KEPT_GRAIN: u64 = 64 << 10;

/// The CRC32C of `a || b`, from `crc(a)`, `crc(b)` and `b`'s length.
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    if len_b == 0 {
        return crc_a;
    }
    match shift_for(len_b) {
        Some(shift) => shift.apply(crc_a) ^ crc_b,
        None => crc32c::crc32c_combine(crc_a, crc_b, len_b as usize),
    }
}

/// The operator that moves a CRC over `len` zero bytes, as four tables
/// of 256 entries (one per byte of the CRC).
struct ZeroShift {
    tables: [[u32; 256]; 4],
}

impl ZeroShift {
    fn new(len: u64) -> Self {
        // The image of each of the 32 bits; combining with a zero CRC is
        // the shift alone.
        let bits: [u32; 32] =
            std::array::from_fn(|i| crc32c::crc32c_combine(1 << i, 0, len as usize));
        let mut tables = [[0u32; 256]; 4];
        for (byte, table) in tables.iter_mut().enumerate() {
            for (value, entry) in table.iter_mut().enumerate() {
                *entry = (0..8)
                    .filter(|bit| value & (1 << bit) != 0)
                    .fold(0, |acc, bit| acc ^ bits[byte * 8 + bit]);
            }
        }
        Self { tables }
    }

    fn apply(&self, crc: u32) -> u32 {
        let [b0, b1, b2, b3] = crc.to_le_bytes();
        self.tables[0][b0 as usize]
            ^ self.tables[1][b1 as usize]
            ^ self.tables[2][b2 as usize]
            ^ self.tables[3][b3 as usize]
    }
}

fn shift_for(len: u64) -> Option<Arc<ZeroShift>> {
    if !len.is_multiple_of(KEPT_GRAIN) {
        return None;
    }
    static KEPT: OnceLock<Mutex<HashMap<u64, Arc<ZeroShift>>>> = OnceLock::new();
    let kept = KEPT.get_or_init(Default::default);
    let mut kept = kept.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(shift) = kept.get(&len) {
        return Some(shift.clone());
    }
    if kept.len() >= KEPT_LENGTHS {
        return None;
    }
    let shift = Arc::new(ZeroShift::new(len));
    kept.insert(len, shift.clone());
    Some(shift)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn combining_matches_the_crc_of_the_joined_bytes(
            a in proptest::collection::vec(any::<u8>(), 0..600),
            b in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            let joined = [a.clone(), b.clone()].concat();
            prop_assert_eq!(
                combine(crc32c::crc32c(&a), crc32c::crc32c(&b), b.len() as u64),
                crc32c::crc32c(&joined)
            );
        }

        #[test]
        fn combining_matches_the_slow_combine_at_any_length(
            crc_a: u32,
            crc_b: u32,
            len in prop_oneof![0u64..(64 << 20), (0u64..1024).prop_map(|k| k * KEPT_GRAIN)],
        ) {
            prop_assert_eq!(
                combine(crc_a, crc_b, len),
                crc32c::crc32c_combine(crc_a, crc_b, len as usize)
            );
        }
    }

    #[test]
    fn lengths_beyond_those_kept_still_combine_right() {
        let lens = (1..=(KEPT_LENGTHS as u64 * 2)).flat_map(|i| [i * KEPT_GRAIN, i * 4099]);
        for len in lens {
            let b: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let a = b"head".to_vec();
            let joined = [a.clone(), b.clone()].concat();
            assert_eq!(
                combine(crc32c::crc32c(&a), crc32c::crc32c(&b), len),
                crc32c::crc32c(&joined),
                "{len} bytes"
            );
        }
    }
}
