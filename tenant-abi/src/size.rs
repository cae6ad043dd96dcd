//! Byte-size strings as people write them: `20GiB`, `512MiB`, `80GB`, `1.5TiB`, `4096`. The one
//! parser of sizes in vgpu: the API (`api::size`), vgpuctl and the tenant environment all use it.
//!
//! Binary suffixes (`KiB`, `MiB`, `GiB`, `TiB`, also `Ki`, `Mi`, `Gi`, `Ti` as in Kubernetes) are
//! powers of 1024; decimal ones (`KB`, `MB`, `GB`, `TB`, `K`, `M`, `G`, `T`) powers of 1000. A
//! plain number is bytes. Fractions are allowed and rounded down to a whole byte.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("the size is empty; write a size such as `20GiB`")]
    Empty,
    #[error("the size `{0}` is negative; sizes are zero or more, e.g. `20GiB`")]
    Negative(String),
    #[error(
        "cannot read the size `{0}`; write a number with an optional unit, e.g. `20GiB`, `512MiB`, `80GB`"
    )]
    Malformed(String),
    #[error(
        "the size `{0}` has the unknown unit `{1}`; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
    )]
    UnknownUnit(String, String),
    #[error("the size `{0}` is too large (more than 16 EiB)")]
    TooLarge(String),
}

const KIB: f64 = 1024.0;

/// Parses a size string into bytes.
pub fn parse_bytes(text: &str) -> Result<u64, SizeError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(SizeError::Empty);
    }
    if trimmed.starts_with('-') {
        return Err(SizeError::Negative(trimmed.to_owned()));
    }
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let unit = unit.trim();
    if number.is_empty() || number.chars().filter(|&c| c == '.').count() > 1 {
        return Err(SizeError::Malformed(trimmed.to_owned()));
    }
    let multiplier: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "ki" | "kib" => KIB,
        "mi" | "mib" => KIB * KIB,
        "gi" | "gib" => KIB * KIB * KIB,
        "ti" | "tib" => KIB * KIB * KIB * KIB,
        _ => return Err(SizeError::UnknownUnit(trimmed.to_owned(), unit.to_owned())),
    };
    // Whole numbers are computed exactly; fractions go through f64.
    if let Ok(whole) = number.parse::<u64>() {
        return whole
            .checked_mul(multiplier as u64)
            .ok_or_else(|| SizeError::TooLarge(trimmed.to_owned()));
    }
    let value: f64 = number
        .parse()
        .map_err(|_| SizeError::Malformed(trimmed.to_owned()))?;
    let bytes = value * multiplier;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(SizeError::TooLarge(trimmed.to_owned()));
    }
    Ok(bytes as u64)
}

/// Formats bytes with the largest binary unit that keeps the number at or above 1, e.g. `20GiB`,
/// `1.5GiB`, `512MiB`, `100B`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 5] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("B", 1),
    ];
    for (unit, size) in UNITS {
        if bytes >= size {
            if bytes.is_multiple_of(size) {
                return format!("{}{unit}", bytes / size);
            }
            let value = bytes as f64 / size as f64;
            let shown = format!("{}{unit}", trim_float(value));
            // Within half a hundredth of a TiB of 16 EiB the rounding reaches 2^64 bytes, which
            // no size can be: print the exact bytes there, so that what we print reads back.
            if parse_bytes(&shown).is_err() {
                return format!("{bytes}B");
            }
            return shown;
        }
    }
    "0B".to_owned()
}

fn trim_float(value: f64) -> String {
    let text = format!("{value:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_common_sizes() {
        assert_eq!(parse_bytes("20GiB"), Ok(20 << 30));
        assert_eq!(parse_bytes("20Gi"), Ok(20 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes(" 7 gib "), Ok(7 << 30));
        assert_eq!(parse_bytes("0"), Ok(0));
    }

    #[test]
    fn rejects_bad_sizes_with_a_reason() {
        assert_eq!(
            parse_bytes("-5GiB"),
            Err(SizeError::Negative("-5GiB".into()))
        );
        assert_eq!(parse_bytes(""), Err(SizeError::Empty));
        assert!(matches!(parse_bytes("GiB"), Err(SizeError::Malformed(_))));
        assert!(matches!(
            parse_bytes("1.2.3G"),
            Err(SizeError::Malformed(_))
        ));
        assert!(matches!(
            parse_bytes("5 parsecs"),
            Err(SizeError::UnknownUnit(..))
        ));
        assert!(matches!(
            parse_bytes("99999999999TiB"),
            Err(SizeError::TooLarge(_))
        ));
    }

    #[test]
    fn formats_sizes() {
        assert_eq!(format_bytes(20 << 30), "20GiB");
        assert_eq!(format_bytes(3 << 29), "1.5GiB");
        assert_eq!(format_bytes(100), "100B");
        assert_eq!(format_bytes(0), "0B");
    }

    proptest! {
        #[test]
        fn whole_units_round_trip(value in 0u64..1_000_000, unit in 0usize..4) {
            let text = format!("{value}{}", ["B", "KiB", "MiB", "GiB"][unit]);
            let bytes = parse_bytes(&text).unwrap();
            prop_assert_eq!(bytes, value << (10 * unit));
            // Formatting keeps two decimals of the largest unit, so the round trip is exact to
            // within half a hundredth of that unit (0.5% of the value at most).
            let back = parse_bytes(&format_bytes(bytes)).unwrap();
            prop_assert!(back.abs_diff(bytes) as f64 <= bytes as f64 * 0.005, "{bytes} -> {} -> {back}", format_bytes(bytes));
        }

        #[test]
        fn never_panics(text in ".{0,24}") {
            let _ = parse_bytes(&text);
        }
    }
}
