//! The one boundary macro of this cdylib. Every `extern "C"` body, and every policy step inside
//! a hook, runs inside `ffi_boundary!`: an unwind escaping an `extern "C"` function aborts the host
//! process, and a bug in our accounting must never kill a tenant's training run.

/// Runs `$body`, catching any panic. On a panic it logs once per call site (`$what`) and
/// evaluates `$fallback` instead: for interposed calls that is usually "behave as the real
/// driver would" (fail open), for pure reporting it is the real driver's answer.
macro_rules! ffi_boundary {
    ($what:expr, fallback = $fallback:expr, $body:block) => {{
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| $body)) {
            Ok(value) => value,
            Err(_) => {
                $crate::log::panicked($what);
                $fallback
            }
        }
    }};
}
