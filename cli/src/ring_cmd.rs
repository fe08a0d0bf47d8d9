//! `lakecache ring`: prints who owns which keys, for checking that every
//! machine computes the same placement.

use anyhow::Result;
use clap::Args;
use lakecache_registry::{Member, Ring, RingOptions};

use crate::units::ByteSize;

#[derive(Args)]
pub struct RingCmd {
    /// Worker ids, comma separated
    #[arg(long, value_delimiter = ',', required = true)]
    members: Vec<String>,
    /// How many keys (s3://lake/key-N, segment 0) to place
    #[arg(long, default_value_t = 10)]
    keys: u64,
    /// Virtual nodes per worker [default: 512]
    #[arg(long)]
    vnodes: Option<u32>,
    /// Segment size [default: 64MiB]
    #[arg(long)]
    segment_size: Option<ByteSize>,
}

impl RingCmd {
    pub async fn run(self) -> Result<()> {
        let members: Vec<Member> = self
            .members
            .iter()
            .map(|id| Member {
                id: id.clone(),
                address: id.clone(),
                capacity: 0,
            })
            .collect();
        let ring = Ring::new(
            &members,
            RingOptions {
                vnodes: self.vnodes.unwrap_or(lakecache_registry::DEFAULT_VNODES),
                segment_size: self
                    .segment_size
                    .map_or(lakecache_registry::DEFAULT_SEGMENT_SIZE, |s| s.0),
                ..RingOptions::default()
            },
        );
        let mut out = String::new();
        for k in 0..self.keys {
            let uri = format!("s3://lake/key-{k}");
            if let Some(owner) = ring.owner(&uri, 0) {
                out.push_str(&owner.id);
                out.push('\n');
            }
        }
        print!("{out}");
        Ok(())
    }
}
