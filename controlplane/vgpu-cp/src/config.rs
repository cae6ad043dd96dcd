//! The settings of `vgpu-cp` and where they come from: command-line flags, then `VGPU_CP_*`
//! environment variables, then the TOML configuration file, then built-in defaults.
//!
//! One [`Settings`] struct (all fields optional, unknown keys refused) holds each layer; [`merge`]
//! stacks them and [`Settings::resolve`] fills in defaults, checks what must be given and builds
//! the [`Config`] that [`crate::run`] takes. [`KEYS`] documents every key; tests hold it against
//! the struct, `docs/configuration.md` and `deploy/config/vgpu-cp.toml`.
//!
//! `mode` makes one systemd unit (`vgpu-cp run`) fit every member: the first member's file says
//! `mode = "bootstrap"`, the others' `mode = "join"` with `peers`. Either restarts from the data
//! directory once it holds a member.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use api::config::{self as common, ConfigError, Environment, KeyDoc};
use serde::{Deserialize, Deserializer, Serialize};

use crate::{Config, Mode, RaftTimings, control_plane::Timings};

/// The variable that names the configuration file when `--config` is not given.
pub const CONFIG_ENV: &str = "VGPU_CP_CONFIG";
/// The file read when neither `--config` nor [`CONFIG_ENV`] is given, if it exists.
pub const CONFIG_PATH_DEFAULT: &str = "/etc/vgpu/vgpu-cp.toml";
/// The longest timing setting (`*_ms`): a day.
pub const TIMING_MS_MAX: u64 = 24 * 3600 * 1000;

/// How a member starts when its data directory is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModeName {
    /// Initialise a new one-voter cluster.
    Bootstrap,
    /// Join the cluster of `peers`.
    Join,
    /// Member 1 bootstraps, every other member joins: one setting for all members (a Kubernetes
    /// StatefulSet, with `id_from_hostname`).
    Auto,
}

impl std::str::FromStr for ModeName {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim() {
            "bootstrap" => Ok(ModeName::Bootstrap),
            "join" => Ok(ModeName::Join),
            "auto" => Ok(ModeName::Auto),
            _ => Err(format!(
                "the mode `{text}` is unknown; write `bootstrap` (the first member), `join` or `auto` (member 1 bootstraps, the others join)"
            )),
        }
    }
}

/// Every setting of `vgpu-cp`, each optional: one layer (flags, environment or file).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub mode: Option<ModeName>,
    pub id: Option<u64>,
    pub id_from_hostname: Option<bool>,
    #[serde(default, deserialize_with = "socket_address")]
    pub listen: Option<SocketAddr>,
    pub advertise: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub peers: Option<Vec<String>>,
    pub node_lost_timeout_ms: Option<u64>,
    pub agent_heartbeat_ms: Option<u64>,
    pub raft_heartbeat_ms: Option<u64>,
    pub election_timeout_ms: Option<u64>,
    pub snapshot_every: Option<u64>,
    pub snapshot_keep_logs: Option<u64>,
    pub insecure: Option<bool>,
    pub tls_ca_cert: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_ca_key: Option<PathBuf>,
    pub tenant_priority_max: Option<i32>,
    pub etcd_endpoints: Option<Vec<String>>,
    pub etcd_prefix: Option<String>,
    pub etcd_ca: Option<PathBuf>,
    pub etcd_cert: Option<PathBuf>,
    pub etcd_key: Option<PathBuf>,
    pub etcd_lease_ttl_s: Option<u64>,
}

fn socket_address<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<SocketAddr>, D::Error> {
    common::parse_with(deserializer, common::parse_socket_address)
}

const MODE: KeyDoc = KeyDoc {
    key: "mode",
    env: "VGPU_CP_MODE",
    env_aliases: &[],
    flag: None,
    default: "required by `vgpu-cp run`",
    example: "\"bootstrap\"",
};
const ID: KeyDoc = KeyDoc {
    key: "id",
    env: "VGPU_CP_ID",
    env_aliases: &[],
    flag: Some("--id"),
    default: "required",
    example: "1",
};
const ID_FROM_HOSTNAME: KeyDoc = KeyDoc {
    key: "id_from_hostname",
    env: "VGPU_CP_ID_FROM_HOSTNAME",
    env_aliases: &[],
    flag: None,
    default: "false",
    example: "true",
};
const LISTEN: KeyDoc = KeyDoc {
    key: "listen",
    env: "VGPU_CP_LISTEN",
    env_aliases: &[],
    flag: Some("--listen"),
    default: "127.0.0.1:7401",
    example: "\"0.0.0.0:7401\"",
};
const ADVERTISE: KeyDoc = KeyDoc {
    key: "advertise",
    env: "VGPU_CP_ADVERTISE",
    env_aliases: &[],
    flag: Some("--advertise"),
    default: "the listen address",
    example: "\"cp1.example.net:7401\"",
};
const DATA_DIR: KeyDoc = KeyDoc {
    key: "data_dir",
    env: "VGPU_CP_DATA_DIR",
    env_aliases: &[],
    flag: Some("--data-dir"),
    default: "required",
    example: "\"/var/lib/vgpu-cp\"",
};
const PEERS: KeyDoc = KeyDoc {
    key: "peers",
    env: "VGPU_CP_PEERS",
    env_aliases: &[],
    flag: Some("--peer"),
    default: "required to join",
    example: "[\"cp1.example.net:7401\", \"cp2.example.net:7401\"]",
};
const NODE_LOST_TIMEOUT_MS: KeyDoc = KeyDoc {
    key: "node_lost_timeout_ms",
    env: "VGPU_CP_NODE_LOST_TIMEOUT_MS",
    env_aliases: &["VGPU_NODE_LOST_TIMEOUT_MS"],
    flag: Some("--node-lost-timeout-ms"),
    default: "5000",
    example: "5000",
};
const AGENT_HEARTBEAT_MS: KeyDoc = KeyDoc {
    key: "agent_heartbeat_ms",
    env: "VGPU_CP_AGENT_HEARTBEAT_MS",
    env_aliases: &[],
    flag: Some("--agent-heartbeat-ms"),
    default: "1000",
    example: "1000",
};
const RAFT_HEARTBEAT_MS: KeyDoc = KeyDoc {
    key: "raft_heartbeat_ms",
    env: "VGPU_CP_RAFT_HEARTBEAT_MS",
    env_aliases: &[],
    flag: Some("--raft-heartbeat-ms"),
    default: "50",
    example: "50",
};
const ELECTION_TIMEOUT_MS: KeyDoc = KeyDoc {
    key: "election_timeout_ms",
    env: "VGPU_CP_ELECTION_TIMEOUT_MS",
    env_aliases: &[],
    flag: Some("--election-timeout-ms"),
    default: "250",
    example: "250",
};
const SNAPSHOT_EVERY: KeyDoc = KeyDoc {
    key: "snapshot_every",
    env: "VGPU_CP_SNAPSHOT_EVERY",
    env_aliases: &[],
    flag: Some("--snapshot-every"),
    default: "20000",
    example: "20000",
};
const SNAPSHOT_KEEP_LOGS: KeyDoc = KeyDoc {
    key: "snapshot_keep_logs",
    env: "VGPU_CP_SNAPSHOT_KEEP_LOGS",
    env_aliases: &[],
    flag: Some("--snapshot-keep-logs"),
    default: "1000",
    example: "1000",
};

const INSECURE: KeyDoc = KeyDoc {
    key: "insecure",
    env: "VGPU_CP_INSECURE",
    env_aliases: &[],
    flag: Some("--insecure"),
    default: "false",
    example: "false",
};
const TLS_CA_CERT: KeyDoc = KeyDoc {
    key: "tls_ca_cert",
    env: "VGPU_CP_TLS_CA_CERT",
    env_aliases: &[],
    flag: Some("--tls-ca-cert"),
    default: "required unless insecure",
    example: "\"/etc/vgpu/tls/ca.crt\"",
};
const TLS_CERT: KeyDoc = KeyDoc {
    key: "tls_cert",
    env: "VGPU_CP_TLS_CERT",
    env_aliases: &[],
    flag: Some("--tls-cert"),
    default: "required unless insecure",
    example: "\"/etc/vgpu/tls/member-1.crt\"",
};
const TLS_KEY: KeyDoc = KeyDoc {
    key: "tls_key",
    env: "VGPU_CP_TLS_KEY",
    env_aliases: &[],
    flag: Some("--tls-key"),
    default: "required unless insecure",
    example: "\"/etc/vgpu/tls/member-1.key\"",
};
const TLS_CA_KEY: KeyDoc = KeyDoc {
    key: "tls_ca_key",
    env: "VGPU_CP_TLS_CA_KEY",
    env_aliases: &[],
    flag: Some("--tls-ca-key"),
    default: "none (agents cannot join with a token through this member)",
    example: "\"/etc/vgpu/tls/ca.key\"",
};

const TENANT_PRIORITY_MAX: KeyDoc = KeyDoc {
    key: "tenant_priority_max",
    env: "VGPU_CP_TENANT_PRIORITY_MAX",
    env_aliases: &[],
    flag: Some("--tenant-priority-max"),
    default: "100",
    example: "100",
};

const ETCD_ENDPOINTS: KeyDoc = KeyDoc {
    key: "etcd_endpoints",
    env: "VGPU_CP_ETCD_ENDPOINTS",
    env_aliases: &[],
    flag: Some("--etcd-endpoints"),
    default: "none (the built-in Raft store)",
    example: "[\"https://etcd1.example.net:2379\", \"https://etcd2.example.net:2379\"]",
};
const ETCD_PREFIX: KeyDoc = KeyDoc {
    key: "etcd_prefix",
    env: "VGPU_CP_ETCD_PREFIX",
    env_aliases: &[],
    flag: Some("--etcd-prefix"),
    default: "/vgpu/",
    example: "\"/vgpu/\"",
};
const ETCD_CA: KeyDoc = KeyDoc {
    key: "etcd_ca",
    env: "VGPU_CP_ETCD_CA",
    env_aliases: &[],
    flag: Some("--etcd-ca"),
    default: "none (plain http:// endpoints)",
    example: "\"/etc/vgpu/etcd/ca.crt\"",
};
const ETCD_CERT: KeyDoc = KeyDoc {
    key: "etcd_cert",
    env: "VGPU_CP_ETCD_CERT",
    env_aliases: &[],
    flag: Some("--etcd-cert"),
    default: "none (plain http:// endpoints)",
    example: "\"/etc/vgpu/etcd/client.crt\"",
};
const ETCD_KEY: KeyDoc = KeyDoc {
    key: "etcd_key",
    env: "VGPU_CP_ETCD_KEY",
    env_aliases: &[],
    flag: Some("--etcd-key"),
    default: "none (plain http:// endpoints)",
    example: "\"/etc/vgpu/etcd/client.key\"",
};
const ETCD_LEASE_TTL_S: KeyDoc = KeyDoc {
    key: "etcd_lease_ttl_s",
    env: "VGPU_CP_ETCD_LEASE_TTL_S",
    env_aliases: &[],
    flag: Some("--etcd-lease-ttl-s"),
    default: "5",
    example: "5",
};
/// The longest leader lease on etcd: an hour (a dead leader is replaced only after it).
pub const ETCD_LEASE_TTL_S_MAX: u64 = 3600;

/// Every key of the `vgpu-cp` configuration file, in the order of the documentation.
pub const KEYS: &[KeyDoc] = &[
    MODE,
    ID,
    ID_FROM_HOSTNAME,
    LISTEN,
    ADVERTISE,
    DATA_DIR,
    PEERS,
    NODE_LOST_TIMEOUT_MS,
    AGENT_HEARTBEAT_MS,
    RAFT_HEARTBEAT_MS,
    ELECTION_TIMEOUT_MS,
    SNAPSHOT_EVERY,
    SNAPSHOT_KEEP_LOGS,
    INSECURE,
    TLS_CA_CERT,
    TLS_CERT,
    TLS_KEY,
    TLS_CA_KEY,
    TENANT_PRIORITY_MAX,
    ETCD_ENDPOINTS,
    ETCD_PREFIX,
    ETCD_CA,
    ETCD_CERT,
    ETCD_KEY,
    ETCD_LEASE_TTL_S,
];

impl Settings {
    /// The settings the `VGPU_CP_*` variables give.
    pub fn from_env(env: &dyn Environment) -> Result<Settings, ConfigError> {
        let number =
            |key: &KeyDoc, min: u64| common::from_env(env, key, common::parse_at_least(min));
        Ok(Settings {
            mode: common::from_env(env, &MODE, |text| text.parse())?,
            id: number(&ID, 1)?,
            id_from_hostname: common::from_env(env, &ID_FROM_HOSTNAME, common::parse_bool)?,
            listen: common::from_env(env, &LISTEN, common::parse_socket_address)?,
            advertise: common::from_env(env, &ADVERTISE, |text| Ok(text.to_owned()))?,
            data_dir: common::from_env(env, &DATA_DIR, common::parse_path)?,
            peers: common::from_env(env, &PEERS, |text| Ok(common::split_list(text)))?,
            node_lost_timeout_ms: number(&NODE_LOST_TIMEOUT_MS, 1)?,
            agent_heartbeat_ms: number(&AGENT_HEARTBEAT_MS, 1)?,
            raft_heartbeat_ms: number(&RAFT_HEARTBEAT_MS, 1)?,
            election_timeout_ms: number(&ELECTION_TIMEOUT_MS, 1)?,
            snapshot_every: number(&SNAPSHOT_EVERY, 1)?,
            snapshot_keep_logs: number(&SNAPSHOT_KEEP_LOGS, 0)?,
            insecure: common::from_env(env, &INSECURE, common::parse_bool)?,
            tls_ca_cert: common::from_env(env, &TLS_CA_CERT, common::parse_path)?,
            tls_cert: common::from_env(env, &TLS_CERT, common::parse_path)?,
            tls_key: common::from_env(env, &TLS_KEY, common::parse_path)?,
            tls_ca_key: common::from_env(env, &TLS_CA_KEY, common::parse_path)?,
            tenant_priority_max: common::from_env(
                env,
                &TENANT_PRIORITY_MAX,
                common::parse_from_str("give a priority from -1000 to 1000, such as 100"),
            )?,
            etcd_endpoints: common::from_env(env, &ETCD_ENDPOINTS, |text| {
                Ok(common::split_list(text))
            })?,
            etcd_prefix: common::from_env(env, &ETCD_PREFIX, |text| Ok(text.to_owned()))?,
            etcd_ca: common::from_env(env, &ETCD_CA, common::parse_path)?,
            etcd_cert: common::from_env(env, &ETCD_CERT, common::parse_path)?,
            etcd_key: common::from_env(env, &ETCD_KEY, common::parse_path)?,
            etcd_lease_ttl_s: number(&ETCD_LEASE_TTL_S, 2)?,
        })
    }

    /// Fills in defaults, checks what must be given, and builds the member's [`Config`]. `file`
    /// only names the configuration file in messages; `hostname` is this machine's host name,
    /// which `id_from_hostname` reads.
    pub fn resolve(
        self,
        file: Option<&Path>,
        hostname: Option<&str>,
    ) -> Result<Config, ConfigError> {
        let mode_name = self
            .mode
            .ok_or_else(|| MODE.missing("mode (`bootstrap`, `join` or `auto`)", file))?;
        let id = match (self.id, self.id_from_hostname.unwrap_or(false)) {
            (Some(id), _) => id,
            (None, true) => id_from_hostname(hostname.unwrap_or(""))?,
            (None, false) => return Err(ID.missing("member id", file)),
        };
        let data_dir = self
            .data_dir
            .ok_or_else(|| DATA_DIR.missing("data directory", file))?;
        let listen = self
            .listen
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 7401)));
        let advertise = self
            .advertise
            .filter(|advertise| !advertise.trim().is_empty())
            .unwrap_or_else(|| listen.to_string());
        let bootstrap = match mode_name {
            ModeName::Bootstrap => true,
            ModeName::Join => false,
            ModeName::Auto => id == 1,
        };
        let mode = if bootstrap {
            Mode::Bootstrap
        } else {
            // A member listed among its own peers (one peer list for all members) skips itself.
            let peers: Vec<String> = self
                .peers
                .unwrap_or_default()
                .into_iter()
                .filter(|peer| *peer != advertise)
                .collect();
            if peers.is_empty() {
                return Err(PEERS.missing("peer to join through", file));
            }
            Mode::Join { peers }
        };
        let positive = |key: &KeyDoc, value: Option<u64>, default: u64| {
            let value = value.unwrap_or(default);
            if value == 0 {
                return Err(ConfigError::Conflict(format!(
                    "`{}` ({}, {}) is 0; give 1 or more",
                    key.key,
                    key.flag.unwrap_or("no flag"),
                    key.env
                )));
            }
            Ok(value)
        };
        // Timings above a day are mistakes (and the agents' interval travels as a u32 of
        // milliseconds, and the election timeout is doubled for its maximum).
        let timing = |key: &KeyDoc, value: Option<u64>, default: u64| {
            let value = positive(key, value, default)?;
            if value > TIMING_MS_MAX {
                return Err(ConfigError::Conflict(format!(
                    "`{}` ({}, {}) is {value} ms; give at most {TIMING_MS_MAX} (a day)",
                    key.key,
                    key.flag.unwrap_or("no flag"),
                    key.env
                )));
            }
            Ok(value)
        };
        if id == 0 {
            return Err(ConfigError::Conflict(
                "the member id is 0; member ids are 1 or more (--id, VGPU_CP_ID, `id`)".to_owned(),
            ));
        }
        let raft_heartbeat_ms = timing(&RAFT_HEARTBEAT_MS, self.raft_heartbeat_ms, 50)?;
        let election_timeout_ms = timing(&ELECTION_TIMEOUT_MS, self.election_timeout_ms, 250)?;
        if election_timeout_ms <= raft_heartbeat_ms {
            return Err(ConfigError::Conflict(format!(
                "the election timeout ({election_timeout_ms} ms) must exceed the Raft heartbeat ({raft_heartbeat_ms} ms); raise election_timeout_ms (--election-timeout-ms) or lower raft_heartbeat_ms (--raft-heartbeat-ms)"
            )));
        }
        let node_lost_timeout_ms = timing(&NODE_LOST_TIMEOUT_MS, self.node_lost_timeout_ms, 5000)?;
        let agent_heartbeat_ms = timing(&AGENT_HEARTBEAT_MS, self.agent_heartbeat_ms, 1000)?;
        let tls = api::tls::TlsFiles::from_parts(
            self.tls_ca_cert,
            self.tls_cert,
            self.tls_key,
            [TLS_CA_CERT.key, TLS_CERT.key, TLS_KEY.key],
        )
        .map_err(|error| ConfigError::Conflict(error.to_string()))?;
        let tenant_priority_max = self.tenant_priority_max;
        if let Some(ceiling) = tenant_priority_max
            && !(api::validate::PRIORITY_MIN..=api::validate::PRIORITY_MAX).contains(&ceiling)
        {
            return Err(ConfigError::Conflict(format!(
                "`{}` ({}, {}) is {ceiling}; give a priority from {} to {} (tenant certificates may use priorities up to it)",
                TENANT_PRIORITY_MAX.key,
                TENANT_PRIORITY_MAX.flag.unwrap_or("no flag"),
                TENANT_PRIORITY_MAX.env,
                api::validate::PRIORITY_MIN,
                api::validate::PRIORITY_MAX
            )));
        }
        let etcd = etcd_store(
            self.etcd_endpoints,
            self.etcd_prefix,
            [self.etcd_ca, self.etcd_cert, self.etcd_key],
            self.etcd_lease_ttl_s,
        )?;
        let security = crate::Security {
            insecure: self.insecure.unwrap_or(false),
            tls,
            ca_key: self.tls_ca_key,
            tenant_priority_max,
        };
        let config = Config {
            mode,
            id,
            listen,
            advertise,
            data_dir,
            timings: Timings {
                node_lost_timeout: Duration::from_millis(node_lost_timeout_ms),
                heartbeat_interval: Duration::from_millis(agent_heartbeat_ms),
                ..Default::default()
            },
            raft: RaftTimings {
                heartbeat_interval_ms: raft_heartbeat_ms,
                election_timeout_min_ms: election_timeout_ms,
                election_timeout_max_ms: election_timeout_ms.saturating_mul(2),
                snapshot_logs_since_last: positive(&SNAPSHOT_EVERY, self.snapshot_every, 20_000)?,
                snapshot_keep_logs: self.snapshot_keep_logs.unwrap_or(1000),
            },
            security,
            etcd,
        };
        debug_assert!(config.raft.election_timeout_max_ms > config.raft.election_timeout_min_ms);
        Ok(config)
    }
}

/// Stacks layers: a field set in `higher` wins over the same field in `lower`.
pub fn merge(higher: Settings, lower: Settings) -> Settings {
    Settings {
        mode: higher.mode.or(lower.mode),
        id: higher.id.or(lower.id),
        id_from_hostname: higher.id_from_hostname.or(lower.id_from_hostname),
        listen: higher.listen.or(lower.listen),
        advertise: higher.advertise.or(lower.advertise),
        data_dir: higher.data_dir.or(lower.data_dir),
        peers: higher.peers.or(lower.peers),
        node_lost_timeout_ms: higher.node_lost_timeout_ms.or(lower.node_lost_timeout_ms),
        agent_heartbeat_ms: higher.agent_heartbeat_ms.or(lower.agent_heartbeat_ms),
        raft_heartbeat_ms: higher.raft_heartbeat_ms.or(lower.raft_heartbeat_ms),
        election_timeout_ms: higher.election_timeout_ms.or(lower.election_timeout_ms),
        snapshot_every: higher.snapshot_every.or(lower.snapshot_every),
        snapshot_keep_logs: higher.snapshot_keep_logs.or(lower.snapshot_keep_logs),
        insecure: higher.insecure.or(lower.insecure),
        tls_ca_cert: higher.tls_ca_cert.or(lower.tls_ca_cert),
        tls_cert: higher.tls_cert.or(lower.tls_cert),
        tls_key: higher.tls_key.or(lower.tls_key),
        tls_ca_key: higher.tls_ca_key.or(lower.tls_ca_key),
        tenant_priority_max: higher.tenant_priority_max.or(lower.tenant_priority_max),
        etcd_endpoints: higher.etcd_endpoints.or(lower.etcd_endpoints),
        etcd_prefix: higher.etcd_prefix.or(lower.etcd_prefix),
        etcd_ca: higher.etcd_ca.or(lower.etcd_ca),
        etcd_cert: higher.etcd_cert.or(lower.etcd_cert),
        etcd_key: higher.etcd_key.or(lower.etcd_key),
        etcd_lease_ttl_s: higher.etcd_lease_ttl_s.or(lower.etcd_lease_ttl_s),
    }
}

/// The etcd store's settings, or `None` (the Raft store) when no endpoint is given; the other
/// `etcd_*` keys without endpoints are a mistake, and so are some of the three TLS files only.
fn etcd_store(
    endpoints: Option<Vec<String>>,
    prefix: Option<String>,
    tls: [Option<PathBuf>; 3],
    lease_ttl_s: Option<u64>,
) -> Result<Option<crate::EtcdStore>, ConfigError> {
    let endpoints: Vec<String> = endpoints
        .unwrap_or_default()
        .into_iter()
        .map(|endpoint| endpoint.trim().to_owned())
        .filter(|endpoint| !endpoint.is_empty())
        .collect();
    let named = |key: &KeyDoc| {
        format!(
            "`{}` ({}, {})",
            key.key,
            key.flag.unwrap_or("no flag"),
            key.env
        )
    };
    if endpoints.is_empty() {
        let given: Vec<String> = [
            (&ETCD_PREFIX, prefix.is_some()),
            (&ETCD_LEASE_TTL_S, lease_ttl_s.is_some()),
        ]
        .into_iter()
        .chain(
            [&ETCD_CA, &ETCD_CERT, &ETCD_KEY]
                .into_iter()
                .zip(tls.iter().map(Option::is_some)),
        )
        .filter(|(_, given)| *given)
        .map(|(key, _)| named(key))
        .collect();
        if !given.is_empty() {
            return Err(ConfigError::Conflict(format!(
                "{} set without {}: give the etcd cluster's endpoints, or drop the etcd settings to use the built-in Raft store",
                given.join(", "),
                named(&ETCD_ENDPOINTS)
            )));
        }
        return Ok(None);
    }
    if let Some(endpoint) = endpoints
        .iter()
        .find(|endpoint| !endpoint.starts_with("http://") && !endpoint.starts_with("https://"))
    {
        return Err(ConfigError::Conflict(format!(
            "the etcd endpoint `{endpoint}` ({}) is not a URL; write http://HOST:PORT, or https://HOST:PORT with etcd_ca, etcd_cert and etcd_key",
            named(&ETCD_ENDPOINTS)
        )));
    }
    let prefix = prefix.unwrap_or_else(|| crate::ETCD_PREFIX_DEFAULT.to_owned());
    if !prefix.starts_with('/') || !prefix.ends_with('/') || prefix.len() < 2 {
        return Err(ConfigError::Conflict(format!(
            "the etcd prefix `{prefix}` ({}) must start and end with `/`, such as /vgpu/ (one prefix per pool)",
            named(&ETCD_PREFIX)
        )));
    }
    let tls = match tls {
        [None, None, None] => None,
        [Some(ca), Some(cert), Some(key)] => Some(crate::EtcdTlsFiles { ca, cert, key }),
        _ => {
            return Err(ConfigError::Conflict(format!(
                "mTLS to etcd needs all three of {}, {} and {}",
                named(&ETCD_CA),
                named(&ETCD_CERT),
                named(&ETCD_KEY)
            )));
        }
    };
    let lease_ttl = match lease_ttl_s {
        None => crate::ETCD_LEASE_TTL_DEFAULT,
        Some(seconds) if (2..=ETCD_LEASE_TTL_S_MAX).contains(&seconds) => {
            Duration::from_secs(seconds)
        }
        Some(seconds) => {
            return Err(ConfigError::Conflict(format!(
                "{} is {seconds}; give 2 to {ETCD_LEASE_TTL_S_MAX} seconds (etcd leases are whole seconds; a dead leader is replaced within about this long)",
                named(&ETCD_LEASE_TTL_S)
            )));
        }
    };
    Ok(Some(crate::EtcdStore {
        endpoints,
        prefix,
        tls,
        lease_ttl,
    }))
}

/// The member's [`Config`] from the command line's `flags`, the environment and the
/// configuration file (`--config`, else `$VGPU_CP_CONFIG`, else `/etc/vgpu/vgpu-cp.toml` if it
/// exists).
pub fn load(
    flags: Settings,
    config_flag: Option<&Path>,
    env: &dyn Environment,
) -> Result<Config, ConfigError> {
    let located = common::locate(
        config_flag,
        env,
        CONFIG_ENV,
        &[PathBuf::from(CONFIG_PATH_DEFAULT)],
    );
    let (file, path) = common::load::<Settings>(located)?;
    let settings = merge(flags, merge(Settings::from_env(env)?, file));
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| env.var("HOSTNAME"));
    settings.resolve(path.as_deref(), hostname.as_deref().map(str::trim))
}

/// The member id of a StatefulSet pod: 1 + the ordinal that ends its host name (`vgpu-cp-0` is
/// member 1).
pub fn id_from_hostname(hostname: &str) -> Result<u64, ConfigError> {
    let ordinal = hostname
        .trim()
        .rsplit_once('-')
        .and_then(|(_, ordinal)| ordinal.parse::<u64>().ok())
        .ok_or_else(|| {
            ConfigError::Conflict(format!(
                "id_from_hostname is set, but the host name `{hostname}` does not end in `-N` as a StatefulSet pod's does (`vgpu-cp-0`); set id instead"
            ))
        })?;
    ordinal.checked_add(1).ok_or_else(|| {
        ConfigError::Conflict(format!(
            "the host name `{hostname}` has too large an ordinal"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::config::check;
    use std::collections::BTreeMap;

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
    fn flags_win_over_the_environment_which_wins_over_the_file() {
        let file = write_config(
            "mode = \"join\"\nid = 3\nlisten = \"0.0.0.0:7403\"\ndata_dir = \"/file\"\npeers = [\"file:1\"]\nraft_heartbeat_ms = 60\n",
        );
        let vars = env(&[
            ("VGPU_CP_ID", "2"),
            ("VGPU_CP_DATA_DIR", "/env"),
            ("VGPU_CP_PEERS", "env:1, env:2"),
        ]);
        let flags = Settings {
            id: Some(7),
            ..Settings::default()
        };
        let config = load(flags, Some(file.path()), &vars).unwrap();
        assert_eq!(config.id, 7, "the flag wins");
        assert_eq!(
            config.data_dir,
            PathBuf::from("/env"),
            "the variable wins over the file"
        );
        let Mode::Join { peers } = config.mode else {
            panic!("the file's mode applies")
        };
        assert_eq!(peers, vec!["env:1", "env:2"]);
        assert_eq!(
            config.listen.to_string(),
            "0.0.0.0:7403",
            "the file wins over the default"
        );
        assert_eq!(config.advertise, "0.0.0.0:7403");
        assert_eq!(config.raft.heartbeat_interval_ms, 60);
        assert_eq!(
            config.raft.election_timeout_min_ms, 250,
            "the default applies"
        );
        assert_eq!(config.timings.node_lost_timeout, Duration::from_secs(5));
    }

    #[test]
    fn the_config_variable_names_the_file_and_the_old_variable_still_works() {
        let file = write_config("mode = \"bootstrap\"\nid = 1\ndata_dir = \"/d\"\n");
        let path = file.path().to_str().unwrap();
        let vars = env(&[
            ("VGPU_CP_CONFIG", path),
            ("VGPU_NODE_LOST_TIMEOUT_MS", "1500"),
        ]);
        let config = load(Settings::default(), None, &vars).unwrap();
        assert!(matches!(config.mode, Mode::Bootstrap));
        assert_eq!(
            config.timings.node_lost_timeout,
            Duration::from_millis(1500)
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_file_and_what_to_write() {
        let file = write_config("mode = \"bootstrap\"\nlissen = \"0.0.0.0:1\"\n");
        let error = load(Settings::default(), Some(file.path()), &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("unknown field `lissen`"), "{error}");
        assert!(
            error.contains(&file.path().display().to_string()),
            "{error}"
        );
        let file = write_config("mode = \"leader\"\n");
        let error = load(Settings::default(), Some(file.path()), &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("`bootstrap`"), "{error}");
        let error = load(
            Settings::default(),
            None,
            &env(&[("VGPU_CP_LISTEN", "port 80")]),
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("VGPU_CP_LISTEN=`port 80`"), "{error}");
        assert!(error.contains("0.0.0.0:7401"), "{error}");
    }

    /// The tenant priority ceiling (issue 22, point 4) is a setting like any other, bounded by
    /// the priority range.
    #[test]
    fn the_tenant_priority_ceiling_is_a_bounded_setting() {
        let base = Settings {
            mode: Some(ModeName::Bootstrap),
            id: Some(1),
            data_dir: Some("/d".into()),
            ..Settings::default()
        };
        let config = base.clone().resolve(None, None).unwrap();
        assert_eq!(config.security.tenant_priority_max, None, "the default");
        let vars = env(&[("VGPU_CP_TENANT_PRIORITY_MAX", "250")]);
        let from_env = Settings::from_env(&vars).unwrap();
        assert_eq!(from_env.tenant_priority_max, Some(250));
        let config = merge(from_env, base.clone()).resolve(None, None).unwrap();
        assert_eq!(config.security.tenant_priority_max, Some(250));
        let error = Settings {
            tenant_priority_max: Some(5000),
            ..base
        }
        .resolve(None, None)
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("tenant_priority_max") && error.contains("-1000 to 1000"),
            "{error}"
        );
        let error = Settings::from_env(&env(&[("VGPU_CP_TENANT_PRIORITY_MAX", "high")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("VGPU_CP_TENANT_PRIORITY_MAX"), "{error}");
    }

    #[test]
    fn missing_settings_say_where_to_give_them() {
        let bootstrap = Settings {
            mode: Some(ModeName::Bootstrap),
            data_dir: Some("/d".into()),
            ..Settings::default()
        };
        let error = bootstrap
            .clone()
            .resolve(None, None)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--id") && error.contains("VGPU_CP_ID"),
            "{error}"
        );
        let join = Settings {
            mode: Some(ModeName::Join),
            id: Some(2),
            ..bootstrap
        };
        let error = join
            .resolve(Some(Path::new("/etc/x.toml")), None)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--peer") && error.contains("/etc/x.toml"),
            "{error}"
        );
        let error = Settings::default()
            .resolve(None, None)
            .unwrap_err()
            .to_string();
        assert!(error.contains("VGPU_CP_MODE"), "{error}");
        let fast = Settings {
            mode: Some(ModeName::Bootstrap),
            id: Some(1),
            data_dir: Some("/d".into()),
            raft_heartbeat_ms: Some(300),
            ..Settings::default()
        };
        assert!(
            fast.resolve(None, None)
                .unwrap_err()
                .to_string()
                .contains("must exceed")
        );
    }

    #[test]
    fn the_etcd_store_is_one_setting_and_its_mistakes_are_named() {
        let base = Settings {
            mode: Some(ModeName::Bootstrap),
            id: Some(1),
            data_dir: Some("/d".into()),
            ..Settings::default()
        };
        assert!(base.clone().resolve(None, None).unwrap().etcd.is_none());
        let vars = env(&[
            ("VGPU_CP_ETCD_ENDPOINTS", "http://e1:2379, http://e2:2379"),
            ("VGPU_CP_ETCD_PREFIX", "/pool-a/"),
        ]);
        let config = merge(Settings::from_env(&vars).unwrap(), base.clone())
            .resolve(None, None)
            .unwrap();
        let etcd = config.etcd.expect("the etcd store");
        assert_eq!(etcd.endpoints, ["http://e1:2379", "http://e2:2379"]);
        assert_eq!(etcd.prefix, "/pool-a/");
        assert!(etcd.tls.is_none());
        let with = |settings: Settings| settings.resolve(None, None).unwrap_err().to_string();
        let endpoints = Some(vec!["http://e1:2379".to_owned()]);
        let error = with(Settings {
            etcd_prefix: Some("/p/".into()),
            ..base.clone()
        });
        assert!(
            error.contains("--etcd-endpoints") && error.contains("--etcd-prefix"),
            "{error}"
        );
        let error = with(Settings {
            etcd_endpoints: endpoints.clone(),
            etcd_prefix: Some("vgpu".into()),
            ..base.clone()
        });
        assert!(error.contains("must start and end with `/`"), "{error}");
        let error = with(Settings {
            etcd_endpoints: endpoints.clone(),
            etcd_ca: Some("/ca".into()),
            ..base.clone()
        });
        assert!(
            error.contains("all three") && error.contains("--etcd-key"),
            "{error}"
        );
        let error = with(Settings {
            etcd_endpoints: Some(vec!["e1:2379".to_owned()]),
            ..base.clone()
        });
        assert!(error.contains("not a URL"), "{error}");
        let error = with(Settings {
            etcd_endpoints: endpoints.clone(),
            etcd_lease_ttl_s: Some(7200),
            ..base
        });
        assert!(error.contains("--etcd-lease-ttl-s"), "{error}");
    }

    #[test]
    fn auto_mode_and_ids_from_statefulset_host_names() {
        let peers = [
            "vgpu-cp-0.vgpu-cp:7401",
            "vgpu-cp-1.vgpu-cp:7401",
            "vgpu-cp-2.vgpu-cp:7401",
        ];
        let member = |pod: &str| {
            Settings {
                mode: Some(ModeName::Auto),
                id_from_hostname: Some(true),
                advertise: Some(format!("{pod}.vgpu-cp:7401")),
                data_dir: Some("/d".into()),
                peers: Some(peers.iter().map(|peer| peer.to_string()).collect()),
                ..Settings::default()
            }
            .resolve(None, Some(pod))
        };
        let first = member("vgpu-cp-0").unwrap();
        assert_eq!(first.id, 1);
        assert!(matches!(first.mode, Mode::Bootstrap));
        let third = member("vgpu-cp-2").unwrap();
        assert_eq!(third.id, 3);
        let Mode::Join { peers: joined } = third.mode else {
            panic!("member 3 joins")
        };
        assert_eq!(joined, &peers[..2], "a member does not join through itself");
        let error = member("gpu-box").unwrap_err().to_string();
        assert!(
            error.contains("`gpu-box`") && error.contains("set id"),
            "{error}"
        );
        assert_eq!(id_from_hostname("a-b-41").unwrap(), 42);
    }

    #[test]
    fn the_settings_keys_example_and_documentation_agree() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        check::assert_consistent(&check::Consistency {
            keys: KEYS,
            repository_root: &root,
            example: "deploy/config/vgpu-cp.toml",
            docs_section: "vgpu-cp",
            docs_mentions: &[CONFIG_ENV, CONFIG_PATH_DEFAULT],
            from_env: Settings::from_env,
        });
    }
}
