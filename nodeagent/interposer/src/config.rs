//! The interposer's configuration, read once from the environment the node agent sets:
//!
//! | variable | meaning |
//! | --- | --- |
//! | `VGPU_TENANT` | tenant name; without it the interposer passes everything through |
//! | `VGPU_MEMORY_LIMITS` | `<device>:<size>,...`, device = CUDA ordinal as the process sees it |
//! | `VGPU_MEMORY_LIMIT` | one size for every device not named in `VGPU_MEMORY_LIMITS` |
//! | `VGPU_SHM_DIR` | where the tenant's ledger file lives (default `/dev/shm/vgpu`) |
//! | `VGPU_CONTEXT_OVERHEAD` | charged once per process per device for its CUDA context: a size for every device or `<device>:<size>,...` (default `CONTEXT_OVERHEAD_DEFAULT_BYTES`; `0` turns it off) |
//! | `VGPU_REAL_LIBNVML` | the real NVML library (default `libnvidia-ml.so.1`) |
//! | `VGPU_REAL_LIBCUDA` | the real driver library (default `libcuda.so.1`) |
//!
//! Sizes are written as in the rest of vgpu (`api::size`): `10GiB`, `512MiB`, `80GB`, `4096`.
//! This crate does not depend on `api` (it would pull tonic into every tenant process), so the
//! same rules are re-implemented in `parse_size` and tested to agree on the common forms.
//!
//! Pure: `from_lookup` takes the environment as a function, so tests need no process state.

use std::fmt;
use std::path::PathBuf;

/// The most devices a ledger tracks; higher ordinals are passed through unlimited.
pub const DEVICES_MAX: usize = 16;

/// Where ledger files live unless `VGPU_SHM_DIR` says otherwise.
pub const SHM_DIR_DEFAULT: &str = "/dev/shm/vgpu";

/// Longest accepted tenant name (a DNS label, as in `api::names`).
pub const TENANT_NAME_LEN_MAX: usize = 63;

/// What a process's CUDA context costs on a device unless `VGPU_CONTEXT_OVERHEAD` says otherwise.
/// The context's own memory (local-memory reservation, loaded kernels, driver heaps) never goes
/// through an allocation we see. Measured on an H100 (driver 580, CUDA 13.0, PyTorch 2.11,
/// `tests/gpu/nvml_slice.sh`): a process loses 518 MiB to a fresh context, 610 MiB after its first
/// kernels, 676-684 MiB once cuBLAS and cuDNN kernels are loaded. 640 MiB covers the common case
/// with little waste; docs/benchmarks.md has the table.
pub const CONTEXT_OVERHEAD_DEFAULT_BYTES: u64 = 640 << 20;

/// What the environment asks of this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub tenant: String,
    /// Per-device memory limit in bytes; `None` means that device is not limited.
    pub limits_bytes: [Option<u64>; DEVICES_MAX],
    pub shm_dir: PathBuf,
    /// Charged once per process on each device where it creates a context or allocates (the
    /// CUDA context's own memory), per device.
    pub context_overhead_bytes: [u64; DEVICES_MAX],
}

/// A configuration the interposer cannot follow. The process then gets a clear error on every
/// allocation (fail closed) rather than running without its limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Reads the configuration; `Ok(None)` when `VGPU_TENANT` is unset or empty (pass-through).
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Config>, ConfigError> {
        let Some(tenant) = get("VGPU_TENANT").filter(|t| !t.trim().is_empty()) else {
            return Ok(None);
        };
        let tenant = tenant.trim().to_owned();
        check_tenant_name(&tenant)?;

        let mut limits_bytes = [None; DEVICES_MAX];
        if let Some(all) = get("VGPU_MEMORY_LIMIT").filter(|v| !v.trim().is_empty()) {
            let bytes =
                parse_size(&all).map_err(|e| ConfigError(format!("VGPU_MEMORY_LIMIT: {e}")))?;
            limits_bytes = [Some(bytes); DEVICES_MAX];
        }
        if let Some(list) = get("VGPU_MEMORY_LIMITS").filter(|v| !v.trim().is_empty()) {
            for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                let (device, size) = item.split_once(':').ok_or_else(|| {
                    ConfigError(format!(
                        "VGPU_MEMORY_LIMITS: `{item}` is not `<device>:<size>`, e.g. `0:10GiB`"
                    ))
                })?;
                let device: usize = device.trim().parse().map_err(|_| {
                    ConfigError(format!(
                        "VGPU_MEMORY_LIMITS: `{device}` is not a device ordinal (0, 1, ...)"
                    ))
                })?;
                if device >= DEVICES_MAX {
                    return Err(ConfigError(format!(
                        "VGPU_MEMORY_LIMITS: device {device} is past the supported {DEVICES_MAX}"
                    )));
                }
                let bytes = parse_size(size)
                    .map_err(|e| ConfigError(format!("VGPU_MEMORY_LIMITS: {e}")))?;
                limits_bytes[device] = Some(bytes);
            }
        }
        if limits_bytes.contains(&Some(0)) {
            return Err(ConfigError(
                "VGPU_MEMORY_LIMIT(S): a limit of 0 bytes would refuse every allocation; hide the \
                 device with CUDA_VISIBLE_DEVICES instead"
                    .to_owned(),
            ));
        }
        let shm_dir = get("VGPU_SHM_DIR")
            .filter(|d| !d.trim().is_empty())
            .map_or_else(|| PathBuf::from(SHM_DIR_DEFAULT), PathBuf::from);
        let context_overhead_bytes = match get("VGPU_CONTEXT_OVERHEAD") {
            Some(v) if !v.trim().is_empty() => parse_overheads(&v)?,
            _ => [CONTEXT_OVERHEAD_DEFAULT_BYTES; DEVICES_MAX],
        };
        Ok(Some(Config {
            tenant,
            limits_bytes,
            shm_dir,
            context_overhead_bytes,
        }))
    }

    /// The ledger file of this tenant.
    pub fn ledger_path(&self) -> PathBuf {
        self.shm_dir.join(format!("{}.mem", self.tenant))
    }
}

/// The compute side of the environment: per-device shares and how the tenant shares.
///
/// | variable | meaning |
/// | --- | --- |
/// | `VGPU_COMPUTE_SHARES` | `<device>:<percent>,...` (1..=100); devices not listed are not gated |
/// | `VGPU_BURST` | `1`: may use idle time beyond the share (default `0`) |
/// | `VGPU_GUARANTEED` | `0`: the share is best effort (default `1`) |
/// | `VGPU_PRIORITY` | higher first, `-1000..=1000` (default 0) |
/// | `VGPU_COMPUTE_QUANTUM_MS` | turn length for a GPU whose schedule this process creates (default 20) |
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputeConfig {
    pub tenant: String,
    pub shm_dir: PathBuf,
    /// Per-device share in percent; `None`: not gated on that device.
    pub shares_pct: [Option<u32>; DEVICES_MAX],
    pub burst: bool,
    pub guaranteed: bool,
    pub priority: i32,
    pub quantum_ms: u64,
}

impl ComputeConfig {
    /// `Ok(None)` without a tenant or without any share (nothing to gate).
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<ComputeConfig>, ConfigError> {
        let Some(tenant) = get("VGPU_TENANT").filter(|t| !t.trim().is_empty()) else {
            return Ok(None);
        };
        let tenant = tenant.trim().to_owned();
        check_tenant_name(&tenant)?;
        let mut shares_pct = [None; DEVICES_MAX];
        let list = get("VGPU_COMPUTE_SHARES").unwrap_or_default();
        for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let bad = || {
                ConfigError(format!(
                    "VGPU_COMPUTE_SHARES: `{item}` is not `<device>:<percent>` with a device below \
                     {DEVICES_MAX} and a percentage of 0..=100, e.g. `0:70`"
                ))
            };
            let (device, pct) = item.split_once(':').ok_or_else(bad)?;
            let device: usize = device.trim().parse().map_err(|_| bad())?;
            let pct: u32 = pct
                .trim()
                .trim_end_matches('%')
                .parse()
                .map_err(|_| bad())?;
            if device >= DEVICES_MAX || pct > 100 {
                return Err(bad());
            }
            // 0 means "no share configured": not gated.
            shares_pct[device] = (pct > 0).then_some(pct);
        }
        if shares_pct.iter().all(Option::is_none) {
            return Ok(None);
        }
        let flag = |name: &str, default: bool| match get(name).as_deref().map(str::trim) {
            None | Some("") => Ok(default),
            Some("1" | "true") => Ok(true),
            Some("0" | "false") => Ok(false),
            Some(other) => Err(ConfigError(format!("{name}: `{other}` is not 0 or 1"))),
        };
        let priority = match get("VGPU_PRIORITY").as_deref().map(str::trim) {
            None | Some("") => 0,
            Some(v) => v
                .parse::<i32>()
                .ok()
                .filter(|p| (-1000..=1000).contains(p))
                .ok_or_else(|| {
                    ConfigError(format!(
                        "VGPU_PRIORITY: `{v}` is not an integer in -1000..=1000"
                    ))
                })?,
        };
        let quantum_ms = match get("VGPU_COMPUTE_QUANTUM_MS").as_deref().map(str::trim) {
            None | Some("") => 20,
            Some(v) => v
                .parse::<u64>()
                .ok()
                .filter(|q| (1..=1000).contains(q))
                .ok_or_else(|| {
                    ConfigError(format!(
                        "VGPU_COMPUTE_QUANTUM_MS: `{v}` is not a number of milliseconds in 1..=1000"
                    ))
                })?,
        };
        Ok(Some(ComputeConfig {
            tenant,
            shm_dir: get("VGPU_SHM_DIR")
                .filter(|d| !d.trim().is_empty())
                .map_or_else(|| PathBuf::from(SHM_DIR_DEFAULT), PathBuf::from),
            shares_pct,
            burst: flag("VGPU_BURST", false)?,
            guaranteed: flag("VGPU_GUARANTEED", true)?,
            priority,
            quantum_ms,
        }))
    }
}

/// Spatial partitioning (`spatial`): squeezing this tenant onto fewer SMs while a latency tenant
/// is active on the GPU, or marking this tenant as that latency tenant.
///
/// | variable | meaning |
/// | --- | --- |
/// | `VGPU_SPATIAL` | `1`: spatial mode on (default `0`: off, nothing changes) |
/// | `VGPU_LATENCY` | `1`: a latency tenant (never held by turns, stamps the GPU's schedule) |
/// | `VGPU_SPATIAL_HOLD_MS` | how long after a latency launch others stay squeezed (default 50) |
/// | `VGPU_SPATIAL_SMS` | SMs a squeezed tenant keeps (default: all but 28, 8-SM granularity) |
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpatialConfig {
    pub tenant: String,
    pub shm_dir: PathBuf,
    pub latency: bool,
    pub hold_ms: u64,
    /// `None`: the default (`spatial::SMS_RESERVED_DEFAULT` left to the latency tenant).
    pub sms: Option<u32>,
}

/// The longest `VGPU_SPATIAL_HOLD_MS`.
pub const SPATIAL_HOLD_MS_MAX: u64 = 60_000;

impl SpatialConfig {
    /// `Ok(None)` without a tenant or without `VGPU_SPATIAL=1`.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<SpatialConfig>, ConfigError> {
        let Some(tenant) = get("VGPU_TENANT").filter(|t| !t.trim().is_empty()) else {
            return Ok(None);
        };
        let tenant = tenant.trim().to_owned();
        check_tenant_name(&tenant)?;
        let flag = |name: &str| match get(name).as_deref().map(str::trim) {
            None | Some("" | "0" | "false") => Ok(false),
            Some("1" | "true") => Ok(true),
            Some(other) => Err(ConfigError(format!("{name}: `{other}` is not 0 or 1"))),
        };
        if !flag("VGPU_SPATIAL")? {
            return Ok(None);
        }
        let number = |name: &str, range: std::ops::RangeInclusive<u64>| match get(name)
            .as_deref()
            .map(str::trim)
        {
            None | Some("") => Ok(None),
            Some(v) => v
                .parse::<u64>()
                .ok()
                .filter(|n| range.contains(n))
                .map(Some)
                .ok_or_else(|| {
                    ConfigError(format!(
                        "{name}: `{v}` is not a whole number in {}..={}",
                        range.start(),
                        range.end()
                    ))
                }),
        };
        let hold_ms = number("VGPU_SPATIAL_HOLD_MS", 1..=SPATIAL_HOLD_MS_MAX)?.unwrap_or(50);
        let sms = number("VGPU_SPATIAL_SMS", 1..=100_000)?.map(|n| n as u32);
        Ok(Some(SpatialConfig {
            tenant,
            shm_dir: get("VGPU_SHM_DIR")
                .filter(|d| !d.trim().is_empty())
                .map_or_else(|| PathBuf::from(SHM_DIR_DEFAULT), PathBuf::from),
            latency: flag("VGPU_LATENCY")?,
            hold_ms,
            sms,
        }))
    }
}

/// `VGPU_CONTEXT_OVERHEAD`: one size for every device (`640MiB`, `0`), or `<device>:<size>,...`
/// where unlisted devices keep the default.
fn parse_overheads(text: &str) -> Result<[u64; DEVICES_MAX], ConfigError> {
    let bad = |e: String| ConfigError(format!("VGPU_CONTEXT_OVERHEAD: {e}"));
    if !text.contains(':') {
        return Ok([parse_size(text).map_err(bad)?; DEVICES_MAX]);
    }
    let mut overheads = [CONTEXT_OVERHEAD_DEFAULT_BYTES; DEVICES_MAX];
    for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (device, size) = item.split_once(':').ok_or_else(|| {
            bad(format!(
                "`{item}` is not `<device>:<size>`, e.g. `0:640MiB` (or give one size for all)"
            ))
        })?;
        let device = device
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&d| d < DEVICES_MAX)
            .ok_or_else(|| {
                bad(format!(
                    "`{device}` is not a device ordinal below {DEVICES_MAX}"
                ))
            })?;
        overheads[device] = parse_size(size).map_err(bad)?;
    }
    Ok(overheads)
}

/// Tenant names become file names: only DNS-label characters, so no `/` or `..` can sneak in.
fn check_tenant_name(name: &str) -> Result<(), ConfigError> {
    let valid = !name.is_empty()
        && name.len() <= TENANT_NAME_LEN_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && !name.starts_with('-');
    if valid {
        Ok(())
    } else {
        Err(ConfigError(format!(
            "VGPU_TENANT `{name}` is not a valid tenant name (lowercase letters, digits, `-`, `_`; \
             at most {TENANT_NAME_LEN_MAX})"
        )))
    }
}

/// Parses `10GiB`, `512MiB`, `80GB`, `1.5TiB`, `4096` into bytes: binary suffixes (`Ki`, `KiB`,
/// ...) are powers of 1024, decimal ones (`K`, `KB`, ...) powers of 1000, no suffix is bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    if number.is_empty() || number.matches('.').count() > 1 {
        return Err(format!(
            "cannot read the size `{trimmed}`; write e.g. `10GiB`"
        ));
    }
    const KIB: u64 = 1024;
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "ki" | "kib" => KIB,
        "mi" | "mib" => KIB * KIB,
        "gi" | "gib" => KIB * KIB * KIB,
        "ti" | "tib" => KIB * KIB * KIB * KIB,
        other => {
            return Err(format!(
                "the size `{trimmed}` has the unknown unit `{other}`; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
            ));
        }
    };
    let too_large = || format!("the size `{trimmed}` is too large");
    if let Ok(whole) = number.parse::<u64>() {
        return whole.checked_mul(multiplier).ok_or_else(too_large);
    }
    let fractional: f64 = number
        .parse()
        .map_err(|_| format!("cannot read the size `{trimmed}`; write e.g. `10GiB`"))?;
    let bytes = fractional * multiplier as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(too_large());
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<Option<Config>, ConfigError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn sizes_follow_the_api_rules() {
        assert_eq!(parse_size("10GiB"), Ok(10 << 30));
        assert_eq!(parse_size("10Gi"), Ok(10 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size(" 4096 "), Ok(4096));
        assert!(parse_size("10XB").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }

    #[test]
    fn no_tenant_means_pass_through() {
        assert_eq!(config(&[("VGPU_MEMORY_LIMIT", "1GiB")]), Ok(None));
        assert_eq!(config(&[("VGPU_TENANT", " ")]), Ok(None));
    }

    #[test]
    fn per_device_limits_override_the_global_one() {
        let c = config(&[
            ("VGPU_TENANT", "a"),
            ("VGPU_MEMORY_LIMIT", "10GiB"),
            ("VGPU_MEMORY_LIMITS", "1:2GiB, 3:512MiB"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(c.limits_bytes[0], Some(10 << 30));
        assert_eq!(c.limits_bytes[1], Some(2 << 30));
        assert_eq!(c.limits_bytes[3], Some(512 << 20));
        assert_eq!(c.shm_dir, PathBuf::from(SHM_DIR_DEFAULT));
        assert_eq!(c.ledger_path(), PathBuf::from("/dev/shm/vgpu/a.mem"));
        assert_eq!(
            c.context_overhead_bytes,
            [CONTEXT_OVERHEAD_DEFAULT_BYTES; DEVICES_MAX]
        );
    }

    #[test]
    fn context_overhead_is_one_size_or_per_device() {
        let overheads = |value: &str| {
            config(&[("VGPU_TENANT", "a"), ("VGPU_CONTEXT_OVERHEAD", value)])
                .map(|c| c.expect("a tenant").context_overhead_bytes)
        };
        assert_eq!(overheads("0"), Ok([0; DEVICES_MAX]));
        assert_eq!(overheads("512MiB"), Ok([512 << 20; DEVICES_MAX]));
        let listed = overheads("1:0, 3:1GiB").unwrap();
        assert_eq!(listed[0], CONTEXT_OVERHEAD_DEFAULT_BYTES);
        assert_eq!((listed[1], listed[3]), (0, 1 << 30));
        for bad in ["16:1GiB", "x:1GiB", "0:lots", "1GiB,2"] {
            let err = overheads(bad).unwrap_err();
            assert!(err.0.starts_with("VGPU_CONTEXT_OVERHEAD: "), "{err}");
        }
    }

    #[test]
    fn only_listed_devices_are_limited() {
        let c = config(&[("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMITS", "1:1GiB")])
            .unwrap()
            .unwrap();
        assert_eq!(c.limits_bytes[0], None);
        assert_eq!(c.limits_bytes[1], Some(1 << 30));
    }

    fn compute(vars: &[(&str, &str)]) -> Result<Option<ComputeConfig>, ConfigError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        ComputeConfig::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn compute_shares_and_flags_are_read() {
        assert_eq!(compute(&[("VGPU_COMPUTE_SHARES", "0:50")]), Ok(None));
        assert_eq!(compute(&[("VGPU_TENANT", "a")]), Ok(None));
        assert_eq!(
            compute(&[("VGPU_TENANT", "a"), ("VGPU_COMPUTE_SHARES", "0:0")]),
            Ok(None)
        );
        let c = compute(&[
            ("VGPU_TENANT", "a"),
            ("VGPU_COMPUTE_SHARES", "0:70, 2:30%"),
            ("VGPU_BURST", "1"),
            ("VGPU_PRIORITY", "-5"),
            ("VGPU_SHM_DIR", "/tmp/x"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(c.shares_pct[0], Some(70));
        assert_eq!(c.shares_pct[1], None);
        assert_eq!(c.shares_pct[2], Some(30));
        assert!(c.burst && c.guaranteed);
        assert_eq!((c.priority, c.quantum_ms), (-5, 20));
        assert_eq!(c.shm_dir, PathBuf::from("/tmp/x"));
        for vars in [
            vec![("VGPU_COMPUTE_SHARES", "0:101")],
            vec![("VGPU_COMPUTE_SHARES", "16:10")],
            vec![("VGPU_COMPUTE_SHARES", "0=10")],
            vec![("VGPU_COMPUTE_SHARES", "0:10"), ("VGPU_BURST", "yes")],
            vec![("VGPU_COMPUTE_SHARES", "0:10"), ("VGPU_PRIORITY", "5000")],
            vec![
                ("VGPU_COMPUTE_SHARES", "0:10"),
                ("VGPU_COMPUTE_QUANTUM_MS", "0"),
            ],
        ] {
            let mut vars = vars;
            vars.push(("VGPU_TENANT", "a"));
            let err = compute(&vars).unwrap_err();
            assert!(err.0.starts_with("VGPU_"), "{err}");
        }
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        for vars in [
            vec![("VGPU_TENANT", "../etc")],
            vec![("VGPU_TENANT", "A")],
            vec![("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMITS", "0=1GiB")],
            vec![("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMITS", "16:1GiB")],
            vec![("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMITS", "x:1GiB")],
            vec![("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMIT", "lots")],
            vec![("VGPU_TENANT", "a"), ("VGPU_MEMORY_LIMITS", "0:0")],
            vec![("VGPU_TENANT", "a"), ("VGPU_CONTEXT_OVERHEAD", "1QB")],
        ] {
            let err = config(&vars).unwrap_err();
            assert!(err.0.starts_with("VGPU_"), "{err}");
        }
    }

    fn spatial(vars: &[(&str, &str)]) -> Result<Option<SpatialConfig>, ConfigError> {
        let map: std::collections::HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        SpatialConfig::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn spatial_mode_is_opt_in_and_validated() {
        assert_eq!(spatial(&[("VGPU_SPATIAL", "1")]), Ok(None));
        assert_eq!(spatial(&[("VGPU_TENANT", "a")]), Ok(None));
        assert_eq!(
            spatial(&[("VGPU_TENANT", "a"), ("VGPU_SPATIAL", "0")]),
            Ok(None)
        );
        let c = spatial(&[("VGPU_TENANT", "a"), ("VGPU_SPATIAL", "1")])
            .unwrap()
            .unwrap();
        assert!(!c.latency);
        assert_eq!((c.hold_ms, c.sms), (50, None));
        let c = spatial(&[
            ("VGPU_TENANT", "a"),
            ("VGPU_SPATIAL", "1"),
            ("VGPU_LATENCY", "1"),
            ("VGPU_SPATIAL_HOLD_MS", "20"),
            ("VGPU_SPATIAL_SMS", "96"),
        ])
        .unwrap()
        .unwrap();
        assert!(c.latency);
        assert_eq!((c.hold_ms, c.sms), (20, Some(96)));
        for bad in [
            ("VGPU_SPATIAL_HOLD_MS", "0"),
            ("VGPU_SPATIAL_HOLD_MS", "x"),
            ("VGPU_SPATIAL_SMS", "0"),
            ("VGPU_LATENCY", "yes"),
        ] {
            let err = spatial(&[("VGPU_TENANT", "a"), ("VGPU_SPATIAL", "1"), bad]).unwrap_err();
            assert!(err.0.starts_with(bad.0), "{err}");
        }
    }
}
