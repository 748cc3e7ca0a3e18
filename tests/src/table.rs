//! The machinery of the `BPF_PROG_TEST_RUN` packet tables (`datapath_v4`, `datapath_v6`):
//! a case is a setup, a list of steps (program, device, frame in, expected verdict and
//! frame out) and the exact counters it leaves; every case of a table runs on a thread of
//! its own, in a fresh network namespace, and all failures are reported together.

use std::{
    collections::VecDeque,
    net::IpAddr,
    panic::{AssertUnwindSafe, catch_unwind},
    sync::{Arc, Mutex},
};

use egress_common::counters;

use crate::{
    packet::{Ipv4Packet, diff},
    packet6::Ipv6Packet,
    testrun::{Datapath, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, in_netns},
};

/// A packet a table can send or expect.
pub trait Frame {
    fn frame(&self) -> Vec<u8>;
}

impl Frame for Ipv4Packet {
    fn frame(&self) -> Vec<u8> {
        self.build()
    }
}

impl Frame for Ipv6Packet {
    fn frame(&self) -> Vec<u8> {
        self.build()
    }
}

/// The device a step's packet arrives on.
#[derive(Clone, Copy, Debug)]
pub enum Dev {
    Pod,
    /// Another pod's device on the same node.
    OtherPod,
    Tunnel,
    Secondary,
}

pub type Check = Box<dyn Fn(&[u8]) -> Result<(), String> + Send>;
pub type Derive = Box<dyn Fn(&[u8]) -> Vec<u8> + Send>;

pub enum Input {
    Frame(Vec<u8>),
    /// Built from the previous step's output frame (e.g. a reply to a translated port).
    FromPrevious(Derive),
}

pub enum Out {
    /// The frame must come out exactly as it went in.
    Unchanged,
    /// The frame must come out exactly like this.
    Frame(Vec<u8>),
    Check(Check),
    /// Not checked (dropped packets).
    Any,
}

pub struct Step {
    pub prog: &'static str,
    pub dev: Dev,
    /// Tunnel metadata (sender, VNI) for `from_tunnel`.
    pub tunnel: Option<(IpAddr, u32)>,
    pub input: Input,
    pub verdict: u32,
    pub out: Out,
}

/// `p` into `prog` on `dev`, expected to pass unchanged until told otherwise.
pub fn step(prog: &'static str, dev: Dev, tunnel: Option<(IpAddr, u32)>, p: &impl Frame) -> Step {
    Step {
        prog,
        dev,
        tunnel,
        input: Input::Frame(p.frame()),
        verdict: TC_ACT_OK,
        out: Out::Unchanged,
    }
}

impl Step {
    pub fn raw(mut self, frame: Vec<u8>) -> Self {
        self.input = Input::Frame(frame);
        self
    }

    pub fn derive(mut self, f: impl Fn(&[u8]) -> Vec<u8> + Send + 'static) -> Self {
        self.input = Input::FromPrevious(Box::new(f));
        self
    }

    pub fn passes(self) -> Self {
        self.expect(TC_ACT_OK, Out::Unchanged)
    }

    pub fn dropped(self) -> Self {
        self.expect(TC_ACT_SHOT, Out::Any)
    }

    pub fn redirected(self, out: &impl Frame) -> Self {
        self.expect(TC_ACT_REDIRECT, Out::Frame(out.frame()))
    }

    /// Redirected unchanged (into the tunnel: the key is metadata, not bytes).
    pub fn tunneled(self) -> Self {
        self.expect(TC_ACT_REDIRECT, Out::Unchanged)
    }

    pub fn redirected_if(self, f: impl Fn(&[u8]) -> Result<(), String> + Send + 'static) -> Self {
        self.expect(TC_ACT_REDIRECT, Out::Check(Box::new(f)))
    }

    /// Redirected, bytes not checked.
    pub fn forwarded_any(self) -> Self {
        self.expect(TC_ACT_REDIRECT, Out::Any)
    }

    pub fn expect(mut self, verdict: u32, out: Out) -> Self {
        self.verdict = verdict;
        self.out = out;
        self
    }
}

/// The devices of a case's namespace, by role.
pub trait Bed {
    fn ifindex(&self, dev: Dev) -> u32;
}

pub type Setup<N> = Box<dyn Fn(&mut Datapath, &N) + Send>;

pub struct Case<N> {
    pub name: String,
    pub setup: Setup<N>,
    pub steps: Vec<Step>,
    /// Every non-zero counter after the last step: (reason, packets).
    pub counters: Vec<(u32, u64)>,
}

pub fn case<N>(
    name: impl Into<String>,
    setup: impl Fn(&mut Datapath, &N) + Send + 'static,
    steps: Vec<Step>,
    counters: &[(u32, u64)],
) -> Case<N> {
    Case {
        name: name.into(),
        setup: Box::new(setup),
        steps,
        counters: counters.to_vec(),
    }
}

pub fn no_setup<N>(_: &mut Datapath, _: &N) {}

fn reason_name(r: u32) -> String {
    counters::name(r).map_or_else(|| format!("#{r}"), str::to_owned)
}

fn verdict_name(v: u32) -> &'static str {
    match v {
        TC_ACT_OK => "OK",
        TC_ACT_SHOT => "SHOT",
        TC_ACT_REDIRECT => "REDIRECT",
        _ => "?",
    }
}

/// `Ok` when `got` is `want` byte for byte, else the differing bytes.
pub fn frame_diff(got: &[u8], want: &[u8]) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("frame differs: {}", diff(got, want)))
    }
}

fn named(c: &[(u32, u64)]) -> Vec<(String, u64)> {
    c.iter().map(|&(r, n)| (reason_name(r), n)).collect()
}

fn run_case<N: Bed>(
    c: Case<N>,
    dp: &mut Datapath,
    prepare: impl FnOnce(&mut Datapath) -> N,
) -> Result<(), String> {
    let Case {
        name: _,
        setup,
        steps,
        counters,
    } = c;
    dp.reset();
    let net = prepare(dp);
    // Every program the steps run is verified before the setup: a setup that writes
    // entries aged from the clock (conntrack's timeouts) must not see them age by the
    // verifier's time, which under emulation (the 6.1 guest) is tens of seconds.
    for s in &steps {
        dp.program(s.prog);
    }
    setup(dp, &net);
    let mut prev: Vec<u8> = Vec::new();
    for (i, s) in steps.into_iter().enumerate() {
        let input = match &s.input {
            Input::Frame(f) => f.clone(),
            Input::FromPrevious(f) => f(&prev),
        };
        let o = dp.run(s.prog, &input, net.ifindex(s.dev), s.tunnel);
        let step = format!("step {} ({})", i + 1, s.prog);
        if o.verdict != s.verdict {
            return Err(format!(
                "{step}: verdict {} ({}), expected {} ({}); counters {:?}",
                o.verdict,
                verdict_name(o.verdict),
                s.verdict,
                verdict_name(s.verdict),
                named(&dp.counters().into_iter().collect::<Vec<_>>()),
            ));
        }
        let r = match &s.out {
            Out::Unchanged => frame_diff(&o.frame, &input),
            Out::Frame(want) => frame_diff(&o.frame, want),
            Out::Check(f) => f(&o.frame),
            Out::Any => Ok(()),
        };
        r.map_err(|e| format!("{step}: {e}"))?;
        prev = o.frame;
    }
    let got: Vec<(u32, u64)> = dp.counters().into_iter().collect();
    let mut want = counters;
    want.sort_unstable();
    if got != want {
        return Err(format!(
            "counters {:?}, expected {:?}",
            named(&got),
            named(&want)
        ));
    }
    Ok(())
}

/// How many cases of a table run at once, each worker with its own loaded object.
const WORKERS: usize = 2;

/// Run every case, each in its own network namespace, `WORKERS` at a time; `prepare`
/// builds the namespace's devices and writes the common maps into the worker's
/// datapath, emptied for the case ([`Datapath::reset`]). Each worker loads the object
/// once and verifies each program once, on its first use: a fresh object per case made
/// the verifier the tables' cost (from_tunnel's table took 277 s in the 6.1 guest).
/// Report all failures, `what` saying which table.
pub fn run_table<N: Bed + 'static>(
    what: &str,
    cases: Vec<Case<N>>,
    prepare: impl Fn(&mut Datapath) -> N + Clone + Send + 'static,
) {
    let total = cases.len();
    let queue = Arc::new(Mutex::new(
        cases.into_iter().enumerate().collect::<VecDeque<_>>(),
    ));
    let workers: Vec<_> = (0..WORKERS.min(total))
        .map(|_| {
            let queue = Arc::clone(&queue);
            let prepare = prepare.clone();
            std::thread::spawn(move || {
                let mut results = Vec::new();
                let mut kept: Option<Datapath> = None;
                loop {
                    let Some((i, c)) = queue.lock().expect("case queue").pop_front() else {
                        break;
                    };
                    let name = c.name.clone();
                    let prepare = prepare.clone();
                    let dp = kept.take();
                    // A case that panics loses its worker's object: the next loads anew.
                    let (r, dp) = catch_unwind(AssertUnwindSafe(|| {
                        in_netns(move || {
                            let mut dp = dp.unwrap_or_else(Datapath::load);
                            let r =
                                catch_unwind(AssertUnwindSafe(|| run_case(c, &mut dp, prepare)));
                            match r {
                                Ok(r) => (r, Some(dp)),
                                Err(p) => (Err(format!("panicked: {}", panic_text(&p))), None),
                            }
                        })
                    }))
                    .unwrap_or_else(|p| (Err(format!("panicked: {}", panic_text(&p))), None));
                    kept = dp;
                    results.push((i, name, r));
                }
                results
            })
        })
        .collect();
    let mut results: Vec<_> = workers
        .into_iter()
        .flat_map(|w| w.join().expect("table worker"))
        .collect();
    results.sort_by_key(|(i, _, _)| *i);
    let failures: Vec<String> = results
        .into_iter()
        .filter_map(|(_, name, r)| r.err().map(|e| format!("  {name}: {e}")))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {total} cases of {what} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}
