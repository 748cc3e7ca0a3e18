//! Packet fuzzing of the three programs through `BPF_PROG_TEST_RUN`: a seeded generator
//! ([`cases`], [`mutate`]) makes realistic, broken and random frames, each program runs them
//! one by one against maps set up like a busy node ([`node`]), and every packet's verdict,
//! output and counters are held to the datapath's properties ([`check`]).
//!
//! One namespace and one loaded object serve the whole run (loading and verifying take
//! longer than a hundred thousand packets); the programs run one after the other on the
//! same maps, so the flows that `from_pod` and `from_tunnel` create are there for
//! `from_secondary`'s replies. The counters are read whole before and after every packet
//! ([`counters`]), which is how each packet's counters are known without reloading.
//!
//! A seed reproduces a run's packets exactly (each case is a function of the seed, the
//! program and its index: [`cases::case`]); what the kernel draws (SNAT ports) and the
//! clock may differ between runs.
//!
//! `cargo xtask fuzz --packets N [--seed S]` runs it (`egress-fuzz`, release build);
//! `tests/tests/fuzz.rs` runs a short one in `cargo xtask test`.

/// One of the values, drawn evenly; every value is evaluated first, so values may draw
/// from the generator too (`pick!(rng, [1, 2, rng.u8()])`).
macro_rules! pick {
    ($rng:ident, [$($x:expr),+ $(,)?]) => {{
        let xs = [$($x),+];
        xs[$rng.below(xs.len())]
    }};
}

/// One of the values, drawn by weight: `weighted!(rng, [(3, a), (1, b)])`.
macro_rules! weighted {
    ($rng:ident, [$($x:expr),+ $(,)?]) => {{
        let xs = [$($x),+];
        *$rng.weighted(&xs)
    }};
}

pub mod cases;
pub mod check;
pub mod counters;
pub mod mutate;
pub mod node;
pub mod report;
pub mod rng;
pub mod sweeps;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use aya::programs::{TestRun as _, TestRunOptions};
pub use cases::{Input, Kind, Prog, case};

use crate::testrun::{
    Datapath, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, in_netns, skb_ctx_gso,
};

/// The established flows are written again this often (in packets), so that neither
/// the LRU nor their idle timeouts take them in a long run.
const REFRESH_EVERY: u64 = 4096;
/// Failures kept per program with their packets (all are counted).
const KEEP_FAILURES: usize = 10;

#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Packets per program.
    pub packets: u64,
    pub seed: u64,
    /// Start with both conntrack maps full of other flows ([`node::fill_conntrack`]):
    /// every new flow evicts one (LRU), a known flow's half among them now and then.
    pub full_conntrack: bool,
    /// Walk the conntrack maps with the agent's sweeper every [`sweeps::EVERY`] packets,
    /// its clock some time ahead ([`sweeps`]).
    pub sweeps: bool,
}

/// A broken property, with what it takes to see it again.
#[derive(Clone, Debug)]
pub struct Failure {
    pub prog: Prog,
    pub seed: u64,
    pub index: u64,
    pub input: Input,
    pub verdict: Option<u32>,
    pub out: Vec<u8>,
    pub delta: Vec<(u32, u64, u64)>,
    pub problem: String,
}

/// What one program did with its packets.
#[derive(Clone, Debug)]
pub struct ProgramReport {
    pub prog: Prog,
    pub packets: u64,
    /// By verdict: pass, drop, redirect.
    pub verdicts: [u64; 3],
    /// Packets by reason counted.
    pub reasons: BTreeMap<u32, u64>,
    /// Packets by how they were made: well-formed, mutated, garbage.
    pub kinds: [u64; 3],
    pub elapsed: Duration,
    pub failed: u64,
    pub failures: Vec<Failure>,
    /// Sweeper walks, and the entries they removed.
    pub swept: (u64, usize),
    /// What a walk left that the sweeper itself would remove (each counted failed).
    pub sweep_problems: Vec<String>,
}

#[derive(Clone, Debug)]
pub struct Report {
    pub seed: u64,
    pub programs: Vec<ProgramReport>,
}

impl Report {
    pub fn failed(&self) -> u64 {
        self.programs.iter().map(|p| p.failed).sum()
    }
}

/// Fuzz every program with `opts.packets` packets, on a node of its own (a new network
/// namespace, a freshly loaded object).
pub fn run(opts: Options) -> Report {
    in_netns(move || {
        let net = node::topology();
        let mut dp = Datapath::load();
        node::fill(&mut dp, &net);
        if opts.full_conntrack {
            node::fill_conntrack(&mut dp);
        }
        let programs = Prog::ALL
            .into_iter()
            .map(|prog| run_program(&mut dp, &net, prog, opts))
            .collect();
        Report {
            seed: opts.seed,
            programs,
        }
    })
}

fn run_program(dp: &mut Datapath, net: &node::Net, prog: Prog, opts: Options) -> ProgramReport {
    let mut reader = counters::Reader::new(dp);
    // Loaded and verified before the clock starts.
    dp.program(prog.name());
    let mut report = ProgramReport {
        prog,
        packets: 0,
        verdicts: [0; 3],
        reasons: BTreeMap::new(),
        kinds: [0; 3],
        elapsed: Duration::ZERO,
        failed: 0,
        failures: Vec::new(),
        swept: (0, 0),
        sweep_problems: Vec::new(),
    };
    let mut before = reader.read();
    let mut out = vec![0u8; 4096];
    let start = Instant::now();
    for index in 0..opts.packets {
        if index % REFRESH_EVERY == 0 {
            node::refresh_flows(dp, net);
        }
        if opts.sweeps && index % sweeps::EVERY == sweeps::EVERY - 1 {
            match sweeps::walk(dp, report.swept.0) {
                Ok(removed) => report.swept.1 += removed,
                Err(problem) => {
                    report.failed += 1;
                    report.sweep_problems.push(problem);
                }
            }
            report.swept.0 += 1;
            // The counters the sweeper moved (CT_EXPIRED) are not the next packet's.
            before = reader.read();
        }
        let input = cases::case(opts.seed, prog, index);
        let ctx = skb_ctx_gso(net.ifindex(input.dev), input.tunnel, input.gso);
        let ran = dp.program(prog.name()).test_run(TestRunOptions {
            data_in: Some(&input.frame),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            ..TestRunOptions::new()
        });
        let after = reader.read();
        let delta = counters::delta(&before, &after);
        before = after;
        let (verdict, frame, problem) = match ran {
            Ok(r) => {
                let frame = &out[..r.data_size_out as usize];
                let seen = check::Seen {
                    verdict: r.return_value,
                    out: frame,
                    delta: &delta,
                };
                let problem = check::check(prog, &input, &seen).err();
                (Some(r.return_value), frame, problem)
            }
            Err(e) => (None, &out[..0], Some(format!("test_run failed: {e:?}"))),
        };
        report.record(&input, verdict, &delta);
        if let Some(problem) = problem {
            report.failed += 1;
            if report.failures.len() < KEEP_FAILURES {
                report.failures.push(Failure {
                    prog,
                    seed: opts.seed,
                    index,
                    out: frame.to_vec(),
                    input,
                    verdict,
                    delta,
                    problem,
                });
            }
        }
    }
    report.elapsed = start.elapsed();
    report
}

impl ProgramReport {
    fn record(&mut self, input: &Input, verdict: Option<u32>, delta: &[(u32, u64, u64)]) {
        self.packets += 1;
        self.kinds[input.kind as usize] += 1;
        match verdict {
            // `from_underlay` passes on what is not its own.
            Some(TC_ACT_OK | TC_ACT_UNSPEC) => self.verdicts[0] += 1,
            Some(TC_ACT_SHOT) => self.verdicts[1] += 1,
            Some(TC_ACT_REDIRECT) => self.verdicts[2] += 1,
            _ => {}
        }
        for &(r, n, _) in delta {
            *self.reasons.entry(r).or_default() += n;
        }
    }

    pub fn packets_per_second(&self) -> f64 {
        self.packets as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// A seed from the clock, for runs that were not given one.
pub fn random_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    rng::splitmix64(t.as_nanos() as u64 ^ u64::from(std::process::id()))
}

/// The bytes of a hex string (whitespace ignored): how a failing case's packet becomes a
/// table test (`step(...).raw(fuzz::unhex("..."))`).
pub fn unhex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    digits
        .chunks(2)
        .map(|p| {
            let t = std::str::from_utf8(p).expect("hex digits");
            u8::from_str_radix(t, 16).unwrap_or_else(|_| panic!("not a hex byte: {t:?}"))
        })
        .collect()
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
