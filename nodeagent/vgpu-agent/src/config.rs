//! The settings of `vgpu-agent` and where they come from: command-line flags, then
//! `VGPU_AGENT_*` environment variables, then the TOML configuration file, then built-in
//! defaults.
//!
//! One [`Settings`] struct (all fields optional, unknown keys refused) holds each layer; [`merge`]
//! stacks them, and the merged settings answer what each subcommand needs ([`Settings::join`],
//! [`Settings::node`], [`Settings::tenant_state_dir`], ...). The same file serves `join`,
//! `inventory`, `exec` and `env`, so `vgpu-agent exec` on a node finds the state directory that
//! the agent's service uses. [`KEYS`] documents every key; tests hold it against the struct,
//! `docs/configuration.md` and `deploy/config/vgpu-agent.toml`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use api::config::{self as common, ConfigError, Environment, KeyDoc};
use serde::{Deserialize, Serialize};

use crate::cdi::CdiConfig;
use crate::error::Result;
use crate::inventory::InventorySource;
use crate::{JoinConfig, Timings, tenant};

/// The variable that names the configuration file when `--config` is not given.
pub const CONFIG_ENV: &str = "VGPU_AGENT_CONFIG";
/// The file read when neither `--config` nor [`CONFIG_ENV`] is given, if it exists.
pub const CONFIG_PATH_DEFAULT: &str = "/etc/vgpu/vgpu-agent.toml";

/// Every setting of `vgpu-agent`, each optional: one layer (flags, environment or file).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub control_plane: Option<Vec<String>>,
    pub name: Option<String>,
    pub simulate: Option<String>,
    pub state_dir: Option<PathBuf>,
    pub labels: Option<BTreeMap<String, String>>,
    pub address: Option<String>,
    pub cdi: Option<bool>,
    pub cdi_dir: Option<PathBuf>,
    pub interposer: Option<PathBuf>,
    pub shm_dir: Option<PathBuf>,
    pub nic_gbps: Option<u32>,
    /// Millicores (`"4"`, `"500m"` in the file).
    #[serde(default, deserialize_with = "reserved_cpu")]
    pub reserved_cpu: Option<u64>,
    /// Bytes (`"16GiB"` in the file).
    #[serde(default, deserialize_with = "reserved_host_memory")]
    pub reserved_host_memory: Option<u64>,
    /// Bytes (`"256GiB"` in the file): pinned host memory for swapped-out borrowed GPU memory.
    #[serde(default, deserialize_with = "swap_host_memory")]
    pub swap_host_memory: Option<u64>,
    /// One swap staging file per GPU, shared by its processes (experimental).
    pub shared_staging: Option<bool>,
    pub mps: Option<bool>,
    pub mps_tenants: Option<crate::mps::MpsTenants>,
    pub mps_control: Option<PathBuf>,
    /// On an MPS node, redistribute each GPU's SMs among its burst tenants by their measured
    /// progress (issue 15, point 4).
    pub redistribute: Option<bool>,
    /// The kube-scheduler allocates this node's GPUs through DRA (issue 18).
    pub kubernetes_managed: Option<bool>,
    pub insecure: Option<bool>,
    pub tls_ca_cert: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub token: Option<String>,
    pub ca_cert_hash: Option<String>,
}

const CONTROL_PLANE: KeyDoc = KeyDoc {
    key: "control_plane",
    env: "VGPU_AGENT_CONTROL_PLANE",
    env_aliases: &[],
    flag: Some("--control-plane"),
    default: "required by `join`",
    example: "[\"cp1.example.net:7401\", \"cp2.example.net:7401\", \"cp3.example.net:7401\"]",
};
const NAME: KeyDoc = KeyDoc {
    key: "name",
    env: "VGPU_AGENT_NAME",
    env_aliases: &[],
    flag: Some("--name"),
    default: "the host name",
    example: "\"gpu-node-1\"",
};
const SIMULATE: KeyDoc = KeyDoc {
    key: "simulate",
    env: "VGPU_AGENT_SIMULATE",
    env_aliases: &[],
    flag: Some("--simulate"),
    default: "discover GPUs through NVML",
    example: "\"8xH100-80GB\"",
};
const STATE_DIR: KeyDoc = KeyDoc {
    key: "state_dir",
    env: "VGPU_AGENT_STATE_DIR",
    env_aliases: &[],
    flag: Some("--state-dir"),
    default: "/var/lib/vgpu-agent/NAME if writable, else ~/.local/state/vgpu-agent/NAME",
    example: "\"/var/lib/vgpu-agent/gpu-node-1\"",
};
const LABELS: KeyDoc = KeyDoc {
    key: "labels",
    env: "VGPU_AGENT_LABELS",
    env_aliases: &[],
    flag: Some("--labels"),
    default: "none",
    example: "{ zone = \"a\", rack = \"r1\" }",
};
const ADDRESS: KeyDoc = KeyDoc {
    key: "address",
    env: "VGPU_AGENT_ADDRESS",
    env_aliases: &[],
    flag: Some("--address"),
    default: "empty",
    example: "\"gpu-node-1.example.net:7480\"",
};
const CDI: KeyDoc = KeyDoc {
    key: "cdi",
    env: "VGPU_AGENT_CDI",
    env_aliases: &[],
    flag: Some("--no-cdi"),
    default: "true",
    example: "true",
};
const CDI_DIR: KeyDoc = KeyDoc {
    key: "cdi_dir",
    env: "VGPU_AGENT_CDI_DIR",
    env_aliases: &[],
    flag: Some("--cdi-dir"),
    default: "/var/run/cdi if writable, else STATE_DIR/cdi (always STATE_DIR/cdi when simulating)",
    example: "\"/var/run/cdi\"",
};
const INTERPOSER: KeyDoc = KeyDoc {
    key: "interposer",
    env: "VGPU_AGENT_INTERPOSER",
    env_aliases: &["VGPU_INTERPOSER"],
    flag: Some("--interposer"),
    default: "libvgpu_cuda.so beside vgpu-agent if present, else /usr/lib/vgpu/libvgpu_cuda.so",
    example: "\"/usr/lib/vgpu/libvgpu_cuda.so\"",
};
const SHM_DIR: KeyDoc = KeyDoc {
    key: "shm_dir",
    env: "VGPU_AGENT_SHM_DIR",
    env_aliases: &[tenant_abi::env::var::SHM_DIR],
    flag: Some("--shm-dir"),
    default: "/dev/shm/vgpu; with simulate, STATE_DIR/shm (exec and env: the agent's, from STATE_DIR/shm-dir)",
    example: "\"/dev/shm/vgpu\"",
};

const NIC_GBPS: KeyDoc = KeyDoc {
    key: "nic_gbps",
    env: "VGPU_AGENT_NIC_GBPS",
    env_aliases: &[],
    flag: Some("--nic-gbps"),
    default: "100",
    example: "100",
};

const RESERVED_CPU: KeyDoc = KeyDoc {
    key: "reserved_cpu",
    env: "VGPU_AGENT_RESERVED_CPU",
    env_aliases: &[],
    flag: Some("--reserved-cpu"),
    default: "0",
    example: "\"4\"",
};

const RESERVED_HOST_MEMORY: KeyDoc = KeyDoc {
    key: "reserved_host_memory",
    env: "VGPU_AGENT_RESERVED_HOST_MEMORY",
    env_aliases: &[],
    flag: Some("--reserved-host-memory"),
    default: "0",
    example: "\"16GiB\"",
};

const SWAP_HOST_MEMORY: KeyDoc = KeyDoc {
    key: "swap_host_memory",
    env: "VGPU_AGENT_SWAP_HOST_MEMORY",
    env_aliases: &[],
    flag: Some("--swap-host-memory"),
    default: "a quarter of the host memory the node offers tenants",
    example: "\"256GiB\"",
};

const SHARED_STAGING: KeyDoc = KeyDoc {
    key: "shared_staging",
    env: "VGPU_AGENT_SHARED_STAGING",
    env_aliases: &[],
    flag: Some("--shared-staging"),
    default: "false",
    example: "false",
};

const MPS: KeyDoc = KeyDoc {
    key: "mps",
    env: "VGPU_AGENT_MPS",
    env_aliases: &[],
    flag: Some("--mps"),
    default: "false",
    example: "false",
};
const MPS_TENANTS: KeyDoc = KeyDoc {
    key: "mps_tenants",
    env: "VGPU_AGENT_MPS_TENANTS",
    env_aliases: &[],
    flag: Some("--mps-tenants"),
    default: "non-latency",
    example: "\"non-latency\"",
};
const MPS_CONTROL: KeyDoc = KeyDoc {
    key: "mps_control",
    env: "VGPU_AGENT_MPS_CONTROL",
    env_aliases: &[],
    flag: None,
    default: "nvidia-cuda-mps-control (from PATH)",
    example: "\"/usr/bin/nvidia-cuda-mps-control\"",
};
const REDISTRIBUTE: KeyDoc = KeyDoc {
    key: "redistribute",
    env: "VGPU_AGENT_REDISTRIBUTE",
    env_aliases: &[],
    flag: Some("--no-redistribute"),
    default: "true (acts on MPS nodes only)",
    example: "true",
};
const KUBERNETES_MANAGED: KeyDoc = KeyDoc {
    key: "kubernetes_managed",
    env: "VGPU_AGENT_KUBERNETES_MANAGED",
    env_aliases: &[],
    flag: Some("--kubernetes-managed"),
    default: "false",
    example: "false",
};
const INSECURE: KeyDoc = KeyDoc {
    key: "insecure",
    env: "VGPU_AGENT_INSECURE",
    env_aliases: &[],
    flag: Some("--insecure"),
    default: "false",
    example: "false",
};
const TLS_CA_CERT: KeyDoc = KeyDoc {
    key: "tls_ca_cert",
    env: "VGPU_AGENT_TLS_CA_CERT",
    env_aliases: &[],
    flag: Some("--tls-ca-cert"),
    default: "STATE_DIR/tls/ca.crt",
    example: "\"/var/lib/vgpu-agent/gpu-node-1/tls/ca.crt\"",
};
const TLS_CERT: KeyDoc = KeyDoc {
    key: "tls_cert",
    env: "VGPU_AGENT_TLS_CERT",
    env_aliases: &[],
    flag: Some("--tls-cert"),
    default: "STATE_DIR/tls/agent.crt",
    example: "\"/var/lib/vgpu-agent/gpu-node-1/tls/agent.crt\"",
};
const TLS_KEY: KeyDoc = KeyDoc {
    key: "tls_key",
    env: "VGPU_AGENT_TLS_KEY",
    env_aliases: &[],
    flag: Some("--tls-key"),
    default: "STATE_DIR/tls/agent.key",
    example: "\"/var/lib/vgpu-agent/gpu-node-1/tls/agent.key\"",
};
const TOKEN: KeyDoc = KeyDoc {
    key: "token",
    env: "VGPU_AGENT_TOKEN",
    env_aliases: &[],
    flag: Some("--token"),
    default: "none",
    example: "\"abcdef.0123456789abcdef\"",
};
const CA_CERT_HASH: KeyDoc = KeyDoc {
    key: "ca_cert_hash",
    env: "VGPU_AGENT_CA_CERT_HASH",
    env_aliases: &[],
    flag: Some("--ca-cert-hash"),
    default: "required with token",
    example: "\"sha256:0000000000000000000000000000000000000000000000000000000000000000\"",
};

/// The NIC speed shared by tenant when none is configured, in Gb/s.
pub const NIC_GBPS_DEFAULT: u32 = 100;

/// Every key of the `vgpu-agent` configuration file, in the order of the documentation.
pub const KEYS: &[KeyDoc] = &[
    CONTROL_PLANE,
    NAME,
    SIMULATE,
    STATE_DIR,
    LABELS,
    ADDRESS,
    CDI,
    CDI_DIR,
    INTERPOSER,
    SHM_DIR,
    NIC_GBPS,
    RESERVED_CPU,
    RESERVED_HOST_MEMORY,
    SWAP_HOST_MEMORY,
    SHARED_STAGING,
    MPS,
    MPS_TENANTS,
    MPS_CONTROL,
    REDISTRIBUTE,
    KUBERNETES_MANAGED,
    INSECURE,
    TLS_CA_CERT,
    TLS_CERT,
    TLS_KEY,
    TOKEN,
    CA_CERT_HASH,
];

fn parse_gbps(text: &str) -> std::result::Result<u32, String> {
    match text.trim().parse::<u32>() {
        Ok(g) if (1..=100_000).contains(&g) => Ok(g),
        _ => Err(format!(
            "`{text}` is not a NIC speed; give whole gigabits per second between 1 and 100000"
        )),
    }
}

/// Parses `--reserved-cpu`: CPUs or millicores (`4`, `0.5`, `500m`).
pub fn parse_reserved_cpu(text: &str) -> std::result::Result<u64, String> {
    api::cpu::parse_cpu_milli(text).map_err(|error| error.to_string())
}

/// Parses `--reserved-host-memory`: a size (`16GiB`).
pub fn parse_reserved_host_memory(text: &str) -> std::result::Result<u64, String> {
    api::size::parse_bytes(text).map_err(|error| error.to_string())
}

/// Parses `--swap-host-memory`: a size (`256GiB`; `0` turns the swap off on the node).
pub fn parse_swap_host_memory(text: &str) -> std::result::Result<u64, String> {
    api::size::parse_bytes(text).map_err(|error| error.to_string())
}

fn swap_host_memory<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Option<u64>, D::Error> {
    common::parse_with(deserializer, parse_swap_host_memory)
}

fn reserved_cpu<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Option<u64>, D::Error> {
    common::parse_with(deserializer, parse_reserved_cpu)
}

fn reserved_host_memory<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Option<u64>, D::Error> {
    common::parse_with(deserializer, parse_reserved_host_memory)
}

fn parse_labels(text: &str) -> std::result::Result<BTreeMap<String, String>, String> {
    common::split_list(text)
        .iter()
        .map(|pair| crate::parse_label(pair).map_err(|error| error.to_string()))
        .collect()
}

fn parse_name(text: &str) -> std::result::Result<String, String> {
    api::names::validate("node", text).map_err(|error| error.to_string())?;
    Ok(text.to_owned())
}

impl Settings {
    /// The settings the `VGPU_AGENT_*` variables give.
    pub fn from_env(env: &dyn Environment) -> std::result::Result<Settings, ConfigError> {
        let path = |key: &KeyDoc| common::from_env(env, key, common::parse_path);
        let text = |key: &KeyDoc| common::from_env(env, key, |text| Ok(text.to_owned()));
        Ok(Settings {
            control_plane: common::from_env(env, &CONTROL_PLANE, |text| {
                Ok(common::split_list(text))
            })?,
            name: common::from_env(env, &NAME, parse_name)?,
            simulate: text(&SIMULATE)?,
            state_dir: path(&STATE_DIR)?,
            labels: common::from_env(env, &LABELS, parse_labels)?,
            address: text(&ADDRESS)?,
            cdi: common::from_env(env, &CDI, common::parse_bool)?,
            cdi_dir: path(&CDI_DIR)?,
            interposer: path(&INTERPOSER)?,
            shm_dir: path(&SHM_DIR)?,
            nic_gbps: common::from_env(env, &NIC_GBPS, parse_gbps)?,
            reserved_cpu: common::from_env(env, &RESERVED_CPU, parse_reserved_cpu)?,
            reserved_host_memory: common::from_env(
                env,
                &RESERVED_HOST_MEMORY,
                parse_reserved_host_memory,
            )?,
            swap_host_memory: common::from_env(env, &SWAP_HOST_MEMORY, parse_swap_host_memory)?,
            shared_staging: common::from_env(env, &SHARED_STAGING, common::parse_bool)?,
            mps: common::from_env(env, &MPS, common::parse_bool)?,
            mps_tenants: common::from_env(env, &MPS_TENANTS, crate::mps::MpsTenants::parse)?,
            mps_control: path(&MPS_CONTROL)?,
            redistribute: common::from_env(env, &REDISTRIBUTE, common::parse_bool)?,
            kubernetes_managed: common::from_env(env, &KUBERNETES_MANAGED, common::parse_bool)?,
            insecure: common::from_env(env, &INSECURE, common::parse_bool)?,
            tls_ca_cert: path(&TLS_CA_CERT)?,
            tls_cert: path(&TLS_CERT)?,
            tls_key: path(&TLS_KEY)?,
            token: text(&TOKEN)?,
            ca_cert_hash: text(&CA_CERT_HASH)?,
        })
    }

    /// This node's name: `name`, else the host name.
    pub fn node(&self) -> String {
        self.name.clone().unwrap_or_else(crate::default_node_name)
    }

    /// Where GPUs come from: `simulate`, else NVML.
    pub fn inventory_source(&self) -> Result<InventorySource> {
        Ok(match &self.simulate {
            Some(spec) => InventorySource::from_simulate_arg(spec)?,
            None => InventorySource::Nvml,
        })
    }

    /// The shared-memory directory `join` uses: as given, else `STATE_DIR/shm` for simulated
    /// GPUs (several simulated agents may share a host, and each one's tenant directories must
    /// be its own), else `/dev/shm/vgpu`. Absolute.
    pub fn join_shm_dir(&self, state_dir: &Path) -> PathBuf {
        absolute(&match (&self.shm_dir, &self.simulate) {
            (Some(given), _) => given.clone(),
            (None, Some(_)) => state_dir.join("shm"),
            (None, None) => PathBuf::from(tenant::SHM_DIR_DEFAULT),
        })
    }

    /// The shared-memory directory `exec` and `env` use: as given, else the one the running
    /// agent recorded in its state directory, else `/dev/shm/vgpu`.
    pub fn tenant_shm_dir(&self) -> PathBuf {
        if let Some(given) = &self.shm_dir {
            return given.clone();
        }
        crate::state::read_shm_dir(&self.tenant_state_dir())
            .unwrap_or_else(|| PathBuf::from(tenant::SHM_DIR_DEFAULT))
    }

    /// The MPS pipe directory tenants connect to, when the node runs MPS (`mps = true`), for the
    /// shared-memory directory `shm_dir`.
    pub fn mps_pipe_dir(&self, shm_dir: &Path) -> Option<PathBuf> {
        self.mps
            .unwrap_or(false)
            .then(|| crate::mps::pipe_dir(&absolute(shm_dir)))
    }

    /// The interposer to preload; `executable` is vgpu-agent's own path.
    pub fn interposer(&self, executable: Option<&Path>) -> PathBuf {
        tenant::resolve_interposer(self.interposer.as_deref(), executable)
    }

    /// The running agent's state directory as `exec` and `env` find it (creating nothing).
    pub fn tenant_state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| crate::state::find_state_dir(&self.node()))
    }

    /// What `join` runs with. `file` only names the configuration file in messages;
    /// `executable` is vgpu-agent's own path (the interposer may sit beside it).
    pub fn join(self, file: Option<&Path>, executable: Option<&Path>) -> Result<JoinConfig> {
        let control_plane = self.control_plane.clone().unwrap_or_default();
        if control_plane.is_empty() {
            return Err(CONTROL_PLANE.missing("control-plane address", file).into());
        }
        let name = self.node();
        let source = self.inventory_source()?;
        let state_dir = self
            .state_dir
            .clone()
            .unwrap_or_else(|| crate::default_state_dir(&name));
        let labels = self.labels.clone().unwrap_or_default();
        for (key, value) in &labels {
            // A label from the file must be one `--labels KEY=VALUE` could give: a key with `=`
            // or spaces around it (`" zone "`) would never match a selector's `zone`.
            let text = format!("{key}={value}");
            if crate::parse_label(&text)? != (key.clone(), value.clone()) {
                return Err(crate::error::Error::BadLabel(text));
            }
        }
        let cdi = self.cdi.unwrap_or(true).then(|| CdiConfig {
            dir: self.cdi_dir.clone().unwrap_or_else(|| {
                crate::cdi::default_cdi_dir(&state_dir, self.simulate.is_some())
            }),
            interposer: self.interposer(executable),
            shm_dir: self.join_shm_dir(&state_dir),
            state_dir: absolute(&state_dir),
            mps_pipe_dir: self.mps_pipe_dir(&self.join_shm_dir(&state_dir)),
            mps_tenants: self.mps_tenants.unwrap_or_default(),
        });
        let security = crate::bootstrap::Security {
            insecure: self.insecure.unwrap_or(false),
            files: crate::bootstrap::files(
                &state_dir,
                self.tls_ca_cert.clone(),
                self.tls_cert.clone(),
                self.tls_key.clone(),
            ),
            token: self.token.clone(),
            ca_cert_hash: self.ca_cert_hash.clone(),
        };
        if security.token.is_some() && security.ca_cert_hash.is_none() {
            return Err(crate::error::Error::Tls(
                "--token needs --ca-cert-hash sha256:... (the pin `vgpu-cp token create` prints), so that the agent knows it talks to its cluster".to_owned(),
            ));
        }
        let shm_dir = self.join_shm_dir(&state_dir);
        let mps = self.mps.unwrap_or(false).then(|| crate::mps::MpsConfig {
            redistribute: self.redistribute.unwrap_or(true),
            ..crate::mps::MpsConfig::new(
                self.mps_control.clone(),
                &shm_dir,
                &absolute(&state_dir),
                self.mps_tenants.unwrap_or_default(),
            )
        });
        Ok(JoinConfig {
            mps,
            kubernetes_managed: self.kubernetes_managed.unwrap_or(false),
            security,
            control_plane,
            source,
            state_dir,
            labels,
            address: self.address.unwrap_or_default(),
            name,
            timings: Timings::default(),
            shm_dir,
            nic_bytes_per_second: u64::from(self.nic_gbps.unwrap_or(NIC_GBPS_DEFAULT))
                * 125_000_000,
            host_reserve: crate::inventory::host::HostReserve {
                cpu_milli: self.reserved_cpu.unwrap_or(0),
                memory_bytes: self.reserved_host_memory.unwrap_or(0),
            },
            swap_host_memory: self.swap_host_memory,
            shared_staging: self.shared_staging.unwrap_or(false),
            cdi,
        })
    }
}

/// `path` made absolute against the working directory (CDI mounts need absolute paths).
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}

/// Stacks layers: a field set in `higher` wins over the same field in `lower`.
pub fn merge(higher: Settings, lower: Settings) -> Settings {
    Settings {
        control_plane: higher.control_plane.or(lower.control_plane),
        name: higher.name.or(lower.name),
        simulate: higher.simulate.or(lower.simulate),
        state_dir: higher.state_dir.or(lower.state_dir),
        labels: higher.labels.or(lower.labels),
        address: higher.address.or(lower.address),
        cdi: higher.cdi.or(lower.cdi),
        cdi_dir: higher.cdi_dir.or(lower.cdi_dir),
        interposer: higher.interposer.or(lower.interposer),
        shm_dir: higher.shm_dir.or(lower.shm_dir),
        nic_gbps: higher.nic_gbps.or(lower.nic_gbps),
        reserved_cpu: higher.reserved_cpu.or(lower.reserved_cpu),
        reserved_host_memory: higher.reserved_host_memory.or(lower.reserved_host_memory),
        swap_host_memory: higher.swap_host_memory.or(lower.swap_host_memory),
        shared_staging: higher.shared_staging.or(lower.shared_staging),
        mps: higher.mps.or(lower.mps),
        mps_tenants: higher.mps_tenants.or(lower.mps_tenants),
        mps_control: higher.mps_control.or(lower.mps_control),
        redistribute: higher.redistribute.or(lower.redistribute),
        kubernetes_managed: higher.kubernetes_managed.or(lower.kubernetes_managed),
        insecure: higher.insecure.or(lower.insecure),
        tls_ca_cert: higher.tls_ca_cert.or(lower.tls_ca_cert),
        tls_cert: higher.tls_cert.or(lower.tls_cert),
        tls_key: higher.tls_key.or(lower.tls_key),
        token: higher.token.or(lower.token),
        ca_cert_hash: higher.ca_cert_hash.or(lower.ca_cert_hash),
    }
}

/// The merged settings from the command line's `flags`, the environment and the configuration
/// file (`--config`, else `$VGPU_AGENT_CONFIG`, else `/etc/vgpu/vgpu-agent.toml` if it exists),
/// with the file's path when one was read.
pub fn load(
    flags: Settings,
    config_flag: Option<&Path>,
    env: &dyn Environment,
) -> std::result::Result<(Settings, Option<PathBuf>), ConfigError> {
    let located = common::locate(
        config_flag,
        env,
        CONFIG_ENV,
        &[PathBuf::from(CONFIG_PATH_DEFAULT)],
    );
    let (file, path) = common::load::<Settings>(located)?;
    if let Some(name) = &file.name {
        parse_name(name).map_err(|problem| ConfigError::Parse {
            path: path.clone().unwrap_or_default(),
            message: format!("name: {problem}"),
        })?;
    }
    Ok((merge(flags, merge(Settings::from_env(env)?, file)), path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::config::check;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn write_config(text: &str) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), text).unwrap();
        file
    }

    #[test]
    fn the_shared_memory_directory_is_per_agent_when_simulating_and_exec_finds_the_agents() {
        let state = tempfile::tempdir().unwrap();
        let simulated = Settings {
            simulate: Some("1xH100-80GB".into()),
            state_dir: Some(state.path().to_owned()),
            ..Settings::default()
        };
        assert_eq!(
            simulated.join_shm_dir(state.path()),
            state.path().join("shm")
        );
        let real = Settings::default();
        assert_eq!(
            real.join_shm_dir(state.path()),
            PathBuf::from(tenant::SHM_DIR_DEFAULT)
        );
        let given = Settings {
            shm_dir: Some("/dev/shm/mine".into()),
            ..simulated.clone()
        };
        assert_eq!(
            given.join_shm_dir(state.path()),
            PathBuf::from("/dev/shm/mine")
        );
        // exec and env: what the agent recorded, unless given.
        let for_exec = Settings {
            state_dir: Some(state.path().to_owned()),
            ..Settings::default()
        };
        assert_eq!(
            for_exec.tenant_shm_dir(),
            PathBuf::from(tenant::SHM_DIR_DEFAULT)
        );
        let dir = crate::state::StateDir::open(state.path(), "node-a").unwrap();
        dir.write_shm_dir(&state.path().join("shm")).unwrap();
        assert_eq!(for_exec.tenant_shm_dir(), state.path().join("shm"));
        let given = Settings {
            shm_dir: Some("/dev/shm/mine".into()),
            ..for_exec
        };
        assert_eq!(given.tenant_shm_dir(), PathBuf::from("/dev/shm/mine"));
    }

    #[test]
    fn flags_win_over_the_environment_which_wins_over_the_file() {
        let file = write_config(
            "control_plane = [\"file:7401\"]\nname = \"from-file\"\nsimulate = \"2xL40S-48GB\"\nstate_dir = \"/file\"\nlabels = { zone = \"a\" }\ncdi = false\n",
        );
        let vars = env(&[
            ("VGPU_AGENT_NAME", "from-env"),
            ("VGPU_AGENT_STATE_DIR", "/env"),
            ("VGPU_SHM_DIR", "/dev/shm/old-name"),
        ]);
        let flags = Settings {
            state_dir: Some("/flag".into()),
            ..Settings::default()
        };
        let (settings, path) = load(flags, Some(file.path()), &vars).unwrap();
        assert_eq!(path.as_deref(), Some(file.path()));
        let join = settings.clone().join(path.as_deref(), None).unwrap();
        assert_eq!(join.state_dir, PathBuf::from("/flag"), "the flag wins");
        assert_eq!(join.name, "from-env", "the variable wins over the file");
        assert_eq!(
            join.control_plane,
            vec!["file:7401"],
            "the file wins over nothing"
        );
        assert!(matches!(join.source, InventorySource::Simulated(_)));
        assert_eq!(join.labels.get("zone").map(String::as_str), Some("a"));
        assert!(join.cdi.is_none(), "cdi = false writes no spec");
        assert_eq!(join.shm_dir, PathBuf::from("/dev/shm/old-name"));
    }

    #[test]
    fn defaults_apply_when_nothing_is_given() {
        let settings = Settings {
            control_plane: Some(vec!["cp:7401".into()]),
            name: Some("n".into()),
            simulate: Some("1xH100-80GB".into()),
            state_dir: Some("/tmp/vgpu-agent-config-test".into()),
            ..Settings::default()
        };
        let join = settings.join(None, None).unwrap();
        // Simulated: under the state directory (see join_shm_dir).
        assert_eq!(
            join.shm_dir,
            PathBuf::from("/tmp/vgpu-agent-config-test/shm")
        );
        let cdi = join.cdi.expect("CDI is on by default");
        assert_eq!(cdi.dir, PathBuf::from("/tmp/vgpu-agent-config-test/cdi"));
        assert_eq!(join.address, "");
        assert!(
            !Settings::default().node().is_empty(),
            "the host name is the default name"
        );
    }

    /// Issue 19: the host reserve comes from flags, variables or the file, and bad amounts say
    /// what to write.
    #[test]
    fn the_host_reserve_is_read_from_each_layer() {
        let file = write_config(
            "control_plane = [\"a:1\"]\nsimulate = \"1xH100-80GB\"\nreserved_cpu = \"2.5\"\nreserved_host_memory = \"16GiB\"\n",
        );
        let (settings, _) = load(Settings::default(), Some(file.path()), &env(&[])).unwrap();
        let join = settings.join(None, None).unwrap();
        assert_eq!(join.host_reserve.cpu_milli, 2_500);
        assert_eq!(join.host_reserve.memory_bytes, 16 << 30);
        let (settings, _) = load(
            Settings::default(),
            Some(file.path()),
            &env(&[("VGPU_AGENT_RESERVED_CPU", "500m")]),
        )
        .unwrap();
        assert_eq!(settings.reserved_cpu, Some(500), "the variable wins");
        let error = load(
            Settings::default(),
            None,
            &env(&[("VGPU_AGENT_RESERVED_CPU", "lots")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("VGPU_AGENT_RESERVED_CPU") && error.contains("500m"),
            "{error}"
        );
        let file = write_config("reserved_host_memory = \"much\"\n");
        let error = load(Settings::default(), Some(file.path()), &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("reserved_host_memory"), "{error}");
    }

    #[test]
    fn unknown_keys_bad_values_and_missing_settings_are_explained() {
        let file = write_config("control_plane = [\"a:1\"]\nsimualte = \"8xH100-80GB\"\n");
        let error = load(Settings::default(), Some(file.path()), &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("unknown field `simualte`"), "{error}");
        assert!(
            error.contains(&file.path().display().to_string()),
            "{error}"
        );
        let error = load(
            Settings::default(),
            None,
            &env(&[("VGPU_AGENT_CDI", "maybe")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("VGPU_AGENT_CDI=`maybe`") && error.contains("`true`"),
            "{error}"
        );
        let error = load(
            Settings::default(),
            None,
            &env(&[("VGPU_AGENT_LABELS", "zone")]),
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("KEY=VALUE"), "{error}");
        let file = write_config("name = \"Bad_Name\"\n");
        let error = load(Settings::default(), Some(file.path()), &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("name") && error.contains("Bad_Name"),
            "{error}"
        );
        let error = Settings::default()
            .join(None, None)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--control-plane") && error.contains("VGPU_AGENT_CONTROL_PLANE"),
            "{error}"
        );
    }

    #[test]
    fn the_settings_keys_example_and_documentation_agree() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        check::assert_consistent(&check::Consistency {
            keys: KEYS,
            repository_root: &root,
            example: "deploy/config/vgpu-agent.toml",
            docs_section: "vgpu-agent",
            docs_mentions: &[CONFIG_ENV, CONFIG_PATH_DEFAULT],
            from_env: Settings::from_env,
        });
    }
}
