//! `vgpu-agent`, the node agent of vgpu: it registers the node's GPUs with the control plane,
//! heartbeats, follows the node's assignments over a stream and keeps them in a state directory
//! for the enforcement layer.
//!
//! Map of the crate:
//!
//! * [`inventory`]: what GPUs the node has: discovered through NVML, or simulated from a spec or
//!   a topology file, behind one [`InventorySource`] enum.
//! * [`agent`]: the `join` runtime (register, heartbeat, watch), with bounded retries.
//! * [`follower`], [`reconcile`], [`assignments`]: turning each stream message into a list of
//!   [`Change`]s (a pure function) and applying it.
//! * [`state`]: the state directory and its atomic writes.
//! * [`tenant`]: the environment of a tenant's processes (`exec`, `env`); [`cdi`]: the same for
//!   containers, as a CDI spec kept in step with the assignments.
//! * [`fleet`]: `simulate-fleet`, many simulated nodes in one process for scale tests.
//! * [`bootstrap`]: the transport: `--insecure`, the certificate files, or a bootstrap token that
//!   gets a certificate from the control plane.
//! * [`monitor`]: GPU health ([`health`], NVML or simulated) and per-tenant usage ([`usage`],
//!   read from the interposer's shared files) sampled on a thread for the heartbeats.
//! * [`config`]: the settings of every subcommand, from flags, `VGPU_AGENT_*` variables and the
//!   TOML configuration file.
//!
//! **Architecture Invariant:** the agent never decides placement. The control plane's newest
//! assignment set is the truth; the agent only reconciles its files towards it.

pub mod agent;
pub mod assignments;
pub mod backoff;
pub mod bandwidth;
pub mod bootstrap;
pub mod cdi;
pub mod closed_loop;
pub mod config;
pub mod endpoints;
pub mod error;
pub mod fleet;
pub mod follower;
pub mod health;
pub mod inventory;
pub mod monitor;
pub mod mps;
pub mod mps_watch;
pub mod private;
pub mod reconcile;
pub mod redistribution;
pub mod report;
pub mod reserve;
pub mod session;
pub mod state;
pub mod tenant;
pub mod usage;
pub mod users;

use std::future::Future;

pub use agent::{JoinConfig, Timings, join};
pub use error::{Error, Result};
pub use inventory::{Inventory, InventorySource};
pub use reconcile::{Change, reconcile};
pub use state::default_state_dir;

/// Longest label key, as for Kubernetes label keys with a prefix.
pub const LABEL_KEY_LENGTH_MAX: usize = 253;
/// Longest label value.
pub const LABEL_VALUE_LENGTH_MAX: usize = 253;

/// Parses one `KEY=VALUE` node label.
pub fn parse_label(text: &str) -> Result<(String, String)> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| Error::BadLabel(text.to_owned()))?;
    let (key, value) = (key.trim(), value.trim());
    if key.is_empty() || key.len() > LABEL_KEY_LENGTH_MAX || value.len() > LABEL_VALUE_LENGTH_MAX {
        return Err(Error::BadLabel(text.to_owned()));
    }
    Ok((key.to_owned(), value.to_owned()))
}

/// This machine's host name made into a valid node name (lower case, other characters turned
/// into `-`), or `localhost` when there is none.
pub fn default_node_name() -> String {
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    node_name_from_hostname(&hostname)
}

fn node_name_from_hostname(hostname: &str) -> String {
    let cleaned: String = hostname
        .trim()
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .take(api::names::NAME_LENGTH_MAX)
        .collect();
    let trimmed = cleaned.trim_matches(|c: char| c == '-' || c == '.');
    if trimmed.is_empty() {
        "localhost".to_owned()
    } else {
        trimmed.to_owned()
    }
}

/// Completes on the first SIGINT or SIGTERM. The handlers are installed at once, so a signal that
/// arrives while the agent is still starting is not lost.
pub fn shutdown_signal() -> std::io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    Ok(async move {
        let name = tokio::select! {
            _ = interrupt.recv() => "SIGINT",
            _ = terminate.recv() => "SIGTERM",
        };
        tracing::info!("received {name}");
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_key_value_pairs() {
        assert_eq!(parse_label("zone=a").unwrap(), ("zone".into(), "a".into()));
        assert_eq!(
            parse_label(" vgpu.io/rack = r1 ").unwrap(),
            ("vgpu.io/rack".into(), "r1".into())
        );
        assert_eq!(
            parse_label("empty=").unwrap(),
            ("empty".into(), String::new())
        );
        for bad in ["zone", "=a", ""] {
            let error = parse_label(bad).unwrap_err();
            assert!(error.to_string().contains("KEY=VALUE"), "{error}");
        }
    }

    #[test]
    fn host_names_become_node_names() {
        assert_eq!(node_name_from_hostname("GPU-Box_01\n"), "gpu-box-01");
        assert_eq!(node_name_from_hostname("  "), "localhost");
        assert_eq!(node_name_from_hostname("_x_"), "x");
        assert!(api::names::validate("node", &node_name_from_hostname(&"a".repeat(100))).is_ok());
        assert!(api::names::validate("node", &default_node_name()).is_ok());
    }
}
