//! Checks a recorded history: linearizability of each tenant name as a register (a Wing–Gong /
//! Lowe search with memoisation), and an acknowledged-writes oracle on the final states.
//!
//! The register holds `None` (absent) or `Some(milli_gpus)` (present with that request).
//! Operations whose outcome is unknown may be linearized anywhere after their invocation, or not
//! at all, and may have any outcome the model allows. Names are independent (P-compositionality),
//! so each is searched on its own, which keeps the search small.

use crate::history::{Call, Operation, Outcome, by_name};
use std::collections::{BTreeMap, HashSet};

/// Search states explored per name before the checker gives up (a bug in the checker, or a
/// history far larger than the simulation makes).
const EXPLORED_STATES_MAX: u64 = 2_000_000;

/// The register a tenant name is: absent, or present with a request of this many milli-GPUs.
pub type Register = Option<u32>;

/// Every state `call` can move `state` to while answering `outcome` (none: not allowed).
fn step(state: Register, call: Call, outcome: Outcome) -> Vec<Register> {
    match (call, outcome, state) {
        (Call::Place(milli), Outcome::Placed, None) => vec![Some(milli)],
        (Call::Place(milli), Outcome::Placed, Some(held)) if held == milli => vec![state],
        (Call::Place(milli), Outcome::Exists, Some(held)) if held != milli => vec![state],
        (Call::Place(_), Outcome::Unplaceable, None) => vec![None],
        (Call::Place(milli), Outcome::Unknown, None) => vec![Some(milli), None],
        (Call::Place(_), Outcome::Unknown, Some(_)) => vec![state],
        (Call::Release, Outcome::Released, Some(_)) => vec![None],
        (Call::Release, Outcome::NotFound, None) => vec![None],
        (Call::Release, Outcome::Unknown, _) => vec![None],
        (Call::Read, Outcome::Present(seen), Some(held)) if seen == held => vec![state],
        (Call::Read, Outcome::Absent, None) => vec![None],
        (Call::Read, Outcome::Unknown, _) => vec![state],
        _ => Vec::new(),
    }
}

/// Checks every name of `operations`; returns one message per name that is not linearizable.
pub fn check_linearizable(operations: &[Operation]) -> Vec<String> {
    let mut failures = Vec::new();
    for (name, operations) in by_name(operations) {
        if let Err(message) = check_register(&operations) {
            failures.push(format!("tenant `{name}` is not linearizable: {message}"));
        }
    }
    failures
}

/// Checks the operations of one name, starting from an absent register.
pub fn check_register(operations: &[Operation]) -> Result<(), String> {
    if let Some(unexpected) = operations
        .iter()
        .find(|op| op.outcome == Outcome::Unexpected)
    {
        return Err(format!("unexpected answer: {unexpected:?}"));
    }
    // An unknown read changes nothing; leave it out.
    let mut operations: Vec<Operation> = operations
        .iter()
        .filter(|op| op.call != Call::Read || op.is_complete())
        .cloned()
        .collect();
    operations.sort_by_key(|op| (op.invoked, op.returned));
    let complete = operations.iter().filter(|op| op.is_complete()).count();
    let mut search = Search {
        operations: &operations,
        seen: HashSet::new(),
        explored: 0,
        deepest: Vec::new(),
        path: Vec::new(),
    };
    let mut linearized = vec![0u64; operations.len().div_ceil(64)];
    match search.run(&mut linearized, None, complete) {
        Ok(true) => Ok(()),
        Ok(false) => Err(describe_failure(&operations, &search.deepest)),
        Err(()) => Err(format!(
            "the checker gave up after {EXPLORED_STATES_MAX} states on {} operations",
            operations.len()
        )),
    }
}

struct Search<'a> {
    /// Sorted by invocation.
    operations: &'a [Operation],
    /// (linearized set, register) pairs already shown to lead nowhere.
    seen: HashSet<(Vec<u64>, Register)>,
    explored: u64,
    /// The longest linearization found, for the failure message.
    deepest: Vec<usize>,
    path: Vec<usize>,
}

fn is_set(bits: &[u64], index: usize) -> bool {
    bits[index / 64] & (1 << (index % 64)) != 0
}

fn flip(bits: &mut [u64], index: usize) {
    bits[index / 64] ^= 1 << (index % 64);
}

impl Search<'_> {
    /// Whether the operations not in `linearized` can be linearized from `state`; `Err` when the
    /// budget ran out. `complete_left` counts the complete operations not yet linearized.
    fn run(
        &mut self,
        linearized: &mut Vec<u64>,
        state: Register,
        complete_left: usize,
    ) -> Result<bool, ()> {
        if complete_left == 0 {
            return Ok(true);
        }
        if !self.seen.insert((linearized.clone(), state)) {
            return Ok(false);
        }
        self.explored += 1;
        if self.explored > EXPLORED_STATES_MAX {
            return Err(());
        }
        if self.path.len() > self.deepest.len() {
            self.deepest = self.path.clone();
        }
        // An operation can go next only if no other pending operation returned before it began.
        let horizon = (0..self.operations.len())
            .filter(|&index| !is_set(linearized, index))
            .map(|index| self.operations[index].returned)
            .min()
            .expect("complete operations are left");
        for index in 0..self.operations.len() {
            let operation = &self.operations[index];
            if operation.invoked > horizon {
                break;
            }
            if is_set(linearized, index) {
                continue;
            }
            let left = complete_left - usize::from(operation.is_complete());
            for next in step(state, operation.call, operation.outcome) {
                flip(linearized, index);
                self.path.push(index);
                let found = self.run(linearized, next, left)?;
                self.path.pop();
                flip(linearized, index);
                if found {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }
}

fn describe_failure(operations: &[Operation], deepest: &[usize]) -> String {
    let mut state: Register = None;
    let mut lines = vec![format!(
        "longest linearization ({} of {} operations):",
        deepest.len(),
        operations.len()
    )];
    for &index in deepest {
        let operation = &operations[index];
        state = step(state, operation.call, operation.outcome)
            .first()
            .copied()
            .unwrap_or(state);
        lines.push(format!("  {} -> register {state:?}", describe(operation)));
    }
    lines.push("all operations, by invocation:".to_owned());
    for (index, operation) in operations.iter().enumerate() {
        let mark = if deepest.contains(&index) { ' ' } else { '*' };
        lines.push(format!(" {mark}{}", describe(operation)));
    }
    lines.join("\n")
}

fn describe(operation: &Operation) -> String {
    let returned = if operation.returned_us == u64::MAX {
        "never".to_owned()
    } else {
        format!("{}us", operation.returned_us)
    };
    format!(
        "client {} {:?} [{}us, {returned}] -> {:?} ({})",
        operation.client, operation.call, operation.invoked_us, operation.outcome, operation.note
    )
}

/// The acknowledged-writes oracle: every acknowledged placement that no release could have undone
/// is present, with its request, in every member's final state. `finals` maps each member to its
/// tenants (name -> milli-GPUs).
pub fn check_acknowledged_writes(
    operations: &[Operation],
    finals: &BTreeMap<u64, BTreeMap<String, u32>>,
) -> Vec<String> {
    let mut failures = Vec::new();
    for (name, operations) in by_name(operations) {
        for place in operations.iter().filter(|op| op.outcome == Outcome::Placed) {
            let Call::Place(milli) = place.call else {
                continue;
            };
            // A release can undo it only if the release may have taken effect after it.
            let undone = operations.iter().any(|op| {
                op.call == Call::Release
                    && matches!(op.outcome, Outcome::Released | Outcome::Unknown)
                    && op.returned > place.invoked
            });
            if undone {
                continue;
            }
            for (member, tenants) in finals {
                if tenants.get(&name) != Some(&milli) {
                    failures.push(format!(
                        "acknowledged write lost: {} but member {member} ends with {:?}",
                        describe(place),
                        tenants.get(&name)
                    ));
                }
            }
        }
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(client: u32, call: Call, span: (u64, u64), outcome: Outcome) -> Operation {
        let returned = if outcome == Outcome::Unknown {
            u64::MAX
        } else {
            span.1
        };
        Operation {
            client,
            name: "t".to_owned(),
            call,
            invoked: span.0,
            returned,
            invoked_us: span.0,
            returned_us: returned,
            outcome,
            note: String::new(),
        }
    }

    #[test]
    fn a_sequential_history_passes() {
        let history = [
            op(0, Call::Read, (0, 1), Outcome::Absent),
            op(0, Call::Place(200), (2, 3), Outcome::Placed),
            op(0, Call::Place(300), (4, 5), Outcome::Exists),
            op(0, Call::Place(200), (6, 7), Outcome::Placed),
            op(0, Call::Read, (8, 9), Outcome::Present(200)),
            op(0, Call::Release, (10, 11), Outcome::Released),
            op(0, Call::Release, (12, 13), Outcome::NotFound),
            op(0, Call::Read, (14, 15), Outcome::Absent),
        ];
        assert_eq!(check_register(&history), Ok(()));
    }

    #[test]
    fn concurrent_operations_may_take_effect_in_either_order() {
        let history = [
            op(0, Call::Place(200), (0, 10), Outcome::Placed),
            op(1, Call::Read, (1, 2), Outcome::Present(200)),
            op(2, Call::Read, (3, 4), Outcome::Present(200)),
            op(1, Call::Release, (5, 20), Outcome::Released),
            op(2, Call::Read, (6, 7), Outcome::Present(200)),
            op(2, Call::Read, (21, 22), Outcome::Absent),
        ];
        assert_eq!(check_register(&history), Ok(()));
    }

    #[test]
    fn a_read_that_sees_a_write_before_it_was_invoked_is_rejected() {
        let history = [
            op(1, Call::Read, (0, 1), Outcome::Present(200)),
            op(0, Call::Place(200), (2, 3), Outcome::Placed),
        ];
        assert!(check_register(&history).is_err());
    }

    #[test]
    fn a_lost_acknowledged_write_is_rejected() {
        let history = [
            op(0, Call::Place(200), (0, 1), Outcome::Placed),
            op(1, Call::Read, (2, 3), Outcome::Absent),
        ];
        let error = check_register(&history).expect_err("the read lost the write");
        assert!(error.contains("Absent"), "{error}");
        let finals = BTreeMap::from([
            (1, BTreeMap::new()),
            (2, BTreeMap::from([("t".to_owned(), 200)])),
        ]);
        let lost = check_acknowledged_writes(&history, &finals);
        assert_eq!(lost.len(), 1, "{lost:?}");
        assert!(lost[0].contains("member 1"), "{lost:?}");
    }

    #[test]
    fn a_stale_read_after_a_release_is_rejected() {
        let history = [
            op(0, Call::Place(200), (0, 1), Outcome::Placed),
            op(0, Call::Release, (2, 3), Outcome::Released),
            op(1, Call::Read, (4, 5), Outcome::Present(200)),
        ];
        assert!(check_register(&history).is_err());
    }

    /// What a deposed leader cut off from the others would answer if it served reads from its
    /// own state: the release committed by the new leader is not there. Unknown attempts of
    /// other requests do not excuse it.
    #[test]
    fn a_stale_read_from_a_deposed_leader_is_rejected_among_unknown_writes() {
        let history = [
            op(0, Call::Place(200), (0, 1), Outcome::Placed),
            op(3, Call::Place(300), (2, 0), Outcome::Unknown),
            op(1, Call::Release, (3, 6), Outcome::Released),
            op(4, Call::Release, (4, 0), Outcome::Unknown),
            op(2, Call::Read, (7, 9), Outcome::Present(200)),
        ];
        let error = check_register(&history).expect_err("the read is stale");
        assert!(error.contains("Present(200)"), "{error}");
        // The same read concurrent with the release may see the tenant still there.
        let concurrent = [
            op(0, Call::Place(200), (0, 1), Outcome::Placed),
            op(1, Call::Release, (3, 6), Outcome::Released),
            op(2, Call::Read, (5, 9), Outcome::Present(200)),
        ];
        assert_eq!(check_register(&concurrent), Ok(()));
    }

    #[test]
    fn an_unknown_write_may_take_effect_late_but_only_once() {
        let late = [
            op(0, Call::Place(200), (0, 0), Outcome::Unknown),
            op(1, Call::Read, (5, 6), Outcome::Absent),
            op(1, Call::Read, (7, 8), Outcome::Present(200)),
        ];
        assert_eq!(check_register(&late), Ok(()));
        let never = [
            op(0, Call::Place(200), (0, 0), Outcome::Unknown),
            op(1, Call::Read, (5, 6), Outcome::Absent),
        ];
        assert_eq!(check_register(&never), Ok(()));
        let twice = [
            op(0, Call::Place(200), (0, 0), Outcome::Unknown),
            op(1, Call::Read, (5, 6), Outcome::Present(200)),
            op(1, Call::Read, (7, 8), Outcome::Absent),
            op(1, Call::Read, (9, 10), Outcome::Present(200)),
        ];
        assert!(check_register(&twice).is_err());
    }

    #[test]
    fn answers_the_model_does_not_allow_are_rejected() {
        let exists_when_absent = [op(0, Call::Place(200), (0, 1), Outcome::Exists)];
        assert!(check_register(&exists_when_absent).is_err());
        let unexpected = [op(0, Call::Release, (0, 1), Outcome::Unexpected)];
        assert!(check_register(&unexpected).is_err());
        let wrong_request = [
            op(0, Call::Place(200), (0, 1), Outcome::Placed),
            op(1, Call::Read, (2, 3), Outcome::Present(300)),
        ];
        assert!(check_register(&wrong_request).is_err());
    }

    #[test]
    fn a_release_that_may_follow_the_write_excuses_its_absence() {
        let history = [
            op(0, Call::Place(200), (0, 1), Outcome::Placed),
            op(1, Call::Release, (2, 0), Outcome::Unknown),
        ];
        let finals = BTreeMap::from([(1, BTreeMap::new())]);
        assert!(check_acknowledged_writes(&history, &finals).is_empty());
    }
}
