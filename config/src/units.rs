//! Sizes and durations written in human units (`"4KiB"`, `"1GiB"`, `"5s"`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// A size in bytes. In TOML either an integer (bytes) or a string with a binary unit:
/// `"512"`, `"512B"`, `"4KiB"`, `"128KiB"`, `"1MiB"`, `"64GiB"`, `"2TiB"`.
///
/// Decimal units (`KB`, `MB`, ...) are refused: storage engineers read `4KB` both as 4000 and as
/// 4096 bytes, and a target must not guess which one was meant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// `n` KiB.
    pub const fn kib(n: u64) -> Self {
        Self(n * 1024)
    }
    /// `n` MiB.
    pub const fn mib(n: u64) -> Self {
        Self(n * 1024 * 1024)
    }
    /// `n` GiB.
    pub const fn gib(n: u64) -> Self {
        Self(n * 1024 * 1024 * 1024)
    }
    /// The size in bytes.
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

/// Why a size string did not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ByteSizeError {
    /// the size is empty
    #[error("the size is empty")]
    Empty,
    /// the number part is missing or not a whole number
    #[error("`{0}` is not a size: expected a whole number followed by B, KiB, MiB, GiB or TiB")]
    Syntax(String),
    /// decimal units are refused
    #[error("`{0}` uses a decimal unit, which is ambiguous for storage: write {1} (binary units: KiB, MiB, GiB, TiB)")]
    Decimal(String, String),
    /// the size does not fit in 64 bits
    #[error("`{0}` is too large")]
    Overflow(String),
}

impl FromStr for ByteSize {
    type Err = ByteSizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.is_empty() {
            return Err(ByteSizeError::Empty);
        }
        let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(digits_end);
        if num.is_empty() {
            return Err(ByteSizeError::Syntax(s.to_owned()));
        }
        let n: u64 = num
            .parse()
            .map_err(|_| ByteSizeError::Overflow(s.to_owned()))?;
        let shift = match unit.trim() {
            "" | "B" => 0,
            "KiB" => 10,
            "MiB" => 20,
            "GiB" => 30,
            "TiB" => 40,
            u @ ("K" | "KB" | "k" | "kB" | "M" | "MB" | "G" | "GB" | "T" | "TB") => {
                let binary = format!("{num}{}iB", &u[..1].to_ascii_uppercase());
                return Err(ByteSizeError::Decimal(
                    s.to_owned(),
                    format!("\"{binary}\""),
                ));
            }
            _ => return Err(ByteSizeError::Syntax(s.to_owned())),
        };
        n.checked_mul(1u64 << shift)
            .map(ByteSize)
            .ok_or_else(|| ByteSizeError::Overflow(s.to_owned()))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u32); 4] = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
        for (name, shift) in UNITS {
            let unit = 1u64 << shift;
            if self.0 >= unit && self.0.is_multiple_of(unit) {
                return write!(f, "{}{}", self.0 / unit, name);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: a number of bytes or a string such as \"4KiB\" or \"1GiB\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom("a size cannot be negative"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration written as a string with units: `"500ms"`, `"5s"`, `"2min"`, `"1h 30min"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// `n` seconds.
    pub const fn secs(n: u64) -> Self {
        Self(Duration::from_secs(n))
    }
    /// `n` milliseconds.
    pub const fn millis(n: u64) -> Self {
        Self(Duration::from_millis(n))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s)
            .map(HumanDuration)
            .map_err(|e| {
                de::Error::custom(format!(
                    "`{s}` is not a duration ({e}); write e.g. \"500ms\", \"5s\" or \"2min\""
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_binary_units() {
        assert_eq!("512".parse(), Ok(ByteSize(512)));
        assert_eq!("512B".parse(), Ok(ByteSize(512)));
        assert_eq!("4KiB".parse(), Ok(ByteSize(4096)));
        assert_eq!("4 KiB".parse(), Ok(ByteSize(4096)));
        assert_eq!("1GiB".parse(), Ok(ByteSize(1 << 30)));
        assert_eq!("2TiB".parse(), Ok(ByteSize(2 << 40)));
    }

    #[test]
    fn sizes_refuse_decimal_and_garbage() {
        assert!(
            matches!("4KB".parse::<ByteSize>(), Err(ByteSizeError::Decimal(_, hint)) if hint == "\"4KiB\"")
        );
        assert!(matches!(
            "4k".parse::<ByteSize>(),
            Err(ByteSizeError::Decimal(..))
        ));
        assert!(matches!(
            "KiB".parse::<ByteSize>(),
            Err(ByteSizeError::Syntax(_))
        ));
        assert!(matches!(
            "1.5GiB".parse::<ByteSize>(),
            Err(ByteSizeError::Syntax(_))
        ));
        assert!(matches!(
            "4PiB".parse::<ByteSize>(),
            Err(ByteSizeError::Syntax(_))
        ));
        assert!(matches!("".parse::<ByteSize>(), Err(ByteSizeError::Empty)));
        assert!(matches!(
            "99999999999TiB".parse::<ByteSize>(),
            Err(ByteSizeError::Overflow(_))
        ));
    }

    #[test]
    fn sizes_display_in_the_largest_exact_unit() {
        assert_eq!(ByteSize(4096).to_string(), "4KiB");
        assert_eq!(ByteSize(4097).to_string(), "4097B");
        assert_eq!(ByteSize::mib(1536).to_string(), "1536MiB");
        assert_eq!(ByteSize::gib(2).to_string(), "2GiB");
        assert_eq!(ByteSize(0).to_string(), "0B");
    }

    #[test]
    fn durations_round_trip() {
        let d: HumanDuration =
            toml::from_str::<std::collections::BTreeMap<String, HumanDuration>>("a = \"1500ms\"")
                .unwrap()["a"];
        assert_eq!(d.0, Duration::from_millis(1500));
        assert_eq!(d.to_string(), "1s 500ms");
    }
}
