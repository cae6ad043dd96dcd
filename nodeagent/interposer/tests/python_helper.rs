//! The Python hint helper's unit tests (`deploy/python/tests`, without torch or a GPU), run with
//! the suite: `vgpu.torch` calls this crate's C exports (`vgpu_memory_*`), so a change to them
//! is checked against its caller here. Skipped, with a line, where `python3` is missing.

use std::path::Path;
use std::process::Command;

#[test]
fn the_python_helpers_unit_tests_pass() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let output = match Command::new("python3")
        .args(["-m", "unittest", "discover", "deploy/python/tests"])
        .current_dir(&root)
        .output()
    {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("SKIPPED: python3 is not installed (.ci/run installs it)");
            return;
        }
        Err(e) => panic!("running python3: {e}"),
    };
    assert!(
        output.status.success(),
        "deploy/python/tests failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
