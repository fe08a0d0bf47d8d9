//! The store of planned ranges: what it holds, serves and lets go.

use super::*;
use crate::data_plane::{DataError, DataFault, DataOp, FaultyDataPlane, MemoryDataPlane};

const MIB: u64 = 1 << 20;

fn body(len: u64) -> Vec<u8> {
    (0..len).map(|i| (i * 7 % 251) as u8).collect()
}

type Store = (
    Arc<PlanRanges>,
    Arc<FaultyDataPlane<MemoryDataPlane>>,
    String,
);

/// A store over one 8 MiB object, and the object's ETag.
fn store(most: u64, budget: u64) -> Store {
    store_of(8 * MIB, most, budget)
}

/// A store over one object of `len` bytes.
fn store_of(len: u64, most: u64, budget: u64) -> Store {
    let plane = Arc::new(FaultyDataPlane::new(MemoryDataPlane::new()));
    let etag = plane.inner().insert("bkt", "d/a.bin", body(len));
    let ranges = PlanRanges::new(plane.clone(), MemoryBudget::new(budget), most);
    (ranges, plane, etag)
}

fn uri() -> ObjectUri {
    "s3://bkt/d/a.bin".parse().unwrap()
}

async fn held(ranges: &PlanRanges, start: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let done = ranges.lock()["s3://bkt/d/a.bin"][&start].held.is_some();
        if done {
            return;
        }
        assert!(Instant::now() < deadline, "range at {start} never fetched");
        // The fetch runs on this runtime: let it, then wait a little.
        tokio::task::yield_now().await;
        if ranges.lock()["s3://bkt/d/a.bin"][&start].held.is_none() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

#[tokio::test]
async fn a_held_range_serves_one_read_of_its_version_then_goes() {
    let (ranges, plane, etag) = store(64 * MIB, 64 * MIB);
    assert!(ranges.fetch(&uri(), MIB, 2 * MIB));
    held(&ranges, MIB).await;
    assert_eq!(plane.read_ranges(), vec![MIB..2 * MIB]);
    // Another version: not served, and the range is dropped.
    assert!(ranges
        .take("s3://bkt/d/a.bin", "\"other\"", MIB, MIB)
        .is_none());
    assert_eq!(ranges.held_bytes(), 0);

    assert!(ranges.fetch(&uri(), MIB, 2 * MIB));
    held(&ranges, MIB).await;
    let want = body(8 * MIB);
    // A read of its first half, then of the rest: the range goes after.
    let first = ranges
        .take("s3://bkt/d/a.bin", &etag, MIB, MIB / 2)
        .unwrap();
    assert_eq!(&first[..], &want[MIB as usize..(MIB + MIB / 2) as usize]);
    assert!(ranges.has("s3://bkt/d/a.bin", MIB));
    let rest = ranges
        .take("s3://bkt/d/a.bin", &etag, MIB + MIB / 2, MIB / 2)
        .unwrap();
    assert_eq!(&rest[..], &want[(MIB + MIB / 2) as usize..2 * MIB as usize]);
    assert!(!ranges.has("s3://bkt/d/a.bin", MIB));
    assert_eq!(ranges.held_bytes(), 0);
    // Reads outside any held range find nothing.
    assert!(ranges.take("s3://bkt/d/a.bin", &etag, 0, MIB).is_none());
    assert_eq!(ranges.stats.served.load(Ordering::Relaxed), 2);
    assert_eq!(plane.calls(DataOp::Read), 2);
}

#[tokio::test]
async fn a_read_it_cannot_answer_whole_drops_the_ranges_it_overlaps() {
    let (ranges, _, etag) = store(64 * MIB, 64 * MIB);
    for i in 0..3 {
        assert!(ranges.fetch(&uri(), (2 * i + 1) * MIB, (2 * i + 2) * MIB));
        held(&ranges, (2 * i + 1) * MIB).await;
    }
    let key = "s3://bkt/d/a.bin";
    // Past the end of [1, 2) MiB: not answered short; the range goes.
    assert!(ranges.take(key, &etag, MIB + MIB / 2, MIB).is_none());
    assert!(!ranges.has(key, MIB));
    // Starting before [3, 4) MiB and ending inside it: it goes too.
    assert!(ranges.take(key, &etag, 2 * MIB, MIB + 1).is_none());
    assert!(!ranges.has(key, 3 * MIB));
    // A read between ranges touches none.
    assert!(ranges.take(key, &etag, 4 * MIB, MIB).is_none());
    assert!(ranges.has(key, 5 * MIB));
    assert_eq!(ranges.held_bytes(), MIB);
    assert_eq!(ranges.stats.dropped.load(Ordering::Relaxed), 2);
    // Ranges that follow one another answer one read across them (the
    // kernel reading ahead two samples at once).
    assert!(ranges.fetch(&uri(), 6 * MIB, 7 * MIB));
    held(&ranges, 6 * MIB).await;
    let want = body(8 * MIB);
    let got = ranges.take(key, &etag, 5 * MIB + MIB / 2, MIB).unwrap();
    assert!(got[..] == want[(5 * MIB + MIB / 2) as usize..(6 * MIB + MIB / 2) as usize]);
    assert!(!ranges.has(key, 5 * MIB) && ranges.has(key, 6 * MIB));
}

#[tokio::test]
async fn a_read_never_waits_on_a_fetch_and_a_failed_fetch_holds_nothing() {
    let (ranges, plane, etag) = store(64 * MIB, 64 * MIB);
    plane.inject(DataOp::Read, 0, 1, DataFault::Fail(DataError::NotFound));
    assert!(ranges.fetch(&uri(), 0, MIB));
    let deadline = Instant::now() + Duration::from_secs(10);
    while ranges.has("s3://bkt/d/a.bin", 0) {
        assert!(Instant::now() < deadline, "a failed fetch stayed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(ranges.held_bytes(), 0);
    // A read that finds its range still being fetched drops it.
    plane.inject(
        DataOp::Read,
        0,
        1,
        DataFault::Delay(Duration::from_millis(300)),
    );
    assert!(ranges.fetch(&uri(), 0, MIB));
    assert!(ranges.take("s3://bkt/d/a.bin", &etag, 0, MIB).is_none());
    assert!(!ranges.has("s3://bkt/d/a.bin", 0));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!ranges.has("s3://bkt/d/a.bin", 0), "a late fetch came back");
    assert_eq!(ranges.held_bytes(), 0);
}

#[tokio::test]
async fn the_bound_and_the_budget_cap_what_is_held() {
    // Bound of 2 MiB: a third 1 MiB range waits for room.
    let (ranges, _, etag) = store(2 * MIB, 64 * MIB);
    assert!(ranges.fetch(&uri(), 0, MIB));
    assert!(ranges.fetch(&uri(), MIB, 2 * MIB));
    assert!(!ranges.fetch(&uri(), 2 * MIB, 3 * MIB));
    assert!(!ranges.fetch(&uri(), 0, MAX_RANGE + 1), "too large");
    held(&ranges, 0).await;
    assert!(ranges.take("s3://bkt/d/a.bin", &etag, 0, MIB).is_some());
    assert!(ranges.fetch(&uri(), 2 * MIB, 3 * MIB));
    // At most FETCHES_IN_FLIGHT run at once (this test's runtime has one
    // thread: none of them runs before the test waits).
    let (ranges, _, _) = store(64 * MIB, 64 * MIB);
    for i in 0..FETCHES_IN_FLIGHT as u64 {
        assert!(ranges.fetch(&uri(), i * MIB / 4, (i + 1) * MIB / 4));
    }
    let over = FETCHES_IN_FLIGHT as u64;
    assert!(!ranges.fetch(&uri(), over * MIB / 4, (over + 1) * MIB / 4));
    // The mount's budget of 1 MiB: once a range holds it, no other
    // range is fetched until that one is read.
    let (ranges, _, etag) = store(64 * MIB, MIB);
    assert!(ranges.fetch(&uri(), 0, MIB));
    assert!(!ranges.fetch(&uri(), MIB, 2 * MIB));
    held(&ranges, 0).await;
    assert!(ranges.take("s3://bkt/d/a.bin", &etag, 0, MIB).is_some());
    assert!(ranges.fetch(&uri(), MIB, 2 * MIB));
}

mod reads {
    use super::*;
    use proptest::prelude::*;

    /// The unit of ranges and reads: 128 of them make the object.
    const UNIT: u64 = 8 << 10;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Whatever reads come, in 8 KiB units over a 1 MiB object: an
        /// answer is exactly the object's bytes, no read panics, and the
        /// store's count of held bytes is what its ranges hold.
        #[test]
        fn any_read_gets_the_objects_bytes_or_nothing(
            starts in proptest::collection::btree_set(0u64..120, 1..12),
            reads in proptest::collection::vec((0u64..128, 1u64..40), 1..40),
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let (ranges, _, etag) = store_of(128 * UNIT, 64 * MIB, 64 * MIB);
                let want = body(128 * UNIT);
                // Ranges of 1-8 units, cut short where the next begins.
                let starts: Vec<u64> = starts.into_iter().collect();
                for (i, &s) in starts.iter().enumerate() {
                    let next = starts.get(i + 1).copied().unwrap_or(128);
                    let end = (s + 1 + s % 8).min(next);
                    prop_assert!(ranges.fetch(&uri(), s * UNIT, end * UNIT));
                    held(&ranges, s * UNIT).await;
                }
                for (at, len) in reads {
                    let (offset, len) = (at * UNIT, len * UNIT);
                    if let Some(got) = ranges.take("s3://bkt/d/a.bin", &etag, offset, len) {
                        prop_assert_eq!(got.len() as u64, len);
                        prop_assert!(got[..] == want[offset as usize..(offset + len) as usize]);
                    }
                    let held_now: u64 = ranges
                        .lock()
                        .values()
                        .flat_map(|s| s.iter().map(|(start, slot)| slot.end - start))
                        .sum();
                    prop_assert_eq!(ranges.held_bytes(), held_now);
                }
                Ok(())
            })?;
        }
    }
}
