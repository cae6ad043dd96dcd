//! Watching the node's MPS server for fatal faults (issue 15, point 6). MPS makes its clients of a
//! GPU one fault domain: when one faults, the server marks every client of that GPU with a sticky
//! error and refuses new clients ("Server teardown in progress") until all of them have exited. A
//! client that catches the error and lingers (an inference server retrying) thus locks every new
//! tenant process out of MPS on the node.
//!
//! [`Watch`] is the pure core: it reads the server's log lines (`<mps log dir>/server.log`,
//! which the agent's daemon writes) and the clock, and returns [`Action`]s: a warning naming
//! the process that faulted and every client that lost its context (with their tenants where
//! known), and, for clients still alive `grace` after the fault, `terminate_client` through the
//! control daemon so that the server recovers (their contexts are lost already: the driver gives
//! them `CUDA_ERROR_MPS_CLIENT_TERMINATED` instead of the sticky error). [`spawn`] runs it on a
//! thread, tailing the log with a bounded read per poll.
//!
//! The log lines matched (NVIDIA driver 580, H100): `[<time> Server <pid>] Client {PID: <p>,
//! Context: <c>} encountered a fatal GPU error.`, then `The following client process have a sticky
//! error set:` followed by one line per PID, and `Failed to accept client {PID: <p>, ...} with
//! status 807` while it tears down. A driver that words them otherwise leaves the watch silent:
//! nothing is terminated on a guess.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long the clients of a faulted server may linger before they are terminated.
pub const GRACE_DEFAULT: Duration = Duration::from_secs(10);
/// At most this many bytes of the log are read per poll (the rest on the next ones).
const READ_MAX: u64 = 1 << 20;
/// A partial line longer than this is dropped (no log line is that long).
const LINE_MAX: usize = 64 << 10;
/// Clients of one fault followed at most (a GPU has at most 48 MPS clients on Volta and later;
/// more room for several GPUs).
const CLIENTS_MAX: usize = 1024;
/// How often the thread looks at the log.
const POLL: Duration = Duration::from_millis(250);

/// What the watch asks the agent to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Log this, as a warning.
    Warn(String),
    /// Terminate the MPS client `client` of the server `server` (`terminate_client`).
    Terminate { server: u32, client: u32 },
}

/// A fault being handled: the server, the process that faulted, and the clients with a sticky
/// error and when they are due to be terminated if still alive.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fault {
    server: u32,
    culprit: u32,
    sticky: Vec<u32>,
    at: Instant,
    due: Instant,
    reported: bool,
}

/// The pure core; see the module's documentation.
#[derive(Debug)]
pub struct Watch {
    grace: Duration,
    fault: Option<Fault>,
    /// The last line announced the list of clients with a sticky error.
    in_sticky_list: bool,
    refused_reported: bool,
}

impl Watch {
    pub fn new(grace: Duration) -> Watch {
        Watch {
            grace,
            fault: None,
            in_sticky_list: false,
            refused_reported: false,
        }
    }

    /// One line of the server's log, read at `now`.
    pub fn on_line(&mut self, line: &str, now: Instant) -> Vec<Action> {
        let Some((server, text)) = server_line(line) else {
            self.in_sticky_list = false;
            return Vec::new();
        };
        if let Some(culprit) = text
            .strip_suffix("encountered a fatal GPU error.")
            .and_then(client_pid)
        {
            self.fault = Some(Fault {
                server,
                culprit,
                sticky: Vec::new(),
                at: now,
                due: now + self.grace,
                reported: false,
            });
            self.in_sticky_list = false;
            self.refused_reported = false;
            return Vec::new();
        }
        if text.starts_with("The following client process have a sticky error set") {
            self.in_sticky_list = true;
            return Vec::new();
        }
        if self.in_sticky_list {
            if let (Ok(pid), Some(fault)) = (text.trim().parse::<u32>(), self.fault.as_mut()) {
                if fault.sticky.len() < CLIENTS_MAX && !fault.sticky.contains(&pid) {
                    fault.sticky.push(pid);
                }
                return Vec::new();
            }
            self.in_sticky_list = false;
        }
        if text.starts_with("Failed to accept client")
            && text.ends_with("with status 807")
            && !self.refused_reported
            && let Some(fault) = &self.fault
        {
            self.refused_reported = true;
            return vec![Action::Warn(format!(
                "the MPS server refuses new clients while clients of its fault (process {}) are \
                 still alive: {}; they are terminated {:?} after the fault if they do not exit",
                fault.culprit,
                pids(&fault.sticky),
                self.grace
            ))];
        }
        if text.starts_with("Destroy server context") || text.starts_with("Creating server context")
        {
            // Every client of the fault has gone: the server takes new clients again.
            self.fault = None;
        }
        Vec::new()
    }

    /// The clock moved to `now`; `alive` says whether a process still exists, `tenant` names a
    /// process's tenant where known.
    pub fn on_tick(
        &mut self,
        now: Instant,
        alive: impl Fn(u32) -> bool,
        tenant: impl Fn(u32) -> Option<String>,
    ) -> Vec<Action> {
        let Some(fault) = self.fault.as_mut() else {
            return Vec::new();
        };
        let mut actions = Vec::new();
        // Reported once its list of clients has ended (or a second on, if the log went quiet
        // right after the list).
        let listed = !self.in_sticky_list || now >= fault.at + Duration::from_secs(1);
        if !fault.reported && listed {
            fault.reported = true;
            let named = |pid: u32| match tenant(pid) {
                Some(name) => format!("{pid} (tenant {name})"),
                None => pid.to_string(),
            };
            let lost: Vec<String> = fault.sticky.iter().map(|&pid| named(pid)).collect();
            actions.push(Action::Warn(format!(
                "the MPS server {} hit a fatal GPU error of process {}; every client of that GPU \
                 lost its CUDA context: {}. They must restart; new MPS clients are refused until \
                 all of them have exited (those still alive in {:?} are terminated). Tenants that \
                 must not share this fault domain run outside MPS (`mps_tenants`)",
                fault.server,
                named(fault.culprit),
                if lost.is_empty() {
                    "none listed".to_owned()
                } else {
                    lost.join(", ")
                },
                self.grace
            )));
        }
        if now >= fault.due {
            let server = fault.server;
            for client in fault.sticky.drain(..) {
                if alive(client) {
                    actions.push(Action::Terminate { server, client });
                }
            }
        }
        actions
    }
}

/// `[<time> Server <pid>] <text>` -> (pid, text).
fn server_line(line: &str) -> Option<(u32, &str)> {
    let rest = line.strip_prefix('[')?;
    let (head, text) = rest.split_once("] ")?;
    let mut words = head.split_whitespace().rev();
    let pid = words.next()?.parse().ok()?;
    (words.next()? == "Server").then_some((pid, text))
}

/// `Client {PID: <p>, Context: <c>} ` -> p.
fn client_pid(text: &str) -> Option<u32> {
    let rest = text.strip_prefix("Client {PID: ")?;
    let (pid, _) = rest.split_once(',')?;
    pid.trim().parse().ok()
}

fn pids(list: &[u32]) -> String {
    list.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads what was appended to a file since the last call, whole lines at a time; starts at the
/// file's end (faults before the agent started are not its to handle) and starts over when the
/// file was replaced or truncated.
struct Tail {
    path: PathBuf,
    offset: Option<u64>,
    partial: Vec<u8>,
}

impl Tail {
    fn new(path: PathBuf) -> Tail {
        Tail {
            path,
            offset: None,
            partial: Vec::new(),
        }
    }

    fn lines(&mut self) -> Vec<String> {
        let Ok(mut file) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        let Ok(length) = file.metadata().map(|m| m.len()) else {
            return Vec::new();
        };
        let offset = match self.offset {
            None => length,
            Some(offset) if offset > length => 0,
            Some(offset) => offset,
        };
        let mut bytes = Vec::new();
        if file.seek(SeekFrom::Start(offset)).is_err()
            || file.take(READ_MAX).read_to_end(&mut bytes).is_err()
        {
            return Vec::new();
        }
        self.offset = Some(offset + bytes.len() as u64);
        self.partial.extend_from_slice(&bytes);
        let mut lines = Vec::new();
        while let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            lines.push(String::from_utf8_lossy(&line).trim_end().to_owned());
        }
        if self.partial.len() > LINE_MAX {
            self.partial.clear();
        }
        lines
    }
}

/// The tenant of process `pid`, from its `VGPU_TENANT` (readable by the agent, which runs as
/// root where it runs MPS).
fn tenant_of(pid: u32) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let name = tenant_abi::env::var::TENANT;
    environ.split(|&b| b == 0).find_map(|entry| {
        let entry = std::str::from_utf8(entry).ok()?;
        let (key, value) = entry.split_once('=')?;
        (key == name && !value.is_empty()).then(|| value.to_owned())
    })
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Runs the watch on a thread for the daemon of `config`: its server log, polled every 250 ms.
pub fn spawn(config: crate::mps::MpsConfig, grace: Duration) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("mps-watch".into())
        .spawn(move || {
            let mut tail = Tail::new(config.log_dir.join("server.log"));
            let mut watch = Watch::new(grace);
            let mut terminated: BTreeMap<u32, Instant> = BTreeMap::new();
            loop {
                let now = Instant::now();
                let mut actions = Vec::new();
                for line in tail.lines() {
                    actions.extend(watch.on_line(&line, now));
                }
                actions.extend(watch.on_tick(now, alive, tenant_of));
                for action in actions {
                    match action {
                        Action::Warn(message) => tracing::warn!("{message}"),
                        Action::Terminate { server, client } => {
                            terminated.retain(|_, at| now.duration_since(*at) < grace * 6);
                            if terminated.insert(client, now).is_some() {
                                continue;
                            }
                            // Named before: a terminated client may exit at once.
                            let tenant = tenant_of(client).unwrap_or_else(|| "unknown".into());
                            match crate::mps::terminate_client(&config, server, client) {
                                Ok(()) => tracing::warn!(
                                    "terminated MPS client {client} (tenant {tenant}) of the faulted server {server}: it kept a lost context past the grace period"
                                ),
                                Err(e) => tracing::warn!(
                                    "could not terminate MPS client {client} of the faulted server {server}: {e}; new MPS clients are refused until it exits"
                                ),
                            }
                        }
                    }
                }
                std::thread::sleep(POLL);
            }
        })
        .expect("spawning the MPS watch thread")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines of a fault as the H100's server logged it (trimmed to what matters).
    const FAULT: &str = "\
[2026-11-25 16:57:12.067 Server  2878] Status of client {PID: 2747, Context ID: 1} is ACTIVE
[2026-11-25 16:57:15.487 Server  2878] Client {PID: 2748, Context: 1} encountered a fatal GPU error.
[2026-11-25 16:57:15.487 Server  2878] Server is handling a fatal GPU error.
[2026-11-25 16:57:15.487 Server  2878] The following devices will be reset:
[2026-11-25 16:57:15.487 Server  2878] 0
[2026-11-25 16:57:15.487 Server  2878] The following client process have a sticky error set:
[2026-11-25 16:57:15.487 Server  2878] 2748
[2026-11-25 16:57:15.487 Server  2878] 2747
[2026-11-25 16:57:19.942 Server  2878] Client process 2748 disconnected
";
    const REFUSED: &str = "[2026-11-25 16:57:24.356 Server  2878] Failed to accept client {PID: 3033, Context ID: 0} with status 807";
    const RECOVERED: &str = "[2026-11-25 16:57:24.929 Server  2878] Destroy server context on device 0 (NVIDIA H100 80GB HBM3)";

    fn feed(watch: &mut Watch, text: &str, now: Instant) -> Vec<Action> {
        text.lines().flat_map(|l| watch.on_line(l, now)).collect()
    }

    #[test]
    fn a_fault_is_reported_once_and_lingering_clients_are_terminated_after_the_grace() {
        let t0 = Instant::now();
        let mut watch = Watch::new(Duration::from_secs(10));
        assert!(feed(&mut watch, FAULT, t0).is_empty());
        let tenant = |pid: u32| (pid == 2747).then(|| "lat".to_owned());
        let actions = watch.on_tick(t0, |_| true, tenant);
        assert_eq!(actions.len(), 1);
        let Action::Warn(message) = &actions[0] else {
            panic!("{actions:?}")
        };
        assert!(message.contains("process 2748"), "{message}");
        assert!(message.contains("2747 (tenant lat)"), "{message}");
        assert!(
            watch
                .on_tick(t0 + Duration::from_secs(5), |_| true, tenant)
                .is_empty()
        );
        // New clients refused meanwhile: said once.
        assert_eq!(feed(&mut watch, REFUSED, t0).len(), 1);
        assert!(feed(&mut watch, REFUSED, t0).is_empty());
        // After the grace: the faulting process exited, the lingering one is terminated, once.
        let late = t0 + Duration::from_secs(10);
        assert_eq!(
            watch.on_tick(late, |pid| pid == 2747, tenant),
            [Action::Terminate {
                server: 2878,
                client: 2747
            }]
        );
        assert!(watch.on_tick(late, |_| true, tenant).is_empty());
        // Recovered: nothing more.
        assert!(feed(&mut watch, RECOVERED, late).is_empty());
        assert!(watch.on_tick(late, |_| true, tenant).is_empty());
    }

    #[test]
    fn clients_that_exit_within_the_grace_are_left_alone_and_other_lines_do_nothing() {
        let t0 = Instant::now();
        let mut watch = Watch::new(Duration::from_secs(1));
        feed(&mut watch, FAULT, t0);
        feed(&mut watch, RECOVERED, t0);
        assert!(
            watch
                .on_tick(t0 + Duration::from_secs(2), |_| true, |_| None)
                .is_empty()
        );
        // Control lines, garbage, other roles' lines: ignored.
        let mut watch = Watch::new(Duration::from_secs(1));
        for line in [
            "",
            "garbage",
            "[2026-11-25 16:57:24.355 Control  2736] NEW CLIENT 3033 from user 0",
            "[x Server notapid] Client {PID: 1, Context: 1} encountered a fatal GPU error.",
            "[2026-11-25 16:57:15.487 Server  2878] Client {PID: x, Context: 1} encountered a fatal GPU error.",
            REFUSED,
        ] {
            assert!(watch.on_line(line, t0).is_empty(), "{line}");
        }
        assert!(
            watch
                .on_tick(t0 + Duration::from_secs(5), |_| true, |_| None)
                .is_empty()
        );
    }

    #[test]
    fn the_tail_reads_appended_whole_lines_and_starts_over_on_truncation() {
        use std::io::Write;
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("server.log");
        std::fs::write(&path, "before the agent\n").unwrap();
        let mut tail = Tail::new(path.clone());
        assert!(tail.lines().is_empty(), "the old content is not ours");
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        write!(file, "one\ntw").unwrap();
        assert_eq!(tail.lines(), ["one"]);
        writeln!(file, "o").unwrap();
        assert_eq!(tail.lines(), ["two"]);
        std::fs::write(&path, "new\n").unwrap();
        assert_eq!(tail.lines(), ["new"]);
        std::fs::remove_file(&path).unwrap();
        assert!(tail.lines().is_empty());
    }
}
