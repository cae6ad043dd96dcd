//! Elastic memory (issue 17, `docs/design/elastic-memory.md`): which borrowers give memory back
//! when a tenant needs memory within its request that the GPU no longer has free. Pure: the
//! tenants' figures in, the reclaim asks out. The interposer asks borrowers by this rule (wants
//! on the per-GPU memory board) when its swap is on (`VGPU_MEMORY_SWAP=1`, tests only until
//! launches hold while memory is out).
//!
//! The rule, in order:
//! 1. Only memory *above a tenant's request* is ever taken (its borrowed part); a tenant is never
//!    asked to go below its request, and the tenant that needs the memory is never asked.
//! 2. Lower priority gives first; at equal priority, preemptible before guaranteed; then the
//!    tenant that borrowed the most; then the name, so that every process plans the same.
//! 3. Each borrower is asked for at most what it borrowed, and in all just the shortfall.
//! 4. What is short is the rest of the needy tenant's request, not one allocation's piece
//!    ([`owed`], then [`plan`] for it): a tenant that allocates within its request against borrowed memory
//!    is growing into it, and its request is guaranteed. Asking one piece at a time made every
//!    piece a whole reclaim round at the borrower (its next launch, a drain, pinned staging, the
//!    copy): on an H200, PyTorch taking its 27 GiB request back in pieces paid six rounds, 4.07 s
//!    for 6 GiB that the copy engines move in 0.14 s. The room the borrowers make is held for
//!    the tenant (`board::Board::claim`) until a while after it last allocated within its
//!    request, and is free to borrow again after that.
//!
//! A need that the request does not cover (the tenant asks past its request) is no reclaim: it
//! borrows only what is free, like everyone else, and a borrow that finds no room (retried)
//! waits in the GPU's line (`board`, "The line"):
//! 5. The line is served in [`line_order`]: higher priority first, then the longest waiting.
//!    The first in line whose bytes do not fit may ask the tenants of the *other waiters* for
//!    what they borrowed ([`unstall`], in rule 2's order, at most the shortfall). They wait
//!    anyway, so giving it costs them nothing they would do meanwhile; without it two borrowers
//!    each waiting for the other's memory would wait for ever. A tenant that runs is never asked
//!    for a waiter: its memory comes when it frees it (a later turn, or its end).
//! 6. A line that cannot move ([`stuck`]: every process holding memory waits, and the waiter it
//!    serves can neither fit nor be unstalled, or it serves none) refuses its last borrow, never
//!    a wait for swapped-out memory.
//! 7. The line serves ([`line_serves`], [`served`]) its first waiter that it *can* serve: one
//!    whose bytes fit in what is free for it (the line aside) plus what the other waiters'
//!    tenants borrowed. A waiter that cannot be served even so (what it waits for is held within
//!    requests, or by tenants that run) is passed over by the *borrows* behind it (not by waits
//!    for swapped-out memory: see [`line_serves`]): it holds no room ahead of them
//!    (`board::Region::ahead_in_line`) and may itself be asked to unstall the one served (it
//!    waits anyway). Without the pass, such a first waiter made the line stuck and rule 6
//!    refused a borrow that swapping the first's borrowed memory out would have served (the line
//!    simulation, `line_sim_test`, found it). It is served again as soon as it can be: when
//!    memory frees, or when the waiters around it borrowed enough to give. A process that gave
//!    memory while it waited goes to the back of the line (`board::Board::requeue`).
//! 8. A borrower asked for memory that gives nothing back within the needy tenant's patience
//!    (`RECLAIM_ESCALATE_MS` in the interposer: a kernel of its runs longer, or it is stopped) is
//!    passed over, and the other borrowers are asked for what is still missing and asked of
//!    nobody ([`asks_past`]), also when every borrower gave something (two needy tenants asking
//!    at once may both have asked one borrower for the same memory): a guaranteed request then
//!    depends on no single borrower.

/// One tenant of the GPU, as the planner sees it (bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub name: String,
    pub request: u64,
    /// Resident on the GPU now (allocated and not swapped out).
    pub resident: u64,
    pub priority: i32,
    pub guaranteed: bool,
}

impl Holder {
    /// What it holds above its request: what may be taken back.
    pub fn borrowed(&self) -> u64 {
        self.resident.saturating_sub(self.request)
    }
}

/// One process in the GPU's line (`board::Board::wait`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter {
    pub tenant: String,
    /// Its slot on the board: the last tie-break, so that every process sees one order.
    pub slot: usize,
    /// In line since (CLOCK_MONOTONIC ns, not 0).
    pub since_ns: u64,
    /// Bytes it waits to have resident.
    pub bytes: u64,
    /// Its tenant's priority.
    pub priority: i32,
    /// It waits for a borrow (which a stuck line may refuse), not for its swapped-out memory.
    pub borrow: bool,
}

/// The order of the line (rule 5): higher priority first, then the longest waiting, then the
/// slot.
pub fn line_order(a: &Waiter, b: &Waiter) -> std::cmp::Ordering {
    b.priority
        .cmp(&a.priority)
        .then(a.since_ns.cmp(&b.since_ns))
        .then(a.slot.cmp(&b.slot))
}

/// The waiters the line serves (rule 7), in [`line_order`]: each one whose bytes fit in
/// `room_of(waiter)` (what is free for it, the line aside: the capacity less what every slot
/// holds and other tenants' claims) plus what the other waiters' tenants borrowed ([`servable`]),
/// except a wait for swapped-out memory behind a waiter passed over. Only a borrow is served past
/// a waiter the line cannot serve: a borrow granted is progress (a job has one more piece), while
/// bringing memory back for a process that then waits again could take turns for ever with the
/// one passed over (two jobs whose peaks cannot be resident together swapped each other out and
/// in: the line simulation found it). The first of them is the waiter [`unstall`] works for.
pub fn line_serves<'w>(
    holders: &[Holder],
    waiters: &'w [Waiter],
    room_of: impl Fn(&Waiter) -> u64,
) -> Vec<&'w Waiter> {
    let mut order: Vec<&Waiter> = waiters.iter().collect();
    order.sort_by(|a, b| line_order(a, b));
    let mut passed_over = false;
    order
        .into_iter()
        .filter(|w| {
            if !servable(holders, waiters, w, room_of(w)) {
                passed_over = true;
                return false;
            }
            w.borrow || !passed_over
        })
        .collect()
}

/// The waiter the line serves first (rule 7, [`line_serves`]); `None` when the line is empty
/// or it can serve nobody.
pub fn served<'w>(
    holders: &[Holder],
    waiters: &'w [Waiter],
    room_of: impl Fn(&Waiter) -> u64,
) -> Option<&'w Waiter> {
    line_serves(holders, waiters, room_of).first().copied()
}

/// Whether the line can serve `waiter` (rule 7): its bytes fit in `room` plus what the other
/// waiters' tenants borrowed.
pub fn servable(holders: &[Holder], waiters: &[Waiter], waiter: &Waiter, room: u64) -> bool {
    let others = stalled_by(waiters, waiter);
    let lendable = holders
        .iter()
        .filter(|h| others.contains(h.name.as_str()))
        .fold(0u64, |sum, h| sum.saturating_add(h.borrowed()));
    waiter.bytes <= room.saturating_add(lendable)
}

/// The tenants of the waiters other than `first`'s tenant: those it may ask (rule 5).
fn stalled_by<'w>(waiters: &'w [Waiter], first: &Waiter) -> std::collections::BTreeSet<&'w str> {
    waiters
        .iter()
        .filter(|w| w.tenant != first.tenant)
        .map(|w| w.tenant.as_str())
        .collect()
}

/// What `first` (the waiter the line serves, [`served`]) should ask the other waiters' tenants
/// for (rule 5) when its bytes do not fit in `room` (what is free for it now): `(tenant, bytes)`
/// pairs in rule 2's order, each at most what that tenant borrowed, in all at most the
/// shortfall. Empty when it fits, or no other waiter's tenant borrowed anything; never its own
/// tenant, never a tenant with no process in line.
pub fn unstall(
    holders: &[Holder],
    waiters: &[Waiter],
    first: &Waiter,
    room: u64,
) -> Vec<(String, u64)> {
    let stalled = stalled_by(waiters, first);
    let shortfall = first.bytes.saturating_sub(room);
    asks_in_giving_order(
        holders.iter().filter(|h| stalled.contains(h.name.as_str())),
        shortfall,
    )
}

/// Rules 2 and 3: `givers` that borrowed something, in rule 2's order, each asked for at most what
/// it borrowed and in all for at most `shortfall`.
fn asks_in_giving_order<'h>(
    givers: impl Iterator<Item = &'h Holder>,
    mut shortfall: u64,
) -> Vec<(String, u64)> {
    let mut order: Vec<&Holder> = givers.filter(|h| h.borrowed() > 0).collect();
    order.sort_by(|a, b| giving_order(a, b));
    let mut asks = Vec::new();
    for holder in order {
        if shortfall == 0 {
            break;
        }
        let take = holder.borrowed().min(shortfall);
        shortfall -= take;
        asks.push((holder.name.clone(), take));
    }
    asks
}

/// Rule 6, a stuck line: the slot whose borrow is refused, if the line cannot move. It cannot
/// when every process holding memory on the GPU is in line (`every_holder_waits`: nobody runs to
/// free anything) and either it serves nobody (`served` is `None`, [`served`]) or the waiter it
/// serves does not fit in `room` (what is free for it) even with all that [`unstall`] could move
/// for it, which is at most `swap_room` (what the node's swap space can still take): for example
/// when the requests fill the GPU and each tenant waits for more, or when the swap space is
/// full. Then the last borrow in line is refused (out of memory), so that its process goes on
/// without it, or ends and frees what it holds; a process waiting for its own swapped-out memory
/// is never refused (that would be a kill). `None` when the line can move, or no waiter is a
/// borrow.
pub fn stuck(
    holders: &[Holder],
    waiters: &[Waiter],
    served: Option<&Waiter>,
    room: u64,
    swap_room: u64,
    every_holder_waits: bool,
) -> Option<usize> {
    if !every_holder_waits || waiters.is_empty() {
        return None;
    }
    if let Some(first) = served {
        let movable = unstall(holders, waiters, first, room)
            .iter()
            .fold(0u64, |sum, (_, bytes)| sum.saturating_add(*bytes))
            .min(swap_room);
        if first.bytes <= room.saturating_add(movable) {
            return None;
        }
    }
    waiters
        .iter()
        .filter(|w| w.borrow)
        .max_by(|a, b| line_order(a, b))
        .map(|w| w.slot)
}

/// Rule 8, a reclaim that did not come within the needy tenant's patience: the asks for what is
/// still short of `shortfall` bytes (what every slot holds past the capacity), from the
/// borrowers other than `needy` and the `slow` ones (asked before and not given back: a kernel
/// longer than the wait, a stopped process), in rule 2's order. `untaken` is what each tenant
/// was asked and has not taken yet (the slow ones' withdrawn first): each borrower is asked
/// only for what it borrowed past that. The shortfall itself is not reduced by what others were
/// asked: a want that stays untaken (a stopped borrower another tenant asked) would then leave
/// this request short, while asking a little more than needed costs only a swap-out. Also when
/// every borrower gave something: two tenants asking in one
/// instant plan from the same borrowed memory (what borrowers hold, not what they were asked
/// for), so both may ask one borrower for all it has; it gives that, and what the second asked
/// past it was asked of nobody (the line simulation found a guaranteed request refused so). A
/// guaranteed request then depends on no single borrower and on no race between the needy.
pub fn asks_past(
    holders: &[Holder],
    needy: &str,
    shortfall: u64,
    slow: &[String],
    untaken: &[(String, u64)],
) -> Vec<(String, u64)> {
    let net: Vec<Holder> = net_of_untaken(holders, untaken, needy)
        .into_iter()
        .filter(|h| h.name != needy && !slow.contains(&h.name))
        .collect();
    asks_in_giving_order(net.iter(), shortfall)
}

/// What the holders other than `needy` hold once they gave what they were asked and have not
/// taken yet (`untaken`, per tenant): what a [`plan`] may still ask of them. Two tenants planning
/// at once from what borrowers hold could both ask one borrower for all it borrowed; planning
/// from this, the second asks the others for what the first asked of it. `needy`'s own entry is
/// kept as it is (its request and residence decide what it may ask for).
pub fn net_of_untaken(holders: &[Holder], untaken: &[(String, u64)], needy: &str) -> Vec<Holder> {
    let untaken_of = |name: &str| -> u64 {
        untaken
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, bytes)| bytes)
            .fold(0u64, |sum, bytes| sum.saturating_add(*bytes))
    };
    holders
        .iter()
        .map(|h| {
            if h.name == needy {
                return h.clone();
            }
            Holder {
                resident: h.resident.saturating_sub(untaken_of(&h.name)),
                ..h.clone()
            }
        })
        .collect()
}

/// Rule 2: who gives first.
fn giving_order(a: &Holder, b: &Holder) -> std::cmp::Ordering {
    a.priority
        .cmp(&b.priority)
        .then(a.guaranteed.cmp(&b.guaranteed))
        .then(b.borrowed().cmp(&a.borrowed()))
        .then(a.name.cmp(&b.name))
}

/// Why nothing is planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoReclaim {
    #[error("tenant `{0}` is not on this GPU")]
    UnknownTenant(String),
    #[error(
        "tenant `{tenant}` asks {asked} bytes past its request ({request} bytes, {resident} resident): \
         memory past a request is borrowed from what is free, never taken from others"
    )]
    PastRequest {
        tenant: String,
        asked: u64,
        request: u64,
        resident: u64,
    },
}

/// What `needy` must get back from borrowers so that `bytes` more fit on a GPU with `free` bytes
/// free now: `(borrower, bytes)` pairs in the order to ask them. Empty when it fits already.
/// The sum covers the shortfall whenever the borrowers hold that much (they always do when every
/// request was booked without overbooking: the shortfall is then at most what others borrowed).
pub fn plan(
    holders: &[Holder],
    needy: &str,
    bytes: u64,
    free: u64,
) -> Result<Vec<(String, u64)>, NoReclaim> {
    let Some(me) = holders.iter().find(|h| h.name == needy) else {
        return Err(NoReclaim::UnknownTenant(needy.to_owned()));
    };
    let within_request = me.request.saturating_sub(me.resident);
    if bytes > within_request {
        return Err(NoReclaim::PastRequest {
            tenant: needy.to_owned(),
            asked: bytes,
            request: me.request,
            resident: me.resident,
        });
    }
    Ok(asks_in_giving_order(
        holders.iter().filter(|h| h.name != needy),
        bytes.saturating_sub(free),
    ))
}

/// What `needy` is owed when `bytes` more do not fit (rule 4): room for them now, and for the
/// rest of its request with them. What to [`plan`] for, and what to hold for it.
pub fn owed(holders: &[Holder], needy: &str, bytes: u64) -> u64 {
    let rest = holders
        .iter()
        .find(|h| h.name == needy)
        .map_or(0, |h| h.request.saturating_sub(h.resident));
    bytes.max(rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;

    fn holder(name: &str, request: u64, resident: u64, priority: i32, guaranteed: bool) -> Holder {
        Holder {
            name: name.to_owned(),
            request,
            resident,
            priority,
            guaranteed,
        }
    }

    #[test]
    fn a_piece_within_the_request_asks_for_the_rest_of_the_request_at_once() {
        // "b" (request 30) holds 3 and allocates 1 GiB pieces with 1 free: asked for the 26 it
        // is owed beyond what is free, in one want, not 0 now and another at every piece.
        let holders = [
            holder("a", 30 * GIB, 57 * GIB, 0, false),
            holder("b", 30 * GIB, 3 * GIB, 0, true),
        ];
        assert_eq!(
            plan(&holders, "b", owed(&holders, "b", GIB), GIB),
            Ok(vec![("a".to_owned(), 26 * GIB)])
        );
        // A piece larger than the rest of the request is past it: no reclaim, as with `plan`.
        assert!(matches!(
            plan(&holders, "b", owed(&holders, "b", 28 * GIB), GIB),
            Err(NoReclaim::PastRequest { .. })
        ));
        // Nothing borrowed to give: nothing asked.
        let holders = [holder("b", 30 * GIB, 3 * GIB, 0, true)];
        assert_eq!(plan(&holders, "b", owed(&holders, "b", GIB), 0), Ok(vec![]));
    }

    #[test]
    fn a_second_plan_at_once_asks_others_for_what_the_first_asked_of_a_borrower() {
        // "a" and "c" borrowed 8 each; "b" asked "a" for 8 (not taken yet); "d" now needs 8.
        let holders = [
            holder("a", 4 * GIB, 12 * GIB, 0, false),
            holder("b", 8 * GIB, 0, 0, true),
            holder("c", 4 * GIB, 12 * GIB, 0, false),
            holder("d", 8 * GIB, 0, 0, true),
        ];
        let untaken = [("a".to_owned(), 8 * GIB)];
        // From what they hold, "d" asks "a" (first in the giving order by name) for all of it.
        assert_eq!(
            plan(&holders, "d", 8 * GIB, 0),
            Ok(vec![("a".to_owned(), 8 * GIB)])
        );
        // Net of what "a" was asked: "c".
        let net = net_of_untaken(&holders, &untaken, "d");
        assert_eq!(
            plan(&net, "d", 8 * GIB, 0),
            Ok(vec![("c".to_owned(), 8 * GIB)])
        );
        // The needy's own entry is not reduced, even if it was asked for something.
        let asked_of_d = [("d".to_owned(), 8 * GIB)];
        assert_eq!(net_of_untaken(&holders, &asked_of_d, "d"), holders.to_vec());
    }

    #[test]
    fn the_issues_case_takes_the_borrowed_memory_back() {
        // 80 GiB GPU: "a" (request 30, limit 70) grew to 60 while "b" (request 30) idled; "b"
        // now allocates its 30 with 20 free.
        let holders = [
            holder("a", 30 * GIB, 60 * GIB, 0, true),
            holder("b", 30 * GIB, 0, 0, true),
        ];
        assert_eq!(
            plan(&holders, "b", 30 * GIB, 20 * GIB),
            Ok(vec![("a".to_owned(), 10 * GIB)])
        );
        // it fits already: nothing to ask
        assert_eq!(plan(&holders, "b", 10 * GIB, 20 * GIB), Ok(vec![]));
        // past its request: no reclaim, whatever is free
        assert!(matches!(
            plan(&holders, "b", 31 * GIB, 0),
            Err(NoReclaim::PastRequest { .. })
        ));
        assert!(matches!(
            plan(&holders, "c", GIB, 0),
            Err(NoReclaim::UnknownTenant(_))
        ));
    }

    #[test]
    fn lower_priority_then_preemptible_then_the_biggest_borrower_gives_first() {
        let holders = [
            holder("needy", 40 * GIB, 0, 5, true),
            holder("high", 0, 10 * GIB, 9, false),
            holder("low-guaranteed", 0, 10 * GIB, 1, true),
            holder("low-small", 0, 2 * GIB, 1, false),
            holder("low-big", 0, 8 * GIB, 1, false),
        ];
        let asks = plan(&holders, "needy", 25 * GIB, 0).unwrap();
        assert_eq!(
            asks,
            vec![
                ("low-big".to_owned(), 8 * GIB),
                ("low-small".to_owned(), 2 * GIB),
                ("low-guaranteed".to_owned(), 10 * GIB),
                ("high".to_owned(), 5 * GIB),
            ]
        );
    }

    /// [`stuck`] with every waiter's room `room` (the waiter served from [`served`]).
    fn stuck_at(
        holders: &[Holder],
        waiters: &[Waiter],
        room: u64,
        swap_room: u64,
        every: bool,
    ) -> Option<usize> {
        let first = served(holders, waiters, |_| room);
        stuck(holders, waiters, first, room, swap_room, every)
    }

    /// [`unstall`] for the first in line order (nothing for an empty line).
    fn unstall_first(holders: &[Holder], waiters: &[Waiter], room: u64) -> Vec<(String, u64)> {
        match waiters.iter().min_by(|a, b| line_order(a, b)) {
            Some(first) => unstall(holders, waiters, first, room),
            None => Vec::new(),
        }
    }

    #[test]
    fn a_borrower_that_gives_nothing_back_is_passed_over_for_the_rest() {
        let holders = [
            holder("needy", 8 * GIB, 8 * GIB, 0, true),
            holder("stuck", 4 * GIB, 12 * GIB, 0, false),
            holder("idle", 2 * GIB, 8 * GIB, 0, false),
            holder("small", 2 * GIB, 3 * GIB, 0, false),
        ];
        // "stuck" (the most borrowed) was asked first and gave nothing: the 4 GiB still missing
        // come from the others in rule 2's order, never from the needy tenant itself.
        assert_eq!(
            asks_past(&holders, "needy", 4 * GIB, &["stuck".to_owned()], &[]),
            vec![("idle".to_owned(), 4 * GIB)]
        );
        assert_eq!(
            asks_past(&holders, "needy", 7 * GIB, &["stuck".to_owned()], &[]),
            vec![("idle".to_owned(), 6 * GIB), ("small".to_owned(), GIB)]
        );
        // Nothing else borrowed: nobody to ask.
        assert!(asks_past(&holders[..2], "needy", 4 * GIB, &["stuck".to_owned()], &[]).is_empty());
    }

    #[test]
    fn the_rest_of_a_reclaim_is_asked_past_what_borrowers_were_asked_already() {
        // Two needy tenants asked at once: both planned from "big"'s 3 and "small"'s 2. "big"
        // gave all it had, "small" gave its 1 and still borrows 1; 1 is short and nobody was
        // slow: "small" is asked for it.
        let holders = [
            holder("a", 4 * GIB, 0, 0, true),
            holder("b", 4 * GIB, 4 * GIB, 0, true),
            holder("big", GIB, GIB, 0, true),
            holder("small", GIB, 2 * GIB, 0, true),
        ];
        assert_eq!(
            asks_past(&holders, "a", GIB, &[], &[]),
            vec![("small".to_owned(), GIB)]
        );
        // Each borrower is asked only for what it borrowed past what it was asked already
        // (another needy tenant's ask of "small" leaves it nothing to give).
        assert!(asks_past(&holders, "a", GIB, &[], &[("small".to_owned(), GIB)]).is_empty());
        let more = [
            holder("a", 4 * GIB, 0, 0, true),
            holder("c", GIB, 4 * GIB, 0, true),
            holder("d", GIB, 3 * GIB, 0, true),
        ];
        assert_eq!(
            asks_past(&more, "a", 4 * GIB, &[], &[("c".to_owned(), 2 * GIB)]),
            vec![("d".to_owned(), 2 * GIB), ("c".to_owned(), GIB)],
            "c's 3 borrowed less the 2 it was asked leave 1, d's 2 go first; the whole \
             shortfall is asked (what c was asked may never come)"
        );
    }

    #[test]
    fn the_line_passes_over_a_first_waiter_it_cannot_serve() {
        // 16 GiB, requests of 6 and 6: "a" holds 6 + 3 borrowed and waits to borrow 6 more
        // (first in line: nothing could ever make room for it while "b" holds its request);
        // "b" holds its 6 and waits to borrow 2, which "a"'s borrowed 3 would serve.
        let holders = [
            holder("a", 6 * GIB, 9 * GIB, 0, false),
            holder("b", 6 * GIB, 6 * GIB, 0, false),
        ];
        let waiters = [
            waiter("a", 0, 10, 6 * GIB, 0),
            waiter("b", 1, 20, 2 * GIB, 0),
        ];
        let room = GIB;
        assert!(!servable(&holders, &waiters, &waiters[0], room));
        let first = served(&holders, &waiters, |_| room).expect("b is served");
        assert_eq!(first.tenant, "b");
        assert_eq!(
            unstall(&holders, &waiters, first, room),
            vec![("a".to_owned(), GIB)]
        );
        // Not stuck: the line moves for "b"; before the pass it refused "b"'s borrow.
        assert_eq!(
            stuck(&holders, &waiters, Some(first), room, u64::MAX, true),
            None
        );
        // Without swap room the served one cannot be unstalled: stuck, the last borrow refused.
        assert_eq!(
            stuck(&holders, &waiters, Some(first), room, 0, true),
            Some(1)
        );
        // Nobody servable (a's borrowed memory gone): stuck.
        let lean = [holder("a", 6 * GIB, 6 * GIB, 0, false), holders[1].clone()];
        assert_eq!(served(&lean, &waiters, |_| room), None);
        assert_eq!(stuck(&lean, &waiters, None, room, u64::MAX, true), Some(1));
        // A first waiter that fits is served first, whatever comes after it.
        assert_eq!(served(&holders, &waiters, |_| 6 * GIB).unwrap().tenant, "a");
    }

    fn waiter(tenant: &str, slot: usize, since_ns: u64, bytes: u64, priority: i32) -> Waiter {
        Waiter {
            tenant: tenant.to_owned(),
            slot,
            since_ns,
            bytes,
            priority,
            borrow: true,
        }
    }

    #[test]
    fn a_stuck_line_refuses_its_last_borrow_and_never_a_wait_for_swapped_memory() {
        // 12 GiB, requests of 4 each filling it: "a" and "b" hold their requests with their
        // borrowed memory out (they wait for it), "c" holds its request and waits to borrow 2.
        let holders = [
            holder("a", 4 * GIB, 4 * GIB, 0, false),
            holder("b", 4 * GIB, 4 * GIB, 0, false),
            holder("c", 4 * GIB, 4 * GIB, 0, false),
        ];
        let swapped = |tenant, slot, since| Waiter {
            borrow: false,
            ..waiter(tenant, slot, since, 2 * GIB, 0)
        };
        let waiters = [
            waiter("c", 2, 10, 2 * GIB, 0),
            swapped("a", 0, 20),
            swapped("b", 1, 30),
        ];
        assert_eq!(stuck_at(&holders, &waiters, 0, u64::MAX, true), Some(2));
        // Someone runs (and may free): not stuck. Room for the first, or something to unstall:
        // not stuck.
        assert_eq!(stuck_at(&holders, &waiters, 0, u64::MAX, false), None);
        assert_eq!(stuck_at(&holders, &waiters, 2 * GIB, u64::MAX, true), None);
        let lending = [
            holder("a", 4 * GIB, 6 * GIB, 0, false),
            holders[1].clone(),
            holders[2].clone(),
        ];
        assert_eq!(stuck_at(&lending, &waiters, 0, u64::MAX, true), None);
        // ... unless the swap space cannot take what a would give: stuck again.
        assert_eq!(stuck_at(&lending, &waiters, 0, GIB, true), Some(2));
        assert_eq!(stuck_at(&lending, &waiters, GIB, GIB, true), None);
        // Less to unstall than the first needs (1 of 2 GiB borrowed, nothing free): stuck.
        let short = [
            holder("a", 4 * GIB, 5 * GIB, 0, false),
            holders[1].clone(),
            holders[2].clone(),
        ];
        assert_eq!(stuck_at(&short, &waiters, 0, u64::MAX, true), Some(2));
        // Only waits for swapped-out memory: nobody is refused.
        assert_eq!(stuck_at(&holders, &waiters[1..], 0, u64::MAX, true), None);
        // Of two borrows, the last in line.
        let two = [
            waiter("c", 2, 10, 2 * GIB, 0),
            waiter("b", 1, 30, 2 * GIB, 0),
            swapped("a", 0, 20),
        ];
        assert_eq!(stuck_at(&holders, &two, 0, u64::MAX, true), Some(1));
    }

    #[test]
    fn two_borrowers_waiting_for_each_others_memory_are_unstalled_first_come_first() {
        // 16 GiB: "a" and "b" (requests 2) each borrowed 6 and wait for 4 more; "c" runs with
        // its 2. "a" waited first: "b" is asked for what "a" lacks, "c" (running) never.
        let holders = [
            holder("a", 2 * GIB, 8 * GIB, 0, false),
            holder("b", 2 * GIB, 8 * GIB, 0, false),
            holder("c", 2 * GIB, 2 * GIB, 0, false),
        ];
        let waiters = [
            waiter("b", 1, 20, 4 * GIB, 0),
            waiter("a", 0, 10, 4 * GIB, 0),
        ];
        assert_eq!(
            unstall_first(&holders, &waiters, 0),
            vec![("b".to_owned(), 4 * GIB)]
        );
        // Room for part of it: only the rest is asked.
        assert_eq!(
            unstall_first(&holders, &waiters, 3 * GIB),
            vec![("b".to_owned(), GIB)]
        );
        // It fits: nothing; an empty line: nothing.
        assert!(unstall_first(&holders, &waiters, 4 * GIB).is_empty());
        assert!(unstall_first(&holders, &[], 0).is_empty());
        // Higher priority goes first whatever the time: "b" at priority 1 asks "a".
        let waiters = [
            waiter("b", 1, 20, 4 * GIB, 1),
            waiter("a", 0, 10, 4 * GIB, 0),
        ];
        assert_eq!(
            unstall_first(&holders, &waiters, 0),
            vec![("a".to_owned(), 4 * GIB)]
        );
        // Its own tenant's other process in line is never asked.
        let waiters = [
            waiter("a", 1, 20, 4 * GIB, 0),
            waiter("a", 0, 10, 4 * GIB, 0),
        ];
        assert!(unstall_first(&holders, &waiters, 0).is_empty());
    }

    fn line() -> impl Strategy<Value = Vec<Waiter>> {
        prop::collection::vec((0usize..8, 1u64..50, 0u64..20, -1i32..2), 0..10).prop_map(|specs| {
            specs
                .into_iter()
                .enumerate()
                .map(|(slot, (tenant, since, bytes, priority))| {
                    waiter(&format!("t{tenant}"), slot, since, bytes * GIB, priority)
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn the_first_in_line_asks_only_other_waiters_for_borrowed_memory(
            holders in holders(),
            waiters in line(),
            room in 0u64..20,
        ) {
            let room = room * GIB;
            let asks = unstall_first(&holders, &waiters, room);
            let mut seen = std::collections::BTreeSet::new();
            for (name, take) in &asks {
                let first = waiters.iter().min_by(|a, b| line_order(a, b)).unwrap();
                prop_assert!(name != &first.tenant, "the first's own tenant is never asked");
                prop_assert!(waiters.iter().any(|w| &w.tenant == name), "{name} runs: never asked");
                prop_assert!(seen.insert(name.clone()), "each tenant once");
                let h = holders.iter().find(|h| &h.name == name).unwrap();
                prop_assert!(*take > 0 && *take <= h.borrowed());
            }
            let asked: u64 = asks.iter().map(|(_, take)| take).sum();
            let shortfall = waiters
                .iter()
                .min_by(|a, b| line_order(a, b))
                .map_or(0, |first| first.bytes.saturating_sub(room));
            prop_assert!(asked <= shortfall, "never more than the shortfall");
            // The order is total: every process sees the same first.
            let mut sorted = waiters.clone();
            sorted.sort_by(line_order);
            let mut reversed = waiters.clone();
            reversed.reverse();
            reversed.sort_by(line_order);
            prop_assert_eq!(sorted, reversed);
        }
    }

    fn holders() -> impl Strategy<Value = Vec<Holder>> {
        prop::collection::vec((0u64..40, 0u64..80, -3i32..3, any::<bool>()), 1..8).prop_map(
            |specs| {
                specs
                    .into_iter()
                    .enumerate()
                    .map(|(i, (request, resident, priority, guaranteed))| {
                        holder(
                            &format!("t{i}"),
                            request * GIB,
                            resident * GIB,
                            priority,
                            guaranteed,
                        )
                    })
                    .collect()
            },
        )
    }

    proptest! {
        #[test]
        fn asks_never_go_below_a_request_and_cover_what_borrowers_can_give(
            holders in holders(),
            pick in 0usize..8,
            bytes in 0u64..50,
            free in 0u64..20,
        ) {
            let needy = holders[pick % holders.len()].name.clone();
            let (bytes, free) = (bytes * GIB, free * GIB);
            match plan(&holders, &needy, bytes, free) {
                Err(NoReclaim::PastRequest { .. }) => {
                    let me = holders.iter().find(|h| h.name == needy).unwrap();
                    prop_assert!(bytes > me.request.saturating_sub(me.resident));
                }
                Err(other) => prop_assert!(false, "{other}"),
                Ok(asks) => {
                    let mut seen = std::collections::BTreeSet::new();
                    for (name, take) in &asks {
                        prop_assert!(name != &needy, "the needy tenant is never asked");
                        prop_assert!(seen.insert(name.clone()), "each borrower once");
                        let h = holders.iter().find(|h| &h.name == name).unwrap();
                        prop_assert!(*take > 0 && *take <= h.borrowed(), "{name}: {take} of {}", h.borrowed());
                    }
                    let asked: u64 = asks.iter().map(|(_, take)| take).sum();
                    let shortfall = bytes.saturating_sub(free);
                    let lendable: u64 = holders
                        .iter()
                        .filter(|h| h.name != needy)
                        .map(Holder::borrowed)
                        .sum();
                    prop_assert!(asked <= shortfall, "never more than the shortfall");
                    prop_assert_eq!(asked, shortfall.min(lendable));
                }
            }
        }
    }
}
