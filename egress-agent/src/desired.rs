//! What one node's datapath should hold: the output of the policy compiler
//! (`compiler::compile`), the input of the map and interface sync (`datapath`).
//!
//! Plain data, ordered collections (so diffs and printouts are deterministic), no kernel
//! types: interfaces are named, the sync resolves them to ifindexes.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;

pub use crate::family::{ByFamily, Family, V4, V6};

/// What `from_pod` does for one (pod, destination prefix).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PolicyAction {
    /// Send to `gateway` (this node or another) tagged with the rule id.
    Forward,
    /// An `except` prefix: untouched.
    Exclude,
    /// No usable gateway, `failurePolicy: Drop`.
    NoGatewayDrop,
    /// No usable gateway, `failurePolicy: Fallthrough`.
    NoGatewayPass,
    /// The pod's egress NetworkPolicies allow nothing toward the prefix: dropped.
    Deny,
}

/// Allowed (protocol, first port, last port) ranges, sorted, merged per protocol: what a
/// pod's egress NetworkPolicies allow toward one destination prefix.
pub type PortSet = Vec<(u8, u16, u16)>;

/// What `from_pod` does for one (pod, destination prefix) of family `F`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyEntry<F: Family> {
    pub action: PolicyAction,
    /// Underlay address (either family) of the gateway node (`Some` iff `action == Forward`).
    pub gateway: Option<IpAddr>,
    /// The egress address the gateway will use (observability; `None` when unknown).
    pub egress_ip: Option<F::Addr>,
    /// Cluster-wide rule id (1..=`egress_common::policy::MAX_RULE_ID`); every node derives
    /// the same id for the same (policy, rule index).
    pub rule_id: u32,
    /// `Forward` only: the key in [`Desired::port_filters`] of the ports the pod's egress
    /// NetworkPolicies allow there; 0: every port and protocol.
    pub filter: u16,
}
pub type PolicyEntryV4 = PolicyEntry<V4>;
pub type PolicyEntryV6 = PolicyEntry<V6>;

/// Gateway side: what to do with tunneled packets of one rule on this node.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GatewayRule<F: Family> {
    pub egress_ip: F::Addr,
    /// Interface the packets leave from (must carry `egress_ip`, or a route for the
    /// destinations).
    pub interface: String,
}
pub type GatewayRuleV4 = GatewayRule<V4>;
pub type GatewayRuleV6 = GatewayRule<V6>;

/// An egress address (of either family) this node must hold on one of its interfaces.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HeldIp {
    pub interface: String,
    /// Prefix length of the interface's subnet that contains the address (for `ip addr add`).
    pub prefix_len: u8,
    /// `true` for an interface's own address used by an `interface:` rule: the agent does
    /// not add or remove it, and packets to it without conntrack belong to the host.
    pub shared: bool,
}

/// The part of a node's desired state that each family has for itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FamilyDesired<F: Family> {
    /// Source side: (local pod, destination prefix) -> entry. Only pods of this node.
    pub policy: BTreeMap<(F::Addr, F::Net), PolicyEntry<F>>,
    /// Source side: local pods with at least one entry -> number of entries.
    pub selected: BTreeMap<F::Addr, u32>,
    /// Gateway side: rule id -> egress address and interface, for every rule this node
    /// may serve.
    pub rules: BTreeMap<u32, GatewayRule<F>>,
    /// Pod address of the family -> underlay address of its node: every pod of the
    /// cluster on a gateway (spoofing check, return path), this node's pods elsewhere
    /// (the return path's check that a reply is for a pod of this node).
    pub pod_owner: BTreeMap<F::Addr, IpAddr>,
    /// Egress addresses this node holds (dedicated) or uses (shared), by address.
    pub egress_ips: BTreeMap<F::Addr, HeldIp>,
}

impl<F: Family> Default for FamilyDesired<F> {
    fn default() -> Self {
        Self {
            policy: BTreeMap::new(),
            selected: BTreeMap::new(),
            rules: BTreeMap::new(),
            pod_owner: BTreeMap::new(),
            egress_ips: BTreeMap::new(),
        }
    }
}

/// The desired datapath state of one node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    /// This node's underlay address (IPv4 or IPv6), when the view knows it.
    pub node_ip: Option<IpAddr>,
    /// This node's pod CIDRs (its Node's `spec.podCIDRs`).
    pub pod_cidrs: Vec<IpNet>,
    /// IPv4: pods, rules and egress addresses of IPv4.
    pub v4: FamilyDesired<V4>,
    /// IPv6: the same for IPv6 (dual-stack and IPv6-only pods).
    pub v6: FamilyDesired<V6>,
    /// Every node's underlay address -> small stable id (tunnel sender check).
    pub nodes: BTreeMap<IpAddr, u32>,
    /// Interfaces that need `from_secondary` (those of the rules and egress IPs of both
    /// families).
    pub egress_interfaces: BTreeSet<String>,
    /// Gateway side: the (pod address, rule id) pairs this node admits from the tunnel:
    /// pods whose policy selects them for a rule, with at least one destination of it
    /// forwarded through this node. Anything else claiming a served rule is forged.
    pub admitted: BTreeSet<(IpAddr, u32)>,
    /// Source side, `--unknown-pods drop`: the addresses of this node's running pods,
    /// selected or not (any other address on a pod device is a pod the agent has not seen).
    pub known_pods: BTreeSet<IpAddr>,
    /// Source side, `--unknown-pods drop`: every destination prefix a rule of any policy
    /// covers (`true`), and the `except` prefixes inside them (`false`); longest match.
    pub covered: BTreeMap<IpNet, bool>,
    /// Source side: the port filters the policy entries name (`PolicyEntry::filter`), by
    /// id (derived from the set, so an unrelated change keeps every id).
    pub port_filters: BTreeMap<u16, PortSet>,
}

/// A [`Desired`]'s per-family parts, reached from code written once over both families
/// with `F::part(desired)`.
impl ByFamily for Desired {
    type Part<F: Family> = FamilyDesired<F>;
    fn v4(&self) -> &FamilyDesired<V4> {
        &self.v4
    }
    fn v4_mut(&mut self) -> &mut FamilyDesired<V4> {
        &mut self.v4
    }
    fn v6(&self) -> &FamilyDesired<V6> {
        &self.v6
    }
    fn v6_mut(&mut self) -> &mut FamilyDesired<V6> {
        &mut self.v6
    }
}

impl Desired {
    /// Local pods whose traffic `from_pod` must see.
    pub fn local_selected_pods(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.v4
            .selected
            .keys()
            .map(|a| IpAddr::V4(*a))
            .chain(self.v6.selected.keys().map(|a| IpAddr::V6(*a)))
    }

    /// The egress address `ip` of either family, when this node holds or uses it.
    pub fn egress_ip(&self, ip: IpAddr) -> Option<&HeldIp> {
        crate::by_family!(ip, |a: F| F::part(self).egress_ips.get(&a))
    }
}
