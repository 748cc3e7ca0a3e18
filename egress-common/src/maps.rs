//! The pinned maps: one registry ([`REGISTRY`]) with each map's name (as it appears in
//! the object file and under the pin directory), its key and value bytes (the ABI of this
//! build), its capacity, and whether an object may lack it. The eBPF side declares the
//! maps with these names and capacities; the agent loads, checks and syncs them from here.
//!
//! The kernel truncates map names to 15 characters; every name here fits.

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
/// Local pods bound to their host-side device, per family (not preallocated): as many
/// as the known pods.
pub const POD_DEVICES_MAX_ENTRIES: u32 = KNOWN_PODS_MAX_ENTRIES;
/// Translations with a remapped source port that other gateways shared, per family (an
/// LRU map: the oldest go first). A pod's flow gets its own port unless another flow to
/// the same destination holds it: such remaps are few.
pub const REMAP_MAX_ENTRIES: u32 = 65_536;
/// Remaps this gateway made and has not yet handed to its agent, per family (an LRU
/// map: under a burst the oldest go first, and the conntrack sweep shares them later).
/// The agent drains it every hello interval.
pub const FRESH_REMAPS_MAX_ENTRIES: u32 = 4_096;
/// Covered destination and except prefixes, per family: every rule's listed prefixes and
/// the union of the routes its gateways publish (16,384 per gateway interface at most).
pub const COVERED_MAX_ENTRIES: u32 = 131_072;
/// Distinct port filters of this node's policy entries (one per distinct set of allowed
/// ports among its pods' egress NetworkPolicies; ids are 16 bits).
pub const PORT_FILTERS_MAX_ENTRIES: u32 = 4_096;

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

/// A pinned map's declaration: its registry entry and its key and value types, one
/// zero-sized type per map in [`def`]. The agent's typed handles and its wanted and held
/// contents are parameterised by these, so pairing a map's name with another map's types
/// does not compile.
pub trait Map {
    const SPEC: MapSpec;
    /// The key; for an LPM trie, the data after the 4-byte prefix length.
    type Key: Pod + core::fmt::Debug + 'static;
    type Value: Pod + core::fmt::Debug + 'static;
}

/// Plain old data: in userspace (feature `user`) what aya can put in a map, so that a
/// [`Map`]'s types go into aya's typed handles as they are.
#[cfg(feature = "user")]
pub trait Pod: aya::Pod {}
#[cfg(feature = "user")]
impl<T: aya::Pod> Pod for T {}
/// Plain old data (the eBPF side needs no more than `Copy`).
#[cfg(not(feature = "user"))]
pub trait Pod: Copy {}
#[cfg(not(feature = "user"))]
impl<T: Copy> Pod for T {}

/// Something done for each map of the registry, with its types ([`visit`]).
pub trait Visit {
    fn map<M: Map>(&mut self);
}

/// The bytes of a map's key as the kernel sees it.
const fn key_size(kind: MapKind, data: usize) -> u32 {
    match kind {
        MapKind::LpmTrie => 4 + data as u32,
        _ => data as u32,
    }
}

/// Declares each map once: its name constant, its [`def`] type and its [`REGISTRY`] entry
/// (in the order written). `optional` marks a map an older object may lack.
macro_rules! maps {
    ($(
        $(#[$doc:meta])*
        $name:ident = $ty:ident: $kind:ident<$key:ty, $value:ty>, $max:expr $(, $optional:ident)?;
    )*) => {
        $(
            $(#[$doc])*
            pub const $name: &str = stringify!($name);
        )*

        /// One type per pinned map (see [`Map`]).
        pub mod def {
            #[allow(unused_imports, reason = "each map uses some of them")]
            use super::*;
            use crate::{
                config::Config as ConfigValue,
                conntrack::*,
                counters::{Counter, MAX_REASONS},
                policy::*,
                underlay::Underlay,
            };
            $(
                $(#[$doc])*
                #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
                pub struct $ty;
                impl Map for $ty {
                    type Key = $key;
                    type Value = $value;
                    const SPEC: MapSpec = MapSpec {
                        name: $name,
                        kind: MapKind::$kind,
                        key_size: key_size(MapKind::$kind, core::mem::size_of::<$key>()),
                        value_size: core::mem::size_of::<$value>() as u32,
                        max_entries: $max,
                        optional: maps!(@optional $($optional)?),
                    };
                }
            )*
        }

        /// Every map the agent pins, in a stable order.
        pub const REGISTRY: &[MapSpec] = &[$(<def::$ty as Map>::SPEC),*];

        /// `v.map::<M>()` for every map `M`, in [`REGISTRY`] order.
        pub fn visit(v: &mut impl Visit) {
            $(v.map::<def::$ty>();)*
        }
    };
    (@optional optional) => { true };
    (@optional) => { false };
}

maps! {
    POLICY_V4 = PolicyV4: Hash<PolicyKeyV4, PolicyValueV4>, POLICY_MAX_ENTRIES;
    /// The destination prefixes of this node's policy entries, by destination.
    DESTS_V4 = DestsV4: LpmTrie<[u8; 4], DestValueV4>, DESTS_MAX_ENTRIES;
    SELECTED_V4 = SelectedV4: Hash<[u8; 4], SelectedValueV4>, SELECTED_MAX_ENTRIES;
    RULES_V4 = RulesV4: Hash<u32, RuleValueV4>, RULES_MAX_ENTRIES;
    NODES = Nodes: Hash<Underlay, NodeValue>, NODES_MAX_ENTRIES;
    POD_OWNER_V4 = PodOwnerV4: Hash<[u8; 4], PodOwnerValue>, POD_OWNER_MAX_ENTRIES;
    CT_V4 = CtV4: LruHash<CtKeyV4, CtEntryV4>, CT_MAX_ENTRIES;
    /// New flows refused for want of a SNAT port (`DROP_PORT_EXHAUSTED`), by pod.
    EXHAUSTED_V4 = ExhaustedV4: LruPerCpuHash<[u8; 4], u64>, EXHAUSTED_MAX_ENTRIES;
    EGRESS_IPS_V4 = EgressIpsV4: Hash<[u8; 4], EgressIpValue>, EGRESS_IPS_MAX_ENTRIES;
    POLICY_V6 = PolicyV6: Hash<PolicyKeyV6, PolicyValueV6>, POLICY_MAX_ENTRIES, optional;
    DESTS_V6 = DestsV6: LpmTrie<[u8; 16], DestValueV6>, DESTS_MAX_ENTRIES, optional;
    SELECTED_V6 = SelectedV6: Hash<[u8; 16], SelectedValueV6>, SELECTED_MAX_ENTRIES, optional;
    RULES_V6 = RulesV6: Hash<u32, RuleValueV6>, RULES_MAX_ENTRIES, optional;
    POD_OWNER_V6 = PodOwnerV6: Hash<[u8; 16], PodOwnerValue>, POD_OWNER_MAX_ENTRIES, optional;
    CT_V6 = CtV6: LruHash<CtKeyV6, CtEntryV6>, CT_MAX_ENTRIES, optional;
    EXHAUSTED_V6 = ExhaustedV6: LruPerCpuHash<[u8; 16], u64>, EXHAUSTED_MAX_ENTRIES, optional;
    EGRESS_IPS_V6 = EgressIpsV6: Hash<[u8; 16], EgressIpValue>, EGRESS_IPS_MAX_ENTRIES, optional;
    COUNTERS = Counters: PerCpuArray<u32, Counter>, MAX_REASONS;
    CONFIG = Config: Array<u32, ConfigValue>, 1;
    ADMITTED_V4 = AdmittedV4: Hash<AdmittedKeyV4, AdmittedValue>, ADMITTED_MAX_ENTRIES;
    ADMITTED_V6 = AdmittedV6: Hash<AdmittedKeyV6, AdmittedValue>, ADMITTED_MAX_ENTRIES, optional;
    /// Live flows per pod on this gateway (`--max-flows-per-pod`).
    FLOWS_V4 = FlowsV4: Hash<[u8; 4], FlowCount>, FLOWS_MAX_ENTRIES;
    FLOWS_V6 = FlowsV6: Hash<[u8; 16], FlowCount>, FLOWS_MAX_ENTRIES, optional;
    /// Local pod addresses the agent has seen (`--unknown-pods drop`).
    KNOWN_PODS_V4 = KnownPodsV4: Hash<[u8; 4], KnownPodValue>, KNOWN_PODS_MAX_ENTRIES;
    KNOWN_PODS_V6 = KnownPodsV6: Hash<[u8; 16], KnownPodValue>, KNOWN_PODS_MAX_ENTRIES, optional;
    /// Local pod addresses bound to the device they were found behind (`from_pod`'s
    /// source check).
    POD_DEVICES_V4 = PodDevicesV4: Hash<[u8; 4], PodDeviceValue>, POD_DEVICES_MAX_ENTRIES;
    POD_DEVICES_V6 = PodDevicesV6: Hash<[u8; 16], PodDeviceValue>, POD_DEVICES_MAX_ENTRIES, optional;
    /// Remapped translations (a flow whose pod port another flow held) that the gateway
    /// holding the egress IP shared: a gateway that takes the egress IP over gives such a
    /// flow the same port (issue 44).
    REMAP_V4 = RemapV4: LruHash<CtKeyV4, RemapValueV4>, REMAP_MAX_ENTRIES;
    REMAP_V6 = RemapV6: LruHash<CtKeyV6, RemapValueV6>, REMAP_MAX_ENTRIES, optional;
    /// The remaps this gateway's datapath made since its agent last looked (the agent
    /// takes them out every hello interval and shares them at once, not at the next
    /// conntrack sweep): a flow opened just before its holder fails keeps its port too.
    FRESH_REMAPS_V4 = FreshRemapsV4: LruHash<CtKeyV4, RemapValueV4>, FRESH_REMAPS_MAX_ENTRIES;
    FRESH_REMAPS_V6 = FreshRemapsV6: LruHash<CtKeyV6, RemapValueV6>, FRESH_REMAPS_MAX_ENTRIES, optional;
    /// What any rule covers, by destination (`--unknown-pods drop`).
    COVERED_V4 = CoveredV4: LpmTrie<[u8; 4], CoveredValue>, COVERED_MAX_ENTRIES;
    COVERED_V6 = CoveredV6: LpmTrie<[u8; 16], CoveredValue>, COVERED_MAX_ENTRIES, optional;
    /// The next-hop generation (one `u32`), bumped by the agent on route and neighbour
    /// changes: conntrack entries' cached next hops of an older one are looked up again.
    NH_GEN = NhGen: Array<u32, u32>, 1;
    /// Allowed protocols and ports of policy entries with a `filter` (NetworkPolicy).
    PORT_FILTERS = PortFilters: Hash<u32, PortFilter>, PORT_FILTERS_MAX_ENTRIES;
}

/// The registry entry of map `name`.
pub fn spec(name: &str) -> Option<&'static MapSpec> {
    REGISTRY.iter().find(|m| m.name == name)
}

/// Every pinned map's name, in registry order.
pub fn names() -> impl Iterator<Item = &'static str> {
    REGISTRY.iter().map(|m| m.name)
}
