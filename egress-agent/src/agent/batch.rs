//! When a pass that a state change asks for may start (`--state-batch-max-ms`).
//!
//! Every pass compiles the whole cluster view: at 100 nodes and 100k pods that is about
//! half a second, and pod events 10 times a second kept passes running back to back, a
//! core per agent. So a change that finds the agent quiet is passed at once, and one that
//! comes while passes are expensive waits until the last pass has rested [`FACTOR`] - 1
//! times its own duration (passes then take at most 1/[`FACTOR`] of a core), but never
//! more than the bound after that pass ended; every change that arrives meanwhile is
//! taken by the same pass. Cheap passes rest for almost nothing: at a few thousand pods
//! nothing waits noticeably.
//!
//! A pass's duration is its wall time, not the CPU it spent, on purpose: on a machine
//! whose cores are busy a pass of 20 ms of CPU takes 400 ms or more of wall time, and the
//! longer rest that follows is what keeps a starved node from passing more often. Resting
//! for the CPU instead was tried at 100 agents on 2 cores (docs/benchmarks.md): the
//! passes per event went from 2.3-4.9 to 7.5-9.3 per agent and every event's row got
//! slower. Each `reconciled` log line gives both (`took_ms`, `cpu_ms`).
//!
//! Only the state source waits. The liveness service (failover), netlink, the timers a
//! pass asks for and the resync tick wake a pass at once, and that pass takes any
//! pending change with it (every pass reads the newest view).

use std::time::{Duration, Instant};

/// A pass's cost sets the gap to the next state pass: it begins no sooner than `FACTOR`
/// times the last pass's duration after that pass began.
pub const FACTOR: u32 = 4;

/// The default of `--state-batch-max-ms`: the longest rest after a pass.
pub const DEFAULT_MAX_REST_MS: u64 = 1_000;

/// When the next pass a state change asks for may begin.
#[derive(Clone, Copy, Debug)]
pub struct StateBatch {
    /// The longest rest after a pass; zero: none, every change passes at once.
    max_rest: Duration,
    /// When the last pass (whatever woke it) began, and how long it took.
    last: Option<(Instant, Duration)>,
}

impl StateBatch {
    /// A batch that has seen no pass yet: the first change passes at once.
    pub fn new(max_rest: Duration) -> Self {
        Self {
            max_rest,
            last: None,
        }
    }

    /// A pass began at `began` and took `took` (whatever woke it: it took every change).
    pub fn ran(&mut self, began: Instant, took: Duration) {
        self.last = Some((began, took));
    }

    /// How long the agent rests after the last pass before a state pass: `FACTOR` - 1
    /// times that pass's duration, at most the bound.
    pub fn rest(&self) -> Duration {
        self.last.map_or(Duration::ZERO, |(_, took)| {
            took.saturating_mul(FACTOR - 1).min(self.max_rest)
        })
    }

    /// When a state pass for a change seen at `now` may begin: `now` if the agent has
    /// rested enough since its last pass, else when it will have.
    pub fn start_at(&self, now: Instant) -> Instant {
        let Some((began, took)) = self.last else {
            return now;
        };
        began
            .checked_add(took + self.rest())
            .map_or(now, |at| at.max(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A batch whose last pass began at `t0` and took `took` ms, bounded by `max` ms.
    fn after_pass(t0: Instant, took: u32, max: u32) -> StateBatch {
        let mut b = StateBatch::new(MS * max);
        b.ran(t0, MS * took);
        b
    }

    #[test]
    fn a_first_change_passes_at_once() {
        let now = Instant::now();
        assert_eq!(StateBatch::new(MS * 1_000).start_at(now), now);
    }

    /// (last pass's duration, bound, change seen after the pass began, pass starts after
    /// the last one began), all in ms.
    #[test]
    fn a_change_waits_for_the_rest_after_an_expensive_pass() {
        let cases = [
            // Quiet: the last pass is long over.
            (500, 1_000, 5_000, 5_000),
            (10, 1_000, 100, 100),
            // Cheap passes rest three times their duration: barely noticed.
            (10, 1_000, 12, 40),
            // A change during a half-second pass: the pass, then 1 s (the bound, not 1.5 s).
            (500, 1_000, 100, 1_500),
            (500, 1_000, 700, 1_500),
            (500, 2_000, 700, 2_000),
            // Past the rest: at once.
            (500, 1_000, 1_600, 1_600),
            // No bound: every change passes once the last pass is over.
            (500, 0, 100, 500),
            (500, 0, 900, 900),
        ];
        let t0 = Instant::now();
        for (took, max, seen, want) in cases {
            let b = after_pass(t0, took, max);
            assert_eq!(
                b.start_at(t0 + MS * seen),
                t0 + MS * want,
                "pass of {took} ms, bound {max} ms, change at {seen} ms"
            );
        }
    }

    #[test]
    fn passes_take_at_most_a_quarter_of_a_core_below_the_bound() {
        let b = after_pass(Instant::now(), 200, 1_000);
        assert_eq!(b.rest(), MS * 600);
        // Above it, the bound holds: a pass of 2 s rests 1 s.
        assert_eq!(after_pass(Instant::now(), 2_000, 1_000).rest(), MS * 1_000);
    }

    #[test]
    fn every_pass_counts_whatever_woke_it() {
        let t0 = Instant::now();
        let mut b = after_pass(t0, 500, 1_000);
        // A probe pass at 3 s, cheap: the next change waits only for its short rest.
        b.ran(t0 + MS * 3_000, MS * 20);
        assert_eq!(b.start_at(t0 + MS * 3_030), t0 + MS * 3_080);
    }
}
