//! The plan's reader and lead, and what a plan refuses.

use super::*;
use crate::data_plane::MemoryDataPlane;

const MIB: u64 = 1 << 20;

fn plans(dir: &std::path::Path, budget: u64) -> Arc<TierPlans> {
    plans_on(dir, budget, 64 << 30)
}

fn plans_on(dir: &std::path::Path, budget: u64, capacity: u64) -> Arc<TierPlans> {
    let data: Arc<dyn DataPlane> = Arc::new(MemoryDataPlane::new());
    let tier = Arc::new(LocalTier::open(dir, capacity).unwrap());
    let completer = Arc::new(Completer::new(
        data.clone(),
        tier.clone(),
        crate::memory::MemoryBudget::new(256 * MIB),
    ));
    TierPlans::new(data, Some((tier, completer)), budget, None)
}

fn uri(i: usize) -> String {
    format!("s3://bkt/d/{i}.bin")
}

/// `n` objects of 10 MiB each, read whole, in the order given.
fn install(p: &TierPlans, name: &str, order: &[u32], objects: usize) {
    let objects = (0..objects).map(uri).collect();
    let order = order.iter().map(|&o| (o, 0, 10 * MIB)).collect();
    p.install(name, 60, objects, order, |_| true).unwrap();
}

fn reached(p: &TierPlans, name: &str) -> usize {
    p.lock()[name].reached
}

#[test]
fn opens_move_the_reader_to_each_objects_next_entry_and_never_far_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let p = plans(dir.path(), 1 << 30);
    // Object 3 is read twice: at entries 1 and 5.
    install(&p, "job/0", &[0, 3, 1, 2, 4, 3, 5], 6);
    p.note(&uri(0), None);
    assert_eq!(reached(&p, "job/0"), 1);
    p.note(&uri(3), None);
    assert_eq!(reached(&p, "job/0"), 2);
    // A loader worker a sample ahead: entry 3 first, then 2.
    p.note(&uri(2), None);
    p.note(&uri(1), None);
    assert_eq!(reached(&p, "job/0"), 4);
    // Object 3 again: its second entry.
    p.note(&uri(3), None);
    assert_eq!(reached(&p, "job/0"), 6);
    // Unplanned objects move nothing.
    p.note("s3://bkt/d/elsewhere.bin", None);
    assert_eq!(reached(&p, "job/0"), 6);
    assert_eq!(p.stats.moved.load(Ordering::Relaxed), 4);
}

#[test]
fn a_read_matches_the_entry_whose_range_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let p = plans(dir.path(), 1 << 30);
    // Samples of one shard: 0-1 MiB, then object 1, then 4-5 MiB.
    let objects = vec![uri(0), uri(1)];
    let order = vec![(0, 0, MIB), (1, 0, MIB), (0, 4 * MIB, 5 * MIB)];
    p.install("job/0", 60, objects, order, |_| true).unwrap();
    p.note(&uri(0), Some(4 * MIB + 10));
    assert_eq!(reached(&p, "job/0"), 3);
    // A late read of the first sample takes its own entry and moves
    // nothing; once taken, it is not taken again.
    p.note(&uri(0), Some(100));
    p.note(&uri(0), Some(200));
    assert_eq!(reached(&p, "job/0"), 3);
    assert_eq!(p.lock()["job/0"].taken, vec![true, false, true]);
}

#[test]
fn the_lead_starts_at_two_entries_and_follows_the_pace_within_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let p = plans(dir.path(), 1 << 30);
    let order: Vec<u32> = (0..100).collect();
    install(&p, "job/0", &order, 100);
    let t0 = Instant::now();
    let mut plans = p.lock();
    let plan = plans.get_mut("job/0").unwrap();
    plan.pace.at = t0;
    assert_eq!(
        plan.lead(1 << 30, t0),
        20 * MIB,
        "two entries before any pace"
    );
    // 10 entries (100 MiB) in half a second: 200 MiB/s, 2 s of lead.
    plan.reached = 10;
    let lead = plan.lead(1 << 30, t0 + Duration::from_millis(500));
    assert_eq!(lead, 400 * MIB);
    assert_eq!(
        plan.lead(100 * MIB, t0 + Duration::from_millis(500)),
        100 * MIB
    );
    // Objects within the lead are wanted once each.
    let wanted = plan.wanted(35 * MIB);
    assert_eq!(
        wanted.iter().map(ToString::to_string).collect::<Vec<_>>(),
        vec![uri(10), uri(11), uri(12), uri(13)]
    );
    assert!(plan.wanted(35 * MIB).is_empty());
    // A paused reader's pace decays; it does not drop to nothing.
    let later = plan.lead(1 << 30, t0 + Duration::from_millis(1000));
    assert!(later > 300 * MIB && later < 400 * MIB, "{later}");
}

#[test]
fn a_plan_is_checked_whole_and_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let p = plans(dir.path(), 1 << 30);
    let one = || vec![uri(0)];
    let refused = |objects: Vec<String>, order: Vec<(u32, u64, u64)>, ttl: u64| {
        p.install("job/0", ttl, objects, order, |u| u.key().starts_with("d/"))
            .unwrap_err()
            .to_string()
    };
    assert!(refused(one(), vec![(0, 5, 5)], 60).contains("empty or reversed"));
    assert!(refused(one(), vec![(1, 0, 5)], 60).contains("not in the plan's 1 objects"));
    assert!(
        refused(vec!["s3://bkt/x/1.bin".into()], vec![(0, 0, 5)], 60)
            .contains("outside this mount")
    );
    assert!(refused(vec!["nonsense".into()], vec![(0, 0, 5)], 60).contains("\"nonsense\""));
    assert!(refused(one(), vec![(0, 0, 5)], 0).contains("ttl_s is 0"));
    let long = vec![(0, 0, 5); lakecache_protocol::tier_socket::MAX_TIER_PLAN_ENTRIES + 1];
    assert!(refused(one(), long, 60).contains("at most"));
    assert_eq!(p.held(), 0, "a refused plan is not held");
    // At most MAX_PLANS; the one renewed longest ago goes.
    for rank in 0..=MAX_PLANS {
        install(&p, &format!("job/{rank}"), &[0], 1);
    }
    assert_eq!(p.held(), MAX_PLANS);
    assert!(!p.lock().contains_key("job/0"));
}

#[test]
fn an_expired_plan_is_dropped_and_wants_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let p = plans(dir.path(), 1 << 30);
    install(&p, "job/0", &[0, 1], 2);
    p.lock().get_mut("job/0").unwrap().expires = Instant::now();
    assert!(p.wanted_now().is_empty());
    assert_eq!(p.held(), 0);
}

#[test]
fn the_tier_evicts_unplanned_objects_first_then_the_furthest_planned_one() {
    let dir = tempfile::tempdir().unwrap();
    let p = plans_on(dir.path(), 1 << 30, 30 * MIB);
    p.attach();
    let tier = p.tier.clone().expect("a tier").0;
    let add = |name: &str| drop(tier.get_or_create(name, "e", 10 * MIB).unwrap());
    let held = |name: &str| tier.contains(name, "e");
    // Read next: 3, then 1, then 0, then 2; "u" is in no plan.
    install(&p, "job/0", &[3, 1, 0, 2], 4);
    add(&uri(0));
    add("s3://bkt/d/u.bin");
    add(&uri(2));
    // Full: the unplanned object goes first, though 0 is older.
    add(&uri(1));
    assert!(!held("s3://bkt/d/u.bin") && held(&uri(0)) && held(&uri(2)));
    // Then the object read furthest ahead (2), not the oldest (0).
    add(&uri(3));
    assert!(!held(&uri(2)), "kept the object read last");
    assert!(held(&uri(0)) && held(&uri(1)) && held(&uri(3)));
    // The reader passes 3 and 1, which no plan reads again: the least
    // recently used of them (1) goes, and 0, read next, stays.
    p.note(&uri(3), None);
    p.note(&uri(1), None);
    add(&uri(2));
    assert!(!held(&uri(1)) && held(&uri(0)) && held(&uri(3)) && held(&uri(2)));
    // Without plans the tier evicts by recency again: 0 is the oldest,
    // though the plan read it next.
    p.lock().clear();
    add("s3://bkt/d/v.bin");
    assert!(!held(&uri(0)) && held(&uri(3)) && held(&uri(2)));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// A reader follows its plan through a tier of `k` objects: every
    /// object the tier evicts is one Belady's rule picks (read again
    /// furthest ahead, or never).
    #[test]
    fn the_tier_evicts_what_beladys_rule_picks(
        k in 2usize..5,
        seq in proptest::collection::vec(0u32..7, 1..40),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let p = plans_on(dir.path(), 1 << 30, k as u64 * MIB);
        p.attach();
        let tier = p.tier.clone().expect("a tier").0;
        let objects = (0..7).map(uri).collect();
        let order = seq.iter().map(|&o| (o, 0, MIB)).collect();
        p.install("job/0", 60, objects, order, |_| true).unwrap();
        for (t, &o) in seq.iter().enumerate() {
            p.note(&uri(o as usize), None);
            if tier.contains(&uri(o as usize), "e") {
                continue;
            }
            let held: Vec<u32> = (0..7).filter(|&h| tier.contains(&uri(h as usize), "e")).collect();
            let next = |h: u32| seq[t + 1..].iter().position(|&x| x == h).unwrap_or(usize::MAX);
            let furthest = held.iter().map(|&h| next(h)).max();
            drop(tier.get_or_create(&uri(o as usize), "e", MIB).unwrap());
            if held.len() == k {
                let gone: Vec<u32> = held
                    .iter()
                    .copied()
                    .filter(|&h| !tier.contains(&uri(h as usize), "e"))
                    .collect();
                proptest::prop_assert_eq!(gone.len(), 1);
                proptest::prop_assert_eq!(
                    Some(next(gone[0])), furthest,
                    "step {}: evicted {} of {:?}", t, gone[0], held
                );
            }
        }
    }
}
