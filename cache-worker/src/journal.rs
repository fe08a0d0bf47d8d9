//! The write-back journal: the objects a worker acknowledged in `back`
//! mode and must still upload. One append-only file per cache directory.
//! A record is synced before the write it records is acknowledged, so
//! whatever a client was told is durable is in the journal after a crash.
//!
//! Layout: a header (magic, format version, worker id, CRC32C), then
//! frames of `length u32 | crc32c u32 | JSON record`. On open the records
//! are replayed. A frame cut short or failing its CRC at the very end is
//! an append that never returned (its write was not acknowledged) and is
//! cut off; a bad frame with good ones after it is damage, and the worker
//! refuses to start rather than drop what the journal holds. A journal of
//! a newer format is refused, never rewritten.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The format this build writes and the newest it reads. Format 2 adds
/// replica entries, which a format-1 build would mistake for its own
/// uploads: such a build refuses a format-2 journal. A format-1 journal
/// is read and rewritten as format 2.
pub const JOURNAL_FORMAT: u32 = 2;
const MAGIC: &[u8; 8] = b"LCJRNL\0\0";
const FILE_NAME: &str = "writeback.journal";
/// Frames longer than this are damage, not records (a record names one
/// object and its part checksums).
const MAX_RECORD: u32 = 64 << 20;
/// Rewrite the file once this many bytes of finished records pile up.
const COMPACT_AFTER: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is damaged at byte {offset} ({why}); it is kept as it is: move it aside only once its pending uploads are known to be in S3")]
    Damaged {
        path: PathBuf,
        offset: u64,
        why: String,
    },
    #[error("{path} has journal format {found}; this build reads up to {JOURNAL_FORMAT}: run a newer lakecache")]
    NewerFormat { path: PathBuf, found: u32 },
    #[error("{path} belongs to worker {found:?}, not {expected:?}")]
    OtherWorker {
        path: PathBuf,
        found: String,
        expected: String,
    },
}

/// An acknowledged object waiting for its upload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingObject {
    /// Order of acknowledgement: S3 receives a prefix's objects in it.
    pub seq: u64,
    pub uri: String,
    /// The cache's version of the object until S3 gives it an ETag.
    pub version: String,
    pub size: u64,
    pub part_size: u64,
    /// CRC32C of each part as the client computed it.
    pub part_crcs: Vec<u32>,
    pub acked_ms: i64,
    /// Page size the object's dirty pages were written with (a restart
    /// with another `--page-size` still finds them).
    #[serde(default)]
    pub page_size: u64,
    /// A delete acknowledged after earlier pending writes of the same
    /// object: S3 gets it in order, after them.
    #[serde(default)]
    pub delete: bool,
    /// Set on a copy of another worker's write: that worker (the primary)
    /// uploads it; this copy is uploaded here only if the primary's
    /// journal is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_of: Option<ReplicaOf>,
    /// On a copy: its primary has not yet confirmed that its own journal
    /// holds the write, so the write may never have been acknowledged. A
    /// copy taken over from a lost primary is uploaded only if confirmed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unconfirmed: bool,
    /// On a primary's entry: the workers holding copies, told to drop
    /// them once S3 has the object.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
    /// User metadata the object gets in S3 (the mount's mode, owner,
    /// times).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub meta: lakecache_protocol::UserMeta,
    /// The tenant that wrote it: its quota counts the bytes until S3 has
    /// them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// The primary of a replica entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReplicaOf {
    /// The primary's journal identity when it sent the copy.
    pub journal_id: String,
    /// The primary's ring address.
    pub addr: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Record {
    Pending(Box<PendingObject>),
    Uploaded { seq: u64, etag: String },
}

pub struct Journal {
    path: PathBuf,
    file: File,
    worker_id: String,
    next_seq: u64,
    pending: BTreeMap<u64, PendingObject>,
    /// Bytes of records about finished uploads, reclaimed by compaction.
    finished_bytes: u64,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> JournalError + '_ {
    move |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn header(worker_id: &str) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&JOURNAL_FORMAT.to_le_bytes());
    out.extend_from_slice(&(worker_id.len() as u16).to_le_bytes());
    out.extend_from_slice(worker_id.as_bytes());
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn frame(record: &Record) -> Vec<u8> {
    let body = serde_json::to_vec(record).unwrap_or_default();
    let mut out = Vec::with_capacity(body.len() + 8);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

fn sync_dir(dir: &Path) -> Result<(), JournalError> {
    crate::crashsim::sync_dir(dir, || File::open(dir).and_then(|d| d.sync_all())).map_err(io(dir))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

impl Journal {
    /// Opens (or creates) the journal in `dir` and replays it.
    pub fn open(dir: &Path, worker_id: &str) -> Result<Self, JournalError> {
        let path = dir.join(FILE_NAME);
        if !path.exists() {
            Self::write_new(&path, worker_id, &[])?;
        }
        let mut raw = Vec::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut raw))
            .map_err(io(&path))?;
        let damaged = |offset: usize, why: &str| JournalError::Damaged {
            path: path.clone(),
            offset: offset as u64,
            why: why.into(),
        };
        if raw.get(..8) != Some(&MAGIC[..]) {
            return Err(damaged(0, "not a lakecache journal"));
        }
        let format = u32_at(&raw, 8).ok_or_else(|| damaged(8, "header cut short"))?;
        if format > JOURNAL_FORMAT {
            return Err(JournalError::NewerFormat {
                path,
                found: format,
            });
        }
        let id_len = raw
            .get(12..14)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
            .ok_or_else(|| damaged(12, "header cut short"))?;
        let header_end = 14 + id_len + 4;
        let crc = u32_at(&raw, 14 + id_len).ok_or_else(|| damaged(14, "header cut short"))?;
        if crc32c::crc32c(&raw[..14 + id_len]) != crc {
            return Err(damaged(0, "header checksum mismatch"));
        }
        let found = String::from_utf8_lossy(&raw[14..14 + id_len]).into_owned();
        if found != worker_id {
            return Err(JournalError::OtherWorker {
                path,
                found,
                expected: worker_id.into(),
            });
        }
        let mut journal = Self {
            file: OpenOptions::new()
                .append(true)
                .open(&path)
                .map_err(io(&path))?,
            path: path.clone(),
            worker_id: worker_id.into(),
            next_seq: 1,
            pending: BTreeMap::new(),
            finished_bytes: 0,
        };
        let mut at = header_end;
        while at < raw.len() {
            match Self::read_frame(&raw, at) {
                Ok((record, next)) => {
                    journal.apply(record, (next - at) as u64);
                    at = next;
                }
                Err(why) => {
                    if Self::later_frame_is_whole(&raw, at) {
                        return Err(damaged(at, &why));
                    }
                    // An append that never returned: nobody was told it
                    // was durable. Cut it off so new records follow good ones.
                    tracing::warn!(path = %path.display(), offset = at, why, "dropping an unfinished journal append");
                    journal.file.set_len(at as u64).map_err(io(&path))?;
                    journal.file.sync_all().map_err(io(&path))?;
                    break;
                }
            }
        }
        if format < JOURNAL_FORMAT {
            // Records of this format may follow: the header must say so.
            journal.compact()?;
        }
        crate::crashsim::existing(&journal.path);
        Ok(journal)
    }

    /// One frame at `at`: the record and where the next frame starts.
    fn read_frame(raw: &[u8], at: usize) -> Result<(Record, usize), String> {
        let len = u32_at(raw, at).ok_or("frame header cut short")?;
        let crc = u32_at(raw, at + 4).ok_or("frame header cut short")?;
        if len > MAX_RECORD {
            return Err(format!("frame length {len} is implausible"));
        }
        let body = raw
            .get(at + 8..at + 8 + len as usize)
            .ok_or("frame cut short")?;
        if crc32c::crc32c(body) != crc {
            return Err("frame checksum mismatch".into());
        }
        let record = serde_json::from_slice(body).map_err(|e| format!("bad record: {e}"))?;
        Ok((record, at + 8 + len as usize))
    }

    /// Whether any whole, checksummed frame starts after a bad one at
    /// `bad`: then the bad one is damage, not a torn last append.
    fn later_frame_is_whole(raw: &[u8], bad: usize) -> bool {
        (bad + 1..raw.len().saturating_sub(8)).any(|at| Self::read_frame(raw, at).is_ok())
    }

    fn apply(&mut self, record: Record, bytes: u64) {
        match record {
            Record::Pending(p) => {
                self.next_seq = self.next_seq.max(p.seq + 1);
                self.pending.insert(p.seq, *p);
            }
            Record::Uploaded { seq, .. } => {
                self.pending.remove(&seq);
                self.finished_bytes += bytes;
            }
        }
    }

    fn append(&mut self, record: &Record) -> Result<u64, JournalError> {
        let bytes = frame(record);
        crate::crashsim::alive(&self.path).map_err(io(&self.path))?;
        self.file.write_all(&bytes).map_err(io(&self.path))?;
        crate::crashsim::sync_file(&self.path, &self.file, || self.file.sync_data())
            .map_err(io(&self.path))?;
        Ok(bytes.len() as u64)
    }

    /// Records an acknowledged object; returns once the record is on
    /// disk. The object's `seq` is assigned here.
    pub fn add_pending(&mut self, mut object: PendingObject) -> Result<u64, JournalError> {
        let seq = self.next_seq;
        object.seq = seq;
        self.append(&Record::Pending(Box::new(object.clone())))?;
        self.next_seq += 1;
        self.pending.insert(seq, object);
        Ok(seq)
    }

    /// The copy `seq` is confirmed by its primary; returns once that is on
    /// disk (the entry is recorded again, confirmed).
    pub fn confirm(&mut self, seq: u64) -> Result<(), JournalError> {
        let Some(entry) = self.pending.get(&seq).filter(|p| p.unconfirmed) else {
            return Ok(());
        };
        let mut entry = entry.clone();
        entry.unconfirmed = false;
        self.append(&Record::Pending(Box::new(entry.clone())))?;
        self.pending.insert(seq, entry);
        Ok(())
    }

    /// S3 has the object under `etag`: it is no longer pending.
    pub fn mark_uploaded(&mut self, seq: u64, etag: &str) -> Result<(), JournalError> {
        if !self.pending.contains_key(&seq) {
            return Ok(());
        }
        let _site = crate::crashsim::site("upload: journal marks the object uploaded");
        let bytes = self.append(&Record::Uploaded {
            seq,
            etag: etag.into(),
        })?;
        self.pending.remove(&seq);
        self.finished_bytes += bytes;
        if self.finished_bytes > crate::crashsim::compact_after(&self.path, COMPACT_AFTER) {
            self.compact()?;
        }
        Ok(())
    }

    /// Pending objects in the order they were acknowledged.
    pub fn pending(&self) -> impl Iterator<Item = &PendingObject> {
        self.pending.values()
    }

    pub fn first_pending(&self) -> Option<&PendingObject> {
        self.pending.values().next()
    }

    pub fn is_pending(&self, seq: u64) -> bool {
        self.pending.contains_key(&seq)
    }

    pub fn pending_bytes(&self) -> u64 {
        self.pending.values().map(|p| p.size).sum()
    }

    /// Rewrites the file with only the pending records (a new file synced
    /// and renamed over the old, so a crash leaves one or the other).
    pub fn compact(&mut self) -> Result<(), JournalError> {
        let _site = crate::crashsim::site("journal compaction");
        let records: Vec<Record> = self
            .pending
            .values()
            .cloned()
            .map(|p| Record::Pending(Box::new(p)))
            .collect();
        Self::write_new(&self.path, &self.worker_id, &records)?;
        self.file = OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(io(&self.path))?;
        self.finished_bytes = 0;
        Ok(())
    }

    fn write_new(path: &Path, worker_id: &str, records: &[Record]) -> Result<(), JournalError> {
        let tmp = path.with_extension("journal.tmp");
        let mut out = header(worker_id);
        for r in records {
            out.extend_from_slice(&frame(r));
        }
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        crate::crashsim::created(&tmp).map_err(io(&tmp))?;
        f.write_all(&out).map_err(io(&tmp))?;
        crate::crashsim::sync_file(&tmp, &f, || f.sync_all()).map_err(io(&tmp))?;
        crate::crashsim::rename(&tmp, path, || std::fs::rename(&tmp, path)).map_err(io(path))?;
        sync_dir(path.parent().unwrap_or(Path::new(".")))
    }
}

#[cfg(test)]
mod tests;
