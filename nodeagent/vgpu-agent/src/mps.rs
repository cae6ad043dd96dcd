//! Concurrent sharing (`mps = true`): the agent runs NVIDIA's MPS control daemon for the node, so
//! that the kernels of the tenants that are its clients run side by side instead of being
//! time-sliced by the driver, and hands its pipe directory to those tenants' processes
//! ([`MpsTenants`]: by default every tenant but latency tenants, which keep contexts of their own
//! unless `mps_tenants = "all"`).
//!
//! The daemon is started once (`nvidia-cuda-mps-control -d`, with `CUDA_MPS_PIPE_DIRECTORY`
//! `<shm dir>/mps` and `CUDA_MPS_LOG_DIRECTORY` `<state dir>/mps-log`); one that already answers
//! on the pipe directory (an agent restart) is kept. The agent never stops it: quitting it would
//! take the running tenants' MPS server with it, so an agent restart or upgrade leaves tenants
//! running. To stop it: `echo quit | CUDA_MPS_PIPE_DIRECTORY=<shm dir>/mps nvidia-cuda-mps-control`.
//!
//! The price, stated in ARCHITECTURE.md and measured by `tests/gpu/fault_matrix.sh`: MPS puts its
//! clients in one fault domain. A fatal fault of one client (an illegal address; on an H100 even
//! a `kill -9` with kernels in flight) ends every client of that GPU, and new clients are refused
//! until all of them have exited. That is why only tenants that allow it are clients. MPS also
//! serves one Unix user at a time per GPU: run the tenants of an MPS node as one user.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tracing::info;

/// Which tenants of an MPS node run as MPS clients (`mps_tenants`). MPS puts its clients in
/// one fault domain: a fatal fault of one (an illegal address; on an H100 even a `kill -9`
/// with kernels in flight) ends every client of that GPU, and new clients are refused until
/// all of them have exited (docs/benchmarks.md, "Fault matrix"). A latency tenant, whose
/// guarantee is the point, is therefore no client unless the node says so; the others are (the
/// operator chose MPS for the node: multi-rank jobs of one tenant on one GPU need it to run their
/// ranks at once, issue 16).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MpsTenants {
    /// Every tenant but latency tenants: a latency tenant keeps a context of its own
    /// (time-sliced against the MPS server, fault-isolated from its clients, and without the MPS
    /// client's cost on its own steps: 12-40% of p99 on an H100).
    #[default]
    NonLatency,
    /// Every tenant, latency tenants included: they trade fault isolation for running beside
    /// their neighbours (and the SM lever of the closed loop).
    All,
}

impl MpsTenants {
    /// Whether a tenant with these flags runs as an MPS client on an MPS node.
    pub fn joins(self, latency: bool) -> bool {
        match self {
            MpsTenants::All => true,
            MpsTenants::NonLatency => !latency,
        }
    }

    /// Whether latency tenants are MPS clients (then the neighbours' SMs are a lever).
    pub fn latency_tenants_join(self) -> bool {
        self.joins(true)
    }

    pub fn parse(text: &str) -> Result<MpsTenants, String> {
        match text.trim() {
            "non-latency" => Ok(MpsTenants::NonLatency),
            "all" => Ok(MpsTenants::All),
            other => Err(format!(
                "`{other}` is not a choice of MPS tenants: `non-latency` (every tenant but latency tenants, the default) or `all` (latency tenants too, giving up their fault isolation)"
            )),
        }
    }
}

/// The MPS control program, looked up in `PATH` unless configured.
pub const CONTROL_DEFAULT: &str = "nvidia-cuda-mps-control";
/// How long one control command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `terminate_client` may take: it returns once the client's work is torn down, which
/// took 11 s on an H100 for a client of a faulted server.
const TERMINATE_TIMEOUT: Duration = Duration::from_secs(60);

/// Where the daemon lives on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpsConfig {
    /// The control program.
    pub control: PathBuf,
    /// `CUDA_MPS_PIPE_DIRECTORY`, handed to tenants.
    pub pipe_dir: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY`.
    pub log_dir: PathBuf,
    /// Which tenants are its clients.
    pub tenants: MpsTenants,
    /// Whether the closed-loop thread redistributes each GPU's SMs among its burst tenants
    /// (`crate::redistribution`; the agent's `redistribute`, on by default).
    pub redistribute: bool,
}

impl MpsConfig {
    /// The node's daemon under `shm_dir` and `state_dir`.
    pub fn new(
        control: Option<PathBuf>,
        shm_dir: &Path,
        state_dir: &Path,
        tenants: MpsTenants,
    ) -> MpsConfig {
        MpsConfig {
            control: control.unwrap_or_else(|| PathBuf::from(CONTROL_DEFAULT)),
            pipe_dir: pipe_dir(shm_dir),
            log_dir: state_dir.join("mps-log"),
            tenants,
            redistribute: true,
        }
    }
}

/// The pipe directory of the node's daemon under `shm_dir`.
pub fn pipe_dir(shm_dir: &Path) -> PathBuf {
    shm_dir.join("mps")
}

#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error(
        "cannot run the MPS control program `{program}`: {source}; install the NVIDIA driver's MPS tools, set `mps_control` to its path, or turn concurrent sharing off (`mps = false`)"
    )]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("cannot prepare {path} for MPS: {source}")]
    Directory {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "`{program} -d` failed ({status}): {output}; see {log}/control.log, or turn concurrent sharing off (`mps = false`)"
    )]
    Start {
        program: String,
        status: String,
        output: String,
        log: String,
    },
    #[error(
        "`{command}` to the MPS control daemon failed ({status}): {output}; see {log}/control.log"
    )]
    Command {
        command: String,
        status: String,
        output: String,
        log: String,
    },
    #[error("the MPS control program `{program}` did not answer within {limit:?}")]
    Timeout { program: String, limit: Duration },
}

/// What [`ensure_running`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Started {
    /// A daemon already answered on the pipe directory.
    Running,
    /// The agent started one.
    Started,
}

/// Starts the node's MPS control daemon unless one already answers on the pipe directory.
pub fn ensure_running(config: &MpsConfig) -> Result<Started, MpsError> {
    for (path, mode) in [(&config.pipe_dir, 0o755), (&config.log_dir, 0o755)] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(path)
            .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)))
            .map_err(|source| MpsError::Directory {
                path: path.clone(),
                source,
            })?;
    }
    if answers(config)? {
        info!(
            "MPS control daemon already running on {}",
            config.pipe_dir.display()
        );
        return Ok(Started::Running);
    }
    let output = run(config, &["-d"], None)?;
    if !output.status.success() {
        return Err(MpsError::Start {
            program: config.control.display().to_string(),
            status: output.status.to_string(),
            output: String::from_utf8_lossy(&[output.stdout, output.stderr].concat())
                .trim()
                .to_owned(),
            log: config.log_dir.display().to_string(),
        });
    }
    info!(
        "started the MPS control daemon: pipes in {}, logs in {}",
        config.pipe_dir.display(),
        config.log_dir.display()
    );
    Ok(Started::Started)
}

/// Ends the MPS client `client` of the server `server` (`terminate_client`): its CUDA calls then
/// fail with `CUDA_ERROR_MPS_CLIENT_TERMINATED`. For clients whose context a fault already lost
/// (`crate::mps_watch`), so that the server recovers and takes new clients.
pub fn terminate_client(config: &MpsConfig, server: u32, client: u32) -> Result<(), MpsError> {
    let command = format!("terminate_client {server} {client}");
    let output = run_within(
        config,
        &[],
        Some(&format!("{command}\n")),
        TERMINATE_TIMEOUT,
    )?;
    if output.status.success() {
        Ok(())
    } else {
        Err(MpsError::Command {
            command,
            status: output.status.to_string(),
            output: String::from_utf8_lossy(&[output.stdout, output.stderr].concat())
                .trim()
                .to_owned(),
            log: config.log_dir.display().to_string(),
        })
    }
}

/// Whether a daemon answers on the pipe directory (`get_server_list` succeeds).
fn answers(config: &MpsConfig) -> Result<bool, MpsError> {
    if !config.pipe_dir.join("control").exists() {
        return Ok(false);
    }
    Ok(run(config, &[], Some("get_server_list\n"))?
        .status
        .success())
}

/// Runs the control program with the node's directories, feeding `input`, within
/// [`COMMAND_TIMEOUT`].
fn run(
    config: &MpsConfig,
    args: &[&str],
    input: Option<&str>,
) -> Result<std::process::Output, MpsError> {
    run_within(config, args, input, COMMAND_TIMEOUT)
}

fn run_within(
    config: &MpsConfig,
    args: &[&str],
    input: Option<&str>,
    limit: Duration,
) -> Result<std::process::Output, MpsError> {
    let program = config.control.display().to_string();
    let mut child = Command::new(&config.control)
        .args(args)
        .env("CUDA_MPS_PIPE_DIRECTORY", &config.pipe_dir)
        .env("CUDA_MPS_LOG_DIRECTORY", &config.log_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| MpsError::Spawn {
            program: program.clone(),
            source,
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        // A daemon that exits early closes the pipe; its status tells what happened.
        let _ = stdin.write_all(input.unwrap_or_default().as_bytes());
    }
    let deadline = std::time::Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(MpsError::Timeout { program, limit });
            }
        }
    }
    child
        .wait_with_output()
        .map_err(|source| MpsError::Spawn { program, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in for `nvidia-cuda-mps-control` with the real one's contract: `-d` starts a
    /// daemon (here: makes the `control` pipe file) and refuses when one runs; without arguments
    /// it sends stdin's command to the running daemon and fails when none runs. Every call is
    /// logged with its directories.
    fn fake_control(directory: &Path) -> PathBuf {
        let path = directory.join("fake-mps-control");
        std::fs::write(
            &path,
            r#"#!/bin/sh
echo "$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "$CUDA_MPS_LOG_DIRECTORY/calls"
if [ "$1" = "-d" ]; then
  [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] && { echo "An instance of this daemon is already running" >&2; exit 1; }
  : > "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || exit 1
read command; echo "$command" >> "$CUDA_MPS_LOG_DIRECTORY/commands"; exit 0
"#,
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[test]
    fn the_daemon_is_started_once_and_an_answering_one_is_kept() {
        let directory = tempfile::tempdir().unwrap();
        let config = MpsConfig::new(
            Some(fake_control(directory.path())),
            &directory.path().join("shm"),
            &directory.path().join("state"),
            MpsTenants::default(),
        );
        assert_eq!(config.pipe_dir, directory.path().join("shm/mps"));
        assert_eq!(ensure_running(&config).unwrap(), Started::Started);
        // The agent restarts: the daemon answers, so it is kept.
        assert_eq!(ensure_running(&config).unwrap(), Started::Running);
        let calls = std::fs::read_to_string(config.log_dir.join("calls")).unwrap();
        let pipe = config.pipe_dir.display();
        let log = config.log_dir.display();
        assert_eq!(
            calls,
            format!("-d pipe={pipe} log={log}\n pipe={pipe} log={log}\n")
        );
        let commands = std::fs::read_to_string(config.log_dir.join("commands")).unwrap();
        assert_eq!(commands, "get_server_list\n");
    }

    #[test]
    fn a_missing_or_failing_control_program_says_what_to_do() {
        let directory = tempfile::tempdir().unwrap();
        let missing = MpsConfig::new(
            Some(directory.path().join("no-such-program")),
            directory.path(),
            directory.path(),
            MpsTenants::default(),
        );
        let error = ensure_running(&missing).unwrap_err();
        assert!(matches!(error, MpsError::Spawn { .. }), "{error}");
        assert!(error.to_string().contains("mps = false"), "{error}");

        let failing = directory.path().join("failing");
        std::fs::write(&failing, "#!/bin/sh\necho no GPU >&2\nexit 3\n").unwrap();
        std::fs::set_permissions(&failing, std::fs::Permissions::from_mode(0o755)).unwrap();
        let config = MpsConfig::new(
            Some(failing),
            directory.path(),
            directory.path(),
            MpsTenants::default(),
        );
        let error = ensure_running(&config).unwrap_err();
        assert!(error.to_string().contains("no GPU"), "{error}");
    }
}
