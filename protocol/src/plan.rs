//! The plan format (issue #35): one rank's read order for the coming
//! epoch, published by a training job to the workers so that they evict
//! by it. `PUT /v1/plans/{job}/{rank}` with a JSON [`PlanSpec`]:
//!
//! ```json
//! {"format": "lakecache-plan", "version": 1, "ttl_seconds": 900,
//!  "entries": [{"bucket": "data", "key": "train/000.npz", "start": 0, "end": 1048576}]}
//! ```
//!
//! Entries are byte ranges (`start` inclusive, `end` exclusive) in read
//! order; one may repeat exactly (a sampler with replacement), but two
//! ranges of one object may not partly overlap. A plan lives for
//! `ttl_seconds` unless published again.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::uri::ObjectUri;

pub const PLAN_FORMAT: &str = "lakecache-plan";
pub const PLAN_VERSION: u32 = 1;
/// Entries a plan may hold at most.
pub const MAX_PLAN_ENTRIES: usize = 1 << 20;
/// The longest a plan lives without being published again.
pub const MAX_PLAN_TTL_SECONDS: u64 = 24 * 3600;
/// A plan body's bytes at most (about 100 bytes per entry).
pub const MAX_PLAN_BYTES: usize = 128 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanSpec {
    pub format: String,
    pub version: u32,
    pub ttl_seconds: u64,
    pub entries: Vec<PlanSpecEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanSpecEntry {
    pub bucket: String,
    pub key: String,
    pub start: u64,
    pub end: u64,
}

/// A worker's answer to a published plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanResult {
    /// Pages of this worker's cache the plan names.
    pub pages: u64,
    /// Entries naming objects that could not be found (skipped).
    pub skipped_entries: u64,
    /// The first few of those, with why.
    pub skipped: Vec<String>,
}

impl PlanSpec {
    /// The entries as object URIs and ranges, in order, once the format,
    /// version, TTL, size and every range are checked.
    pub fn checked(&self) -> Result<Vec<(ObjectUri, std::ops::Range<u64>)>, String> {
        if self.format != PLAN_FORMAT {
            return Err(format!(
                "format is {:?}; a plan's format is {PLAN_FORMAT:?}",
                self.format
            ));
        }
        if self.version != PLAN_VERSION {
            return Err(format!(
                "plan version {} is not supported; this worker reads version {PLAN_VERSION}",
                self.version
            ));
        }
        if self.ttl_seconds == 0 || self.ttl_seconds > MAX_PLAN_TTL_SECONDS {
            return Err(format!(
                "ttl_seconds is {}; it must be 1 to {MAX_PLAN_TTL_SECONDS}",
                self.ttl_seconds
            ));
        }
        if self.entries.len() > MAX_PLAN_ENTRIES {
            return Err(format!(
                "the plan has {} entries; the limit is {MAX_PLAN_ENTRIES}",
                self.entries.len()
            ));
        }
        let mut out = Vec::with_capacity(self.entries.len());
        // Each object's ranges: (start, end, entry index).
        type Ranges = Vec<(u64, u64, usize)>;
        let mut by_object: HashMap<(&str, &str), Ranges> = HashMap::new();
        for (i, e) in self.entries.iter().enumerate() {
            let uri = ObjectUri::new(e.bucket.clone(), e.key.clone())
                .map_err(|err| format!("entry {i}: {err}"))?;
            if e.start >= e.end {
                return Err(format!(
                    "entry {i} ({uri}): the range {}..{} is empty or reversed; start must be below end",
                    e.start, e.end
                ));
            }
            by_object
                .entry((&e.bucket, &e.key))
                .or_default()
                .push((e.start, e.end, i));
            out.push((uri, e.start..e.end));
        }
        for ((bucket, key), mut ranges) in by_object {
            ranges.sort_unstable();
            for pair in ranges.windows(2) {
                let ((s0, e0, i0), (s1, e1, i1)) = (pair[0], pair[1]);
                if s1 < e0 && (s0, e0) != (s1, e1) {
                    return Err(format!(
                        "entries {i0} and {i1} of s3://{bucket}/{key} overlap ({s0}..{e0} and {s1}..{e1}); \
                         ranges of one object may repeat exactly but not overlap"
                    ));
                }
            }
        }
        Ok(out)
    }
}

/// A plan's name, `{job}/{rank}`: a job id of 1 to 64 characters of
/// A-Z, a-z, 0-9, '-' and '_', and a rank below 2^20.
pub fn validate_plan_name(name: &str) -> Result<(), String> {
    let bad = || {
        format!(
            "plan name {name:?} must be JOB/RANK: a job id of 1 to 64 characters of A-Z, a-z, 0-9, '-' and '_', and a rank number below {}",
            1 << 20
        )
    };
    let (job, rank) = name.split_once('/').ok_or_else(bad)?;
    crate::load::validate_load_id(job).map_err(|_| bad())?;
    match rank.parse::<u32>() {
        Ok(r)
            if r < 1 << 20 && !rank.starts_with('+') && (rank == "0" || !rank.starts_with('0')) =>
        {
            Ok(())
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, start: u64, end: u64) -> PlanSpecEntry {
        PlanSpecEntry {
            bucket: "data".into(),
            key: key.into(),
            start,
            end,
        }
    }

    fn spec(entries: Vec<PlanSpecEntry>) -> PlanSpec {
        PlanSpec {
            format: PLAN_FORMAT.into(),
            version: PLAN_VERSION,
            ttl_seconds: 60,
            entries,
        }
    }

    #[test]
    fn a_plan_in_order_with_exact_repeats_is_accepted() {
        let p = spec(vec![
            entry("a", 0, 10),
            entry("b", 5, 9),
            entry("a", 0, 10),
            entry("a", 10, 20),
        ]);
        let got = p.checked().unwrap();
        assert_eq!(got.len(), 4);
        assert_eq!(got[1].0.to_string(), "s3://data/b");
        assert_eq!(got[1].1, 5..9);
    }

    #[test]
    fn each_malformed_plan_is_refused_naming_the_problem_and_the_limit() {
        let mut p = spec(vec![entry("a", 0, 10)]);
        p.format = "csv".into();
        assert!(p.checked().unwrap_err().contains("\"lakecache-plan\""));
        let mut p = spec(vec![entry("a", 0, 10)]);
        p.version = 2;
        assert!(p
            .checked()
            .unwrap_err()
            .contains("version 2 is not supported"));
        let mut p = spec(vec![entry("a", 0, 10)]);
        p.ttl_seconds = 0;
        assert!(p.checked().unwrap_err().contains("1 to 86400"));
        let p = spec(vec![entry("a", 10, 10)]);
        assert!(p.checked().unwrap_err().contains("empty or reversed"));
        let p = spec(vec![entry("a", 0, 10), entry("a", 5, 15)]);
        let e = p.checked().unwrap_err();
        assert!(
            e.contains("entries 0 and 1") && e.contains("overlap"),
            "{e}"
        );
        let p = spec(vec![entry("../x", 0, 10)]);
        assert!(p.checked().unwrap_err().starts_with("entry 0:"));
        let p = spec(vec![entry("a", 0, 1); MAX_PLAN_ENTRIES + 1]);
        assert!(p.checked().unwrap_err().contains("the limit is 1048576"));
        // Negative numbers and unknown fields fail at parsing, by name.
        let e = serde_json::from_str::<PlanSpec>(
            r#"{"format":"lakecache-plan","version":1,"ttl_seconds":9,"entries":[{"bucket":"d","key":"k","start":-1,"end":4}]}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("invalid value: integer `-1`"), "{e}");
        let e = serde_json::from_str::<PlanSpec>(
            r#"{"format":"lakecache-plan","version":1,"ttl_seconds":9,"entries":[],"order":"x"}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("unknown field `order`"), "{e}");
    }

    #[test]
    fn plan_names_are_job_and_rank() {
        assert!(validate_plan_name("train-1/0").is_ok());
        assert!(validate_plan_name("train_1/1023").is_ok());
        for bad in [
            "",
            "job",
            "job/",
            "/0",
            "job/01",
            "job/-1",
            "job/+1",
            "job/1/2",
            "j b/0",
            "job/1048576",
        ] {
            assert!(validate_plan_name(bad).is_err(), "{bad:?}");
        }
    }
}
