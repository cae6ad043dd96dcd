//! vgpuctl, the command-line client of the vgpu control plane, in the manner of kubectl:
//! `place`, `set`, `release`, `get`, `describe`, `drain`, `uncordon` and `cluster`.
//!
//! The binary's `main.rs` parses a [`Cli`], installs tracing and calls [`run`]; everything else is
//! here: [`cli`] (flags and their parsers), [`endpoints`] (connections and failover between
//! control-plane members), [`config`] (flags, `VGPUCTL_*` variables and the configuration file),
//! [`commands`] (one function per subcommand), [`views`] (the JSON/YAML
//! shapes), [`output`] (tables and formatting) and [`describe`] (the `describe` text).
//!
//! Scripting contract: results go to stdout, diagnostics to stderr, and the exit status is
//! 0 on success (including a `place` that leaves the tenant pending after `--wait-timeout`; check
//! `state` in `-o json` to tell), 1 when the control plane refused or failed the request (the
//! message ends with its stable code, e.g. `(VGPU-TENANT-NOT-FOUND)`), 2 for bad usage (flags,
//! values and names, checked before anything is sent), and 3 when no endpoint answered.

pub mod cli;
pub mod commands;
pub mod config;
pub mod describe;
pub mod endpoints;
pub mod output;
pub mod views;

#[cfg(test)]
mod fake;

use std::io::Write as _;
use std::time::Duration;

use anyhow::Context as _;

pub use cli::{Cli, Format};
use endpoints::{CallError, Endpoints, EndpointsConfig};

/// Exit status for success.
pub const EXIT_OK: u8 = 0;
/// Exit status when the control plane refused or failed the request.
pub const EXIT_FAILED: u8 = 1;
/// Exit status for bad usage (clap uses it too).
pub const EXIT_USAGE: u8 = 2;
/// Exit status when no endpoint answered.
pub const EXIT_UNREACHABLE: u8 = 3;

/// Input that vgpuctl refuses before sending anything; the message says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Runs the command line: connects lazily to the endpoints, runs the subcommand, prints to stdout.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    let settings = config::load(&cli, &api::config::ProcessEnvironment)
        .map_err(|error| UsageError(error.to_string()))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let connect_timeout = settings
        .timeout
        .min(Duration::from_millis(endpoints::CONNECT_TIMEOUT_MS));
    let transport = api::tls::Transport::choose(
        settings.insecure,
        settings.tls.as_ref(),
        "ask an admin for a certificate (`vgpu-cp cert issue --role tenant:OWNER`) and set --tls-ca-cert, --tls-cert and --tls-key (or tls_ca_cert, tls_cert and tls_key in ~/.config/vgpu/vgpuctl.toml)",
    )
    .map_err(|error| UsageError(error.to_string()))?;
    let config = EndpointsConfig {
        addresses: settings.endpoints,
        call_timeout: settings.timeout,
        connect_timeout,
        transport,
    };
    let session = commands::Session {
        endpoints: Endpoints::new(config),
        format: settings.output,
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    runtime.block_on(commands::execute(&cli.command, &session, &mut out))?;
    out.flush()?;
    Ok(())
}

/// The exit status for an error returned by [`run`].
pub fn exit_code(error: &anyhow::Error) -> u8 {
    for cause in error.chain() {
        if cause.is::<UsageError>() {
            return EXIT_USAGE;
        }
        if let Some(CallError::Unreachable { .. }) = cause.downcast_ref::<CallError>() {
            return EXIT_UNREACHABLE;
        }
    }
    EXIT_FAILED
}

/// Whether the error is only stdout having been closed early (`vgpuctl get nodes | head -1`),
/// which is not worth reporting.
pub fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_error_kind() {
        assert_eq!(exit_code(&UsageError("bad".into()).into()), EXIT_USAGE);
        let unreachable = CallError::Unreachable {
            endpoints: "a:1".into(),
            what: "x".into(),
            last: "refused".into(),
        };
        assert_eq!(
            exit_code(&anyhow::Error::from(unreachable).context("while placing")),
            EXIT_UNREACHABLE
        );
        let refused = CallError::Refused {
            code: None,
            grpc: tonic::Code::NotFound,
            message: "gone".into(),
        };
        assert_eq!(exit_code(&refused.into()), EXIT_FAILED);
        assert_eq!(exit_code(&anyhow::anyhow!("other")), EXIT_FAILED);
        let pipe = anyhow::Error::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        assert!(is_broken_pipe(&pipe));
    }
}
