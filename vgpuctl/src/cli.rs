//! Command-line shape of vgpuctl (clap derive) and the parsers that turn what people type
//! (`--gpus 0.25`, `--memory 20GiB`, `--selector zone=a`) into request fields.
//!
//! Parsers return the messages of the `api` crate where one exists, so that a bad value reads the
//! same whether vgpuctl or the server refuses it. Values that clap could mistake for flags
//! (`--memory -5GiB`, `--priority -10`) are accepted by clap and refused here, with our message.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use api::validate::{PRIORITY_MAX, PRIORITY_MIN, RequestError};
use clap::{Args, Parser, Subcommand, ValueEnum};

/// Address used when neither `--endpoints`, `VGPUCTL_ENDPOINTS` nor the configuration file
/// gives one.
pub const ENDPOINT_DEFAULT: &str = "127.0.0.1:7401";
/// Port added to an endpoint written without one.
pub const PORT_DEFAULT: u16 = 7401;
/// More decimals than this cannot be expressed in thousandths of a GPU.
const GPU_DECIMALS_MAX: usize = 3;

/// vgpuctl: place, release and inspect GPU tenants, nodes and the vgpu control-plane cluster.
///
/// Results go to stdout, diagnostics to stderr. Exit status: 0 on success, 1 when the control
/// plane refused or failed the request, 2 for bad usage, 3 when no endpoint answered. The global
/// options can also be set by VGPUCTL_* variables or in the configuration file; flags win over
/// variables, variables over the file (docs/configuration.md).
#[derive(Debug, Parser)]
#[command(name = "vgpuctl", version, propagate_version = true)]
pub struct Cli {
    /// Configuration file (TOML) [default: $VGPUCTL_CONFIG, else
    /// ~/.config/vgpu/vgpuctl.toml if it exists].
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        value_name = "FILE"
    )]
    pub config: Option<PathBuf>,

    /// Control-plane addresses, comma separated (any member works; writes are forwarded to the
    /// leader) [env: VGPUCTL_ENDPOINTS or VGPU_ENDPOINTS] [default: 127.0.0.1:7401].
    #[arg(
        long,
        global = true, help_heading = "Global options",
        value_delimiter = ',',
        value_parser = parse_endpoint,
        value_name = "ADDR[,ADDR...]"
    )]
    pub endpoints: Vec<String>,

    /// Output format [env: VGPUCTL_OUTPUT] [default: table].
    #[arg(
        short,
        long,
        global = true,
        help_heading = "Global options",
        value_enum
    )]
    pub output: Option<Format>,

    /// Time limit for each call to the control plane, including retries on other endpoints
    /// (`10s`, `500ms`, `1m`; a plain number is seconds) [env: VGPUCTL_TIMEOUT] [default: 10s].
    #[arg(long, global = true, help_heading = "Global options", value_parser = parse_duration, value_name = "DURATION")]
    pub timeout: Option<Duration>,

    /// Plain-text gRPC without a certificate, for a control plane started with --insecure
    /// [env: VGPUCTL_INSECURE].
    #[arg(long, global = true, help_heading = "Global options")]
    pub insecure: bool,

    /// The cluster CA certificate [env: VGPUCTL_TLS_CA_CERT].
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        value_name = "FILE"
    )]
    pub tls_ca_cert: Option<PathBuf>,

    /// Your certificate (role admin or tenant:OWNER, from `vgpu-cp cert issue`) [env:
    /// VGPUCTL_TLS_CERT].
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        value_name = "FILE"
    )]
    pub tls_cert: Option<PathBuf>,

    /// Its private key [env: VGPUCTL_TLS_KEY].
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        value_name = "FILE"
    )]
    pub tls_key: Option<PathBuf>,

    /// More diagnostics on stderr (-v info, -vv debug, -vvv trace). `VGPUCTL_LOG` overrides.
    #[arg(short, long, global = true, help_heading = "Global options", action = clap::ArgAction::Count)]
    pub verbose: u8,

    #[command(subcommand)]
    pub command: Command,
}

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// Aligned columns or short sentences, for people.
    Table,
    /// JSON, for scripts (stable field names).
    Json,
    /// YAML with the same structure as JSON.
    Yaml,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Creates a tenant and places it on GPUs (or queues it until it fits).
    ///
    /// Waits up to --wait-timeout for a pending tenant to be placed. A tenant that is still
    /// pending then is reported as pending with its reason, and the exit status is 0: the request
    /// was accepted and stays queued. Placing the same name with the same request again is safe.
    Place(PlaceArgs),
    /// Changes a running tenant in place: its compute share, priority or latency target.
    Set {
        #[command(subcommand)]
        target: SetTarget,
    },
    /// Releases a tenant's GPUs and forgets it.
    Release {
        /// Tenant name.
        #[arg(value_parser = tenant_name)]
        name: String,
    },
    /// Lists tenants, nodes or GPUs, or shows one of them.
    Get(GetArgs),
    /// Shows one tenant or node in detail, for people.
    Describe {
        #[command(subcommand)]
        target: DescribeTarget,
    },
    /// Cordons a node: its tenants are re-placed elsewhere and nothing new lands on it.
    Drain {
        /// Node name.
        #[arg(value_parser = node_name)]
        node: String,
    },
    /// Makes a drained node schedulable again.
    Uncordon {
        /// Node name.
        #[arg(value_parser = node_name)]
        node: String,
    },
    /// Control-plane membership.
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Nodes of the pool (admins).
    Node {
        #[command(subcommand)]
        command: NodeCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// Forgets a node that is gone for good or was registered by mistake: its tenants are
    /// re-placed elsewhere. An agent still running for it registers it again.
    Remove {
        /// Node name.
        #[arg(value_parser = node_name)]
        node: String,
    },
}

/// Flags of `vgpuctl place`.
#[derive(Debug, Clone, Args)]
pub struct PlaceArgs {
    /// Tenant name (lowercase letters, digits, `-` and `.`).
    #[arg(value_parser = tenant_name)]
    pub name: String,

    /// Whole GPUs (`2`) or a fraction of one GPU (`0.25`, at most 3 decimals). With --nodes, GPUs
    /// per node.
    #[arg(long, value_parser = parse_gpus, allow_hyphen_values = true, value_name = "N|FRACTION")]
    pub gpus: GpuAmount,

    /// Memory per GPU (`20GiB`, `512MiB`, `80GB`). Default: the whole GPU, or the requested
    /// fraction of its memory.
    #[arg(long, value_parser = parse_memory, allow_hyphen_values = true, value_name = "SIZE")]
    pub memory: Option<u64>,

    /// Elastic memory: what the tenant may grow to per GPU (`60GiB`), at least `--memory` and
    /// at most a GPU's memory. Only `--memory` is booked; above it the tenant borrows memory the
    /// GPU has free, and gives it back (swapped to host memory, never killed) when others need
    /// their requests. Needs `--memory`. Default: the request (a hard quota).
    #[arg(long, value_parser = parse_memory, allow_hyphen_values = true, value_name = "SIZE")]
    pub memory_limit: Option<u64>,

    /// Guaranteed compute share per GPU in percent (1..=100). Default: 100 for whole GPUs, the
    /// requested fraction otherwise.
    #[arg(long, value_parser = parse_compute, allow_hyphen_values = true, value_name = "PCT")]
    pub compute: Option<u32>,

    /// Let the tenant use idle compute beyond its guaranteed share.
    #[arg(long)]
    pub burst: bool,

    /// Higher runs first and may preempt lower (-1000..=1000).
    #[arg(long, default_value_t = 0, value_parser = parse_priority, allow_hyphen_values = true, value_name = "P")]
    pub priority: i32,

    /// May be evicted by non-preemptible tenants of equal or higher priority.
    #[arg(long)]
    pub preemptible: bool,

    /// Bandwidth weight of the tenant's NCCL traffic against the other tenants on its links
    /// (1..=1000000). Default: its compute share (percent per GPU, summed), so a tenant with half
    /// a GPU weighs 50 against a neighbour with a quarter (25).
    #[arg(long, value_parser = parse_bandwidth, value_name = "WEIGHT")]
    pub bandwidth: Option<u32>,

    /// Latency-sensitive (small-batch inference): on nodes that run MPS, never held by turns,
    /// and the other tenants of its GPUs give up SMs while it is active.
    #[arg(long)]
    pub latency: bool,

    /// With --latency: the step latency to hold the tenant to (`500us`, `2ms`, `1.5ms`,
    /// `0.002s`; 10us..=60s). Default: 1.2x its latency alone, as the node measures it.
    #[arg(long, value_parser = parse_latency_target, allow_hyphen_values = true, value_name = "DURATION")]
    pub latency_target: Option<u64>,

    /// Require every pair of GPUs on a node to be NVLink-connected (default: prefer NVLink).
    #[arg(
        long,
        visible_alias = "require-nvlink",
        conflicts_with = "ignore_nvlink"
    )]
    pub nvlink: bool,

    /// Do not consider NVLink at all when choosing GPUs.
    #[arg(long)]
    pub ignore_nvlink: bool,

    /// Number of nodes of a multi-node gang; --gpus is then GPUs per node.
    #[arg(long, value_parser = parse_nodes, allow_hyphen_values = true, value_name = "N")]
    pub nodes: Option<u32>,

    /// Only nodes whose labels contain all these pairs (`k=v,k2=v2`; may be repeated).
    #[arg(long, visible_alias = "node-selector", value_parser = parse_selector, value_name = "K=V,...")]
    pub selector: Vec<BTreeMap<String, String>>,

    /// CPU the tenant needs on each node it is placed on (`8`, `2.5`, `500m`): only nodes whose
    /// agents report that much not yet requested qualify. Default: none.
    #[arg(long, value_parser = parse_cpu, allow_hyphen_values = true, value_name = "CPUS")]
    pub cpu: Option<u64>,

    /// Host memory (RAM) the tenant needs on each node it is placed on (`64GiB`). Default: none.
    #[arg(long, value_parser = parse_memory, allow_hyphen_values = true, value_name = "SIZE")]
    pub host_memory: Option<u64>,

    /// Only GPUs of this model, as `vgpuctl get gpus` shows it (`H100-80GB`); repeat the flag to
    /// allow several models. Default: any model.
    #[arg(long = "gpu-model", value_parser = parse_gpu_model, value_name = "MODEL")]
    pub gpu_models: Vec<String>,

    /// Return as soon as the control plane accepted the tenant, placed or pending.
    #[arg(long)]
    pub no_wait: bool,

    /// Seconds to wait for a pending tenant to be placed.
    #[arg(long, default_value_t = 30, value_name = "SECS")]
    pub wait_timeout: u64,

    /// Record this owner on the tenant (admins; a tenant certificate always places for its own
    /// owner).
    #[arg(long, value_parser = owner_name, value_name = "OWNER")]
    pub owner: Option<String>,
}

#[derive(Debug, Clone, Subcommand)]
pub enum SetTarget {
    /// A tenant: give at least one of --compute, --latency-target and --priority.
    ///
    /// The tenant stays on its GPUs: a compute share that does not fit them is refused with the
    /// reason (release it and place it again to move it). The change is recorded in its history
    /// and reaches its node with the next assignment; processes started after that get the new
    /// values.
    #[command(visible_alias = "tenants")]
    Tenant(SetTenantArgs),
}

/// Flags of `vgpuctl set tenant`.
#[derive(Debug, Clone, Args)]
pub struct SetTenantArgs {
    /// Tenant name.
    #[arg(value_parser = tenant_name)]
    pub name: String,

    /// New guaranteed compute share per GPU in percent (1..=100), for a tenant with a fraction
    /// of a GPU; it must fit the GPU the tenant is on.
    #[arg(long, value_parser = parse_compute, allow_hyphen_values = true, value_name = "PCT")]
    pub compute: Option<u32>,

    /// New step-latency target of a latency tenant (`500us`, `2ms`, `1.5ms`, `0.002s`;
    /// 10us..=60s), or `default` to remove it (1.2x its latency alone).
    #[arg(long, value_parser = parse_latency_target_setting, allow_hyphen_values = true, value_name = "DURATION|default")]
    pub latency_target: Option<u64>,

    /// New priority (-1000..=1000).
    #[arg(long, value_parser = parse_priority, allow_hyphen_values = true, value_name = "P")]
    pub priority: Option<i32>,
}

/// Flags of `vgpuctl get`.
#[derive(Debug, Clone, Args)]
pub struct GetArgs {
    /// What to list.
    #[arg(value_enum)]
    pub kind: Kind,

    /// One tenant or node name, or one GPU uuid; prints that object alone.
    pub name: Option<String>,

    /// Only GPUs of this node (`get gpus`).
    #[arg(long, value_parser = node_name)]
    pub node: Option<String>,

    /// Answer from the contacted node's local state, without a linearizability check (faster,
    /// works without a leader, may be slightly behind).
    #[arg(long)]
    pub stale: bool,
}

/// Kinds of objects `vgpuctl get` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Kind {
    #[value(alias = "tenant", alias = "t")]
    Tenants,
    #[value(alias = "node", alias = "no")]
    Nodes,
    #[value(alias = "gpu")]
    Gpus,
}

#[derive(Debug, Clone, Subcommand)]
pub enum DescribeTarget {
    /// A tenant: request, state, placement and history.
    #[command(visible_alias = "tenants")]
    Tenant {
        #[arg(value_parser = tenant_name)]
        name: String,
        /// Read the contacted node's local state.
        #[arg(long)]
        stale: bool,
    },
    /// A node: labels, state and every GPU with its topology and tenants.
    #[command(visible_alias = "nodes")]
    Node {
        #[arg(value_parser = node_name)]
        name: String,
        /// Read the contacted node's local state.
        #[arg(long)]
        stale: bool,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum ClusterCommand {
    /// Leader, term, members and log progress, as seen by the node that answers.
    Status,
    /// Removes a member from the control plane.
    Remove {
        /// Member id, as `cluster status` shows it.
        id: u64,
    },
    /// Adds a member: it joins as a learner and becomes a voter once caught up.
    Add {
        /// New member id.
        id: u64,
        /// Address at which the other members reach it (`host:port`).
        #[arg(value_parser = parse_endpoint)]
        address: String,
    },
}

/// A GPU amount as the API carries it: whole GPUs or thousandths of one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuAmount {
    Whole(u32),
    Milli(u32),
}

/// Parses `--gpus`: a positive whole number, or a fraction below 1 with at most 3 decimals.
pub fn parse_gpus(text: &str) -> Result<GpuAmount, String> {
    let text = text.trim();
    let examples = "ask for whole GPUs (`--gpus 2`) or a fraction below 1 (`--gpus 0.25`)";
    if text.is_empty() {
        return Err(format!("the GPU count is empty; {examples}"));
    }
    if text.starts_with('-') {
        return Err(format!("the GPU count `{text}` is negative; {examples}"));
    }
    let (whole_part, fraction_part) = text.split_once('.').unwrap_or((text, ""));
    let digits_only = |part: &str| part.chars().all(|c| c.is_ascii_digit());
    if !digits_only(whole_part)
        || !digits_only(fraction_part)
        || (whole_part.is_empty() && fraction_part.is_empty())
    {
        return Err(format!("cannot read the GPU count `{text}`; {examples}"));
    }
    let whole: u32 = if whole_part.is_empty() {
        0
    } else {
        whole_part
            .parse()
            .map_err(|_| format!("the GPU count `{text}` is too large; {examples}"))?
    };
    let fraction_is_zero = fraction_part.chars().all(|c| c == '0');
    if whole > 0 && !fraction_is_zero {
        return Err(format!(
            "the GPU count `{text}` is neither whole nor below 1; use whole GPUs or a fraction below 1, e.g. `--gpus 2` or `--gpus 0.5`"
        ));
    }
    let fraction_part = fraction_part.trim_end_matches('0');
    if fraction_part.len() > GPU_DECIMALS_MAX {
        return Err(format!(
            "the GPU fraction `{text}` has more than {GPU_DECIMALS_MAX} decimals; GPUs are shared in thousandths, e.g. `--gpus 0.125`"
        ));
    }
    if whole > 0 {
        return Ok(GpuAmount::Whole(whole));
    }
    let milli: u32 = format!("{fraction_part:0<3}")[..GPU_DECIMALS_MAX]
        .parse()
        .unwrap_or(0);
    if milli == 0 {
        return Err(RequestError::NoGpus.to_string());
    }
    debug_assert!((1..1000).contains(&milli));
    Ok(GpuAmount::Milli(milli))
}

/// Parses `--memory` with [`api::size::parse_bytes`].
pub fn parse_memory(text: &str) -> Result<u64, String> {
    api::size::parse_bytes(text).map_err(|error| error.to_string())
}

/// Parses `--compute`: a percentage 1..=100, with or without a trailing `%`.
pub fn parse_compute(text: &str) -> Result<u32, String> {
    let trimmed = text.trim();
    let number = trimmed.strip_suffix('%').unwrap_or(trimmed).trim();
    if number.starts_with('-')
        && number[1..].chars().all(|c| c.is_ascii_digit())
        && number.len() > 1
    {
        return Err(format!(
            "the compute share `{trimmed}` is negative; give a share between 1 and 100"
        ));
    }
    let percent: u32 = match number.parse() {
        Ok(percent) => percent,
        // Only digits but no u32: far above 100.
        Err(_) if !number.is_empty() && number.chars().all(|c| c.is_ascii_digit()) => u32::MAX,
        Err(_) => {
            return Err(format!(
                "cannot read the compute share `{trimmed}`; give a percentage between 1 and 100, e.g. `--compute 25`"
            ));
        }
    };
    if !(1..=100).contains(&percent) {
        return Err(RequestError::ComputeOutOfRange(percent).to_string());
    }
    Ok(percent)
}

/// Parses `--priority`: a whole number in -1000..=1000.
pub fn parse_bandwidth(text: &str) -> Result<u32, String> {
    let trimmed = text.trim();
    match trimmed.parse::<u64>() {
        Ok(w) if (1..=u64::from(api::validate::BANDWIDTH_WEIGHT_MAX)).contains(&w) => Ok(w as u32),
        _ => Err(format!(
            "cannot use the bandwidth weight `{trimmed}`; give a whole number between 1 and {}",
            api::validate::BANDWIDTH_WEIGHT_MAX
        )),
    }
}

/// Parses `--latency-target`: a decimal number with a unit (`us` or `µs`, `ms`, `s`), into
/// whole microseconds within the API's bounds. Exact: `1.5ms` is 1500, and a value finer than a
/// microsecond is refused rather than rounded.
pub fn parse_latency_target(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let examples = "write e.g. `500us`, `2ms`, `1.5ms` or `0.002s`";
    if trimmed.starts_with('-') {
        return Err(format!(
            "the latency target `{trimmed}` is negative; {examples}"
        ));
    }
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let unit_us: u128 = match unit.trim() {
        "us" | "µs" | "μs" => 1,
        "ms" => 1_000,
        "s" => 1_000_000,
        "" if !number.is_empty() => {
            return Err(format!(
                "the latency target `{trimmed}` has no unit; {examples}"
            ));
        }
        _ => {
            return Err(format!(
                "cannot read the latency target `{trimmed}`; {examples}"
            ));
        }
    };
    let (whole_part, fraction_part) = number.split_once('.').unwrap_or((number, ""));
    let digits_only = |part: &str| part.chars().all(|c| c.is_ascii_digit());
    if (whole_part.is_empty() && fraction_part.is_empty())
        || !digits_only(whole_part)
        || !digits_only(fraction_part)
    {
        return Err(format!(
            "cannot read the latency target `{trimmed}`; {examples}"
        ));
    }
    // The server's message, with the value in microseconds (saturated: far out of range).
    let out_of_range = |microseconds: u128| {
        let microseconds = u64::try_from(microseconds).unwrap_or(u64::MAX);
        RequestError::LatencyTargetOutOfRange(microseconds).to_string()
    };
    let whole_part = whole_part.trim_start_matches('0');
    let fraction_part = fraction_part.trim_end_matches('0');
    // More digits than these cannot be within 60 s, nor whole microseconds.
    if whole_part.len() > 12 {
        return Err(out_of_range(u128::MAX));
    }
    if fraction_part.len() > 6 {
        return Err(format!(
            "the latency target `{trimmed}` is finer than a microsecond; {examples}"
        ));
    }
    let whole: u128 = whole_part.parse().unwrap_or(0);
    let fraction: u128 = fraction_part.parse().unwrap_or(0);
    let fraction_scale = 10u128.pow(fraction_part.len() as u32);
    if !(fraction * unit_us).is_multiple_of(fraction_scale) {
        return Err(format!(
            "the latency target `{trimmed}` is finer than a microsecond; {examples}"
        ));
    }
    let microseconds = whole * unit_us + fraction * unit_us / fraction_scale;
    let bounds = u128::from(api::validate::LATENCY_TARGET_US_MIN)
        ..=u128::from(api::validate::LATENCY_TARGET_US_MAX);
    if !bounds.contains(&microseconds) {
        return Err(out_of_range(microseconds));
    }
    let microseconds = microseconds as u64;
    debug_assert!(api::validate::check_latency_target(true, microseconds).is_ok());
    Ok(microseconds)
}

/// Parses `set tenant --latency-target`: a target as [`parse_latency_target`] reads it, or
/// `default` (or `none`) for 0, which removes the tenant's target.
pub fn parse_latency_target_setting(text: &str) -> Result<u64, String> {
    match text.trim() {
        "default" | "none" => Ok(0),
        _ => parse_latency_target(text)
            .map_err(|problem| format!("{problem}, or `default` to remove the target")),
    }
}

/// Parses `--cpu` with [`api::cpu::parse_cpu_milli`]: CPUs or millicores, more than zero.
pub fn parse_cpu(text: &str) -> Result<u64, String> {
    let milli = api::cpu::parse_cpu_milli(text).map_err(|error| error.to_string())?;
    if milli == 0 {
        return Err(format!(
            "the CPU amount `{}` is zero; leave out --cpu to ask for none, or give CPUs such as `--cpu 8`",
            text.trim()
        ));
    }
    Ok(milli)
}

/// Parses `--gpu-model`: a model name as the GPUs report it, not empty.
pub fn parse_gpu_model(text: &str) -> Result<String, String> {
    let model = text.trim();
    if model.is_empty() {
        return Err(
            "the GPU model is empty; give a model as `vgpuctl get gpus` shows it, e.g. `--gpu-model H100-80GB`"
                .to_owned(),
        );
    }
    Ok(model.to_owned())
}

pub fn parse_priority(text: &str) -> Result<i32, String> {
    let trimmed = text.trim();
    let cannot_read = || {
        format!(
            "cannot read the priority `{trimmed}`; give a whole number between {PRIORITY_MIN} and {PRIORITY_MAX}"
        )
    };
    let priority: i64 = trimmed.parse().map_err(|_| cannot_read())?;
    let priority =
        i32::try_from(priority).unwrap_or(if priority < 0 { i32::MIN } else { i32::MAX });
    if !(PRIORITY_MIN..=PRIORITY_MAX).contains(&priority) {
        return Err(RequestError::PriorityOutOfRange(priority).to_string());
    }
    Ok(priority)
}

/// Parses `--nodes`: 1 or more.
pub fn parse_nodes(text: &str) -> Result<u32, String> {
    let trimmed = text.trim();
    match trimmed.parse::<u32>() {
        Ok(0) => {
            Err("the node count is 0; give 1 or more (leave out --nodes for one node)".to_owned())
        }
        Ok(nodes) => Ok(nodes),
        Err(_) => Err(format!(
            "cannot read the node count `{trimmed}`; give a whole number of 1 or more"
        )),
    }
}

/// Parses one `--selector` value: `key=value` pairs separated by commas.
pub fn parse_selector(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut pairs = BTreeMap::new();
    for pair in text
        .split(',')
        .map(str::trim)
        .filter(|pair| !pair.is_empty())
    {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(format!(
                "the selector `{pair}` is not a `key=value` pair; write e.g. `--selector zone=a,gpu=h100`"
            ));
        };
        let (key, value) = (key.trim(), value.trim());
        if key.is_empty() {
            return Err(format!(
                "the selector `{pair}` has an empty key; write e.g. `--selector zone=a`"
            ));
        }
        if let Some(previous) = pairs.insert(key.to_owned(), value.to_owned())
            && previous != value
        {
            return Err(format!(
                "the selector gives `{key}` twice (`{previous}` and `{value}`); give each key once"
            ));
        }
    }
    if pairs.is_empty() {
        return Err(
            "the selector is empty; write `key=value` pairs, e.g. `--selector zone=a`".to_owned(),
        );
    }
    Ok(pairs)
}

/// Merges repeated `--selector` flags into one map; a key given twice with different values is an
/// error.
pub fn merge_selectors(
    selectors: &[BTreeMap<String, String>],
) -> Result<BTreeMap<String, String>, String> {
    let mut merged = BTreeMap::new();
    for (key, value) in selectors.iter().flatten() {
        if let Some(previous) = merged.insert(key.clone(), value.clone())
            && &previous != value
        {
            return Err(format!(
                "the selector gives `{key}` twice (`{previous}` and `{value}`); give each key once"
            ));
        }
    }
    Ok(merged)
}

/// Parses one endpoint: `host:port`, optionally with `http://`; the port defaults to 7401.
pub fn parse_endpoint(text: &str) -> Result<String, String> {
    let trimmed = text.trim();
    if trimmed.starts_with("https://") {
        return Err(format!(
            "the endpoint `{trimmed}` uses https, which vgpu-cp does not serve; write `host:port`"
        ));
    }
    let address = trimmed
        .strip_prefix("http://")
        .unwrap_or(trimmed)
        .trim_end_matches('/');
    if address.is_empty() {
        return Err("the endpoint is empty; write `host:port`, e.g. `127.0.0.1:7401`".to_owned());
    }
    // `@` would make what precedes it user information of the URI, not the host (`a@b:1`
    // connects to `b`); `?` and `#` would start a query or a fragment.
    if address.contains(['/', '@', '?', '#']) || address.contains(char::is_whitespace) {
        return Err(format!(
            "cannot read the endpoint `{trimmed}`; write `host:port`, e.g. `127.0.0.1:7401`"
        ));
    }
    // A bare IPv6 address has several colons and no brackets; a port needs brackets there.
    let has_port = match address.rsplit_once(':') {
        Some((host, port)) => {
            if host.contains(':') && !host.ends_with(']') {
                false
            } else {
                port.parse::<u16>().map_err(|_| {
                    format!("the endpoint `{trimmed}` has the bad port `{port}`; write `host:port`")
                })?;
                true
            }
        }
        None => false,
    };
    let address = if has_port {
        address.to_owned()
    } else if address.contains(':') && !address.starts_with('[') {
        format!("[{address}]:{PORT_DEFAULT}")
    } else {
        format!("{address}:{PORT_DEFAULT}")
    };
    // Brackets hold an IPv6 address and nothing else (`[::1]7401` would otherwise pass the URI
    // parser below as an authority that does not read back).
    let brackets_ok = match address.strip_prefix('[') {
        Some(rest) => rest.split_once(']').is_some_and(|(ip, port)| {
            let ip = ip.split_once('%').map_or(ip, |(ip, _zone)| ip);
            ip.parse::<std::net::Ipv6Addr>().is_ok()
                && port
                    .strip_prefix(':')
                    .is_some_and(|port| port.parse::<u16>().is_ok())
        }),
        None => !address.contains(['[', ']']),
    };
    if !brackets_ok {
        return Err(format!(
            "cannot read the endpoint `{trimmed}`; write `host:port`, e.g. `127.0.0.1:7401` or `[::1]:7401`"
        ));
    }
    let uri: Result<tonic::transport::Uri, _> = format!("http://{address}").parse();
    uri.map_err(|error| {
        format!("cannot read the endpoint `{trimmed}` ({error}); write `host:port`")
    })?;
    Ok(address)
}

/// Parses a duration: `10s`, `500ms`, `2m`, or a plain number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let cannot_read =
        || format!("cannot read the duration `{trimmed}`; write e.g. `10s`, `500ms` or `2m`");
    let value: f64 = number.parse().map_err(|_| cannot_read())?;
    let seconds = match unit.trim() {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" | "min" => value * 60.0,
        _ => return Err(cannot_read()),
    };
    if !seconds.is_finite() || seconds <= 0.0 || seconds > 86_400.0 {
        return Err(format!(
            "the duration `{trimmed}` is out of range; give more than 0 and at most a day"
        ));
    }
    let duration = Duration::from_secs_f64(seconds);
    // Below a nanosecond the conversion gives 0, which would time every call out at once.
    if duration.is_zero() {
        return Err(format!(
            "the duration `{trimmed}` is out of range; give more than 0 and at most a day"
        ));
    }
    Ok(duration)
}

fn tenant_name(text: &str) -> Result<String, String> {
    api::names::validate("tenant", text).map_err(|error| error.to_string())?;
    Ok(text.to_owned())
}

fn owner_name(text: &str) -> Result<String, String> {
    api::names::validate("owner", text).map_err(|error| error.to_string())?;
    Ok(text.to_owned())
}

fn node_name(text: &str) -> Result<String, String> {
    api::names::validate("node", text).map_err(|error| error.to_string())?;
    Ok(text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("vgpuctl").chain(args.iter().copied()))
    }

    fn error_of(args: &[&str]) -> String {
        parse(args)
            .expect_err("the arguments should be refused")
            .to_string()
    }

    #[test]
    fn the_clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn gpus_accepts_whole_numbers_and_fractions() {
        assert_eq!(parse_gpus("2"), Ok(GpuAmount::Whole(2)));
        assert_eq!(parse_gpus("1"), Ok(GpuAmount::Whole(1)));
        assert_eq!(parse_gpus("2.0"), Ok(GpuAmount::Whole(2)));
        assert_eq!(parse_gpus("0.25"), Ok(GpuAmount::Milli(250)));
        assert_eq!(parse_gpus(".5"), Ok(GpuAmount::Milli(500)));
        assert_eq!(parse_gpus("0.125"), Ok(GpuAmount::Milli(125)));
        assert_eq!(parse_gpus("0.001"), Ok(GpuAmount::Milli(1)));
        assert_eq!(parse_gpus("0.9990"), Ok(GpuAmount::Milli(999)));
    }

    #[test]
    fn gpus_refuses_bad_amounts_with_a_reason() {
        assert!(parse_gpus("0").unwrap_err().contains("at least one GPU"));
        assert!(
            parse_gpus("0.000")
                .unwrap_err()
                .contains("at least one GPU")
        );
        assert!(parse_gpus("-1").unwrap_err().contains("negative"));
        assert!(parse_gpus("abc").unwrap_err().contains("cannot read"));
        assert!(parse_gpus("1e3").unwrap_err().contains("cannot read"));
        assert!(parse_gpus("").unwrap_err().contains("empty"));
        assert!(parse_gpus(".").unwrap_err().contains("cannot read"));
        assert!(
            parse_gpus("1.5")
                .unwrap_err()
                .contains("use whole GPUs or a fraction below 1")
        );
        assert!(
            parse_gpus("0.0001")
                .unwrap_err()
                .contains("more than 3 decimals")
        );
        assert!(parse_gpus("99999999999").unwrap_err().contains("too large"));
    }

    #[test]
    fn memory_uses_the_api_size_rules() {
        assert_eq!(parse_memory("20GiB"), Ok(20 << 30));
        assert!(parse_memory("-5GiB").unwrap_err().contains("negative"));
        assert!(
            parse_memory("5 parsecs")
                .unwrap_err()
                .contains("unknown unit")
        );
    }

    #[test]
    fn compute_is_a_percentage_between_1_and_100() {
        assert_eq!(parse_compute("25"), Ok(25));
        assert_eq!(parse_compute("25%"), Ok(25));
        assert_eq!(parse_compute("100"), Ok(100));
        assert_eq!(
            parse_compute("250").unwrap_err(),
            "the compute share is 250%; give a share between 1 and 100"
        );
        assert!(
            parse_compute("0")
                .unwrap_err()
                .contains("between 1 and 100")
        );
        assert!(parse_compute("-5").unwrap_err().contains("negative"));
        assert!(parse_compute("lots").unwrap_err().contains("cannot read"));
        assert!(
            parse_compute("99999999999")
                .unwrap_err()
                .contains("between 1 and 100")
        );
    }

    #[test]
    fn priority_is_bounded() {
        assert_eq!(parse_priority("-1000"), Ok(-1000));
        assert_eq!(parse_priority("1000"), Ok(1000));
        assert_eq!(
            parse_priority("5000").unwrap_err(),
            "the priority is 5000; give a priority between -1000 and 1000"
        );
        assert!(
            parse_priority("-99999999999")
                .unwrap_err()
                .contains("between -1000 and 1000")
        );
        assert!(parse_priority("high").unwrap_err().contains("cannot read"));
    }

    #[test]
    fn latency_targets_are_exact_microseconds_within_bounds() {
        assert_eq!(parse_latency_target("500us"), Ok(500));
        assert_eq!(parse_latency_target("500µs"), Ok(500));
        assert_eq!(parse_latency_target("2ms"), Ok(2_000));
        assert_eq!(parse_latency_target(" 1.5ms "), Ok(1_500));
        assert_eq!(parse_latency_target("0.002s"), Ok(2_000));
        assert_eq!(parse_latency_target("2.000ms"), Ok(2_000));
        assert_eq!(parse_latency_target("10us"), Ok(10));
        assert_eq!(parse_latency_target("60s"), Ok(60_000_000));
        assert_eq!(parse_latency_target(".5ms"), Ok(500));
        assert_eq!(
            parse_latency_target("5us").unwrap_err(),
            "the latency target is 5 microseconds; give a target between 10us and 60s, e.g. `--latency-target 2ms`"
        );
        assert!(
            parse_latency_target("61s")
                .unwrap_err()
                .contains("between 10us and 60s")
        );
        assert!(
            parse_latency_target("99999999999999999999s")
                .unwrap_err()
                .contains("between 10us and 60s")
        );
        assert!(parse_latency_target("2").unwrap_err().contains("no unit"));
        assert!(
            parse_latency_target("-2ms")
                .unwrap_err()
                .contains("negative")
        );
        assert!(
            parse_latency_target("1.5us")
                .unwrap_err()
                .contains("finer than a microsecond")
        );
        assert!(
            parse_latency_target("0.0000001s")
                .unwrap_err()
                .contains("finer than a microsecond")
        );
        for bad in ["", "ms", "2 hours", "1.2.3ms", "2m", "fast"] {
            assert!(
                parse_latency_target(bad)
                    .unwrap_err()
                    .contains("`500us`, `2ms`"),
                "{bad}"
            );
        }
    }

    #[test]
    fn nodes_and_selectors() {
        assert_eq!(parse_nodes("4"), Ok(4));
        assert!(parse_nodes("0").unwrap_err().contains("1 or more"));
        let selector = parse_selector("zone=a, gpu=h100").unwrap();
        assert_eq!(selector.get("zone").map(String::as_str), Some("a"));
        assert_eq!(selector.get("gpu").map(String::as_str), Some("h100"));
        assert!(parse_selector("zone").unwrap_err().contains("key=value"));
        assert!(parse_selector("=a").unwrap_err().contains("empty key"));
        assert!(
            parse_selector("zone=a,zone=b")
                .unwrap_err()
                .contains("twice")
        );
        let merged = merge_selectors(&[
            parse_selector("a=1").unwrap(),
            parse_selector("b=2").unwrap(),
        ])
        .unwrap();
        assert_eq!(merged.len(), 2);
        assert!(
            merge_selectors(&[
                parse_selector("a=1").unwrap(),
                parse_selector("a=2").unwrap()
            ])
            .is_err()
        );
    }

    #[test]
    fn endpoints_are_normalised() {
        assert_eq!(
            parse_endpoint("127.0.0.1:7401"),
            Ok("127.0.0.1:7401".into())
        );
        assert_eq!(parse_endpoint("http://cp-0:7402/"), Ok("cp-0:7402".into()));
        assert_eq!(parse_endpoint("cp-0"), Ok("cp-0:7401".into()));
        assert_eq!(parse_endpoint("[::1]:7401"), Ok("[::1]:7401".into()));
        assert_eq!(parse_endpoint("::1"), Ok("[::1]:7401".into()));
        assert!(
            parse_endpoint("https://cp-0:7401")
                .unwrap_err()
                .contains("https")
        );
        assert!(
            parse_endpoint("cp-0:http")
                .unwrap_err()
                .contains("bad port")
        );
        assert!(parse_endpoint("").unwrap_err().contains("empty"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn place_parses_every_flag() {
        let cli = parse(&[
            "--endpoints",
            "a:1,http://b:2",
            "place",
            "infer-a",
            "--gpus",
            "0.25",
            "--memory",
            "20GiB",
            "--memory-limit",
            "60GiB",
            "--compute",
            "25",
            "--burst",
            "--priority",
            "-10",
            "--preemptible",
            "--require-nvlink",
            "--selector",
            "zone=a",
            "--no-wait",
            "-o",
            "json",
        ])
        .unwrap();
        assert_eq!(cli.endpoints, vec!["a:1".to_owned(), "b:2".to_owned()]);
        assert_eq!(cli.output, Some(Format::Json));
        let Command::Place(place) = cli.command else {
            panic!("expected place")
        };
        assert_eq!(place.gpus, GpuAmount::Milli(250));
        assert_eq!(place.memory, Some(20 << 30));
        assert_eq!(place.memory_limit, Some(60 << 30));
        assert_eq!(place.compute, Some(25));
        assert_eq!(place.priority, -10);
        assert!(place.burst && place.preemptible && place.nvlink && place.no_wait);
        assert_eq!(place.wait_timeout, 30);
    }

    #[test]
    fn place_takes_cpu_host_memory_and_gpu_models() {
        let cli = parse(&[
            "place",
            "train",
            "--gpus",
            "2",
            "--cpu",
            "8",
            "--host-memory",
            "64GiB",
            "--gpu-model",
            "H100-80GB",
            "--gpu-model",
            "A100-80GB",
        ])
        .unwrap();
        let Command::Place(place) = cli.command else {
            panic!("expected place")
        };
        assert_eq!(place.cpu, Some(8_000));
        assert_eq!(place.host_memory, Some(64 << 30));
        assert_eq!(place.gpu_models, vec!["H100-80GB", "A100-80GB"]);
        let millicores = parse(&["place", "t", "--gpus", "1", "--cpu", "500m"]).unwrap();
        let Command::Place(place) = millicores.command else {
            panic!("expected place")
        };
        assert_eq!(place.cpu, Some(500));
        for (flag, value, says) in [
            ("--cpu", "-2", "negative"),
            ("--cpu", "0", "leave out --cpu"),
            ("--cpu", "eight", "cannot read the CPU amount"),
            ("--cpu", "1.2345", "thousandths"),
            ("--host-memory", "lots", "20GiB"),
            ("--gpu-model", " ", "H100-80GB"),
        ] {
            let error = error_of(&["place", "t", "--gpus", "1", flag, value]);
            assert!(error.contains(says), "{flag} {value}: {error}");
        }
    }

    #[test]
    fn place_takes_a_latency_target() {
        let cli = parse(&[
            "place",
            "chat",
            "--gpus",
            "0.25",
            "--latency",
            "--latency-target",
            "1.5ms",
        ])
        .unwrap();
        let Command::Place(place) = cli.command else {
            panic!("expected place")
        };
        assert!(place.latency);
        assert_eq!(place.latency_target, Some(1_500));
        assert!(
            error_of(&["place", "a", "--gpus", "1", "--latency-target", "-1ms"])
                .contains("negative")
        );
    }

    #[test]
    fn set_tenant_parses_each_change() {
        let cli = parse(&[
            "set",
            "tenant",
            "chat",
            "--compute",
            "40%",
            "--latency-target",
            "1.5ms",
            "--priority",
            "-5",
            "-o",
            "json",
        ])
        .unwrap();
        let Command::Set {
            target: SetTarget::Tenant(set),
        } = cli.command
        else {
            panic!("expected set tenant")
        };
        assert_eq!(set.name, "chat");
        assert_eq!(
            (set.compute, set.latency_target, set.priority),
            (Some(40), Some(1_500), Some(-5))
        );
        let cli = parse(&["set", "tenant", "chat", "--latency-target", "default"]).unwrap();
        let Command::Set {
            target: SetTarget::Tenant(set),
        } = cli.command
        else {
            panic!("expected set tenant")
        };
        assert_eq!(
            (set.compute, set.latency_target, set.priority),
            (None, Some(0), None)
        );
        assert!(
            error_of(&["set", "tenant", "chat", "--compute", "0"]).contains("between 1 and 100")
        );
        assert!(
            error_of(&["set", "tenant", "chat", "--latency-target", "5us"])
                .contains("`default` to remove the target")
        );
        assert!(
            error_of(&["set", "tenant", "Bad_Name", "--priority", "1"]).contains("tenant name")
        );
        assert!(error_of(&["set", "node", "a"]).contains("unrecognized subcommand"));
    }

    #[test]
    fn values_that_look_like_flags_get_our_message() {
        assert!(
            error_of(&["place", "a", "--gpus", "1", "--memory", "-5GiB"])
                .contains("the size `-5GiB` is negative")
        );
        assert!(error_of(&["place", "a", "--gpus", "-1"]).contains("negative"));
        assert!(
            error_of(&["place", "a", "--gpus", "1", "--compute", "250"])
                .contains("between 1 and 100")
        );
        assert!(
            error_of(&["place", "a", "--gpus", "1.5"])
                .contains("use whole GPUs or a fraction below 1")
        );
        assert!(error_of(&["place", "Bad_Name", "--gpus", "1"]).contains("tenant name"));
        assert!(
            error_of(&["place", "a", "--gpus", "1", "--nvlink", "--ignore-nvlink"])
                .contains("cannot be used")
        );
    }

    #[test]
    fn get_accepts_singular_kinds_and_a_trailing_output_flag() {
        let cli = parse(&["get", "tenant", "infer-a", "-o", "yaml", "--stale"]).unwrap();
        assert_eq!(cli.output, Some(Format::Yaml));
        let Command::Get(get) = cli.command else {
            panic!("expected get")
        };
        assert_eq!(get.kind, Kind::Tenants);
        assert_eq!(get.name.as_deref(), Some("infer-a"));
        assert!(get.stale);
        assert!(parse(&["get", "pods"]).is_err());
    }
}
