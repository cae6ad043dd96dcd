//! Minimal stderr logging, prefixed `vgpu[pid]:`. `VGPU_LOG=0` silences everything, the default
//! (1) prints errors and refusals, 2 adds debug lines (hook resolution). The level is read once.

use std::io::Write;
use std::sync::OnceLock;

fn level() -> u8 {
    static LEVEL: OnceLock<u8> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        std::env::var(tenant_abi::env::var::LOG)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(1)
    })
}

/// Something the tenant should know about (a refusal, a broken configuration).
pub fn error(message: std::fmt::Arguments<'_>) {
    if level() >= 1 {
        write_line(message);
    }
}

/// Details useful when checking that the hooks are reached.
pub fn debug(message: std::fmt::Arguments<'_>) {
    if level() >= 2 {
        write_line(message);
    }
}

/// A panic was caught at the C boundary: a bug in vgpu, reported, never fatal to the tenant.
pub fn panicked(what: &str) {
    error(format_args!(
        "internal error (panic) in {what}; continuing as the real driver would. Please report this."
    ));
}

/// `eprintln!` panics when stderr is closed; a logger called from a panic fallback must not.
fn write_line(message: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr(), "vgpu[{}]: {message}", std::process::id());
}
