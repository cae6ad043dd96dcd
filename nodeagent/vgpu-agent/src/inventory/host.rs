//! The node's host capacity for tenants: CPU (online CPUs x 1000 millicores) and host memory
//! (`MemTotal` of `/proc/meminfo`), less what the operator reserves for work outside vgpu
//! (`--reserved-cpu`, `--reserved-host-memory`). Registered with the GPUs, so that placement
//! can hold requests' `--cpu` and `--host-memory` against it (issue 19).
//!
//! The parsers are pure ([`parse_cpu_list`], [`parse_mem_total`]); [`read_system`] reads the
//! two files. Simulated nodes get [`simulated`] capacity from their GPUs.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::inventory::GpuInfo;

/// Where the kernel lists the online CPUs (`0-63,128-191`).
pub const ONLINE_CPUS_PATH: &str = "/sys/devices/system/cpu/online";
/// Where the kernel reports the memory (`MemTotal:  131891520 kB`).
pub const MEMINFO_PATH: &str = "/proc/meminfo";
/// CPUs a simulated node has per GPU (an 8-GPU training node has about 128 to 192 cores).
pub const SIMULATED_CPUS_PER_GPU: u64 = 16;
/// Host memory a simulated node has per GPU (an 8-GPU node has 1 to 2 TiB).
pub const SIMULATED_HOST_MEMORY_PER_GPU_BYTES: u64 = 128 << 30;
/// Most CPUs the online list may name; a longer list is not a real one.
const ONLINE_CPUS_MAX: u64 = 1 << 20;

/// What the node offers tenants; 0 means not reported, and placement does not bound it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostResources {
    pub cpu_milli: u64,
    pub memory_bytes: u64,
}

/// What the operator keeps for work outside vgpu (system daemons, CPU-only jobs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostReserve {
    pub cpu_milli: u64,
    pub memory_bytes: u64,
}

impl HostResources {
    /// What is left for tenants after `reserve`. A reserve of all of a reported amount or more
    /// is refused: the node would register as if it had none, which means unbounded. A reserve
    /// of an amount not reported is ignored (there is nothing to subtract it from).
    pub fn less(self, reserve: HostReserve) -> Result<HostResources> {
        type Text = fn(u64) -> String;
        let left = |total: u64, reserved: u64, flag: &'static str, text: Text| {
            if total == 0 || reserved == 0 {
                return Ok(total);
            }
            if reserved >= total {
                return Err(Error::HostReserveTooLarge {
                    flag,
                    reserved: text(reserved),
                    total: text(total),
                });
            }
            Ok(total - reserved)
        };
        let left = HostResources {
            cpu_milli: left(
                self.cpu_milli,
                reserve.cpu_milli,
                "--reserved-cpu",
                api::cpu::format_cpu_milli,
            )?,
            memory_bytes: left(
                self.memory_bytes,
                reserve.memory_bytes,
                "--reserved-host-memory",
                api::size::format_bytes,
            )?,
        };
        assert!(left.cpu_milli <= self.cpu_milli && left.memory_bytes <= self.memory_bytes);
        Ok(left)
    }
}

/// The capacity of a simulated node with these GPUs: [`SIMULATED_CPUS_PER_GPU`] and
/// [`SIMULATED_HOST_MEMORY_PER_GPU_BYTES`] per GPU.
pub fn simulated(gpus: &[GpuInfo]) -> HostResources {
    let count = gpus.len() as u64;
    HostResources {
        cpu_milli: count * SIMULATED_CPUS_PER_GPU * api::cpu::MILLI_PER_CPU,
        memory_bytes: count * SIMULATED_HOST_MEMORY_PER_GPU_BYTES,
    }
}

/// Reads this machine's online CPUs and `MemTotal`. An amount that cannot be read is left at 0
/// (not reported) with a warning: the node still registers, unbounded in that amount.
pub fn read_system() -> HostResources {
    let cpus = std::fs::read_to_string(ONLINE_CPUS_PATH)
        .ok()
        .and_then(|text| parse_cpu_list(&text))
        .or_else(|| {
            std::thread::available_parallelism()
                .ok()
                .map(|count| count.get() as u64)
        });
    let memory = std::fs::read_to_string(MEMINFO_PATH)
        .ok()
        .and_then(|text| parse_mem_total(&text));
    if cpus.is_none() {
        tracing::warn!(
            "cannot read the online CPUs ({ONLINE_CPUS_PATH}); the node registers without a CPU capacity, so requests' --cpu is not bounded on it"
        );
    }
    if memory.is_none() {
        tracing::warn!(
            "cannot read MemTotal ({MEMINFO_PATH}); the node registers without a host memory capacity, so requests' --host-memory is not bounded on it"
        );
    }
    HostResources {
        cpu_milli: cpus.unwrap_or(0) * api::cpu::MILLI_PER_CPU,
        memory_bytes: memory.unwrap_or(0),
    }
}

/// The number of CPUs in a kernel CPU list (`0-63,128-191`, `0`, `0,2,4-7`); `None` when the
/// text is not one.
pub fn parse_cpu_list(text: &str) -> Option<u64> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    let mut count: u64 = 0;
    for range in text.split(',') {
        let (first, last) = match range.split_once('-') {
            Some((first, last)) => (first.trim().parse::<u64>().ok()?, last.trim().parse().ok()?),
            None => {
                let cpu = range.trim().parse::<u64>().ok()?;
                (cpu, cpu)
            }
        };
        if last < first {
            return None;
        }
        count = count.checked_add((last - first).checked_add(1)?)?;
        if count > ONLINE_CPUS_MAX {
            return None;
        }
    }
    Some(count)
}

/// `MemTotal` of `/proc/meminfo`, in bytes (the kernel writes kibibytes as `kB`).
pub fn parse_mem_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|line| line.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => kib.checked_mul(1024),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn online_cpu_lists_are_counted() {
        assert_eq!(parse_cpu_list("0-63\n"), Some(64));
        assert_eq!(parse_cpu_list("0-63,128-191"), Some(128));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0,2,4-7"), Some(6));
        for bad in ["", "a-b", "7-3", "0-", "0-18446744073709551615"] {
            assert_eq!(parse_cpu_list(bad), None, "{bad}");
        }
    }

    #[test]
    fn mem_total_is_read_in_bytes() {
        let meminfo = "MemTotal:       131891520 kB\nMemFree:         1234 kB\n";
        assert_eq!(parse_mem_total(meminfo), Some(131_891_520 * 1024));
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: many kB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: 12 MB\n"), None);
    }

    #[test]
    fn the_reserve_is_subtracted_and_may_not_take_everything() {
        let host = HostResources {
            cpu_milli: 64_000,
            memory_bytes: 512 << 30,
        };
        let reserve = HostReserve {
            cpu_milli: 4_000,
            memory_bytes: 32 << 30,
        };
        assert_eq!(
            host.less(reserve).unwrap(),
            HostResources {
                cpu_milli: 60_000,
                memory_bytes: 480 << 30,
            }
        );
        assert_eq!(host.less(HostReserve::default()).unwrap(), host);
        let all = HostReserve {
            cpu_milli: 64_000,
            memory_bytes: 0,
        };
        let error = host.less(all).unwrap_err().to_string();
        assert!(
            error.contains("--reserved-cpu") && error.contains("64"),
            "{error}"
        );
        let memory = HostReserve {
            cpu_milli: 0,
            memory_bytes: 1 << 40,
        };
        let error = host.less(memory).unwrap_err().to_string();
        assert!(error.contains("--reserved-host-memory"), "{error}");
        // Nothing reported: nothing to subtract from, and still not reported.
        assert_eq!(
            HostResources::default().less(reserve).unwrap(),
            HostResources::default()
        );
    }

    #[test]
    fn simulated_nodes_get_capacity_from_their_gpus() {
        let spec = crate::inventory::simulated::SimulatedSpec::parse("4xH100-80GB").unwrap();
        let inventory = spec.inventory("node-a");
        assert_eq!(
            inventory.host,
            HostResources {
                cpu_milli: 64_000,
                memory_bytes: 512 << 30,
            }
        );
    }
}
