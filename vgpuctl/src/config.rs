//! The settings of `vgpuctl` and where they come from: command-line flags, then `VGPUCTL_*`
//! environment variables, then the TOML configuration file, then built-in defaults.
//!
//! The file is `--config FILE`, else `$VGPUCTL_CONFIG`, else `$XDG_CONFIG_HOME/vgpu/vgpuctl.toml`
//! (or `~/.config/vgpu/vgpuctl.toml`) when it exists. [`KEYS`] documents every key; tests hold
//! it against [`Settings`], `docs/configuration.md` and `deploy/config/vgpuctl.toml`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use api::config::{self as common, ConfigError, Environment, KeyDoc};
use serde::{Deserialize, Deserializer, Serialize};

use crate::cli::{self, Cli, ENDPOINT_DEFAULT, Format};

/// The variable that names the configuration file when `--config` is not given.
pub const CONFIG_ENV: &str = "VGPUCTL_CONFIG";
/// The default file, under `$XDG_CONFIG_HOME` or `~/.config`.
pub const CONFIG_PATH_IN_CONFIG_HOME: &str = "vgpu/vgpuctl.toml";
/// The time limit of a call when nothing sets one.
pub const TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

/// Every setting of `vgpuctl`, each optional: one layer (flags, environment or file).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    #[serde(default, deserialize_with = "endpoints")]
    pub endpoints: Option<Vec<String>>,
    pub output: Option<Format>,
    #[serde(default, deserialize_with = "timeout")]
    pub timeout: Option<Duration>,
    pub insecure: Option<bool>,
    pub tls_ca_cert: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

/// What a command runs with, every setting decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub endpoints: Vec<String>,
    pub output: Format,
    pub timeout: Duration,
    /// `--insecure`: plain text, no certificate.
    pub insecure: bool,
    /// The CA certificate, this client's certificate and key, when all three are set.
    pub tls: Option<api::tls::TlsFiles>,
}

fn endpoints<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Vec<String>>, D::Error> {
    common::parse_list_with(deserializer, cli::parse_endpoint)
}

fn timeout<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
    common::parse_with(deserializer, cli::parse_duration)
}

const ENDPOINTS: KeyDoc = KeyDoc {
    key: "endpoints",
    env: "VGPUCTL_ENDPOINTS",
    env_aliases: &["VGPU_ENDPOINTS"],
    flag: Some("--endpoints"),
    default: ENDPOINT_DEFAULT,
    example: "[\"cp1.example.net:7401\", \"cp2.example.net:7401\"]",
};
const OUTPUT: KeyDoc = KeyDoc {
    key: "output",
    env: "VGPUCTL_OUTPUT",
    env_aliases: &[],
    flag: Some("--output"),
    default: "table",
    example: "\"json\"",
};
const TIMEOUT: KeyDoc = KeyDoc {
    key: "timeout",
    env: "VGPUCTL_TIMEOUT",
    env_aliases: &[],
    flag: Some("--timeout"),
    default: "10s",
    example: "\"30s\"",
};

const INSECURE: KeyDoc = KeyDoc {
    key: "insecure",
    env: "VGPUCTL_INSECURE",
    env_aliases: &[],
    flag: Some("--insecure"),
    default: "false",
    example: "false",
};
const TLS_CA_CERT: KeyDoc = KeyDoc {
    key: "tls_ca_cert",
    env: "VGPUCTL_TLS_CA_CERT",
    env_aliases: &[],
    flag: Some("--tls-ca-cert"),
    default: "required unless insecure",
    example: "\"/home/me/.config/vgpu/ca.crt\"",
};
const TLS_CERT: KeyDoc = KeyDoc {
    key: "tls_cert",
    env: "VGPUCTL_TLS_CERT",
    env_aliases: &[],
    flag: Some("--tls-cert"),
    default: "required unless insecure",
    example: "\"/home/me/.config/vgpu/me.crt\"",
};
const TLS_KEY: KeyDoc = KeyDoc {
    key: "tls_key",
    env: "VGPUCTL_TLS_KEY",
    env_aliases: &[],
    flag: Some("--tls-key"),
    default: "required unless insecure",
    example: "\"/home/me/.config/vgpu/me.key\"",
};

/// Every key of the `vgpuctl` configuration file, in the order of the documentation.
pub const KEYS: &[KeyDoc] = &[
    ENDPOINTS,
    OUTPUT,
    TIMEOUT,
    INSECURE,
    TLS_CA_CERT,
    TLS_CERT,
    TLS_KEY,
];

fn parse_format(text: &str) -> Result<Format, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "table" => Ok(Format::Table),
        "json" => Ok(Format::Json),
        "yaml" => Ok(Format::Yaml),
        _ => Err(format!(
            "the output format `{text}` is unknown; write `table`, `json` or `yaml`"
        )),
    }
}

impl Settings {
    /// The settings the `VGPUCTL_*` variables (and `VGPU_ENDPOINTS`) give.
    pub fn from_env(env: &dyn Environment) -> Result<Settings, ConfigError> {
        Ok(Settings {
            endpoints: common::from_env(env, &ENDPOINTS, |text| {
                common::split_list(text)
                    .iter()
                    .map(|item| cli::parse_endpoint(item))
                    .collect()
            })?,
            output: common::from_env(env, &OUTPUT, parse_format)?,
            timeout: common::from_env(env, &TIMEOUT, cli::parse_duration)?,
            insecure: common::from_env(env, &INSECURE, common::parse_bool)?,
            tls_ca_cert: common::from_env(env, &TLS_CA_CERT, common::parse_path)?,
            tls_cert: common::from_env(env, &TLS_CERT, common::parse_path)?,
            tls_key: common::from_env(env, &TLS_KEY, common::parse_path)?,
        })
    }

    /// The settings the command line gives.
    pub fn from_flags(cli: &Cli) -> Settings {
        Settings {
            endpoints: (!cli.endpoints.is_empty()).then(|| cli.endpoints.clone()),
            output: cli.output,
            timeout: cli.timeout,
            insecure: cli.insecure.then_some(true),
            tls_ca_cert: cli.tls_ca_cert.clone(),
            tls_cert: cli.tls_cert.clone(),
            tls_key: cli.tls_key.clone(),
        }
    }

    /// Fills in the defaults; only some of the TLS files is an error.
    pub fn resolve(self) -> Result<Resolved, ConfigError> {
        let endpoints = self
            .endpoints
            .filter(|endpoints| !endpoints.is_empty())
            .unwrap_or_else(|| vec![ENDPOINT_DEFAULT.to_owned()]);
        debug_assert!(!endpoints.is_empty());
        let tls = api::tls::TlsFiles::from_parts(
            self.tls_ca_cert,
            self.tls_cert,
            self.tls_key,
            [TLS_CA_CERT.key, TLS_CERT.key, TLS_KEY.key],
        )
        .map_err(|error| ConfigError::Conflict(error.to_string()))?;
        Ok(Resolved {
            endpoints,
            output: self.output.unwrap_or(Format::Table),
            timeout: self.timeout.unwrap_or(TIMEOUT_DEFAULT),
            insecure: self.insecure.unwrap_or(false),
            tls,
        })
    }
}

/// Stacks layers: a field set in `higher` wins over the same field in `lower`.
pub fn merge(higher: Settings, lower: Settings) -> Settings {
    Settings {
        endpoints: higher.endpoints.or(lower.endpoints),
        output: higher.output.or(lower.output),
        timeout: higher.timeout.or(lower.timeout),
        insecure: higher.insecure.or(lower.insecure),
        tls_ca_cert: higher.tls_ca_cert.or(lower.tls_ca_cert),
        tls_cert: higher.tls_cert.or(lower.tls_cert),
        tls_key: higher.tls_key.or(lower.tls_key),
    }
}

/// The default file: `$XDG_CONFIG_HOME/vgpu/vgpuctl.toml`, else `$HOME/.config/vgpu/vgpuctl.toml`.
pub fn default_path(env: &dyn Environment) -> Option<PathBuf> {
    env.var("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| env.var("HOME").map(|home| Path::new(&home).join(".config")))
        .map(|base| base.join(CONFIG_PATH_IN_CONFIG_HOME))
}

/// The settings for `cli` from its flags, the environment and the configuration file.
pub fn load(cli: &Cli, env: &dyn Environment) -> Result<Resolved, ConfigError> {
    let defaults: Vec<PathBuf> = default_path(env).into_iter().collect();
    let located = common::locate(cli.config.as_deref(), env, CONFIG_ENV, &defaults);
    let (file, _) = common::load::<Settings>(located)?;
    let settings = merge(
        Settings::from_flags(cli),
        merge(Settings::from_env(env)?, file),
    );
    settings.resolve()
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::config::check;
    use clap::Parser as _;
    use std::collections::BTreeMap;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("vgpuctl").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn flags_win_over_the_environment_which_wins_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("vgpu/vgpuctl.toml");
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(
            &file,
            "endpoints = [\"file-a\", \"file-b:7402\"]\noutput = \"yaml\"\ntimeout = \"3s\"\n",
        )
        .unwrap();
        let xdg = dir.path().to_str().unwrap();
        let vars = env(&[("XDG_CONFIG_HOME", xdg), ("VGPUCTL_OUTPUT", "json")]);
        let resolved = load(&cli(&["get", "nodes"]), &vars).unwrap();
        assert_eq!(resolved.endpoints, vec!["file-a:7401", "file-b:7402"]);
        assert_eq!(
            resolved.output,
            Format::Json,
            "the variable wins over the file"
        );
        assert_eq!(resolved.timeout, Duration::from_secs(3));
        let resolved = load(
            &cli(&["-o", "table", "--endpoints", "x:1", "get", "nodes"]),
            &vars,
        )
        .unwrap();
        assert_eq!(resolved.output, Format::Table, "the flag wins");
        assert_eq!(resolved.endpoints, vec!["x:1"]);
        let vars = env(&[("VGPU_ENDPOINTS", "old:1"), ("HOME", "/nonexistent")]);
        assert_eq!(
            load(&cli(&["get", "nodes"]), &vars).unwrap().endpoints,
            vec!["old:1"]
        );
        let defaults = load(&cli(&["get", "nodes"]), &env(&[])).unwrap();
        assert_eq!(
            defaults,
            Resolved {
                endpoints: vec![ENDPOINT_DEFAULT.to_owned()],
                output: Format::Table,
                timeout: TIMEOUT_DEFAULT,
                insecure: false,
                tls: None,
            }
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_explained() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ctl.toml");
        std::fs::write(&file, "endpoint = [\"a:1\"]\n").unwrap();
        let path = file.to_str().unwrap();
        let error = load(&cli(&["--config", path, "get", "nodes"]), &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("unknown field `endpoint`") && error.contains(path),
            "{error}"
        );
        std::fs::write(&file, "output = \"xml\"\n").unwrap();
        let error = load(&cli(&["get", "nodes"]), &env(&[("VGPUCTL_CONFIG", path)]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("`table`, `json`"), "{error}");
        let error = load(
            &cli(&["get", "nodes"]),
            &env(&[("VGPUCTL_TIMEOUT", "soon")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("VGPUCTL_TIMEOUT=`soon`") && error.contains("`10s`"),
            "{error}"
        );
        let missing = load(
            &cli(&["--config", "/nonexistent.toml", "get", "nodes"]),
            &env(&[]),
        );
        assert!(
            missing
                .unwrap_err()
                .to_string()
                .contains("/nonexistent.toml")
        );
    }

    #[test]
    fn the_settings_keys_example_and_documentation_agree() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        check::assert_consistent(&check::Consistency {
            keys: KEYS,
            repository_root: &root,
            example: "deploy/config/vgpuctl.toml",
            docs_section: "vgpuctl",
            docs_mentions: &[CONFIG_ENV, CONFIG_PATH_IN_CONFIG_HOME],
            from_env: Settings::from_env,
        });
    }
}
