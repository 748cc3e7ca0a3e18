//! Every map of the datapath. BTF-defined, so that `bpftool map dump` prints field names.

use aya_ebpf::{
    bindings::{bpf_fib_lookup, bpf_tunnel_key},
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, LruPerCpuHashMap, PerCpuArray, lpm_trie::Key},
    macros::btf_map,
};
use egress_common::{
    config::Config,
    conntrack::{CtEntryV4, CtEntryV6, CtKeyV4, CtKeyV6, FlowCount},
    counters::{Counter, MAX_REASONS},
    maps::*,
    policy::{
        AdmittedKeyV4, AdmittedKeyV6, AdmittedValue, CoveredValue, DestValue, DestValueV6,
        EgressIpValue, KnownPodValue, NodeValue, PodOwnerValue, PolicyKeyV4, PolicyKeyV6,
        PolicyValue, PolicyValueV6, RuleValueV4, RuleValueV6, SelectedValue, SelectedValueV6,
    },
    underlay::Underlay,
};

use crate::{
    conntrack,
    gateway::Xlate6,
    parse::L4,
    parse6::Ipv6,
    reset::{Segment4, TcpHdr},
};

/// `BPF_F_NO_PREALLOC`: entries are allocated as the agent inserts them, so memory
/// follows the entries (see `POLICY_MAX_ENTRIES`, `ADMITTED_MAX_ENTRIES`). Only the agent
/// writes the maps that use it.
const NO_PREALLOC: usize = aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize;

/// (pod, destination prefix, length) -> entry; probed by `policy::lookup4`.
#[btf_map]
pub static POLICY_V4: HashMap<
    PolicyKeyV4,
    PolicyValue,
    { POLICY_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

/// Destination prefix -> lengths of the prefixes containing it; see `policy`.
#[btf_map]
pub static DESTS_V4: LpmTrie<[u8; 4], DestValue, { DESTS_MAX_ENTRIES as usize }> = LpmTrie::new();

#[btf_map]
pub static SELECTED_V4: HashMap<
    [u8; 4],
    SelectedValue,
    { SELECTED_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static RULES_V4: HashMap<u32, RuleValueV4, { RULES_MAX_ENTRIES as usize }> = HashMap::new();

#[btf_map]
pub static NODES: HashMap<Underlay, NodeValue, { NODES_MAX_ENTRIES as usize }> = HashMap::new();

#[btf_map]
pub static POD_OWNER_V4: HashMap<[u8; 4], PodOwnerValue, { POD_OWNER_MAX_ENTRIES as usize }> =
    HashMap::new();

#[btf_map]
pub static CT_V4: LruHashMap<CtKeyV4, CtEntryV4, { CT_MAX_ENTRIES as usize }> = LruHashMap::new();

/// New flows refused as `DROP_PORT_EXHAUSTED`, per CPU, by pod address.
#[btf_map]
pub static EXHAUSTED_V4: LruPerCpuHashMap<[u8; 4], u64, { EXHAUSTED_MAX_ENTRIES as usize }> =
    LruPerCpuHashMap::new();

#[btf_map]
pub static EGRESS_IPS_V4: HashMap<[u8; 4], EgressIpValue, { EGRESS_IPS_MAX_ENTRIES as usize }> =
    HashMap::new();

// ---- IPv6 pods and egress IPs (the underlay, and so node keys, is either family) ----

#[btf_map]
pub static POLICY_V6: HashMap<
    PolicyKeyV6,
    PolicyValueV6,
    { POLICY_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static DESTS_V6: LpmTrie<[u8; 16], DestValueV6, { DESTS_MAX_ENTRIES as usize }> =
    LpmTrie::new();

#[btf_map]
pub static SELECTED_V6: HashMap<
    [u8; 16],
    SelectedValueV6,
    { SELECTED_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static RULES_V6: HashMap<u32, RuleValueV6, { RULES_MAX_ENTRIES as usize }> = HashMap::new();

#[btf_map]
pub static POD_OWNER_V6: HashMap<[u8; 16], PodOwnerValue, { POD_OWNER_MAX_ENTRIES as usize }> =
    HashMap::new();

#[btf_map]
pub static CT_V6: LruHashMap<CtKeyV6, CtEntryV6, { CT_MAX_ENTRIES as usize }> = LruHashMap::new();

#[btf_map]
pub static EXHAUSTED_V6: LruPerCpuHashMap<[u8; 16], u64, { EXHAUSTED_MAX_ENTRIES as usize }> =
    LruPerCpuHashMap::new();

#[btf_map]
pub static EGRESS_IPS_V6: HashMap<[u8; 16], EgressIpValue, { EGRESS_IPS_MAX_ENTRIES as usize }> =
    HashMap::new();

// ---- the (pod, rule) pairs this gateway admits (both families) ----

#[btf_map]
pub static ADMITTED_V4: HashMap<
    AdmittedKeyV4,
    AdmittedValue,
    { ADMITTED_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static ADMITTED_V6: HashMap<
    AdmittedKeyV6,
    AdmittedValue,
    { ADMITTED_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

// ---- live flows per pod on this gateway (`--max-flows-per-pod`, both families) ----

#[btf_map]
pub static FLOWS_V4: HashMap<[u8; 4], FlowCount, { FLOWS_MAX_ENTRIES as usize }, NO_PREALLOC> =
    HashMap::new();

#[btf_map]
pub static FLOWS_V6: HashMap<[u8; 16], FlowCount, { FLOWS_MAX_ENTRIES as usize }, NO_PREALLOC> =
    HashMap::new();

// ---- pods the agent has not seen yet (`--unknown-pods drop`, both families) ----

#[btf_map]
pub static KNOWN_PODS_V4: HashMap<
    [u8; 4],
    KnownPodValue,
    { KNOWN_PODS_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static KNOWN_PODS_V6: HashMap<
    [u8; 16],
    KnownPodValue,
    { KNOWN_PODS_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static COVERED_V4: LpmTrie<[u8; 4], CoveredValue, { COVERED_MAX_ENTRIES as usize }> =
    LpmTrie::new();

#[btf_map]
pub static COVERED_V6: LpmTrie<[u8; 16], CoveredValue, { COVERED_MAX_ENTRIES as usize }> =
    LpmTrie::new();

/// Per-CPU room for the IPv6 paths' large temporaries (the parsed headers, the policy
/// key, conntrack keys and entries, the FIB lookup and the tunnel key), and for those of
/// the RSTs of both families: looked up once per IPv6 packet (and per RST), so that no
/// call chain's stack frames exceed the verifier's 512 bytes.
/// A program runs to completion on its CPU, so one slot per CPU is enough.
#[repr(C)]
pub struct Scratch {
    pub ip6: Ipv6,
    pub l4: L4,
    pub ct6: conntrack::v6::Slots,
    pub x6: Xlate6,
    pub fib: bpf_fib_lookup,
    pub tunnel: bpf_tunnel_key,
    pub policy6: PolicyKeyV6,
    pub dest6: Key<[u8; 16]>,
    pub reset4: Segment4,
    pub rst: TcpHdr,
}

#[btf_map]
pub static SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

/// This CPU's scratch slot (never `None` in practice: the array has its one entry).
#[inline(always)]
pub fn scratch() -> Option<&'static mut Scratch> {
    // SAFETY: per-CPU slot, used by one program run at a time.
    SCRATCH.get_ptr_mut(0).map(|p| unsafe { &mut *p })
}

#[btf_map]
pub static COUNTERS: PerCpuArray<Counter, { MAX_REASONS as usize }> = PerCpuArray::new();

#[btf_map]
pub static CONFIG: Array<Config, 1> = Array::new();

/// The next-hop generation: the agent adds one on every route or neighbour change, and
/// a conntrack entry's cached next hop of another generation is looked up again
/// (`egress_common::conntrack::NextHop`). A map of its own rather than a field of
/// `CONFIG`: the agent bumps it from its netlink listener without rewriting (and racing)
/// the configuration entry.
#[btf_map]
pub static NH_GEN: Array<u32, 1> = Array::new();

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
