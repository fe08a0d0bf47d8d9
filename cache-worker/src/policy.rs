//! Per-prefix cache policies from the worker config: pin (never evicted),
//! TTL (evicted that long after the page was fetched), skip-cache
//! (served from S3, never stored) and max-age (metadata revalidated after
//! this age instead of the worker-wide metadata TTL). The longest
//! matching prefix decides; one policy applies per object.

use std::time::Duration;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixPolicy {
    /// `s3://bucket/` or `s3://bucket/some/prefix`.
    pub prefix: String,
    pub pin: bool,
    pub ttl: Option<Duration>,
    pub skip_cache: bool,
    pub max_age: Option<Duration>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("policy prefix {0:?} must look like s3://bucket/ or s3://bucket/prefix")]
    Prefix(String),
    #[error("policy {prefix:?}: {why}")]
    Conflict { prefix: String, why: &'static str },
    #[error("two policies name the same prefix {0:?}")]
    Duplicate(String),
    #[error("policy {0:?} sets nothing (pin, ttl, skip_cache or max_age)")]
    Empty(String),
}

/// Checked policies, longest prefix first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policies(Vec<PrefixPolicy>);

impl Policies {
    pub fn new(mut list: Vec<PrefixPolicy>) -> Result<Self, PolicyError> {
        for p in &list {
            let rest = p
                .prefix
                .strip_prefix("s3://")
                .ok_or_else(|| PolicyError::Prefix(p.prefix.clone()))?;
            let bucket = rest.split('/').next().unwrap_or("");
            if lakecache_protocol::validate_bucket(bucket).is_err()
                || !rest.contains('/')
                || p.prefix.chars().any(char::is_control)
            {
                return Err(PolicyError::Prefix(p.prefix.clone()));
            }
            let conflict = |why| PolicyError::Conflict {
                prefix: p.prefix.clone(),
                why,
            };
            if p.pin && p.skip_cache {
                return Err(conflict("pin keeps pages, skip_cache stores none"));
            }
            if p.pin && p.ttl.is_some() {
                return Err(conflict("pin never evicts, ttl evicts: pick one"));
            }
            if p.skip_cache && p.ttl.is_some() {
                return Err(conflict("skip_cache stores no pages for a ttl to evict"));
            }
            if p.ttl.is_some_and(|t| t.is_zero()) {
                return Err(conflict("ttl must be above 0 (use skip_cache)"));
            }
            if !p.pin && !p.skip_cache && p.ttl.is_none() && p.max_age.is_none() {
                return Err(PolicyError::Empty(p.prefix.clone()));
            }
        }
        list.sort_by_key(|p| std::cmp::Reverse(p.prefix.len()));
        if let Some(w) = list.windows(2).find(|w| w[0].prefix == w[1].prefix) {
            return Err(PolicyError::Duplicate(w[0].prefix.clone()));
        }
        Ok(Self(list))
    }

    /// The policy for an object URI (`s3://bucket/key`), if any.
    pub fn for_uri(&self, uri: &str) -> Option<&PrefixPolicy> {
        self.0.iter().find(|p| uri.starts_with(&p.prefix))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn list(&self) -> &[PrefixPolicy] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(prefix: &str) -> PrefixPolicy {
        PrefixPolicy {
            prefix: prefix.into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_longest_prefix_decides() {
        let policies = Policies::new(vec![
            PrefixPolicy {
                pin: true,
                ..p("s3://data/")
            },
            PrefixPolicy {
                skip_cache: true,
                ..p("s3://data/scratch/")
            },
        ])
        .unwrap();
        assert!(policies.for_uri("s3://data/train/0.bin").unwrap().pin);
        assert!(policies.for_uri("s3://data/scratch/x").unwrap().skip_cache);
        assert!(policies.for_uri("s3://database/x").is_none());
        assert!(policies.for_uri("s3://other/x").is_none());
    }

    #[test]
    fn contradictions_and_bad_prefixes_are_refused_with_the_reason() {
        let both = PrefixPolicy {
            pin: true,
            skip_cache: true,
            ..p("s3://bkt/x")
        };
        assert!(matches!(
            Policies::new(vec![both]),
            Err(PolicyError::Conflict { .. })
        ));
        let ttl_pin = PrefixPolicy {
            pin: true,
            ttl: Some(Duration::from_secs(5)),
            ..p("s3://bkt/x")
        };
        assert!(matches!(
            Policies::new(vec![ttl_pin]),
            Err(PolicyError::Conflict { .. })
        ));
        for bad in ["b/x", "s3://", "s3://B/x", "s3://bucket"] {
            let pol = PrefixPolicy {
                pin: true,
                ..p(bad)
            };
            assert_eq!(
                Policies::new(vec![pol]),
                Err(PolicyError::Prefix(bad.into()))
            );
        }
        assert_eq!(
            Policies::new(vec![p("s3://bkt/")]),
            Err(PolicyError::Empty("s3://bkt/".into()))
        );
        let pin = PrefixPolicy {
            pin: true,
            ..p("s3://bkt/")
        };
        assert_eq!(
            Policies::new(vec![pin.clone(), pin]),
            Err(PolicyError::Duplicate("s3://bkt/".into()))
        );
    }
}
