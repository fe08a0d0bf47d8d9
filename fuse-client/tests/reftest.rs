//! Property-based reference-model test of the filesystem core: random
//! operation sequences run against `Fs` over the in-memory data plane and
//! against a plain model of the namespace; every result must agree.
//!
//! Cases: `PROPTEST_CASES` (default 4000); `benches/model/reftest-long.sh`
//! runs many more.

mod model;

use std::sync::Arc;

use lakecache_fuse::data_plane::MemoryDataPlane;
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

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn fs_matches_the_model(ops in proptest::collection::vec(model::op(), 1..48)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let data = Arc::new(MemoryDataPlane::new());
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
            let data = Arc::new(MemoryDataPlane::new());
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
