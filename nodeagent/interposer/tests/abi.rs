//! The interposer through its real ABI, without a GPU: `libvgpu_cuda.so` is preloaded into a C
//! program (`abi/probe.c`) linked against a fake driver (`abi/fakecuda.c`, an 80 GiB device that
//! allocates nothing), and every test runs the program as separate processes, the way tenants
//! run. A fake NVML (`abi/fakenvml.c`) sits in a directory of its own, which only the NVML tests
//! put on the library path (`Probe::with_nvml`), with a second build of the probe linked against
//! it. The C files are compiled here with the system `cc`; the interposer is built with cargo.

#[path = "abi/closed_loop.rs"]
mod closed_loop;
#[path = "abi/compute.rs"]
mod compute;
#[path = "abi/elastic.rs"]
mod elastic;
#[path = "abi/nvml.rs"]
mod nvml;
#[path = "abi/overhead.rs"]
mod overhead;
#[path = "abi/progress.rs"]
mod progress;
#[path = "abi/spatial.rs"]
mod spatial;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;
const FAKE_TOTAL: u64 = 80 * GIB;
/// No probe run takes long; past this it is hung (a deadlock is what these tests look for).
const RUN_TIMEOUT: Duration = Duration::from_secs(20);

/// The built pieces: the interposer and a directory with the fake `libcuda.so.1`, the probe and
/// the RTLD_NEXT test library.
struct Kit {
    interposer: PathBuf,
    dir: PathBuf,
}

fn kit() -> &'static Kit {
    static KIT: OnceLock<Kit> = OnceLock::new();
    KIT.get_or_init(|| {
        let profile_dir = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(Path::to_owned))
            .map(|dir| {
                if dir.ends_with("deps") {
                    dir.parent().expect("deps has a parent").to_owned()
                } else {
                    dir
                }
            })
            .expect("the test executable has a directory");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let mut build = Command::new(cargo);
        build.args(["build", "-p", "interposer", "--lib"]);
        if profile_dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build.status().expect("running cargo build");
        assert!(status.success(), "building libvgpu_cuda.so failed");
        let interposer = profile_dir.join("libvgpu_cuda.so");
        assert!(interposer.exists(), "{} is missing", interposer.display());

        let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/abi");
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("abi");
        std::fs::create_dir_all(&dir).expect("creating the build directory");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
        // The output (after "-o") is written under a temporary name and renamed, so concurrent
        // test runs never see a half-written file.
        let compile = |args: &[&str]| {
            let output = args[args.iter().position(|a| *a == "-o").expect("-o") + 1];
            let partial = format!("{output}.{}.tmp", std::process::id());
            let args: Vec<&str> = args
                .iter()
                .map(|a| if *a == output { partial.as_str() } else { a })
                .collect();
            let status = Command::new(&cc)
                .current_dir(&dir)
                .args(&args)
                .status()
                .expect("running cc (install build-essential)");
            assert!(status.success(), "cc {args:?} failed");
            std::fs::rename(dir.join(&partial), dir.join(output)).expect("renaming the output");
        };
        let source = |name: &str| sources.join(name).display().to_string();
        compile(&[
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            "-Wl,-Bsymbolic",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            "libcuda.so.1",
            &source("fakecuda.c"),
            "-lpthread",
        ]);
        // The same fake without the green-context functions (an older driver).
        std::fs::create_dir_all(dir.join("nogreen")).expect("creating nogreen/");
        compile(&[
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            "-DFAKE_NO_GREEN",
            "-Wl,-Bsymbolic",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            "nogreen/libcuda.so.1",
            &source("fakecuda.c"),
            "-lpthread",
        ]);
        // The same fake exporting a copy entry point the interposer does not hold (a driver on
        // which the swap must stay off).
        std::fs::create_dir_all(dir.join("unheld")).expect("creating unheld/");
        compile(&[
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            "-DFAKE_UNHELD_COPY",
            "-Wl,-Bsymbolic",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            "unheld/libcuda.so.1",
            &source("fakecuda.c"),
            "-lpthread",
        ]);
        compile(&[
            "-O1",
            "-Wall",
            "-Werror",
            "-o",
            "probe",
            &source("probe.c"),
            "-L.",
            "-l:libcuda.so.1",
            "-ldl",
        ]);
        // The fake NVML, in a directory of its own (absent from the other tests' library path),
        // and a probe linked against it.
        std::fs::create_dir_all(dir.join("nvml")).expect("creating nvml/");
        compile(&[
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            "-Wl,-Bsymbolic",
            "-Wl,-soname,libnvidia-ml.so.1",
            "-o",
            "nvml/libnvidia-ml.so.1",
            &source("fakenvml.c"),
        ]);
        compile(&[
            "-O1",
            "-Wall",
            "-Werror",
            "-DPROBE_NVML_LINKED",
            "-o",
            "probe_nvml",
            &source("probe.c"),
            "-L.",
            "-Lnvml",
            "-l:libcuda.so.1",
            "-l:libnvidia-ml.so.1",
            "-ldl",
        ]);
        compile(&[
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            "-o",
            "libnextwrap.so",
            &source("nextwrap.c"),
            "-ldl",
        ]);
        Kit { interposer, dir }
    })
}

/// One probe run: its environment and arguments.
struct Probe {
    command: Command,
}

impl Probe {
    /// A probe of `tenant` (none: no `VGPU_TENANT`) with its ledger in `shm`.
    fn new(shm: &Path, tenant: Option<&str>) -> Probe {
        let kit = kit();
        let mut command = Command::new(kit.dir.join("probe"));
        for (name, _) in std::env::vars() {
            if name.starts_with("VGPU_") || name.starts_with("FAKE_CUDA_") {
                command.env_remove(name);
            }
        }
        // No context overhead unless a test asks for it: the figures these tests expect are
        // the allocations alone (the default overhead has tests of its own).
        command
            .env("LD_LIBRARY_PATH", &kit.dir)
            .env("LD_PRELOAD", &kit.interposer)
            .env("VGPU_REAL_LIBCUDA", kit.dir.join("libcuda.so.1"))
            .env("VGPU_CONTEXT_OVERHEAD", "0")
            .env("VGPU_SHM_DIR", shm)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(tenant) = tenant {
            command.env("VGPU_TENANT", tenant);
        }
        Probe { command }
    }

    fn env(mut self, name: &str, value: impl AsRef<std::ffi::OsStr>) -> Probe {
        self.command.env(name, value);
        self
    }

    fn env_remove(mut self, name: &str) -> Probe {
        self.command.env_remove(name);
        self
    }

    /// The fake NVML on the library path, and the probe build linked against it.
    fn with_nvml(self) -> Probe {
        let kit = kit();
        let mut probe = Probe {
            command: Command::new(kit.dir.join("probe_nvml")),
        };
        let inherited = self
            .command
            .get_envs()
            .map(|(k, v)| (k.to_owned(), v.map(ToOwned::to_owned)));
        for (name, value) in inherited {
            match value {
                Some(value) => probe.command.env(name, value),
                None => probe.command.env_remove(name),
            };
        }
        probe
            .command
            .env(
                "LD_LIBRARY_PATH",
                format!("{}:{}", kit.dir.join("nvml").display(), kit.dir.display()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        probe
    }

    /// Runs `script` to completion; returns stdout. Fails on a hang, a crash or a bad exit.
    fn run(mut self, script: &str) -> String {
        let mut child = self
            .command
            .args(script.split_whitespace())
            .spawn()
            .expect("starting the probe");
        let deadline = Instant::now() + RUN_TIMEOUT;
        let status = loop {
            if let Some(status) = child.try_wait().expect("waiting for the probe") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the probe `{script}` hung for {RUN_TIMEOUT:?} (deadlock?)");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let output = child
            .wait_with_output()
            .expect("reading the probe's output");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(
            status.success(),
            "the probe `{script}` failed ({status}):\n{stdout}\n{stderr}"
        );
        stdout
    }

    /// Runs `script` followed by `hold` and returns once the probe holds its allocations.
    fn hold(self, script: &str) -> Holder {
        let mut holder = self.start_holding(script);
        holder.wait_held();
        holder
    }

    /// Starts `script` followed by `hold`; `Holder::wait_held` waits for it to get there.
    fn start_holding(mut self, script: &str) -> Holder {
        let mut child = self
            .command
            .args(script.split_whitespace())
            .arg("hold")
            .spawn()
            .expect("starting the probe");
        let stdout = child.stdout.take().expect("piped stdout");
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Holder {
            child,
            lines,
            output: String::new(),
        }
    }
}

/// A probe process that holds its allocations until killed.
struct Holder {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    /// What it printed before "holding".
    output: String,
}

impl Holder {
    fn wait_held(&mut self) {
        self.wait_for_line("holding");
    }

    /// Waits until the probe prints `wanted` (the lines before it go to `output`).
    fn wait_for_line(&mut self, wanted: &str) {
        loop {
            match self.lines.recv_timeout(RUN_TIMEOUT) {
                Ok(line) if line == wanted => return,
                Ok(line) => {
                    self.output.push_str(&line);
                    self.output.push('\n');
                }
                Err(e) => panic!(
                    "the probe never printed {wanted:?} ({e}); it printed:\n{}",
                    self.output
                ),
            }
        }
    }

    /// `kill -9`, leaving it a zombie (not yet reaped) as a crashed process briefly is.
    fn kill_without_reaping(&mut self) {
        self.child.kill().expect("kill -9");
        let proc = PathBuf::from(format!("/proc/{}/stat", self.child.id()));
        let deadline = Instant::now() + RUN_TIMEOUT;
        // Wait for the kernel to finish the kill: the process turns into a zombie.
        loop {
            let stat = std::fs::read_to_string(&proc).unwrap_or_default();
            let state = stat
                .rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().next());
            if state == Some("Z") {
                break;
            }
            assert!(Instant::now() < deadline, "the killed probe did not die");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn shm_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary directory")
}

/// The uuid the fake driver gives its device 0.
const FAKE_UUID: &str = "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae00";

/// The schedule file of the fake's device 0 under `shm`, mapped read-write as the agent maps it.
fn schedule(shm: &Path) -> tenant_abi::writer::Mapping<tenant_abi::compute::Region> {
    let path = tenant_abi::layout::schedule_path(shm, FAKE_UUID);
    tenant_abi::writer::schedule(&path, tenant_abi::compute::QUANTUM_NS_DEFAULT)
        .expect("the schedule file")
}

/// CLOCK_MONOTONIC here (the probes' clock), without starting a process.
#[allow(unsafe_code)]
fn now_ns_fast() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    let result = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    assert_eq!(result, 0, "CLOCK_MONOTONIC");
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// CLOCK_MONOTONIC now, as the probes read it.
fn now_ns(shm: &Path) -> u64 {
    Probe::new(shm, None)
        .run("clock")
        .trim()
        .strip_prefix("clock ")
        .and_then(|v| v.parse().ok())
        .expect("clock <ns>")
}

/// A latency tenant (`vgpuctl place --latency`) as the agent starts it.
fn latency_tenant(shm: &Path) -> Probe {
    Probe::new(shm, Some("inference"))
        .env("VGPU_SPATIAL", "1")
        .env("VGPU_LATENCY", "1")
}

/// The trace a probe printed (its `trace ...` line).
fn trace(out: &str) -> String {
    out.lines()
        .find_map(|line| line.strip_prefix("trace"))
        .expect("a trace line")
        .trim()
        .to_owned()
}

/// The `clock <ns>` lines a probe printed, in order.
fn clocks(out: &str) -> Vec<u64> {
    out.lines()
        .filter_map(|line| line.strip_prefix("clock "))
        .filter_map(|v| v.trim().parse().ok())
        .collect()
}

#[test]
fn the_limit_holds_across_two_processes_of_a_tenant() {
    let shm = shm_dir();
    let first = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "10GiB")
        .hold("alloc 6G");
    assert_eq!(first.output, "alloc 0\n");
    let second = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "10GiB")
        .run("alloc 6G alloc 4G info alloc 1 free alloc 4G");
    assert_eq!(
        second,
        format!(
            "alloc 2\nalloc 0\ninfo 0 0 {}\nalloc 2\nfree 0\nalloc 0\n",
            10 * GIB
        )
    );
    let mode = std::fs::metadata(shm.path().join("a.mem"))
        .expect("the ledger file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn a_killed_process_is_credited_back_without_deadlock() {
    let shm = shm_dir();
    let mut holder = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "10GiB")
        .hold("alloc 6G");
    let refused = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "10GiB")
        .run("alloc 8G");
    assert_eq!(refused, "alloc 2\n");
    holder.kill_without_reaping();
    // The zombie's slot is reclaimed on the way to refusing: the 8 GiB now fit.
    let granted = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "10GiB")
        .run("info alloc 8G info");
    assert_eq!(
        granted,
        format!(
            "info 0 {} {}\nalloc 0\ninfo 0 {} {}\n",
            10 * GIB,
            10 * GIB,
            2 * GIB,
            10 * GIB
        )
    );
    drop(holder);
    // Reaped too: still fine, and the finished process's slot does not count either.
    let again = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "10GiB")
        .run("alloc 10G");
    assert_eq!(again, "alloc 0\n");
}

#[test]
fn other_tenants_and_unconfigured_processes_are_unaffected() {
    let shm = shm_dir();
    let _full = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "10GiB")
        .hold("alloc 10G");
    let other = Probe::new(shm.path(), Some("b"))
        .env("VGPU_MEMORY_LIMIT", "20GiB")
        .run("alloc 20G info alloc 1");
    assert_eq!(other, format!("alloc 0\ninfo 0 0 {}\nalloc 2\n", 20 * GIB));
    // No VGPU_TENANT: the real driver answers everything (the fake's 80 GiB).
    let plain = Probe::new(shm.path(), None).run("alloc 70G info dl_alloc 1G gpa_alloc 1G");
    assert_eq!(
        plain,
        format!(
            "alloc 0\ninfo 0 {} {FAKE_TOTAL}\ndl_alloc 0 lib=libcuda.so.1\ngpa_alloc 0 lib=libcuda.so.1\n",
            10 * GIB
        )
    );
    let mut ledgers: Vec<_> = std::fs::read_dir(shm.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    ledgers.sort();
    assert_eq!(ledgers, ["a.mem", "b.mem"]);
}

#[test]
fn memory_queries_report_the_slice_of_limited_devices_only() {
    let shm = shm_dir();
    let out = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMITS", "0:10GiB")
        .run("info alloc 3G info total 0 total 1 ctx 1 info alloc 75G info");
    assert_eq!(
        out,
        format!(
            "info 0 {ten} {ten}\nalloc 0\ninfo 0 {seven} {ten}\ntotal 0 {ten}\ntotal 0 {FAKE_TOTAL}\n\
             ctx 0\ninfo 0 {FAKE_TOTAL} {FAKE_TOTAL}\nalloc 0\ninfo 0 {five} {FAKE_TOTAL}\n",
            ten = 10 * GIB,
            seven = 7 * GIB,
            five = 5 * GIB,
        )
    );
}

#[test]
fn get_proc_address_and_dlsym_return_the_hooks() {
    let shm = shm_dir();
    let out = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "4GiB")
        .run("gpa_alloc 1G gpa_chain 1G gpa_ptsz 1G dl_alloc 1G alloc 1 info");
    assert_eq!(
        out,
        format!(
            "gpa_alloc 0 lib=libvgpu_cuda.so\ngpa_self lib=libvgpu_cuda.so\n\
             gpa_chain 0 lib=libvgpu_cuda.so\ngpa_ptsz 0 lib=libvgpu_cuda.so\n\
             dl_alloc 0 lib=libvgpu_cuda.so\nalloc 2\ninfo 0 0 {}\n",
            4 * GIB
        )
    );
}

#[test]
fn an_unknown_get_proc_address_answer_is_hooked_by_name() {
    let shm = shm_dir();
    let out = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "1GiB")
        .env("FAKE_CUDA_GPA_THUNKS", "1")
        .run("gpa_alloc 1G alloc 1");
    assert_eq!(out, "gpa_alloc 0 lib=libvgpu_cuda.so\nalloc 2\n");
}

/// Runs `script` in a probe of tenant "a" with `env`; its stdout and stderr.
fn run_with_stderr(shm: &Path, env: &[(&str, &str)], script: &str) -> (String, String) {
    let mut probe = Probe::new(shm, Some("a")).env("VGPU_MEMORY_LIMIT", "1GiB");
    for (name, value) in env {
        probe = probe.env(name, value);
    }
    probe.command.args(script.split_whitespace());
    let output = probe.command.output().expect("running the probe");
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn the_driver_is_checked_at_load_and_mismatches_are_said_not_fatal() {
    let shm = shm_dir();
    // the driver the hooks were written for: nothing to say
    let (out, err) = run_with_stderr(shm.path(), &[], "alloc 1M gpa_alloc 1M");
    assert_eq!(out, "alloc 0\ngpa_alloc 0 lib=libvgpu_cuda.so\n");
    assert!(err.is_empty(), "{err}");
    // a newer driver: a warning, and the limits still hold
    let (out, err) = run_with_stderr(
        shm.path(),
        &[("FAKE_CUDA_DRIVER_VERSION", "14010")],
        "alloc 1M alloc 2G",
    );
    assert_eq!(out, "alloc 0\nalloc 2\n");
    assert_eq!(err.matches("newer than the 13.0").count(), 1, "{err}");
    assert!(err.contains("14.1"), "{err}");
    // a driver whose cuGetProcAddress answers with functions we do not know: named at load, as
    // a warning on a driver of another version, a debug line on the one we were built for (the
    // hook substitutes by name there, and says so when it does)
    let thunks = ("FAKE_CUDA_GPA_THUNKS", "1");
    let (out, err) = run_with_stderr(
        shm.path(),
        &[thunks, ("FAKE_CUDA_DRIVER_VERSION", "14000")],
        "alloc 1M",
    );
    assert_eq!(out, "alloc 0\n");
    assert!(
        err.contains("resolves cuMemAlloc (through cuGetProcAddress)"),
        "{err}"
    );
    let (_, err) = run_with_stderr(shm.path(), &[thunks], "alloc 1M");
    assert!(err.is_empty(), "{err}");
    let (_, err) = run_with_stderr(shm.path(), &[thunks, ("VGPU_LOG", "2")], "alloc 1M");
    assert!(
        err.contains("resolves cuMemAlloc (through cuGetProcAddress)"),
        "{err}"
    );
}

#[test]
fn every_allocation_api_is_charged_and_credited() {
    let shm = shm_dir();
    let limit = 8 * GIB;
    // Pitch 1000 -> 1024 bytes x 1M rows = 1 GiB; arrays of FLOAT x 4 channels (16 bytes):
    // 16384 x 16384 = 4 GiB, 512^3 = 2 GiB.
    let script = "managed 1G async 1G pool 1G gpa_ptsz 1G create 1G pitch 1000 1M info alloc 3G \
                  release free_async free_async free_async free info \
                  array 16384 16384 array3d 512 512 512 alloc 2G destroy destroy info \
                  free info";
    let out = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "8GiB")
        .run(script);
    let expected = [
        "managed 0".to_owned(),
        "async 0".to_owned(),
        "pool 0".to_owned(),
        "gpa_ptsz 0 lib=libvgpu_cuda.so".to_owned(),
        "create 0".to_owned(),
        "pitch 0 1024".to_owned(),
        format!("info 0 {} {limit}", 2 * GIB),
        "alloc 2".to_owned(),
        "release 0".to_owned(),
        "free_async 0".to_owned(),
        "free_async 0".to_owned(),
        "free_async 0".to_owned(),
        "free 0".to_owned(),
        format!("info 0 {} {limit}", 7 * GIB),
        "array 0".to_owned(),
        "array3d 0".to_owned(),
        "alloc 2".to_owned(),
        "destroy 0".to_owned(),
        "destroy 0".to_owned(),
        format!("info 0 {} {limit}", 7 * GIB),
        "free 0".to_owned(),
        format!("info 0 {limit} {limit}"),
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), expected);
}

#[test]
fn context_overhead_is_charged_once_per_device() {
    let shm = shm_dir();
    let out = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "4GiB")
        .env("VGPU_CONTEXT_OVERHEAD", "512MiB")
        .run("alloc 1G alloc 1G info alloc 2G");
    assert_eq!(
        out,
        format!(
            "alloc 0\nalloc 0\ninfo 0 {} {}\nalloc 2\n",
            3 * GIB / 2,
            4 * GIB
        )
    );
}

#[test]
fn the_default_context_overhead_is_charged_when_a_context_is_created() {
    let shm = shm_dir();
    let overhead = 640 << 20;
    let shown = 4 * GIB - overhead;
    // The probe retains device 0's primary context on start: charged before any allocation; a
    // second retain costs nothing; device 1's context is charged when it is created.
    let out = Probe::new(shm.path(), Some("a"))
        .env_remove("VGPU_CONTEXT_OVERHEAD")
        .env("VGPU_MEMORY_LIMIT", "4GiB")
        .run("info retain 0 info ctx 1 info alloc 1G info");
    assert_eq!(
        out,
        format!(
            "info 0 {shown} {four}\nretain 0\ninfo 0 {shown} {four}\nctx 0\ninfo 0 {shown} {four}\n\
             alloc 0\ninfo 0 {} {four}\n",
            shown - GIB,
            four = 4 * GIB,
        )
    );
}

#[test]
fn a_context_that_does_not_fit_in_the_slice_is_refused() {
    let shm = shm_dir();
    let tenant = || {
        Probe::new(shm.path(), Some("a"))
            .env("VGPU_MEMORY_LIMIT", "1GiB")
            .env("VGPU_CONTEXT_OVERHEAD", "400MiB")
    };
    // Two processes' contexts take 800 MiB of the 1 GiB: a third context does not fit on
    // device 0 (the driver is not asked), and fits on device 1.
    let mut first = tenant().hold("");
    let _second = tenant().hold("");
    let out = tenant()
        .env("PROBE_NO_CUDA", "1")
        .run("retain 0 retain 1 info");
    assert_eq!(
        out,
        format!("retain 2\nretain 0\ninfo 0 {} {GIB}\n", GIB - (400 << 20))
    );
    // A dead process's context is credited back; a full slice does not refuse a context that
    // is already paid for.
    first.kill_without_reaping();
    let out = tenant()
        .env("PROBE_NO_CUDA", "1")
        .run("retain 0 info alloc 224M info retain 0 alloc 1");
    assert_eq!(
        out,
        format!(
            "retain 0\ninfo 0 {} {GIB}\nalloc 0\ninfo 0 0 {GIB}\nretain 0\nalloc 2\n",
            GIB - (800 << 20)
        )
    );
}

#[test]
fn a_broken_configuration_refuses_allocations_with_a_message() {
    let shm = shm_dir();
    let mut probe = Probe::new(shm.path(), Some("a")).env("VGPU_MEMORY_LIMIT", "lots");
    probe.command.args(["alloc", "1M", "info"]);
    let output = probe.command.output().expect("running the probe");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stdout,
        format!("alloc 2\ninfo 0 {FAKE_TOTAL} {FAKE_TOTAL}\n")
    );
    assert!(
        stderr.contains("VGPU_MEMORY_LIMIT: cannot read the size `lots`"),
        "{stderr}"
    );
}

#[test]
fn dlsym_rtld_next_stays_relative_to_its_caller() {
    let shm = shm_dir();
    let kit = kit();
    let preload = format!(
        "{} {}",
        kit.interposer.display(),
        kit.dir.join("libnextwrap.so").display()
    );
    let out = Probe::new(shm.path(), Some("a"))
        .env("LD_PRELOAD", preload)
        .run("parent");
    let parent = out
        .strip_prefix("parent ")
        .and_then(|rest| rest.trim().parse::<u32>().ok())
        .expect("parent <pid>");
    assert_eq!(parent, std::process::id() + 1_000_000);
}

#[test]
fn many_processes_racing_never_exceed_the_limit() {
    let shm = shm_dir();
    // Eight processes each try to take 2 GiB twice against a 10 GiB limit, all at once.
    let mut children: Vec<Holder> = (0..8)
        .map(|_| {
            Probe::new(shm.path(), Some("a"))
                .env("VGPU_MEMORY_LIMIT", "10GiB")
                .start_holding("alloc 2G alloc 2G")
        })
        .collect();
    for child in &mut children {
        child.wait_held();
    }
    let granted: usize = children
        .iter()
        .map(|c| c.output.lines().filter(|l| *l == "alloc 0").count())
        .sum();
    assert!(
        (1..=5).contains(&granted),
        "granted {granted} x 2 GiB under a 10 GiB limit"
    );
    let out = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "10GiB")
        .run("info");
    let free = 10 * GIB - granted as u64 * 2 * GIB;
    assert_eq!(out, format!("info 0 {free} {}\n", 10 * GIB));
}

#[test]
fn a_lost_context_is_explained_once_with_whose_fault_it_may_be() {
    let shm = shm_dir();
    let run = |mps: bool| {
        let mut probe = Probe::new(shm.path(), Some("a")).env("FAKE_CUDA_SYNC_RESULT", "700");
        if mps {
            probe = probe.env("CUDA_MPS_PIPE_DIRECTORY", shm.path().join("mps"));
        }
        probe.command.args(["stream_sync", "stream_sync"]);
        let output = probe.command.output().expect("running the probe");
        (
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (stdout, stderr) = run(true);
    // The driver's result reaches the application unchanged, twice; the line comes once.
    assert_eq!(stdout, "stream_sync 700\nstream_sync 700\n");
    assert_eq!(
        stderr.matches("CUDA context is lost").count(),
        1,
        "{stderr}"
    );
    assert!(stderr.contains("another tenant's too"), "{stderr}");
    let (_, stderr) = run(false);
    assert!(
        stderr.contains("other tenants are not affected"),
        "{stderr}"
    );
}

/// Issue 17: with `VGPU_MEMORY_VMM=1` every `cuMemAlloc_v2` is backed by a reserved address
/// range with created and mapped memory (what elastic memory needs to swap it later), charged at
/// its size rounded to the driver's granularity, and undone by `cuMemFree_v2`; without it the
/// driver's own `cuMemAlloc_v2` serves.
#[test]
fn vmm_backed_allocations_are_charged_rounded_and_undone() {
    const MIB: u64 = 1 << 20;
    let shm = shm_dir();
    let out = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "10GiB")
        .env("VGPU_MEMORY_VMM", "1")
        .run("alloc 3G vmm info alloc 1 info alloc 7G free free vmm info");
    let three = 3 * GIB;
    assert_eq!(
        out,
        format!(
            "alloc 0\nvmm 0 reserved={three} mapped={three}\ninfo 0 {} {ten}\nalloc 0\n\
             info 0 {} {ten}\nalloc 2\nfree 0\nfree 0\nvmm 0 reserved=0 mapped=0\n\
             info 0 {ten} {ten}\n",
            7 * GIB,
            7 * GIB - 2 * MIB,
            ten = 10 * GIB,
        )
    );
    let plain = Probe::new(shm.path(), Some("a"))
        .env("VGPU_MEMORY_LIMIT", "10GiB")
        .run("alloc 1 vmm free");
    assert_eq!(plain, "alloc 0\nvmm 0 reserved=0 mapped=0\nfree 0\n");
}
