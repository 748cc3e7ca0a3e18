//! The policy compiler: a pure function from the cluster view and this node's name to the
//! desired datapath state of this node, the status of every policy and the holder of every
//! egress address.
//!
//! No I/O and no clocks; everything is sorted, so the same view gives the same result on
//! every node. Policy statuses, holders and problems do not depend on the node name: every
//! agent (and `egress-agent check`) derives the same ones.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt,
    net::{IpAddr, Ipv4Addr},
};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, Pod};

use crate::{
    api::{
        EgressGatewayPolicy, EgressIpStatus, EgressNode, EgressRule, FailurePolicy,
        PolicyCondition, PolicyStatus,
    },
    desired::{
        Desired, GatewayRuleV4, GatewayRuleV6, HeldIpV4, PolicyAction, PolicyEntryV4, PolicyEntryV6,
    },
    liveness::{PeerView, Report},
    source::ClusterView,
};

mod hash;
mod selector;
#[cfg(test)]
mod tests;

pub use hash::{fnv1a64, rule_ids};
pub use selector::Selector;

/// Condition types.
pub mod condition {
    pub const ACCEPTED: &str = "Accepted";
    pub const READY: &str = "Ready";
    pub const CONFLICT: &str = "Conflict";
}

/// Condition reasons (stable: users and alerts match on them).
pub mod reason {
    // Accepted=True / Ready=True
    pub const ACCEPTED: &str = "Accepted";
    pub const READY: &str = "Ready";
    // Accepted=False: the spec itself is wrong.
    pub const INVALID_CIDR: &str = "InvalidCIDR";
    pub const INVALID_IP: &str = "InvalidIP";
    pub const INVALID_INTERFACE: &str = "InvalidInterface";
    pub const INVALID_TARGET: &str = "InvalidTarget";
    pub const INVALID_SELECTOR: &str = "InvalidSelector";
    pub const NO_DESTINATIONS: &str = "NoDestinations";
    pub const EXCEPT_OUTSIDE_DESTINATIONS: &str = "ExceptOutsideDestinations";
    pub const FAMILY_MISMATCH: &str = "FamilyMismatch";
    pub const NO_RULES: &str = "NoRules";
    // Ready=False: the spec is fine, the cluster cannot serve (all of) it.
    pub const NOT_ACCEPTED: &str = "NotAccepted";
    pub const NO_MATCHING_GATEWAY: &str = "NoMatchingGateway";
    pub const NO_ELIGIBLE_GATEWAY: &str = "NoEligibleGateway";
    pub const EGRESS_IP_NOT_HOSTABLE: &str = "EgressIPNotHostable";
    pub const EGRESS_IP_IS_NODE_ADDRESS: &str = "EgressIPIsNodeAddress";
    pub const EGRESS_IP_IN_USE: &str = "EgressIPInUse";
    pub const INTERFACE_NOT_FOUND: &str = "InterfaceNotFound";
    // Conflict=True
    pub const DESTINATION_CLAIMED: &str = "DestinationClaimed";
    // Problems about other objects.
    pub const NO_UNDERLAY_ADDRESS: &str = "NoUnderlayAddress";
    pub const UNDERLAY_FAMILY_MISMATCH: &str = "UnderlayFamilyMismatch";
}

/// Why an egress IP is held where it is (stable: `EgressIpStatus.reason`, Events and the
/// `egress_failovers_total` metric use them).
pub mod move_reason {
    /// No node held it before.
    pub const ASSIGNED: &str = "Assigned";
    /// The previous holder stopped answering probes (dead, or cut off from the others).
    pub const HOLDER_UNREACHABLE: &str = "HolderUnreachable";
    pub const HOLDER_NOT_READY: &str = "HolderNotReady";
    /// The previous holder is drained (`egress.dev/drain: "true"`) or cordoned.
    pub const HOLDER_DRAINED: &str = "HolderDrained";
    /// The previous holder's interface for the address is down or gone.
    pub const HOLDER_INTERFACE_DOWN: &str = "HolderInterfaceDown";
    /// The previous holder is no longer selected by the policy's gatewaySelector.
    pub const HOLDER_NOT_SELECTED: &str = "HolderNotSelected";
    /// Anything else (the policy changed, several nodes claimed it).
    pub const REASSIGNED: &str = "Reassigned";

    pub const ALL: [&str; 7] = [
        ASSIGNED,
        HOLDER_UNREACHABLE,
        HOLDER_NOT_READY,
        HOLDER_DRAINED,
        HOLDER_INTERFACE_DOWN,
        HOLDER_NOT_SELECTED,
        REASSIGNED,
    ];

    /// The constant spelled `text`, if any.
    pub fn parse(text: &str) -> Option<&'static str> {
        ALL.into_iter().find(|r| *r == text)
    }
}

/// The annotation that drains a gateway: its egress IPs move away (a planned move), as
/// they do when the node is cordoned.
pub const DRAIN_ANNOTATION: &str = "egress.dev/drain";

/// What the compiler derived for this node and for the cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Compiled {
    /// This node's datapath state.
    pub desired: Desired,
    /// Status of every policy, by name (the same on every node).
    pub statuses: BTreeMap<String, PolicyStatus>,
    /// Who uses which egress address for which policy (the same on every node), sorted.
    pub holders: Vec<Holder>,
    /// Everything a user should fix or know, sorted (the same on every node).
    pub problems: Vec<Problem>,
}

/// One egress address in use: a dedicated egress IP and its holder, or (`shared`) a
/// gateway's own interface address serving an `interface:` rule.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Holder {
    /// The egress address (IPv4 or IPv6; the node is reached over the underlay, of either family).
    pub ip: IpAddr,
    pub node: String,
    pub interface: String,
    pub policy: String,
    /// Index of the rule in the policy.
    pub rule: usize,
    pub rule_id: u32,
    /// The gateway's own address (an `interface:` rule), not a dedicated egress IP.
    pub shared: bool,
    /// Ownership generation of a dedicated egress IP (0 for a shared address).
    pub epoch: u64,
    /// Why it is held there (see [`move_reason`]).
    pub reason: &'static str,
}

/// The object a [`Problem`] is about.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Object {
    Policy(String),
    Node(String),
}

impl fmt::Display for Object {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Policy(name) => write!(f, "policy {name}"),
            Self::Node(name) => write!(f, "node {name}"),
        }
    }
}

/// A guardrail that fired, a conflict, or an object the compiler had to leave out.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Problem {
    pub object: Object,
    /// The condition reason (see [`reason`]).
    pub reason: String,
    /// Starts with the field path: `rules[0].egressIP: ...`.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.message)
    }
}

/// Underlay address of a node: its first InternalIP, of either family (Kubernetes lists
/// the cluster's primary family first). Tunnels between nodes use this address, so every
/// node of a cluster must have one of the same family.
pub fn node_underlay(node: &Node) -> Option<IpAddr> {
    node.status
        .as_ref()?
        .addresses
        .as_ref()?
        .iter()
        .filter(|a| a.type_ == "InternalIP")
        .find_map(|a| a.address.parse::<IpAddr>().ok())
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

/// Nodes that some policy's gatewaySelector matches (invalid selectors match nothing):
/// the gateways every agent probes.
pub fn gateway_candidates(view: &ClusterView) -> BTreeSet<String> {
    let selectors: Vec<Selector> = view
        .policies
        .iter()
        .filter_map(|p| Selector::new(&p.spec.gateway_selector, "spec.gatewaySelector").ok())
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

/// Pod IPv4 addresses (`status.podIPs`, else `status.podIP`), invalid ones left out.
pub fn pod_ipv4s(pod: &Pod) -> Vec<Ipv4Addr> {
    pod_ips(pod)
        .into_iter()
        .filter_map(|ip| match ip {
            IpAddr::V4(ip) => Some(ip),
            IpAddr::V6(_) => None,
        })
        .collect()
}

/// Pod addresses of both families (`status.podIPs`, else `status.podIP`), invalid ones
/// left out, in listed order.
pub fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(status) = &pod.status else {
        return Vec::new();
    };
    let mut ips: Vec<IpAddr> = match &status.pod_ips {
        Some(list) if !list.is_empty() => list.iter().filter_map(|p| p.ip.parse().ok()).collect(),
        _ => status
            .pod_ip
            .iter()
            .filter_map(|ip| ip.parse().ok())
            .collect(),
    };
    ips.dedup();
    ips
}

/// A node as the compiler sees it.
struct NodeInfo<'a> {
    name: &'a str,
    labels: BTreeMap<String, String>,
    underlay: Option<IpAddr>,
    ready: bool,
    /// Drained or cordoned: holds nothing new and gives up what it holds.
    drained: bool,
    /// Not heard by this node's probes (or this node itself, cut off).
    dead: bool,
    /// Every address the node has (Node addresses, EgressNode underlay and interface
    /// addresses, minus the egress IPs it holds), with where it was seen.
    own_addresses: Vec<(IpAddr, String)>,
    egress: Option<EgressInfo>,
}

/// What a node's EgressNode says.
struct EgressInfo {
    /// Up interfaces, by name: (address, network) in listed order.
    interfaces: BTreeMap<String, Vec<IpNet>>,
    /// Egress IPs it holds now, with their epochs.
    held: BTreeMap<IpAddr, u64>,
    /// When and why it took them, as it published in its EgressNode: by address.
    held_meta: BTreeMap<IpAddr, (u64, Option<String>, Option<String>)>,
}

impl EgressInfo {
    /// What the EgressNode says, corrected by the node's latest hello (`report`): the
    /// interfaces it reports down are down, and it holds what it claims.
    fn new(en: &EgressNode, report: Option<&Report>) -> Self {
        let mut interfaces = BTreeMap::new();
        let mut held = BTreeMap::new();
        let mut held_meta = BTreeMap::new();
        if let Some(status) = &en.status {
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
        }
    }

    /// The interface whose subnet contains `ip` (first by name) and that subnet's prefix
    /// length. IPv6 link-local subnets host nothing.
    fn hosting_interface(&self, ip: IpAddr) -> Option<(&str, u8)> {
        self.interfaces.iter().find_map(|(name, nets)| {
            nets.iter()
                .find(|net| usable(net) && net.contains(&ip))
                .map(|net| (name.as_str(), net.prefix_len()))
        })
    }

    /// The node's own first address of the family (`v6`) on `interface`: held egress IPs
    /// are not its own, and an IPv6 link-local address cannot be a source off-link.
    fn own_address(&self, interface: &str, v6: bool) -> Option<(IpAddr, u8)> {
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

/// A pod as the compiler sees it.
struct PodInfo<'a> {
    namespace: &'a str,
    name: &'a str,
    labels: &'a BTreeMap<String, String>,
    node: &'a str,
    /// Both families (dual-stack pods have one of each).
    ips: Vec<IpAddr>,
}

/// A policy checked and resolved: name, (namespace, pod) selectors when valid, failure
/// policy and rules.
type PolicyPlan = (
    String,
    Option<(Selector, Selector)>,
    FailurePolicy,
    Vec<RulePlan>,
);

/// A rule checked and resolved.
struct RulePlan {
    index: usize,
    rule_id: u32,
    /// Destination and except prefixes that parsed (one family unless the rule is
    /// invalid); each applies to the pod addresses of its family.
    destinations: Vec<IpNet>,
    except: Vec<IpNet>,
    target: Target,
}

enum Target {
    /// A dedicated egress IP and its holder: (node, underlay, interface, prefix length).
    Dedicated {
        ip: IpAddr,
        holder: Option<GatewayAddr>,
    },
    /// An interface rule and the gateways serving it, by node name.
    Interface {
        gateways: BTreeMap<String, GatewayAddr>,
    },
    /// No gateway at all (invalid, unhostable, ...): the failure policy applies.
    None,
}

#[derive(Clone, Debug)]
struct GatewayAddr {
    node: String,
    underlay: IpAddr,
    interface: String,
    ip: IpAddr,
    prefix_len: u8,
    /// The holding (dedicated addresses): its epoch, why, and since when (as published).
    epoch: u64,
    reason: &'static str,
    since: Option<String>,
}

impl GatewayAddr {
    fn new(node: &NodeInfo<'_>, underlay: IpAddr, interface: &str, ip: IpAddr, len: u8) -> Self {
        Self {
            node: node.name.to_owned(),
            underlay,
            interface: interface.to_owned(),
            ip,
            prefix_len: len,
            epoch: 0,
            reason: move_reason::ASSIGNED,
            since: None,
        }
    }
}

/// Conditions being built for one policy.
#[derive(Default)]
struct PolicyReport {
    /// (reason, message) of static errors.
    invalid: Vec<(String, String)>,
    /// (reason, message) of what keeps rules from being served.
    unready: Vec<(String, String)>,
    /// (winner policy, pod, prefix) pairs lost to another policy or an earlier rule.
    conflicts: Vec<String>,
    conflict_count: usize,
}

/// Most conflict pairs named in a condition message; the rest are counted.
const MAX_CONFLICTS_NAMED: usize = 3;

fn family_name(v6: bool) -> &'static str {
    if v6 { "IPv6" } else { "IPv4" }
}

/// Compile `view` for the node named `node_name`, without liveness probes (every node
/// with an EgressNode counts as alive): what `egress-agent check` and tests see.
pub fn compile(view: &ClusterView, node_name: &str) -> Compiled {
    compile_with(view, &PeerView::default(), node_name)
}

/// Compile `view` for the node named `node_name`, with what its probes tell (`peers`):
/// dead gateways are not eligible, hellos correct the EgressNodes (interfaces down, IPs
/// held).
pub fn compile_with(view: &ClusterView, peers: &PeerView, node_name: &str) -> Compiled {
    let mut out = Compiled::default();
    let mut problems: Vec<Problem> = Vec::new();

    // ---- Nodes --------------------------------------------------------------------------
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
            let mut own_addresses = Vec::new();
            for a in node
                .status
                .iter()
                .flat_map(|s| s.addresses.iter().flatten())
            {
                if let Ok(ip) = a.address.parse::<IpAddr>() {
                    own_addresses.push((ip, a.type_.clone()));
                }
            }
            if let Some(en) = en {
                if let Some(ip) = en.spec.underlay_ip.as_deref().and_then(|s| s.parse().ok()) {
                    own_addresses.push((ip, "EgressNode underlayIP".to_owned()));
                }
                if let Some(info) = &egress {
                    for (iface, nets) in &info.interfaces {
                        for net in nets {
                            if !info.held.contains_key(&net.addr()) {
                                own_addresses.push((net.addr(), format!("interface {iface}")));
                            }
                        }
                    }
                }
            }
            Some(NodeInfo {
                name,
                labels: node.metadata.labels.clone().unwrap_or_default(),
                underlay: node_underlay(node),
                ready: node_ready(node),
                drained: node_drained(node),
                dead: peers.dead.contains(name),
                own_addresses,
                egress,
            })
        })
        .collect();
    nodes.sort_by(|a, b| a.name.cmp(b.name));
    nodes.dedup_by(|a, b| a.name == b.name);

    let mut next_id = 1u32;
    for node in &nodes {
        match node.underlay {
            Some(ip) => {
                out.desired.nodes.entry(ip).or_insert_with(|| {
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
            out.desired.node_ip = node.underlay;
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
        for node in &nodes {
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
    let underlay_of: BTreeMap<&str, IpAddr> = nodes
        .iter()
        .filter_map(|n| Some((n.name, n.underlay?)))
        .collect();

    // ---- Namespaces and pods -----------------------------------------------------------
    let mut namespace_labels: BTreeMap<&str, BTreeMap<String, String>> = BTreeMap::new();
    for ns in &view.namespaces {
        if let Some(name) = ns.metadata.name.as_deref() {
            let mut labels = ns.metadata.labels.clone().unwrap_or_default();
            labels
                .entry("kubernetes.io/metadata.name".to_owned())
                .or_insert_with(|| name.to_owned());
            namespace_labels.insert(name, labels);
        }
    }
    let mut pods: Vec<PodInfo<'_>> = view
        .pods
        .iter()
        .filter_map(|pod| {
            if pod.host_network || !pod.running || pod.ips.is_empty() || pod.name.is_empty() {
                return None;
            }
            Some(PodInfo {
                namespace: &pod.namespace,
                name: &pod.name,
                labels: &pod.labels,
                node: pod.node_name.as_deref()?,
                ips: pod.ips.clone(),
            })
        })
        .collect();
    pods.sort_by(|a, b| (a.namespace, a.name).cmp(&(b.namespace, b.name)));
    for pod in &pods {
        if let Some(underlay) = underlay_of.get(pod.node) {
            for ip in &pod.ips {
                match ip {
                    IpAddr::V4(ip) => {
                        out.desired.pod_owner_v4.insert(*ip, *underlay);
                    }
                    IpAddr::V6(ip) => {
                        out.desired.pod_owner_v6.insert(*ip, *underlay);
                    }
                }
            }
        }
    }

    // ---- Policies ----------------------------------------------------------------------
    let mut policies: Vec<&EgressGatewayPolicy> = view
        .policies
        .iter()
        .filter(|p| p.metadata.name.is_some())
        .collect();
    policies.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    policies.dedup_by(|a, b| a.metadata.name == b.metadata.name);
    let ids = rule_ids(policies.iter().flat_map(|p| {
        let name = p.metadata.name.as_deref().unwrap_or_default();
        (0..p.spec.rules.len()).map(move |i| (name, i))
    }));

    // Egress IP -> (holder, deciding policy): the first policy (in name order) that can
    // place an egress IP decides where it lives; later users must agree.
    let mut placed: BTreeMap<IpAddr, (GatewayAddr, String)> = BTreeMap::new();
    let mut plans: Vec<PolicyPlan> = Vec::new();
    let mut reports: BTreeMap<String, PolicyReport> = BTreeMap::new();

    for policy in &policies {
        let name = policy.metadata.name.clone().unwrap_or_default();
        let mut report = PolicyReport::default();
        let spec = &policy.spec;

        // Selectors.
        let mut selector =
            |sel: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>,
             field: &str| match sel {
                None => Some(Selector::everything()),
                Some(sel) => match Selector::new(sel, field) {
                    Ok(s) => Some(s),
                    Err(message) => {
                        report
                            .invalid
                            .push((reason::INVALID_SELECTOR.to_owned(), message));
                        None
                    }
                },
            };
        let ns_sel = selector(spec.namespace_selector.as_ref(), "spec.namespaceSelector");
        let pod_sel = selector(spec.pod_selector.as_ref(), "spec.podSelector");
        let gw_sel = selector(Some(&spec.gateway_selector), "spec.gatewaySelector");
        let selectors = ns_sel.zip(pod_sel);

        if spec.rules.is_empty() {
            report.invalid.push((
                reason::NO_RULES.to_owned(),
                "spec.rules: at least one rule is required".to_owned(),
            ));
        }

        // Eligible gateways.
        let mut eligible: Vec<&NodeInfo<'_>> = Vec::new();
        let mut candidate_names: BTreeSet<&str> = BTreeSet::new();
        if let Some(gw_sel) = &gw_sel {
            let candidates: Vec<&NodeInfo<'_>> =
                nodes.iter().filter(|n| gw_sel.matches(&n.labels)).collect();
            candidate_names = candidates.iter().map(|n| n.name).collect();
            let mut why_not = Vec::new();
            for node in &candidates {
                if !node.ready {
                    why_not.push(format!("{} is not Ready", node.name));
                } else if node.dead {
                    why_not.push(format!(
                        "{} is unreachable (no probe heard within the detection time)",
                        node.name
                    ));
                } else if node.drained {
                    why_not.push(format!(
                        "{} is drained ({DRAIN_ANNOTATION} or cordoned)",
                        node.name
                    ));
                } else if node.egress.is_none() {
                    why_not.push(format!(
                        "{} has no EgressNode (is its agent running?)",
                        node.name
                    ));
                } else if node.underlay.is_none() {
                    why_not.push(format!("{} has no InternalIP address", node.name));
                } else {
                    eligible.push(node);
                }
            }
            if candidates.is_empty() {
                report.unready.push((
                    reason::NO_MATCHING_GATEWAY.to_owned(),
                    "spec.gatewaySelector: matches no node".to_owned(),
                ));
            } else if eligible.is_empty() {
                report.unready.push((
                    reason::NO_ELIGIBLE_GATEWAY.to_owned(),
                    format!(
                        "spec.gatewaySelector: no selected node is eligible: {}",
                        why_not.join(", ")
                    ),
                ));
            }
        }
        let eligible_names = || {
            eligible
                .iter()
                .map(|n| n.name)
                .collect::<Vec<_>>()
                .join(", ")
        };

        let mut rule_plans = Vec::new();
        for (index, rule) in spec.rules.iter().enumerate() {
            let rule_id = ids.get(&(name.clone(), index)).copied().unwrap_or(0);
            let checked = check_rule(index, rule, &mut report);
            let mut plan = RulePlan {
                index,
                rule_id,
                destinations: Vec::new(),
                except: Vec::new(),
                target: Target::None,
            };
            let Some(checked) = checked else {
                rule_plans.push(plan);
                continue;
            };
            plan.destinations = checked.destinations;
            plan.except = checked.except;
            if !checked.valid {
                rule_plans.push(plan);
                continue;
            }
            match (&rule.egress_ip, &rule.interface) {
                (Some(_), None) => {
                    let Some(ip) = checked.egress_ip else {
                        rule_plans.push(plan);
                        continue;
                    };
                    plan.target = Target::Dedicated { ip, holder: None };
                    if let Some((node, how)) = nodes.iter().find_map(|n| {
                        n.own_addresses
                            .iter()
                            .find(|(a, _)| *a == ip)
                            .map(|(_, how)| (n.name, how))
                    }) {
                        report.unready.push((
                            reason::EGRESS_IP_IS_NODE_ADDRESS.to_owned(),
                            format!(
                                "rules[{index}].egressIP: {ip} is an address of node {node} \
                                 ({how}); use a free address of that subnet, or `interface:` to \
                                 SNAT to the gateways' own addresses"
                            ),
                        ));
                        rule_plans.push(plan);
                        continue;
                    }
                    if eligible.is_empty() {
                        // Said once for the policy (spec.gatewaySelector).
                        rule_plans.push(plan);
                        continue;
                    }
                    let hosts: Vec<GatewayAddr> = eligible
                        .iter()
                        .filter_map(|n| {
                            let (iface, prefix_len) = n.egress.as_ref()?.hosting_interface(ip)?;
                            Some(GatewayAddr::new(n, n.underlay?, iface, ip, prefix_len))
                        })
                        .collect();
                    let holder = if let Some((placed_at, decider)) = placed.get(&ip) {
                        let agreed = hosts
                            .iter()
                            .any(|h| h.node == placed_at.node)
                            .then(|| placed_at.clone());
                        if agreed.is_none() {
                            report.unready.push((
                                reason::EGRESS_IP_IN_USE.to_owned(),
                                format!(
                                    "rules[{index}].egressIP: {ip} is held by {} for policy \
                                     {decider}, which is not an eligible gateway here",
                                    placed_at.node
                                ),
                            ));
                        }
                        agreed
                    } else if hosts.is_empty() {
                        report.unready.push((
                            reason::EGRESS_IP_NOT_HOSTABLE.to_owned(),
                            format!(
                                "rules[{index}].egressIP: {ip} is in no subnet of an up \
                                 interface of any eligible gateway ({})",
                                eligible_names()
                            ),
                        ));
                        None
                    } else {
                        let chosen = choose_holder(
                            ip,
                            &hosts,
                            &nodes,
                            &candidate_names,
                            peers.last_claims.get(&ip),
                        );
                        if let Some(h) = &chosen {
                            placed.insert(ip, (h.clone(), name.clone()));
                        }
                        chosen
                    };
                    plan.target = Target::Dedicated { ip, holder };
                }
                (None, Some(interface)) => {
                    let gateways: BTreeMap<String, GatewayAddr> = eligible
                        .iter()
                        .filter_map(|n| {
                            let (ip, prefix_len) =
                                n.egress.as_ref()?.own_address(interface, checked.v6)?;
                            Some((
                                n.name.to_owned(),
                                GatewayAddr::new(n, n.underlay?, interface, ip, prefix_len),
                            ))
                        })
                        .collect();
                    if eligible.is_empty() {
                        // Said once for the policy (spec.gatewaySelector).
                    } else if gateways.is_empty() {
                        report.unready.push((
                            reason::INTERFACE_NOT_FOUND.to_owned(),
                            format!(
                                "rules[{index}].interface: no eligible gateway ({}) has an up \
                                 interface {interface} with {} address",
                                eligible_names(),
                                if checked.v6 {
                                    "a global IPv6"
                                } else {
                                    "an IPv4"
                                }
                            ),
                        ));
                    } else {
                        plan.target = Target::Interface { gateways };
                    }
                }
                _ => {}
            }
            rule_plans.push(plan);
        }
        plans.push((name.clone(), selectors, spec.failure_policy, rule_plans));
        reports.insert(name, report);
    }

    // ---- Gateway side and holders ------------------------------------------------------
    let mut statuses_ips: BTreeMap<String, BTreeSet<EgressIpStatus>> = BTreeMap::new();
    for (name, _, _, rules) in &plans {
        let ips = statuses_ips.entry(name.clone()).or_default();
        for plan in rules {
            let served: Vec<(&GatewayAddr, bool)> = match &plan.target {
                Target::Dedicated {
                    holder: Some(h), ..
                } => vec![(h, false)],
                Target::Interface { gateways } => gateways.values().map(|g| (g, true)).collect(),
                _ => Vec::new(),
            };
            for (g, shared) in served {
                out.holders.push(Holder {
                    ip: g.ip,
                    node: g.node.clone(),
                    interface: g.interface.clone(),
                    policy: name.clone(),
                    rule: plan.index,
                    rule_id: plan.rule_id,
                    shared,
                    epoch: g.epoch,
                    reason: g.reason,
                });
                ips.insert(EgressIpStatus {
                    ip: g.ip.to_string(),
                    node: g.node.clone(),
                    interface: g.interface.clone(),
                    since: (!shared).then(|| g.since.clone()).flatten(),
                    reason: (!shared).then(|| g.reason.to_owned()),
                });
                if g.node == node_name {
                    let held = HeldIpV4 {
                        interface: g.interface.clone(),
                        prefix_len: g.prefix_len,
                        shared,
                    };
                    match g.ip {
                        IpAddr::V4(egress_ip) => {
                            out.desired.rules_v4.insert(
                                plan.rule_id,
                                GatewayRuleV4 {
                                    egress_ip,
                                    interface: g.interface.clone(),
                                },
                            );
                            out.desired.egress_ips_v4.insert(egress_ip, held);
                        }
                        IpAddr::V6(egress_ip) => {
                            out.desired.rules_v6.insert(
                                plan.rule_id,
                                GatewayRuleV6 {
                                    egress_ip,
                                    interface: g.interface.clone(),
                                },
                            );
                            out.desired.egress_ips_v6.insert(egress_ip, held);
                        }
                    }
                    out.desired.egress_interfaces.insert(g.interface.clone());
                }
            }
        }
    }
    out.holders.sort();

    // ---- Source side -------------------------------------------------------------------
    // Claims over every pod of the cluster (so that conflicts, and thus statuses, are the
    // same on every node); entries only for this node's pods.
    // Accepted policies claim first (in name order), so that a broken policy never takes
    // a (pod, prefix) from a working one; among accepted ones the smaller name wins.
    let mut claims: HashMap<(IpAddr, IpNet), (usize, usize)> = HashMap::new();
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by_key(|i| {
        let accepted = reports
            .get(&plans[*i].0)
            .is_some_and(|r| r.invalid.is_empty());
        (!accepted, *i)
    });
    for p_idx in order {
        let (name, selectors, failure_policy, rules) = &plans[p_idx];
        let Some((ns_sel, pod_sel)) = selectors else {
            continue;
        };
        let selected: Vec<&PodInfo<'_>> = pods
            .iter()
            .filter(|pod| {
                let empty = BTreeMap::new();
                let ns_labels = namespace_labels.get(pod.namespace).unwrap_or(&empty);
                let matches_ns = if ns_labels.is_empty() {
                    let mut implicit = BTreeMap::new();
                    implicit.insert(
                        "kubernetes.io/metadata.name".to_owned(),
                        pod.namespace.to_owned(),
                    );
                    ns_sel.matches(&implicit)
                } else {
                    ns_sel.matches(ns_labels)
                };
                matches_ns && pod_sel.matches(pod.labels)
            })
            .collect();
        let mut report_conflicts = Vec::new();
        for plan in rules {
            // Excepts first: within a rule, an except equal to a destination wins.
            let prefixes = plan
                .except
                .iter()
                .map(|p| (*p, true))
                .chain(plan.destinations.iter().map(|p| (*p, false)));
            let prefixes: Vec<(IpNet, bool)> = prefixes.collect();
            for pod in &selected {
                let local = pod.node == node_name;
                for ip in &pod.ips {
                    // A prefix applies to the pod's address of its own family.
                    let same_family = prefixes
                        .iter()
                        .filter(|(p, _)| p.addr().is_ipv6() == ip.is_ipv6());
                    for (prefix, is_except) in same_family {
                        match claims.get(&(*ip, *prefix)) {
                            Some(&(w_policy, w_rule)) => {
                                if w_policy == p_idx && w_rule == plan.index {
                                    continue; // the rule's own except
                                }
                                let winner = if w_policy == p_idx {
                                    format!("rules[{w_rule}] of this policy")
                                } else {
                                    format!("policy {}", plans[w_policy].0)
                                };
                                report_conflicts.push(format!(
                                    "rules[{}]: pod {}/{} destination {prefix} is claimed by \
                                     {winner}",
                                    plan.index, pod.namespace, pod.name
                                ));
                                continue;
                            }
                            None => {
                                claims.insert((*ip, *prefix), (p_idx, plan.index));
                            }
                        }
                        if !local {
                            continue;
                        }
                        let entry = if *is_except {
                            Entry {
                                action: PolicyAction::Exclude,
                                gateway: None,
                                egress_ip: None,
                                rule_id: plan.rule_id,
                            }
                        } else {
                            entry_for(plan, *ip, *failure_policy)
                        };
                        entry.insert(&mut out.desired, *ip, *prefix);
                    }
                }
            }
        }
        if let Some(report) = reports.get_mut(name) {
            report.conflict_count = report_conflicts.len();
            report_conflicts.truncate(MAX_CONFLICTS_NAMED);
            report.conflicts = report_conflicts;
        }
    }

    // ---- Statuses ----------------------------------------------------------------------
    for policy in &policies {
        let name = policy.metadata.name.clone().unwrap_or_default();
        let report = reports.remove(&name).unwrap_or_default();
        let object = Object::Policy(name.clone());
        let mut conditions = Vec::new();
        let joined = |items: &[(String, String)]| {
            items
                .iter()
                .map(|(_, m)| m.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        };
        for (reason, message) in report.invalid.iter().chain(&report.unready) {
            problems.push(Problem {
                object: object.clone(),
                reason: reason.clone(),
                message: message.clone(),
            });
        }
        match report.invalid.first() {
            None => conditions.push(condition(
                condition::ACCEPTED,
                true,
                reason::ACCEPTED,
                "the policy is valid".to_owned(),
            )),
            Some((reason, _)) => {
                conditions.push(condition(
                    condition::ACCEPTED,
                    false,
                    reason,
                    joined(&report.invalid),
                ));
            }
        }
        let ready = if !report.invalid.is_empty() {
            condition(
                condition::READY,
                false,
                reason::NOT_ACCEPTED,
                "the policy is not accepted: invalid rules have no gateway and follow the \
                 failure policy"
                    .to_owned(),
            )
        } else if let Some((reason, _)) = report.unready.first() {
            condition(condition::READY, false, reason, joined(&report.unready))
        } else {
            condition(
                condition::READY,
                true,
                reason::READY,
                format!("every rule ({}) has a gateway", policy.spec.rules.len()),
            )
        };
        conditions.push(ready);
        if report.conflict_count > 0 {
            let mut message = report.conflicts.join("; ");
            let more = report.conflict_count.saturating_sub(report.conflicts.len());
            if more > 0 {
                message.push_str(&format!(" (and {more} more)"));
            }
            problems.push(Problem {
                object: object.clone(),
                reason: reason::DESTINATION_CLAIMED.to_owned(),
                message: message.clone(),
            });
            conditions.push(condition(
                condition::CONFLICT,
                true,
                reason::DESTINATION_CLAIMED,
                message,
            ));
        }
        out.statuses.insert(
            name.clone(),
            PolicyStatus {
                observed_generation: policy.metadata.generation,
                conditions,
                egress_ips: statuses_ips
                    .remove(&name)
                    .unwrap_or_default()
                    .into_iter()
                    .collect(),
            },
        );
    }
    problems.sort();
    problems.dedup();
    out.problems = problems;
    out
}

fn condition(type_: &str, ok: bool, reason: &str, message: String) -> PolicyCondition {
    PolicyCondition {
        type_: type_.to_owned(),
        status: if ok { "True" } else { "False" }.to_owned(),
        reason: reason.to_owned(),
        message,
        last_transition_time: None,
    }
}

/// A policy entry of either family, before it goes to `policy_v4` or `policy_v6`.
struct Entry {
    action: PolicyAction,
    gateway: Option<IpAddr>,
    egress_ip: Option<IpAddr>,
    rule_id: u32,
}

impl Entry {
    /// Store the entry for (pod, prefix) in the maps of their family (the caller pairs
    /// pod addresses and prefixes of one family; a stray pair is left out).
    fn insert(self, desired: &mut Desired, pod: IpAddr, prefix: IpNet) {
        match (pod, prefix) {
            (IpAddr::V4(pod), IpNet::V4(prefix)) => {
                desired.policy_v4.insert(
                    (pod, prefix),
                    PolicyEntryV4 {
                        action: self.action,
                        gateway: self.gateway,
                        egress_ip: match self.egress_ip {
                            Some(IpAddr::V4(ip)) => Some(ip),
                            _ => None,
                        },
                        rule_id: self.rule_id,
                    },
                );
                *desired.selected_v4.entry(pod).or_insert(0) += 1;
            }
            (IpAddr::V6(pod), IpNet::V6(prefix)) => {
                desired.policy_v6.insert(
                    (pod, prefix),
                    PolicyEntryV6 {
                        action: self.action,
                        gateway: self.gateway,
                        egress_ip: match self.egress_ip {
                            Some(IpAddr::V6(ip)) => Some(ip),
                            _ => None,
                        },
                        rule_id: self.rule_id,
                    },
                );
                *desired.selected_v6.entry(pod).or_insert(0) += 1;
            }
            _ => {}
        }
    }
}

/// Address bytes as hashed by rendezvous (4 for IPv4, 16 for IPv6).
fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(ip) => ip.octets().to_vec(),
        IpAddr::V6(ip) => ip.octets().to_vec(),
    }
}

/// The entry for destination traffic of pod `ip` under `plan`.
fn entry_for(plan: &RulePlan, ip: IpAddr, failure_policy: FailurePolicy) -> Entry {
    let gateway = match &plan.target {
        Target::Dedicated {
            holder: Some(h), ..
        } => Some(h),
        Target::Interface { gateways } => {
            let rule_id = plan.rule_id.to_be_bytes();
            let octets = ip_bytes(ip);
            hash::rendezvous(&[&octets, &rule_id], gateways.keys().map(String::as_str))
                .and_then(|node| gateways.get(node))
        }
        _ => None,
    };
    match gateway {
        Some(g) => Entry {
            action: PolicyAction::Forward,
            gateway: Some(g.underlay),
            egress_ip: Some(g.ip),
            rule_id: plan.rule_id,
        },
        None => Entry {
            action: match failure_policy {
                FailurePolicy::Drop => PolicyAction::NoGatewayDrop,
                FailurePolicy::Fallthrough => PolicyAction::NoGatewayPass,
            },
            gateway: None,
            egress_ip: match &plan.target {
                Target::Dedicated { ip, .. } => Some(*ip),
                _ => None,
            },
            rule_id: plan.rule_id,
        },
    }
}

/// The holder of dedicated egress IP `ip` among `hosts` (all eligible; `selected`: the
/// nodes the policy's gatewaySelector matches; `heard`: the newest claim heard in a
/// hello, perhaps released since). Sticky: a host holding the newest claim keeps it (a
/// holder back from the dead has an older one). Otherwise a host that claims it anyway
/// (the largest epoch first), else the rendezvous winner, takes it with the newest epoch
/// + 1, and the reason says why the last claimant lost it.
fn choose_holder(
    ip: IpAddr,
    hosts: &[GatewayAddr],
    nodes: &[NodeInfo<'_>],
    selected: &BTreeSet<&str>,
    heard: Option<&(String, u64)>,
) -> Option<GatewayAddr> {
    let octets = ip_bytes(ip);
    let node_info = |name: &str| nodes.iter().find(|n| n.name == name);
    let claim =
        |name: &str| node_info(name).and_then(|n| n.egress.as_ref()?.held.get(&ip).copied());
    // The last claimant, wherever it is: the newest claim published, or heard.
    let published = nodes
        .iter()
        .filter_map(|n| Some((n.egress.as_ref()?.held.get(&ip).copied()?, n)))
        .max_by(|(a, na), (b, nb)| a.cmp(b).then(nb.name.cmp(na.name)));
    let heard = heard.and_then(|(name, e)| Some((*e, node_info(name)?)));
    let last = match (published, heard) {
        (Some(p), Some(h)) if h.0 > p.0 => Some(h),
        (p @ Some(_), _) => p,
        (None, h) => h,
    };
    let newest = last.map(|(e, _)| e);
    let claimants: Vec<(&GatewayAddr, u64)> = hosts
        .iter()
        .filter_map(|h| Some((h, claim(&h.node)?)))
        .collect();
    let pool: Vec<&GatewayAddr> = match claimants.iter().map(|(_, e)| *e).max() {
        Some(top) => claimants
            .iter()
            .filter(|(_, e)| *e == top)
            .map(|(h, _)| *h)
            .collect(),
        None => hosts.iter().collect(),
    };
    let node = hash::rendezvous(&[&octets], pool.iter().map(|h| h.node.as_str()))?;
    let mut g = pool.into_iter().find(|h| h.node == node)?.clone();
    let kept = claim(node);
    if kept.is_some() && kept == newest {
        // Sticky: it holds the newest claim.
        g.epoch = kept.unwrap_or_default();
        let published =
            node_info(node).and_then(|n| n.egress.as_ref()?.held_meta.get(&ip).cloned());
        if let Some((epoch, since, why)) = published
            && Some(epoch) == kept
        {
            g.since = since;
            g.reason = why
                .as_deref()
                .and_then(move_reason::parse)
                .unwrap_or(move_reason::ASSIGNED);
        }
        return Some(g);
    }
    g.epoch = newest.map_or(1, |e| e + 1);
    g.reason = match last {
        None => move_reason::ASSIGNED,
        Some((_, n)) if n.dead => move_reason::HOLDER_UNREACHABLE,
        Some((_, n)) if !n.ready => move_reason::HOLDER_NOT_READY,
        Some((_, n)) if n.drained => move_reason::HOLDER_DRAINED,
        Some((_, n)) if !selected.contains(n.name) => move_reason::HOLDER_NOT_SELECTED,
        Some((_, n))
            if n.egress
                .as_ref()
                .is_none_or(|e| e.hosting_interface(ip).is_none()) =>
        {
            move_reason::HOLDER_INTERFACE_DOWN
        }
        Some(_) => move_reason::REASSIGNED,
    };
    Some(g)
}

/// A rule after static checks.
struct CheckedRule {
    /// Every check passed.
    valid: bool,
    /// The rule is IPv6 (its destinations, or its egress IP when destinations are absent).
    v6: bool,
    /// Parsed destinations/excepts (both families only in an invalid rule).
    destinations: Vec<IpNet>,
    except: Vec<IpNet>,
    egress_ip: Option<IpAddr>,
}

/// Parse a prefix that must have no host bits.
fn parse_prefix(text: &str, field: &str) -> Result<IpNet, (&'static str, String)> {
    let net: IpNet = text.parse().map_err(|_| {
        (
            reason::INVALID_CIDR,
            format!("{field}: invalid CIDR {text:?} (expected e.g. 192.0.2.0/24)"),
        )
    })?;
    if net.trunc() != net {
        return Err((
            reason::INVALID_CIDR,
            format!(
                "{field}: {text} has host bits set (did you mean {}?)",
                net.trunc()
            ),
        ));
    }
    Ok(net)
}

/// Static checks of one rule (what CEL checks in a cluster; a YAML directory has none).
/// Returns `None` when nothing usable is left (no destination parsed).
fn check_rule(index: usize, rule: &EgressRule, report: &mut PolicyReport) -> Option<CheckedRule> {
    let at = format!("rules[{index}]");
    let before = report.invalid.len();
    let mut fail = |reason: &str, message: String| {
        report.invalid.push((reason.to_owned(), message));
    };
    if rule.destinations.is_empty() {
        fail(
            reason::NO_DESTINATIONS,
            format!("{at}.destinations: at least one destination is required"),
        );
    }
    let mut destinations = Vec::new();
    for (i, text) in rule.destinations.iter().enumerate() {
        match parse_prefix(text, &format!("{at}.destinations[{i}]")) {
            Ok(net) => destinations.push(net),
            Err((reason, message)) => fail(reason, message),
        }
    }
    let mut except = Vec::new();
    for (i, text) in rule.except.iter().enumerate() {
        let field = format!("{at}.except[{i}]");
        match parse_prefix(text, &field) {
            Ok(net) if destinations.iter().any(|d| d.contains(&net)) => except.push(net),
            Ok(net) => fail(
                reason::EXCEPT_OUTSIDE_DESTINATIONS,
                format!("{field}: {net} is not inside any of the destinations"),
            ),
            Err((reason, message)) => fail(reason, message),
        }
    }
    let mut egress_ip: Option<IpAddr> = None;
    match (&rule.egress_ip, &rule.interface) {
        (Some(_), Some(_)) | (None, None) => fail(
            reason::INVALID_TARGET,
            format!("{at}: exactly one of egressIP or interface must be set"),
        ),
        (Some(text), None) => match text.parse::<IpAddr>() {
            Ok(ip) => egress_ip = Some(ip),
            Err(_) => fail(
                reason::INVALID_IP,
                format!("{at}.egressIP: invalid IP address {text:?}"),
            ),
        },
        (None, Some(name)) => {
            if name.is_empty()
                || name.len() > 15
                || name.contains(['/', ':'])
                || name.contains(char::is_whitespace)
            {
                fail(
                    reason::INVALID_INTERFACE,
                    format!("{at}.interface: {name:?} is not a valid interface name"),
                );
            }
        }
    }
    // Families.
    let v6_dest = destinations
        .iter()
        .filter(|d| matches!(d, IpNet::V6(_)))
        .count();
    let mixed = v6_dest != 0 && v6_dest != destinations.len();
    if mixed {
        fail(
            reason::FAMILY_MISMATCH,
            format!("{at}.destinations: mixes IPv4 and IPv6 prefixes"),
        );
    }
    let v6 = if destinations.is_empty() {
        matches!(egress_ip, Some(IpAddr::V6(_)))
    } else {
        v6_dest == destinations.len()
    };
    if let Some(ip) = egress_ip
        && !mixed
        && !destinations.is_empty()
        && ip.is_ipv6() != v6
    {
        fail(
            reason::FAMILY_MISMATCH,
            format!(
                "{at}.egressIP: {ip} is {} but the destinations are {}",
                family_name(ip.is_ipv6()),
                family_name(v6)
            ),
        );
    }
    let valid = report.invalid.len() == before;
    if destinations.is_empty() {
        return None;
    }
    Some(CheckedRule {
        valid,
        // A mixed rule is invalid: both families follow the failure policy.
        v6: v6 && !mixed,
        destinations,
        except,
        egress_ip,
    })
}
