//! `Range: bytes=...` parsing (RFC 9110 §14), one range per request.

use std::ops::Range;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeSpec {
    /// `first-` or `first-last` (inclusive).
    From { first: u64, last: Option<u64> },
    /// `-n`: the last n bytes.
    Suffix(u64),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    #[error("Range header must be bytes=FIRST-LAST, bytes=FIRST- or bytes=-SUFFIX")]
    Syntax,
    #[error("multiple ranges in one request are not supported")]
    Multiple,
}

pub fn parse_range(header: &str) -> Result<RangeSpec, RangeError> {
    let spec = header
        .trim()
        .strip_prefix("bytes=")
        .ok_or(RangeError::Syntax)?;
    if spec.contains(',') {
        return Err(RangeError::Multiple);
    }
    let (a, b) = spec.trim().split_once('-').ok_or(RangeError::Syntax)?;
    let num = |s: &str| -> Result<u64, RangeError> {
        if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
            return Err(RangeError::Syntax);
        }
        s.parse().map_err(|_| RangeError::Syntax)
    };
    if a.is_empty() {
        return Ok(RangeSpec::Suffix(num(b)?));
    }
    let first = num(a)?;
    let last = if b.is_empty() { None } else { Some(num(b)?) };
    if last.is_some_and(|l| l < first) {
        return Err(RangeError::Syntax);
    }
    Ok(RangeSpec::From { first, last })
}

/// The half-open byte range `spec` selects in an object of `size` bytes,
/// or `None` when it is unsatisfiable (answer 416).
pub fn resolve(spec: RangeSpec, size: u64) -> Option<Range<u64>> {
    match spec {
        RangeSpec::From { first, last } => {
            if first >= size {
                return None;
            }
            let end = last.map_or(size, |l| l.saturating_add(1).min(size));
            Some(first..end)
        }
        RangeSpec::Suffix(n) => {
            if n == 0 || size == 0 {
                return None;
            }
            Some(size.saturating_sub(n)..size)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_forms() {
        assert_eq!(
            parse_range("bytes=0-99"),
            Ok(RangeSpec::From {
                first: 0,
                last: Some(99)
            })
        );
        assert_eq!(
            parse_range("bytes=5-"),
            Ok(RangeSpec::From {
                first: 5,
                last: None
            })
        );
        assert_eq!(parse_range("bytes=-10"), Ok(RangeSpec::Suffix(10)));
        assert_eq!(parse_range("bytes=0-1,4-5"), Err(RangeError::Multiple));
        for bad in [
            "0-1",
            "bytes=",
            "bytes=-",
            "bytes=a-b",
            "bytes=5-1",
            "items=0-1",
            "bytes=+1-2",
        ] {
            assert_eq!(parse_range(bad), Err(RangeError::Syntax), "{bad}");
        }
    }

    #[test]
    fn resolves_against_size() {
        let r = |s| resolve(parse_range(s).unwrap(), 100);
        assert_eq!(r("bytes=0-99"), Some(0..100));
        assert_eq!(r("bytes=90-200"), Some(90..100));
        assert_eq!(r("bytes=100-"), None);
        assert_eq!(r("bytes=-10"), Some(90..100));
        assert_eq!(r("bytes=-1000"), Some(0..100));
        assert_eq!(r("bytes=-0"), None);
        assert_eq!(
            resolve(
                RangeSpec::From {
                    first: 0,
                    last: None
                },
                0
            ),
            None
        );
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use lakecache_protocol::testing::fuzz_cases;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(fuzz_cases(250_000)))]

        /// Any header value: a spec or a documented error, never a panic;
        /// a spec resolves inside the object or not at all.
        #[test]
        fn any_range_header_parses_or_is_rejected(
            header in prop_oneof![
                "bytes=[0-9,\\- ]{0,24}",
                "\\PC{0,40}",
                (any::<u64>(), any::<u64>()).prop_map(|(a, b)| format!("bytes={a}-{b}")),
            ],
            size in any::<u64>(),
        ) {
            match parse_range(&header) {
                Ok(spec) => {
                    if let Some(r) = resolve(spec, size) {
                        prop_assert!(r.start < r.end && r.end <= size, "{header:?} {size} -> {r:?}");
                    }
                }
                Err(RangeError::Syntax | RangeError::Multiple) => {}
            }
        }
    }
}
