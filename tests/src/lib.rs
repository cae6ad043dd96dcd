//! A harness for tests and benchmarks that run the real binaries: control-plane members, node
//! agents and vgpuctl as separate processes on loopback, with `kill -9`, restart and waiting.
//!
//! The binaries are built once per test run (`cargo build --bins`) into the workspace target
//! directory, so `cargo test` alone is enough.
//!
//! Clusters run with `--insecure` (plain text) unless started with [`Cluster::start_secure`]:
//! then a cluster CA ([`Pki`]) issues member and admin certificates, agents join with bootstrap
//! tokens, and vgpuctl calls use the admin certificate.

pub mod nemesis;

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Where the workspace's binaries are, built on first use.
pub fn binaries() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("tests/ sits in the workspace")
            .to_owned();
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
        let release = profile_dir.ends_with("release");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let mut build = Command::new(cargo);
        build.current_dir(&workspace).args([
            "build",
            "--bins",
            "-p",
            "vgpu-cp",
            "-p",
            "vgpu-agent",
            "-p",
            "vgpuctl",
        ]);
        if release {
            build.arg("--release");
        }
        let status = build.status().expect("running cargo build");
        assert!(status.success(), "building the binaries failed");
        profile_dir
    })
}

pub fn binary(name: &str) -> PathBuf {
    let path = binaries().join(name);
    assert!(path.exists(), "{} is missing", path.display());
    path
}

/// A free loopback port, below the kernel's ephemeral range (`etcd_store::testing::free_ports`):
/// a process restarted on its port later does not find it taken by an outgoing connection.
pub fn free_port() -> u16 {
    etcd_store::testing::free_ports(1)[0]
}

/// Polls `check` until it returns `Some`, or fails after `timeout` with `what`.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check() {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A child process killed (SIGKILL) when dropped; its stderr goes to a log file.
pub struct Process {
    child: Option<Child>,
    pub log: PathBuf,
}

impl Process {
    pub fn spawn(mut command: Command, log: PathBuf) -> Result<Process> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        command
            .stdout(file.try_clone()?)
            .stderr(file)
            .stdin(Stdio::null());
        let child = command
            .spawn()
            .with_context(|| format!("spawning {command:?}"))?;
        Ok(Process {
            child: Some(child),
            log,
        })
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The process id, while the child has not been reaped.
    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGTERM, then waits up to `patience` for the exit (then `kill -9`). Returns whether the
    /// process exited successfully on its own.
    pub fn terminate(&mut self, patience: Duration) -> Result<bool> {
        let Some(mut child) = self.child.take() else {
            return Ok(false);
        };
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .context("running kill -TERM")?;
        if !status.success() {
            let _ = child.kill();
        }
        let deadline = Instant::now() + patience;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status.success());
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Flags that make failure detection fast in tests.
pub const FAST_FLAGS: [&str; 2] = ["--node-lost-timeout-ms", "1500"];

/// One control-plane member.
pub struct Member {
    pub id: u64,
    pub address: String,
    pub data_dir: PathBuf,
    pub process: Option<Process>,
    pub peer: Option<String>,
    pub extra: Vec<String>,
}

impl Member {
    fn command(&self) -> Command {
        let mut command = Command::new(binary("vgpu-cp"));
        let mode = if self.peer.is_some() {
            "join"
        } else {
            "bootstrap"
        };
        command.args([
            mode,
            "--id",
            &self.id.to_string(),
            "--listen",
            &self.address,
        ]);
        command.arg("--data-dir").arg(&self.data_dir);
        if let Some(peer) = &self.peer {
            command.args(["--peer", peer]);
        }
        if !self.extra.iter().any(|arg| arg == "--tls-cert") {
            command.arg("--insecure");
        }
        command.args(&self.extra);
        command
    }

    pub fn start(&mut self) -> Result<()> {
        let log = self.data_dir.with_extension("log");
        self.process = Some(Process::spawn(self.command(), log)?);
        Ok(())
    }

    pub fn kill(&mut self) {
        if let Some(process) = self.process.as_mut() {
            process.kill();
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.data_dir.with_extension("log")).unwrap_or_default()
    }
}

/// A control-plane cluster of real processes in a temporary directory.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub members: Vec<Member>,
    pub agents: Vec<Agent>,
    /// The cluster CA and the admin's certificate, for a cluster started with mTLS.
    pub pki: Option<Pki>,
}

pub struct Agent {
    pub name: String,
    pub spec: String,
    pub state_dir: PathBuf,
    pub process: Option<Process>,
    /// `--insecure`, or `--token T --ca-cert-hash H` under mTLS.
    pub security: Vec<String>,
}

/// A cluster CA made with `vgpu-cp ca init`, and certificates issued with `vgpu-cp cert issue`.
pub struct Pki {
    pub dir: PathBuf,
    /// `sha256:...`, for `vgpu-agent join --ca-cert-hash`.
    pub ca_cert_hash: String,
    /// The TLS flags of an admin certificate (`--tls-ca-cert F --tls-cert F --tls-key F`).
    pub admin: Vec<String>,
}

impl Pki {
    /// A new CA in `dir/ca`.
    pub fn init(dir: &Path) -> Result<Pki> {
        let ca_dir = dir.join("ca");
        let output = Command::new(binary("vgpu-cp"))
            .args(["ca", "init", "--dir"])
            .arg(&ca_dir)
            .output()?;
        if !output.status.success() {
            bail!(
                "vgpu-cp ca init failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let hash = Command::new(binary("vgpu-cp"))
            .args(["ca", "hash", "--ca-cert"])
            .arg(ca_dir.join("ca.crt"))
            .output()?;
        let ca_cert_hash = String::from_utf8(hash.stdout)?.trim().to_owned();
        if !ca_cert_hash.starts_with("sha256:") {
            bail!("vgpu-cp ca hash printed `{ca_cert_hash}`");
        }
        let mut pki = Pki {
            dir: dir.to_owned(),
            ca_cert_hash,
            admin: Vec::new(),
        };
        pki.admin = pki.issue("admin", "admin", &[])?;
        Ok(pki)
    }

    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca/ca.crt")
    }

    pub fn ca_key(&self) -> PathBuf {
        self.dir.join("ca/ca.key")
    }

    /// Issues a certificate (`role`, common name `name`, SANs `hosts`) and returns the
    /// `--tls-ca-cert`, `--tls-cert` and `--tls-key` flags that use it.
    pub fn issue(&self, role: &str, name: &str, hosts: &[&str]) -> Result<Vec<String>> {
        let out_dir = self.dir.join("issued");
        let mut command = Command::new(binary("vgpu-cp"));
        command
            .args(["cert", "issue", "--ca-dir"])
            .arg(self.dir.join("ca"))
            .args(["--role", role, "--name", name])
            .arg("--out-dir")
            .arg(&out_dir);
        if !hosts.is_empty() {
            command.args(["--host", &hosts.join(",")]);
        }
        let output = command.output()?;
        if !output.status.success() {
            bail!(
                "vgpu-cp cert issue failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let path = |extension: &str| {
            out_dir
                .join(format!("{name}.{extension}"))
                .display()
                .to_string()
        };
        Ok(vec![
            "--tls-ca-cert".to_owned(),
            self.ca_cert().display().to_string(),
            "--tls-cert".to_owned(),
            path("crt"),
            "--tls-key".to_owned(),
            path("key"),
        ])
    }
}

impl Cluster {
    /// Starts `size` members with `--insecure`: the first bootstraps, the others join it in turn.
    pub fn start(size: usize, extra: &[&str]) -> Result<Cluster> {
        Cluster::start_with(size, extra, false)
    }

    /// Starts `size` members with mutual TLS: a new CA, a member certificate for each (every
    /// member holds the CA key, so agents can join through any of them), an admin certificate
    /// for vgpuctl.
    pub fn start_secure(size: usize, extra: &[&str]) -> Result<Cluster> {
        Cluster::start_with(size, extra, true)
    }

    fn start_with(size: usize, extra: &[&str], secure: bool) -> Result<Cluster> {
        let dir = tempfile::tempdir()?;
        let pki = if secure {
            Some(Pki::init(&dir.path().join("pki"))?)
        } else {
            None
        };
        let mut cluster = Cluster {
            dir,
            members: Vec::new(),
            agents: Vec::new(),
            pki,
        };
        for index in 0..size {
            let id = index as u64 + 1;
            let address = format!("127.0.0.1:{}", free_port());
            let peer = (index > 0).then(|| cluster.members[0].address.clone());
            let data_dir = cluster.dir.path().join(format!("cp{id}"));
            let mut extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
            if let Some(pki) = &cluster.pki {
                extra.extend(pki.issue("member", &id.to_string(), &["127.0.0.1", "localhost"])?);
                extra.push("--tls-ca-key".to_owned());
                extra.push(pki.ca_key().display().to_string());
            }
            let mut member = Member {
                id,
                address,
                data_dir,
                process: None,
                peer,
                extra,
            };
            member.start()?;
            cluster.members.push(member);
            let expected = index + 1;
            wait_for(
                &format!("member {id} to be a voter"),
                Duration::from_secs(30),
                || {
                    let status = cluster.status_json().ok()?;
                    let voters = status["members"]
                        .as_array()?
                        .iter()
                        .filter(|m| m["voter"] == true)
                        .count();
                    (voters == expected && status["leader"].as_u64()? > 0).then_some(())
                },
            )
            .with_context(|| cluster.logs())?;
        }
        Ok(cluster)
    }

    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| m.address.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Endpoints of the members whose process runs.
    pub fn live_endpoints(&mut self) -> String {
        let mut live = Vec::new();
        for member in &mut self.members {
            if member.process.as_mut().is_some_and(Process::is_running) {
                live.push(member.address.clone());
            }
        }
        live.join(",")
    }

    /// vgpuctl with the admin's certificate (or `--insecure`).
    pub fn vgpuctl(&self, args: &[&str]) -> Result<Output> {
        match &self.pki {
            None => vgpuctl(&self.endpoints(), args),
            Some(pki) => {
                let mut all = pki.admin.clone();
                all.extend(args.iter().map(|arg| arg.to_string()));
                let all: Vec<&str> = all.iter().map(String::as_str).collect();
                vgpuctl(&self.endpoints(), &all)
            }
        }
    }

    /// `vgpuctl` with another identity's flags (`Pki::issue`'s `--tls-*` arguments).
    pub fn vgpuctl_as(&self, flags: &[String], args: &[&str]) -> Result<Output> {
        let mut all: Vec<&str> = flags.iter().map(String::as_str).collect();
        all.extend_from_slice(args);
        vgpuctl(&self.endpoints(), &all)
    }

    /// A bootstrap token from `vgpu-cp token create` with the admin's certificate.
    pub fn create_token(&self, ttl: &str) -> Result<String> {
        let pki = self
            .pki
            .as_ref()
            .context("tokens need a cluster started with mTLS")?;
        let flags = &pki.admin;
        let output = Command::new(binary("vgpu-cp"))
            .args([
                "token",
                "create",
                "--ttl",
                ttl,
                "--endpoint",
                &self.members[0].address,
            ])
            .args([
                "--ca-cert",
                &flags[1],
                "--cert",
                &flags[3],
                "--key",
                &flags[5],
            ])
            .output()?;
        if !output.status.success() {
            bail!(
                "vgpu-cp token create failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8(output.stdout)?.trim().to_owned())
    }

    pub fn status_json(&self) -> Result<serde_json::Value> {
        json(&self.vgpuctl(&["cluster", "status", "-o", "json"])?)
    }

    pub fn leader(&self) -> Result<u64> {
        wait_for("a leader", Duration::from_secs(15), || {
            self.status_json().ok()?["leader"]
                .as_u64()
                .filter(|&leader| leader > 0)
        })
    }

    pub fn member(&mut self, id: u64) -> &mut Member {
        self.members
            .iter_mut()
            .find(|m| m.id == id)
            .expect("member exists")
    }

    pub fn start_agent(&mut self, name: &str, spec: &str) -> Result<()> {
        self.start_agent_with(name, spec, &[])
    }

    /// [`Cluster::start_agent`] with more `vgpu-agent join` flags (such as `--shm-dir`).
    pub fn start_agent_with(&mut self, name: &str, spec: &str, extra: &[&str]) -> Result<()> {
        let state_dir = self.dir.path().join(format!("agent-{name}"));
        let mut security = match &self.pki {
            None => vec!["--insecure".to_owned()],
            Some(pki) => vec![
                "--token".to_owned(),
                self.create_token("10m")?,
                "--ca-cert-hash".to_owned(),
                pki.ca_cert_hash.clone(),
            ],
        };
        security.extend(extra.iter().map(|flag| (*flag).to_owned()));
        let mut agent = Agent {
            name: name.to_owned(),
            spec: spec.to_owned(),
            state_dir,
            process: None,
            security,
        };
        self.spawn_agent(&mut agent)?;
        self.agents.push(agent);
        Ok(())
    }

    fn spawn_agent(&self, agent: &mut Agent) -> Result<()> {
        let mut command = Command::new(binary("vgpu-agent"));
        command.args([
            "join",
            "--control-plane",
            &self.endpoints(),
            "--name",
            &agent.name,
            "--simulate",
            &agent.spec,
        ]);
        command.arg("--state-dir").arg(&agent.state_dir);
        command.args(&agent.security);
        let log = agent.state_dir.with_extension("log");
        agent.process = Some(Process::spawn(command, log)?);
        Ok(())
    }

    pub fn restart_agent(&mut self, name: &str) -> Result<()> {
        let index = self
            .agents
            .iter()
            .position(|a| a.name == name)
            .expect("agent exists");
        let mut agent = self.agents.remove(index);
        self.spawn_agent(&mut agent)?;
        self.agents.insert(index, agent);
        Ok(())
    }

    pub fn agent(&mut self, name: &str) -> &mut Agent {
        self.agents
            .iter_mut()
            .find(|a| a.name == name)
            .expect("agent exists")
    }

    /// Waits until `count` nodes are registered and ready.
    pub fn wait_nodes_ready(&self, count: usize) -> Result<()> {
        wait_for(
            &format!("{count} ready nodes"),
            Duration::from_secs(30),
            || {
                let nodes = json(&self.vgpuctl(&["get", "nodes", "-o", "json"]).ok()?).ok()?;
                let ready = nodes
                    .as_array()?
                    .iter()
                    .filter(|n| n["state"] == "ready")
                    .count();
                (ready == count).then_some(())
            },
        )
        .with_context(|| self.logs())
    }

    /// All member and agent logs, for failure messages.
    pub fn logs(&self) -> String {
        let mut text = String::new();
        for member in &self.members {
            let log = member.log_text();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            text += &format!("\n--- member {} log (last lines) ---\n", member.id);
            text += &tail.into_iter().rev().collect::<Vec<_>>().join("\n");
        }
        for agent in &self.agents {
            let log =
                std::fs::read_to_string(agent.state_dir.with_extension("log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            text += &format!("\n--- agent {} log (last lines) ---\n", agent.name);
            text += &tail.into_iter().rev().collect::<Vec<_>>().join("\n");
        }
        text
    }
}

/// Runs vgpuctl against `endpoints`, with `--insecure` unless `args` name a certificate.
pub fn vgpuctl(endpoints: &str, args: &[&str]) -> Result<Output> {
    let mut command = Command::new(binary("vgpuctl"));
    command.arg("--endpoints").arg(endpoints);
    if !args.contains(&"--tls-cert") {
        command.arg("--insecure");
    }
    Ok(command.args(args).output()?)
}

/// Parses a successful command's stdout as JSON.
pub fn json(output: &Output) -> Result<serde_json::Value> {
    if !output.status.success() {
        bail!(
            "command failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    serde_json::from_slice(&output.stdout).with_context(|| {
        format!(
            "stdout is not JSON: {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

/// A gRPC pool client to one address.
pub async fn pool_client(
    address: &str,
) -> Result<api::v1::pool_client::PoolClient<tonic::transport::Channel>> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(15));
    Ok(api::v1::pool_client::PoolClient::new(
        endpoint.connect_lazy(),
    ))
}

/// A fractional placement request.
pub fn fraction(milli: u32, memory_gib: u64) -> api::v1::PlacementRequest {
    api::v1::PlacementRequest {
        milli_gpus: milli,
        memory_bytes_per_gpu: memory_gib << 30,
        ..Default::default()
    }
}

/// A GET over the API's own transport (HTTP/2, mTLS with the certificate in `flags`, as
/// [`Pki::issue`] returns them): the status code and the body.
pub fn get_as(flags: &[String], address: &str, path: &str) -> Result<(u16, String)> {
    let files = api::tls::TlsFiles {
        ca_cert: flags[1].clone().into(),
        cert: flags[3].clone().into(),
        key: flags[5].clone().into(),
    };
    let transport = api::tls::Transport::choose(false, Some(&files), "")?;
    get_through(transport.endpoint(address)?, path)
}

/// A GET over HTTP/2 through `endpoint` (e.g. `api::tls::pinned_endpoint`, which presents no
/// client certificate): the status code and the body, within 10 s.
pub fn get_through(endpoint: tonic::transport::Endpoint, path: &str) -> Result<(u16, String)> {
    use tonic::codegen::{Body as _, Service as _, http};
    let runtime = tokio::runtime::Runtime::new()?;
    let exchange = async {
        let mut channel = endpoint.connect().await?;
        std::future::poll_fn(|cx| channel.poll_ready(cx)).await?;
        let request = http::Request::get(path).body(tonic::body::Body::empty())?;
        let response = channel.call(request).await?;
        let status = response.status().as_u16();
        let mut body = std::pin::pin!(response.into_body());
        let mut bytes = Vec::new();
        while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
            if let Ok(data) = frame?.into_data() {
                bytes.extend_from_slice(&data);
            }
        }
        anyhow::Ok((status, String::from_utf8(bytes)?))
    };
    runtime.block_on(async { tokio::time::timeout(Duration::from_secs(10), exchange).await })?
}

/// A plain HTTP/1.1 GET on loopback: the status code, the head (lower case) and the body.
pub fn http_request(address: &str, path: &str) -> Result<(u16, String, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let Some((head, body)) = response.split_once("\r\n\r\n") else {
        bail!("malformed HTTP response: {response}")
    };
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status in {head}"))?;
    Ok((status, head.to_ascii_lowercase(), body.to_owned()))
}

/// A plain HTTP/1.1 GET on loopback (for `/metrics`); returns the body of a 200 answer.
pub fn http_get(address: &str, path: &str) -> Result<String> {
    let (status, head, body) = http_request(address, path)?;
    if status != 200 {
        bail!("GET {path} failed: {head}");
    }
    Ok(body)
}
