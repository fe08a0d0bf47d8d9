//! The cache directory as a whole: an exclusive lock taken before anything
//! in it is touched, and a `FORMAT` file recording the layout and page
//! size its pages were written with. A worker opened with other settings
//! discards the old pages (logged and counted) instead of serving them.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::pages::{mkdir_private, CHECK_BLOCK, PAGE_FORMAT};

const LOCK_FILE: &str = "lock";
const FORMAT_FILE: &str = "FORMAT";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Format {
    format: u32,
    page_size: u64,
    block_size: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CacheDirError {
    #[error("cache directory {dir} is in use by another worker{holder}")]
    InUse { dir: PathBuf, holder: String },
    #[error("cache directory {dir}: {source}")]
    Io {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Holds the directory's lock for as long as it lives.
#[derive(Debug)]
pub struct CacheDir {
    _lock: fs::File,
    /// Page files dropped at open because they were written under another
    /// format or page size.
    pub discarded_pages: u64,
}

impl CacheDir {
    pub fn open(dir: &Path, page_size: u64) -> Result<Self, CacheDirError> {
        let io_err = |source| CacheDirError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        mkdir_private(dir).map_err(io_err)?;
        {
            use std::os::unix::fs::PermissionsExt;
            // An existing directory may have been created with looser modes.
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io_err)?;
        }
        let lock = lock(dir)?;
        let want = Format {
            format: PAGE_FORMAT,
            page_size,
            block_size: CHECK_BLOCK,
        };
        let found = read_format(dir);
        let mut discarded_pages = 0;
        if found.as_ref() != Some(&want) {
            let pages = dir.join("pages");
            let index = dir.join("index");
            if pages.exists() || index.exists() {
                discarded_pages = count_files(&pages);
                tracing::warn!(
                    dir = %dir.display(),
                    found = ?found,
                    want = ?want,
                    pages = discarded_pages,
                    "cache was written with another format or page size; discarding its pages"
                );
                remove_if_present(&pages).map_err(io_err)?;
                remove_if_present(&index).map_err(io_err)?;
            }
            write_format(dir, &want).map_err(io_err)?;
        }
        Ok(Self {
            _lock: lock,
            discarded_pages,
        })
    }
}

fn lock(dir: &Path) -> Result<fs::File, CacheDirError> {
    let path = dir.join(LOCK_FILE);
    let io_err = |source| CacheDirError::Io {
        dir: dir.to_path_buf(),
        source,
    };
    let mut file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io_err)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => {
            let holder = fs::read_to_string(&path)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .map(|pid| format!(" (pid {pid})"))
                .unwrap_or_default();
            return Err(CacheDirError::InUse {
                dir: dir.to_path_buf(),
                holder,
            });
        }
        Err(fs::TryLockError::Error(e)) => return Err(io_err(e)),
    }
    file.set_len(0).map_err(io_err)?;
    writeln!(file, "{}", std::process::id()).map_err(io_err)?;
    Ok(file)
}

fn read_format(dir: &Path) -> Option<Format> {
    let raw = fs::read(dir.join(FORMAT_FILE)).ok()?;
    serde_json::from_slice(&raw).ok()
}

fn write_format(dir: &Path, format: &Format) -> io::Result<()> {
    let tmp = dir.join(".FORMAT.tmp");
    let mut f = fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec(format).map_err(io::Error::other)?)?;
    f.sync_all()?;
    fs::rename(&tmp, dir.join(FORMAT_FILE))?;
    fs::File::open(dir)?.sync_all()
}

fn count_files(dir: &Path) -> u64 {
    let Ok(shards) = fs::read_dir(dir) else {
        return 0;
    };
    shards
        .flatten()
        .map(|shard| fs::read_dir(shard.path()).map_or(0, |f| f.count() as u64))
        .sum()
}

fn remove_if_present(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_open_is_refused_while_the_first_lives() {
        let dir = tempfile::tempdir().unwrap();
        let first = CacheDir::open(dir.path(), 1 << 20).unwrap();
        let err = CacheDir::open(dir.path(), 1 << 20).unwrap_err();
        assert!(err.to_string().contains("in use"), "{err}");
        assert!(err.to_string().contains(&std::process::id().to_string()));
        drop(first);
        CacheDir::open(dir.path(), 1 << 20).unwrap();
    }

    #[test]
    fn another_page_size_discards_pages() {
        let dir = tempfile::tempdir().unwrap();
        drop(CacheDir::open(dir.path(), 1 << 20).unwrap());
        let shard = dir.path().join("pages").join("ab");
        fs::create_dir_all(&shard).unwrap();
        fs::write(shard.join("abcd"), b"x").unwrap();
        let same = CacheDir::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(same.discarded_pages, 0);
        drop(same);
        let other = CacheDir::open(dir.path(), 2 << 20).unwrap();
        assert_eq!(other.discarded_pages, 1);
        assert!(!dir.path().join("pages").exists());
    }
}
