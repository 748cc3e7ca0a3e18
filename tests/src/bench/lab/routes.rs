//! Learned routes (`destinationsFrom: Routes`, issue 11) in the lab: one route added or
//! removed on the gateways until every source node's pinned POLICY_V4 follows, 10k routes
//! at once, and the compiler in this process with 10k learned routes.
//!
//! Each measurement runs under [`routes_policy`] (rule B learns its destinations from the
//! routes out of `sec-b`) and puts the sample policy and the gateways' routes back after,
//! even when it fails: the 10k-pod steps that follow must not meet learned routes.

use std::{
    net::Ipv4Addr,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use aya::maps::{HashMap as BpfHash, MapData};
use egress_common::policy::{PolicyKeyV4, PolicyValueV4, action};

use super::control::{Pause, lab_policy, policy_map, reconcile_took, sample_policy};
use crate::{
    cluster::holder,
    lab::{GatewayRoute, Lab, PAYMENTS, addr},
};

/// Gateways that get the routes (both: they must agree, else the rule is RoutesDegraded).
const GATEWAYS: [&str; 2] = ["gw1", "gw2"];
/// How often the latency samples read the maps (as the policy-edit latency does).
const POLL: Duration = Duration::from_micros(500);
/// How often [`route_scale`] reads them.
const SCALE_POLL: Duration = Duration::from_millis(1);
/// Routes added at once by [`route_scale`].
pub const SCALE_ROUTES: u32 = 10_000;
/// Where the lab's gateways route network D from the start: learned as soon as the policy
/// applies, so its entry tells that it did.
const NET_D: (Ipv4Addr, u8) = (Ipv4Addr::new(192, 168, 104, 0), 24);
/// Network E, routed by nobody until [`route_latency`] adds it.
const NET_E: (Ipv4Addr, u8) = (Ipv4Addr::new(192, 168, 105, 0), 24);

/// The sample policy with rule B as `destinationsFrom: Routes` (rule A as listed).
pub fn routes_policy() -> String {
    sample_policy(&format!(
        "    - destinations: [{a}]
      egressIP: {ea}
    - destinationsFrom: Routes
      egressIP: {eb}
",
        a = addr::NET_A,
        ea = addr::EGRESS_IP_A,
        eb = addr::EGRESS_IP_B,
    ))
}

/// The `i`-th route of [`route_scale`]: `10.<100 + i / 256>.<i % 256>.0/24`.
fn scale_prefix(i: u32) -> (Ipv4Addr, u8) {
    (
        Ipv4Addr::new(10, (100 + i / 256) as u8, (i % 256) as u8, 0),
        24,
    )
}

fn via_rtr_b((ip, len): (Ipv4Addr, u8)) -> String {
    format!("{ip}/{len} via {} dev sec-b", addr::RTR_B)
}

/// (node, ms) until a node's map showed a change.
type NodeMs = (String, f64);

/// A selected pod and its node's pinned policy map.
struct Source {
    node: String,
    pod: Ipv4Addr,
    map: BpfHash<MapData, PolicyKeyV4, PolicyValueV4>,
}

impl Source {
    /// Does the pod's entry for `prefix` forward to egress IP B?
    fn shows(&self, (dst, len): (Ipv4Addr, u8)) -> bool {
        let key = PolicyKeyV4::new(self.pod.octets(), dst.octets(), u32::from(len));
        // An exact key: the entry of that prefix itself.
        matches!(self.map.get(&key, 0), Ok(v)
            if v.action == action::FORWARD && v.egress_ip == addr::EGRESS_IP_B.octets())
    }
}

/// Every pod the sample policy selects (payments, app=api), with its node's policy map.
fn sources(lab: &Lab) -> Result<Vec<Source>> {
    let out: Vec<Source> = lab
        .pods()
        .iter()
        .filter(|p| p.namespace == PAYMENTS && p.labels.get("app").is_some_and(|a| a == "api"))
        .map(|p| {
            Ok(Source {
                node: p.node.clone(),
                pod: p.ip,
                map: policy_map(lab, &p.node)?,
            })
        })
        .collect::<Result<_>>()?;
    if out.is_empty() {
        bail!("the lab has no selected pod");
    }
    Ok(out)
}

/// Poll every source every `poll` until each shows (`want`) or no longer shows `prefix`;
/// (node, ms since `t0`) in the order they got there.
fn wait_all(
    sources: &[Source],
    prefix: (Ipv4Addr, u8),
    want: bool,
    t0: Instant,
    limit: Duration,
    poll: Duration,
) -> Result<Vec<(String, f64)>> {
    let mut done: Vec<(String, f64)> = Vec::new();
    loop {
        for s in sources {
            if !done.iter().any(|(n, _)| *n == s.node) && s.shows(prefix) == want {
                done.push((s.node.clone(), t0.elapsed().as_secs_f64() * 1e3));
            }
        }
        if done.len() == sources.len() {
            return Ok(done);
        }
        if t0.elapsed() > limit {
            let late: Vec<&str> = sources
                .iter()
                .filter(|s| !done.iter().any(|(n, _)| *n == s.node))
                .map(|s| s.node.as_str())
                .collect();
            bail!(
                "entry for {}/{} not {} in POLICY_V4 of {late:?} within {limit:?}",
                prefix.0,
                prefix.1,
                if want { "added" } else { "removed" },
            );
        }
        thread::sleep(poll);
    }
}

fn last(times: &[(String, f64)]) -> f64 {
    times.iter().map(|(_, ms)| *ms).fold(0.0, f64::max)
}

/// `ip -batch` of `lines` on each gateway, one after the other.
fn on_gateways(lab: &Lab, lines: &[String]) -> Result<()> {
    for gw in GATEWAYS {
        lab.ns(gw)?.ip_batch(lines)?;
    }
    Ok(())
}

/// Run `f` under [`routes_policy`], once every source shows network D (the policy
/// applied); then put the sample policy back, flush what the measurements may have left
/// on the gateways (`cleanup`), and wait until network D's entries are gone.
fn with_routes_policy<T>(
    lab: &Lab,
    cleanup: &[String],
    f: impl FnOnce(&[Source]) -> Result<T>,
) -> Result<T> {
    let sources = sources(lab)?;
    let out = (|| {
        lab.write_policy(&routes_policy())?;
        wait_all(
            &sources,
            NET_D,
            true,
            Instant::now(),
            Duration::from_secs(30),
            Duration::from_millis(5),
        )
        .context("the routes policy was not applied")?;
        f(&sources)
    })();
    let restored = (|| {
        lab.write_policy(&lab_policy(false))?;
        on_gateways(lab, cleanup)?;
        wait_all(
            &sources,
            NET_D,
            false,
            Instant::now(),
            Duration::from_secs(30),
            Duration::from_millis(5),
        )
        .context("the sample policy was not restored")
    })();
    let out = out?;
    restored?;
    Ok(out)
}

/// Add or remove network E's route on both gateways `n` times (one `ip -batch` each,
/// timed from just before the first) until every source node's POLICY_V4 shows the
/// change, polled every 0.5 ms; a sample is the time until the last node shows it.
pub fn route_latency(lab: &Lab, n: usize) -> Result<Vec<f64>> {
    let route = GatewayRoute::net_e(false);
    let cleanup = [format!("route flush exact {}", route.prefix)];
    with_routes_policy(lab, &cleanup, |sources| {
        let mut samples = Vec::new();
        let mut pause = Pause::default();
        let mut present = false;
        for _ in 0..n {
            let want = !present;
            let verb = if want { "add" } else { "del" };
            let line = [format!("route {verb} {route}")];
            let (_, times) = batch_until(lab, &line, sources, (NET_E, want), POLL)?;
            samples.push(last(&times));
            present = want;
            thread::sleep(pause.next());
        }
        Ok(samples)
    })
}

/// What [`route_scale`] measured.
#[derive(Clone, Debug, Default)]
pub struct RouteScale {
    /// (node, ms) from just before the first gateway's `ip -batch` of 10k `route add`
    /// until the node's POLICY_V4 held the last route's entry for its selected pod.
    pub add: Vec<(String, f64)>,
    /// The same for the 10k `route del`, until the entry was gone.
    pub del: Vec<(String, f64)>,
    /// ms from the same start until each gateway's `ip -batch` returned (gw1, gw2; both
    /// run at once), for (add, del): part of the above, the kernel's and `ip`'s share.
    pub batch_ms: ([f64; 2], [f64; 2]),
    /// Index in (gw1, gw2) of the gateway that holds egress IP B (whose routes count).
    pub serving: usize,
    /// (node, `took_ms` of the agent's reconcile that applied the most changes) while the
    /// routes were added, from the logs.
    pub reconcile_ms: Vec<(String, f64)>,
    /// w1's POLICY_V4 entries with the routes.
    pub w1_entries: usize,
    /// Bytes of the first gateway's EgressNode file with the routes.
    pub egress_node_bytes: u64,
    /// ms for this process to read the state directory (`yaml::load_dir`) without and with
    /// the gateways' 10k routes in their EgressNodes.
    pub load_ms: (Vec<f64>, Vec<f64>),
    /// In-process compile with 10k routes on the serving gateway's `sec-b`: (node, ms per
    /// compile, policy entries).
    pub compile: Vec<(String, Vec<f64>, usize)>,
}

/// Time `f` `rounds` times, in ms.
fn timed<T>(rounds: usize, mut f: impl FnMut() -> T) -> (Vec<f64>, T) {
    let mut ms = Vec::new();
    let mut once = || {
        let t = Instant::now();
        let out = f();
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        out
    };
    let mut out = once();
    for _ in 1..rounds {
        out = once();
    }
    (ms, out)
}

/// Add [`SCALE_ROUTES`] routes out of `sec-b` on both gateways (one `ip -batch` each) and
/// time until every source node's map holds the last one's entry (publish, propagate,
/// compile, apply), then delete them and time until it is gone; `rounds` in-process
/// compiles of the lab's state with 10k routes on the serving gateway.
pub fn route_scale(lab: &Lab, rounds: usize) -> Result<RouteScale> {
    use egress_agent::source::yaml;

    let prefixes: Vec<(Ipv4Addr, u8)> = (0..SCALE_ROUTES).map(scale_prefix).collect();
    let add: Vec<String> = prefixes
        .iter()
        .map(|p| format!("route add {}", via_rtr_b(*p)))
        .collect();
    let del: Vec<String> = prefixes
        .iter()
        .map(|p| format!("route del {}", via_rtr_b(*p)))
        .collect();
    let last_prefix = prefixes[prefixes.len() - 1];
    // Everything 10.100.0.0 to 10.139.255.255 (ignored when there is nothing to flush).
    let cleanup = [
        "route flush root 10.96.0.0/11".to_owned(),
        "route flush root 10.128.0.0/12".to_owned(),
    ];
    let (gw, _) = holder(lab, addr::EGRESS_IP_B).context("nobody holds egress IP B")?;
    let state = lab.state_dir();
    with_routes_policy(lab, &cleanup, |sources| {
        let mut out = RouteScale::default();
        let (base_ms, base) = timed(rounds, || yaml::load_dir(&state));
        let nodes = ["w1", "w2", "gw1", "gw2"];
        let offsets: Vec<usize> = nodes.iter().map(|n| lab.agent_log(n).len()).collect();

        let (batch_add, times) = batch_until(lab, &add, sources, (last_prefix, true), SCALE_POLL)?;
        out.add = times;
        // Let the agents finish (their log lines come after the maps).
        thread::sleep(Duration::from_millis(1500));
        for (node, off) in nodes.iter().zip(&offsets) {
            if let Some(ms) = reconcile_took(lab, node, *off) {
                out.reconcile_ms.push(((*node).to_owned(), ms));
            }
        }
        out.w1_entries = policy_map(lab, "w1")?.keys().count();
        let file = state.join(yaml::egress_node_file_name(GATEWAYS[0]));
        out.egress_node_bytes = std::fs::metadata(&file)
            .with_context(|| format!("failed to stat {}", file.display()))?
            .len();
        let (routed_ms, _) = timed(rounds, || yaml::load_dir(&state));
        out.load_ms = (base_ms, routed_ms);

        let (batch_del, times) = batch_until(lab, &del, sources, (last_prefix, false), SCALE_POLL)?;
        out.del = times;
        out.batch_ms = (batch_add, batch_del);

        out.serving = GATEWAYS.iter().position(|g| *g == gw).unwrap_or(0);
        out.compile = compile_routes(base.view, &gw, &prefixes, rounds)?;
        Ok(out)
    })
}

/// `lines` in one `ip -batch` on each gateway, both at once, while polling every `poll`
/// until every source shows `prefix` (`want`) or no longer does: ms until each gateway's
/// batch returned, and (node, ms), from just before they start.
fn batch_until(
    lab: &Lab,
    lines: &[String],
    sources: &[Source],
    (prefix, want): ((Ipv4Addr, u8), bool),
    poll: Duration,
) -> Result<([f64; 2], Vec<NodeMs>)> {
    let t0 = Instant::now();
    let namespaces = GATEWAYS.map(|gw| lab.ns(gw));
    thread::scope(|scope| {
        let batches: Vec<_> = namespaces
            .iter()
            .map(|ns| {
                scope.spawn(move || -> Result<f64> {
                    ns.as_ref()
                        .map_err(|e| anyhow::anyhow!("{e:#}"))?
                        .ip_batch(lines)?;
                    Ok(t0.elapsed().as_secs_f64() * 1e3)
                })
            })
            .collect();
        let times = wait_all(sources, prefix, want, t0, Duration::from_secs(60), poll);
        let mut batch = [0.0; 2];
        for (handle, ms) in batches.into_iter().zip(&mut batch) {
            *ms = handle
                .join()
                .map_err(|_| anyhow::anyhow!("an `ip -batch` thread panicked"))??;
        }
        Ok((batch, times?))
    })
}

/// The compiler in this process on `view` with `prefixes` routed out of `gateway`'s
/// `sec-b`: (node, ms per compile, policy entries) for w1 and for `gateway`.
fn compile_routes(
    mut view: egress_agent::source::ClusterView,
    gateway: &str,
    prefixes: &[(Ipv4Addr, u8)],
    rounds: usize,
) -> Result<Vec<(String, Vec<f64>, usize)>> {
    use egress_agent::compiler::compile;

    let node = view
        .egress_nodes
        .iter_mut()
        .find(|n| n.metadata.name.as_deref() == Some(gateway))
        .with_context(|| format!("no EgressNode {gateway} in the state directory"))?;
    let iface = node
        .status
        .as_mut()
        .and_then(|s| s.interfaces.iter_mut().find(|i| i.name == "sec-b"))
        .with_context(|| format!("EgressNode {gateway} lists no sec-b"))?;
    iface
        .routes
        .extend(prefixes.iter().map(|(ip, len)| format!("{ip}/{len}")));
    let mut out = Vec::new();
    for name in ["w1", gateway] {
        let (ms, c) = timed(rounds, || compile(&view, name));
        out.push((name.to_owned(), ms, c.desired.v4.policy.len()));
    }
    Ok(out)
}
