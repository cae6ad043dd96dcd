//! The controller's plain data: its [`Config`], the one closed [`Event`] enum it takes, and the
//! [`Output`] it returns (the [`Decision`] to publish, what changed and why, and each latency
//! tenant's [`TenantStatus`]).

use tenant_abi::control::{Decision, LatencySnapshot};

/// Latency tenants one controller follows: every tenant slot of a GPU's schedule
/// (`tenant_abi::compute::TENANTS`), so a GPU's windows always fit.
pub const TENANTS_MAX: usize = tenant_abi::compute::TENANTS;

/// Settings of one GPU's controller. [`Config::new`] gives the defaults; every field is
/// checked by `Controller::new` (programmer errors: it asserts).
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Whether the node runs MPS, so that the SM lever (green contexts) exists.
    pub mps: bool,
    /// SMs of the GPU; 0 (unknown) leaves the SM lever out.
    pub sm_count: u16,
    /// SMs are kept in multiples of this (a green context's granule: 8 on H100).
    pub sm_granularity: u16,
    /// The fewest SMs a squeezed tenant keeps (rounded up to a granule).
    pub sm_min: u16,
    /// The loosest in-flight cap worth setting (the ladder halves it down to 1); 0 leaves the
    /// in-flight lever out.
    pub inflight_max: u8,
    /// Without an explicit target, a tenant's target is this times its p99 alone.
    pub target_ratio: f64,
    /// The share of a tenant's steps allowed over its target.
    pub violation_budget: f64,
    /// How often `Event::Window` comes (the runtime's period).
    pub period_ns: u64,
    /// Consecutive clean windows before one relaxation (above a level that failed recently).
    pub relax_windows: u32,
    /// A window is clean when its p99 is under this share of the target (and nothing violated).
    pub relax_margin: f64,
    /// Windows spent tightening one lever kind, with the p99 not lower than before it, after
    /// which the rest of that kind is skipped.
    pub lever_patience_windows: u32,
    /// The span of a [`TenantStatus`]'s p50 and p99.
    pub status_window_ns: u64,
    /// A tenant is idle once silent for four of its usual gaps between steps, clamped to
    /// `idle_min_ns..=idle_max_ns`.
    pub idle_min_ns: u64,
    pub idle_max_ns: u64,
}

impl Config {
    /// Clean steps needed before one relaxation: as many as it takes one violation to exceed
    /// the budget (100 at 1%).
    pub fn relax_steps(&self) -> u64 {
        assert!(self.violation_budget > 0.0, "a violation budget");
        (1.0 / self.violation_budget).ceil() as u64
    }

    /// The defaults for a GPU of `sm_count` SMs (0: unknown), with or without MPS: H100's
    /// granule of 8 SMs, a floor of one granule, in-flight caps 8, 4, 2, 1, a target of 1.2x the
    /// tenant's own p99 alone, 1% of steps allowed over it, a 10 ms period, and a status span
    /// of 1 s.
    pub fn new(mps: bool, sm_count: u16) -> Config {
        Config {
            mps,
            sm_count,
            sm_granularity: 8,
            sm_min: 8,
            inflight_max: 8,
            target_ratio: 1.2,
            violation_budget: 0.01,
            period_ns: 10_000_000,
            relax_windows: 10,
            relax_margin: 0.9,
            lever_patience_windows: 3,
            status_window_ns: 1_000_000_000,
            idle_min_ns: 50_000_000,
            idle_max_ns: 1_000_000_000,
        }
    }

    /// Asserts that the settings make sense together.
    pub fn assert_valid(&self) {
        assert!(self.sm_granularity > 0, "an SM granule");
        assert!(self.sm_min > 0, "a squeezed tenant keeps some SMs");
        assert!(
            self.target_ratio.is_finite() && self.target_ratio > 1.0,
            "a target above the latency alone: {}",
            self.target_ratio
        );
        assert!(
            self.violation_budget > 0.0 && self.violation_budget < 1.0,
            "a violation budget within (0, 1): {}",
            self.violation_budget
        );
        assert!(
            self.relax_margin > 0.0 && self.relax_margin <= 1.0,
            "a relax margin within (0, 1]: {}",
            self.relax_margin
        );
        assert!(self.period_ns > 0 && self.relax_windows > 0);
        assert!(self.lever_patience_windows > 0);
        assert!(self.status_window_ns >= self.period_ns);
        assert!(0 < self.idle_min_ns && self.idle_min_ns <= self.idle_max_ns);
    }
}

/// One latency tenant's steps in one control period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantWindow {
    pub name: String,
    /// The steps that ended in this period (the difference of two histogram snapshots).
    pub window: LatencySnapshot,
    /// An explicit target (`vgpuctl place --latency-target`); `None`: learnt from the tenant's
    /// latency alone.
    pub target_ns: Option<u64>,
}

/// What the controller reacts to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// One control period ended at `now_ns`. `tenants`: the latency tenants on the GPU (one
    /// missing from the list had no steps); `neighbours_active`: whether any other tenant on the
    /// GPU launched work during the period; `open_step_since_ns`: when the oldest latency step
    /// still in flight on the GPU began (`tenant_abi::control::Control::open_step_since`), so
    /// that a starving tenant, whose steps do not end, is seen before they do.
    Window {
        now_ns: u64,
        tenants: Vec<TenantWindow>,
        neighbours_active: bool,
        open_step_since_ns: Option<u64>,
    },
    /// A latency tenant left the GPU: its baseline and status go.
    TenantGone { name: String },
}

/// The levers, in the order the ladder tightens them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Lever {
    /// Neighbours keep fewer SMs (MPS green contexts).
    Sms,
    /// Neighbours keep at most N launches queued per stream.
    Inflight,
    /// Neighbours wait while a latency step is in flight.
    Pause,
    /// Neighbours also wait when a latency step is predicted to start soon
    /// (`Decision::guard_us`), so that it does not start behind a kernel launched just before.
    Guard,
    /// Neighbours do not launch while a latency tenant is active at all (`Decision::exclusive`).
    Exclusive,
}

impl Lever {
    pub const ALL: [Lever; 5] = [
        Lever::Sms,
        Lever::Inflight,
        Lever::Pause,
        Lever::Guard,
        Lever::Exclusive,
    ];

    /// Whether the controller may learn the lever useless and leave it out: Pause and
    /// Exclusive are always in force at their levels (the ladder's last resorts).
    pub fn can_be_released(self) -> bool {
        !matches!(self, Lever::Pause | Lever::Exclusive)
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Why the decision changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// `tenant` spent more than its violation budget: steps over its target.
    OverBudget {
        tenant: String,
        steps: u64,
        violations: u64,
    },
    /// Tightening `lever` for several windows did not lower the p99: the rest of its levels are
    /// skipped (and it is released), the next lever kind is tried.
    LeverUseless { lever: Lever },
    /// Enough clean windows: one level looser.
    Relaxed,
    /// Clean long enough to test whether `lever` is needed at all: it is released while the
    /// level stays.
    ProbeLever { lever: Lever },
    /// Releasing `lever` cost violations: it is restored, and kept for this episode.
    LeverNeeded { lever: Lever },
    /// `tenant` is active and has no target yet (none given, its latency alone not learnt):
    /// Exclusive, the most protective level: the safe default.
    NoTarget { tenant: String },
    /// A step of `tenant` has been open for longer than `STARVING_TARGETS` times its target:
    /// the top at once (the level that gives it its latency alone), then down by the usual
    /// relaxation.
    Starving { tenant: String },
    /// No latency tenant has had steps for a while: nothing is restricted.
    Idle,
    /// The latency tenants are active again beside active neighbours: the level the last
    /// episode settled on, from the first window (not a climb from 0 at every burst).
    Resumed,
    /// The first relaxation of an episode whose unrestricted latency beside these neighbours
    /// is not measured yet (the target just learnt, or a resumed episode): straight to level
    /// 0, the floor (plain co-location), which may need no restriction at all. Over budget
    /// there, the level left comes back at once.
    ProbeUnrestricted,
    /// Level `level` and every level under it do not measurably lower the latency tenants'
    /// latency against level 0 beside these neighbours (see `Controller`'s docs on the
    /// floor): they only cost the neighbours, so level 0, and the climb skips them for the
    /// rest of the episode.
    NoBetterThanUnrestricted { level: usize },
}

/// A change of the decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub from: Decision,
    pub to: Decision,
    pub reason: Reason,
}

/// One latency tenant as the agent reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantStatus {
    pub name: String,
    /// The target in force: the explicit one, else `target_ratio` times the baseline; `None`
    /// while neither is known.
    pub target_ns: Option<u64>,
    /// The p99 of its steps alone (or, until such steps are seen, at Exclusive: see the
    /// crate's docs).
    pub baseline_p99_ns: Option<u64>,
    /// Over the last `status_window_ns` of steps; `None` without steps there.
    pub p50_ns: Option<u64>,
    pub p99_ns: Option<u64>,
    /// Steps seen, and those over the target in force when they ended (cumulative).
    pub steps: u64,
    pub violations: u64,
}

/// What one event leads to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The decision to publish (every period, even unchanged: a decision older than
    /// `tenant_abi::control::DECISION_TTL_NS` is void).
    pub decision: Decision,
    /// Set when the decision changed.
    pub change: Option<Change>,
    /// Every latency tenant the controller follows, by name.
    pub tenants: Vec<TenantStatus>,
}
