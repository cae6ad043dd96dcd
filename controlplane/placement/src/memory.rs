//! Elastic memory's part of placement (issue 17, `docs/design/elastic-memory.md`): a tenant has a
//! memory **request** per GPU, which placement books exactly as a plain memory quota, and a
//! **limit**, up to which it borrows what the GPU has free on the node. Limits are never booked:
//! any number of tenants' limits may add up past a GPU's memory (borrowed memory is given back by
//! swapping to host memory, never by killing), while the requests of the tenants on a GPU never
//! do. So the engine places on requests alone; this module holds the few rules about limits the
//! control plane applies around it. Pure, like the engine.

use crate::units::format_bytes;

/// A limit no GPU of the pool can hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitTooLarge {
    pub limit_bytes: u64,
    /// The largest GPU memory of the pool's nodes; 0 when the pool has no GPU.
    pub largest_gpu_bytes: u64,
}

impl std::fmt::Display for LimitTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the memory limit {} is more than any GPU of the pool has (the largest has {}); give `--memory-limit` at most that",
            format_bytes(self.limit_bytes),
            format_bytes(self.largest_gpu_bytes)
        )
    }
}

impl std::error::Error for LimitTooLarge {}

/// Whether a limit of `limit_bytes` per GPU (0: none, the request is the limit) fits a GPU of a
/// pool whose largest GPU has `largest_gpu_bytes`. A pool without GPUs refuses no limit: the
/// tenant waits for nodes like any other, and its limit is capped where it lands.
pub fn check_limit(limit_bytes: u64, largest_gpu_bytes: u64) -> Result<(), LimitTooLarge> {
    if limit_bytes == 0 || largest_gpu_bytes == 0 || limit_bytes <= largest_gpu_bytes {
        return Ok(());
    }
    Err(LimitTooLarge {
        limit_bytes,
        largest_gpu_bytes,
    })
}

/// What a tenant may hold on one GPU: its limit (`limit_bytes`, 0 = none), never below the
/// slice's booked request and never above the GPU's memory. A limit of 0, or one the GPU cannot
/// exceed the request by, is the request: a hard quota.
pub fn slice_limit(request_bytes: u64, limit_bytes: u64, gpu_memory_bytes: u64) -> u64 {
    let limit = if limit_bytes == 0 {
        request_bytes
    } else {
        limit_bytes.min(gpu_memory_bytes).max(request_bytes)
    };
    assert!(limit >= request_bytes, "a limit covers its request");
    assert!(
        limit == request_bytes || limit <= gpu_memory_bytes,
        "a limit past the request fits the GPU"
    );
    limit
}

/// A sentence for a tenant's placement reasons when it borrows: what is booked and what it may
/// borrow. `None` for a hard quota (`limit_bytes` at most `request_bytes`).
pub fn borrow_note(request_bytes: u64, limit_bytes: u64) -> Option<String> {
    if limit_bytes <= request_bytes {
        return None;
    }
    Some(format!(
        "its memory request {} per GPU is booked; up to its limit {} it borrows what the GPU has free ({} more, not booked, given back by swapping to host memory when others need it)",
        format_bytes(request_bytes),
        format_bytes(limit_bytes),
        format_bytes(limit_bytes - request_bytes)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_limit_must_fit_the_largest_gpu() {
        assert_eq!(check_limit(0, 80 * GIB), Ok(()));
        assert_eq!(check_limit(80 * GIB, 80 * GIB), Ok(()));
        assert_eq!(check_limit(200 * GIB, 0), Ok(()));
        let error = check_limit(90 * GIB, 80 * GIB).unwrap_err();
        assert_eq!(
            error,
            LimitTooLarge {
                limit_bytes: 90 * GIB,
                largest_gpu_bytes: 80 * GIB
            }
        );
        assert_eq!(
            error.to_string(),
            "the memory limit 90GiB is more than any GPU of the pool has (the largest has 80GiB); give `--memory-limit` at most that"
        );
    }

    #[test]
    fn a_slice_limit_lies_between_the_request_and_the_gpu() {
        // No limit: a hard quota, as before limits existed.
        assert_eq!(slice_limit(20 * GIB, 0, 80 * GIB), 20 * GIB);
        assert_eq!(slice_limit(20 * GIB, 60 * GIB, 80 * GIB), 60 * GIB);
        // Capped at a smaller GPU of a mixed pool.
        assert_eq!(slice_limit(20 * GIB, 100 * GIB, 80 * GIB), 80 * GIB);
        // Never below the booked request.
        assert_eq!(slice_limit(20 * GIB, 20 * GIB, 80 * GIB), 20 * GIB);
    }

    #[test]
    fn only_borrowers_get_a_note() {
        assert_eq!(borrow_note(20 * GIB, 20 * GIB), None);
        assert_eq!(borrow_note(20 * GIB, 0), None);
        let note = borrow_note(20 * GIB, 60 * GIB).unwrap();
        assert!(note.contains("request 20GiB per GPU is booked"), "{note}");
        assert!(note.contains("limit 60GiB"), "{note}");
        assert!(note.contains("40GiB more, not booked"), "{note}");
    }
}
