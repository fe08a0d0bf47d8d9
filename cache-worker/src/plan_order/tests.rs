use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::lru::{Lru, Retention};
use ReadKind::Demand;

const PAGE: u64 = 10;

fn key(i: u8) -> PageKey {
    PageKey([i; 32])
}

/// A cache of `pages` pages that evicts one page per page over.
fn cache(pages: u64) -> Lru {
    Lru::new(pages * PAGE, 1.0, 1.0, Arc::default())
}

/// The pages an eviction pass takes, by number.
fn evicted(lru: &Lru) -> Vec<u8> {
    lru.take_victims().iter().map(|(k, _)| k.0[0]).collect()
}

/// Reads `page` through `lru` as the worker does: a hit touches it, a
/// miss stores it (then the read touches it) and evicts. Returns whether
/// it hit, and the page evicted.
fn read(lru: &Lru, page: u8) -> (bool, Option<u8>) {
    let hit = lru.contains(&key(page));
    lru.planned_read(&key(page), 0..PAGE, Demand);
    if !hit {
        lru.insert(key(page), PAGE);
    }
    lru.touch(&key(page));
    let victims = lru.take_victims();
    assert!(
        victims.len() <= 1,
        "one page over, {} evicted",
        victims.len()
    );
    (hit, victims.first().map(|(k, _)| k.0[0]))
}

/// Belady's rule, written plainly: on a miss past capacity, evict the
/// cached page (the new one included) read again furthest in the future;
/// among pages never read again, the least recently used.
fn belady(seq: &[u8], capacity: usize) -> Vec<(bool, Option<u8>)> {
    let mut last_used: Vec<(u8, usize)> = Vec::new();
    let mut out = Vec::new();
    for (i, page) in seq.iter().enumerate() {
        let hit = last_used.iter().any(|(p, _)| p == page);
        last_used.retain(|(p, _)| p != page);
        last_used.push((*page, i));
        let mut victim = None;
        if last_used.len() > capacity {
            let next_use = |p: u8| seq[i + 1..].iter().position(|q| *q == p);
            let (at, _) = last_used
                .iter()
                .enumerate()
                .max_by_key(|(_, (p, used))| match next_use(*p) {
                    // Never again: before any page read again, the least
                    // recent first.
                    None => (1, 0, usize::MAX - used),
                    Some(n) => (0, n, 0),
                })
                .expect("the cache is not empty");
            victim = Some(last_used.remove(at).0);
        }
        out.push((hit, victim));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The property: with the read order published as a plan, the
    /// cache evicts exactly the pages Belady's rule picks.
    #[test]
    fn a_planned_sequence_evicts_what_beladys_rule_picks(
        mut seq in proptest::collection::vec(0u8..12, 1..120),
        capacity in 1usize..8,
    ) {
        // A page listed twice in a row is one read of it, in pieces
        // (`a_page_read_in_pieces_moves_the_plan_once`).
        seq.dedup();
        let lru = cache(capacity as u64);
        let pages: Vec<PageKey> = seq.iter().map(|p| key(*p)).collect();
        lru.install_plan("job/0", None, &pages, &[], Duration::from_secs(600)).unwrap();
        let got: Vec<_> = seq.iter().map(|p| read(&lru, *p)).collect();
        prop_assert_eq!(got, belady(&seq, capacity));
    }
}

/// The headline case in small: a shuffled scan of twice the
/// cache's pages, epoch after epoch. Recency keeps nothing; the plan keeps
/// about half.
#[test]
fn a_scan_of_twice_the_cache_hits_half_with_a_plan_and_nothing_without() {
    let epoch2: Vec<u8> = (0..40u16).map(|i| ((i * 7) % 40) as u8).collect();
    let run = |planned: bool| {
        let lru = cache(20);
        for p in 0..40 {
            read(&lru, p);
        }
        if planned {
            let pages: Vec<PageKey> = epoch2.iter().map(|p| key(*p)).collect();
            lru.install_plan("job/0", None, &pages, &[], Duration::from_secs(600))
                .unwrap();
        }
        epoch2.iter().filter(|p| read(&lru, **p).0).count()
    };
    let with_plan = run(true);
    let without = run(false);
    assert!(with_plan >= 18, "hits with the plan: {with_plan} of 40");
    assert!(without <= 5, "hits by recency alone: {without} of 40");
}

#[test]
fn prefetch_reaches_only_as_far_as_what_it_would_evict() {
    // Watermarks of 1.0: no room once 3 pages are held.
    let lru = cache(3);
    let far = Duration::from_secs(600);
    lru.install_plan("job/0", None, &[1, 2, 3, 4, 5].map(key), &[], far)
        .unwrap();
    lru.insert(key(1), PAGE);
    assert_eq!(lru.prefetch_horizon(None), None, "room");
    lru.insert(key(9), PAGE);
    lru.insert(key(3), PAGE);
    assert_eq!(
        lru.prefetch_horizon(None),
        None,
        "9 is read by no plan: it goes first"
    );
    lru.remove(&key(9));
    lru.insert(key(4), PAGE);
    // Full of planned pages: the one read last (4, 3 entries ahead) would
    // go, so only pages read before it are worth fetching.
    assert_eq!(lru.prefetch_horizon(None), Some(3));
    assert_eq!(lru.plan_distance(&key(2), None), Some(1));
    assert_eq!(lru.plan_distance(&key(5), None), Some(4));
    // Another tenant's plan does not rank these pages.
    assert_eq!(lru.plan_distance(&key(2), Some("other")), None);
}

#[test]
fn pages_no_plan_reads_again_go_first_and_pinned_pages_never() {
    let lru = cache(3);
    lru.insert_kept(key(9), PAGE, Retention::Pinned, None);
    lru.insert(key(1), PAGE);
    lru.insert(key(2), PAGE);
    let far = Duration::from_secs(600);
    lru.install_plan("job/0", None, &[key(1), key(2), key(9)], &[], far)
        .unwrap();
    lru.insert(key(3), PAGE);
    let victims = evicted(&lru);
    assert_eq!(victims, vec![3], "the only page no plan reads again");
    // Now every page is planned; the pinned one is read again last, but
    // the furthest page that may go is 4.
    lru.install_plan("job/0", None, &[key(1), key(2), key(4), key(9)], &[], far)
        .unwrap();
    lru.insert(key(4), PAGE);
    let victims = evicted(&lru);
    assert_eq!(victims, vec![4]);
    assert!(lru.contains(&key(9)) && lru.contains(&key(1)) && lru.contains(&key(2)));
}

#[test]
fn the_furthest_planned_page_goes_when_all_are_planned() {
    let lru = cache(3);
    for p in [1, 2, 3] {
        lru.insert(key(p), PAGE);
    }
    let plan = [key(4), key(2), key(1), key(4), key(3)];
    lru.install_plan("job/0", None, &plan, &[], Duration::from_secs(600))
        .unwrap();
    let (hit, victim) = read(&lru, 4);
    assert!(!hit);
    assert_eq!(victim, Some(3), "3 is read again last");
}

#[test]
fn a_read_of_one_sample_moves_the_rank_that_reads_that_sample() {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    // Page 9 holds two samples: rank 0 reads its first half at position
    // 2, rank 1 its second half first.
    let (first, second) = ((0, 5), (5, 10));
    order
        .install(
            "job/0",
            None,
            &[key(1), key(3), key(9)],
            &[(0, 10), (0, 10), first],
            far,
        )
        .unwrap();
    order
        .install("job/1", None, &[key(9), key(4)], &[second, (0, 10)], far)
        .unwrap();
    // Rank 1's next read of 9 is nearer, but this read is of rank 0's
    // sample: rank 0 moves on, rank 1 still reads 9 next.
    order.read_part(&key(9), Some(0..5), Demand);
    assert_eq!(
        order.distance(&key(9)),
        Some(0),
        "rank 1 still reads 9 first"
    );
    assert_eq!(order.cursor("job/1"), Some(0));
    assert_eq!(order.cursor("job/0"), Some(3), "rank 0 read position 2");
    // A piece of the read rank 0 just took is no new read.
    order.read_part(&key(9), Some(2..5), Demand);
    assert_eq!(order.cursor("job/1"), Some(0));
    // Bytes no plan reads next there: the nearest plan takes the read,
    // as a read without its bytes does.
    order.read_part(&key(9), Some(10..11), Demand);
    assert_eq!(order.cursor("job/1"), Some(1));
    assert_eq!(order.distance(&key(9)), None, "no plan reads 9 again");
}

#[test]
fn a_later_piece_of_one_ranks_read_is_not_another_ranks_read_of_that_sample() {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    // Rank 0 reads sample 0..5 of page 9 now; rank 1 reads the same
    // sample in the next epoch, after 1 and 2.
    let sample = (0, 5);
    order
        .install(
            "job/0",
            None,
            &[key(9), key(3), key(4)],
            &[sample, (0, 10), (0, 10)],
            far,
        )
        .unwrap();
    order
        .install(
            "job/1",
            None,
            &[key(1), key(2), key(9)],
            &[(0, 10), (0, 10), sample],
            far,
        )
        .unwrap();
    order.read_part(&key(9), Some(0..2), Demand);
    // Another loader worker's read comes between the pieces.
    order.read_part(&key(3), Some(0..10), Demand);
    order.read_part(&key(9), Some(2..5), Demand);
    assert_eq!(order.cursor("job/0"), Some(2));
    assert_eq!(order.cursor("job/1"), Some(0), "rank 1 read nothing");
    assert_eq!(
        order.distance(&key(9)),
        Some(2),
        "rank 1 still reads 9 at 2"
    );
    // Rank 1's own read of the sample, after its first two.
    order.read_part(&key(1), Some(0..10), Demand);
    order.read_part(&key(2), Some(0..10), Demand);
    order.read_part(&key(9), Some(0..5), Demand);
    assert_eq!(order.distance(&key(9)), None);
    assert_eq!(order.cursor("job/1"), Some(3));
}

#[test]
fn samples_of_one_page_read_out_of_order_each_take_their_own_position() {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    let plan = [key(9), key(3), key(9), key(4)];
    let spans = [(5, 10), (0, 10), (0, 5), (0, 10)];
    order.install("job/0", None, &plan, &spans, far).unwrap();
    // Two loader workers: the later sample's read comes first, and the
    // earlier one's is no piece of it.
    order.read_part(&key(9), Some(0..5), Demand);
    order.read_part(&key(3), Some(0..10), Demand);
    order.read_part(&key(9), Some(5..10), Demand);
    assert_eq!(order.distance(&key(9)), None, "both reads of 9 taken");
    order.read_part(&key(4), Some(0..10), Demand);
    assert_eq!(order.cursor("job/0"), Some(4), "nothing left behind");
}

#[test]
fn samples_of_one_entry_of_several_move_only_its_plan() {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    // Rank 0 reads both samples of page 9 in a row (one entry); rank 1
    // reads its second sample 80 entries on.
    order
        .install(
            "job/0",
            None,
            &[key(9), key(9), key(3)],
            &[(0, 5), (5, 10), (0, 10)],
            far,
        )
        .unwrap();
    let mut later: Vec<PageKey> = (100..180).map(key).collect();
    later.push(key(9));
    let mut spans = vec![(0, 10); 80];
    spans.push((5, 10));
    order.install("job/1", None, &later, &spans, far).unwrap();
    // Rank 0's loader workers read the second sample first.
    order.read_part(&key(9), Some(5..10), Demand);
    order.read_part(&key(9), Some(0..5), Demand);
    assert_eq!(order.cursor("job/0"), Some(1), "rank 0 read its entry");
    assert_eq!(order.cursor("job/1"), Some(0), "rank 1 read nothing");
    assert_eq!(order.distance(&key(9)), Some(80), "rank 1 still reads 9");
}

#[test]
fn two_ranks_plans_rank_a_page_by_its_nearest_use() {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    // Rank 0 reads 1 soon and 2 late; rank 1 reads 2 first.
    order
        .install("job/0", None, &[key(1), key(5), key(6), key(2)], &[], far)
        .unwrap();
    order
        .install("job/1", None, &[key(2), key(7), key(1)], &[], far)
        .unwrap();
    assert_eq!(order.distance(&key(2)), Some(0));
    assert_eq!(order.distance(&key(1)), Some(0));
    let ranked: Vec<u8> = order.furthest_first(None).map(|k| k.0[0]).collect();
    assert_eq!(ranked.len(), 5, "each page once: {ranked:?}");
    // 6 is 2 ahead; 5 and 7 are 1 ahead; 1 and 2 are next for some rank.
    assert_eq!(ranked[0], 6, "{ranked:?}");
    let mut middle = ranked[1..3].to_vec();
    middle.sort();
    assert_eq!(middle, vec![5, 7], "{ranked:?}");
    let mut nearest = ranked[3..].to_vec();
    nearest.sort();
    assert_eq!(nearest, vec![1, 2], "{ranked:?}");
    // The read was rank 1's (2 was next for it): rank 0 stays where it was.
    order.read(&key(2), Demand);
    assert_eq!(
        order.distance(&key(2)),
        Some(3),
        "rank 1 moved on; rank 0 reads 2 at 3"
    );
    assert_eq!(order.distance(&key(1)), Some(0));
}

#[test]
fn a_plan_not_renewed_expires_and_recency_resumes() {
    let lru = cache(2);
    lru.insert(key(1), PAGE);
    lru.insert(key(2), PAGE);
    lru.install_plan("job/0", None, &[key(1)], &[], Duration::from_millis(1))
        .unwrap();
    assert_eq!(lru.expire_plans(Instant::now() + Duration::from_secs(1)), 1);
    let (_, victim) = read(&lru, 3);
    assert_eq!(victim, Some(1), "least recent, the plan gone");
}

#[test]
fn a_read_far_ahead_of_the_cursor_is_not_the_plans_reader() {
    let mut order = PlanOrder::new(2);
    let far = Instant::now() + Duration::from_secs(600);
    let plan: Vec<PageKey> = (0..10).map(key).collect();
    order.install("job/0", None, &plan, &[], far).unwrap();
    order.read(&key(8), Demand);
    assert_eq!(order.distance(&key(0)), Some(0), "another job read 8");
    order.read(&key(1), Demand);
    assert_eq!(order.distance(&key(0)), Some(0), "0 may still be read late");
    assert_eq!(order.distance(&key(2)), Some(2));
    order.read(&key(3), Demand);
    assert_eq!(
        order.distance(&key(0)),
        None,
        "skipped: the window behind the furthest read"
    );
    assert_eq!(order.distance(&key(2)), Some(0));
}

#[test]
fn a_stray_read_far_ahead_does_not_move_where_the_reader_is() {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    let plan: Vec<PageKey> = (0..=200).map(key).collect();
    order.install("job/0", None, &plan, &[], far).unwrap();
    for p in 0..10 {
        order.read(&key(p), Demand);
    }
    assert_eq!(order.cursor("job/0"), Some(10));
    // A read-ahead into page 150, read by the plan much later.
    order.read(&key(150), Demand);
    for p in 10..13 {
        order.read(&key(p), Demand);
        assert_eq!(
            order.cursor("job/0"),
            Some(u64::from(p) + 1),
            "the reader is at {p}, not past the stray read"
        );
    }
    // Reads a little out of order are the reader's, as before.
    order.read(&key(15), Demand);
    assert_eq!(order.cursor("job/0"), Some(13), "the recent reads' median");
    order.read(&key(16), Demand);
    order.read(&key(17), Demand);
    order.read(&key(14), Demand);
    order.read(&key(13), Demand);
    assert_eq!(
        order.cursor("job/0"),
        Some(18),
        "never behind the first position not read"
    );
    // A reader that really jumps ahead is followed once its reads are there.
    for p in 100..104 {
        order.read(&key(p), Demand);
    }
    assert_eq!(order.cursor("job/0"), Some(151), "the furthest read again");
}

#[test]
fn a_read_ahead_far_past_the_reader_leaves_the_page_planned() {
    let far = Instant::now() + Duration::from_secs(600);
    // Two epochs of one order: page 150 is read at positions 150 and 351.
    let plan: Vec<PageKey> = (0..=200).chain(0..=200).map(key).collect();
    let started = || {
        let mut order = PlanOrder::default();
        order.install("job/0", None, &plan, &[], far).unwrap();
        for p in 0..10 {
            order.read(&key(p), Demand);
        }
        order
    };
    // A mount's guess past a sample lands in page 150.
    let mut order = started();
    order.read(&key(150), ReadKind::Ahead);
    assert_eq!(
        order.distance(&key(150)),
        Some(140),
        "still read at 150 this epoch"
    );
    assert_eq!(order.cursor("job/0"), Some(10));
    // The same read made on demand is the plan's read of it (the plan
    // then reads it next epoch only, and evicts it before that).
    let mut order = started();
    order.read(&key(150), Demand);
    assert_eq!(order.distance(&key(150)), Some(341));
    // A stream's read-ahead reads what the plan reads next: it moves on.
    let mut order = started();
    for p in 10..20 {
        order.read(&key(p), ReadKind::Ahead);
    }
    assert_eq!(order.cursor("job/0"), Some(20));
    assert_eq!(order.distance(&key(15)), Some(201 + 15 - 20));
}

#[test]
fn reads_out_of_order_each_take_their_own_position() {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    // Two loader workers: one reads 2 before the other reads 1.
    let plan = [key(1), key(2), key(3), key(1), key(4)];
    order.install("job/0", None, &plan, &[], far).unwrap();
    order.read(&key(2), Demand);
    assert_eq!(order.distance(&key(1)), Some(0), "1 is still to be read");
    assert_eq!(order.distance(&key(3)), Some(2));
    order.read(&key(1), Demand);
    assert_eq!(order.distance(&key(3)), Some(0));
    assert_eq!(
        order.distance(&key(1)),
        Some(1),
        "its second read is next but one"
    );
    order.read(&key(3), Demand);
    order.read(&key(1), Demand);
    assert_eq!(order.distance(&key(1)), None);
    assert_eq!(order.distance(&key(4)), Some(0));
}

#[test]
fn a_page_read_again_at_once_is_not_its_next_planned_read() {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    let plan: Vec<PageKey> = [1, 2, 3, 4, 5, 6, 7, 8, 1].map(key).to_vec();
    order.install("job/0", None, &plan, &[], far).unwrap();
    order.read(&key(1), Demand);
    order.read(&key(2), Demand);
    // A second sample of page 1 (listed once), read after 2 by another
    // loader worker: not the read of page 1 at position 8.
    order.read(&key(1), Demand);
    assert_eq!(order.distance(&key(1)), Some(6));
    for p in 3..=8 {
        order.read(&key(p), Demand);
    }
    order.read(&key(1), Demand);
    assert_eq!(order.distance(&key(1)), None);
}

#[test]
fn a_page_read_in_pieces_moves_the_plan_once() {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    // Two samples in page 1, then 2, then 1 again.
    let plan = [key(1), key(1), key(2), key(1), key(3)];
    order.install("job/0", None, &plan, &[], far).unwrap();
    for _ in 0..4 {
        order.read(&key(1), Demand);
    }
    assert_eq!(
        order.distance(&key(2)),
        Some(0),
        "page 1's pieces moved it once"
    );
    assert_eq!(order.distance(&key(1)), Some(1));
    order.read(&key(2), Demand);
    order.read(&key(1), Demand);
    assert_eq!(order.distance(&key(1)), None);
    assert_eq!(order.distance(&key(3)), Some(0));
}

#[test]
fn plans_are_bounded() {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    let long = vec![key(1); MAX_PLAN_PAGES + 1];
    assert_eq!(
        order.install("job/0", None, &long, &[], far),
        Err(PlanError::TooLong {
            pages: MAX_PLAN_PAGES + 1,
            limit: MAX_PLAN_PAGES
        })
    );
    let full = vec![key(1); MAX_PLAN_PAGES];
    for rank in 0..4 {
        order
            .install(&format!("job/{rank}"), None, &full, &[], far)
            .unwrap();
    }
    let err = order
        .install("job/4", None, &[key(2)], &[], far)
        .unwrap_err();
    assert!(err.to_string().contains("at most"), "{err}");
    // Renewing a plan replaces it, within the bound.
    order.install("job/3", None, &full, &[], far).unwrap();
}

/// Installs `tenant`'s plan of pages `pages`, as the HTTP route names it.
fn plan_of(lru: &Lru, tenant: &Arc<str>, pages: &[u8]) {
    let pages: Vec<PageKey> = pages.iter().map(|p| key(*p)).collect();
    lru.install_plan(
        &format!("{tenant}:job/0"),
        Some(tenant.clone()),
        &pages,
        &[],
        Duration::from_secs(600),
    )
    .unwrap();
}

/// The tenant rule: a plan reorders its own tenant's evictions and
/// never shifts them onto another tenant.
#[test]
fn a_plan_never_makes_another_tenant_give_up_pages() {
    let (a, b): (Arc<str>, Arc<str>) = (Arc::from("team-a"), Arc::from("team-b"));
    let lru = cache(4);
    // Oldest first: a1, a2, then b's two.
    lru.insert_kept(key(1), PAGE, Retention::Lru, Some(a.clone()));
    lru.insert_kept(key(2), PAGE, Retention::Lru, Some(a.clone()));
    lru.insert_kept(key(11), PAGE, Retention::Lru, Some(b.clone()));
    lru.insert_kept(key(12), PAGE, Retention::Lru, Some(b.clone()));
    // Team a plans to read 1 soon and 2 later; b's pages are in no plan.
    plan_of(&lru, &a, &[1, 2]);
    lru.insert_kept(key(3), PAGE, Retention::Lru, Some(a.clone()));
    let victims = evicted(&lru);
    // Recency would take a1; a gives up its own page instead: 3, which its
    // plan does not read, not one of b's.
    assert_eq!(victims, vec![3]);
    assert!(lru.contains(&key(11)) && lru.contains(&key(12)));
    lru.insert_kept(key(4), PAGE, Retention::Lru, Some(a.clone()));
    plan_of(&lru, &a, &[1, 2, 4]);
    lru.insert_kept(key(13), PAGE, Retention::Lru, Some(b.clone()));
    let victims = evicted(&lru);
    // Two pages over, and recency's two oldest are a's (1, 2): every page
    // of a is planned now, so a pays with the two its plan reads last.
    assert_eq!(victims, vec![4, 2]);
    assert_eq!(lru.tenant_used("team-b"), 3 * PAGE, "b keeps 11, 12, 13");
    // A plan of b's naming a's pages does not protect them.
    plan_of(&lru, &b, &[1]);
    lru.insert_kept(key(14), PAGE, Retention::Lru, Some(b.clone()));
    let victims = evicted(&lru);
    assert_eq!(
        victims,
        vec![1],
        "the oldest page is a's, and a has no other: b's plan naming it keeps nothing of b's from going later"
    );
    // Over its quota, a gives up pages in its plan's order too.
    lru.insert_kept(key(5), PAGE, Retention::Lru, Some(a.clone()));
    lru.insert_kept(key(6), PAGE, Retention::Lru, Some(a.clone()));
    lru.insert_kept(key(7), PAGE, Retention::Lru, Some(a.clone()));
    plan_of(&lru, &a, &[7, 6, 5]);
    let victims: Vec<u8> = lru
        .take_tenant_victims("team-a", PAGE)
        .iter()
        .map(|(k, _)| k.0[0])
        .collect();
    assert_eq!(victims, vec![5, 6], "a's plan reads 7 first, 5 last");
}

#[test]
fn upcoming_lists_the_unread_entries_from_the_first_one_to_the_lead() {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    // Page 2 is read at positions 1 and 5.
    let plan = [key(1), key(2), key(3), key(4), key(5), key(2), key(6)];
    order.install("job/0", None, &plan, &[], far).unwrap();
    assert_eq!(
        order.upcoming("job/0", 3, 10),
        vec![(0, key(1)), (1, key(2)), (2, key(3))]
    );
    // Two loader workers: 3 is read before 2. The reader is past 3; 2 is
    // still to come, then 4 and 5 within a lead of 2.
    order.read(&key(1), Demand);
    order.read(&key(3), Demand);
    assert_eq!(
        order.upcoming("job/0", 2, 10),
        vec![(1, key(2)), (3, key(4)), (4, key(5))]
    );
    // Once read, a page is listed at its next position.
    order.read(&key(2), Demand);
    assert_eq!(
        order.upcoming("job/0", 3, 10),
        vec![(3, key(4)), (4, key(5)), (5, key(2))]
    );
    assert_eq!(order.upcoming("job/0", 3, 1), vec![(3, key(4))]);
    assert!(order.upcoming("job/1", 3, 10).is_empty());
}

/// Page `i` of a plan longer than [`key`] can name.
fn wide_key(i: u16) -> PageKey {
    let mut bytes = [0xaa; 32];
    bytes[..2].copy_from_slice(&i.to_le_bytes());
    PageKey(bytes)
}

/// A plan "job/0" of `len` pages, each read once.
fn plan_of_wide_keys(len: u16) -> PlanOrder {
    let mut order = PlanOrder::default();
    let far = Instant::now() + Duration::from_secs(600);
    let plan: Vec<PageKey> = (0..len).map(wide_key).collect();
    order.install("job/0", None, &plan, &[], far).unwrap();
    order
}

#[test]
fn a_position_never_read_stops_holding_the_cursor_once_the_reader_is_past_it() {
    let mut order = plan_of_wide_keys(400);
    // Position 10's read never comes (another plan took it, say).
    for i in (0..=200).filter(|i| *i != 10) {
        order.read(&wide_key(i), Demand);
    }
    assert_eq!(
        order.distance(&wide_key(10)),
        None,
        "skipped: far behind a reader that reads in order"
    );
    assert_eq!(
        order.distance(&wide_key(300)),
        Some(99),
        "distances count from the reader, not from position 10"
    );
}

#[test]
fn a_late_read_within_the_readers_spread_is_still_waited_for() {
    let mut order = plan_of_wide_keys(400);
    // Two loader workers 40 positions apart: reads arrive up to 39 late.
    for i in 0..40 {
        order.read(&wide_key(i + 40), Demand);
        order.read(&wide_key(i), Demand);
    }
    // Position 100 has not come 80 reads later (more than STRAY_GAP)...
    for i in (80..=180).filter(|i| *i != 100) {
        order.read(&wide_key(i), Demand);
    }
    assert_eq!(
        order.distance(&wide_key(100)),
        Some(0),
        "within twice the spread: still this reader's next read"
    );
    // ...and is given up once the reader is well past what its spread
    // explains.
    for i in 181..=330 {
        order.read(&wide_key(i), Demand);
    }
    assert_eq!(order.distance(&wide_key(100)), None);
    assert_eq!(order.distance(&wide_key(350)), Some(19));
}
