//! The gateway's forward path, shared by `from_tunnel` (pods of other nodes) and
//! `from_pod` (pods on the gateway itself): SNAT with conntrack, TTL, next hop. One
//! function per family: IPv6 (NAT66) takes its rule from `RULES_V6`, its flows from
//! `CT_V6`, and has a hop limit without a header checksum.
//!
//! A flow starts its conntrack entry with any packet, so that a dedicated egress IP's new
//! holder takes established TCP flows over mid-stream with the same translation. Not so
//! for a rule whose egress address is the gateway's own (`egress_ip_flags::SHARED` on its
//! `EGRESS_IPS_*` entry: an `interface:` rule): a TCP segment without SYN (or RST) and
//! without an entry belongs to a flow that left from another gateway's address, which the
//! far host does not know from this one. No entry is made: the segment is answered with a
//! RST to the pod (`reset`, counted `RESET_MIDSTREAM`), so that the pod fails at once
//! instead of waiting minutes for a RST that a stateful firewall on the way may drop.
//!
//! A new flow is admitted only when its (pod, rule) pair is in `ADMITTED_V4`/`_V6` (the
//! pods the policies select for a rule this node serves), checked after the rule lookup
//! (an unknown rule stays `DROP_UNKNOWN_RULE`): the tunnel is not authenticated, and the
//! sender and pod-owner checks alone would let a node's unselected pod (or the pod's
//! address, forged by whoever can send from that node's underlay address) use any rule.
//! The same check covers pods on the gateway itself, which enter here from `from_pod`.
//! A conntrack hit skips it: entries are only ever made on this admitted path, so a hit
//! is a flow that was admitted at its start, and it stays so while its entry lives, as it
//! keeps its egress IP when the rule changes. That costs one lookup per new flow, not per
//! packet; a deselected pod's established flows end when their entries expire (the pod's
//! node stops tunneling them as soon as its own policy entries go).

use aya_ebpf::{helpers::generated::bpf_redirect, programs::TcContext};
use egress_common::{
    config::Config,
    conntrack::NextHop,
    counters::reason,
    policy::{AdmittedKeyV4, egress_ip_flags},
    underlay::Underlay,
};

use crate::{
    answer,
    conntrack::{self, AllocError, v4, v6},
    counters::{self, SHOT, count, verdict},
    fib, flows,
    handoff::Origin,
    maps::{
        self, ADMITTED_V4, ADMITTED_V6, CT_V6, EGRESS_IPS_V4, EGRESS_IPS_V6, RULES_V4, RULES_V6,
    },
    parse::{ETH_LEN, Ipv4, L4, PROTO_TCP, TCP_RST, TCP_SYN},
    reset, rewrite,
    scratch::{self, Scratch},
};

/// Translate and send out a packet of `rule_id` from a pod of `pod_node`, or return
/// [`reset::RESET`] for a segment to answer with a RST.
#[inline(always)]
pub fn forward(
    ctx: &TcContext,
    cfg: &Config,
    ip: &Ipv4,
    l4: &L4,
    rule_id: u32,
    pod_node: egress_common::underlay::Underlay,
) -> i32 {
    if ip.ttl <= 1 {
        return expired4(ctx, ip, l4, rule_id, &pod_node);
    }
    let now = conntrack::now();
    let generation = maps::nh_gen();
    let headers = fib::segment_headers(ip.l4 - ETH_LEN, l4.tcp_hdr_len);
    // An established flow keeps the egress IP and interface it started with, even if the
    // rule changed since: decided once per flow. Its entry caches the next hop.
    let (egress_ip, port_be, next) =
        match v4::lookup_mut(&v4::original_key(ip, l4), l4.tcp_flags, now) {
            Some(e) => {
                count(ctx, reason::SNAT_HIT);
                if fib::cache_valid(ctx, &e.next_hop, generation, now, headers) {
                    return send_cached(ctx, ip, l4, e.xlate_addr, e.xlate_port_be, &e.next_hop);
                }
                let Some(s) = scratch::scratch() else {
                    return verdict(ctx, reason::DROP_FIB, SHOT);
                };
                let next = fib::lookup4(
                    ctx,
                    &mut s.fib,
                    ip.proto,
                    e.xlate_addr,
                    ip.dst,
                    fib::From::Output(e.ifindex),
                    headers,
                );
                if next.kind == fib::RESOLVED {
                    fib::cache_store(&mut e.next_hop, &next.nh, generation, now);
                }
                (e.xlate_addr, e.xlate_port_be, next)
            }
            None => {
                let Some(rule) = (unsafe { RULES_V4.get(rule_id) }) else {
                    return verdict(ctx, reason::DROP_UNKNOWN_RULE, SHOT);
                };
                if !admitted4(ip.src, rule_id) {
                    return verdict(ctx, reason::DROP_NOT_ADMITTED, SHOT);
                }
                if mid_stream(ip.proto, l4.tcp_flags) && shared4(rule.egress_ip) {
                    return defer_reset4(ctx, ip, l4, &pod_node);
                }
                if !flows::allowed4(cfg, &ip.src) {
                    counters::exhausted4(&ip.src);
                    return verdict(ctx, reason::DROP_POD_FLOW_LIMIT, SHOT);
                }
                // The next hop first, so that the flow's entry is made with it. A failed
                // lookup still makes the flow (as before the cache): the packet is dropped
                // below, and the next one looks again.
                let Some(s) = scratch::scratch() else {
                    return verdict(ctx, reason::DROP_FIB, SHOT);
                };
                let mut next = fib::lookup4(
                    ctx,
                    &mut s.fib,
                    ip.proto,
                    rule.egress_ip,
                    ip.dst,
                    fib::From::Output(rule.ifindex),
                    headers,
                );
                // Only a resolved next hop is cached; an unresolved one (`NO_NEIGH`) still
                // carries the packet (`fib::send4` redirects to `nh.ifindex` and the kernel
                // resolves the neighbour), so its ifindex must stay. In place, not a copy
                // (a copy of the struct becomes a `memmove` call).
                let cache = if next.kind == fib::RESOLVED {
                    next.nh.generation = egress_common::conntrack::generation(generation);
                    next.nh.filled = egress_common::conntrack::stamp(now);
                    Some(&next.nh)
                } else {
                    None
                };
                // The new flow's keys and entries in the per-CPU scratch slot, not on this
                // path's frame: Linux 6.1 counts the frames of `bpf_loop` callbacks into
                // the 512-byte budget of the call chain, which the stack copy overran.
                let Some(slots) = scratch::scratch().map(|s| &mut s.ct4) else {
                    return verdict(ctx, reason::DROP_CT_INSERT, SHOT);
                };
                match v4::create_in(
                    cfg,
                    ip,
                    l4,
                    &rule.egress_ip,
                    rule.ifindex,
                    rule_id,
                    pod_node,
                    now,
                    cache,
                    !shared4(rule.egress_ip),
                    slots,
                ) {
                    Ok(port_be) => {
                        count(ctx, reason::SNAT_NEW);
                        flows::opened4(&ip.src);
                        (rule.egress_ip, port_be, next)
                    }
                    Err(AllocError::PortsExhausted) => {
                        counters::exhausted4(&ip.src);
                        return verdict(ctx, reason::DROP_PORT_EXHAUSTED, SHOT);
                    }
                    Err(AllocError::InsertFailed) => {
                        return verdict(ctx, reason::DROP_CT_INSERT, SHOT);
                    }
                }
            }
        };
    if next.kind == fib::TOO_BIG {
        let what = (answer::TOO_BIG, next.nh.mtu);
        return answer::defer4(ctx, ip, l4, &pod_node, egress_ip, what);
    }
    if rewrite::nat4(ctx, ip, l4, rewrite::Side::Source, egress_ip, port_be, None).is_err() {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    match fib::send4(ctx, &next) {
        Ok(v) => verdict(ctx, reason::FORWARDED, v),
        Err(()) => verdict(ctx, reason::DROP_FIB, SHOT),
    }
}

/// An established flow's packet with a valid cached next hop `nh`: translated, MACs
/// written, redirected; no FIB lookup.
#[inline(always)]
fn send_cached(
    ctx: &TcContext,
    ip: &Ipv4,
    l4: &L4,
    addr: [u8; 4],
    port_be: u16,
    nh: &NextHop,
) -> i32 {
    let macs = Some((&nh.dmac, &nh.smac));
    if rewrite::nat4(ctx, ip, l4, rewrite::Side::Source, addr, port_be, macs).is_err() {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    verdict(
        ctx,
        reason::FORWARDED,
        unsafe { bpf_redirect(nh.ifindex, 0) } as i32,
    )
}

/// A TCP segment that only an established flow sends: neither SYN nor RST.
#[inline(always)]
fn mid_stream(proto: u8, tcp_flags: u8) -> bool {
    proto == PROTO_TCP && tcp_flags & (TCP_SYN | TCP_RST) == 0
}

/// A packet whose TTL would reach zero here: answered with "time exceeded" from the
/// rule's egress IP (`answer`) when the pod may use the rule, else dropped.
#[inline(always)]
fn expired4(ctx: &TcContext, ip: &Ipv4, l4: &L4, rule_id: u32, pod_node: &Underlay) -> i32 {
    match unsafe { RULES_V4.get(rule_id) } {
        Some(rule) if admitted4(ip.src, rule_id) => {
            let what = (answer::TIME_EXCEEDED, 0);
            answer::defer4(ctx, ip, l4, pod_node, rule.egress_ip, what)
        }
        _ => verdict(ctx, reason::DROP_TTL_EXCEEDED, SHOT),
    }
}

/// [`expired4`] for IPv6 (hop limit), its packet in the scratch slot `s`. Out of line:
/// `forward6`'s frame stays small.
#[inline(never)]
fn expired6(ctx: &TcContext, s: &mut Scratch) -> i32 {
    let rule_id = s.x6.origin.rule_id;
    match unsafe { RULES_V6.get(rule_id) } {
        Some(rule) if admitted6(s, rule_id) => {
            // SAFETY: as in `lookup6`: a map value and the scratch slot.
            unsafe { core::ptr::copy_nonoverlapping(&rule.egress_ip, &mut s.x6.egress_ip, 1) };
            answer::defer6(s, answer::TIME_EXCEEDED, 0)
        }
        _ => verdict(ctx, reason::DROP_TTL_EXCEEDED, SHOT),
    }
}

/// Whether the policies let `pod` use `rule_id` (see the module comment).
#[inline(always)]
fn admitted4(pod: [u8; 4], rule_id: u32) -> bool {
    let key = AdmittedKeyV4 { pod, rule_id };
    ADMITTED_V4.get_ptr(key).is_some()
}

/// [`admitted4`] for IPv6, its key built in the scratch slot `s` (off `create6`'s frame).
#[inline(always)]
fn admitted6(s: &mut Scratch, rule_id: u32) -> bool {
    // SAFETY: two distinct, valid 16-byte arrays of the scratch slot.
    unsafe { core::ptr::copy_nonoverlapping(&s.ip6.src, &mut s.admitted6.pod, 1) };
    s.admitted6.rule_id = rule_id;
    // By reference: the key stays in the scratch slot.
    let key = &s.admitted6;
    ADMITTED_V6.get_ptr(key).is_some()
}

/// Whether `addr` is the gateway's own address (an `interface:` rule's), not a dedicated
/// egress IP. An address without an entry counts as dedicated (as before: flows are taken
/// over).
#[inline(always)]
fn shared4(addr: [u8; 4]) -> bool {
    unsafe { EGRESS_IPS_V4.get(addr) }.is_some_and(|e| e.flags & egress_ip_flags::SHARED != 0)
}

#[inline(always)]
fn shared6(addr: &[u8; 16]) -> bool {
    unsafe { EGRESS_IPS_V6.get(addr) }.is_some_and(|e| e.flags & egress_ip_flags::SHARED != 0)
}

/// Leave the segment for [`reset::deferred4`], which the entry point calls
/// ([`scratch::keep4`]).
#[inline(always)]
fn defer_reset4(ctx: &TcContext, ip: &Ipv4, l4: &L4, pod_node: &Underlay) -> i32 {
    match scratch::keep4(ip, l4, pod_node) {
        Some(_) => reset::RESET,
        None => verdict(ctx, reason::DROP_MALFORMED, SHOT),
    }
}

/// [`forward`] for IPv6: NAT66 to the rule's egress IPv6, hop limit, FIB lookup (IPv6)
/// restricted to the rule's interface (or [`reset::RESET`]). The packet's parsed headers
/// (`s.ip6`, `s.l4`) and its origin (`s.x6.origin`) are in the per-CPU scratch slot `s`,
/// and so are the conntrack keys and entries and the FIB parameters: BPF calls nest their
/// stack frames into one 512-byte budget. Out of line, and in out-of-line steps
/// ([`lookup6`], [`create6`], [`send6`]) called one after the other.
#[inline(never)]
pub fn forward6(ctx: &TcContext, cfg: &Config, s: &mut Scratch) -> i32 {
    if s.ip6.hop_limit <= 1 {
        return expired6(ctx, s);
    }
    if lookup6(ctx, s) {
        count(ctx, reason::SNAT_HIT);
    } else {
        let v = create6(ctx, cfg, s);
        if v != TRANSLATED {
            return v;
        }
    }
    send6(ctx, s)
}

/// The rest of [`forward6`] once the flow's translation is in `s.x6`: NAT66, then the
/// cached next hop or the FIB. Out of line so that `forward6`'s own frame stays small:
/// Linux 6.1 counts `create6`'s port-scan callback into the chain of frames under it.
#[inline(never)]
fn send6(ctx: &TcContext, s: &mut Scratch) -> i32 {
    // An established flow with a valid cached next hop takes its MACs with the
    // translation: no FIB lookup.
    let cached = s.x6.cached != 0;
    let macs = cached.then_some((&s.x6.nh.dmac, &s.x6.nh.smac));
    let side = rewrite::Side::Source;
    if rewrite::nat6(
        ctx,
        &s.ip6,
        &s.l4,
        side,
        &s.x6.egress_ip,
        s.x6.port_be,
        macs,
    )
    .is_err()
    {
        return verdict(ctx, reason::DROP_MALFORMED, SHOT);
    }
    if cached {
        let v = unsafe { bpf_redirect(s.x6.nh.ifindex, 0) } as i32;
        return verdict(ctx, reason::FORWARDED, v);
    }
    match fib::redirect6(
        ctx,
        &mut s.fib,
        s.ip6.proto,
        &s.x6.egress_ip,
        &s.ip6.dst,
        &fib::From::Output(s.x6.ifindex),
        fib::segment_headers(s.ip6.l4 - ETH_LEN, s.l4.tcp_hdr_len),
    ) {
        Ok((v, resolved)) => {
            // The flow's entry (made above, for a new flow) keeps what the lookup found.
            if resolved {
                cache6(s);
            }
            verdict(ctx, reason::FORWARDED, v)
        }
        // Answered from the entry point's frame (`answer::answer6`), the packet's
        // headers and origin in `s` already.
        Err(fib::Unsent::TooBig) => {
            // SAFETY: a plain u16 (the kernel wrote the device's MTU there).
            let mtu = u32::from(unsafe { s.fib.__bindgen_anon_1.mtu_result });
            answer::defer6(s, answer::TOO_BIG, mtu)
        }
        Err(fib::Unsent::NoRoute) => verdict(ctx, reason::DROP_FIB, SHOT),
    }
}

/// Cache the next hop of the FIB lookup just made (`s.fib`, resolved) in the flow's
/// original entry, under the generation the packet found (`s.x6.generation`). Field by
/// field: a struct copy becomes a `memmove` call.
#[inline(never)]
fn cache6(s: &mut Scratch) {
    let nh = &mut s.x6.nh;
    nh.dmac = s.fib.dmac;
    nh.smac = s.fib.smac;
    // SAFETY: a plain u16 (on success the kernel wrote the device's MTU there).
    nh.mtu = unsafe { s.fib.__bindgen_anon_1.mtu_result };
    nh.ifindex = s.fib.ifindex;
    s.ct6.peer = v6::original_key(&s.ip6, &s.l4);
    // By reference: the 40-byte key stays in the scratch slot.
    let key = &s.ct6.peer;
    if let Some(e) = CT_V6.get_ptr_mut(key) {
        // SAFETY: a valid map value; see `fib::cache_store` for concurrent readers.
        let slot = unsafe { &mut (*e).next_hop };
        fib::cache_store(slot, &s.x6.nh, s.x6.generation, conntrack::now());
    }
}

/// What [`create6`] returns when `s.x6` is filled in: not a TC verdict (a plain integer:
/// a `Result` would travel through a hidden argument, and BPF calls take five).
const TRANSLATED: i32 = i32::MIN;

/// Whether the flow has a live entry (an established flow keeps the egress IP and
/// interface it started with); fills in `s.x6` from it, with its cached next hop when
/// that may carry this packet (`fib::cache_valid`).
#[inline(never)]
fn lookup6(ctx: &TcContext, s: &mut Scratch) -> bool {
    let now = conntrack::now();
    s.x6.generation = maps::nh_gen();
    s.x6.cached = 0;
    s.ct6.key = v6::original_key(&s.ip6, &s.l4);
    match v6::lookup_in(&s.ct6.key, s.l4.tcp_flags, now, &mut s.ct6.peer) {
        Some(e) => {
            // A map value and the per-CPU scratch never overlap; said so, the copies
            // stay inline instead of becoming byte-at-a-time `memmove` calls.
            // SAFETY: two distinct, valid 16-byte arrays.
            unsafe { core::ptr::copy_nonoverlapping(&e.xlate_addr, &mut s.x6.egress_ip, 1) };
            s.x6.port_be = e.xlate_port_be;
            s.x6.ifindex = e.ifindex;
            let headers = fib::segment_headers(s.ip6.l4 - ETH_LEN, s.l4.tcp_hdr_len);
            if fib::cache_valid(ctx, &e.next_hop, s.x6.generation, now, headers) {
                // SAFETY: as above, two distinct, valid next hops.
                unsafe { core::ptr::copy_nonoverlapping(&e.next_hop, &mut s.x6.nh, 1) };
                s.x6.cached = 1;
            }
            true
        }
        None => false,
    }
}

/// A new flow: its rule's egress IP and a port, both conntrack entries. Returns
/// [`TRANSLATED`], the verdict of a refused packet, or [`reset::RESET`] for a
/// mid-stream segment of a shared-address rule (no entry; its headers and origin are in
/// `s` already).
#[inline(never)]
fn create6(ctx: &TcContext, cfg: &Config, s: &mut Scratch) -> i32 {
    let Origin { rule_id, pod_node } = s.x6.origin;
    let Some(rule) = (unsafe { RULES_V6.get(rule_id) }) else {
        return verdict(ctx, reason::DROP_UNKNOWN_RULE, SHOT);
    };
    if !admitted6(s, rule_id) {
        return verdict(ctx, reason::DROP_NOT_ADMITTED, SHOT);
    }
    if mid_stream(s.ip6.proto, s.l4.tcp_flags) && shared6(&rule.egress_ip) {
        return reset::RESET;
    }
    if !flows::allowed6(cfg, &s.ip6.src) {
        counters::exhausted6(&s.ip6.src);
        return verdict(ctx, reason::DROP_POD_FLOW_LIMIT, SHOT);
    }
    match v6::create_in(
        cfg,
        &s.ip6,
        &s.l4,
        &rule.egress_ip,
        rule.ifindex,
        rule_id,
        pod_node,
        conntrack::now(),
        // Cached after the FIB lookup (`cache6`): IPv6 looks up after the entry is made.
        None,
        !shared6(&rule.egress_ip),
        &mut s.ct6,
    ) {
        Ok(port_be) => {
            count(ctx, reason::SNAT_NEW);
            flows::opened6(&s.ip6.src);
            // SAFETY: as in `lookup6`: a map value and the scratch slot.
            unsafe { core::ptr::copy_nonoverlapping(&rule.egress_ip, &mut s.x6.egress_ip, 1) };
            s.x6.port_be = port_be;
            s.x6.ifindex = rule.ifindex;
            TRANSLATED
        }
        Err(AllocError::PortsExhausted) => {
            counters::exhausted6(&s.ip6.src);
            verdict(ctx, reason::DROP_PORT_EXHAUSTED, SHOT)
        }
        Err(AllocError::InsertFailed) => verdict(ctx, reason::DROP_CT_INSERT, SHOT),
    }
}
