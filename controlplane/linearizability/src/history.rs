//! The record of every client operation: what was asked, of which tenant, when it was invoked and
//! when it returned (microseconds since the start of the run: virtual in the simulation, real in
//! the nemesis test), and what came back.
//!
//! Each tenant name is an independent register (present with a request, or absent), so the
//! history is checked per name. The request is identified by its `milli_gpus`, which is the only
//! field the clients vary.

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a client asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Call {
    /// Place the tenant with a request of this many milli-GPUs.
    Place(u32),
    Release,
    /// A linearizable read of the tenant.
    Read,
}

/// What came back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Outcome {
    /// Placed or pending, holding the request of the call.
    Placed,
    /// The tenant exists with a different request.
    Exists,
    /// The engine rejected the request (the tenant stays absent).
    Unplaceable,
    Released,
    NotFound,
    /// The read saw the tenant with a request of this many milli-GPUs.
    Present(u32),
    Absent,
    /// The client gave up without an answer (timeout, or the member it asked crashed): the
    /// operation may or may not have taken effect, at any time after its invocation.
    Unknown,
    /// An answer the model does not allow at all (e.g. an unexpected error code); always wrong.
    Unexpected,
}

/// One client operation; a line of the nemesis test's `history.jsonl`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Operation {
    pub client: u32,
    pub name: String,
    pub call: Call,
    /// Where the invocation and the return fall among all events of the run ([`History::event`]):
    /// the real-time order the checker uses. Virtual time moves in millisecond steps, so several
    /// events can share one instant; their order cannot be read from the clock.
    /// An operation whose return has a lower position than another's invocation happened before
    /// it; the position must be taken before the request is sent and after the answer arrived.
    pub invoked: u64,
    /// `u64::MAX` when the outcome is unknown.
    pub returned: u64,
    /// Microseconds since the run started, for messages.
    pub invoked_us: u64,
    /// `u64::MAX` when the outcome is unknown.
    pub returned_us: u64,
    pub outcome: Outcome,
    /// Which member answered, and any detail worth printing on failure.
    #[serde(default)]
    pub note: String,
}

impl Operation {
    pub fn is_complete(&self) -> bool {
        self.outcome != Outcome::Unknown
    }
}

/// Operations of all clients, in the order they returned.
#[derive(Default)]
pub struct History {
    operations: Mutex<Vec<Operation>>,
    events: AtomicU64,
}

impl History {
    /// The position of an invocation or a return that happens now.
    pub fn event(&self) -> u64 {
        self.events.fetch_add(1, Ordering::Relaxed)
    }

    pub fn record(&self, operation: Operation) {
        assert!(
            operation.invoked < operation.returned,
            "an operation returns after it is invoked"
        );
        assert!(
            operation.invoked_us <= operation.returned_us,
            "time does not go back"
        );
        assert_eq!(
            operation.outcome == Outcome::Unknown,
            operation.returned == u64::MAX,
            "only unknown outcomes never return"
        );
        self.operations
            .lock()
            .expect("history lock")
            .push(operation);
    }

    pub fn operations(&self) -> Vec<Operation> {
        self.operations.lock().expect("history lock").clone()
    }
}

/// The operations of each tenant name.
pub fn by_name(operations: &[Operation]) -> BTreeMap<String, Vec<Operation>> {
    let mut names: BTreeMap<String, Vec<Operation>> = BTreeMap::new();
    for operation in operations {
        names
            .entry(operation.name.clone())
            .or_default()
            .push(operation.clone());
    }
    names
}

/// A fingerprint of a history, to compare two runs of one seed.
pub fn fingerprint(operations: &[Operation]) -> u64 {
    let mut hasher = DefaultHasher::new();
    operations.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operation_round_trips_through_a_json_line() {
        let operation = Operation {
            client: 3,
            name: "nemesis-07".to_owned(),
            call: Call::Place(300),
            invoked: 10,
            returned: u64::MAX,
            invoked_us: 1_500,
            returned_us: u64::MAX,
            outcome: Outcome::Unknown,
            note: "cp2: no answer within 2s".to_owned(),
        };
        let line = serde_json::to_string(&operation).expect("serialises");
        assert!(!line.contains('\n'), "one operation per line: {line}");
        let back: Operation = serde_json::from_str(&line).expect("parses");
        assert_eq!(back, operation);
        let read: Operation = serde_json::from_str(
            r#"{"client":0,"name":"t","call":"Read","invoked":1,"returned":2,"invoked_us":5,"returned_us":9,"outcome":{"Present":200}}"#,
        )
        .expect("a line without a note parses");
        assert_eq!(read.outcome, Outcome::Present(200));
        assert_eq!(read.note, "");
    }

    #[test]
    fn by_name_keeps_each_names_operations_in_order() {
        let history = History::default();
        for (index, name) in ["a", "b", "a"].into_iter().enumerate() {
            let invoked = history.event();
            let returned = history.event();
            history.record(Operation {
                client: 0,
                name: name.to_owned(),
                call: Call::Read,
                invoked,
                returned,
                invoked_us: index as u64,
                returned_us: index as u64,
                outcome: Outcome::Absent,
                note: String::new(),
            });
        }
        let names = by_name(&history.operations());
        assert_eq!(names.len(), 2);
        assert_eq!(names["a"].len(), 2);
        assert!(names["a"][0].invoked < names["a"][1].invoked);
        assert_eq!(names["b"][0].invoked, 2);
    }
}
