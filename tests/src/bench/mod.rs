//! `cargo xtask bench`: per-packet `BPF_PROG_TEST_RUN` timings of the datapath next to an
//! empty-program floor ([`per_packet`]), the lab sections ([`lab`]), and the markdown
//! report ([`report`]). Benchmarks are measured and reported, never asserted.

pub mod churn;
pub mod empty;
pub mod failover;
pub mod frame;
pub mod lab;
pub mod per_packet;
pub mod probes;
pub mod report;
pub mod scale;
pub mod source;
pub mod spread;
pub mod yaml;

/// One `BPF_PROG_TEST_RUN` call: the verdict of the last run and the kernel's own average
/// time per run (whole nanoseconds, truncated by the kernel).
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub verdict: u32,
    pub ns: u32,
}

/// How much to measure.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub quick: bool,
    /// Rounds per case; the report gives median, min and max over rounds.
    pub rounds: usize,
    /// Program runs per round for the repeated cases.
    pub repeats: u32,
    /// Single runs (`repeat = 1`) per round for the new-flow case and its floor.
    pub singles: u32,
}

impl Plan {
    pub const FULL: Plan = Plan {
        quick: false,
        rounds: 5,
        repeats: 1_000_000,
        singles: 20_000,
    };
    pub const QUICK: Plan = Plan {
        quick: true,
        rounds: 3,
        repeats: 200_000,
        singles: 5_000,
    };
}

/// Median, min and max of a set of samples (one per round).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Spread {
    /// `None` for an empty set.
    pub fn of(samples: &[f64]) -> Option<Spread> {
        let mut s: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        if s.is_empty() {
            return None;
        }
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: s[0],
            max: s[n - 1],
            n,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Spread;

    #[test]
    fn spread_of_odd_and_even_sets() {
        let s = Spread::of(&[3.0, 1.0, 2.0]).expect("non-empty");
        assert_eq!((s.median, s.min, s.max, s.n), (2.0, 1.0, 3.0, 3));
        let s = Spread::of(&[4.0, 1.0, 2.0, 3.0]).expect("non-empty");
        assert_eq!(s.median, 2.5);
        assert!(Spread::of(&[]).is_none());
    }
}
