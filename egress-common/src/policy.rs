//! The policy trie (source side), the rule table (gateway side) and the tables used to
//! check who sent a tunneled packet.
//!
//! Node addresses (`gateway`, `node`, the `NODES` key) are [`Underlay`] addresses: 16
//! bytes, IPv4 underlays IPv4-mapped.

use crate::underlay::Underlay;

/// Data part of an LPM key for the IPv4 policy trie. The trie key's prefix length is
/// `POD_PREFIX_BITS_V4 + destination prefix length`: the pod address always matches in
/// full, the destination by longest prefix.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKeyV4 {
    pub pod: [u8; 4],
    pub dst: [u8; 4],
}
const _: () = assert!(core::mem::size_of::<PolicyKeyV4>() == 8);

pub const POD_PREFIX_BITS_V4: u32 = 32;

/// What `from_pod` does with a packet whose (pod, destination) matched.
pub mod action {
    /// Send to the gateway in `PolicyValue::gateway` (tunnel, or the local gateway path
    /// when the gateway is this node), tagged with `rule_id`.
    pub const FORWARD: u8 = 1;
    /// An `except` prefix: the packet continues untouched.
    pub const EXCLUDE: u8 = 2;
    /// The rule has no usable gateway and its policy says `failurePolicy: Drop`.
    pub const NO_GATEWAY_DROP: u8 = 3;
    /// The rule has no usable gateway and its policy says `failurePolicy: Fallthrough`.
    pub const NO_GATEWAY_PASS: u8 = 4;
}

/// Value of the policy trie.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PolicyValue {
    /// Underlay address of the gateway node (zero unless `action == FORWARD`).
    pub gateway: Underlay,
    /// The egress address the gateway will use, for observability (the gateway decides
    /// from its own `RULES_*` entry).
    pub egress_ip: [u8; 4],
    /// Rule id, carried to the gateway in the tunnel's VNI. 1..=`MAX_RULE_ID`.
    pub rule_id: u32,
    /// One of [`action`].
    pub action: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<PolicyValue>() == 28);

/// Rule ids fit in a 24-bit VNI; `RETURN_VNI` is reserved for replies travelling back from
/// a gateway to the pod's node.
pub const MAX_RULE_ID: u32 = 0x00ff_fffe;
pub const RETURN_VNI: u32 = 0x00ff_ffff;

/// Gateway side: rule id -> what to do with a tunneled packet of that rule.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RuleValueV4 {
    /// Source address after SNAT.
    pub egress_ip: [u8; 4],
    /// Interface the packet must leave from.
    pub ifindex: u32,
}
const _: () = assert!(core::mem::size_of::<RuleValueV4>() == 8);

/// Known nodes: [`Underlay`] address -> node.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeValue {
    /// Stable small id of the node (for logs and counters).
    pub node_id: u32,
}
const _: () = assert!(core::mem::size_of::<NodeValue>() == 4);

/// Pod address -> underlay address of the node it runs on.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PodOwnerValue {
    pub node: Underlay,
}
const _: () = assert!(core::mem::size_of::<PodOwnerValue>() == 16);

/// Egress IPv4 held by this node -> interface it lives on.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EgressIpValue {
    pub ifindex: u32,
    /// Bit set of [`egress_ip_flags`].
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<EgressIpValue>() == 8);

pub mod egress_ip_flags {
    /// The address is the gateway interface's own address (an `interface:` rule): packets
    /// to it without a conntrack entry belong to the host and pass. Without this flag the
    /// address is a dedicated egress IP, and such packets are dropped and counted.
    pub const SHARED: u32 = 1 << 0;
}

/// Source side: local pod IPv4 selected by at least one rule -> number of trie entries.
/// Checked before the trie so that packets of unselected pods cost one hash lookup.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SelectedValue {
    pub entries: u32,
}
const _: () = assert!(core::mem::size_of::<SelectedValue>() == 4);

// ---- IPv6 pods and egress IPs (the underlay is either family, see above) ----

/// Data part of an LPM key for the IPv6 policy trie: prefix length is
/// `POD_PREFIX_BITS_V6 + destination prefix length`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKeyV6 {
    pub pod: [u8; 16],
    pub dst: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<PolicyKeyV6>() == 32);

pub const POD_PREFIX_BITS_V6: u32 = 128;

/// Value of the IPv6 policy trie (same meaning as [`PolicyValue`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PolicyValueV6 {
    /// Underlay address of the gateway node.
    pub gateway: Underlay,
    pub rule_id: u32,
    /// One of [`action`].
    pub action: u8,
    pub _pad: [u8; 3],
    /// The egress address the gateway will use (observability).
    pub egress_ip: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<PolicyValueV6>() == 40);

/// Gateway side, IPv6 rules: rule id -> egress IPv6 and interface.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RuleValueV6 {
    pub egress_ip: [u8; 16],
    pub ifindex: u32,
}
const _: () = assert!(core::mem::size_of::<RuleValueV6>() == 20);

// ---- the (pod, rule) pairs a gateway admits from the tunnel ----

/// Gateway side: an IPv4 pod that may use a rule served here. `from_tunnel` (and the
/// local gateway path of `from_pod`) translates a new flow of rule `rule_id` from `pod`
/// only when this key is in `ADMITTED_V4`: the tunnel is not authenticated, and the
/// sender and pod-owner checks alone would let a node's *unselected* pod claim any rule.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdmittedKeyV4 {
    pub pod: [u8; 4],
    pub rule_id: u32,
}
const _: () = assert!(core::mem::size_of::<AdmittedKeyV4>() == 8);

/// [`AdmittedKeyV4`] for an IPv6 pod (`ADMITTED_V6`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdmittedKeyV6 {
    pub pod: [u8; 16],
    pub rule_id: u32,
}
const _: () = assert!(core::mem::size_of::<AdmittedKeyV6>() == 20);

/// Value of `ADMITTED_V4` and `ADMITTED_V6`: presence is what counts; `flags` is 0 (room
/// for later use without a layout change).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AdmittedValue {
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<AdmittedValue>() == 4);

// ---- pods the agent has not seen yet (`--unknown-pods drop`) ----

/// Source side, `KNOWN_PODS_V4` / `_V6`: a local pod address the agent has seen (a
/// running Pod object on this node), selected or not. With `--unknown-pods drop`, a packet
/// of a pod address missing from both this map and `SELECTED_*` is dropped when its
/// destination is covered (`COVERED_*`). Presence is what counts; `flags` is 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KnownPodValue {
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<KnownPodValue>() == 4);

/// Source side, `COVERED_V4` / `_V6` (LPM tries keyed by destination): what any rule of
/// any policy covers. The longest match decides: [`coverage::COVERED`] for a rule's
/// destination, [`coverage::EXCEPTED`] for its `except` prefixes inside it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CoveredValue {
    pub covered: u32,
}
const _: () = assert!(core::mem::size_of::<CoveredValue>() == 4);

pub mod coverage {
    pub const EXCEPTED: u32 = 0;
    pub const COVERED: u32 = 1;
}
