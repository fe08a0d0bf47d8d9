//! Property-based reference-model test of the filesystem core: random
//! operation sequences run against `Fs` over the in-memory data plane and
//! against a plain model of the namespace; every result must agree.
//!
//! Cases: `PROPTEST_CASES` (default 4000); `benches/model/reftest-long.sh`
//! runs many more. The seed is printed; `LAKECACHE_MODEL_SEED` replays it.

mod model;

use std::sync::Arc;

use lakecache_fuse::data_plane::{FaultyDataPlane, MemoryDataPlane};
use lakecache_fuse::{Fs, FsConfig};
use model::{run_case, Op};
use proptest::prelude::*;

const BUCKET: &str = "ref";

fn config() -> FsConfig {
    let mut c = FsConfig::new(BUCKET, "root/");
    // Tiny read-ahead so that a few hundred bytes span many chunks.
    c.readahead_initial = 16;
    c.readahead_max = 64;
    c.readahead_chunk = 24;
    // Ops run one after another: a writer closed before any write is
    // released only by a later op, so waiting for it would only add 2 s
    // before the answer the model expects (EBUSY and friends).
    c.release_wait = std::time::Duration::ZERO;
    c
}

/// A whole number from the environment, or `default`; anything else
/// stops the test saying what was wrong.
fn env_number(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Err(_) => default,
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
    }
}

fn cases() -> u32 {
    let cases = env_number("PROPTEST_CASES", 4000);
    assert!(
        cases > 0,
        "PROPTEST_CASES=0: the model needs at least one case"
    );
    u32::try_from(cases).unwrap_or_else(|_| panic!("PROPTEST_CASES={cases} is too many"))
}

/// The run's seed: `LAKECACHE_MODEL_SEED`, or drawn and printed, so a
/// failure can be replayed.
fn seed() -> u64 {
    let drawn = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let seed = env_number("LAKECACHE_MODEL_SEED", drawn);
    eprintln!(
        "reference model: seed {seed} (replay with LAKECACHE_MODEL_SEED={seed}), {} cases",
        cases()
    );
    seed
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        rng_seed: proptest::test_runner::RngSeed::Fixed(seed()),
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn fs_matches_the_model(ops in proptest::collection::vec(model::op(), 1..48)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let data = Arc::new(FaultyDataPlane::new(MemoryDataPlane::new()));
            let fs = Fs::new(data.clone(), config());
            run_case(&fs, &data, BUCKET, "root/", &ops).await
        }).map_err(TestCaseError::fail)?;
    }
}

/// Regressions the model found, kept as plain tests.
mod found {
    use super::*;
    use model::Op::*;

    fn run(ops: Vec<Op>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let data = Arc::new(FaultyDataPlane::new(MemoryDataPlane::new()));
            let fs = Fs::new(data.clone(), config());
            run_case(&fs, &data, BUCKET, "root/", &ops).await
        })
        .unwrap();
    }

    #[test]
    fn renaming_over_a_file_being_written_is_refused() {
        run(vec![
            Create { dir: 0, name: 0 },
            Write {
                handle: 0,
                len: 5,
                seed: 1,
            },
            Flush { handle: 0 },
            Create { dir: 0, name: 1 },
            Rename {
                dir: 0,
                name: 0,
                to_dir: 0,
                to_name: 1,
            },
            Write {
                handle: 1,
                len: 3,
                seed: 2,
            },
            Release { handle: 1 },
            Read {
                dir: 0,
                name: 1,
                reads: vec![(0, 64)],
            },
        ]);
    }

    #[test]
    fn a_file_replaced_while_open_for_writing_reads_its_new_content() {
        run(vec![
            Create { dir: 0, name: 2 },
            Write {
                handle: 0,
                len: 40,
                seed: 3,
            },
            Release { handle: 0 },
            Create { dir: 0, name: 2 },
            Write {
                handle: 0,
                len: 7,
                seed: 4,
            },
            Fsync { handle: 0 },
            Read {
                dir: 0,
                name: 2,
                reads: vec![(0, 10), (10, 40)],
            },
        ]);
    }

    /// An unlink of a file being rewritten (`O_TRUNC` over a stored
    /// file) failed on S3 after marking the writer discarded: the close
    /// then succeeded and its data was never stored.
    #[test]
    fn an_unlink_that_fails_leaves_the_writer_to_store_its_data() {
        run(vec![
            Create { dir: 0, name: 0 },
            Write {
                handle: 0,
                len: 1,
                seed: 0,
            },
            Flush { handle: 0 },
            Create { dir: 0, name: 0 },
            Write {
                handle: 1,
                len: 4,
                seed: 7,
            },
            Faulty {
                fault: model::meta::Fault::S3Error,
                op: Box::new(Unlink { dir: 0, name: 0 }),
            },
        ]);
    }

    /// A chmod of a file open for reading is stored by a copy in place,
    /// a new version: the reader, still on the old one, got ESTALE.
    #[test]
    fn a_chmod_stored_while_a_file_is_open_for_reading_keeps_its_reader() {
        run(vec![
            Create { dir: 0, name: 0 },
            Write {
                handle: 0,
                len: 40,
                seed: 3,
            },
            Flush { handle: 0 },
            OpenRead { dir: 0, name: 0 },
            ReadHandle {
                handle: 0,
                offset: 0,
                len: 1,
            },
            Chmod {
                dir: 0,
                name: 0,
                mode: 0o600,
            },
            Create { dir: 0, name: 1 },
            Fsync { handle: 0 },
            ReadHandle {
                handle: 0,
                offset: 0,
                len: 30,
            },
        ]);
    }

    /// A file open for reading in a directory that is renamed: the
    /// reader kept the old key, which the move deleted (ENOENT).
    #[test]
    fn a_file_open_for_reading_survives_a_rename_of_its_directory() {
        run(vec![
            Mkdir { dir: 0, name: 3 },
            Create { dir: 1, name: 3 },
            Write {
                handle: 0,
                len: 8,
                seed: 0,
            },
            Flush { handle: 0 },
            OpenRead { dir: 1, name: 3 },
            Rename {
                dir: 6,
                name: 3,
                to_dir: 2,
                to_name: 0,
            },
            ReadHandle {
                handle: 0,
                offset: 0,
                len: 5,
            },
        ]);
    }

    /// A truncate of a file open for reading: the reader went on seeing
    /// the old size and bytes (POSIX shows it the truncation), also
    /// after the file was renamed.
    #[test]
    fn a_reader_sees_a_truncate_of_its_file_also_after_a_rename() {
        run(vec![
            Create { dir: 0, name: 0 },
            Write {
                handle: 0,
                len: 20,
                seed: 4,
            },
            Release { handle: 0 },
            OpenRead { dir: 0, name: 0 },
            Rename {
                dir: 0,
                name: 0,
                to_dir: 0,
                to_name: 3,
            },
            Truncate {
                dir: 0,
                name: 3,
                size: 5,
            },
            ReadHandle {
                handle: 0,
                offset: 0,
                len: 20,
            },
            Truncate {
                dir: 0,
                name: 3,
                size: 9,
            },
            ReadHandle {
                handle: 0,
                offset: 3,
                len: 20,
            },
        ]);
    }

    /// An unlink that failed on S3 had already detached the file's
    /// readers onto a local copy: a later truncate did not reach them.
    #[test]
    fn an_unlink_that_fails_leaves_the_readers_on_the_file() {
        run(vec![
            Create { dir: 0, name: 1 },
            Release { handle: 0 },
            OpenRead { dir: 0, name: 1 },
            Faulty {
                fault: model::meta::Fault::S3Error,
                op: Box::new(Unlink { dir: 0, name: 1 }),
            },
            Truncate {
                dir: 0,
                name: 1,
                size: 7,
            },
            ReadHandle {
                handle: 0,
                offset: 0,
                len: 9,
            },
        ]);
    }

    /// A directory rename copies its files to new versions; the inodes
    /// kept the old ETags, and a truncate (which reads the kept bytes by
    /// version) failed with ESTALE.
    #[test]
    fn a_file_in_a_renamed_directory_can_be_truncated() {
        run(vec![
            Mkdir { dir: 0, name: 1 },
            Create { dir: 1, name: 0 },
            Write {
                handle: 0,
                len: 3,
                seed: 1,
            },
            Release { handle: 0 },
            Rename {
                dir: 0,
                name: 1,
                to_dir: 0,
                to_name: 2,
            },
            Truncate {
                dir: 1,
                name: 0,
                size: 1,
            },
        ]);
    }

    #[test]
    fn a_renamed_directory_lists_what_was_created_in_it_after_a_listing() {
        run(vec![
            Mkdir { dir: 0, name: 0 },
            Create { dir: 2, name: 3 },
            Rename {
                dir: 0,
                name: 3,
                to_dir: 1,
                to_name: 0,
            },
            Mkdir { dir: 2, name: 1 },
            Readdir { dir: 2 },
            Rename {
                dir: 3,
                name: 0,
                to_dir: 3,
                to_name: 1,
            },
            Mkdir { dir: 2, name: 2 },
            Readdir { dir: 4 },
        ]);
    }
}

/// Every operation the model grew, in one sequence the model checks:
/// chmod, chown, utimens, truncate up and down, symlink and readlink,
/// reads through handles of files unlinked and renamed while open, and
/// operations over a faulty data plane (slow, S3's 500, the worker gone).
mod grown {
    use super::*;
    use model::meta::Fault;
    use model::Op::*;

    fn faulty(fault: Fault, op: Op) -> Op {
        Faulty {
            fault,
            op: Box::new(op),
        }
    }

    #[test]
    fn every_grown_operation_agrees_with_the_model() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ops = vec![
            Create { dir: 0, name: 0 },
            Write {
                handle: 0,
                len: 60,
                seed: 5,
            },
            Truncate {
                dir: 0,
                name: 0,
                size: 100,
            },
            Release { handle: 0 },
            Stat { dir: 0, name: 0 },
            Truncate {
                dir: 0,
                name: 0,
                size: 30,
            },
            Truncate {
                dir: 0,
                name: 0,
                size: 90,
            },
            Chmod {
                dir: 0,
                name: 0,
                mode: 0o4711,
            },
            Chown {
                dir: 0,
                name: 0,
                uid: 1000,
                gid: 1000,
            },
            Utimens {
                dir: 0,
                name: 0,
                secs: 1_700_000_000,
            },
            Stat { dir: 0, name: 0 },
            Symlink {
                dir: 0,
                name: 1,
                target: 1,
            },
            Readlink { dir: 0, name: 1 },
            Readlink { dir: 0, name: 0 },
            Stat { dir: 0, name: 1 },
            // Open for reading, then renamed over and unlinked: reads go on.
            OpenRead { dir: 0, name: 0 },
            Create { dir: 0, name: 2 },
            Write {
                handle: 0,
                len: 10,
                seed: 9,
            },
            Release { handle: 0 },
            OpenRead { dir: 0, name: 2 },
            Rename {
                dir: 0,
                name: 0,
                to_dir: 0,
                to_name: 3,
            },
            ReadHandle {
                handle: 0,
                offset: 20,
                len: 40,
            },
            Rename {
                dir: 0,
                name: 2,
                to_dir: 0,
                to_name: 3,
            },
            ReadHandle {
                handle: 0,
                offset: 0,
                len: 90,
            },
            ReadHandle {
                handle: 1,
                offset: 0,
                len: 10,
            },
            Unlink { dir: 0, name: 3 },
            ReadHandle {
                handle: 1,
                offset: 2,
                len: 5,
            },
            CloseRead { handle: 0 },
            CloseRead { handle: 0 },
            faulty(Fault::Slow, Stat { dir: 0, name: 1 }),
            faulty(Fault::S3Error, Mkdir { dir: 0, name: 2 }),
            faulty(Fault::WorkerGone, Readdir { dir: 0 }),
            faulty(Fault::S3Error, Unlink { dir: 0, name: 1 }),
            Readdir { dir: 0 },
        ];
        rt.block_on(async {
            let data = Arc::new(FaultyDataPlane::new(MemoryDataPlane::new()));
            let fs = Fs::new(data.clone(), config());
            run_case(&fs, &data, BUCKET, "root/", &ops).await
        })
        .unwrap();
    }
}
