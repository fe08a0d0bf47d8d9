//! Human-friendly sizes and durations for flags and config files.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

/// A byte count: `4194304`, `4MiB`, `4M`, `10GiB`, `1T` (all binary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num.parse().map_err(|_| {
            format!("invalid size {s:?}: expected a number with an optional unit like 4MiB")
        })?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" | "kib" => 1 << 10,
            "m" | "mb" | "mib" => 1 << 20,
            "g" | "gb" | "gib" => 1 << 30,
            "t" | "tb" | "tib" => 1 << 40,
            other => {
                return Err(format!(
                    "invalid size unit {other:?} in {s:?}: use B, KiB, MiB, GiB or TiB"
                ))
            }
        };
        n.checked_mul(mult)
            .map(ByteSize)
            .ok_or_else(|| format!("size {s:?} is too large"))
    }
}

/// Binary units, largest first.
const UNITS: [(&str, u64); 4] = [
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
];

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, size) in UNITS {
            if self.0 >= size && self.0.is_multiple_of(size) {
                return write!(f, "{}{name}", self.0 / size);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl ByteSize {
    /// Rounded for tables: `1.5GiB`, `512MiB`, `900B`.
    pub fn human(self) -> String {
        for (name, size) in UNITS {
            if self.0 >= size {
                return format!("{:.1}{name}", self.0 as f64 / size as f64);
            }
        }
        format!("{}B", self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte count or a string like \"4MiB\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom("size must not be negative"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration: `60`, `60s`, `500ms`, `5m`, `1h`; bare numbers are seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seconds(pub Duration);

impl FromStr for Seconds {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num
            .parse()
            .map_err(|_| format!("invalid duration {s:?}: expected e.g. 60s, 500ms, 5m"))?;
        let d = match unit.trim() {
            "" | "s" => Duration::from_secs(n),
            "ms" => Duration::from_millis(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            "h" => Duration::from_secs(n.saturating_mul(3600)),
            "d" => Duration::from_secs(n.saturating_mul(86_400)),
            other => {
                return Err(format!(
                    "invalid duration unit {other:?} in {s:?}: use ms, s, m, h or d"
                ))
            }
        };
        Ok(Seconds(d))
    }
}

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Seconds;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("seconds or a string like \"60s\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seconds, E> {
                Ok(Seconds(Duration::from_secs(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seconds, E> {
                u64::try_from(v)
                    .map(|v| Seconds(Duration::from_secs(v)))
                    .map_err(|_| E::custom("duration must not be negative"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Seconds, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!("4MiB".parse::<ByteSize>().unwrap().0, 4 << 20);
        assert_eq!("4m".parse::<ByteSize>().unwrap().0, 4 << 20);
        assert_eq!("123".parse::<ByteSize>().unwrap().0, 123);
        assert_eq!(" 2 GiB".parse::<ByteSize>().unwrap().0, 2 << 30);
        assert!("4XB".parse::<ByteSize>().is_err());
        assert!("-1".parse::<ByteSize>().is_err());
        assert!("99999999999T".parse::<ByteSize>().is_err());
        assert_eq!(ByteSize(4 << 20).to_string(), "4MiB");
    }

    #[test]
    fn durations() {
        assert_eq!("60".parse::<Seconds>().unwrap().0, Duration::from_secs(60));
        assert_eq!(
            "500ms".parse::<Seconds>().unwrap().0,
            Duration::from_millis(500)
        );
        assert_eq!("2m".parse::<Seconds>().unwrap().0, Duration::from_secs(120));
        assert_eq!(
            "30d".parse::<Seconds>().unwrap().0,
            Duration::from_secs(30 * 86_400)
        );
        assert!("1w".parse::<Seconds>().is_err());
        assert!("d".parse::<Seconds>().is_err());
    }
}
