//! Damage to the tier behind the mount's back (a flipped byte, a
//! truncated or deleted file, a full disk): reads stay right because the
//! bytes are fetched again, and each kind is counted and named in the log
//! once (later occurrences at debug level, so a full disk cannot flood it).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::TierError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Damage {
    /// A block that does not match its CRC.
    Corrupt,
    /// A data file shorter than its object.
    Truncated,
    /// A data file or the tier directory gone.
    Missing,
    /// The tier's filesystem is full.
    NoSpace,
    /// Any other I/O error.
    Io,
}

pub const ALL: [Damage; 5] = [
    Damage::Corrupt,
    Damage::Truncated,
    Damage::Missing,
    Damage::NoSpace,
    Damage::Io,
];

static COUNTS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];
static LOGGED: [AtomicBool; 5] = [const { AtomicBool::new(false) }; 5];

impl Damage {
    pub fn name(self) -> &'static str {
        match self {
            Damage::Corrupt => "corrupt",
            Damage::Truncated => "truncated",
            Damage::Missing => "missing",
            Damage::NoSpace => "no_space",
            Damage::Io => "io",
        }
    }

    fn index(self) -> usize {
        ALL.iter().position(|d| *d == self).unwrap_or(0)
    }

    /// What kind of damage an error of the tier's files shows.
    pub fn of(error: &TierError) -> Self {
        match error {
            TierError::Io { source, .. } => Self::of_io(source),
            _ => Damage::Io,
        }
    }

    pub fn of_io(error: &std::io::Error) -> Self {
        match (error.kind(), error.raw_os_error()) {
            (std::io::ErrorKind::UnexpectedEof, _) => Damage::Truncated,
            (std::io::ErrorKind::NotFound, _) => Damage::Missing,
            (_, Some(libc::ENOSPC | libc::EDQUOT)) => Damage::NoSpace,
            _ => Damage::Io,
        }
    }

    /// How often this kind was met by this process.
    pub fn count(self) -> u64 {
        COUNTS[self.index()].load(Ordering::Relaxed)
    }

    /// Counts one occurrence and names the first in the log; `what` says
    /// what the mount does about it.
    pub fn note(self, object: &str, detail: &dyn std::fmt::Display, what: &str) {
        let i = self.index();
        COUNTS[i].fetch_add(1, Ordering::Relaxed);
        if LOGGED[i].swap(true, Ordering::Relaxed) {
            tracing::debug!(damage = %self.name(), object, %detail, what, "local tier damaged");
        } else {
            tracing::warn!(damage = %self.name(), object, %detail, what,
                "local tier damaged behind the mount's back (further cases of this kind are counted in lakecache_fuse_local_tier_damage_total, logged at debug)");
        }
    }
}
