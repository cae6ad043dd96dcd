//! GPU health for heartbeats: XID errors, volatile ECC counts, throttle reasons, temperature,
//! utilisation, memory in use and the compute processes, per GPU.
//!
//! A [`HealthSource`] samples every GPU; each query is optional (a GPU or driver that does not
//! support one lists it in `unsupported`, which is not an error). Two sources:
//!
//! * [`nvml::NvmlHealth`] on real GPUs: XIDs come from an NVML event set that is polled with a
//!   zero timeout at each sample (never blocking), the rest from plain queries;
//! * [`SimulatedHealth`] for `--simulate`: fixed, deterministic values (40 °C + index, nothing
//!   throttled, no ECC or XID errors), which tests change through a JSON file in the state
//!   directory ([`SIMULATED_HEALTH_FILE`]), read at every sample.
//!
//! Sampling runs on the [`crate::monitor`] thread, never on the heartbeat path.

pub mod nvml;

use std::collections::BTreeMap;
use std::path::PathBuf;

use api::v1::GpuHealth;
use serde::Deserialize;

use crate::inventory::Inventory;

/// The file in the state directory through which tests drive simulated health.
pub const SIMULATED_HEALTH_FILE: &str = "simulated-health.json";
/// Largest simulated-health file read (bounded like every state file).
const SIMULATED_HEALTH_BYTES_MAX: u64 = 1 << 20;

/// Query names as they appear in `GpuHealth.unsupported`.
pub const QUERIES: [&str; 7] = [
    "xid",
    "ecc",
    "throttle",
    "temperature",
    "utilization",
    "memory",
    "processes",
];

/// Samples the health of every GPU of the node.
pub trait HealthSource {
    /// One entry per GPU, in index order. Must not block for long: it runs once per heartbeat
    /// interval.
    fn sample(&mut self) -> Vec<GpuHealth>;
}

/// Names of NVML's clock throttle reason bits (`nvmlClocksThrottleReason*`), the idle bit left
/// out. Unknown bits are named by their value.
pub fn throttle_reason_names(bits: u64) -> Vec<String> {
    const NAMES: [(u64, &str); 8] = [
        (0x2, "applications_clocks_setting"),
        (0x4, "sw_power_cap"),
        (0x8, "hw_slowdown"),
        (0x10, "sync_boost"),
        (0x20, "sw_thermal_slowdown"),
        (0x40, "hw_thermal_slowdown"),
        (0x80, "hw_power_brake_slowdown"),
        (0x100, "display_clock_setting"),
    ];
    const GPU_IDLE: u64 = 0x1;
    let mut names = Vec::new();
    let mut rest = bits & !GPU_IDLE;
    for (bit, name) in NAMES {
        if rest & bit != 0 {
            names.push(name.to_owned());
            rest &= !bit;
        }
    }
    while rest != 0 {
        let bit = rest & rest.wrapping_neg();
        names.push(format!("0x{bit:x}"));
        rest &= !bit;
    }
    names
}

/// Made-up values a test may set for one simulated GPU (by index) in [`SIMULATED_HEALTH_FILE`].
/// Every field is optional; `unsupported` names queries to report as unsupported.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimulatedGpu {
    pub xid_errors: Option<u64>,
    pub last_xid: Option<u32>,
    pub ecc_corrected: Option<u64>,
    pub ecc_uncorrected: Option<u64>,
    pub throttle_reasons: Option<Vec<String>>,
    pub temperature_celsius: Option<u32>,
    pub utilization_percent: Option<u32>,
    /// The GPU's memory that is not free (NVML's total less free: allocations, the driver's
    /// reservation and the CUDA contexts), as `nvidia-smi` shows it.
    pub memory_used_bytes: Option<u64>,
    #[serde(default)]
    pub unsupported: Vec<String>,
}

/// Health of simulated GPUs.
#[derive(Debug)]
pub struct SimulatedHealth {
    gpus: Vec<(String, u32)>,
    overrides: PathBuf,
    /// When the XID count last grew, per GPU index (the simulated "time of the last XID").
    last_xid: BTreeMap<u32, (u64, i64)>,
}

impl SimulatedHealth {
    /// `state_dir` holds the optional [`SIMULATED_HEALTH_FILE`].
    pub fn new(inventory: &Inventory, state_dir: &std::path::Path) -> SimulatedHealth {
        SimulatedHealth {
            gpus: inventory
                .gpus
                .iter()
                .map(|gpu| (gpu.uuid.clone(), gpu.index))
                .collect(),
            overrides: state_dir.join(SIMULATED_HEALTH_FILE),
            last_xid: BTreeMap::new(),
        }
    }

    fn read_overrides(&self) -> BTreeMap<u32, SimulatedGpu> {
        use std::io::Read;
        let Ok(file) = std::fs::File::open(&self.overrides) else {
            return BTreeMap::new();
        };
        let mut text = String::new();
        if let Err(error) = file
            .take(SIMULATED_HEALTH_BYTES_MAX)
            .read_to_string(&mut text)
        {
            tracing::warn!("cannot read {}: {error}", self.overrides.display());
            return BTreeMap::new();
        }
        match serde_json::from_str(&text) {
            Ok(overrides) => overrides,
            Err(error) => {
                tracing::warn!(
                    "ignoring {}: {error}; write an object of GPU index to fields, e.g. {{\"0\": {{\"last_xid\": 79, \"xid_errors\": 1}}}}",
                    self.overrides.display()
                );
                BTreeMap::new()
            }
        }
    }
}

impl HealthSource for SimulatedHealth {
    fn sample(&mut self) -> Vec<GpuHealth> {
        let overrides = self.read_overrides();
        let now = crate::monitor::unix_ms();
        let mut entries = Vec::with_capacity(self.gpus.len());
        for (uuid, index) in &self.gpus {
            let set = overrides.get(index).cloned().unwrap_or_default();
            let mut health = api::usage::empty_health(uuid, *index);
            health.xid_errors = set.xid_errors.unwrap_or(0);
            health.last_xid = set.last_xid.unwrap_or(0);
            if health.xid_errors > 0 {
                let seen = self.last_xid.entry(*index).or_insert((0, now));
                if seen.0 != health.xid_errors {
                    *seen = (health.xid_errors, now);
                }
                health.last_xid_unix_ms = seen.1;
            }
            health.ecc_corrected = Some(set.ecc_corrected.unwrap_or(0));
            health.ecc_uncorrected = Some(set.ecc_uncorrected.unwrap_or(0));
            health.throttle_reasons = set.throttle_reasons.unwrap_or_default();
            health.temperature_celsius = Some(set.temperature_celsius.unwrap_or(40 + index));
            health.utilization_percent = Some(set.utilization_percent.unwrap_or(0));
            health.memory_used_bytes = Some(set.memory_used_bytes.unwrap_or(0));
            for query in &set.unsupported {
                mark_unsupported(&mut health, query);
            }
            entries.push(health);
        }
        entries
    }
}

/// Lists `query` as unsupported and clears what it would have filled in.
pub fn mark_unsupported(health: &mut GpuHealth, query: &str) {
    match query {
        "xid" => {
            health.xid_errors = 0;
            health.last_xid = 0;
            health.last_xid_unix_ms = 0;
        }
        "ecc" => {
            health.ecc_corrected = None;
            health.ecc_uncorrected = None;
        }
        "throttle" => health.throttle_reasons.clear(),
        "temperature" => health.temperature_celsius = None,
        "utilization" => health.utilization_percent = None,
        "memory" => health.memory_used_bytes = None,
        "processes" => health.processes.clear(),
        _ => {}
    }
    if !health.unsupported.iter().any(|known| known == query) {
        health.unsupported.push(query.to_owned());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::InventorySource;

    #[test]
    fn throttle_bits_become_names_without_idle() {
        assert!(throttle_reason_names(0).is_empty());
        assert!(
            throttle_reason_names(0x1).is_empty(),
            "idle is not a problem"
        );
        assert_eq!(
            throttle_reason_names(0x1 | 0x4 | 0x40),
            ["sw_power_cap", "hw_thermal_slowdown"]
        );
        assert_eq!(throttle_reason_names(0x1000), ["0x1000"]);
    }

    #[test]
    fn simulated_health_is_deterministic_and_driven_by_the_file() {
        let directory = tempfile::tempdir().unwrap();
        let inventory = InventorySource::from_simulate_arg("2xH100-80GB")
            .unwrap()
            .discover("node-a")
            .unwrap();
        let mut source = SimulatedHealth::new(&inventory, directory.path());
        let first = source.sample();
        assert_eq!(first.len(), 2);
        assert_eq!(first[1].uuid, inventory.gpus[1].uuid);
        assert_eq!(first[1].temperature_celsius, Some(41));
        assert_eq!(first[0].ecc_uncorrected, Some(0));
        assert_eq!(first[0].xid_errors, 0);
        assert!(first[0].unsupported.is_empty());
        assert_eq!(source.sample(), first, "the same values every time");

        std::fs::write(
            directory.path().join(SIMULATED_HEALTH_FILE),
            r#"{"1": {"xid_errors": 2, "last_xid": 79, "ecc_uncorrected": 3,
                      "throttle_reasons": ["hw_slowdown"], "unsupported": ["temperature"]}}"#,
        )
        .unwrap();
        let driven = source.sample();
        assert_eq!(driven[0], first[0]);
        assert_eq!(driven[1].xid_errors, 2);
        assert_eq!(driven[1].last_xid, 79);
        assert!(driven[1].last_xid_unix_ms > 0);
        assert_eq!(driven[1].ecc_uncorrected, Some(3));
        assert_eq!(driven[1].throttle_reasons, ["hw_slowdown"]);
        assert_eq!(driven[1].temperature_celsius, None);
        assert_eq!(driven[1].unsupported, ["temperature"]);

        // A broken file is ignored (logged), not fatal.
        std::fs::write(directory.path().join(SIMULATED_HEALTH_FILE), "{oops").unwrap();
        assert_eq!(source.sample(), first);
    }
}
