use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

/// The GPU as the model sees it: what each address range holds while mapped, what the host
/// staging holds while out, and injected failures.
#[derive(Default)]
struct Model {
    mapped: BTreeMap<u64, Vec<u8>>,
    staging: BTreeMap<u64, Vec<u8>>,
    /// The next driver step on these addresses fails (once).
    fail: std::collections::BTreeSet<u64>,
    /// How many chunks each batch moved out had, in order.
    batches: Vec<usize>,
    /// How many chunks each swap-in brought back (with those that joined it), in order.
    swap_ins: Vec<usize>,
    /// What the driver says is free (`None`: it cannot tell).
    driver_free: Option<u64>,
}

/// The model pins one staging buffer per chunk out and frees it when the chunk is back, so the
/// staging reserved is exactly the bytes out (the real driver's backing keeps buffers: `staging`).
impl Backing for Model {
    fn swap_out(
        &mut self,
        chunks: &[(u64, u64)],
        counters: &mut impl Counters,
        count_every: Option<u64>,
    ) -> (Vec<OutResult>, SwapTimes) {
        self.batches.push(chunks.len());
        let mut results = Vec::new();
        let mut landed = 0u64;
        for &(address, size) in chunks {
            if !counters.reserve_staging(size) {
                results.push(OutResult::StagingRefused);
                continue;
            }
            if self.fail.remove(&address) {
                counters.release_staging(size);
                results.push(OutResult::Failed(SwapError { address, result: 2 }));
                continue;
            }
            let bytes = self
                .mapped
                .remove(&address)
                .expect("swapping out a mapped chunk");
            assert_eq!(bytes.len() as u64, size);
            assert!(self.staging.insert(address, bytes).is_none());
            results.push(OutResult::Moved);
            if let Some(piece) = count_every {
                landed += size;
                if landed >= piece {
                    counters.swapped_out(landed);
                    landed = 0;
                }
            }
        }
        if landed > 0 {
            counters.swapped_out(landed);
        }
        (results, SwapTimes::default())
    }

    fn swap_in<C: Counters>(
        &mut self,
        chunks: &[(u64, u64)],
        counters: &mut C,
        more: &mut dyn FnMut(&mut C) -> Vec<(u64, u64)>,
    ) -> (Vec<Result<(), SwapError>>, InTimes) {
        let mut results = Vec::new();
        let mut all = chunks.to_vec();
        let mut next = 0;
        while next < all.len() {
            let (address, size) = all[next];
            next += 1;
            if self.fail.remove(&address) {
                results.push(Err(SwapError { address, result: 2 }));
                continue;
            }
            let bytes = self
                .staging
                .remove(&address)
                .expect("swapping in a staged chunk");
            assert_eq!(bytes.len() as u64, size);
            assert!(self.mapped.insert(address, bytes).is_none());
            counters.release_staging(size);
            results.push(Ok(()));
            if next == all.len() {
                // Waiting for the copies queued so far: what freed meanwhile joins them.
                all.extend(more(counters));
            }
        }
        self.swap_ins.push(all.len());
        (results, InTimes::default())
    }

    fn driver_free(&mut self, _address: u64) -> Option<u64> {
        self.driver_free
    }
}

/// The board's counters of this process, and what other tenants hold on a GPU of `capacity`.
#[derive(Default)]
struct Board {
    capacity: u64,
    others: u64,
    resident: u64,
    swapped: u64,
    /// The staging budget and what is reserved of it.
    staging_budget: u64,
    staging: u64,
    /// The pieces a swap-out may count free as they land (`Counters::piece`).
    piece: Option<u64>,
    /// This process is the one the line serves.
    first: bool,
    /// Each count of bytes out, in order.
    outs: Vec<u64>,
    /// What the staging budget becomes when a swap-out waits for staging (another process freed
    /// some); `None`: nothing frees.
    budget_after_wait: Option<u64>,
    /// Bytes the other tenants free each time this process gives staging back (a swap-in's
    /// copy completing): a giver's swap-out making room while this one's copies run.
    others_free_per_copy: u64,
}

impl Counters for Board {
    fn swapped_out(&mut self, bytes: u64) {
        self.resident -= bytes;
        self.swapped += bytes;
        self.outs.push(bytes);
    }

    fn piece(&mut self) -> Option<u64> {
        self.piece
    }

    fn first_in_line(&mut self) -> bool {
        self.first
    }

    fn wait_for_staging(&mut self, bytes: u64) -> bool {
        if let Some(budget) = self.budget_after_wait.take() {
            self.staging_budget = budget;
        }
        self.staging + bytes <= self.staging_budget
    }

    fn room_for(&mut self, bytes: u64) -> bool {
        self.others + self.resident + bytes <= self.capacity
    }

    fn swap_in(&mut self, bytes: u64) -> bool {
        if self.others + self.resident + bytes > self.capacity {
            return false;
        }
        self.resident += bytes;
        self.swapped -= bytes;
        true
    }

    fn swap_in_failed(&mut self, bytes: u64) {
        self.resident -= bytes;
        self.swapped += bytes;
    }

    fn reserve_staging(&mut self, bytes: u64) -> bool {
        if self.staging + bytes > self.staging_budget {
            return false;
        }
        self.staging += bytes;
        true
    }

    fn release_staging(&mut self, bytes: u64) {
        self.staging -= bytes;
        self.others = self.others.saturating_sub(self.others_free_per_copy);
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A borrowed allocation of `units` KiB filled with `seed`, if the GPU has room.
    Alloc { units: u64, seed: u8 },
    /// Frees the `n`-th chunk (modulo how many there are).
    Free { n: usize },
    /// Another tenant wants `units` KiB back.
    Want { units: u64 },
    /// Other tenants' resident memory changes to `units` KiB.
    Others { units: u64 },
    /// The next driver step on the `n`-th chunk fails.
    Fail { n: usize },
    /// The process tries to take everything back (its next hook call).
    TakeBack,
    /// A launch, which reads every chunk; admitted only while nothing is out.
    Launch,
    /// The agent writes a staging budget of `units` KiB (never below what is reserved).
    Budget { units: u64 },
    /// Pieces of `units` KiB count free as they land (0: at the end of the round), and whether
    /// the process is first in the GPU's line.
    Line { units: u64, first: bool },
    /// The driver has `units` KiB free (`None`: it cannot tell), whatever the board says.
    Driver { units: Option<u64> },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u64..=8, any::<u8>()).prop_map(|(units, seed)| Op::Alloc { units, seed }),
        (0usize..16).prop_map(|n| Op::Free { n }),
        (1u64..=24).prop_map(|units| Op::Want { units }),
        (0u64..=48).prop_map(|units| Op::Others { units }),
        (0usize..16).prop_map(|n| Op::Fail { n }),
        Just(Op::TakeBack),
        Just(Op::Launch),
        (0u64..=32).prop_map(|units| Op::Budget { units }),
        (0u64..=8, any::<bool>()).prop_map(|(units, first)| Op::Line { units, first }),
        prop::option::of(0u64..=64).prop_map(|units| Op::Driver { units }),
    ]
}

const UNIT: u64 = 1024;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Over any interleaving: the contents of every chunk survive its trips out and back, at the
    /// same address; a launch is admitted only while nothing is out; the board's counters are
    /// what the chunks say; a want is met whenever enough is resident, the staging budget has
    /// room and the driver does not fail (and with too little staging, nothing passes the
    /// budget and what stays resident is said); taking back never passes the GPU's capacity;
    /// staging is held exactly for the chunks out.
    #[test]
    fn contents_survive_and_nothing_runs_while_a_chunk_is_out(ops in prop::collection::vec(op(), 1..60)) {
        let mut chunks = Chunks::default();
        let mut model = Model::default();
        let mut board = Board {
            capacity: 64 * UNIT, others: 0, resident: 0, swapped: 0,
            staging_budget: 64 * UNIT, staging: 0, ..Board::default()
        };
        let mut expected: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        let mut next_address = 0x7f00_0000_0000u64;
        for op in ops {
            match op {
                Op::Alloc { units, seed } => {
                    let size = units * UNIT;
                    if board.others + board.resident + size <= board.capacity {
                        let bytes: Vec<u8> = (0..size).map(|i| seed.wrapping_add(i as u8)).collect();
                        model.mapped.insert(next_address, bytes.clone());
                        expected.insert(next_address, bytes);
                        chunks.add(next_address, size);
                        board.resident += size;
                        next_address += size + UNIT;
                    }
                }
                Op::Free { n } => {
                    if let Some(&address) = expected.keys().nth(n % expected.len().max(1)) {
                        let chunk = chunks.remove(address).expect("tracked");
                        if chunk.out {
                            model.staging.remove(&address).expect("staged");
                            board.swapped -= chunk.size;
                            board.staging -= chunk.size;
                        } else {
                            model.mapped.remove(&address).expect("mapped");
                            board.resident -= chunk.size;
                        }
                        expected.remove(&address);
                    }
                }
                Op::Want { units } => {
                    let want = units * UNIT;
                    let resident = chunks.resident_bytes();
                    let failing = !model.fail.is_empty();
                    let ample = board.staging + resident <= board.staging_budget;
                    let given = chunks.give_back(want, &mut model, &mut board);
                    if !failing && ample {
                        prop_assert!(given.bytes >= want.min(resident), "gave {:?} of {want} with {resident} resident", given);
                        prop_assert_eq!(given.refused_for_staging, 0);
                    }
                    if given.refused_for_staging > 0 {
                        prop_assert!(given.bytes < want);
                    }
                }
                // Others hold what the board granted them: never past the capacity.
                Op::Others { units } => {
                    board.others = (units * UNIT).min(board.capacity - board.resident)
                }
                Op::Fail { n } => {
                    if let Some(&address) = expected.keys().nth(n % expected.len().max(1)) {
                        model.fail.insert(address);
                    }
                }
                Op::TakeBack => {
                    let all = chunks.take_back(&mut model, &mut board);
                    prop_assert_eq!(all, !chunks.held());
                }
                Op::Budget { units } => {
                    board.staging_budget = (units * UNIT).max(board.staging);
                }
                Op::Line { units, first } => {
                    board.piece = (units > 0).then_some(units * UNIT);
                    board.first = first;
                }
                Op::Driver { units } => model.driver_free = units.map(|u| u * UNIT),
                Op::Launch => {
                    if !chunks.held() {
                        // Every chunk the kernel may touch is mapped, with its contents.
                        for (address, bytes) in &expected {
                            prop_assert_eq!(model.mapped.get(address), Some(bytes));
                        }
                    }
                }
            }
            prop_assert!(board.others + board.resident <= board.capacity);
            prop_assert_eq!(board.resident, chunks.resident_bytes());
            prop_assert_eq!(board.swapped, chunks.out_bytes());
            prop_assert_eq!(board.staging, chunks.out_bytes());
            prop_assert!(board.staging <= board.staging_budget);
            prop_assert_eq!(chunks.held(), chunks.out_bytes() > 0);
            for (address, bytes) in &expected {
                let chunk = chunks.chunks[address];
                let place = if chunk.out { &model.staging } else { &model.mapped };
                prop_assert_eq!(place.get(address), Some(bytes), "chunk {:#x}", address);
                let other = if chunk.out { &model.mapped } else { &model.staging };
                prop_assert!(!other.contains_key(address));
            }
        }
    }
}

#[test]
fn the_largest_chunks_go_first_and_only_as_many_as_wanted() {
    let mut chunks = Chunks::default();
    let mut model = Model::default();
    let mut board = Board {
        capacity: 64 * UNIT,
        others: 0,
        resident: 0,
        swapped: 0,
        staging_budget: 64 * UNIT,
        staging: 0,
        ..Board::default()
    };
    for (address, units) in [(0x1000u64, 2u64), (0x2000, 8), (0x3000, 4)] {
        model
            .mapped
            .insert(address, vec![units as u8; (units * UNIT) as usize]);
        chunks.add(address, units * UNIT);
        board.resident += units * UNIT;
    }
    // 5 units wanted: the 8-unit chunk alone covers it.
    assert_eq!(
        chunks.give_back(5 * UNIT, &mut model, &mut board),
        GivenBack {
            bytes: 8 * UNIT,
            refused_for_staging: 0,
            times: SwapTimes::default(),
        }
    );
    assert!(chunks.held());
    assert_eq!(model.staging.keys().collect::<Vec<_>>(), [&0x2000]);
    // The GPU is full: nothing comes back, and the hold stays.
    board.others = 64 * UNIT - board.resident;
    assert!(!chunks.take_back(&mut model, &mut board));
    assert!(chunks.held());
    // Room again: back at the same address, and a launch may go.
    board.others = 0;
    assert!(chunks.take_back(&mut model, &mut board));
    assert_eq!(model.mapped[&0x2000], vec![8u8; (8 * UNIT) as usize]);
    assert_eq!(board.swapped, 0);
    assert_eq!(board.staging, 0);
}

/// The chunks that cover a want go out in one batch (their copies queued back to back); a chunk
/// that failed is made up for by a second batch of the next ones.
#[test]
fn the_chunks_that_cover_a_want_go_out_in_one_batch() {
    let mut chunks = Chunks::default();
    let mut model = Model::default();
    let mut board = Board {
        capacity: 64 * UNIT,
        others: 0,
        resident: 0,
        swapped: 0,
        staging_budget: 64 * UNIT,
        staging: 0,
        ..Board::default()
    };
    for (address, units) in [(0x1000u64, 2u64), (0x2000, 8), (0x3000, 4), (0x4000, 1)] {
        model
            .mapped
            .insert(address, vec![units as u8; (units * UNIT) as usize]);
        chunks.add(address, units * UNIT);
        board.resident += units * UNIT;
    }
    assert_eq!(
        chunks.give_back(11 * UNIT, &mut model, &mut board).bytes,
        12 * UNIT
    );
    assert_eq!(model.batches, [2], "8 and 4 units in one batch");
    assert!(chunks.take_back(&mut model, &mut board));
    // The 8-unit chunk fails: the 2-unit one makes up for it in a second batch.
    model.fail.insert(0x2000);
    model.batches.clear();
    assert_eq!(
        chunks.give_back(5 * UNIT, &mut model, &mut board).bytes,
        6 * UNIT
    );
    assert_eq!(model.batches, [1, 2], "8; then 4 (not enough alone) and 2");
    assert_eq!(model.mapped[&0x2000], vec![8u8; (8 * UNIT) as usize]);
    assert_eq!(board.staging, 6 * UNIT);
}

/// The staging budget has room for the 4-unit chunk only: the 8-unit one stays resident (said in
/// `refused_for_staging`), the 4-unit one goes; with no room at all nothing goes.
#[test]
fn a_chunk_the_staging_budget_has_no_room_for_stays_resident() {
    let mut chunks = Chunks::default();
    let mut model = Model::default();
    let mut board = Board {
        capacity: 64 * UNIT,
        others: 0,
        resident: 0,
        swapped: 0,
        staging_budget: 5 * UNIT,
        staging: 0,
        ..Board::default()
    };
    for (address, units) in [(0x2000u64, 8u64), (0x3000, 4)] {
        model
            .mapped
            .insert(address, vec![units as u8; (units * UNIT) as usize]);
        chunks.add(address, units * UNIT);
        board.resident += units * UNIT;
    }
    assert_eq!(
        chunks.give_back(12 * UNIT, &mut model, &mut board),
        GivenBack {
            bytes: 4 * UNIT,
            refused_for_staging: 8 * UNIT,
            times: SwapTimes::default(),
        }
    );
    assert_eq!(model.staging.keys().collect::<Vec<_>>(), [&0x3000]);
    assert_eq!(board.staging, 4 * UNIT);
    board.staging_budget = 0;
    assert!(chunks.take_back(&mut model, &mut board));
    assert_eq!(board.staging, 0);
    assert_eq!(
        chunks.give_back(UNIT, &mut model, &mut board),
        GivenBack {
            bytes: 0,
            refused_for_staging: 12 * UNIT,
            times: SwapTimes::default(),
        }
    );
    assert!(!chunks.held());
    assert_eq!(model.mapped[&0x2000], vec![8u8; (8 * UNIT) as usize]);
}

/// The process-wide counts the launch and copy paths read (the only test that touches them: they
/// are statics of the test binary). A launch enters only while no chunk is out, no swap-out is
/// under way and no want is posted; a swap-out waits for the launches already in flight.
#[test]
fn launches_enter_only_while_nothing_is_out_and_a_swap_out_waits_for_those_in_flight() {
    forked();
    assert!(!any_chunk());
    let mut chunks = Chunks::default();
    chunks.add(0x1000, 4);
    let mut devices = [Chunks::default(), Chunks::default()];
    devices[1] = chunks;
    publish(&devices);
    assert!(any_chunk() && !any_out());
    assert_eq!(resident_on(), 0b10);
    assert!(try_enter(|| false).is_none(), "a want posted: act first");
    let in_flight = try_enter(|| true).expect("nothing out, no want");
    // A swap-out waits for the launch in flight (on another thread here) to reach the driver.
    let (entered, released) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        released.recv().expect("released");
        drop(in_flight);
    });
    let swapper = std::thread::spawn(move || {
        let quiet = quiesce().expect("the launch in flight returned within the bound");
        assert!(
            try_enter(|| true).is_none(),
            "no launch enters during a swap-out"
        );
        drop(quiet);
    });
    entered.send(()).expect("sending");
    holder.join().expect("holder");
    swapper.join().expect("swapper");
    // A chunk out holds every launch; back, they enter again.
    devices[1].chunks.get_mut(&0x1000).expect("the chunk").out = true;
    publish(&devices);
    assert!(any_out() && try_enter(|| true).is_none());
    assert_eq!(resident_on(), 0);
    devices[1].chunks.get_mut(&0x1000).expect("the chunk").out = false;
    publish(&devices);
    drop(try_enter(|| true).expect("back"));
    forked();
    assert!(!any_chunk() && !inherited());
}

#[test]
fn the_swap_is_on_unless_the_environment_says_0() {
    use std::ffi::OsStr;
    assert_eq!(Asked::from_value(None), Asked::Default);
    assert_eq!(Asked::from_value(Some(OsStr::new("1"))), Asked::On);
    assert_eq!(Asked::from_value(Some(OsStr::new("0"))), Asked::Off);
    assert_eq!(Asked::from_value(Some(OsStr::new("yes"))), Asked::Default);
    assert!(Asked::Default.on() && Asked::On.on() && !Asked::Off.on());
}

#[test]
fn chunks_marked_cold_go_first() {
    let mut chunks = Chunks::default();
    for (address, units) in [(0x10000u64, 2u64), (0x20000, 8), (0x30000, 4)] {
        chunks.add(address, units * UNIT);
    }
    assert_eq!(
        chunks.resident_in_giving_order(),
        [8 * UNIT, 4 * UNIT, 2 * UNIT]
    );
    // A range inside the 2-unit chunk marks it.
    assert_eq!(chunks.mark_cold(0x10000 + 1, 1, true), 2 * UNIT);
    assert_eq!(
        chunks.resident_in_giving_order(),
        [2 * UNIT, 8 * UNIT, 4 * UNIT]
    );
    // Across two chunks: both; cold among themselves, the larger first.
    assert_eq!(
        chunks.mark_cold(0x20000, 0x30000 - 0x20000 + 1, true),
        12 * UNIT
    );
    assert_eq!(
        chunks.resident_in_giving_order(),
        [8 * UNIT, 4 * UNIT, 2 * UNIT]
    );
    assert_eq!(chunks.mark_cold(0x20000, 1, false), 8 * UNIT);
    assert_eq!(
        chunks.resident_in_giving_order(),
        [4 * UNIT, 2 * UNIT, 8 * UNIT]
    );
    // Nothing borrowed there (below the first chunk, past the last): 0 bytes.
    assert_eq!(chunks.mark_cold(0x10, 0x10, true), 0);
    assert_eq!(chunks.mark_cold(0x30000 + 4 * UNIT, 8, true), 0);
}

/// A GPU of 64 units with this process's chunks of `units` each, resident.
fn resident(units: &[u64]) -> (Chunks, Model, Board) {
    let mut chunks = Chunks::default();
    let mut model = Model::default();
    let mut board = Board {
        capacity: 64 * UNIT,
        staging_budget: 64 * UNIT,
        ..Board::default()
    };
    for (i, &u) in units.iter().enumerate() {
        let address = 0x10_0000 * (i as u64 + 1);
        model
            .mapped
            .insert(address, vec![i as u8; (u * UNIT) as usize]);
        chunks.add(address, u * UNIT);
        board.resident += u * UNIT;
    }
    (chunks, model, board)
}

/// With pieces (no tenant waits within its request), a swap-out counts each piece's room free as
/// soon as it is out, so a process taking its chunks back can start after the first; without,
/// the whole round's room at its end, in one batch.
#[test]
fn a_swap_out_counts_each_piece_free_as_it_lands_when_pieces_count() {
    let (mut chunks, mut model, mut board) = resident(&[2, 2, 2, 2]);
    board.piece = Some(4 * UNIT);
    assert_eq!(
        chunks.give_back(8 * UNIT, &mut model, &mut board).bytes,
        8 * UNIT
    );
    assert_eq!(
        model.batches,
        [4],
        "one batch: the copies queued back to back"
    );
    assert_eq!(board.outs, [4 * UNIT, 4 * UNIT]);

    let (mut chunks, mut model, mut board) = resident(&[2, 2, 2, 2]);
    assert_eq!(
        chunks.give_back(8 * UNIT, &mut model, &mut board).bytes,
        8 * UNIT
    );
    assert_eq!(model.batches, [4]);
    assert_eq!(board.outs, [8 * UNIT]);

    // A chunk larger than a piece is counted alone.
    let (mut chunks, mut model, mut board) = resident(&[8, 1]);
    board.piece = Some(4 * UNIT);
    assert_eq!(
        chunks.give_back(9 * UNIT, &mut model, &mut board).bytes,
        9 * UNIT
    );
    assert_eq!(model.batches, [2]);
    assert_eq!(board.outs, [8 * UNIT, UNIT]);
}

/// The process the line serves brings back what fits as room frees (its swap-in runs while the
/// other's swap-out makes the room); any other waits for room for all of them, and the contents
/// come back whole either way.
#[test]
fn the_first_in_line_brings_its_chunks_back_piece_by_piece() {
    let (mut chunks, mut model, mut board) = resident(&[4, 4, 4]);
    assert_eq!(
        chunks.give_back(12 * UNIT, &mut model, &mut board).bytes,
        12 * UNIT
    );
    // Room for one chunk only.
    board.others = 64 * UNIT - 4 * UNIT;
    assert!(!chunks.take_back(&mut model, &mut board));
    assert_eq!(
        chunks.out_bytes(),
        12 * UNIT,
        "not first in line: waits for room for all"
    );
    board.first = true;
    assert!(!chunks.take_back(&mut model, &mut board));
    assert_eq!(
        chunks.out_bytes(),
        8 * UNIT,
        "first in line: one chunk back"
    );
    assert_eq!(board.resident, 4 * UNIT);
    assert!(chunks.coming_back());
    board.others = 0;
    assert!(chunks.take_back(&mut model, &mut board));
    assert!(!chunks.held() && !chunks.coming_back());
    for (i, address) in [0x10_0000u64, 0x20_0000, 0x30_0000].iter().enumerate() {
        assert_eq!(model.mapped[address], vec![i as u8; (4 * UNIT) as usize]);
    }
}

/// Room that frees while the first in line's copies run is taken at once: the chunks join the
/// swap-in under way, so the copy engine goes on from one piece to the next without waiting for
/// the process to look again. Only for the first in line: any other process still waits for
/// room for all its chunks.
#[test]
fn room_that_frees_during_a_swap_in_joins_it() {
    let (mut chunks, mut model, mut board) = resident(&[4, 4, 4, 4]);
    chunks.give_back(16 * UNIT, &mut model, &mut board);
    board.others = 64 * UNIT - 4 * UNIT;
    board.others_free_per_copy = 4 * UNIT;
    board.first = true;
    assert!(
        chunks.take_back(&mut model, &mut board),
        "all back in one call"
    );
    assert_eq!(model.swap_ins, [4], "one swap-in, three chunks joined it");
    assert_eq!((board.resident, board.swapped), (16 * UNIT, 0));
    for (i, address) in [0x10_0000u64, 0x20_0000, 0x30_0000, 0x40_0000]
        .iter()
        .enumerate()
    {
        assert_eq!(model.mapped[address], vec![i as u8; (4 * UNIT) as usize]);
    }

    // Not first in line: nothing until room for all, and nothing joins.
    let (mut chunks, mut model, mut board) = resident(&[4, 4]);
    chunks.give_back(8 * UNIT, &mut model, &mut board);
    board.others = 64 * UNIT - 4 * UNIT;
    board.others_free_per_copy = 4 * UNIT;
    assert!(!chunks.take_back(&mut model, &mut board));
    assert!(model.swap_ins.is_empty());
}

/// The board may have room that the driver has not released yet (an exiting process): nothing
/// comes back until the driver has it free, or until `DRIVER_LAG_MAX` passed (then it tries).
#[test]
fn nothing_comes_back_while_the_driver_has_less_free_than_the_board_says() {
    let (mut chunks, mut model, mut board) = resident(&[4, 4]);
    chunks.give_back(8 * UNIT, &mut model, &mut board);
    model.driver_free = Some(7 * UNIT);
    assert!(!chunks.take_back(&mut model, &mut board));
    assert!(chunks.driver_behind_since.is_some());
    assert_eq!(board.swapped, 8 * UNIT, "nothing counted back");
    model.driver_free = Some(8 * UNIT);
    assert!(chunks.take_back(&mut model, &mut board));
    assert!(chunks.driver_behind_since.is_none());
    // Past the bound it goes ahead (a chunk the driver has no memory for would stay out).
    chunks.give_back(8 * UNIT, &mut model, &mut board);
    model.driver_free = Some(0);
    assert!(!chunks.take_back(&mut model, &mut board));
    let since = std::time::Instant::now()
        .checked_sub(DRIVER_LAG_MAX)
        .expect("the clock is past the bound");
    chunks.driver_behind_since = Some(since);
    assert!(chunks.take_back(&mut model, &mut board));
    // Unknown (another device is current): no wait.
    chunks.give_back(8 * UNIT, &mut model, &mut board);
    model.driver_free = None;
    assert!(chunks.take_back(&mut model, &mut board));
}

/// A chunk the staging budget refused waits (once, bounded) for staging to free (the other side
/// of an exchange, other processes' idle staging), and the swap-out goes on; with nothing freed,
/// the rest stays resident and is said.
#[test]
fn a_swap_out_short_of_staging_waits_once_for_staging_to_free() {
    let (mut chunks, mut model, mut board) = resident(&[2, 2, 2, 2]);
    board.piece = Some(2 * UNIT);
    board.staging_budget = 4 * UNIT;
    board.budget_after_wait = Some(8 * UNIT);
    let given = chunks.give_back(8 * UNIT, &mut model, &mut board);
    assert_eq!((given.bytes, given.refused_for_staging), (8 * UNIT, 0));
    assert_eq!(board.outs, [2 * UNIT, 2 * UNIT, 2 * UNIT, 2 * UNIT]);

    // Nothing frees: half stays.
    let (mut chunks, mut model, mut board) = resident(&[2, 2, 2, 2]);
    board.piece = Some(2 * UNIT);
    board.staging_budget = 4 * UNIT;
    let given = chunks.give_back(8 * UNIT, &mut model, &mut board);
    assert_eq!(
        (given.bytes, given.refused_for_staging),
        (4 * UNIT, 4 * UNIT)
    );

    // Without pieces as well: other processes free the staging they keep idle.
    let (mut chunks, mut model, mut board) = resident(&[2, 2, 2, 2]);
    board.staging_budget = 4 * UNIT;
    board.budget_after_wait = Some(8 * UNIT);
    let given = chunks.give_back(8 * UNIT, &mut model, &mut board);
    assert_eq!((given.bytes, given.refused_for_staging), (8 * UNIT, 0));
    assert_eq!(board.budget_after_wait, None, "waited once");
}
