//! Typed filesystem errors; the kernel adapter turns each into an errno.

use lakecache_protocol::{ClientError, ErrorCode};
use lakecache_registry::ClusterError;
use lakecache_worker::store::StoreError;

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
    #[error("the upload failed: {0}")]
    UploadFailed(String),
    #[error("cache cluster error: {0}")]
    Cluster(String),
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
            FsError::UploadFailed(_) | FsError::Cluster(_) => libc::EIO,
        }
    }
}

impl From<ClusterError> for FsError {
    fn from(e: ClusterError) -> Self {
        match &e {
            ClusterError::Worker(ClientError::Api { code, .. }) => match code {
                ErrorCode::NotFound => FsError::NotFound,
                ErrorCode::PreconditionFailed => FsError::Stale,
                ErrorCode::CopyTooLarge => {
                    FsError::CrossDevice("object larger than a server-side copy allows")
                }
                _ => FsError::Cluster(e.to_string()),
            },
            ClusterError::S3(StoreError::NotFound) => FsError::NotFound,
            ClusterError::S3(StoreError::PreconditionFailed) => FsError::Stale,
            ClusterError::Changed { .. } => FsError::Stale,
            _ => FsError::Cluster(e.to_string()),
        }
    }
}
