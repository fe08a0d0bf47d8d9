//! The filesystem core without the kernel: S3-compatible stores' quirks
//! and faults, driven through `Fs` over the in-memory data plane.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use lakecache_fuse::data_plane::{
    DataError, DataFault, DataOp, FaultyDataPlane, MemoryDataPlane, Quirks,
};
use lakecache_fuse::{Chain, Fs, FsConfig, FsError, Kind, ROOT_INO};

/// The caller of creating operations in these tests.
const WHO: lakecache_fuse::Creator = lakecache_fuse::Creator {
    uid: 0,
    gid: 0,
    perm: 0o644,
};

const BUCKET: &str = "data";

struct Setup {
    fs: Fs,
    plane: Arc<FaultyDataPlane<MemoryDataPlane>>,
}

impl Setup {
    fn new(quirks: Quirks) -> Self {
        let plane = Arc::new(FaultyDataPlane::new(MemoryDataPlane::with_quirks(quirks)));
        let mut config = FsConfig::new(BUCKET, "");
        config.readahead_initial = 4096;
        config.readahead_chunk = 8192;
        config.readahead_max = 32768;
        let fs = Fs::new(plane.clone(), config);
        Self { fs, plane }
    }

    fn store(&self) -> &MemoryDataPlane {
        self.plane.inner()
    }

    async fn read_all(&self, name: &str) -> Result<Vec<u8>, FsError> {
        let node = self.fs.lookup(ROOT_INO, name).await?;
        let (fh, _) = self.fs.open(node.ino, libc::O_RDONLY, pid()).await?;
        let mut out = Vec::new();
        let result = loop {
            match self.fs.read(fh, out.len() as u64, 3000).await {
                Ok(b) if b.is_empty() => break Ok(out),
                Ok(b) => out.extend_from_slice(&b),
                Err(e) => break Err(e),
            }
        };
        self.fs.release(fh).await?;
        result
    }

    /// create + write in pieces + release; the release's answer.
    async fn write_file(&self, name: &str, body: &[u8]) -> Result<(), FsError> {
        let fh = match self.fs.lookup(ROOT_INO, name).await {
            Ok(node) => {
                self.fs
                    .open(node.ino, libc::O_WRONLY | libc::O_TRUNC, pid())
                    .await?
                    .0
            }
            Err(FsError::NotFound) => {
                self.fs
                    .create(ROOT_INO, name, pid(), WHO, libc::O_WRONLY)
                    .await?
                    .1
            }
            Err(e) => return Err(e),
        };
        let mut written = 0;
        for piece in body.chunks(1000) {
            if let Err(e) = self
                .fs
                .write(fh, written, Bytes::copy_from_slice(piece))
                .await
            {
                let _ = self.fs.release(fh).await;
                return Err(e);
            }
            written += piece.len() as u64;
        }
        self.fs.release(fh).await
    }

    async fn names(&self) -> Vec<String> {
        self.fs
            .list_dir(ROOT_INO)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .filter(|n| n != "." && n != "..")
            .collect()
    }
}

fn pid() -> u32 {
    std::process::id()
}

fn body(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(seed)).collect()
}

#[tokio::test]
async fn a_listing_without_etags_still_opens_and_reads() {
    let s = Setup::new(Quirks {
        list_without_etags: true,
        ..Quirks::default()
    });
    let content = body(20_000, 3);
    s.store().insert(BUCKET, "f.bin", content.clone());
    assert_eq!(s.names().await, vec!["f.bin"]);
    assert_eq!(s.read_all("f.bin").await.unwrap(), content);
}

#[tokio::test]
async fn an_object_replaced_between_listing_and_open_never_serves_mixed_bytes() {
    let s = Setup::new(Quirks::default());
    let old = body(30_000, 5);
    let new = body(12_000, 7);
    s.store().insert(BUCKET, "f.bin", old);
    assert_eq!(s.names().await, vec!["f.bin"]);
    s.store().insert(BUCKET, "f.bin", new.clone());
    // The listing's version is gone before the file is opened: the read
    // is the new object whole, never an error, old-sized or spliced data.
    assert_eq!(s.read_all("f.bin").await.unwrap(), new);
}

#[tokio::test]
async fn a_directory_listed_over_many_small_pages_is_complete() {
    let s = Setup::new(Quirks {
        list_page_limit: Some(2),
        ..Quirks::default()
    });
    for i in 0..7 {
        s.store().insert(BUCKET, &format!("f{i}"), vec![i as u8]);
    }
    s.store().insert(BUCKET, "sub/x", vec![1]);
    let mut names = s.names().await;
    names.sort();
    assert_eq!(names, ["f0", "f1", "f2", "f3", "f4", "f5", "f6", "sub"]);
    let sub = s.fs.lookup(ROOT_INO, "sub").await.unwrap();
    assert_eq!(sub.kind, Kind::Dir);
}

#[tokio::test]
async fn read_errors_after_n_calls_surface_as_eio_and_heal() {
    let s = Setup::new(Quirks::default());
    let content = body(100_000, 9);
    s.store().insert(BUCKET, "f.bin", content.clone());
    s.plane.inject(
        DataOp::Read,
        2,
        u64::MAX,
        DataFault::Fail(DataError::UploadCut),
    );
    let err = s.read_all("f.bin").await.unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    s.plane.heal();
    assert_eq!(s.read_all("f.bin").await.unwrap(), content);
}

#[tokio::test]
async fn slow_responses_still_give_the_right_bytes() {
    let s = Setup::new(Quirks {
        latency: Some(Duration::from_millis(2)),
        ..Quirks::default()
    });
    let content = body(70_000, 11);
    s.store().insert(BUCKET, "f.bin", content.clone());
    s.plane.inject(
        DataOp::Read,
        1,
        3,
        DataFault::Delay(Duration::from_millis(40)),
    );
    assert_eq!(s.read_all("f.bin").await.unwrap(), content);
}

#[tokio::test]
async fn a_failed_upload_of_a_new_file_leaves_nothing_and_says_why() {
    let s = Setup::new(Quirks::default());
    s.plane.inject(
        DataOp::Upload,
        0,
        1,
        DataFault::Fail(DataError::ShortBody {
            expected: 5000,
            got: 10,
        }),
    );
    let err = s.write_file("new.bin", &body(5000, 1)).await.unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    // The cause reaches the log whole.
    let logged = Chain(&err).to_string();
    assert!(logged.contains("short body"), "{logged}");
    assert!(s.store().get(BUCKET, "new.bin").is_none());
    assert_eq!(
        s.fs.lookup(ROOT_INO, "new.bin").await.unwrap_err().errno(),
        libc::ENOENT
    );
}

#[tokio::test]
async fn a_cut_upload_over_an_existing_file_keeps_the_old_content() {
    let s = Setup::new(Quirks::default());
    let old = body(9000, 2);
    s.write_file("f.bin", &old).await.unwrap();
    s.plane
        .inject(DataOp::Upload, 0, 1, DataFault::Truncate { keep: 2500 });
    let err = s.write_file("f.bin", &body(9000, 3)).await.unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    assert_eq!(s.store().get(BUCKET, "f.bin").unwrap(), old);
    let node = s.fs.lookup(ROOT_INO, "f.bin").await.unwrap();
    assert_eq!(node.meta.size, old.len() as u64);
    assert_eq!(s.read_all("f.bin").await.unwrap(), old);
}

#[tokio::test]
async fn listing_and_lookup_failures_are_eio_not_enoent() {
    let s = Setup::new(Quirks::default());
    s.store().insert(BUCKET, "f", vec![1]);
    s.plane.inject(
        DataOp::List,
        0,
        1,
        DataFault::Fail(DataError::ShortBody {
            expected: 1,
            got: 0,
        }),
    );
    assert_eq!(s.fs.opendir(ROOT_INO).await.unwrap_err().errno(), libc::EIO);
    s.plane.inject(
        DataOp::Stat,
        0,
        1,
        DataFault::Fail(DataError::ShortBody {
            expected: 1,
            got: 0,
        }),
    );
    // A failing store must not make an existing file look deleted.
    assert_eq!(
        s.fs.lookup(ROOT_INO, "f").await.unwrap_err().errno(),
        libc::EIO
    );
    assert_eq!(s.fs.lookup(ROOT_INO, "f").await.unwrap().meta.size, 1);
}

#[tokio::test]
async fn a_failed_rename_copy_keeps_the_source() {
    let s = Setup::new(Quirks::default());
    s.write_file("a", &body(100, 4)).await.unwrap();
    s.plane.inject(
        DataOp::Copy,
        0,
        1,
        DataFault::Fail(DataError::ShortBody {
            expected: 1,
            got: 0,
        }),
    );
    let err =
        s.fs.rename(ROOT_INO, "a", ROOT_INO, "b", false, pid())
            .await;
    assert_eq!(err.unwrap_err().errno(), libc::EIO);
    assert_eq!(s.store().get(BUCKET, "a").unwrap(), body(100, 4));
    assert!(s.store().get(BUCKET, "b").is_none());
    assert_eq!(s.read_all("a").await.unwrap(), body(100, 4));
}

#[tokio::test]
async fn another_process_cannot_rename_a_file_being_written() {
    let s = Setup::new(Quirks::default());
    let (_, fh) =
        s.fs.create(ROOT_INO, "ckpt.tmp", pid(), WHO, libc::O_WRONLY)
            .await
            .unwrap();
    s.fs.write(fh, 0, Bytes::from(vec![7u8; 5000]))
        .await
        .unwrap();
    // pid 1 (init) is not the writer: the half-written file stays put.
    let err =
        s.fs.rename(ROOT_INO, "ckpt.tmp", ROOT_INO, "ckpt.pt", false, 1)
            .await
            .unwrap_err();
    assert_eq!(err.errno(), libc::EBUSY);
    assert!(s.store().get(BUCKET, "ckpt.pt").is_none());
    assert!(s.store().get(BUCKET, "ckpt.tmp").is_none());
    // The writer itself may (safetensors renames before close): what it
    // wrote so far is committed and moved.
    s.fs.write(fh, 5000, Bytes::from(vec![8u8; 100]))
        .await
        .unwrap();
    s.fs.rename(ROOT_INO, "ckpt.tmp", ROOT_INO, "ckpt.pt", false, pid())
        .await
        .unwrap();
    s.fs.release(fh).await.unwrap();
    let got = s.store().get(BUCKET, "ckpt.pt").unwrap();
    assert_eq!(got.len(), 5100);
    assert_eq!(got[5099], 8);
}

/// A filesystem over a fresh in-memory plane, with `tune` applied to the
/// default config.
fn fs_with(tune: impl FnOnce(&mut FsConfig)) -> (Fs, Arc<FaultyDataPlane<MemoryDataPlane>>) {
    let plane = Arc::new(FaultyDataPlane::new(MemoryDataPlane::with_quirks(
        Quirks::default(),
    )));
    let mut config = FsConfig::new(BUCKET, "");
    tune(&mut config);
    (Fs::new(plane.clone(), config), plane)
}

/// A name looked up before stays resolvable when the cluster cannot be
/// asked (stale-if-error); a name never seen gets the error, and a
/// definite "no such object" still removes a known name.
#[tokio::test]
async fn a_known_name_outlives_an_unreachable_cluster_but_not_a_delete() {
    // Every lookup asks the cluster.
    let (fs, plane) = fs_with(|c| c.entry_ttl = Duration::ZERO);
    plane.inner().insert(BUCKET, "known.bin", b"abc".to_vec());
    plane.inner().insert(BUCKET, "unseen.bin", b"def".to_vec());
    let before = fs.lookup(ROOT_INO, "known.bin").await.unwrap();

    let down = || DataError::StoreUnavailable("every worker failed".into());
    for op in [DataOp::Stat, DataOp::List] {
        plane.inject(op, 0, u64::MAX, DataFault::Fail(down()));
    }
    let after = fs.lookup(ROOT_INO, "known.bin").await.unwrap();
    assert_eq!((after.ino, after.meta.size), (before.ino, 3));
    let unseen = fs.lookup(ROOT_INO, "unseen.bin").await.unwrap_err();
    assert_eq!(unseen.errno(), libc::EIO, "{unseen:?}");

    plane.heal();
    plane.inner().remove(BUCKET, "known.bin");
    let gone = fs.lookup(ROOT_INO, "known.bin").await.unwrap_err();
    assert!(matches!(gone, FsError::NotFound), "{gone:?}");
}

/// Write-back through an S3 outage: an unknown name is taken as absent
/// (so checkpoint writers can create files), but a directory made
/// through the mount stays, and files are still created in it, even
/// after the kernel forgot its inode. Before, its lookup answered ENOENT
/// and so did every create under it (seen in the mount's write-back
/// crash test while another test ran `drop_caches`).
#[tokio::test]
async fn a_directory_made_here_survives_its_lookup_during_an_s3_outage() {
    let (fs, plane) = fs_with(|c| {
        c.entry_ttl = Duration::ZERO;
        c.write_mode = lakecache_protocol::WriteMode::Back;
    });
    let dir = fs.mkdir(ROOT_INO, "ckpt", WHO).await.unwrap();

    // The kernel drops the directory's dentry and inode.
    fs.forget(dir.ino, 1);
    // S3 cannot list; a stat of the pending marker still answers, as a
    // worker holding it does.
    let down = DataError::StoreUnavailable("S3 unreachable".into());
    plane.inject(DataOp::List, 0, u64::MAX, DataFault::Fail(down));
    let again = fs.lookup(ROOT_INO, "ckpt").await.unwrap();
    assert_eq!(again.kind, Kind::Dir);
    let unknown = fs.lookup(ROOT_INO, "never-made").await.unwrap_err();
    assert!(matches!(unknown, FsError::NotFound), "{unknown:?}");
    let (node, fh) = fs
        .create(again.ino, "step1.bin", pid(), WHO, libc::O_WRONLY)
        .await
        .unwrap();
    fs.write(fh, 0, Bytes::from_static(b"weights"))
        .await
        .unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(node.parent, again.ino);
    assert_eq!(
        plane.inner().get(BUCKET, "ckpt/step1.bin").unwrap(),
        &b"weights"[..]
    );
}

/// `shutil.copy2` closes the copy, then sets its times and mode; the
/// kernel's release of the handle comes on its own, and for an empty
/// file it is the release that uploads. A mode set while that upload is
/// under way must still reach S3 (it was lost: the copy's listing showed
/// 644 where the source had 604).
#[tokio::test]
async fn a_mode_set_while_the_release_uploads_reaches_s3() {
    let s = Setup::new(Quirks::default());
    let (node, fh) =
        s.fs.create(ROOT_INO, "empty", pid(), WHO, libc::O_WRONLY)
            .await
            .unwrap();
    s.fs.flush(fh, pid()).await.unwrap();
    let slow = DataFault::Delay(Duration::from_millis(300));
    s.plane.inject(DataOp::Put, 0, u64::MAX, slow.clone());
    s.plane.inject(DataOp::Upload, 0, u64::MAX, slow);
    let release = s.fs.release(fh);
    let chmod = async {
        // The release holds the upload by now.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let change = lakecache_fuse::SetAttr {
            mode: Some(0o604),
            ..Default::default()
        };
        s.fs.setattr(node.ino, change).await
    };
    let (released, changed) = tokio::join!(release, chmod);
    released.unwrap();
    assert_eq!(s.fs.attrs(&changed.unwrap()).perm, 0o604);
    s.fs.sync_metadata().await.unwrap();
    // A new mount sees what S3 holds.
    let fresh = Fs::new(s.plane.clone(), FsConfig::new(BUCKET, ""));
    let stored = fresh.lookup(ROOT_INO, "empty").await.unwrap();
    assert_eq!(fresh.attrs(&stored).perm, 0o604);
}

/// An object replaced while a passthrough handle pins its old version:
/// the name's next lookup gets a new inode. A revalidation of the old
/// inode that comes after that must not take the name from the new one
/// (it did, so every later lookup made yet another inode).
#[tokio::test]
async fn revalidating_a_pinned_old_version_leaves_the_names_new_inode_alone() {
    let (fs, plane) = fs_with(|c| {
        c.attr_ttl = Duration::ZERO;
        c.entry_ttl = Duration::ZERO;
    });
    let store = plane.inner();
    store.insert(BUCKET, "model.bin", body(5000, 1));
    let old = fs.lookup(ROOT_INO, "model.bin").await.unwrap();
    fs.pin_version(old.ino, true);
    store.insert(BUCKET, "model.bin", body(7000, 2));
    let new = fs.lookup(ROOT_INO, "model.bin").await.unwrap();
    assert_ne!(new.ino, old.ino, "a pinned inode keeps its version");
    assert_eq!(new.meta.size, 7000);
    // The kernel asks about the old inode (a handle still has it open).
    let still_old = fs.getattr(old.ino).await.unwrap();
    assert_eq!(still_old.meta.size, 5000);
    let again = fs.lookup(ROOT_INO, "model.bin").await.unwrap();
    assert_eq!(again.ino, new.ino, "the name keeps its new inode");
}

/// A zip writer (np.savez, zipfile, torch.save's older format) writes
/// its entries, then seeks back to patch the header; HDF5 writes where
/// it likes. Both write modes, a file past the held-back size (its
/// upload already streaming) and a small one: the object is exactly the
/// bytes the application left, and nothing half-written reaches the
/// store before the close.
#[tokio::test]
async fn a_file_patched_behind_its_end_is_stored_as_written_in_both_modes() {
    let spool = tempfile::tempdir().unwrap();
    for mode in [
        lakecache_protocol::WriteMode::Through,
        lakecache_protocol::WriteMode::Back,
    ] {
        for len in [3 << 20, 5000usize] {
            let (fs, plane) = fs_with(|c| {
                c.write_mode = mode;
                c.spool_dir = spool.path().to_path_buf();
            });
            let name = format!("archive-{len}.npz");
            let (_, fh) = fs
                .create(ROOT_INO, &name, pid(), WHO, libc::O_WRONLY)
                .await
                .unwrap();
            let mut want = body(len, 7);
            let mut at = 0;
            for piece in want.chunks(128 << 10) {
                fs.write(fh, at, Bytes::copy_from_slice(piece))
                    .await
                    .unwrap();
                at += piece.len() as u64;
            }
            // The header patched, then a trailer appended at the end.
            let header = vec![0xAB; 30];
            fs.write(fh, 0, Bytes::from(header.clone())).await.unwrap();
            want[..30].copy_from_slice(&header);
            let trailer = vec![0xCD; 100];
            fs.write(fh, len as u64, Bytes::from(trailer.clone()))
                .await
                .unwrap();
            want.extend_from_slice(&trailer);
            // A write further back again, after the move.
            fs.write(fh, 1000, Bytes::from_static(b"patched"))
                .await
                .unwrap();
            want[1000..1007].copy_from_slice(b"patched");
            assert!(
                plane.inner().get(BUCKET, &name).is_none(),
                "{mode:?} {len}: stored before the close"
            );
            fs.flush(fh, pid()).await.unwrap();
            fs.release(fh).await.unwrap();
            let got = plane.inner().get(BUCKET, &name).expect("stored");
            assert_eq!(got.len(), want.len(), "{mode:?} {len}");
            assert!(got == want[..], "{mode:?} {len}: different bytes");
            let node = fs.lookup(ROOT_INO, &name).await.unwrap();
            assert_eq!(node.meta.size, want.len() as u64);
        }
    }
    // The spool files are anonymous: nothing is left behind.
    let left: Vec<_> = walk(spool.path());
    assert!(left.is_empty(), "left in the spool: {left:?}");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.path().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

/// rsync closes an empty temporary file, then opens it to set its mode
/// and renames it, while the kernel's release of the writer comes on its
/// own. Before the release came, the open failed EBUSY ("the file is
/// being written") and the rename EBADF (the handle it committed was
/// released under it); both must wait for the release instead.
#[tokio::test]
async fn an_empty_file_closed_but_not_yet_released_can_be_opened_and_renamed() {
    let s = Setup::new(Quirks::default());
    let (node, fh) =
        s.fs.create(ROOT_INO, ".empty.tmp", pid(), WHO, libc::O_WRONLY)
            .await
            .unwrap();
    s.fs.flush(fh, pid()).await.unwrap();
    let late_release = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        s.fs.release(fh).await
    };
    let open_then_rename = async {
        let (read_fh, _) = s.fs.open(node.ino, libc::O_RDONLY, pid()).await?;
        s.fs.release(read_fh).await?;
        s.fs.rename(ROOT_INO, ".empty.tmp", ROOT_INO, "empty", false, pid())
            .await
    };
    let (released, renamed) = tokio::join!(late_release, open_then_rename);
    released.unwrap();
    renamed.unwrap();
    assert_eq!(s.store().get(BUCKET, "empty").unwrap().len(), 0);
    assert!(s.store().get(BUCKET, ".empty.tmp").is_none());

    // A rename racing the release itself (the rename resolved the writer
    // before the release took it) still finds the file stored.
    let (_, fh) =
        s.fs.create(ROOT_INO, "b.tmp", pid(), WHO, libc::O_WRONLY)
            .await
            .unwrap();
    let (released, renamed) = tokio::join!(
        s.fs.release(fh),
        s.fs.rename(ROOT_INO, "b.tmp", ROOT_INO, "b", false, pid())
    );
    released.unwrap();
    renamed.unwrap();
    assert!(s.store().get(BUCKET, "b").is_some());
}
