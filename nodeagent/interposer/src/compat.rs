//! Whether the loaded driver is one the hooks were written for. Pure: `real::check` asks the
//! driver (its version, its `cuGetProcAddress` answers) and logs what `findings` says.
//!
//! The hooks wrap the driver API entry points of CUDA 13.0 (driver 580). A driver of another
//! major version may resolve an entry point to a version we do not wrap (`cuMemAlloc_v3`): the
//! `cuGetProcAddress` hook still substitutes its hook by name (`exports::hook_by_base_name`),
//! which assumes the signature did not change. Both are said once, at load, so that a tenant
//! on such a driver learns it from its log instead of from a limit that does not hold; nothing
//! is refused and nothing crashes.

/// The CUDA driver API version the hooks were written and tested for (13.0).
pub const BUILT_FOR: i32 = 13_000;
/// The oldest driver API version tested (12.0: `cuGetProcAddress_v2`).
pub const OLDEST_TESTED: i32 = 12_000;

/// The base names (`cuMemAlloc`, `cuLaunchKernel`) of the entry points we wrap, as
/// `cuGetProcAddress` is asked for them: without the `_v2` / `_ptsz` suffixes.
pub fn base_names() -> Vec<String> {
    let mut names: Vec<String> = crate::exports::hooks()
        .iter()
        .filter_map(|(name, _)| name.to_str().ok())
        .map(base_name)
        .filter(|name| !name.starts_with("cuGetProcAddress"))
        .map(str::to_owned)
        .collect();
    names.sort();
    names.dedup();
    names
}

fn base_name(name: &str) -> &str {
    let name = name
        .strip_suffix("_ptsz")
        .or_else(|| name.strip_suffix("_ptds"))
        .unwrap_or(name);
    name.strip_suffix("_v2").unwrap_or(name)
}

/// The versions to ask `cuGetProcAddress` at: the driver's own (what a runtime of its version
/// asks) and the one we were built for (what the runtimes we were tested with ask).
pub fn versions_to_ask(driver: i32) -> Vec<i32> {
    if driver == BUILT_FOR {
        vec![driver]
    } else {
        vec![driver, BUILT_FOR.min(driver)]
    }
}

/// `12.8` for 12080.
fn dotted(version: i32) -> String {
    format!("{}.{}", version / 1000, version % 1000 / 10)
}

/// Whether a finding is for every tenant (`Warn`, the default log level) or for diagnosis
/// (`Debug`, `VGPU_LOG=2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Warn,
    Debug,
}

/// How loud to say `findings`: on the driver we were built for, an unknown `cuGetProcAddress`
/// answer is one the hook substitutes by name at run time (and says so there), so it is a debug
/// line; on any other driver every finding is a warning.
pub fn level(version: Option<i32>) -> Level {
    match version {
        Some(v) if v / 1000 == BUILT_FOR / 1000 && v >= OLDEST_TESTED => Level::Debug,
        _ => Level::Warn,
    }
}

/// What to tell the tenant about this driver: its version `version` (`None`: unreadable) and the
/// base names its `cuGetProcAddress` resolves to functions we do not know (`unknown`).
pub fn findings(version: Option<i32>, unknown: &[String]) -> Vec<String> {
    let mut lines = Vec::new();
    match version {
        None => lines.push(
            "cannot read the CUDA driver's version (cuDriverGetVersion failed); memory and \
             compute limits hold only for the entry points this interposer knows"
                .to_owned(),
        ),
        Some(v) if v / 1000 > BUILT_FOR / 1000 => lines.push(format!(
            "the CUDA driver's API is {}, newer than the {} this interposer was built and tested \
             for: limits hold for the entry points it knows; use a vgpu release built for CUDA {}",
            dotted(v),
            dotted(BUILT_FOR),
            v / 1000
        )),
        Some(v) if v < OLDEST_TESTED => lines.push(format!(
            "the CUDA driver's API is {}, older than the {} this interposer was tested with; \
             upgrade the driver if limits do not hold",
            dotted(v),
            dotted(OLDEST_TESTED)
        )),
        Some(_) => {}
    }
    if !unknown.is_empty() {
        lines.push(format!(
            "the CUDA driver resolves {} (through cuGetProcAddress) to functions this \
             interposer does not know; it puts its hooks in their place by name, which assumes \
             their signatures did not change: check that this vgpu release supports the driver",
            unknown.join(", ")
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_names_strip_versions_and_per_thread_suffixes() {
        assert_eq!(base_name("cuMemAlloc_v2"), "cuMemAlloc");
        assert_eq!(base_name("cuMemcpyDtoDAsync_v2_ptsz"), "cuMemcpyDtoDAsync");
        assert_eq!(base_name("cuLaunchKernel_ptsz"), "cuLaunchKernel");
        assert_eq!(base_name("cuArrayDestroy"), "cuArrayDestroy");
        let names = base_names();
        assert!(names.contains(&"cuMemAlloc".to_owned()), "{names:?}");
        assert!(names.contains(&"cuStreamBeginCapture".to_owned()));
        assert!(
            !names
                .iter()
                .any(|n| n.ends_with("_v2") || n.ends_with("_ptsz"))
        );
        assert!(!names.iter().any(|n| n.starts_with("cuGetProcAddress")));
        assert!(
            names.windows(2).all(|w| w[0] < w[1]),
            "sorted, no duplicates"
        );
    }

    #[test]
    fn the_driver_we_were_built_for_gets_no_finding() {
        assert!(findings(Some(13_000), &[]).is_empty());
        assert!(findings(Some(13_020), &[]).is_empty());
        assert!(findings(Some(12_080), &[]).is_empty());
        assert_eq!(versions_to_ask(13_000), [13_000]);
        assert_eq!(versions_to_ask(14_000), [14_000, 13_000]);
        assert_eq!(versions_to_ask(12_080), [12_080, 12_080]);
    }

    #[test]
    fn only_drivers_of_another_version_make_warnings() {
        assert_eq!(level(Some(13_000)), Level::Debug);
        assert_eq!(level(Some(13_020)), Level::Debug);
        assert_eq!(level(Some(14_000)), Level::Warn);
        assert_eq!(level(Some(12_080)), Level::Warn);
        assert_eq!(level(None), Level::Warn);
    }

    #[test]
    fn other_drivers_and_unknown_answers_are_named() {
        let newer = findings(Some(14_010), &[]);
        assert_eq!(newer.len(), 1);
        assert!(
            newer[0].contains("14.1") && newer[0].contains("13.0"),
            "{newer:?}"
        );
        let older = findings(Some(11_080), &[]);
        assert!(older[0].contains("11.8"), "{older:?}");
        assert!(findings(None, &[])[0].contains("cuDriverGetVersion"));
        let unknown = findings(
            Some(13_000),
            &["cuMemAlloc".into(), "cuLaunchKernel".into()],
        );
        assert_eq!(unknown.len(), 1);
        assert!(
            unknown[0].contains("cuMemAlloc, cuLaunchKernel"),
            "{unknown:?}"
        );
    }
}
