//! Eviction by plan through a real worker in front of the S3 endpoint
//! (issue #35): a shuffled second epoch over twice the cache's size keeps
//! about half its pages with the plan, where recency keeps almost none.

use std::time::Duration;

use lakecache_worker::cache::PlanEntry;

use crate::harness::*;

const OBJECTS: u64 = 32;

fn name(i: u64) -> String {
    format!("plan/{i:02}.bin")
}

/// A cache of 16 one-page objects (evicting to 15.5 pages when over).
async fn small_cache() -> Harness {
    let h = Harness::with(|o| {
        o.cache.capacity = 16 * MIB;
        o.cache.high_watermark = 1.0;
        o.cache.low_watermark = 0.97;
    })
    .await;
    for i in 0..OBJECTS {
        h.put_direct(&name(i), &data(MIB as usize, i)).await;
    }
    h
}

/// Reads object `i` whole, then waits for the evictor to bring the cache
/// back within its capacity (eviction runs beside reads).
async fn read(h: &Harness, i: u64) {
    let got = h.client.read(&uri(&name(i)), None).await.unwrap();
    assert_eq!(got.len() as u64, MIB);
    let cache = h.worker.as_ref().unwrap().cache().clone();
    eventually(Duration::from_secs(10), "eviction to the capacity", || {
        let used = cache.used_bytes();
        async move { used <= 16 * MIB }
    })
    .await;
}

/// Installs plan `job/0` on the worker directly (the HTTP route is tested
/// below).
async fn install(h: &Harness, entries: &[PlanEntry]) -> lakecache_worker::cache::PlanReport {
    h.worker
        .as_ref()
        .unwrap()
        .cache()
        .install_plan("job/0", entries, Duration::from_secs(600))
        .await
        .unwrap()
}

/// Epoch 1 in order, then epoch 2 shuffled; hits in epoch 2 (reads that
/// made no S3 GET).
async fn second_epoch_hits(planned: bool) -> u64 {
    let h = small_cache().await;
    for i in 0..OBJECTS {
        read(&h, i).await;
    }
    // 13 is prime to 32: a permutation.
    let epoch2: Vec<u64> = (0..OBJECTS).map(|i| (i * 13) % OBJECTS).collect();
    if planned {
        let entries: Vec<PlanEntry> = epoch2
            .iter()
            .map(|i| PlanEntry {
                uri: uri(&name(*i)),
                range: 0..MIB,
            })
            .collect();
        let report = install(&h, &entries).await;
        assert_eq!(report.pages, OBJECTS as usize);
        assert_eq!(report.skipped_entries, 0);
    }
    let mut hits = 0;
    for i in epoch2 {
        let before = h.gets();
        read(&h, i).await;
        if h.gets() == before {
            hits += 1;
        }
    }
    hits
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_keeps_half_a_shuffled_epoch_over_twice_the_cache_where_recency_keeps_little() {
    let with_plan = second_epoch_hits(true).await;
    let by_recency = second_epoch_hits(false).await;
    eprintln!("epoch-2 hits of {OBJECTS}: plan {with_plan}, recency {by_recency}");
    // The best possible is the 15-16 pages the cache holds at the start.
    assert!(
        with_plan >= 14,
        "plan: {with_plan} hits of {OBJECTS} (recency: {by_recency})"
    );
    assert!(
        by_recency < with_plan / 2,
        "recency: {by_recency} hits, plan: {with_plan}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_naming_missing_objects_skips_them_and_installs_the_rest() {
    let h = small_cache().await;
    let entries = vec![
        PlanEntry {
            uri: uri(&name(1)),
            range: 0..MIB,
        },
        PlanEntry {
            uri: uri("plan/gone.bin"),
            range: 0..MIB,
        },
        // Past the end: clamped to the object.
        PlanEntry {
            uri: uri(&name(2)),
            range: MIB / 2..4 * MIB,
        },
    ];
    let report = install(&h, &entries).await;
    assert_eq!(report.pages, 2, "{report:?}");
    assert_eq!(report.skipped_entries, 1, "{report:?}");
    assert!(report.skipped[0].contains("plan/gone.bin"), "{report:?}");
    // Reads go on as before.
    read(&h, 1).await;
}

async fn put_plan(h: &Harness, name: &str, body: &str) -> (u16, String) {
    let req = format!(
        "PUT /v1/plans/{name} HTTP/1.1\r\nHost: worker\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    raw_request(h.addr(), req.as_bytes()).await
}

fn plan_body(ttl: u64, entries: &str) -> String {
    format!(
        r#"{{"format":"lakecache-plan","version":1,"ttl_seconds":{ttl},"entries":[{entries}]}}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plans_over_http_are_installed_or_refused_naming_the_problem() {
    let h = small_cache().await;
    let entry = |i: u64, start: u64, end: u64| {
        format!(
            r#"{{"bucket":"{BUCKET}","key":"{}","start":{start},"end":{end}}}"#,
            name(i)
        )
    };
    let good = plan_body(60, &format!("{},{}", entry(3, 0, MIB), entry(4, 0, 10)));
    let (status, text) = put_plan(&h, "train/0", &good).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains(r#""pages":2"#), "{text}");
    // Renewed: the same again.
    let (status, text) = put_plan(&h, "train/0", &good).await;
    assert_eq!(status, 200, "{text}");

    let refused = [
        (
            "train/0",
            r#"{"format":"lakecache-plan""#.to_string(),
            "plan: ",
        ),
        ("train", good.clone(), "must be JOB/RANK"),
        (
            "train/0",
            good.replace(r#""version":1"#, r#""version":7"#),
            "version 7 is not supported",
        ),
        (
            "train/0",
            good.replace(r#""format":"lakecache-plan""#, r#""format":"csv""#),
            "a plan's format is",
        ),
        ("train/0", plan_body(0, &entry(3, 0, 1)), "ttl_seconds is 0"),
        (
            "train/0",
            plan_body(60, &entry(3, 5, 5)),
            "empty or reversed",
        ),
        (
            "train/0",
            plan_body(60, &entry(3, 0, 10)).replace(r#""start":0"#, r#""start":-4"#),
            "invalid value: integer `-4`",
        ),
        (
            "train/0",
            plan_body(60, &format!("{},{}", entry(3, 0, 10), entry(3, 5, 20))),
            "overlap",
        ),
        (
            "train/0",
            plan_body(
                60,
                r#"{"bucket":"data","key":"a/../../etc","start":0,"end":1}"#,
            ),
            "entry 0:",
        ),
    ];
    for (plan, body, says) in refused {
        let (status, text) = put_plan(&h, plan, &body).await;
        assert_eq!(status, 400, "{plan} {body}: {text}");
        assert!(text.contains(says), "{body}: wanted {says:?} in {text}");
    }
    // The worker serves on.
    read(&h, 3).await;
}

/// Whether the worker answered a read of (1 MiB) object `i` from its
/// cache.
async fn read_says(h: &Harness, i: u64) -> String {
    read_range_says(h, i, 0..MIB).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_says_whether_its_bytes_were_cached() {
    let h = small_cache().await;
    assert_eq!(read_says(&h, 5).await, "miss");
    assert_eq!(read_says(&h, 5).await, "hit");
}

fn plan_of(order: &[u64]) -> Vec<PlanEntry> {
    order
        .iter()
        .map(|i| PlanEntry {
            uri: uri(&name(*i)),
            range: 0..MIB,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plans_next_pages_are_fetched_before_they_are_read() {
    let h = small_cache().await;
    let order: Vec<u64> = vec![9, 2, 30, 17, 4, 21];
    install(&h, &plan_of(&order)).await;
    // Nothing read yet: the prefetcher fetches ahead of the cursor, within
    // a quarter of the cache (4 pages here).
    for i in &order[..4] {
        let i = *i;
        eventually(Duration::from_secs(10), "4 pages prefetched", || {
            let h = &h;
            async move { read_is_cached(h, i).await }
        })
        .await;
    }
    for i in &order[..4] {
        assert_eq!(read_says(&h, *i).await, "hit", "object {i}");
    }
    // Reading moved the cursor: the rest follow.
    for i in &order[4..] {
        let i = *i;
        eventually(Duration::from_secs(10), "the rest prefetched", || {
            let h = &h;
            async move { read_is_cached(h, i).await }
        })
        .await;
    }
    for i in &order[4..] {
        assert_eq!(read_says(&h, *i).await, "hit", "object {i}");
    }
}

/// Whether object `i`'s page is cached, without reading it (a read would
/// move the plan).
async fn read_is_cached(h: &Harness, i: u64) -> bool {
    let cache = h.worker.as_ref().unwrap().cache().clone();
    cache.is_cached(&uri(&name(i)), 0).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plan_prefetch_stays_within_its_budget_and_can_be_turned_off() {
    let h = Harness::with(|o| {
        o.cache.capacity = 64 * MIB;
        o.cache.plan_prefetch.budget_bytes = 3 * MIB;
    })
    .await;
    for i in 0..OBJECTS {
        h.put_direct(&name(i), &data(MIB as usize, i)).await;
    }
    let before = h.gets();
    install(&h, &plan_of(&(0..OBJECTS).collect::<Vec<_>>())).await;
    eventually(Duration::from_secs(10), "3 pages prefetched", || {
        let gets = h.gets();
        async move { gets >= before + 3 }
    })
    .await;
    // Several prefetcher rounds later, still 3: the budget holds while
    // the reader does not move.
    tokio::time::sleep(scaled(Duration::from_millis(300))).await;
    assert_eq!(h.gets(), before + 3);

    let off = Harness::with(|o| o.cache.plan_prefetch.budget_bytes = 0).await;
    for i in 0..4 {
        off.put_direct(&name(i), &data(MIB as usize, i)).await;
    }
    let before = off.gets();
    off.worker
        .as_ref()
        .unwrap()
        .cache()
        .install_plan("job/0", &plan_of(&[0, 1, 2, 3]), Duration::from_secs(600))
        .await
        .unwrap();
    tokio::time::sleep(scaled(Duration::from_millis(300))).await;
    assert_eq!(off.gets(), before, "prefetch was off");
}

/// Reads `range` of object `i`; says whether it hit.
async fn read_range_says(h: &Harness, i: u64, range: std::ops::Range<u64>) -> String {
    let resp = h
        .client
        .read_stream(&uri(&name(i)), Some(range.clone()))
        .await
        .unwrap();
    let said = resp
        .headers()
        .get(lakecache_protocol::CACHE_HEADER)
        .expect("a read's answer says whether it hit")
        .to_str()
        .unwrap()
        .to_string();
    use http_body_util::BodyExt as _;
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let want = data(MIB as usize, i);
    assert!(
        body[..] == want[range.start as usize..range.end as usize],
        "object {i} bytes {range:?} came back wrong"
    );
    said
}

/// A plan of samples smaller than a page: `(object, range)` in order.
fn sample_plan(samples: &[(u64, std::ops::Range<u64>)]) -> Vec<PlanEntry> {
    samples
        .iter()
        .map(|(i, range)| PlanEntry {
            uri: uri(&name(*i)),
            range: range.clone(),
        })
        .collect()
}

const S3_BYTES: &str = "lakecache_s3_transferred_bytes_total{op=\"get_object\"}";

/// Bytes the worker fetched from S3 so far (the counter appears with the
/// first fetch; absent, it fails the test rather than read as 0).
async fn s3_bytes(h: &Harness) -> u64 {
    counter(h, S3_BYTES).await as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plans_samples_of_a_page_fetch_only_their_blocks_and_count_only_them() {
    // Prefetch off: the reader's own misses are under test.
    let h = Harness::with(|o| o.cache.plan_prefetch.budget_bytes = 0).await;
    for i in 0..4 {
        h.put_direct(&name(i), &data(MIB as usize, i)).await;
    }
    let cache = h.worker.as_ref().unwrap().cache().clone();
    const Q: u64 = MIB / 4;
    // Two samples of object 0's page with one of object 1's between
    // them (none at an object's start: a read there counts as
    // sequential), then object 2 whole.
    let samples = [(0, Q..2 * Q), (1, Q..2 * Q), (0, 3 * Q..MIB), (2, 0..MIB)];
    install(&h, &sample_plan(&samples)).await;
    assert_eq!(read_range_says(&h, 0, Q..2 * Q).await, "miss");
    assert_eq!(s3_bytes(&h).await, Q, "only the sample's block came");
    assert_eq!(cache.used_bytes(), Q, "the page counts the bytes it holds");
    assert_eq!(read_range_says(&h, 1, Q..2 * Q).await, "miss");
    // The page's second sample was not fetched with its first: its own
    // block comes now.
    assert_eq!(read_range_says(&h, 0, 3 * Q..MIB).await, "miss");
    assert_eq!((s3_bytes(&h).await, cache.used_bytes()), (3 * Q, 3 * Q));
    // What came stays: both samples of object 0 hit now.
    assert_eq!(read_range_says(&h, 0, Q..2 * Q).await, "hit");
    assert_eq!(read_range_says(&h, 0, 3 * Q..MIB).await, "hit");
    // A page the plan reads whole comes whole, in one GET.
    let gets = h.gets();
    assert_eq!(read_range_says(&h, 2, 0..MIB).await, "miss");
    assert_eq!(h.gets(), gets + 1);
    assert_eq!(s3_bytes(&h).await, 3 * Q + MIB);
    // (Counted once its file is written, beside the read.)
    eventually(Duration::from_secs(10), "object 2 counted whole", || {
        let used = cache.used_bytes();
        async move { used == 3 * Q + MIB }
    })
    .await;
    // A read carrying on from a planned sample (the kernel reading ahead
    // through a mount) fetches the rest of the page, which it reads next.
    // (Object 0's samples between keep page 3's reads apart: a plan
    // takes consecutive reads of one page as one read of it.)
    let samples = [
        (3, Q..2 * Q),
        (0, Q..2 * Q),
        (3, 3 * Q..MIB),
        (0, 3 * Q..MIB),
        (3, 2 * Q..3 * Q),
    ];
    install(&h, &sample_plan(&samples)).await;
    let before = s3_bytes(&h).await;
    assert_eq!(read_range_says(&h, 3, Q..2 * Q).await, "miss");
    assert_eq!(read_range_says(&h, 3, 2 * Q..3 * Q).await, "miss");
    assert_eq!(read_range_says(&h, 3, 3 * Q..MIB).await, "hit");
    assert_eq!(s3_bytes(&h).await - before, 3 * Q, "block 0 never came");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefetch_fetches_the_blocks_a_plan_reads_of_a_partly_filled_page() {
    let h = Harness::start().await;
    h.put_direct(&name(0), &data(MIB as usize, 0)).await;
    const Q: u64 = MIB / 4;
    // A random read of one whole block, before any plan: kept as a
    // partly filled page.
    assert_eq!(read_range_says(&h, 0, Q..2 * Q).await, "miss");
    assert_eq!(read_range_says(&h, 0, Q..2 * Q).await, "hit");
    assert!(
        !read_is_cached(&h, 0).await,
        "the page is only partly filled"
    );
    assert_eq!(s3_bytes(&h).await, Q);
    install(&h, &sample_plan(&[(0, 3 * Q..MIB)])).await;
    eventually(Duration::from_secs(10), "the planned block fetched", || {
        let h = &h;
        async move { s3_bytes(h).await >= 2 * Q }
    })
    .await;
    assert_eq!(read_range_says(&h, 0, 3 * Q..MIB).await, "hit");
    // Nothing else of the page came.
    assert_eq!(s3_bytes(&h).await, 2 * Q);
    let cache = h.worker.as_ref().unwrap().cache().clone();
    assert_eq!(cache.used_bytes(), 2 * Q);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_planned_read_at_an_objects_start_fetches_no_pages_by_guess() {
    // A random sample that happens to start an object looks sequential;
    // without a plan the worker reads the next pages ahead.
    let run = |planned: bool| async move {
        let h = Harness::with(|o| {
            o.cache.plan_prefetch.budget_bytes = 0;
            o.cache.readahead_pages = 4;
        })
        .await;
        h.put_direct(&name(0), &data(4 * MIB as usize, 0)).await;
        if planned {
            install(&h, &sample_plan(&[(0, 0..MIB / 4)])).await;
        }
        let before = h.gets();
        let got = h
            .client
            .read(&uri(&name(0)), Some(0..MIB / 4))
            .await
            .unwrap();
        assert_eq!(got.len() as u64, MIB / 4);
        (h, before)
    };
    let (plain, before) = run(false).await;
    eventually(Duration::from_secs(10), "read-ahead without a plan", || {
        let gets = plain.gets();
        async move { gets >= before + 2 }
    })
    .await;
    let (planned, before) = run(true).await;
    // As long as the read-ahead above took at most: nothing more came.
    tokio::time::sleep(scaled(Duration::from_millis(300))).await;
    assert_eq!(planned.gets(), before + 1, "only the page read");
}

/// Whether object 31, read once by `kind` while its plan reads it only
/// much later, is still cached after 20 MiB of other reads through a
/// 16 MiB cache.
async fn kept_for_the_plan_after(kind: lakecache_protocol::ReadKind) -> String {
    let h = Harness::with(|o| {
        o.cache.capacity = 16 * MIB;
        o.cache.high_watermark = 1.0;
        o.cache.low_watermark = 0.97;
        // Four pages an object: the plan's 32 objects are 128 positions.
        o.cache.page_size = MIB / 4;
        o.cache.plan_prefetch.budget_bytes = 0;
    })
    .await;
    for i in 0..52 {
        h.put_direct(&name(i), &data(MIB as usize, i)).await;
    }
    install(&h, &plan_of(&(0..32).collect::<Vec<_>>())).await;
    read(&h, 0).await;
    let (got, _) = h
        .client
        .read_checked_as(&uri(&name(31)), Some(0..MIB), None, kind)
        .await
        .unwrap();
    assert_eq!(got[..], data(MIB as usize, 31)[..]);
    // Objects no plan reads: eviction takes those first.
    for i in 32..52 {
        read(&h, i).await;
    }
    read_range_says(&h, 31, 0..MIB).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_ahead_far_past_the_reader_keeps_the_page_for_the_plans_own_read() {
    use lakecache_protocol::ReadKind;
    // A mount's guess past a sample (the read-ahead header) is not the
    // plan's read: the plan still reads the page, and keeps it.
    assert_eq!(kept_for_the_plan_after(ReadKind::Ahead).await, "hit");
    // The same read on demand is the plan's read of it: the page is then
    // one no plan reads again, and goes first.
    assert_eq!(kept_for_the_plan_after(ReadKind::Demand).await, "miss");
}

/// The worker's count `name` (a Prometheus counter).
async fn counter(h: &Harness, name: &str) -> f64 {
    metric_value(&h.client.metrics().await.unwrap(), name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plans_cached_pages_are_staged_in_memory_before_it_reads_them() {
    const STAGED: &str = "lakecache_plan_staged_bytes_total";
    const FROM_MEMORY: &str = "lakecache_fresh_served_bytes_total";
    let h = Harness::with(|o| o.cache.capacity = 64 * MIB).await;
    for i in 0..8 {
        h.put_direct(&name(i), &data(MIB as usize, i)).await;
        // Cached on disk; its first reader had it from memory, whole.
        assert_eq!(read_says(&h, i).await, "miss");
    }
    let order = [5, 1, 7, 3];
    install(&h, &plan_of(&order)).await;
    // Before any read: the reader is at the plan's start, so its first
    // pages are read from their files now.
    eventually(Duration::from_secs(10), "4 pages staged", || {
        let h = &h;
        async move {
            // Counted from the first page staged on.
            let m = h.client.metrics().await.unwrap();
            m.contains(STAGED) && metric_value(&m, STAGED) >= 4.0 * MIB as f64
        }
    })
    .await;
    for i in order {
        assert_eq!(read_says(&h, i).await, "hit", "object {i}");
    }
    // (Cold reads are not counted there: the count is the plan's reads.)
    assert_eq!(
        counter(&h, FROM_MEMORY).await,
        4.0 * MIB as f64,
        "the plan's reads were served from memory"
    );
    // Read whole, each page left memory, and none was staged again.
    tokio::time::sleep(scaled(Duration::from_millis(200))).await;
    assert_eq!(counter(&h, STAGED).await, 4.0 * MIB as f64);
    // An object outside the plan is read from its file.
    assert_eq!(read_says(&h, 6).await, "hit");
    assert_eq!(counter(&h, FROM_MEMORY).await, 4.0 * MIB as f64);
    // Where the plan reads part of a page (a sample in it), only that
    // part is staged: staging the whole page would read it all from disk
    // for one sample. The reader then has the part from memory.
    install(
        &h,
        &sample_plan(&[(0, 0..MIB / 2), (4, 0..MIB), (2, MIB / 2..MIB)]),
    )
    .await;
    // The first two positions at least: a reader that has stood still
    // since its reads has a decayed pace, and a window of 2 positions.
    eventually(
        Duration::from_secs(10),
        "half of object 0 and object 4 staged",
        || {
            let h = &h;
            async move { counter(h, STAGED).await >= 5.5 * MIB as f64 }
        },
    )
    .await;
    let staged = counter(&h, STAGED).await / MIB as f64;
    assert!(staged == 5.5 || staged == 6.0, "{staged} MiB staged");
    assert_eq!(read_range_says(&h, 0, 0..MIB / 2).await, "hit");
    assert_eq!(read_says(&h, 4).await, "hit");
    assert_eq!(counter(&h, FROM_MEMORY).await, 5.5 * MIB as f64);
    // Past them, the third position comes into the window.
    eventually(Duration::from_secs(10), "half of object 2 staged", || {
        let h = &h;
        async move { counter(h, STAGED).await >= 6.0 * MIB as f64 }
    })
    .await;
    assert_eq!(read_range_says(&h, 2, MIB / 2..MIB).await, "hit");
    assert_eq!(counter(&h, FROM_MEMORY).await, 6.0 * MIB as f64);
    assert_eq!(counter(&h, STAGED).await, 6.0 * MIB as f64);
}
