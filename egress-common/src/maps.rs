//! The pinned maps: one registry ([`REGISTRY`]) with each map's name (as it appears in
//! the object file and under the pin directory), its key and value bytes (the ABI of this
//! build), its capacity, and whether an object may lack it. The eBPF side declares the
//! maps with these names and capacities; the agent loads, checks and syncs them from here.
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
/// Live flows per pod on this gateway (`--max-flows-per-pod`).
pub const FLOWS_V4: &str = "FLOWS_V4";
pub const FLOWS_V6: &str = "FLOWS_V6";
/// Local pod addresses the agent has seen (`--unknown-pods drop`).
pub const KNOWN_PODS_V4: &str = "KNOWN_PODS_V4";
pub const KNOWN_PODS_V6: &str = "KNOWN_PODS_V6";
/// The destination prefixes of this node's policy entries, by destination.
pub const DESTS_V4: &str = "DESTS_V4";
pub const DESTS_V6: &str = "DESTS_V6";
/// What any rule covers, by destination (`--unknown-pods drop`).
pub const COVERED_V4: &str = "COVERED_V4";
pub const COVERED_V6: &str = "COVERED_V6";

/// Capacities. The policy map holds only this node's pods (source side), so 64k entries
/// cover 1,000 local pods with 64 prefixes each; conntrack is sized for a busy gateway.
/// Not preallocated (`BPF_F_NO_PREALLOC`): memory follows the entries.
pub const POLICY_MAX_ENTRIES: u32 = 65_536;
/// Distinct destination prefixes of the policy entries (an LPM trie, never preallocated):
/// at most one per policy entry, so the policy map's capacity is enough (the agent gives
/// both the operator's `--policy-map-entries`).
pub const DESTS_MAX_ENTRIES: u32 = POLICY_MAX_ENTRIES;
/// Local pods with at least one policy entry (not preallocated).
pub const SELECTED_MAX_ENTRIES: u32 = 262_144;
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
/// Pods with live flows on a gateway, per family (not preallocated): one per pod, so the
/// conntrack map's size is the bound.
pub const FLOWS_MAX_ENTRIES: u32 = CT_MAX_ENTRIES;
/// Local pods the agent has seen, per family (not preallocated: empty unless
/// `--unknown-pods drop`). A pod left out by a full map stays unknown: fail closed.
pub const KNOWN_PODS_MAX_ENTRIES: u32 = 65_536;
/// Covered destination and except prefixes, per family: every rule's listed prefixes and
/// the union of the routes its gateways publish (16,384 per gateway interface at most).
pub const COVERED_MAX_ENTRIES: u32 = 131_072;

/// The kernel map type of a registry entry (`BPF_MAP_TYPE_*`). Two layouts may share
/// key and value sizes (the policy maps were LPM tries of the same sizes before they were
/// hashes), so the agent checks the type of a pinned map too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapKind {
    Hash,
    Array,
    PerCpuArray,
    LruHash,
    LruPerCpuHash,
    LpmTrie,
}

/// One pinned map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSpec {
    pub name: &'static str,
    pub kind: MapKind,
    /// Key bytes (an LPM trie's include its 4-byte prefix length).
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    /// An object built without it still loads: the agent then leaves it alone (the IPv6
    /// maps of an object built before the IPv6 datapath).
    pub optional: bool,
}

/// Every map the agent pins, in a stable order.
pub const REGISTRY: &[MapSpec] = {
    use core::mem::size_of;

    use crate::{
        config::Config,
        conntrack::*,
        counters::{Counter, MAX_REASONS},
        policy::*,
        underlay::Underlay,
    };
    const fn sz<T>() -> u32 {
        size_of::<T>() as u32
    }
    const fn map(name: &'static str, key_size: u32, value_size: u32, max: u32) -> MapSpec {
        MapSpec {
            name,
            kind: MapKind::Hash,
            key_size,
            value_size,
            max_entries: max,
            optional: false,
        }
    }
    const fn v6(spec: MapSpec) -> MapSpec {
        MapSpec {
            optional: true,
            ..spec
        }
    }
    const fn kind(kind: MapKind, spec: MapSpec) -> MapSpec {
        MapSpec { kind, ..spec }
    }
    const LPM: u32 = 4;
    &[
        map(
            POLICY_V4,
            sz::<PolicyKeyV4>(),
            sz::<PolicyValue>(),
            POLICY_MAX_ENTRIES,
        ),
        kind(
            MapKind::LpmTrie,
            map(DESTS_V4, LPM + 4, sz::<DestValue>(), DESTS_MAX_ENTRIES),
        ),
        map(SELECTED_V4, 4, sz::<SelectedValue>(), SELECTED_MAX_ENTRIES),
        map(RULES_V4, 4, sz::<RuleValueV4>(), RULES_MAX_ENTRIES),
        map(
            NODES,
            sz::<Underlay>(),
            sz::<NodeValue>(),
            NODES_MAX_ENTRIES,
        ),
        map(
            POD_OWNER_V4,
            4,
            sz::<PodOwnerValue>(),
            POD_OWNER_MAX_ENTRIES,
        ),
        kind(
            MapKind::LruHash,
            map(CT_V4, sz::<CtKeyV4>(), sz::<CtEntryV4>(), CT_MAX_ENTRIES),
        ),
        kind(
            MapKind::LruPerCpuHash,
            map(EXHAUSTED_V4, 4, 8, EXHAUSTED_MAX_ENTRIES),
        ),
        map(
            EGRESS_IPS_V4,
            4,
            sz::<EgressIpValue>(),
            EGRESS_IPS_MAX_ENTRIES,
        ),
        v6(map(
            POLICY_V6,
            sz::<PolicyKeyV6>(),
            sz::<PolicyValueV6>(),
            POLICY_MAX_ENTRIES,
        )),
        kind(
            MapKind::LpmTrie,
            v6(map(
                DESTS_V6,
                LPM + 16,
                sz::<DestValueV6>(),
                DESTS_MAX_ENTRIES,
            )),
        ),
        v6(map(
            SELECTED_V6,
            16,
            sz::<SelectedValueV6>(),
            SELECTED_MAX_ENTRIES,
        )),
        v6(map(RULES_V6, 4, sz::<RuleValueV6>(), RULES_MAX_ENTRIES)),
        v6(map(
            POD_OWNER_V6,
            16,
            sz::<PodOwnerValue>(),
            POD_OWNER_MAX_ENTRIES,
        )),
        kind(
            MapKind::LruHash,
            v6(map(
                CT_V6,
                sz::<CtKeyV6>(),
                sz::<CtEntryV6>(),
                CT_MAX_ENTRIES,
            )),
        ),
        kind(
            MapKind::LruPerCpuHash,
            v6(map(EXHAUSTED_V6, 16, 8, EXHAUSTED_MAX_ENTRIES)),
        ),
        v6(map(
            EGRESS_IPS_V6,
            16,
            sz::<EgressIpValue>(),
            EGRESS_IPS_MAX_ENTRIES,
        )),
        kind(
            MapKind::PerCpuArray,
            map(COUNTERS, 4, sz::<Counter>(), MAX_REASONS),
        ),
        kind(MapKind::Array, map(CONFIG, 4, sz::<Config>(), 1)),
        map(
            ADMITTED_V4,
            sz::<AdmittedKeyV4>(),
            sz::<AdmittedValue>(),
            ADMITTED_MAX_ENTRIES,
        ),
        v6(map(
            ADMITTED_V6,
            sz::<AdmittedKeyV6>(),
            sz::<AdmittedValue>(),
            ADMITTED_MAX_ENTRIES,
        )),
        map(FLOWS_V4, 4, sz::<FlowCount>(), FLOWS_MAX_ENTRIES),
        v6(map(FLOWS_V6, 16, sz::<FlowCount>(), FLOWS_MAX_ENTRIES)),
        map(
            KNOWN_PODS_V4,
            4,
            sz::<KnownPodValue>(),
            KNOWN_PODS_MAX_ENTRIES,
        ),
        v6(map(
            KNOWN_PODS_V6,
            16,
            sz::<KnownPodValue>(),
            KNOWN_PODS_MAX_ENTRIES,
        )),
        kind(
            MapKind::LpmTrie,
            map(
                COVERED_V4,
                LPM + 4,
                sz::<CoveredValue>(),
                COVERED_MAX_ENTRIES,
            ),
        ),
        kind(
            MapKind::LpmTrie,
            v6(map(
                COVERED_V6,
                LPM + 16,
                sz::<CoveredValue>(),
                COVERED_MAX_ENTRIES,
            )),
        ),
    ]
};

/// The registry entry of map `name`.
pub fn spec(name: &str) -> Option<&'static MapSpec> {
    REGISTRY.iter().find(|m| m.name == name)
}

/// Every pinned map's name, in registry order.
pub fn names() -> impl Iterator<Item = &'static str> {
    REGISTRY.iter().map(|m| m.name)
}
