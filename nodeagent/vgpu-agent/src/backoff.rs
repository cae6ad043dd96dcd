//! Exponential backoff for the agent's retry loops: each delay doubles from `initial` up to
//! `max`, and a success resets it. Every retry loop of the agent sleeps through one of these, so
//! no loop spins faster than `initial` and a long outage costs one attempt per `max`.

use std::time::Duration;

/// Delays 100 ms, 200 ms, 400 ms, ... up to 2 s by default.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        assert!(!initial.is_zero(), "a zero backoff would spin");
        assert!(initial <= max, "the first delay is at most the largest");
        Backoff {
            initial,
            max,
            next: initial,
        }
    }

    /// The delay to wait now; the following one is twice as long, up to the maximum.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        assert!(delay >= self.initial && delay <= self.max);
        delay
    }

    /// Starts again from the first delay, after a success.
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_maximum_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let delays: Vec<u128> = (0..7).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 2000, 2000]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_millis(100));
    }
}
