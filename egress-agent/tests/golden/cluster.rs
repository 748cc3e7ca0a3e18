//! The cluster a golden script edits, and its agents as the compiler sees them: after every
//! edit each node's agent compiles (`compile_remembering`, with the policies' last
//! accepted versions, as `egress-agent run` does), and the agents then publish what they
//! hold, which the next compile reads:
//!
//! * each live agent's EgressNode lists the egress IPs it holds (`status.egressIPs`:
//!   epoch and reason; no `since`), whatever the script applies to that EgressNode;
//! * each live agent's hello claims them (`PeerView::reports`), and the newest claim of
//!   every address is remembered (`PeerView::last_claims`);
//! * a dead agent (`peer-dead`) publishes nothing: its last EgressNode and hello stay as
//!   they were, and every agent, itself included (cut off), counts it dead.
//!
//! Interface indexes, which the maps hold instead of names, are numbered from 2 (1 is
//! `lo`) in the order of the interfaces' names over every EgressNode of the initial state;
//! a name first seen later takes the next free number. A node resolves only the names its
//! EgressNode lists.

use std::collections::{BTreeMap, BTreeSet};

use egress_agent::{
    api::{EgressGatewayPolicy, EgressNode, HeldEgressIp},
    compiler::{Compiled, compile_remembering, render},
    datapath::{render as maps, state::MapState},
    liveness::{Claim, PeerView, Report},
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
}

impl Cluster {
    /// The cluster of `view`, after its agents' first reconcile.
    pub fn new(view: ClusterView) -> Self {
        let mut c = Self {
            view,
            peers: PeerView::default(),
            last_accepted: BTreeMap::new(),
            published: BTreeMap::new(),
            ifindexes: BTreeMap::new(),
            compiled: BTreeMap::new(),
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
        let holders = first.holders.clone();
        for en in &view.egress_nodes {
            let Some(node) = en.metadata.name.clone() else {
                continue;
            };
            if self.peers.dead.contains(&node) {
                continue;
            }
            let held: Vec<HeldEgressIp> = holders
                .iter()
                .filter(|h| h.node == node && !h.shared)
                .map(|h| HeldEgressIp {
                    ip: h.ip.to_string(),
                    interface: h.interface.clone(),
                    epoch: h.epoch,
                    since: None,
                    reason: Some(h.reason.to_owned()),
                })
                .collect();
            let claims = holders
                .iter()
                .filter(|h| h.node == node && !h.shared)
                .map(|h| {
                    let claim = Claim {
                        interface: h.interface.clone(),
                        epoch: h.epoch,
                    };
                    (h.ip, claim)
                })
                .collect();
            for h in holders.iter().filter(|h| h.node == node && !h.shared) {
                let newest = self.peers.last_claims.get(&h.ip).map(|(_, e)| *e);
                if newest.is_none_or(|e| e <= h.epoch) {
                    self.peers.last_claims.insert(h.ip, (node.clone(), h.epoch));
                }
            }
            let report = Report {
                claims,
                ..Report::default()
            };
            self.peers.reports.insert(node.clone(), report);
            self.published.insert(node, held);
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
            let (state, unresolved) = MapState::from_desired(&c.desired, |name| {
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
