//! The compile patched for pods no policy selects (issue 49, "each event costs what it
//! changes"). Most pods of a cluster are no egress policy's: one that comes, goes or
//! changes touches only its own pod owner entries (every pod's on a gateway, this node's
//! elsewhere) and, on its own node, the known pods. So when a new view differs from the
//! last compiled one only in such pods, the last result is patched instead of compiled
//! anew, and the property test `an_incremental_compile_equals_a_full_one` checks the
//! patch against a full compile over random edit sequences.
//!
//! A pod is such a pod ([`Index::inert`]) when no plan's selectors select it, each of its
//! addresses lies in a declared cluster CIDR or a Node's pod CIDR (a route's carve-outs
//! and the outside-CIDR problems never name it), no NetworkPolicy of its namespace may
//! restrict it on this node, and its addresses are its alone (not another pod's, not a
//! node's, not disputed before). Anything else, and any change beside the pods, compiles
//! anew.

use std::{
    cmp::Ordering,
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;

use super::{
    Compiled, Selector,
    nodes::NodeInfo,
    plans::PolicyPlan,
    pods::{self, Pods},
};
use crate::source::{ClusterView, PodSummary};

/// Most pods one patch takes (a bound on what it looks at): more compile anew.
const MAX_CHANGES: usize = 64;

/// What a compile keeps to patch its result for pods no policy selects.
pub(super) struct Index {
    /// The view's pods are sorted by namespace and name, each once: what [`changes`]
    /// needs to pair old and new versions. Found at the first patch (a compile that is
    /// never patched does not pay for it), kept through the patches (each checks the
    /// order where the pods changed).
    sorted: Option<bool>,
    /// Every address of the compiled pods (one pod's alone), sorted.
    listed: Vec<IpAddr>,
    /// Addresses no pod may take without a full compile: those two claimants dispute
    /// and every node's.
    taken: BTreeSet<IpAddr>,
    /// Each plan's namespace and pod selectors.
    selectors: Vec<(Selector, Selector)>,
    /// Declared cluster CIDRs and the Nodes' pod CIDRs.
    cidrs: Vec<IpNet>,
    /// Each node's underlay address, by name.
    underlay_of: BTreeMap<String, IpAddr>,
    /// A gateway records every pod's owner; other nodes their own pods'.
    owners_of_all: bool,
    /// Namespaces with a NetworkPolicy.
    restricted: BTreeSet<String>,
    node: String,
}

impl Index {
    /// The index of a compile of `view` for `node`.
    pub(super) fn new(
        view: &ClusterView,
        (pods, plans, nodes): (&Pods<'_>, &[PolicyPlan<'_>], &[NodeInfo<'_>]),
        held: &BTreeSet<IpAddr>,
        gateway: bool,
        node: &str,
    ) -> Self {
        let mut taken: BTreeSet<IpAddr> = pods.disputed.iter().map(|d| d.ip).collect();
        taken.extend(pods::node_addresses(view, held).into_keys());
        Self {
            sorted: None,
            listed: pods.by_address.iter().map(|(ip, _)| *ip).collect(),
            taken,
            selectors: plans.iter().filter_map(|p| p.selectors.clone()).collect(),
            cidrs: pods::pod_cidrs(view, nodes),
            underlay_of: nodes
                .iter()
                .filter_map(|n| Some((n.name.to_owned(), n.underlay?)))
                .collect(),
            owners_of_all: gateway,
            restricted: view
                .network_policies
                .iter()
                .filter_map(|p| p.metadata.namespace.clone())
                .collect(),
            node: node.to_owned(),
        }
    }

    /// Whether `pod` (on `node`) is one a compile of `view` gives nothing but its owner
    /// entries and known addresses.
    fn inert(&self, view: &ClusterView, pod: &PodSummary, node: &str) -> bool {
        pod.ips
            .iter()
            .all(|ip| self.cidrs.iter().any(|c| c.contains(ip)))
            && !self.selectors.iter().any(|(ns_sel, pod_sel)| {
                pod_sel.matches(&pod.labels)
                    && pods::namespace_selected(view, &pod.namespace, ns_sel)
            })
            && !(node == self.node && self.restricted.contains(&*pod.namespace))
    }
}

/// Whether `pods` are sorted by namespace and name, each once. Pods of one namespace
/// share its name ([`crate::source::intern`]): compared by pointer first.
fn sorted(pods: &[Arc<PodSummary>]) -> bool {
    pods.windows(2).all(|w| {
        if Arc::ptr_eq(&w[0].namespace, &w[1].namespace) {
            w[0].name < w[1].name
        } else {
            key(&w[0]) < key(&w[1])
        }
    })
}

/// A pod's place in the view's order.
fn key(pod: &PodSummary) -> (&str, &str) {
    (&pod.namespace, &pod.name)
}

/// One pod's versions: before (absent: added) and after (absent: removed).
type Change<'a> = (Option<&'a PodSummary>, Option<&'a PodSummary>);

/// The pods that differ between `old` and `new` (both sorted by namespace and name, each
/// once: `new` is checked where it differs), unless more than [`MAX_CHANGES`] do or `new`
/// is out of order. A pod that is the very same `Arc` is not looked at.
fn changes<'a>(old: &'a [Arc<PodSummary>], new: &'a [Arc<PodSummary>]) -> Option<Vec<Change<'a>>> {
    let mut out = Vec::new();
    // `new[j]` is in its place between its neighbours.
    let in_place = |j: usize| {
        (j == 0 || key(&new[j - 1]) < key(&new[j]))
            && new.get(j + 1).is_none_or(|n| key(&new[j]) < key(n))
    };
    let (mut i, mut j) = (0, 0);
    loop {
        let step = match (old.get(i), new.get(j)) {
            (None, None) => break,
            (Some(a), Some(b)) if Arc::ptr_eq(a, b) => None,
            (Some(a), Some(b)) => match key(a).cmp(&key(b)) {
                Ordering::Equal if a == b => None,
                Ordering::Equal => Some((Some(&**a), Some(&**b))),
                Ordering::Less => Some((Some(&**a), None)),
                Ordering::Greater => Some((None, Some(&**b))),
            },
            (Some(a), None) => Some((Some(&**a), None)),
            (None, Some(b)) => Some((None, Some(&**b))),
        };
        match step {
            None => (i, j) = (i + 1, j + 1),
            Some(change) => {
                if change.1.is_some() && !in_place(j) {
                    return None;
                }
                i += usize::from(change.0.is_some());
                j += usize::from(change.1.is_some());
                out.push(change);
                if out.len() > MAX_CHANGES {
                    return None;
                }
            }
        }
    }
    Some(out)
}

/// Whether `old` and `new` differ in their pods alone.
fn same_but_pods(old: &ClusterView, new: &ClusterView) -> bool {
    // Every field named: a new one must be placed here.
    let ClusterView {
        policies,
        namespaces,
        pods: _,
        pod_scope,
        nodes,
        egress_nodes,
        cluster_cidrs,
        ovn_egress_ips,
        network_policies,
        unapplied,
    } = old;
    *policies == new.policies
        && *namespaces == new.namespaces
        && *pod_scope == new.pod_scope
        && *nodes == new.nodes
        && *egress_nodes == new.egress_nodes
        && *cluster_cidrs == new.cluster_cidrs
        && *ovn_egress_ips == new.ovn_egress_ips
        && *network_policies == new.network_policies
        && *unapplied == new.unapplied
}

/// What [`patch`] made of the last compile.
pub(super) enum Patch {
    /// Nothing the compile reads differs: the last result holds.
    Same,
    /// The last result with the changed pods' entries.
    Patched(Box<Compiled>),
}

/// `compiled` (of `old`, whose index is `index`) patched to be the compile of `new`, when
/// they differ only in pods no policy selects; `None` when a full compile is needed (the
/// index is then stale: the full compile makes a new one).
pub(super) fn patch(
    index: &mut Index,
    old: &ClusterView,
    new: &ClusterView,
    compiled: &Compiled,
) -> Option<Patch> {
    if !same_but_pods(old, new) || !*index.sorted.get_or_insert_with(|| sorted(&old.pods)) {
        return None;
    }
    let changes = changes(&old.pods, &new.pods)?;
    if changes.is_empty() {
        return Some(Patch::Same);
    }
    // The versions the compile sees, with their nodes.
    fn seen(pod: Option<&PodSummary>) -> Option<(&PodSummary, &str)> {
        pod.and_then(|p| Some((p, pods::seen(p)?)))
    }
    let (gone, came): (Vec<_>, Vec<_>) = (
        changes.iter().filter_map(|c| seen(c.0)).collect(),
        changes.iter().filter_map(|c| seen(c.1)).collect(),
    );
    if !gone
        .iter()
        .chain(&came)
        .all(|(pod, node)| index.inert(new, pod, node))
    {
        return None;
    }
    // The old addresses were theirs alone; the new ones are nobody else's.
    for ip in gone.iter().flat_map(|(p, _)| &p.ips) {
        let at = index.listed.binary_search(ip).ok()?;
        index.listed.remove(at);
    }
    for ip in came.iter().flat_map(|(p, _)| &p.ips) {
        if index.taken.contains(ip) {
            return None;
        }
        let at = index.listed.binary_search(ip).err()?;
        index.listed.insert(at, *ip);
    }
    let mut out = compiled.clone();
    let desired = &mut out.desired;
    for (pod, node) in gone {
        let local = node == index.node;
        for ip in &pod.ips {
            if index.owners_of_all || local {
                match ip {
                    IpAddr::V4(a) => desired.v4.pod_owner.remove(a),
                    IpAddr::V6(a) => desired.v6.pod_owner.remove(a),
                };
            }
            if local {
                desired.known_pods.remove(ip);
            }
        }
    }
    for (pod, node) in came {
        let local = node == index.node;
        for ip in &pod.ips {
            if let Some(underlay) = index.underlay_of.get(node)
                && (index.owners_of_all || local)
            {
                match ip {
                    IpAddr::V4(a) => desired.v4.pod_owner.insert(*a, *underlay),
                    IpAddr::V6(a) => desired.v6.pod_owner.insert(*a, *underlay),
                };
            }
            if local {
                desired.known_pods.insert(*ip);
            }
        }
    }
    Some(Patch::Patched(Box::new(out)))
}
