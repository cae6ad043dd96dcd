//! Checks a placement request before it reaches the replicated log, so that bad input is refused
//! with a message that says what to change, and never becomes a state change.
//!
//! Two levels: [`validate_request`] is also applied by every replica to each logged request, so
//! its rules must never change (a replica of another version, or a replay of an old log, would
//! otherwise decide the same entry differently). New restrictions go only into
//! [`admit_request`], which the member receiving a call (and vgpuctl) checks before proposing.
//!
//! A change to a running tenant (`Pool.SetTenant`) is checked by [`validate_change`], on
//! admission and again by every replica for every logged change: its rules never change either.

use crate::v1::{NvlinkPolicy, PlacementRequest, SetTenantRequest};

pub const PRIORITY_MAX: i32 = 1000;
pub const PRIORITY_MIN: i32 = -1000;
/// Largest gang: nodes x GPUs per node.
pub const GANG_GPUS_MAX: u32 = 4096;
pub const SELECTOR_PAIRS_MAX: usize = 32;
/// Longest node-selector key or value, and longest owner (a DNS name's length).
pub const SELECTOR_TEXT_MAX: usize = 253;
/// Most memory one GPU may report (16 TiB, a hundred times today's largest): with 64 GPUs a node
/// and thousands of nodes, totals of memory stay far from overflowing a `u64`.
pub const GPU_MEMORY_BYTES_MAX: u64 = 1 << 44;
/// Largest bandwidth weight (the NCCL tuner's and netshare's weight range).
pub const BANDWIDTH_WEIGHT_MAX: u32 = 1_000_000;
/// Shortest latency target, in µs: the range the interposer accepts in `VGPU_LATENCY_TARGET_US`
/// (one definition, in the tenant contract).
pub const LATENCY_TARGET_US_MIN: u64 = tenant_abi::env::LATENCY_TARGET_US_MIN;
/// Longest latency target, in µs (60 s).
pub const LATENCY_TARGET_US_MAX: u64 = tenant_abi::env::LATENCY_TARGET_US_MAX;
/// Most CPU a request asks per node, or a node reports, in millicores (16,384 CPUs: more than
/// the largest single machines have): totals over thousands of nodes stay far from overflowing.
pub const CPU_MILLI_MAX: u64 = 16_384 * crate::cpu::MILLI_PER_CPU;
/// Most host memory a request asks per node, or a node reports (256 TiB).
pub const HOST_MEMORY_BYTES_MAX: u64 = 1 << 48;
/// Most GPU models one request allows.
pub const GPU_MODELS_MAX: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("ask for at least one GPU or a fraction of one: `--gpus 1`, `--gpus 0.25`")]
    NoGpus,
    #[error("ask for either whole GPUs or a fraction of one, not both")]
    BothWholeAndFraction,
    #[error(
        "a fraction of a GPU is between 0.001 and 0.999 (got {0} thousandths); use `--gpus 1` for a whole GPU"
    )]
    FractionOutOfRange(u32),
    #[error("the compute share is {0}%; give a share between 1 and 100")]
    ComputeOutOfRange(u32),
    #[error("the priority is {0}; give a priority between {PRIORITY_MIN} and {PRIORITY_MAX}")]
    PriorityOutOfRange(i32),
    #[error("a fractional GPU cannot span {0} nodes; use whole GPUs for multi-node gangs")]
    FractionAcrossNodes(u32),
    #[error("the gang asks for {0} GPUs in all; the limit is {GANG_GPUS_MAX}")]
    GangTooLarge(u64),
    #[error("unknown NVLink policy {0}")]
    UnknownNvlinkPolicy(i32),
    #[error("the node selector has {0} pairs; the limit is {SELECTOR_PAIRS_MAX}")]
    SelectorTooLarge(usize),
    #[error("the node selector key `{0}` is empty or longer than {SELECTOR_TEXT_MAX} characters")]
    BadSelectorKey(String),
    #[error(
        "the node selector value of `{0}` is longer than {SELECTOR_TEXT_MAX} characters; node labels are never that long"
    )]
    BadSelectorValue(String),
    #[error(
        "{0} bytes of memory per GPU is more than any GPU has (the limit is {GPU_MEMORY_BYTES_MAX} bytes, 16 TiB); give a size such as `--memory 40GiB`"
    )]
    MemoryOutOfRange(u64),
    #[error(
        "a memory limit needs a memory request: add `--memory SIZE` (the part that is guaranteed) to `--memory-limit`"
    )]
    MemoryLimitWithoutRequest,
    #[error(
        "the memory limit ({}) is below the memory request ({}); the limit is what the tenant may grow to, so give `--memory-limit` at least `--memory`",
        crate::size::format_bytes(*limit),
        crate::size::format_bytes(*request)
    )]
    MemoryLimitBelowRequest { request: u64, limit: u64 },
    #[error(
        "{0} bytes of memory limit per GPU is more than any GPU has (the limit is {GPU_MEMORY_BYTES_MAX} bytes, 16 TiB); give a size such as `--memory-limit 60GiB`"
    )]
    MemoryLimitOutOfRange(u64),
    #[error(
        "a pinned tenant holds exactly its pinned memory; leave `memory_limit_bytes_per_gpu` out of a pin"
    )]
    MemoryLimitWithPin,
    #[error("the owner is {0} characters long; the limit is {SELECTOR_TEXT_MAX}")]
    OwnerTooLong(usize),
    #[error(
        "the bandwidth weight is {0}; give a weight between 1 and {BANDWIDTH_WEIGHT_MAX}, or leave it out to follow the compute share"
    )]
    BandwidthOutOfRange(u32),
    #[error(
        "a latency target applies only to a latency tenant; add `--latency` (or leave out `--latency-target`)"
    )]
    LatencyTargetWithoutLatency,
    #[error(
        "the latency target is {0} microseconds; give a target between 10us and 60s, e.g. `--latency-target 2ms`"
    )]
    LatencyTargetOutOfRange(u64),
    #[error("say what to change: `--compute PCT`, `--latency-target DURATION` or `--priority P`")]
    NothingToChange,
    #[error(
        "{} CPUs per node is more than any node has (the limit is {}); give CPUs such as `--cpu 8`",
        crate::cpu::format_cpu_milli(*.0),
        crate::cpu::format_cpu_milli(CPU_MILLI_MAX)
    )]
    CpuOutOfRange(u64),
    #[error(
        "{} of host memory per node is more than any node has (the limit is {}); give a size such as `--host-memory 64GiB`",
        crate::size::format_bytes(*.0),
        crate::size::format_bytes(HOST_MEMORY_BYTES_MAX)
    )]
    HostMemoryOutOfRange(u64),
    #[error("the request allows {0} GPU models; the limit is {GPU_MODELS_MAX}")]
    TooManyGpuModels(usize),
    #[error(
        "the GPU model `{0}` is empty or longer than {GPU_TEXT_MAX} characters; give a model as `vgpuctl get gpus` shows it, e.g. `--gpu-model H100-80GB`"
    )]
    BadGpuModel(String),
    #[error("the GPU model `{0}` is listed twice; list each model once")]
    RepeatedGpuModel(String),
    #[error(
        "the pin names the node `{0}`, which is not a node name; pin to a node as `vgpuctl get nodes` shows it"
    )]
    PinBadNode(String),
    #[error(
        "the pin has {0} GPUs; pin 1 to {NODE_GPUS_MAX} GPUs, each with its uuid, compute and memory"
    )]
    PinGpusOutOfRange(usize),
    #[error(
        "the pin has {pinned} GPUs and the request asks for {asked}; ask `whole_gpus` = the pinned GPUs, or `milli_gpus` for one pinned GPU"
    )]
    PinGpuCount { pinned: usize, asked: u32 },
    #[error("a pin is on one node; the request asks for {0} nodes (leave `nodes` at 0 or 1)")]
    PinAcrossNodes(u32),
    #[error(
        "the pin's GPU uuid `{0}` is empty or longer than {GPU_TEXT_MAX} characters; give the uuid as `vgpuctl get gpus` shows it"
    )]
    PinBadGpu(String),
    #[error("the pin names GPU `{0}` twice; pin each GPU once")]
    PinRepeatedGpu(String),
    #[error("the pin asks {percent}% of GPU `{uuid}`; a pinned slice takes 1 to 100%")]
    PinComputeOutOfRange { uuid: String, percent: u32 },
    #[error(
        "the pin asks {bytes} bytes of GPU `{uuid}`, more than any GPU has (the limit is {GPU_MEMORY_BYTES_MAX} bytes)"
    )]
    PinMemoryOutOfRange { uuid: String, bytes: u64 },
    #[error(
        "a pinned tenant's owner is its claim, `k8s:<namespace>/<claim>` (got `{0}`); the DRA driver sets it from the claim it prepares"
    )]
    PinBadOwner(String),
    #[error(
        "tenant `{tenant}` is not named after claim `{claim}`; a claim's tenant is named as the DRA driver names it (`api::names::claim_tenant_name`: the claim's name, `-`, the first 8 hex digits of its uid)"
    )]
    PinTenantName { tenant: String, claim: String },
}

/// Validates the fields of a placement request on their own (not whether the pool can hold it).
pub fn validate_request(request: &PlacementRequest) -> Result<(), RequestError> {
    match (request.whole_gpus, request.milli_gpus) {
        (0, 0) => return Err(RequestError::NoGpus),
        (whole, milli) if whole > 0 && milli > 0 => return Err(RequestError::BothWholeAndFraction),
        (0, milli) if milli >= 1000 => return Err(RequestError::FractionOutOfRange(milli)),
        _ => {}
    }
    if request.compute_percent > 100 {
        return Err(RequestError::ComputeOutOfRange(request.compute_percent));
    }
    if request.bandwidth_weight > BANDWIDTH_WEIGHT_MAX {
        return Err(RequestError::BandwidthOutOfRange(request.bandwidth_weight));
    }
    if !(PRIORITY_MIN..=PRIORITY_MAX).contains(&request.priority) {
        return Err(RequestError::PriorityOutOfRange(request.priority));
    }
    let nodes = request.nodes.max(1);
    if request.milli_gpus > 0 && nodes > 1 {
        return Err(RequestError::FractionAcrossNodes(nodes));
    }
    let total = u64::from(nodes) * u64::from(request.whole_gpus);
    if total > u64::from(GANG_GPUS_MAX) {
        return Err(RequestError::GangTooLarge(total));
    }
    if NvlinkPolicy::try_from(request.nvlink).is_err() {
        return Err(RequestError::UnknownNvlinkPolicy(request.nvlink));
    }
    if request.node_selector.len() > SELECTOR_PAIRS_MAX {
        return Err(RequestError::SelectorTooLarge(request.node_selector.len()));
    }
    if let Some(key) = request
        .node_selector
        .keys()
        .find(|k| k.is_empty() || k.len() > SELECTOR_TEXT_MAX)
    {
        return Err(RequestError::BadSelectorKey(key.clone()));
    }
    Ok(())
}

/// What a new request must satisfy before it is proposed: [`validate_request`], plus the bounds
/// added after requests were first logged (memory per GPU, selector values, owner length, the
/// latency target, the whole-node constraints).
pub fn admit_request(request: &PlacementRequest) -> Result<(), RequestError> {
    validate_request(request)?;
    check_latency_target(request.latency, request.latency_target_us)?;
    check_constraints(request)?;
    if request.memory_bytes_per_gpu > GPU_MEMORY_BYTES_MAX {
        return Err(RequestError::MemoryOutOfRange(request.memory_bytes_per_gpu));
    }
    check_memory_limit(request)?;
    // A pinned request's owner is its claim, bounded by the claim owner rule in `check_pin`.
    if request.pin.is_none() && request.owner.len() > SELECTOR_TEXT_MAX {
        return Err(RequestError::OwnerTooLong(request.owner.len()));
    }
    if let Some(pin) = &request.pin {
        check_pin(request, pin)?;
    }
    if let Some((key, _)) = request
        .node_selector
        .iter()
        .find(|(_, v)| v.len() > SELECTOR_TEXT_MAX)
    {
        return Err(RequestError::BadSelectorValue(key.clone()));
    }
    Ok(())
}

/// The elastic memory limit of a request (issue 17): 0 (the request is the limit), or an
/// explicit request no larger than it, within what a GPU can have, without a pin. Whether a GPU
/// of the pool is large enough is decided where the request is applied.
fn check_memory_limit(request: &PlacementRequest) -> Result<(), RequestError> {
    let limit = request.memory_limit_bytes_per_gpu;
    if limit == 0 {
        return Ok(());
    }
    if request.pin.is_some() {
        return Err(RequestError::MemoryLimitWithPin);
    }
    if request.memory_bytes_per_gpu == 0 {
        return Err(RequestError::MemoryLimitWithoutRequest);
    }
    if limit < request.memory_bytes_per_gpu {
        return Err(RequestError::MemoryLimitBelowRequest {
            request: request.memory_bytes_per_gpu,
            limit,
        });
    }
    if limit > GPU_MEMORY_BYTES_MAX {
        return Err(RequestError::MemoryLimitOutOfRange(limit));
    }
    Ok(())
}

/// The pin of a request (issue 18), on its own: a node name, 1 to [`NODE_GPUS_MAX`] distinct
/// GPUs of bounded uuids with 1..=100% compute and memory a GPU can have, as many GPUs as the
/// request asks, one node, and an owner that names a claim. Whether the pool can hold it is
/// decided where it is applied.
fn check_pin(request: &PlacementRequest, pin: &crate::v1::Pin) -> Result<(), RequestError> {
    if crate::names::validate("node", &pin.node).is_err() {
        return Err(RequestError::PinBadNode(excerpt(&pin.node, 64)));
    }
    if pin.gpus.is_empty() || pin.gpus.len() > NODE_GPUS_MAX {
        return Err(RequestError::PinGpusOutOfRange(pin.gpus.len()));
    }
    if request.nodes > 1 {
        return Err(RequestError::PinAcrossNodes(request.nodes));
    }
    let asked = if request.milli_gpus > 0 {
        1
    } else {
        request.whole_gpus
    };
    if pin.gpus.len() != asked as usize {
        return Err(RequestError::PinGpuCount {
            pinned: pin.gpus.len(),
            asked,
        });
    }
    let mut seen = std::collections::BTreeSet::new();
    for gpu in &pin.gpus {
        if gpu.uuid.is_empty() || gpu.uuid.len() > GPU_TEXT_MAX {
            return Err(RequestError::PinBadGpu(excerpt(&gpu.uuid, 32)));
        }
        if !seen.insert(gpu.uuid.as_str()) {
            return Err(RequestError::PinRepeatedGpu(gpu.uuid.clone()));
        }
        if !(1..=100).contains(&gpu.compute_percent) {
            return Err(RequestError::PinComputeOutOfRange {
                uuid: gpu.uuid.clone(),
                percent: gpu.compute_percent,
            });
        }
        if gpu.memory_bytes > GPU_MEMORY_BYTES_MAX {
            return Err(RequestError::PinMemoryOutOfRange {
                uuid: gpu.uuid.clone(),
                bytes: gpu.memory_bytes,
            });
        }
    }
    if crate::names::parse_claim_owner(&request.owner).is_none() {
        return Err(RequestError::PinBadOwner(excerpt(&request.owner, 64)));
    }
    Ok(())
}

/// Whether tenant `tenant` may hold the pin of `request` (admitted by [`admit_request`]): its
/// name is the one the DRA driver gives the claim its owner names
/// (`crate::names::is_claim_tenant_name`). A request without a pin passes.
pub fn admit_claim_tenant(tenant: &str, request: &PlacementRequest) -> Result<(), RequestError> {
    if request.pin.is_none() {
        return Ok(());
    }
    let Some((_, claim)) = crate::names::parse_claim_owner(&request.owner) else {
        return Err(RequestError::PinBadOwner(excerpt(&request.owner, 64)));
    };
    if !crate::names::is_claim_tenant_name(claim, tenant) {
        return Err(RequestError::PinTenantName {
            tenant: excerpt(tenant, 64),
            claim: claim.to_owned(),
        });
    }
    Ok(())
}

/// The whole-node constraints of a request (issue 19): CPU and host memory per node within what
/// a node can report, and a short list of distinct, non-empty GPU model names.
pub fn check_constraints(request: &PlacementRequest) -> Result<(), RequestError> {
    if request.cpu_milli > CPU_MILLI_MAX {
        return Err(RequestError::CpuOutOfRange(request.cpu_milli));
    }
    if request.host_memory_bytes > HOST_MEMORY_BYTES_MAX {
        return Err(RequestError::HostMemoryOutOfRange(
            request.host_memory_bytes,
        ));
    }
    if request.gpu_models.len() > GPU_MODELS_MAX {
        return Err(RequestError::TooManyGpuModels(request.gpu_models.len()));
    }
    let mut seen = std::collections::BTreeSet::new();
    for model in &request.gpu_models {
        if model.is_empty() || model.len() > GPU_TEXT_MAX {
            return Err(RequestError::BadGpuModel(excerpt(model, 32)));
        }
        if !seen.insert(model.as_str()) {
            return Err(RequestError::RepeatedGpuModel(model.clone()));
        }
    }
    Ok(())
}

/// A latency target (µs; 0 = none) for a tenant whose latency flag is `latency`: only a latency
/// tenant has one, within [`LATENCY_TARGET_US_MIN`]..=[`LATENCY_TARGET_US_MAX`].
pub fn check_latency_target(latency: bool, latency_target_us: u64) -> Result<(), RequestError> {
    if latency_target_us == 0 {
        return Ok(());
    }
    if !latency {
        return Err(RequestError::LatencyTargetWithoutLatency);
    }
    if !(LATENCY_TARGET_US_MIN..=LATENCY_TARGET_US_MAX).contains(&latency_target_us) {
        return Err(RequestError::LatencyTargetOutOfRange(latency_target_us));
    }
    Ok(())
}

/// Validates the fields of a change to a running tenant on their own: at least one field, a
/// compute share of 1..=100, a priority within bounds, and a latency target of 0 (none) or within
/// bounds. Whether the share fits the tenant's GPUs, and whether the tenant is a latency tenant,
/// is decided where the change is applied. Logged changes are checked with it again: its rules
/// never change (see the module docs).
pub fn validate_change(change: &SetTenantRequest) -> Result<(), RequestError> {
    if change.compute_percent.is_none()
        && change.priority.is_none()
        && change.latency_target_us.is_none()
    {
        return Err(RequestError::NothingToChange);
    }
    if let Some(percent) = change.compute_percent
        && !(1..=100).contains(&percent)
    {
        return Err(RequestError::ComputeOutOfRange(percent));
    }
    if let Some(priority) = change.priority
        && !(PRIORITY_MIN..=PRIORITY_MAX).contains(&priority)
    {
        return Err(RequestError::PriorityOutOfRange(priority));
    }
    if let Some(target) = change.latency_target_us {
        check_latency_target(true, target)?;
    }
    Ok(())
}

/// Longest address an agent registers: a DNS name (253), `:` and a port, or an IPv6 literal.
pub const NODE_ADDRESS_TEXT_MAX: usize = 261;
/// Most labels a node registers (a node selector matches at most [`SELECTOR_PAIRS_MAX`]).
pub const NODE_LABELS_MAX: usize = 64;
/// Most GPUs a node registers.
pub const NODE_GPUS_MAX: usize = 64;
/// Longest GPU uuid or model name (NVML's are under 96 characters).
pub const GPU_TEXT_MAX: usize = 128;
/// Longest PCI bus id (`00000000:3B:00.0` is 16).
pub const PCI_BUS_ID_TEXT_MAX: usize = 32;
/// Most NICs listed nearest one GPU, and the longest NIC name.
pub const GPU_NICS_MAX: usize = 16;
pub const NIC_NAME_TEXT_MAX: usize = 64;
/// Most NVLink links between two GPUs (an H100 has 18 in all).
pub const NVLINK_LINKS_MAX: u32 = 64;
/// Largest registration in all (a node of [`NODE_GPUS_MAX`] GPUs with every field at its bound
/// stays well under it); the fields the control plane fills in count too.
pub const REGISTER_BYTES_MAX: usize = 256 << 10;
/// Longest certificate signing request a joining agent sends (an RSA-4096 CSR is under 2 KiB).
pub const CSR_PEM_TEXT_MAX: usize = 16 << 10;
/// Longest serial text `RevokeCertificate` takes (a serial has at most 20 bytes: 40 hex digits,
/// with colons 59).
pub const SERIAL_TEXT_MAX: usize = 128;

/// Why a node's registration is refused on admission; each message says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeError {
    #[error("the node is missing from the registration")]
    Missing,
    #[error(
        "the registration is {0} bytes; the limit is {REGISTER_BYTES_MAX} (check the node's labels and GPU inventory)"
    )]
    TooLarge(usize),
    #[error(
        "the node's address is {0} characters long; the limit is {NODE_ADDRESS_TEXT_MAX} (HOST:PORT)"
    )]
    AddressTooLong(usize),
    #[error("the node has {0} labels; the limit is {NODE_LABELS_MAX}")]
    TooManyLabels(usize),
    #[error(
        "a node label key is empty or longer than {SELECTOR_TEXT_MAX} characters, or its value is longer than {SELECTOR_TEXT_MAX} (key starting `{0}`)"
    )]
    BadLabel(String),
    #[error("the node reports {0} GPUs; the limit is {NODE_GPUS_MAX}")]
    TooManyGpus(usize),
    #[error("GPU {index} has a {field} of {length} characters; the limit is {limit}")]
    GpuTextTooLong {
        index: u32,
        field: &'static str,
        length: usize,
        limit: usize,
    },
    #[error("GPU {index} lists {count} nearest NICs; the limit is {GPU_NICS_MAX}")]
    TooManyNics { index: u32, count: usize },
    #[error(
        "GPU {index} lists {count} NVLink peers; a GPU has at most {NODE_GPUS_MAX} peers, each listed once with at most {NVLINK_LINKS_MAX} links"
    )]
    BadNvlinkPeers { index: u32, count: usize },
    #[error(
        "the node reports {0} millicores of CPU; the limit is {CPU_MILLI_MAX} (check the agent's CPU count and --reserved-cpu)"
    )]
    CpuOutOfRange(u64),
    #[error(
        "the node reports {0} bytes of host memory; the limit is {HOST_MEMORY_BYTES_MAX} (check the agent's memory and --reserved-host-memory)"
    )]
    HostMemoryOutOfRange(u64),
}

/// What a registering node must satisfy before its registration is proposed: every string and
/// list within its bound (the replicated log keeps what is admitted, and every member applies
/// it). Whether the inventory is consistent (indexes, uuids, memory) is checked again where it
/// is applied.
pub fn admit_node(node: Option<&crate::v1::Node>) -> Result<(), NodeError> {
    use prost::Message;
    let node = node.ok_or(NodeError::Missing)?;
    let size = node.encoded_len();
    if size > REGISTER_BYTES_MAX {
        return Err(NodeError::TooLarge(size));
    }
    if node.address.len() > NODE_ADDRESS_TEXT_MAX {
        return Err(NodeError::AddressTooLong(node.address.len()));
    }
    if node.labels.len() > NODE_LABELS_MAX {
        return Err(NodeError::TooManyLabels(node.labels.len()));
    }
    if let Some((key, _)) = node.labels.iter().find(|(key, value)| {
        key.is_empty() || key.len() > SELECTOR_TEXT_MAX || value.len() > SELECTOR_TEXT_MAX
    }) {
        return Err(NodeError::BadLabel(excerpt(key, 32)));
    }
    if node.gpus.len() > NODE_GPUS_MAX {
        return Err(NodeError::TooManyGpus(node.gpus.len()));
    }
    if node.cpu_milli > CPU_MILLI_MAX {
        return Err(NodeError::CpuOutOfRange(node.cpu_milli));
    }
    if node.host_memory_bytes > HOST_MEMORY_BYTES_MAX {
        return Err(NodeError::HostMemoryOutOfRange(node.host_memory_bytes));
    }
    for gpu in &node.gpus {
        let texts = [
            ("uuid", gpu.uuid.len(), GPU_TEXT_MAX),
            ("model", gpu.model.len(), GPU_TEXT_MAX),
            ("PCI bus id", gpu.pci_bus_id.len(), PCI_BUS_ID_TEXT_MAX),
        ];
        let longest_nic = gpu.nearest_nics.iter().map(String::len).max().unwrap_or(0);
        let nic = ("NIC name", longest_nic, NIC_NAME_TEXT_MAX);
        if let Some((field, length, limit)) = texts
            .into_iter()
            .chain([nic])
            .find(|(_, length, limit)| length > limit)
        {
            return Err(NodeError::GpuTextTooLong {
                index: gpu.index,
                field,
                length,
                limit,
            });
        }
        if gpu.nearest_nics.len() > GPU_NICS_MAX {
            return Err(NodeError::TooManyNics {
                index: gpu.index,
                count: gpu.nearest_nics.len(),
            });
        }
        let peers = &gpu.nvlink_peers;
        let distinct: std::collections::BTreeSet<u32> = peers.iter().map(|p| p.gpu_index).collect();
        if peers.len() > NODE_GPUS_MAX
            || distinct.len() != peers.len()
            || peers.iter().any(|p| p.link_count > NVLINK_LINKS_MAX)
        {
            return Err(NodeError::BadNvlinkPeers {
                index: gpu.index,
                count: peers.len(),
            });
        }
    }
    Ok(())
}

/// At most `max` characters of `text`, with `...` when it was cut: for messages that quote
/// what a caller sent.
pub fn excerpt(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_owned(),
        Some((end, _)) => format!("{}...", &text[..end]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(n: u32) -> PlacementRequest {
        PlacementRequest {
            whole_gpus: n,
            ..Default::default()
        }
    }

    #[test]
    fn accepts_ordinary_requests() {
        assert_eq!(validate_request(&whole(1)), Ok(()));
        let fraction = PlacementRequest {
            milli_gpus: 250,
            compute_percent: 25,
            ..Default::default()
        };
        assert_eq!(validate_request(&fraction), Ok(()));
        assert_eq!(
            validate_request(&PlacementRequest {
                nodes: 4,
                ..whole(8)
            }),
            Ok(())
        );
    }

    #[test]
    fn bandwidth_weight_is_optional_and_bounded() {
        let weighted = |w| PlacementRequest {
            bandwidth_weight: w,
            ..whole(1)
        };
        assert_eq!(validate_request(&weighted(0)), Ok(()));
        assert_eq!(validate_request(&weighted(BANDWIDTH_WEIGHT_MAX)), Ok(()));
        assert_eq!(
            validate_request(&weighted(BANDWIDTH_WEIGHT_MAX + 1)),
            Err(RequestError::BandwidthOutOfRange(BANDWIDTH_WEIGHT_MAX + 1))
        );
    }

    #[test]
    fn rejects_each_bad_field() {
        assert_eq!(validate_request(&whole(0)), Err(RequestError::NoGpus));
        let both = PlacementRequest {
            milli_gpus: 5,
            ..whole(1)
        };
        assert_eq!(
            validate_request(&both),
            Err(RequestError::BothWholeAndFraction)
        );
        let big_fraction = PlacementRequest {
            milli_gpus: 1000,
            ..Default::default()
        };
        assert_eq!(
            validate_request(&big_fraction),
            Err(RequestError::FractionOutOfRange(1000))
        );
        let compute = PlacementRequest {
            compute_percent: 250,
            ..whole(1)
        };
        assert_eq!(
            validate_request(&compute),
            Err(RequestError::ComputeOutOfRange(250))
        );
        let priority = PlacementRequest {
            priority: 5000,
            ..whole(1)
        };
        assert_eq!(
            validate_request(&priority),
            Err(RequestError::PriorityOutOfRange(5000))
        );
        let spread = PlacementRequest {
            milli_gpus: 500,
            nodes: 2,
            ..Default::default()
        };
        assert_eq!(
            validate_request(&spread),
            Err(RequestError::FractionAcrossNodes(2))
        );
        let huge = PlacementRequest {
            nodes: 1000,
            ..whole(8)
        };
        assert_eq!(
            validate_request(&huge),
            Err(RequestError::GangTooLarge(8000))
        );
        let policy = PlacementRequest {
            nvlink: 42,
            ..whole(2)
        };
        assert_eq!(
            validate_request(&policy),
            Err(RequestError::UnknownNvlinkPolicy(42))
        );
        // Admission only: the log's rule accepts them (see the module docs).
        let memory = PlacementRequest {
            memory_bytes_per_gpu: GPU_MEMORY_BYTES_MAX + 1,
            ..whole(1)
        };
        assert_eq!(
            admit_request(&memory),
            Err(RequestError::MemoryOutOfRange(GPU_MEMORY_BYTES_MAX + 1))
        );
        let at_most = PlacementRequest {
            memory_bytes_per_gpu: GPU_MEMORY_BYTES_MAX,
            ..whole(1)
        };
        assert_eq!(admit_request(&at_most), Ok(()));
        let value = PlacementRequest {
            node_selector: [("zone".to_owned(), "a".repeat(254))].into(),
            ..whole(1)
        };
        assert_eq!(
            admit_request(&value),
            Err(RequestError::BadSelectorValue("zone".to_owned()))
        );
        let owner = PlacementRequest {
            owner: "o".repeat(300),
            ..whole(1)
        };
        assert_eq!(admit_request(&owner), Err(RequestError::OwnerTooLong(300)));
        for accepted_by_the_log in [&memory, &value, &owner] {
            assert_eq!(validate_request(accepted_by_the_log), Ok(()));
        }
    }

    /// Issue 19: CPU, host memory and GPU models are bounded on admission only (a logged request
    /// keeps its meaning).
    #[test]
    fn a_memory_limit_needs_a_request_it_covers() {
        const GIB: u64 = 1 << 30;
        let elastic = |request: u64, limit: u64| PlacementRequest {
            milli_gpus: 250,
            memory_bytes_per_gpu: request,
            memory_limit_bytes_per_gpu: limit,
            ..Default::default()
        };
        assert_eq!(admit_request(&elastic(20 * GIB, 60 * GIB)), Ok(()));
        assert_eq!(admit_request(&elastic(20 * GIB, 20 * GIB)), Ok(()));
        assert_eq!(admit_request(&elastic(20 * GIB, 0)), Ok(()));
        assert_eq!(
            admit_request(&elastic(0, 60 * GIB)),
            Err(RequestError::MemoryLimitWithoutRequest)
        );
        let below = admit_request(&elastic(20 * GIB, 10 * GIB)).unwrap_err();
        assert_eq!(
            below,
            RequestError::MemoryLimitBelowRequest {
                request: 20 * GIB,
                limit: 10 * GIB
            }
        );
        assert!(below.to_string().contains("at least `--memory`"), "{below}");
        assert_eq!(
            admit_request(&elastic(20 * GIB, GPU_MEMORY_BYTES_MAX + 1)),
            Err(RequestError::MemoryLimitOutOfRange(
                GPU_MEMORY_BYTES_MAX + 1
            ))
        );
        // The log's rule accepts them: the bounds came after requests were first logged.
        assert_eq!(validate_request(&elastic(0, 60 * GIB)), Ok(()));
    }

    #[test]
    fn whole_node_constraints_are_bounded_on_admission() {
        let constrained = PlacementRequest {
            cpu_milli: 8_000,
            host_memory_bytes: 64 << 30,
            gpu_models: vec!["H100-80GB".into(), "A100-80GB".into()],
            ..whole(1)
        };
        assert_eq!(admit_request(&constrained), Ok(()));
        let at_most = PlacementRequest {
            cpu_milli: CPU_MILLI_MAX,
            host_memory_bytes: HOST_MEMORY_BYTES_MAX,
            gpu_models: (0..GPU_MODELS_MAX).map(|i| format!("m{i}")).collect(),
            ..whole(1)
        };
        assert_eq!(admit_request(&at_most), Ok(()));
        let cases = [
            (
                PlacementRequest {
                    cpu_milli: CPU_MILLI_MAX + 1,
                    ..whole(1)
                },
                RequestError::CpuOutOfRange(CPU_MILLI_MAX + 1),
            ),
            (
                PlacementRequest {
                    host_memory_bytes: HOST_MEMORY_BYTES_MAX + 1,
                    ..whole(1)
                },
                RequestError::HostMemoryOutOfRange(HOST_MEMORY_BYTES_MAX + 1),
            ),
            (
                PlacementRequest {
                    gpu_models: (0..=GPU_MODELS_MAX).map(|i| format!("m{i}")).collect(),
                    ..whole(1)
                },
                RequestError::TooManyGpuModels(GPU_MODELS_MAX + 1),
            ),
            (
                PlacementRequest {
                    gpu_models: vec![String::new()],
                    ..whole(1)
                },
                RequestError::BadGpuModel(String::new()),
            ),
            (
                PlacementRequest {
                    gpu_models: vec!["x".repeat(GPU_TEXT_MAX + 1)],
                    ..whole(1)
                },
                RequestError::BadGpuModel(format!("{}...", "x".repeat(32))),
            ),
            (
                PlacementRequest {
                    gpu_models: vec!["H100".into(), "H100".into()],
                    ..whole(1)
                },
                RequestError::RepeatedGpuModel("H100".into()),
            ),
        ];
        for (request, error) in cases {
            assert_eq!(admit_request(&request), Err(error.clone()));
            assert!(error.to_string().len() < 300, "{error}");
            assert_eq!(validate_request(&request), Ok(()), "{error}: log rule");
        }
        let message = RequestError::CpuOutOfRange(20_000_000).to_string();
        assert!(message.contains("20000 CPUs"), "{message}");
    }

    #[test]
    fn a_change_names_something_to_change_within_bounds() {
        let change = |compute_percent, priority, latency_target_us| SetTenantRequest {
            name: "chat".into(),
            compute_percent,
            priority,
            latency_target_us,
        };
        assert_eq!(
            validate_change(&change(None, None, None)),
            Err(RequestError::NothingToChange)
        );
        assert_eq!(validate_change(&change(Some(40), None, None)), Ok(()));
        assert_eq!(validate_change(&change(None, Some(-1000), None)), Ok(()));
        assert_eq!(validate_change(&change(None, None, Some(1_500))), Ok(()));
        assert_eq!(
            validate_change(&change(None, None, Some(0))),
            Ok(()),
            "0 removes the target"
        );
        assert_eq!(
            validate_change(&change(Some(0), None, None)),
            Err(RequestError::ComputeOutOfRange(0))
        );
        assert_eq!(
            validate_change(&change(Some(101), Some(0), None)),
            Err(RequestError::ComputeOutOfRange(101))
        );
        assert_eq!(
            validate_change(&change(None, Some(1001), None)),
            Err(RequestError::PriorityOutOfRange(1001))
        );
        assert_eq!(
            validate_change(&change(None, None, Some(9))),
            Err(RequestError::LatencyTargetOutOfRange(9))
        );
    }

    #[test]
    fn a_latency_target_needs_a_latency_tenant_and_is_bounded() {
        let target = |latency, latency_target_us| PlacementRequest {
            latency,
            latency_target_us,
            ..whole(1)
        };
        assert_eq!(admit_request(&target(false, 0)), Ok(()));
        assert_eq!(
            admit_request(&target(true, 0)),
            Ok(()),
            "no target: derived"
        );
        assert_eq!(admit_request(&target(true, 2_000)), Ok(()));
        assert_eq!(admit_request(&target(true, LATENCY_TARGET_US_MIN)), Ok(()));
        assert_eq!(admit_request(&target(true, LATENCY_TARGET_US_MAX)), Ok(()));
        let without = admit_request(&target(false, 2_000)).unwrap_err();
        assert_eq!(without, RequestError::LatencyTargetWithoutLatency);
        assert!(without.to_string().contains("add `--latency`"), "{without}");
        assert_eq!(
            admit_request(&target(true, 9)),
            Err(RequestError::LatencyTargetOutOfRange(9))
        );
        assert_eq!(
            admit_request(&target(true, LATENCY_TARGET_US_MAX + 1)),
            Err(RequestError::LatencyTargetOutOfRange(
                LATENCY_TARGET_US_MAX + 1
            ))
        );
        // Admission only: a logged request keeps its meaning (see the module docs).
        assert_eq!(validate_request(&target(false, 2_000)), Ok(()));
    }

    fn registered() -> crate::v1::Node {
        crate::v1::Node {
            name: "node-a".into(),
            address: "10.0.0.1:7402".into(),
            labels: [("zone".to_owned(), "a".to_owned())].into(),
            gpus: (0..8)
                .map(|index| crate::v1::Gpu {
                    uuid: format!("GPU-{index:08x}-0000-0000-0000-000000000000"),
                    index,
                    model: "NVIDIA H100 80GB HBM3".into(),
                    memory_bytes: 80 << 30,
                    pci_bus_id: format!("00000000:{index:02X}:00.0"),
                    nearest_nics: vec!["mlx5_0".into()],
                    nvlink_peers: (0..8)
                        .filter(|&peer| peer != index)
                        .map(|gpu_index| crate::v1::NvlinkPeer {
                            gpu_index,
                            link_count: 18,
                        })
                        .collect(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn an_ordinary_registration_is_admitted() {
        assert_eq!(admit_node(Some(&registered())), Ok(()));
        let host = crate::v1::Node {
            cpu_milli: 96_000,
            host_memory_bytes: 2 << 40,
            ..registered()
        };
        assert_eq!(admit_node(Some(&host)), Ok(()));
        assert_eq!(admit_node(None), Err(NodeError::Missing));
    }

    /// Issue 22, point 1: every field of a registration is bounded on admission.
    #[test]
    fn every_unbounded_registration_field_is_refused() {
        let long = |n: usize| "x".repeat(n);
        type Change = Box<dyn Fn(&mut crate::v1::Node)>;
        let cases: Vec<(&str, Change)> = vec![
            ("address", Box::new(move |n| n.address = long(262))),
            (
                "labels",
                Box::new(|n| {
                    n.labels = (0..65).map(|i| (format!("k{i}"), String::new())).collect()
                }),
            ),
            (
                "label value",
                Box::new(move |n| {
                    n.labels.insert("zone".into(), long(254));
                }),
            ),
            (
                "label key",
                Box::new(|n| {
                    n.labels.insert(String::new(), "a".into());
                }),
            ),
            ("uuid", Box::new(move |n| n.gpus[0].uuid = long(129))),
            ("model", Box::new(move |n| n.gpus[1].model = long(129))),
            ("pci", Box::new(move |n| n.gpus[2].pci_bus_id = long(33))),
            (
                "nics",
                Box::new(|n| n.gpus[3].nearest_nics = vec!["mlx".into(); 17]),
            ),
            (
                "nic name",
                Box::new(move |n| n.gpus[3].nearest_nics = vec![long(65)]),
            ),
            (
                "peers",
                Box::new(|n| {
                    let peer = n.gpus[4].nvlink_peers[0];
                    n.gpus[4].nvlink_peers.push(peer);
                }),
            ),
            (
                "links",
                Box::new(|n| n.gpus[5].nvlink_peers[0].link_count = 65),
            ),
            (
                "gpus",
                Box::new(|n| {
                    let gpu = n.gpus[0].clone();
                    n.gpus = vec![gpu; 65];
                }),
            ),
            (
                "size",
                Box::new(move |n| n.gpus[6].tenants = vec![long(1000); 300]),
            ),
            ("cpu", Box::new(|n| n.cpu_milli = CPU_MILLI_MAX + 1)),
            (
                "host memory",
                Box::new(|n| n.host_memory_bytes = HOST_MEMORY_BYTES_MAX + 1),
            ),
        ];
        for (what, change) in cases {
            let mut node = registered();
            change(&mut node);
            let error = admit_node(Some(&node)).expect_err(what);
            assert!(error.to_string().len() < 300, "{what}: {error}");
        }
    }

    #[test]
    fn an_excerpt_is_cut_on_a_character_boundary() {
        assert_eq!(excerpt("short", 8), "short");
        assert_eq!(excerpt("ééééé", 2), "éé...");
        assert_eq!(excerpt(&"y".repeat(1 << 20), 4), "yyyy...");
    }

    fn pinned(gpus: &[(&str, u32, u64)]) -> PlacementRequest {
        PlacementRequest {
            whole_gpus: gpus.len() as u32,
            owner: "k8s:ml/train".to_owned(),
            pin: Some(crate::v1::Pin {
                node: "gpu-1".to_owned(),
                gpus: gpus
                    .iter()
                    .map(
                        |&(uuid, compute_percent, memory_bytes)| crate::v1::PinnedGpu {
                            uuid: uuid.to_owned(),
                            compute_percent,
                            memory_bytes,
                        },
                    )
                    .collect(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn pins_are_bounded_on_admission() {
        let good = pinned(&[("GPU-a", 25, 20 << 30), ("GPU-b", 100, 80 << 30)]);
        assert_eq!(admit_request(&good), Ok(()));
        let fraction = PlacementRequest {
            whole_gpus: 0,
            milli_gpus: 250,
            ..pinned(&[("GPU-a", 25, 20 << 30)])
        };
        assert_eq!(admit_request(&fraction), Ok(()));
        let mut bad_node = good.clone();
        bad_node.pin.as_mut().unwrap().node = "GPU 1".to_owned();
        let too_many: Vec<(String, u32, u64)> = (0..=NODE_GPUS_MAX)
            .map(|i| (format!("GPU-{i}"), 1, 0))
            .collect();
        let too_many: Vec<(&str, u32, u64)> = too_many
            .iter()
            .map(|(u, c, m)| (u.as_str(), *c, *m))
            .collect();
        let long_uuid = "u".repeat(GPU_TEXT_MAX + 1);
        let mut wrong_count = good.clone();
        wrong_count.whole_gpus = 3;
        let mut across = good.clone();
        across.nodes = 2;
        let mut not_a_claim = good.clone();
        not_a_claim.owner = "alice".to_owned();
        let cases = [
            (bad_node, RequestError::PinBadNode("GPU 1".to_owned())),
            (pinned(&[]), RequestError::NoGpus),
            (pinned(&too_many), RequestError::PinGpusOutOfRange(65)),
            (
                wrong_count,
                RequestError::PinGpuCount {
                    pinned: 2,
                    asked: 3,
                },
            ),
            (across, RequestError::PinAcrossNodes(2)),
            (
                pinned(&[(&long_uuid, 1, 0)]),
                RequestError::PinBadGpu(excerpt(&long_uuid, 32)),
            ),
            (
                pinned(&[("GPU-a", 1, 0), ("GPU-a", 1, 0)]),
                RequestError::PinRepeatedGpu("GPU-a".to_owned()),
            ),
            (
                pinned(&[("GPU-a", 0, 0)]),
                RequestError::PinComputeOutOfRange {
                    uuid: "GPU-a".to_owned(),
                    percent: 0,
                },
            ),
            (
                pinned(&[("GPU-a", 10, GPU_MEMORY_BYTES_MAX + 1)]),
                RequestError::PinMemoryOutOfRange {
                    uuid: "GPU-a".to_owned(),
                    bytes: GPU_MEMORY_BYTES_MAX + 1,
                },
            ),
            (not_a_claim, RequestError::PinBadOwner("alice".to_owned())),
        ];
        for (request, error) in cases {
            assert_eq!(admit_request(&request), Err(error));
        }
        // A claim owner may be longer than other owners.
        let mut long_owner = good.clone();
        long_owner.owner = crate::names::claim_owner(&"n".repeat(63), &"c".repeat(253));
        assert_eq!(admit_request(&long_owner), Ok(()));
    }

    #[test]
    fn a_pin_is_for_the_tenant_named_after_its_claim() {
        let request = pinned(&[("GPU-a", 25, 20 << 30)]);
        assert_eq!(admit_claim_tenant("train-3f2a9c1e", &request), Ok(()));
        assert_eq!(
            admit_claim_tenant("infer-3f2a9c1e", &request),
            Err(RequestError::PinTenantName {
                tenant: "infer-3f2a9c1e".to_owned(),
                claim: "train".to_owned(),
            })
        );
        assert_eq!(admit_claim_tenant("anything", &whole(1)), Ok(()));
    }
}
