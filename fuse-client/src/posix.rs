//! POSIX attributes stored with each object as S3 user metadata, so any
//! S3 client still sees a plain object and the mount sees a file.
//!
//! The format (names as `x-amz-meta-<name>`, values ASCII):
//! - `mode`: the whole `st_mode` (type and permission bits), decimal, as
//!   s3fs writes it; `uid`, `gid`, `rdev`: decimal.
//! - `mtime`, `atime`, `ctime`: seconds since the epoch, optionally with
//!   a fraction of up to 9 digits (`1700000000.123456789`); s3fs's whole
//!   seconds read the same.
//!
//! A symbolic link is an object whose mode has `S_IFLNK`; its body is
//! the target. FIFOs, sockets and device nodes are empty objects whose
//! mode (and `rdev`) say what they are. An object without these entries
//! gets the mount's defaults and S3's Last-Modified as its times.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lakecache_protocol::UserMeta;

use crate::inode::Kind;

pub const MODE: &str = "mode";
pub const UID: &str = "uid";
pub const GID: &str = "gid";
pub const RDEV: &str = "rdev";
pub const ATIME: &str = "atime";
pub const MTIME: &str = "mtime";
pub const CTIME: &str = "ctime";

const TYPE_MASK: u32 = libc::S_IFMT;
const PERM_MASK: u32 = 0o7777;

/// What an object is to the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    Regular,
    Directory,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl FileType {
    pub fn from_mode(mode: u32) -> Option<Self> {
        Some(match mode & TYPE_MASK {
            libc::S_IFREG => FileType::Regular,
            libc::S_IFDIR => FileType::Directory,
            libc::S_IFLNK => FileType::Symlink,
            libc::S_IFIFO => FileType::Fifo,
            libc::S_IFSOCK => FileType::Socket,
            libc::S_IFCHR => FileType::CharDevice,
            libc::S_IFBLK => FileType::BlockDevice,
            _ => return None,
        })
    }

    pub fn type_bits(self) -> u32 {
        match self {
            FileType::Regular => libc::S_IFREG,
            FileType::Directory => libc::S_IFDIR,
            FileType::Symlink => libc::S_IFLNK,
            FileType::Fifo => libc::S_IFIFO,
            FileType::Socket => libc::S_IFSOCK,
            FileType::CharDevice => libc::S_IFCHR,
            FileType::BlockDevice => libc::S_IFBLK,
        }
    }
}

/// Owner and permissions of objects that carry none.
#[derive(Debug, Clone, Copy)]
pub struct Defaults {
    pub uid: u32,
    pub gid: u32,
    pub file_mode: u16,
    pub dir_mode: u16,
}

/// The attributes of one object, as `stat` shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attrs {
    pub kind: FileType,
    /// Permission bits with set-id and sticky bits (no type bits).
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub atime: SystemTime,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
}

impl Attrs {
    pub fn mode(&self) -> u32 {
        self.kind.type_bits() | self.perm
    }
}

/// Attributes of an object of S3 shape `kind` with user metadata `user`;
/// `s3_mtime_ms` stands in for missing times. A file object cannot
/// become a directory, nor a directory anything else: the S3 shape wins.
pub fn decode(user: &UserMeta, kind: Kind, s3_mtime_ms: i64, defaults: &Defaults) -> Attrs {
    let stored_mode = user.get(MODE).and_then(|m| m.trim().parse::<u32>().ok());
    let kind_from_mode = stored_mode.and_then(FileType::from_mode);
    let file_type = match kind {
        Kind::Dir => FileType::Directory,
        Kind::File => match kind_from_mode {
            Some(FileType::Directory) | None => FileType::Regular,
            Some(t) => t,
        },
    };
    let perm = match (stored_mode, kind) {
        (Some(m), _) => m & PERM_MASK,
        (None, Kind::Dir) => u32::from(defaults.dir_mode) & PERM_MASK,
        (None, Kind::File) => u32::from(defaults.file_mode) & PERM_MASK,
    };
    let number = |name: &str| user.get(name).and_then(|v| v.trim().parse::<u32>().ok());
    let s3_time = UNIX_EPOCH + Duration::from_millis(s3_mtime_ms.max(0) as u64);
    let mtime = user
        .get(MTIME)
        .and_then(|v| parse_time(v))
        .unwrap_or(s3_time);
    Attrs {
        kind: file_type,
        perm,
        uid: number(UID).unwrap_or(defaults.uid),
        gid: number(GID).unwrap_or(defaults.gid),
        rdev: number(RDEV).unwrap_or(0),
        atime: user.get(ATIME).and_then(|v| parse_time(v)).unwrap_or(mtime),
        mtime,
        ctime: user.get(CTIME).and_then(|v| parse_time(v)).unwrap_or(mtime),
    }
}

/// Writes `attrs` into `user`, keeping entries this module does not own.
pub fn encode(attrs: &Attrs, user: &mut UserMeta) {
    user.insert(MODE.into(), attrs.mode().to_string());
    user.insert(UID.into(), attrs.uid.to_string());
    user.insert(GID.into(), attrs.gid.to_string());
    user.insert(ATIME.into(), format_time(attrs.atime));
    user.insert(MTIME.into(), format_time(attrs.mtime));
    user.insert(CTIME.into(), format_time(attrs.ctime));
    if matches!(attrs.kind, FileType::CharDevice | FileType::BlockDevice) {
        user.insert(RDEV.into(), attrs.rdev.to_string());
    } else {
        user.remove(RDEV);
    }
}

/// `secs[.fraction]`; times before the epoch are refused (S3 objects
/// cannot predate it and s3fs never writes them).
pub fn parse_time(v: &str) -> Option<SystemTime> {
    let (secs, frac) = match v.trim().split_once('.') {
        Some((s, f)) => (s, f),
        None => (v.trim(), ""),
    };
    let secs: u64 = secs.parse().ok()?;
    if frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let nanos: u32 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<9}").parse().ok()?
    };
    UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
}

pub fn format_time(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    format!("{}.{:09}", d.as_secs(), d.subsec_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULTS: Defaults = Defaults {
        uid: 1000,
        gid: 1000,
        file_mode: 0o644,
        dir_mode: 0o755,
    };

    #[test]
    fn round_trip_keeps_every_field() {
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
        let attrs = Attrs {
            kind: FileType::CharDevice,
            perm: 0o4751,
            uid: 7,
            gid: 8,
            rdev: 0x0103,
            atime: t,
            mtime: t + Duration::from_secs(1),
            ctime: t + Duration::from_secs(2),
        };
        let mut user = UserMeta::from([("other".to_string(), "kept".to_string())]);
        encode(&attrs, &mut user);
        assert_eq!(user["other"], "kept");
        assert_eq!(user[MODE], (libc::S_IFCHR | 0o4751).to_string());
        assert_eq!(decode(&user, Kind::File, 0, &DEFAULTS), attrs);
        lakecache_protocol::validate_user_meta(&user).unwrap();
    }

    #[test]
    fn plain_objects_get_defaults_and_s3_shape_wins() {
        let plain = decode(&UserMeta::new(), Kind::File, 5_000, &DEFAULTS);
        assert_eq!(plain.kind, FileType::Regular);
        assert_eq!(plain.perm, 0o644);
        assert_eq!((plain.uid, plain.gid), (1000, 1000));
        assert_eq!(plain.mtime, UNIX_EPOCH + Duration::from_secs(5));
        // A file object claiming to be a directory stays a file.
        let odd = UserMeta::from([(MODE.to_string(), (libc::S_IFDIR | 0o700).to_string())]);
        let a = decode(&odd, Kind::File, 0, &DEFAULTS);
        assert_eq!((a.kind, a.perm), (FileType::Regular, 0o700));
        // s3fs's whole seconds, and garbage ignored.
        assert_eq!(
            parse_time("1700000000"),
            Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000))
        );
        assert_eq!(
            parse_time("1.5"),
            Some(UNIX_EPOCH + Duration::from_millis(1500))
        );
        assert_eq!(parse_time("-1"), None);
        assert_eq!(parse_time("1.1234567890"), None);
        assert_eq!(parse_time("x"), None);
    }
}
