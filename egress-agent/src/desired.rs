//! What one node's datapath should hold: the output of the policy compiler
//! (`compiler::compile`), the input of the map and interface sync (`datapath`).
//!
//! Plain data, ordered collections (so diffs and printouts are deterministic), no kernel
//! types: interfaces are named, the sync resolves them to ifindexes.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyEntryV4 {
    pub action: PolicyAction,
    /// Underlay address (either family) of the gateway node (`Some` iff `action == Forward`).
    pub gateway: Option<IpAddr>,
    /// The egress address the gateway will use (observability; `None` when unknown).
    pub egress_ip: Option<Ipv4Addr>,
    /// Cluster-wide rule id (1..=`egress_common::policy::MAX_RULE_ID`); every node derives
    /// the same id for the same (policy, rule index).
    pub rule_id: u32,
}

/// Gateway side: what to do with tunneled packets of one rule on this node.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GatewayRuleV4 {
    pub egress_ip: Ipv4Addr,
    /// Interface the packets leave from (must carry `egress_ip`, or a route for the
    /// destinations).
    pub interface: String,
}

/// An egress address this node must hold on one of its interfaces.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HeldIpV4 {
    pub interface: String,
    /// Prefix length of the interface's subnet that contains the address (for `ip addr add`).
    pub prefix_len: u8,
    /// `true` for an interface's own address used by an `interface:` rule: the agent does
    /// not add or remove it, and packets to it without conntrack belong to the host.
    pub shared: bool,
}

/// IPv6 counterpart of [`PolicyEntryV4`]: the pod and egress IP are IPv6, the gateway is
/// the underlay address of the gateway node (either family, like every underlay address).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyEntryV6 {
    pub action: PolicyAction,
    pub gateway: Option<IpAddr>,
    pub egress_ip: Option<Ipv6Addr>,
    pub rule_id: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GatewayRuleV6 {
    pub egress_ip: Ipv6Addr,
    pub interface: String,
}

/// The desired datapath state of one node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    /// This node's underlay address (IPv4 or IPv6), when the view knows it.
    pub node_ip: Option<IpAddr>,
    /// This node's pod CIDRs (its Node's `spec.podCIDRs`).
    pub pod_cidrs: Vec<IpNet>,
    /// Source side: (local pod, destination prefix) -> entry. Only pods of this node.
    pub policy_v4: BTreeMap<(Ipv4Addr, Ipv4Net), PolicyEntryV4>,
    /// Source side: local pods with at least one entry -> number of entries.
    pub selected_v4: BTreeMap<Ipv4Addr, u32>,
    /// Gateway side: rule id -> egress address and interface, for every rule this node
    /// may serve.
    pub rules_v4: BTreeMap<u32, GatewayRuleV4>,
    /// Every node's underlay address -> small stable id (tunnel sender check).
    pub nodes: BTreeMap<IpAddr, u32>,
    /// Every pod IPv4 in the cluster -> underlay address of its node (spoofing check and
    /// return path).
    pub pod_owner_v4: BTreeMap<Ipv4Addr, IpAddr>,
    /// Egress addresses this node holds (dedicated) or uses (shared), by address.
    pub egress_ips_v4: BTreeMap<Ipv4Addr, HeldIpV4>,
    /// Interfaces that need `from_secondary` (those of the rules and egress IPs of both
    /// families).
    pub egress_interfaces: BTreeSet<String>,
    /// IPv6 counterparts of the maps above (dual-stack and IPv6-only pods).
    pub policy_v6: BTreeMap<(Ipv6Addr, Ipv6Net), PolicyEntryV6>,
    pub selected_v6: BTreeMap<Ipv6Addr, u32>,
    pub rules_v6: BTreeMap<u32, GatewayRuleV6>,
    pub pod_owner_v6: BTreeMap<Ipv6Addr, IpAddr>,
    /// `HeldIpV4` carries what an IPv6 address needs too (interface, prefix, shared).
    pub egress_ips_v6: BTreeMap<Ipv6Addr, HeldIpV4>,
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
}

impl Desired {
    /// Local pods whose traffic `from_pod` must see.
    pub fn local_selected_pods(&self) -> impl Iterator<Item = std::net::IpAddr> + '_ {
        self.selected_v4
            .keys()
            .map(|a| std::net::IpAddr::V4(*a))
            .chain(self.selected_v6.keys().map(|a| std::net::IpAddr::V6(*a)))
    }
}
