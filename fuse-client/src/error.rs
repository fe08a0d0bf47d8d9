//! Typed filesystem errors; the kernel adapter turns each into an errno.

pub use lakecache_protocol::Chain;

use crate::data_plane::DataError;

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("already exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("invalid name: {0}")]
    InvalidName(String),
    #[error("name too long")]
    NameTooLong,
    #[error("stale inode or file handle")]
    BadHandle,
    #[error("busy: {0}")]
    Busy(&'static str),
    /// Writes must be sequential from offset 0.
    #[error("write at offset {offset}, but the next sequential offset is {expected}")]
    OutOfOrderWrite { offset: u64, expected: u64 },
    /// What S3 cannot express: in-place edits, permissions, links.
    #[error("not permitted: {0}")]
    NotPermitted(&'static str),
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// Rename cannot be done server-side (large object, non-empty directory);
    /// `mv` answers this by copying.
    #[error("cannot rename in place: {0}")]
    CrossDevice(&'static str),
    #[error("the object changed while it was open")]
    Stale,
    /// The mount's token does not allow this.
    #[error("{0}")]
    AccessDenied(String),
    #[error("the upload failed")]
    UploadFailed(#[source] DataError),
    #[error("cache cluster error")]
    DataPlane(#[source] DataError),
    /// A background task of the mount died (a bug, or shutdown).
    #[error("internal task failed")]
    Task(#[source] tokio::task::JoinError),
}

impl FsError {
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::Exists => libc::EEXIST,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::NotEmpty => libc::ENOTEMPTY,
            FsError::InvalidName(_) => libc::EINVAL,
            FsError::NameTooLong => libc::ENAMETOOLONG,
            FsError::BadHandle => libc::EBADF,
            FsError::Busy(_) => libc::EBUSY,
            FsError::OutOfOrderWrite { .. } => libc::EINVAL,
            FsError::NotPermitted(_) => libc::EPERM,
            FsError::Unsupported(_) => libc::EOPNOTSUPP,
            FsError::CrossDevice(_) => libc::EXDEV,
            FsError::Stale => libc::ESTALE,
            FsError::AccessDenied(_) => libc::EACCES,
            FsError::UploadFailed(DataError::Denied(_))
            | FsError::DataPlane(DataError::Denied(_)) => libc::EACCES,
            FsError::UploadFailed(_) | FsError::DataPlane(_) | FsError::Task(_) => libc::EIO,
        }
    }
}

impl From<DataError> for FsError {
    fn from(e: DataError) -> Self {
        match e {
            DataError::NotFound => FsError::NotFound,
            DataError::Changed { .. } => FsError::Stale,
            DataError::Denied(why) => FsError::AccessDenied(why),
            DataError::CopyTooLarge => {
                FsError::CrossDevice("object larger than a server-side copy allows")
            }
            other => FsError::DataPlane(other),
        }
    }
}
