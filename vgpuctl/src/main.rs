//! The `vgpuctl` binary: parses the command line, installs tracing to stderr, and hands over to
//! [`vgpuctl::run`]. See the library docs for the exit statuses.

use std::process::ExitCode;

use clap::Parser as _;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = vgpuctl::Cli::parse();
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_env("VGPUCTL_LOG").unwrap_or_else(|_| EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    match vgpuctl::run(cli) {
        Ok(()) => ExitCode::from(vgpuctl::EXIT_OK),
        Err(error) if vgpuctl::is_broken_pipe(&error) => ExitCode::from(vgpuctl::EXIT_OK),
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(vgpuctl::exit_code(&error))
        }
    }
}
