//! Completion of objects in the node-local tier. Once a reader shows an
//! object will be wanted whole (a long sequential run), or a previous
//! mount recorded that, its missing blocks are fetched from the workers
//! in the background, apart from any reader: large ranged requests, a few
//! at a time, yielding to demand reads. Bytes go straight to the tier, not
//! through the fill queue (which drops when behind): a block that cannot
//! be written stays a hole, and the object is tried again later.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lakecache_protocol::ObjectUri;

use crate::data_plane::{read_exact, DataError, DataPlane};
use crate::kernel_cache::KernelCache;
use crate::local_tier::filler::KEPT_WAIT;
use crate::local_tier::{LocalTier, TierObject};
use crate::memory::MemoryBudget;

/// A sequential run this long marks an object as wanted whole: far past
/// the kernel's read-ahead, so header and footer readers never reach it.
pub const COMPLETE_AFTER: u64 = 8 << 20;
/// Bytes per completion request.
const REQUEST_BYTES: u64 = 8 << 20;
/// Completion requests in flight at most.
const IN_FLIGHT: usize = 2;
/// For an object a random reader wants now: each request finished is
/// 8 MiB its reader no longer waits a round trip for (S3 10 ms away, a
/// 2 GiB file, 10 s of random 4 KiB reads: 4 in flight gave 4,600 IOPS,
/// 12 gave 6,100; the whole fetch, not the reads, is what limits it).
const IN_FLIGHT_NOW: usize = 12;
/// How long a completion request waits for demand reads to finish
/// before it goes anyway: a cold reader streaming the object fetches it
/// itself, so completion mostly runs once readers stop, and is slowed,
/// never starved, on a node that is always reading (200 ms cost cold
/// sequential reads 7-16 %).
const DEMAND_YIELD: Duration = Duration::from_secs(2);
/// How long an object goes unread before completion fetches for it: a
/// reader streaming it fills it itself, and completion fetching the same
/// ranges beside it doubled the worker's load (cold reads were 10-16 %
/// slower).
const QUIET: Duration = Duration::from_secs(1);
/// An object whose reader streamed it with its fills kept, missing at
/// most this much (fills dropped before the run showed it was wanted
/// whole), is finished without yielding to demand reads: on a node always
/// reading, two yields of 2 s per object kept the plain tier's objects
/// partial for epochs (DLIO's UNet3D: 82% AU warm against 88-90% with
/// `--local-cache-whole`).
const FINISHING_BYTES: u64 = 32 << 20;
const RETRY_AFTER: Duration = Duration::from_secs(2);
const MAX_ATTEMPTS: u32 = 6;

/// Reads for a reader in flight in this process (one process, one mount).
static DEMAND: AtomicUsize = AtomicUsize::new(0);

/// Held while a reader waits on the workers; completion yields to it.
pub struct DemandRead(());

impl DemandRead {
    pub fn start() -> Self {
        DEMAND.fetch_add(1, Ordering::Relaxed);
        Self(())
    }
}

impl Drop for DemandRead {
    fn drop(&mut self) {
        DEMAND.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Default)]
pub struct CompletionStats {
    /// Objects queued for completion (by readers or a remount).
    pub asked: AtomicU64,
    /// Bytes fetched from the workers to complete objects.
    pub fetched_bytes: AtomicU64,
    /// Objects made whole by completion.
    pub completed: AtomicU64,
    /// Fetches or writes that failed (the object is tried again).
    pub failures: AtomicU64,
    /// Objects given up: changed or gone in S3, or failing every try.
    pub abandoned: AtomicU64,
    /// Requests that first waited for demand reads to finish.
    pub yielded: AtomicU64,
}

struct Job {
    object: Arc<TierObject>,
    uri: ObjectUri,
    etag: String,
    attempts: u32,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Object ids queued or being completed.
    ids: HashSet<String>,
}

enum Outcome {
    Whole,
    Retry(String),
    Abandon(String),
}

pub struct Completer {
    data: Arc<dyn DataPlane>,
    tier: Arc<LocalTier>,
    budget: Arc<MemoryBudget>,
    queue: Mutex<Queue>,
    wake: tokio::sync::Notify,
    started: AtomicBool,
    stats: CompletionStats,
    /// Where a random reader's fetched bytes are also pushed.
    kernel_cache: Option<Arc<KernelCache>>,
}

impl Completer {
    pub fn new(data: Arc<dyn DataPlane>, tier: Arc<LocalTier>, budget: Arc<MemoryBudget>) -> Self {
        Self {
            data,
            tier,
            budget,
            queue: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            started: AtomicBool::new(false),
            stats: CompletionStats::default(),
            kernel_cache: None,
        }
    }

    /// Pushes what it fetches for a random reader into the kernel's page
    /// cache too.
    pub fn with_kernel_cache(mut self, kernel_cache: Arc<KernelCache>) -> Self {
        self.kernel_cache = Some(kernel_cache);
        self
    }

    pub fn stats(&self) -> &CompletionStats {
        &self.stats
    }

    /// Objects queued or being completed now.
    pub fn pending(&self) -> usize {
        self.lock().ids.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues what a previous mount wanted whole and did not finish.
    pub fn resume(self: &Arc<Self>) {
        for object in self.tier.wanted_incomplete() {
            let (uri, etag) = object.uri_and_etag();
            match uri.parse::<ObjectUri>() {
                Ok(uri) => self.enqueue(object, uri, etag, 0),
                Err(e) => {
                    tracing::warn!(%uri, error = %e, "local tier object with an unreadable URI; dropped");
                    self.tier.forget_version(&uri, &etag);
                }
            }
        }
    }

    /// A reader wants `object` whole: queued, and recorded in the tier
    /// when its completion starts (so a remount resumes it).
    pub fn want_whole(self: &Arc<Self>, object: Arc<TierObject>, uri: ObjectUri, etag: String) {
        if !object.is_complete() {
            self.enqueue(object, uri, etag, 0);
        }
    }

    fn enqueue(
        self: &Arc<Self>,
        object: Arc<TierObject>,
        uri: ObjectUri,
        etag: String,
        attempts: u32,
    ) {
        {
            let mut queue = self.lock();
            if !queue.ids.insert(object.id().to_string()) {
                return;
            }
            if attempts == 0 {
                self.stats.asked.fetch_add(1, Ordering::Relaxed);
            }
            queue.jobs.push_back(Job {
                object,
                uri,
                etag,
                attempts,
            });
        }
        self.start();
        self.wake.notify_one();
    }

    fn start(self: &Arc<Self>) {
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(self.clone().run());
            }
            Err(_) => {
                self.started.store(false, Ordering::Release);
                tracing::warn!("local tier completion needs a runtime; not started");
            }
        }
    }

    async fn run(self: Arc<Self>) {
        loop {
            let job = self.lock().jobs.pop_front();
            let Some(job) = job else {
                self.wake.notified().await;
                continue;
            };
            let outcome = self.complete(&job).await;
            self.lock().ids.remove(job.object.id());
            match outcome {
                Outcome::Whole => {
                    self.stats.completed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(uri = %job.uri, "local tier object completed");
                }
                Outcome::Abandon(why) => {
                    self.stats.abandoned.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(uri = %job.uri, why, "stopped completing a local tier object");
                }
                Outcome::Retry(why) if job.attempts + 1 >= MAX_ATTEMPTS => {
                    self.stats.abandoned.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(uri = %job.uri, why, attempts = job.attempts + 1,
                        "gave up completing a local tier object; later reads still fill it");
                }
                Outcome::Retry(why) => {
                    tracing::warn!(uri = %job.uri, why, "completing a local tier object failed; trying again");
                    let this = self.clone();
                    let delay = RETRY_AFTER * (job.attempts + 1);
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        this.enqueue(job.object, job.uri, job.etag, job.attempts + 1);
                    });
                }
            }
        }
    }

    async fn complete(&self, job: &Job) -> Outcome {
        if !self.tier.holds(&job.object) {
            return Outcome::Abandon("evicted from the tier".into());
        }
        let object = job.object.clone();
        match tokio::task::spawn_blocking(move || object.mark_wanted_whole()).await {
            Ok(Ok(_)) => {}
            // Completion still runs; only a remount would not resume it.
            Ok(Err(e)) => tracing::warn!(error = %e, "recording a wanted-whole object failed"),
            Err(e) => return Outcome::Retry(e.to_string()),
        }
        let ranges = job.object.missing_ranges(REQUEST_BYTES);
        let in_flight = if job.object.wanted_now() {
            IN_FLIGHT_NOW
        } else {
            IN_FLIGHT
        };
        let mut fetches = futures::stream::iter(ranges)
            .map(|range| self.fetch_and_fill(job, range))
            .buffer_unordered(in_flight);
        let mut retry = None;
        while let Some(result) = fetches.next().await {
            match result {
                Ok(()) => {}
                Err(Outcome::Abandon(why)) => {
                    // Another version in S3: this copy can never be read.
                    let (uri, etag) = job.object.uri_and_etag();
                    self.tier.forget_version(&uri, &etag);
                    return Outcome::Abandon(why);
                }
                Err(other) => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    retry.get_or_insert(other);
                }
            }
        }
        match retry {
            Some(outcome) => outcome,
            None if job.object.is_complete() => Outcome::Whole,
            None => Outcome::Retry("blocks still missing".into()),
        }
    }

    async fn fetch_and_fill(&self, job: &Job, range: std::ops::Range<u64>) -> Result<(), Outcome> {
        // A random reader fills next to nothing itself and is always
        // reading: its object is fetched at once, beside its reads.
        if !job.object.wanted_now() {
            loop {
                let idle = job.object.idle_for();
                if idle >= QUIET {
                    break;
                }
                tokio::time::sleep(QUIET - idle).await;
            }
            let finishing =
                job.object.fills_kept() && job.object.missing_bytes() <= FINISHING_BYTES;
            if !finishing && DEMAND.load(Ordering::Relaxed) > 0 {
                self.stats.yielded.fetch_add(1, Ordering::Relaxed);
                let waited = Instant::now();
                while DEMAND.load(Ordering::Relaxed) > 0 && waited.elapsed() < DEMAND_YIELD {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
        // Nor what a reader's kept fills are writing now.
        let waited = Instant::now();
        while job.object.kept_fills_pending() && waited.elapsed() < KEPT_WAIT {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // What readers filled meanwhile is not fetched again.
        let Some(range) = job.object.missing_within(range) else {
            return Ok(());
        };
        let len = range.end - range.start;
        // Back-pressure: completion waits for memory instead of growing.
        let memory = self.budget.reserve(len).await;
        let bytes = match read_exact(self.data.as_ref(), &job.uri, range.clone(), &job.etag).await {
            Ok(b) => b,
            Err(e @ (DataError::Changed { .. } | DataError::NotFound)) => {
                return Err(Outcome::Abandon(e.to_string()))
            }
            Err(e) => return Err(Outcome::Retry(e.to_string())),
        };
        self.stats.fetched_bytes.fetch_add(len, Ordering::Relaxed);
        // The reader gets the bytes from the kernel as soon as they are
        // pushed, beside the write to the tier (held in the budget apart
        // from the fill's share, or not pushed).
        if let Some(kernel_cache) = self.kernel_cache.as_ref() {
            if job.object.wanted_now() {
                if let Some(pushed) = self.budget.try_reserve(len) {
                    let uri = job.uri.to_string();
                    kernel_cache.offer(&uri, &job.etag, range.start, bytes.clone(), pushed);
                }
            }
        }
        let object = job.object.clone();
        let written = tokio::task::spawn_blocking(move || {
            let r = object.fill(range.start, &bytes);
            drop(memory);
            r
        })
        .await;
        match written {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => {
                crate::local_tier::Damage::of(&e).note(
                    job.object.id(),
                    &e,
                    "left as a hole, completed later",
                );
                Err(Outcome::Retry(e.to_string()))
            }
            Err(e) => Err(Outcome::Retry(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data_plane::MemoryDataPlane;

    const MIB: u64 = 1 << 20;

    fn body(len: u64) -> Vec<u8> {
        (0..len).map(|i| (i % 239) as u8).collect()
    }

    async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        for _ in 0..1000 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{what} did not happen within 10 s");
    }

    fn uri() -> ObjectUri {
        ObjectUri::new("bkt", "obj").unwrap()
    }

    fn completer(plane: &Arc<MemoryDataPlane>, tier: &Arc<LocalTier>) -> Arc<Completer> {
        Arc::new(Completer::new(
            plane.clone(),
            tier.clone(),
            MemoryBudget::new(1 << 30),
        ))
    }

    /// An object of `len` bytes in a memory data plane, and its empty
    /// copy in a new tier.
    struct Fixture {
        data: Vec<u8>,
        plane: Arc<MemoryDataPlane>,
        etag: String,
        _dir: tempfile::TempDir,
        tier: Arc<LocalTier>,
        object: Arc<TierObject>,
    }

    fn fixture(len: u64) -> Fixture {
        let data = body(len);
        let plane = Arc::new(MemoryDataPlane::new());
        let etag = plane.insert("bkt", "obj", data.clone());
        let dir = tempfile::tempdir().unwrap();
        let tier = Arc::new(LocalTier::open(dir.path(), 64 * MIB).unwrap());
        let object = tier.get_or_create(&uri().to_string(), &etag, len).unwrap();
        Fixture {
            data,
            plane,
            etag,
            _dir: dir,
            tier,
            object,
        }
    }

    /// A reader of the fixture's object through its tier and `c`.
    fn tier_reader(f: &Fixture, c: &Arc<Completer>) -> crate::read::FileReader {
        use crate::read::{FileReader, ReadaheadPolicy};
        FileReader::new(
            f.plane.clone(),
            uri(),
            f.etag.clone(),
            f.data.len() as u64,
            ReadaheadPolicy {
                initial: 256 << 10,
                max: 2 * MIB,
                chunk: 512 << 10,
            },
            MemoryBudget::new(1 << 30),
        )
        .with_tier(Some(f.object.clone()), Some(c.clone()))
    }

    #[tokio::test]
    async fn a_wanted_object_is_completed_fetching_only_what_it_misses() {
        let len = 20 * MIB + 5;
        let Fixture {
            data,
            plane,
            etag,
            _dir,
            tier,
            object,
        } = fixture(len);
        object.fill(0, &data[..4 * MIB as usize]).unwrap();
        let c = completer(&plane, &tier);
        c.want_whole(object.clone(), uri(), etag);
        wait_for("completion", || object.is_complete()).await;
        assert_eq!(
            object.read(0, len).unwrap().unwrap().as_ref(),
            &data[..],
            "the completed copy"
        );
        assert_eq!(
            c.stats().fetched_bytes.load(Ordering::Relaxed),
            len - 4 * MIB
        );
        wait_for("the outcome counted", || {
            c.stats().completed.load(Ordering::Relaxed) == 1
        })
        .await;
        assert!(object.wanted_whole());
        assert_eq!(c.pending(), 0);
    }

    /// Other readers always reading: an object its reader streamed (fills
    /// kept) that misses only its head is fetched without yielding to
    /// them; one missing most of its bytes still yields.
    #[tokio::test]
    async fn a_streamed_object_missing_only_its_head_is_finished_without_yielding() {
        let len = 8 * MIB;
        let Fixture {
            data,
            plane,
            etag,
            _dir,
            tier,
            object,
        } = fixture(len);
        object.keep_fills();
        object.fill(2 * MIB, &data[2 * MIB as usize..]).unwrap();
        let c = completer(&plane, &tier);
        let others_reading = DemandRead::start();
        c.want_whole(object.clone(), uri(), etag.clone());
        wait_for("completion", || object.is_complete()).await;
        assert_eq!(c.stats().fetched_bytes.load(Ordering::Relaxed), 2 * MIB);
        assert_eq!(c.stats().yielded.load(Ordering::Relaxed), 0);
        // Most of it missing: completion yields first, as before.
        let (other_uri, len2) = ("s3://bkt/obj2".parse::<ObjectUri>().unwrap(), 40 * MIB);
        let etag2 = plane.insert("bkt", "obj2", body(len2));
        let partial = tier
            .get_or_create(&other_uri.to_string(), &etag2, len2)
            .unwrap();
        partial.keep_fills();
        partial.fill(0, &body(len2)[..MIB as usize]).unwrap();
        c.want_whole(partial.clone(), other_uri, etag2);
        wait_for("the first yield", || {
            c.stats().yielded.load(Ordering::Relaxed) > 0
        })
        .await;
        drop(others_reading);
        wait_for("completion of the mostly missing object", || {
            partial.is_complete()
        })
        .await;
    }

    #[tokio::test]
    async fn completion_waits_while_a_reader_streams_the_object_and_skips_what_it_filled() {
        let len = 16 * MIB;
        let Fixture {
            data,
            plane,
            etag,
            _dir,
            tier,
            object,
        } = fixture(len);
        let c = completer(&plane, &tier);
        object.note_read();
        c.want_whole(object.clone(), uri(), etag);
        // A reader streams the first half, reading every 100 ms: nothing
        // is fetched for completion meanwhile.
        for step in 0..8u64 {
            let at = (step * MIB) as usize;
            object.note_read();
            object
                .fill(at as u64, &data[at..at + MIB as usize])
                .unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(c.stats().fetched_bytes.load(Ordering::Relaxed), 0);
        // It stops: completion fetches only the half it left.
        wait_for("completion", || object.is_complete()).await;
        assert_eq!(c.stats().fetched_bytes.load(Ordering::Relaxed), len / 2);
        assert_eq!(object.read(0, len).unwrap().unwrap().as_ref(), &data[..]);
    }

    #[tokio::test]
    async fn an_object_replaced_in_s3_ends_its_completion_and_the_old_copy_goes() {
        let len = 6 * MIB;
        let plane = Arc::new(MemoryDataPlane::new());
        let old = plane.insert("bkt", "obj", body(len));
        let dir = tempfile::tempdir().unwrap();
        let tier = Arc::new(LocalTier::open(dir.path(), 64 * MIB).unwrap());
        let object = tier.get_or_create(&uri().to_string(), &old, len).unwrap();
        let new = plane.insert("bkt", "obj", vec![7u8; len as usize]);
        assert_ne!(old, new);
        let c = completer(&plane, &tier);
        c.want_whole(object.clone(), uri(), old.clone());
        wait_for("completion abandoned", || {
            c.stats().abandoned.load(Ordering::Relaxed) == 1
        })
        .await;
        assert!(tier.get(&uri().to_string(), &old).is_none());
        assert!(!object.is_complete(), "no bytes of the new version went in");
    }

    #[tokio::test]
    async fn a_reopened_tier_resumes_what_a_reader_wanted_whole() {
        let len = 9 * MIB + 1;
        let data = body(len);
        let plane = Arc::new(MemoryDataPlane::new());
        let etag = plane.insert("bkt", "obj", data.clone());
        let dir = tempfile::tempdir().unwrap();
        {
            let tier = LocalTier::open(dir.path(), 64 * MIB).unwrap();
            let object = tier.get_or_create(&uri().to_string(), &etag, len).unwrap();
            object
                .fill(MIB, &data[MIB as usize..2 * MIB as usize])
                .unwrap();
            assert!(object.mark_wanted_whole().unwrap());
        }
        let tier = Arc::new(LocalTier::open(dir.path(), 64 * MIB).unwrap());
        assert_eq!(tier.wanted_incomplete().len(), 1);
        let c = completer(&plane, &tier);
        c.resume();
        let object = tier.get(&uri().to_string(), &etag).unwrap();
        wait_for("completion after reopening", || object.is_complete()).await;
        assert_eq!(object.read(0, len).unwrap().unwrap().as_ref(), &data[..]);
        assert_eq!(c.stats().fetched_bytes.load(Ordering::Relaxed), len - MIB);
    }

    #[tokio::test]
    async fn a_long_run_in_file_order_asks_for_the_whole_object_and_a_header_and_footer_do_not() {
        const KIB: u64 = 1024;
        let len = 32 * MIB;
        let f = fixture(len);
        let (data, object) = (f.data.clone(), f.object.clone());
        let c = completer(&f.plane, &f.tier);
        let reader = || tier_reader(&f, &c);
        let asked = || c.stats().asked.load(Ordering::Relaxed);
        let mut header_footer = reader();
        header_footer.read(0, 64 * KIB).await.unwrap();
        header_footer.read(len - 64 * KIB, 64 * KIB).await.unwrap();
        assert_eq!(
            asked(),
            0,
            "a header and a footer asked for the whole object"
        );
        let mut streaming = reader();
        let mut at = 0;
        while at < COMPLETE_AFTER - 128 * KIB {
            at += streaming.read(at, 128 * KIB).await.unwrap().len() as u64;
        }
        assert_eq!(asked(), 0, "asked before the run reached {COMPLETE_AFTER}");
        streaming.read(at, 128 * KIB).await.unwrap();
        assert_eq!(asked(), 1);
        wait_for("completion", || object.is_complete()).await;
        assert_eq!(object.read(0, len).unwrap().unwrap().as_ref(), &data[..]);
    }

    #[tokio::test]
    async fn a_random_reader_gets_the_object_fetched_at_once_while_it_keeps_reading() {
        const KIB: u64 = 1024;
        let len = 24 * MIB;
        let f = fixture(len);
        let (data, object) = (f.data.clone(), f.object.clone());
        let c = completer(&f.plane, &f.tier);
        let reader = |max: u64| tier_reader(&f, &c).whole_on_random(max);
        let asked = || c.stats().asked.load(Ordering::Relaxed);
        let jumps = [5 * MIB, 17 * MIB, MIB, 11 * MIB, 3 * MIB];
        // The policy off, or an object over it: reads fetch what they ask.
        for max in [0, len - 1] {
            let mut r = reader(max);
            for at in jumps {
                r.read(at, 4 * KIB).await.unwrap();
            }
            assert_eq!(asked(), 0, "asked with --random-whole-max {max}");
        }
        // Within it: the third jump asks, and completion does not wait
        // for the reader to stop (it reads every 50 ms throughout).
        let mut r = reader(len);
        for (i, at) in jumps.iter().enumerate() {
            r.read(*at, 4 * KIB).await.unwrap();
            assert_eq!(asked(), u64::from(i >= 2), "after jump {}", i + 1);
        }
        for i in 0..200u64 {
            if object.is_complete() {
                break;
            }
            r.read((i * 7 * MIB) % (len - 4 * KIB), 4 * KIB)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            object.is_complete(),
            "not whole while the reader kept reading"
        );
        assert_eq!(object.read(0, len).unwrap().unwrap().as_ref(), &data[..]);
    }

    #[test]
    fn missing_ranges_merge_adjacent_blocks_up_to_the_request_size() {
        let dir = tempfile::tempdir().unwrap();
        let tier = LocalTier::open(dir.path(), 64 * MIB).unwrap();
        let len = 10 * MIB + 7;
        let object = tier.get_or_create("s3://bkt/obj", "e", len).unwrap();
        object.fill(2 * MIB, &vec![1u8; MIB as usize]).unwrap();
        assert_eq!(
            object.missing_ranges(4 * MIB),
            vec![0..2 * MIB, 3 * MIB..4 * MIB, 4 * MIB..8 * MIB, 8 * MIB..len]
        );
        assert_eq!(object.missing_bytes(), len - MIB);
        assert_eq!(
            object.missing_ranges(1),
            vec![
                0..MIB,
                MIB..2 * MIB,
                3 * MIB..4 * MIB,
                4 * MIB..5 * MIB,
                5 * MIB..6 * MIB,
                6 * MIB..7 * MIB,
                7 * MIB..8 * MIB,
                8 * MIB..9 * MIB,
                9 * MIB..10 * MIB,
                10 * MIB..len,
            ]
        );
    }
}
