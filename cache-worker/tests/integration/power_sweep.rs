//! Crash case 2c, the power-loss sweep widened to what happens in
//! production: S3 is on (uploads, the settle that re-keys pages to the
//! ETag and journal compaction run while writes go on), every write has a
//! second copy on another worker, and the disk loses only what fsync does
//! not promise (torn and reordered unsynced writes, `crashsim::tear`).
//! One run per cut point, in passes over every cut point of a run, until
//! the budget of cuts is spent. After each cut the worker starts again
//! over what its disk kept, or (one run in five) with its disk lost, and
//! then:
//! - every acknowledged write reads back, and reaches S3;
//! - an unacknowledged write is absent or whole, never torn;
//! - the client's retry of an unacknowledged write is what S3 ends with
//!   (no stale copy lands over it).
//!
//! `LAKECACHE_POWER_SEED` replays a seed (printed at the start);
//! `LAKECACHE_POWER_CUTS` sets the budget (default 50;
//! `benches/model/power-sweep-long.sh` runs 500). A replay draws the same
//! losses for the same operations; where uploads race the writes, the
//! operations at a cut point may differ between runs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::{ClientError, ObjectUri, WorkerClient};
use lakecache_worker::{crashsim, Placement, RunningWorker};

use crate::harness::*;
use crate::power_loss::ONE_AT_A_TIME;

/// One byte, part of a page, a page, several pages, several upload parts
/// (pages are 1 MiB, parts 5 MiB).
const SIZES: [usize; 5] = [
    1,
    300_000,
    MIB as usize,
    2 * MIB as usize + 512,
    6 * MIB as usize + 3,
];

/// Where a cut may land, each of which the default budget must reach.
const SITES: [&str; 5] = [
    "write: page file",
    "write: journal record",
    "upload: journal marks the object uploaded",
    "settle: pages re-keyed to the ETag",
    "journal compaction",
];

/// Every write's copy goes to the other worker.
struct Pair {
    me: String,
    other: String,
}

impl Placement for Pair {
    fn remote_owner(&self, _: &ObjectUri, _: u64) -> Option<String> {
        None
    }
    fn replica_candidates(&self, _: &ObjectUri) -> Vec<String> {
        vec![self.other.clone()]
    }
    fn me(&self) -> Option<String> {
        Some(self.me.clone())
    }
}

fn pair(worker: &RunningWorker, other: &str) {
    worker.cache().set_placement(Arc::new(Pair {
        me: worker.addr().to_string(),
        other: other.to_string(),
    }));
}

fn client_of(worker: &RunningWorker) -> WorkerClient {
    WorkerClient::new(&worker.addr().to_string(), Duration::from_secs(60)).unwrap()
}

async fn put_back(client: &WorkerClient, key: &str, body: &[u8]) -> Result<String, ClientError> {
    let chunks: Vec<Bytes> = body.chunks(200_000).map(Bytes::copy_from_slice).collect();
    let stat = client
        .put_back(
            &uri(key),
            futures::stream::iter(chunks),
            &Default::default(),
        )
        .await?;
    Ok(stat.etag)
}

async fn s3_sha(h: &Harness, key: &str) -> Option<String> {
    h.s3_bytes(key).await.map(|b| sha(&b))
}

/// A reader's view through `client`: the version and bytes' hash, or
/// None where the object is not there.
async fn read_sha(client: &WorkerClient, key: &str) -> Result<Option<(String, String)>, String> {
    let stat = match client.stat(&uri(key)).await {
        Ok(s) => s,
        Err(ClientError::Api {
            code: lakecache_protocol::ErrorCode::NotFound,
            ..
        }) => return Ok(None),
        Err(e) => return Err(format!("stat: {e}")),
    };
    let (bytes, _) = client
        .read_checked(&uri(key), None, Some(&stat.etag))
        .await
        .map_err(|e| format!("read: {e}"))?;
    Ok(Some((stat.etag, sha(&bytes))))
}

/// A number from the environment, or `default`; anything else stops the
/// test with what was wrong.
fn env_number(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Err(_) => default,
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
    }
}

/// SplitMix64 step: a run's own seed from the sweep's.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Written {
    key: String,
    len: usize,
    retried: bool,
    sha: String,
    version: Option<String>,
}

struct Outcome {
    /// Where the power went out; None: the run had fewer cut points.
    site: Option<&'static str>,
    /// Writes acknowledged before the cut.
    acked: usize,
    /// Cut points the run reached.
    points: u64,
}

/// One run: the power goes out at cut point `cut_at` of the primary.
async fn run(label: &str, seed: u64, cut_at: u64, lose_disk: bool) -> Outcome {
    let tag = label.replace(' ', "-");
    let label = &format!("{label}{}", if lose_disk { " (disk lost)" } else { "" });
    let mut h = Harness::with(|o| {
        o.cache.writeback.replicas = Some(2);
        // Copies of unacknowledged writes are found settled sooner.
        o.cache.writeback.replica_check = Duration::from_millis(200);
        crashsim::arm(&o.cache_dir, u64::MAX);
        crashsim::tear(seed);
    })
    .await;
    let b_dir = tempfile::tempdir().unwrap();
    let b = h.start_another(b_dir.path(), None).await;
    let (a_addr, b_addr) = (h.addr().to_string(), b.addr().to_string());
    pair(h.worker.as_ref().unwrap(), &b_addr);
    pair(&b, &a_addr);
    let b_client = client_of(&b);
    crashsim::cut_after(cut_at);

    let mut writes = Vec::new();
    for (i, size) in SIZES.iter().enumerate() {
        let key = format!("sweep/{tag}/obj{i}");
        let body = data(*size, seed ^ i as u64);
        let version = put_back(&h.client, &key, &body).await.ok();
        writes.push(Written {
            key,
            len: *size,
            retried: false,
            sha: sha(&body),
            version,
        });
    }
    let acked = writes.iter().filter(|w| w.version.is_some()).count();
    // Uploads, settles and compactions go on after the last write: the
    // run ends when the power goes out or every acknowledged write is
    // uploaded and settled.
    let limit = scaled(Duration::from_secs(60));
    let start = std::time::Instant::now();
    while !crashsim::power_is_out() {
        let settled = match h.client.metrics().await {
            Ok(m) => metric_value(&m, "lakecache_writeback_uploaded_objects") as usize >= acked,
            Err(_) => false,
        };
        if settled {
            break;
        }
        assert!(
            start.elapsed() < limit,
            "{label}: uploads not done in {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    h.worker.take().unwrap().shutdown().await;
    let points = crashsim::points_reached();
    let site = crashsim::disarm_site();
    if site.is_none() {
        b.shutdown().await;
        return Outcome {
            site,
            acked,
            points,
        };
    }
    if lose_disk {
        std::fs::remove_dir_all(&h.options.cache_dir).unwrap();
    }
    let a = h.start_another(&h.options.cache_dir, Some(&a_addr)).await;
    pair(&a, &b_addr);
    let a_client = client_of(&a);
    // A reader fails over to the copy while the primary has lost its disk.
    let reader = if lose_disk { &b_client } else { &a_client };
    for w in &writes {
        let seen = read_sha(reader, &w.key)
            .await
            .unwrap_or_else(|e| panic!("{label} ({site:?}): reading {}: {e}", w.key));
        match (&w.version, seen) {
            (Some(version), Some((etag, got))) => {
                // Once uploaded, S3's ETag names the version.
                assert!(
                    &etag == version || !etag.starts_with("lc-"),
                    "{label} ({site:?}): {} is at version {etag}, acknowledged as {version}",
                    w.key
                );
                assert_eq!(
                    got, w.sha,
                    "{label} ({site:?}): {} reads other bytes",
                    w.key
                );
            }
            (Some(_), None) => {
                panic!("{label} ({site:?}): {} was acknowledged and is gone", w.key)
            }
            (None, Some((_, got))) => assert_eq!(
                got, w.sha,
                "{label} ({site:?}): {} was never acknowledged and reads torn",
                w.key
            ),
            (None, None) => {}
        }
    }
    // The client retries what was not acknowledged, with new bytes.
    for (i, w) in writes.iter_mut().enumerate() {
        if w.version.is_none() {
            let body = data(SIZES[i], !seed ^ i as u64);
            w.version = Some(
                put_back(&a_client, &w.key, &body)
                    .await
                    .unwrap_or_else(|e| {
                        panic!("{label} ({site:?}): the retry of {} failed: {e}", w.key)
                    }),
            );
            w.sha = sha(&body);
            w.retried = true;
        }
    }
    let limit = scaled(Duration::from_secs(60));
    let start = std::time::Instant::now();
    loop {
        let mut state = Vec::new();
        for w in &writes {
            if s3_sha(&h, &w.key).await.as_deref() != Some(w.sha.as_str()) {
                let held = h.direct.head(&uri(&w.key)).await;
                let seen = match &held {
                    Ok(m) => format!("S3 holds {} bytes as {}", m.size, m.etag),
                    Err(e) => format!("S3: {e}"),
                };
                let retried = if w.retried {
                    "the retry of an unacknowledged write"
                } else {
                    "acknowledged before the cut"
                };
                state.push(format!(
                    "{} ({retried}, {} bytes, version {:?}) not in S3 as written; {seen}",
                    w.key, w.len, w.version
                ));
            }
        }
        for (who, c) in [("primary", &a_client), ("copy holder", &b_client)] {
            match c.writeback_status(None).await {
                Ok(s) if s.pending_objects == 0 && s.replica_objects == 0 => {}
                Ok(s) => state.push(format!("{who}: {s:?}")),
                Err(e) => state.push(format!("{who}: {e}")),
            }
        }
        if state.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < limit,
            "{label} ({site:?}): S3 does not hold every acknowledged write with the backlogs drained after {limit:?}: {state:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Nothing left anywhere may land later over what S3 holds.
    for w in &writes {
        assert_eq!(
            s3_sha(&h, &w.key).await.as_deref(),
            Some(w.sha.as_str()),
            "{label} ({site:?}): {} in S3 after the backlogs drained",
            w.key
        );
    }
    a.shutdown().await;
    b.shutdown().await;
    Outcome {
        site,
        acked,
        points,
    }
}

#[tokio::test]
async fn acknowledged_writes_survive_torn_power_cuts_with_s3_on_and_a_second_copy() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let seed = env_number(
        "LAKECACHE_POWER_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
    );
    let budget = env_number("LAKECACHE_POWER_CUTS", 50);
    assert!(
        budget > 0,
        "LAKECACHE_POWER_CUTS=0: a sweep needs at least one cut"
    );
    eprintln!("power sweep: seed {seed} (replay with LAKECACHE_POWER_SEED={seed}), {budget} cuts");
    crashsim::compact_journals_after(1);
    // `LAKECACHE_POWER_AT=pass:cut` replays one run of a failed sweep.
    if let Ok(at) = std::env::var("LAKECACHE_POWER_AT") {
        let parsed = at.split_once(':').and_then(|(p, c)| {
            Some((p.trim().parse::<u64>().ok()?, c.trim().parse::<u64>().ok()?))
        });
        let Some((pass, cut_at)) = parsed else {
            panic!("LAKECACHE_POWER_AT={at:?} is not PASS:CUT (two whole numbers)");
        };
        let run_seed = mix(seed ^ mix(pass) ^ cut_at);
        let label = format!("seed {seed} pass {pass} cut {cut_at}");
        let outcome = run(&label, run_seed, cut_at, run_seed.is_multiple_of(5)).await;
        eprintln!(
            "{label}: cut at {:?}, {} acknowledged before it",
            outcome.site, outcome.acked
        );
        return;
    }
    // A run without a cut counts the cut points; each pass then cuts at
    // every one of them, or, where the budget is smaller than a pass, at
    // evenly spaced ones from a seeded start.
    let dry = run(&format!("seed {seed} dry run"), seed, u64::MAX, false).await;
    assert!(dry.site.is_none() && dry.acked == SIZES.len());
    let points = dry.points;
    assert!(points > SIZES.len() as u64, "too few cut points: {points}");
    let stride = (points / budget).max(1);
    let mut per_site: BTreeMap<&str, usize> = BTreeMap::new();
    let (mut cuts, mut acked, mut disks_lost) = (0u64, 0usize, 0usize);
    'sweep: for pass in 0u64.. {
        let first = 1 + mix(seed ^ pass) % stride;
        for cut_at in (first..).step_by(stride as usize) {
            let run_seed = mix(seed ^ mix(pass) ^ cut_at);
            let lose_disk = run_seed.is_multiple_of(5);
            let label = format!("seed {seed} pass {pass} cut {cut_at}");
            let began = std::time::Instant::now();
            let outcome = run(&label, run_seed, cut_at, lose_disk).await;
            if std::env::var_os("LAKECACHE_POWER_VERBOSE").is_some() {
                eprintln!("{label}: {:?} in {:?}", outcome.site, began.elapsed());
            }
            let Some(site) = outcome.site else {
                assert_eq!(
                    outcome.acked,
                    SIZES.len(),
                    "{label}: no cut, yet a write failed"
                );
                break;
            };
            *per_site.entry(site).or_default() += 1;
            cuts += 1;
            acked += outcome.acked;
            disks_lost += usize::from(lose_disk);
            if cuts >= budget {
                break 'sweep;
            }
            assert!(
                cut_at < 10 * points,
                "{label}: the run never stops reaching cut points"
            );
        }
    }
    crashsim::compact_journals_after(0);
    eprintln!(
        "power sweep: {cuts} cuts over {points} cut points a run (seed {seed}), {acked} writes \
         acknowledged before them, {disks_lost} primaries restarted without their disk; none \
         lost. Cuts per site:"
    );
    for (site, n) in &per_site {
        eprintln!("  {n:4}  {site}");
    }
    if budget >= 50 {
        for site in SITES {
            assert!(
                per_site.contains_key(site),
                "no cut landed at {site:?} (seed {seed}): {per_site:?}"
            );
        }
    }
}
