//! Closed-loop sharing of one GPU: the controller that holds the step latency of the GPU's
//! latency tenants (`vgpuctl place --latency`) to a target while restricting their best-effort
//! neighbours as little as it can. The node agent's closed-loop thread
//! (`vgpu_agent::closed_loop`) reads the tenants' step histograms from the GPU's schedule file
//! (`tenant_abi::control`), feeds one [`Event::Window`] per control period to the GPU's
//! [`Controller`], and publishes the [`Decision`] of the [`Output`] for the neighbours'
//! interposers to obey.
//!
//! **Architecture Invariant:** a sans-IO core. It depends on `tenant-abi` (for `Decision` and
//! the histograms) and std only: no tokio, no clock (`now_ns` comes in the event), no
//! randomness, no I/O, no logging. The same events give the same outputs, so tests compare
//! exact outputs (`controller_test.rs`) and drive it against a simulated GPU
//! (`simulation_test.rs`).
//!
//! **The levers** form a ladder of levels ([`Ladder`]): 0 restricts nothing; under MPS the SMs a
//! neighbour keeps shrink first, then its launches in flight are capped at 8, 4, 2, 1, then it
//! pauses while a latency step is in flight (*Pause*), then it also waits when the latency
//! tenant's next step is predicted within 1/4, 1/2, 1, 2 of the tenant's step period, or within
//! the launch's own duration as the neighbour's interposer measured it, whichever is longer
//! (*Guard*: a step must not start behind a neighbour kernel launched just before it, which
//! pausing during steps cannot prevent when that kernel is longer than the latency budget; the
//! measured duration lets a neighbour kernel that ends before the next step go, and holds one
//! that would not, whatever the quarter), and at the top it
//! does not launch while a latency tenant is active at all (*Exclusive*). A level holds every
//! restriction below it. The step period is the time between the tenant's step starts,
//! measured from its steps per window (the shortest among several tenants); until it is known
//! the guard levels are skipped, and while one of them is in force it is not updated (the
//! decision changes only with a reason).
//!
//! **The target** of a tenant is the explicit one (`--latency-target`), else `target_ratio`
//! times its *baseline*, the p99 of its steps alone. The baseline is learnt from windows in
//! which no neighbour was active. Until 100 such steps were seen (a p99 needs that many), it is
//! learnt from windows at Exclusive beside active neighbours (from the second window there on:
//! the first may still hold the neighbours' queued work): nothing else runs, as good as alone.
//! Work queued before Exclusive can take longer than a window to drain, so the steps there are
//! taken in blocks of 100, and a block becomes the baseline only once the next one agrees with
//! it (p99s within one bucket; the lower of the two), or the lowest after
//! `PROTECTIVE_BLOCKS_MAX` blocks. A learnt target must be one the tenant meets where nothing
//! else runs: blocks of 100 steps at Exclusive (settled after a climb) whose p99 misses it by
//! `STALE_BASELINE_BUCKETS`, in a row and holding a quarter of the steps the baseline was learnt
//! from (`STALE_EVIDENCE_SHARE`: evidence in proportion to what it overturns, so that the
//! tenant's own slow spells do not become its target; a stay at another level ends the run),
//! replace the baseline; so does the floor finding the top no better than level 0 while the
//! tenant misses its target both there and unrestricted (it misses everywhere: the baseline is
//! wrong; a tenant within it unrestricted missed at the top only in a spell of its own) (a
//! baseline learnt from a warm-up's short
//! synchronisations, 0.7 ms against steps of 3-4 ms, held the level at Exclusive for good).
//! Only there: at Pause or Guard, a neighbour kernel launched before a step can still triple it,
//! and a baseline learnt there makes the target that much too loose. That fallback is learnt
//! only while the tenant has no target and is frozen once a block is taken: later windows at the
//! top are ones the controller climbed to after violations, and learning from them would let
//! interference loosen its own target. Until a tenant has a target, the controller holds
//! Exclusive (the safe default) while the tenant is active.
//!
//! **The rule**, every window beside active neighbours (windows without neighbours only teach
//! the baseline: the levers change nothing there):
//! - *Open steps.* A latency step still in flight (`open_step_since_ns`) that has been open for
//!   longer than the target counts as a violation at once, once per open step (its end is not
//!   counted again), so a starving tenant, whose steps end rarely, is answered within a period
//!   or two. With one latency tenant it is that tenant's; with several, it is charged to the
//!   one with the loosest target among those active when it began.
//! - *Starving.* Open for longer than `STARVING_TARGETS` (2) times that tenant's target, and
//!   either the tenant over its budget with it or the step open for longer than any step it
//!   took alone (no tenant's own tail explains that), the tenant is starving now: straight to
//!   the top (the
//!   level known to give it its latency alone), not one level per starving step (on an H100
//!   beside a copy-engine hog, steps of 150-190 ms for a 1.4 ms target climbed one level each
//!   and starved the tenant for a second per episode). A step within the tenant's own tail and
//!   its allowance is a violation like any other: an eager PyTorch tenant's own rare steps run
//!   past twice its target (p99.9 beside a training loop, plain, 3x its p99), and each sent the
//!   level to the top, where the trainer made no step at all; but a decoder behind GEMMs
//!   queued during a probe of level 0 stayed open, counted once, for 680 ms until the
//!   allowance alone was the rule. The level left failed, as when over budget (relaxing back into it waits its
//!   backoff), a lever under probe is needed, and what was learnt of the other levers stays.
//!   From the top, down by the usual relaxation. Windows in which a step starved (one took, or
//!   was seen open for, that long) are no samples of the step period: it would be the
//!   neighbour's pace, and size the guards ten times too wide.
//! - *Budget.* Each tenant has an allowance of violations: it grows by `violation_budget` per
//!   step (to at most one banked violation) and each step over the target spends one. A window
//!   with a violation that leaves the allowance negative is *over budget*. So a tenant at
//!   exactly its budget of isolated slow steps passes, two slow steps within
//!   `1 / violation_budget` steps do not, and in the long run no more than the budget passes
//!   unanswered.
//! - *Up, fast.* Over budget at level `l`: to `l + max(1, l / 2)` (multiplicative, so the top is
//!   reached in a handful of windows from anywhere), and past every level that failed in this
//!   episode and has not earned it back. The level that failed is remembered, with one
//!   exception: the level known to hold, climbed back into from a failed probe below it while
//!   the work the probe let start still drains (the climb's settling), has not failed (a 12 ms
//!   kernel started at a failed probe of a guard failed the guard above it too, on an H200, and
//!   relaxing back into it waited a doubled backoff); the climb goes on all the same.
//! - *Down, by halves.* After `relax_windows` consecutive clean windows (no violation) holding
//!   at least `1 / violation_budget` steps, and with every tenant in allowance, down: to the
//!   middle of
//!   the untried levels between the current one and the highest level that failed in this
//!   episode (or 0), or one level when only one is left. One level per wait took 17 waits of
//!   100 steps from the top of an H100's ladder, longer than most pairs of workloads stay
//!   together (the neighbour then sat at Exclusive); halving finds the level that holds in a
//!   few probes. The level left is *known to hold*: a climb from a failed probe below it goes no
//!   higher than it (until it fails itself). Going
//!   down to a level that failed waits for more clean steps: as many as its failure cost over
//!   the budget (`violations / violation_budget`), doubled for each failure of that level (at
//!   most 2^6). Probing a level that fails then costs no more than the budget, and the level
//!   settles instead of oscillating. Going down to a level that failed, or releasing a lever
//!   (below), also needs headroom: the p99 of the run of clean windows under `relax_margin` of
//!   the target (judged on the whole run: a window's own p99 is its slowest of two or three
//!   steps, and judging each window so held levels up on a few percent of steps between margin
//!   and target). A level that has not failed is tried without it: asked of every probe, it
//!   kept a restriction that bought nothing (a decoder at 1.15x its latency alone next to a
//!   training loop, at level 2 and at level 0 alike, held the trainer at 0.60 of its speed). A level that holds for its whole wait earns one doubling
//!   back, so a fluke (the tenant's own slow step) is not held against it for ever.
//! - *Learning the lever.* The controller measures which lever the pair of workloads needs,
//!   fitting nothing to one workload. Stepping up into a lever kind records the worst excess of
//!   p99 over target (in histogram buckets); if, after `lever_patience_windows` windows at that
//!   kind's levels, the p99 has not fallen by two buckets (one is the histogram's rounding) and
//!   the tenant is still over budget, the kind is switched off and the climb goes on at the next
//!   kind. And when clean long enough at a level, before relaxing, a lever kind in force below
//!   the current one that has not been judged is released on its own (the level stays): if the
//!   tenants stay clean it was not needed; if they go over budget it comes back and stays.
//!   Pause and Exclusive are never switched off, and nothing is probed at Exclusive (nothing
//!   else runs there: every lever would look useless). Levers interact: the in-flight bound of
//!   1 is a prerequisite of Pause and Guard (they hold back new launches, not work already
//!   queued), so every level from Pause up holds it whatever was learnt of the in-flight kind,
//!   which is therefore judged only at its own levels below Pause and never probed from Pause
//!   up (on an H200 without MPS the cap learnt away left Pause and the guards unbounded: the
//!   neighbour's queued kernels ran into every step and the controller ended at Exclusive). What was learnt lasts for an *episode*: until the latency
//!   tenants go idle, or the top level with levers switched off is over budget (the pair
//!   changed: every lever comes back).
//! - *Resume.* An episode ends when the latency tenants go idle (everything is released). The
//!   next one, beside active neighbours, starts at the level the last one settled on (its
//!   lowest level known to hold, else where it stood), not at 0: a bursty serving tenant is
//!   protected from the first step of every burst, and the relaxation takes the level down if
//!   the neighbours now need less. Only when every latency tenant active now was active in that
//!   episode: another tenant is another pair, and starts from 0 (on an H200, bert beside a
//!   trainer resumed at the top a decoder's episode had ended at, and spent its 8 s relaxing).
//! - *Idle.* A tenant is idle after four of its usual gaps between steps without one (clamped to
//!   `idle_min_ns..=idle_max_ns`); with every latency tenant idle, nothing is restricted. Never
//!   while a latency step is open on the GPU: with one latency tenant, the step is its own; with
//!   several, those that were active when the step began stay active. And a tenant whose step
//!   was seen open, with no step ended since, is idle only after `idle_max_ns` (the agent stops
//!   reporting a step open for longer than 100 ms; a starving step can take longer).
//!
//! **The floor.** No level may leave the latency tenants no better off than level 0 (plain
//! co-location) while it costs the neighbours: the issue's "never worse than plain co-location
//! on both axes at once", judged from measurement. Per episode, the controller keeps each
//! tenant's steps per level (beside running neighbours, from a decision's second window on,
//! not under a lever probe), and:
//! - *Level 0 first.* The first relaxation of an episode whose level 0 is unmeasured goes
//!   straight to 0 (`Reason::ProbeUnrestricted`), and so does the end of a `NoTarget` hold the
//!   moment the target is learnt: many pairs need no restriction at all (an H100 run: bert next
//!   to a training loop at 1.11x alone unrestricted, while the ladder's relaxation held Pause
//!   and the guards and left the trainer 9-23% of its speed). Over budget at 0, the level the
//!   probe came from returns at once (not a climb through every level below it). An episode
//!   that resumes after one whose level 0 failed does not try it first (most likely the same
//!   pair: a decoder beside GEMMs paid a starving step for it at every burst); its relaxation
//!   still halves its way down to 0.
//! - *Dominance.* Once a tenant has `FLOOR_RELAX_WAITS` relaxation waits of steps (200 at 1%)
//!   both at the current level and at 0, the level is kept only if it is measurably better for
//!   some tenant: a p99 `LEVER_IMPROVEMENT_BUCKETS` lower with the steps over it more frequent
//!   at level 0 beyond chance (a tenant whose own tail holds about 1% of its steps has a p99 that
//!   flips between tail and body from one sample to the next), or a share of steps over the
//!   target lower beyond chance (`FLOOR_BETTER_P`, an exact test; level 0's share over the
//!   budget).
//!   Otherwise it and every level under it are *dominated*: level 0
//!   (`Reason::NoBetterThanUnrestricted`), and climbs, relaxations and starving skip them for the
//!   rest of the episode; with the top dominated, nothing restricts. Until level 0 fails with its
//!   recent steps over the target far more often than the steps the floor measured there in
//!   the episode (`FLOOR_CHANGED_P`): the neighbours changed, and what the levels bought is
//!   measured again (in simulation a harmless neighbour that turned compute-bound otherwise had
//!   every level found no better than the old level 0, and nothing restricted).
//! - *Sampling the floor.* A failing level 0 leaves few steps to compare with, so when even the
//!   top misses the target over all its steps in the episode (not a burst: the tenant's own
//!   hiccups), level 0 is sampled until it has the steps to compare (and, sampled again each
//!   time the top's steps outgrow it, at least `1 / FLOOR_SAMPLE_SHARE` of the top's: a verdict
//!   drawn by chance from a small sample does not stand for the rest of the episode), unless its
//!   violations are already far more frequent than the top's (`FLOOR_FAR_WORSE_P`) or a step
//!   starves there: then level 0 is worse, and it is not sampled again in the episode.
//! - *A level's trial.* Over budget, a level fails only once it has failed its own trial: more
//!   violations since it was set than the budget's share of its steps (credited for one
//!   relaxation wait of steps at most: from there the tenant's allowance judges it alone), plus
//!   one when a tenant was already in debt as it was set (its debt is the level below's).
//!   Level 0, until the floor has its steps there in the episode and again once the floor has
//!   found a level no better than it, fails only on violations far more frequent than the budget
//!   (`FLOOR_FAR_WORSE_P`, exact binomial tails over its steps since it was set and over the
//!   last 200): two slow steps within 100 are a tenant's own tail as often as not (an eager
//!   PyTorch loop beside a trainer on an H200 climbed on them 0.5 s into the pair and held the
//!   trainer at 0.47 for a p99 no better than plain co-location's; and each such burst after a
//!   level was found no better climbed to the next level not yet judged), while interference
//!   worth a lever fails it within a few steps. Once a level was found no better, a lasting rate
//!   over the budget fails it at `FLOOR_BETTER_P`, and the climb goes straight to the top:
//!   whether any restriction helps is the top's to show (found no better too, nothing
//!   restricts for the rest of the episode).
//!
//! Several latency tenants on one GPU share one level: it steps up when any of them is over
//! budget and relaxes only when all are clean.
//!
//! **Redistribution** ([`Redistributor`], `redistribute`): a second core, for what the
//! latency tenants leave: the SMs among a GPU's burst MPS clients, each capped so that
//! capacity goes to the tenant that turns it into the most progress (its own units), uncapped
//! (max-min by the hardware) unless a move measurably pays. See the module's docs.

mod controller;
mod ladder;
pub mod redistribute;
mod tenant;
mod types;

pub use controller::{
    Controller, FLOOR_BETTER_P, FLOOR_CHANGED_P, FLOOR_FAR_WORSE_P, FLOOR_RELAX_WAITS,
    FLOOR_SAMPLE_SHARE, LEVER_IMPROVEMENT_BUCKETS, LeverState, PROBE_BACKOFF_MAX, SETTLE_MAX_NS,
};
pub use ladder::{GUARD_QUARTERS, Ladder, Rung, guard_us};
pub use redistribute::{
    Member, MemberStatus, RedistributeChange, RedistributeConfig, RedistributeOutput,
    Redistributor, ResetReason,
};
pub use tenant::{
    ALLOWANCE_MAX_PPM, ALLOWANCE_MIN_PPM, BASELINE_STEPS_MAX, BASELINE_STEPS_MIN, IDLE_GAPS,
    PERIOD_SAMPLES_MIN, PROTECTIVE_BLOCKS_MAX, STALE_BASELINE_BUCKETS, STALE_EVIDENCE_SHARE,
    STARVING_TARGETS, VIOLATION_PPM,
};
pub use tenant_abi::control::{Decision, LatencySnapshot};
pub use types::{
    Change, Config, Event, Lever, Output, Reason, TENANTS_MAX, TenantStatus, TenantWindow,
};
