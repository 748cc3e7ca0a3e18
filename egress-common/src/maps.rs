//! Map names as they appear in the object file and under the pin directory.
//!
//! The kernel truncates map names to 15 characters; every name here fits.

pub const POLICY_V4: &str = "POLICY_V4";
pub const SELECTED_V4: &str = "SELECTED_V4";
pub const RULES_V4: &str = "RULES_V4";
pub const NODES: &str = "NODES";
pub const POD_OWNER_V4: &str = "POD_OWNER_V4";
pub const CT_V4: &str = "CT_V4";
/// New flows refused for want of a SNAT port (`DROP_PORT_EXHAUSTED`), by pod.
pub const EXHAUSTED_V4: &str = "EXHAUSTED_V4";
pub const EGRESS_IPS_V4: &str = "EGRESS_IPS_V4";
pub const POLICY_V6: &str = "POLICY_V6";
pub const SELECTED_V6: &str = "SELECTED_V6";
pub const RULES_V6: &str = "RULES_V6";
pub const POD_OWNER_V6: &str = "POD_OWNER_V6";
pub const CT_V6: &str = "CT_V6";
pub const EXHAUSTED_V6: &str = "EXHAUSTED_V6";
pub const EGRESS_IPS_V6: &str = "EGRESS_IPS_V6";
pub const COUNTERS: &str = "COUNTERS";
pub const CONFIG: &str = "CONFIG";
pub const ADMITTED_V4: &str = "ADMITTED_V4";
pub const ADMITTED_V6: &str = "ADMITTED_V6";

/// Every map the agent pins, in a stable order.
pub const ALL: &[&str] = &[
    POLICY_V4,
    SELECTED_V4,
    RULES_V4,
    NODES,
    POD_OWNER_V4,
    CT_V4,
    EXHAUSTED_V4,
    EGRESS_IPS_V4,
    POLICY_V6,
    SELECTED_V6,
    RULES_V6,
    POD_OWNER_V6,
    CT_V6,
    EXHAUSTED_V6,
    EGRESS_IPS_V6,
    COUNTERS,
    CONFIG,
    ADMITTED_V4,
    ADMITTED_V6,
];

/// Capacities. The policy trie holds only this node's pods (source side), so 64k entries
/// cover 1,000 local pods with 64 prefixes each; conntrack is sized for a busy gateway.
pub const POLICY_MAX_ENTRIES: u32 = 65_536;
pub const RULES_MAX_ENTRIES: u32 = 16_384;
pub const NODES_MAX_ENTRIES: u32 = 16_384;
pub const POD_OWNER_MAX_ENTRIES: u32 = 262_144;
pub const CT_MAX_ENTRIES: u32 = 262_144;
pub const EGRESS_IPS_MAX_ENTRIES: u32 = 4_096;
/// Pods counted in `EXHAUSTED_V4` / `_V6` (LRU: the pods that ran out most recently stay).
pub const EXHAUSTED_MAX_ENTRIES: u32 = 16_384;
/// (pod, rule) pairs a gateway admits, per family: 100k selected pods with five rules
/// each served by one gateway. The maps are not preallocated (`BPF_F_NO_PREALLOC`): a
/// worker, which admits nothing, pays only for the hash buckets. When a map is full the
/// agent's inserts fail (reported once per map, `ApplyStats::problems`), and new flows
/// of the pairs left out are dropped as `DROP_NOT_ADMITTED`: fail closed.
pub const ADMITTED_MAX_ENTRIES: u32 = 524_288;

/// Key and value sizes of every pinned map, in bytes: the layout of this build's ABI. The
/// agent replaces a pinned map of another layout (left by an agent of another version)
/// instead of adopting it. LPM trie keys carry a 4-byte prefix length before the data.
pub const LAYOUT: &[(&str, u32, u32)] = {
    use core::mem::size_of;

    use crate::{config::Config, conntrack::*, counters::Counter, policy::*, underlay::Underlay};
    const fn sz<T>() -> u32 {
        size_of::<T>() as u32
    }
    &[
        (POLICY_V4, 4 + sz::<PolicyKeyV4>(), sz::<PolicyValue>()),
        (SELECTED_V4, 4, sz::<SelectedValue>()),
        (RULES_V4, 4, sz::<RuleValueV4>()),
        (NODES, sz::<Underlay>(), sz::<NodeValue>()),
        (POD_OWNER_V4, 4, sz::<PodOwnerValue>()),
        (CT_V4, sz::<CtKeyV4>(), sz::<CtEntryV4>()),
        (EXHAUSTED_V4, 4, 8),
        (EGRESS_IPS_V4, 4, sz::<EgressIpValue>()),
        (POLICY_V6, 4 + sz::<PolicyKeyV6>(), sz::<PolicyValueV6>()),
        (SELECTED_V6, 16, sz::<SelectedValue>()),
        (RULES_V6, 4, sz::<RuleValueV6>()),
        (POD_OWNER_V6, 16, sz::<PodOwnerValue>()),
        (CT_V6, sz::<CtKeyV6>(), sz::<CtEntryV6>()),
        (EXHAUSTED_V6, 16, 8),
        (EGRESS_IPS_V6, 16, sz::<EgressIpValue>()),
        (COUNTERS, 4, sz::<Counter>()),
        (CONFIG, 4, sz::<Config>()),
        (ADMITTED_V4, sz::<AdmittedKeyV4>(), sz::<AdmittedValue>()),
        (ADMITTED_V6, sz::<AdmittedKeyV6>(), sz::<AdmittedValue>()),
    ]
};
const _: () = assert!(LAYOUT.len() == ALL.len());
