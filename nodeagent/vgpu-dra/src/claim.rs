//! A ResourceClaim's allocation on this node, and the vgpu tenant it becomes. Pure: the claim
//! comes in as the apiserver returned it, the [`TenantAssignment`] goes out.
//!
//! * The tenant is named after the claim ([`tenant_name`]): its name made a DNS label, cut to
//!   leave room, then `-` and the first 8 hex digits of the claim's uid, so two claims of one
//!   name (in two namespaces, or one deleted and made again) are two tenants.
//! * Each allocated device (`status.allocation.devices.results[]` of driver `vgpu.dev`) is one
//!   GPU of this node (device `gpu-<index>`, pool = the node's name). Its consumed capacity
//!   `memory` (bytes) and `compute` (percent) are the tenant's slice of that GPU; a capacity the
//!   scheduler did not record is the whole GPU's (what DRA consumes for a request that names no
//!   capacity of a device without a request policy). Two results on one GPU (two requests of
//!   the claim) add up into one slice.
//! * Every slice is guaranteed and does not burst, priority 0, like `vgpuctl place` without
//!   options.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;
use vgpu_agent::assignments::{SliceAssignment, TenantAssignment};
use vgpu_agent::inventory::{GpuInfo, Inventory};

use crate::error::ClaimError;

/// The driver's name: the DeviceClass, the ResourceSlices' driver, the CDI vendor.
pub const DRIVER_NAME: &str = "vgpu.dev";
/// The consumable capacity in bytes of GPU memory.
pub const CAPACITY_MEMORY: &str = "memory";
/// The consumable capacity in percent of the GPU's compute.
pub const CAPACITY_COMPUTE: &str = "compute";
/// Most devices one claim may hold on this node (every GPU of the largest node twice).
pub const CLAIM_DEVICES_MAX: usize = 2 * vgpu_agent::inventory::MAX_GPUS_PER_NODE;

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

/// One device allocated to the claim on this node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AllocatedDevice {
    /// The claim's request the device serves.
    pub request: String,
    pub pool: String,
    pub device: String,
    /// The consumed capacities as the apiserver wrote them (quantities), by name.
    pub consumed: BTreeMap<String, String>,
}

/// What the scheduler allocated to a claim on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub claim: ClaimRef,
    pub devices: Vec<AllocatedDevice>,
}

/// The device name of GPU `index` in the node's ResourceSlice.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The tenant that claim `claim` becomes (see the module docs). Always a valid tenant name. The
/// rule is `api::names::claim_tenant_name`, which the control plane checks pins against.
pub fn tenant_name(claim: &ClaimRef) -> String {
    api::names::claim_tenant_name(&claim.name, &claim.uid)
}

/// Reads the allocation of `wanted` on node `node` out of the claim the apiserver returned.
pub fn allocation_from_claim(
    claim: &ResourceClaim,
    wanted: &ClaimRef,
    node: &str,
) -> Result<Allocation, ClaimError> {
    let uid = claim.metadata.uid.as_deref().unwrap_or_default();
    if uid != wanted.uid {
        return Err(ClaimError::Replaced {
            claim: wanted.clone(),
            uid: uid.to_owned(),
        });
    }
    let results = claim
        .status
        .as_ref()
        .and_then(|status| status.allocation.as_ref())
        .and_then(|allocation| allocation.devices.as_ref())
        .and_then(|devices| devices.results.as_deref())
        .ok_or_else(|| ClaimError::NotAllocated(wanted.clone()))?;
    let ours = || results.iter().filter(|result| result.driver == DRIVER_NAME);
    // Admin access consumes no capacity, so the claim would be a tenant the scheduler did not
    // count: on a GPU's compute schedule it would take turns from the tenants that were.
    if ours().any(|result| result.admin_access == Some(true)) {
        return Err(ClaimError::AdminAccess(wanted.clone()));
    }
    let devices: Vec<AllocatedDevice> = ours()
        .map(|result| AllocatedDevice {
            request: result.request.clone(),
            pool: result.pool.clone(),
            device: result.device.clone(),
            consumed: result
                .consumed_capacity
                .iter()
                .flatten()
                .map(|(name, quantity)| (name.clone(), quantity.0.clone()))
                .collect(),
        })
        .collect();
    if devices.is_empty() {
        return Err(ClaimError::NoDevices(wanted.clone()));
    }
    if devices.len() > CLAIM_DEVICES_MAX {
        return Err(ClaimError::TooManyDevices {
            claim: wanted.clone(),
            count: devices.len(),
        });
    }
    if let Some(other) = devices.iter().find(|device| device.pool != node) {
        return Err(ClaimError::OtherNode {
            claim: wanted.clone(),
            pool: other.pool.clone(),
            node: node.to_owned(),
        });
    }
    Ok(Allocation {
        claim: wanted.clone(),
        devices,
    })
}

/// The tenant `allocation` becomes on the node of `inventory` (see the module docs).
pub fn assignment(
    allocation: &Allocation,
    inventory: &Inventory,
) -> Result<TenantAssignment, ClaimError> {
    assert!(!allocation.devices.is_empty(), "an allocation has devices");
    let claim = &allocation.claim;
    let mut per_gpu: BTreeMap<u32, (&GpuInfo, u64, u64)> = BTreeMap::new();
    for device in &allocation.devices {
        let gpu = inventory
            .gpus
            .iter()
            .find(|gpu| device_name(gpu.index) == device.device)
            .ok_or_else(|| ClaimError::UnknownDevice {
                claim: claim.clone(),
                device: device.device.clone(),
            })?;
        let capacity = |name: &str, whole: u64| match device.consumed.get(name) {
            None => Ok(whole),
            Some(text) => parse_quantity(text).map_err(|reason| ClaimError::BadCapacity {
                claim: claim.clone(),
                capacity: name.to_owned(),
                value: text.clone(),
                reason,
            }),
        };
        let memory = capacity(CAPACITY_MEMORY, gpu.memory_bytes)?;
        let compute = capacity(CAPACITY_COMPUTE, 100)?;
        let entry = per_gpu.entry(gpu.index).or_insert((gpu, 0, 0));
        entry.1 = entry.1.saturating_add(memory);
        entry.2 = entry.2.saturating_add(compute);
    }
    let mut slices = Vec::with_capacity(per_gpu.len());
    for (index, (gpu, memory_bytes, compute)) in per_gpu {
        if memory_bytes == 0 || memory_bytes > gpu.memory_bytes || compute == 0 || compute > 100 {
            return Err(ClaimError::OutOfRange {
                claim: claim.clone(),
                device: device_name(index),
                memory_bytes,
                compute_percent: compute,
                gpu_memory_bytes: gpu.memory_bytes,
            });
        }
        slices.push(SliceAssignment {
            gpu_index: index,
            gpu_uuid: gpu.uuid.clone(),
            compute_percent: u32::try_from(compute).expect("at most 100"),
            memory_bytes,
            guaranteed: true,
            burst: false,
            memory_limit_bytes: 0,
        });
    }
    let assignment = TenantAssignment {
        tenant: tenant_name(claim),
        priority: 0,
        slices,
        bandwidth_weight: 0,
        latency: false,
        latency_target_us: None,
    };
    assert!(assignment.slices.is_sorted(), "slices are in GPU order");
    assert!(!assignment.slices.is_empty());
    Ok(assignment)
}

/// Reads a Kubernetes quantity that names a whole number: digits, then an optional suffix
/// (`Ki` `Mi` `Gi` `Ti` `Pi` `Ei`, `k` `M` `G` `T` `P` `E`, or an exponent `eN`/`EN`). The
/// apiserver writes consumed capacities in their canonical form, which for our capacities
/// (bytes, percent) is always one of these. Fractions (`1.5Gi`, `500m`) are refused unless they
/// come to a whole number.
pub fn parse_quantity(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    if number.is_empty() || number.len() > 40 {
        return Err("not a number".to_owned());
    }
    // value = mantissa * base^exponent / 10^decimals, computed exactly in u128.
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if fraction.contains('.') {
        return Err("two decimal points".to_owned());
    }
    let digits = format!("{whole}{fraction}");
    let mantissa: u128 = digits.parse().map_err(|_| "not a number".to_owned())?;
    let decimals = u32::try_from(fraction.len()).expect("bounded above");
    let (base, exponent): (u128, u32) = match suffix {
        "" => (10, 0),
        "Ki" => (2, 10),
        "Mi" => (2, 20),
        "Gi" => (2, 30),
        "Ti" => (2, 40),
        "Pi" => (2, 50),
        "Ei" => (2, 60),
        "k" => (10, 3),
        "M" => (10, 6),
        "G" => (10, 9),
        "T" => (10, 12),
        "P" => (10, 15),
        "E" => (10, 18),
        "m" => return milli(mantissa, decimals),
        exponent if exponent.starts_with(['e', 'E']) => {
            let power: u32 = exponent[1..]
                .parse()
                .map_err(|_| format!("unknown suffix `{suffix}`"))?;
            if power > 38 {
                return Err("too large".to_owned());
            }
            (10, power)
        }
        _ => return Err(format!("unknown suffix `{suffix}`")),
    };
    let scaled = mantissa
        .checked_mul(base.checked_pow(exponent).ok_or("too large")?)
        .ok_or("too large")?;
    whole_number(scaled, decimals)
}

fn milli(mantissa: u128, decimals: u32) -> Result<u64, String> {
    whole_number(mantissa, decimals + 3)
}

fn whole_number(scaled: u128, decimals: u32) -> Result<u64, String> {
    let divisor = 10u128.checked_pow(decimals).ok_or("too many decimals")?;
    if !scaled.is_multiple_of(divisor) {
        return Err("not a whole number".to_owned());
    }
    u64::try_from(scaled / divisor).map_err(|_| "too large".to_owned())
}

#[cfg(test)]
#[path = "claim_test.rs"]
mod tests;
