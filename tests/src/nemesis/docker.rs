//! The nemesis's hands: `docker` commands against the containers of one compose project, found
//! by the labels Compose puts on them (the same for `docker compose` v2 and `docker-compose` v1).

use anyhow::{Context, Result, bail};
use std::time::Duration;

/// How long one `docker` command may take (a `docker restart` waits for the stop timeout).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// Seconds `docker restart` gives a member to stop after SIGTERM before it sends SIGKILL.
pub const STOP_TIMEOUT_S: u32 = 10;

/// One compose project on this machine's Docker engine.
#[derive(Clone, Debug)]
pub struct Project {
    pub name: String,
    /// The compose network members are cut off from (its key in the compose file).
    pub network: String,
}

impl Project {
    /// The id of the container of `service`.
    pub async fn container(&self, service: &str) -> Result<String> {
        let output = docker(&[
            "ps",
            "-aq",
            "--filter",
            &format!("label=com.docker.compose.project={}", self.name),
            "--filter",
            &format!("label=com.docker.compose.service={service}"),
        ])
        .await?;
        let mut ids = output.lines().filter(|line| !line.is_empty());
        let Some(id) = ids.next() else {
            bail!(
                "no container of service `{service}` in compose project `{}`; is the cluster up (`docker-compose -p {} ps`)?",
                self.name,
                self.name
            );
        };
        Ok(id.to_owned())
    }

    /// The id of the project's network.
    pub async fn network_id(&self) -> Result<String> {
        let output = docker(&[
            "network",
            "ls",
            "-q",
            "--filter",
            &format!("label=com.docker.compose.project={}", self.name),
            "--filter",
            &format!("label=com.docker.compose.network={}", self.network),
        ])
        .await?;
        match output.lines().find(|line| !line.is_empty()) {
            Some(id) => Ok(id.to_owned()),
            None => bail!(
                "compose project `{}` has no network `{}`; check the compose file",
                self.name,
                self.network
            ),
        }
    }

    /// Cuts `service` off the cluster network: it reaches no peer, agent or client.
    pub async fn disconnect(&self, service: &str) -> Result<()> {
        let network = self.network_id().await?;
        let container = self.container(service).await?;
        docker(&["network", "disconnect", "-f", &network, &container]).await?;
        Ok(())
    }

    /// Reconnects `service` under its service name, which peers and agents resolve.
    pub async fn connect(&self, service: &str) -> Result<()> {
        let network = self.network_id().await?;
        let container = self.container(service).await?;
        docker(&[
            "network", "connect", "--alias", service, &network, &container,
        ])
        .await?;
        Ok(())
    }

    /// Runs `docker ACTION [ARGS...] CONTAINER` for `service`: pause, unpause, start, restart,
    /// kill.
    pub async fn act(&self, action: &str, args: &[&str], service: &str) -> Result<()> {
        let container = self.container(service).await?;
        let mut command = vec![action];
        command.extend_from_slice(args);
        command.push(&container);
        docker(&command).await?;
        Ok(())
    }
}

/// Runs `docker ARGS`; returns its stdout, or an error with its stderr.
pub async fn docker(args: &[&str]) -> Result<String> {
    let run = tokio::process::Command::new("docker")
        .args(args)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(COMMAND_TIMEOUT, run)
        .await
        .with_context(|| format!("`docker {}` ran past {COMMAND_TIMEOUT:?}", args.join(" ")))?
        .with_context(|| format!("running `docker {}`; is docker installed?", args.join(" ")))?;
    if !output.status.success() {
        bail!(
            "`docker {}` failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
