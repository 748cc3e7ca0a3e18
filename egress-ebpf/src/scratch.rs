//! The per-CPU scratch slot: room for the datapath's large temporaries, outside the
//! stack. A map of its own module (the others are in `maps`): its value is made of the
//! paths' own types, and `maps` imports nothing from the paths that use it.

use aya_ebpf::{
    bindings::{bpf_fib_lookup, bpf_tunnel_key},
    btf_maps::{PerCpuArray, lpm_trie::Key},
    macros::btf_map,
};
use egress_common::{
    policy::{AdmittedKeyV6, PolicyKeyV6},
    underlay::Underlay,
};

use crate::{
    conntrack,
    handoff::{Answer4, Answer6, Pending, Segment4, TcpHdr, Xlate6},
    parse::{Ipv4, L4},
    parse6::Ipv6,
    tunnel::Received,
};

/// Per-CPU room for the IPv6 paths' large temporaries (the parsed headers, the policy
/// key, conntrack keys and entries, the FIB lookup and the tunnel key), for a new IPv4
/// flow's conntrack keys and entries, and for those of the RSTs of both families: looked up once per IPv6 packet (and per RST), so that no
/// call chain's stack frames exceed the verifier's 512 bytes.
/// A program runs to completion on its CPU, so one slot per CPU is enough.
#[repr(C)]
pub struct Scratch {
    pub ip6: Ipv6,
    pub l4: L4,
    /// A new IPv4 flow's keys and entries (`gateway::forward`).
    pub ct4: conntrack::v4::Slots,
    pub ct6: conntrack::v6::Slots,
    pub x6: Xlate6,
    pub fib: bpf_fib_lookup,
    pub tunnel: bpf_tunnel_key,
    pub policy6: PolicyKeyV6,
    /// `gateway::create6`'s key of `ADMITTED_V6`.
    pub admitted6: AdmittedKeyV6,
    pub dest6: Key<[u8; 16]>,
    /// The IPv4 packet to answer with a RST (`reset`) or an ICMP error (`answer`).
    pub segment4: Segment4,
    pub rst: TcpHdr,
    pub pending: Pending,
    pub answer4: Answer4,
    pub answer6: Answer6,
    /// The metadata of a packet `from_underlay` decapsulated (`crate::decap`).
    pub decap: Received,
}

#[btf_map]
pub static SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

/// Leave an IPv4 packet's headers and its pod's node in the slot (`segment4`) for an
/// answer made from the entry point's frame (`reset`, `answer`), not from under the
/// gateway path's large one; the slot, to add what else the answer needs.
#[inline(always)]
pub fn keep4(ip: &Ipv4, l4: &L4, pod_node: &Underlay) -> Option<&'static mut Scratch> {
    let s = scratch()?;
    s.segment4 = Segment4 {
        ip: *ip,
        l4: *l4,
        pod_node: *pod_node,
    };
    Some(s)
}

/// This CPU's scratch slot (never `None` in practice: the array has its one entry).
#[inline(always)]
pub fn scratch() -> Option<&'static mut Scratch> {
    // SAFETY: per-CPU slot, used by one program run at a time.
    SCRATCH.get_ptr_mut(0).map(|p| unsafe { &mut *p })
}
