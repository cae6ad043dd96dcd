//! Tiny formatters for reasons shown to people: binary byte units (`20GiB`, `1.5GiB`) and
//! selectors (`gpu=h100,zone=a`). Kept in-crate so the core depends on nothing but serde.

use std::collections::BTreeMap;

const UNITS: [(&str, u64); 5] = [
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("B", 1),
];

/// Formats `bytes` with the largest binary unit that keeps the value >= 1, rounded to one
/// decimal, trailing `.0` dropped: `20GiB`, `1.5GiB`, `512B`.
pub(crate) fn format_bytes(bytes: u64) -> String {
    for (unit_name, unit_bytes) in UNITS {
        if bytes >= unit_bytes || unit_bytes == 1 {
            // Tenths, rounded half up; u128 because bytes * 10 can overflow u64.
            let tenths =
                (u128::from(bytes) * 10 + u128::from(unit_bytes) / 2) / u128::from(unit_bytes);
            assert!(unit_bytes > 1 || tenths == u128::from(bytes) * 10);
            return if tenths % 10 == 0 {
                format!("{}{unit_name}", tenths / 10)
            } else {
                format!("{}.{}{unit_name}", tenths / 10, tenths % 10)
            };
        }
    }
    unreachable!("the last unit is one byte")
}

/// Millicores as CPUs: `1 CPU`, `8 CPUs`, `2.5 CPUs`, `0.25 CPUs`.
pub(crate) fn format_cpu(milli: u64) -> String {
    let whole = milli / 1000;
    let rest = milli % 1000;
    let number = if rest == 0 {
        whole.to_string()
    } else {
        let decimals = format!("{rest:03}");
        format!("{whole}.{}", decimals.trim_end_matches('0'))
    };
    if milli == 1000 {
        "1 CPU".to_string()
    } else {
        format!("{number} CPUs")
    }
}

/// `a=1,b=2` in key order (BTreeMap order, so the text is the same on every replica).
pub(crate) fn format_selector(selector: &BTreeMap<String, String>) -> String {
    let pairs: Vec<String> = selector
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect();
    pairs.join(",")
}

/// `1 node` / `2 nodes`: reasons read better with the right plural.
pub(crate) fn plural(count: u64, noun: &str) -> String {
    if count == 1 {
        format!("{count} {noun}")
    } else {
        format!("{count} {noun}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_use_binary_units() {
        assert_eq!(format_bytes(0), "0B");
        assert_eq!(format_bytes(512), "512B");
        assert_eq!(format_bytes(1024), "1KiB");
        assert_eq!(format_bytes(20 << 30), "20GiB");
        assert_eq!(format_bytes(3 << 29), "1.5GiB");
        assert_eq!(format_bytes(80 << 30), "80GiB");
        assert_eq!(format_bytes((1 << 40) + (1 << 39)), "1.5TiB");
        assert_eq!(format_bytes(u64::MAX), "16777216TiB");
    }

    #[test]
    fn selectors_and_plurals() {
        let selector: BTreeMap<String, String> = [
            ("zone".to_string(), "a".to_string()),
            ("gpu".to_string(), "h100".to_string()),
        ]
        .into();
        assert_eq!(format_selector(&selector), "gpu=h100,zone=a");
        assert_eq!(plural(1, "node"), "1 node");
        assert_eq!(plural(2, "node"), "2 nodes");
        assert_eq!(format_cpu(1000), "1 CPU");
        assert_eq!(format_cpu(8000), "8 CPUs");
        assert_eq!(format_cpu(2500), "2.5 CPUs");
        assert_eq!(format_cpu(250), "0.25 CPUs");
    }
}
