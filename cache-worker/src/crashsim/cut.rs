//! The moment the power goes out: what the disk keeps of what was not
//! synced, under the conservative model or the seeded torn one.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;

use super::{Op, Sim};

/// The unit a disk writes whole.
const SECTOR: u64 = 512;

/// SplitMix64: explicit, so a seed replays the same choices on every
/// build and machine.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..=max`.
    fn upto(&mut self, max: u64) -> u64 {
        if max == u64::MAX {
            return self.next();
        }
        self.next() % (max + 1)
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

fn warn_unless_gone(what: &str, result: io::Result<()>) {
    if let Err(e) = result {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::warn!(error = %e, what, "simulated power loss: undoing an operation failed");
        }
    }
}

impl Sim {
    /// Undoes what the power loss loses.
    pub(super) fn cut(&mut self) {
        self.dead = true;
        self.undo_directory_operations();
        self.undo_overwrites();
        self.lose_unsynced_bytes();
        tracing::warn!(root = %self.root.display(), point = self.points, site = ?self.cut_site, torn = self.tear.is_some(), "simulated power loss");
    }

    /// Per directory, a prefix of its unsynced operations survives (none
    /// in the conservative model); the rest are undone, newest first.
    fn undo_directory_operations(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        let mut per_dir: HashMap<PathBuf, usize> = HashMap::new();
        for p in &pending {
            *per_dir.entry(p.dir.clone()).or_default() += 1;
        }
        let mut kept: HashMap<PathBuf, usize> = HashMap::new();
        let mut dirs: Vec<_> = per_dir.into_iter().collect();
        dirs.sort();
        for (dir, count) in dirs {
            let keep = self.tear.as_mut().map_or(0, |r| r.upto(count as u64)) as usize;
            kept.insert(dir, keep);
        }
        let mut seen: HashMap<PathBuf, usize> = HashMap::new();
        let mut undo = Vec::new();
        for p in pending {
            let n = seen.entry(p.dir.clone()).or_default();
            *n += 1;
            if *n > kept[&p.dir] {
                undo.push(p.op);
            } else {
                match &p.op {
                    Op::Rename {
                        replaced: Some(old),
                        ..
                    }
                    | Op::Remove { kept: old, .. } => {
                        let _ = fs::remove_file(old);
                    }
                    _ => {}
                }
            }
        }
        for op in undo.into_iter().rev() {
            match op {
                Op::Rename { from, to, replaced } => {
                    warn_unless_gone("rename", fs::rename(&to, &from));
                    if let Some(old) = replaced {
                        warn_unless_gone("replaced file", fs::rename(&old, &to));
                    }
                }
                Op::Create(path) => warn_unless_gone("create", fs::remove_file(path)),
                Op::Remove { path, kept } => warn_unless_gone("unlink", fs::rename(kept, path)),
                Op::Mkdir(path) => warn_unless_gone("mkdir", fs::remove_dir_all(path)),
            }
        }
    }

    /// Unsynced overwrites in place: undone whole (conservative), or
    /// sector by sector at random (torn).
    fn undo_overwrites(&mut self) {
        let overwrites = std::mem::take(&mut self.overwrites);
        if overwrites.is_empty() {
            return;
        }
        let files: HashMap<u64, PathBuf> = self
            .files()
            .into_iter()
            .map(|(path, ino)| (ino, path))
            .collect();
        for o in overwrites.iter().rev() {
            let Some(path) = files.get(&o.ino) else {
                continue;
            };
            let Ok(file) = fs::OpenOptions::new().write(true).open(path) else {
                continue;
            };
            for (i, old) in o.old.chunks(SECTOR as usize).enumerate() {
                let lost = self.tear.as_mut().is_none_or(Rng::coin);
                if lost {
                    let at = o.offset + i as u64 * SECTOR;
                    warn_unless_gone("overwrite", file.write_all_at(old, at));
                }
            }
        }
    }

    /// Bytes a file gained since its last sync: all lost (conservative);
    /// a random whole-sector prefix kept, sometimes with a zeroed sector
    /// range inside it (torn).
    fn lose_unsynced_bytes(&mut self) {
        for (path, ino) in self.files() {
            let Some(&synced) = self.synced_len.get(&ino) else {
                continue;
            };
            let Ok(len) = fs::metadata(&path).map(|m| m.len()) else {
                continue;
            };
            if len <= synced {
                continue;
            }
            let (keep, hole) = match self.tear.as_mut() {
                None => (synced, None),
                Some(r) => {
                    let sectors = (len - synced).div_ceil(SECTOR);
                    let kept = r.upto(sectors);
                    let keep = (synced + kept * SECTOR).min(len);
                    let hole = (kept > 1 && r.coin()).then(|| {
                        let first = r.upto(kept - 1);
                        let n = 1 + r.upto(kept - 1 - first);
                        (synced + first * SECTOR, n * SECTOR)
                    });
                    (keep, hole)
                }
            };
            let Ok(file) = fs::OpenOptions::new().write(true).open(&path) else {
                continue;
            };
            warn_unless_gone("truncate", file.set_len(keep));
            if let Some((at, n)) = hole {
                let n = n.min(keep.saturating_sub(at));
                warn_unless_gone("hole", file.write_all_at(&vec![0u8; n as usize], at));
            }
        }
    }

    /// Every regular file under the root with its inode, by path (an
    /// order a seed can replay).
    fn files(&self) -> Vec<(PathBuf, u64)> {
        let mut out = Vec::new();
        let mut stack = vec![self.root.clone()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                let Ok(meta) = fs::symlink_metadata(&path) else {
                    continue;
                };
                if meta.is_dir() {
                    stack.push(path);
                } else if meta.is_file() {
                    out.push((path, meta.ino()));
                }
            }
        }
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::io::Write;

    use super::super::*;
    use super::SECTOR;

    /// One scenario, cut under a given model: a synced file gains bytes,
    /// a synced journal is replaced by an unsynced rename, and a synced
    /// header is overwritten in place. Returns what the disk kept.
    fn scenario(root: &Path, seed: Option<u64>) -> (Vec<u8>, Vec<u8>, Vec<u8>, bool) {
        let _ = fs::remove_dir_all(root);
        fs::create_dir_all(root).unwrap();
        arm(root, u64::MAX);
        if let Some(seed) = seed {
            tear(seed);
        }
        let data = root.join("data");
        let mut f = fs::File::create(&data).unwrap();
        created(&data).unwrap();
        f.write_all(&[1u8; 1000]).unwrap();
        sync_file(&data, &f, || f.sync_data()).unwrap();
        sync_dir(root, || Ok(())).unwrap();
        f.write_all(&[2u8; 5000]).unwrap();

        let journal = root.join("j");
        let tmp = root.join("j.tmp");
        fs::write(&journal, b"old journal").unwrap();
        existing(&journal);
        fs::write(&tmp, b"new journal").unwrap();
        rename(&tmp, &journal, || fs::rename(&tmp, &journal)).unwrap();

        let header = root.join("h");
        fs::write(&header, [7u8; 1024]).unwrap();
        existing(&header);
        let h = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&header)
            .unwrap();
        overwriting(&header, &h, 0, 1024).unwrap();
        h.write_all_at(&[9u8; 1024], 0).unwrap();

        let gone = root.join("gone");
        fs::write(&gone, b"unlinked").unwrap();
        existing(&gone);
        remove(&gone, || fs::remove_file(&gone)).unwrap();

        cut_after(1);
        assert!(cut_point(root).is_err(), "the power goes out here");
        assert!(power_is_out());
        assert!(disarm());
        (
            fs::read(&data).unwrap(),
            fs::read(&journal).unwrap(),
            fs::read(&header).unwrap(),
            gone.exists(),
        )
    }

    #[test]
    fn a_cut_loses_what_fsync_does_not_promise_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("disk");
        let (data, journal, header, back) = scenario(&root, None);
        assert!(back, "an unsynced unlink is undone");
        assert_eq!(
            data,
            vec![1u8; 1000],
            "conservative: unsynced bytes all lost"
        );
        assert_eq!(
            journal, b"old journal",
            "an undone rename brings back what it replaced"
        );
        assert_eq!(header, vec![7u8; 1024], "an unsynced overwrite is undone");

        let (mut shorter, mut holes, mut journals_kept) = (0, 0, 0);
        for seed in 0..64 {
            let (data, journal, header, _) = scenario(&root, Some(seed));
            assert!(data.len() >= 1000 && data.len() <= 6000, "seed {seed}");
            assert_eq!(
                &data[..1000],
                &[1u8; 1000][..],
                "seed {seed}: synced bytes kept"
            );
            assert!(
                (data.len() - 1000) % SECTOR as usize == 0 || data.len() == 6000,
                "seed {seed}: torn at a sector boundary"
            );
            shorter += usize::from(data.len() < 6000);
            holes += usize::from(data[1000..].contains(&0));
            assert!(
                data[1000..].iter().all(|b| *b == 2 || *b == 0),
                "seed {seed}"
            );
            assert!(
                journal == b"old journal" || journal == b"new journal",
                "seed {seed}"
            );
            journals_kept += usize::from(journal == b"new journal");
            for sector in header.chunks(SECTOR as usize) {
                assert!(sector.iter().all(|b| *b == 7) || sector.iter().all(|b| *b == 9));
            }
        }
        // The seeded model really draws both ways.
        assert!(
            shorter > 0 && holes > 0,
            "{shorter} torn, {holes} with holes"
        );
        assert!(journals_kept > 0 && journals_kept < 64, "{journals_kept}");
    }
}
