//! The policy map (source side), the rule table (gateway side) and the tables used to
//! check who sent a tunneled packet.
//!
//! Node addresses (`gateway`, `node`, the `NODES` key) are [`Underlay`] addresses: 16
//! bytes, IPv4 underlays IPv4-mapped.

use crate::underlay::Underlay;

/// Key of the IPv4 policy map (`POLICY_V4`, a hash): one destination prefix of one pod.
/// `dst` is the prefix's network address (the bits past `dst_len` are zero). `from_pod`
/// finds a packet's entry by masking its destination to each length that both its pod
/// uses ([`SelectedValueV4::lengths`]) and the chain of prefixes containing the destination
/// has ([`DestValueV4`]), longest first: the first hit is the longest prefix match among
/// that pod's entries, and an `except` hole is an entry of its own length.
/// Unlike an LPM trie keyed by (pod, destination), the cost does not grow with the number
/// of pods in front of the destination bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKeyV4 {
    pub pod: [u8; 4],
    pub dst: [u8; 4],
    /// Destination prefix length, 0..=[`MAX_PREFIX_LEN_V4`].
    pub dst_len: u32,
}
const _: () = assert!(core::mem::size_of::<PolicyKeyV4>() == 12);

pub const MAX_PREFIX_LEN_V4: u32 = 32;

impl PolicyKeyV4 {
    /// The key of `pod`'s prefix `dst/dst_len` (`dst` masked to `dst_len`, which is
    /// clamped to 32).
    pub const fn new(pod: [u8; 4], dst: [u8; 4], dst_len: u32) -> Self {
        let dst_len = if dst_len > MAX_PREFIX_LEN_V4 {
            MAX_PREFIX_LEN_V4
        } else {
            dst_len
        };
        Self {
            pod,
            dst: (u32::from_be_bytes(dst) & mask_v4(dst_len)).to_be_bytes(),
            dst_len,
        }
    }
}

/// The netmask of an IPv4 prefix of length `len` (0..=32), host order.
#[inline(always)]
pub const fn mask_v4(len: u32) -> u32 {
    if len == 0 {
        0
    } else if len >= 32 {
        u32::MAX
    } else {
        u32::MAX << (32 - len)
    }
}

/// What `from_pod` does with a packet whose (pod, destination) matched.
pub mod action {
    /// Send to the gateway in `PolicyValueV4::gateway` (tunnel, or the local gateway path
    /// when the gateway is this node), tagged with `rule_id`.
    pub const FORWARD: u8 = 1;
    /// An `except` prefix: the packet continues untouched.
    pub const EXCLUDE: u8 = 2;
    /// The rule has no usable gateway and its policy says `failurePolicy: Drop`.
    pub const NO_GATEWAY_DROP: u8 = 3;
    /// The rule has no usable gateway and its policy says `failurePolicy: Fallthrough`.
    pub const NO_GATEWAY_PASS: u8 = 4;
    /// The pod's egress NetworkPolicies allow nothing to this destination: dropped
    /// (`DROP_NETWORK_POLICY`) before the tunnel.
    pub const DENY: u8 = 5;
}

/// Most port ranges of one [`PortFilter`]: the agent merges a pod's ranges per protocol
/// first, and fails closed (denies the destination, saying so) past this.
pub const PORT_FILTER_RANGES: usize = 16;

/// One allowed protocol and destination port range of a [`PortFilter`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortRange {
    /// IP protocol number (6 TCP, 17 UDP, 132 SCTP).
    pub proto: u8,
    pub _pad: u8,
    /// First and last allowed destination port, host order, inclusive.
    pub first: u16,
    pub last: u16,
}
const _: () = assert!(core::mem::size_of::<PortRange>() == 6);

/// `PORT_FILTERS` (filter id -> this): what a policy entry's `filter` allows, the union
/// of a pod's egress NetworkPolicy ports toward one destination prefix. A packet passes
/// when its protocol and destination port fall in one of the first `count` ranges.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortFilter {
    pub count: u32,
    pub ranges: [PortRange; PORT_FILTER_RANGES],
}
const _: () = assert!(core::mem::size_of::<PortFilter>() == 100);

impl PortFilter {
    /// Whether protocol `proto`'s destination port `port` (host order) passes.
    #[inline(always)]
    pub fn allows(&self, proto: u8, port: u16) -> bool {
        let mut i = 0;
        while i < PORT_FILTER_RANGES {
            if i as u32 >= self.count {
                return false;
            }
            let r = &self.ranges[i];
            if r.proto == proto && r.first <= port && port <= r.last {
                return true;
            }
            i += 1;
        }
        false
    }
}

/// Value of the policy map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PolicyValueV4 {
    /// Underlay address of the gateway node (zero unless `action == FORWARD`).
    pub gateway: Underlay,
    /// The egress address the gateway will use, for observability (the gateway decides
    /// from its own `RULES_*` entry).
    pub egress_ip: [u8; 4],
    /// Rule id, carried to the gateway in the tunnel's VNI. 1..=`MAX_RULE_ID`.
    pub rule_id: u32,
    /// One of [`action`].
    pub action: u8,
    pub _pad: u8,
    /// `FORWARD` only: the [`PortFilter`] (`PORT_FILTERS` key) the packet's protocol and
    /// destination port must pass (the pod's egress NetworkPolicies), 0 for none. Zero in
    /// the padding of agents before it existed: the layout is the same.
    pub filter: u16,
}
const _: () = assert!(core::mem::size_of::<PolicyValueV4>() == 28);

/// Rule ids fit in a 24-bit VNI; `RETURN_VNI` is reserved for replies travelling back from
/// a gateway to the pod's node.
pub const MAX_RULE_ID: u32 = 0x00ff_fffe;
pub const RETURN_VNI: u32 = 0x00ff_ffff;

/// Source side, `DESTS_V4` (an LPM trie keyed by destination): every destination prefix
/// of this node's `POLICY_V4` entries (of any pod) -> the lengths of that prefix and of
/// every other such prefix that contains it (bit n: length n). The longest match for a
/// packet's destination names the chain of prefixes that contain it; `from_pod` probes
/// `POLICY_V4` only at the lengths of that chain that its pod also uses
/// ([`SelectedValueV4::lengths`]), longest first: usually one probe, whatever the number of
/// pods and prefixes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DestValueV4 {
    /// The 64-bit set as two halves, low first (an LPM trie's value must be 4-aligned
    /// here: its 4-byte key leaves no room for an 8-byte alignment).
    pub lengths: [u32; 2],
    /// The length of this entry's own prefix (the highest bit of `lengths`): the probe
    /// to try first.
    pub len: u32,
}
const _: () = assert!(core::mem::size_of::<DestValueV4>() == 12);

impl DestValueV4 {
    /// Bit n set: a prefix of length n.
    #[inline(always)]
    pub const fn lengths(&self) -> u64 {
        self.lengths[0] as u64 | (self.lengths[1] as u64) << 32
    }

    /// The value of a prefix of length `len` within the prefixes of lengths `lengths`.
    pub const fn new(len: u32, lengths: u64) -> Self {
        Self {
            lengths: [lengths as u32, (lengths >> 32) as u32],
            len,
        }
    }
}

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

/// Source side, `SELECTED_V4`: local pod IPv4 selected by at least one rule -> the
/// destination prefix lengths of its `POLICY_V4` entries. Checked first, so that packets
/// of unselected pods cost one hash lookup; a selected pod's packet then costs one
/// `DESTS_V4` lookup (none when the pod uses a single length) and one `POLICY_V4` lookup
/// per length that both name (see [`DestValueV4`]), longest first, until one hits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SelectedValueV4 {
    /// Bit `n` set: the pod has at least one entry of destination prefix length `n`
    /// (bits 0..=32).
    pub lengths: u64,
    /// Number of policy entries of the pod.
    pub entries: u32,
    /// [`selected_flags`] (zero from agents before they existed: the layout is the same).
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<SelectedValueV4>() == 16);

/// `SelectedValueV4::flags` and `SelectedValueV6::flags`.
pub mod selected_flags {
    /// The pod's policy entries did not all fit the node's policy map: the agent wrote
    /// none of them, and `from_pod` drops the pod's packets to every destination a rule
    /// covers (`COVERED_*`) as `DROP_POLICY_MAP_FULL`, never sending them with the pod's
    /// own address.
    pub const INCOMPLETE: u32 = 1;
}

impl SelectedValueV4 {
    /// Note an entry of destination prefix length `len` (clamped to 32) in `lengths`.
    pub fn add_length(&mut self, len: u32) {
        self.lengths |= 1u64 << len.min(MAX_PREFIX_LEN_V4);
    }
}

// ---- IPv6 pods and egress IPs (the underlay is either family, see above) ----

/// Key of the IPv6 policy map (`POLICY_V6`, a hash): as [`PolicyKeyV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKeyV6 {
    pub pod: [u8; 16],
    pub dst: [u8; 16],
    /// Destination prefix length, 0..=[`MAX_PREFIX_LEN_V6`].
    pub dst_len: u32,
}
const _: () = assert!(core::mem::size_of::<PolicyKeyV6>() == 36);

pub const MAX_PREFIX_LEN_V6: u32 = 128;

impl PolicyKeyV6 {
    /// The key of `pod`'s prefix `dst/dst_len` (`dst` masked to `dst_len`, which is
    /// clamped to 128).
    pub fn new(pod: [u8; 16], dst: [u8; 16], dst_len: u32) -> Self {
        let dst_len = dst_len.min(MAX_PREFIX_LEN_V6);
        let (hi, lo) = split_v6(&dst);
        let (mhi, mlo) = mask_v6(dst_len);
        Self {
            pod,
            dst: join_v6(hi & mhi, lo & mlo),
            dst_len,
        }
    }
}

/// An IPv6 address as its (high, low) 64-bit halves, host order.
#[inline(always)]
pub fn split_v6(a: &[u8; 16]) -> (u64, u64) {
    (
        u64::from_be_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]),
        u64::from_be_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]),
    )
}

/// The inverse of [`split_v6`].
#[inline(always)]
pub fn join_v6(hi: u64, lo: u64) -> [u8; 16] {
    let (h, l) = (hi.to_be_bytes(), lo.to_be_bytes());
    [
        h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], l[0], l[1], l[2], l[3], l[4], l[5], l[6],
        l[7],
    ]
}

/// The netmask of an IPv6 prefix of length `len` (0..=128) as (high, low) halves.
#[inline(always)]
pub const fn mask_v6(len: u32) -> (u64, u64) {
    if len == 0 {
        (0, 0)
    } else if len < 64 {
        (u64::MAX << (64 - len), 0)
    } else if len == 64 {
        (u64::MAX, 0)
    } else if len < 128 {
        (u64::MAX, u64::MAX << (128 - len))
    } else {
        (u64::MAX, u64::MAX)
    }
}

/// Value of the IPv6 policy map (same meaning as [`PolicyValueV4`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PolicyValueV6 {
    /// Underlay address of the gateway node.
    pub gateway: Underlay,
    pub rule_id: u32,
    /// One of [`action`].
    pub action: u8,
    pub _pad: u8,
    /// As [`PolicyValueV4::filter`].
    pub filter: u16,
    /// The egress address the gateway will use (observability).
    pub egress_ip: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<PolicyValueV6>() == 40);

/// Source side, `SELECTED_V6`: as [`SelectedValueV4`], for IPv6 pods: bit `n % 64` of
/// `lengths[n / 64]` set means an entry of destination prefix length `n` (0..=128).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SelectedValueV6 {
    pub lengths: [u64; 3],
    /// Number of policy entries of the pod.
    pub entries: u32,
    /// [`selected_flags`].
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<SelectedValueV6>() == 32);

impl SelectedValueV6 {
    /// Note an entry of destination prefix length `len` (clamped to 128) in `lengths`.
    pub fn add_length(&mut self, len: u32) {
        let len = len.min(MAX_PREFIX_LEN_V6);
        if let Some(w) = self.lengths.get_mut((len / 64) as usize) {
            *w |= 1u64 << (len % 64);
        }
    }
}

/// Source side, `DESTS_V6`: as [`DestValueV4`], with the lengths laid out as in
/// [`SelectedValueV6`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DestValueV6 {
    pub lengths: [u64; 3],
    /// As [`DestValueV4::len`].
    pub len: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<DestValueV6>() == 32);

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

/// Source side, `POD_DEVICES_V4` / `_V6`: the host-side device a local pod address was
/// found behind (its host route, its veth's peer, its OVS port), written by the agent for
/// every selected pod, and every known pod with `--unknown-pods drop`. `from_pod` drops a
/// packet of a bound address that arrived on another device (`DROP_SOURCE_DEVICE`): a pod
/// cannot send as another pod of its node. An address without an entry (a pod the agent
/// has not bound yet, or found behind several devices) is left to the unknown-pod policy.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PodDeviceValue {
    /// The host-side device's ifindex (never 0).
    pub ifindex: u32,
    /// Bit set of [`pod_device_flags`].
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<PodDeviceValue>() == 8);

pub mod pod_device_flags {
    /// The device is a veth whose peer is in another network namespace (the pod's):
    /// replies of the pod's flows through our rules, and ICMP errors about them, go
    /// straight into the pod (`bpf_redirect_peer`), not by the node's routing, which on
    /// OVN-Kubernetes leads into OVN's management port and the pod's stateful ACLs, which
    /// never saw the request leave. Without it (an Open vSwitch internal port, a device
    /// of another kind) replies take the FIB lookup as before.
    pub const REPLY_TO_PEER: u32 = 1 << 0;
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_hold_the_network_address_of_their_prefix() {
        let k = PolicyKeyV4::new([10, 1, 2, 3], [192, 168, 101, 77], 24);
        assert_eq!((k.dst, k.dst_len), ([192, 168, 101, 0], 24));
        assert_eq!(PolicyKeyV4::new([0; 4], [255; 4], 0).dst, [0; 4]);
        assert_eq!(PolicyKeyV4::new([0; 4], [255; 4], 32).dst, [255; 4]);
        assert_eq!(PolicyKeyV4::new([0; 4], [255; 4], 40).dst_len, 32);
        for (len, want) in [
            (0, [0u8; 16]),
            (1, [0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            (
                63,
                [
                    255, 255, 255, 255, 255, 255, 255, 254, 0, 0, 0, 0, 0, 0, 0, 0,
                ],
            ),
            (
                64,
                [
                    255, 255, 255, 255, 255, 255, 255, 255, 0, 0, 0, 0, 0, 0, 0, 0,
                ],
            ),
            (
                65,
                [
                    255, 255, 255, 255, 255, 255, 255, 255, 0x80, 0, 0, 0, 0, 0, 0, 0,
                ],
            ),
            (
                127,
                [
                    255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 254,
                ],
            ),
            (128, [255; 16]),
        ] {
            assert_eq!(
                PolicyKeyV6::new([0; 16], [255; 16], len).dst,
                want,
                "/{len}"
            );
        }
    }

    #[test]
    fn selected_values_hold_one_bit_per_length() {
        let mut v = SelectedValueV4::default();
        for len in [0, 16, 24, 32, 24] {
            v.add_length(len);
        }
        assert_eq!(v.lengths, 1 | 1 << 16 | 1 << 24 | 1 << 32);
        let mut v = SelectedValueV6::default();
        for len in [0, 63, 64, 127, 128] {
            v.add_length(len);
        }
        assert_eq!(v.lengths, [1 | 1 << 63, 1 | 1 << 63, 1]);
    }
}
