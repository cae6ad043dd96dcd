//! A simulation of the GPU's line (docs/design/elastic-memory.md, "The line") on a real board
//! region: jobs of several tenants grow piece by piece past their requests, run, and exit, acting
//! in turn as the interposer acts for a process (the model below names the interposer's step each
//! action stands for). It checks what no single test pins down: the capacity is never passed,
//! every job ends within a bound (nobody waits for ever), and when the requests fit the GPU and
//! the swap space holds what the jobs may have out, every job finishes (the line refuses nobody).
//! Some jobs are killed on the way, at whatever point they are (issue 17: a killed process's
//! memory and host staging are returned): the survivors and the agent reclaim the dead slot, and
//! the survivors still end, or finish when there is room.
//!
//! The model is coarse on purpose (one process per tenant, no hint helpers, staging released when
//! a chunk comes back, every action instant): it checks the rules, not the interposer's code.

use super::*;
use crate::ledger::test_liveness::Fake;
use crate::reclaim;
use proptest::prelude::*;

/// A unit of memory (the sizes below are in units).
const U: u64 = 1 << 20;
/// One turn of the simulation in the board's clock.
const TURN_NS: u64 = 10_000_000;
/// Turns a borrow waits while the line is stuck before it is refused (`line::STUCK_GRACE`, 2 s).
const STUCK_TURNS: u32 = 200;
/// Turns a within-request allocation waits for a reclaim before it is refused
/// (`RECLAIM_WAIT_MAX_MS`, 5 s).
const RECLAIM_TURNS: u32 = 500;
/// How long a finished wait's place is kept for the next (`line::RETRY_WINDOW`, 10 s).
const RETRY_TURNS: u64 = 1_000;
/// How often a waiter looks at its line (`line::UNSTALL_EVERY`, 1 s).
const UNSTALL_TURNS: u64 = 100;
/// How often the agent samples the board, reclaiming dead processes' slots (`shm::sample_board`,
/// at each heartbeat). Slower here than the agent's 1 s default so that a dead slot is freed by
/// the survivors' own looks and reservations whenever any survivor needs the room, which is what
/// the kill properties check; the agent is the backstop for a death nobody is waiting on.
const AGENT_TURNS: u64 = 1_000;

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Growing,
    Running(u32),
    Done,
    /// Refused: a within-request allocation whose reclaim did not come, or the last borrow of a
    /// stuck line.
    Failed(&'static str),
    /// Its process was killed at that turn, at whatever point it was: its slot says what it held
    /// until someone reclaims it.
    Killed(u64),
}

impl State {
    fn ended(&self) -> bool {
        matches!(self, State::Done | State::Failed(_) | State::Killed(_))
    }
}

#[derive(Debug, Clone)]
struct Job {
    tenant: usize,
    name: String,
    request: u64,
    slot: usize,
    pid: u32,
    pieces: Vec<u64>,
    run: u32,
    within: u64,
    resident: Vec<u64>,
    out: Vec<u64>,
    staging: u64,
    state: State,
    /// Since when it waits in line (the board's clock), and whether for a borrow.
    waiting: Option<u64>,
    refused_once: bool,
    reclaim_turns: u32,
    stuck_turns: u32,
    /// Where the GPU's memory was at its last look (`Region::movement`): a line whose memory
    /// moved since is not stuck, and the stuck grace starts again. Per borrow, as the
    /// interposer keeps it per wait.
    movement: Option<u64>,
    seen_refusals: u32,
    /// The turn its current stay in line began (its place may be older: `place`): a survivor
    /// that stood in line a whole look since a death must have reclaimed the dead slot.
    in_line_from: Option<u64>,
    /// The turn its dead slot was found reclaimed (a killed job).
    reclaimed_at: Option<u64>,
    /// The place it had in line and the turn its wait ended: a wait that starts again within
    /// [`RETRY_TURNS`] keeps it (`Process::line_place`).
    place: Option<(u64, u64)>,
}

#[derive(Debug, Clone)]
struct Spec {
    request: u64,
    peak_pieces: Vec<u64>,
    run: u32,
    start: u64,
    /// Turns after its start at which its process is killed, if it still runs then.
    kill_at: Option<u64>,
}

struct Outcome {
    /// Each job as it ended, and the line: what a failure shows.
    end: String,
    done: usize,
    killed: usize,
    failed: Vec<(String, &'static str)>,
    turns: u64,
}

fn simulate(capacity: u64, staging: u64, specs: &[Spec], turns_max: u64) -> Outcome {
    let region = Region::new_boxed();
    region.initialise();
    region.set_capacity(capacity);
    region.set_staging_budget(staging);
    let live = Fake::with(&[]);
    let board = Board::new(&region, &live);
    let mut jobs: Vec<Option<Job>> = vec![None; specs.len()];
    let mut turn = 0u64;
    loop {
        let now = (turn + 1) * TURN_NS;
        for (i, spec) in specs.iter().enumerate() {
            if jobs[i].is_none() && spec.start <= turn {
                let name = format!("t{i}");
                let limit = spec.peak_pieces.iter().sum::<u64>().max(spec.request);
                let tenant = region
                    .set_tenant(&TenantSpec {
                        name: name.clone(),
                        request_bytes: spec.request,
                        limit_bytes: limit,
                        priority: 0,
                        guaranteed: true,
                    })
                    .unwrap();
                let pid = 100 + i as u32;
                live.add(pid);
                let slot = board.claim_slot(pid, 1, tenant).unwrap();
                jobs[i] = Some(Job {
                    tenant,
                    name,
                    request: spec.request,
                    slot,
                    pid,
                    pieces: spec.peak_pieces.iter().rev().copied().collect(),
                    run: spec.run,
                    within: 0,
                    resident: Vec::new(),
                    out: Vec::new(),
                    staging: 0,
                    state: State::Growing,
                    waiting: None,
                    refused_once: false,
                    reclaim_turns: 0,
                    stuck_turns: 0,
                    movement: None,
                    seen_refusals: 0,
                    in_line_from: None,
                    reclaimed_at: None,
                    place: None,
                });
            }
        }
        // A kill takes the process wherever it is: growing, in line, with chunks out in
        // staging, running. The OS frees its GPU memory and pinned host memory; the board learns
        // it only when someone reclaims its slot.
        for (job, spec) in jobs.iter_mut().zip(specs) {
            if let Some(job) = job
                && spec.kill_at.is_some_and(|at| spec.start + at == turn)
                && !matches!(job.state, State::Done | State::Failed(_))
            {
                live.kill(job.pid);
                job.state = State::Killed(turn);
            }
        }
        if turn.is_multiple_of(AGENT_TURNS) {
            board.reclaim_dead(0);
        }
        for job in jobs.iter_mut().flatten() {
            step(&region, &board, &live, job, now, turn);
            assert!(
                region.resident_total() <= capacity,
                "turn {turn}: {} resident on a GPU of {capacity}",
                region.resident_total()
            );
            assert!(
                region.staging_total() <= staging,
                "turn {turn}: {} staging held on a budget of {staging}",
                region.staging_total()
            );
        }
        check_the_dead(&region, &mut jobs, turn);
        turn += 1;
        let started = jobs.iter().all(Option::is_some);
        let ended = jobs.iter().flatten().all(|j| j.state.ended());
        let reclaimed = region.slots.iter().all(|s| s.pid.load(SeqCst) == 0);
        if started && ended && reclaimed {
            // Everyone gone: no slot holds anything, the dead's staging included (the board's
            // totals skip free slots, so each slot's own counters are what say it).
            let held: Vec<(usize, [u64; 3])> = region
                .slots
                .iter()
                .map(|s| [&s.resident_bytes, &s.swapped_bytes, &s.staging_bytes])
                .map(|counters| counters.map(|c| c.load(SeqCst)))
                .enumerate()
                .filter(|(_, held)| *held != [0; 3])
                .collect();
            assert!(
                held.is_empty(),
                "turn {turn}: held after every job ended: {held:?}"
            );
            break;
        }
        if turn >= turns_max {
            break;
        }
    }
    let all: Vec<&Job> = jobs.iter().flatten().collect();
    let end = format!(
        "{:?}; waiters {:?}; free {}",
        all.iter()
            .map(|j| (
                j.name.clone(),
                j.state.clone(),
                j.within / U,
                j.resident.iter().sum::<u64>() / U,
                j.out.iter().sum::<u64>() / U,
                j.pieces.len(),
                j.waiting.is_some()
            ))
            .collect::<Vec<_>>(),
        region.waiters(),
        region.free() / U
    );
    Outcome {
        end,
        done: all.iter().filter(|j| j.state == State::Done).count(),
        killed: all
            .iter()
            .filter(|j| matches!(j.state, State::Killed(_)))
            .count(),
        failed: all
            .iter()
            .filter_map(|j| match j.state {
                State::Failed(why) => Some((j.name.clone(), why)),
                _ => None,
            })
            .collect(),
        turns: turn,
    }
}

/// A killed job's slot is reclaimed, and holds nothing then: its resident, swapped and staging
/// bytes are the board's again. Reclaimed by the first survivor's look at its line
/// ([`UNSTALL_TURNS`]) when one stands in line, by any reservation that finds the GPU or the
/// staging budget short, and by the agent's sample ([`AGENT_TURNS`]) at the latest.
fn check_the_dead(region: &Region, jobs: &mut [Option<Job>], turn: u64) {
    let waiting_since: Vec<u64> = jobs
        .iter()
        .flatten()
        .filter(|j| !j.state.ended())
        .filter_map(|j| j.in_line_from)
        .collect();
    for job in jobs.iter_mut().flatten() {
        let State::Killed(killed) = job.state else {
            continue;
        };
        if job.reclaimed_at.is_some() {
            continue;
        }
        let slot = &region.slots[job.slot];
        if slot.pid.load(SeqCst) != job.pid {
            job.reclaimed_at = Some(turn);
            // Zeroed, or already another process's slot (claimed after the reclaim).
            if slot.pid.load(SeqCst) == 0 {
                let held = [
                    &slot.resident_bytes,
                    &slot.swapped_bytes,
                    &slot.staging_bytes,
                    &slot.wait_since_ns,
                ]
                .map(|c| c.load(SeqCst));
                assert_eq!(held, [0; 4], "{}: its reclaimed slot still holds", job.name);
            }
            continue;
        }
        assert!(
            turn - killed < AGENT_TURNS,
            "{}: killed at turn {killed}, its slot still held at turn {turn}",
            job.name
        );
        let waited = waiting_since
            .iter()
            .map(|&since| turn + 1 - since.max(killed))
            .max();
        assert!(
            waited.is_none_or(|waited| waited < UNSTALL_TURNS),
            "{}: killed at turn {killed}, its slot still held at turn {turn} by a line that \
             waited {waited:?} turns since",
            job.name
        );
    }
}

fn step(
    region: &Region,
    board: &Board<'_, &Fake>,
    live: &Fake,
    job: &mut Job,
    now: u64,
    turn: u64,
) {
    if let State::Failed(_) = job.state
        && live.contains(job.pid)
    {
        // A refusal is an out-of-memory error in the job, which ends it.
        exit(region, live, job);
    }
    if job.state.ended() {
        return;
    }
    // `poll_swap`: a want on the tenant is met from resident borrowed chunks, largest first,
    // within the staging budget.
    let want = board.take_want(job.tenant);
    if want > 0 {
        job.resident.sort_unstable();
        let mut given = 0;
        while given < want {
            let Some(&size) = job.resident.last() else {
                break;
            };
            if !board.reserve_staging(job.slot, size) {
                board.swap_refused();
                break;
            }
            job.resident.pop();
            job.out.push(size);
            job.staging += size;
            given += size;
        }
        if given > 0 {
            // As the interposer's `SlotCounters::swapped_out`: given while in line, to its back.
            board.swapped_out(job.slot, given);
            board.requeue(job.slot, now);
            if job.waiting.is_some() {
                job.waiting = board.wait_since(job.slot);
            }
        }
    }
    // The hold rule: with a chunk out, nothing runs or grows until all are back (`take_back`;
    // the held wait in line, `wait_in_line`).
    if !job.out.is_empty() {
        let total: u64 = job.out.iter().sum();
        if region.room_in_line(job.slot, total, now) && board.swap_in(job.slot, total) {
            job.resident.append(&mut job.out);
            board.release_staging(job.slot, job.staging);
            job.staging = 0;
            end_wait(board, job, turn);
            return;
        }
        // The line's first brings back what fits, a chunk at a time, as the room frees
        // (`Counters::first_in_line`), and what they held in staging is free again.
        if region.served(now).0.is_some_and(|w| w.slot == job.slot) {
            let mut kept = Vec::new();
            for size in std::mem::take(&mut job.out) {
                if region.room_in_line(job.slot, size, now) && board.swap_in(job.slot, size) {
                    job.resident.push(size);
                    board.release_staging(job.slot, size);
                    job.staging -= size;
                } else {
                    kept.push(size);
                }
            }
            job.out = kept;
            if job.out.is_empty() {
                end_wait(board, job, turn);
                return;
            }
        }
        let total: u64 = job.out.iter().sum();
        let since = start_wait(job, now, turn);
        board.wait(job.slot, total, false, since);
        look_at_the_line(region, board, job, now, turn);
        return;
    }
    match job.state {
        State::Growing => grow(region, board, job, now, turn),
        State::Running(0) => {
            exit(region, live, job);
            job.state = State::Done;
        }
        State::Running(left) => job.state = State::Running(left - 1),
        State::Done | State::Failed(_) | State::Killed(_) => {}
    }
}

/// The job's process ends: the OS frees everything, and the board learns it from the dead slot.
/// The model reclaims that slot at once (as if the next look came at once), and only that one:
/// the slots of killed processes are left to the survivors and the agent, whose reclaim is what
/// the kill properties check (a reclaim here would free them behind the survivors' backs).
fn exit(region: &Region, live: &Fake, job: &Job) {
    live.kill(job.pid);
    let others: Vec<u32> = region
        .slots
        .iter()
        .map(|s| s.pid.load(SeqCst))
        .filter(|&pid| pid != 0 && pid != job.pid)
        .collect();
    let others = Fake::with(&others);
    assert_eq!(Board::new(region, &others).reclaim_dead(0), 1);
}

fn grow(region: &Region, board: &Board<'_, &Fake>, job: &mut Job, now: u64, turn: u64) {
    let Some(&piece) = job.pieces.last() else {
        board.stop_waiting(job.slot);
        job.waiting = None;
        job.in_line_from = None;
        job.state = State::Running(job.run);
        return;
    };
    if job.resident.is_empty() && job.within + piece <= job.request {
        // Within the request: granted, or the borrowers are asked and it waits (`reclaimed`).
        match board.reserve(job.slot, piece) {
            Ok(_) => {
                job.within += piece;
                job.pieces.pop();
                job.reclaim_turns = 0;
                board.refresh_claim(job.tenant, now);
            }
            Err(Refusal::NeedsReclaim { .. }) => {
                if job.reclaim_turns == 0 {
                    let holders = region.holders();
                    let owed = reclaim::owed(&holders, &job.name, piece);
                    let asks = reclaim::plan(&holders, &job.name, owed, region.free()).unwrap();
                    for (name, bytes) in &asks {
                        board.post_want(region.find(name).unwrap(), *bytes);
                    }
                    if !asks.is_empty() {
                        board.claim(job.tenant, owed, now);
                    }
                }
                job.reclaim_turns += 1;
                if job.reclaim_turns > RECLAIM_TURNS {
                    job.state = State::Failed("within its request, the reclaim did not come");
                }
            }
            Err(e) => panic!("{}: within-request piece refused: {e:?}", job.name),
        }
        return;
    }
    // A borrow (`borrow_in_line`): granted when there is room beside the claims and the
    // waiters ahead; else refused once at once (the caching allocator frees and retries), then
    // it waits in line.
    if region.room_in_line(job.slot, piece, now) {
        match board.reserve(job.slot, piece) {
            Ok(_) => {
                job.resident.push(piece);
                job.pieces.pop();
                end_wait(board, job, turn);
                job.stuck_turns = 0;
                job.movement = None;
                return;
            }
            Err(Refusal::OverLimit { .. }) => {
                panic!("{}: the limit is the sum of its pieces", job.name)
            }
            Err(_) => {}
        }
    }
    if !job.refused_once {
        job.refused_once = true;
        return;
    }
    let since = start_wait(job, now, turn);
    board.wait(job.slot, piece, true, since);
    look_at_the_line(region, board, job, now, turn);
    if job.stuck_turns > STUCK_TURNS {
        board.stop_waiting(job.slot);
        job.state = State::Failed("the last borrow of a stuck line");
    }
}

fn start_wait(job: &mut Job, now: u64, turn: u64) -> u64 {
    let kept = job
        .place
        .filter(|&(_, ended)| turn.saturating_sub(ended) < RETRY_TURNS)
        .map(|(since, _)| since);
    job.in_line_from.get_or_insert(turn);
    *job.waiting.get_or_insert(kept.unwrap_or(now))
}

fn end_wait(board: &Board<'_, &Fake>, job: &mut Job, turn: u64) {
    job.in_line_from = None;
    if let Some(since) = job.waiting.take() {
        board.stop_waiting(job.slot);
        job.place = Some((since, turn));
    }
}

/// Once a [`UNSTALL_TURNS`]: dead slots go, the first in line asks the other waiters' tenants
/// (`reclaim::unstall`), and a stuck line refuses its last borrow after [`STUCK_TURNS`] without
/// any memory moving.
fn look_at_the_line(region: &Region, board: &Board<'_, &Fake>, job: &mut Job, now: u64, turn: u64) {
    if turn % UNSTALL_TURNS != job.slot as u64 % UNSTALL_TURNS {
        if job.stuck_turns > 0 {
            job.stuck_turns += 1;
        }
        return;
    }
    board.reclaim_dead(job.pid);
    let (served, waiters) = region.served(now);
    // As the interposer's wait loop: memory that moved since this job's last look (a chunk out
    // or back, a grant, a free, a dead slot reclaimed just now) means the line is not stuck,
    // whatever the rule's arithmetic says: the grace starts again.
    let moved = region.movement();
    if job.movement.replace(moved) != Some(moved) {
        job.stuck_turns = 0;
    }
    if waiters.is_empty() {
        return;
    }
    let room = served
        .as_ref()
        .map_or(0, |first| region.free_in_line(first.slot, now));
    if let Some(first) = served.as_ref().filter(|first| first.slot == job.slot) {
        for (name, bytes) in reclaim::unstall(&region.holders(), &waiters, first, room) {
            board.post_want(region.find(&name).unwrap(), bytes);
        }
    }
    // As `refused_by_stuck_line`: the board's rule, with the swap refusals since the last look.
    let refusals = region.swap_refusals();
    let refused_since = std::mem::replace(&mut job.seen_refusals, refusals) != refusals;
    let stuck = region.stuck(now, refused_since);
    if stuck == Some(job.slot) {
        job.stuck_turns = job.stuck_turns.max(1);
    } else {
        job.stuck_turns = 0;
    }
}

fn jobs() -> impl Strategy<Value = (u64, Vec<Spec>)> {
    // A GPU of 16 to 48 units; 2 to 4 jobs with requests that together fit it, peaks of up to
    // the whole GPU in pieces of 1 to 4 units, runs of 0 to 300 turns, arrivals within 200; one
    // job in four killed within 600 turns of its start (growing, in line, swapped out, running,
    // or after it ended: no kill then).
    (16u64..=48, 2usize..=4).prop_flat_map(|(capacity, n)| {
        let job = (
            1u64..=capacity / n as u64,
            proptest::collection::vec(1u64..=4, 1..=16),
            0u32..=300,
            0u64..=200,
            proptest::option::weighted(0.25, 0u64..600),
        );
        (
            Just(capacity),
            proptest::collection::vec(job, n).prop_map(move |jobs| {
                jobs.into_iter()
                    .map(|(request, pieces, run, start, kill_at)| {
                        // At most the GPU in all (a job larger than the GPU never fits).
                        let mut total = 0;
                        let peak_pieces: Vec<u64> = pieces
                            .into_iter()
                            .take_while(|p| {
                                total += p;
                                total <= capacity
                            })
                            .map(|p| p * U)
                            .collect();
                        Spec {
                            request: request * U,
                            peak_pieces,
                            run,
                            start,
                            kill_at,
                        }
                    })
                    .collect()
            }),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, max_shrink_iters: 64, .. ProptestConfig::default() })]

    /// When every job's peak fits beside the other jobs' requests and the swap space holds every
    /// job's peak, every job finishes: nobody is refused, nobody waits for ever. (Requests that
    /// fit are not enough: two jobs whose peaks cannot be resident beside each other's request
    /// can never both finish, and the line refuses one of them, as it should.) Failed before the
    /// line passed over a waiter it cannot serve (rule 7 of `reclaim`): rule 6 refused the last
    /// borrow when the first waiter could only be served by memory others held within their
    /// requests, though swapping the first waiter's borrowed memory out would have served it.
    /// Killed jobs aside: every survivor finishes, whatever point the dead were at (their memory
    /// and staging come back to the board, within a look of a survivor's wait: `check_the_dead`).
    #[test]
    fn with_room_for_the_requests_and_the_swap_every_job_finishes((capacity, specs) in jobs()) {
        // Each job's pieces cut to what fits beside the other jobs' requests.
        let requests: u64 = specs.iter().map(|s| s.request).sum();
        let specs: Vec<Spec> = specs
            .into_iter()
            .map(|mut s| {
                let room = capacity * U - (requests - s.request);
                let mut total = 0;
                s.peak_pieces.retain(|p| {
                    total += p;
                    total <= room
                });
                s
            })
            .collect();
        let peaks: u64 = specs.iter().map(|s| s.peak_pieces.iter().sum::<u64>()).sum();
        let outcome = simulate(capacity * U, peaks, &specs, 20_000);
        prop_assert!(
            outcome.failed.is_empty() && outcome.done + outcome.killed == specs.len(),
            "{} of {} done ({} killed) after {} turns; failed: {:?}; end {}; jobs: {:?}",
            outcome.done, specs.len(), outcome.killed, outcome.turns, outcome.failed, outcome.end,
            specs
        );
    }

    /// With a swap space too small, jobs may be refused, but every job ends (done, refused with
    /// a reason, or killed) within the bound: the line never hangs, deaths or not. (A model
    /// without the kept place of `Process::line_place` hung here: two waiters took turns a piece
    /// at a time for ever.)
    #[test]
    fn with_a_small_swap_space_every_job_still_ends((capacity, specs) in jobs(), staging in 0u64..8) {
        let outcome = simulate(capacity * U, staging * U, &specs, 20_000);
        prop_assert_eq!(
            outcome.done + outcome.failed.len() + outcome.killed,
            specs.len(),
            "capacity {} staging {}: after {} turns: {} done, {} killed, failed {:?}; end {}; \
             jobs {:?}",
            capacity, staging, outcome.turns, outcome.done, outcome.killed, outcome.failed,
            outcome.end, specs
        );
    }
}
