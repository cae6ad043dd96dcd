//! `Applier`: a member's apply task. It drives a `Follower` into the member's state machine (a
//! callback), publishes how far it applied, and answers linearizable reads: read the log's head
//! in etcd (a quorum read), then wait until applied that far.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::follower::{Applied, Follower};
use crate::log::EtcdLog;

/// How long the task waits for new entries per round: it only bounds how soon it notices that
/// its owner dropped it.
const ROUND_WAIT: Duration = Duration::from_secs(1);

/// Pause after the follower failed (etcd unreachable) before trying again.
const FAILURE_PAUSE: Duration = Duration::from_millis(100);

/// How far the task got: the last sequence number applied, or why it stopped for good.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Progress {
    Applied(u64),
    Stopped { applied: u64, reason: String },
}

/// Applies the log from a sequence number on, on its own task; dropping it stops the task.
pub struct Applier {
    log: EtcdLog,
    progress: watch::Receiver<Progress>,
    task: JoinHandle<()>,
}

impl Applier {
    /// Starts applying from `next_seq` (1, or one past the snapshot the state was loaded from).
    /// `apply` gets every `Applied` in order; an `Err` from it stops the task for good (the
    /// state machine cannot go on: a corrupt entry), and `health` then says why.
    pub fn spawn<F>(log: EtcdLog, next_seq: u64, mut apply: F) -> Applier
    where
        F: FnMut(&Applied) -> std::result::Result<(), String> + Send + 'static,
    {
        assert!(next_seq >= 1, "sequence numbers start at 1");
        let (publish, progress) = watch::channel(Progress::Applied(next_seq - 1));
        let mut follower = Follower::new(log.clone(), next_seq);
        let task = tokio::spawn(async move {
            loop {
                let applied = follower.next_seq() - 1;
                match follower.next(ROUND_WAIT).await {
                    Ok(Some(batch)) => {
                        if let Err(reason) = apply(&batch) {
                            tracing::error!(applied, reason, "applying the etcd log failed");
                            publish.send_replace(Progress::Stopped { applied, reason });
                            return;
                        }
                        let now = follower.next_seq() - 1;
                        assert!(now > applied, "a batch always moves the follower on");
                        publish.send_replace(Progress::Applied(now));
                    }
                    Ok(None) => {}
                    Err(error) => {
                        tracing::warn!(%error, applied, "following the etcd log failed; retrying");
                        tokio::time::sleep(FAILURE_PAUSE).await;
                    }
                }
                if publish.is_closed() {
                    return;
                }
            }
        });
        Applier {
            log,
            progress,
            task,
        }
    }

    /// The last sequence number applied.
    pub fn applied(&self) -> u64 {
        match &*self.progress.borrow() {
            Progress::Applied(seq) | Progress::Stopped { applied: seq, .. } => *seq,
        }
    }

    /// `Err` with the reason once applying failed for good.
    pub fn health(&self) -> std::result::Result<(), String> {
        match &*self.progress.borrow() {
            Progress::Applied(_) => Ok(()),
            Progress::Stopped { applied, reason } => Err(format!(
                "applying the etcd log stopped after entry {applied}: {reason}; this member \
                 serves nothing until it is started again"
            )),
        }
    }

    /// Waits until entries up to `seq` are applied, at most `wait`.
    pub async fn wait_applied(&self, seq: u64, wait: Duration) -> Result<()> {
        let mut progress = self.progress.clone();
        let reached = |progress: &Progress| match progress {
            Progress::Applied(applied) => *applied >= seq,
            Progress::Stopped { .. } => true,
        };
        let waited = tokio::time::timeout(wait, progress.wait_for(reached)).await;
        if let Err(reason) = self.health() {
            return Err(Error::Stopped { reason });
        }
        match waited {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(Error::Stopped {
                reason: "the apply task ended".into(),
            }),
            Err(_) => Err(Error::Lagging {
                applied: self.applied(),
                wanted: seq,
                waited: wait,
            }),
        }
    }

    /// Makes this member's applied state include every append acknowledged before the call:
    /// a linearizable read of the head in etcd, then `wait_applied` up to it. Returns the head.
    pub async fn linearize(&self, wait: Duration) -> Result<u64> {
        let started = Instant::now();
        let head = self.log.head().await?;
        let left = wait.saturating_sub(started.elapsed());
        self.wait_applied(head.seq, left).await?;
        assert!(self.applied() >= head.seq);
        Ok(head.seq)
    }
}

impl Drop for Applier {
    fn drop(&mut self) {
        self.task.abort();
    }
}
