//! CPU amounts as people write them (`8`, `2.5`, `500m`) and as the API carries them:
//! millicores, 1000 to a CPU. The one parser and formatter, for vgpuctl's `--cpu` and the agent's
//! `--reserved-cpu`, so that both read and print the same text.

/// Millicores in one CPU.
pub const MILLI_PER_CPU: u64 = 1000;

/// Why a CPU amount cannot be read; each message gives an example.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CpuError {
    #[error("the CPU amount is empty; give CPUs (`8`, `2.5`) or millicores (`500m`)")]
    Empty,
    #[error("the CPU amount `{0}` is negative; give CPUs (`8`, `2.5`) or millicores (`500m`)")]
    Negative(String),
    #[error("cannot read the CPU amount `{0}`; give CPUs (`8`, `2.5`) or millicores (`500m`)")]
    Unreadable(String),
    #[error(
        "the CPU amount `{0}` has more than 3 decimals; CPUs are counted in thousandths, e.g. `2.125` or `2125m`"
    )]
    TooPrecise(String),
    #[error("the CPU amount `{0}` is too large")]
    TooLarge(String),
}

/// At most 32 characters of what was typed, for a message that quotes it.
fn quoted(text: &str) -> String {
    crate::validate::excerpt(text, 32)
}

/// Parses CPUs (`8`, `2.5`, `0.125`) or millicores (`500m`) into millicores. Zero is accepted
/// (`0` means none where the caller allows it).
pub fn parse_cpu_milli(text: &str) -> Result<u64, CpuError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(CpuError::Empty);
    }
    if text.starts_with('-') {
        return Err(CpuError::Negative(quoted(text)));
    }
    let digits = |part: &str| !part.is_empty() && part.chars().all(|c| c.is_ascii_digit());
    if let Some(milli) = text.strip_suffix('m') {
        if !digits(milli) {
            return Err(CpuError::Unreadable(quoted(text)));
        }
        return milli.parse().map_err(|_| CpuError::TooLarge(quoted(text)));
    }
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let whole_ok = whole.is_empty() || digits(whole);
    let fraction_ok = fraction.is_empty() || digits(fraction);
    if !whole_ok || !fraction_ok || (whole.is_empty() && fraction.is_empty()) {
        return Err(CpuError::Unreadable(quoted(text)));
    }
    let fraction = fraction.trim_end_matches('0');
    if fraction.len() > 3 {
        return Err(CpuError::TooPrecise(quoted(text)));
    }
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole
            .parse()
            .map_err(|_| CpuError::TooLarge(quoted(text)))?
    };
    let thousandths: u64 = format!("{fraction:0<3}")
        .parse()
        .expect("three ASCII digits");
    debug_assert!(thousandths < MILLI_PER_CPU);
    whole
        .checked_mul(MILLI_PER_CPU)
        .and_then(|milli| milli.checked_add(thousandths))
        .ok_or_else(|| CpuError::TooLarge(quoted(text)))
}

/// Millicores as CPUs, the way [`parse_cpu_milli`] reads them back: `8`, `2.5`, `0.125`.
pub fn format_cpu_milli(milli: u64) -> String {
    let whole = milli / MILLI_PER_CPU;
    let rest = milli % MILLI_PER_CPU;
    if rest == 0 {
        return whole.to_string();
    }
    let decimals = format!("{rest:03}");
    format!("{whole}.{}", decimals.trim_end_matches('0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_and_millicores_are_read_and_printed_alike() {
        for (text, milli) in [
            ("8", 8000),
            ("2.5", 2500),
            ("0.125", 125),
            (".5", 500),
            ("500m", 500),
            ("0", 0),
            ("1.000", 1000),
            (" 16 ", 16_000),
        ] {
            assert_eq!(parse_cpu_milli(text), Ok(milli), "{text}");
            assert_eq!(
                parse_cpu_milli(&format_cpu_milli(milli)),
                Ok(milli),
                "{text} round trip"
            );
        }
        assert_eq!(format_cpu_milli(2500), "2.5");
        assert_eq!(format_cpu_milli(64_000), "64");
    }

    #[test]
    fn bad_amounts_say_what_to_write() {
        for (text, error) in [
            ("", CpuError::Empty),
            ("-2", CpuError::Negative("-2".into())),
            ("two", CpuError::Unreadable("two".into())),
            ("2.5m", CpuError::Unreadable("2.5m".into())),
            ("m", CpuError::Unreadable("m".into())),
            (".", CpuError::Unreadable(".".into())),
            ("1.2345", CpuError::TooPrecise("1.2345".into())),
            (
                "99999999999999999999",
                CpuError::TooLarge("99999999999999999999".into()),
            ),
            (
                "18446744073709551615",
                CpuError::TooLarge("18446744073709551615".into()),
            ),
        ] {
            let got = parse_cpu_milli(text);
            assert_eq!(got, Err(error), "{text}");
            assert!(got.unwrap_err().to_string().contains('`'), "{text}");
        }
    }
}
