//! Destinations learned from the gateways' routes (`destinationsFrom: Routes`).
//!
//! For one rule and one gateway: the prefixes the gateway routes out of the rule's
//! interface (as its agent publishes them), without default routes unless the rule asks
//! for them and without what overlaps the cluster itself; the more specific prefixes it
//! routes out of *other* interfaces are carved out (traffic follows the routes of the
//! gateway that forwards it); the rule's excepts apply where they fall.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    net::IpAddr,
};

use ipnet::IpNet;

use super::{nodes::NodeInfo, pods::Pods};
use crate::source::ClusterView;

/// What an entry for a prefix does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// An `except` prefix: untouched (claims the pair like a destination).
    Except,
    /// A destination: forward to the rule's gateway.
    Forward,
    /// Routed elsewhere by the gateway, inside a destination: untouched, but only where
    /// no rule claims the pair.
    Carve,
    /// The cluster's own addresses inside a destination (a pod or cluster CIDR, the
    /// underlay subnet, a node's or pod's address): untouched whatever any rule says, and
    /// never a conflict.
    Cluster,
}

/// One rule's prefixes, excepts first (an except equal to a destination wins), then
/// destinations, then carve-outs.
#[derive(Clone, Debug, Default)]
pub(super) struct Prefixes(pub(super) Vec<(IpNet, Kind)>);

impl Prefixes {
    /// Listed destinations and excepts.
    pub(super) fn listed(destinations: &[IpNet], except: &[IpNet]) -> Self {
        let excepts = except.iter().map(|p| (*p, Kind::Except));
        let forwards = destinations.iter().map(|p| (*p, Kind::Forward));
        Self(excepts.chain(forwards).collect())
    }

    /// The listed destinations and excepts with the cluster's own addresses carved out
    /// ([`Kind::Cluster`], first: they win over an equal prefix), and for each
    /// destination that covers some of them, its index and what it covers (the first
    /// few named).
    pub(super) fn listed_carved(
        destinations: &[IpNet],
        except: &[IpNet],
        reserved: &Reserved<'_>,
    ) -> (Self, Vec<(usize, IpNet, Vec<String>)>) {
        let listed = Self::listed(destinations, except);
        let mut carved: BTreeSet<IpNet> = BTreeSet::new();
        let mut covering = Vec::new();
        for (i, d) in destinations.iter().enumerate() {
            let found = reserved.within(*d);
            if found.is_empty() {
                continue;
            }
            covering.push((i, *d, found.iter().map(|(_, w)| w.clone()).collect()));
            carved.extend(found.into_iter().map(|(net, _)| net));
        }
        let out = carved
            .into_iter()
            .map(|p| (p, Kind::Cluster))
            .chain(listed.0)
            .collect();
        (Self(out), covering)
    }

    pub(super) fn forwards(&self) -> impl Iterator<Item = IpNet> + '_ {
        self.0
            .iter()
            .filter(|(_, k)| *k == Kind::Forward)
            .map(|(p, _)| *p)
    }
}

/// The cluster's own addresses, which no learned route may steer to a gateway.
pub(super) struct Reserved<'a> {
    /// Cluster CIDRs (`--cluster-cidr`) and Nodes' pod CIDRs, with what they are.
    cidrs: Vec<(IpNet, String)>,
    /// Node underlay and pod addresses, sorted (equal ones: nodes first, in their
    /// order, then pods, in theirs), with whose they are.
    hosts: Vec<(IpAddr, Host<'a>)>,
}

/// Whose address a reserved host address is, put in words only when a route meets it.
enum Host<'a> {
    /// A node's underlay address, in words.
    Node(String),
    /// A pod's address: its namespace and name.
    Pod(&'a str, &'a str),
}

impl Host<'_> {
    fn describe(&self, ip: &IpAddr) -> String {
        match self {
            Self::Node(what) => what.clone(),
            Self::Pod(namespace, name) => format!("address {ip} of pod {namespace}/{name}"),
        }
    }
}

impl<'a> Reserved<'a> {
    pub(super) fn new(view: &ClusterView, nodes: &[NodeInfo<'_>], pods: &Pods<'a>) -> Self {
        let mut cidrs: Vec<(IpNet, String)> = view
            .cluster_cidrs
            .iter()
            .map(|c| (c.trunc(), format!("cluster CIDR {}", c.trunc())))
            .collect();
        let mut hosts = Vec::new();
        for n in nodes {
            for c in &n.pod_cidrs {
                cidrs.push((*c, format!("pod CIDR {c} of node {}", n.name)));
            }
            if let Some(u) = n.underlay {
                hosts.push((u, Host::Node(format!("address {u} of node {}", n.name))));
                // The subnet of the interface that holds the underlay address: the other
                // nodes, and the routers between them, are there.
                let subnet = n.egress.as_ref().and_then(|e| {
                    e.interfaces
                        .iter()
                        .flat_map(|(name, nets)| nets.iter().map(move |net| (name, net)))
                        .find(|(_, net)| net.addr() == u)
                });
                if let Some((iface, net)) = subnet
                    && net.prefix_len() < net.max_prefix_len()
                    && !cidrs.iter().any(|(c, _)| *c == net.trunc())
                {
                    cidrs.push((
                        net.trunc(),
                        format!(
                            "underlay subnet {} ({iface} of node {})",
                            net.trunc(),
                            n.name
                        ),
                    ));
                }
            }
        }
        hosts.sort_by_key(|h| h.0);
        // The pods' addresses come sorted: merged in, after the nodes' equal ones.
        let mut merged = Vec::with_capacity(hosts.len() + pods.by_address.len());
        let mut nodes = hosts.into_iter().peekable();
        for (ip, i) in &pods.by_address {
            merged.extend(std::iter::from_fn(|| nodes.next_if(|(n, _)| n <= ip)));
            let p = &pods.pods[*i];
            merged.push((*ip, Host::Pod(p.namespace, p.name)));
        }
        merged.extend(nodes);
        Self {
            cidrs,
            hosts: merged,
        }
    }

    /// What of the cluster `net` overlaps (a CIDR it is inside of or contains, an
    /// address it contains); `None` if nothing.
    fn overlap(&self, net: IpNet) -> Option<String> {
        if let Some((_, what)) = self
            .cidrs
            .iter()
            .find(|(c, _)| c.contains(&net) || net.contains(c))
        {
            return Some(what.clone());
        }
        let first = self.hosts.partition_point(|(h, _)| *h < net.network());
        self.hosts
            .get(first)
            .filter(|(h, _)| net.contains(h))
            .map(|(h, what)| what.describe(h))
    }

    /// What of the cluster lies within `net`, as prefixes to carve out of it, with what
    /// each is: the CIDRs inside it (or `net` itself, when a CIDR contains it), and the
    /// node and pod addresses inside it that no such CIDR holds (as host prefixes).
    pub(super) fn within(&self, net: IpNet) -> Vec<(IpNet, String)> {
        let v6 = net.addr().is_ipv6();
        let same = |c: &IpNet| c.addr().is_ipv6() == v6;
        if let Some((_, what)) = self.cidrs.iter().find(|(c, _)| same(c) && c.contains(&net)) {
            return vec![(net, what.clone())];
        }
        let mut cidrs: Vec<(IpNet, String)> = self
            .cidrs
            .iter()
            .filter(|(c, _)| same(c) && net.contains(c))
            .cloned()
            .collect();
        // A pod CIDR inside the cluster CIDR needs no entry of its own.
        let all: Vec<IpNet> = cidrs.iter().map(|(c, _)| *c).collect();
        cidrs.retain(|(c, _)| !all.iter().any(|o| o != c && o.contains(c)));
        let first = self.hosts.partition_point(|(h, _)| *h < net.network());
        let hosts = self.hosts[first..]
            .iter()
            .take_while(|(h, _)| net.contains(h))
            .filter(|(h, _)| !cidrs.iter().any(|(c, _)| c.contains(h)))
            .map(|(h, what)| (IpNet::from(*h), what.describe(h)))
            .collect::<Vec<_>>();
        let mut out = cidrs;
        out.extend(hosts);
        out.sort();
        out.dedup_by(|a, b| a.0 == b.0);
        out
    }
}

/// What a rule learns from one gateway, and what it had to leave out.
pub(super) struct Learned {
    pub(super) prefixes: Prefixes,
    /// Routes that overlap the cluster: (route, what it overlaps).
    pub(super) overlapping: Vec<(IpNet, String)>,
    /// Routes the gateway left out of its EgressNode (over the cap).
    pub(super) omitted: u32,
}

/// The rule's prefixes on `node` for the routes out of `interface` of one family (`v6`):
/// default routes only with `include_default`, overlapping routes left out (and listed),
/// more specific routes out of other interfaces carved out, `except` where it falls.
pub(super) fn learn(
    node: &NodeInfo<'_>,
    interface: &str,
    v6: bool,
    include_default: bool,
    except: &[IpNet],
    reserved: &Reserved<'_>,
) -> Learned {
    let mut out = Learned {
        prefixes: Prefixes::default(),
        overlapping: Vec::new(),
        omitted: 0,
    };
    let Some(egress) = &node.egress else {
        return out;
    };
    let family = |p: &&IpNet| p.addr().is_ipv6() == v6;
    let excepted = |p: &IpNet| except.iter().any(|e| e.contains(p));
    let mut forwards: BTreeSet<IpNet> = BTreeSet::new();
    let mut carve: BTreeSet<IpNet> = BTreeSet::new();
    let mut cluster: BTreeSet<IpNet> = BTreeSet::new();
    if let Some(published) = egress.routes.get(interface) {
        out.omitted = published.omitted;
        for p in published.prefixes.iter().filter(family) {
            if p.prefix_len() == 0 {
                if include_default && !excepted(p) {
                    forwards.insert(*p);
                    cluster.extend(reserved.within(*p).into_iter().map(|(n, _)| n));
                }
            } else if let Some(what) = reserved.overlap(*p) {
                out.overlapping.push((*p, what));
            } else if !excepted(p) {
                forwards.insert(*p);
            }
        }
    }
    // More specific routes out of other interfaces, inside a destination.
    let lens: BTreeSet<u8> = forwards.iter().map(IpNet::prefix_len).collect();
    let inside_forward = |q: &IpNet| {
        lens.iter()
            .take_while(|l| **l < q.prefix_len())
            .any(|l| IpNet::new(q.addr(), *l).is_ok_and(|n| forwards.contains(&n.trunc())))
    };
    let others = egress
        .routes
        .iter()
        .filter(|(name, _)| name.as_str() != interface)
        .flat_map(|(_, r)| r.prefixes.iter().filter(family));
    for q in others {
        if !forwards.contains(q) && inside_forward(q) {
            carve.insert(*q);
        }
    }
    carve.retain(|q| !forwards.contains(q) && !excepted(q));
    let excepts: HashSet<IpNet> = except
        .iter()
        .filter(|e| e.addr().is_ipv6() == v6)
        .filter(|e| forwards.iter().any(|f| f.contains(*e)))
        .copied()
        .collect();
    let mut excepts: Vec<IpNet> = excepts.into_iter().collect();
    excepts.sort();
    carve.retain(|q| !cluster.contains(q));
    out.prefixes = Prefixes(
        cluster
            .into_iter()
            .map(|p| (p, Kind::Cluster))
            .chain(excepts.into_iter().map(|p| (p, Kind::Except)))
            .chain(forwards.into_iter().map(|p| (p, Kind::Forward)))
            .chain(carve.into_iter().map(|p| (p, Kind::Carve)))
            .collect(),
    );
    out
}

/// The union of what several gateways route (for a rule none of them serves now: its
/// failure policy still covers every destination any of them would serve). Carve-outs
/// are left out: they differ from one gateway to the next.
pub(super) fn union<'a>(learned: impl IntoIterator<Item = &'a Prefixes>) -> Prefixes {
    let mut cluster = BTreeSet::new();
    let mut excepts = BTreeSet::new();
    let mut forwards = BTreeSet::new();
    for prefixes in learned {
        for (p, kind) in &prefixes.0 {
            match kind {
                Kind::Cluster => {
                    cluster.insert(*p);
                }
                Kind::Except => {
                    excepts.insert(*p);
                }
                Kind::Forward => {
                    forwards.insert(*p);
                }
                Kind::Carve => {}
            }
        }
    }
    Prefixes(
        cluster
            .into_iter()
            .map(|p| (p, Kind::Cluster))
            .chain(excepts.into_iter().map(|p| (p, Kind::Except)))
            .chain(forwards.into_iter().map(|p| (p, Kind::Forward)))
            .collect(),
    )
}

/// Most prefixes named per gateway pair in a disagreement message.
const MAX_NAMED: usize = 3;

/// How the gateways of one rule disagree: for each gateway whose destinations differ
/// from those of the first (by name), a message naming both and the prefixes.
pub(super) fn disagreements(by_node: &BTreeMap<String, Prefixes>) -> Vec<String> {
    let mut sets = by_node
        .iter()
        .map(|(node, p)| (node, p.forwards().collect::<BTreeSet<IpNet>>()));
    let Some((first, reference)) = sets.next() else {
        return Vec::new();
    };
    let list = |set: Vec<&IpNet>| {
        if set.is_empty() {
            return "none".to_owned();
        }
        let mut text = set
            .iter()
            .take(MAX_NAMED)
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        if set.len() > MAX_NAMED {
            text.push_str(&format!(" and {} more", set.len() - MAX_NAMED));
        }
        text
    };
    sets.filter(|(_, set)| *set != reference)
        .map(|(node, set)| {
            let only_first: Vec<&IpNet> = reference.difference(&set).collect();
            let only_other: Vec<&IpNet> = set.difference(&reference).collect();
            format!(
                "{first} and {node} route different prefixes (only {first}: {}; only {node}: {})",
                list(only_first),
                list(only_other)
            )
        })
        .collect()
}
