//! Page files on local disk: one file per page, named by a hash of
//! (URI, ETag, page index), written atomically, checked by CRC32C.

use std::fs;
use std::io::{self, Write};
use std::ops::Range;
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};

use bytes::{Bytes, BytesMut};
use sha2::{Digest, Sha256};

/// Granularity of CRC checks, so a small read verifies a small block
/// instead of the whole page.
pub const CHECK_BLOCK: u64 = 256 * 1024;

/// Identity of one page; SHA-256 over explicit bytes, stable everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageKey(pub [u8; 32]);

impl PageKey {
    pub fn new(uri: &str, etag: &str, index: u64) -> Self {
        let mut h = Sha256::new();
        h.update((uri.len() as u64).to_be_bytes());
        h.update(uri.as_bytes());
        h.update((etag.len() as u64).to_be_bytes());
        h.update(etag.as_bytes());
        h.update(index.to_be_bytes());
        Self(h.finalize().into())
    }

    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PageReadError {
    #[error("page file missing")]
    Missing,
    #[error("page file corrupt: CRC mismatch in block {block}")]
    Corrupt { block: usize },
    #[error("page i/o: {0}")]
    Io(#[from] io::Error),
}

/// CRC32C of each [`CHECK_BLOCK`] of `data`.
pub fn block_crcs(data: &[u8]) -> Vec<u32> {
    data.chunks(CHECK_BLOCK as usize)
        .map(crc32c::crc32c)
        .collect()
}

pub struct PageStore {
    pages: PathBuf,
    tmp: PathBuf,
}

fn mkdir_private(path: &Path) -> io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
}

impl PageStore {
    /// Creates `<dir>/pages` and `<dir>/tmp` (0700); stale temp files from
    /// a crash are removed.
    pub fn open(dir: &Path) -> io::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        mkdir_private(dir)?;
        // An existing directory may have been created with looser modes.
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
        let pages = dir.join("pages");
        let tmp = dir.join("tmp");
        mkdir_private(&pages)?;
        let _ = fs::remove_dir_all(&tmp);
        mkdir_private(&tmp)?;
        Ok(Self { pages, tmp })
    }

    pub fn path(&self, key: &PageKey) -> PathBuf {
        let hex = key.hex();
        self.pages.join(&hex[..2]).join(hex)
    }

    /// Writes `data` to a temp file; `commit` moves it into place.
    pub fn stage(&self, data: &[u8]) -> io::Result<(PathBuf, Vec<u32>)> {
        let tmp = self.tmp.join(uuid::Uuid::new_v4().simple().to_string());
        let mut f = fs::File::create(&tmp)?;
        if let Err(e) = f.write_all(data) {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        Ok((tmp, block_crcs(data)))
    }

    pub fn commit(&self, staged: &Path, key: &PageKey) -> io::Result<()> {
        let dest = self.path(key);
        if let Some(parent) = dest.parent() {
            mkdir_private(parent)?;
        }
        fs::rename(staged, dest)
    }

    /// Stage + commit: the page appears whole or not at all.
    pub fn write(&self, key: &PageKey, data: &[u8]) -> io::Result<Vec<u32>> {
        let (tmp, crcs) = self.stage(data)?;
        if let Err(e) = self.commit(&tmp, key) {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(crcs)
    }

    /// Reads `range` (page-relative) of a page of `len` bytes, verifying
    /// every block it touches against `crcs`.
    pub fn read(
        &self,
        key: &PageKey,
        len: u64,
        crcs: &[u32],
        range: Range<u64>,
    ) -> Result<Bytes, PageReadError> {
        if range.end > len || range.start > range.end {
            return Err(PageReadError::Corrupt { block: 0 });
        }
        let first = (range.start / CHECK_BLOCK) as usize;
        let last = (range.end.div_ceil(CHECK_BLOCK) as usize).max(first + 1);
        let start = first as u64 * CHECK_BLOCK;
        let end = (last as u64 * CHECK_BLOCK).min(len);
        let file = match fs::File::open(self.path(key)) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(PageReadError::Missing),
            Err(e) => return Err(e.into()),
        };
        let mut buf = BytesMut::zeroed((end - start) as usize);
        if let Err(e) = file.read_exact_at(&mut buf, start) {
            return Err(if e.kind() == io::ErrorKind::UnexpectedEof {
                PageReadError::Corrupt { block: first }
            } else {
                e.into()
            });
        }
        for (i, chunk) in buf.chunks(CHECK_BLOCK as usize).enumerate() {
            let block = first + i;
            if crcs.get(block) != Some(&crc32c::crc32c(chunk)) {
                return Err(PageReadError::Corrupt { block });
            }
        }
        let buf = buf.freeze();
        Ok(buf.slice((range.start - start) as usize..(range.end - start) as usize))
    }

    pub fn remove(&self, key: &PageKey) {
        if let Err(e) = fs::remove_file(self.path(key)) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(page = %key.hex(), error = %e, "removing page file failed");
            }
        }
    }

    pub fn discard_staged(&self, staged: &Path) {
        let _ = fs::remove_file(staged);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_keys_are_stable_and_distinct() {
        let a = PageKey::new("s3://b/k", "e1", 0);
        assert_eq!(a, PageKey::new("s3://b/k", "e1", 0));
        assert_ne!(a, PageKey::new("s3://b/k", "e2", 0));
        assert_ne!(a, PageKey::new("s3://b/k", "e1", 1));
        // Length prefixes keep ("ab","c") and ("a","bc") apart.
        assert_ne!(PageKey::new("ab", "c", 0), PageKey::new("a", "bc", 0));
        // Pinned value: placement of files must not change across builds.
        assert_eq!(
            &PageKey::new("s3://bucket/key", "etag", 7).hex()[..16],
            &PAGE_KEY_PIN[..16]
        );
    }

    const PAGE_KEY_PIN: &str = include_str!("../testdata/page_key_pin.txt");

    #[test]
    fn reads_verify_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let store = PageStore::open(dir.path()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(dir.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "cache dir must be private");
        let key = PageKey::new("s3://b/k", "e", 0);
        let data: Vec<u8> = (0..(CHECK_BLOCK * 2 + 100))
            .map(|i| (i % 251) as u8)
            .collect();
        let crcs = store.write(&key, &data).unwrap();
        assert_eq!(crcs.len(), 3);
        let got = store
            .read(&key, data.len() as u64, &crcs, 10..CHECK_BLOCK + 5)
            .unwrap();
        assert_eq!(&got[..], &data[10..CHECK_BLOCK as usize + 5]);
        // Flip one byte in the second block.
        let path = store.path(&key);
        let mut raw = fs::read(&path).unwrap();
        raw[CHECK_BLOCK as usize + 1] ^= 0xff;
        fs::write(&path, raw).unwrap();
        assert!(store.read(&key, data.len() as u64, &crcs, 0..10).is_ok());
        assert!(matches!(
            store.read(&key, data.len() as u64, &crcs, 0..CHECK_BLOCK + 2),
            Err(PageReadError::Corrupt { block: 1 })
        ));
        store.remove(&key);
        assert!(matches!(
            store.read(&key, data.len() as u64, &crcs, 0..1),
            Err(PageReadError::Missing)
        ));
    }
}
