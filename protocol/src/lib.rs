//! The lakecache worker's HTTP API: wire types, object URIs and a client.
//!
//! Every layer above the worker (CLI, cluster client, FUSE) speaks to it
//! through this crate, so the validation rules live here once.

pub mod buffer_pool;
mod buffered;
mod chain;
mod client;
pub mod direct_io;
mod load;
pub mod local_read;
pub mod member_sig;
pub mod memory;
mod plan;
#[doc(hidden)]
pub mod snapshot;
pub mod testing;
pub mod tier_socket;
pub mod tls;
pub mod token;
pub mod trace_context;
mod types;
pub mod unix_server;
mod uri;
mod user_meta;
mod writeback;

pub use chain::Chain;
pub use client::{
    BoxError, ClientError, Deadlines, ReadKind, RequestBody, WorkerClient, CACHE_HEADER,
    COPY_SOURCE_HEADER, FROM_HEADER, OFFSET_HEADER, READ_AHEAD_HEADER,
};
pub use load::{
    validate_load_id, FreeResult, FreeSpec, LoadFailure, LoadProgress, LoadSpec, LoadState,
    MAX_LOAD_FAILURES_KEPT, MAX_LOAD_REPLICAS,
};
pub use plan::{
    validate_plan_name, PlanResult, PlanSpec, PlanSpecEntry, MAX_PLAN_BYTES, MAX_PLAN_ENTRIES,
    MAX_PLAN_TTL_SECONDS, PLAN_FORMAT, PLAN_VERSION,
};
pub use types::{
    BucketTraffic, ErrorBody, ErrorCode, ErrorDetail, Health, ListEntry, ListResponse, ObjectStat,
    ObjectVersion, TenantUsage, WorkerDeadlines, WriteOutcome,
};
pub use uri::{validate_bucket, validate_key, InvalidUri, ObjectUri, MAX_KEY_BYTES};
pub use user_meta::{
    user_meta_from_headers, validate_user_meta, with_user_meta, InvalidUserMeta, UserMeta,
    MAX_USER_META_BYTES, METADATA_DIRECTIVE_HEADER, META_HEADER_PREFIX,
};
pub use writeback::{
    header_lists, is_cache_version, parse_written_stamp, written_stamp, EntryState, UriWrite,
    WriteBackEntry, WriteBackStatus, WriteMode, BODY_CRC32C_TRAILER, CACHE_VERSION_PREFIX,
    CONFIRM_HEADER, KEEPALIVE_HEADER, LENGTH_HEADER, REPLICA_OF_HEADER, SENT_AT_HEADER,
    VERSION_HEADER, WRITE_MODE_HEADER, WRITTEN_STAMP_META,
};
