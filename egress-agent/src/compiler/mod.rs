//! The policy compiler: a pure function from the cluster view and this node's name to the
//! desired datapath state of this node, the status of every policy and the holder of every
//! egress address.
//!
//! No I/O and no clocks; everything is sorted, so the same view gives the same result on
//! every node. Policy statuses, holders and problems do not depend on the node name: every
//! agent (and `egress-agent check`) derives the same ones.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use self::plans::PolicyPlan;
use crate::{
    api::{EgressGatewayPolicy, PolicyStatus},
    desired::Desired,
    liveness::{Membership, PeerView},
    source::{ClusterView, PodScope},
};

mod coverage;
mod gateway_side;
mod hash;
mod members;
pub mod netpol;
mod nodes;
mod placement;
mod plans;
mod pods;
pub mod render;
mod routes;
mod rules;
mod selector;
mod source_side;
mod spread;
mod status;
#[cfg(test)]
mod tests;

pub use hash::{fnv1a64, rule_ids};
pub use members::pods_needed;
pub use nodes::{gateway_candidates, held_egress_ips, node_drained, node_ready, node_underlay};
pub use pods::{Selection, selection};
pub use selector::Selector;
pub use spread::PodRoute;

/// Condition types.
pub mod condition {
    pub const ACCEPTED: &str = "Accepted";
    pub const READY: &str = "Ready";
    pub const CONFLICT: &str = "Conflict";
    /// Some destinations learned from routes are left out or differ between gateways.
    pub const ROUTES_DEGRADED: &str = "RoutesDegraded";
    /// Some listed destinations cover the cluster's own addresses, which are carved out.
    pub const CLUSTER_EXCLUDED: &str = "ClusterExcluded";
    /// AdminNetworkPolicies, BaselineAdminNetworkPolicies or EgressFirewalls exist that
    /// may cover the pods this policy redirects: they do not hold for that traffic.
    pub const ADMIN_POLICIES_NOT_APPLIED: &str = "AdminPoliciesNotApplied";
    /// Several addresses of one rule's `egressIPs` share a gateway: fewer eligible
    /// gateways host them than the rule has addresses.
    pub const EGRESS_IPS_SHARE_GATEWAY: &str = "EgressIPsShareGateway";

    /// Every type the compiler emits (the CRD's description of `type` names them all).
    pub const ALL: [&str; 7] = [
        ACCEPTED,
        READY,
        CONFLICT,
        ROUTES_DEGRADED,
        CLUSTER_EXCLUDED,
        ADMIN_POLICIES_NOT_APPLIED,
        EGRESS_IPS_SHARE_GATEWAY,
    ];
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
    pub const INVALID_DESTINATIONS: &str = "InvalidDestinations";
    pub const EXCEPT_OUTSIDE_DESTINATIONS: &str = "ExceptOutsideDestinations";
    pub const FAMILY_MISMATCH: &str = "FamilyMismatch";
    pub const NO_RULES: &str = "NoRules";
    // Ready=False: the spec is fine, the cluster cannot serve (all of) it.
    pub const NOT_ACCEPTED: &str = "NotAccepted";
    /// The spec is not accepted; its last accepted version is served meanwhile.
    pub const SERVING_LAST_ACCEPTED: &str = "ServingLastAccepted";
    pub const NO_MATCHING_GATEWAY: &str = "NoMatchingGateway";
    pub const NO_ELIGIBLE_GATEWAY: &str = "NoEligibleGateway";
    pub const EGRESS_IP_NOT_HOSTABLE: &str = "EgressIPNotHostable";
    pub const EGRESS_IP_IS_NODE_ADDRESS: &str = "EgressIPIsNodeAddress";
    pub const EGRESS_IP_IN_USE: &str = "EgressIPInUse";
    /// An egress IP that two policies name: it belongs to the older one (`Conflict=True`
    /// on both; the other's rules get no gateway).
    pub const EGRESS_IP_CONFLICT: &str = "EgressIPConflict";
    /// A pod address that two pods list, or a pod and a node: nobody's (`Conflict=True` on
    /// every policy selecting a claimant).
    pub const POD_ADDRESS_CONFLICT: &str = "PodAddressConflict";
    /// A selected pod's destination of this policy that another policy's longer prefix
    /// takes for that pod (`Conflict=True` on both).
    pub const DESTINATION_OVERRIDDEN: &str = "DestinationOverridden";
    /// An egress IP that another implementation's object claims too (an OVN-Kubernetes
    /// `EgressIP`): `Conflict=True`, and this policy leaves the address alone.
    pub const EGRESS_IP_CLAIMED_ELSEWHERE: &str = "EgressIPClaimedElsewhere";
    pub const INTERFACE_NOT_FOUND: &str = "InterfaceNotFound";
    pub const NO_ROUTES: &str = "NoRoutes";
    /// A node's policy map cannot hold the entries of every selected pod there: the pods
    /// left out (some selected by this policy) have their covered traffic dropped.
    pub const POLICY_MAP_FULL: &str = "PolicyMapFull";
    // Conflict=True
    pub const DESTINATION_CLAIMED: &str = "DestinationClaimed";
    // RoutesDegraded=True
    pub const ROUTES_DISAGREE: &str = "RoutesDisagree";
    pub const ROUTES_OVERLAP_CLUSTER: &str = "RoutesOverlapCluster";
    pub const ROUTES_TRUNCATED: &str = "RoutesTruncated";
    // ClusterExcluded=True
    pub const DESTINATIONS_COVER_CLUSTER: &str = "DestinationsCoverCluster";
    // AdminPoliciesNotApplied=True
    pub const NOT_APPLIED_TO_REDIRECTED_TRAFFIC: &str = "NotAppliedToRedirectedTraffic";
    // EgressIPsShareGateway=True
    pub const FEWER_GATEWAYS_THAN_EGRESS_IPS: &str = "FewerGatewaysThanEgressIPs";
    // Problems about other objects.
    pub const NO_UNDERLAY_ADDRESS: &str = "NoUnderlayAddress";
    pub const UNDERLAY_FAMILY_MISMATCH: &str = "UnderlayFamilyMismatch";
    /// Pods of a node have addresses outside the declared cluster CIDRs and the nodes'
    /// pod CIDRs.
    pub const POD_OUTSIDE_CLUSTER_CIDRS: &str = "PodOutsideClusterCIDRs";
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
    /// The previous holder holds another address of the rule's `egressIPs`, and an
    /// eligible gateway that holds none can host this one.
    pub const REBALANCED: &str = "Rebalanced";

    pub const ALL: [&str; 8] = [
        ASSIGNED,
        HOLDER_UNREACHABLE,
        HOLDER_NOT_READY,
        HOLDER_DRAINED,
        HOLDER_INTERFACE_DOWN,
        HOLDER_NOT_SELECTED,
        REASSIGNED,
        REBALANCED,
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
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Compiled {
    /// This node's datapath state.
    pub desired: Desired,
    /// Status of every policy, by name (the same on every node).
    pub statuses: BTreeMap<String, PolicyStatus>,
    /// Who uses which egress address for which policy (the same on every node), sorted.
    pub holders: Vec<Holder>,
    /// Everything a user should fix or know, sorted (the same on every node).
    pub problems: Vec<Problem>,
    /// The accepted version of each policy, by name: its own spec when accepted, else
    /// the last accepted one it is served from. The agent passes it back as
    /// `last_accepted` to its next compile.
    pub accepted: BTreeMap<String, EgressGatewayPolicy>,
    /// Whom this node probes and counts for its quorum.
    pub membership: Membership,
    /// Every egress IP any policy names (accepted or not): the only addresses an agent
    /// may remove, besides those it holds or published.
    pub policy_egress_ips: BTreeSet<IpAddr>,
    /// The node whose agent writes policy statuses and Events (the same on every node
    /// that hears the same peers).
    pub status_writer: Option<String>,
    /// The address each of this node's selected pods leaves with, per rule, sorted.
    pub pod_routes: Vec<PodRoute>,
    /// The pods this node needs ([`members::needed`]): every pod of the cluster on a
    /// gateway, on the status writer, and where the cluster's CIDRs are not declared;
    /// else its own. A view of its own pods gives it the same `desired` and `pod_routes`
    /// as a view of every pod.
    pub pods_needed: PodScope,
    /// The pods the compiled view held (`ClusterView::pod_scope`): statuses, holders'
    /// pod counts and problems about pods are cluster-wide only from `Cluster`.
    pub pod_scope: PodScope,
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
    /// The selected pods (cluster-wide) that leave by it.
    pub pods: u32,
}

/// The object a [`Problem`] is about.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Object {
    Policy(String),
    Node(String),
    /// A `networking.k8s.io/v1` NetworkPolicy, `namespace/name`.
    NetworkPolicy(String),
}

impl fmt::Display for Object {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Policy(name) => write!(f, "policy {name}"),
            Self::Node(name) => write!(f, "node {name}"),
            Self::NetworkPolicy(name) => write!(f, "networkpolicy {name}"),
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

/// The pods each plan selects (none for a plan without valid selectors), by plan: once
/// per compile, for every stage that needs them.
fn selected_by<'p, 'a>(
    pods: &'p pods::Pods<'a>,
    plans: &[PolicyPlan<'_>],
) -> Vec<Vec<&'p pods::PodInfo<'a>>> {
    plans
        .iter()
        .map(|p| match &p.selectors {
            Some((ns_sel, pod_sel)) => pods.selected(ns_sel, pod_sel),
            None => Vec::new(),
        })
        .collect()
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
    compile_remembering(view, peers, &BTreeMap::new(), node_name)
}

/// [`compile_with`], remembering the policies' last accepted versions (`last_accepted`,
/// by name: [`Compiled::accepted`] of the previous compile): a policy whose spec turns
/// invalid keeps being served from its last accepted version (`Accepted=False`,
/// `Ready=False` with [`reason::SERVING_LAST_ACCEPTED`]) until it is fixed or deleted.
pub fn compile_remembering(
    view: &ClusterView,
    peers: &PeerView,
    last_accepted: &BTreeMap<String, EgressGatewayPolicy>,
    node_name: &str,
) -> Compiled {
    let mut desired = Desired::default();
    let held = nodes::held_egress_ips(view, peers);
    let nodes = nodes::index(view, peers, &held);
    let mut problems = nodes::register(&nodes, node_name, &mut desired);
    let pods = pods::Pods::index(view, &held);
    let reserved = routes::Reserved::new(view, &nodes, &pods);
    let policies = sorted_policies(view);
    let foreign = nodes::claimed_elsewhere(view);
    let mut plans = placement::plan(&policies, last_accepted, &nodes, peers, &reserved, &foreign);
    let gateway = is_gateway(view, &plans, &nodes, node_name);
    pods.record_owners(&nodes, (!gateway).then_some(node_name), &mut desired);
    report_outside_cidrs(view, &nodes, &pods, &mut problems);
    let selected = selected_by(&pods, &plans);
    report_disputed(&mut plans, &pods, &selected);
    report_unapplied(&mut plans, &selected, &view.unapplied);
    report_full_maps(&mut plans, view);
    let (counts, pod_routes) = spread::spread(&plans, &selected, node_name);
    let (holders, egress_ips) = gateway_side::serve(&plans, &counts, node_name, &mut desired);
    source_side::claim(&mut plans, &selected, node_name, &mut desired);
    coverage::cover(&plans, &pods, node_name, &mut desired);
    netpol::restrict(view, &pods, node_name, &mut desired, &mut problems);
    let reported = plans.iter().map(PolicyPlan::reported);
    let statuses = status::statuses(reported, egress_ips, &mut problems);
    problems.sort();
    problems.dedup();
    let accepted = plans
        .iter()
        .filter_map(|p| Some((p.name.clone(), p.accepted?.clone())))
        .collect();
    Compiled {
        desired,
        statuses,
        holders,
        problems,
        accepted,
        membership: members::membership(view, node_name, &held),
        policy_egress_ips: members::policy_egress_ips(view),
        status_writer: members::status_writer(view, &peers.dead),
        pod_routes,
        pods_needed: members::needed(view, gateway, node_name, &peers.dead),
        pod_scope: view.pod_scope,
    }
}

/// Whether some policy's gatewaySelector selects the node named `me`: as the view has
/// it (the gateways every agent probes), or as the accepted version a plan is served
/// from has it (an edit that is not accepted keeps the old gateways serving).
fn is_gateway(
    view: &ClusterView,
    plans: &[PolicyPlan<'_>],
    nodes: &[nodes::NodeInfo<'_>],
    me: &str,
) -> bool {
    if gateway_candidates(view).contains(me) {
        return true;
    }
    let Some(me) = nodes.iter().find(|n| n.name == me) else {
        return false;
    };
    plans
        .iter()
        .filter_map(|p| p.accepted)
        .filter_map(|a| Selector::gateways(&a.spec.gateway_selector).ok())
        .any(|s| s.matches(&me.labels))
}

/// Pods whose addresses no declared cluster CIDR and no node's pod CIDR holds, one
/// problem per node: a worker that watches only its own node's pods
/// ([`members::needed`]) does not carve them out of the destinations, as a view of every
/// pod does. Only a view of every pod sees them, and only declared CIDRs make workers
/// watch less.
fn report_outside_cidrs(
    view: &ClusterView,
    nodes: &[nodes::NodeInfo<'_>],
    pods: &pods::Pods<'_>,
    problems: &mut Vec<Problem>,
) {
    if view.pod_scope != PodScope::Cluster || view.cluster_cidrs.is_empty() {
        return;
    }
    let cidrs: Vec<ipnet::IpNet> = view
        .cluster_cidrs
        .iter()
        .chain(nodes.iter().flat_map(|n| &n.pod_cidrs))
        .map(ipnet::IpNet::trunc)
        .collect();
    let declared: Vec<String> = view.cluster_cidrs.iter().map(ToString::to_string).collect();
    for outside in pods.outside(&cidrs) {
        problems.push(Problem {
            object: Object::Node(outside.node.to_owned()),
            reason: reason::POD_OUTSIDE_CLUSTER_CIDRS.to_owned(),
            message: format!(
                "{} pods of this node have addresses outside the cluster's CIDRs ({}) and \
                 every node's pod CIDRs, such as pod {} at {}: the agents that watch only \
                 their own node's pods do not carve these addresses out of the policies' \
                 destinations, so their pods' traffic to them may be steered to a gateway; \
                 add the range to --cluster-cidr",
                outside.pods,
                declared.join(", "),
                outside.example,
                outside.ip
            ),
        });
    }
}

/// A pod address claimed twice is a conflict on every policy that selects a claimant.
fn report_disputed(
    plans: &mut [PolicyPlan<'_>],
    pods: &pods::Pods<'_>,
    selected_by: &[Vec<&pods::PodInfo<'_>>],
) {
    if pods.disputed.is_empty() {
        return;
    }
    for (plan, selected) in plans.iter_mut().zip(selected_by) {
        if plan.selectors.is_none() {
            continue;
        }
        let selected: std::collections::BTreeSet<String> = selected
            .iter()
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect();
        for d in &pods.disputed {
            if d.pods.iter().any(|p| selected.contains(p)) {
                plan.report.address_conflict(d.message());
            }
        }
    }
}

/// A node's policy map that its agent could not fit (its EgressNode says so, naming the
/// policies that select the pods left out) makes those policies `Ready=False`. Only
/// nodes with a Node object count: a stale EgressNode of a deleted node does not.
fn report_full_maps(plans: &mut [PolicyPlan<'_>], view: &ClusterView) {
    let nodes: BTreeSet<&str> = view
        .nodes
        .iter()
        .filter_map(|n| n.metadata.name.as_deref())
        .collect();
    let mut full: Vec<(&str, &crate::api::FullPolicyMap)> = view
        .egress_nodes
        .iter()
        .filter_map(|e| Some((e.metadata.name.as_deref()?, e.status.as_ref()?)))
        .filter(|(name, _)| nodes.contains(name))
        .flat_map(|(name, st)| st.full_policy_maps.iter().map(move |m| (name, m)))
        .collect();
    full.sort_by(|a, b| (a.0, &a.1.map).cmp(&(b.0, &b.1.map)));
    for plan in plans {
        for (node, map) in full.iter().filter(|(_, m)| m.policies.contains(&plan.name)) {
            plan.report.unready(
                reason::POLICY_MAP_FULL,
                format!(
                    "node {node}: map {} is full at {} entries: the entries of {} selected \
                     pods there (some selected by this policy) are left out and their traffic \
                     to the destinations a rule covers is dropped (DROP_POLICY_MAP_FULL); \
                     raise --policy-map-entries on the agents, or select fewer pods or \
                     prefixes",
                    map.map, map.capacity, map.pods_left_out
                ),
            );
        }
    }
}

/// Objects named in an `AdminPoliciesNotApplied` message; the rest are counted.
const UNAPPLIED_NAMED: usize = 3;

/// Every policy that selects pods an AdminNetworkPolicy or BaselineAdminNetworkPolicy
/// (cluster-wide) or an EgressFirewall (of a selected pod's namespace) may cover says that
/// they do not hold for the traffic it redirects.
fn report_unapplied(
    plans: &mut [PolicyPlan<'_>],
    selected_by: &[Vec<&pods::PodInfo<'_>>],
    unapplied: &[crate::source::Unapplied],
) {
    if unapplied.is_empty() {
        return;
    }
    let mut sorted: Vec<&crate::source::Unapplied> = unapplied.iter().collect();
    sorted.sort();
    for (plan, selected) in plans.iter_mut().zip(selected_by) {
        if plan.selectors.is_none() {
            continue;
        }
        let namespaces: std::collections::BTreeSet<&str> =
            selected.iter().map(|p| p.namespace).collect();
        if namespaces.is_empty() {
            continue;
        }
        let applies: Vec<String> = sorted
            .iter()
            .filter(|u| {
                u.namespace
                    .as_deref()
                    .is_none_or(|ns| namespaces.contains(ns))
            })
            .map(|u| u.to_string())
            .collect();
        if applies.is_empty() {
            continue;
        }
        let mut named: Vec<String> = applies.iter().take(UNAPPLIED_NAMED).cloned().collect();
        if applies.len() > UNAPPLIED_NAMED {
            named.push(format!("and {} more", applies.len() - UNAPPLIED_NAMED));
        }
        plan.report.unapplied(format!(
            "{} may cover pods this policy redirects: the datapath takes their traffic \
             before the CNI applies these kinds, and does not apply them itself (egress \
             NetworkPolicies it does apply; docs/networkpolicy.md)",
            named.join(", ")
        ));
    }
}

/// The policies with a name, sorted and deduplicated by name.
fn sorted_policies(view: &ClusterView) -> Vec<&EgressGatewayPolicy> {
    let mut policies: Vec<&EgressGatewayPolicy> = view
        .policies
        .iter()
        .filter(|p| p.metadata.name.is_some())
        .collect();
    policies.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    policies.dedup_by(|a, b| a.metadata.name == b.metadata.name);
    policies
}
