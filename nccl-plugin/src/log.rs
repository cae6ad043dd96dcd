//! Logging through NCCL's own logger (so `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=NET,TUNING` shows
//! what the plugin does), or to stderr for warnings when NCCL gave none (the test harness).
#![allow(unsafe_code)]

use crate::abi::{NCCL_LOG_INFO, NCCL_LOG_WARN, ncclDebugLogger_t};
use std::ffi::{CString, c_ulong};
use std::sync::Mutex;

static LOGGER: Mutex<ncclDebugLogger_t> = Mutex::new(None);

pub fn set(logger: ncclDebugLogger_t) {
    if logger.is_some() {
        *LOGGER.lock().unwrap_or_else(|e| e.into_inner()) = logger;
    }
}

pub fn emit(level: i32, flags: c_ulong, msg: &str) {
    let logger = *LOGGER.lock().unwrap_or_else(|e| e.into_inner());
    let text = CString::new(format!("vgpu: {msg}").replace('\0', " ")).unwrap_or_default();
    match logger {
        Some(f) => {
            // SAFETY: NCCL's logger is a printf-style function; the format is the constant "%s"
            // and the one argument is a NUL-terminated string that outlives the call.
            unsafe {
                f(
                    level,
                    flags,
                    c"vgpu".as_ptr(),
                    0,
                    c"%s".as_ptr(),
                    text.as_ptr(),
                );
            }
        }
        None if level <= NCCL_LOG_WARN || info_to_stderr() => {
            eprintln!("{}", text.to_string_lossy())
        }
        None => {}
    }
}

/// `VGPU_NCCL_LOG_STDERR=1`: without NCCL's logger (the ABI tests), INFO lines go to stderr
/// too, so a test can see which transport a connection took.
fn info_to_stderr() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var(tenant_abi::env::var::NCCL_LOG_STDERR).is_ok_and(|v| v == "1"))
}

/// `VGPU_NCCL_TRACE=1`: log every control message and copy (debugging a stuck connection).
pub fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var(tenant_abi::env::var::NCCL_TRACE).is_ok_and(|v| v == "1"))
}

macro_rules! trace {
    ($($arg:tt)*) => { if $crate::log::tracing() { $crate::log::emit($crate::abi::NCCL_LOG_INFO, $crate::abi::NCCL_NET, &format!($($arg)*)) } };
}

macro_rules! info {
    ($flags:expr, $($arg:tt)*) => { $crate::log::emit($crate::abi::NCCL_LOG_INFO, $flags, &format!($($arg)*)) };
}
macro_rules! warning {
    ($flags:expr, $($arg:tt)*) => { $crate::log::emit($crate::abi::NCCL_LOG_WARN, $flags, &format!($($arg)*)) };
}
pub(crate) use {info, trace, warning as warn};

#[allow(dead_code)]
const _LEVELS: (i32, i32) = (NCCL_LOG_INFO, NCCL_LOG_WARN);
