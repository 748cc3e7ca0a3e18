//! The cluster a golden script edits, and its agents as the compiler sees them: after every
//! edit each node's agent compiles (`compile_remembering`, with the policies' last
//! accepted versions, as `egress-agent run` does), and then each live agent makes its
//! pass as `egress-agent run` does, with the peers as they were before the round:
//!
//! * its [`Ownership`] adopts, releases and acquires through a fake address layer (the
//!   node's interfaces as its EgressNode lists them; probes find in use the addresses
//!   of `answer`), so a handover waits for the previous holder's claim to go, a released
//!   address lingers in the maps (which show what the agent serves), and an address
//!   another host answers for is refused;
//! * its EgressNode lists what it holds (`status.egressIPs`, as
//!   `publish::egress_node_doc` builds it), whatever the script applies to that
//!   EgressNode; its hello claims the same (`PeerView::reports`), and the newest claim of
//!   every address is remembered (`PeerView::last_claims`);
//! * a dead agent (`peer-dead`) makes no pass: its last EgressNode and hello stay as
//!   they were, and every agent, itself included (cut off), counts it dead.
//!
//! The script's clock moves only with `wait`: the agents start warm at its start.
//!
//! Interface indexes, which the maps hold instead of names, are numbered from 2 (1 is
//! `lo`) in the order of the interfaces' names over every EgressNode of the initial state;
//! a name first seen later takes the next free number. A node resolves only the names its
//! EgressNode lists.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Instant,
};

use egress_agent::{
    agent::{
        holding::{Addresses, Ownership, Pass, Release},
        publish,
    },
    api::{EgressGatewayPolicy, EgressNode, HeldEgressIp},
    compiler::{Compiled, compile_remembering, render},
    datapath::{render as maps, state::MapState},
    iface::Interface,
    liveness::{PeerView, Report, Settings},
    source::{ClusterView, yaml},
};
use k8s_openapi::api::core::v1::{NodeCondition, NodeStatus};

use super::script::Command;

/// One titled part of a rendering (the cluster, a node's desired state, its maps), as
/// lines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    pub title: String,
    pub lines: Vec<String>,
}

pub struct Cluster {
    view: ClusterView,
    peers: PeerView,
    /// What the last compile accepted of each policy, passed to the next.
    last_accepted: BTreeMap<String, EgressGatewayPolicy>,
    /// What each live agent last published in its EgressNode, by node.
    published: BTreeMap<String, Vec<HeldEgressIp>>,
    ifindexes: BTreeMap<String, u32>,
    /// The latest compile of every node, by name.
    compiled: BTreeMap<String, Compiled>,
    /// Each live node's agent, from its first pass.
    agents: BTreeMap<String, Agent>,
    /// The script's clock: when the agents started (warm from there), and now.
    started: Instant,
    now: Instant,
    /// Addresses another host answers for (`answer`): the agents' probes find it.
    answered: BTreeSet<IpAddr>,
}

/// What one node's agent holds, and the interfaces its addresses are on.
struct Agent {
    own: Ownership,
    /// The node's interfaces: its EgressNode's, with the addresses the agent added.
    ifaces: Vec<Interface>,
    /// What its EgressNode last said it holds.
    published: Vec<HeldEgressIp>,
    /// The problems of its last pass.
    problems: Vec<String>,
    /// When it asked for its next pass.
    next_pass: Option<Instant>,
}

/// The agents' address layer: the interfaces of [`Agent`], and probes that find the
/// addresses of `answered` in use.
struct FakeAddresses<'a> {
    ifaces: &'a mut Vec<Interface>,
    answered: &'a BTreeSet<IpAddr>,
}

impl Addresses for FakeAddresses<'_> {
    async fn add(&mut self, i: &Interface, ip: IpAddr, prefix_len: u8) -> Result<(), String> {
        let Some(on) = self.ifaces.iter_mut().find(|x| x.name == i.name) else {
            return Err(format!("no interface {}", i.name));
        };
        on.addresses.push((ip, prefix_len));
        Ok(())
    }

    async fn remove(&mut self, r: &Release) -> Result<(), String> {
        for i in self.ifaces.iter_mut().filter(|i| i.name == r.interface) {
            i.addresses.retain(|(a, _)| *a != r.ip);
        }
        Ok(())
    }

    async fn probe(&mut self, i: &Interface, ip: IpAddr) -> Result<Option<String>, String> {
        let answer = format!("another host answers for {ip} on {}", i.name);
        Ok(self.answered.contains(&ip).then_some(answer))
    }

    fn announce(&mut self, _: &Interface, _: IpAddr) {}

    fn silence(&mut self, _: IpAddr) {}
}

impl Agent {
    /// The agent of `en`'s node before its first pass: the interfaces its EgressNode
    /// lists (numbered by `ifindexes`), what it says the node holds.
    fn new(en: &EgressNode, ifindexes: &BTreeMap<String, u32>) -> Self {
        let listed = en.status.iter().flat_map(|s| s.interfaces.iter());
        let ifaces = listed
            .map(|i| Interface {
                name: i.name.clone(),
                ifindex: ifindexes.get(&i.name).copied().unwrap_or(0),
                up: i.up,
                mtu: 1500,
                mac: None,
                addresses: i
                    .addresses
                    .iter()
                    .filter_map(|a| a.parse::<ipnet::IpNet>().ok())
                    .map(|n| (n.addr(), n.prefix_len()))
                    .collect(),
                pod_like: false,
            })
            .collect();
        Self {
            own: Ownership::default(),
            ifaces,
            published: publish::held_in(Some(en)).to_vec(),
            problems: Vec::new(),
            next_pass: None,
        }
    }

    /// One pass of the agent's [`Ownership`] over the compile `c`, as `egress-agent run`
    /// makes it (adopt, release, acquire, remember), then its EgressNode as the
    /// publisher builds it.
    fn pass(&mut self, c: &Compiled, pass: &Pass<'_>, answered: &BTreeSet<IpAddr>) {
        let ifaces = self.ifaces.clone();
        self.own.adopt(&self.published, &ifaces);
        let addrs = &mut FakeAddresses {
            ifaces: &mut self.ifaces,
            answered,
        };
        let released = self
            .own
            .release(addrs, c, &self.published, &ifaces, pass.now);
        let released = futures::executor::block_on(released);
        let acquired = self.own.acquire(addrs, c, &ifaces, pass, &self.published);
        let acquired = futures::executor::block_on(acquired);
        self.own.remember(&c.desired);
        self.problems = released.problems;
        self.problems.extend(acquired.problems);
        self.next_pass = self.own.next_pass(pass.now, pass.detection, pass.warm_at);
        let holdings = self.own.holdings();
        let doc = publish::egress_node_doc("", None, Vec::new(), holdings, &[], false, Vec::new());
        self.published = publish::held_in(Some(&doc)).to_vec();
    }

    /// What the agent holds, waits for (the compile gives it this node, its address is
    /// not added yet) and refused, its problems and its next pass.
    fn render(&self, me: &str, c: &Compiled, now: Instant) -> String {
        let mut out = String::new();
        for (ip, h) in self.own.holdings() {
            out += &format!(
                "holds {ip} on {} epoch {} ({})\n",
                h.interface, h.epoch, h.reason
            );
        }
        let mine = c.holders.iter().filter(|h| h.node == me && !h.shared);
        for h in mine.filter(|h| !self.own.holdings().contains_key(&h.ip)) {
            out += &format!("waits for {} on {} epoch {}\n", h.ip, h.interface, h.epoch);
        }
        for (ip, why) in self.own.refused() {
            out += &format!("refused {ip}: {why}\n");
        }
        for p in &self.problems {
            out += &format!("problem: {p}\n");
        }
        if let Some(at) = self.next_pass {
            let ms = at.saturating_duration_since(now).as_millis();
            out += &format!("next pass in {ms} ms\n");
        }
        out
    }
}

impl Cluster {
    /// The cluster of `view`, after its agents' first reconcile.
    pub fn new(view: ClusterView) -> Self {
        let started = Instant::now();
        let mut c = Self {
            view,
            peers: PeerView::default(),
            last_accepted: BTreeMap::new(),
            published: BTreeMap::new(),
            ifindexes: BTreeMap::new(),
            compiled: BTreeMap::new(),
            agents: BTreeMap::new(),
            started,
            now: started,
            answered: BTreeSet::new(),
        };
        c.reconcile();
        c
    }

    /// Apply one edit, then let every agent reconcile (`Render` changes nothing).
    pub fn run(&mut self, command: &Command) -> Result<(), String> {
        match command {
            Command::Render => return Ok(()),
            Command::Apply { file, text } => self.apply(file, text)?,
            Command::Delete { kind, name } => self.delete(kind, name)?,
            Command::NodeReady { node, ready } => self.set_ready(node, *ready)?,
            Command::Peer { node, alive } => {
                self.node(node)?;
                if *alive {
                    self.peers.dead.remove(node);
                } else {
                    self.peers.dead.insert(node.clone());
                }
            }
            Command::Routes {
                node,
                interface,
                prefixes,
            } => {
                let en = self.egress_node(node)?;
                let iface = en
                    .status
                    .iter_mut()
                    .flat_map(|s| s.interfaces.iter_mut())
                    .find(|i| i.name == *interface)
                    .ok_or_else(|| format!("EgressNode {node} has no interface {interface}"))?;
                iface.routes = prefixes.iter().map(ToString::to_string).collect();
            }
            Command::ClusterCidr(prefixes) => self.view.cluster_cidrs = prefixes.clone(),
            Command::Wait(d) => self.now += *d,
            Command::Answer { ip, answered } => {
                if *answered {
                    self.answered.insert(*ip);
                } else {
                    self.answered.remove(ip);
                }
            }
        }
        self.reconcile();
        Ok(())
    }

    /// The objects of `text` replace those of the same kind and name, or are added.
    fn apply(&mut self, file: &str, text: &str) -> Result<(), String> {
        let snapshot = yaml::load_str(file, text);
        if let Some(e) = snapshot.errors.first() {
            return Err(format!("apply {file}: {e}"));
        }
        let new = snapshot.view;
        let v = &mut self.view;
        upsert(&mut v.policies, new.policies, |p| named(&p.metadata));
        upsert(&mut v.namespaces, new.namespaces, |n| named(&n.metadata));
        upsert(&mut v.pods, new.pods, |p| {
            format!("{}/{}", p.namespace, p.name)
        });
        upsert(&mut v.nodes, new.nodes, |n| named(&n.metadata));
        upsert(&mut v.egress_nodes, new.egress_nodes, |n| {
            named(&n.metadata)
        });
        upsert(&mut v.network_policies, new.network_policies, |n| {
            named(&n.metadata)
        });
        upsert(&mut v.ovn_egress_ips, new.ovn_egress_ips, |e| {
            named(&e.metadata)
        });
        upsert(&mut v.unapplied, new.unapplied, |u| u.to_string());
        Ok(())
    }

    fn delete(&mut self, kind: &str, name: &str) -> Result<(), String> {
        let v = &mut self.view;
        let found = match kind {
            "EgressGatewayPolicy" => remove(&mut v.policies, name, |p| named(&p.metadata)),
            "Namespace" => remove(&mut v.namespaces, name, |n| named(&n.metadata)),
            "Pod" => remove(&mut v.pods, name, |p| format!("{}/{}", p.namespace, p.name)),
            "Node" => remove(&mut v.nodes, name, |n| named(&n.metadata)),
            "EgressNode" => remove(&mut v.egress_nodes, name, |n| named(&n.metadata)),
            "NetworkPolicy" => remove(&mut v.network_policies, name, |n| named(&n.metadata)),
            "EgressIP" => remove(&mut v.ovn_egress_ips, name, |e| named(&e.metadata)),
            _ => return Err(format!("delete: unknown kind {kind}")),
        };
        if found {
            Ok(())
        } else {
            Err(format!("delete: no {kind} {name}"))
        }
    }

    fn node(&mut self, name: &str) -> Result<&mut k8s_openapi::api::core::v1::Node, String> {
        self.view
            .nodes
            .iter_mut()
            .find(|n| n.metadata.name.as_deref() == Some(name))
            .ok_or_else(|| format!("no Node {name}"))
    }

    fn egress_node(&mut self, name: &str) -> Result<&mut EgressNode, String> {
        self.view
            .egress_nodes
            .iter_mut()
            .find(|n| n.metadata.name.as_deref() == Some(name))
            .ok_or_else(|| format!("no EgressNode {name}"))
    }

    /// Set the Node's `Ready` condition.
    fn set_ready(&mut self, name: &str, ready: bool) -> Result<(), String> {
        let status = self
            .node(name)?
            .status
            .get_or_insert_with(NodeStatus::default);
        let conditions = status.conditions.get_or_insert_with(Vec::new);
        conditions.retain(|c| c.type_ != "Ready");
        conditions.push(NodeCondition {
            type_: "Ready".to_owned(),
            status: if ready { "True" } else { "False" }.to_owned(),
            ..NodeCondition::default()
        });
        Ok(())
    }

    /// Every node's agent compiles; then the live ones publish what they hold.
    fn reconcile(&mut self) {
        self.number_interfaces();
        let view = self.published_view();
        self.compiled = node_names(&view)
            .into_iter()
            .map(|node| {
                let c = compile_remembering(&view, &self.peers, &self.last_accepted, &node);
                (node, c)
            })
            .collect();
        let Some(first) = self.compiled.values().next() else {
            return;
        };
        self.last_accepted = first.accepted.clone();
        // Every live agent passes on what the peers said before this round.
        let peers = self.peers.clone();
        for en in &view.egress_nodes {
            let Some(node) = en.metadata.name.clone() else {
                continue;
            };
            let Some(c) = self.compiled.get(&node) else {
                continue;
            };
            if self.peers.dead.contains(&node) {
                continue;
            }
            let agent = self
                .agents
                .entry(node.clone())
                .or_insert_with(|| Agent::new(en, &self.ifindexes));
            let pass = Pass {
                me: &node,
                now: self.now,
                stamp: "2026-01-01T00:00:00Z",
                peers: &peers,
                warm_at: self.started,
                detection: Settings::default().detection(),
                dad: true,
            };
            agent.pass(c, &pass, &self.answered);
            for (ip, claim) in agent.own.claims() {
                let newest = self.peers.last_claims.get(&ip).map(|(_, e)| *e);
                if newest.is_none_or(|e| e <= claim.epoch) {
                    self.peers
                        .last_claims
                        .insert(ip, (node.clone(), claim.epoch));
                }
            }
            let report = Report {
                claims: agent.own.claims(),
                ..Report::default()
            };
            self.peers.reports.insert(node.clone(), report);
            self.published.insert(node, agent.published.clone());
        }
    }

    /// Give every interface name not numbered yet the next numbers, in name order.
    fn number_interfaces(&mut self) {
        let names: BTreeSet<String> = self
            .view
            .egress_nodes
            .iter()
            .flat_map(|en| en.status.iter().flat_map(|s| s.interfaces.iter()))
            .map(|i| i.name.clone())
            .collect();
        for name in names {
            let next = 2 + self.ifindexes.len() as u32;
            self.ifindexes.entry(name).or_insert(next);
        }
    }

    /// The view with what the agents published in their EgressNodes.
    fn published_view(&self) -> ClusterView {
        let mut view = self.view.clone();
        for en in &mut view.egress_nodes {
            let name = en.metadata.name.as_deref().unwrap_or_default();
            if let Some(held) = self.published.get(name) {
                en.status.get_or_insert_with(Default::default).egress_ips = held.clone();
            }
        }
        view
    }

    /// The latest reconcile: the interface numbering, what is the same on every node
    /// (holders, statuses, problems), then each node's desired state and maps.
    pub fn render(&self) -> Vec<Section> {
        let mut out = vec![Section {
            title: "interfaces (ifindex, on every node that has one)".to_owned(),
            lines: self
                .ifindexes
                .iter()
                .map(|(name, i)| format!("{name} {i}"))
                .collect(),
        }];
        if let Some(first) = self.compiled.values().next() {
            out.push(section(
                "cluster (the same on every node)",
                &render::cluster(first),
            ));
        }
        for (node, c) in &self.compiled {
            out.push(section(&format!("node {node}"), &render::node(c)));
            let agent = self.agents.get(node);
            if let Some(a) = agent {
                let text = a.render(node, c, self.now);
                out.push(section(&format!("node {node} agent"), &text));
            }
            // What the maps serve: the compile's desired state, with what lingers.
            let serving = agent.map(|a| a.own.serving(&c.desired));
            let desired = serving.as_deref().unwrap_or(&c.desired);
            let (state, unresolved) = MapState::from_desired(desired, |name| {
                self.has_interface(node, name)
                    .then(|| self.ifindexes.get(name).copied())
                    .flatten()
            });
            let mut text = maps::maps(&state);
            for u in unresolved {
                text += &format!("unresolved: {u}\n");
            }
            out.push(section(&format!("node {node} maps"), &text));
        }
        out
    }

    /// Does `node`'s EgressNode list interface `name` (up or down)?
    fn has_interface(&self, node: &str, name: &str) -> bool {
        self.view
            .egress_nodes
            .iter()
            .filter(|en| en.metadata.name.as_deref() == Some(node))
            .flat_map(|en| en.status.iter().flat_map(|s| s.interfaces.iter()))
            .any(|i| i.name == name)
    }
}

fn section(title: &str, text: &str) -> Section {
    Section {
        title: title.to_owned(),
        lines: text.lines().map(str::to_owned).collect(),
    }
}

/// `namespace/name`, or `name` for a cluster-scoped object.
fn named(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    let name = meta.name.as_deref().unwrap_or_default();
    match meta.namespace.as_deref() {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_owned(),
    }
}

/// `new` replaces the objects of `list` of the same key, or is added.
fn upsert<T>(list: &mut Vec<T>, new: Vec<T>, key: impl Fn(&T) -> String) {
    for object in new {
        let k = key(&object);
        list.retain(|o| key(o) != k);
        list.push(object);
    }
}

/// Remove the object of key `name`; whether there was one.
fn remove<T>(list: &mut Vec<T>, name: &str, key: impl Fn(&T) -> String) -> bool {
    let before = list.len();
    list.retain(|o| key(o) != name);
    list.len() != before
}

/// The names of the Nodes, sorted.
fn node_names(view: &ClusterView) -> Vec<String> {
    let names: BTreeSet<String> = view
        .nodes
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    names.into_iter().collect()
}
