//! The phases of a nemesis run, and the clock every client stamps operations with.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

/// What the nemesis is doing while a request is invoked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// No fault yet.
    Warmup,
    /// The leader is disconnected from the cluster network.
    Partition,
    /// A member (the leader) is frozen with `docker pause`.
    Pause,
    /// The leader is frozen while a churn load places and releases tenants as fast as the
    /// members answer.
    ChurnPause,
    /// Registrations as large as admission allows, then a follower paused: it must catch up.
    BulkRegistration,
    /// Members are killed with SIGKILL and started again.
    Kill,
    /// Every member in turn is stopped and started (`docker restart`): no request may fail.
    RollingRestart,
    /// Faults healed; the cluster settles.
    Quiet,
}

impl Phase {
    const ALL: [Phase; 8] = [
        Phase::Warmup,
        Phase::Partition,
        Phase::Pause,
        Phase::ChurnPause,
        Phase::BulkRegistration,
        Phase::Kill,
        Phase::RollingRestart,
        Phase::Quiet,
    ];

    fn index(self) -> u8 {
        Phase::ALL
            .iter()
            .position(|phase| *phase == self)
            .expect("every phase is listed") as u8
    }
}

/// The run's clock and current phase, shared by the nemesis (which sets the phase) and the
/// clients (which read it).
#[derive(Clone)]
pub struct PhaseClock {
    start: Instant,
    phase: Arc<AtomicU8>,
}

impl Default for PhaseClock {
    fn default() -> PhaseClock {
        PhaseClock {
            start: Instant::now(),
            phase: Arc::new(AtomicU8::new(Phase::Warmup.index())),
        }
    }
}

impl PhaseClock {
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_micros()).expect("a run lasts less than 500000 years")
    }

    pub fn elapsed_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub fn phase(&self) -> Phase {
        Phase::ALL[usize::from(self.phase.load(Ordering::SeqCst))]
    }

    pub fn set_phase(&self, phase: Phase) {
        self.phase.store(phase.index(), Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_phase_set_is_the_phase_read() {
        let clock = PhaseClock::default();
        assert_eq!(clock.phase(), Phase::Warmup);
        for phase in Phase::ALL {
            clock.clone().set_phase(phase);
            assert_eq!(clock.phase(), phase);
        }
    }
}
