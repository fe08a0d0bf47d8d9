//! UploadPartCopy's data path: one byte range of a stored blob copied into
//! a part file, hashed on the way like a received part.

use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::Path;

use md5::{Digest, Md5};

/// S3's limit for one copied part.
pub(crate) const MAX_PART_COPY: u64 = 5 << 30;

/// `x-amz-copy-source-range: bytes=first-last` (inclusive) against an
/// object of `size` bytes; none means the whole object.
pub(crate) fn parse_copy_range(header: Option<&str>, size: u64) -> Result<Range<u64>, String> {
    let Some(header) = header else {
        return Ok(0..size);
    };
    let spec = header
        .trim()
        .strip_prefix("bytes=")
        .ok_or_else(|| format!("copy source range {header:?} must be bytes=first-last"))?;
    let (first, last) = spec
        .split_once('-')
        .ok_or_else(|| format!("copy source range {header:?} must be bytes=first-last"))?;
    let parse = |s: &str| {
        s.trim()
            .parse::<u64>()
            .map_err(|_| format!("copy source range {header:?} must be bytes=first-last"))
    };
    let (first, last) = (parse(first)?, parse(last)?);
    if first > last || last >= size {
        return Err(format!(
            "copy source range {header:?} is outside the {size}-byte source"
        ));
    }
    Ok(first..last + 1)
}

/// Copies `range` of `blob` into a new file at `dest` (synced); returns
/// the part's MD5 (its ETag) and CRC32C.
pub(crate) fn copy_range(
    blob: &Path,
    dest: &Path,
    range: Range<u64>,
) -> std::io::Result<([u8; 16], u32)> {
    let mut src = std::fs::File::open(blob)?;
    src.seek(SeekFrom::Start(range.start))?;
    let mut src = src.take(range.end - range.start);
    let mut out = std::fs::File::create(dest)?;
    let mut hasher = Md5::new();
    let mut crc = 0u32;
    let mut buf = vec![0u8; 1 << 20];
    let mut copied = 0u64;
    loop {
        let n = src.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        out.write_all(&buf[..n])?;
        copied += n as u64;
    }
    if copied != range.end - range.start {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("source blob ended after {copied} bytes of the range"),
        ));
    }
    out.sync_all()?;
    Ok((hasher.finalize().into(), crc))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_inclusive_and_checked_against_the_source() {
        assert_eq!(parse_copy_range(None, 10), Ok(0..10));
        assert_eq!(parse_copy_range(Some("bytes=0-9"), 10), Ok(0..10));
        assert_eq!(parse_copy_range(Some("bytes=4-4"), 10), Ok(4..5));
        for bad in ["bytes=0-10", "bytes=5-4", "0-3", "bytes=a-3", "bytes=3"] {
            assert!(parse_copy_range(Some(bad), 10).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_copied_range_has_the_bytes_and_hashes_of_that_range() {
        let dir = tempfile::tempdir().unwrap();
        let blob = dir.path().join("blob");
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&blob, &data).unwrap();
        let dest = dir.path().join("part");
        let (md5, crc) = copy_range(&blob, &dest, 1_000..2_500_000).unwrap();
        let want = &data[1_000..2_500_000];
        assert_eq!(std::fs::read(&dest).unwrap(), want);
        assert_eq!(md5, <[u8; 16]>::from(Md5::digest(want)));
        assert_eq!(crc, crc32c::crc32c(want));
        assert!(copy_range(&blob, &dest, 2_999_000..3_000_100).is_err());
    }
}
