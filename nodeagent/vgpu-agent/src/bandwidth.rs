//! The node's network bandwidth shared by tenant: the agent turns its assignments into
//! `netshare` flows (one per tenant over the node's NIC), lets the weighted max-min allocator
//! decide each flow's rate, and writes each rate into the tenant's own token-bucket table, in
//! its private directory ([`crate::private`]), which the tenant's NCCL plugin obeys
//! (`VGPU_NETSHARE_TABLE`, `VGPU_NETSHARE_FLOW`). One table per tenant, so no tenant can read or
//! take from another's bucket.
//!
//! [`Shaper::sync`] and [`Shaper::sample`] return the allocator's commands; [`Shaper::apply`]
//! executes them on the table. Every period the agent re-reads the persisted assignments (the
//! commit point the follower writes) and the buckets' counters: a flow whose requests were told to
//! wait is backlogged; otherwise its demand is what it sent, with headroom, so that idle tenants'
//! share goes to busy ones (work conservation) and comes back as soon as they send again.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::Duration;

use netshare::{
    Allocator, BucketConfig, BucketStats, Command, DemandReport, Event, FlowId, FlowSpec, LinkId,
    LinkKind, LinkSpec, TableOwner,
};
use tracing::{info, warn};

use crate::assignments::TenantAssignment;
use crate::private::Layout;
/// The NIC link's id (one link per node for now: NIC port 0, sending direction).
const NIC: LinkId = LinkId(0);
/// A flow's demand is what it sent in the last period times this, and never below
/// [`DEMAND_FLOOR`], so an idle tenant that starts again is not stuck at nothing for a period.
const HEADROOM: f64 = 1.25;
const DEMAND_FLOOR: u64 = 1 << 20;
/// How often rates follow the assignments and the measured demand.
pub const PERIOD: Duration = Duration::from_secs(1);

/// The flow id of a tenant: a stable non-zero hash of its name, the same in the agent and in
/// the environment it hands the tenant.
pub fn flow_id(tenant: &str) -> FlowId {
    FlowId::of_tenant(tenant)
}

/// The bandwidth weight of a tenant on this node: as placed, else its compute percents summed
/// (at least 1). The same rule gives the NCCL tuner its weight.
pub fn weight(assignment: &TenantAssignment) -> u32 {
    let derived: u32 = assignment.slices.iter().map(|s| s.compute_percent).sum();
    match assignment.bandwidth_weight {
        0 => derived.max(1),
        asked => asked,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BandwidthError {
    #[error("the bandwidth table {path}: {source}; tenants will send unthrottled")]
    Table {
        path: PathBuf,
        source: netshare::Error,
    },
}

/// A tenant's table as the shaper holds it: the file's identity tells a directory that was
/// removed and made again (the tenant released and placed again between two periods).
struct OpenTable {
    owner: TableOwner,
    inode: (u64, u64),
}

/// The allocator's view of this node plus the tables it drives.
pub struct Shaper {
    allocator: Allocator,
    /// tenant -> (flow, weight)
    flows: BTreeMap<String, (FlowId, u32)>,
    last: BTreeMap<FlowId, BucketStats>,
    /// Where the tenants' tables are; `None` only computes (tests).
    layout: Option<Layout>,
    tables: BTreeMap<FlowId, OpenTable>,
}

impl Shaper {
    /// A shaper for a NIC of `nic_bytes_per_second` that drives the tenants' tables under
    /// `layout`, or only computes (`None`).
    pub fn new(nic_bytes_per_second: u64, layout: Option<Layout>) -> Shaper {
        let mut allocator = Allocator::new();
        let commands = allocator.handle(Event::AddLink(LinkSpec {
            link: NIC,
            kind: LinkKind::NicPort { nic: 0, port: 0 },
            capacity_bytes_per_second: nic_bytes_per_second,
        }));
        debug_assert!(
            !commands
                .iter()
                .any(|c| matches!(c, Command::Rejected { .. }))
        );
        Shaper {
            allocator,
            flows: BTreeMap::new(),
            last: BTreeMap::new(),
            layout,
            tables: BTreeMap::new(),
        }
    }

    /// Opens the table of every shaped tenant whose private directory exists (the follower
    /// makes it before the tenant is committed, which may be after this period's sync) and gives
    /// a newly opened table its flow's current rate. Reopens a table whose file was replaced.
    pub fn open_tables(&mut self) -> Vec<BandwidthError> {
        let Some(layout) = &self.layout else {
            return Vec::new();
        };
        let mut problems = Vec::new();
        for (tenant, (flow, _)) in &self.flows {
            let path = layout.netshare(tenant);
            let on_disk = std::fs::metadata(&path).ok().map(|m| (m.dev(), m.ino()));
            if let Some(open) = self.tables.get(flow)
                && Some(open.inode) == on_disk
            {
                continue;
            }
            self.tables.remove(flow);
            if !layout.tenant_dir(tenant).is_dir() {
                continue;
            }
            let opened = TableOwner::open_or_create(&path).and_then(|owner| {
                let metadata = std::fs::metadata(&path).map_err(|source| netshare::Error::Io {
                    path: path.clone(),
                    source,
                })?;
                if let Some(rate) = self.allocator.flow(*flow).map(|f| f.rate_bytes_per_second) {
                    owner.set_rate(*flow, BucketConfig::for_rate(rate))?;
                }
                Ok(OpenTable {
                    owner,
                    inode: (metadata.dev(), metadata.ino()),
                })
            });
            match opened {
                Ok(table) => {
                    self.tables.insert(*flow, table);
                }
                Err(source) => problems.push(BandwidthError::Table { path, source }),
            }
        }
        problems
    }

    /// Bring the flows in line with the tenants placed on this node.
    pub fn sync(&mut self, tenants: &[TenantAssignment]) -> Vec<Command> {
        let wanted: BTreeMap<String, (FlowId, u32)> = tenants
            .iter()
            .map(|t| (t.tenant.clone(), (flow_id(&t.tenant), weight(t))))
            .collect();
        let mut commands = Vec::new();
        let gone: Vec<String> = self
            .flows
            .iter()
            .filter(|(name, flow)| wanted.get(*name) != Some(flow))
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            let (flow, _) = self.flows.remove(&name).expect("listed above");
            self.last.remove(&flow);
            if let Some(table) = self.tables.remove(&flow) {
                table.owner.clear(flow);
            }
            commands.extend(self.allocator.handle(Event::RemoveFlow { flow }));
        }
        for (name, (flow, weight)) in wanted {
            if self.flows.contains_key(&name) {
                continue;
            }
            if self.flows.values().any(|(other, _)| *other == flow) {
                warn!("tenants {name} and another share a bandwidth flow id; {name} is not shaped");
                continue;
            }
            let added = self.allocator.handle(Event::AddFlow(FlowSpec {
                flow,
                tenant: name.clone(),
                links: vec![NIC],
                weight,
                min_bytes_per_second: None,
                cap_bytes_per_second: None,
            }));
            if added.iter().any(|c| matches!(c, Command::Rejected { .. })) {
                warn!("the bandwidth allocator refused tenant {name}'s flow: {added:?}");
                continue;
            }
            commands.extend(added);
            self.flows.insert(name, (flow, weight));
        }
        commands
    }

    /// Feed the demand measured over the last `period` (from `stats`, by flow) to the allocator.
    pub fn sample(
        &mut self,
        stats: &BTreeMap<FlowId, BucketStats>,
        period: Duration,
    ) -> Vec<Command> {
        let mut reports = Vec::new();
        for (flow, _) in self.flows.values() {
            let Some(now) = stats.get(flow) else { continue };
            if let Some(before) = self.last.insert(*flow, *now) {
                reports.push(DemandReport {
                    flow: *flow,
                    bytes_per_second: demand(&before, now, period),
                });
            }
        }
        if reports.is_empty() {
            return Vec::new();
        }
        self.allocator.handle(Event::Demands(reports))
    }

    /// The rate the allocator gives `tenant` now, if it is shaped.
    pub fn rate(&self, tenant: &str) -> Option<u64> {
        let (flow, _) = self.flows.get(tenant)?;
        self.allocator.flow(*flow).map(|f| f.rate_bytes_per_second)
    }

    /// Every shaped flow's counters in its tenant's table.
    pub fn stats(&self) -> BTreeMap<FlowId, BucketStats> {
        self.tables
            .iter()
            .filter_map(|(flow, table)| table.owner.table().stats(*flow).map(|s| (*flow, s)))
            .collect()
    }

    /// Execute the allocator's commands on the tenants' tables (a flow whose table is not open
    /// yet gets its rate when [`Shaper::open_tables`] opens it).
    pub fn apply(&self, commands: &[Command]) {
        for command in commands {
            match command {
                Command::SetRate {
                    flow,
                    bytes_per_second,
                } => {
                    let Some(table) = self.tables.get(flow) else {
                        continue;
                    };
                    if let Err(error) = table
                        .owner
                        .set_rate(*flow, BucketConfig::for_rate(*bytes_per_second))
                    {
                        warn!("cannot set the rate of {flow}: {error}");
                    }
                }
                Command::ClearRate { flow } => {
                    if let Some(table) = self.tables.get(flow) {
                        table.owner.clear(*flow);
                    }
                }
                Command::Oversubscribed {
                    link,
                    guaranteed_bytes_per_second,
                    capacity_bytes_per_second,
                } => warn!(
                    "{link}: guaranteed bandwidth {guaranteed_bytes_per_second} B/s exceeds its capacity {capacity_bytes_per_second} B/s; guarantees are scaled down"
                ),
                Command::OversubscriptionResolved { link } => info!("{link}: guarantees fit again"),
                Command::Rejected { reason } => warn!("bandwidth allocator: {reason:?}"),
            }
        }
    }
}

/// A flow's demand from two samples of its bucket: `None` (backlogged) if it was throttled.
fn demand(before: &BucketStats, now: &BucketStats, period: Duration) -> Option<u64> {
    if now.throttled_count != before.throttled_count {
        return None;
    }
    let sent = now.admitted_bytes.wrapping_sub(before.admitted_bytes);
    let rate = sent as f64 / period.as_secs_f64().max(1e-3) * HEADROOM;
    Some((rate as u64).max(DEMAND_FLOOR))
}

/// Run the shaper until `shutdown`: every [`PERIOD`], sync with the persisted assignments and
/// sample the demand. Best effort: a table that cannot be made leaves tenants unthrottled.
pub async fn run(state_dir: PathBuf, shm_dir: PathBuf, nic_bytes_per_second: u64) {
    let layout = Layout::new(&shm_dir);
    info!(
        "sharing {} Gb/s of network bandwidth by tenant weight through each tenant's table under {}",
        nic_bytes_per_second * 8 / 1_000_000_000,
        layout.tenant_dir("<tenant>").display()
    );
    let mut shaper = Shaper::new(nic_bytes_per_second, Some(layout));
    // A table that cannot be opened is reported once until it can.
    let mut reported: Vec<String> = Vec::new();
    let mut ticker = tokio::time::interval(PERIOD);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match crate::state::read_assignments_file(&state_dir) {
            Ok(Some(file)) => {
                let commands = shaper.sync(&file.assignments);
                shaper.apply(&commands);
            }
            Ok(None) => {}
            Err(error) => warn!("bandwidth shaping: {error}"),
        }
        let problems: Vec<String> = shaper
            .open_tables()
            .iter()
            .map(ToString::to_string)
            .collect();
        for problem in problems.iter().filter(|p| !reported.contains(p)) {
            warn!("{problem}");
        }
        reported = problems;
        let stats = shaper.stats();
        let commands = shaper.sample(&stats, PERIOD);
        shaper.apply(&commands);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignments::SliceAssignment;

    fn tenant(name: &str, compute: u32, bandwidth: u32) -> TenantAssignment {
        TenantAssignment {
            tenant: name.into(),
            priority: 0,
            slices: vec![SliceAssignment {
                gpu_index: 0,
                gpu_uuid: "GPU-0".into(),
                compute_percent: compute,
                memory_bytes: 1 << 30,
                guaranteed: true,
                burst: false,
                memory_limit_bytes: 0,
            }],
            bandwidth_weight: bandwidth,
            latency: false,
            latency_target_us: None,
        }
    }

    const GB: u64 = 1_000_000_000;

    #[test]
    fn placements_split_the_nic_by_weight_and_follow_changes() {
        let mut s = Shaper::new(12 * GB, None);
        s.sync(&[tenant("a", 50, 75), tenant("b", 25, 0)]);
        // 75 : 25 of 12 GB/s
        assert_eq!(s.rate("a"), Some(9 * GB));
        assert_eq!(s.rate("b"), Some(3 * GB));
        // b leaves: a gets the whole NIC
        s.sync(&[tenant("a", 50, 75)]);
        assert_eq!(s.rate("a"), Some(12 * GB));
        assert_eq!(s.rate("b"), None);
        // a's weight changes: its flow is replaced, still alone
        let commands = s.sync(&[tenant("a", 50, 10), tenant("c", 50, 0)]);
        assert!(
            commands
                .iter()
                .any(|c| matches!(c, Command::ClearRate { .. }))
        );
        assert_eq!(s.rate("a"), Some(2 * GB)); // 10 : 50
        assert_eq!(s.rate("c"), Some(10 * GB));
    }

    #[test]
    fn idle_tenants_lend_their_share_until_they_send_again() {
        let mut s = Shaper::new(12 * GB, None);
        s.sync(&[tenant("a", 50, 75), tenant("b", 50, 25)]);
        let (fa, fb) = (flow_id("a"), flow_id("b"));
        let stats = |a: u64, b: u64, throttled_b: u64| {
            let config = BucketConfig::for_rate(GB);
            BTreeMap::from([
                (
                    fa,
                    BucketStats {
                        config,
                        admitted_bytes: a,
                        throttled_count: 0,
                    },
                ),
                (
                    fb,
                    BucketStats {
                        config,
                        admitted_bytes: b,
                        throttled_count: throttled_b,
                    },
                ),
            ])
        };
        s.sample(&stats(0, 0, 0), PERIOD); // first sample: a baseline only
        // a sent 1 GB in the period and was never throttled; b was throttled: backlogged
        s.sample(&stats(GB, 0, 5), PERIOD);
        assert_eq!(s.rate("a"), Some(GB * 5 / 4));
        assert_eq!(s.rate("b"), Some(12 * GB - GB * 5 / 4));
        // both busy again: back to 3:1
        s.sample(&stats(GB, 0, 9), PERIOD);
        assert_eq!(s.rate("a"), Some(DEMAND_FLOOR));
        s.sample(&stats(GB, 0, 9), PERIOD); // a idle too now
        let _ = s.stats();
    }

    #[test]
    fn weights_and_flow_ids() {
        assert_eq!(weight(&tenant("x", 30, 0)), 30);
        assert_eq!(weight(&tenant("x", 30, 500)), 500);
        assert_eq!(weight(&tenant("x", 0, 0)), 1);
        assert_ne!(flow_id("a"), flow_id("b"));
        assert_ne!(flow_id("").0, 0);
    }

    #[test]
    fn each_tenants_table_gets_only_its_rate() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path());
        let mut s = Shaper::new(10 * GB, Some(layout.clone()));
        let rate = |tenant: &str| {
            let table = netshare::Table::open(&layout.netshare(tenant)).unwrap();
            let flows = table.flows();
            assert!(flows.len() <= 1, "{tenant}'s table holds {flows:?}");
            table
                .stats(flow_id(tenant))
                .map(|s| s.config.rate_bytes_per_second)
        };
        let commands = s.sync(&[tenant("a", 50, 0), tenant("b", 50, 0)]);
        s.apply(&commands);
        // No directory yet (the follower makes them): nothing opened, nothing created.
        assert!(s.open_tables().is_empty());
        assert!(!layout.netshare("a").exists());
        for t in ["a", "b"] {
            std::fs::create_dir_all(layout.tenant_dir(t)).unwrap();
        }
        assert!(s.open_tables().is_empty());
        assert_eq!(rate("a"), Some(5 * GB));
        assert_eq!(rate("b"), Some(5 * GB));
        let commands = s.sync(&[tenant("a", 50, 0)]);
        s.apply(&commands);
        assert_eq!(rate("b"), None);
        assert_eq!(rate("a"), Some(10 * GB));
        // a's directory is made again (released and placed again between two periods): the
        // new table is opened and gets the rate.
        std::fs::remove_dir_all(layout.tenant_dir("a")).unwrap();
        std::fs::create_dir_all(layout.tenant_dir("a")).unwrap();
        assert!(s.open_tables().is_empty());
        assert_eq!(rate("a"), Some(10 * GB));
    }
}
