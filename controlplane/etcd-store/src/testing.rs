//! `EtcdCluster`: 1 or 3 real `etcd` processes (Debian's `etcd-server`) on free loopback ports in
//! a temporary folder, killed when dropped, for the tests of this crate and of its users
//! (vgpu-cp's tests of the etcd store). Where `etcd` is not installed, `start` prints a SKIPPED
//! line and returns `None`, unless the caller says etcd is required (CI does): then it panics.
//!
//! A library module rather than a test file so that vgpu-cp's tests can start clusters too; it
//! costs the library only `tempfile`. Test code: it panics on failure, by design.

use std::fs::File;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{Entry, EtcdConfig, EtcdLog, TlsPem};
use tokio::time::Instant;

/// How long a member (or, for 3, a quorum) has to answer after it starts.
const READY_BOUND: Duration = Duration::from_secs(30);

/// Bounds the tests' clients use: short, so a lost quorum shows within seconds.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

pub struct EtcdCluster {
    dir: tempfile::TempDir,
    tls: Option<ClusterTls>,
    members: Vec<Member>,
    initial_cluster: String,
}

/// mTLS on the client port: etcd's server certificate and the CA it trusts for clients, and the
/// client material the tests connect with.
pub struct ClusterTls {
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub ca: PathBuf,
    pub client: TlsPem,
}

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl EtcdCluster {
    /// Starts `size` members and waits until every one answers a linearizable read. `None`
    /// (the test skips) where `etcd` is not installed and not `required`.
    pub async fn start(test: &str, size: usize, required: bool) -> Option<EtcdCluster> {
        EtcdCluster::start_with(test, size, None, required).await
    }

    /// `start`, with mTLS on the client port when `tls` is given.
    pub async fn start_with(
        test: &str,
        size: usize,
        tls: Option<ClusterTls>,
        required: bool,
    ) -> Option<EtcdCluster> {
        assert!(size == 1 || size == 3);
        if !etcd_installed(test, required) {
            return None;
        }
        let dir = tempfile::tempdir().expect("a temporary folder");
        let ports = free_ports(2 * size);
        let members: Vec<Member> = (0..size)
            .map(|index| Member {
                name: format!("m{index}"),
                client_port: ports[2 * index],
                peer_port: ports[2 * index + 1],
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|member| format!("{}=http://127.0.0.1:{}", member.name, member.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            dir,
            tls,
            members,
            initial_cluster,
        };
        for index in 0..size {
            cluster.spawn(index);
        }
        let all: Vec<usize> = (0..size).collect();
        cluster.wait_ready(&all).await;
        Some(cluster)
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len())
            .map(|index| self.endpoint(index))
            .collect()
    }

    pub fn endpoint(&self, index: usize) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.members[index].client_port)
    }

    /// A config for all members under `prefix`, with the tests' short bounds.
    pub fn config(&self, prefix: &str) -> EtcdConfig {
        let mut config = EtcdConfig::new(self.endpoints(), prefix);
        config.tls = self.tls.as_ref().map(|tls| tls.client.clone());
        config.connect_timeout = REQUEST_TIMEOUT;
        config.request_timeout = REQUEST_TIMEOUT;
        config
    }

    /// A log under `prefix` claimed for `cluster_id`.
    pub async fn claimed_log(&self, prefix: &str, cluster_id: &str) -> EtcdLog {
        let mut log = EtcdLog::connect(&self.config(prefix))
            .await
            .expect("connect");
        log.claim_cluster(cluster_id).await.expect("claim");
        log
    }

    /// `kill -9` of one member.
    pub fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.members[index].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a killed member again on its data directory and ports.
    pub async fn restart(&mut self, index: usize) {
        assert!(
            self.members[index].child.is_none(),
            "restart a killed member"
        );
        self.spawn(index);
        self.wait_ready(&[index]).await;
    }

    fn spawn(&mut self, index: usize) {
        let member = &self.members[index];
        let data_dir: PathBuf = self.dir.path().join(&member.name);
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{}.log", member.name)))
            .expect("etcd's log file");
        let client_url = self.endpoint(index);
        let member = &self.members[index];
        let peer_url = format!("http://127.0.0.1:{}", member.peer_port);
        let mut command = Command::new("etcd");
        if let Some(tls) = &self.tls {
            command
                .arg("--cert-file")
                .arg(&tls.server_cert)
                .arg("--key-file")
                .arg(&tls.server_key)
                .arg("--trusted-ca-file")
                .arg(&tls.ca)
                .arg("--client-cert-auth");
        }
        let child = command
            .arg("--name")
            .arg(&member.name)
            .arg("--data-dir")
            .arg(&data_dir)
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-state", "new"])
            .args([
                "--initial-cluster-token",
                &self.dir.path().display().to_string(),
            ])
            // Fast elections keep the tests at seconds: loopback has no real latency.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("etcd's log file"))
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.members[index].child = Some(child);
    }

    /// Whether member `index`'s process has exited (a zombie not reaped yet, or gone): it will not
    /// become ready, so waiting for it is pointless.
    fn exited(&self, index: usize) -> bool {
        let Some(child) = &self.members[index].child else {
            return false;
        };
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id()));
        stat.map_or(true, |stat| {
            stat.rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().next())
                == Some("Z")
        })
    }

    /// The last lines of member `index`'s log, for a failure's message.
    fn log_tail(&self, index: usize) -> String {
        let path = self
            .dir
            .path()
            .join(format!("{}.log", self.members[index].name));
        let log = std::fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Polls (bounded by `READY_BOUND`) until each of `members` answers a linearizable read.
    pub async fn wait_ready(&self, members: &[usize]) {
        let deadline = Instant::now() + READY_BOUND;
        for &index in members {
            let mut config = EtcdConfig::new(vec![self.endpoint(index)], "/ready/");
            config.tls = self.tls.as_ref().map(|tls| tls.client.clone());
            config.connect_timeout = Duration::from_millis(500);
            config.request_timeout = Duration::from_millis(500);
            loop {
                match EtcdLog::connect(&config).await {
                    Ok(_) => break,
                    Err(error) if self.exited(index) => panic!(
                        "etcd member {index} exited before it was ready ({error}); the end of its \
                         log:\n{}",
                        self.log_tail(index)
                    ),
                    Err(_) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(error) => panic!(
                        "etcd member {index} not ready within {READY_BOUND:?}: {error}; its log is {}",
                        self.dir.path().join(format!("m{index}.log")).display()
                    ),
                }
            }
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for index in 0..self.members.len() {
            self.kill(index);
        }
    }
}

fn etcd_installed(test: &str, required: bool) -> bool {
    let found = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if found {
        return true;
    }
    assert!(
        !required,
        "{test}: etcd is required here but `etcd` does not run (apt-get install etcd-server)"
    );
    eprintln!(
        "SKIPPED {test}: no `etcd` here (install Debian's etcd-server; .ci/run installs it and \
         makes the tests require it)"
    );
    false
}

/// `count` distinct ports nothing listens on right now, below the kernel's ephemeral range when
/// it leaves room for that (`/proc/sys/net/ipv4/ip_local_port_range`). A port the kernel hands
/// out for `bind(0)` comes from the range it also gives outgoing connections, so a member
/// restarted on its port later (the tests' `kill -9`) could find it taken by some client's
/// connection: etcd exits and the test waits 30 s for nothing ("etcd member 2 not ready within
/// 30s", connection refused, once in a full run on 2 cores). Below the range nothing takes a port
/// unasked. Ports are handed out by one counter per process (tests run as threads), from a start
/// that differs between processes, and each is checked free by binding it.
pub fn free_ports(count: usize) -> Vec<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    if ephemeral_low < LOW + 2_000 {
        // No room below the range: the kernel's choice, as before.
        let listeners: Vec<TcpListener> = (0..count)
            .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free loopback port"))
            .collect();
        return listeners
            .iter()
            .map(|listener| listener.local_addr().expect("a bound address").port())
            .collect();
    }
    let span = ephemeral_low - LOW;
    let start = std::process::id().wrapping_mul(7_919) % span;
    let _ = NEXT.compare_exchange(0, start + 1, Ordering::SeqCst, Ordering::SeqCst);
    let mut ports = Vec::with_capacity(count);
    for _ in 0..span {
        if ports.len() == count {
            break;
        }
        let offset = (NEXT.fetch_add(1, Ordering::SeqCst) - 1) % span;
        let port = u16::try_from(LOW + offset).expect("below the ephemeral range");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            ports.push(port);
        }
    }
    assert_eq!(
        ports.len(),
        count,
        "{count} free loopback ports below {ephemeral_low}"
    );
    ports
}

/// Every entry of `log` from 1, read in batches until one comes back empty, and the head's
/// sequence number that empty batch saw.
pub async fn read_whole_log(log: &EtcdLog) -> (Vec<Entry>, u64) {
    let mut entries = Vec::new();
    loop {
        let batch = log
            .read_from(entries.len() as u64 + 1, 64)
            .await
            .expect("read");
        if batch.entries.is_empty() {
            return (entries, batch.head.seq);
        }
        entries.extend(batch.entries);
    }
}
