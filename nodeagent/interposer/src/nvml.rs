//! NVML memory queries as the tenant should see them: the policy behind the NVML hooks of
//! `nvml_exports`, pure and unit-tested here.
//!
//! Frameworks size themselves from NVML as well as from CUDA (vLLM reads the GPU's total through
//! `nvmlDeviceGetMemoryInfo`, `torch.cuda.device_memory_used` and monitoring tools read `used`),
//! so a limited device must look the same through both: total = the slice, used = what the
//! tenant's processes hold on it (the ledger, context overheads included), free = the rest, never
//! more than the GPU really has free (the same rule as `cuMemGetInfo`).
//!
//! NVML names a device by handle, and through it by uuid; the tenant's limits and ledger are per
//! CUDA ordinal as the process sees it. `ordinal_of` maps one to the other: through the CUDA
//! driver when the process has initialised it (authoritative: it is the order CUDA numbers the
//! devices in), otherwise through `CUDA_VISIBLE_DEVICES` when it lists GPU uuids, as
//! `vgpu-agent exec` sets it. A device that maps to no ordinal (outside the slice, or a process
//! that neither initialised CUDA nor lists uuids) is reported as NVML sees it.

/// Memory figures of one device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// What NVML reports for a limited device: total = min(limit, real total), used = the tenant's
/// usage (at most the total), free = min(real free, total − used).
pub fn slice_memory(real: Memory, limit_bytes: u64, used_bytes: u64) -> Memory {
    assert!(limit_bytes > 0, "a limited device has a limit");
    let total = real.total.min(limit_bytes);
    let used = used_bytes.min(total);
    let shown = Memory {
        total,
        free: real.free.min(total - used),
        used,
    };
    assert!(shown.used + shown.free <= shown.total);
    shown
}

/// The CUDA ordinal of the GPU `uuid` (`GPU-...`, as NVML prints it), from the uuids of the CUDA
/// ordinals when the driver can list them, else from `CUDA_VISIBLE_DEVICES`.
pub fn ordinal_of(
    uuid: &str,
    cuda_uuids: Option<&[String]>,
    visible_devices: Option<&str>,
) -> Option<usize> {
    match cuda_uuids {
        Some(uuids) => uuids.iter().position(|u| u.eq_ignore_ascii_case(uuid)),
        None => ordinal_in_visible_devices(uuid, visible_devices?),
    }
}

/// The position of `uuid` in a `CUDA_VISIBLE_DEVICES` list of GPU uuids, which is its CUDA
/// ordinal. Entries may be unique prefixes (`GPU-8a2f`), as CUDA accepts. An entry that is not a
/// GPU uuid (an index, a MIG device) stops the search: the ordinals of what follows cannot be
/// known without the driver. An empty entry ends the list, as it does for CUDA.
pub fn ordinal_in_visible_devices(uuid: &str, visible_devices: &str) -> Option<usize> {
    let uuid = uuid.to_ascii_lowercase();
    for (ordinal, entry) in visible_devices.split(',').map(str::trim).enumerate() {
        let entry = entry.to_ascii_lowercase();
        if !entry.starts_with("gpu-") || entry.len() <= "gpu-".len() {
            return None;
        }
        if uuid.starts_with(&entry) {
            return Some(ordinal);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_limited_device_shows_the_slice_and_the_tenants_usage() {
        let real = Memory {
            total: 80 * GIB,
            free: 70 * GIB,
            used: 10 * GIB,
        };
        assert_eq!(
            slice_memory(real, 10 * GIB, 3 * GIB),
            Memory {
                total: 10 * GIB,
                free: 7 * GIB,
                used: 3 * GIB
            }
        );
        // The GPU has less free than the slice would allow: free follows the GPU.
        let full = Memory {
            free: 2 * GIB,
            ..real
        };
        assert_eq!(slice_memory(full, 10 * GIB, 3 * GIB).free, 2 * GIB);
        // Usage past the limit (a context charged over it) never shows more used than total.
        let over = slice_memory(real, 10 * GIB, 11 * GIB);
        assert_eq!((over.total, over.used, over.free), (10 * GIB, 10 * GIB, 0));
        // A limit larger than the GPU: the GPU's total.
        assert_eq!(slice_memory(real, 100 * GIB, 0).total, 80 * GIB);
        // Applying the view twice changes nothing (NVML calling its own hooked entry points).
        let once = slice_memory(real, 10 * GIB, 3 * GIB);
        assert_eq!(slice_memory(once, 10 * GIB, 3 * GIB), once);
    }

    #[test]
    fn devices_map_through_cuda_first_then_visible_uuids() {
        let a = "GPU-aaaaaaaa-1111-2222-3333-444444444444";
        let b = "GPU-bbbbbbbb-1111-2222-3333-444444444444";
        let c = "GPU-cccccccc-1111-2222-3333-444444444444";
        let cuda = [b.to_owned(), a.to_owned()];
        assert_eq!(ordinal_of(a, Some(&cuda), Some(a)), Some(1));
        assert_eq!(ordinal_of(c, Some(&cuda), Some(c)), None);
        assert_eq!(ordinal_of(&a.to_uppercase(), Some(&cuda), None), Some(1));
        let visible = format!("{b},{a}");
        assert_eq!(ordinal_of(a, None, Some(&visible)), Some(1));
        assert_eq!(ordinal_of(c, None, Some(&visible)), None);
        assert_eq!(ordinal_of(a, None, None), None);
        // Prefixes, spaces and case as CUDA accepts them.
        assert_eq!(
            ordinal_in_visible_devices(a, " gpu-bbbb , GPU-AAAA"),
            Some(1)
        );
        // Indices cannot be mapped without the driver; nor can what follows them.
        assert_eq!(ordinal_in_visible_devices(a, "0,1"), None);
        assert_eq!(ordinal_in_visible_devices(a, &format!("{b},1,{a}")), None);
        assert_eq!(
            ordinal_in_visible_devices(b, &format!("{b},1,{a}")),
            Some(0)
        );
        assert_eq!(ordinal_in_visible_devices(a, &format!("{b},,{a}")), None);
        assert_eq!(ordinal_in_visible_devices(a, "GPU-"), None);
        assert_eq!(ordinal_in_visible_devices(a, ""), None);
    }
}
