//! What the compiler derives: this node's datapath state and the cluster's statuses,
//! holders and problems ([`Compiled`]), and the objects its problems are about.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use super::spread::PodRoute;
use crate::{
    api::{EgressGatewayPolicy, PolicyStatus},
    desired::Desired,
    liveness::Membership,
    source::PodScope,
};

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
    /// The pods this node needs ([`super::members::needed`]): every pod of the cluster on a
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
    /// Why it is held there (see [`super::move_reason`]).
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
    /// The condition reason (see [`super::reason`]).
    pub reason: String,
    /// Starts with the field path: `rules[0].egressIP: ...`.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.message)
    }
}
