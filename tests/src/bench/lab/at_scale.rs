//! The agents at cluster scale, in the lab: the lab's four agents (real processes, real
//! maps) against a state of 100 nodes and 100,000 pods, and what each costs once it has
//! converged: its peak and current RSS, the kernel memory of its maps (charged to the
//! agent's memory cgroup on Linux 5.11+), their sum, and its CPU while nothing changes.
//!
//! The state: the lab's four nodes and 96 more (Node objects only: no agent, no
//! EgressNode), 1,030 pods on each of those and 1,120 on `w2` (devices routed as a CNI
//! would, [`control::apply_pods`]): 100,000 in all, in 10 namespaces with one policy
//! each (a rule of 10 destination prefixes and one of one prefix, each on its own egress
//! IP: 20 egress IPs on the two gateways), beside the lab's sample policy.

use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::control;
use crate::{
    bench::report::Table,
    cluster::{self, wait_until},
    lab::{GATEWAY_LABEL, Lab},
};

/// Nodes beside the lab's four.
pub const FAKE_NODES: u32 = 96;
/// Pods on each of them.
pub const PODS_PER_FAKE_NODE: u32 = 1_030;
/// Pods on `w2`, with devices: 96 x 1,030 + 1,120 = 100,000.
pub const W2_PODS: u32 = 1_120;
/// Namespaces, one policy each.
pub const TEAMS: u32 = 10;
/// The state file of the extra nodes, namespaces, policies and pods.
pub const SCALE_FILE: &str = "bench-scale.yaml";
/// How long the idle CPU is measured over.
const IDLE: Duration = Duration::from_secs(20);

/// Every pod of the state.
pub const fn total_pods() -> u32 {
    FAKE_NODES * PODS_PER_FAKE_NODE + W2_PODS
}

fn fake_node_ip(n: u32) -> Ipv4Addr {
    Ipv4Addr::new(10, 98, (n / 250) as u8, (n % 250 + 1) as u8)
}

/// Node `n`'s pod CIDR: a /21 of 100.64.0.0/10.
fn fake_pod_cidr(n: u32) -> String {
    format!(
        "{}/21",
        Ipv4Addr::from(u32::from(Ipv4Addr::new(100, 64, 0, 0)) + n * 2048)
    )
}

fn fake_pod_ip(n: u32, k: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(100, 64, 0, 0)) + n * 2048 + k + 1)
}

/// The extra Nodes, Namespaces, policies and pods, as one state file.
pub fn state_yaml() -> String {
    let mut s = String::with_capacity((FAKE_NODES * PODS_PER_FAKE_NODE) as usize * 400);
    for t in 0..TEAMS {
        let _ = write!(
            s,
            "---
apiVersion: v1
kind: Namespace
metadata:
  name: team-{t}
  labels:
    team: team-{t}
---
apiVersion: egress.dev/v1alpha1
kind: EgressGatewayPolicy
metadata:
  name: team-{t}
spec:
  namespaceSelector:
    matchLabels:
      team: team-{t}
  podSelector:
    matchLabels:
      app: api
  gatewaySelector:
    matchLabels:
      {GATEWAY_LABEL}: \"true\"
  rules:
    - destinations:
"
        );
        for j in 0..10 {
            let _ = writeln!(s, "        - 198.18.{}.0/24", t * 10 + j);
        }
        let _ = write!(
            s,
            "      egressIP: 192.168.101.{a}
    - destinations:
        - 198.19.{t}.0/24
      egressIP: 192.168.102.{a}
",
            a = 60 + t
        );
    }
    for n in 0..FAKE_NODES {
        let _ = write!(
            s,
            "---
apiVersion: v1
kind: Node
metadata:
  name: node-{n:03}
spec:
  podCIDR: {cidr}
  podCIDRs:
    - {cidr}
status:
  addresses:
    - type: InternalIP
      address: {ip}
    - type: Hostname
      address: node-{n:03}
  conditions:
    - type: Ready
      status: \"True\"
      reason: KubeletReady
",
            cidr = fake_pod_cidr(n),
            ip = fake_node_ip(n),
        );
    }
    for n in 0..FAKE_NODES {
        for k in 0..PODS_PER_FAKE_NODE {
            let ip = fake_pod_ip(n, k);
            let _ = write!(
                s,
                "---
apiVersion: v1
kind: Pod
metadata:
  name: p-{n}-{k}
  namespace: team-{t}
  labels:
    app: api
spec:
  nodeName: node-{n:03}
  containers:
    - name: app
      image: egress-echo
status:
  phase: Running
  hostIP: {host}
  podIP: {ip}
  podIPs:
    - ip: {ip}
  conditions:
    - type: Ready
      status: \"True\"
",
                t = (n * PODS_PER_FAKE_NODE + k) % TEAMS,
                host = fake_node_ip(n),
            );
        }
    }
    s
}

/// One agent's cost.
#[derive(Clone, Debug, Default)]
pub struct Cost {
    pub node: String,
    pub hwm_kib: u64,
    pub rss_kib: u64,
    /// The `bytes_memlock` of every map pinned in its directory.
    pub maps_bytes: u64,
    /// CPU seconds per second (user + system).
    pub cpu: f64,
    /// The passes it logged over the idle window, by trigger.
    pub passes: std::collections::BTreeMap<String, usize>,
}

/// What one run measured.
#[derive(Clone, Debug, Default)]
pub struct Run {
    pub agent_bin: String,
    /// Before the state (the lab's 7 pods), then after it.
    pub before: Vec<Cost>,
    pub after: Vec<Cost>,
    /// The state file written -> every gateway's pod owners complete.
    pub converged: Duration,
    pub state_bytes: u64,
    /// POD_OWNER_V4 entries on each node at the end.
    pub owners: Vec<(String, usize)>,
}

/// user + system clock ticks of `pid`.
pub(crate) fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command's closing parenthesis: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)
}

/// The summed `bytes_memlock` of the maps pinned in `dir`.
pub(crate) fn maps_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| super::super::scale::memlock(&e.path()).ok())
        .sum()
}

/// The passes `log` records, by trigger (`reconciled trigger="state"`).
fn passes(log: &str) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for l in log.lines() {
        if let Some(rest) = l.split_once("reconciled trigger=\"").map(|(_, r)| r)
            && let Some((trigger, _)) = rest.split_once('"')
        {
            *out.entry(trigger.to_owned()).or_default() += 1;
        }
    }
    out
}

/// Every agent's cost now, its CPU over [`IDLE`].
fn costs(lab: &Lab) -> Result<Vec<Cost>> {
    let pids = control::agent_pids(lab)?;
    let ticks: Vec<u64> = pids.iter().map(|(_, p)| cpu_ticks(*p)).collect();
    let logged: Vec<usize> = pids.iter().map(|(n, _)| lab.agent_log(n).len()).collect();
    let t0 = Instant::now();
    thread::sleep(IDLE);
    let secs = t0.elapsed().as_secs_f64();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(pids
        .iter()
        .zip(ticks)
        .zip(logged)
        .map(|(((node, pid), before), from)| Cost {
            passes: passes(lab.agent_log(node).get(from..).unwrap_or_default()),
            node: node.clone(),
            hwm_kib: control::status_kib(*pid, "VmHWM:"),
            rss_kib: control::status_kib(*pid, "VmRSS:"),
            maps_bytes: maps_bytes(&lab.bpffs_dir(node)),
            cpu: cpu_ticks(*pid).saturating_sub(before) as f64 / hz / secs,
        })
        .collect())
}

/// Bring up the lab with its agents, measure them, write the state, wait until every
/// gateway has every pod's owner in its map, and measure them again.
pub fn run() -> Result<Run> {
    let mut lab = cluster::up_with_agents(cluster::default_spec()?)?;
    let mut r = Run {
        agent_bin: cluster::agent_bin()?.display().to_string(),
        ..Run::default()
    };
    r.before = costs(&lab)?;
    control::apply_pods(&mut lab, W2_PODS).context("w2's pods")?;
    let text = state_yaml();
    r.state_bytes = text.len() as u64;
    let t0 = Instant::now();
    lab.write_state_file(SCALE_FILE, &text)?;
    let want = total_pods() as usize;
    let owners = |lab: &Lab| -> Vec<(String, usize)> {
        ["w1", "w2", "gw1", "gw2"]
            .iter()
            .map(|n| {
                let count = control::pod_owner(lab, n).map_or(0, |m| m.keys().count());
                ((*n).to_owned(), count)
            })
            .collect()
    };
    // A gateway owns every pod; a worker only its own (the return path's check).
    wait_until(Duration::from_secs(600), || {
        let done = owners(&lab)
            .iter()
            .filter(|(n, _)| n.starts_with("gw"))
            .all(|(_, c)| *c >= want);
        if !done {
            thread::sleep(Duration::from_secs(2));
        }
        done
    })
    .with_context(|| format!("the agents did not converge: {:?}", owners(&lab)))?;
    r.converged = t0.elapsed();
    // The pass that filled the last map may still be writing the rest.
    thread::sleep(Duration::from_secs(5));
    r.owners = owners(&lab);
    r.after = costs(&lab)?;
    Ok(r)
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// The run as a table: one row per agent, before and after.
pub fn table(r: &Run) -> Table {
    let mut t = Table {
        title: "Agents at cluster scale (100 nodes, 100k pods, in the lab)".to_owned(),
        intro: vec![
            format!(
                "The lab's four agents (`{}`, default flags) against a state of {} nodes and \
                 {} pods: the lab's nodes and {FAKE_NODES} more (Node objects only), \
                 {PODS_PER_FAKE_NODE} pods on each of those and {W2_PODS} on w2 with \
                 devices, in {TEAMS} namespaces with one policy each (10 + 1 destination \
                 prefixes, 20 egress IPs on gw1 and gw2). The state file is {:.1} MB; both \
                 gateways had every pod's owner in their maps {:.1} s after it was written \
                 (a worker owns its own pods only).",
                r.agent_bin,
                FAKE_NODES + 4,
                total_pods(),
                r.state_bytes as f64 / 1e6,
                r.converged.as_secs_f64(),
            ),
            format!(
                "Maps: the `bytes_memlock` of every map pinned in the agent's directory (the \
                 kernel's own accounting, charged to the agent's memory cgroup on Linux \
                 5.11+). CPU: user + system seconds per second over {} s with nothing \
                 changing (the YAML source's one-second poll and the resync included). \
                 POD_OWNER_V4 at the end: {}.",
                IDLE.as_secs(),
                r.owners
                    .iter()
                    .map(|(n, c)| format!("{n} {c}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ],
        header: [
            "agent",
            "peak RSS",
            "RSS",
            "maps",
            "RSS + maps",
            "idle CPU",
            "passes while idle, by trigger",
            "at the lab's 7 pods (RSS + maps, idle CPU)",
        ]
        .map(str::to_owned)
        .into(),
        ..Table::default()
    };
    for c in &r.after {
        let before = r.before.iter().find(|b| b.node == c.node);
        t.rows.push(vec![
            c.node.clone(),
            mib(c.hwm_kib),
            mib(c.rss_kib),
            mib(c.maps_bytes / 1024),
            format!("**{}**", mib(c.rss_kib + c.maps_bytes / 1024)),
            format!("{:.1} %", c.cpu * 100.0),
            c.passes
                .iter()
                .map(|(t, n)| format!("{t} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
            before.map_or("-".to_owned(), |b| {
                format!(
                    "{}, {:.1} %",
                    mib(b.rss_kib + b.maps_bytes / 1024),
                    b.cpu * 100.0
                )
            }),
        ]);
    }
    t
}
