//! Publishing a rank's read order (a plan, issue #35) to the cluster: each
//! entry is cut at segment boundaries and sent to the segment's owner, so
//! every worker evicts by the part of the plan it serves. Every member
//! gets its share, an empty one included, which replaces what an earlier
//! epoch's plan left there.

use std::collections::HashMap;
use std::ops::Range;

use lakecache_protocol::{ObjectUri, PlanSpec, PlanSpecEntry, PLAN_FORMAT, PLAN_VERSION};

use crate::client::{ClusterClient, ClusterError};
use crate::ring::Ring;

/// What publishing a plan did, over the workers it went to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PlanPublished {
    pub workers: usize,
    /// Pages named, summed over the workers.
    pub pages: u64,
    pub skipped_entries: u64,
    /// The first few skipped entries the workers named, with why.
    pub skipped: Vec<String>,
}

/// Each member's share of a plan: every entry cut at segment boundaries,
/// each piece given to its segment's owner, in the plan's order. Every
/// member has a share, an empty one included; `Err` when the ring has no
/// owner for a piece (no members).
fn shares(
    ring: &Ring,
    entries: &[(ObjectUri, Range<u64>)],
    segment: u64,
) -> Result<HashMap<String, Vec<PlanSpecEntry>>, ()> {
    let segment = segment.max(1);
    let mut shares: HashMap<String, Vec<PlanSpecEntry>> = ring
        .members()
        .iter()
        .map(|m| (m.id.clone(), Vec::new()))
        .collect();
    for (uri, range) in entries {
        let key = uri.to_string();
        let mut share_of = |start: u64, end: u64| -> Result<(), ()> {
            let owner = ring.owner(&key, ring.segment_of(start)).ok_or(())?;
            if let Some(share) = shares.get_mut(&owner.id) {
                share.push(PlanSpecEntry {
                    bucket: uri.bucket().to_string(),
                    key: uri.key().to_string(),
                    start,
                    end,
                });
            }
            Ok(())
        };
        if range.start >= range.end {
            // Sent as it is: the worker refuses it, naming it.
            share_of(range.start, range.end)?;
            continue;
        }
        let mut at = range.start;
        while at < range.end {
            let end = range.end.min((at / segment + 1) * segment);
            share_of(at, end)?;
            at = end;
        }
    }
    Ok(shares)
}

impl ClusterClient {
    /// Publishes plan `name` (`job/rank`): `entries` in read order, live
    /// on each worker for `ttl_seconds` unless published again.
    pub async fn publish_plan(
        &self,
        name: &str,
        entries: &[(ObjectUri, Range<u64>)],
        ttl_seconds: u64,
    ) -> Result<PlanPublished, ClusterError> {
        let state = self.current();
        let shares = shares(&state.ring, entries, self.segment_size())
            .map_err(|()| ClusterError::NoWorkers(self.describe_membership()))?;
        let sends = shares.into_iter().map(|(id, entries)| {
            let client = state.clients.get(&id).cloned();
            let spec = PlanSpec {
                format: PLAN_FORMAT.into(),
                version: PLAN_VERSION,
                ttl_seconds,
                entries,
            };
            async move {
                let client =
                    client.ok_or_else(|| ClusterError::NoWorkers(format!("no client for {id}")))?;
                client
                    .publish_plan(name, &spec)
                    .await
                    .map_err(ClusterError::Worker)
            }
        });
        let mut published = PlanPublished::default();
        for answer in futures::future::join_all(sends).await {
            let answer = answer?;
            published.workers += 1;
            published.pages += answer.pages;
            published.skipped_entries += answer.skipped_entries;
            let room = 8usize.saturating_sub(published.skipped.len());
            published
                .skipped
                .extend(answer.skipped.into_iter().take(room));
        }
        Ok(published)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::{tests::members, RingOptions};

    #[test]
    fn each_piece_goes_to_its_segments_owner_in_order_and_every_member_gets_a_share() {
        let options = RingOptions {
            segment_size: 1 << 20,
            ..RingOptions::default()
        };
        let ring = Ring::new(&members(3), options);
        let uri = |k: &str| ObjectUri::new("data", k).unwrap();
        let entries = vec![
            (uri("a"), 0..(5 << 20) + 7),
            (uri("b"), 100..200),
            (uri("a"), (1 << 20) - 1..(1 << 20) + 1),
        ];
        let shares = shares(&ring, &entries, 1 << 20).unwrap();
        assert_eq!(shares.len(), 3, "every member has a share");
        // The pieces, written out: a cut at each MiB, b whole, and the
        // entry straddling a's first boundary in two.
        const M: u64 = 1 << 20;
        let mut pieces: Vec<(&str, u64, u64)> = (0..5).map(|i| ("a", i * M, (i + 1) * M)).collect();
        pieces.push(("a", 5 * M, 5 * M + 7));
        pieces.push(("b", 100, 200));
        pieces.push(("a", M - 1, M));
        pieces.push(("a", M, M + 1));
        let mut expected: HashMap<String, Vec<(String, u64, u64)>> = HashMap::new();
        for (key, start, end) in pieces {
            let owner = ring.owner(&format!("s3://data/{key}"), start / M).unwrap();
            expected
                .entry(owner.id.clone())
                .or_default()
                .push((key.to_string(), start, end));
        }
        for (id, share) in &shares {
            let got: Vec<(String, u64, u64)> = share
                .iter()
                .map(|e| (e.key.clone(), e.start, e.end))
                .collect();
            assert_eq!(&got, expected.get(id).unwrap_or(&Vec::new()), "{id}");
        }
        // Nothing to own: an error, not a lost plan.
        let empty = Ring::new(&[], RingOptions::default());
        assert!(shares_of_empty(&empty).is_err());
    }

    fn shares_of_empty(ring: &Ring) -> Result<HashMap<String, Vec<PlanSpecEntry>>, ()> {
        shares(
            ring,
            &[(ObjectUri::new("data", "x").unwrap(), 0..1)],
            1 << 20,
        )
    }
}
