//! Follower-side batching of forwarded heartbeats. With 10,000 nodes beating once a second and
//! two thirds of them connected to followers, forwarding each beat as its own `Raft.Forward`
//! call meant about 6,000 calls a second into the leader, each with its HTTP/2 framing and
//! task wake-ups. A follower instead queues the beats it receives and forwards them in batches:
//! one call per batch (`ForwardRequest::HeartbeatBatch`), and each caller gets its own beat's
//! answer back.
//!
//! Bounds ([`BatchLimits`]): the queue holds at most `queue_beats_max` beats (a caller waits for
//! room, and its agent's call timeout bounds that wait); a batch takes at most
//! `beats_per_batch_max` beats and waits at most `linger` after its first; at most
//! `batches_in_flight_max` batches are on their way to the leader at once (the collector waits
//! for one to finish, and the queue fills behind it). Beats whose caller gave up while queued
//! are dropped before sending.
//!
//! The batching loop [`run`] takes the forwarding as a function, so tests drive it without a
//! cluster; `ControlPlane::forward_beats` is the real one.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tonic::Status;

/// What the leader answers for one heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BeatAnswer {
    /// False when the node is not registered: the agent registers again.
    pub known: bool,
    /// True when the leader does not hold the report the beat referred to.
    pub report_wanted: bool,
}

/// What a queued beat's caller gets.
#[derive(Debug, Clone)]
pub enum BeatOutcome {
    Answered(BeatAnswer),
    Failed(Status),
    /// The leader did not take the batch (an older version, or a failure mid-call whose outcome
    /// is unknown): forward this beat on its own.
    Single,
}

/// One beat waiting for a batch: the encoded `HeartbeatRequest` and where its answer goes.
#[derive(Debug)]
pub struct QueuedBeat {
    pub request: Vec<u8>,
    pub answer: oneshot::Sender<BeatOutcome>,
}

/// The bounds of the batcher (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    pub queue_beats_max: usize,
    pub beats_per_batch_max: usize,
    pub linger: Duration,
    pub batches_in_flight_max: usize,
}

impl Default for BatchLimits {
    /// 5 ms of linger adds little to a beat (agents beat every second) and, at 6,000 forwarded
    /// beats a second, makes batches of about 30; 512 beats per batch keep a batch below about
    /// 150 KB even when every beat carries an 8-GPU report.
    fn default() -> Self {
        BatchLimits {
            queue_beats_max: 16_384,
            beats_per_batch_max: 512,
            linger: Duration::from_millis(5),
            batches_in_flight_max: 8,
        }
    }
}

impl BatchLimits {
    fn assert_valid(&self) {
        assert!(self.queue_beats_max > 0, "a queue");
        assert!(self.beats_per_batch_max > 0, "a batch");
        assert!(self.batches_in_flight_max > 0, "batches in flight");
        assert!(self.linger <= Duration::from_secs(1), "a short linger");
    }
}

/// What forwarding one batch yields: one answer (or error) per beat, in order, or one outcome
/// for all of them.
pub type BatchResult = Result<Vec<Result<BeatAnswer, String>>, BeatOutcome>;

/// A queue for [`run`], bounded by `limits.queue_beats_max`.
pub fn queue(limits: &BatchLimits) -> (mpsc::Sender<QueuedBeat>, mpsc::Receiver<QueuedBeat>) {
    limits.assert_valid();
    mpsc::channel(limits.queue_beats_max)
}

/// Takes beats from `queue` in batches and hands each batch to `forward`, until the queue is
/// closed and empty.
pub async fn run<Forward, Forwarding>(
    mut queue: mpsc::Receiver<QueuedBeat>,
    limits: BatchLimits,
    forward: Forward,
) where
    Forward: Fn(Vec<Vec<u8>>) -> Forwarding + Clone + Send + 'static,
    Forwarding: Future<Output = BatchResult> + Send + 'static,
{
    limits.assert_valid();
    let in_flight = Arc::new(Semaphore::new(limits.batches_in_flight_max));
    while let Some(batch) = collect(&mut queue, &limits).await {
        let permit = in_flight
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let forward = forward.clone();
        tokio::spawn(async move {
            send(batch, forward).await;
            drop(permit);
        });
    }
}

/// Waits for a first beat, then takes more until the batch is full or `linger` has passed since
/// the first. `None` once the queue is closed and empty.
pub async fn collect(
    queue: &mut mpsc::Receiver<QueuedBeat>,
    limits: &BatchLimits,
) -> Option<Vec<QueuedBeat>> {
    let first = queue.recv().await?;
    let deadline = tokio::time::Instant::now() + limits.linger;
    let mut batch = Vec::with_capacity(limits.beats_per_batch_max.min(64));
    batch.push(first);
    while batch.len() < limits.beats_per_batch_max {
        match tokio::time::timeout_at(deadline, queue.recv()).await {
            Ok(Some(beat)) => batch.push(beat),
            Ok(None) | Err(_) => break,
        }
    }
    assert!(!batch.is_empty() && batch.len() <= limits.beats_per_batch_max);
    Some(batch)
}

/// Forwards one batch and answers each of its callers with its own result.
pub async fn send<Forward, Forwarding>(batch: Vec<QueuedBeat>, forward: Forward)
where
    Forward: FnOnce(Vec<Vec<u8>>) -> Forwarding,
    Forwarding: Future<Output = BatchResult>,
{
    // A caller that gave up (its agent's call timed out) needs no answer.
    let (requests, answers): (Vec<Vec<u8>>, Vec<oneshot::Sender<BeatOutcome>>) = batch
        .into_iter()
        .filter(|beat| !beat.answer.is_closed())
        .map(|beat| (beat.request, beat.answer))
        .unzip();
    if requests.is_empty() {
        return;
    }
    let count = requests.len();
    match forward(requests).await {
        Ok(results) if results.len() == count => {
            for (answer, result) in answers.into_iter().zip(results) {
                let outcome = match result {
                    Ok(beat) => BeatOutcome::Answered(beat),
                    Err(message) => {
                        BeatOutcome::Failed(api::ErrorCode::InvalidArgument.status(message))
                    }
                };
                // The caller may have given up meanwhile.
                let _ = answer.send(outcome);
            }
        }
        Ok(results) => {
            let status = api::ErrorCode::Internal.status(format!(
                "the leader answered {} of {count} forwarded heartbeats",
                results.len()
            ));
            for answer in answers {
                let _ = answer.send(BeatOutcome::Failed(status.clone()));
            }
        }
        Err(outcome) => {
            for answer in answers {
                let _ = answer.send(outcome.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn limits(batch: usize, queue_beats: usize) -> BatchLimits {
        BatchLimits {
            queue_beats_max: queue_beats,
            beats_per_batch_max: batch,
            linger: Duration::from_millis(5),
            batches_in_flight_max: 2,
        }
    }

    fn beat(index: u8) -> (QueuedBeat, oneshot::Receiver<BeatOutcome>) {
        let (answer, receiver) = oneshot::channel();
        let beat = QueuedBeat {
            request: vec![index],
            answer,
        };
        (beat, receiver)
    }

    /// A leader that knows nodes with even bytes and wants a report from multiples of three;
    /// byte 255 does not decode. Records every batch it got.
    fn fake_leader(
        batches: Arc<Mutex<Vec<Vec<u8>>>>,
    ) -> impl Fn(Vec<Vec<u8>>) -> std::future::Ready<BatchResult> + Clone + Send + 'static {
        move |requests: Vec<Vec<u8>>| {
            batches
                .lock()
                .unwrap()
                .push(requests.iter().map(|r| r[0]).collect());
            let answers = requests
                .iter()
                .map(|request| match request[0] {
                    255 => Err("does not decode".to_owned()),
                    byte => Ok(BeatAnswer {
                        known: byte % 2 == 0,
                        report_wanted: byte % 3 == 0,
                    }),
                })
                .collect();
            std::future::ready(Ok(answers))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn batches_are_bounded_and_every_caller_gets_its_own_answer() {
        let limits = limits(4, 64);
        let (sender, receiver) = queue(&limits);
        let batches = Arc::new(Mutex::new(Vec::new()));
        let mut waiting = Vec::new();
        for index in 0..10u8 {
            let (queued, answer) = beat(index);
            sender.send(queued).await.unwrap();
            waiting.push((index, answer));
        }
        let (queued, bad) = beat(255);
        sender.send(queued).await.unwrap();
        let runner = tokio::spawn(run(receiver, limits, fake_leader(batches.clone())));
        for (index, answer) in waiting {
            match answer.await.unwrap() {
                BeatOutcome::Answered(answer) => assert_eq!(
                    answer,
                    BeatAnswer {
                        known: index % 2 == 0,
                        report_wanted: index % 3 == 0
                    },
                    "beat {index}"
                ),
                other => panic!("beat {index}: {other:?}"),
            }
        }
        assert!(matches!(bad.await.unwrap(), BeatOutcome::Failed(_)));
        // 11 queued beats in batches of at most 4, in order: one call per batch, not per beat.
        let sent = batches.lock().unwrap().clone();
        assert_eq!(sent, [vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9, 255]]);
        drop(sender);
        runner.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_waits_no_longer_than_its_linger() {
        let limits = limits(100, 64);
        let (sender, mut receiver) = queue(&limits);
        let (first, _first_answer) = beat(1);
        sender.send(first).await.unwrap();
        let started = tokio::time::Instant::now();
        let late_sender = sender.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let (late, _late_answer) = beat(2);
            let _ = late_sender.send(late).await;
        });
        let batch = collect(&mut receiver, &limits).await.unwrap();
        assert_eq!(batch.len(), 1, "the late beat is left for the next batch");
        assert_eq!(started.elapsed(), limits.linger);
        let next = collect(&mut receiver, &limits).await.unwrap();
        assert_eq!(next[0].request, [2]);
        drop(sender);
        assert!(collect(&mut receiver, &limits).await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn the_queue_is_bounded_and_callers_that_left_are_not_forwarded() {
        let limits = limits(8, 2);
        let (sender, receiver) = queue(&limits);
        let (first, first_answer) = beat(1);
        let (second, second_answer) = beat(2);
        sender.try_send(first).unwrap();
        sender.try_send(second).unwrap();
        let (third, _third_answer) = beat(3);
        assert!(
            matches!(
                sender.try_send(third),
                Err(mpsc::error::TrySendError::Full(_))
            ),
            "a full queue takes no more beats"
        );
        drop(first_answer);
        let batches = Arc::new(Mutex::new(Vec::new()));
        drop(sender);
        run(receiver, limits, fake_leader(batches.clone())).await;
        // Let the spawned send finish.
        tokio::task::yield_now().await;
        assert!(matches!(
            second_answer.await.unwrap(),
            BeatOutcome::Answered(_)
        ));
        assert_eq!(*batches.lock().unwrap(), [vec![2]]);
    }

    #[tokio::test]
    async fn a_refused_batch_or_a_short_answer_reaches_every_caller() {
        let (first, first_answer) = beat(1);
        let (second, second_answer) = beat(2);
        send(vec![first, second], |_| async { Err(BeatOutcome::Single) }).await;
        assert!(matches!(first_answer.await.unwrap(), BeatOutcome::Single));
        assert!(matches!(second_answer.await.unwrap(), BeatOutcome::Single));

        let (first, first_answer) = beat(1);
        let (second, second_answer) = beat(2);
        send(vec![first, second], |_| async {
            Ok(vec![Ok(BeatAnswer {
                known: true,
                report_wanted: false,
            })])
        })
        .await;
        for answer in [first_answer, second_answer] {
            match answer.await.unwrap() {
                BeatOutcome::Failed(status) => assert!(status.message().contains("1 of 2")),
                other => panic!("{other:?}"),
            }
        }
    }
}
