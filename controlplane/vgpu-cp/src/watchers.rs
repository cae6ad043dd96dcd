//! Per-node wake-ups for `WatchAssignments` streams.
//!
//! A stream needs waking only when its node's assignments change. Waiting on the applied index
//! instead woke every stream of a member on every applied entry: with 10,000 nodes that is
//! thousands of task wake-ups (and as many state lookups) per entry, most of a member's work at
//! that scale. Instead, one dispatcher task per member waits on the applied index, finds the
//! nodes whose revision moved since it last looked, and wakes only their streams.
//!
//! This relies on how `PoolState` keeps revisions: a node's revision is the index of the entry
//! that last changed it, so it only grows, and "changed since the dispatcher last looked" is
//! "revision above the applied index it saw then" (one pass over the revisions, integer
//! comparisons only). A stream that subscribes before it reads the state misses nothing: a change
//! after the subscription marks it changed.
//!
//! Every stream also wakes when a certificate is revoked (the dispatcher counts the revoked
//! serials), so that a stream whose caller's certificate was revoked is closed as soon as this
//! member applies the revocation (issue 22: such a stream kept receiving updates).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::watch;

use crate::store::Shared;

/// The streams' wake-up channels, by node (each channel carries the node's latest revision).
pub struct NodeWatchers {
    senders: Mutex<HashMap<String, watch::Sender<u64>>>,
    /// How many certificates the applied state lists as revoked (it only grows).
    revocations: watch::Sender<usize>,
    dispatcher_started: AtomicBool,
}

impl Default for NodeWatchers {
    fn default() -> NodeWatchers {
        NodeWatchers {
            senders: Mutex::default(),
            revocations: watch::channel(0).0,
            dispatcher_started: AtomicBool::new(false),
        }
    }
}

/// One stream's wake-ups; dropping it forgets the node once no stream watches it.
pub struct Subscription {
    node: String,
    receiver: watch::Receiver<u64>,
    revocations: watch::Receiver<usize>,
    shared: Weak<Shared>,
}

/// Subscribes to `node`'s assignment changes on this member, starting the member's dispatcher on
/// first use (it needs a tokio runtime).
pub fn subscribe(shared: &Arc<Shared>, node: &str) -> Subscription {
    let watchers = &shared.watchers;
    if !watchers.dispatcher_started.swap(true, Ordering::AcqRel) {
        // What was applied before now is in the state every stream reads after subscribing;
        // the dispatcher looks for changes after it (not after whatever is applied by the time
        // the task first runs).
        let applied = shared.applied_index.subscribe();
        let seen = *applied.borrow();
        tokio::spawn(dispatch(Arc::downgrade(shared), applied, seen));
    }
    let mut senders = watchers.senders.lock().expect("watchers lock");
    let receiver = senders
        .entry(node.to_owned())
        .or_insert_with(|| watch::channel(0).0)
        .subscribe();
    Subscription {
        node: node.to_owned(),
        receiver,
        revocations: watchers.revocations.subscribe(),
        shared: Arc::downgrade(shared),
    }
}

impl Subscription {
    /// Waits until the node's assignments may have changed, or a certificate was revoked (the
    /// stream then checks its caller's). `false`: the member is stopping.
    pub async fn changed(&mut self) -> bool {
        tokio::select! {
            changed = self.receiver.changed() => changed.is_ok(),
            changed = self.revocations.changed() => changed.is_ok(),
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        let mut senders = shared.watchers.senders.lock().expect("watchers lock");
        // This subscription's receiver still counts while it is being dropped.
        if senders
            .get(&self.node)
            .is_some_and(|sender| sender.receiver_count() <= 1)
        {
            senders.remove(&self.node);
        }
    }
}

/// Wakes the streams of the nodes whose revision moved, after every change of the applied index,
/// until the member's state is dropped.
async fn dispatch(shared: Weak<Shared>, mut applied: watch::Receiver<u64>, mut seen: u64) {
    while applied.changed().await.is_ok() {
        let index = *applied.borrow_and_update();
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let (changed, revoked): (Vec<(String, u64)>, usize) = {
            let state = shared.read();
            let changed = state
                .pool
                .node_revisions
                .iter()
                .filter(|(_, revision)| **revision > seen)
                .map(|(node, revision)| (node.clone(), *revision))
                .collect();
            (changed, state.pool.revoked.len())
        };
        shared.watchers.revocations.send_if_modified(|count| {
            let grew = revoked != *count;
            *count = revoked;
            grew
        });
        // The state may already hold entries past `index`; they are looked at again next time,
        // which wakes a stream twice at worst.
        seen = seen.max(index);
        if changed.is_empty() {
            continue;
        }
        let senders = shared.watchers.senders.lock().expect("watchers lock");
        for (node, revision) in changed {
            if let Some(sender) = senders.get(&node) {
                sender.send_replace(revision);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn only_the_streams_of_changed_nodes_wake_and_revocations_wake_all() {
        let directory = tempfile::tempdir().unwrap();
        let (_store, shared) = crate::store::StateMachineStore::open(directory.path()).unwrap();
        let mut a = subscribe(&shared, "node-a");
        let mut b = subscribe(&shared, "node-b");
        let mut a_again = subscribe(&shared, "node-a");
        let change = |node: &str, index: u64| {
            let mut state = shared.applied.write().unwrap();
            state.pool.node_revisions.insert(node.to_owned(), index);
            drop(state);
            shared.applied_index.send_replace(index);
        };
        async fn woke(subscription: &mut Subscription) -> bool {
            let wait = subscription.changed();
            tokio::time::timeout(Duration::from_millis(200), wait)
                .await
                .is_ok()
        }

        change("node-a", 3);
        assert!(woke(&mut a).await, "node-a changed");
        assert!(woke(&mut a_again).await, "both streams of node-a wake");
        assert!(!woke(&mut b).await, "node-b did not change");
        // An entry that changes no node (a release elsewhere, a retry) wakes no one.
        shared.applied_index.send_replace(4);
        assert!(!woke(&mut a).await);
        change("node-b", 5);
        assert!(woke(&mut b).await);
        assert!(!woke(&mut a).await);

        // A revocation wakes every stream (each checks its own caller's certificate).
        {
            let mut state = shared.applied.write().unwrap();
            state.pool.revoked.insert("1f".to_owned(), 1);
        }
        shared.applied_index.send_replace(6);
        assert!(woke(&mut a).await, "a revocation wakes node-a's stream");
        assert!(woke(&mut b).await, "and node-b's");
        shared.applied_index.send_replace(7);
        assert!(!woke(&mut a).await, "nothing more was revoked");

        // The channel of a node goes away with its last stream.
        drop(a);
        assert!(
            shared
                .watchers
                .senders
                .lock()
                .unwrap()
                .contains_key("node-a")
        );
        drop(a_again);
        assert!(
            !shared
                .watchers
                .senders
                .lock()
                .unwrap()
                .contains_key("node-a")
        );
        assert!(
            shared
                .watchers
                .senders
                .lock()
                .unwrap()
                .contains_key("node-b")
        );
    }
}
