//! One pod change at cluster scale (issue 15, "One change at scale"): on the synthetic
//! cluster of [`scale`](super::scale), the pass an agent makes when one pod comes or goes
//! (compile, `MapState::from_desired`, and the diff against what its maps hold, without
//! the map writes), and its CPU while pods change 10 times a second across the cluster.
//! Measured in this process, without root: `egress-bench --churn`.

use std::time::{Duration, Instant};

use anyhow::Result;
use egress_agent::{
    compiler::{Compiled, compile},
    datapath::state::MapState,
    source::ClusterView,
};

use super::{
    Plan,
    report::Table,
    scale::{self, SHAPE, Shape},
};

/// What an agent keeps between passes: what its maps hold.
struct Agent {
    node: String,
    held: MapState,
}

/// One pass's stages, in milliseconds, and the entries it would write.
#[derive(Clone, Copy, Debug, Default)]
pub struct PassTimes {
    pub compile_ms: f64,
    pub from_desired_ms: f64,
    pub diff_ms: f64,
    pub changed: usize,
}

impl PassTimes {
    pub fn total_ms(&self) -> f64 {
        self.compile_ms + self.from_desired_ms + self.diff_ms
    }
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Every interface resolves (nothing is attached).
fn ifindex(_: &str) -> Option<u32> {
    Some(2)
}

impl Agent {
    fn new(view: &ClusterView, node: &str) -> Self {
        let compiled = compile(view, node);
        Self {
            node: node.to_owned(),
            held: state_of(&compiled),
        }
    }

    /// The pass after a change of `view`: compile, convert, diff; the maps then hold it.
    fn pass(&mut self, view: &ClusterView) -> PassTimes {
        let t = Instant::now();
        let compiled = compile(view, &self.node);
        let compile_ms = ms_since(t);
        let t = Instant::now();
        let want = state_of(&compiled);
        let from_desired_ms = ms_since(t);
        let t = Instant::now();
        let changed = self.held.changes(&want);
        let diff_ms = ms_since(t);
        self.held = want;
        PassTimes {
            compile_ms,
            from_desired_ms,
            diff_ms,
            changed,
        }
    }
}

fn state_of(compiled: &Compiled) -> MapState {
    let (mut state, _) = MapState::from_desired(&compiled.desired, ifindex);
    state.forget_unknown_pods();
    state
}

/// The `k`th pod of the churn: a pod beyond the first 1,000 of node `(k x 37) mod nodes`
/// (its pod CIDR has room for 23 more).
fn churn_pod(shape: &Shape, k: u32) -> egress_agent::source::PodSummary {
    let node = (k * 37) % shape.nodes;
    scale::pod(shape, node, shape.pods_per_node() + k % 20)
}

/// One node's pass for one added pod.
#[derive(Clone, Debug)]
pub struct OnePod {
    pub node: String,
    pub gateway: bool,
    pub passes: Vec<PassTimes>,
}

/// Add one pod to `view` on `node` and pass, then remove it and pass again (untimed),
/// `rounds` times.
fn one_pod_added(
    shape: &Shape,
    view: &mut ClusterView,
    node: &str,
    gateway: bool,
    rounds: usize,
) -> OnePod {
    let mut agent = Agent::new(view, node);
    let mut passes = Vec::new();
    for k in 0..rounds as u32 {
        let i = view
            .nodes
            .iter()
            .position(|n| n.metadata.name.as_deref() == Some(node));
        let i = i.map_or(0, |i| i as u32);
        view.pods
            .push(scale::pod(shape, i, shape.pods_per_node() + k % 20));
        passes.push(agent.pass(view));
        view.pods.pop();
        agent.pass(view);
    }
    OnePod {
        node: node.to_owned(),
        gateway,
        passes,
    }
}

/// One node's agent while pods change at `rate` per second for `wall`.
#[derive(Clone, Debug)]
pub struct Churn {
    pub node: String,
    pub gateway: bool,
    pub events: u32,
    pub passes: u32,
    pub wall_s: f64,
    pub cpu_s: f64,
    /// From each event's arrival to the end of the pass that took it, ms.
    pub latency_ms: Vec<f64>,
}

/// This process's CPU time (user + system), seconds.
fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Pod events arrive at `rate` per second (a pod added, then removed again, on another
/// node each time); the agent takes every event that has arrived in one pass, as it does
/// from its watch channel, and sleeps while none is pending.
fn churn(
    shape: &Shape,
    view: &mut ClusterView,
    node: &str,
    gateway: bool,
    rate: u32,
    wall: Duration,
) -> Churn {
    let mut agent = Agent::new(view, node);
    let period = Duration::from_secs(1) / rate;
    let total = (wall.as_secs_f64() * f64::from(rate)) as u32;
    let (start, cpu_start) = (Instant::now(), cpu_seconds());
    let (mut taken, mut passes, mut latency_ms) = (0u32, 0u32, Vec::new());
    while taken < total {
        let arrived =
            ((start.elapsed().as_secs_f64() / period.as_secs_f64()) as u32 + 1).min(total);
        if arrived == taken {
            std::thread::sleep((start + period * taken).saturating_duration_since(Instant::now()));
            continue;
        }
        for k in taken..arrived {
            if k % 2 == 0 {
                view.pods.push(churn_pod(shape, k / 2));
            } else {
                view.pods.pop();
            }
        }
        agent.pass(view);
        passes += 1;
        let done = start.elapsed();
        latency_ms.extend((taken..arrived).map(|k| (done - period * k).as_secs_f64() * 1e3));
        taken = arrived;
    }
    if total % 2 == 1 {
        view.pods.pop();
    }
    let wall_s = start.elapsed().as_secs_f64();
    Churn {
        node: node.to_owned(),
        gateway,
        events: total,
        passes,
        wall_s,
        cpu_s: cpu_seconds() - cpu_start,
        latency_ms,
    }
}

/// Everything the churn section measured.
#[derive(Clone, Debug)]
pub struct ChurnRun {
    pub shape: Shape,
    pub one_pod: Vec<OnePod>,
    pub churn: Vec<Churn>,
}

/// Pod events per second across the cluster, and for how long.
pub const RATE: u32 = 10;
pub const WALL: Duration = Duration::from_secs(10);

/// Measure a source node and a serving gateway: one pod added, then churn.
pub fn run(plan: &Plan) -> Result<ChurnRun> {
    let shape = SHAPE;
    let mut view = scale::cluster(&shape)?;
    let gateway = scale::serving_gateway(&shape, &view)?;
    let worker = scale::node_name(&shape, shape.nodes / 2);
    let rounds = plan.rounds.max(3);
    let nodes = [(worker, false), (gateway, true)];
    let mut one_pod = Vec::new();
    for (node, is_gateway) in &nodes {
        eprintln!("churn: one pod added, {node}");
        one_pod.push(one_pod_added(&shape, &mut view, node, *is_gateway, rounds));
    }
    let mut churns = Vec::new();
    for (node, is_gateway) in &nodes {
        eprintln!(
            "churn: {RATE} pod events/s for {} s, {node}",
            WALL.as_secs()
        );
        churns.push(churn(&shape, &mut view, node, *is_gateway, RATE, WALL));
    }
    Ok(ChurnRun {
        shape,
        one_pod,
        churn: churns,
    })
}

fn role(gateway: bool) -> &'static str {
    if gateway { "gateway" } else { "source node" }
}

/// The rows of one pod change at cluster scale.
pub fn table(run: &Result<ChurnRun>) -> Table {
    let title = "One pod change at cluster scale".to_owned();
    let cols = ["metric", "value", "notes"].map(str::to_owned).to_vec();
    let r = match run {
        Ok(r) => r,
        Err(e) => {
            return Table {
                title,
                intro: vec![format!("The churn section failed: {e:#}")],
                header: cols,
                ..Default::default()
            };
        }
    };
    let mut rows = Vec::new();
    for o in &r.one_pod {
        let stage = |f: fn(&PassTimes) -> f64| {
            scale::spread_ms(&o.passes.iter().map(f).collect::<Vec<_>>())
        };
        rows.push(vec![
            format!(
                "one pod added at {} pods, {} ({})",
                super::report::thousands(u64::from(r.shape.pods)),
                role(o.gateway),
                o.node
            ),
            stage(PassTimes::total_ms),
            format!(
                "the whole pass but the map writes: compile {}, `MapState::from_desired` {}, \
                 diff against the maps' state {}; {} entries to write; {} runs",
                stage(|p| p.compile_ms),
                stage(|p| p.from_desired_ms),
                stage(|p| p.diff_ms),
                o.passes.first().map_or(0, |p| p.changed),
                o.passes.len()
            ),
        ]);
    }
    for c in &r.churn {
        let lat = super::Spread::of(&c.latency_ms);
        rows.push(vec![
            format!(
                "{} pod events/s churn: CPU per agent, {} ({})",
                RATE,
                role(c.gateway),
                c.node
            ),
            format!("**{:.3}** CPU s per s", c.cpu_s / c.wall_s),
            format!(
                "{} events in {:.1} s (a pod added or removed, on another node each time), \
                 taken in {} passes (each takes every event that has arrived, as the watch \
                 channel does); event to pass done: median {}, max {}",
                c.events,
                c.wall_s,
                c.passes,
                lat.as_ref()
                    .map_or("-".to_owned(), |s| format!("{:.0} ms", s.median)),
                lat.as_ref()
                    .map_or("-".to_owned(), |s| format!("{:.0} ms", s.max)),
            ),
        ]);
    }
    Table {
        title,
        intro: vec![format!(
            "The cluster of the section above, in this process (release build, \
             `tests/src/bench/churn.rs`, `egress-bench --churn`, no root): the pass an agent \
             makes after one pod change (everything but the map writes), and its CPU while \
             pods change {RATE} times a second across the cluster for {} s.",
            WALL.as_secs()
        )],
        header: cols,
        rows,
        notes: vec![],
    }
}
