//! Preload jobs: the client asks every worker to fetch the segments it
//! owns under a prefix, then polls each for progress.

use serde::{Deserialize, Serialize};

/// Failures kept per job with their reasons (the count goes on).
pub const MAX_LOAD_FAILURES_KEPT: usize = 20;

/// What to load: every object under `prefix` of `bucket` whose key
/// matches `include` (a glob over the key after the prefix; none: all).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSpec {
    pub bucket: String,
    pub prefix: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include: Option<String>,
    /// How many workers keep each segment: its owner and the next ones
    /// on the ring, which serve it when the owner is down (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
}

/// The most copies of a segment a load may ask for.
pub const MAX_LOAD_REPLICAS: u32 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LoadState {
    #[default]
    Running,
    Done,
    Cancelled,
    /// The listing itself failed; objects already loaded stay cached.
    Failed,
}

impl LoadState {
    pub fn is_finished(self) -> bool {
        self != LoadState::Running
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadFailure {
    pub key: String,
    pub reason: String,
}

/// One worker's share of a job. Bytes count only segments this worker
/// owns; `objects_listed` is the same on every worker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadProgress {
    pub id: String,
    pub spec: Option<LoadSpec>,
    pub state: LoadState,
    /// True once the whole prefix has been listed (totals are final).
    pub listing_done: bool,
    pub objects_listed: u64,
    pub bytes_owned: u64,
    /// Fetched from S3 by this job.
    pub bytes_fetched: u64,
    /// Already cached with the object's current ETag (skipped).
    pub bytes_cached: u64,
    pub bytes_failed: u64,
    pub objects_failed: u64,
    /// The first [`MAX_LOAD_FAILURES_KEPT`] failures.
    pub failures: Vec<LoadFailure>,
    pub elapsed_ms: u64,
    /// Why the job as a whole stopped early (state `failed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl LoadProgress {
    /// Owned bytes handled either way.
    pub fn bytes_done(&self) -> u64 {
        self.bytes_fetched + self.bytes_cached + self.bytes_failed
    }
}

/// A job id: 1 to 64 of `[A-Za-z0-9_-]`, chosen by the client so that
/// every worker knows the job by the same name.
pub fn validate_load_id(id: &str) -> Result<(), String> {
    if id.is_empty()
        || id.len() > 64
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(format!(
            "load job id {id:?} must be 1 to 64 characters of A-Z, a-z, 0-9, '-' and '_'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids_are_short_and_plain() {
        assert!(validate_load_id("job-1_A").is_ok());
        for bad in ["", "a/b", "a b", "ü", &"x".repeat(65)] {
            assert!(validate_load_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn progress_round_trips_and_states_say_when_they_end() {
        let p = LoadProgress {
            id: "j".into(),
            state: LoadState::Done,
            bytes_fetched: 3,
            bytes_cached: 4,
            ..Default::default()
        };
        let back: LoadProgress = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert_eq!(back.bytes_done(), 7);
        assert!(LoadState::Done.is_finished() && !LoadState::Running.is_finished());
    }
}

/// `POST /v1/free/{bucket}` body: evict the cached pages under a prefix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FreeSpec {
    #[serde(default)]
    pub prefix: String,
}

/// What one worker evicted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreeResult {
    pub pages: u64,
    pub bytes: u64,
}
