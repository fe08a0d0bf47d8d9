//! User metadata carried with an object (S3's `x-amz-meta-*`): the mount
//! keeps a file's mode, owner, times and type there. On the worker API
//! each entry travels as an `x-lakecache-meta-<name>` header.

use std::collections::BTreeMap;

/// Metadata names (lowercase, without `x-amz-meta-`) and their values.
pub type UserMeta = BTreeMap<String, String>;

/// Prefix of one user-metadata header on the worker API.
pub const META_HEADER_PREFIX: &str = "x-lakecache-meta-";
/// On a copy: `replace` stores the request's metadata on the copy
/// instead of the source's (S3's `x-amz-metadata-directive`).
pub const METADATA_DIRECTIVE_HEADER: &str = "x-lakecache-metadata-directive";

/// S3 refuses more than 2 KiB of user metadata (names and values).
pub const MAX_USER_META_BYTES: usize = 2048;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidUserMeta {
    #[error("metadata name {0:?} must be 1-64 characters of a-z, 0-9, '-' and '_'")]
    Name(String),
    #[error("metadata value of {0:?} must be printable ASCII")]
    Value(String),
    #[error("user metadata of {0} bytes exceeds S3's limit of {MAX_USER_META_BYTES}")]
    TooLarge(usize),
}

/// Checks that `meta` can be stored in S3 as it is.
pub fn validate_user_meta(meta: &UserMeta) -> Result<(), InvalidUserMeta> {
    let mut total = 0;
    for (name, value) in meta {
        let name_ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if !name_ok {
            return Err(InvalidUserMeta::Name(name.clone()));
        }
        if !value.bytes().all(|b| (0x20..0x7f).contains(&b)) {
            return Err(InvalidUserMeta::Value(name.clone()));
        }
        total += name.len() + value.len();
    }
    if total > MAX_USER_META_BYTES {
        return Err(InvalidUserMeta::TooLarge(total));
    }
    Ok(())
}

/// The user metadata a request's headers carry.
pub fn user_meta_from_headers(headers: &http::HeaderMap) -> Result<UserMeta, InvalidUserMeta> {
    let mut meta = UserMeta::new();
    for (name, value) in headers {
        let Some(short) = name.as_str().strip_prefix(META_HEADER_PREFIX) else {
            continue;
        };
        let value = value
            .to_str()
            .map_err(|_| InvalidUserMeta::Value(short.to_string()))?;
        meta.insert(short.to_string(), value.to_string());
    }
    validate_user_meta(&meta)?;
    Ok(meta)
}

/// Adds `meta` to a request as headers.
pub fn with_user_meta(
    mut builder: http::request::Builder,
    meta: &UserMeta,
) -> http::request::Builder {
    for (name, value) in meta {
        builder = builder.header(format!("{META_HEADER_PREFIX}{name}"), value.as_str());
    }
    builder
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_input_is_refused() {
        let meta = UserMeta::from([
            ("mode".to_string(), "33188".to_string()),
            ("mtime".to_string(), "1700000000.5".to_string()),
        ]);
        let req = with_user_meta(http::Request::builder(), &meta)
            .body(())
            .unwrap();
        assert_eq!(user_meta_from_headers(req.headers()).unwrap(), meta);

        let bad_name = UserMeta::from([("Mode".to_string(), "1".to_string())]);
        assert!(matches!(
            validate_user_meta(&bad_name),
            Err(InvalidUserMeta::Name(_))
        ));
        let bad_value = UserMeta::from([("link".to_string(), "é".to_string())]);
        assert!(matches!(
            validate_user_meta(&bad_value),
            Err(InvalidUserMeta::Value(_))
        ));
        let big = UserMeta::from([("x".to_string(), "a".repeat(3000))]);
        assert!(matches!(
            validate_user_meta(&big),
            Err(InvalidUserMeta::TooLarge(_))
        ));
    }
}
