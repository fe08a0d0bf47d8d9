use super::*;
use crate::inode::{Kind, Meta, ROOT_INO};
use crate::memory::MemoryBudget;

const URI: &str = "s3://b/shard.bin";
const SIZE: u64 = 1 << 20;

/// Records stores; holds each one while `gate` is closed.
#[derive(Default)]
struct Recorder {
    stores: Mutex<Vec<(u64, u64, usize)>>,
    gate: Mutex<bool>,
    opened: std::sync::Condvar,
    refuse: AtomicBool,
}

impl Recorder {
    fn stored(&self) -> Vec<(u64, u64, usize)> {
        lock(&self.stores).clone()
    }
}

impl PageCacheStore for Arc<Recorder> {
    fn store(&self, ino: u64, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let closed = lock(&self.gate);
        drop(
            self.opened
                .wait_while(closed, |closed| *closed)
                .unwrap_or_else(|e| e.into_inner()),
        );
        if self.refuse.load(Ordering::Relaxed) {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        lock(&self.stores).push((ino, offset, data.len()));
        Ok(())
    }
}

struct Fixture {
    cache: Arc<KernelCache>,
    inodes: Arc<InodeTable>,
    recorder: Arc<Recorder>,
    budget: Arc<MemoryBudget>,
    ino: u64,
}

/// One file showing version "e1", its page cache holding that version.
fn fixture() -> Fixture {
    let inodes = Arc::new(InodeTable::new(""));
    let meta = Meta {
        size: SIZE,
        etag: Some("e1".into()),
        ..Meta::default()
    };
    let node = inodes.upsert(ROOT_INO, "shard.bin", Kind::File, "shard.bin".into(), meta);
    inodes.update(node.ino, |n| n.page_cache_etag = Some("e1".into()));
    let cache = KernelCache::new(inodes.clone(), true);
    let recorder = Arc::new(Recorder::default());
    cache.connect(Box::new(recorder.clone()));
    Fixture {
        cache,
        inodes,
        recorder,
        budget: MemoryBudget::new(64 << 20),
        ino: node.ino,
    }
}

impl Fixture {
    fn offer(&self, etag: &str, offset: u64, len: usize) {
        let memory = self.budget.try_reserve(len as u64).expect("budget");
        self.cache
            .offer(URI, etag, offset, Bytes::from(vec![7u8; len]), memory);
    }

    /// Offers a piece and waits until the pusher is done with it.
    fn offer_and_wait(&self, etag: &str, offset: u64, len: usize) {
        self.offer(etag, offset, len);
        let deadline = Instant::now() + Duration::from_secs(10);
        while *lock(&self.cache.queued) != 0 {
            assert!(Instant::now() < deadline, "the pusher never took the piece");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits until a store at `offset` was made (pieces are pushed in
    /// the order offered, so earlier ones are done with too).
    fn wait_for_store_at(&self, offset: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.recorder.stored().iter().any(|s| s.1 == offset) {
            assert!(
                Instant::now() < deadline,
                "no store at {offset}: {:?}",
                self.recorder.stored()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

#[test]
fn only_inodes_reading_the_version_get_its_bytes_in_chunks_within_the_size() {
    let f = fixture();
    // No handle reads it yet: nothing is queued.
    f.offer("e1", 0, 4096);
    f.cache.opened(10, f.ino, URI, "e1");
    // Another version, and a piece past the size, are not pushed.
    f.offer("e2", 0, 4096);
    f.offer("e1", SIZE - 4096, 8192);
    f.offer("e1", 0, 2 * STORE_CHUNK + 100);
    f.wait_for_store_at(2 * STORE_CHUNK as u64);
    assert_eq!(
        f.recorder.stored(),
        vec![
            (f.ino, 0, STORE_CHUNK),
            (f.ino, STORE_CHUNK as u64, STORE_CHUNK),
            (f.ino, 2 * STORE_CHUNK as u64, 100),
        ]
    );
    assert_eq!(
        f.cache.stats().pushed_bytes.load(Ordering::Relaxed),
        2 * STORE_CHUNK as u64 + 100
    );
    // Once the last handle is closed, nothing more goes.
    f.cache.closed(10);
    f.offer_and_wait("e1", 4096, 4096);
    f.cache.opened(11, f.ino, URI, "e1");
    f.offer("e1", 8192, 4096);
    f.wait_for_store_at(8192);
    assert!(!f.recorder.stored().iter().any(|s| s.1 == 4096));
    // The bytes held for pushing went back to the budget.
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.budget.available() != f.budget.limit() {
        assert!(Instant::now() < deadline, "push memory never returned");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_taking_the_inode_waits_for_a_store_under_way_and_stops_the_rest() {
    let f = fixture();
    f.cache.opened(10, f.ino, URI, "e1");
    *lock(&f.recorder.gate) = true;
    f.offer("e1", 0, 2 * STORE_CHUNK);
    // The first chunk's store is under way (held by the gate).
    let deadline = Instant::now() + Duration::from_secs(10);
    while *lock(&f.cache.storing) != Some(f.ino) {
        assert!(Instant::now() < deadline, "the store never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // A writer claims the inode; settling waits for the store.
    f.inodes.update(f.ino, |n| n.writer = Some(99));
    let settled = Arc::new(AtomicBool::new(false));
    let waiter = {
        let (cache, settled, ino) = (f.cache.clone(), settled.clone(), f.ino);
        tokio::spawn(async move {
            cache.settle(ino).await;
            settled.store(true, Ordering::SeqCst);
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !settled.load(Ordering::SeqCst),
        "settle returned while a store was under way"
    );
    *lock(&f.recorder.gate) = false;
    f.recorder.opened.notify_all();
    waiter.await.unwrap();
    // The first chunk landed before the writer's reply; the second was
    // never stored, nor is anything offered after.
    f.offer_and_wait("e1", SIZE - 4096, 4096);
    f.inodes.update(f.ino, |n| n.writer = None);
    f.inodes.update(f.ino, |n| n.page_cache_etag = None);
    f.offer_and_wait("e1", 8192, 4096);
    f.inodes
        .update(f.ino, |n| n.page_cache_etag = Some("e1".into()));
    f.offer("e1", 12288, 4096);
    f.wait_for_store_at(12288);
    assert_eq!(
        f.recorder.stored(),
        vec![(f.ino, 0, STORE_CHUNK), (f.ino, 12288, 4096)]
    );
}

#[test]
fn a_refused_store_ends_pushing_for_the_mount() {
    let f = fixture();
    f.cache.opened(10, f.ino, URI, "e1");
    f.recorder.refuse.store(true, Ordering::Relaxed);
    f.offer("e1", 0, 4096);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f.cache.refused.load(Ordering::Relaxed) {
        assert!(Instant::now() < deadline, "the refusal was not noticed");
        std::thread::sleep(Duration::from_millis(2));
    }
    f.recorder.refuse.store(false, Ordering::Relaxed);
    f.offer_and_wait("e1", 4096, 4096);
    assert!(f.recorder.stored().is_empty());
    assert_eq!(f.cache.stats().pushed_bytes.load(Ordering::Relaxed), 0);
}

#[test]
fn switched_off_it_pushes_nothing() {
    let inodes = Arc::new(InodeTable::new(""));
    let cache = KernelCache::new(inodes, false);
    let recorder = Arc::new(Recorder::default());
    cache.connect(Box::new(recorder.clone()));
    cache.opened(10, 2, URI, "e1");
    let budget = MemoryBudget::new(1 << 20);
    let memory = budget.try_reserve(4096).unwrap();
    cache.offer(URI, "e1", 0, Bytes::from(vec![1u8; 4096]), memory);
    assert!(cache.queue.get().is_none());
    assert!(recorder.stored().is_empty());
}
