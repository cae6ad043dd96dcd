//! Our `dlsym`, which overrides glibc's in the whole process (the library is preloaded). Needed
//! because `dlsym(dlopen("libcuda.so.1"), "cuX")`, as libcudart and NCCL do, searches only
//! libcuda's scope and would never find the hooks we export.
//!
//! `route` decides: for a name we hook, it asks glibc what the lookup yields and, if that is the
//! real driver's function (or the real NVML's, for the `nvml` hooks of `nvml_exports`), answers
//! with our hook; otherwise (null) glibc answers the call.
//!
//! On x86-64 the exported `dlsym` is a small trampoline that calls `route` and then *jumps* into
//! glibc's `dlsym` with the caller's arguments and return address intact. That matters for
//! `dlsym(RTLD_NEXT, ...)`, which glibc resolves relative to the object that called it: a plain
//! wrapper would make every `RTLD_NEXT` lookup relative to this library, and a library loaded
//! after us that wraps a function with `RTLD_NEXT` would find itself and recurse forever. Other
//! architectures use a plain wrapper and have that caveat (documented in the README).
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_void};

/// Our hook for this lookup, or null to let glibc answer it.
extern "C" fn route(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    ffi_boundary!("dlsym", fallback = std::ptr::null_mut(), {
        if symbol.is_null() || crate::real::in_resolution() {
            return std::ptr::null_mut();
        }
        // SAFETY: dlsym's contract: `symbol` is a NUL-terminated string.
        let name = unsafe { CStr::from_ptr(symbol) };
        if name.to_bytes().starts_with(b"nvml") {
            return route_nvml(handle, name);
        }
        if !name.to_bytes().starts_with(b"cu")
            || crate::exports::hook_by_name(name).is_none()
            || !crate::hooks::enabled()
        {
            return std::ptr::null_mut();
        }
        let found = crate::real::lookup(handle, name);
        if found.is_null() {
            return std::ptr::null_mut();
        }
        match crate::real::driver().and_then(|driver| driver.substitute(found)) {
            Some(hook) => {
                crate::log::debug(format_args!("dlsym({name:?}) -> hook"));
                hook
            }
            None => std::ptr::null_mut(),
        }
    })
}

/// `route` for NVML names: our hook when the lookup yields the real NVML's function.
fn route_nvml(handle: *mut c_void, name: &CStr) -> *mut c_void {
    if crate::nvml_exports::hook_by_name(name).is_none() || !crate::hooks::enabled() {
        return std::ptr::null_mut();
    }
    let found = crate::real::lookup(handle, name);
    if found.is_null() {
        return std::ptr::null_mut();
    }
    match crate::nvml_exports::nvml().and_then(|nvml| nvml.substitute(found)) {
        Some(hook) => {
            crate::log::debug(format_args!("dlsym({name:?}) -> hook"));
            hook
        }
        None => std::ptr::null_mut(),
    }
}

/// Where a lookup that `route` declined goes: glibc's `dlsym` (null if it cannot be found).
extern "C" fn forward_target() -> *mut c_void {
    ffi_boundary!("dlsym", fallback = std::ptr::null_mut(), {
        crate::real::libc_dlsym().map_or(std::ptr::null_mut(), |f| f as *mut c_void)
    })
}

/// # Safety
/// glibc's contract for `dlsym`.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // Keep the two arguments across the calls; three pushes of 8 bytes after the return address
    // leave the stack 16-byte aligned at each `call`, as the SysV ABI requires.
    std::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {route}",
        "test rax, rax",
        "jnz 2f",
        "call {forward_target}",
        "test rax, rax",
        "jz 2f",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "jmp rax",
        "2:",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "ret",
        route = sym route,
        forward_target = sym forward_target,
    )
}

/// # Safety
/// glibc's contract for `dlsym`.
#[cfg(not(target_arch = "x86_64"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let hook = route(handle, symbol);
    if !hook.is_null() {
        return hook;
    }
    match crate::real::libc_dlsym() {
        // SAFETY: glibc's dlsym, called with the caller's arguments under the same contract.
        Some(real) => unsafe { real(handle, symbol) },
        None => std::ptr::null_mut(),
    }
}
