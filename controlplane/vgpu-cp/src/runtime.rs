//! The async runtime Raft runs on: tokio, except that the randomness openraft draws (election
//! timeouts) comes from a per-thread generator that a test can seed.
//!
//! Production behaves exactly as with openraft's `TokioRuntime`: the generator is seeded from OS
//! entropy. The deterministic simulation (`tests/sim`) calls [`seed_thread_rng`] on the thread
//! that runs its current-thread tokio runtime, so a seed replays the same election timeouts.

use openraft::AsyncRuntime;
use openraft::OptionalSend;
use openraft::async_runtime::TokioOneShotSender;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use std::cell::RefCell;
use std::future::Future;
use std::time::Duration;

thread_local! {
    /// The generator behind [`ThreadRng`]; one per thread, from OS entropy until re-seeded.
    static THREAD_RNG: RefCell<StdRng> = RefCell::new(StdRng::from_entropy());
}

/// Re-seeds this thread's generator, so what openraft draws on this thread from now on is
/// reproducible. Tasks of a current-thread runtime driven from this thread all draw from it.
pub fn seed_thread_rng(seed: u64) {
    THREAD_RNG.with(|rng| *rng.borrow_mut() = StdRng::seed_from_u64(seed));
}

/// A handle to the calling thread's generator; every draw reads the generator of the thread it
/// runs on (openraft uses it right away and never keeps it).
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadRng;

impl RngCore for ThreadRng {
    fn next_u32(&mut self) -> u32 {
        THREAD_RNG.with(|rng| rng.borrow_mut().next_u32())
    }

    fn next_u64(&mut self) -> u64 {
        THREAD_RNG.with(|rng| rng.borrow_mut().next_u64())
    }

    fn fill_bytes(&mut self, destination: &mut [u8]) {
        THREAD_RNG.with(|rng| rng.borrow_mut().fill_bytes(destination));
    }

    fn try_fill_bytes(&mut self, destination: &mut [u8]) -> Result<(), rand::Error> {
        THREAD_RNG.with(|rng| rng.borrow_mut().try_fill_bytes(destination))
    }
}

/// tokio, with [`ThreadRng`] as openraft's source of randomness.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VgpuRuntime;

impl AsyncRuntime for VgpuRuntime {
    type JoinError = tokio::task::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = tokio::task::JoinHandle<T>;
    type Sleep = tokio::time::Sleep;
    type Instant = tokio::time::Instant;
    type TimeoutError = tokio::time::error::Elapsed;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = tokio::time::Timeout<T>;
    type ThreadLocalRng = ThreadRng;
    type OneshotSender<T: OptionalSend> = TokioOneShotSender<T>;
    type OneshotReceiver<T: OptionalSend> = tokio::sync::oneshot::Receiver<T>;
    type OneshotReceiverError = tokio::sync::oneshot::error::RecvError;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        tokio::spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        tokio::time::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        tokio::time::sleep_until(deadline)
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(
        duration: Duration,
        future: F,
    ) -> Self::Timeout<R, F> {
        tokio::time::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(
        deadline: Self::Instant,
        future: F,
    ) -> Self::Timeout<R, F> {
        tokio::time::timeout_at(deadline, future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        join_error.is_panic()
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        ThreadRng
    }

    fn oneshot<T>() -> (Self::OneshotSender<T>, Self::OneshotReceiver<T>)
    where
        T: OptionalSend,
    {
        let (sender, receiver) = tokio::sync::oneshot::channel();
        (TokioOneShotSender(sender), receiver)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    #[test]
    fn a_seed_replays_the_same_draws() {
        seed_thread_rng(7);
        let first: Vec<u64> = (0..4)
            .map(|_| VgpuRuntime::thread_rng().gen_range(150..300))
            .collect();
        seed_thread_rng(7);
        let second: Vec<u64> = (0..4)
            .map(|_| VgpuRuntime::thread_rng().gen_range(150..300))
            .collect();
        assert_eq!(first, second);
        assert!(first.iter().all(|timeout| (150..300).contains(timeout)));
    }
}
