//! The control plane at cluster scale (issue 15): the agent's compiler on a synthetic
//! cluster of 100 nodes (10 of them gateways) and 100k pods, its desired state turned into
//! map contents (`MapState::from_desired`) and applied into real, freshly pinned maps
//! (`Datapath::apply`), and what those maps hold and take per node: one source node, one
//! gateway. Measured in this process; nothing is attached, no traffic flows.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail, ensure};
use egress_agent::{
    compiler::{Compiled, compile},
    datapath::{Capacities, Datapath, state::MapState},
    source::{ClusterView, PodSummary, intern, yaml},
};
use egress_common::maps::REGISTRY;

use super::{
    Plan, Spread,
    report::{Table, thousands},
};

/// The synthetic cluster's shape.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub nodes: u32,
    /// The first `gateways` nodes are gateways (they run pods too).
    pub gateways: u32,
    pub pods: u32,
    /// Namespaces, one policy each; pod `i` lives in namespace `i % policies`.
    pub policies: u32,
    /// Destination prefixes of each policy's first rule (the second has one).
    pub prefixes: u32,
}

/// Issue 15's cluster: 100 nodes, 10 gateways, 100k pods (1,000 per node), every pod
/// selected by its namespace's policy for 10 + 1 destination prefixes.
pub const SHAPE: Shape = Shape {
    nodes: 100,
    gateways: 10,
    pods: 100_000,
    policies: 10,
    prefixes: 10,
};

impl Shape {
    pub(super) fn pods_per_node(&self) -> u32 {
        self.pods / self.nodes
    }

    /// Policy entries each source node should get: its pods x every prefix of their rules.
    fn entries_per_node(&self) -> usize {
        (self.pods_per_node() * (self.prefixes + 1)) as usize
    }
}

pub(super) fn node_name(shape: &Shape, i: u32) -> String {
    if i < shape.gateways {
        format!("gateway-{i:02}")
    } else {
        format!("worker-{i:03}")
    }
}

fn node_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, (i / 250) as u8, (i % 250 + 1) as u8)
}

/// Node `i`'s pod CIDR: a /22 from 10.128.0.0 upwards.
fn pod_base(i: u32) -> u32 {
    u32::from(Ipv4Addr::new(10, 128, 0, 0)) + i * 1024
}

fn pod_cidr(i: u32) -> String {
    format!("{}/22", Ipv4Addr::from(pod_base(i)))
}

/// Namespaces, Nodes, EgressNodes (two secondary networks per gateway) and one policy per
/// namespace, as the YAML source reads them.
fn objects_yaml(shape: &Shape) -> String {
    let mut s = String::new();
    for k in 0..shape.policies {
        let _ = write!(
            s,
            "---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: ns-{k}, labels: {{team: t{k}}}}}\n"
        );
    }
    for i in 0..shape.nodes {
        let labels = if i < shape.gateways {
            ", labels: {egress.dev/gateway: \"true\"}"
        } else {
            ""
        };
        let _ = write!(
            s,
            "---\napiVersion: v1\nkind: Node\nmetadata: {{name: {name}{labels}}}\n\
             spec: {{podCIDRs: [{cidr}]}}\nstatus:\n  addresses: [{{type: InternalIP, address: {ip}}}]\n  \
             conditions: [{{type: Ready, status: \"True\"}}]\n",
            name = node_name(shape, i),
            cidr = pod_cidr(i),
            ip = node_ip(i),
        );
    }
    for g in 0..shape.gateways {
        let _ = write!(
            s,
            "---\napiVersion: egress.dev/v1alpha1\nkind: EgressNode\nmetadata: {{name: {name}}}\n\
             spec: {{underlayIP: {ip}}}\nstatus:\n  interfaces:\n  \
             - {{name: ens224, up: true, addresses: [\"198.51.100.{a}/24\"], routes: [\"198.51.100.0/24\"]}}\n  \
             - {{name: ens256, up: true, addresses: [\"203.0.113.{a}/24\"], routes: [\"203.0.113.0/24\"]}}\n",
            name = node_name(shape, g),
            ip = node_ip(g),
            a = g + 2,
        );
    }
    for k in 0..shape.policies {
        let dests: Vec<String> = (0..shape.prefixes)
            .map(|d| format!("\"172.{}.{d}.0/24\"", 16 + k))
            .collect();
        let _ = write!(
            s,
            "---\napiVersion: egress.dev/v1alpha1\nkind: EgressGatewayPolicy\n\
             metadata: {{name: p-{k}, generation: 1}}\nspec:\n  \
             namespaceSelector: {{matchLabels: {{team: t{k}}}}}\n  \
             podSelector: {{matchLabels: {{app: api}}}}\n  \
             gatewaySelector: {{matchLabels: {{egress.dev/gateway: \"true\"}}}}\n  rules:\n  \
             - {{destinations: [{dests}], egressIP: 198.51.100.{a}}}\n  \
             - {{destinations: [\"192.0.2.{b}/32\"], egressIP: 203.0.113.{a}}}\n",
            dests = dests.join(", "),
            a = 100 + k,
            b = 10 + k,
        );
    }
    s
}

/// Pod `j` of node `i`: `api-<i>-<j>` in namespace `ns-<(i * per node + j) % policies>`,
/// its names and labels shared as the sources share them.
pub(super) fn pod(shape: &Shape, i: u32, j: u32) -> PodSummary {
    let n = i * shape.pods_per_node() + j;
    PodSummary {
        namespace: intern::name(&format!("ns-{}", n % shape.policies)),
        name: format!("api-{i}-{j}"),
        labels: intern::labels([("app".to_owned(), "api".to_owned())].into()),
        node_name: Some(intern::name(&node_name(shape, i))),
        host_network: false,
        running: true,
        ips: vec![IpAddr::V4(Ipv4Addr::from(pod_base(i) + 1 + j))],
    }
}

fn joined<T: std::fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The synthetic cluster's view: the objects from YAML, the pods built directly (what
/// the source would summarise them to).
pub fn cluster(shape: &Shape) -> Result<ClusterView> {
    let snap = yaml::load_str("scale.yaml", &objects_yaml(shape));
    if !snap.errors.is_empty() {
        bail!(
            "the synthetic cluster did not parse: {}",
            joined(&snap.errors)
        );
    }
    let mut view = snap.view;
    ensure!(
        view.nodes.len() == shape.nodes as usize && view.policies.len() == shape.policies as usize,
        "the synthetic cluster has {} nodes and {} policies, expected {} and {}",
        view.nodes.len(),
        view.policies.len(),
        shape.nodes,
        shape.policies
    );
    view.pods = (0..shape.nodes)
        .flat_map(|i| (0..shape.pods_per_node()).map(move |j| (i, j)))
        .map(|(i, j)| std::sync::Arc::new(pod(shape, i, j)))
        .collect();
    // As the Kubernetes source hands them over.
    view.pods
        .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    Ok(view)
}

/// A gateway that serves at least one rule (holds an egress IP) in `view`.
pub(super) fn serving_gateway(shape: &Shape, view: &ClusterView) -> Result<String> {
    (0..shape.gateways)
        .map(|g| node_name(shape, g))
        .find(|n| !compile(view, n).desired.v4.rules.is_empty())
        .context("no gateway of the synthetic cluster serves a rule")
}

/// What one node's compile must give before it is timed: no problem, every pod's owner
/// on the gateway and its own pods' on a source node, and on a source node exactly its
/// pods' entries, on the gateway some admitted pairs.
fn check_compiled(shape: &Shape, node: &str, c: &Compiled, gateway: bool) -> Result<()> {
    let d = &c.desired;
    ensure!(
        c.problems.is_empty(),
        "compile for {node}: problems: {}",
        joined(&c.problems)
    );
    let owners = if gateway {
        shape.pods as usize
    } else {
        shape.pods_per_node() as usize
    };
    ensure!(
        d.v4.pod_owner.len() == owners,
        "compile for {node}: {} pod owners, expected {owners}",
        d.v4.pod_owner.len(),
    );
    ensure!(
        d.v4.policy.len() == shape.entries_per_node(),
        "compile for {node}: {} policy entries, expected {}",
        d.v4.policy.len(),
        shape.entries_per_node()
    );
    if gateway {
        ensure!(
            !d.v4.rules.is_empty() && !d.admitted.is_empty(),
            "compile for {node}: the gateway serves no rule or admits no pod"
        );
    }
    Ok(())
}

/// bpffs pin directories of this run, removed on drop.
struct PinDirs(PathBuf);

impl PinDirs {
    fn new() -> Result<Self> {
        let dir = PathBuf::from(format!(
            "/sys/fs/bpf/egress-bench-scale-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("failed to create {}", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for PinDirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One map of one node: entries, entries x (key + value) bytes, and the kernel's memlock
/// figure for the pinned map (`bpftool map show pinned`).
#[derive(Clone, Debug)]
pub struct MapUse {
    pub name: &'static str,
    pub entries: usize,
    pub entry_bytes: u64,
    pub memlock: Option<u64>,
}

/// One node's numbers.
#[derive(Clone, Debug)]
pub struct NodeScale {
    pub node: String,
    pub gateway: bool,
    pub compile_ms: Vec<f64>,
    pub from_desired_ms: Vec<f64>,
    /// Into freshly created maps, then once more with nothing changed.
    pub apply_ms: f64,
    pub reapply_ms: f64,
    pub inserted: usize,
    pub maps: Vec<MapUse>,
    /// The same state applied to a datapath opened with this many conntrack entries
    /// (`--conntrack-entries`), and its maps: the source node as it can run when it never
    /// serves a gateway.
    pub small_ct: Option<(u32, Vec<MapUse>)>,
}

/// The source node's conntrack size in the memory table's extra column: the agent's
/// minimum, for nodes that never serve a gateway.
const SMALL_CT: u32 = 1_024;

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// `bytes_memlock` of the map pinned at `path`.
pub(crate) fn memlock(path: &Path) -> Result<u64> {
    let out = Command::new("bpftool")
        .args(["-j", "map", "show", "pinned"])
        .arg(path)
        .output()
        .context("failed to run bpftool")?;
    ensure!(
        out.status.success(),
        "bpftool map show pinned {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("failed to parse bpftool's JSON for {}", path.display()))?;
    v.get("bytes_memlock")
        .and_then(serde_json::Value::as_u64)
        .with_context(|| format!("no bytes_memlock for {}", path.display()))
}

/// Every map of the registry: what `state` puts in it, and its pinned memlock.
fn map_use(state: &MapState, pin_dir: &Path) -> Vec<MapUse> {
    let sizes: Vec<(&str, usize)> = state.sizes().collect();
    REGISTRY
        .iter()
        .map(|spec| {
            let entries = sizes
                .iter()
                .find(|(n, _)| *n == spec.name)
                .map_or(0, |(_, e)| *e);
            MapUse {
                name: spec.name,
                entries,
                entry_bytes: entries as u64 * u64::from(spec.key_size + spec.value_size),
                memlock: memlock(&pin_dir.join(spec.name)).ok(),
            }
        })
        .collect()
}

/// Compile for `node` `rounds` times, convert, apply into maps pinned under `pins`,
/// re-apply, and read the maps' sizes.
fn measure_node(
    shape: &Shape,
    view: &ClusterView,
    node: &str,
    gateway: bool,
    rounds: usize,
    pins: &Path,
) -> Result<NodeScale> {
    let compiled = compile(view, node);
    check_compiled(shape, node, &compiled, gateway)?;
    let mut compile_ms = Vec::new();
    let mut from_desired_ms = Vec::new();
    // Every interface the gateway's rules name resolves (nothing is attached).
    let ifindex = |_: &str| Some(2);
    for _ in 0..rounds {
        let t = Instant::now();
        let c = compile(view, node);
        compile_ms.push(ms_since(t));
        let t = Instant::now();
        let (state, _) = MapState::from_desired(&c.desired, ifindex);
        from_desired_ms.push(ms_since(t));
        drop(state);
    }
    let (mut want, unresolved) = MapState::from_desired(&compiled.desired, ifindex);
    ensure!(unresolved.is_empty(), "{node}: unresolved: {unresolved:?}");
    // The agent's default (`--unknown-pods pass`).
    want.forget_unknown_pods();
    let pin_dir = pins.join(node);
    let mut dp = Datapath::open(&pin_dir).with_context(|| {
        format!(
            "failed to load the datapath for {node} at {}",
            pin_dir.display()
        )
    })?;
    let t = Instant::now();
    let stats = dp.apply(&want)?;
    let apply_ms = ms_since(t);
    let total: usize = want.sizes().map(|(_, n)| n).sum();
    ensure!(
        stats.failed == 0 && stats.inserted == total,
        "{node}: apply inserted {} of {total} entries, {} failed: {:?}",
        stats.inserted,
        stats.failed,
        stats.problems()
    );
    let t = Instant::now();
    let again = dp.apply(&want)?;
    let reapply_ms = ms_since(t);
    ensure!(
        again.changed() == 0,
        "{node}: re-applying the same state changed {} entries",
        again.changed()
    );
    let maps = map_use(&want, &pin_dir);
    drop(dp);
    let small_ct = if gateway {
        None
    } else {
        let dir = pins.join(format!("{node}-ct{SMALL_CT}"));
        let capacities = Capacities {
            conntrack: SMALL_CT,
            ..Capacities::default()
        };
        let mut dp = Datapath::open_with(&dir, &capacities).with_context(|| {
            format!("failed to load the datapath for {node} with {SMALL_CT} conntrack entries")
        })?;
        let stats = dp.apply(&want)?;
        ensure!(
            stats.failed == 0 && stats.inserted == total,
            "{node} with {SMALL_CT} conntrack entries: apply inserted {} of {total} entries",
            stats.inserted
        );
        let maps = map_use(&want, &dir);
        drop(dp);
        Some((SMALL_CT, maps))
    };
    Ok(NodeScale {
        node: node.to_owned(),
        gateway,
        compile_ms,
        from_desired_ms,
        apply_ms,
        reapply_ms,
        inserted: stats.inserted,
        maps,
        small_ct,
    })
}

/// Everything the scale section measured.
#[derive(Clone, Debug)]
pub struct ScaleRun {
    pub shape: Shape,
    pub build_ms: f64,
    pub nodes: Vec<NodeScale>,
    pub took_s: f64,
}

/// Build the synthetic cluster, then measure a worker and a serving gateway.
pub fn run(plan: &Plan) -> Result<ScaleRun> {
    let start = Instant::now();
    let shape = SHAPE;
    let t = Instant::now();
    let view = cluster(&shape)?;
    let build_ms = ms_since(t);
    let gateway = serving_gateway(&shape, &view)?;
    let worker = node_name(&shape, shape.nodes / 2);
    let pins = PinDirs::new()?;
    let mut nodes = Vec::new();
    for (node, is_gateway) in [(worker, false), (gateway, true)] {
        eprintln!("scale: {node}");
        nodes.push(measure_node(
            &shape,
            &view,
            &node,
            is_gateway,
            plan.rounds,
            &pins.0,
        )?);
    }
    Ok(ScaleRun {
        shape,
        build_ms,
        nodes,
        took_s: start.elapsed().as_secs_f64(),
    })
}

pub(super) fn spread_ms(v: &[f64]) -> String {
    match Spread::of(v) {
        None => "-".to_owned(),
        Some(s) => format!("**{:.0}** ({:.0}-{:.0}) ms", s.median, s.min, s.max),
    }
}

fn kib(bytes: u64) -> String {
    if bytes < 1024 {
        format!("{bytes} B")
    } else if bytes >= 10 * 1024 * 1024 {
        format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
    } else {
        format!("{} KiB", thousands(bytes.div_ceil(1024)))
    }
}

fn role(n: &NodeScale) -> &'static str {
    if n.gateway { "gateway" } else { "source node" }
}

fn shape_text(s: &Shape) -> String {
    format!(
        "{} nodes ({} gateways, two secondary networks each), {} pods ({} per node, all \
         running), {} namespaces with one policy each selecting all their pods: rule 1 with \
         {} destination prefixes, rule 2 with one, each on its own egress IP ({} egress IPs \
         in all)",
        s.nodes,
        s.gateways,
        thousands(u64::from(s.pods)),
        thousands(u64::from(s.pods_per_node())),
        s.policies,
        s.prefixes,
        2 * s.policies
    )
}

/// The control-plane rows at cluster scale.
pub fn table(run: &Result<ScaleRun>) -> Table {
    let cols = ["metric", "value", "notes"].map(str::to_owned).to_vec();
    let r = match run {
        Ok(r) => r,
        Err(e) => {
            return Table {
                title: "Control plane at cluster scale".to_owned(),
                intro: vec![format!("The scale section failed: {e:#}")],
                header: cols,
                ..Default::default()
            };
        }
    };
    let mut rows = vec![vec![
        "build the synthetic cluster view".to_owned(),
        format!("{:.0} ms", r.build_ms),
        "objects from YAML (`egress_agent::source::yaml::load_str`), pods as the source's \
         `PodSummary` directly"
            .to_owned(),
    ]];
    for n in &r.nodes {
        let entries: usize = n.maps.iter().map(|m| m.entries).sum();
        rows.push(vec![
            format!("full compile, for {} ({})", role(n), n.node),
            spread_ms(&n.compile_ms),
            format!(
                "`egress_agent::compiler::compile`; checked first: no problem, {} pod \
                 owners, {} policy entries{}; {} runs",
                thousands(u64::from(r.shape.pods)),
                thousands(r.shape.entries_per_node() as u64),
                if n.gateway {
                    ", rules served and pods admitted"
                } else {
                    ""
                },
                n.compile_ms.len()
            ),
        ]);
        rows.push(vec![
            format!("desired -> map contents, {}", role(n)),
            spread_ms(&n.from_desired_ms),
            "`MapState::from_desired` (ABI keys and values, interfaces resolved)".to_owned(),
        ]);
        rows.push(vec![
            format!("apply into fresh maps, {}", role(n)),
            format!("**{:.0} ms**", n.apply_ms),
            format!(
                "`Datapath::apply` into maps freshly pinned under a temporary bpffs \
                 directory (programs loaded, not attached): {} entries inserted ({} in the \
                 maps), none failed; the same state applied again changed nothing in {:.0} ms",
                thousands(n.inserted as u64),
                thousands(entries as u64),
                n.reapply_ms
            ),
        ]);
    }
    Table {
        title: "Control plane at cluster scale".to_owned(),
        intro: vec![format!(
            "A synthetic cluster in this process (release build, `tests/src/bench/scale.rs`): \
             {}. The source node and the gateway are compiled for, converted and applied \
             into real maps, in this process; the section took {:.0} s.",
            shape_text(&r.shape),
            r.took_s
        )],
        header: cols,
        rows,
        notes: vec![],
    }
}

/// Per-map entries and memory of the source node and the gateway.
pub fn memory_table(run: &Result<ScaleRun>) -> Table {
    let Ok(r) = run else {
        return Table {
            title: "Map memory at cluster scale".to_owned(),
            intro: vec!["Not measured: the scale section failed.".to_owned()],
            ..Default::default()
        };
    };
    let mut cols = vec!["map".to_owned(), "key + value bytes".to_owned()];
    for n in &r.nodes {
        cols.push(format!("{} entries", role(n)));
        cols.push(format!("{} entries x (key + value)", role(n)));
        cols.push(format!("{} memlock", role(n)));
        if let Some((entries, _)) = &n.small_ct {
            cols.push(format!(
                "{} memlock, `--conntrack-entries {}`",
                role(n),
                thousands(u64::from(*entries))
            ));
        }
    }
    let mut rows = Vec::new();
    let mut totals = vec![(0u64, 0u64, 0u64); r.nodes.len()];
    for (i, spec) in REGISTRY.iter().enumerate() {
        let mut row = vec![
            format!("`{}`", spec.name),
            format!("{} + {}", spec.key_size, spec.value_size),
        ];
        for (n, total) in r.nodes.iter().zip(&mut totals) {
            let m = &n.maps[i];
            total.0 += m.entry_bytes;
            total.1 += m.memlock.unwrap_or(0);
            row.push(thousands(m.entries as u64));
            row.push(kib(m.entry_bytes));
            row.push(m.memlock.map_or("-".to_owned(), kib));
            if let Some((_, small)) = &n.small_ct {
                let lock = small[i].memlock;
                total.2 += lock.unwrap_or(0);
                row.push(lock.map_or("-".to_owned(), kib));
            }
        }
        rows.push(row);
    }
    let mut total_row = vec!["**all maps**".to_owned(), String::new()];
    for (n, (bytes, lock, small_lock)) in r.nodes.iter().zip(&totals) {
        let entries: usize = n.maps.iter().map(|m| m.entries).sum();
        total_row.push(format!("**{}**", thousands(entries as u64)));
        total_row.push(format!("**{}**", kib(*bytes)));
        total_row.push(format!("**{}**", kib(*lock)));
        if n.small_ct.is_some() {
            total_row.push(format!("**{}**", kib(*small_lock)));
        }
    }
    rows.push(total_row);
    Table {
        title: "Map memory at cluster scale".to_owned(),
        intro: vec![format!(
            "The maps of the source node ({}) and the gateway ({}) of the cluster above \
             after the apply. *entries x (key + value)* is the payload; *memlock* is the \
             kernel's own figure for the pinned map (`bpftool map show pinned`, \
             `bytes_memlock`), which counts preallocated hash maps (conntrack, pod owners, \
             ...) at their capacity whatever they hold, and the tries and \
             `BPF_F_NO_PREALLOC` maps by what they hold. The source node's last column is \
             the same state applied to maps made with `--conntrack-entries 1024`, as a node \
             that never serves a gateway can run.",
            r.nodes.first().map_or("-", |n| n.node.as_str()),
            r.nodes.get(1).map_or("-", |n| n.node.as_str()),
        )],
        header: cols,
        rows,
        notes: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each map at `memlock` bytes, holding nothing.
    fn maps_at(memlock: u64) -> Vec<MapUse> {
        REGISTRY
            .iter()
            .map(|spec| MapUse {
                name: spec.name,
                entries: 0,
                entry_bytes: 0,
                memlock: Some(memlock),
            })
            .collect()
    }

    #[test]
    fn the_memory_table_gives_the_source_node_with_a_small_conntrack_a_column_and_total() {
        let node = |name: &str, gateway: bool, small: Option<u64>| NodeScale {
            node: name.to_owned(),
            gateway,
            compile_ms: vec![],
            from_desired_ms: vec![],
            apply_ms: 0.0,
            reapply_ms: 0.0,
            inserted: 0,
            maps: maps_at(2048),
            small_ct: small.map(|b| (SMALL_CT, maps_at(b))),
        };
        let run = ScaleRun {
            shape: SHAPE,
            build_ms: 0.0,
            nodes: vec![node("w", false, Some(1024)), node("g", true, None)],
            took_s: 0.0,
        };
        let t = memory_table(&Ok(run));
        assert_eq!(
            t.header.len(),
            2 + 4 + 3,
            "one extra column, the source node's"
        );
        assert_eq!(
            t.header[5],
            "source node memlock, `--conntrack-entries 1,024`"
        );
        let total = t.rows.last().unwrap();
        let n = REGISTRY.len() as u64;
        assert_eq!(total.len(), t.header.len());
        assert_eq!(total[4], format!("**{}**", kib(2048 * n)));
        assert_eq!(total[5], format!("**{}**", kib(1024 * n)));
        assert_eq!(total[8], format!("**{}**", kib(2048 * n)));
    }

    #[test]
    fn the_synthetic_cluster_compiles_to_each_nodes_share() {
        let shape = Shape {
            nodes: 4,
            gateways: 2,
            pods: 40,
            policies: 2,
            prefixes: 3,
        };
        let view = cluster(&shape).expect("the small cluster builds");
        assert_eq!(view.pods.len(), 40);
        let worker = compile(&view, &node_name(&shape, 3));
        check_compiled(&shape, "worker-003", &worker, false).expect("worker");
        let gw = serving_gateway(&shape, &view).expect("a gateway serves");
        check_compiled(&shape, &gw, &compile(&view, &gw), true).expect("gateway");
    }
}
