//! EgressGatewayPolicy and EgressNode custom resources (group `egress.dev`, version
//! `v1alpha1`, both cluster-scoped).
//!
//! Addresses and prefixes are strings on the wire, as users write them: the schema and its
//! CEL rules reject what can be rejected statically, and the compiler turns anything that
//! still slips through (a YAML directory has no API server to validate it) into a condition.

use std::net::IpAddr;

use k8s_openapi::{
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    apimachinery::pkg::apis::meta::v1::LabelSelector,
};
use kube::{CustomResource, CustomResourceExt as _};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// API group of both resources.
pub const GROUP: &str = "egress.dev";
/// API version of both resources.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` of both resources.
pub const API_VERSION: &str = "egress.dev/v1alpha1";

/// Longest textual IPv6 prefix ("ffff:...:ffff/128" is 43 characters), with room to spare.
/// Bounds the CEL cost estimate.
const MAX_ADDRESS_LEN: u64 = 49;
/// Bounds on list lengths, also for the CEL cost estimate (the `length(max = ..)`
/// attributes below use the same numbers).
const MAX_PREFIXES: u64 = 64;
const MAX_ADDRESSES: u64 = 64;

/// Why the CRD's rule refuses an empty `gatewaySelector`, and what to write instead (the
/// compiler's condition says the same of `spec.gatewaySelector`).
pub const GATEWAY_SELECTOR_EMPTY: &str = "gatewaySelector must not be empty (it would make \
    every node a gateway): select the gateway nodes by label, such as \
    matchLabels: {egress.dev/gateway: \"true\"}";

/// Routes the traffic of selected pods to selected destinations through gateway nodes,
/// with a source address chosen per destination.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[expect(
    clippy::duplicated_attributes,
    reason = "kube-derive's printcolumn(...) repeats the same keys for every column"
)]
#[kube(
    group = "egress.dev",
    version = "v1alpha1",
    kind = "EgressGatewayPolicy",
    shortname = "egp",
    status = "PolicyStatus",
    derive = "PartialEq",
    derive = "Default",
    doc = "Sends the traffic of selected pods to selected destinations out of gateway nodes, \
           with an egress address chosen per destination.",
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Egress IPs",
        type_ = "string",
        json_path = ".status.egressIPs[*].ip"
    ),
    printcolumn(
        name = "Holders",
        type_ = "string",
        json_path = ".status.egressIPs[*].node"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EgressGatewayPolicySpec {
    /// Namespaces whose pods the policy applies to. Absent: every namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Pods (in the selected namespaces) the policy applies to. Absent: every pod there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    /// Nodes that may act as gateways for this policy (they must also be Ready and run an
    /// agent that publishes their EgressNode). Must not be empty: an empty selector would
    /// make every node a gateway.
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "(has(self.matchLabels) && size(self.matchLabels) > 0) || (has(self.matchExpressions) && size(self.matchExpressions) > 0)",
        "message": GATEWAY_SELECTOR_EMPTY
    }]))]
    pub gateway_selector: LabelSelector,
    /// What selected traffic to a rule's destinations does when the rule has no usable
    /// gateway: `Drop` (the default) or `Fallthrough` (leave as if unselected).
    #[serde(default)]
    pub failure_policy: FailurePolicy,
    /// Destinations and the egress address to use for them. Longest prefix wins.
    #[schemars(length(min = 1, max = 64))]
    pub rules: Vec<EgressRule>,
}

/// What a selected packet does when its rule has no usable gateway.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum FailurePolicy {
    /// Drop it and count it (fail closed).
    #[default]
    Drop,
    /// Let it continue as if the pod were not selected (fail open).
    Fallthrough,
}

/// One rule: destination prefixes (listed in `destinations`, or learned from the
/// gateways' routing tables with `destinationsFrom: Routes`), the prefixes excepted from
/// them, and one of: a dedicated egress IP (`egressIP`), several spread over the gateways
/// (`egressIPs`), or a gateway interface whose own address is used (`interface`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "(has(self.egressIP) ? 1 : 0) + (has(self.egressIPs) ? 1 : 0) + (has(self.interface) ? 1 : 0) == 1",
        "message": "exactly one of egressIP, egressIPs or interface must be set"
    },
    {
        "rule": "!has(self.egressIPs) || self.egressIPs.all(a, !isIP(a) || self.egressIPs.exists_one(b, isIP(b) && ip(b) == ip(a)))",
        "message": "egressIPs must not list an address twice"
    },
    {
        "rule": "!has(self.egressIPs) || self.egressIPs.all(a, !isIP(a) || !isIP(self.egressIPs[0]) || ip(a).family() == ip(self.egressIPs[0]).family())",
        "message": "egressIPs must all be of one address family"
    },
    {
        "rule": "!has(self.destinations) || !has(self.egressIPs) || !isIP(self.egressIPs[0]) || self.destinations.all(d, !isCIDR(d) || cidr(d).ip().family() == ip(self.egressIPs[0]).family())",
        "message": "destinations must be of the same address family as egressIPs"
    },
    {
        "rule": "has(self.destinations) != has(self.destinationsFrom)",
        "message": "exactly one of destinations or destinationsFrom must be set"
    },
    {
        "rule": "!has(self.includeDefault) || has(self.destinationsFrom)",
        "message": "includeDefault applies only with destinationsFrom"
    },
    {
        "rule": "!has(self.destinations) || !has(self.egressIP) || !isIP(self.egressIP) || self.destinations.all(d, !isCIDR(d) || cidr(d).ip().family() == ip(self.egressIP).family())",
        "message": "destinations must be of the same address family as egressIP"
    },
    {
        "rule": "!has(self.destinations) || self.destinations.all(d, !isCIDR(d) || !isCIDR(self.destinations[0]) || cidr(d).ip().family() == cidr(self.destinations[0]).ip().family())",
        "message": "destinations must all be of one address family"
    },
    {
        "rule": "!has(self.except) || !has(self.destinations) || self.except.all(e, !isCIDR(e) || self.destinations.exists(d, isCIDR(d) && cidr(d).containsCIDR(e)))",
        "message": "every except prefix must lie inside one of the destinations"
    }
]))]
pub struct EgressRule {
    /// Destination prefixes (CIDR, without host bits), all of one address family. Exactly
    /// one of `destinations` and `destinationsFrom` is set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "destination_list_schema")]
    pub destinations: Vec<String>,
    /// `Routes`: the destinations are the prefixes the serving gateway routes out of the
    /// rule's interface (the one holding the egress IP's subnet, or the named one), as
    /// its agent publishes them in its EgressNode; they follow route changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destinations_from: Option<DestinationsFrom>,
    /// With `destinationsFrom`: include default routes (`0.0.0.0/0`, `::/0`) out of the
    /// interface. Off by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_default: Option<bool>,
    /// Prefixes inside `destinations` (or the learned routes) that are left untouched.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "except_list_schema")]
    pub except: Vec<String>,
    /// A dedicated egress address, held by one eligible gateway that has an up interface
    /// whose subnet contains it.
    #[serde(default, rename = "egressIP", skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "optional_ip_schema")]
    pub egress_ip: Option<String>,
    /// Several dedicated egress addresses of one family, each held by a different eligible
    /// gateway where there are enough: each selected pod leaves with one of them, the same
    /// one while it lives (a hash of the pod over the addresses), so a far side can allow
    /// each pod's address and a failure moves only the failed address's pods.
    #[serde(default, rename = "egressIPs", skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "egress_ip_list_schema")]
    pub egress_ips: Vec<String>,
    /// A gateway interface name: each eligible gateway with this interface SNATs to its own
    /// address there, and selected pods are spread over those gateways.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "optional_interface_schema")]
    pub interface: Option<String>,
}

impl EgressRule {
    /// The dedicated egress addresses the rule names (`egressIP` or `egressIPs`) that
    /// parse, in the order written; none for an `interface:` rule.
    pub fn dedicated_ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        let listed = self.interface.is_none().then_some(
            self.egress_ip
                .iter()
                .chain(&self.egress_ips)
                .filter_map(|t| t.parse::<IpAddr>().ok()),
        );
        listed.into_iter().flatten()
    }
}

/// Where a rule's destinations come from, when not listed.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum DestinationsFrom {
    /// The serving gateway's routes out of the rule's interface.
    Routes,
}

/// Status of an EgressGatewayPolicy, as the compiler derives it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStatus {
    /// `metadata.generation` of the spec these conditions describe (each condition says
    /// so too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "generation_schema")]
    pub observed_generation: Option<i64>,
    /// At most one of each type: `Accepted` and `Ready` always; `Conflict`,
    /// `RoutesDegraded`, `ClusterExcluded`, `AdminPoliciesNotApplied` and
    /// `EgressIPsShareGateway` when they hold (see `type`).
    #[serde(default)]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["type"],
        "maxItems" = 16
    ))]
    pub conditions: Vec<PolicyCondition>,
    /// Egress addresses in use for this policy and where.
    #[serde(default, rename = "egressIPs")]
    pub egress_ips: Vec<EgressIpStatus>,
}

/// A condition in the shape of `metav1.Condition`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyCondition {
    /// `Accepted`: the spec is valid (`False`: it is refused, the message names the field
    /// to fix). `Ready`: every rule has a gateway and every selected pod's entries fit
    /// the nodes' policy maps. `Conflict`: another policy or implementation wins some of
    /// this policy's pods, destinations or egress IPs. `RoutesDegraded`: destinations
    /// learned from routes are left out or differ between gateways.
    /// `ClusterExcluded`: listed destinations cover the cluster's own addresses, which
    /// are carved out. `AdminPoliciesNotApplied`: policy kinds the datapath does not
    /// apply may cover the redirected pods. `EgressIPsShareGateway`: fewer gateways host
    /// a rule's `egressIPs` than it lists.
    #[serde(rename = "type")]
    #[schemars(schema_with = "condition_type_schema")]
    pub type_: String,
    pub status: ConditionStatus,
    /// `metadata.generation` of the spec this condition describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "generation_schema")]
    pub observed_generation: Option<i64>,
    /// RFC 3339 time the condition last changed status. The compiler leaves it unset;
    /// the status writer keeps the time of the condition it replaces while the status is
    /// the same, else writes the current time. A status written without it (by an older
    /// agent) still reads.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "transition_time_schema")]
    pub last_transition_time: Option<String>,
    /// A CamelCase word for machines (stable: alerts match on it).
    #[schemars(schema_with = "condition_reason_schema")]
    pub reason: String,
    /// What is wrong, naming the rule and field, and what to do, for humans.
    #[schemars(length(max = 32768))]
    pub message: String,
}

/// The most characters of a condition message (as `metav1.Condition` allows).
pub const MAX_CONDITION_MESSAGE: usize = 32_768;

/// Whether a condition holds.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ConditionStatus {
    True,
    False,
    #[default]
    Unknown,
}

impl ConditionStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::True => "True",
            Self::False => "False",
            Self::Unknown => "Unknown",
        }
    }
}

impl From<bool> for ConditionStatus {
    fn from(holds: bool) -> Self {
        if holds { Self::True } else { Self::False }
    }
}

/// `status == "True"`, as the wire spells it.
impl PartialEq<&str> for ConditionStatus {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl std::fmt::Display for ConditionStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where one egress address of a policy lives.
#[derive(
    Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct EgressIpStatus {
    pub ip: String,
    pub node: String,
    pub interface: String,
    /// RFC 3339 time the holder took the address (as it published it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// Why the address is where it is: `Assigned`, or why the previous holder lost it
    /// (`HolderUnreachable`, `HolderNotReady`, `HolderDrained`, `HolderInterfaceDown`,
    /// `HolderNotSelected`, `Reassigned`, `Rebalanced`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// How many of the policy's selected pods leave by it (through this node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<u32>,
}

/// The network inventory of one node, published by the agent on that node (name = node
/// name). Every agent reads all of them to know which gateway can host which egress IP.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[expect(
    clippy::duplicated_attributes,
    reason = "kube-derive's printcolumn(...) repeats the same keys for every column"
)]
#[kube(
    group = "egress.dev",
    version = "v1alpha1",
    kind = "EgressNode",
    shortname = "egn",
    status = "EgressNodeStatus",
    derive = "PartialEq",
    derive = "Default",
    doc = "Network inventory of one node (name = node name), written by the agent on it.",
    printcolumn(name = "Underlay", type_ = "string", json_path = ".spec.underlayIP"),
    printcolumn(
        name = "Egress IPs",
        type_ = "string",
        json_path = ".status.egressIPs[*].ip"
    ),
    printcolumn(name = "Cut Off", type_ = "boolean", json_path = ".status.cutOff"),
    printcolumn(name = "Agent", type_ = "string", json_path = ".status.agentVersion"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EgressNodeSpec {
    /// The node's underlay (tunnel) address.
    #[serde(
        default,
        rename = "underlayIP",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(schema_with = "optional_ip_schema")]
    pub underlay_ip: Option<String>,
}

/// What the node's agent last saw on the node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressNodeStatus {
    /// Network interfaces that may carry egress traffic (the agent lists the up ones).
    #[serde(default)]
    #[schemars(length(max = 256))]
    pub interfaces: Vec<NodeInterface>,
    /// Egress IPs this node currently holds (added to one of its interfaces).
    #[serde(default, rename = "egressIPs")]
    #[schemars(length(max = 1024))]
    pub egress_ips: Vec<HeldEgressIp>,
    /// The peers this node's agent probes, and whether it hears them (directly or through
    /// others). Updated when one dies or comes back, not on every probe.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4096))]
    pub peers: Vec<PeerLiveness>,
    /// The agent hears fewer than a majority of its peers and holds nothing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cut_off: bool,
    /// The newest liveness hello version the agent speaks. Peers judge an agent by its
    /// hellos only once it says so (or they hear it): during a rolling upgrade, an agent
    /// older than the protocol is judged by its Node, never declared dead for its silence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hello_version: Option<u32>,
    /// The agent's version and commit (`egress-agent --version`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<String>,
    /// Whether the agent's hellos are signed (`--liveness-key-file`); `false`: anything
    /// on the underlay can speak for any node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness_authenticated: Option<bool>,
    /// What `egress-agent doctor` found when the agent started (kernel, bpffs,
    /// capabilities, tunnel port, rp_filter, MTU, egress IPs), and egress IPs it refused
    /// to claim because another host answers for them (`duplicate-address`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128))]
    pub preflight: Vec<PreflightCheck>,
    /// This node's policy maps that cannot hold every selected local pod's entries: the
    /// pods left out have their traffic to the destinations a rule covers dropped. The
    /// policies named get `Ready=False` with reason `PolicyMapFull`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 2))]
    pub full_policy_maps: Vec<FullPolicyMap>,
    /// The pods the agent's view of the cluster holds, as of the maps it last wrote:
    /// `Cluster` (every pod; unset means so, as agents before this field watched every
    /// pod) or `Node` (the pods of this node only: a worker's). A node that a policy's
    /// `gatewaySelector` selects is an eligible gateway only with `Cluster`: it admits and
    /// owns every selected pod then.
    #[serde(default, skip_serializing_if = "PodScope::is_cluster")]
    pub pod_scope: PodScope,
}

/// Which pods a view of the cluster holds, or a node needs. `Node < Cluster`: the larger
/// of two needs is their `max`.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    JsonSchema,
)]
pub enum PodScope {
    /// The pods whose `spec.nodeName` is this node.
    Node,
    /// Every pod of the cluster.
    #[default]
    Cluster,
}

impl PodScope {
    pub fn is_cluster(&self) -> bool {
        *self == Self::Cluster
    }
}

/// A policy map (one per address family) too small for the node's selected pods.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FullPolicyMap {
    /// `POLICY_V4` or `POLICY_V6`.
    #[schemars(length(max = 32))]
    pub map: String,
    /// Its capacity in entries (`--policy-map-entries`).
    pub capacity: u32,
    /// Selected pods whose entries were left out (whole pods: none of a pod's entries is
    /// in the map, so none of its covered traffic leaves with the pod's own address).
    pub pods_left_out: u32,
    /// The policies that select a pod left out, sorted.
    #[schemars(length(max = 1024), inner(length(max = 253)))]
    pub policies: Vec<String>,
}

/// One line of `egress-agent doctor`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreflightCheck {
    /// What was checked, such as `bpffs` or `rp-filter sec-a`.
    #[schemars(length(max = 128))]
    pub check: String,
    pub result: PreflightResult,
    /// What was found, and what to do about it.
    #[schemars(length(max = 1024))]
    pub message: String,
}

/// The verdict of one check.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum PreflightResult {
    Ok,
    /// Works, with a cost or a risk the message names.
    Warn,
    /// Egress through this node fails, in part or in whole, until it is fixed.
    Fail,
}

/// One peer as a node's agent sees it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PeerLiveness {
    #[schemars(length(max = 253))]
    pub name: String,
    pub alive: bool,
}

/// One network interface of a node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeInterface {
    #[schemars(schema_with = "interface_schema")]
    pub name: String,
    /// Administratively and operationally up.
    pub up: bool,
    /// Addresses with their prefix length, as `ip addr` prints them (`10.1.0.5/24`).
    #[serde(default)]
    #[schemars(schema_with = "address_list_schema")]
    pub addresses: Vec<String>,
    /// Prefixes the node routes out of this interface (unicast routes of the tables its
    /// agent reads, connected subnets included), sorted; what `destinationsFrom: Routes`
    /// rules compile from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "route_list_schema")]
    pub routes: Vec<String>,
    /// Routes out of this interface left out of `routes` because the node has more than
    /// the cap (`MAX_ROUTES`).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub routes_omitted: u32,
}

/// Most routes a node publishes in its EgressNode, over all its interfaces (a larger
/// object would approach etcd's object size limit).
pub const MAX_ROUTES: usize = 16_384;

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

/// An egress IP held by a node, and the interface it is on.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeldEgressIp {
    #[schemars(schema_with = "ip_schema")]
    pub ip: String,
    #[schemars(schema_with = "interface_schema")]
    pub interface: String,
    /// Ownership generation: each new holder takes the largest it knows + 1, so a stale
    /// claim (a holder back from the dead) loses to the current one.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u64,
    /// RFC 3339 time this node took the address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// Why it moved here (see `EgressIpStatus.reason`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `metav1.Condition`'s `type`: a CamelCase word, optionally prefixed by a DNS domain.
fn condition_type_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "maxLength": 316,
        "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
    })
}

/// `metav1.Condition`'s `reason`.
fn condition_reason_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "minLength": 1,
        "maxLength": 1024,
        "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
    })
}

fn generation_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({"type": "integer", "format": "int64", "minimum": 0})
}

/// Required and never null, although the compiler leaves it unset: the writer fills it
/// in before anything reaches the API server.
fn transition_time_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({"type": "string", "format": "date-time"})
}

fn ip_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "maxLength": MAX_ADDRESS_LEN,
        "x-kubernetes-validations": [
            {"rule": "isIP(self)", "message": "must be an IP address such as 198.51.100.10"}
        ]
    })
}

fn optional_ip_schema(generator: &mut SchemaGenerator) -> Schema {
    ip_schema(generator)
}

/// The most addresses one `egressIPs` list may name.
pub const MAX_RULE_EGRESS_IPS: usize = 16;

fn egress_ip_list_schema(generator: &mut SchemaGenerator) -> Schema {
    let item = ip_schema(generator);
    json_schema!({
        "type": "array",
        "minItems": 1,
        "maxItems": MAX_RULE_EGRESS_IPS,
        "items": item
    })
}

fn interface_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "minLength": 1,
        "maxLength": 15,
        "pattern": "^[^\\s/:]+$"
    })
}

fn optional_interface_schema(generator: &mut SchemaGenerator) -> Schema {
    interface_schema(generator)
}

fn prefix_item_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "string",
        "maxLength": MAX_ADDRESS_LEN,
        "x-kubernetes-validations": [
            {"rule": "isCIDR(self)", "message": "must be a CIDR prefix such as 192.0.2.0/24"},
            {
                "rule": "!isCIDR(self) || cidr(self) == cidr(self).masked()",
                "message": "must not have host bits set (write the network address, such as 192.0.2.0/24)"
            }
        ]
    })
}

fn destination_list_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "minItems": 1,
        "maxItems": MAX_PREFIXES,
        "items": prefix_item_schema()
    })
}

fn except_list_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "maxItems": MAX_PREFIXES,
        "items": prefix_item_schema()
    })
}

/// Routes are written by agents, not users, and can be many: no CEL rule per item (its
/// cost estimate would be times `MAX_ROUTES`); the compiler skips what does not parse.
fn route_list_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "maxItems": MAX_ROUTES,
        "items": {"type": "string", "maxLength": MAX_ADDRESS_LEN}
    })
}

fn address_list_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "maxItems": MAX_ADDRESSES,
        "items": {
            "type": "string",
            "maxLength": MAX_ADDRESS_LEN,
            "x-kubernetes-validations": [
                {"rule": "isCIDR(self)", "message": "must be an address with its prefix length such as 10.1.0.5/24"}
            ]
        }
    })
}

/// Every CRD of this crate.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![EgressGatewayPolicy::crd(), EgressNode::crd()]
}

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("failed to serialize CustomResourceDefinition {name}: {source}")]
    Serialize {
        name: String,
        #[source]
        source: serde_yaml_ng::Error,
    },
}

/// The CRDs as one multi-document YAML stream (what `deploy/base/crds.yaml` holds).
pub fn try_crd_yaml() -> Result<String, Error> {
    let mut out = String::from(
        "# Generated by `egress-agent crd` (egress_agent::api::crd_yaml): do not edit.\n",
    );
    for crd in crds() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let yaml =
            serde_yaml_ng::to_string(&crd).map_err(|source| Error::Serialize { name, source })?;
        out.push_str("---\n");
        out.push_str(&yaml);
    }
    Ok(out)
}

/// The CRDs as one multi-document YAML stream. Serializing plain data structures cannot
/// fail; should it ever, the error text stands in as a YAML comment.
pub fn crd_yaml() -> String {
    try_crd_yaml().unwrap_or_else(|e| format!("# {e}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMMITTED: &str = include_str!("../../deploy/base/crds.yaml");

    #[test]
    fn committed_crds_match_generated() {
        let generated = crd_yaml();
        if std::env::var_os("EGRESS_UPDATE_CRDS").is_some() {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/base/crds.yaml");
            std::fs::write(path, &generated).expect("write deploy/base/crds.yaml");
        }
        assert!(
            COMMITTED == generated,
            "deploy/base/crds.yaml is stale: run `EGRESS_UPDATE_CRDS=1 cargo test -p egress-agent \
             --lib api::` (or `egress-agent crd > deploy/base/crds.yaml`)"
        );
    }

    #[test]
    fn crds_are_cluster_scoped_with_expected_names() {
        let crds = crds();
        let names: Vec<_> = crds.iter().map(|c| c.metadata.name.clone()).collect();
        assert_eq!(
            names,
            [
                Some("egressgatewaypolicies.egress.dev".to_owned()),
                Some("egressnodes.egress.dev".to_owned())
            ]
        );
        for crd in &crds {
            assert_eq!(crd.spec.scope, "Cluster");
        }
        assert_eq!(crds[0].spec.names.short_names, Some(vec!["egp".to_owned()]));
        assert_eq!(crds[1].spec.names.short_names, Some(vec!["egn".to_owned()]));
        let columns = |i: usize| -> Vec<String> {
            crds[i].spec.versions[0]
                .additional_printer_columns
                .iter()
                .flatten()
                .map(|c| c.name.clone())
                .collect()
        };
        assert_eq!(
            columns(0),
            ["Accepted", "Ready", "Egress IPs", "Holders", "Age"]
        );
        assert_eq!(
            columns(1),
            ["Underlay", "Egress IPs", "Cut Off", "Agent", "Age"]
        );
    }

    #[test]
    fn policy_schema_carries_cel_rules() {
        let yaml = crd_yaml();
        for needle in [
            "exactly one of egressIP, egressIPs or interface must be set",
            "egressIPs must not list an address twice",
            "every except prefix must lie inside one of the destinations",
            "destinations must be of the same address family as egressIP",
            "isCIDR(self)",
            "isIP(self)",
            "minItems: 1",
        ] {
            assert!(yaml.contains(needle), "missing {needle:?}");
        }
    }

    /// The schema of `crds()[index]` at `path` (property names, `items` for list items).
    fn schema_at(index: usize, path: &[&str]) -> serde_json::Value {
        let crd = serde_json::to_value(&crds()[index]).expect("CRD to JSON");
        let mut at = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        for step in path {
            at = if *step == "items" {
                &at["items"]
            } else {
                &at["properties"][*step]
            };
        }
        assert!(!at.is_null(), "no schema at {path:?}");
        at.clone()
    }

    #[test]
    fn policy_conditions_follow_metav1_condition() {
        let list = schema_at(0, &["status", "conditions"]);
        assert_eq!(list["x-kubernetes-list-type"], "map");
        assert_eq!(
            list["x-kubernetes-list-map-keys"],
            serde_json::json!(["type"])
        );
        let item = schema_at(0, &["status", "conditions", "items"]);
        let mut required: Vec<&str> = item["required"]
            .as_array()
            .expect("required")
            .iter()
            .filter_map(|r| r.as_str())
            .collect();
        required.sort_unstable();
        assert_eq!(
            required,
            ["lastTransitionTime", "message", "reason", "status", "type"]
        );
        let field = |name: &str| item["properties"][name].clone();
        assert_eq!(
            field("status")["enum"],
            serde_json::json!(["True", "False", "Unknown"])
        );
        let time = field("lastTransitionTime");
        assert_eq!(
            (&time["type"], &time["format"], time.get("nullable")),
            (&"string".into(), &"date-time".into(), None)
        );
        assert_eq!(field("observedGeneration")["format"], "int64");
        assert_eq!(field("observedGeneration")["minimum"].as_f64(), Some(0.0));
        assert!(field("reason")["pattern"].is_string());
        // Every type the compiler emits is described.
        let described = field("type")["description"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        for type_ in crate::compiler::condition::ALL {
            assert!(
                described.contains(&format!("`{type_}`")),
                "{type_} in {described:?}"
            );
        }
    }

    #[test]
    fn an_empty_gateway_selector_is_refused_by_the_schema() {
        let rules = schema_at(0, &["spec", "gatewaySelector"])["x-kubernetes-validations"].clone();
        assert_eq!(rules[0]["message"], GATEWAY_SELECTOR_EMPTY, "{rules}");
        let rule = rules[0]["rule"].as_str().unwrap_or_default();
        assert!(
            rule.contains("size(self.matchLabels) > 0")
                && rule.contains("size(self.matchExpressions) > 0"),
            "{rule}"
        );
    }

    #[test]
    fn a_status_an_older_agent_wrote_still_reads() {
        // No observedGeneration per condition; one condition without a transition time.
        let old = r#"
observedGeneration: 2
conditions:
- {type: Accepted, status: "True", reason: Accepted, message: the policy is valid,
   lastTransitionTime: "2026-01-01T00:00:00Z"}
- {type: Ready, status: "False", reason: NoEligibleGateway, message: none}
egressIPs: []
"#;
        let status: PolicyStatus = serde_yaml_ng::from_str(old).expect("old status reads");
        assert_eq!(status.conditions[0].status, ConditionStatus::True);
        assert_eq!(status.conditions[0].observed_generation, None);
        assert_eq!(
            status.conditions[0].last_transition_time.as_deref(),
            Some("2026-01-01T00:00:00Z")
        );
        assert_eq!(status.conditions[1].status, ConditionStatus::False);
        assert_eq!(status.conditions[1].last_transition_time, None);
    }

    #[test]
    fn policy_round_trips_the_documented_example() {
        let doc = r#"
apiVersion: egress.dev/v1alpha1
kind: EgressGatewayPolicy
metadata: {name: payments}
spec:
  namespaceSelector: {matchLabels: {team: payments}}
  podSelector: {matchLabels: {app: api}}
  gatewaySelector: {matchLabels: {egress.dev/gateway: "true"}}
  failurePolicy: Drop
  rules:
  - destinations: ["192.0.2.0/24"]
    except: ["192.0.2.128/25"]
    egressIP: 198.51.100.10
  - destinations: ["203.0.113.0/24"]
    interface: ens224
status:
  observedGeneration: 3
  conditions: []
  egressIPs: [{ip: 198.51.100.10, node: gw-1, interface: ens224}]
"#;
        let policy: EgressGatewayPolicy = serde_yaml_ng::from_str(doc).expect("parse");
        assert_eq!(policy.spec.rules.len(), 2);
        assert_eq!(
            policy.spec.rules[0].egress_ip.as_deref(),
            Some("198.51.100.10")
        );
        assert_eq!(policy.spec.rules[1].interface.as_deref(), Some("ens224"));
        assert_eq!(policy.spec.failure_policy, FailurePolicy::Drop);
        let status = policy.status.clone().expect("status");
        assert_eq!(status.observed_generation, Some(3));
        assert_eq!(status.egress_ips[0].node, "gw-1");
        let back: EgressGatewayPolicy =
            serde_yaml_ng::from_str(&serde_yaml_ng::to_string(&policy).expect("serialize"))
                .expect("reparse");
        assert_eq!(back, policy);
    }
}
