//! Who is in the cluster and who owns what.
//!
//! - [`membership`]: the [`Membership`] trait with a static list, a
//!   reloaded members file and etcd (leases + watch) behind it.
//! - [`ring`]: a consistent-hash ring (the `hashring` crate) over
//!   virtual nodes, hashed with XXH3-64 over explicit bytes so every
//!   client and worker on any build computes the same owner.
//! - [`client`]: the cluster client: routes each segment of a read to its
//!   owner, fails over to replicas and finally to S3.

pub mod client;
pub mod etcd_access;
pub mod membership;
mod plan;
pub mod registry_url;
pub mod ring;
pub mod ring_settings;
pub mod stable_hash;
mod taken_elsewhere;

pub use client::{ClusterClient, ClusterError, ClusterOptions};
pub use etcd_access::EtcdAccess;
pub use membership::{EtcdMembership, EtcdRegistration, Member, Membership, StaticMembership};
pub use plan::PlanPublished;
pub use registry_url::RegistryUrl;
pub use ring::{Ring, RingOptions, DEFAULT_SEGMENT_SIZE, DEFAULT_VNODES};
pub use ring_settings::{advertised_ring_settings, claim_ring_settings, RingSettings};
