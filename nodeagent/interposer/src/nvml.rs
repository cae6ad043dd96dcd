//! NVML memory queries as the tenant should see them: the policy behind the NVML hooks of
//! `nvml_exports`, pure and unit-tested here.
//!
//! Frameworks size themselves from NVML as well as from CUDA (vLLM reads the GPU's total through
//! `nvmlDeviceGetMemoryInfo`, `torch.cuda.device_memory_used` and monitoring tools read `used`),
//! so a limited device must look the same through both: total = the slice (with elastic memory,
//! the tenant's limit), used = what the tenant's processes hold on it (the ledger, context
//! overheads included), free = what it may still allocate, never more than the GPU really has
//! free (the same rule as `cuMemGetInfo`).
//!
//! NVML names a device by handle, and through it by uuid; the tenant's limits and ledger are per
//! CUDA ordinal as the process sees it. `ordinal_of` maps one to the other: through the CUDA
//! driver when the process has initialised it (authoritative: it is the order CUDA numbers the
//! devices in), otherwise through `CUDA_VISIBLE_DEVICES` when it lists GPU uuids, as
//! `vgpu-agent exec` sets it. A device that maps to no ordinal (outside the slice, or a process
//! that neither initialised CUDA nor lists uuids) is reported as NVML sees it.
//!
//! NVML's process lists (`nvmlDeviceGetComputeRunningProcesses` and its graphics and MPS
//! siblings) name every process on a GPU with its memory; for a limited device a tenant sees only
//! the entries of its own live processes (`own_processes`), answered by NVML's calling convention
//! (`list_answer`) after reading the whole list into a bounded buffer (`next_capacity`).

use std::collections::BTreeSet;

/// Entries of the first read of a process list: more processes than a GPU runs in practice (MPS
/// allows 48 clients per GPU), so one read is the rule.
pub const PROCESS_ENTRIES_START: usize = 1024;
/// The most entries a process list is read into (1.5 MiB of `nvmlProcessInfo_t`); a GPU listing
/// more is answered as NVML answers it.
pub const PROCESS_ENTRIES_MAX: usize = 65_536;
/// Reads of a process list before giving up on a list that keeps growing between them.
pub const PROCESS_LIST_READS_MAX: usize = 4;

/// Memory figures of one device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// What NVML reports for a limited device: total = min(limit, real total), used = the tenant's
/// usage (at most the total), free = min(real free, total − used, what it may still allocate:
/// with elastic memory, past the request only what the GPU has free).
pub fn slice_memory(real: Memory, slice: crate::hooks::Slice) -> Memory {
    assert!(slice.limit_bytes > 0, "a limited device has a limit");
    let total = real.total.min(slice.limit_bytes);
    let used = slice.used_bytes.min(total);
    let shown = Memory {
        total,
        free: real.free.min(total - used).min(slice.allocatable_bytes),
        used,
    };
    assert!(shown.used + shown.free <= shown.total);
    shown
}

/// The entries of a device's process list that a tenant may see: those whose pid is one of its
/// live processes' (`tenant_pids`), in NVML's order. Other tenants' pids and their memory stay
/// hidden, as HAMi-core hides them.
pub fn own_processes<T: Copy>(
    entries: &[T],
    pid_of: impl Fn(&T) -> u32,
    tenant_pids: &BTreeSet<u32>,
) -> Vec<T> {
    let kept: Vec<T> = entries
        .iter()
        .filter(|entry| tenant_pids.contains(&pid_of(entry)))
        .copied()
        .collect();
    assert!(kept.len() <= entries.len());
    kept
}

/// How a process-list query answers its caller, by NVML's convention, once the list is filtered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListAnswer {
    /// `NVML_SUCCESS`: the first `count` entries written, `*infoCount = count`.
    Filled { count: u32 },
    /// `NVML_ERROR_INSUFFICIENT_SIZE`: nothing written, `*infoCount = needed`.
    TooSmall { needed: u32 },
}

/// The answer for `kept` entries when the caller has room for `capacity` (`*infoCount`; `None`:
/// `infos` is null, which has room for none). An empty list succeeds whatever the room, as NVML
/// documents for the count query (`*infoCount = 0`, `infos` null).
pub fn list_answer(kept: usize, capacity: Option<u32>) -> ListAnswer {
    let count = u32::try_from(kept).expect("a process list read into a bounded buffer");
    assert!(kept <= PROCESS_ENTRIES_MAX);
    if count == 0 || count <= capacity.unwrap_or(0) {
        ListAnswer::Filled { count }
    } else {
        ListAnswer::TooSmall { needed: count }
    }
}

/// The room for the next read of a process list after NVML said `needed` entries do not fit in
/// `current`: at least twice as much (the list may grow between reads), at most
/// `PROCESS_ENTRIES_MAX`; `None` once that is reached.
pub fn next_capacity(current: usize, needed: u32) -> Option<usize> {
    assert!(current > 0, "a read has room for at least one entry");
    if current >= PROCESS_ENTRIES_MAX {
        return None;
    }
    let wanted = usize::try_from(needed)
        .unwrap_or(usize::MAX)
        .max(current.saturating_mul(2));
    let next = wanted.min(PROCESS_ENTRIES_MAX);
    assert!(next > current);
    Some(next)
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

    /// A hard quota of `limit` with `used` of it held.
    fn quota(limit: u64, used: u64) -> crate::hooks::Slice {
        crate::hooks::Slice {
            limit_bytes: limit,
            used_bytes: used,
            allocatable_bytes: limit.saturating_sub(used),
        }
    }

    #[test]
    fn a_limited_device_shows_the_slice_and_the_tenants_usage() {
        let real = Memory {
            total: 80 * GIB,
            free: 70 * GIB,
            used: 10 * GIB,
        };
        assert_eq!(
            slice_memory(real, quota(10 * GIB, 3 * GIB)),
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
        assert_eq!(slice_memory(full, quota(10 * GIB, 3 * GIB)).free, 2 * GIB);
        // Usage past the limit (a context charged over it) never shows more used than total.
        let over = slice_memory(real, quota(10 * GIB, 11 * GIB));
        assert_eq!((over.total, over.used, over.free), (10 * GIB, 10 * GIB, 0));
        // A limit larger than the GPU: the GPU's total.
        assert_eq!(slice_memory(real, quota(100 * GIB, 0)).total, 80 * GIB);
        // Applying the view twice changes nothing (NVML calling its own hooked entry points).
        let once = slice_memory(real, quota(10 * GIB, 3 * GIB));
        assert_eq!(slice_memory(once, quota(10 * GIB, 3 * GIB)), once);
        // Elastic memory: the limit is the total, free is what may be allocated now.
        let borrowing = crate::hooks::Slice {
            limit_bytes: 40 * GIB,
            used_bytes: 20 * GIB,
            allocatable_bytes: 5 * GIB,
        };
        assert_eq!(
            slice_memory(real, borrowing),
            Memory {
                total: 40 * GIB,
                free: 5 * GIB,
                used: 20 * GIB
            }
        );
    }

    #[test]
    fn a_process_list_keeps_only_the_tenants_pids_in_nvmls_order() {
        // (pid, bytes), as an nvmlProcessInfo entry carries them.
        let entries = [(40, 1), (7, 2), (41, 3), (40, 4), (9, 5)];
        let tenant: BTreeSet<u32> = [40, 41, 100].into_iter().collect();
        assert_eq!(
            own_processes(&entries, |&(pid, _)| pid, &tenant),
            [(40, 1), (41, 3), (40, 4)]
        );
        assert_eq!(
            own_processes(&entries, |&(pid, _)| pid, &BTreeSet::new()),
            []
        );
        assert_eq!(
            own_processes(&[] as &[(u32, u64)], |&(pid, _)| pid, &tenant),
            []
        );
        // Filtering twice changes nothing (NVML calling its own hooked entry points).
        let once = own_processes(&entries, |&(pid, _)| pid, &tenant);
        assert_eq!(own_processes(&once, |&(pid, _)| pid, &tenant), once);
    }

    #[test]
    fn process_lists_answer_by_nvmls_convention_with_the_filtered_count() {
        use ListAnswer::{Filled, TooSmall};
        // The count query: `*infoCount = 0`, `infos` null.
        assert_eq!(list_answer(3, None), TooSmall { needed: 3 });
        assert_eq!(list_answer(3, Some(0)), TooSmall { needed: 3 });
        assert_eq!(list_answer(0, None), Filled { count: 0 });
        assert_eq!(list_answer(0, Some(0)), Filled { count: 0 });
        // Too small by one, exactly enough, more than enough.
        assert_eq!(list_answer(3, Some(2)), TooSmall { needed: 3 });
        assert_eq!(list_answer(3, Some(3)), Filled { count: 3 });
        assert_eq!(list_answer(3, Some(1024)), Filled { count: 3 });
        // A null buffer has room for nothing, whatever `*infoCount` says.
        assert_eq!(list_answer(1, None), TooSmall { needed: 1 });
    }

    #[test]
    fn process_list_reads_grow_geometrically_up_to_the_bound() {
        assert_eq!(next_capacity(PROCESS_ENTRIES_START, 1500), Some(2048));
        assert_eq!(next_capacity(PROCESS_ENTRIES_START, 5000), Some(5000));
        // NVML claiming no more than we had (the list shrank and grew again): still grows.
        assert_eq!(next_capacity(PROCESS_ENTRIES_START, 3), Some(2048));
        assert_eq!(
            next_capacity(PROCESS_ENTRIES_START, u32::MAX),
            Some(PROCESS_ENTRIES_MAX)
        );
        assert_eq!(next_capacity(40_000, 1), Some(PROCESS_ENTRIES_MAX));
        assert_eq!(next_capacity(PROCESS_ENTRIES_MAX, 70_000), None);
        // The bound is reached within the allowed reads from the start.
        let mut capacity = PROCESS_ENTRIES_START;
        let mut reads = 1;
        while let Some(next) = next_capacity(capacity, u32::MAX) {
            capacity = next;
            reads += 1;
        }
        assert_eq!(capacity, PROCESS_ENTRIES_MAX);
        assert!(reads <= PROCESS_LIST_READS_MAX);
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
