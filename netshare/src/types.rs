//! The allocator's vocabulary: identifiers, the closed [`Event`] and [`Command`] enums, the
//! reasons an event is rejected, and the bounds every input is checked against.

use std::fmt;

/// The most links one allocator tracks (a node with 8 GPUs has 28 NVLink pairs, 8 PCIe links and a
/// few NIC ports; this leaves room for larger nodes and for a pool-wide allocator of a rack).
pub const LINKS_MAX: usize = 1024;
/// The most flows one allocator tracks (tenants × the links each of them uses); one token bucket
/// each, so it equals the bucket table's `SLOTS`.
pub const FLOWS_MAX: usize = 1024;
/// The most links one flow crosses (GPU → PCIe switch → NIC port is three).
pub const LINKS_PER_FLOW_MAX: usize = 8;
/// The largest link capacity, flow guarantee or flow cap: 2^50 bytes/s (about 1.1 PB/s). Keeping
/// every rate below 2^53 makes it exact as an `f64`, which the water-filling relies on.
pub const BYTES_PER_SECOND_MAX: u64 = 1 << 50;
/// The largest flow weight. Weights are relative, so this only bounds the ratio between tenants.
pub const WEIGHT_MAX: u32 = 1_000_000;
/// The longest tenant name (a DNS label, as everywhere else in vgpu).
pub const TENANT_NAME_BYTES_MAX: usize = 63;

/// A link, named by the agent. Opaque to the allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LinkId(pub u32);

/// A flow: one tenant's traffic over one path of links, named by the agent. The same number names
/// the flow's token bucket in the shared-memory table, where 0 means "free slot", so 0 is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FlowId(pub u64);

impl FlowId {
    /// The flow of tenant `name` on a node: a stable non-zero hash (FNV-1a) of the name, so the
    /// agent and every process of the tenant derive the same id.
    pub fn of_tenant(name: &str) -> FlowId {
        let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        FlowId(h | 1)
    }
}

impl fmt::Display for LinkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "link {}", self.0)
    }
}

impl fmt::Display for FlowId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "flow {}", self.0)
    }
}

/// What a link is. The allocator treats every kind the same way; the kind is kept for reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// The NVLink bandwidth between two GPUs of a node (indices in the node's inventory), in one
    /// direction: `from` sends to `to`.
    NvLink { from: u32, to: u32 },
    /// One port of a NIC, in one direction.
    NicPort { nic: u32, port: u32 },
    /// The PCIe link of one GPU, in one direction.
    Pcie { gpu: u32 },
}

/// A link with its capacity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkSpec {
    pub link: LinkId,
    pub kind: LinkKind,
    pub capacity_bytes_per_second: u64,
}

/// A flow as the agent declares it: who it belongs to, which links it crosses, and its share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowSpec {
    pub flow: FlowId,
    pub tenant: String,
    /// The links the flow crosses; distinct, at least one, at most [`LINKS_PER_FLOW_MAX`].
    pub links: Vec<LinkId>,
    /// The flow's share relative to the other flows on its links (75 and 25 split 3:1).
    pub weight: u32,
    /// The guaranteed minimum. Honoured before any weighted sharing; scaled down proportionally
    /// (and reported) on a link whose guarantees exceed its capacity.
    pub min_bytes_per_second: Option<u64>,
    /// The most the flow may get, however idle its links are.
    pub cap_bytes_per_second: Option<u64>,
}

/// A measured demand. `None` means backlogged: the flow would use whatever it is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DemandReport {
    pub flow: FlowId,
    pub bytes_per_second: Option<u64>,
}

/// Everything that changes the allocator's state: one closed enum, handled by
/// [`crate::Allocator::handle`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    AddLink(LinkSpec),
    /// Refused while flows cross the link: remove them first.
    RemoveLink {
        link: LinkId,
    },
    /// A link's capacity changed (for example an NVLink lane went down).
    SetLinkCapacity {
        link: LinkId,
        capacity_bytes_per_second: u64,
    },
    /// A new flow starts backlogged (its demand unknown), so it gets its full share at once.
    AddFlow(FlowSpec),
    RemoveFlow {
        flow: FlowId,
    },
    /// One flow's measured demand.
    Demand {
        flow: FlowId,
        bytes_per_second: Option<u64>,
    },
    /// Many flows' measured demands, applied together so that rates are recomputed once (what the
    /// agent sends after each sampling period).
    Demands(Vec<DemandReport>),
}

/// What the runtime must do. Commands are emitted in a fixed order: `Rejected` alone; otherwise
/// `ClearRate` (for a removed flow), then oversubscription changes by link, then `SetRate` by
/// flow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Set the flow's token-bucket rate. Emitted only when the rate changed (always for a new flow).
    SetRate { flow: FlowId, bytes_per_second: u64 },
    /// The flow is gone: free its token bucket.
    ClearRate { flow: FlowId },
    /// The guarantees demanded on this link exceed its capacity; they are scaled down by
    /// `capacity / guaranteed`. Emitted when a link becomes oversubscribed or the amount changes.
    Oversubscribed {
        link: LinkId,
        guaranteed_bytes_per_second: u64,
        capacity_bytes_per_second: u64,
    },
    /// The link's guarantees fit again.
    OversubscriptionResolved { link: LinkId },
    /// The event was invalid and changed nothing.
    Rejected { reason: Reject },
}

/// Why an event was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reject {
    DuplicateLink(LinkId),
    UnknownLink(LinkId),
    LinkInUse {
        link: LinkId,
        flows: usize,
    },
    TooManyLinks,
    InvalidCapacity {
        link: LinkId,
        bytes_per_second: u64,
    },
    DuplicateFlow(FlowId),
    UnknownFlow(FlowId),
    TooManyFlows,
    /// Flow id 0 is reserved (it marks a free bucket slot).
    ReservedFlowId,
    InvalidTenantName {
        flow: FlowId,
    },
    /// No links, more than [`LINKS_PER_FLOW_MAX`], or a link listed twice.
    InvalidPath {
        flow: FlowId,
    },
    InvalidWeight {
        flow: FlowId,
        weight: u32,
    },
    /// A guarantee or cap above [`BYTES_PER_SECOND_MAX`], or a guarantee above the cap.
    InvalidLimits {
        flow: FlowId,
    },
    /// A demand of more than [`BYTES_PER_SECOND_MAX`] (report `None` for "backlogged").
    InvalidDemand {
        flow: FlowId,
        bytes_per_second: u64,
    },
    /// A batch of demand reports with more entries than [`FLOWS_MAX`].
    TooManyDemands,
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reject::DuplicateLink(link) => write!(f, "{link} already exists"),
            Reject::UnknownLink(link) => write!(f, "{link} does not exist"),
            Reject::LinkInUse { link, flows } => {
                write!(f, "{link} is crossed by {flows} flows; remove them first")
            }
            Reject::TooManyLinks => write!(f, "more than {LINKS_MAX} links"),
            Reject::InvalidCapacity {
                link,
                bytes_per_second,
            } => write!(
                f,
                "{link}: capacity {bytes_per_second} B/s is not in 1..={BYTES_PER_SECOND_MAX}"
            ),
            Reject::DuplicateFlow(flow) => write!(f, "{flow} already exists"),
            Reject::UnknownFlow(flow) => write!(f, "{flow} does not exist"),
            Reject::TooManyFlows => write!(f, "more than {FLOWS_MAX} flows"),
            Reject::ReservedFlowId => write!(f, "flow id 0 is reserved"),
            Reject::InvalidTenantName { flow } => write!(
                f,
                "{flow}: the tenant name is empty or longer than {TENANT_NAME_BYTES_MAX} bytes"
            ),
            Reject::InvalidPath { flow } => write!(
                f,
                "{flow}: a flow crosses 1..={LINKS_PER_FLOW_MAX} distinct links"
            ),
            Reject::InvalidWeight { flow, weight } => {
                write!(f, "{flow}: weight {weight} is not in 1..={WEIGHT_MAX}")
            }
            Reject::InvalidLimits { flow } => write!(
                f,
                "{flow}: the guarantee must not exceed the cap, and neither {BYTES_PER_SECOND_MAX} B/s"
            ),
            Reject::InvalidDemand {
                flow,
                bytes_per_second,
            } => write!(
                f,
                "{flow}: demand {bytes_per_second} B/s exceeds {BYTES_PER_SECOND_MAX} (use None for backlogged)"
            ),
            Reject::TooManyDemands => write!(f, "more than {FLOWS_MAX} demand reports at once"),
        }
    }
}
