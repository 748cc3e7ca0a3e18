//! One pod change at cluster scale (issues 15 and 34, "One change at scale"): on the
//! synthetic cluster of [`scale`](super::scale), the pass an agent makes when one pod comes
//! or goes (compile, `MapState::from_desired`, and the diff against what its maps hold,
//! without the map writes), the pass of the resync tick (nothing changed), and its CPU and
//! latency while pods change 10 times a second across the cluster, with the agent's
//! state passes batched as its own [`StateBatch`] allows, unbatched and at two bounds.
//! Measured in this process, without root: `egress-bench --churn`.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Result;
use egress_agent::{
    agent::batch::{DEFAULT_MAX_REST_MS, FACTOR, StateBatch},
    compiler::{Compiled, Made, Memo, compile},
    datapath::state::MapState,
    liveness::PeerView,
    source::{ClusterView, PodSummary, Snapshot, intern},
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
        let node = self.node.clone();
        self.pass_of(|| Arc::new(compile(view, &node)))
    }

    /// [`Agent::pass`] of `snapshot` as the agent makes it: compiled through its memo;
    /// and how the memo came by the result.
    fn pass_memo(&mut self, memo: &mut Memo, snapshot: &Arc<Snapshot>) -> (PassTimes, Made) {
        let node = self.node.clone();
        let mut made = Made::Compiled;
        let times = self.pass_of(|| {
            let (compiled, how) =
                memo.compile(snapshot, &PeerView::default(), &BTreeMap::new(), &node);
            made = how;
            compiled
        });
        (times, made)
    }

    fn pass_of(&mut self, compile: impl FnOnce() -> Arc<Compiled>) -> PassTimes {
        let t = Instant::now();
        let compiled = compile();
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

/// Add `pod` to `view` where the Kubernetes source hands it over: in (namespace, name)
/// order.
fn add_pod(view: &mut ClusterView, pod: PodSummary) {
    let at = view
        .pods
        .partition_point(|p| (&p.namespace, &p.name) < (&pod.namespace, &pod.name));
    view.pods.insert(at, pod.into());
}

/// Take the pod named like `pod` out of `view`.
fn remove_pod(view: &mut ClusterView, pod: &PodSummary) {
    view.pods
        .retain(|p| (&p.namespace, &p.name) != (&pod.namespace, &pod.name));
}

/// The `k`th pod of the churn: a pod beyond the first 1,000 of node `(k x 37) mod nodes`
/// (its pod CIDR has room for 23 more).
fn churn_pod(shape: &Shape, k: u32) -> PodSummary {
    let node = (k * 37) % shape.nodes;
    scale::pod(shape, node, shape.pods_per_node() + k % 20)
}

/// One node's pass for one added pod, and with nothing changed.
#[derive(Clone, Debug)]
pub struct OnePod {
    pub node: String,
    pub gateway: bool,
    pub passes: Vec<PassTimes>,
    /// A pass with nothing changed since the last one: what the resync tick cost.
    pub unchanged: Vec<PassTimes>,
    /// The same pass as the agent makes it now: the compile taken again from its memo.
    pub unchanged_memo: Vec<PassTimes>,
    /// One pod that no policy selects added, compiled anew (as every pod event was
    /// before `compiler::delta`).
    pub unselected_full: Vec<PassTimes>,
    /// The same pod added through the agent's memo, which patches the last result.
    pub unselected_memo: Vec<PassTimes>,
}

/// The place of the node named `node` among `view`'s Nodes (the synthetic cluster's
/// node number; 0 when it has none).
fn node_index(view: &ClusterView, node: &str) -> u32 {
    view.nodes
        .iter()
        .position(|n| n.metadata.name.as_deref() == Some(node))
        .map_or(0, |i| i as u32)
}

/// A snapshot of `view` as a source hands it over.
fn snapshot_of(view: &ClusterView) -> Arc<Snapshot> {
    Arc::new(Snapshot {
        view: view.clone(),
        errors: Vec::new(),
    })
}

/// Add one pod to `view` on `node` and pass, then remove it and pass again (untimed), then
/// pass once more with nothing changed, `rounds` times.
fn one_pod_added(
    shape: &Shape,
    view: &mut ClusterView,
    node: &str,
    gateway: bool,
    rounds: usize,
) -> OnePod {
    let mut agent = Agent::new(view, node);
    let (mut passes, mut unchanged) = (Vec::new(), Vec::new());
    for k in 0..rounds as u32 {
        let i = node_index(view, node);
        let pod = scale::pod(shape, i, shape.pods_per_node() + k % 20);
        add_pod(view, pod.clone());
        passes.push(agent.pass(view));
        remove_pod(view, &pod);
        agent.pass(view);
        unchanged.push(agent.pass(view));
    }
    let snapshot = snapshot_of(view);
    let mut memo = Memo::default();
    agent.pass_memo(&mut memo, &snapshot);
    let unchanged_memo = (0..rounds)
        .map(|_| agent.pass_memo(&mut memo, &snapshot).0)
        .collect();
    let (unselected_full, unselected_memo) = unselected_added(shape, view, &mut agent, rounds);
    OnePod {
        node: node.to_owned(),
        gateway,
        passes,
        unchanged,
        unchanged_memo,
        unselected_full,
        unselected_memo,
    }
}

/// A pod that no policy selects (`app: web`) added on `agent`'s node and taken out again,
/// `rounds` times: each added pass compiled anew, then through the agent's memo (whose
/// last result, without the pod, it patches).
fn unselected_added(
    shape: &Shape,
    view: &mut ClusterView,
    agent: &mut Agent,
    rounds: usize,
) -> (Vec<PassTimes>, Vec<PassTimes>) {
    let i = node_index(view, &agent.node);
    let mut memo = Memo::default();
    agent.pass_memo(&mut memo, &snapshot_of(view));
    let (mut full, mut patched) = (Vec::new(), Vec::new());
    for k in 0..rounds as u32 {
        let mut pod = scale::pod(shape, i, shape.pods_per_node() + k % 20);
        pod.labels = intern::labels([("app".to_owned(), "web".to_owned())].into());
        add_pod(view, pod.clone());
        full.push(agent.pass(view));
        remove_pod(view, &pod);
        agent.pass(view);
        add_pod(view, pod.clone());
        let (times, made) = agent.pass_memo(&mut memo, &snapshot_of(view));
        assert_eq!(made, Made::Patched, "a pod no policy selects is patched in");
        patched.push(times);
        remove_pod(view, &pod);
        agent.pass_memo(&mut memo, &snapshot_of(view));
    }
    (full, patched)
}

/// One node's agent while pods change at `rate` per second for `wall`.
#[derive(Clone, Debug)]
pub struct Churn {
    pub node: String,
    pub gateway: bool,
    /// `--state-batch-max-ms`; zero: unbatched, every pass as soon as the last is over.
    pub max_rest: Duration,
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

/// Pod events at `rate` per second from `start`, `total` of them: the first arrives at
/// `start`, the `k`th `k` periods later.
struct Events {
    start: Instant,
    period: Duration,
    total: u32,
}

impl Events {
    /// How many have arrived by `t`.
    fn arrived(&self, t: Instant) -> u32 {
        let periods =
            t.saturating_duration_since(self.start).as_secs_f64() / self.period.as_secs_f64();
        (periods as u32 + 1).min(self.total)
    }

    /// When the `k`th arrives.
    fn at(&self, k: u32) -> Instant {
        self.start + self.period * k
    }
}

/// Apply events `from..to` to `view`: even ones add the churn's next pod, odd ones remove it.
fn apply_events(shape: &Shape, view: &mut ClusterView, from: u32, to: u32) {
    for k in from..to {
        if k % 2 == 0 {
            add_pod(view, churn_pod(shape, k / 2));
        } else {
            remove_pod(view, &churn_pod(shape, k / 2));
        }
    }
}

/// Pod events arrive at `rate` per second (a pod added, then removed again, on another
/// node each time). The agent's loop: it sleeps while no event is pending; a pending one
/// asks for a pass, which starts when the agent's own [`StateBatch`] (bounded by
/// `max_rest`) allows; the pass takes every event that has arrived by then, as the agent
/// takes the newest view from its watch channel.
fn churn(
    shape: &Shape,
    view: &mut ClusterView,
    node: &str,
    gateway: bool,
    (rate, wall): (u32, Duration),
    max_rest: Duration,
) -> Churn {
    let mut agent = Agent::new(view, node);
    let mut batch = StateBatch::new(max_rest);
    let events = Events {
        start: Instant::now(),
        period: Duration::from_secs(1) / rate,
        total: (wall.as_secs_f64() * f64::from(rate)) as u32,
    };
    let cpu_start = cpu_seconds();
    let (mut taken, mut passes, mut latency_ms) = (0u32, 0u32, Vec::new());
    while taken < events.total {
        let now = Instant::now();
        if events.arrived(now) == taken {
            std::thread::sleep(events.at(taken).saturating_duration_since(now));
            continue;
        }
        std::thread::sleep(batch.start_at(now).saturating_duration_since(now));
        let began = Instant::now();
        let arrived = events.arrived(began);
        apply_events(shape, view, taken, arrived);
        agent.pass(view);
        batch.ran(began, began.elapsed());
        passes += 1;
        let done = Instant::now();
        latency_ms.extend((taken..arrived).map(|k| (done - events.at(k)).as_secs_f64() * 1e3));
        taken = arrived;
    }
    if events.total % 2 == 1 {
        remove_pod(view, &churn_pod(shape, events.total / 2));
    }
    Churn {
        node: node.to_owned(),
        gateway,
        max_rest,
        events: events.total,
        passes,
        wall_s: events.start.elapsed().as_secs_f64(),
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

/// The churn's `--state-batch-max-ms` settings: unbatched (as before issue 34), the
/// default, and twice the default.
pub const MAX_RESTS: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_millis(DEFAULT_MAX_REST_MS),
    Duration::from_millis(2 * DEFAULT_MAX_REST_MS),
];

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
        for max_rest in MAX_RESTS {
            eprintln!(
                "churn: {RATE} pod events/s for {} s, {node}, --state-batch-max-ms {}",
                WALL.as_secs(),
                max_rest.as_millis()
            );
            let load = (RATE, WALL);
            churns.push(churn(&shape, &mut view, node, *is_gateway, load, max_rest));
        }
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

/// The rows of one pod change at cluster scale: one pod added, and nothing changed.
pub fn table(run: &Result<ChurnRun>) -> Table {
    let title = "One pod change at cluster scale".to_owned();
    let cols = ["metric", "value", "notes"].map(str::to_owned).to_vec();
    let r = match run {
        Ok(r) => r,
        Err(e) => {
            return Table::failed(title, cols, "churn section", e);
        }
    };
    let mut rows = Vec::new();
    for o in &r.one_pod {
        rows.push(pass_row(
            format!(
                "one pod added at {} pods, {} ({})",
                super::report::thousands(u64::from(r.shape.pods)),
                role(o.gateway),
                o.node
            ),
            &o.passes,
        ));
    }
    for o in &r.one_pod {
        let mut row = pass_row(
            format!(
                "nothing changed (the resync tick's pass), {}",
                role(o.gateway)
            ),
            &o.unchanged,
        );
        let median = super::Spread::of(
            &o.unchanged
                .iter()
                .map(PassTimes::total_ms)
                .collect::<Vec<_>>(),
        );
        if let Some(m) = median {
            row[2].push_str(&format!(
                "; every 10 s (`--resync-secs`): {:.1} % of a core idle",
                m.median / 100.0
            ));
        }
        rows.push(row);
    }
    for o in &r.one_pod {
        rows.push(pass_row(
            format!(
                "nothing changed, now: the compile taken again from the agent's memo \
                 (`compiler::Memo`), {}",
                role(o.gateway)
            ),
            &o.unchanged_memo,
        ));
    }
    for o in &r.one_pod {
        rows.push(pass_row(
            format!(
                "one pod no policy selects added, compiled anew (as before `compiler::delta`), {}",
                role(o.gateway)
            ),
            &o.unselected_full,
        ));
        rows.push(pass_row(
            format!(
                "the same pod added, now: the memo's last result patched with its entries \
                 (`compiler::delta`), {}",
                role(o.gateway)
            ),
            &o.unselected_memo,
        ));
    }
    Table {
        title,
        intro: vec![
            "The cluster of the section above, in this process (release build, \
             `tests/src/bench/churn.rs`, `egress-bench --churn`, no root): the pass an agent \
             makes after one pod change, and after none (everything but the map writes)."
                .to_owned(),
        ],
        header: cols,
        rows,
        notes: vec![],
    }
}

/// A row of pass times: the whole pass, then its stages.
fn pass_row(metric: String, passes: &[PassTimes]) -> Vec<String> {
    let stage =
        |f: fn(&PassTimes) -> f64| scale::spread_ms(&passes.iter().map(f).collect::<Vec<_>>());
    vec![
        metric,
        stage(PassTimes::total_ms),
        format!(
            "the whole pass but the map writes: compile {}, `MapState::from_desired` {}, \
             diff against the maps' state {}; {} entries to write; {} runs",
            stage(|p| p.compile_ms),
            stage(|p| p.from_desired_ms),
            stage(|p| p.diff_ms),
            passes.first().map_or(0, |p| p.changed),
            passes.len()
        ),
    ]
}

/// The `p`th percentile (0-1) of `v`, nearest rank.
fn percentile(v: &[f64], p: f64) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let rank = (p * s.len() as f64).ceil() as usize;
    Some(s[rank.clamp(1, s.len()) - 1])
}

/// The churn with state passes unbatched and batched, side by side.
pub fn churn_table(run: &Result<ChurnRun>) -> Table {
    let title = format!("{RATE} pod events/s at cluster scale, unbatched and batched");
    let cols = [
        "node",
        "`--state-batch-max-ms`",
        "CPU s per s",
        "passes",
        "events",
        "wall",
        "event to pass done: p50",
        "p99",
        "max",
    ]
    .map(str::to_owned)
    .to_vec();
    let Ok(r) = run else {
        return Table {
            title,
            header: cols,
            ..Default::default()
        };
    };
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.0} ms"));
    let rows = r
        .churn
        .iter()
        .map(|c| {
            vec![
                format!("{} ({})", role(c.gateway), c.node),
                match c.max_rest.as_millis() {
                    0 => "0 (unbatched)".to_owned(),
                    n => n.to_string(),
                },
                format!("**{:.3}**", c.cpu_s / c.wall_s),
                c.passes.to_string(),
                c.events.to_string(),
                format!("{:.1} s", c.wall_s),
                ms(percentile(&c.latency_ms, 0.5)),
                ms(percentile(&c.latency_ms, 0.99)),
                ms(percentile(&c.latency_ms, 1.0)),
            ]
        })
        .collect();
    Table {
        title,
        intro: vec![format!(
            "Pods change {RATE} times a second across the cluster for {} s (a pod added or \
             removed, on another node each time). The loop is the agent's: a pending change \
             asks for a pass, which starts when the agent's `StateBatch` allows (at once on \
             a quiet agent; while passes are expensive, once the last pass has rested {} \
             times its duration, at most the bound), and takes every event that has arrived \
             by then, driving the real compile and diff. Latency is from an event's \
             arrival to the end of the pass that took it (the Kubernetes source's 50 ms \
             batching and its snapshot not included).",
            WALL.as_secs(),
            FACTOR - 1
        )],
        header: cols,
        rows,
        notes: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&v, 1.0), Some(100.0));
        assert_eq!(percentile(&[3.0], 0.99), Some(3.0));
        assert_eq!(percentile(&[], 0.5), None);
    }
}
