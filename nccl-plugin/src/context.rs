//! The CUDA context the plugin's own threads copy GPU memory in (same-host copy workers, TCP
//! stream threads staging GPU buffers): a context of the plugin's own per device, not the
//! application's (`VGPU_NCCL_OWN_CONTEXT`; config.rs says why).

use crate::cuda;
use crate::log::trace;

/// The plugin's own CUDA context on `device`: one per device and process, made at the first GPU
/// copy and kept for the life of the process (a context costs device memory, so the copy threads
/// of all connections share it).
fn own_context(driver: &'static cuda::Cuda, device: i32) -> Result<usize, cuda::CudaError> {
    static CONTEXTS: std::sync::Mutex<Vec<(i32, usize)>> = std::sync::Mutex::new(Vec::new());
    let mut all = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, ctx)) = all.iter().find(|(d, _)| *d == device) {
        return Ok(ctx);
    }
    let ctx = driver.create_context(device)? as usize;
    trace!("copy threads: own context {ctx:#x} on device {device}");
    all.push((device, ctx));
    Ok(ctx)
}

/// Makes current, on the calling thread of the plugin's own (a same-host copy worker or a TCP
/// stream thread), the context its GPU copies for a connection made in the application's
/// context `app` (on `device`) run in: the plugin's own context on that device
/// (`VGPU_NCCL_OWN_CONTEXT`, on by default; config.rs says why), or `app` when that is turned off
/// or the driver refuses a context of ours (with a warning: it can deadlock under lazy loading).
pub(crate) fn enter_copy_context(
    driver: &'static cuda::Cuda,
    app: usize,
    device: i32,
) -> Result<(), cuda::CudaError> {
    let ctx = if crate::net::global().config.own_context {
        own_context(driver, device).unwrap_or_else(|e| {
            // a context of our own can be refused (device memory, an MPS client limit): the
            // application's context still works unless lazy module loading gets in the way
            crate::log::warn!(
                crate::abi::NCCL_NET,
                "GPU copies: no context of our own ({e}); using the application's, which can deadlock while the application loads CUDA modules lazily (set CUDA_MODULE_LOADING=EAGER, or free device memory)"
            );
            app
        })
    } else {
        app
    };
    driver.set_context(ctx as cuda::CUcontext)
}
