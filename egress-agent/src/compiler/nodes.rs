//! Nodes as the compiler sees them: what the Node objects, the EgressNodes and the
//! liveness probes say about each, and the node-wide facts derived from them (underlay
//! ids, the cluster's tunnel family).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

use super::{
    compiled::{Object, Problem},
    reason,
};
use crate::{
    api::{EgressNode, FullPolicyMap, PodScope},
    desired::Desired,
    liveness::{PeerView, Report},
    selector::Selector,
    source::ClusterView,
};

/// The annotation that drains a gateway: its egress IPs move away (a planned move), as
/// they do when the node is cordoned.
pub const DRAIN_ANNOTATION: &str = "egress.dev/drain";

/// Underlay address of a node: its first InternalIP, of either family (Kubernetes lists
/// the cluster's primary family first), that is not an egress IP the cluster holds
/// (`held`, from [`held_egress_ips`]: a cloud provider lists every address of a VM's
/// NICs, a held egress IP included). Tunnels between nodes use this address, so every
/// node of a cluster must have one of the same family.
pub fn node_underlay(node: &Node, held: &BTreeSet<IpAddr>) -> Option<IpAddr> {
    node_addresses(node, held)
        .find(|(_, kind)| *kind == "InternalIP")
        .map(|(ip, _)| ip)
}

/// Egress IPs the cluster holds: those any EgressNode's `status.egressIPs` lists and
/// those any node's latest hello claims. A Node address among them is no address of that
/// node, whichever node lists it (a cloud provider may still list it on the old holder
/// after a move).
pub fn held_egress_ips(view: &ClusterView, peers: &PeerView) -> BTreeSet<IpAddr> {
    let published = view
        .egress_nodes
        .iter()
        .flat_map(|en| en.status.iter().flat_map(|s| s.egress_ips.iter()))
        .filter_map(|h| h.ip.parse::<IpAddr>().ok());
    let claimed = peers
        .reports
        .values()
        .flat_map(|r| r.claims.keys().copied());
    published.chain(claimed).collect()
}

/// Every address OVN-Kubernetes' `EgressIP` objects of the view claim -> `OVN-Kubernetes
/// EgressIP <name>` (the first object, by name, when several claim one): not ours to
/// take. Addresses that do not parse are left out.
pub(super) fn claimed_elsewhere(view: &ClusterView) -> BTreeMap<IpAddr, String> {
    let mut out = BTreeMap::new();
    let mut sorted: Vec<_> = view.ovn_egress_ips.iter().collect();
    sorted.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    for o in sorted {
        let name = o.metadata.name.clone().unwrap_or_default();
        for ip in o.spec.egress_ips.iter().filter_map(|s| s.parse().ok()) {
            out.entry(ip)
                .or_insert_with(|| format!("OVN-Kubernetes EgressIP {name}"));
        }
    }
    out
}

/// The Node's `status.addresses` with their types, in order, without the held egress
/// IPs (`held`).
pub fn node_addresses<'a>(
    node: &'a Node,
    held: &'a BTreeSet<IpAddr>,
) -> impl Iterator<Item = (IpAddr, &'a str)> + 'a {
    node.status
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .filter_map(|a| Some((a.address.parse::<IpAddr>().ok()?, a.type_.as_str())))
        .filter(|(ip, _)| !held.contains(ip))
}

/// Is the node drained (the [`DRAIN_ANNOTATION`] is `"true"`) or cordoned?
pub fn node_drained(node: &Node) -> bool {
    let annotated = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(DRAIN_ANNOTATION))
        .is_some_and(|v| v == "true");
    let cordoned = node
        .spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false);
    annotated || cordoned
}

/// Is the node's `Ready` condition `True`?
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Nodes that some policy's gatewaySelector matches (invalid or empty selectors match
/// nothing): the gateways every agent probes.
pub fn gateway_candidates(view: &ClusterView) -> BTreeSet<String> {
    let selectors: Vec<Selector> = view
        .policies
        .iter()
        .filter_map(|p| Selector::gateways(&p.spec.gateway_selector).ok())
        .collect();
    view.nodes
        .iter()
        .filter(|n| {
            let empty = BTreeMap::new();
            let labels = n.metadata.labels.as_ref().unwrap_or(&empty);
            selectors.iter().any(|s| s.matches(labels))
        })
        .filter_map(|n| n.metadata.name.clone())
        .collect()
}

/// Every Node with a name, sorted and deduplicated by name, with its EgressNode as the
/// node's latest hello corrects it, and whether the probes hear it.
pub(super) fn index<'a>(
    view: &'a ClusterView,
    peers: &PeerView,
    held: &BTreeSet<IpAddr>,
) -> Vec<NodeInfo<'a>> {
    let egress_by_name: BTreeMap<&str, &EgressNode> = view
        .egress_nodes
        .iter()
        .filter_map(|en| Some((en.metadata.name.as_deref()?, en)))
        .collect();
    let mut nodes: Vec<NodeInfo<'_>> = view
        .nodes
        .iter()
        .filter_map(|node| {
            let name = node.metadata.name.as_deref()?;
            let en = egress_by_name.get(name).copied();
            let egress = en.map(|en| EgressInfo::new(en, peers.reports.get(name)));
            let mut own_addresses: Vec<(IpAddr, String)> = node_addresses(node, held)
                .map(|(ip, kind)| (ip, kind.to_owned()))
                .collect();
            if let Some(en) = en {
                if let Some(ip) = en.spec.underlay_ip.as_deref().and_then(|s| s.parse().ok()) {
                    own_addresses.push((ip, "EgressNode underlayIP".to_owned()));
                }
                if let Some(info) = &egress {
                    // An egress IP on its interface is no address of the node: held now
                    // (its hellos claim it), or held when it published its EgressNode
                    // (a planned move: it has let go since, and its next EgressNode
                    // drops the address with the claim).
                    let egress_ip =
                        |a: &IpAddr| info.held.contains_key(a) || info.held_meta.contains_key(a);
                    for (iface, nets) in &info.interfaces {
                        for net in nets {
                            if !egress_ip(&net.addr()) {
                                own_addresses.push((net.addr(), format!("interface {iface}")));
                            }
                        }
                    }
                }
            }
            Some(NodeInfo {
                name,
                labels: node.metadata.labels.clone().unwrap_or_default(),
                underlay: node_underlay(node, held),
                ready: node_ready(node),
                drained: node_drained(node),
                dead: peers.dead.contains(name),
                own_addresses,
                pod_cidrs: pod_cidrs(node),
                egress,
            })
        })
        .collect();
    nodes.sort_by(|a, b| a.name.cmp(b.name));
    nodes.dedup_by(|a, b| a.name == b.name);
    nodes
}

/// The annotation where OVN-Kubernetes keeps a Node's subnets (its `spec.podCIDRs` stay
/// empty): `{"default":["10.128.2.0/23","fd01:0:0:1::/64"]}`, or one string per network
/// in older releases.
pub const OVN_NODE_SUBNETS: &str = "k8s.ovn.org/node-subnets";

/// A Node's pod CIDRs that parse: `spec.podCIDRs`, else `spec.podCIDR`, else the default
/// network's subnets in OVN-Kubernetes' [`OVN_NODE_SUBNETS`] annotation.
fn pod_cidrs(node: &Node) -> Vec<IpNet> {
    let spec = node.spec.as_ref();
    let listed = spec
        .and_then(|s| s.pod_cidrs.as_ref())
        .filter(|l| !l.is_empty());
    let texts: Vec<String> = match (listed, spec.and_then(|s| s.pod_cidr.as_ref())) {
        (Some(list), _) => list.clone(),
        (None, Some(one)) => vec![one.clone()],
        (None, None) => ovn_node_subnets(node),
    };
    texts
        .iter()
        .filter_map(|t| t.parse::<IpNet>().ok())
        .map(|n| n.trunc())
        .collect()
}

/// The default network's subnets in the [`OVN_NODE_SUBNETS`] annotation; none when it is
/// absent or not of either shape.
fn ovn_node_subnets(node: &Node) -> Vec<String> {
    let Some(text) = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(OVN_NODE_SUBNETS))
    else {
        return Vec::new();
    };
    let Ok(serde_json::Value::Object(networks)) = serde_json::from_str(text) else {
        return Vec::new();
    };
    match networks.get("default") {
        Some(serde_json::Value::String(one)) => vec![one.clone()],
        Some(serde_json::Value::Array(many)) => many
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

/// Give every node with an underlay address its small stable id and this node its own
/// address (`node_name`); report nodes without an underlay, and those whose underlay is of
/// the cluster's minority family.
pub(super) fn register(
    nodes: &[NodeInfo<'_>],
    node_name: &str,
    desired: &mut Desired,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut next_id = 1u32;
    for node in nodes {
        match node.underlay {
            Some(ip) => {
                desired.nodes.entry(ip).or_insert_with(|| {
                    let id = next_id;
                    next_id += 1;
                    id
                });
            }
            None => problems.push(Problem {
                object: Object::Node(node.name.to_owned()),
                reason: reason::NO_UNDERLAY_ADDRESS.to_owned(),
                message: "status.addresses: no InternalIP address: the node can be \
                          neither a source nor a gateway"
                    .to_owned(),
            }),
        }
        if node.name == node_name {
            desired.node_ip = node.underlay;
            desired.pod_cidrs.clone_from(&node.pod_cidrs);
        }
    }
    // One tunnel family per cluster: nodes of the minority family (IPv4 on a tie) cannot
    // reach the others, which is worth saying on every node, in the same words.
    let v6_nodes = nodes
        .iter()
        .filter(|n| n.underlay.is_some_and(|u| u.is_ipv6()))
        .count();
    let v4_nodes = nodes
        .iter()
        .filter(|n| n.underlay.is_some_and(|u| u.is_ipv4()))
        .count();
    if v4_nodes > 0 && v6_nodes > 0 {
        let (odd_v6, majority, count) = if v6_nodes > v4_nodes {
            (false, "IPv6", v6_nodes)
        } else {
            (true, "IPv4", v4_nodes)
        };
        for node in nodes {
            let Some(ip) = node.underlay.filter(|u| u.is_ipv6() == odd_v6) else {
                continue;
            };
            problems.push(Problem {
                object: Object::Node(node.name.to_owned()),
                reason: reason::UNDERLAY_FAMILY_MISMATCH.to_owned(),
                message: format!(
                    "status.addresses: the first InternalIP, {ip}, is not {majority} like \
                     that of {count} other nodes: no tunnel between this node and those; \
                     list an {majority} InternalIP first"
                ),
            });
        }
    }
    problems
}

/// The policy maps that agents could not fit, as their EgressNodes say (naming the
/// policies that select the pods left out), by node and map name. Only nodes with a Node
/// object count: a stale EgressNode of a deleted node does not.
pub(super) fn full_policy_maps(view: &ClusterView) -> Vec<(&str, &FullPolicyMap)> {
    let nodes: BTreeSet<&str> = view
        .nodes
        .iter()
        .filter_map(|n| n.metadata.name.as_deref())
        .collect();
    let mut full: Vec<(&str, &FullPolicyMap)> = view
        .egress_nodes
        .iter()
        .filter_map(|e| Some((e.metadata.name.as_deref()?, e.status.as_ref()?)))
        .filter(|(name, _)| nodes.contains(name))
        .flat_map(|(name, st)| st.full_policy_maps.iter().map(move |m| (name, m)))
        .collect();
    full.sort_by(|a, b| (a.0, &a.1.map).cmp(&(b.0, &b.1.map)));
    full
}

/// A node as the compiler sees it.
pub(super) struct NodeInfo<'a> {
    pub(super) name: &'a str,
    pub(super) labels: BTreeMap<String, String>,
    pub(super) underlay: Option<IpAddr>,
    pub(super) ready: bool,
    /// Drained or cordoned: holds nothing new and gives up what it holds.
    pub(super) drained: bool,
    /// Not heard by this node's probes (or this node itself, cut off).
    pub(super) dead: bool,
    /// Every address the node has (Node addresses, EgressNode underlay and interface
    /// addresses, minus the egress IPs it holds), with where it was seen.
    pub(super) own_addresses: Vec<(IpAddr, String)>,
    /// `spec.podCIDRs` (else `spec.podCIDR`) that parse.
    pub(super) pod_cidrs: Vec<IpNet>,
    pub(super) egress: Option<EgressInfo>,
}

/// What a node's EgressNode says.
pub(super) struct EgressInfo {
    /// Up interfaces, by name: (address, network) in listed order.
    pub(super) interfaces: BTreeMap<String, Vec<IpNet>>,
    /// Egress IPs it holds now, with their epochs.
    pub(super) held: BTreeMap<IpAddr, u64>,
    /// When and why it took them, as it published in its EgressNode: by address.
    pub(super) held_meta: BTreeMap<IpAddr, (u64, Option<String>, Option<String>)>,
    /// The routes it publishes, by interface (up or not).
    pub(super) routes: BTreeMap<String, PublishedRoutes>,
    /// The pods its agent's maps were written from (`status.podScope`).
    pub(super) pod_scope: PodScope,
}

/// The routes a node publishes out of one interface.
#[derive(Default)]
pub(super) struct PublishedRoutes {
    /// The prefixes that parse, without host bits.
    pub(super) prefixes: Vec<IpNet>,
    /// How many it left out (over `api::MAX_ROUTES`).
    pub(super) omitted: u32,
}

impl EgressInfo {
    /// What the EgressNode says, corrected by the node's latest hello (`report`): the
    /// interfaces it reports down are down, and it holds what it claims.
    fn new(en: &EgressNode, report: Option<&Report>) -> Self {
        let mut interfaces = BTreeMap::new();
        let mut held = BTreeMap::new();
        let mut held_meta = BTreeMap::new();
        let mut routes = BTreeMap::new();
        if let Some(status) = &en.status {
            for iface in &status.interfaces {
                let published = PublishedRoutes {
                    prefixes: iface
                        .routes
                        .iter()
                        .filter_map(|r| r.parse::<IpNet>().ok())
                        .map(|r| r.trunc())
                        .collect(),
                    omitted: iface.routes_omitted,
                };
                routes.insert(iface.name.clone(), published);
            }
            for h in &status.egress_ips {
                if let Ok(ip) = h.ip.parse::<IpAddr>() {
                    held.insert(ip, h.epoch);
                    held_meta.insert(ip, (h.epoch, h.since.clone(), h.reason.clone()));
                }
            }
            let down = |name: &str| report.is_some_and(|r| r.down.contains(name));
            for iface in status.interfaces.iter().filter(|i| i.up && !down(&i.name)) {
                let nets: Vec<IpNet> = iface
                    .addresses
                    .iter()
                    .filter_map(|a| a.parse::<IpNet>().ok())
                    .collect();
                interfaces
                    .entry(iface.name.clone())
                    .or_insert_with(Vec::new)
                    .extend(nets);
            }
        }
        if let Some(r) = report {
            held = r.claims.iter().map(|(ip, c)| (*ip, c.epoch)).collect();
        }
        Self {
            interfaces,
            held,
            held_meta,
            routes,
            pod_scope: en.status.as_ref().map(|s| s.pod_scope).unwrap_or_default(),
        }
    }

    /// The interface whose subnet contains `ip` (first by name) and that subnet's prefix
    /// length. IPv6 link-local subnets host nothing.
    pub(super) fn hosting_interface(&self, ip: IpAddr) -> Option<(&str, u8)> {
        self.interfaces.iter().find_map(|(name, nets)| {
            nets.iter()
                .find(|net| usable(net) && net.contains(&ip))
                .map(|net| (name.as_str(), net.prefix_len()))
        })
    }

    /// The node's own first address of the family (`v6`) on `interface`: held egress IPs
    /// are not its own, and an IPv6 link-local address cannot be a source off-link.
    pub(super) fn own_address(&self, interface: &str, v6: bool) -> Option<(IpAddr, u8)> {
        self.interfaces
            .get(interface)?
            .iter()
            .find(|net| {
                net.addr().is_ipv6() == v6 && usable(net) && !self.held.contains_key(&net.addr())
            })
            .map(|net| (net.addr(), net.prefix_len()))
    }
}

/// An interface address that can serve as (or host) an egress address: not IPv6
/// link-local (fe80::/10), not unspecified or loopback.
fn usable(net: &IpNet) -> bool {
    match net.addr() {
        IpAddr::V4(a) => !a.is_unspecified() && !a.is_loopback(),
        IpAddr::V6(a) => {
            !a.is_unspecified() && !a.is_loopback() && (a.segments()[0] & 0xffc0) != 0xfe80
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::{api::core::v1::NodeSpec, apimachinery::pkg::apis::meta::v1::ObjectMeta};

    use super::*;

    fn node(pod_cidrs: &[&str], annotation: Option<&str>) -> Node {
        Node {
            metadata: ObjectMeta {
                annotations: annotation
                    .map(|a| BTreeMap::from([(OVN_NODE_SUBNETS.to_owned(), a.to_owned())])),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                pod_cidrs: Some(pod_cidrs.iter().map(|s| (*s).to_owned()).collect()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn texts(n: &Node) -> Vec<String> {
        pod_cidrs(n).iter().map(ToString::to_string).collect()
    }

    #[test]
    fn ovn_kubernetes_node_subnets_stand_in_for_empty_pod_cidrs() {
        let both = r#"{"default":["10.128.2.0/23","fd01:0:0:1::/64"]}"#;
        assert_eq!(
            texts(&node(&[], Some(both))),
            ["10.128.2.0/23", "fd01:0:0:1::/64"]
        );
        // Older releases: one string per network; other networks are not the pods'.
        let old = r#"{"default":"10.128.4.0/23","blue":"10.200.0.0/24"}"#;
        assert_eq!(texts(&node(&[], Some(old))), ["10.128.4.0/23"]);
        // spec.podCIDRs, when set, wins; an annotation of neither shape gives none.
        assert_eq!(
            texts(&node(&["10.244.1.0/24"], Some(both))),
            ["10.244.1.0/24"]
        );
        assert!(texts(&node(&[], Some("10.128.2.0/23"))).is_empty());
        assert!(texts(&node(&[], Some(r#"{"default":7}"#))).is_empty());
        assert!(texts(&node(&[], None)).is_empty());
    }
}
