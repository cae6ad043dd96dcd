//! What a tenant process is told when its CUDA context is lost: a synchronisation returned a
//! fatal error (an illegal address, a failed launch, an MPS client terminated or a server not
//! ready). The driver's error alone does not say whose fault it was. Without MPS it is this
//! process's own (vgpu keeps every tenant in a context of its own: other tenants are
//! unaffected); as an MPS client it may be any client's of the same GPU, since MPS makes its
//! clients one fault domain (`docs/benchmarks.md`, "Fault matrix"). One line, once per process,
//! with what to do.

use crate::sys::CUresult;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// The driver's results after which a context is unusable (`cuda.h`: 700, 714-719, 805-810).
pub fn is_fatal(rc: CUresult) -> bool {
    matches!(rc, 700 | 714..=719 | 805..=810)
}

/// A synchronisation or completion query returned `rc`: a fatal one is explained once.
pub fn sync_failed(rc: CUresult) {
    static TOLD: AtomicBool = AtomicBool::new(false);
    if !is_fatal(rc) || TOLD.swap(true, Relaxed) {
        return;
    }
    let mps = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").is_some();
    crate::log::error(format_args!("{}", message(rc, mps)));
}

fn message(rc: CUresult, mps: bool) -> String {
    if mps {
        format!(
            "this process's CUDA context is lost (CUresult {rc}). It is a client of the node's MPS \
             server, which makes every client of a GPU one fault domain: a fatal fault of any \
             client (another tenant's too) ends them all. Restart the process; the MPS server takes \
             new clients once every client of the faulted one has exited. A tenant that must not \
             share a fault domain runs outside MPS (the agent's `mps_tenants = \"non-latency\"`, \
             the default, keeps latency tenants out)."
        )
    } else {
        format!(
            "this process's CUDA context is lost (CUresult {rc}): a fault of this process's own \
             work (vgpu runs every tenant in a context of its own, so other tenants are not \
             affected). Restart the process."
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fatal_results_are_the_context_losing_ones() {
        for rc in [700, 714, 719, 805, 810] {
            assert!(is_fatal(rc), "{rc}");
        }
        // Not ready, out of memory, invalid value and unknown leave the context usable.
        for rc in [0, 1, 2, 600, 713, 720, 804, 811, 999] {
            assert!(!is_fatal(rc), "{rc}");
        }
    }

    #[test]
    fn the_message_says_whose_fault_it_may_be() {
        assert!(message(700, true).contains("another tenant's too"));
        assert!(message(700, false).contains("other tenants are not affected"));
    }
}
