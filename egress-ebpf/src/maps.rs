//! Every map of the datapath but the per-CPU scratch slot (`scratch`). BTF-defined, so
//! that `bpftool map dump` prints field names.

use aya_ebpf::{
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, LruPerCpuHashMap, PerCpuArray},
    macros::btf_map,
};
use egress_common::{
    config::Config,
    maps::{Map, def},
};

/// A map's key type, value type and capacity, as `egress_common::maps` declares them: the
/// maps here take theirs from there, so that the object and the agent cannot disagree.
type K<M> = <M as Map>::Key;
type V<M> = <M as Map>::Value;
const fn cap<M: Map>() -> usize {
    M::SPEC.max_entries as usize
}

/// `BPF_F_NO_PREALLOC`: entries are allocated as the agent inserts them, so memory
/// follows the entries (see `POLICY_MAX_ENTRIES`, `ADMITTED_MAX_ENTRIES`). Only the agent
/// writes the maps that use it.
const NO_PREALLOC: usize = aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize;

/// (pod, destination prefix, length) -> entry; probed by `policy::lookup4`.
#[btf_map]
pub static POLICY_V4: HashMap<
    K<def::PolicyV4>,
    V<def::PolicyV4>,
    { cap::<def::PolicyV4>() },
    NO_PREALLOC,
> = HashMap::new();

/// Destination prefix -> lengths of the prefixes containing it; see `policy`.
#[btf_map]
pub static DESTS_V4: LpmTrie<K<def::DestsV4>, V<def::DestsV4>, { cap::<def::DestsV4>() }> =
    LpmTrie::new();

#[btf_map]
pub static SELECTED_V4: HashMap<
    K<def::SelectedV4>,
    V<def::SelectedV4>,
    { cap::<def::SelectedV4>() },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static RULES_V4: HashMap<K<def::RulesV4>, V<def::RulesV4>, { cap::<def::RulesV4>() }> =
    HashMap::new();

#[btf_map]
pub static NODES: HashMap<K<def::Nodes>, V<def::Nodes>, { cap::<def::Nodes>() }> = HashMap::new();

#[btf_map]
pub static POD_OWNER_V4: HashMap<
    K<def::PodOwnerV4>,
    V<def::PodOwnerV4>,
    { cap::<def::PodOwnerV4>() },
> = HashMap::new();

#[btf_map]
pub static CT_V4: LruHashMap<K<def::CtV4>, V<def::CtV4>, { cap::<def::CtV4>() }> =
    LruHashMap::new();

/// Remapped translations other gateways shared (see `conntrack::v4::create_in`).
#[btf_map]
pub static REMAP_V4: LruHashMap<K<def::RemapV4>, V<def::RemapV4>, { cap::<def::RemapV4>() }> =
    LruHashMap::new();

/// New flows refused as `DROP_PORT_EXHAUSTED`, per CPU, by pod address.
#[btf_map]
pub static EXHAUSTED_V4: LruPerCpuHashMap<
    K<def::ExhaustedV4>,
    V<def::ExhaustedV4>,
    { cap::<def::ExhaustedV4>() },
> = LruPerCpuHashMap::new();

#[btf_map]
pub static EGRESS_IPS_V4: HashMap<
    K<def::EgressIpsV4>,
    V<def::EgressIpsV4>,
    { cap::<def::EgressIpsV4>() },
> = HashMap::new();

// ---- IPv6 pods and egress IPs (the underlay, and so node keys, is either family) ----

#[btf_map]
pub static POLICY_V6: HashMap<
    K<def::PolicyV6>,
    V<def::PolicyV6>,
    { cap::<def::PolicyV6>() },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static DESTS_V6: LpmTrie<K<def::DestsV6>, V<def::DestsV6>, { cap::<def::DestsV6>() }> =
    LpmTrie::new();

#[btf_map]
pub static SELECTED_V6: HashMap<
    K<def::SelectedV6>,
    V<def::SelectedV6>,
    { cap::<def::SelectedV6>() },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static RULES_V6: HashMap<K<def::RulesV6>, V<def::RulesV6>, { cap::<def::RulesV6>() }> =
    HashMap::new();

#[btf_map]
pub static POD_OWNER_V6: HashMap<
    K<def::PodOwnerV6>,
    V<def::PodOwnerV6>,
    { cap::<def::PodOwnerV6>() },
> = HashMap::new();

#[btf_map]
pub static CT_V6: LruHashMap<K<def::CtV6>, V<def::CtV6>, { cap::<def::CtV6>() }> =
    LruHashMap::new();

/// Remaps made here since the agent last took them (see `conntrack::v4::create_in`).
#[btf_map]
pub static FRESH_REMAPS_V4: LruHashMap<
    K<def::FreshRemapsV4>,
    V<def::FreshRemapsV4>,
    { cap::<def::FreshRemapsV4>() },
> = LruHashMap::new();

#[btf_map]
pub static FRESH_REMAPS_V6: LruHashMap<
    K<def::FreshRemapsV6>,
    V<def::FreshRemapsV6>,
    { cap::<def::FreshRemapsV6>() },
> = LruHashMap::new();

#[btf_map]
pub static REMAP_V6: LruHashMap<K<def::RemapV6>, V<def::RemapV6>, { cap::<def::RemapV6>() }> =
    LruHashMap::new();

#[btf_map]
pub static EXHAUSTED_V6: LruPerCpuHashMap<
    K<def::ExhaustedV6>,
    V<def::ExhaustedV6>,
    { cap::<def::ExhaustedV6>() },
> = LruPerCpuHashMap::new();

#[btf_map]
pub static EGRESS_IPS_V6: HashMap<
    K<def::EgressIpsV6>,
    V<def::EgressIpsV6>,
    { cap::<def::EgressIpsV6>() },
> = HashMap::new();

// ---- the (pod, rule) pairs this gateway admits (both families) ----

#[btf_map]
pub static ADMITTED_V4: HashMap<
    K<def::AdmittedV4>,
    V<def::AdmittedV4>,
    { cap::<def::AdmittedV4>() },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static ADMITTED_V6: HashMap<
    K<def::AdmittedV6>,
    V<def::AdmittedV6>,
    { cap::<def::AdmittedV6>() },
    NO_PREALLOC,
> = HashMap::new();

// ---- live flows per pod on this gateway (`--max-flows-per-pod`, both families) ----

#[btf_map]
pub static FLOWS_V4: HashMap<
    K<def::FlowsV4>,
    V<def::FlowsV4>,
    { cap::<def::FlowsV4>() },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static FLOWS_V6: HashMap<
    K<def::FlowsV6>,
    V<def::FlowsV6>,
    { cap::<def::FlowsV6>() },
    NO_PREALLOC,
> = HashMap::new();

// ---- pods the agent has not seen yet (`--unknown-pods drop`, both families) ----

#[btf_map]
pub static KNOWN_PODS_V4: HashMap<
    K<def::KnownPodsV4>,
    V<def::KnownPodsV4>,
    { cap::<def::KnownPodsV4>() },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static KNOWN_PODS_V6: HashMap<
    K<def::KnownPodsV6>,
    V<def::KnownPodsV6>,
    { cap::<def::KnownPodsV6>() },
    NO_PREALLOC,
> = HashMap::new();

// ---- local pods bound to their host-side device (`from_pod`'s source check) ----

#[btf_map]
pub static POD_DEVICES_V4: HashMap<
    K<def::PodDevicesV4>,
    V<def::PodDevicesV4>,
    { cap::<def::PodDevicesV4>() },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static POD_DEVICES_V6: HashMap<
    K<def::PodDevicesV6>,
    V<def::PodDevicesV6>,
    { cap::<def::PodDevicesV6>() },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static COVERED_V4: LpmTrie<K<def::CoveredV4>, V<def::CoveredV4>, { cap::<def::CoveredV4>() }> =
    LpmTrie::new();

#[btf_map]
pub static COVERED_V6: LpmTrie<K<def::CoveredV6>, V<def::CoveredV6>, { cap::<def::CoveredV6>() }> =
    LpmTrie::new();

#[btf_map]
pub static COUNTERS: PerCpuArray<V<def::Counters>, { cap::<def::Counters>() }> = PerCpuArray::new();

#[btf_map]
pub static CONFIG: Array<V<def::Config>, { cap::<def::Config>() }> = Array::new();

/// The next-hop generation: the agent adds one on every route or neighbour change, and
/// a conntrack entry's cached next hop of another generation is looked up again
/// (`egress_common::conntrack::NextHop`). A map of its own rather than a field of
/// `CONFIG`: the agent bumps it from its netlink listener without rewriting (and racing)
/// the configuration entry.
#[btf_map]
pub static NH_GEN: Array<V<def::NhGen>, { cap::<def::NhGen>() }> = Array::new();

/// A policy entry's allowed protocols and ports (its pod's egress NetworkPolicies).
#[btf_map]
pub static PORT_FILTERS: HashMap<
    K<def::PortFilters>,
    V<def::PortFilters>,
    { cap::<def::PortFilters>() },
    NO_PREALLOC,
> = HashMap::new();

/// The current next-hop generation (0 before the agent's first bump).
#[inline(always)]
pub fn nh_gen() -> u32 {
    NH_GEN.get(0).copied().unwrap_or(0)
}

/// This node's configuration, or `None` until the agent has written it.
#[inline(always)]
pub fn config() -> Option<&'static Config> {
    let c = CONFIG.get(0)?;
    if c.flags & egress_common::config::flags::READY == 0 {
        return None;
    }
    Some(c)
}
