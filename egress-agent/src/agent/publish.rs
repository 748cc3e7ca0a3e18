//! What the agent tells the cluster: its EgressNode (inventory, held IPs, peers), built
//! here; where it goes (and the policy statuses and Events) is the source's
//! [`StatusWriter`](crate::source::StatusWriter).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use anyhow::Result;
use ipnet::IpNet;
use tracing::{info, warn};

use super::{Reconciler, RunConfig, holding::Holding};
use crate::{
    api::{
        EgressNode, EgressNodeSpec, EgressNodeStatus, FullPolicyMap, HeldEgressIp, MAX_ROUTES,
        NodeInterface, PeerLiveness, PodScope, PreflightCheck, PreflightResult,
    },
    compiler::{Compiled, Holder},
    iface,
    liveness::{PeerStatus, PeerView},
    metrics,
    source::{ClusterView, Event, StatusWriter},
};

/// This node's interfaces as it publishes them: every one with an address but the
/// loopback and the tunnel, in `ifaces` order, with its addresses (without the egress IPs
/// this node holds) and the destinations `routes` (by ifindex) sends out of it, capped as
/// [`capped_routes`] says.
pub fn node_interfaces(
    ifaces: &[iface::Interface],
    tunnel: &str,
    holdings: &BTreeMap<IpAddr, Holding>,
    routes: &BTreeMap<u32, BTreeSet<IpNet>>,
) -> Vec<NodeInterface> {
    let listed: Vec<&iface::Interface> = ifaces
        .iter()
        .filter(|i| i.name != "lo" && i.name != tunnel && !i.addresses.is_empty())
        .collect();
    let lists = capped_routes(
        listed
            .iter()
            .map(|i| {
                let all = routes.get(&i.ifindex).into_iter().flatten().copied();
                (i.name.as_str(), all.collect())
            })
            .collect(),
        MAX_ROUTES,
    );
    listed
        .into_iter()
        .zip(lists)
        .map(|(i, (routes, routes_omitted))| NodeInterface {
            name: i.name.clone(),
            up: i.up,
            addresses: i
                .addresses
                .iter()
                // Our own egress IPs are not part of the inventory.
                .filter(|(a, _)| !holdings.contains_key(a))
                .map(|(a, l)| format!("{a}/{l}"))
                .collect(),
            routes,
            routes_omitted,
        })
        .collect()
}

/// Each interface's routes as published, in the order given: sorted (IPv4 first, then
/// shorter prefixes first, then by address), within a node-wide `budget` spent in
/// interface name order; with the number left out past the budget.
fn capped_routes(interfaces: Vec<(&str, Vec<IpNet>)>, budget: usize) -> Vec<(Vec<String>, u32)> {
    let mut by_name: Vec<usize> = (0..interfaces.len()).collect();
    by_name.sort_by_key(|&i| interfaces[i].0);
    let mut out = vec![(Vec::new(), 0); interfaces.len()];
    let mut left = budget;
    for i in by_name {
        let mut all = interfaces[i].1.clone();
        all.sort_unstable_by_key(|n| (n.addr().is_ipv6(), n.prefix_len(), n.addr()));
        let kept = all.len().min(left);
        left -= kept;
        let omitted = u32::try_from(all.len() - kept).unwrap_or(u32::MAX);
        out[i] = (
            all[..kept].iter().map(ToString::to_string).collect(),
            omitted,
        );
    }
    out
}

/// Warn once for each interface whose routes no longer all fit in the EgressNode (it was
/// not in `capped`, the interfaces capped as of the last pass), and say when one fits
/// again. Returns the interfaces capped now.
pub fn warn_capped(capped: &BTreeSet<String>, interfaces: &[NodeInterface]) -> BTreeSet<String> {
    let now: BTreeSet<String> = interfaces
        .iter()
        .filter(|i| i.routes_omitted > 0)
        .map(|i| i.name.clone())
        .collect();
    for i in interfaces.iter().filter(|i| i.routes_omitted > 0) {
        if !capped.contains(&i.name) {
            warn!(
                interface = %i.name,
                published = i.routes.len(),
                omitted = i.routes_omitted,
                "failed to publish every route out of interface {}: a node publishes at most \
                 {MAX_ROUTES} routes over all its interfaces, so {} of its routes (the longest \
                 prefixes) are left out and rules with destinationsFrom: Routes do not reach \
                 them through this node; remove routes or summarize them into fewer, shorter \
                 prefixes",
                i.name,
                i.routes_omitted,
            );
        }
    }
    for name in capped.difference(&now) {
        info!(interface = %name, "every route out of the interface is published again");
    }
    now
}

/// This node's EgressNode: its interfaces (see [`node_interfaces`]), what it holds, the
/// peers it probes, and its preflight (`egress-agent doctor` at start, refused addresses).
pub fn egress_node_doc(
    name: &str,
    underlay: Option<IpAddr>,
    interfaces: Vec<NodeInterface>,
    holdings: &BTreeMap<IpAddr, Holding>,
    peers: &[PeerStatus],
    cut_off: bool,
    preflight: Vec<PreflightCheck>,
) -> EgressNode {
    let mut doc = EgressNode::new(
        name,
        EgressNodeSpec {
            underlay_ip: underlay.map(|u| u.to_string()),
        },
    );
    doc.status = Some(EgressNodeStatus {
        interfaces,
        egress_ips: holdings
            .iter()
            .map(|(ip, h)| HeldEgressIp {
                ip: ip.to_string(),
                interface: h.interface.clone(),
                epoch: h.epoch,
                since: Some(h.since.clone()),
                reason: Some(h.reason.clone()),
            })
            .collect(),
        peers: peers
            .iter()
            .map(|p| PeerLiveness {
                name: p.name.clone(),
                alive: p.alive,
            })
            .collect(),
        cut_off,
        preflight,
        hello_version: Some(u32::from(crate::liveness::hello::VERSION)),
        agent_version: Some(crate::VERSION.to_owned()),
        liveness_authenticated: None,
        full_policy_maps: Vec::new(),
        pod_scope: PodScope::Cluster,
    });
    doc
}

impl Reconciler<'_> {
    /// Write this node's EgressNode when it changed ([`Publisher::publish_node`]), and
    /// its part of the metrics.
    pub(super) fn publish_node(
        &mut self,
        underlay: Option<IpAddr>,
        ifaces: &[iface::Interface],
        peers: &PeerView,
    ) -> Result<()> {
        let statuses = self.probes.status();
        let holdings = self.own.holdings();
        let cut_off = peers.dead.contains(&self.cfg.node_name);
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.liveness.peers.clone_from(&statuses);
        s.liveness.cut_off = cut_off;
        s.liveness.refused = self.probes.refused();
        s.liveness.late_hellos = self.probes.late_sends();
        s.liveness.authenticated = self.probes.authenticated();
        s.liveness.remaps = self.probes.remaps().stats();
        s.liveness.remaps_kept = self.probes.remaps().kept();
        s.liveness.held = holdings
            .iter()
            .map(|(ip, h)| metrics::HeldStat {
                ip: ip.to_string(),
                interface: h.interface.clone(),
                epoch: h.epoch,
                since: h.since.clone(),
                reason: h.reason.clone(),
            })
            .collect();
        let interfaces = self.publisher.interfaces(ifaces, holdings);
        s.routes_published = interfaces
            .iter()
            .map(|i| (i.name.clone(), i.routes.len()))
            .collect();
        drop(s);
        let report = NodeReport {
            underlay,
            holdings,
            refused: self
                .own
                .refused()
                .map(|(ip, m)| (ip, m.to_owned()))
                .collect(),
            peers: &statuses,
            cut_off,
            authenticated: self.probes.authenticated(),
        };
        self.publisher.publish_node(interfaces, &report)
    }
}

/// What an EgressNode says its node holds (nothing without one).
pub fn held_in(doc: Option<&EgressNode>) -> &[HeldEgressIp] {
    doc.and_then(|d| d.status.as_ref())
        .map_or(&[], |s| s.egress_ips.as_slice())
}

/// Where each dedicated egress IP is held: address -> (node, interface).
pub type Placement = BTreeMap<IpAddr, (String, String)>;

/// The dedicated holders of `holders` as a [`Placement`], and each change from `last` in
/// words (moved, newly assigned, left without a holder), by address. Nothing is "newly
/// assigned" on the first pass (`last` empty): an agent that starts reports no moves.
pub fn holder_moves(last: &Placement, holders: &[Holder]) -> (Placement, Vec<(IpAddr, String)>) {
    let dedicated = || holders.iter().filter(|h| !h.shared);
    let now: Placement = dedicated()
        .map(|h| (h.ip, (h.node.clone(), h.interface.clone())))
        .collect();
    let mut moves = Vec::new();
    for h in dedicated() {
        let (ip, node, interface) = (h.ip, &h.node, &h.interface);
        match last.get(&ip) {
            Some((old, _)) if old != node => moves.push((
                ip,
                format!(
                    "egress IP {ip} moved from {old} to {node} ({interface}): {}",
                    h.reason
                ),
            )),
            None if !last.is_empty() => {
                moves.push((
                    ip,
                    format!("egress IP {ip} assigned to {node} ({interface})"),
                ));
            }
            _ => {}
        }
    }
    for ip in last.keys().filter(|ip| !now.contains_key(ip)) {
        moves.push((*ip, format!("egress IP {ip} has no holder")));
    }
    (now, moves)
}

/// A start-time preflight line about an egress IP (`egress-ip X`, `duplicate-address
/// X`), as it stands now: once this node holds X, it says so rather than what was found
/// before it did.
fn refreshed(check: &PreflightCheck, holdings: &BTreeMap<IpAddr, Holding>) -> PreflightCheck {
    let ip = check
        .check
        .strip_prefix("egress-ip ")
        .or_else(|| check.check.strip_prefix("duplicate-address "))
        .and_then(|ip| ip.parse::<IpAddr>().ok());
    match ip.and_then(|ip| holdings.get(&ip)) {
        Some(h) => PreflightCheck {
            check: check.check.clone(),
            result: PreflightResult::Ok,
            message: format!(
                "held by this node on {} since {} (at start: {}: {})",
                h.interface,
                h.since,
                check.result,
                // The line's schema allows 1,024 characters.
                check.message.chars().take(640).collect::<String>()
            ),
        },
        None => check.clone(),
    }
}

/// What this node tells the cluster (through the source's [`StatusWriter`]) and what it
/// last told it: its EgressNode, the policy statuses and Events of the holders' moves.
pub(super) struct Publisher<'a> {
    cfg: &'a RunConfig,
    sink: Box<dyn StatusWriter>,
    /// The EgressNode last written.
    last_node_doc: Option<EgressNode>,
    /// The destinations routed out of each interface (by ifindex), from the last route
    /// dump that succeeded.
    route_prefixes: BTreeMap<u32, BTreeSet<IpNet>>,
    /// Interfaces whose routes did not all fit in the last EgressNode.
    routes_capped: BTreeSet<String>,
    /// Egress IP -> (node, interface) as of the last pass, to report moves.
    last_holders: Placement,
    /// What `doctor` found at start, kept current by the passes.
    preflight: Vec<PreflightCheck>,
    /// This node's policy maps that the last pass could not fit.
    full_policy_maps: Vec<FullPolicyMap>,
}

/// What the EgressNode says of this node's liveness and holdings, besides its interfaces.
pub(super) struct NodeReport<'r> {
    pub underlay: Option<IpAddr>,
    pub holdings: &'r BTreeMap<IpAddr, Holding>,
    /// Addresses refused because another host answers for them, with the problem.
    pub refused: Vec<(IpAddr, String)>,
    pub peers: &'r [PeerStatus],
    pub cut_off: bool,
    pub authenticated: bool,
}

impl<'a> Publisher<'a> {
    /// A publisher that has published nothing yet, with `doctor`'s `preflight` at start.
    pub(super) fn new(
        cfg: &'a RunConfig,
        sink: Box<dyn StatusWriter>,
        preflight: Vec<PreflightCheck>,
    ) -> Self {
        Self {
            cfg,
            sink,
            last_node_doc: None,
            route_prefixes: BTreeMap::new(),
            routes_capped: BTreeSet::new(),
            last_holders: Placement::new(),
            preflight,
            full_policy_maps: Vec::new(),
        }
    }

    /// What this node's EgressNode says it holds: as this agent last wrote it, or, before
    /// it has, as `view` has it (what an earlier agent published). Read once a pass.
    pub(super) fn held(&self, view: &ClusterView) -> Vec<HeldEgressIp> {
        let me = self.cfg.node_name.as_str();
        let doc = self.last_node_doc.as_ref().or_else(|| {
            view.egress_nodes
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(me))
        });
        held_in(doc).to_vec()
    }

    /// Replace the EgressNode's preflight line of `check`'s name (or add it): the line
    /// says what is true now, not at start.
    pub(super) fn set_preflight(&mut self, check: PreflightCheck) {
        match self.preflight.iter_mut().find(|c| c.check == check.check) {
            Some(c) => *c = check,
            None => self.preflight.push(check),
        }
    }

    /// This node's policy maps that the pass could not fit, for the EgressNode.
    pub(super) fn set_full_policy_maps(&mut self, full: Vec<FullPolicyMap>) {
        self.full_policy_maps = full;
    }

    /// A route dump succeeded: its destinations by interface, for the EgressNode (which
    /// keeps the last good dump's while dumps fail).
    pub(super) fn routes_dumped(&mut self, prefixes: &BTreeMap<u32, BTreeSet<IpNet>>) {
        self.route_prefixes.clone_from(prefixes);
    }

    /// This node's interfaces as its EgressNode lists them ([`node_interfaces`]), with a
    /// warning when their routes stop fitting.
    pub(super) fn interfaces(
        &mut self,
        ifaces: &[iface::Interface],
        holdings: &BTreeMap<IpAddr, Holding>,
    ) -> Vec<NodeInterface> {
        let interfaces = node_interfaces(
            ifaces,
            &self.cfg.tunnel_device,
            holdings,
            &self.route_prefixes,
        );
        self.routes_capped = warn_capped(&self.routes_capped, &interfaces);
        interfaces
    }

    /// Write this node's EgressNode, of `interfaces` and `report`, when it changed.
    pub(super) fn publish_node(
        &mut self,
        interfaces: Vec<NodeInterface>,
        report: &NodeReport<'_>,
    ) -> Result<()> {
        let refused = report.refused.iter().map(|(ip, message)| PreflightCheck {
            check: format!("duplicate-address {ip}"),
            result: PreflightResult::Fail,
            message: message.clone(),
        });
        let preflight = self
            .preflight
            .iter()
            .map(|c| refreshed(c, report.holdings))
            .chain(refused)
            .collect();
        let mut doc = egress_node_doc(
            &self.cfg.node_name,
            report.underlay,
            interfaces,
            report.holdings,
            report.peers,
            report.cut_off,
            preflight,
        );
        if let Some(s) = doc.status.as_mut() {
            s.liveness_authenticated = Some(report.authenticated);
            s.full_policy_maps.clone_from(&self.full_policy_maps);
            // Set by `report`, after the maps are written.
            s.pod_scope = self
                .last_node_doc
                .as_ref()
                .and_then(|d| d.status.as_ref())
                .map(|s| s.pod_scope)
                .unwrap_or_default();
        }
        if self.last_node_doc.as_ref() != Some(&doc) {
            self.sink.egress_node(&doc)?;
            self.last_node_doc = Some(doc);
        }
        Ok(())
    }

    /// Say in this node's EgressNode which pods its maps were written from, when that
    /// changed: a gateway is eligible only once they are every pod of the cluster.
    fn publish_pod_scope(&mut self, scope: PodScope) {
        let Some(doc) = self.last_node_doc.as_mut() else {
            return;
        };
        let Some(status) = doc.status.as_mut().filter(|s| s.pod_scope != scope) else {
            return;
        };
        status.pod_scope = scope;
        info!(pods = ?scope, "maps written from this view of the pods");
        if let Err(e) = self.sink.egress_node(doc) {
            warn!("failed to publish the EgressNode's pod scope: {e:#}");
        }
    }

    /// The pods this node needs, to the source; the pods its maps were written from, in
    /// its EgressNode; policy statuses and holder moves: logged always, written to the
    /// API (statuses, Events) by the compile's status writer only, once its view holds
    /// every pod.
    pub(super) fn report(&mut self, compiled: &Compiled) {
        self.sink.pods_needed(compiled.pods_needed);
        self.publish_pod_scope(compiled.pod_scope);
        let writer = compiled.status_writer.as_deref() == Some(self.cfg.node_name.as_str());
        if writer && compiled.pod_scope != PodScope::Cluster {
            // Just elected (its source is listing every pod now): statuses counted from
            // this node's pods would be wrong. The moves are logged and written once it
            // has them all.
            return;
        }
        let (now, moves) = holder_moves(&self.last_holders, &compiled.holders);
        self.last_holders = now;
        for (_, m) in &moves {
            info!("{m}");
        }
        if !writer {
            return;
        }
        self.sink.policy_statuses(&compiled.statuses);
        for (ip, message) in moves {
            if let Some(h) = compiled.holders.iter().find(|h| h.ip == ip) {
                self.sink.event(Event {
                    policy: h.policy.clone(),
                    reason: "EgressIPMoved",
                    message,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        net::Ipv4Addr,
        sync::{Arc, Mutex},
    };

    use super::*;

    fn interface(name: &str, ifindex: u32) -> iface::Interface {
        iface::Interface::up_for_test(name, ifindex, &[("192.0.2.1", 24)])
    }

    fn nets(list: &[&str]) -> BTreeSet<IpNet> {
        list.iter()
            .map(|n| n.parse().expect("prefix literal"))
            .collect()
    }

    #[test]
    fn routes_are_listed_ipv4_first_then_shortest_prefix_first() {
        let ifaces = [
            interface("lo", 1),
            interface("eth1", 2),
            interface("egress0", 3),
        ];
        let routes = BTreeMap::from([
            (1, nets(&["127.0.0.0/8"])),
            (
                2,
                nets(&[
                    "2001:db8::/32",
                    "10.2.0.0/16",
                    "::/0",
                    "10.1.0.0/16",
                    "0.0.0.0/0",
                    "192.168.104.0/24",
                ]),
            ),
            (3, nets(&["10.0.0.0/8"])),
        ]);
        let listed = node_interfaces(&ifaces, "egress0", &BTreeMap::new(), &routes);
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(
            listed[0].routes,
            [
                "0.0.0.0/0",
                "10.1.0.0/16",
                "10.2.0.0/16",
                "192.168.104.0/24",
                "::/0",
                "2001:db8::/32"
            ]
        );
        assert_eq!(listed[0].routes_omitted, 0);
    }

    #[test]
    fn routes_past_the_node_budget_are_counted_not_listed() {
        // 4,000 /20s and 16,000 /28s out of eth1; eth2 comes after it by name.
        let mut many = BTreeSet::new();
        for i in 0..4_000u32 {
            many.insert(
                IpNet::new(Ipv4Addr::from(0x0a00_0000 + (i << 12)).into(), 20).expect("/20"),
            );
        }
        for i in 0..16_000u32 {
            many.insert(
                IpNet::new(Ipv4Addr::from(0x6400_0000 + (i << 4)).into(), 28).expect("/28"),
            );
        }
        assert_eq!(many.len(), 20_000);
        let ifaces = [interface("eth2", 3), interface("eth1", 2)];
        let routes = BTreeMap::from([(2, many), (3, nets(&["0.0.0.0/0", "10.0.0.0/8"]))]);
        let listed = node_interfaces(&ifaces, "egress0", &BTreeMap::new(), &routes);

        let (eth2, eth1) = (&listed[0], &listed[1]);
        assert_eq!((eth1.name.as_str(), eth2.name.as_str()), ("eth1", "eth2"));
        assert_eq!((eth1.routes.len(), eth1.routes_omitted), (16_384, 3_616));
        assert_eq!((eth2.routes.len(), eth2.routes_omitted), (0, 2));
        // The shortest prefixes are kept: every /20, then the lowest /28s.
        assert!(eth1.routes[..4_000].iter().all(|r| r.ends_with("/20")));
        assert_eq!(eth1.routes[4_000], "100.0.0.0/28");
        assert_eq!(eth1.routes[16_383], "100.3.5.240/28");

        // One warning when the cap starts to bite, none while it stays, a note when it ends.
        let capped = warn_capped(&BTreeSet::new(), &listed);
        assert_eq!(
            capped,
            BTreeSet::from(["eth1".to_owned(), "eth2".to_owned()])
        );
        assert_eq!(warn_capped(&capped, &listed), capped);
        assert!(warn_capped(&capped, &[]).is_empty());
    }

    #[test]
    fn an_egress_ip_preflight_line_says_so_once_the_node_holds_it() {
        let start = PreflightCheck {
            check: "egress-ip 192.168.101.50".to_owned(),
            result: PreflightResult::Fail,
            message: "in no subnet of an up interface".to_owned(),
        };
        let other = PreflightCheck {
            check: "bpffs".to_owned(),
            ..start.clone()
        };
        let mut holdings = BTreeMap::new();
        assert_eq!(refreshed(&start, &holdings), start);
        holdings.insert(
            "192.168.101.50".parse().unwrap(),
            Holding {
                interface: "sec-a".to_owned(),
                epoch: 1,
                since: "2026-12-02T01:00:00Z".to_owned(),
                reason: "Assigned".to_owned(),
            },
        );
        let now = refreshed(&start, &holdings);
        assert_eq!(now.result, PreflightResult::Ok);
        assert!(
            now.message
                .starts_with("held by this node on sec-a since 2026-12-02T01:00:00Z")
                && now.message.contains("at start: fail: in no subnet"),
            "{now:?}"
        );
        assert_eq!(refreshed(&other, &holdings), other);
    }

    fn holder(ip: &str, node: &str, reason: &'static str) -> Holder {
        Holder {
            ip: ip.parse().expect("ip literal"),
            node: node.to_owned(),
            interface: "sec-a".to_owned(),
            policy: "p".to_owned(),
            rule: 0,
            rule_id: 1,
            shared: false,
            epoch: 1,
            reason,
            pods: 0,
        }
    }

    #[test]
    fn holder_moves_say_what_moved_was_assigned_or_lost_its_holder() {
        let a = holder("192.168.101.50", "gw1", "Assigned");
        let b = holder("192.168.102.50", "gw1", "Assigned");
        let (first, moves) = holder_moves(&Placement::new(), std::slice::from_ref(&a));
        assert!(
            moves.is_empty(),
            "a starting agent reports no moves: {moves:?}"
        );
        let shared = Holder {
            shared: true,
            ..holder("192.168.101.12", "gw2", "Assigned")
        };
        let (same, moves) = holder_moves(&first, &[a.clone(), shared]);
        assert_eq!(
            (same.len(), moves.len()),
            (1, 0),
            "shared addresses are not held"
        );
        let moved = holder("192.168.101.50", "gw2", "HolderUnreachable");
        let (now, moves) = holder_moves(&first, &[moved, b]);
        let words: Vec<&str> = moves.iter().map(|(_, m)| m.as_str()).collect();
        assert_eq!(
            words,
            [
                "egress IP 192.168.101.50 moved from gw1 to gw2 (sec-a): HolderUnreachable",
                "egress IP 192.168.102.50 assigned to gw1 (sec-a)",
            ]
        );
        let (_, moves) = holder_moves(&now, &[a]);
        let words: Vec<&str> = moves.iter().map(|(_, m)| m.as_str()).collect();
        assert_eq!(
            words,
            [
                "egress IP 192.168.101.50 moved from gw2 to gw1 (sec-a): Assigned",
                "egress IP 192.168.102.50 has no holder",
            ]
        );
    }

    /// A status writer that keeps what it is given.
    #[derive(Clone, Default)]
    struct Recorder {
        nodes: Arc<Mutex<Vec<EgressNode>>>,
        statuses: Arc<Mutex<usize>>,
        events: Arc<Mutex<Vec<String>>>,
    }

    impl StatusWriter for Recorder {
        fn egress_node(&self, doc: &EgressNode) -> Result<()> {
            self.nodes.lock().unwrap().push(doc.clone());
            Ok(())
        }
        fn policy_statuses(&self, _: &BTreeMap<String, crate::api::PolicyStatus>) {
            *self.statuses.lock().unwrap() += 1;
        }
        fn event(&self, ev: Event) {
            self.events.lock().unwrap().push(ev.message);
        }
    }

    fn holding(interface: &str) -> Holding {
        Holding {
            interface: interface.to_owned(),
            epoch: 2,
            since: "2026-12-05T20:00:00Z".to_owned(),
            reason: "Assigned".to_owned(),
        }
    }

    fn node_report(holdings: &BTreeMap<IpAddr, Holding>) -> NodeReport<'_> {
        NodeReport {
            underlay: Some("192.0.2.1".parse().unwrap()),
            holdings,
            refused: Vec::new(),
            peers: &[],
            cut_off: false,
            authenticated: true,
        }
    }

    #[test]
    fn the_egress_node_is_written_when_it_changes_and_read_back_as_written() {
        let cfg = crate::agent::tests::config();
        let sink = Recorder::default();
        let mut p = Publisher::new(&cfg, Box::new(sink.clone()), Vec::new());
        // Before this agent writes: what an earlier one published, as the view has it.
        let ip: IpAddr = "198.51.100.10".parse().unwrap();
        let held = BTreeMap::from([(ip, holding("sec-a"))]);
        let earlier = egress_node_doc("gw-1", None, Vec::new(), &held, &[], false, Vec::new());
        let view = ClusterView {
            egress_nodes: vec![earlier],
            ..ClusterView::default()
        };
        assert_eq!(p.held(&view)[0].ip, "198.51.100.10");

        let nothing = BTreeMap::new();
        p.publish_node(Vec::new(), &node_report(&nothing)).unwrap();
        p.publish_node(Vec::new(), &node_report(&nothing)).unwrap();
        assert_eq!(
            sink.nodes.lock().unwrap().len(),
            1,
            "unchanged: written once"
        );
        assert!(p.held(&view).is_empty(), "what this agent wrote wins");

        p.set_preflight(PreflightCheck {
            check: "policy-map".to_owned(),
            result: PreflightResult::Fail,
            message: "full".to_owned(),
        });
        let report = NodeReport {
            refused: vec![(ip, "192.0.2.9 answers for it".to_owned())],
            ..node_report(&nothing)
        };
        p.publish_node(Vec::new(), &report).unwrap();
        let nodes = sink.nodes.lock().unwrap();
        let preflight = &nodes[1].status.as_ref().unwrap().preflight;
        let lines: Vec<(&str, &str)> = preflight
            .iter()
            .map(|c| (c.check.as_str(), c.message.as_str()))
            .collect();
        assert_eq!(
            lines,
            [
                ("policy-map", "full"),
                (
                    "duplicate-address 198.51.100.10",
                    "192.0.2.9 answers for it"
                )
            ]
        );
    }

    #[test]
    fn statuses_and_moves_are_written_by_the_status_writer_once_it_has_every_pod() {
        let cfg = crate::agent::tests::config();
        let sink = Recorder::default();
        let mut p = Publisher::new(&cfg, Box::new(sink.clone()), Vec::new());
        let first = Compiled {
            holders: vec![holder("192.168.101.50", "gw-2", "Assigned")],
            ..Compiled::default()
        };
        let moved = Compiled {
            holders: vec![holder("192.168.101.50", "gw-1", "HolderUnreachable")],
            ..Compiled::default()
        };
        // Not the writer: moves are logged only.
        p.report(&first);
        assert_eq!(*sink.statuses.lock().unwrap(), 0);
        // The writer, just elected (its view has this node's pods): nothing yet.
        let elected = Compiled {
            status_writer: Some("gw-1".to_owned()),
            pod_scope: PodScope::Node,
            ..moved.clone()
        };
        p.report(&elected);
        assert_eq!(*sink.statuses.lock().unwrap(), 0);
        let writing = Compiled {
            pod_scope: PodScope::Cluster,
            ..elected
        };
        p.report(&writing);
        assert_eq!(*sink.statuses.lock().unwrap(), 1);
        assert_eq!(
            *sink.events.lock().unwrap(),
            ["egress IP 192.168.101.50 moved from gw-2 to gw-1 (sec-a): HolderUnreachable"]
        );
    }
}
