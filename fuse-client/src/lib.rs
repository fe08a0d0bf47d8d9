//! lakecache's FUSE client: an S3 prefix as a POSIX directory tree, read
//! through the cache cluster and written back through its workers.
//!
//! [`fs::Fs`] holds the filesystem logic and is driven directly by tests;
//! [`adapter::KernelAdapter`] maps kernel requests onto it.

pub mod adapter;
pub mod complete;
pub mod config;
pub mod data_plane;
pub mod dir;
pub mod error;
pub mod fs;
pub mod inode;
pub mod kernel_cache;
pub mod local_tier;
pub mod memory;
pub mod metrics;
pub mod mount;
mod passthrough;
pub mod plan_ranges;
pub mod posix;
pub mod read;
pub mod resend;
mod staged;
pub mod tier_clients;
pub mod tier_plans;
pub mod unmount_guard;
pub mod write;

pub use config::FsConfig;
pub use data_plane::{DataError, DataPlane};
pub use error::{Chain, FsError};
pub use fs::{Creator, DirEntry, Fs, SetAttr};
pub use inode::{Inode, Kind, ROOT_INO};
pub use mount::{mount, MountError, MountOptions, Mounted};
