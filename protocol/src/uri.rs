use std::fmt;
use std::str::FromStr;

use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

/// S3's limit on key length.
pub const MAX_KEY_BYTES: usize = 1024;

/// Characters left as-is in a key path segment.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidUri {
    #[error("object URI must look like s3://bucket/key, got {0:?}")]
    Scheme(String),
    #[error("invalid bucket name {0:?}: 3-63 characters of a-z, 0-9, '-' and '.'")]
    Bucket(String),
    #[error("object key is empty")]
    EmptyKey,
    #[error("object key is longer than {MAX_KEY_BYTES} bytes")]
    KeyTooLong,
    #[error("object key contains a NUL or control character")]
    ControlChar,
    #[error("object key contains an empty, '.' or '..' component")]
    BadComponent,
    #[error("object key starts with '/'")]
    LeadingSlash,
    #[error("object key is not valid percent-encoded UTF-8")]
    Encoding,
}

pub fn validate_bucket(bucket: &str) -> Result<(), InvalidUri> {
    let b = bucket.as_bytes();
    let ok = (3..=63).contains(&b.len())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'.')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && !bucket.contains("..");
    if ok {
        Ok(())
    } else {
        Err(InvalidUri::Bucket(bucket.to_string()))
    }
}

/// Keys must be usable as paths by every client: no NUL or control
/// characters, no `.`/`..` or empty components (a trailing `/` marks a
/// directory and is allowed).
pub fn validate_key(key: &str) -> Result<(), InvalidUri> {
    if key.is_empty() {
        return Err(InvalidUri::EmptyKey);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(InvalidUri::KeyTooLong);
    }
    if key.chars().any(|c| c.is_control()) {
        return Err(InvalidUri::ControlChar);
    }
    if key.starts_with('/') {
        return Err(InvalidUri::LeadingSlash);
    }
    let body = key.strip_suffix('/').unwrap_or(key);
    if body
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(InvalidUri::BadComponent);
    }
    Ok(())
}

/// `s3://bucket/key`: the identity of a cached object.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectUri {
    bucket: String,
    key: String,
}

impl ObjectUri {
    pub fn new(bucket: impl Into<String>, key: impl Into<String>) -> Result<Self, InvalidUri> {
        let (bucket, key) = (bucket.into(), key.into());
        validate_bucket(&bucket)?;
        validate_key(&key)?;
        Ok(Self { bucket, key })
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// The worker API path for this object under `/v1/<kind>/`.
    pub fn api_path(&self, kind: &str) -> String {
        format!("/v1/{kind}/{}/{}", self.bucket, encode_key(&self.key))
    }

    /// Parses `<bucket>/<percent-encoded key>` as found after `/v1/<kind>/`.
    pub fn from_api_path(rest: &str) -> Result<Self, InvalidUri> {
        let (bucket, raw_key) = rest.split_once('/').unwrap_or((rest, ""));
        let key = percent_decode_str(raw_key)
            .decode_utf8()
            .map_err(|_| InvalidUri::Encoding)?;
        Self::new(bucket, key.into_owned())
    }
}

/// Percent-encodes each segment of a key, keeping `/` separators.
pub fn encode_key(key: &str) -> String {
    key.split('/')
        .map(|seg| utf8_percent_encode(seg, SEGMENT).to_string())
        .collect::<Vec<_>>()
        .join("/")
}

impl FromStr for ObjectUri {
    type Err = InvalidUri;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rest = s
            .strip_prefix("s3://")
            .ok_or_else(|| InvalidUri::Scheme(s.to_string()))?;
        let (bucket, key) = rest
            .split_once('/')
            .ok_or_else(|| InvalidUri::Scheme(s.to_string()))?;
        Self::new(bucket, key)
    }
}

impl fmt::Display for ObjectUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let u: ObjectUri = "s3://data-lake/shards/a b.bin".parse().unwrap();
        assert_eq!(u.bucket(), "data-lake");
        assert_eq!(u.key(), "shards/a b.bin");
        assert_eq!(u.to_string(), "s3://data-lake/shards/a b.bin");
        assert_eq!(
            u.api_path("objects"),
            "/v1/objects/data-lake/shards/a%20b.bin"
        );
        assert_eq!(
            ObjectUri::from_api_path("data-lake/shards/a%20b.bin").unwrap(),
            u
        );
    }

    #[test]
    fn rejects_traversal_and_nul() {
        for bad in ["a/../b", "../x", "a/./b", "a//b", "a\0b", "/abs", ""] {
            assert!(validate_key(bad).is_err(), "{bad:?} accepted");
        }
        assert!(validate_key("dir/").is_ok());
        assert!(validate_key("a..b/c").is_ok());
        assert!(ObjectUri::from_api_path("bkt/a/%2E%2E/b").is_err());
        assert!(ObjectUri::from_api_path("bkt/a%00b").is_err());
        assert!(ObjectUri::from_api_path("bkt/%FF").is_err());
    }

    #[test]
    fn rejects_bad_buckets() {
        for bad in ["ab", "Upper", "-lead", "trail-", "a..b", "under_score"] {
            assert!(validate_bucket(bad).is_err(), "{bad:?} accepted");
        }
        assert!("http://b/k".parse::<ObjectUri>().is_err());
        assert!("s3://bucket".parse::<ObjectUri>().is_err());
    }
}
