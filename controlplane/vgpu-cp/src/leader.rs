//! What the leader loop decides by time, sans-IO: since when this leader has watched the nodes
//! itself ([`LeaderWatch`]), and which nodes are lost or back ([`judge_nodes`]).
//!
//! A node is lost only when the *current* leader, under its current term, has itself run and
//! seen no heartbeat from it for a full timeout. So a leader that was paused (SIGSTOP, a VM
//! freeze, a starved runtime) does not judge the silence it slept through: a gap between two
//! ticks of its loop longer than [`LeaderWatch`]'s bound starts its watch again, and so does a
//! new term. What it then proposes is fenced by the term too (`pool::Command::LeaderDecision`),
//! so a decision that reaches the log under a newer leader does nothing.
//!
//! **Architecture Invariant:** no clock and no I/O here: callers pass `now`, the leadership and
//! the heartbeats; tests drive pauses with explicit instants, never with sleeps.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// The leadership this member acts under: its term and its own id (openraft's `LeaderId`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leadership {
    pub term: u64,
    pub leader: u64,
}

/// Why a leader's watch over the nodes (re)started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchStart {
    /// The first tick as leader of this term.
    Elected,
    /// The loop did not run for this long (the process was paused or starved): what happened
    /// meanwhile was not observed.
    Gap(Duration),
}

/// One tick's answer: since when the leader has watched, and whether the watch starts now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Watch {
    pub since: Instant,
    pub started: Option<WatchStart>,
}

/// Since when the current leader has observed the nodes without interruption.
#[derive(Debug)]
pub struct LeaderWatch {
    current: Option<(Leadership, Instant)>,
    last_tick: Option<Instant>,
    gap_max: Duration,
}

impl LeaderWatch {
    /// `gap_max`: the longest pause between two ticks that still counts as watching.
    pub fn new(gap_max: Duration) -> LeaderWatch {
        assert!(gap_max > Duration::ZERO, "a gap bound is positive");
        LeaderWatch {
            current: None,
            last_tick: None,
            gap_max,
        }
    }

    /// One tick of the loop at `now`; `leading` is the leadership this member holds (`None`:
    /// it does not lead). Returns the watch to judge nodes by, or `None` when not leading.
    pub fn tick(&mut self, now: Instant, leading: Option<Leadership>) -> Option<Watch> {
        let gap = self
            .last_tick
            .map(|last| now.saturating_duration_since(last));
        self.last_tick = Some(now);
        let Some(leadership) = leading else {
            self.current = None;
            return None;
        };
        let started = match (self.current, gap) {
            (Some((held, _)), Some(gap)) if held == leadership && gap > self.gap_max => {
                Some(WatchStart::Gap(gap))
            }
            (Some((held, _)), _) if held == leadership => None,
            _ => Some(WatchStart::Elected),
        };
        if started.is_some() {
            self.current = Some((leadership, now));
        }
        let (held, since) = self.current.expect("set above");
        debug_assert_eq!(held, leadership);
        debug_assert!(since <= now);
        Some(Watch { since, started })
    }
}

/// A change of a node's state the leader proposes, with its reason.
pub type NodeChange = (String, placement::NodeState, String);

/// Which nodes turn lost (ready, and no heartbeat observed for more than `timeout` since
/// `since`) or ready again (lost, and a heartbeat within `timeout`). `last_beat` is when this
/// member last recorded a node's heartbeat; `first_seen` remembers when this leader first saw a
/// ready node without any (a node registered but not yet beating gets a full timeout too), and
/// is pruned to the nodes still without one.
pub fn judge_nodes<'a>(
    now: Instant,
    since: Instant,
    timeout: Duration,
    nodes: impl Iterator<Item = (&'a str, placement::NodeState)>,
    last_beat: impl Fn(&str) -> Option<Instant>,
    first_seen: &mut HashMap<String, Instant>,
) -> Vec<NodeChange> {
    assert!(since <= now, "a watch starts before it is judged");
    let mut changes = Vec::new();
    let mut silent: HashSet<&str> = HashSet::new();
    for (name, state) in nodes {
        let last = last_beat(name);
        match state {
            placement::NodeState::Ready => {
                // A beat from before this watch began was not observed by it.
                let reference = match last {
                    Some(at) => at.max(since),
                    None => {
                        silent.insert(name);
                        (*first_seen.entry(name.to_owned()).or_insert(now)).max(since)
                    }
                };
                if now.saturating_duration_since(reference) > timeout {
                    let reason =
                        format!("no heartbeat for more than {:.1}s", timeout.as_secs_f64());
                    changes.push((name.to_owned(), placement::NodeState::Lost, reason));
                }
            }
            placement::NodeState::Lost => {
                if last.is_some_and(|at| now.saturating_duration_since(at) < timeout) {
                    changes.push((
                        name.to_owned(),
                        placement::NodeState::Ready,
                        "heartbeats resumed".to_owned(),
                    ));
                }
            }
            placement::NodeState::Draining => {}
        }
    }
    // Bounded by the nodes: an entry leaves once its node has beaten, is no longer ready, or
    // is gone.
    first_seen.retain(|name, _| silent.contains(name.as_str()));
    debug_assert!(first_seen.len() <= silent.len());
    changes
}

/// Forgets the heartbeats of nodes the pool no longer has (removed by an admin), so that the
/// leader's map stays bounded by the registered nodes: a beat is recorded only for a registered
/// node, so a map larger than the pool (`nodes`) holds a removed one. Scans only then; returns
/// how many it forgot.
pub fn prune_beats<Beat>(
    beats: &mut HashMap<String, Beat>,
    nodes: usize,
    registered: impl Fn(&str) -> bool,
) -> usize {
    if beats.len() <= nodes {
        return 0;
    }
    let before = beats.len();
    beats.retain(|name, _| registered(name));
    debug_assert!(beats.len() <= nodes, "only registered nodes keep a beat");
    before - beats.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use placement::NodeState::{Lost, Ready};

    const TIMEOUT: Duration = Duration::from_secs(5);
    const TICK: Duration = Duration::from_millis(200);

    fn at(start: Instant, ms: u64) -> Instant {
        start + Duration::from_millis(ms)
    }

    /// The pause, replayed with explicit instants: a leader of term 3 ticks, is frozen
    /// for 6 s while a new leader takes over (its agents beat there), and wakes still believing
    /// it leads term 3. Its next tick is past the gap bound, so its watch starts again and no
    /// node is lost, although its last recorded beats are 6 s old.
    #[test]
    fn a_paused_leader_does_not_judge_the_silence_it_slept_through() {
        let start = Instant::now();
        let term3 = Leadership { term: 3, leader: 1 };
        let mut watch = LeaderWatch::new(Duration::from_secs(1));
        let mut ms = 0;
        while ms <= 2000 {
            let tick = watch.tick(at(start, ms), Some(term3)).expect("leads");
            assert_eq!(tick.since, start);
            ms += TICK.as_millis() as u64;
        }
        let beat = at(start, 2000);
        let woke = at(start, 8000);
        let tick = watch
            .tick(woke, Some(term3))
            .expect("still believes it leads");
        assert_eq!(tick.since, woke);
        assert_eq!(
            tick.started,
            Some(WatchStart::Gap(Duration::from_millis(6000)))
        );
        let mut first_seen = HashMap::new();
        let nodes = [("node-a", Ready), ("node-b", Ready)];
        let changes = judge_nodes(
            woke,
            tick.since,
            TIMEOUT,
            nodes.into_iter(),
            |_| Some(beat),
            &mut first_seen,
        );
        assert_eq!(changes, Vec::<NodeChange>::new());
        // Had the loop judged from its old watch, both would have been lost.
        let stale = judge_nodes(
            woke,
            start,
            TIMEOUT,
            nodes.into_iter(),
            |_| Some(beat),
            &mut first_seen,
        );
        assert_eq!(stale.len(), 2);
    }

    #[test]
    fn a_new_term_starts_a_new_watch_and_followers_have_none() {
        let start = Instant::now();
        let mut watch = LeaderWatch::new(Duration::from_secs(1));
        let term3 = Leadership { term: 3, leader: 1 };
        let term5 = Leadership { term: 5, leader: 1 };
        assert_eq!(watch.tick(start, Some(term3)).map(|w| w.since), Some(start));
        assert_eq!(watch.tick(at(start, 200), None), None);
        let again = watch.tick(at(start, 400), Some(term5)).expect("leads");
        assert_eq!(again.since, at(start, 400));
        assert_eq!(again.started, Some(WatchStart::Elected));
        // Re-elected in a later term without a follower tick in between: a new watch too.
        let term7 = Leadership { term: 7, leader: 1 };
        let later = watch.tick(at(start, 600), Some(term7)).expect("leads");
        assert_eq!(later.since, at(start, 600));
    }

    #[test]
    fn a_node_silent_for_a_full_watched_timeout_is_lost_and_comes_back() {
        let start = Instant::now();
        let mut first_seen = HashMap::new();
        let beat = at(start, 100);
        let nodes = [("quiet", Ready)];
        let early = judge_nodes(
            at(start, 5000),
            start,
            TIMEOUT,
            nodes.into_iter(),
            |_| Some(beat),
            &mut first_seen,
        );
        assert!(early.is_empty(), "4.9 s of silence is within the timeout");
        let late = judge_nodes(
            at(start, 5200),
            start,
            TIMEOUT,
            nodes.into_iter(),
            |_| Some(beat),
            &mut first_seen,
        );
        assert_eq!(late.len(), 1);
        assert_eq!(late[0].1, Lost);
        let back = judge_nodes(
            at(start, 9000),
            start,
            TIMEOUT,
            [("quiet", Lost)].into_iter(),
            |_| Some(at(start, 8900)),
            &mut first_seen,
        );
        assert_eq!(back[0].1, Ready);
    }

    #[test]
    fn a_node_that_never_beat_gets_a_full_timeout_from_when_it_was_first_seen() {
        let start = Instant::now();
        let mut first_seen = HashMap::new();
        let nodes = [("new", Ready)];
        let none = |_: &str| None;
        let seen = at(start, 10_000);
        assert!(
            judge_nodes(
                seen,
                start,
                TIMEOUT,
                nodes.into_iter(),
                none,
                &mut first_seen
            )
            .is_empty()
        );
        assert_eq!(first_seen.get("new"), Some(&seen));
        assert!(
            judge_nodes(
                at(start, 14_000),
                start,
                TIMEOUT,
                nodes.into_iter(),
                none,
                &mut first_seen
            )
            .is_empty()
        );
        let lost = judge_nodes(
            at(start, 15_100),
            start,
            TIMEOUT,
            nodes.into_iter(),
            none,
            &mut first_seen,
        );
        assert_eq!(lost.len(), 1);
        judge_nodes(
            at(start, 15_200),
            start,
            TIMEOUT,
            nodes.into_iter(),
            |_| Some(at(start, 15_150)),
            &mut first_seen,
        );
        assert!(first_seen.is_empty(), "a node that beats leaves first_seen");
    }

    /// Issue 22 follow-up: a removed node's last beat left the leader's map only with a
    /// restart; now the next tick that finds more beats than nodes forgets it.
    #[test]
    fn beats_of_removed_nodes_are_forgotten() {
        let mut beats: HashMap<String, u32> = [("node-a", 1), ("node-b", 2)]
            .map(|(name, at)| (name.to_owned(), at))
            .into();
        let registered = |name: &str| name == "node-b" || name == "node-c";
        // node-a removed, node-c registered but silent: as many beats as nodes, nothing scanned.
        assert_eq!(prune_beats(&mut beats, 2, registered), 0);
        assert_eq!(beats.len(), 2);
        beats.insert("node-c".to_owned(), 3);
        assert_eq!(prune_beats(&mut beats, 2, registered), 1);
        assert!(!beats.contains_key("node-a"));
        assert_eq!(beats.len(), 2);
    }
}
