//! Control-plane measurements in the lab: change-to-map latency (read from the pinned map
//! by this process), apply of the 10k-pod state, agent peak RSS, and the compiler's time at
//! 10k pods x 10 prefixes in this process.

use std::{
    collections::HashSet,
    fmt::Write as _,
    net::Ipv4Addr,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use aya::maps::{HashMap as BpfHash, Map, MapData};
use egress_common::{
    maps as names,
    policy::{
        AdmittedKeyV4, AdmittedValue, PodOwnerValue, PolicyKeyV4, PolicyValueV4, SelectedValueV4,
        action,
    },
    underlay,
};

use super::baseline::{DECOY_CIDR, decoy_ip};
use crate::{
    bench::report::thousands,
    cluster::{holder, wait_until},
    lab::{Lab, addr},
    netns,
};

/// The extra state file with the bench's served pods.
pub const PODS_FILE: &str = "bench-pods.yaml";
/// The `except` prefix the latency test toggles (inside network A, clear of host-a).
const EXCEPT: (Ipv4Addr, u8) = (Ipv4Addr::new(192, 168, 101, 192), 26);

/// The sample policy (pods app=api in namespaces team=payments) with `rules`, a YAML list
/// indented by four spaces.
pub(super) fn sample_policy(rules: &str) -> String {
    format!(
        "---
apiVersion: egress.dev/v1alpha1
kind: EgressGatewayPolicy
metadata:
  name: payments
spec:
  namespaceSelector:
    matchLabels:
      team: payments
  podSelector:
    matchLabels:
      app: api
  gatewaySelector:
    matchLabels:
      egress.dev/gateway: \"true\"
  failurePolicy: Drop
  rules:
{rules}"
    )
}

fn policy_yaml(except: bool, extra_a: &[String]) -> String {
    let mut dests = vec![addr::NET_A.to_owned()];
    dests.extend(extra_a.iter().cloned());
    let except = if except {
        format!("\n      except: [{}/{}]", EXCEPT.0, EXCEPT.1)
    } else {
        String::new()
    };
    sample_policy(&format!(
        "    - destinations: [{dests}]
      egressIP: {a}{except}
    - destinations: [{b}]
      egressIP: {eb}
",
        dests = dests.join(", "),
        a = addr::EGRESS_IP_A,
        b = addr::NET_B,
        eb = addr::EGRESS_IP_B,
    ))
}

/// The sample policy's two rules, optionally with the toggled `except`.
pub fn lab_policy(except: bool) -> String {
    policy_yaml(except, &[])
}

/// `n` Pods on w2, `bench-<i>` in `payments`, app=api, IPs from [`decoy_ip`].
pub fn pods_yaml(n: u32) -> String {
    let mut s = String::with_capacity(n as usize * 420);
    for i in 0..n {
        let ip = decoy_ip(i);
        let _ = write!(
            s,
            "---
apiVersion: v1
kind: Pod
metadata:
  name: bench-{i}
  namespace: payments
  labels:
    app: api
spec:
  nodeName: w2
  containers:
    - name: app
      image: egress-echo
status:
  phase: Running
  hostIP: {w2}
  podIP: {ip}
  podIPs:
    - ip: {ip}
  conditions:
    - type: Ready
      status: \"True\"
",
            w2 = addr::W2
        );
    }
    s
}

fn open_pinned(lab: &Lab, node: &str, map: &str) -> Result<MapData> {
    let path = lab.bpffs_dir(node).join(map);
    MapData::from_pin(&path).with_context(|| format!("failed to open {}", path.display()))
}

pub(super) fn policy_map(
    lab: &Lab,
    node: &str,
) -> Result<BpfHash<MapData, PolicyKeyV4, PolicyValueV4>> {
    let data = open_pinned(lab, node, names::POLICY_V4)?;
    BpfHash::try_from(Map::HashMap(data)).context("POLICY_V4 is not a hash")
}

fn selected_map(lab: &Lab, node: &str) -> Result<BpfHash<MapData, [u8; 4], SelectedValueV4>> {
    let data = open_pinned(lab, node, names::SELECTED_V4)?;
    BpfHash::try_from(Map::HashMap(data)).context("SELECTED_V4 is not a hash")
}

pub(super) fn pod_owner(lab: &Lab, node: &str) -> Result<BpfHash<MapData, [u8; 4], PodOwnerValue>> {
    let data = open_pinned(lab, node, names::POD_OWNER_V4)?;
    BpfHash::try_from(Map::HashMap(data)).context("POD_OWNER_V4 is not a hash")
}

fn admitted(lab: &Lab, node: &str) -> Result<BpfHash<MapData, AdmittedKeyV4, AdmittedValue>> {
    let data = open_pinned(lab, node, names::ADMITTED_V4)?;
    BpfHash::try_from(Map::HashMap(data)).context("ADMITTED_V4 is not a hash")
}

/// Is the except entry of w1-p1 in w1's policy map?
fn except_present(map: &BpfHash<MapData, PolicyKeyV4, PolicyValueV4>) -> bool {
    let key = PolicyKeyV4::new(addr::W1_P1.octets(), EXCEPT.0.octets(), u32::from(EXCEPT.1));
    matches!(map.get(&key, 0), Ok(v) if v.action == action::EXCLUDE)
}

/// A pseudo-random pause between samples (30 to 230 ms), so they do not lock onto the
/// watcher's safety-net poll.
#[derive(Clone, Copy, Debug)]
pub(super) struct Pause(u64);

impl Default for Pause {
    fn default() -> Self {
        Self(0x9e37_79b9_7f4a_7c15)
    }
}

impl Pause {
    pub(super) fn next(&mut self) -> Duration {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        Duration::from_millis(30 + (self.0 >> 33) % 200)
    }
}

/// Toggle the `except` prefix `n` times; each sample is the time from the policy file's
/// rename to the entry appearing in (or leaving) w1's pinned POLICY_V4, polled every
/// 0.5 ms. Leaves the policy without the except.
pub fn change_latency(lab: &Lab, n: usize) -> Result<Vec<f64>> {
    let map = policy_map(lab, "w1")?;
    let mut samples = Vec::new();
    let mut pause = Pause::default();
    let mut want = !except_present(&map);
    for _ in 0..n {
        let t0 = Instant::now();
        lab.write_policy(&lab_policy(want))?;
        loop {
            if except_present(&map) == want {
                samples.push(t0.elapsed().as_secs_f64() * 1e3);
                break;
            }
            if t0.elapsed() > Duration::from_secs(10) {
                bail!("w1's POLICY_V4 did not follow the policy within 10 s");
            }
            thread::sleep(Duration::from_micros(500));
        }
        want = !want;
        thread::sleep(pause.next());
    }
    if !want {
        // The last write added the except: put the sample back.
        lab.write_policy(&lab_policy(false))?;
    }
    Ok(samples)
}

/// How long each node took to apply the 10k-pod file.
#[derive(Clone, Debug, Default)]
pub struct Apply {
    /// (node, what was checked, ms from the file's rename until it showed).
    pub nodes: Vec<(String, String, f64)>,
    /// (node, `took_ms` of the agent's own reconcile that applied it), from the logs.
    pub reconcile_ms: Vec<(String, f64)>,
    /// (node, policy entries, pod owners) after the apply.
    pub sizes: Vec<(String, usize, usize)>,
}

fn count<T>(it: impl Iterator<Item = T>) -> usize {
    it.count()
}

/// Write the 10k-pod file and time until each node's maps (w2: the policy entries of
/// the last pod; gateways: its pod-owner entry) or, for w1 (which none of them
/// concern), the agent's next `reconciled` log line show it. Before that, untimed, w2 is
/// set up for the pods as a CNI would be: [`DECOY_CIDR`] among its Node's pod CIDRs, a
/// /32 route per pod to a veth, `bench0` (no dummy driver here; one device for all of
/// them), and every agent has read the new Node.
pub fn apply_pods(lab: &mut Lab, pods: u32) -> Result<Apply> {
    let nodes = ["w1", "w2", "gw1", "gw2"];
    let offsets: Vec<usize> = nodes.iter().map(|n| lab.agent_log(n).len()).collect();
    lab.add_pod_cidr("w2", DECOY_CIDR)?;
    let mut routes: Vec<String> = [
        "link add bench0 type veth peer name bench1",
        "link set bench1 up",
        "link set bench0 up",
    ]
    .map(str::to_owned)
    .into();
    routes.extend((0..pods).map(|i| format!("route add {}/32 dev bench0", decoy_ip(i))));
    lab.ns("w2")?.ip_batch(&routes)?;
    let read = wait_until(Duration::from_secs(10), || {
        nodes.iter().zip(&offsets).all(|(n, off)| {
            lab.agent_log(n)
                .get(*off..)
                .is_some_and(|l| l.contains("reconciled trigger=\"state\""))
        })
    });
    read.context("the agents did not reconcile w2's new pod CIDR within 10 s")?;
    // Quiet before the clock starts: the state source's one-second poll may read the new
    // Node again, and a late `reconciled` line would pass for w1's apply.
    let lengths = || nodes.map(|n| lab.agent_log(n).len());
    let quiet = wait_until(Duration::from_secs(10), || {
        let before = lengths();
        thread::sleep(Duration::from_millis(1200));
        lengths() == before
    });
    quiet.context("the agents' logs did not settle within 10 s of w2's new pod CIDR")?;
    let last = decoy_ip(pods - 1);
    let offsets: Vec<usize> = nodes.iter().map(|n| lab.agent_log(n).len()).collect();
    let text = pods_yaml(pods);
    let t0 = Instant::now();
    lab.write_state_file(PODS_FILE, &text)?;
    let mut out = Apply::default();
    let w2 = policy_map(lab, "w2")?;
    let owners: Vec<_> = ["gw1", "gw2"]
        .iter()
        .map(|g| pod_owner(lab, g))
        .collect::<Result<_>>()?;
    let last_key = PolicyKeyV4::new(last.octets(), addr::HOST_A.octets(), 24);
    let mut done = [false; 4];
    while !done.iter().all(|d| *d) {
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        if !done[0] {
            let log = lab.agent_log("w1");
            if log
                .get(offsets[0]..)
                .is_some_and(|l| l.contains("reconciled"))
            {
                done[0] = true;
                out.nodes
                    .push(("w1".into(), "next `reconciled` log line".into(), ms));
            }
        }
        if !done[1] && w2.get(&last_key, 0).is_ok() {
            done[1] = true;
            out.nodes
                .push(("w2".into(), "last pod's POLICY_V4 entry".into(), ms));
        }
        for (i, o) in owners.iter().enumerate() {
            if !done[2 + i] && o.get(&last.octets(), 0).is_ok() {
                done[2 + i] = true;
                out.nodes.push((
                    nodes[2 + i].into(),
                    "last pod's POD_OWNER_V4 entry".into(),
                    ms,
                ));
            }
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("the 10k-pod state was not applied everywhere within 60 s: {out:?}");
        }
        thread::sleep(Duration::from_millis(2));
    }
    // Let the agents finish (their log lines come after the maps).
    thread::sleep(Duration::from_millis(1500));
    for (node, off) in nodes.iter().zip(&offsets) {
        if let Some(ms) = reconcile_took(lab, node, *off) {
            out.reconcile_ms.push(((*node).to_owned(), ms));
        }
        let policy = count(policy_map(lab, node)?.keys());
        let owners = count(pod_owner(lab, node)?.keys());
        out.sizes.push(((*node).to_owned(), policy, owners));
    }
    Ok(out)
}

/// Check that the `pods` decoy pods of [`apply_pods`] are served as the report says,
/// before anything is timed with them: w2 selects each one (`SELECTED_V4`), logged no
/// problem (such as "no route to its device") since byte `w2_log` of its log and has
/// `from_pod` on `bench0` (its link pin); the gateway holding egress IP A knows each
/// one's node (`POD_OWNER_V4`: w2) and admits it (`ADMITTED_V4`). Returns what was
/// checked, for the report.
pub fn check_served(lab: &Lab, pods: u32, w2_log: usize) -> Result<String> {
    let each = |what: &str, ok: &dyn Fn(&[u8; 4]) -> bool| -> Result<()> {
        let lacking: Vec<Ipv4Addr> = (0..pods)
            .map(decoy_ip)
            .filter(|ip| !ok(&ip.octets()))
            .collect();
        match lacking.first() {
            None => Ok(()),
            Some(first) => bail!(
                "{} of the {pods} decoy pods have no {what} (first: {first})",
                lacking.len()
            ),
        }
    };
    let selected = selected_map(lab, "w2")?;
    each("SELECTED_V4 entry on w2", &|ip| selected.get(ip, 0).is_ok())?;
    let log = lab.agent_log("w2");
    let problems: Vec<&str> = log
        .get(w2_log..)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("problem: "))
        .collect();
    if let Some(first) = problems.first() {
        bail!(
            "w2's agent logged {} problems since the decoy pods came, first: {first}",
            problems.len()
        );
    }
    let pin = lab.bpffs_dir("w2");
    let attached = std::fs::read_dir(&pin)
        .with_context(|| format!("failed to read {}", pin.display()))?
        .filter_map(|e| e.ok())
        .any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("link-from_pod@bench0@")
        });
    if !attached {
        bail!("w2's agent did not attach from_pod to bench0, the decoy pods' device");
    }
    let (gw, _) = holder(lab, addr::EGRESS_IP_A)
        .with_context(|| format!("nobody holds {}", addr::EGRESS_IP_A))?;
    let owners = pod_owner(lab, &gw)?;
    let w2 = underlay::from_v4(addr::W2.octets());
    each(
        &format!("POD_OWNER_V4 entry (w2) on {gw}"),
        &|ip| matches!(owners.get(ip, 0), Ok(o) if o.node == w2),
    )?;
    let admitted: HashSet<[u8; 4]> = admitted(lab, &gw)?
        .keys()
        .filter_map(Result::ok)
        .map(|k| k.pod)
        .collect();
    each(&format!("ADMITTED_V4 entry on {gw}"), &|ip| {
        admitted.contains(ip)
    })?;
    Ok(format!(
        "Checked before the runs at {} served pods: w2's agent selects each decoy pod \
         (SELECTED_V4), logged no problem and attached `from_pod` to `bench0`; {gw}, \
         which holds {}, has a POD_OWNER_V4 entry (w2) and an ADMITTED_V4 entry for each.",
        thousands(u64::from(pods)),
        addr::EGRESS_IP_A,
    ))
}

/// `took_ms` of the `reconciled` log line of `node`'s agent that changed the most map
/// entries, among those after byte `offset` of its log.
pub(super) fn reconcile_took(lab: &Lab, node: &str, offset: usize) -> Option<f64> {
    let log = lab.agent_log(node);
    log.get(offset..)?
        .lines()
        .filter(|l| l.contains("reconciled"))
        .filter_map(|l| {
            let changed: u64 = field(l, "changed=")?.parse().ok()?;
            let took: f64 = field(l, "took_ms=")?.parse().ok()?;
            Some((changed, took))
        })
        .max_by_key(|(c, _)| *c)
        .map(|(_, took)| took)
}

fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let rest = &line[line.find(name)? + name.len()..];
    rest.split_whitespace().next()
}

/// (node, VmHWM KiB, VmRSS KiB) of each running agent.
pub fn agent_memory(lab: &Lab) -> Result<Vec<(String, u64, u64)>> {
    Ok(agent_pids(lab)?
        .into_iter()
        .map(|(node, pid)| {
            let (hwm, rss) = (status_kib(pid, "VmHWM:"), status_kib(pid, "VmRSS:"));
            (node, hwm, rss)
        })
        .collect())
}

/// The agents' processes, by node.
pub(crate) fn agent_pids(lab: &Lab) -> Result<Vec<(String, i32)>> {
    let mut out = Vec::new();
    for node in lab.nodes().iter().map(|n| n.name) {
        for pid in netns::netns_pids(&lab.ns_name(node))? {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "egress-agent" {
                out.push((node.to_owned(), pid));
            }
        }
    }
    Ok(out)
}

/// A `/proc/<pid>/status` figure in KiB (`VmHWM:`, `VmRSS:`); 0 when absent.
pub(crate) fn status_kib(pid: i32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The compiler in this process at `pods` pods x 10 prefixes: the lab's state directory
/// (Nodes, Namespaces, EgressNodes, the pods file) with a policy whose rule A has ten
/// destination prefixes. Returns (ms per compile for w2, the pods' node, and for gw1;
/// policy entries for w2).
pub fn compile_10_prefixes(state_dir: &Path, rounds: usize) -> Result<(Vec<f64>, Vec<f64>, usize)> {
    use egress_agent::{compiler::compile, source::yaml};
    let mut snap = yaml::load_dir(state_dir);
    let extra: Vec<String> = (0..9).map(|i| format!("198.18.{i}.0/24")).collect();
    let policy = yaml::load_str("bench-policy.yaml", &policy_yaml(false, &extra));
    if !policy.errors.is_empty() || policy.view.policies.len() != 1 {
        bail!("bench policy did not parse: {:?}", policy.errors);
    }
    snap.view.policies = policy.view.policies;
    let (mut w2, mut gw1, mut entries) = (Vec::new(), Vec::new(), 0);
    for _ in 0..rounds {
        let t = Instant::now();
        let c = compile(&snap.view, "w2");
        w2.push(t.elapsed().as_secs_f64() * 1e3);
        entries = c.desired.v4.policy.len();
        let t = Instant::now();
        let c = compile(&snap.view, "gw1");
        gw1.push(t.elapsed().as_secs_f64() * 1e3);
        drop(c);
    }
    Ok((w2, gw1, entries))
}
