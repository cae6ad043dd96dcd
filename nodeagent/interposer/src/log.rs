//! Minimal stderr logging, prefixed `vgpu[pid] HH:MM:SS.mmm:` (UTC time of day, so that a
//! tenant's lines can be laid beside the agent's and each other's). `VGPU_LOG=0` silences everything, the default
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
    let _ = writeln!(
        std::io::stderr(),
        "vgpu[{}] {}: {message}",
        std::process::id(),
        time_of_day(std::time::SystemTime::now())
    );
}

/// `at` as UTC `HH:MM:SS.mmm`.
fn time_of_day(at: std::time::SystemTime) -> String {
    let since = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let seconds = since.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60,
        since.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_time_of_day_is_utc_with_milliseconds() {
        let at =
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(86_400_000 * 3 + 3_723_045);
        assert_eq!(super::time_of_day(at), "01:02:03.045");
    }
}
