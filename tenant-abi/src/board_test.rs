use super::*;
use crate::ledger::test_liveness::Fake;
use crate::reclaim;

const GIB: u64 = 1 << 30;

fn spec(name: &str, request: u64, limit: u64) -> TenantSpec {
    TenantSpec {
        name: name.to_owned(),
        request_bytes: request,
        limit_bytes: limit,
        priority: 0,
        guaranteed: true,
    }
}

/// An 80 GiB board with tenants "a" and "b", each requesting 30 GiB with a limit of 70 GiB.
fn issue_board() -> Box<Region> {
    let region = Region::new_boxed();
    region.initialise();
    region.set_capacity(80 * GIB);
    region.set_tenant(&spec("a", 30 * GIB, 70 * GIB)).unwrap();
    region.set_tenant(&spec("b", 30 * GIB, 70 * GIB)).unwrap();
    region
}

#[test]
fn a_zeroed_board_lends_nothing() {
    let region = Region::new_boxed();
    assert!(!region.is_initialised());
    region.initialise();
    region.check_layout().unwrap();
    let index = region.set_tenant(&spec("a", GIB, GIB)).unwrap();
    let live = Fake::with(&[10]);
    let board = Board::new(&region, &live);
    let slot = board.claim_slot(10, 1, index).unwrap();
    // No capacity written yet: nothing may be held, and the request is not the GPU's to give.
    assert_eq!(
        board.reserve(slot, 1),
        Err(Refusal::NeedsReclaim { shortfall: 1 })
    );
}

#[test]
fn the_agent_writes_entries_and_refuses_bad_ones() {
    let region = Region::new_boxed();
    region.initialise();
    let a = region.set_tenant(&spec("a", GIB, 2 * GIB)).unwrap();
    assert_eq!(region.find("a"), Some(a));
    assert_eq!(region.find("ab"), None);
    // Rewriting keeps the index.
    assert_eq!(region.set_tenant(&spec("a", 2 * GIB, 2 * GIB)), Ok(a));
    assert_eq!(region.holders()[0].request, 2 * GIB);
    let long = "x".repeat(NAME_BYTES);
    assert!(matches!(
        region.set_tenant(&spec(&long, 1, 1)),
        Err(SpecError::Name(_))
    ));
    let longest = "y".repeat(NAME_BYTES - 1);
    let y = region.set_tenant(&spec(&longest, 1, 1)).unwrap();
    assert_eq!(region.find(&longest), Some(y));
    assert_eq!(region.holders()[1].name, longest);
    assert!(matches!(
        region.set_tenant(&spec("c", 2, 1)),
        Err(SpecError::LimitBelowRequest { .. })
    ));
    for i in 2..TENANTS {
        region.set_tenant(&spec(&format!("t{i}"), 1, 1)).unwrap();
    }
    assert_eq!(region.set_tenant(&spec("late", 1, 1)), Err(SpecError::Full));
    assert!(region.remove_tenant("a"));
    assert_eq!(region.find("a"), None);
    assert!(region.set_tenant(&spec("late", 1, 1)).is_ok());
}

/// A borrow past the tenant's limit is refused by the limit whether or not the GPU has room:
/// the interposer asks before it stands in line for room that would not serve it.
#[test]
fn the_limit_refuses_a_borrow_whatever_the_gpu_has_free() {
    let region = issue_board();
    let live = Fake::with(&[10, 20]);
    let board = Board::new(&region, &live);
    let a = board.claim_slot(10, 1, 0).unwrap();
    let b = board.claim_slot(20, 1, 1).unwrap();
    assert_eq!(board.reserve(a, 40 * GIB), Ok(Grant::Borrowed));
    assert_eq!(board.reserve(b, 35 * GIB), Ok(Grant::Borrowed));
    // 5 GiB free: b's 40 more is past its limit of 70 (and past the free memory).
    let over = Refusal::OverLimit {
        held: 35 * GIB,
        limit: 70 * GIB,
    };
    assert_eq!(board.over_limit(b, 40 * GIB), Some(over));
    assert_eq!(board.reserve(b, 40 * GIB), Err(over));
    // 35 more is within it: only the room is missing.
    assert_eq!(board.over_limit(b, 35 * GIB), None);
    assert!(matches!(
        board.reserve(b, 35 * GIB),
        Err(Refusal::NothingFree { .. })
    ));
}

/// The issue's case on an 80 GiB GPU: "a" (request 30, limit 70) grows to 60 GiB while "b" idles;
/// then "b" takes its 30: it is short by 10 GiB, the planner asks "a" for them, "a" swaps them
/// out, "b" gets its request. "a" swaps back in only once "b" frees memory.
#[test]
fn a_borrower_gives_back_what_a_request_needs() {
    let region = issue_board();
    let (a, b) = (region.find("a").unwrap(), region.find("b").unwrap());
    let live = Fake::with(&[100, 200]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(100, 1, a).unwrap();
    let sb = board.claim_slot(200, 1, b).unwrap();

    assert_eq!(board.reserve(sa, 30 * GIB), Ok(Grant::Within));
    assert_eq!(board.reserve(sa, 30 * GIB), Ok(Grant::Borrowed));
    // Past its limit: refused whatever is free.
    assert_eq!(
        board.reserve(sa, 11 * GIB),
        Err(Refusal::OverLimit {
            held: 60 * GIB,
            limit: 70 * GIB
        })
    );
    assert_eq!(board.reserve(sb, 20 * GIB), Ok(Grant::Within));
    let short = board.reserve(sb, 10 * GIB);
    assert_eq!(
        short,
        Err(Refusal::NeedsReclaim {
            shortfall: 10 * GIB
        })
    );

    let asks = reclaim::plan(&region.holders(), "b", 10 * GIB, region.free()).unwrap();
    assert_eq!(asks, vec![("a".to_owned(), 10 * GIB)]);
    let epoch = board.post_want(a, 10 * GIB);
    assert_eq!(epoch, 1);
    // "a"'s process takes the want once and swaps that much out.
    let asked = board.take_want(a);
    assert_eq!((asked, board.take_want(a)), (10 * GIB, 0));
    board.swapped_out(sa, asked);
    assert_eq!(board.reserve(sb, 10 * GIB), Ok(Grant::Within));
    // Swapped memory still counts against a's limit.
    assert!(matches!(
        board.reserve(sa, 11 * GIB),
        Err(Refusal::OverLimit { .. })
    ));
    assert!(!board.swap_in(sa, 10 * GIB), "no room until b frees");
    board.release(sb, 10 * GIB);
    assert!(board.swap_in(sa, 10 * GIB));
    assert_eq!(region.free(), 0);
}

#[test]
fn past_the_request_only_what_is_free_is_lent() {
    let region = issue_board();
    let (a, b) = (region.find("a").unwrap(), region.find("b").unwrap());
    let live = Fake::with(&[100, 200]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(100, 1, a).unwrap();
    let sb = board.claim_slot(200, 1, b).unwrap();
    assert_eq!(board.reserve(sb, 30 * GIB), Ok(Grant::Within));
    assert_eq!(board.reserve(sa, 30 * GIB), Ok(Grant::Within));
    assert_eq!(board.reserve(sa, 20 * GIB), Ok(Grant::Borrowed));
    // 80 of 80 held: a borrower asking more is not a reclaim, just refused.
    assert_eq!(
        board.reserve(sa, GIB),
        Err(Refusal::NothingFree {
            asked: GIB,
            free: 0
        })
    );
    assert_eq!(
        reclaim::plan(&region.holders(), "a", GIB, region.free()).map(|_| ()),
        Err(reclaim::NoReclaim::PastRequest {
            tenant: "a".to_owned(),
            asked: GIB,
            request: 30 * GIB,
            resident: 50 * GIB,
        })
    );
}

#[test]
fn a_dead_process_frees_what_it_held() {
    let region = issue_board();
    let (a, b) = (region.find("a").unwrap(), region.find("b").unwrap());
    let live = Fake::with(&[100, 200]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(100, 1, a).unwrap();
    let sb = board.claim_slot(200, 1, b).unwrap();
    board.reserve(sa, 70 * GIB).unwrap();
    board.swapped_out(sa, 10 * GIB);
    live.kill(100);
    // b needs its request; the dead borrower's memory is reclaimed on the way, no want needed.
    assert_eq!(board.reserve(sb, 30 * GIB), Ok(Grant::Within));
    assert_eq!(region.resident_total(), 30 * GIB);
    assert_eq!(region.slots[sa].pid.load(SeqCst), 0);
    assert_eq!(region.slots[sa].swapped_bytes.load(SeqCst), 0);
}

/// Many processes of several tenants reserving and freeing at once never hold more than the
/// capacity or a tenant's limit: each thread adds what it was granted to a shared total after
/// the grant and takes it off before it frees, so the total never exceeds what the board has
/// granted, and two grants the board made past the capacity while both were held show in it.
#[test]
fn racing_processes_never_pass_the_capacity_or_a_limit() {
    use std::sync::atomic::AtomicU64 as Counter;
    let region = Region::new_boxed();
    region.initialise();
    let capacity = 64 * GIB;
    region.set_capacity(capacity);
    let tenants: Vec<usize> = (0..4)
        .map(|t| {
            region
                .set_tenant(&spec(&format!("t{t}"), 8 * GIB, 24 * GIB))
                .unwrap()
        })
        .collect();
    let pids: Vec<u32> = (1..=8).collect();
    let live = Fake::with(&pids);
    let granted_total = Counter::new(0);
    let per_tenant: Vec<Counter> = (0..4).map(|_| Counter::new(0)).collect();
    let peak_total = Counter::new(0);
    let peak_tenant = Counter::new(0);
    std::thread::scope(|scope| {
        for (i, &pid) in pids.iter().enumerate() {
            let (region, live) = (&*region, &live);
            let (granted_total, per_tenant) = (&granted_total, &per_tenant);
            let (peak_total, peak_tenant) = (&peak_total, &peak_tenant);
            let tenant = tenants[i % tenants.len()];
            scope.spawn(move || {
                let board = Board::new(region, live);
                let slot = board.claim_slot(pid, 1, tenant).unwrap();
                // A small deterministic generator per thread.
                let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ u64::from(pid);
                let mut held: Vec<u64> = Vec::new();
                for _ in 0..3000 {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    if held.len() < 8 && !state.is_multiple_of(3) {
                        let bytes = (state >> 8) % (6 * GIB) + 1;
                        if board.reserve(slot, bytes).is_ok() {
                            let total = granted_total.fetch_add(bytes, SeqCst) + bytes;
                            let mine = per_tenant[tenant].fetch_add(bytes, SeqCst) + bytes;
                            peak_total.fetch_max(total, SeqCst);
                            peak_tenant.fetch_max(mine, SeqCst);
                            held.push(bytes);
                        }
                    } else if let Some(bytes) = held.pop() {
                        per_tenant[tenant].fetch_sub(bytes, SeqCst);
                        granted_total.fetch_sub(bytes, SeqCst);
                        board.release(slot, bytes);
                    }
                }
                for bytes in held {
                    per_tenant[tenant].fetch_sub(bytes, SeqCst);
                    granted_total.fetch_sub(bytes, SeqCst);
                    board.release(slot, bytes);
                }
            });
        }
    });
    assert!(peak_total.load(SeqCst) <= capacity, "capacity passed");
    assert!(peak_tenant.load(SeqCst) <= 24 * GIB, "a limit passed");
    assert!(
        peak_total.load(SeqCst) > capacity / 2,
        "the test exercised a full board"
    );
    assert_eq!(region.resident_total(), 0);
}

/// What the agent reports per tenant: request, limit, resident, swapped, and the borrowed part.
#[test]
fn tenant_usage_sums_each_tenants_live_slots() {
    let region = issue_board();
    let (a, b) = (region.find("a").unwrap(), region.find("b").unwrap());
    let live = Fake::with(&[100, 101, 200]);
    let board = Board::new(&region, &live);
    let a1 = board.claim_slot(100, 1, a).unwrap();
    let a2 = board.claim_slot(101, 1, a).unwrap();
    let b1 = board.claim_slot(200, 1, b).unwrap();
    assert_eq!(board.reserve(a1, 30 * GIB), Ok(Grant::Within));
    assert_eq!(board.reserve(a2, 10 * GIB), Ok(Grant::Borrowed));
    assert_eq!(board.reserve(b1, 5 * GIB), Ok(Grant::Within));
    region.set_staging_budget(8 * GIB);
    assert!(board.reserve_staging(a2, 4 * GIB));
    board.swapped_out(a2, 4 * GIB);
    let usage = region.tenant_usage();
    assert_eq!(
        usage,
        [
            TenantUsage {
                name: "a".to_owned(),
                request_bytes: 30 * GIB,
                limit_bytes: 70 * GIB,
                resident_bytes: 36 * GIB,
                swapped_bytes: 4 * GIB,
                staging_bytes: 4 * GIB,
                reclaims: 0,
                reclaimed_bytes: 0,
                last_reclaim_unix_ms: 0,
                waiting_processes: 0,
                waiting_since_ns: 0,
            },
            TenantUsage {
                name: "b".to_owned(),
                request_bytes: 30 * GIB,
                limit_bytes: 70 * GIB,
                resident_bytes: 5 * GIB,
                swapped_bytes: 0,
                staging_bytes: 0,
                reclaims: 0,
                reclaimed_bytes: 0,
                last_reclaim_unix_ms: 0,
                waiting_processes: 0,
                waiting_since_ns: 0,
            }
        ]
    );
    assert_eq!(usage[0].borrowed_bytes(), 6 * GIB);
    assert_eq!(usage[1].borrowed_bytes(), 0);
}

#[test]
fn a_charge_corrects_a_granted_size_and_a_release_undoes_it() {
    let region = issue_board();
    let a = region.find("a").unwrap();
    assert_eq!(region.request_and_limit(a), (30 * GIB, 70 * GIB));
    let live = Fake::with(&[100]);
    let board = Board::new(&region, &live);
    let slot = board.claim_slot(100, 1, a).unwrap();
    assert_eq!(board.reserve(slot, GIB), Ok(Grant::Within));
    // The driver took a little more (a pitch): charged without a check.
    board.charge(slot, 4096);
    assert_eq!(region.resident_total(), GIB + 4096);
    board.release(slot, GIB + 4096);
    assert_eq!(region.resident_total(), 0);
    assert_eq!(region.free(), 80 * GIB);
}

#[test]
fn a_pending_charge_keeps_the_room_a_reclaim_makes_for_the_needy() {
    let region = issue_board();
    let (a, b) = (region.find("a").unwrap(), region.find("b").unwrap());
    let live = Fake::with(&[100, 200]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(100, 1, a).unwrap();
    let sb = board.claim_slot(200, 1, b).unwrap();
    assert_eq!(board.reserve(sa, 60 * GIB), Ok(Grant::Borrowed));
    assert_eq!(
        board.reserve(sb, 30 * GIB),
        Err(Refusal::NeedsReclaim {
            shortfall: 10 * GIB
        })
    );
    // "b" charges its request before "a" gives anything back: over the capacity until then.
    board.charge(sb, 30 * GIB);
    assert!(!region.fits());
    board.swapped_out(sa, 10 * GIB);
    assert!(region.fits());
    // "a" may not take the room back while "b" holds it.
    assert!(!board.swap_in(sa, 10 * GIB));
    board.release(sb, 30 * GIB);
    assert!(board.swap_in(sa, 10 * GIB));
}

/// A claim holds the room a needy tenant asked for: others' swap-ins and borrows see it taken
/// until it lapses, it shrinks as the claimer allocates, and it never holds back the claimer.
#[test]
fn a_claimer_that_frees_is_done_growing_unless_its_tenant_still_waits() {
    let region = issue_board();
    let (a, b) = (region.find("a").unwrap(), region.find("b").unwrap());
    let live = Fake::with(&[10, 20, 21]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(10, 1, a).unwrap();
    let sb = board.claim_slot(20, 1, b).unwrap();
    assert_eq!(board.reserve(sa, 60 * GIB), Ok(Grant::Borrowed));
    let now = 1_000_000_000;
    // "b" took its 30 back and frees 10 of them: its claim ends, the room is "a"'s again.
    board.claim(b, 30 * GIB, now);
    board.swapped_out(sa, 30 * GIB);
    assert_eq!(board.reserve(sb, 30 * GIB), Ok(Grant::Within));
    board.release_freed(sb, 10 * GIB);
    assert_eq!(region.claimed_by_others(a, now), 0);
    assert!(region.room_beside_claims(a, 10 * GIB, now));
    // Another process of "b" still waits in line for room: the claim stays.
    let sb2 = board.claim_slot(21, 1, b).unwrap();
    board.claim(b, 30 * GIB, now);
    board.wait(sb2, 10 * GIB, false, now);
    board.release_freed(sb, 10 * GIB);
    assert_eq!(region.claimed_by_others(a, now), 20 * GIB);
    board.stop_waiting(sb2);
    board.release_freed(sb, 10 * GIB);
    assert_eq!(region.claimed_by_others(a, now), 0);
}

#[test]
fn a_claim_is_its_claimers_to_end_not_another_rank_of_its_tenant() {
    let region = issue_board();
    let (a, b) = (region.find("a").unwrap(), region.find("b").unwrap());
    let live = Fake::with(&[10, 20, 21]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(10, 1, a).unwrap();
    let sb = board.claim_slot(20, 1, b).unwrap();
    let sb2 = board.claim_slot(21, 1, b).unwrap();
    assert_eq!(board.reserve(sa, 60 * GIB), Ok(Grant::Borrowed));
    assert_eq!(board.reserve(sb2, 4 * GIB), Ok(Grant::Within));
    let now = 1_000_000_000;
    // "b"'s first rank reclaims (its claim); its second rank, which never waited, frees: the
    // claim stays (before: any free by a process of "b" not in line ended it).
    board.claim_from(sb, b, 26 * GIB, now);
    board.release_freed(sb2, GIB);
    assert_eq!(region.claimed_by_others(a, now), 26 * GIB);
    // The claimer's own free ends it.
    board.release_freed(sb, 0);
    assert_eq!(region.claimed_by_others(a, now), 0);
    // A claimer that died (its slot reclaimed) does not keep the claim alive for the others.
    board.claim_from(sb, b, 26 * GIB, now);
    live.kill(20);
    assert_eq!(board.reclaim_dead(21), 1);
    board.release_freed(sb2, GIB);
    assert_eq!(region.claimed_by_others(a, now), 0);
}

#[test]
fn a_claim_holds_the_room_for_the_claimers_request_until_it_lapses() {
    let region = issue_board();
    let (a, b) = (region.find("a").unwrap(), region.find("b").unwrap());
    let live = Fake::with(&[10, 20]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(10, 1, a).unwrap();
    let sb = board.claim_slot(20, 1, b).unwrap();
    // "a" borrowed 30 GiB; "b" holds 2 GiB and asks for the 28 of its request left.
    assert_eq!(board.reserve(sa, 60 * GIB), Ok(Grant::Borrowed));
    assert_eq!(board.reserve(sb, 2 * GIB), Ok(Grant::Within));
    let now = 1_000_000_000;
    board.claim(b, 28 * GIB, now);
    assert_eq!(region.claimed_by_others(a, now), 28 * GIB);
    assert_eq!(region.claimed_by_others(b, now), 0, "not against itself");
    // "a" gives 10 GiB back: free, but held for "b".
    board.swapped_out(sa, 10 * GIB);
    assert_eq!(region.free(), 28 * GIB);
    assert!(!region.room_beside_claims(a, GIB, now));
    assert!(region.room_beside_claims(b, 28 * GIB, now));
    // "b" takes 8 of it: the claim shrinks to the 20 it may still take.
    assert_eq!(board.reserve(sb, 8 * GIB), Ok(Grant::Within));
    assert_eq!(region.claimed_by_others(a, now), 20 * GIB);
    // A refresh while it lives carries it on; past its end it has lapsed for good.
    let later = now + CLAIM_LAPSE_NS - 1;
    board.refresh_claim(b, later);
    assert_eq!(region.claimed_by_others(a, later + 1), 20 * GIB);
    let lapsed = later + CLAIM_LAPSE_NS;
    assert_eq!(region.claimed_by_others(a, lapsed), 0);
    board.refresh_claim(b, lapsed);
    assert_eq!(
        region.claimed_by_others(a, lapsed),
        0,
        "a lapsed claim stays lapsed"
    );
    assert!(region.room_beside_claims(a, 10 * GIB, lapsed));
    assert!(board.swap_in(sa, 10 * GIB));
    // A dropped claim holds nothing; nor does a tenant that left.
    board.claim(b, 28 * GIB, lapsed);
    board.drop_claim(b);
    assert_eq!(region.claimed_by_others(a, lapsed), 0);
    board.claim(b, 28 * GIB, lapsed);
    assert!(region.remove_tenant("b"));
    assert_eq!(region.claimed_by_others(a, lapsed), 0);
}

/// Swap staging: a zero budget (a board the agent has not written, or `swap_host_memory = 0`)
/// swaps nothing; within the budget staging is granted and given back; a refusal is counted for
/// the tenant waiting on it; a dead process's staging returns to the budget.
#[test]
fn staging_is_granted_within_the_budget_and_a_dead_slot_returns_it() {
    let region = issue_board();
    let (a, b) = (region.find("a").unwrap(), region.find("b").unwrap());
    let live = Fake::with(&[100, 200]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(100, 1, a).unwrap();
    let sb = board.claim_slot(200, 1, b).unwrap();
    assert!(!board.reserve_staging(sa, 1), "no budget written: no swap");
    region.set_staging_budget(10 * GIB);
    assert!(board.reserve_staging(sa, 6 * GIB));
    assert!(!board.reserve_staging(sb, 6 * GIB), "6 + 6 is past 10");
    assert_eq!(region.slots[sb].staging_bytes.load(SeqCst), 0, "taken back");
    assert!(board.reserve_staging(sb, 4 * GIB));
    assert_eq!(region.staging_total(), 10 * GIB);
    let before = region.swap_refusals();
    board.swap_refused();
    assert_eq!(region.swap_refusals(), before.wrapping_add(1));
    // "a" brought its chunk back: its staging is free again.
    board.release_staging(sa, 6 * GIB);
    assert!(board.reserve_staging(sb, 6 * GIB));
    // "b" dies holding 10 GiB of staging: the next reservation reclaims its slot and gets it.
    live.kill(200);
    assert!(board.reserve_staging(sa, 10 * GIB));
    assert_eq!(region.slots[sb].pid.load(SeqCst), 0);
    assert_eq!(region.staging_total(), 10 * GIB);
}

/// Many processes reserving and giving back staging at once never hold more than the budget
/// (each thread adds what it was granted to a shared total after the grant and takes it off
/// before it gives it back, so the total is at least what the board held granted at any time).
#[test]
fn racing_staging_reservations_never_pass_the_budget() {
    use std::sync::atomic::AtomicU64 as Counter;
    let region = issue_board();
    let budget = 16 * GIB;
    region.set_staging_budget(budget);
    let tenants = [region.find("a").unwrap(), region.find("b").unwrap()];
    let pids: Vec<u32> = (1..=8).collect();
    let live = Fake::with(&pids);
    let granted_total = Counter::new(0);
    let peak = Counter::new(0);
    let refusals = Counter::new(0);
    std::thread::scope(|scope| {
        for (i, &pid) in pids.iter().enumerate() {
            let (region, live) = (&*region, &live);
            let (granted_total, peak, refusals) = (&granted_total, &peak, &refusals);
            let tenant = tenants[i % tenants.len()];
            scope.spawn(move || {
                let board = Board::new(region, live);
                let slot = board.claim_slot(pid, 1, tenant).unwrap();
                let mut state = 0x2545_F491_4F6C_DD1Du64 ^ u64::from(pid);
                let mut held: Vec<u64> = Vec::new();
                for _ in 0..3000 {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    if held.len() < 6 && !state.is_multiple_of(3) {
                        let bytes = (state >> 8) % (4 * GIB) + 1;
                        if board.reserve_staging(slot, bytes) {
                            let total = granted_total.fetch_add(bytes, SeqCst) + bytes;
                            peak.fetch_max(total, SeqCst);
                            held.push(bytes);
                        } else {
                            refusals.fetch_add(1, SeqCst);
                        }
                    } else if let Some(bytes) = held.pop() {
                        granted_total.fetch_sub(bytes, SeqCst);
                        board.release_staging(slot, bytes);
                    }
                }
                for bytes in held {
                    granted_total.fetch_sub(bytes, SeqCst);
                    board.release_staging(slot, bytes);
                }
            });
        }
    });
    assert!(peak.load(SeqCst) <= budget, "the staging budget was passed");
    assert!(
        peak.load(SeqCst) > budget / 2,
        "the test exercised a full budget"
    );
    assert!(refusals.load(SeqCst) > 0, "the test saw the budget refuse");
    assert_eq!(region.staging_total(), 0);
}

/// The reclaim history: each round a tenant's process gave memory back counts, with its bytes
/// and the time of the last; a new tenant in a freed entry starts without it.
#[test]
fn the_reclaim_history_is_the_tenants_and_starts_empty_for_a_new_one() {
    let region = issue_board();
    let a = region.find("a").unwrap();
    let live = Fake::with(&[]);
    let board = Board::new(&region, &live);
    board.record_reclaim(a, 6 * GIB, 1_000);
    board.record_reclaim(a, 2 * GIB, 3_000);
    let usage = |name: &str| {
        region
            .tenant_usage()
            .into_iter()
            .find(|u| u.name == name)
            .unwrap()
    };
    let of_a = usage("a");
    assert_eq!(
        (
            of_a.reclaims,
            of_a.reclaimed_bytes,
            of_a.last_reclaim_unix_ms
        ),
        (2, 8 * GIB, 3_000)
    );
    assert_eq!(usage("b").reclaims, 0);
    assert!(region.remove_tenant("a"));
    let c = region.set_tenant(&spec("c", GIB, GIB)).unwrap();
    assert_eq!(c, a, "the freed entry");
    let of_c = usage("c");
    assert_eq!(
        (
            of_c.reclaims,
            of_c.reclaimed_bytes,
            of_c.last_reclaim_unix_ms
        ),
        (0, 0, 0)
    );
}

/// A want withdrawn by a needy tenant that stopped waiting: what no borrower took goes, what
/// another needy tenant asked for stays.
#[test]
fn a_withdrawn_want_leaves_only_what_others_asked() {
    let region = issue_board();
    let a = region.find("a").unwrap();
    let live = Fake::with(&[]);
    let board = Board::new(&region, &live);
    board.post_want(a, 4 * GIB);
    board.post_want(a, 2 * GIB);
    board.withdraw_want(a, 4 * GIB);
    assert_eq!(board.take_want(a), 2 * GIB);
    // Taken already: a withdrawal finds nothing to take back.
    board.withdraw_want(a, 2 * GIB);
    assert_eq!(board.take_want(a), 0);
}

/// The line: room goes to the waiters in order, a newcomer (not in line) stands behind every
/// waiter, a waiter keeps its place when it waits again, and a dead waiter leaves the line.
#[test]
fn room_goes_to_the_line_in_order_and_a_dead_waiter_leaves_it() {
    let region = Region::new_boxed();
    region.initialise();
    region.set_capacity(16 * GIB);
    for name in ["a", "b", "c"] {
        region.set_tenant(&spec(name, 2 * GIB, 8 * GIB)).unwrap();
    }
    let index = |name| region.find(name).unwrap();
    let live = Fake::with(&[10, 20, 30]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(10, 1, index("a")).unwrap();
    let sb = board.claim_slot(20, 1, index("b")).unwrap();
    let sc = board.claim_slot(30, 1, index("c")).unwrap();
    // "a" and "b" hold 7 each; 2 free.
    assert_eq!(board.reserve(sa, 7 * GIB), Ok(Grant::Borrowed));
    assert_eq!(board.reserve(sb, 7 * GIB), Ok(Grant::Borrowed));
    // "b" waits for 1 first, then "a" for 3.
    board.wait(sb, GIB, true, 100);
    board.wait(sa, 3 * GIB, false, 200);
    assert_eq!(region.ahead_in_line(sb, 0), 0);
    assert_eq!(region.ahead_in_line(sa, 0), GIB);
    assert_eq!(
        region.ahead_in_line(sc, 0),
        4 * GIB,
        "a newcomer is behind everyone"
    );
    assert!(region.room_in_line(sb, GIB, 0));
    assert!(
        !region.room_in_line(sa, 2 * GIB, 0),
        "1 of the 2 free is b's"
    );
    assert!(region.room_in_line(sa, GIB, 0));
    assert!(!region.room_in_line(sc, GIB, 0));
    assert_eq!(region.free_in_line(sc, 0), 0);
    // The agent's report: one process of each waits, "b" since 100.
    let usage = region.tenant_usage();
    let waits: Vec<(u32, u64)> = usage
        .iter()
        .map(|t| (t.waiting_processes, t.waiting_since_ns))
        .collect();
    assert_eq!(waits, [(1, 200), (1, 100), (0, 0)]);
    // Waiting again (more bytes) keeps the place.
    board.wait(sb, 2 * GIB, true, 300);
    let waiters = region.waiters();
    let first = waiters
        .iter()
        .min_by(|x, y| reclaim::line_order(x, y))
        .unwrap();
    assert_eq!(
        (first.slot, first.since_ns, first.bytes),
        (sb, 100, 2 * GIB)
    );
    // The first is unstalled by the other waiter's borrowed memory, not by the runner "c".
    assert!(
        reclaim::unstall(
            &region.holders(),
            &waiters,
            first,
            region.free_in_line(sb, 0)
        )
        .is_empty(),
        "2 free cover b's 2: nothing to ask"
    );
    board.wait(sb, 4 * GIB, true, 300);
    let (served, waiters) = region.served(0);
    let served = served.expect("a's borrowed 5 can serve b's 4");
    assert_eq!(served.slot, sb);
    assert_eq!(
        reclaim::unstall(
            &region.holders(),
            &waiters,
            &served,
            region.free_in_line(sb, 0)
        ),
        vec![("a".to_owned(), 2 * GIB)]
    );
    // "c" holds nothing: every holder ("a", "b") waits. Not when "c" holds memory and runs.
    assert!(region.every_holder_waits());
    assert_eq!(board.reserve(sc, 1), Ok(Grant::Within));
    assert!(!region.every_holder_waits());
    board.release(sc, 1);
    // "b" is served and leaves the line; "a" dies while waiting: the line is empty.
    board.stop_waiting(sb);
    assert_eq!(
        region.ahead_in_line(sc, 0),
        0,
        "a waits for 3 with 2 free while b runs: passed over, it holds no room (rule 7)"
    );
    assert_eq!(region.served(0).0, None);
    board.release(sb, 2 * GIB);
    assert_eq!(
        region.ahead_in_line(sc, 0),
        3 * GIB,
        "4 free: a is served again"
    );
    assert_eq!(region.served(0).0.map(|w| w.slot), Some(sa));
    live.kill(10);
    assert_eq!(board.reclaim_dead(30), 1);
    assert!(region.waiters().is_empty());
    assert_eq!(region.ahead_in_line(sc, 0), 0);
    // A slot claimed afresh is not in line.
    let again = board.claim_slot(40, 1, index("a")).unwrap();
    assert_eq!(region.slots[again].wait_since_ns.load(SeqCst), 0);
}

/// A claim holds room for a process waiting to allocate: once the claimer's processes are gone
/// (it was killed while waiting), nobody will, and the room is free at once, not at the lapse.
#[test]
fn a_claim_of_a_tenant_without_processes_holds_nothing() {
    let region = issue_board();
    let (a, b) = (region.find("a").unwrap(), region.find("b").unwrap());
    let live = Fake::with(&[10, 20]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(10, 1, a).unwrap();
    board.claim_slot(20, 1, b).unwrap();
    assert_eq!(board.reserve(sa, 60 * GIB), Ok(Grant::Borrowed));
    board.claim(b, 28 * GIB, 1);
    assert_eq!(region.claimed_by_others(a, 2), 28 * GIB);
    live.kill(20);
    assert_eq!(
        region.claimed_by_others(a, 2),
        28 * GIB,
        "dead, not yet reclaimed"
    );
    assert_eq!(board.reclaim_dead(10), 1);
    assert_eq!(region.claimed_by_others(a, 2), 0);
}

#[test]
fn booked_or_lent_counts_each_tenants_request_or_what_it_holds_past_it() {
    let region = Region::new_boxed();
    region.initialise();
    region.set_capacity(40 * GIB);
    let a = region.set_tenant(&spec("a", 2 * GIB, 20 * GIB)).unwrap();
    let b = region.set_tenant(&spec("b", 30 * GIB, 30 * GIB)).unwrap();
    let live = Fake::with(&[10, 20]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(10, 1, a).unwrap();
    // Nothing held: the requests book 32.
    assert_eq!(region.booked_or_lent_with(a, 0), 32 * GIB);
    // "a" within its request: still 32; 6 more for it: 8 + 30.
    assert_eq!(board.reserve(sa, 2 * GIB), Ok(Grant::Within));
    assert_eq!(region.booked_or_lent_with(a, 0), 32 * GIB);
    assert_eq!(region.booked_or_lent_with(a, 6 * GIB), 38 * GIB);
    // "b" holding less than its request changes nothing; the extra is "a"'s only.
    let sb = board.claim_slot(20, 1, b).unwrap();
    assert_eq!(board.reserve(sb, 10 * GIB), Ok(Grant::Within));
    assert_eq!(region.booked_or_lent_with(a, 6 * GIB), 38 * GIB);
    assert_eq!(region.booked_or_lent_with(b, 6 * GIB), 32 * GIB);
}

/// The H200 run where the line looked stuck while it moved: "a" (first in line) has 10 GiB out
/// in staging, the budget has 1 GiB left, and "b", also waiting, borrowed 20 GiB. The givers'
/// pieces need staging, and "a"'s frees as its chunks come back piece by piece: the line can move,
/// and "b"'s borrow is not refused. With "a"'s staging not counted it was. With nothing left at
/// all no first piece can go, and the line is stuck.
#[test]
fn a_first_waiters_own_staging_is_room_for_the_exchange_not_a_stuck_line() {
    let region = Region::new_boxed();
    region.initialise();
    region.set_capacity(60 * GIB);
    region.set_staging_budget(11 * GIB);
    let a = region.set_tenant(&spec("a", 10 * GIB, 60 * GIB)).unwrap();
    let b = region.set_tenant(&spec("b", 10 * GIB, 60 * GIB)).unwrap();
    let c = region.set_tenant(&spec("c", 20 * GIB, 20 * GIB)).unwrap();
    let live = Fake::with(&[1, 2, 3]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(1, 1, a).unwrap();
    let sb = board.claim_slot(2, 1, b).unwrap();
    let sc = board.claim_slot(3, 1, c).unwrap();
    // "a" held 30 (20 borrowed) and gave 10 to "c"'s request; "b" holds 30 (20 borrowed).
    assert_eq!(board.reserve(sa, 30 * GIB), Ok(Grant::Borrowed));
    assert!(board.reserve_staging(sa, 10 * GIB));
    board.swapped_out(sa, 10 * GIB);
    assert_eq!(board.reserve(sb, 30 * GIB), Ok(Grant::Borrowed));
    assert_eq!(board.reserve(sc, 10 * GIB), Ok(Grant::Within));
    // "a" waits for its 10 GiB, "b" for a 20 GiB borrow; "c" idles within its request but holds
    // memory, so: every holder of memory must wait for the line to be stuck. "c" waits too.
    board.wait(sa, 10 * GIB, false, 1);
    board.wait(sb, 20 * GIB, true, 2);
    board.wait(sc, 10 * GIB, false, 3);
    assert_eq!(region.staging_total() + GIB, region.staging_budget());
    assert_eq!(
        region.stuck(10, false),
        None,
        "b can give a its 10 GiB through a's own staging"
    );
    region.set_staging_budget(10 * GIB);
    assert_eq!(
        region.stuck(10, false),
        Some(sb),
        "no room for a first piece"
    );
}

/// The H200 jobs run where a borrow was refused while the line moved: the first in line ("a")
/// waits for 10 GiB of its own, and holds 20 GiB more staging pinned ahead for its resident
/// borrowed chunks; the budget has nothing left. That idle staging is freed for a giver's
/// swap-out like anyone's, so "b" can give "a" its room: not stuck. Without it, stuck.
#[test]
fn a_first_waiters_idle_staging_is_room_for_the_givers_too() {
    let region = Region::new_boxed();
    region.initialise();
    region.set_capacity(60 * GIB);
    region.set_staging_budget(30 * GIB);
    let a = region.set_tenant(&spec("a", 10 * GIB, 60 * GIB)).unwrap();
    let b = region.set_tenant(&spec("b", 10 * GIB, 60 * GIB)).unwrap();
    let c = region.set_tenant(&spec("c", 20 * GIB, 20 * GIB)).unwrap();
    let live = Fake::with(&[1, 2, 3]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(1, 1, a).unwrap();
    let sb = board.claim_slot(2, 1, b).unwrap();
    let sc = board.claim_slot(3, 1, c).unwrap();
    assert_eq!(board.reserve(sa, 30 * GIB), Ok(Grant::Borrowed));
    assert!(board.reserve_staging(sa, 30 * GIB));
    board.swapped_out(sa, 10 * GIB);
    assert_eq!(board.reserve(sb, 30 * GIB), Ok(Grant::Borrowed));
    assert_eq!(board.reserve(sc, 10 * GIB), Ok(Grant::Within));
    board.wait(sa, 10 * GIB, false, 1);
    board.wait(sb, 20 * GIB, true, 2);
    board.wait(sc, 10 * GIB, false, 3);
    assert_eq!(region.staging_total(), region.staging_budget());
    assert_eq!(
        region.stuck(10, false),
        None,
        "a's 20 GiB of idle staging takes b's pieces"
    );
    // Once a has freed it (nothing idle left) and the budget is spent, no first piece can go.
    board.release_staging(sa, 20 * GIB);
    region.set_staging_budget(10 * GIB);
    assert_eq!(
        region.stuck(10, false),
        Some(sb),
        "no room for a first piece"
    );
}

#[test]
fn the_movement_fingerprint_sees_an_exchange_whose_sides_balance() {
    let region = Region::new_boxed();
    region.initialise();
    region.set_capacity(60 * GIB);
    region.set_staging_budget(30 * GIB);
    let a = region.set_tenant(&spec("a", 10 * GIB, 60 * GIB)).unwrap();
    let b = region.set_tenant(&spec("b", 10 * GIB, 60 * GIB)).unwrap();
    let live = Fake::with(&[1, 2]);
    let board = Board::new(&region, &live);
    let sa = board.claim_slot(1, 1, a).unwrap();
    let sb = board.claim_slot(2, 1, b).unwrap();
    assert_eq!(board.reserve(sa, 20 * GIB), Ok(Grant::Borrowed));
    assert!(board.reserve_staging(sa, 4 * GIB));
    board.swapped_out(sa, 4 * GIB);
    let before = region.movement();
    assert_eq!(region.movement(), before, "nothing moved");
    // "b" takes 1 GiB as "a" gives 1 GiB more: the totals balance, the fingerprint changes.
    assert!(board.reserve_staging(sa, GIB));
    board.swapped_out(sa, GIB);
    assert_eq!(board.reserve(sb, GIB), Ok(Grant::Within));
    assert_ne!(region.movement(), before);
    // Staging pinned ahead moves no memory.
    let after = region.movement();
    assert!(board.reserve_staging(sb, GIB));
    assert_eq!(region.movement(), after);
}
